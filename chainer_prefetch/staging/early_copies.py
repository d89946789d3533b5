"""Local copies of files made as soon as an example is seen opening them.

A dataset that builds its paths inside ``get_example`` names no files
before it runs; the loaders report what each example opens, and from the
next epoch on the pipeline stages those files by the known order.  The
copies here are made meanwhile, on a few threads, while the first epoch
reads the sources: the next epoch then finds the local files current and
reads them from its first batch, instead of making every copy itself.

Only without a capacity limit (``local_capacity=None``): with one, what is
kept is the eviction policy's choice, made by the planned pipeline.

A copy that fails on the source side is skipped (the planned pipeline
tries again and reports the example); one that fails on the local side, or
a file inside the local directory's tree or holding it, stops these copies
(the planned pipeline finds the same fault, or refuses the files, and
warns).
"""
import collections
import os
import threading
import time
from typing import Iterable, Optional

from chainer_prefetch.errors import (
    CopyLockTimeout,
    LocalStorageError,
    SourceFileError,
)
from chainer_prefetch.staging.checks import check_apart
from chainer_prefetch.staging.counters import Counters
from chainer_prefetch.staging.local_directory import LocalDirectory
from chainer_prefetch.staging.source_ops import SOURCE_OPS, tallied
from chainer_prefetch.staging.sources import as_source

COUNTERS = ('files_copied', 'bytes_copied', 'files_failed_source',
            'copy_seconds') + SOURCE_OPS


class EarlyCopies:
    """Copies files into a local directory on background threads, each once.

    The threads start with the first :meth:`submit` and end at
    :meth:`close`, which their owner calls (the iterator: when the planned
    pipeline takes over, and at ``finalize()``).

    Args:
        local_dir: The local directory (``LocalDirectory``'s ``root``).
        n_threads: Copies made at once, at most.
    """

    def __init__(self, local_dir: str, n_threads: int):
        self._local_dir = local_dir
        self._n_threads = max(1, n_threads)
        self._cond = threading.Condition()
        self._queue = collections.deque()
        self._opened = collections.Counter()  # path -> examples that opened it
        self._sizes = {}  # path -> its size, once copied
        self._threads = []
        self._closed = False
        self._stop_event = threading.Event()
        self._directory: Optional[LocalDirectory] = None
        self.counters = Counters(COUNTERS)

    def submit(self, paths: Iterable[str]) -> None:
        """Queues the copies of ``paths`` not submitted before.

        Args:
            paths: The files one example opened (counted for
                :meth:`bytes_opened`).
        """
        with self._cond:
            for path in paths:
                if path not in self._opened and not self._closed:
                    try:  # (before the directory is made, once per file)
                        check_apart(self._local_dir, os.path.dirname(path))
                    except ValueError:
                        self._stop()
                    else:
                        self._queue.append(path)
                self._opened[path] += 1
            if self._closed:
                return
            if self._queue and len(self._threads) < self._n_threads:
                self._start_threads()
            self._cond.notify_all()

    def bytes_opened(self) -> int:
        """The bytes the submitted examples read from shared storage: each
        file's size once per example that opened it (files not copied yet
        count 0)."""
        with self._cond:
            return sum(count * self._sizes.get(path, 0)
                       for path, count in self._opened.items())

    def close(self, timeout: float = 30.0) -> None:
        """Drops the copies not started and waits for those being made.

        Args:
            timeout: Seconds to wait for each running copy at most (a copy
                stuck on hung storage is left to end on its own; its thread
                is a daemon).
        """
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._stop_event.set()
        for thread in self._threads:
            thread.join(timeout)
        if self._directory is not None and not any(
                thread.is_alive() for thread in self._threads):
            self._directory.close()

    def _start_threads(self) -> None:
        """Opens the directory and starts the threads (holding ``_cond``)."""
        if self._directory is None:
            try:
                self._directory = LocalDirectory(self._local_dir,
                                                 self._stop_event)
            except LocalStorageError:
                self._stop()
                return
        while len(self._threads) < self._n_threads:
            thread = threading.Thread(
                target=self._run, daemon=True,
                name='cp-early-copy-{}'.format(len(self._threads)))
            thread.start()
            self._threads.append(thread)

    def _stop(self) -> None:
        """Stops copying for good (holding ``_cond``)."""
        self._closed = True
        self._queue.clear()
        self._cond.notify_all()

    def _next_path(self) -> Optional[str]:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            return None if self._closed else self._queue.popleft()

    def _run(self) -> None:
        while True:
            path = self._next_path()
            if path is None:
                return
            started = time.perf_counter()
            try:
                with tallied() as asked:
                    try:
                        source = as_source(path)
                        origin_stat = source.stat_origin()
                        with self._cond:
                            self._sizes[path] = origin_stat.st_size
                        written = self._directory.stage(source, origin_stat)
                    finally:
                        self.counters.add(**asked)
            except SourceFileError:
                self.counters.add(files_failed_source=1)
                continue
            except CopyLockTimeout:
                continue  # another process is making it
            except InterruptedError:
                return
            except LocalStorageError:
                with self._cond:
                    self._stop()
                return
            finally:
                self.counters.add(copy_seconds=time.perf_counter() - started)
            if written:
                self.counters.add(files_copied=1, bytes_copied=written)
