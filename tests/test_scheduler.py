"""The pipeline's scheduler on its own: events in, actions out, no threads or processes.

A small driver plays the executor: it answers at once what the executor
answers at once (holds, cancellations, buffers, deliveries) and keeps copies
and loads pending until a test finishes them, in any order, so slow copies,
late loads, resets and failures mid-flight are replayed deterministically.
The scheduler's invariants are checked after every step.
"""
import collections

import numpy
import pytest
from chainer.iterators import _statemachine

from chainer_prefetch.iterators import _scheduler as s
from chainer_prefetch.policy import NextEpochCache, lookahead


class FixedSampler:
    """Order sampler drawing from its own seeded random state."""

    def __init__(self, seed=0):
        self.random = numpy.random.RandomState(seed)

    def __call__(self, order, position):
        return self.random.permutation(len(order))


class Driver:
    """Plays the executor for a scheduler.

    Attributes:
        copies: Pending ``Copy`` actions by copy id.
        loads: Pending ``Load`` actions by task id.
        delivered: What reached the mailbox, in order.
    """

    def __init__(self, n=12, batch_size=3, seed=0, staging=False,
                 limited=False, item_of=None, cache=None, n_copy_ahead=4,
                 n_prefetch=1, repeat=True, example_bytes=None, sampler=None,
                 cancellable=True, **config):
        self.sampler = FixedSampler(seed) if sampler is None else sampler
        self.config = s.SchedulerConfig(
            batch_size=batch_size, repeat=repeat, order_sampler=self.sampler,
            dataset_length=n, n_processes=2, n_prefetch=n_prefetch,
            n_copy_ahead=n_copy_ahead, task_slots=4, staging=staging,
            limited=limited, item_of=item_of, example_bytes=example_bytes,
            **config)
        state = lookahead.initial_state(self.sampler, n, batch_size)
        self.scheduler = s.Scheduler(self.config, state, cache)
        self.copies = collections.OrderedDict()
        self.loads = collections.OrderedDict()
        self.delivered = []
        self.holds = []  # (item, access) the store was asked to keep
        self.used = []  # (item, access, next_use)
        self.cancelled = []
        self.lost_items = set()  # items the store no longer has
        self.cancellable = cancellable
        self.copied = []  # every Copy action, in order
        self.loaded = collections.Counter()  # index -> Load entries naming it
        self.buffers_in_use = collections.Counter()
        self.buffers_alive = set()
        self.handed_over = []  # buffers the consumer holds, oldest first
        self.generation = 0
        self.step(s.Start())

    def step(self, event):
        pending = collections.deque([event])
        while pending:
            actions = self.scheduler.step(pending.popleft())
            self.scheduler.check_invariants()
            for action in actions:
                pending.extend(self._answer(action))

    def _answer(self, action):
        if isinstance(action, s.Copy):
            self.copies[action.copy_id] = action
            self.copied.append(action)
        if isinstance(action, s.Load):
            self.loads[action.task_id] = action
            self.loaded.update(index for _, index, _ in action.entries)
            if action.buffer is not None:
                assert action.buffer not in self.handed_over, \
                    'a load into a buffer the consumer holds'
                self.buffers_in_use[action.buffer] += 1
        elif isinstance(action, s.Hold):
            kept = tuple((p, i) for p, i, _ in action.entries
                         if i not in self.lost_items)
            lost = tuple((p, i) for p, i, _ in action.entries
                         if i in self.lost_items)
            self.holds.extend((i, a) for _, i, a in action.entries)
            return [s.Held(action.batch_id, kept, lost)]
        elif isinstance(action, s.Used):
            self.used.append((action.item, action.access, action.next_use))
        elif isinstance(action, s.CancelCopies):
            ids = tuple(i for i in action.copy_ids
                        if self.cancellable and i in self.copies)
            for copy_id in ids:
                del self.copies[copy_id]
            self.cancelled.extend(ids)
            return [s.CopiesCancelled(ids)] if ids else []
        elif isinstance(action, s.AllocateBuffer):
            assert action.buffer not in self.buffers_alive
            self.buffers_alive.add(action.buffer)
            return [s.BufferAllocated(action.buffer, True)]
        elif isinstance(action, s.FreeBuffer):
            assert self.buffers_in_use[action.buffer] == 0
            assert action.buffer not in self.handed_over
            self.buffers_alive.remove(action.buffer)
        elif isinstance(action, s.Deliver):
            self.delivered.append(action)
            if not isinstance(action, (s.DeliverExamples, s.DeliverColumns)):
                return []
            if action.buffer is not None:
                assert self.buffers_in_use[action.buffer] == 0, \
                    'a buffer delivered while loads still write into it'
                if action.hand_over:
                    self.handed_over.append(action.buffer)
            answers = []
            if action.measure:
                answers.append(s.Measured(8))
            if isinstance(action, s.DeliverExamples) and action.cache_wants:
                answers.append(s.CacheOffers(tuple(
                    (index, epoch, action.examples[position], 1)
                    for position, index, epoch in action.cache_wants)))
            return answers
        return []

    # ---- what the test does --------------------------------------------------

    def finish_copy(self, copy_id=None, staged=True, evicted=()):
        copy_id = next(iter(self.copies)) if copy_id is None else copy_id
        action = self.copies.pop(copy_id)
        self.step(s.Copied(copy_id, action.item, staged, 10 if staged else 0,
                           tuple(evicted), action.epoch))
        return action

    def finish_load(self, task_id=None, read_from=None, fail_at=None):
        task_id = next(iter(self.loads)) if task_id is None else task_id
        action = self.loads.pop(task_id)
        results = []
        for position, index, local in action.entries:
            if fail_at == index:
                results.append(s.LoadFailure(ValueError(index)))
                break
            where = read_from or (s.ReadFrom.LOCAL if local
                                  else s.ReadFrom.SOURCE)
            results.append(s.LoadResult(('example', index), where))
        if action.buffer is not None:
            self.buffers_in_use[action.buffer] -= 1
        self.step(s.Loaded(task_id, tuple(results)))
        return action

    def consume(self, keep=1):
        """Takes a batch; the consumer keeps the arrays of the last ``keep``."""
        self.step(s.Consumed(self.generation))
        while len(self.handed_over) > keep:
            self.step(s.BufferReleased(self.handed_over.pop(0)))

    def reset(self, state):
        self.generation += 1
        self.step(s.Reset(state, self.generation))

    def run(self, batches, copy_staged=True):
        """Finishes copies and loads in order until ``batches`` were delivered."""
        while len(self.batches()) < batches:
            if self.copies:
                self.finish_copy(staged=copy_staged)
            elif self.loads:
                self.finish_load()
            elif self.delivered and len(self.delivered) > self.scheduler.taken:
                self.consume()
            else:
                raise AssertionError('stalled: nothing pending')
        return self.batches()

    def batches(self):
        return [[example[1] for example in d.examples]
                for d in self.delivered if isinstance(d, s.DeliverExamples)]

    def kinds(self):
        """The type of each delivery, in order."""
        return [type(d) for d in self.delivered]


def chainer_batches(n, batch_size, seed, count):
    """The index lists Chainer's own state machine gives with the same sampler."""
    sampler = FixedSampler(seed)
    state = _statemachine.IteratorState(
        0, 0, False, sampler(numpy.arange(n), 0))
    batches = []
    for _ in range(count):
        state, indices = _statemachine.iterator_statemachine(
            state, batch_size, True, sampler, n)
        batches.append([int(i) for i in indices])
    return batches


@pytest.mark.parametrize('staging', [False, True])
def test_batches_come_in_chainers_order(staging):
    driver = Driver(n=10, batch_size=3, staging=staging)
    assert driver.run(9) == chainer_batches(10, 3, 0, 9)


def test_the_copy_window_opens_one_batch_per_delivery_while_copies_run():
    driver = Driver(n=60, batch_size=3, staging=True, n_copy_ahead=6)
    copied_batches = {copy.access // 3 for copy in driver.copies.values()}
    assert copied_batches == {0, 1}  # slow start: the decode window only
    for copy in [copy for copy in driver.copies.values() if copy.access < 3]:
        driver.finish_copy(copy.copy_id)
    while not driver.delivered:
        driver.finish_load()
    # One delivered, batch 1's copies still running: one more batch.
    assert max(copy.access // 3 for copy in driver.copies.values()) == 3
    driver.run(10)
    # At most n_copy_ahead batches generated ahead of the deliveries.
    assert driver.scheduler.generated - driver.scheduler.delivered <= 6


def test_the_copy_window_opens_wholly_once_stage_2_is_idle():
    driver = Driver(n=60, batch_size=3, staging=True, n_copy_ahead=6)
    driver.run(1)  # every copy of batches 0 and 1 done, batch 0 delivered
    # Nothing in flight to take bandwidth from: n_copy_ahead batches ahead.
    assert driver.scheduler.generated - driver.scheduler.delivered == 6
    assert max(copy.access // 3 for copy in driver.copies.values()) == 6


def test_the_copy_window_opens_wholly_once_the_first_copies_are_staged():
    driver = Driver(n=60, batch_size=3, staging=True, n_copy_ahead=6)
    for copy in list(driver.copies.values()):  # batches 0 and 1
        driver.finish_copy(copy.copy_id)
    # Stage 2 idle, every load local, before any delivery: the later
    # copies start at once.
    assert driver.delivered == []
    assert driver.scheduler.generated == 6
    assert max(copy.access // 3 for copy in driver.copies.values()) == 5


def test_the_slow_start_goes_on_while_a_load_reads_shared_storage():
    driver = Driver(n=60, batch_size=3, staging=True, n_copy_ahead=6)
    first, *others = list(driver.copies.values())
    driver.finish_copy(first.copy_id, staged=False)  # read from the source
    for copy in others:
        driver.finish_copy(copy.copy_id)
    # Stage 2 idle, but a load of batch 0 reads shared storage: no copies
    # for later batches until a delivery.
    assert driver.delivered == []
    assert driver.scheduler.generated == 2
    while not driver.delivered:
        driver.finish_load()
    assert driver.scheduler.generated - driver.scheduler.delivered == 6


def test_the_slow_start_goes_on_when_the_last_copy_is_not_staged():
    driver = Driver(n=60, batch_size=3, staging=True, n_copy_ahead=6)
    *others, last = list(driver.copies.values())
    for copy in others:
        driver.finish_copy(copy.copy_id)
    driver.finish_copy(last.copy_id, staged=False)  # read from the source
    assert driver.delivered == []
    assert driver.scheduler.generated == 2


def test_items_copied_in_order_skip_the_slow_start():
    driver = Driver(n=60, batch_size=3, staging=True, n_copy_ahead=6,
                    slow_start=False)
    assert driver.scheduler.generated == 6  # the whole window at once
    assert max(copy.access // 3 for copy in driver.copies.values()) == 5


def test_a_slow_copy_holds_back_only_its_own_batch():
    driver = Driver(n=12, batch_size=2, staging=True, n_copy_ahead=2)
    first, *others = list(driver.copies.values())
    for copy in others:  # batch 1's copies and batch 0's second
        driver.finish_copy(copy.copy_id)
    # Batch 1 loads while batch 0 waits for its slow copy.
    loading = {index for load in driver.loads.values()
               for _, index, _ in load.entries}
    assert first.index not in loading and len(loading) == 3
    while driver.loads:
        driver.finish_load()
    assert driver.delivered == []  # order kept: batch 0 first
    driver.finish_copy(first.copy_id)
    driver.finish_load()
    assert len(driver.batches()) == 1
    assert first.index in driver.batches()[0]


def test_accesses_of_one_shared_item_wait_for_one_copy():
    # Six examples, two items (say two row groups of three rows).
    item_of = numpy.array([0, 0, 0, 1, 1, 1])
    driver = Driver(n=6, batch_size=3, staging=True, item_of=item_of,
                    sampler=lambda order, position: numpy.arange(len(order)))
    assert sorted(copy.item for copy in driver.copies.values()) == [0, 1]
    driver.run(2)
    # Epoch 1: both items are known local, so nothing is copied again.
    driver.run(4)
    assert driver.copies == {}
    assert all(index in (0, 1, 2, 3, 4, 5) for batch in driver.batches()
               for index in batch)


def test_with_a_limit_the_next_batch_reads_from_the_source_what_no_copy_started():
    driver = Driver(n=12, batch_size=3, staging=True, limited=True)
    head_items = set(chainer_batches(12, 3, 0, 1)[0])
    # Copies of the head batch were cancelled at once: it loads from source.
    cancelled = driver.cancelled
    assert len(cancelled) == 3
    head_loads = [load for load in driver.loads.values()
                  if {index for _, index, _ in load.entries} <= head_items]
    assert sum(len(load.entries) for load in head_loads) == 3
    assert all(not local for load in head_loads for _, _, local in load.entries)
    # Not for a copy a thread has started (here: none can be cancelled).
    other = Driver(n=12, batch_size=3, staging=True, limited=True, seed=1,
                   cancellable=False)
    other.run(2)
    assert other.cancelled == []
    assert other.scheduler.counts.total['examples_from_source'] == 0


def test_known_local_items_are_held_and_a_lost_one_is_copied_again():
    driver = Driver(n=6, batch_size=3, staging=True, limited=True,
                    cancellable=False, n_copy_ahead=2)
    driver.run(1)
    while driver.copies:  # epoch 0 copies everything
        driver.finish_copy()
    assert len(driver.copied) == 6
    epoch1 = chainer_batches(6, 3, 0, 4)[2:]
    lost = epoch1[1][0]
    driver.lost_items.add(lost)
    driver.run(4)
    epoch1_holds = {item for item, access in driver.holds if 6 <= access < 12}
    assert epoch1_holds == set(range(6))  # every access of epoch 1
    # The one the store lost was copied again, only that one.
    again = [copy for copy in driver.copied if 6 <= copy.access < 12]
    assert [copy.item for copy in again] == [lost]
    # Each use reports the next use of the item (from the drawn orders).
    for item, access, next_use in driver.used:
        assert next_use > access


def test_the_next_epoch_cache_serves_without_loading():
    cache = NextEpochCache(max_examples=3)
    driver = Driver(n=12, batch_size=3, cache=cache)
    epoch0, epoch1_first = chainer_batches(12, 3, 0, 5)[:4], \
        chainer_batches(12, 3, 0, 5)[4]
    driver.run(5)
    assert driver.batches()[4] == epoch1_first
    # Offered as epoch 0 passed; taken by epoch 1's first batch, except
    # those of epoch 0's last batch, still loading when epoch 1's first
    # batch entered the decode window.
    served = set(epoch1_first) & set(sum(epoch0[:-1], []))
    # Served ones were loaded once (in epoch 0), the others of the batch twice.
    assert {i: driver.loaded[i] for i in epoch1_first} == {
        i: 1 if i in served else 2 for i in epoch1_first}
    assert driver.scheduler.counts.total['examples_from_cache'] == len(served) > 0
    assert driver.scheduler.counts.by_epoch[1]['examples_from_cache'] == len(served)
    assert cache.counters['hits'] == len(served)


def test_a_reset_mid_flight_discards_everything_and_reuses_no_buffer_early():
    driver = Driver(n=12, batch_size=3, staging=True, example_bytes=8)
    assert set(driver.buffers_in_use) <= {0, 1}
    # Copies done, loads still running (writing into buffers), then reset.
    while driver.copies:
        driver.finish_copy()
    running = list(driver.loads)
    assert running
    state = lookahead.initial_state(FixedSampler(5), 12, 3)
    driver.reset(state)
    assert driver.scheduler.generated >= 1
    # New loads never use a buffer the old ones still write into.
    busy = {driver.loads[task].buffer for task in running}
    for task, load in driver.loads.items():
        if task not in running:
            assert load.buffer not in busy
    for task in running:
        driver.finish_load(task)  # late answers are dropped
    assert driver.delivered == []
    batches = driver.run(2)
    state_after = lookahead.initial_state(FixedSampler(5), 12, 3)
    expected = [[int(i) for i in state_after.order[:3]],
                [int(i) for i in state_after.order[3:6]]]
    assert batches == expected


def test_a_failure_is_delivered_in_order_and_its_buffer_freed_after_its_loads():
    driver = Driver(n=12, batch_size=3, example_bytes=8, n_copy_ahead=2)
    batch0, batch1 = chainer_batches(12, 3, 0, 2)
    tasks = list(driver.loads.values())
    failing = next(t for t in tasks if t.entries[0][1] in batch1)
    driver.finish_load(failing.task_id, fail_at=failing.entries[0][1])
    assert driver.delivered == []  # batch 0 first
    while any(t.entries[0][1] in batch0 for t in driver.loads.values()):
        driver.finish_load(next(t.task_id for t in driver.loads.values()
                                if t.entries[0][1] in batch0))
    driver.consume()
    assert driver.kinds() == [s.DeliverExamples, s.DeliverFailure]
    assert isinstance(driver.delivered[1].error, ValueError)


def test_a_fallback_makes_the_item_unknown_again():
    # One batch copied ahead: epoch 1's accesses are planned after the fallback.
    driver = Driver(n=6, batch_size=3, staging=True, repeat=True,
                    n_copy_ahead=1)
    while driver.copies:
        driver.finish_copy()
    load = next(iter(driver.loads.values()))
    item = load.entries[0][1]
    driver.finish_load(load.task_id, read_from=s.ReadFrom.FALLBACK)
    assert driver.scheduler.counts.total['examples_fallback'] == len(load.entries)
    driver.run(4)
    window = driver.scheduler._window
    assert window.unanswered == {}  # nothing pending
    # The item was copied again in epoch 1 (its local copy had vanished),
    # and only it: the others are still known local from epoch 0.
    assert [copy.item for copy in driver.copied if copy.access >= 6] == [item]
    assert driver.scheduler.counts.by_epoch[1]['bytes_copied'] == 10
    assert window.known_local[item] == 1
    assert sorted(window.known_local) == [0] * 5 + [1]


def test_end_of_data_without_repeat_and_stage1_failure_in_order():
    driver = Driver(n=5, batch_size=2, repeat=False)
    driver.run(3)
    driver.consume()
    assert driver.kinds() == [s.DeliverExamples] * 3 + [s.DeliverEnd]

    def broken(order, position):
        raise RuntimeError('sampler broke')

    class OnceThenBroken:
        calls = 0

        def __call__(self, order, position):
            self.calls += 1
            if self.calls > 2:
                broken(order, position)
            return numpy.arange(len(order))

    # The third draw (epoch 1's successor) happens when epoch 0's last
    # batch is made: that batch is replaced by the failure, in order.
    driver = Driver(n=4, batch_size=2, sampler=OnceThenBroken())
    driver.run(1)
    driver.consume()
    assert driver.kinds() == [s.DeliverExamples, s.DeliverFailure]
    assert 'sampler broke' in str(driver.delivered[-1].error)


def test_the_scheduler_keeps_nothing_per_delivered_batch():
    driver = Driver(n=50, batch_size=5, staging=True, limited=True,
                    example_bytes=8)
    driver.cancellable = False
    driver.run(200)
    scheduler = driver.scheduler
    assert len(scheduler._batches) <= 6
    assert scheduler._loads.outstanding <= 8
    window = scheduler._window
    assert len(window.copies) == len(window.unanswered) <= 30
    assert len(scheduler.counts.by_epoch) == 21  # counters only, per epoch
