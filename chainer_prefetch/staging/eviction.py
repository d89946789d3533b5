"""Which files a capacity-limited local directory should keep: pure policies.

A local directory smaller than the dataset must drop files to make room.
Because stage 1 owns the order of examples, the future sequence of file
accesses is known, which allows Belady's rule: when room is needed, drop the
file whose next use is farthest away (or do not store the new file at all if
it is the one needed last).  With random epochs this keeps the share of
reads served locally near ``capacity / dataset`` in every epoch, the best any
policy can do, where LRU, which always drops the least recently used file,
keeps far less: the file used longest ago is, in a fresh random order, as
likely to be needed soon as any other.

Everything here is pure: no files, no threads.  :class:`ResidentSet` is the
policy's bookkeeping (what is stored and how soon it is needed again), used
both by the live local directory (``ExampleStager``) and by ``simulate``,
which replays an access sequence and says, access by access, whether the
item was local, so the policies can be compared on paper with the same code
that moves the bytes.  :class:`FutureUses` answers "when is this example
used next?" from the orders the iterator has already drawn.

Policies:

* ``'belady'``: farthest next use, with bypass (optimal for equal sizes);
* ``'lru'``: least recently used;
* ``'fill_once'``: keep the first files that fit, never evict (the
  "MinIO" cache of CoorDL).
"""
import collections
import heapq
import itertools
from typing import Dict, Hashable, List, Mapping, Optional, Sequence

import numpy

POLICIES = ('belady', 'lru', 'fill_once')
_NEVER = float('inf')
NEVER = _NEVER  #: the next use of an item not used again (as far as known)


def next_use(accesses: Sequence[Hashable]) -> List[float]:
    """For each position, the position of the next access to the same item.

    Args:
        accesses: Item ids in access order.

    Returns:
        A list as long as ``accesses``; ``inf`` where the item is not used
        again.
    """
    following = [_NEVER] * len(accesses)
    seen = {}
    for position in range(len(accesses) - 1, -1, -1):
        item = accesses[position]
        following[position] = seen.get(item, _NEVER)
        seen[item] = position
    return following


class ResidentSet:
    """What a capacity-limited store holds, and which item it should drop next.

    Items are examples (their files are stored and dropped together).  The
    caller keeps the byte accounting; this class only ranks the items:

    * ``'belady'``: each item carries its next use; :meth:`victim` offers the
      item needed farthest in the future, and only when that is later than
      the next use of the item that wants room (otherwise the newcomer is
      the one to leave out: *bypass*).
    * ``'lru'``: each item carries its last use; :meth:`victim` offers the
      least recently used one, always.
    * ``'fill_once'``: :meth:`victim` offers nothing: what is stored stays.

    An item can be *held* (:meth:`hold`) between the moment it is stored
    for an access and the access itself; no policy offers a held item.

    Args:
        policy: One of :data:`POLICIES`.

    Raises:
        ValueError: unknown policy.
    """

    def __init__(self, policy: str):
        if policy not in POLICIES:
            raise ValueError('unknown eviction policy {!r}; known: {}'.format(
                policy, ', '.join(POLICIES)))
        self.policy = policy
        self._rank: Dict[Hashable, float] = {}
        self._held = collections.Counter()
        self._heap = []  # (-rank for belady / rank for lru, tie, item)
        self._tie = itertools.count()

    def __contains__(self, item) -> bool:
        return item in self._rank

    def __len__(self) -> int:
        return len(self._rank)

    def hold(self, item, now: float):
        """Records that ``item`` is stored for the access ``now``, not done yet.

        It is not offered as a victim until :meth:`use` reports that access.
        """
        self._held[item] += 1
        if item not in self._rank:
            self._rank[item] = now

    def use(self, item, now: float, next_use: float):
        """Records that ``item`` is stored and used at ``now``, next at ``next_use``.

        Ends one :meth:`hold`, if any.

        Args:
            item: The item (stored already, or just admitted).
            now: The position of this use in the access sequence.
            next_use: The position of its next use (:data:`NEVER` if none
                is known).
        """
        if self._held[item] > 1:
            self._held[item] -= 1
        else:
            self._held.pop(item, None)
        rank = next_use if self.policy == 'belady' else now
        self._rank[item] = rank
        key = -rank if self.policy == 'belady' else rank
        heapq.heappush(self._heap, (key, next(self._tie), item))

    def remove(self, item):
        """Forgets ``item`` (it was dropped, or its copy failed)."""
        self._rank.pop(item, None)
        self._held.pop(item, None)

    def forget_next_uses(self):
        """Releases every hold and marks every next use unknown (the order was reset)."""
        self._held.clear()
        for item in list(self._rank):
            self.use(item, self._rank[item],
                     _NEVER if self.policy == 'belady' else self._rank[item])

    def victim(self, incoming_next_use: float) -> Optional[Hashable]:
        """The item to drop to make room for one next used at ``incoming_next_use``.

        Returns:
            The item (still in the set: call :meth:`remove` once it is
            dropped), or ``None`` when nothing should be dropped, so the
            newcomer is not stored.
        """
        if self.policy == 'fill_once':
            return None
        while self._heap:
            key, _, item = self._heap[0]
            rank = -key if self.policy == 'belady' else key
            if self._rank.get(item) != rank or item in self._held:
                heapq.heappop(self._heap)  # outdated, or held: use() re-adds
                continue
            if self.policy == 'belady' and rank <= incoming_next_use:
                return None
            return item
        return None


class FutureUses:
    """When each example is used next, from the epoch orders drawn so far.

    Accesses are numbered across epochs: position ``p`` of epoch ``e`` is
    ``e * epoch_size + p``.  The iterator registers the order of every epoch
    as soon as it is drawn (the current one and the next, see
    :mod:`chainer_prefetch.iterators._lookahead`).

    Args:
        epoch_size: Examples per epoch.
        keep_epochs: How many of the latest epochs to remember.
    """

    def __init__(self, epoch_size: int, keep_epochs: int = 3):
        self.epoch_size = epoch_size
        self._keep = keep_epochs
        # epoch -> (indices sorted, their positions): the positions of one
        # index are a contiguous, ascending run (stable sort).
        self._sorted: Dict[int, tuple] = {}

    def add_epoch(self, epoch: int, order: Sequence[int]):
        """Registers the order of ``epoch`` (a no-op if already known)."""
        if epoch in self._sorted:
            return
        order = numpy.asarray(order)
        by_index = numpy.argsort(order, kind='stable')
        self._sorted[epoch] = (order[by_index], by_index)
        for old in sorted(self._sorted)[:-self._keep]:
            del self._sorted[old]

    def clear(self):
        """Forgets every order (after a reset)."""
        self._sorted.clear()

    def following_use(self, index: int, after: int) -> float:
        """The number of the first access to ``index`` after access ``after``.

        Returns:
            :data:`NEVER` when no registered order uses it again.
        """
        epoch, position = divmod(after, self.epoch_size)
        for offset, earliest in ((0, position + 1), (1, 0)):
            known = self._sorted.get(epoch + offset)
            if known is None:
                continue
            indices, positions = known
            start, stop = numpy.searchsorted(indices, (index, index + 1))
            run = positions[start:stop]
            later = numpy.searchsorted(run, earliest)
            if later < len(run):
                return (epoch + offset) * self.epoch_size + int(run[later])
        return _NEVER


def simulate(accesses: Sequence[Hashable], sizes: Mapping[Hashable, int],
             capacity: int, policy: str) -> List[bool]:
    """Replays ``accesses`` through a store of ``capacity`` bytes.

    An access is a hit when the item is stored at that moment; on a miss the
    item is read from shared storage and the policy decides whether to store
    it and what to drop.  The stored bytes never exceed ``capacity``.  The
    live local directory makes the same decisions with the same
    :class:`ResidentSet`.

    Args:
        accesses: Item ids in access order (e.g. several epochs of indices).
        sizes: Bytes of each item.
        capacity: Bytes the store may hold.
        policy: One of :data:`POLICIES`.

    Returns:
        One bool per access: ``True`` if it was served from the store.

    Raises:
        ValueError: unknown policy, or an item larger than the capacity.
    """
    resident = ResidentSet(policy)
    largest = max((sizes[item] for item in set(accesses)), default=0)
    check_capacity(capacity, largest)
    following = next_use(accesses)
    used = 0
    hits = []
    for now, item in enumerate(accesses):
        hit = item in resident
        hits.append(hit)
        if not hit:
            if policy == 'belady' and following[now] == _NEVER:
                continue  # never needed again: not worth storing
            while used + sizes[item] > capacity:
                victim = resident.victim(following[now])
                if victim is None:
                    break
                resident.remove(victim)
                used -= sizes[victim]
            if used + sizes[item] > capacity:
                continue  # bypass
            used += sizes[item]
        resident.use(item, now, following[now])
    return hits


def check_capacity(capacity: int, largest_file: int):
    """Refuses a capacity that cannot hold the largest file.

    Raises:
        ValueError: ``capacity < largest_file``.
    """
    if largest_file > capacity:
        raise ValueError('capacity {} bytes is smaller than the largest file '
                         '({} bytes)'.format(capacity, largest_file))
