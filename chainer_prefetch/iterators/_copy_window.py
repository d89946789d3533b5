"""Stage 2 ahead of the loads: which items to copy, and how far ahead.

Pure bookkeeping for :class:`._scheduler.Scheduler` (which sends the
copies as :class:`._scheduler.Copy` actions).  Its module docstring tells
the rules; this module keeps the state they need:

* the copies in flight: accesses waiting for the same item share one copy;
* for each item, the epoch in which it was last known to have current
  local copies (then an access needs no copy), counted as *check epochs*:
  the epoch plus a base that each reset raises past every check epoch
  used before, so that they never go back (a reset to epoch 0, or a
  restored snapshot, compares the copies again as a new epoch would);
* the window's size in batches: one more per batch delivered ("slow
  start"), all of ``n_copy_ahead`` once stage 2 is idle;
* with ``max_bytes_ahead``, the items the batches in flight use and their
  bytes together.
"""
import collections
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import numpy


class CopyState:
    """A copy in flight and the accesses waiting for it.

    Args:
        copy_id: The copy's id.
        access: The access it was started for.
    """

    def __init__(self, copy_id: int, access: int):
        self.copy_id = copy_id
        self.access = access
        self.waiters: List[Tuple[int, int]] = []  # (batch id, position)


class ItemsAhead:
    """The items the batches in flight use, and their bytes together.

    Args:
        item_bytes: ``item_bytes(item)``, an item's estimated local bytes.
    """

    def __init__(self, item_bytes: Callable[[int], int]):
        self._item_bytes = item_bytes
        self.uses: collections.Counter = collections.Counter()  # item -> batches
        self.bytes = 0

    def bytes_with(self, items: Set[int]) -> int:
        """The bytes together if a batch using ``items`` joined."""
        return self.bytes + sum(self._item_bytes(item) for item in items
                                if item not in self.uses)

    def add(self, items: Set[int]):
        for item in items:
            if item not in self.uses:
                self.bytes += self._item_bytes(item)
            self.uses[item] += 1

    def remove(self, items: Set[int]):
        for item in items:
            self.uses[item] -= 1
            if not self.uses[item]:
                del self.uses[item]
                self.bytes -= self._item_bytes(item)

    def clear(self):
        self.uses.clear()
        self.bytes = 0


class CopyWindow:
    """The copies in flight, the items known local, and how many batches may be ahead.

    Args:
        config: The scheduler's :class:`~._scheduler.SchedulerConfig`.
        decode_window: Batches whose examples load at the same time: the
            window's size at start-up.

    Attributes:
        copies: The copy in flight for each item.
        unanswered: The item of each copy whose answer (copied or
            cancelled) has not come, including those a reset dropped.
        known_local: For each item, the check epoch in which it was last
            known to have current local copies (-1: not known).
    """

    def __init__(self, config, decode_window: int):
        self._config = config
        self._decode_window = decode_window
        self.copies: Dict[int, CopyState] = {}
        self.unanswered: Dict[int, int] = {}
        n_items = (config.dataset_length if config.item_of is None
                   else int(config.item_of.max()) + 1 if len(config.item_of)
                   else 0)
        self.known_local = numpy.full(n_items, -1, dtype=numpy.int32)
        self._items_ahead = (None if config.max_bytes_ahead is None
                             else ItemsAhead(config.item_bytes))
        self._delivered_ever = 0  # batches delivered since the start
        self._slow_start_over = not config.slow_start  # the window is wholly open
        self._reads_only_local = True  # no load reads shared storage
        self._check_base = 0  # added to an epoch: its check epoch
        self._check_high = -1  # the highest check epoch used

    @property
    def n_items(self) -> int:
        """Items in the dataset."""
        return len(self.known_local)

    # ---- how far ahead ----------------------------------------------------------

    def size(self) -> int:
        """Batches that may be generated ahead of the last one delivered."""
        if self._slow_start_over:
            return self._config.n_copy_ahead
        return min(self._config.n_copy_ahead,
                   self._decode_window + self._delivered_ever)

    def reads_source(self):
        """A load reads (or will read) shared storage: the slow start goes on."""
        self._reads_only_local = False

    def delivered(self, items: Optional[Set[int]]):
        """A batch (or what stands in its place) was delivered.

        Args:
            items: The items it counted against ``max_bytes_ahead``, or ``None``.
        """
        if items is not None:
            self._items_ahead.remove(items)
        self._delivered_ever += 1
        self.end_slow_start_if_idle()

    def end_slow_start_if_idle(self):
        """Opens the window wholly once stage 2 is idle after a delivery,
        or after a copy while every load reads local copies.

        Called when a copy ends or a batch is delivered, not on a reset
        (which empties stage 2 too, at a position where nothing is staged).
        """
        if not self.copies and (self._delivered_ever or self._reads_only_local):
            self._slow_start_over = True

    # ---- bytes ahead ---------------------------------------------------------------

    def items_counted(self, indices) -> Optional[Set[int]]:
        """The items of a batch of ``indices``, where they count against ``max_bytes_ahead``."""
        if self._items_ahead is None or indices is None:
            return None
        return self.items_of(indices)

    def has_room_for(self, items: Set[int], alone: bool) -> bool:
        """Whether a batch using ``items`` keeps the items in flight within ``max_bytes_ahead``.

        Args:
            items: Its items (see :meth:`items_counted`).
            alone: No other batch is in flight (then it always has room).
        """
        return (alone or self._items_ahead.bytes_with(items)
                <= self._config.max_bytes_ahead)

    def add_items(self, items: Set[int]):
        """A batch using ``items`` (see :meth:`items_counted`) was generated."""
        self._items_ahead.add(items)

    def items_of(self, indices) -> Set[int]:
        """The items of the examples ``indices`` (a batch's, or a columnar batch's units')."""
        return set(self._config.item_of[numpy.asarray(indices)].tolist())

    # ---- copies and local items ----------------------------------------------

    def check_epoch(self, epoch: int) -> int:
        """The check epoch of ``epoch`` since the last reset (see the module docstring)."""
        check = self._check_base + epoch
        self._check_high = max(self._check_high, check)
        return check

    def is_local(self, item: int, epoch: int) -> bool:
        """Whether an access of ``epoch`` may read ``item``'s local copies without a copy."""
        known = self.known_local[item]
        return known >= 0 and (known == self.check_epoch(epoch)
                               or not self._config.revalidate_each_epoch)

    def mark_local(self, item: int, epoch: int):
        """A copy made for an access of ``epoch`` (since the last reset) staged ``item``."""
        self.known_local[item] = self.check_epoch(epoch)

    def forget(self, item: int):
        """``item``'s local copies are gone (evicted, lost or unreadable)."""
        self.known_local[item] = -1

    def start_copy(self, copy_id: int, item: int, access: int) -> CopyState:
        """Registers the copy of ``item`` for ``access``."""
        copy = self.copies[item] = CopyState(copy_id, access)
        self.unanswered[copy_id] = item
        return copy

    def end_copy(self, copy_id: int) -> Optional[CopyState]:
        """A copy answered (copied or cancelled): its state, or ``None`` if a reset dropped it."""
        item = self.unanswered.pop(copy_id, None)
        copy = self.copies.get(item)
        if copy is None or copy.copy_id != copy_id:
            return None
        del self.copies[item]
        return copy

    def reset(self) -> Tuple[int, ...]:
        """Drops every copy in flight and item ahead; returns the copies to cancel.

        The check epochs of the epochs after the reset are new ones.
        """
        self._check_base = self._check_high + 1
        copy_ids = tuple(copy.copy_id for copy in self.copies.values())
        self.copies.clear()
        if self._items_ahead is not None:
            self._items_ahead.clear()
        return copy_ids

    def check_invariants(self, batches_in_flight: Iterable):
        """Asserts the window's bounds (see the scheduler's module docstring).

        Args:
            batches_in_flight: The indices of each batch in flight.
        """
        config = self._config
        assert self.size() <= config.n_copy_ahead
        if self._items_ahead is None:
            return
        uses = collections.Counter()
        batches = 0
        for indices in batches_in_flight:
            uses.update(self.items_of(indices))
            batches += 1
        ahead = self._items_ahead
        assert uses == ahead.uses, (uses, ahead.uses)
        assert ahead.bytes == sum(map(config.item_bytes, uses))
        assert ahead.bytes <= config.max_bytes_ahead or batches == 1

    @property
    def bytes_ahead(self) -> int:
        """The bytes of the items the batches in flight use (with ``max_bytes_ahead``)."""
        return 0 if self._items_ahead is None else self._items_ahead.bytes
