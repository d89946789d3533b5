"""PrefetchMultiprocessIterator: MultiprocessIterator that stages files to local storage."""
import threading
import time
import warnings
import weakref

import chainer
import numpy
from chainer.dataset import iterator
from chainer.iterators import MultiprocessIterator

from chainer_prefetch.errors import LocalStorageError, StagingWarning
from chainer_prefetch.iterators import _executor, _scheduler, _settings
from chainer_prefetch.iterators._settings import IteratorSettings
from chainer_prefetch.policy import lookahead
from chainer_prefetch.policy.next_epoch_cache import NextEpochCache
from chainer_prefetch.staging import checks, open_watch
from chainer_prefetch.staging.dataset_files import (
    ItemLocalBytes,
    ItemSources,
    LearnedFiles,
    resolve_dataset_files,
)
from chainer_prefetch.staging.early_copies import EarlyCopies
from chainer_prefetch.staging.local_directory import LocalDirectory
from chainer_prefetch.staging.local_memory import MEMORY, LocalMemory
from chainer_prefetch.staging.local_store import STORE_COUNTERS, LocalStore
from chainer_prefetch.staging.open_watch import OpenCheck
from chainer_prefetch.staging.peers import make_lookup
from chainer_prefetch.staging.source_checks import SourceChecks
from chainer_prefetch.staging.source_ops import SOURCE_OPS, tallied
from chainer_prefetch.staging.sources import as_source


class PrefetchMultiprocessIterator(iterator.Iterator):

    """Multiprocess iterator that copies dataset files to node-local storage.

    A drop-in replacement for :class:`chainer.iterators.MultiprocessIterator`
    for datasets whose examples are files on slow shared storage (Lustre,
    GPFS, NFS).  Three stages run at once:

    1. **order**: Chainer's ``iterator_statemachine`` over the order sampler
       makes one index list per batch, up to ``n_copy_ahead`` batches ahead
       of training;
    2. **staging**: ``n_copy_threads`` threads of this process copy the files
       of each example from shared storage into ``local_dir``, skipping
       files already there with the source's size and modification time;
    3. **loading**: ``n_processes`` loader processes (or threads, with
       ``loader_threads=True``) load each example as soon as its files are
       local, and return arrays through shared memory.

    Observable behaviour equals ``MultiprocessIterator``'s: ``epoch``,
    ``epoch_detail``, ``previous_epoch_detail``, ``is_new_epoch``,
    ``current_position``, ``reset()``, ``serialize()`` (snapshots are
    interchangeable with ``MultiprocessIterator``'s and ``SerialIterator``'s),
    ``StopIteration`` with ``repeat=False``, and, with the same random state,
    the same examples in the same order.  The order of epoch ``e + 1`` is
    drawn when epoch ``e`` starts (with the arguments Chainer would pass at
    its end) and saved by ``serialize()`` as ``next_order``; an order
    sampler that shares NumPy's global random state with other code sees
    that state one draw ahead.

    Which files an example reads is found through Chainer's dataset
    wrappers, in the dataset's attributes, or from the dataset's
    ``example_files``/``with_file_locations`` protocol
    (:mod:`chainer_prefetch.staging.dataset_files`); what cannot be staged is
    reported once with a :class:`~chainer_prefetch.StagingWarning`.  A
    dataset that opens no files, or ``local_dir=None``, makes this an
    ordinary multiprocess iterator.

    An example that fails to load raises from ``next()`` an exception of the
    dataset's own type that is also a
    :class:`~chainer_prefetch.ExampleLoadError` (a killed loader process:
    :class:`~chainer_prefetch.WorkerDiedError`), until ``reset()``.  A local
    directory that is full or not writable gives a ``StagingWarning`` once,
    and training continues from shared storage.

    ``docs/options.rst`` has every option with its default and when to
    change it, ``docs/stats.rst`` every field of :attr:`stats`.

    Args:
        dataset (~chainer.dataset.Dataset): Dataset to iterate.
        batch_size (int): Number of examples within each batch.
        repeat (bool): Loop over the dataset forever; otherwise stop at the
            end of the first epoch.
        shuffle (bool): Shuffle the order every epoch (``True``), keep index
            order (``False``); ``None`` with no ``order_sampler`` shuffles.
        n_processes (int): Loader processes (stage 3); the number of CPUs
            by default.
        n_prefetch (int): Finished batches kept ready.
        shared_mem (int): Bytes of shared memory per example (per row for
            columnar batches); ``None`` measures the first batch, 0 pickles
            every batch.
        order_sampler (callable): ``(current_order, current_position) ->
            next_order``; cannot be combined with ``shuffle``.
        dataset_timeout (float): Seconds ``next()`` may wait before a
            :class:`TimeoutWarning`; ``None`` disables it.
        maxtasksperchild (int): Examples a loader process loads before a
            fresh one replaces it.
        local_dir (str): Node-local directory for the copies (created with
            mode 0700; ``~`` is expanded), shared safely by several
            iterators and processes; must not overlap the dataset's
            directory.  ``None`` disables staging; ``':memory:'`` keeps
            Parquet row groups decoded in this process's memory (needs
            ``loader_threads`` and ``local_capacity``).
        n_copy_threads (int): Threads copying files (stage 2); more threads
            hide more of the storage's latency per file.
        n_copy_ahead (int): How many batches stages 1-2 may run ahead of
            training.
        local_capacity (int): Most bytes of copies under ``local_dir``,
            enforced jointly by every process using the directory (give
            them the same value); with ``':memory:'``, this iterator's
            memory.
        eviction_policy (str): With ``local_capacity``: ``'belady'`` (drop
            the copy needed farthest in the future), ``'lru'`` or
            ``'fill_once'``.
        next_epoch_cache_examples (int): Keep in memory at most this many of
            the examples the next epoch needs first
            (:mod:`chainer_prefetch.policy.next_epoch_cache`).
        next_epoch_cache_bytes (int): The same bound in bytes of example
            arrays (both bounds apply when both are given).
        recheck_sources (str): When a local copy is compared with its
            source again (:mod:`chainer_prefetch.staging.source_checks`):
            ``'directories'``, in each epoch whose look at the source's
            directory (one ``stat`` per directory per epoch) shows a name
            in it created, renamed or removed; ``'each_epoch'``, every copy
            once per epoch (one ``stat`` per file); ``'never'``, only the
            first time this run uses it.
        columnar (bool): Load whole batches as columns with the dataset's
            ``get_columns(indices)``; ``next()`` returns a
            :class:`~chainer_prefetch.columnar.ColumnarBatch`.  ``None``:
            when the dataset has ``get_columns``.  Not with the next-epoch
            cache.
        loader_threads (bool): Run stage 3 as threads of this process
            instead of processes, for loading that runs mostly outside the
            GIL (columnar batches of a
            :class:`~chainer_prefetch.datasets.ParquetDataset`).  Not with
            ``maxtasksperchild`` or ``shared_mem``.
        peers (~chainer_prefetch.PeerGroup): Copy each file from the node
            that trained on its example in an earlier epoch, before shared
            storage (with ``order_sampler=ShuffleAcrossRanks(...)``, whose
            ``holders`` the group was made with); needs ``local_dir``.  See
            ``docs/peers.rst``.

    Raises:
        ValueError: An option is out of range, two options do not combine,
            or ``local_dir`` overlaps the dataset's directory.

    Attributes:
        settings (IteratorSettings): The options, validated; each is also
            readable as an attribute of the iterator (``it.batch_size``).
        stats (dict): Counters of what each stage did (see :attr:`stats`).
    """

    class TimeoutWarning(MultiprocessIterator.TimeoutWarning):
        """Issued when ``next()`` waits longer than ``dataset_timeout``."""

    _finalized = False
    _executor = None  # finalize() may run on a half-constructed object
    _final_counts = ({}, {}, None)  # the pipeline's counters at finalize()
    _learned = None  # index -> files the loaders saw it open (to be staged)
    _early_copies = None  # copies of those files made while they are learned
    _store = None
    _lookup = None  # what the peer server answers with, while this one serves

    def __init__(self, dataset, batch_size, repeat=True, shuffle=None,
                 n_processes=None, n_prefetch=1, shared_mem=None,
                 order_sampler=None, dataset_timeout=30.0,
                 maxtasksperchild=None, *, local_dir=None, n_copy_threads=16,
                 n_copy_ahead=16, local_capacity=None,
                 eviction_policy='belady', next_epoch_cache_examples=None,
                 next_epoch_cache_bytes=None, recheck_sources='directories',
                 columnar=None, loader_threads=False, peers=None):
        self.settings = IteratorSettings(
            dataset, batch_size, repeat, shuffle, n_processes, n_prefetch,
            shared_mem, order_sampler, dataset_timeout, maxtasksperchild,
            local_dir, n_copy_threads, n_copy_ahead, local_capacity,
            eviction_policy, next_epoch_cache_examples, next_epoch_cache_bytes,
            recheck_sources, columnar, loader_threads, peers)
        self._initialize()
        self.reset()

    def __getattr__(self, name):
        # The options read as attributes, as MultiprocessIterator's do.
        if name in _settings.FIELDS and 'settings' in self.__dict__:
            return getattr(self.settings, name)
        raise AttributeError('{!r} object has no attribute {!r}'.format(
            type(self).__name__, name))

    def _initialize(self):
        """Sets up everything that is not the iteration state (also after unpickling)."""
        with tallied() as asked:  # what the checks of the dataset's files ask
            self._set_up()
        self._setup_ops = asked

    def _set_up(self):
        settings = self.settings
        self._stop_event = threading.Event()
        self._error = None
        self._warned_local_storage = False
        self._consumer_wait_seconds = 0.0
        self._first_batch_seconds = None
        self._batches_delivered = 0
        self._files = self._store = self._located_dataset = None
        self._item_of = self._item_bytes = None
        self._open_check = None
        self._learned = None
        self._early_copies = None
        self._learning_epoch = None
        self._retired_counts = ({}, {}, None)
        self._staging_warnings = list(_settings.local_dir_warnings(
            settings.local_dir))
        self._warned_findings = set()
        self._lookup = None
        if settings.local_dir is None:
            return
        files = resolve_dataset_files(settings.dataset)
        if files is None and settings.peers is not None:
            self._warn_staging(
                '{} names no files per example, so no peer is asked for '
                'them (peers need a dataset whose files the iterator finds '
                'before training: docs/staging.rst)'.format(
                    type(settings.dataset).__name__),
                stacklevel=4)
        if files is None:
            # Nothing known to stage: the loaders tell what it opens, and
            # what they tell is staged from the next epoch on.
            self._open_check = OpenCheck(None)
            if settings.local_dir != MEMORY:
                self._learned = {}
                if settings.local_capacity is None:
                    self._early_copies = EarlyCopies(settings.local_dir,
                                                     settings.n_copy_threads)
            return
        item_of = files.item_of()
        if item_of is not None:
            item_of = numpy.asarray(item_of, dtype=numpy.int64)
        if settings.local_dir == MEMORY:
            _check_memory_forms(_first_sources(files, len(settings.dataset)))
        paths = checks.sampled_paths(files, len(settings.dataset))
        root = checks.source_root(paths)
        if settings.local_dir != MEMORY:
            checks.check_apart(settings.local_dir, root)
        self._warn_about_samples(paths)
        self._stage(files, item_of, root, stacklevel=5)

    def _stage(self, files, item_of, root, stacklevel, learned=False):
        """Sets up stage 2 for ``files`` (a store, the located view and the
        loaders' check); warns and leaves staging off if the local side
        cannot be used.  ``learned``: files learned in the first epoch,
        which peers are not asked for (as the warning at set-up said)."""
        settings = self.settings
        try:
            directory = (LocalMemory(self._stop_event)
                         if settings.local_dir == MEMORY
                         else LocalDirectory(settings.local_dir, self._stop_event))
            sources_of = ItemSources(files, item_of)
            try:
                peers = (settings.peers if item_of is None and not learned
                         else None)
                self._store = LocalStore(
                    directory, settings.local_capacity,
                    settings.eviction_policy, sources_of,
                    SourceChecks(settings.recheck_sources,
                                 len(settings.dataset) if item_of is None
                                 else int(item_of.max()) + 1 if len(item_of)
                                 else 0), peers)
                if peers is not None:
                    if peers.server is not None and peers.server.lookup is None:
                        # The first iterator serves (not a copy of it).
                        self._lookup = make_lookup(sources_of,
                                                   directory.local_path)
                        peers.serve(self._lookup)
                    if getattr(peers.holders, '__self__', None) not in (
                            None, settings.order_sampler):
                        self._warn_staging(
                            'the PeerGroup was made with the holders of '
                            'another order sampler than this iterator\'s: '
                            'the nodes it asks did not train on these '
                            'examples, and each file is read from shared '
                            'storage after a refusal.  Make it with '
                            'PeerGroup.join(comm, local_dir, '
                            'sampler.holders) of the sampler given as '
                            'order_sampler (docs/peers.rst)',
                            stacklevel=stacklevel + 1)
                elif settings.peers is not None and not learned:
                    self._warn_staging(
                        '{}: several examples share files, so no peer is '
                        'asked for them (peers copy the files of one example '
                        'at a time; docs/peers.rst)'.format(
                            type(settings.dataset).__name__),
                        stacklevel=stacklevel + 1)
            except BaseException:
                directory.close()
                raise
        except LocalStorageError as error:
            self._warn_staging('{}; reading the dataset from its source '
                               'instead.'.format(error), stacklevel=stacklevel)
            return
        if self._store.limited and item_of is not None:
            # Stages 1-2 run only as far ahead as the room holds the items.
            self._item_bytes = ItemLocalBytes(sources_of)
        self._files = files
        self._item_of = item_of
        self._located_dataset = files.located(directory.locate)
        self._open_check = OpenCheck(
            directory.data_root,
            None if settings.local_dir == MEMORY else directory.locate,
            root, files.by_redirection())

    def _stage_learned(self):
        """At an epoch's end: stages, from now on, the files the loaders saw
        the examples open (a dataset that builds its paths in
        ``get_example``).  The pipeline restarts from the current position
        with loaders that redirect those opens to the copies."""
        learned, self._learned = self._learned, None
        if self._early_copies is not None:
            self._early_copies.close()
        files = LearnedFiles(self.settings.dataset, learned)
        paths = sorted({p for found in learned.values() for p in found})
        root = checks.source_root(paths)
        try:
            checks.check_apart(self.settings.local_dir, root)
        except ValueError as error:
            self._warn_staging('{}; the files {} opens are not staged'.format(
                error, type(self.settings.dataset).__name__), stacklevel=4)
            return
        self._retire_pipeline()
        self._stop_event = threading.Event()  # (the old one stopped it)
        self._stage(files, None, root, stacklevel=4, learned=True)

    def _retire_pipeline(self):
        """Stops the running pipeline, keeping its counters for ``stats``."""
        if self._executor is None:
            return
        counts = self._executor.stats()
        self._executor_finalizer()
        self._executor = None
        self._retired_counts = _added(self._retired_counts, counts)

    def _warn_staging(self, message: str, stacklevel: int) -> None:
        """Issues a :class:`StagingWarning` and keeps it for ``stats``."""
        self._staging_warnings.append(message)
        warnings.warn(message, StagingWarning, stacklevel=stacklevel)

    def _warn_about_samples(self, paths):
        """Warns when a few examples show that staging cannot help."""
        name = type(self.settings.dataset).__name__
        missing = checks.missing_files(paths)
        if missing is not None:
            self._warn_staging(
                '{}: none of the files its examples name exists (e.g. {}), '
                'so nothing can be staged; if the dataset reads other files, '
                'make its example_files name them (docs/staging.rst)'.format(
                    name, missing), stacklevel=5)
        capacity = self.settings.local_capacity
        smallest = checks.smallest_bytes(paths)
        if capacity is not None and smallest is not None and smallest > capacity:
            self._warn_staging(
                'local_capacity={} bytes is smaller than each file of the '
                'examples looked at (the smallest: {} bytes), so every '
                'example will be read from shared storage; give a larger '
                'local_capacity'.format(capacity, smallest), stacklevel=5)

    def _on_finding(self, index: int, finding) -> None:
        """What a loader saw an example open (see ``OpenCheck.check``): warns
        once per kind.  Runs on the pipeline's threads."""
        kind, path = finding
        if kind == open_watch.UNNAMED:
            learned = self._learned
            if learned is not None:
                learned[index] = path
                self._copy_early(path)
            path = path[0]
        if kind in self._warned_findings:
            return
        self._warned_findings.add(kind)
        self._warn_staging(_FINDINGS[kind].format(
            dataset=type(self.settings.dataset).__name__, index=index,
            path=path), stacklevel=2)

    def _copy_early(self, paths) -> None:
        """Starts copying the files an example of the learning epoch opened."""
        if self._early_copies is not None:
            if self._learning_epoch is None:
                self._learning_epoch = self.epoch
            self._early_copies.submit(paths)

    def _copied_in_order(self) -> bool:
        """Whether stage 2 copies the first example's files one at a time, in order.

        Such sources (Parquet row groups) need no slow start of the copy
        window; a dataset is taken to be made of one kind of example.
        """
        if self._files is None:
            return False
        sources = _first_sources(self._files, len(self.settings.dataset))
        return bool(sources) and all(source.copied_one_at_a_time
                                     for source in sources)

    def _start_pipeline(self):
        settings = self.settings
        cache = None
        if settings.next_epoch_cache:
            cache = NextEpochCache(settings.next_epoch_cache_examples,
                                   settings.next_epoch_cache_bytes)
        config = _scheduler.SchedulerConfig(
            batch_size=settings.batch_size, repeat=settings.repeat,
            order_sampler=settings.order_sampler,
            dataset_length=len(settings.dataset),
            epoch_size=self._epoch_size,
            n_processes=settings.n_processes, n_prefetch=settings.n_prefetch,
            n_copy_ahead=settings.n_copy_ahead,
            task_slots=_executor.task_slots(settings.n_processes),
            maxtasksperchild=settings.maxtasksperchild,
            staging=self._store is not None,
            limited=self._store is not None and self._store.limited,
            item_of=self._item_of, example_bytes=settings.shared_mem,
            revalidate_each_epoch=settings.recheck_sources != 'never',
            # Columnar batches: two tasks per loader process, one loading
            # and one queued, so that none idles while its answer travels.
            columnar=settings.columnar, decode_window=2 * settings.n_processes,
            slow_start=not self._copied_in_order(),
            max_bytes_ahead=(None if self._item_bytes is None
                             else settings.local_capacity),
            item_bytes=self._item_bytes)
        self._executor = _executor.Executor(
            settings, _scheduler.Scheduler(config, self._state, cache),
            self._store, self._files, self._located_dataset, self._stop_event,
            self._open_check, _weakly(self._on_finding))
        # Stops the pipeline when this iterator is garbage collected or the
        # interpreter exits, even if finalize() is never called.
        self._executor_finalizer = weakref.finalize(self, self._executor.close)
        try:
            self._executor.start()
        except BaseException:
            self.finalize()
            raise

    def __next__(self):
        if self._finalized:
            raise RuntimeError('the iterator is finalized')
        if self._error is not None:
            raise self._error
        started = time.perf_counter()
        if self._executor is None:
            self._start_pipeline()
        item = self._executor.get(self.settings.dataset_timeout,
                                  self.TimeoutWarning)
        waited = time.perf_counter() - started
        self._consumer_wait_seconds += waited
        self._warn_if_staging_stopped()
        if isinstance(item, _executor.Failure):
            self._error = item.error
            raise item.error
        if isinstance(item, _executor.EndOfData):
            batch, state = None, item.state
        else:
            batch, state = item
        self._previous_epoch_detail = self.epoch_detail
        self._state = state
        if batch is None:
            raise StopIteration
        if self._learned and self.is_new_epoch:
            self._stage_learned()
        if self._first_batch_seconds is None:
            self._first_batch_seconds = waited
        self._batches_delivered += 1
        return batch

    next = __next__

    def _warn_if_staging_stopped(self):
        reason = self._store.disabled if self._store is not None else None
        if reason is not None and not self._warned_local_storage:
            self._warned_local_storage = True
            where = ('memory' if self.settings.local_dir == MEMORY
                     else 'the local directory')
            self._warn_staging('Copying to {} stopped ({}); reading the rest '
                               'from shared storage.'.format(where, reason),
                               stacklevel=4)

    @property
    def stats(self):
        """What the stages did so far, as a dict (``docs/stats.rst`` explains each field).

        Stage 2 (the local store): ``files_copied``, ``bytes_copied`` (read
        from shared storage to make local files), ``local_bytes_written``,
        ``files_already_local`` (hits), ``files_failed_source``,
        ``files_lock_timeouts``, ``copy_seconds`` (summed over copy
        threads), ``local_storage_error`` (why staging stopped, or
        ``None``); with ``local_capacity`` also ``items_bypassed``,
        ``items_too_large``, ``files_evicted``, ``bytes_evicted`` and
        ``local_bytes_used`` (the directory's ledger, all processes).

        Per access (a batch position, batches prefetched included):
        ``examples_staged`` / ``examples_not_staged`` (planned to read local
        copies or the source), and what stage 3 did:
        ``examples_from_local``, ``examples_from_source``,
        ``examples_from_cache`` (the next-epoch cache) and
        ``examples_fallback`` (the local copy had vanished; included in
        ``examples_from_source``).

        ``batches``, ``consumer_wait_seconds`` (time ``next()`` waited),
        ``first_batch_seconds``, ``staging_warnings`` (the messages given),
        ``next_epoch_cache`` (its counters, or ``None`` without it) and
        ``by_epoch`` (per epoch: the examples' sources and the bytes read
        from shared storage by stage 2, ``bytes_copied``, and by stage 3,
        ``bytes_from_source``).  The counters keep their values after
        ``finalize()``.
        """
        values = dict.fromkeys(_STORE_DEFAULTS + SOURCE_OPS, 0)
        values['local_storage_error'] = None
        values['local_bytes_used'] = None
        if self._store is not None:
            values.update(self._store.counters.snapshot())
            values['local_storage_error'] = self._store.disabled
            values['local_bytes_used'] = self._store.bytes_used()
        counts, by_epoch, cache = _added(self._retired_counts, (
            self._final_counts if self._executor is None
            else self._executor.stats()))
        if self._early_copies is not None:
            early = self._early_copies.counters.snapshot()
            for name, value in early.items():
                values[name] += value
            if self._learning_epoch is not None:
                # What the learning epoch's loads opened was unknown to
                # the pipeline, which could not count its bytes.
                epoch = by_epoch.setdefault(self._learning_epoch, {})
                for name, value in (
                        ('bytes_copied', early['bytes_copied']),
                        ('bytes_from_source',
                         self._early_copies.bytes_opened())) + tuple(
                            (name, early[name]) for name in SOURCE_OPS):
                    epoch[name] = epoch.get(name, 0) + value
        for name in _ACCESS_COUNTS:
            values[name] = counts.get(name, 0)
        for name in SOURCE_OPS:  # stages 2-3, and the constructor's checks
            values[name] += counts.get(name, 0) + self._setup_ops[name]
        # An epoch between two counted ones that nothing touched yet (its
        # files all current, none of it loaded) is there with zeros too.
        epochs = range(min(by_epoch), max(by_epoch) + 1) if by_epoch else ()
        values['by_epoch'] = {epoch: {name: by_epoch.get(epoch, {}).get(name, 0)
                                      for name in _EPOCH_COUNTS}
                              for epoch in epochs}
        values['next_epoch_cache'] = cache
        values['peers'] = (None if self.settings.peers is None
                           else self.settings.peers.stats())
        values['batches'] = self._batches_delivered
        values['consumer_wait_seconds'] = self._consumer_wait_seconds
        values['first_batch_seconds'] = self._first_batch_seconds
        values['staging_warnings'] = list(self._staging_warnings)
        return values

    def finalize(self):
        """Stops all threads and worker processes and frees shared memory."""
        if self._finalized:
            return
        self._finalized = True
        if self.__dict__.get('_stop_event') is not None:
            self._stop_event.set()
        if self._executor is not None:
            self._executor_finalizer()  # runs Executor.close once
            # stats() still tells what staging did after trainer.run().
            self._final_counts = self._executor.stats()
            self._executor = None
        if self._store is not None:
            self._store.close()
        if self._early_copies is not None:
            self._early_copies.close()
        if self._lookup is not None:
            peers = self.settings.peers
            if peers.server is not None and peers.server.lookup is self._lookup:
                peers.serve(None)

    def __copy__(self):
        other = PrefetchMultiprocessIterator.__new__(PrefetchMultiprocessIterator)
        other.settings = self.settings.copy_settings()
        other._initialize()
        other.reset()  # draws an order, as a new MultiprocessIterator does
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
        return len(self.settings.dataset) if order is None else len(order)

    def serialize(self, serializer):
        """Saves or restores the position; compatible with Chainer's iterators."""
        current_position = serializer('current_position', self.current_position)
        epoch = serializer('epoch', self.epoch)
        is_new_epoch = serializer('is_new_epoch', self.is_new_epoch)
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        sampler = self.settings.order_sampler
        own_orders = hasattr(sampler, 'order_of_epoch')  # ShuffleAcrossRanks
        order = self._state.order
        if order is not None and loading and own_orders:
            order = _own_order(serializer, sampler, int(epoch),
                               int(current_position))
        elif order is not None:
            order = order.copy()
            try:
                serializer('order', order)
            except KeyError:
                serializer('_order', order)
            if own_orders:
                for key, value in sampler.job().items():
                    serializer['order_sampler'](key, value)
        next_order = self._state.next_order
        if loading:
            # Read into nothing: a state without it (a MultiprocessIterator
            # snapshot, or a partial state read with strict=False) draws it
            # again from the order read, never keeps the one drawn before.
            next_order = None
        elif next_order is not None:
            next_order = next_order.copy()
        try:
            next_order = serializer('next_order', next_order)
        except KeyError:
            next_order = None
        if loading and own_orders:
            next_order = None  # drawn again from this rank's order
        if self.settings.peers is not None:
            _serialize_peer_jobs(serializer, self.settings.peers, loading,
                                 int(epoch))
        self._reset_state(current_position, epoch, is_new_epoch, order,
                          next_order)
        try:
            self._previous_epoch_detail = serializer(
                'previous_epoch_detail', self._previous_epoch_detail)
        except KeyError:
            # Snapshots of older Chainer versions lack it: estimate it.
            self._previous_epoch_detail = self.epoch + (
                self.current_position - self.settings.batch_size
            ) / self._epoch_size
            if self.epoch_detail > 0:
                self._previous_epoch_detail = max(
                    self._previous_epoch_detail, 0.)
            else:
                self._previous_epoch_detail = -1.

    def reset(self):
        """Goes back to the start of epoch 0 with a fresh order (and its successor)."""
        self._check_not_finalized()
        settings = self.settings
        self._set_state(lookahead.initial_state(
            settings.order_sampler, len(settings.dataset), settings.batch_size))
        self._previous_epoch_detail = -1.

    def _reset_state(self, current_position, epoch, is_new_epoch, order,
                     next_order=None):
        self._check_not_finalized()
        self._set_state(lookahead.with_next_order(
            (current_position, epoch, is_new_epoch, order),
            self.settings.order_sampler, self.settings.batch_size, next_order))

    def _check_not_finalized(self):
        if self._finalized:
            raise NotImplementedError(
                'Reset of finalized PrefetchMultiprocessIterator is not '
                'supported.')

    def _set_state(self, state):
        self._state = state
        self._error = None
        if self._executor is not None:
            self._executor.restart(self._state)

    def __getstate__(self):
        state = {'current_position': self.current_position,
                 'epoch': self.epoch, 'is_new_epoch': self.is_new_epoch,
                 'order': self._state.order,
                 'next_order': self._state.next_order,
                 'previous_epoch_detail': self._previous_epoch_detail}
        return {'settings': self.settings, 'state': state}

    def __setstate__(self, pickled):
        self.settings = pickled['settings']
        self._initialize()
        state = pickled['state']
        self._reset_state(state['current_position'], state['epoch'],
                          state['is_new_epoch'], state['order'],
                          state.get('next_order'))
        self._previous_epoch_detail = state['previous_epoch_detail']


_FINDINGS = {
    open_watch.SOURCE_READ: (
        '{dataset}: example {index} read {path} from shared storage although '
        'its local copy was staged: opened in a way the redirection of '
        "Python's open does not reach (os.open, io.FileIO, another thread), "
        'or by a with_file_locations view that still names the source; it '
        'counts in examples_from_source.  Read the file with open(), or '
        'declare example_files and a with_file_locations view that reads '
        'locate(path) (docs/staging.rst)'),
    open_watch.NOT_SEEN: (
        '{dataset}: example {index} opened none of its files ({path}, ...) '
        "through Python's open, so its reads could not be redirected to the "
        'local copies (a C library such as cv2.imread opens files itself); '
        'such examples count in examples_from_source.  Give the dataset '
        'example_files and with_file_locations (docs/staging.rst)'),
    open_watch.UNSTAGED: (
        '{dataset}: example {index} opened {path}, which was not staged for '
        'it: a wrapper that reads another index of its dataset (a slice, a '
        'reordering), or a file that many examples share?  That file is read '
        'from shared storage.  Give the wrapper example_files(i) naming the '
        'files self[i] reads, with example_file_groups for shared files '
        '(docs/staging.rst)'),
    open_watch.UNNAMED: (
        '{dataset} names no files this iterator can find, but example '
        '{index} opened {path}: the files its examples open are learned '
        'in this epoch, which reads them from shared storage (and copies '
        'them meanwhile, without local_capacity); the next epochs read the '
        'copies.  To stage from the start, keep the paths in an '
        'attribute with one entry per example, or give the dataset '
        'example_files and with_file_locations (docs/staging.rst)'),
}

_STORE_DEFAULTS = STORE_COUNTERS
_ACCESS_COUNTS = ('examples_staged', 'examples_not_staged',
                  'examples_from_local', 'examples_from_source',
                  'examples_from_cache', 'examples_fallback')
_EPOCH_COUNTS = ('examples_from_local', 'examples_from_source',
                 'examples_from_cache', 'bytes_from_source', 'bytes_copied'
                 ) + SOURCE_OPS


def _serialize_peer_jobs(serializer, peers, loading: bool, epoch: int):
    """Saves which jobs trained which epochs (``PeerGroup.jobs``), or
    tells the group what a snapshot saved (``PeerGroup.resume``)."""
    child = serializer['peer_jobs']
    if not loading:
        for key, value in peers.jobs().items():
            child(key, value)
        return
    try:
        jobs = {key: child(key, None)
                for key in ('first_epochs', 'sizes', 'places')}
    except KeyError:
        jobs = None  # a snapshot without peers
    if jobs is not None and any(value is None for value in jobs.values()):
        jobs = None  # the same, read with strict=False
    peers.resume(epoch, jobs)


def _own_order(serializer, sampler, epoch: int, position: int):
    """This rank's order of ``epoch`` from its sampler
    (:class:`~chainer_prefetch.ShuffleAcrossRanks`), not the snapshot's:
    every rank may load the snapshot rank 0 wrote.

    Raises:
        ValueError: the snapshot's job drew other orders (another dataset
            size or seed), or was taken inside an epoch of a job with
            another number of ranks (its position means other examples).
    """
    order = sampler.order_of_epoch(epoch)
    mine = sampler.job()
    saved = {}
    for key in mine:
        try:
            value = serializer['order_sampler'](key, None)
        except KeyError:
            value = None
        if value is not None:
            saved[key] = int(value)
    if not saved:  # a snapshot without them: compare the orders' lengths
        try:
            old_order = serializer('order', None)
        except KeyError:
            old_order = None
        if old_order is not None and len(old_order) != len(order):
            saved['size'] = -1  # some other number of ranks
    for key in ('n_examples', 'seed'):
        if key in saved and saved[key] != mine[key]:
            raise ValueError(
                'the snapshot was taken with ShuffleAcrossRanks({}={}), and '
                'this job has {}={}: its orders are other ones'.format(
                    key, saved[key], key, mine[key]))
    if saved.get('size', mine['size']) != mine['size'] and position:
        raise ValueError(
            'the snapshot was taken at position {} of an epoch of a job of '
            'another number of ranks ({}; this one has {}): that position '
            'means other examples here.  Resume with the same number of '
            'ranks, or from a snapshot at position 0 of an epoch (taken when '
            'an epoch ended with a whole batch: batch size dividing '
            'ceil(n_examples / ranks))'.format(
                position, saved['size'] if saved['size'] > 0 else 'unknown',
                mine['size']))
    return order


def _added(first, second):
    """Two ``Executor.stats()`` results as one (the counters summed; the
    next-epoch cache's of the second)."""
    counts = dict(first[0])
    for name, value in second[0].items():
        counts[name] = counts.get(name, 0) + value
    by_epoch = {epoch: dict(values) for epoch, values in first[1].items()}
    for epoch, values in second[1].items():
        merged = by_epoch.setdefault(epoch, {})
        for name, value in values.items():
            merged[name] = merged.get(name, 0) + value
    return counts, by_epoch, second[2] if second[2] is not None else first[2]


def _weakly(method):
    """``method`` called through a weak reference to its object: the
    pipeline's threads must not keep the iterator alive (its garbage
    collection is what stops them when ``finalize()`` is never called)."""
    reference = weakref.WeakMethod(method)

    def call(*args):
        target = reference()
        if target is not None:
            target(*args)
    return call


def _first_sources(files, n_examples: int):
    """The sources of example 0, which stand for every example's kind.

    Args:
        files: The dataset's files.
        n_examples: The dataset's length (none: no sources).
    """
    return [as_source(named) for named in files.files(0)] if n_examples else []


def _check_memory_forms(sources):
    """Raises ``ValueError`` unless the sources can be kept in memory.

    Args:
        sources: Example 0's sources (:func:`_first_sources`).
    """
    unfit = [source for source in sources if not source.has_memory_form]
    if unfit:
        raise ValueError(
            "local_dir={!r} keeps Parquet row groups (ParquetDataset) in "
            'memory; example 0 reads {}, which has no in-memory form: give '
            'a local directory instead'.format(MEMORY, unfit[0]))
