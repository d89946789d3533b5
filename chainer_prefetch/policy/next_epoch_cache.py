"""The next-epoch cache: examples that the next epoch needs first, kept in memory.

While epoch ``e`` runs, the order of epoch ``e + 1`` is already drawn (see
:mod:`chainer_prefetch.policy.lookahead`).  Every example of epoch ``e``
passes through the iterator once; those among the first ones of epoch
``e + 1`` (the prefix ``S_next[:k]``) are copied into this cache as they pass,
and epoch ``e + 1`` takes them from memory instead of loading them again, so
its first batches touch no storage for them.  This is the two-sequence
scheme (current order, next order) of the next-epoch cache, with the memory
bound given in examples, in bytes, or both.

When the bound is reached, an example earlier in ``S_next`` replaces the
cached one that comes latest, so the cache converges on the true prefix
whatever order the examples pass in.

Pure bookkeeping (no threads, no I/O), owned by the iterator's scheduler.
Memory: one ``int32`` per example for the planned prefix of each pending
epoch, the examples held, and a heap whose outdated entries are dropped
whenever they outnumber the held ones.
"""
import heapq
import itertools
from typing import Any, Dict, Optional, Sequence

import numpy


class NextEpochCache:
    """Holds, for the next epoch, the examples it needs first.

    Args:
        max_examples: Most examples held for one epoch (``None``: no bound
            in examples).
        max_bytes: Most bytes of example arrays held (``None``: no bound in
            bytes).

    Raises:
        ValueError: both bounds are ``None`` or a bound is not positive.
    """

    def __init__(self, max_examples: Optional[int] = None,
                 max_bytes: Optional[int] = None):
        if max_examples is None and max_bytes is None:
            raise ValueError('the next-epoch cache needs a bound: a number of '
                             'examples, of bytes, or both')
        for name, value in (('max_examples', max_examples),
                            ('max_bytes', max_bytes)):
            if value is not None and value < 1:
                raise ValueError('{} must be positive, got {}'.format(
                    name, value))
        self.max_examples = max_examples
        self.max_bytes = max_bytes
        # epoch -> array: position of each index in the prefix, -1 if absent
        self._wanted: Dict[int, numpy.ndarray] = {}
        self._held: Dict[tuple, tuple] = {}  # (epoch, index) -> (position, bytes, example)
        self._latest = []  # heap of (-position, tie, epoch, index)
        self._tie = itertools.count()
        self._bytes = 0
        self.counters = {'examples_cached': 0, 'examples_replaced': 0,
                         'hits': 0, 'bytes_cached': 0}

    @property
    def held_bytes(self) -> int:
        """Bytes of the examples held now."""
        return self._bytes

    def plan(self, epoch: int, order: Sequence[int]):
        """Registers the order of ``epoch``, whose prefix should be cached.

        Args:
            epoch: The epoch the order belongs to (the one after the epoch
                now being read).
            order: Its order of indices.
        """
        if epoch in self._wanted:
            return
        order = numpy.asarray(order)
        prefix = order if self.max_examples is None else \
            order[:self.max_examples]
        size = int(order.max()) + 1 if len(order) else 0
        wanted = numpy.full(size, -1, dtype=numpy.int32)
        # Reversed, so that an index listed twice keeps its first position.
        wanted[prefix[::-1]] = numpy.arange(len(prefix) - 1, -1, -1)
        self._wanted[epoch] = wanted

    def wants(self, index: int, epoch: int) -> bool:
        """Whether example ``index`` belongs to the planned prefix of ``epoch``."""
        return self._position(index, epoch) is not None

    def _position(self, index, epoch) -> Optional[int]:
        wanted = self._wanted.get(epoch)
        if wanted is None or not 0 <= index < len(wanted) or wanted[index] < 0:
            return None
        return int(wanted[index])

    def offer(self, index: int, epoch: int, example: Any, n_bytes: int) -> bool:
        """Keeps ``example`` for ``epoch`` if it is in its prefix and fits.

        Args:
            index: The example's index.
            epoch: The epoch that will use it (the next one).
            example: The loaded example (the caller passes its own copy).
            n_bytes: Its size in memory.

        Returns:
            Whether it was kept.
        """
        position = self._position(index, epoch)
        if position is None or (epoch, index) in self._held:
            return False
        if self.max_bytes is not None and n_bytes > self.max_bytes:
            return False
        rank = _rank(epoch, position)
        while not self._fits(n_bytes):
            latest = self._latest_held()
            if latest is None or latest[0] < rank:
                return False  # everything held is needed earlier
            self._drop(latest[1:])
            self.counters['examples_replaced'] += 1
        self._held[(epoch, index)] = (position, n_bytes, example)
        heapq.heappush(self._latest, (-rank, next(self._tie), epoch, index))
        self._bytes += n_bytes
        self.counters['examples_cached'] += 1
        self.counters['bytes_cached'] += n_bytes
        return True

    def take(self, index: int, epoch: int) -> Optional[Any]:
        """Removes and returns the example held for ``epoch``, or ``None``."""
        entry = self._held.get((epoch, index))
        if entry is None:
            return None
        self._drop((epoch, index))
        self.counters['hits'] += 1
        return entry[2]

    def holds(self, index: int, epoch: int) -> bool:
        """Whether the example is held for ``epoch`` now."""
        return (epoch, index) in self._held

    def forget_before(self, epoch: int):
        """Drops what was held or planned for epochs before ``epoch``."""
        for key in [key for key in self._held if key[0] < epoch]:
            self._drop(key)
        for old in [old for old in self._wanted if old < epoch]:
            del self._wanted[old]

    def clear(self):
        """Drops everything (the order was reset)."""
        self._held.clear()
        self._wanted.clear()
        self._latest = []
        self._bytes = 0

    def _fits(self, n_bytes):
        held = len(self._held)
        if self.max_examples is not None and held + 1 > self.max_examples:
            return False
        return self.max_bytes is None or self._bytes + n_bytes <= self.max_bytes

    def _latest_held(self):
        while self._latest:
            negative, _, epoch, index = self._latest[0]
            if (epoch, index) in self._held:
                return -negative, epoch, index
            heapq.heappop(self._latest)
        return None

    def _drop(self, key):
        position, n_bytes, _ = self._held.pop(key)
        self._bytes -= n_bytes
        if len(self._latest) > 2 * len(self._held) + 64:
            self._latest = [(-_rank(epoch, entry[0]), next(self._tie), epoch,
                             index)
                            for (epoch, index), entry in self._held.items()]
            heapq.heapify(self._latest)

    @property
    def heap_size(self) -> int:
        """Entries in the internal heap (bounded by about twice the examples held)."""
        return len(self._latest)


def _rank(epoch, position):
    """Orders (epoch, position) pairs as one number: when the example is needed."""
    return (epoch << 40) | position
