"""The three asynchronous stages behind PrefetchMultiprocessIterator.

One *pipeline thread* owns the order and every batch in flight::

    stage 1 (pipeline thread)   Chainer's iterator_statemachine: index lists,
                                 at most ``n_copy_ahead`` batches ahead of the
                                 consumer (bounded queue 1)
    stage 2 (copy threads)      ExampleStager.stage(index) per example
    stage 3 (worker processes)  load_examples(...) per example, as soon as its
                                 files are local, for the first
                                 ``DECODE_WINDOW`` batches (bounded queue 2)
    delivery                    the head batch, once complete, is unpacked
                                 from shared memory into ``ready`` (at most
                                 ``n_prefetch`` batches), which ``get`` pops.

Stage 1 draws each epoch's successor order when the epoch starts
(:mod:`._lookahead`), so the accesses of the next one to two epochs are known
at every moment: :class:`~chainer_prefetch.staging.eviction.FutureUses` turns
them into "next use" numbers for the eviction policy of a capacity-limited
local directory, and the optional next-epoch cache (:mod:`._next_epoch_cache`)
keeps the examples the next epoch needs first: delivery offers them a copy,
stage 3 takes them instead of loading.  With a capacity limit, the batch
next to be delivered does not wait for copies no thread has started: their
examples are read from the source.

Events (a copy finished, an example loaded, the consumer took a batch, a
reset, a stop) are signalled on one condition variable; the pipeline thread
sleeps on it.  Every batch remembers whether a reset made it stale: results
of stale batches are dropped, and their shared-memory buffer is reused only
after the last worker that writes into it has finished.
"""
import collections
import concurrent.futures
import copy
import concurrent.futures.thread
import functools
import os
import threading
import time
import warnings
import weakref
from multiprocessing import shared_memory
from typing import Optional

from chainer.iterators.multiprocess_iterator import _measure, _unpack

from chainer_prefetch.errors import ExampleLoadError
from chainer_prefetch.iterators import _lookahead, _worker
from chainer_prefetch.iterators._worker_pool import WorkerDiedError, WorkerPool
from chainer_prefetch.staging.eviction import FutureUses

#: Batches whose examples stage 3 loads at the same time.  Two keep every
#: worker busy across a batch boundary.
DECODE_WINDOW = 2
_RESPONSE_SECONDS = 0.05
_STOP_SECONDS = 5.0

_live_pipelines = weakref.WeakSet()


def _close_live_pipelines():
    for pipeline in list(_live_pipelines):
        pipeline.close()


# At interpreter exit (e.g. after Ctrl-C), concurrent.futures joins its
# threads only after running every queued task: hundreds of pending copies.
# Hooks registered later run earlier, so this one cancels them first.
# Forked worker processes run these hooks too when they exit; close() acts
# only in the process that started the pipeline.
threading._register_atexit(_close_live_pipelines)


def _epoch_counts():
    return {'examples_from_local': 0, 'examples_from_source': 0,
            'examples_from_cache': 0, 'bytes_from_source': 0,
            'bytes_copied': 0}


class _Batch:
    """A batch between stage 1 and delivery."""

    def __init__(self, indices, state, first_access, following):
        self.indices = indices
        self.state = state
        self.size = len(indices)
        self.first_access = first_access  # access number of indices[0]
        self.following = following  # access number of each one's next use
        self.use_local = [False] * self.size
        self.staged_positions = collections.deque()  # ready for stage 3
        self.copy_futures = []
        self.results = [None] * self.size
        self.loaded = 0
        self.outstanding = 0  # stage-3 tasks not finished yet
        self.buffer: Optional[shared_memory.SharedMemory] = None
        self.error: Optional[BaseException] = None
        self.stale = False
        self.from_cache = set()  # positions served by the next-epoch cache

    @property
    def complete(self):
        return self.error is not None or self.loaded == self.size


class EndOfData:
    """Delivered when ``repeat=False`` and the epoch is over (StopIteration)."""

    def __init__(self, state):
        self.state = state


class Failure:
    """Delivered in place of a batch that failed; ``get`` raises ``error``."""

    def __init__(self, error: BaseException):
        self.error = error


class Pipeline:
    """Runs the stages for one iterator; see the module docstring.

    Args:
        dataset: The user's dataset.
        located_dataset: The view that reads local copies, or ``None``.
        stager: An ``ExampleStager``, or ``None`` when nothing is staged.
        state: The iterator state to start from.
        batch_size, repeat, order_sampler: As in the iterator.
        n_processes (int): Stage-3 worker processes.
        n_copy_threads (int): Stage-2 threads.
        n_copy_ahead (int): Batches stage 1/2 may run ahead of the consumer.
        n_prefetch (int): Finished batches kept ready for the consumer.
        shared_mem (int or None): Bytes per example in shared memory;
            ``None`` measures the first batch.
        maxtasksperchild (int or None): Examples a worker loads before it is
            replaced.
        stop_event (threading.Event): Set by :meth:`close`; the stager's
            waits for other processes' copies watch it.
        next_epoch_cache (NextEpochCache or None): Keeps examples the next
            epoch needs first; see
            :mod:`chainer_prefetch.iterators._next_epoch_cache`.
    """

    def __init__(self, dataset, located_dataset, stager, state, batch_size,
                 repeat, order_sampler, n_processes, n_copy_threads,
                 n_copy_ahead, n_prefetch, shared_mem, maxtasksperchild,
                 stop_event, next_epoch_cache=None):
        self._dataset = dataset
        self._dataset_length = len(dataset)
        self._located_dataset = located_dataset
        self._stager = stager
        self._state = state
        self._batch_size = batch_size
        self._repeat = repeat
        self._order_sampler = order_sampler
        self._n_processes = n_processes
        self._n_copy_threads = n_copy_threads
        self._n_copy_ahead = n_copy_ahead
        self._n_prefetch = n_prefetch
        self._example_bytes = shared_mem
        self._maxtasksperchild = maxtasksperchild

        self._cond = threading.Condition()
        self._in_flight = collections.deque()
        self._ready = collections.deque()
        self._free_buffers = []
        self._all_buffers = []
        self._exhausted = False
        self._delivered = 0
        self._restart_state = None
        self._generation = 0
        self._owner_pid = os.getpid()
        self._stopping = False
        self._stop_event = stop_event
        self._thread = None
        self._copy_pool = None
        self._workers = None
        self.examples_from_local = 0
        self.examples_from_source = 0
        #: epoch -> {'examples_from_local', 'examples_from_source' (stage 3),
        #: 'bytes_from_source' (stage 3), 'bytes_copied' (stage 2)} for the
        #: accesses of that epoch.
        self.by_epoch = collections.defaultdict(_epoch_counts)
        self.next_epoch_cache = next_epoch_cache
        self._dispatch_epoch = 0
        # Only the eviction policy of a capacity limit needs next uses.  With
        # a limit, stage 3 also does not wait for a copy that has not
        # started when its batch is the next to deliver: it reads the source.
        self._limited = stager is not None and stager.limited
        self._future = (FutureUses(self._dataset_length) if self._limited
                        else None)

    # ---- life cycle -------------------------------------------------------

    def start(self):
        """Starts workers first (no thread exists to fork with), then threads."""
        # Workers fork now, while this is the only thread of the pipeline.
        self._workers = WorkerPool(
            self._n_processes, _worker.initialize_worker,
            (self._dataset, self._located_dataset), self._maxtasksperchild)
        if self._stager is not None:
            self._copy_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self._n_copy_threads,
                thread_name_prefix='chainer_prefetch-copy')
        self._allocate_buffers()
        self._thread = threading.Thread(target=self._run,
                                        name='chainer_prefetch-pipeline',
                                        daemon=True)
        self._thread.start()
        _live_pipelines.add(self)

    def close(self):
        """Stops every thread and process and frees shared memory.

        Idempotent, and a no-op in any process but the one that started the
        pipeline (a forked child holds a copy of this object).
        """
        if os.getpid() != self._owner_pid:
            return
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
        self._stop_event.set()
        # Garbage collection may run this on one of the pipeline's own
        # threads, which must not wait for itself.
        threads = [self._thread] if self._thread is not None else []
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=False, cancel_futures=True)
            threads += list(getattr(self._copy_pool, '_threads', ()))
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(_STOP_SECONDS)
        if self._workers is not None:
            self._workers.close()
        for buffer in self._all_buffers:
            buffer.close()
            buffer.unlink()
        self._all_buffers = []
        self._free_buffers = []

    # ---- consumer side ----------------------------------------------------

    def get(self, dataset_timeout, timeout_warning):
        """Waits for the next delivered item: ``(batch, state)``, EndOfData or Failure.

        Args:
            dataset_timeout (float or None): Warn after waiting this long.
            timeout_warning (type): The warning class to issue.
        """
        started = time.perf_counter()
        warned = False
        with self._cond:
            while not self._ready:
                if not self._thread.is_alive():
                    raise RuntimeError('the prefetch pipeline thread stopped')
                self._cond.wait(_RESPONSE_SECONDS)
                waited = time.perf_counter() - started
                if (dataset_timeout is not None and not warned
                        and waited > dataset_timeout):
                    warned = True
                    warnings.warn(
                        'Stalled dataset is detected: no batch for {:.1f} s. '
                        'Slow shared storage, a hung file system or a slow '
                        'get_example are common causes.'.format(waited),
                        timeout_warning)
            item = self._ready[0]
            if not isinstance(item, EndOfData):
                self._ready.popleft()  # EndOfData repeats, as StopIteration does
            self._cond.notify_all()
            return item

    def restart(self, state):
        """Discards everything in flight and continues from ``state`` (reset/serialize)."""
        with self._cond:
            self._generation += 1
            self._ready.clear()
            self._restart_state = state
            self._cond.notify_all()

    # ---- the pipeline thread ---------------------------------------------

    def _run(self):
        try:
            while self._step():
                pass
        except BaseException as error:  # a bug must reach next(), not hang it
            with self._cond:
                self._ready.append(Failure(error))
                self._cond.notify_all()

    def _step(self) -> bool:
        with self._cond:
            if self._stopping:
                return False
            if self._restart_state is not None:
                self._discard_in_flight()
            self._generate()
            self._dispatch()
            head = self._in_flight[0] if self._in_flight else None
            deliverable = (head is not None and len(self._ready) < self._n_prefetch
                           and (not isinstance(head, _Batch) or head.complete))
            if not deliverable:
                self._cond.wait(_RESPONSE_SECONDS)
                return True
            self._in_flight.popleft()
            generation = self._generation
        item = self._finish(head)  # unpacking copies: done outside the lock
        with self._cond:
            if isinstance(head, _Batch):
                head.stale = True  # late results of a failed batch are dropped
                self._release_buffer_if_idle(head)
            if generation == self._generation:  # no reset meanwhile
                self._ready.append(item)
                self._delivered += 1
            self._cond.notify_all()
        return True

    def _discard_in_flight(self):
        for batch in self._in_flight:
            if isinstance(batch, _Batch):
                batch.stale = True
                for future in batch.copy_futures:
                    future.cancel()
                self._release_buffer_if_idle(batch)
        self._in_flight.clear()
        if self._future is not None:
            self._future.clear()
        if self.next_epoch_cache is not None:
            self.next_epoch_cache.clear()
        if self._stager is not None:
            self._stager.forget_next_uses()
        self._state = self._restart_state
        self._restart_state = None
        self._exhausted = False

    def _generate(self):
        """Stage 1: index lists up to ``n_copy_ahead`` batches ahead; starts stage 2.

        The window opens one batch per batch delivered ("slow start"): at
        start-up, copies for batches far ahead would take CPU and storage
        bandwidth from the files the first batch needs.
        """
        window = min(self._n_copy_ahead, DECODE_WINDOW + self._delivered)
        while not self._exhausted and len(self._in_flight) < window:
            first_access = (self._state.epoch * self._dataset_length
                            + self._state.current_position)
            try:
                self._state, indices = _lookahead.lookahead_statemachine(
                    self._state, self._batch_size, self._repeat,
                    self._order_sampler, self._dataset_length)
                self._register_orders()
            except Exception as error:
                self._in_flight.append(Failure(error))
                self._exhausted = True
                return
            if indices is None:
                self._in_flight.append(EndOfData(self._state))
                self._exhausted = True
                return
            following = None
            if self._future is not None:
                following = [self._future.following_use(int(index),
                                                         first_access + position)
                             for position, index in enumerate(indices)]
            batch = _Batch(indices, self._state, first_access, following)
            self._in_flight.append(batch)
            if self._stager is None or self._stager.disabled:
                batch.staged_positions.extend(range(batch.size))
                continue
            for position, index in enumerate(indices):
                if self._cached(int(index), first_access + position):
                    batch.staged_positions.append(position)  # no copy needed
                    continue
                if self._stager.stage_if_local(int(index),
                                               first_access + position):
                    batch.use_local[position] = True
                    batch.staged_positions.append(position)
                    continue
                future = self._copy_pool.submit(
                    self._stager.stage, int(index), first_access + position)
                batch.copy_futures.append(future)
                future.add_done_callback(
                    functools.partial(self._on_staged, batch, position))

    def _register_orders(self):
        """Tells FutureUses and the cache the orders of the state's epoch and the next."""
        for epoch in (self._state.epoch, self._state.epoch + 1):
            order = _lookahead.order_of_epoch(self._state, epoch,
                                              self._dataset_length)
            if order is None:
                continue
            if self._future is not None:
                self._future.add_epoch(epoch, order)
            if self.next_epoch_cache is not None and epoch > 0:
                self.next_epoch_cache.plan(epoch, order)

    def _cached(self, index, access):
        return (self.next_epoch_cache is not None and self.next_epoch_cache.holds(
            index, access // self._dataset_length))

    def _on_staged(self, batch, position, future):
        with self._cond:
            if batch.stale:
                return
            staged = False
            if not future.cancelled() and future.exception() is None:
                staged, copied = future.result()
                access = batch.first_access + position
                self.by_epoch[access // self._dataset_length][
                    'bytes_copied'] += copied
            batch.use_local[position] = staged
            batch.staged_positions.append(position)
            self._cond.notify_all()

    def _dispatch(self):
        """Stage 3: submit staged examples of the first DECODE_WINDOW batches."""
        window = 0
        for batch in self._in_flight:
            if not isinstance(batch, _Batch) or window == DECODE_WINDOW:
                return
            window += 1
            if batch.error is not None:
                continue
            if batch.buffer is None and self._free_buffers:
                batch.buffer = self._free_buffers.pop()
            if self._limited and window == 1:
                # The next batch to deliver: what no copy thread has started
                # is read from the source (the callback queues it).
                for future in batch.copy_futures:
                    future.cancel()
            positions = []
            while batch.staged_positions:
                position = batch.staged_positions.popleft()
                if not (self.next_epoch_cache is not None and self._take_from_cache(
                        batch, position, int(batch.indices[position]))):
                    positions.append(position)
            for chunk in self._chunks(batch, positions):
                self._submit_loads(batch, chunk)

    def _chunks(self, batch, positions):
        """Splits positions staged together into one task per worker.

        One task per example costs a round trip each; examples that become
        ready together and read fast (local copies, data in memory) go as
        one task per worker instead.  Examples read from shared storage go
        one per task, so that slow reads spread over all workers.  With
        ``maxtasksperchild`` a task stays one example, so the limit keeps
        counting examples.
        """
        if self._maxtasksperchild is not None:
            return [[position] for position in positions]
        fast = [position for position in positions
                if self._stager is None or batch.use_local[position]]
        slow = [[position] for position in positions
                if not (self._stager is None or batch.use_local[position])]
        size = max(1, -(-len(fast) // self._n_processes))
        return [fast[start:start + size]
                for start in range(0, len(fast), size)] + slow

    def _submit_loads(self, batch, positions):
        tasks = []
        for position in positions:
            if batch.buffer is None:
                offset = limit = None
            else:
                offset = position * self._example_bytes
                limit = offset + self._example_bytes
            tasks.append((int(batch.indices[position]),
                          batch.use_local[position], offset, limit))
        name = None if batch.buffer is None else batch.buffer.name
        try:
            future = self._workers.submit(_worker.load_examples, tasks, name)
        except RuntimeError as error:  # closed while shutting down
            batch.error = self._load_error(tasks[0][0], error)
            return
        batch.outstanding += 1
        future.add_done_callback(
            functools.partial(self._on_loaded, batch, positions))

    def _on_loaded(self, batch, positions, future):
        from_source = []  # (epoch, index): their bytes are counted unlocked
        with self._cond:
            batch.outstanding -= 1
            if batch.stale or future.cancelled():  # reset, or shutting down
                self._release_buffer_if_idle(batch)
                return
            error = future.exception()
            if error is not None:
                results = [(None, error)] * len(positions)
            else:
                results = future.result()
            for position, (loaded, failure) in zip(positions, results):
                index = int(batch.indices[position])
                if failure is not None:
                    if batch.error is None:
                        batch.error = self._load_error(index, failure)
                    break
                batch.results[position], read_locally = loaded
                batch.loaded += 1
                access = batch.first_access + position
                epoch = access // self._dataset_length
                self._count_load(epoch, read_locally)
                if not read_locally:
                    from_source.append((epoch, index))
                if self._limited:
                    self._stager.loaded(index, access,
                                        batch.following[position])
            self._cond.notify_all()
        if from_source and self._stager is not None:
            # Sizes not known yet are a stat on shared storage: not under
            # the lock every stage waits on.
            sizes = [(epoch, self._stager.example_bytes(index))
                     for epoch, index in from_source]
            with self._cond:
                for epoch, size in sizes:
                    self.by_epoch[epoch]['bytes_from_source'] += size

    def _take_from_cache(self, batch, position, index) -> bool:
        access = batch.first_access + position
        epoch = access // self._dataset_length
        if epoch > self._dispatch_epoch:  # what earlier epochs left is useless
            self._dispatch_epoch = epoch
            self.next_epoch_cache.forget_before(epoch)
        example = self.next_epoch_cache.take(index, epoch)
        if example is None:
            return False
        batch.results[position] = example
        batch.from_cache.add(position)
        batch.loaded += 1
        self.by_epoch[epoch]['examples_from_cache'] += 1
        if self._limited:
            self._stager.loaded(index, access, batch.following[position])
        return True

    def _offer_to_cache(self, batch, examples):
        """Copies the examples the next epoch's prefix wants (outside the lock)."""
        candidates = [
            (position, int(index),
             (batch.first_access + position) // self._dataset_length + 1)
            for position, index in enumerate(batch.indices)]
        with self._cond:
            wanted = [candidate for candidate in candidates
                      if self.next_epoch_cache.wants(*candidate[1:])]
        offers = [(index, epoch, copy.deepcopy(examples[position]),
                   _measure(examples[position]))
                  for position, index, epoch in wanted]
        if offers:
            with self._cond:
                for offer in offers:
                    self.next_epoch_cache.offer(*offer)

    def _count_load(self, epoch, read_locally):
        counts = self.by_epoch[epoch]
        if read_locally:
            self.examples_from_local += 1
            counts['examples_from_local'] += 1
        else:
            self.examples_from_source += 1
            counts['examples_from_source'] += 1

    def _load_error(self, index, error):
        if self._stager is not None:
            files = ', '.join(self._stager.files(index)) or 'none'
        else:
            files = 'not known'
        if isinstance(error, WorkerDiedError):
            cause = ('a stage-3 worker process died (killed, or out of '
                     'memory?): {}'.format(error))
        else:
            cause = str(error)
        return ExampleLoadError('example {} (files: {}) could not be loaded: '
                                '{}'.format(index, files, cause))

    def _finish(self, head):
        """Turns a completed head into what ``get`` delivers."""
        if not isinstance(head, _Batch):
            return head
        if head.error is not None:
            return Failure(head.error)
        if head.buffer is None:
            examples = head.results
        else:
            memory = head.buffer.buf
            examples = [result if position in head.from_cache
                        else _unpack(result, memory)
                        for position, result in enumerate(head.results)]
        head.results = None
        if self.next_epoch_cache is not None:
            self._offer_to_cache(head, examples)
        if self._example_bytes is None:
            self._example_bytes = max(map(_measure, examples))
            with self._cond:
                self._allocate_buffers()
        return examples, head.state

    # ---- shared memory ------------------------------------------------------

    def _allocate_buffers(self):
        if not self._example_bytes or self._all_buffers:
            return
        size = self._example_bytes * self._batch_size
        for _ in range(DECODE_WINDOW + 1):
            buffer = shared_memory.SharedMemory(create=True, size=size)
            self._all_buffers.append(buffer)
            self._free_buffers.append(buffer)

    def _release_buffer_if_idle(self, batch):
        if batch.buffer is not None and batch.outstanding == 0:
            self._free_buffers.append(batch.buffer)
            batch.buffer = None
