"""The local store: a local directory, its byte budget and the policy that keeps it.

Stage 2 asks the store to *stage an item*: make a current local form of each
of its sources (the files of one example, or one Parquet row group shared by
many examples).  The store owns everything about the local side:

* the :class:`~chainer_prefetch.staging.local_directory.LocalDirectory`
  (partial files, locks, atomic renames, no symlink followed);
* with ``capacity_bytes``, the directory's budget: a
  :class:`~chainer_prefetch.staging.capacity.CapacityLedger` shared by every
  process using the directory.  Before making local files the store
  *reserves* their estimated size (for a plain copy the exact size; for a
  derived file what its source predicts), evicting items by the policy until
  the reservation fits, and *settles* the real size afterwards, so the limit
  holds for every kind of source;
* the eviction strategy (:mod:`chainer_prefetch.policy.eviction`), which
  ranks this process's items by their next use or last use.

In place of the directory, a
:class:`~chainer_prefetch.staging.local_memory.LocalMemory` keeps the local
forms in this process's memory, with a budget of its own
(``local_dir=':memory:'``).

Thread-safe: called from the copy threads (:meth:`stage`) and from the
pipeline thread (:meth:`hold`, :meth:`used`).  The store's lock guards only
the strategy's bookkeeping; no file, ledger or shared-storage I/O runs under
it.

When the local side fails (full disk, no permission), staging stops for the
rest of the run (:attr:`disabled` says why) and every item is read from
shared storage, never from a partial file.
"""
import dataclasses
import functools
import os
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple, Union

from chainer_prefetch.errors import CopyLockTimeout, LocalStorageError, SourceFileError
from chainer_prefetch.policy.eviction import make_strategy
from chainer_prefetch.staging.counters import Counters
from chainer_prefetch.staging.local_directory import LocalDirectory
from chainer_prefetch.staging.local_memory import LocalMemory
from chainer_prefetch.staging.peers import PeerCopy
from chainer_prefetch.staging.source_checks import SourceChecks
from chainer_prefetch.staging.sources import PlainFile, Source

#: What the store counts (see ``PrefetchMultiprocessIterator.stats``).
STORE_COUNTERS = ('files_copied', 'bytes_copied', 'local_bytes_written',
                  'files_already_local', 'files_failed_source',
                  'items_bypassed', 'items_too_large', 'files_evicted',
                  'bytes_evicted', 'files_lock_timeouts', 'copy_seconds')


class _NoRoom(Exception):
    """A finished copy is larger than its reservation and no room can be made."""


class _Reservation:
    """What one item still has reserved while its files are made."""

    def __init__(self, remaining: int):
        self.remaining = remaining
        self.no_room = False


@dataclasses.dataclass(frozen=True)
class StageResult:
    """What staging one item did.

    Attributes:
        staged: Every source of the item has a current local form, so the
            examples of the item may be read locally.
        bytes_read: Bytes this call read from shared storage.
        evicted: Items this call dropped to make room.
    """

    staged: bool
    bytes_read: int = 0
    evicted: Tuple[int, ...] = ()


class LocalStore:
    """A local directory with an optional byte budget kept by an eviction policy.

    Args:
        directory: Where the local files go: a ``LocalDirectory``, or a
            :class:`~chainer_prefetch.staging.local_memory.LocalMemory`
            (the local forms kept in this process's memory).
        capacity_bytes: Limit of the bytes under the directory (shared with
            every process using it), or ``None`` for no limit.
        eviction_policy: A name in
            :data:`chainer_prefetch.policy.eviction.STRATEGIES`.
        sources_of: ``sources_of(item)``, the sources of an item (needed to
            evict it; asked again rather than kept, so memory follows the
            number of items stored, not their paths).
        checks: When a local copy is compared with its source again
            (``recheck_sources``); ``None``: each time the item is staged.
        peers: A :class:`~chainer_prefetch.staging.peers.PeerGroup` to copy
            plain files from before their sources (items must be example
            indices).
    """

    def __init__(self, directory: Union[LocalDirectory, LocalMemory],
                 capacity_bytes: Optional[int] = None,
                 eviction_policy: str = 'belady',
                 sources_of: Optional[Callable[[int], Sequence[Source]]] = None,
                 checks: Optional[SourceChecks] = None, peers=None):
        self.directory = directory
        self.peers = peers
        self.checks = checks
        self._sources_of = sources_of
        self.counters = Counters(STORE_COUNTERS)
        self.disabled: Optional[str] = None  #: why staging stopped, if it did
        self._lock = threading.Lock()
        self._ledger = None
        self._strategy = None
        if capacity_bytes is not None:
            if sources_of is None:
                raise ValueError('a capacity limit needs sources_of')
            self._strategy = make_strategy(eviction_policy)
            try:
                self._ledger = directory.capacity_ledger(capacity_bytes)
            except OSError as error:
                raise LocalStorageError(
                    error.errno, 'the capacity ledger of {} is unusable: {}'
                    .format(directory.root, error.strerror or error)
                ) from error

    @property
    def limited(self) -> bool:
        """Whether a capacity limit applies."""
        return self._ledger is not None

    def bytes_used(self) -> Optional[int]:
        """Bytes the capacity ledger counts, or ``None`` without a limit.

        For a directory, every process using it; for a ``LocalMemory``, the
        forms this process keeps.
        """
        return None if self._ledger is None else self._ledger.used_bytes()

    def close(self):
        """Lets go of the ledger and the directory (local files stay; kept memory forms go)."""
        if self._ledger is not None:
            self._ledger.close()
        self.directory.close()

    def stage(self, item: int, sources: Sequence[Source], now: int = 0,
              epoch: int = 0, order_epoch: Optional[int] = None
              ) -> StageResult:
        """Makes a current local form of every source of ``item``.

        Args:
            item: The item (what the policy keeps or drops as one).
            sources: Its sources.
            now: The number of the access it is staged for (the policy
                compares it with the next uses of the stored items).
            epoch: The check epoch of that access (see ``checks``): its
                epoch, numbered so that it never goes back, also across a
                reset of the iterator.
            order_epoch: The iterator's epoch of the access: with
                ``peers``, the item's plain files are copied from the node
                that trained on it in an earlier epoch when it has them
                (:meth:`~chainer_prefetch.staging.peers.PeerGroup.copy`);
                bytes from peers are not counted as read from shared
                storage.

        Returns:
            What happened.  ``staged`` is false when a source cannot be read
            (stage 3 reads it itself and reports the error with the
            example's index), when the local side failed, and when the
            policy left the item on shared storage.
        """
        started = time.perf_counter()
        try:
            copy_from_peers = None
            if self.peers is not None and order_epoch is not None:
                nodes = self.peers.candidates(item, order_epoch)
                if nodes:
                    copy_from_peers = functools.partial(
                        self.peers.copy, index=item, nodes=nodes)
            result = self._stage(item, sources, now, epoch, copy_from_peers)
            if self.checks is not None:
                if result.staged:
                    self.checks.compared(item, epoch)
                else:
                    self.checks.forget(item)
            return result
        finally:
            self.counters.add(copy_seconds=time.perf_counter() - started)

    def _stage(self, item, sources, now, epoch, copy_from_peers
               ) -> StageResult:
        try:
            missing = ([] if self._trusted(item, sources, epoch)
                       else self._missing(sources))
        except SourceFileError:
            self.counters.add(files_failed_source=1)
            return StageResult(False)
        self.counters.add(files_already_local=len(sources) - len(missing))
        if missing and self.disabled is not None:
            return StageResult(False)
        if copy_from_peers is not None:
            missing = [(PeerCopy(source, copy_from_peers)
                        if isinstance(source, PlainFile) else source,
                        origin_stat) for source, origin_stat in missing]
        if self._ledger is None:
            return self._make(missing)
        return self._make_within_budget(item, sources, missing, now)

    def _trusted(self, item, sources, epoch) -> bool:
        """Whether ``checks`` lets the item's local forms be used without
        comparing them with their sources, and they are all still there."""
        return (self.checks is not None
                and self.checks.trusts(item, [source.origin for source in sources],
                                       epoch)
                and all(self.directory.has_local(source) for source in sources))

    def needs_copy(self, sources: Sequence[Source], item: Optional[int] = None,
                   epoch: int = 0) -> bool:
        """Whether :meth:`stage` would read the origin of one of ``sources``.

        Not when every local form is current (or ``checks`` trusts them, for
        ``item`` in ``epoch``), nor when copying is disabled.

        Raises:
            SourceFileError: an origin cannot be read.
        """
        if self.disabled is not None:
            return False
        if item is not None and self._trusted(item, sources, epoch):
            return False
        return bool(self._missing(sources))

    def _missing(self, sources: Sequence[Source]
                 ) -> List[Tuple[Source, Optional[os.stat_result]]]:
        """The sources without a current local form, with their origins' stats.

        Without a capacity limit, a source that ``stats_when_opened`` and
        has no local file at all comes with ``None``: its copy takes the
        stat from the origin it opens, so shared storage is asked once.

        Raises:
            SourceFileError: an origin cannot be read.
        """
        missing = []
        for source in sources:
            if (source.stats_when_opened and self._ledger is None
                    and not self.directory.has_local(source)):
                missing.append((source, None))
                continue
            origin_stat = source.stat_origin()
            if not self.directory.is_current(source, origin_stat):
                missing.append((source, origin_stat))
        return missing

    def hold(self, item: int, now: int) -> bool:
        """Keeps a stored item from eviction until :meth:`used` reports access ``now``.

        Returns:
            ``False`` if the item is not stored (any more): stage it again.
        """
        if self._strategy is None:
            return True
        with self._lock:
            if item not in self._strategy:
                return False
            self._strategy.hold(item, now)
            return True

    def used(self, item: int, now: int, next_use: float):
        """Stage 3 read ``item`` for access ``now``; its next use is ``next_use``."""
        if self._strategy is None:
            return
        with self._lock:
            if item in self._strategy:
                self._strategy.use(item, now, next_use)

    def forget_next_uses(self):
        """The order was reset: every stored item's next use is unknown now."""
        if self._strategy is not None:
            with self._lock:
                self._strategy.forget_next_uses()

    def _make(self, missing) -> StageResult:
        """Makes the missing local files; returns the result (no budget)."""
        bytes_read = 0
        for source, origin_stat in missing:
            written = self._make_one(source, origin_stat)
            if written is None:
                return StageResult(False, bytes_read)
            bytes_read += _bytes_read(source, origin_stat, written)
        return StageResult(True, bytes_read)

    def _make_one(self, source, origin_stat, before_rename=None
                  ) -> Optional[int]:
        """Makes one local file; returns bytes written (0: was there), None on failure."""
        if self.disabled is not None:
            return None
        try:
            written = self.directory.stage(source, origin_stat, before_rename)
        except SourceFileError:
            # Stage 3 reads the source itself and reports the error with the
            # example's index; a transient failure may even succeed there.
            self.counters.add(files_failed_source=1)
            return None
        except LocalStorageError as error:
            if self.disabled is None:
                self.disabled = str(error)
            return None
        except (InterruptedError, _NoRoom):
            return None
        except CopyLockTimeout:
            self.counters.add(files_lock_timeouts=1)
            return None
        if getattr(source, 'from_peer', None) is not None:  # (stats['peers'])
            self.counters.add(local_bytes_written=written)
        elif written:
            self.counters.add(files_copied=1,
                              bytes_copied=_bytes_read(source, origin_stat,
                                                       written),
                              local_bytes_written=written)
        else:
            self.counters.add(files_already_local=1)
        return written

    def _make_within_budget(self, item, sources, missing, now) -> StageResult:
        if not missing:
            with self._lock:
                self._strategy.hold(item, now)  # until stage 3 loaded it
            return StageResult(True)
        # A stale local form (its source changed) goes first, so that the
        # ledger does not keep counting it once the new copy replaces it.
        self._evict_sources([source for source, _ in missing])
        estimate = sum(source.estimated_local_bytes(origin_stat)
                       for source, origin_stat in missing)
        if estimate > self._ledger.limit_bytes:
            self.counters.add(items_too_large=1, items_bypassed=1)
            return StageResult(False)
        evicted: List[int] = []
        if not self._reserve(estimate, now, evicted):
            self.counters.add(items_bypassed=1)
            return StageResult(False, 0, tuple(evicted))
        budget = _Reservation(estimate)
        bytes_read = 0
        made = []
        for source, origin_stat in missing:
            settle = functools.partial(self._settle, budget, now, evicted)
            written = self._make_one(source, origin_stat, settle)
            if written is None:
                self._evict_sources(made)
                self._ledger.release(budget.remaining)
                if budget.no_room:
                    self.counters.add(items_bypassed=1)
                return StageResult(False, bytes_read, tuple(evicted))
            if written:
                made.append(source)
                bytes_read += _bytes_read(source, origin_stat, written)
        # What a file made by another process meanwhile did not use.
        self._ledger.release(budget.remaining)
        with self._lock:
            self._strategy.hold(item, now)  # until stage 3 loaded it
        return StageResult(True, bytes_read, tuple(evicted))

    def _settle(self, budget, now, evicted, written):
        """Called just before a finished copy is renamed into place: count its real size.

        Raises:
            _NoRoom: it is larger than reserved and no room can be made
                (the copy is then dropped).
        """
        if written > budget.remaining:
            if not self._reserve(written - budget.remaining, now, evicted):
                budget.no_room = True
                raise _NoRoom()
            budget.remaining = written
        self._ledger.settle(written, written)
        budget.remaining -= written

    def _reserve(self, n_bytes, now, evicted: List[int]) -> bool:
        """Reserves ``n_bytes``, evicting by the policy; False to leave the item out."""
        while not self._ledger.reserve(n_bytes):
            with self._lock:
                victim = self._strategy.victim(now)
                if victim is None:
                    return False
                self._strategy.remove(victim)
            self._evict_sources(self._sources_of(victim))
            evicted.append(victim)
        return True

    def _evict_sources(self, sources):
        """Removes local files and takes their bytes off the ledger."""
        for source in sources:
            try:
                freed = self.directory.evict(source)
            except LocalStorageError as error:
                if self.disabled is None:
                    self.disabled = str(error)
                continue
            if freed:
                self._ledger.freed(freed)
                self.counters.add(files_evicted=1, bytes_evicted=freed)


def _bytes_read(source: Source, origin_stat: Optional[os.stat_result],
                written: int) -> int:
    """Bytes of shared storage a copy that wrote ``written`` bytes read
    (``origin_stat`` ``None``: a plain copy, as many as it wrote; none
    when it came from a peer)."""
    if not written or getattr(source, 'from_peer', None) is not None:
        return 0
    return written if origin_stat is None else source.source_bytes(origin_stat)


def sources_bytes(sources: Sequence[Source]) -> int:
    """Bytes the sources take on shared storage (0 for one that cannot be read)."""
    total = 0
    for source in sources:
        try:
            total += source.source_bytes(source.stat_origin())
        except (SourceFileError, OSError):
            pass
    return total
