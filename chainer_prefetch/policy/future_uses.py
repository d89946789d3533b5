"""When each stored item is used next, from the epoch orders drawn so far.

Stage 1 draws each epoch's successor order when the epoch starts (see
:mod:`chainer_prefetch.policy.lookahead`), so the accesses of the current and
the next epoch are known.  Accesses are numbered across epochs: position
``p`` of epoch ``e`` is access ``e * epoch_size + p``.

An access reads an *item*: the example itself, or, for examples that share
their files (the rows of a Parquet row group), the group they share, given
as ``item_of[index]``.  The next use of an item is the first later access to
any example of it.

Memory and time: a permutation order with one item per example (Chainer's
``ShuffleOrderSampler``) is kept as its inverse (one ``int32`` per example
and epoch, built in a few milliseconds even for ImageNet); any other order
(repeats, shared items) as its items sorted stably with their positions.
Only the last ``keep_epochs`` epochs are kept.
"""
import bisect
from typing import Dict, Optional, Sequence

import numpy

from chainer_prefetch.policy.eviction import NEVER


class FutureUses:
    """Answers "when is this item used next?" from the registered orders.

    Args:
        epoch_size: Accesses per epoch.
        item_of: For each example index, the item it reads (``None``: the
            example is the item).
        keep_epochs: How many of the latest epochs to remember.
    """

    def __init__(self, epoch_size: int, item_of: Optional[numpy.ndarray] = None,
                 keep_epochs: int = 3):
        self.epoch_size = epoch_size
        self._item_of = item_of
        self._keep = keep_epochs
        # epoch -> ('inverse', positions by item) or ('sorted', items, positions)
        self._epochs: Dict[int, tuple] = {}

    def add_epoch(self, epoch: int, order: Sequence[int]):
        """Registers the order of ``epoch`` (a no-op if already known)."""
        if epoch in self._epochs:
            return
        order = numpy.asarray(order)
        items = order if self._item_of is None else self._item_of[order]
        self._epochs[epoch] = _index_positions(items)
        for old in sorted(self._epochs)[:-self._keep]:
            del self._epochs[old]

    def clear(self):
        """Forgets every order (after a reset)."""
        self._epochs.clear()

    def following_use(self, item: int, after: int) -> float:
        """The number of the first access to ``item`` after access ``after``.

        Returns:
            :data:`~chainer_prefetch.policy.eviction.NEVER` when no
            registered order uses it again.
        """
        epoch, position = divmod(after, self.epoch_size)
        for offset, earliest in ((0, position + 1), (1, 0)):
            known = self._epochs.get(epoch + offset)
            if known is None:
                continue
            found = _first_position(known, item, earliest)
            if found is not None:
                return (epoch + offset) * self.epoch_size + found
        return NEVER


def _index_positions(items: numpy.ndarray) -> tuple:
    size = len(items)
    if size and items.min() >= 0 and items.max() < size:
        inverse = numpy.full(size, -1, dtype=numpy.int64 if size >= 2 ** 31
                             else numpy.int32)
        inverse[items] = numpy.arange(size, dtype=inverse.dtype)
        if (inverse >= 0).all():  # every item once: a permutation
            return ('inverse', inverse)
    by_item = numpy.argsort(items, kind='stable')
    return ('sorted', items[by_item], by_item)


def _first_position(known: tuple, item: int, earliest: int) -> Optional[int]:
    """The first position >= ``earliest`` of ``item`` in one epoch, or ``None``."""
    if known[0] == 'inverse':
        inverse = known[1]
        if 0 <= item < len(inverse) and inverse[item] >= earliest:
            return int(inverse[item])
        return None
    # bisect, not numpy.searchsorted: that gives the GIL up (and waits to
    # take it back from the loader threads) however small the search.
    _, items, positions = known
    start = bisect.bisect_left(items, item)
    stop = bisect.bisect_left(items, item + 1, start)
    run = positions[start:stop]  # ascending: the sort is stable
    later = bisect.bisect_left(run, earliest)
    return int(run[later]) if later < len(run) else None
