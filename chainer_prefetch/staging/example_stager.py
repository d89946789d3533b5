"""Stage 2 for one example: put every file it reads into the local directory."""
import concurrent.futures
import os
import stat
import threading
import time
from typing import Dict, Optional, Tuple

from chainer_prefetch.staging.capacity import CapacityLedger
from chainer_prefetch.staging.dataset_files import DatasetFiles
from chainer_prefetch.staging.derived_files import DerivedFile
from chainer_prefetch.staging.eviction import ResidentSet, check_capacity
from chainer_prefetch.staging.local_directory import (LocalDirectory,
                                                       LocalStorageError,
                                                       SourceFileError,
                                                       stat_source)

#: How long a copy seen locally is trusted without another ``lstat``.
_RECHECK_SECONDS = 1.0


class StagingCounters:
    """What stage 2 did; read a consistent copy with :meth:`snapshot`."""

    FIELDS = ('files_copied', 'bytes_copied', 'files_already_local',
              'files_failed_source', 'examples_staged',
              'examples_not_staged', 'examples_bypassed', 'files_evicted',
              'bytes_evicted', 'copy_seconds')

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

    With a capacity limit, every copy first reserves its bytes in the
    directory's :class:`~chainer_prefetch.staging.capacity.CapacityLedger`
    (shared with every process using the directory).  When the budget is
    full, the eviction policy (a
    :class:`~chainer_prefetch.staging.eviction.ResidentSet`) names an example
    of this stager's to drop.  With ``'belady'`` it is the one needed
    farthest in the future, and the newcomer, needed within the copy-ahead
    window, is always copied in (look-ahead copying: Belady's rule for a
    store every read goes through), so stage 3 reads locally; once loaded,
    the newcomer is ranked by its next use, and is the next to go if that is
    the farthest.  Nothing is dropped when every stored example is waiting
    for a use sooner than the newcomer's; the newcomer then stays on shared
    storage and stage 3 reads it there, as it does for every example with
    ``'fill_once'`` once the store is full.  An example is ranked by the
    access it is staged for until stage 3 has loaded it (:meth:`loaded`), so
    it is not dropped for a later-needed one between its copy and its use.

    Args:
        files: The files of the dataset, from ``resolve_dataset_files``.
        directory: Where the copies go.
        counters: Where to count.
        capacity_bytes: Limit of the bytes under ``directory``, or ``None``.
        eviction_policy: ``'belady'``, ``'lru'`` or ``'fill_once'``.
        n_examples: Examples in the dataset (their files are sized when a
            limit is given).
        n_stat_threads: Threads that read the sizes of the dataset's files
            when a limit is given.

    Raises:
        ValueError: ``capacity_bytes`` is smaller than the dataset's largest
            file, or the policy is unknown.
        SourceFileError: a file's size cannot be read (with a limit).
    """

    def __init__(self, files: DatasetFiles, directory: LocalDirectory,
                 counters: StagingCounters,
                 capacity_bytes: Optional[int] = None,
                 eviction_policy: str = 'belady', n_examples: int = 0,
                 n_stat_threads: int = 16):
        self._files = files
        self._directory = directory
        self._counters = counters
        self._verified: Dict[str, float] = {}  # source -> when last seen local
        self._verified_lock = threading.Lock()
        self._source_sizes: Dict[str, int] = {}
        self._ledger = None
        self._resident = None
        self._policy_lock = threading.Lock()
        if capacity_bytes is not None:
            self._resident = ResidentSet(eviction_policy)
            self._read_source_sizes(n_examples, n_stat_threads)
            check_capacity(capacity_bytes,
                           max(self._source_sizes.values(), default=0))
            self._ledger = CapacityLedger(directory.root, directory.data_root,
                                          capacity_bytes)

    @property
    def limited(self) -> bool:
        """Whether a capacity limit applies."""
        return self._ledger is not None

    def local_bytes_used(self) -> Optional[int]:
        """Bytes the capacity ledger counts (every process), or ``None`` without a limit."""
        if self._ledger is None:
            return None
        return self._ledger.used_bytes()

    def close(self):
        """Lets go of the capacity ledger (the copies stay)."""
        if self._ledger is not None:
            self._ledger.close()

    def example_bytes(self, index: int) -> int:
        """Bytes of the source files of example ``index`` (0 if unknown)."""
        total = 0
        for source in self._files.files(index):
            size = self._source_sizes.get(source)
            if size is None:
                try:
                    size = os.stat(source).st_size
                except OSError:
                    size = 0
                self._source_sizes[source] = size
            total += size
        return total

    @property
    def disabled(self) -> bool:
        """Whether a local-storage failure stopped staging."""
        return self._counters.local_storage_error is not None

    def files(self, index: int):
        """The source files of example ``index``."""
        return self._files.files(index)

    def stage(self, index: int, now: float = 0) -> Tuple[bool, int]:
        """Stages example ``index`` for its access number ``now``.

        Args:
            index: The example.
            now: The number of the access it is staged for (see
                :class:`~chainer_prefetch.staging.eviction.FutureUses`).

        Returns:
            ``(staged, bytes_copied)``: ``staged`` is ``True`` when every file
            of the example has a valid local copy, so the example may be read
            through the located view; ``bytes_copied`` is what this call
            read from shared storage.
        """
        started = time.perf_counter()
        if self._ledger is None:
            copied = [self._stage_file(source)
                      for source in self._files.files(index)]
            staged = None not in copied
            copied = sum(size for size in copied if size)
        else:
            staged, copied = self._stage_within_budget(index, now)
        self._counters.add(examples_staged=int(staged),
                           examples_not_staged=int(not staged),
                           copy_seconds=time.perf_counter() - started)
        return staged, copied

    def stage_if_local(self, index: int, now: float = 0) -> bool:
        """Stages example ``index`` at once if its files are known local copies.

        The cheap path for later epochs and for many examples in one file:
        a set lookup and one local ``lstat`` per file, no thread hand-off.

        Returns:
            ``True`` if staged (as :meth:`stage` would, copying nothing);
            ``False`` when :meth:`stage` has to run.
        """
        sources = self._files.files(index)
        if not all(self._known_local(source)
                   for source in sources):
            return False
        self._counters.add(files_already_local=len(sources), examples_staged=1)
        if self._resident is not None:
            with self._policy_lock:
                self._resident.hold(index, now)  # until stage 3 loaded it
        return True

    def loaded(self, index: int, now: float, next_use: float):
        """Stage 3 loaded example ``index`` for access ``now``; next use ``next_use``."""
        if self._resident is None:
            return
        with self._policy_lock:
            if index in self._resident:
                self._resident.use(index, now, next_use)

    def forget_next_uses(self):
        """The order was reset: every stored example's next use is unknown now."""
        if self._resident is not None:
            with self._policy_lock:
                self._resident.forget_next_uses()

    def _stage_within_budget(self, index, now) -> Tuple[bool, int]:
        sources = self._files.files(index)
        try:
            missing = self._without_valid_copy(sources)
        except SourceFileError:
            self._counters.add(files_failed_source=1)
            return False, 0  # stage 3 reads the source and reports it
        if not missing:
            self._counters.add(files_already_local=len(sources))
            with self._policy_lock:
                self._resident.hold(index, now)  # until stage 3 loaded it
            return True, 0
        if self.disabled:
            return False, 0
        needed = sum(source_stat.st_size for source_stat in missing.values())
        if not self._make_room(index, needed, now):
            self._counters.add(examples_bypassed=1)
            return False, 0
        self._counters.add(files_already_local=len(sources) - len(missing))
        reserved = needed
        total_copied = 0
        for source, source_stat in missing.items():
            size = source_stat.st_size
            copied = self._stage_file(source, source_stat)
            if copied is None:
                self._ledger.release(reserved)
                with self._policy_lock:
                    self._drop(index)
                return False, total_copied
            if not copied:
                self._ledger.release(size)  # another process made this copy
            reserved -= size
            total_copied += copied
        return True, total_copied

    def _without_valid_copy(self, sources) -> Dict[str, os.stat_result]:
        """The sources with no valid copy (copies made earlier count), with their stat.

        Raises:
            SourceFileError: a source cannot be read.
        """
        missing = {}
        for source in sources:
            if self._known_local(source):
                continue
            source_stat = stat_source(source)
            if self._directory.is_valid(source, source_stat):
                self._mark_verified(source)
            else:
                missing[source] = source_stat
        return missing

    def _make_room(self, index, needed, now) -> bool:
        """Reserves ``needed`` bytes, evicting by the policy; False to bypass."""
        with self._policy_lock:
            while not self._ledger.reserve(needed):
                victim = self._resident.victim(now)
                if victim is None:
                    return False
                self._drop(victim)
            self._resident.hold(index, now)  # until stage 3 loaded it
            return True

    def _drop(self, index):
        """Removes the copies of example ``index`` and returns their bytes."""
        self._resident.remove(index)
        for source in self._files.files(index):
            with self._verified_lock:
                self._verified.pop(source, None)
            freed = self._directory.evict(source)
            if freed:
                self._ledger.release(freed)
                self._counters.add(files_evicted=1, bytes_evicted=freed)

    def _read_source_sizes(self, n_examples, n_threads):
        sources = sorted({source for index in range(n_examples)
                          for source in self._files.files(index)})
        derived = [source for source in sources
                   if isinstance(source, DerivedFile)]
        if derived:
            raise ValueError(
                'local_capacity needs the size of every local copy in '
                'advance, which derived files such as {} (a Parquet row '
                'group) do not have; bound their local files with the '
                "dataset's own option (ParquetDataset's local_row_groups) "
                'instead'.format(derived[0]))
        with concurrent.futures.ThreadPoolExecutor(n_threads) as pool:
            for source, info in zip(sources, pool.map(stat_source, sources)):
                self._source_sizes[source] = info.st_size

    def _stage_file(self, source: str,
                    source_stat: Optional[os.stat_result] = None
                    ) -> Optional[int]:
        """Copies one file; returns the bytes copied (0: was local), None on failure."""
        if self._known_local(source):
            self._counters.add(files_already_local=1)
            return 0
        if self.disabled:
            return None
        try:
            copied = self._directory.stage(source, source_stat)
        except SourceFileError:
            # Stage 3 reads the source itself and reports the error with the
            # example's index; a transient failure may even succeed there.
            self._counters.add(files_failed_source=1)
            return None
        except LocalStorageError as error:
            if self._counters.local_storage_error is None:
                self._counters.local_storage_error = str(error)
            return None
        except InterruptedError:
            return None
        if copied:
            self._counters.add(files_copied=1, bytes_copied=copied)
        else:
            self._counters.add(files_already_local=1)
        self._mark_verified(source)
        return copied

    def _known_local(self, source: str) -> bool:
        """Whether ``source`` was verified and its copy is still there.

        A copy seen within the last ``_RECHECK_SECONDS`` is not looked at
        again: many examples in one file (rows of a row group) would
        otherwise cost an ``lstat`` each.  A copy that vanished meanwhile
        (evicted by another process) is read from the source by stage 3.
        """
        seen = self._verified.get(source)
        if seen is None:
            return False
        now = time.monotonic()
        if now - seen < _RECHECK_SECONDS:
            return True
        try:
            local = stat.S_ISREG(
                os.lstat(self._directory.local_path(source)).st_mode)
        except OSError:
            local = False
        with self._verified_lock:
            if local:
                self._verified[source] = now
            else:
                self._verified.pop(source, None)
        return local

    def _mark_verified(self, source: str):
        with self._verified_lock:
            self._verified[source] = time.monotonic()
