"""The scheduler's columnar batches (units of rows sharing an item), without threads."""
import numpy
import pytest

from chainer_prefetch.iterators import _scheduler as s
from test_scheduler import Driver, chainer_batches


class ColumnarDriver(Driver):
    """The driver, also answering ``LoadColumns`` tasks."""

    def __init__(self, **options):
        options.setdefault('columnar', True)
        super().__init__(**options)

    def _answer(self, action):
        if isinstance(action, s.LoadColumns):
            self.loads[action.task_id] = action
            if action.buffer is not None:
                assert action.buffer not in self.handed_over
                self.buffers_in_use[action.buffer] += 1
            return []
        return super()._answer(action)

    def finish_load(self, task_id=None, read_from=None, fail=False, unfit=0):
        task_id = next(iter(self.loads)) if task_id is None else task_id
        action = self.loads.pop(task_id)
        if action.buffer is not None:
            self.buffers_in_use[action.buffer] -= 1
        if fail:
            result = s.LoadFailure(ValueError(int(action.indices[0])))
        else:
            result = s.LoadResult(('columns', list(action.indices)),
                                  read_from or s.ReadFrom.LOCAL, 7, unfit)
        self.step(s.ColumnsLoaded(task_id, result))
        return action

    def batches(self):
        return [[int(index) for index in d.columns[1]]
                for d in self.delivered if isinstance(d, s.DeliverColumns)]


ROW_GROUPS = numpy.repeat(numpy.arange(4), 6)  # 24 rows in 4 items of 6


def test_columnar_batches_come_in_chainers_order():
    for staging in (False, True):
        driver = ColumnarDriver(n=10, batch_size=3, staging=staging)
        assert driver.run(9) == chainer_batches(10, 3, 0, 9)
        assert s.DeliverExamples not in driver.kinds()  # every batch as columns
        # Batches spanning two epochs count their rows in each.
        for epoch in (0, 1):
            counts = driver.scheduler.counts.by_epoch[epoch]
            assert counts['examples_from_local'] + \
                counts['examples_from_source'] == 10


def test_a_batch_is_one_task_after_every_unit_is_staged():
    driver = ColumnarDriver(n=24, batch_size=8, staging=True,
                            item_of=ROW_GROUPS, n_copy_ahead=2)
    batch0 = chainer_batches(24, 8, 0, 1)[0]
    items = sorted({int(ROW_GROUPS[i]) for i in batch0})
    copies = [copy for copy in driver.copies.values() if copy.access < 8]
    assert sorted(copy.item for copy in copies) == items  # one copy per item
    assert driver.loads == {}
    for copy in copies[:-1]:
        driver.finish_copy(copy.copy_id)
    assert not any(list(load.indices) == batch0 for load in driver.loads.values())
    driver.finish_copy(copies[-1].copy_id)
    (load,) = [load for load in driver.loads.values()
               if list(load.indices) == batch0]
    assert load.local.all()
    counts = driver.scheduler.counts.total
    assert counts['examples_staged'] >= 8  # rows, not units


def test_units_count_rows_and_hold_items_until_their_last_row():
    driver = ColumnarDriver(n=24, batch_size=8, staging=True, limited=True,
                            item_of=ROW_GROUPS, cancellable=False,
                            n_copy_ahead=3)
    driver.run(6)  # two epochs
    scheduler = driver.scheduler
    for epoch in (0, 1):
        counts = scheduler.counts.by_epoch[epoch]
        assert counts['examples_from_local'] + counts['examples_from_source'] == 24
    # The totals also count the batch loaded ahead, into the third epoch.
    total = scheduler.counts.total
    assert total['examples_from_local'] + total['examples_from_source'] == sum(
        counts['examples_from_local'] + counts['examples_from_source']
        for counts in scheduler.counts.by_epoch.values())
    # Each use names the access of the unit's last row in its batch, and
    # the item's next use after it.
    orders = chainer_batches(24, 8, 0, 9)  # with the batches loaded ahead
    flat = sum(orders, [])
    for item, access, next_use in driver.used:
        assert int(ROW_GROUPS[flat[access]]) == item
        batch_end = (access // 8 + 1) * 8
        later = [a for a in range(access + 1, batch_end)
                 if int(ROW_GROUPS[flat[a]]) == item]
        assert later == [], 'not the last row of its unit'
        assert next_use > access


def test_every_loader_process_can_have_a_batch():
    driver = ColumnarDriver(n=60, batch_size=4, decode_window=3,
                            n_copy_ahead=8)
    # Three batches load at once (one task each), not the default two.
    loading = {tuple(load.indices) for load in driver.loads.values()}
    assert len(loading) == 3
    assert driver.run(3) == chainer_batches(60, 4, 0, 3)


def test_a_failed_batch_is_delivered_in_order():
    driver = ColumnarDriver(n=12, batch_size=3, example_bytes=8, n_copy_ahead=2)
    first, second = list(driver.loads)[:2]
    driver.finish_load(second, fail=True)
    assert driver.delivered == []
    driver.finish_load(first)
    driver.consume()
    assert driver.kinds() == [s.DeliverColumns, s.DeliverFailure]
    assert isinstance(driver.delivered[1].error, ValueError)


def test_a_reset_drops_late_columnar_answers_and_their_buffers_wait():
    from chainer_prefetch.policy import lookahead
    from test_scheduler import FixedSampler
    driver = ColumnarDriver(n=12, batch_size=3, example_bytes=8)
    running = list(driver.loads)
    busy = {driver.loads[task].buffer for task in running}
    driver.reset(lookahead.initial_state(FixedSampler(5), 12, 3))
    for task, load in driver.loads.items():
        if task not in running:
            assert load.buffer not in busy
    for task in running:
        driver.finish_load(task)
    assert driver.delivered == []
    state = lookahead.initial_state(FixedSampler(5), 12, 3)
    assert driver.run(1) == [[int(i) for i in state.order[:3]]]


def test_columns_that_did_not_fit_grow_later_buffers():
    driver = ColumnarDriver(n=40, batch_size=4, example_bytes=8, n_copy_ahead=4)
    first = next(iter(driver.loads))
    driver.finish_load(first, unfit=10000)
    driver.run(6)
    assert driver.scheduler._buffers.example_bytes >= 10000


@pytest.mark.parametrize('make_driver', [ColumnarDriver, Driver])
def test_the_batches_ahead_use_no_more_items_than_the_store_holds(make_driver):
    # 24 rows in 4 items of 6 (of 10 bytes each), shuffled: a batch of 3
    # uses 1-3 items, and a copy window of 8 batches all 4.  With room for
    # 2, stage 1 waits for deliveries instead of asking for copies that the
    # store would leave on shared storage; a batch that alone uses 3 still
    # goes, alone (check_invariants, after every step, asserts both).
    asked = []
    options = dict(n=24, batch_size=3, staging=True, limited=True,
                   item_of=ROW_GROUPS, cancellable=False, n_copy_ahead=8)
    unlimited = make_driver(**options)
    assert len({copy.item for copy in unlimited.copies.values()}) == 4
    driver = make_driver(max_bytes_ahead=25, item_bytes=lambda item: (
        asked.append(item) or 10), **options)
    copying = {copy.item for copy in driver.copies.values()}
    assert len(copying) == 2, copying
    alone = 0
    batches = chainer_batches(24, 3, 0, 16)  # two epochs
    while len(driver.batches()) < len(batches):
        scheduler = driver.scheduler
        in_flight = scheduler.generated - scheduler.delivered
        alone += in_flight == 1 and scheduler._window.bytes_ahead > 25
        if driver.copies:
            driver.finish_copy()
        elif driver.loads:
            driver.finish_load()
        else:
            driver.consume()
    assert driver.batches() == batches
    assert alone > 0
    assert set(asked) == {0, 1, 2, 3}
    assert all(len({int(ROW_GROUPS[i]) for i in batch}) <= 3 for batch in batches)


def test_the_items_ahead_are_those_of_item_of():
    for missing in ({'item_bytes': len}, {'item_of': ROW_GROUPS}):
        with pytest.raises(ValueError, match='item_of and item_bytes'):
            ColumnarDriver(n=24, batch_size=3, staging=True, limited=True,
                           max_bytes_ahead=2, **missing)


def test_the_items_ahead_end_with_the_data():
    driver = ColumnarDriver(n=24, batch_size=3, staging=True, limited=True,
                            item_of=ROW_GROUPS, cancellable=False,
                            n_copy_ahead=8, repeat=False, max_bytes_ahead=2,
                            item_bytes=lambda item: 1)
    assert driver.run(8) == chainer_batches(24, 3, 0, 8)
    while not isinstance(driver.delivered[-1], s.DeliverEnd):
        driver.consume()
    assert driver.scheduler._window.bytes_ahead == 0
