"""The scheduler's counters: what ``iterator.stats`` reports of stages 2 and 3.

Pure bookkeeping for :class:`._scheduler.Scheduler`; the executor reads a
copy of it (:meth:`PipelineCounts.snapshot`) under its step lock.
"""
import collections
from typing import Dict, Optional, Tuple

from chainer_prefetch.iterators._read_from import ReadFrom


class PipelineCounts:
    """Counts of examples and bytes, in total and per epoch.

    Examples are counted in rows: a columnar unit counts as the rows it
    stands for (its *weight*).

    Attributes:
        total: Across epochs: ``examples_staged`` and ``examples_not_staged``
            (how each access was planned), ``examples_from_local``,
            ``examples_from_source`` and ``examples_fallback`` (where
            stage 3 read them), ``examples_from_cache`` (served by the
            next-epoch cache).
        by_epoch: For each epoch an access belongs to:
            ``examples_from_local``, ``examples_from_source``,
            ``bytes_from_source``, ``bytes_copied``,
            ``examples_from_cache``, and what stages 2 and 3 asked of
            shared storage: ``source_stats`` and ``source_opens`` (also
            in ``total``).
    """

    def __init__(self):
        self.total: collections.Counter = collections.Counter()
        self.by_epoch: Dict[int, collections.Counter] = collections.defaultdict(
            collections.Counter)

    def planned(self, weight: int, local: bool):
        """Accesses of ``weight`` examples will read local copies (``local``) or the source."""
        self.total['examples_staged' if local else 'examples_not_staged'] += weight

    def copied(self, epoch: int, bytes_read: int,
               source_ops: Optional[Dict[str, int]] = None):
        """A copy made for an access of ``epoch`` read ``bytes_read`` bytes.

        Args:
            epoch: The epoch of the access it was made for.
            bytes_read: Bytes it read from shared storage.
            source_ops: What it asked of shared storage (counts keyed by
                :data:`~chainer_prefetch.staging.source_ops.SOURCE_OPS`).
        """
        self.by_epoch[epoch]['bytes_copied'] += bytes_read
        self._add_ops(epoch, source_ops)

    def _add_ops(self, epoch: int, source_ops: Optional[Dict[str, int]]):
        if source_ops:
            self.total.update(source_ops)
            self.by_epoch[epoch].update(source_ops)

    def from_cache(self, epoch: int):
        """The next-epoch cache served one example of ``epoch``."""
        self.total['examples_from_cache'] += 1
        self.by_epoch[epoch]['examples_from_cache'] += 1

    def loaded(self, epoch: int, weight: int, read_from: ReadFrom,
               source_bytes: int, source_ops: Optional[Dict[str, int]] = None):
        """Stage 3 loaded ``weight`` examples of ``epoch``.

        Args:
            epoch: The epoch of their access.
            weight: Examples loaded.
            read_from: Where the loader read them.
            source_bytes: Bytes read from shared storage for them.
            source_ops: What loading them asked of shared storage.
        """
        self._add_ops(epoch, source_ops)
        counts = self.by_epoch[epoch]
        if read_from is ReadFrom.LOCAL:
            self.total['examples_from_local'] += weight
            counts['examples_from_local'] += weight
        else:
            self.total['examples_from_source'] += weight
            counts['examples_from_source'] += weight
            counts['bytes_from_source'] += source_bytes
        if read_from is ReadFrom.FALLBACK:
            self.total['examples_fallback'] += weight

    def snapshot(self) -> Tuple[dict, Dict[int, dict]]:
        """Copies of the counters: ``(total, by_epoch)`` as plain dicts."""
        return (dict(self.total),
                {epoch: dict(counts) for epoch, counts in self.by_epoch.items()})
