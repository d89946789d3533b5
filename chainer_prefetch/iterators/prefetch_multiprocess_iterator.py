"""PrefetchMultiprocessIterator: MultiprocessIterator that stages files to local storage."""
import multiprocessing
import threading
import time
import warnings
import weakref

import numpy
from chainer.dataset import iterator
from chainer.iterators import MultiprocessIterator
from chainer.iterators.order_samplers import ShuffleOrderSampler

from chainer_prefetch.iterators import _lookahead
from chainer_prefetch.iterators._next_epoch_cache import NextEpochCache
from chainer_prefetch.iterators._pipeline import EndOfData, Failure, Pipeline
from chainer_prefetch.staging.dataset_files import resolve_dataset_files
from chainer_prefetch.staging.eviction import POLICIES
from chainer_prefetch.staging.example_stager import (ExampleStager,
                                                     StagingCounters)
from chainer_prefetch.staging.local_directory import (LocalDirectory,
                                                       LocalStorageError)


class PrefetchMultiprocessIterator(iterator.Iterator):

    """Multiprocess iterator that copies dataset files to node-local storage.

    A drop-in replacement for :class:`chainer.iterators.MultiprocessIterator`
    for datasets whose examples are files on slow shared storage (Lustre,
    GPFS, NFS).  Three stages run asynchronously:

    1. **order**: Chainer's ``iterator_statemachine`` over the order sampler
       (``ShuffleOrderSampler`` by default) makes one index list per batch,
       up to ``n_copy_ahead`` batches ahead of training;
    2. **staging**: ``n_copy_threads`` threads copy the files of each example
       from shared storage into ``local_dir``, skipping files already there
       with the source's size and mtime;
    3. **loading**: ``n_processes`` worker processes load each example as
       soon as its files are local (reading the local copies), and return
       arrays through shared memory as ``MultiprocessIterator`` does.

    Training starts at once; every read after the first copy of a file comes
    from local storage.  Threads do the copying because copying waits on I/O
    (the GIL is released), so no process is added for it: the process count
    is that of ``MultiprocessIterator`` with the same ``n_processes``.

    Observable behaviour equals ``MultiprocessIterator``'s: ``epoch``,
    ``epoch_detail``, ``previous_epoch_detail``, ``is_new_epoch``,
    ``current_position``, ``reset()``, ``serialize()`` (snapshots are
    interchangeable with ``MultiprocessIterator``'s and ``SerialIterator``'s),
    ``StopIteration`` with ``repeat=False``, and, with the same random state,
    the same examples in the same order.  One difference in timing: the
    order of epoch ``e + 1`` is drawn when epoch ``e`` starts (with the
    arguments Chainer would pass at its end), and saved by ``serialize()``
    as ``next_order``, so a resumed run continues with the same orders.
    With an order sampler of its own ``RandomState`` nothing else changes;
    one that shares NumPy's global random state with other code sees that
    state one draw ahead.

    Which files an example reads is found through Chainer's dataset wrappers
    or a two-method protocol: see :mod:`chainer_prefetch.staging.dataset_files`.
    A dataset without files, or ``local_dir=None``, makes this an ordinary
    multiprocess iterator.

    Failures:

    * A source file that cannot be read, or an exception in ``get_example``,
      raises :class:`~chainer_prefetch.ExampleLoadError` from ``next()``
      naming the index and the files.  The iterator then keeps raising it
      until ``reset()``.
    * A local directory that is full or not writable: a ``UserWarning`` once,
      and training continues from shared storage; no partial copy is ever
      read.
    * A worker process killed by the system: ``ExampleLoadError`` saying so.

    Args:
        dataset (~chainer.dataset.Dataset): Dataset to iterate.
        batch_size (int): Number of examples within each batch.
        repeat (bool): If ``True``, it infinitely loops over the dataset.
            Otherwise, it stops iteration at the end of the first epoch.
        shuffle (bool): If ``True``, the order of examples is shuffled at the
            beginning of each epoch; if ``False``, examples come in index
            order.  ``None`` with no ``order_sampler`` shuffles.
        n_processes (int): Number of worker processes (stage 3).  The number
            of CPUs by default.
        n_prefetch (int): Number of finished batches kept ready.
        shared_mem (int): Bytes of shared memory per example.  ``None``
            measures the first batch (which then travels by pickling).
        order_sampler (callable): ``(current_order, current_position) ->
            next_order``; cannot be combined with ``shuffle``.
        dataset_timeout (float): A :class:`TimeoutWarning` is issued when
            ``next()`` waits longer than this (seconds); ``None`` disables it.
        maxtasksperchild (int): Examples a worker process loads before it is
            replaced by a fresh one.  Replacement workers are started with
            ``forkserver`` when the default start method is ``fork``.
        local_dir (str): Node-local directory for the copies (e.g. on the
            node's SSD).  Created with mode 0700 when missing; may be shared
            by several iterators and processes.  ``None`` disables staging.
        n_copy_threads (int): Threads copying files (stage 2).  Each waits
            on one file's latency at a time, so more threads hide more
            latency; 16 kept the emulated Lustre-like storage of
            ``scripts/bench_minibatch.py`` ahead of 2 loader processes
            (12 and 16 performed alike, 8 did not).
        n_copy_ahead (int): How many batches stages 1-2 may run ahead of
            training.  Bounds memory and the files staged but not yet used.
        local_capacity (int): Limit in bytes of the copies under
            ``local_dir``, for nodes whose local storage is smaller than the
            dataset.  The limit is per directory and enforced jointly by
            every process using it (a ledger file under ``flock``; see
            :mod:`chainer_prefetch.staging.capacity`): give every iterator
            sharing the directory the same value.  Construction reads the
            size of every file of the dataset (one ``stat`` each, in
            parallel) and refuses a limit smaller than the largest.  Copies
            that would exceed the limit evict others by ``eviction_policy``
            or are left on shared storage, which stage 3 then reads
            directly; stage 3 also reads the source, instead of waiting,
            for an example whose copy has not started when its batch is
            next.
        next_epoch_cache_examples (int): Enables the next-epoch cache: while
            an epoch runs, keep in memory (in this process) the examples
            that the next epoch needs first, at most this many, so that the
            next epoch serves them without storage reads or decoding.  The
            order of examples is unchanged.  See
            :mod:`chainer_prefetch.iterators._next_epoch_cache`.
        next_epoch_cache_bytes (int): Enables the cache with a bound in
            bytes of example arrays (both bounds apply when both are given).
        eviction_policy (str): With ``local_capacity``: ``'belady'``
            (default: drop the example needed farthest in the future, known
            because the next epoch's order is drawn one epoch early; keep a
            newcomer out when it is needed after everything stored),
            ``'lru'`` (least recently used) or ``'fill_once'`` (keep the
            first copies that fit, never evict).

    Attributes:
        stats (dict): Counters of what each stage did (see :attr:`stats`).
    """

    class TimeoutWarning(MultiprocessIterator.TimeoutWarning):
        """Issued when ``next()`` waits longer than ``dataset_timeout``."""

    _finalized = False
    _pipeline = None
    _stop_event = None  # finalize() may run on a half-constructed object
    _stager = None

    def __init__(self, dataset, batch_size, repeat=True, shuffle=None,
                 n_processes=None, n_prefetch=1, shared_mem=None,
                 order_sampler=None, dataset_timeout=30.0,
                 maxtasksperchild=None, *, local_dir=None, n_copy_threads=16,
                 n_copy_ahead=16, local_capacity=None,
                 eviction_policy='belady', next_epoch_cache_examples=None,
                 next_epoch_cache_bytes=None):
        _check_positive_int('batch_size', batch_size)
        _check_positive_int('n_copy_threads', n_copy_threads)
        _check_positive_int('n_copy_ahead', n_copy_ahead)
        if n_processes is not None:
            _check_positive_int('n_processes', n_processes)
        if maxtasksperchild is not None:
            _check_positive_int('maxtasksperchild', maxtasksperchild)
        if local_capacity is not None:
            _check_positive_int('local_capacity', local_capacity)
        for name, value in (('next_epoch_cache_examples',
                             next_epoch_cache_examples),
                            ('next_epoch_cache_bytes', next_epoch_cache_bytes)):
            if value is not None:
                _check_positive_int(name, value)
        if eviction_policy not in POLICIES:
            raise ValueError('eviction_policy must be one of {}, got {!r}'
                             .format(', '.join(POLICIES), eviction_policy))
        self.dataset = dataset
        self.batch_size = batch_size
        self.repeat = repeat
        self.shuffle = shuffle
        self.n_processes = n_processes or multiprocessing.cpu_count()
        self.n_prefetch = max(n_prefetch, 1)
        self.shared_mem = shared_mem
        self.dataset_timeout = dataset_timeout
        self.maxtasksperchild = maxtasksperchild
        self.local_dir = local_dir
        self.n_copy_threads = n_copy_threads
        self.n_copy_ahead = n_copy_ahead
        self.local_capacity = local_capacity
        self.eviction_policy = eviction_policy
        self.next_epoch_cache_examples = next_epoch_cache_examples
        self.next_epoch_cache_bytes = next_epoch_cache_bytes

        if shuffle is not None:
            if order_sampler is not None:
                raise ValueError('`shuffle` is not `None` and a custom '
                                 '`order_sampler` is set. Please set '
                                 '`shuffle` to `None` to use the custom '
                                 'order sampler.')
            if shuffle:
                order_sampler = ShuffleOrderSampler()
        elif order_sampler is None:
            order_sampler = ShuffleOrderSampler()
        self.order_sampler = order_sampler
        self._initialize()
        self.reset()

    def _initialize(self):
        """Sets up everything that is not the iteration state (also after unpickling)."""
        self._counters = StagingCounters()
        self._stop_event = threading.Event()
        self._error = None
        self._warned_local_storage = False
        self._consumer_wait_seconds = 0.0
        self._first_batch_seconds = None
        self._batches_delivered = 0
        self._located_dataset = None
        self._stager = None
        self._local_directory = None
        if self.local_dir is None:
            return
        files = resolve_dataset_files(self.dataset)
        if files is None:
            return
        try:
            self._local_directory = LocalDirectory(self.local_dir,
                                                   self._stop_event)
        except LocalStorageError as error:
            warnings.warn('{}; reading the dataset from its source '
                          'instead.'.format(error))
            return
        self._located_dataset = files.located(self._local_directory.path_map)
        self._stager = ExampleStager(
            files, self._local_directory, self._counters,
            capacity_bytes=self.local_capacity,
            eviction_policy=self.eviction_policy,
            n_examples=len(self.dataset), n_stat_threads=self.n_copy_threads)

    def _start_pipeline(self):
        cache = None
        if (self.next_epoch_cache_examples is not None
                or self.next_epoch_cache_bytes is not None):
            cache = NextEpochCache(self.next_epoch_cache_examples,
                                   self.next_epoch_cache_bytes)
        self._pipeline = Pipeline(
            self.dataset, self._located_dataset, self._stager, self._state,
            self.batch_size, self.repeat, self.order_sampler,
            self.n_processes, self.n_copy_threads, self.n_copy_ahead,
            self.n_prefetch, self.shared_mem, self.maxtasksperchild,
            self._stop_event, cache)
        # Stops the pipeline when this iterator is garbage collected or the
        # interpreter exits, even if finalize() is never called.
        self._pipeline_finalizer = weakref.finalize(self, self._pipeline.close)
        try:
            self._pipeline.start()
        except BaseException:
            self.finalize()
            raise

    def __next__(self):
        if self._finalized:
            raise RuntimeError('the iterator is finalized')
        if self._error is not None:
            raise self._error
        started = time.perf_counter()
        if self._pipeline is None:
            self._start_pipeline()
        item = self._pipeline.get(self.dataset_timeout, self.TimeoutWarning)
        waited = time.perf_counter() - started
        self._consumer_wait_seconds += waited
        self._warn_if_staging_stopped()
        if isinstance(item, Failure):
            self._error = item.error
            raise item.error
        if isinstance(item, EndOfData):
            batch, state = None, item.state
        else:
            batch, state = item
        self._previous_epoch_detail = self.epoch_detail
        self._state = state
        if batch is None:
            raise StopIteration
        if self._first_batch_seconds is None:
            self._first_batch_seconds = waited
        self._batches_delivered += 1
        return batch

    next = __next__

    def _warn_if_staging_stopped(self):
        reason = self._counters.local_storage_error
        if reason is not None and not self._warned_local_storage:
            self._warned_local_storage = True
            warnings.warn('Copying to the local directory stopped ({}); '
                          'reading the rest from shared storage.'.format(reason))

    @property
    def stats(self):
        """What the stages did so far, as a dict.

        Keys: ``files_copied``, ``bytes_copied``, ``files_already_local``
        (hits), ``files_failed_source``, ``examples_staged``,
        ``examples_not_staged``, ``copy_seconds`` (summed over copy threads),
        ``local_storage_error`` (why staging stopped, or ``None``),
        ``examples_from_local`` / ``examples_from_source`` (what stage 3
        loaded, including batches prefetched but not consumed yet, or
        dropped by a reset; later epochs count as hits again),
        ``batches``, ``consumer_wait_seconds`` (time ``next()`` waited) and
        ``first_batch_seconds`` (the first ``next()`` call, start-up
        included).  With ``local_capacity``: ``examples_bypassed`` (left on
        shared storage by the policy), ``files_evicted``, ``bytes_evicted``
        and ``local_bytes_used`` (the directory's ledger, all processes).
        ``next_epoch_cache``: ``examples_cached``, ``examples_replaced``
        (by ones earlier in the next order), ``hits``, ``bytes_cached``,
        ``held_bytes``, or ``None`` without the cache.
        ``by_epoch`` maps each epoch to what its accesses cost:
        ``examples_from_local``, ``examples_from_source``,
        ``examples_from_cache`` (the next-epoch cache), and the bytes
        they read from shared storage, ``bytes_copied`` (stage 2) and
        ``bytes_from_source`` (stage 3).
        """
        values = self._counters.snapshot()
        pipeline = self._pipeline
        values['examples_from_local'] = pipeline.examples_from_local if pipeline else 0
        values['examples_from_source'] = pipeline.examples_from_source if pipeline else 0
        values['by_epoch'] = ({epoch: dict(counts) for epoch, counts
                               in sorted(pipeline.by_epoch.items())}
                              if pipeline else {})
        cache = pipeline and pipeline.next_epoch_cache
        values['next_epoch_cache'] = (dict(cache.counters, held_bytes=(
            cache.held_bytes)) if cache else None)
        values['local_bytes_used'] = (self._stager.local_bytes_used()
                                      if self._stager else None)
        values['batches'] = self._batches_delivered
        values['consumer_wait_seconds'] = self._consumer_wait_seconds
        values['first_batch_seconds'] = self._first_batch_seconds
        return values

    def finalize(self):
        """Stops all threads and worker processes and frees shared memory."""
        if self._finalized:
            return
        self._finalized = True
        if self._stop_event is not None:
            self._stop_event.set()
        if self._pipeline is not None:
            self._pipeline_finalizer()  # runs Pipeline.close once
            self._pipeline = None
        if self._stager is not None:
            self._stager.close()

    def __copy__(self):
        other = PrefetchMultiprocessIterator(
            self.dataset, self.batch_size, self.repeat, shuffle=None,
            n_processes=self.n_processes, n_prefetch=self.n_prefetch,
            shared_mem=self.shared_mem, order_sampler=self.order_sampler,
            dataset_timeout=self.dataset_timeout,
            maxtasksperchild=self.maxtasksperchild, local_dir=self.local_dir,
            n_copy_threads=self.n_copy_threads, n_copy_ahead=self.n_copy_ahead,
            local_capacity=self.local_capacity,
            eviction_policy=self.eviction_policy,
            next_epoch_cache_examples=self.next_epoch_cache_examples,
            next_epoch_cache_bytes=self.next_epoch_cache_bytes)
        other._set_state(self._state)
        other._previous_epoch_detail = self._previous_epoch_detail
        return other

    @property
    def current_position(self):
        return self._state.current_position

    @property
    def epoch(self):
        return self._state.epoch

    @property
    def is_new_epoch(self):
        return self._state.is_new_epoch

    @property
    def epoch_detail(self):
        return self.epoch + self.current_position / self._epoch_size

    @property
    def previous_epoch_detail(self):
        if self._previous_epoch_detail < 0:
            return None
        return self._previous_epoch_detail

    @property
    def _epoch_size(self):
        order = self._state.order
        return len(self.dataset) if order is None else len(order)

    def serialize(self, serializer):
        """Saves or restores the position; compatible with Chainer's iterators."""
        current_position = serializer('current_position', self.current_position)
        epoch = serializer('epoch', self.epoch)
        is_new_epoch = serializer('is_new_epoch', self.is_new_epoch)
        order = self._state.order
        if order is not None:
            order = order.copy()
            try:
                serializer('order', order)
            except KeyError:
                serializer('_order', order)
        next_order = self._state.next_order
        if next_order is not None:
            next_order = next_order.copy()
        try:
            next_order = serializer('next_order', next_order)
        except KeyError:
            next_order = None  # a MultiprocessIterator snapshot: draw it now
        self._reset_state(current_position, epoch, is_new_epoch, order,
                          next_order)
        try:
            self._previous_epoch_detail = serializer(
                'previous_epoch_detail', self._previous_epoch_detail)
        except KeyError:
            # Snapshots of older Chainer versions lack it: estimate it.
            self._previous_epoch_detail = self.epoch + (
                self.current_position - self.batch_size) / self._epoch_size
            if self.epoch_detail > 0:
                self._previous_epoch_detail = max(
                    self._previous_epoch_detail, 0.)
            else:
                self._previous_epoch_detail = -1.

    def reset(self):
        """Goes back to the start of epoch 0 with a fresh order (and its successor)."""
        self._check_not_finalized()
        self._set_state(_lookahead.initial_state(
            self.order_sampler, len(self.dataset), self.batch_size))
        self._previous_epoch_detail = -1.

    def _reset_state(self, current_position, epoch, is_new_epoch, order,
                     next_order=None):
        self._check_not_finalized()
        self._set_state(_lookahead.with_next_order(
            (current_position, epoch, is_new_epoch, order),
            self.order_sampler, self.batch_size, next_order))

    def _check_not_finalized(self):
        if self._finalized:
            raise NotImplementedError(
                'Reset of finalized PrefetchMultiprocessIterator is not '
                'supported.')

    def _set_state(self, state):
        self._state = state
        self._error = None
        if self._pipeline is not None:
            self._pipeline.restart(self._state)

    def __getstate__(self):
        state = {'current_position': self.current_position,
                 'epoch': self.epoch, 'is_new_epoch': self.is_new_epoch,
                 'order': self._state.order,
                 'next_order': self._state.next_order,
                 'previous_epoch_detail': self._previous_epoch_detail}
        settings = {key: value for key, value in self.__dict__.items()
                    if key in _SETTINGS}
        return {'settings': settings, 'state': state}

    def __setstate__(self, pickled):
        self.__dict__.update(pickled['settings'])
        self._initialize()
        state = pickled['state']
        self._reset_state(state['current_position'], state['epoch'],
                          state['is_new_epoch'], state['order'],
                          state.get('next_order'))
        self._previous_epoch_detail = state['previous_epoch_detail']


_SETTINGS = ('dataset', 'batch_size', 'repeat', 'shuffle', 'n_processes',
             'n_prefetch', 'shared_mem', 'dataset_timeout', 'maxtasksperchild',
             'local_dir', 'n_copy_threads', 'n_copy_ahead', 'order_sampler',
             'local_capacity', 'eviction_policy', 'next_epoch_cache_examples',
             'next_epoch_cache_bytes')


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, numpy.integer)) \
            or value < 1:
        raise ValueError('{} must be a positive integer, got {!r}'.format(
            name, value))
