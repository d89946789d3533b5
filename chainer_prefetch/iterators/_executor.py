"""The executor: carries out the scheduler's actions with threads, processes and memory.

Roles (each a small class; the decisions are all in :mod:`._scheduler`)::

    consumer (next())  --Consumed/Reset-->  events  <--Copied--  CopyThreads (stage 2)
          ^                                   |      <--Loaded--  WorkerPool  (stage 3)
          |                                   v
       Mailbox  <--Deliver--  pipeline thread: scheduler.step(event) -> actions,
                              each carried out here (Copy, Load, Hold, Deliver, ...)

* The **pipeline thread** is the only one that touches the scheduler.  It
  takes events from one queue, steps the scheduler (under a lock that only
  guards that pure work, so ``stats`` can read consistent counters), and
  carries out the actions; an action that answers at once (a cancelled copy,
  a failed hold, a delivered batch measured) is fed back before the next
  event.
* **CopyThreads** (:mod:`chainer_prefetch.staging.copy_threads`, with the
  note on how row groups are read ahead) run ``LocalStore.stage`` (stage 2).
* The **WorkerPool** runs the loader processes (stage 3), or
  **LoaderThreads** the loader threads (``loader_threads``).
* **SharedBuffers**: anonymous shared memory (``memfd``), passed to the
  loader processes as descriptors; it has no name in ``/dev/shm``, so it
  does not depend on that file system's size and nothing is left behind
  when the processes are killed.
* The **Mailbox** holds delivered batches for ``next()``.

Shutdown (:meth:`Executor.close`) has one deadline for everything: the
pipeline thread, the copy threads (daemon threads: one stuck in a hung read
of shared storage is abandoned, never waited for past the deadline), the
loader processes (terminated, then killed) and the buffers.  Nothing that can
block on I/O ever runs under a lock that ``next()`` takes.
"""
import collections
import copy
import dataclasses
import functools
import mmap
import os
import queue
import threading
import time
import warnings
import weakref
from typing import Any, Optional, Sequence

import numpy

from chainer_prefetch.errors import ExampleLoadError, WorkerDiedError, example_load_error
from chainer_prefetch.iterators import _columnar_worker, _worker
from chainer_prefetch.iterators import _scheduler as s
from chainer_prefetch.iterators._loader_threads import LoaderThreads
from chainer_prefetch.iterators._worker_pool import TASKS_PER_WORKER, WorkerPool
from chainer_prefetch.staging import source_ops
from chainer_prefetch.staging.copy_threads import CopyThreads
from chainer_prefetch.staging.dataset_files import resolve_dataset_files
from chainer_prefetch.staging.sources import Source, as_source

#: Seconds the whole shutdown may take.
STOP_SECONDS = 5.0
_WAIT_SECONDS = 0.05

_live_executors = weakref.WeakSet()


def _close_live_executors():
    for executor in list(_live_executors):
        executor.close()


# Runs at interpreter exit (e.g. after Ctrl-C) before Python waits for
# threads and children; forked loader processes run it too, and close()
# acts only in the process that owns the executor.
threading._register_atexit(_close_live_executors)


class EndOfData:
    """Delivered when ``repeat=False`` and the epoch is over (StopIteration)."""

    def __init__(self, state):
        self.state = state


class Failure:
    """Delivered in place of a batch that failed; ``next()`` raises ``error``."""

    def __init__(self, error: BaseException):
        self.error = error


@dataclasses.dataclass(frozen=True)
class _Crashed:
    """A thread of the executor failed: the error reaches ``next()``."""

    error: BaseException


class Mailbox:
    """Delivered items, from the pipeline thread to the consumer.

    Items are tagged with the consumer's *generation*, which a reset
    increments: an item of an earlier generation is dropped, never delivered.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._items = collections.deque()
        self.generation = 0

    def put(self, item, generation: int):
        """Called from the pipeline thread."""
        with self._cond:
            if generation == self.generation:
                self._items.append(item)
                self._cond.notify_all()

    def get(self, dataset_timeout, timeout_warning, alive) -> Any:
        """Waits for the next item; ``EndOfData`` stays (it repeats, as StopIteration does).

        Args:
            dataset_timeout (float or None): Warn after waiting this long.
            timeout_warning (type): The warning class to issue.
            alive (callable): Whether the pipeline thread still runs.

        Returns:
            ``(batch, state)``, ``EndOfData`` or ``Failure``, and whether an
            item was taken (``EndOfData`` is not).
        """
        started = time.perf_counter()
        warned = False
        with self._cond:
            while not self._items:
                if not alive():
                    raise RuntimeError('the prefetch pipeline thread stopped')
                self._cond.wait(_WAIT_SECONDS)
                waited = time.perf_counter() - started
                if (dataset_timeout is not None and not warned
                        and waited > dataset_timeout):
                    warned = True
                    warnings.warn(
                        'Stalled dataset is detected: no batch for {:.1f} s. '
                        'Slow shared storage, a hung file system or a slow '
                        'get_example are common causes.'.format(waited),
                        timeout_warning)
            item = self._items[0]
            if isinstance(item, EndOfData):
                return item, False
            self._items.popleft()
            return item, True

    def restart(self) -> int:
        """Drops everything delivered; returns the new generation (consumer side)."""
        with self._cond:
            self.generation += 1
            self._items.clear()
            return self.generation


class SharedBuffers:
    """Anonymous shared memory for batches (``memfd``), one buffer per batch.

    A delivered batch's arrays are views of its buffer when it is handed
    over; a finalizer on the memory the views share reports when the
    consumer has dropped them all.

    Args:
        pool: The loader processes to share the buffers with.
        post: Where :class:`~._scheduler.BufferReleased` events go.
    """

    def __init__(self, pool: WorkerPool, post):
        self._pool = pool
        self._post = post
        self._maps = {}  # id -> mmap
        self._slot_bytes = {}  # id -> bytes per example

    def allocate(self, buffer: int, example_bytes: int, batch_size: int
                 ) -> Optional[str]:
        """Allocates ``buffer``; returns why not (``None`` if allocated).

        Refused when it would take more than half of the memory available
        now (its pages are touched only as examples are written, and running
        out then would bring the out-of-memory killer).
        """
        size = example_bytes * batch_size
        available = available_memory()
        if available is not None and size > available // 2:
            return ('{} bytes of shared memory is more than half of the {} '
                    'bytes available'.format(size, available))
        fd = None
        try:
            fd = os.memfd_create('chainer_prefetch-batch', os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            self._maps[buffer] = mmap.mmap(fd, size)
            self._pool.share_fd(buffer, fd)
        except (OSError, AttributeError) as error:
            self._maps.pop(buffer, None)
            return '{} bytes of shared memory: {}'.format(
                size, getattr(error, 'strerror', None) or error)
        finally:
            if fd is not None:
                os.close(fd)
        self._slot_bytes[buffer] = example_bytes
        return None

    def slot_bytes(self, buffer: Optional[int]) -> int:
        """Bytes per example of ``buffer`` (0 if it does not exist)."""
        return self._slot_bytes.get(buffer, 0)

    def unpack(self, buffer: Optional[int], examples, hand_over: bool) -> list:
        """The examples with their arrays read from ``buffer``.

        With ``hand_over`` the arrays are views of the buffer, and
        ``BufferReleased`` is posted once they are all gone; otherwise they
        are copies and the buffer is free at once.
        """
        base = self._base(buffer, hand_over)
        if base is None:
            return examples
        return [_worker.unpack(example, base, copy=not hand_over)
                for example in examples]

    def unpack_columns(self, buffer: Optional[int], packed, hand_over: bool):
        """A columnar batch with its columns read from ``buffer`` (see :meth:`unpack`)."""
        base = self._base(buffer, hand_over)
        if base is None:
            return packed
        return _columnar_worker.unpack_columns(packed, base, copy=not hand_over)

    def _base(self, buffer: Optional[int], hand_over: bool
              ) -> Optional[numpy.ndarray]:
        """The bytes of ``buffer`` (None: not mapped); with ``hand_over``,
        ``BufferReleased`` is posted once every view of them is gone."""
        memory = self._maps.get(buffer)
        if memory is None:
            return None
        base = numpy.frombuffer(memory, numpy.uint8)
        if hand_over:
            weakref.finalize(base, self._post, s.BufferReleased(buffer))
        return base

    def free(self, buffer: int):
        """Unmaps ``buffer`` here and in the loader processes."""
        memory = self._maps.pop(buffer, None)
        self._slot_bytes.pop(buffer, None)
        if memory is not None:
            self._pool.unshare_fd(buffer)
            _close_map(memory)

    def close(self):
        for buffer in list(self._maps):
            _close_map(self._maps.pop(buffer))
        self._slot_bytes.clear()


def _close_map(memory):
    try:
        memory.close()
    except BufferError:
        pass  # arrays of a delivered batch still view it: freed with them


def available_memory() -> Optional[int]:
    """Bytes of memory available now: the system's, or the cgroup's if smaller."""
    found = []
    try:
        with open('/proc/meminfo') as meminfo:
            for line in meminfo:
                if line.startswith('MemAvailable:'):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        with open('/sys/fs/cgroup/memory.max') as limit, \
                open('/sys/fs/cgroup/memory.current') as current:
            found.append(int(limit.read()) - int(current.read()))
    except (OSError, ValueError):  # no cgroup v2 limit ('max')
        pass
    return min(found) if found else None


class Executor:
    """Runs the pipeline of one iterator; see the module docstring.

    Args:
        settings: The iterator's ``IteratorSettings``.
        scheduler: The scheduler to drive.
        store: The ``LocalStore``, or ``None`` without staging.
        dataset_files: The dataset's files (``None`` without staging).
        located_dataset: The view reading local copies, or ``None``.
        stop_event: Set on close (interrupts waits for other processes' copies).
        open_check: Judges the files each example opens in the loaders
            (``OpenCheck``), or ``None``.
        on_finding: ``on_finding(index, (kind, path))`` for what a loader saw
            an example open (called on the pool's collector thread).
    """

    def __init__(self, settings, scheduler: s.Scheduler, store, dataset_files,
                 located_dataset, stop_event: threading.Event,
                 open_check=None, on_finding=None):
        self._settings = settings
        self._scheduler = scheduler
        self._store = store
        self._files = dataset_files
        # The files named in load errors: the staged ones, or, without
        # staging, those the dataset reads, looked up on the first error.
        self._named_files = dataset_files
        self._located_dataset = located_dataset
        self._stop_event = stop_event
        self._open_check = open_check
        self._on_finding = on_finding
        self.mailbox = Mailbox()
        self._events = queue.SimpleQueue()
        self._step_lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._closed = False
        self._thread = None
        self._copies = None
        self._pool = None
        # What a load task calls: Loader methods, or their worker-process entries.
        self._load_examples = self._load_columns_of = None
        self._buffers = None
        self.pickled_examples = 0  # arrays that did not fit the buffers

    # ---- life cycle -----------------------------------------------------------

    def start(self):
        """Starts the loader processes first (no thread of ours exists yet), then threads."""
        settings = self._settings
        local_root = (None if self._store is None
                      else self._store.directory.data_root)
        views = (settings.dataset, self._located_dataset, local_root,
                 self._files, self._open_check)
        if settings.loader_threads:
            loader = _worker.Loader(*views)
            self._pool = LoaderThreads(settings.n_processes)
            self._load_examples = loader.load_examples
            self._load_columns_of = functools.partial(
                _columnar_worker.load_columns_with, loader)
        else:
            self._pool = WorkerPool(settings.n_processes,
                                    _worker.initialize_worker, views,
                                    settings.maxtasksperchild)
            self._load_examples = _worker.load_examples
            self._load_columns_of = _columnar_worker.load_columns
        self._buffers = SharedBuffers(self._pool, self._events.put)
        if self._store is not None:
            self._copies = CopyThreads(
                settings.n_copy_threads, self._copy, self._events.put,
                lambda error: self._events.put(_Crashed(error)),
                lambda action, sources: self._store.needs_copy(
                    sources, action.item, action.check_epoch))
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name='chainer_prefetch-pipeline')
        _live_executors.add(self)
        self._events.put(s.Start())
        self._thread.start()

    def close(self, deadline: Optional[float] = None):
        """Stops every thread and process and frees the buffers, by one deadline.

        Idempotent, and a no-op in any process but the owner (a forked child
        holds a copy of this object).
        """
        if os.getpid() != self._owner_pid or self._closed:
            return
        self._closed = True
        if deadline is None:
            deadline = time.monotonic() + STOP_SECONDS
        self._stop_event.set()
        self._events.put(None)
        current = threading.current_thread()
        if self._copies is not None:
            self._copies.stop()
        threads = ([self._thread] if self._thread is not None else []) + (
            self._copies.threads if self._copies is not None else [])
        for thread in threads:
            if thread is not current:
                thread.join(max(0.0, deadline - time.monotonic()))
        if self._pool is not None:
            self._pool.close(deadline)
        self.mailbox.restart()  # batches nobody took: their buffers go now
        while not self._events.empty():
            self._events.get_nowait()
        if self._buffers is not None:
            self._buffers.close()

    # ---- consumer side ---------------------------------------------------------

    def get(self, dataset_timeout, timeout_warning):
        """The next delivered item (see :meth:`Mailbox.get`)."""
        item, taken = self.mailbox.get(dataset_timeout, timeout_warning,
                                       self._thread.is_alive)
        if taken:
            self._events.put(s.Consumed(self.mailbox.generation))
        return item

    def restart(self, state):
        """Discards everything in flight and continues from ``state``.

        A loader pool broken by a dead worker gets fresh workers.
        """
        generation = self.mailbox.restart()
        if self._pool is not None:
            self._pool.revive()
        self._events.put(s.Reset(state, generation))

    def stats(self) -> tuple:
        """Copies of the scheduler's counters: ``(counts, by_epoch, cache)``.

        ``cache`` is the next-epoch cache's counters with ``held_bytes``, or
        ``None`` without the cache.
        """
        with self._step_lock:
            cache = self._scheduler.cache
            return (*self._scheduler.counts.snapshot(),
                    None if cache is None else dict(
                        cache.counters, held_bytes=cache.held_bytes))

    # ---- the pipeline thread -----------------------------------------------------

    def _run(self):
        try:
            while True:
                event = self._events.get()
                if event is None:
                    return
                if isinstance(event, _Crashed):
                    raise event.error
                pending = collections.deque([event])
                while pending:
                    with self._step_lock:
                        actions = self._scheduler.step(pending.popleft())
                    for action in actions:
                        pending.extend(self._execute(action))
        except BaseException as error:  # a bug must reach next(), not hang it
            if not self._closed:
                self.mailbox.put(Failure(error), self.mailbox.generation)

    def _execute(self, action) -> list:
        """Carries out one action; returns the events it answers at once."""
        kind = type(action)
        if kind is s.Load:
            self._load(action)
        elif kind is s.LoadColumns:
            self._load_columns(action)
        elif kind is s.Copy:
            self._copies.submit(action, [as_source(named) for named in
                                         self._files.files(action.index)])
        elif kind is s.Used:
            self._store.used(action.item, action.access, action.next_use)
        elif kind is s.Hold:
            kept, lost = [], []
            for position, item, access in action.entries:
                (kept if self._store.hold(item, access) else lost).append(
                    (position, item))
            return [s.Held(action.batch_id, tuple(kept), tuple(lost))]
        elif issubclass(kind, s.Deliver):
            return self._deliver(action)
        elif kind is s.CancelCopies:
            cancelled = self._copies.cancel(action.copy_ids)
            if cancelled:
                return [s.CopiesCancelled(cancelled)]
        elif kind is s.AllocateBuffer:
            return [self._allocate(action)]
        elif kind is s.FreeBuffer:
            self._buffers.free(action.buffer)
        elif kind is s.ForgetNextUses:
            self._store.forget_next_uses()
        else:
            raise TypeError('unknown action {!r}'.format(action))
        return []

    def _copy(self, action: s.Copy, sources: Sequence[Source],
              asked_ahead: Optional[dict] = None) -> s.Copied:
        """On a copy thread: stages one item (its files are ``sources``).

        Args:
            action: The scheduler's copy.
            sources: The item's files.
            asked_ahead: What reading them ahead asked of shared storage.
        """
        with source_ops.tallied() as asked:
            result = self._store.stage(action.item, sources, action.access,
                                       action.check_epoch, action.epoch)
        asked.update(asked_ahead or {})
        return s.Copied(action.copy_id, action.item, result.staged,
                        result.bytes_read, result.evicted, action.epoch,
                        dict(asked))

    def _load(self, action: s.Load):
        slot_bytes = self._buffers.slot_bytes(action.buffer)
        buffer = action.buffer if slot_bytes else None
        try:
            self._pool.submit(
                action.task_id, self._load_examples,
                (action.entries, buffer, slot_bytes),
                self._loaded_callback(action))
        except RuntimeError:  # closed while shutting down
            pass

    def _loaded_callback(self, action: s.Load):
        def on_done(task_id, ok, value):
            """On the worker pool's collector thread: turns answers into an event."""
            if not ok:
                value = [(None, value, None)]
            results = []
            for (position, index, _), answer in zip(action.entries, value):
                read_from, example, detail = answer[:3]
                if read_from is None:
                    results.append(s.LoadFailure(self._load_error(
                        index, example, detail)))
                    break
                results.append(s.LoadResult(example, read_from, detail,
                                            answer[3], answer[5]))
                if answer[4] is not None and self._on_finding is not None:
                    self._on_finding(index, answer[4])
            self._events.put(s.Loaded(task_id, tuple(results)))
        return on_done

    def _load_columns(self, action: s.LoadColumns):
        buffer = action.buffer if self._buffers.slot_bytes(action.buffer) else None

        def on_done(task_id, ok, value):
            """On the worker pool's collector thread: turns the answer into an event."""
            if not ok:
                value = (None, value, None, int(action.indices[0]))
            read_from, batch, detail, last = value[:4]
            if read_from is None and isinstance(batch, ExampleLoadError):
                # named by the dataset already (the row, or a batch transform)
                result = s.LoadFailure(example_load_error(
                    batch, batch.index, batch.files, detail))
            elif read_from is None:
                result = s.LoadFailure(self._load_error(last, batch, detail))
            else:
                result = s.LoadResult(batch, read_from, detail, last, value[4])
            self._events.put(s.ColumnsLoaded(task_id, result))

        try:
            self._pool.submit(action.task_id, self._load_columns_of,
                              (action.indices, action.local, buffer), on_done)
        except RuntimeError:  # closed while shutting down
            pass

    def _load_error(self, index, error, remote_traceback):
        files = ()
        try:
            if self._named_files is None:
                self._named_files = resolve_dataset_files(self._settings.dataset)
            if self._named_files is not None:
                files = tuple(as_source(named).describe()
                              for named in self._named_files.files(index))
        except Exception:  # (the error is reported without them)
            pass
        if isinstance(error, WorkerDiedError):
            return WorkerDiedError(
                'example {} (files: {}) could not be loaded: a loader process '
                'died (killed, or out of memory?): {}'.format(
                    index, ', '.join(files) or 'none known', error))
        return example_load_error(error, index, files, remote_traceback)

    def _allocate(self, action: s.AllocateBuffer) -> s.BufferAllocated:
        problem = self._buffers.allocate(action.buffer, action.example_bytes,
                                         self._settings.batch_size)
        if problem is None:
            return s.BufferAllocated(action.buffer, True)
        warnings.warn('Shared memory for the loader processes is not available '
                      '({}); examples travel by pickling instead, which is '
                      'slower. Set shared_mem smaller, or free memory.'
                      .format(problem), RuntimeWarning)
        return s.BufferAllocated(action.buffer, False)

    def _deliver(self, action: s.Deliver) -> list:
        generation = action.generation
        if isinstance(action, s.DeliverEnd):
            self.mailbox.put(EndOfData(action.state), generation)
            return []
        if isinstance(action, s.DeliverFailure):
            self.mailbox.put(Failure(action.error), generation)
            return []
        if isinstance(action, s.DeliverColumns):
            batch = self._buffers.unpack_columns(
                action.buffer, action.columns, action.hand_over)
            self.mailbox.put((batch, action.state), generation)
            if action.measure:  # bytes per row, with room for larger rows
                return [s.Measured(-(-_columnar_worker.packed_bytes(batch) * 5
                                     // 4 // max(1, len(batch))))]
            return []
        examples = self._buffers.unpack(action.buffer, action.examples,
                                        action.hand_over)
        self.mailbox.put((examples, action.state), generation)
        answers = []
        if action.measure:
            answers.append(s.Measured(max(
                (_worker.slot_bytes(example) for example in examples),
                default=0)))
        if action.cache_wants:
            answers.append(s.CacheOffers(tuple(
                (index, epoch, copy.deepcopy(examples[position]),
                 _worker.example_bytes(examples[position]))
                for position, index, epoch in action.cache_wants)))
        return answers


def task_slots(n_processes: int) -> int:
    """Load tasks the loader processes hold at once."""
    return n_processes * TASKS_PER_WORKER
