"""Stage 2 for one example: put every file it reads into the local directory."""
import os
import stat
import threading
import time
from typing import Optional

from chainer_prefetch.staging.dataset_files import DatasetFiles
from chainer_prefetch.staging.local_directory import (LocalDirectory,
                                                       LocalStorageError,
                                                       SourceFileError)


class StagingCounters:
    """What stage 2 did; read a consistent copy with :meth:`snapshot`."""

    FIELDS = ('files_copied', 'bytes_copied', 'files_already_local',
              'files_failed_source', 'examples_staged',
              'examples_not_staged', 'copy_seconds')

    def __init__(self):
        self._lock = threading.Lock()
        for name in self.FIELDS:
            setattr(self, name, 0)
        self.local_storage_error: Optional[str] = None

    def add(self, **amounts):
        """Adds to counters, e.g. ``add(files_copied=1, bytes_copied=n)``."""
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict:
        """The counters as a dict."""
        with self._lock:
            values = {name: getattr(self, name) for name in self.FIELDS}
        values['local_storage_error'] = self.local_storage_error
        return values


class ExampleStager:
    """Copies the files of examples into a :class:`LocalDirectory`.

    Called from the copy threads.  A file verified once (size and mtime equal
    to the source's) is later checked only locally, so later epochs cost one
    local ``lstat`` per file and no request to shared storage.

    When the local side fails (full disk, no permission) staging stops for
    the rest of the run and ``counters.local_storage_error`` says why: the
    examples are then read from shared storage, never from a partial copy.

    Args:
        files: The files of the dataset, from ``resolve_dataset_files``.
        directory: Where the copies go.
        counters: Where to count.
    """

    def __init__(self, files: DatasetFiles, directory: LocalDirectory,
                 counters: StagingCounters):
        self._files = files
        self._directory = directory
        self._counters = counters
        self._verified = set()
        self._verified_lock = threading.Lock()

    @property
    def disabled(self) -> bool:
        """Whether a local-storage failure stopped staging."""
        return self._counters.local_storage_error is not None

    def files(self, index: int):
        """The source files of example ``index``."""
        return self._files.files(index)

    def stage(self, index: int) -> bool:
        """Stages example ``index``.

        Returns:
            ``True`` when every file of the example has a valid local copy,
            so the example may be read through the located view.
        """
        started = time.perf_counter()
        staged = all(self._stage_file(source)
                     for source in self._files.files(index))
        self._counters.add(examples_staged=int(staged),
                           examples_not_staged=int(not staged),
                           copy_seconds=time.perf_counter() - started)
        return staged

    def _stage_file(self, source: str) -> bool:
        if source in self._verified and self._still_local(source):
            self._counters.add(files_already_local=1)
            return True
        if self.disabled:
            return False
        try:
            copied = self._directory.stage(source)
        except SourceFileError:
            # Stage 3 reads the source itself and reports the error with the
            # example's index; a transient failure may even succeed there.
            self._counters.add(files_failed_source=1)
            return False
        except LocalStorageError as error:
            if self._counters.local_storage_error is None:
                self._counters.local_storage_error = str(error)
            return False
        except InterruptedError:
            return False
        if copied:
            self._counters.add(files_copied=1, bytes_copied=copied)
        else:
            self._counters.add(files_already_local=1)
        with self._verified_lock:
            self._verified.add(source)
        return True

    def _still_local(self, source: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self._directory.local_path(source)).st_mode)
        except OSError:
            with self._verified_lock:
                self._verified.discard(source)
            return False
