"""Which items a capacity-limited local store should keep: pure strategies.

A local directory smaller than the dataset must drop files to make room.
Because stage 1 owns the order of examples, the future accesses are known,
which allows Belady's rule: when room is needed, drop the item whose next use
is farthest away (or do not store the newcomer at all if it is the one needed
last).  With random epochs this keeps the share of reads served locally near
``capacity / dataset`` in every epoch, the best any policy can do; LRU keeps
far less, because in a fresh random order the item used longest ago is as
likely to be needed soon as any other.

Strategies, by name in :data:`STRATEGIES` (a registry: add one with
:func:`register`):

* ``'belady'``: farthest next use first, with bypass (optimal for items of
  equal size);
* ``'lru'``: least recently used first;
* ``'fill_once'``: keep the first items that fit, never drop (CoorDL's
  "MinIO" cache).

An item is whatever is stored and dropped as one: the files of one example,
or one Parquet row group shared by many examples.  Everything here is pure
(no files, no threads): the live store (:mod:`chainer_prefetch.staging.local_store`)
calls it under its own lock, and :func:`simulate` replays an access sequence
through the same code, so the policies can be compared on paper.

Memory is bounded by the number of stored items, not by the number of
accesses: each strategy keeps one rank per stored item and a heap whose
outdated entries are dropped whenever they outnumber the live ones.
"""
import heapq
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence

NEVER = float('inf')  #: the next use of an item not used again (as far as known)


class EvictionStrategy:
    """What a capacity-limited store holds, and which item it should drop next.

    The caller keeps the byte accounting; a strategy only ranks the items.
    An item can be *held* (:meth:`hold`) between the moment it is stored for
    an access and the access itself; no strategy offers a held item.

    Subclasses set :attr:`evicts` and define :meth:`_rank` (a number per
    stored item; the item with the *highest* rank is offered first) and,
    optionally, :meth:`_admits`.
    """

    #: Whether the strategy ever offers a victim.
    evicts = True
    #: The registry name.
    name = ''

    def __init__(self):
        self._rank: Dict[Hashable, float] = {}
        self._last_use: Dict[Hashable, float] = {}
        self._held: Dict[Hashable, int] = {}
        self._heap: List[tuple] = []  # (-rank, item); outdated entries stay

    def __contains__(self, item) -> bool:
        return item in self._rank

    def __len__(self) -> int:
        return len(self._rank)

    @property
    def heap_size(self) -> int:
        """Entries in the internal heap (bounded by about twice :func:`len`)."""
        return len(self._heap)

    def _rank_for(self, now: float, next_use: float) -> float:
        raise NotImplementedError

    def _admits(self, victim_rank: float, incoming_next_use: float) -> bool:
        """Whether dropping an item of ``victim_rank`` is worth it for the newcomer."""
        return True

    def hold(self, item, now: float):
        """Records that ``item`` is stored for the access ``now``, not done yet.

        It is not offered as a victim until :meth:`use` ends the hold.
        """
        self._held[item] = self._held.get(item, 0) + 1
        if item not in self._rank:  # ranked (and offered) once its hold ends
            self._rank[item] = self._rank_for(now, NEVER)

    def use(self, item, now: float, next_use: float):
        """Records that ``item`` is stored and used at ``now``, next at ``next_use``.

        Ends one :meth:`hold`, if any.  Uses may be reported out of order (the
        examples of a shared item load in parallel): a use earlier than one
        already reported only ends its hold.

        Args:
            item: The item (stored already, or just admitted).
            now: The number of this access in the access sequence.
            next_use: The number of its next access (:data:`NEVER` if none
                is known).
        """
        holds = self._held.get(item, 0)
        if holds > 1:
            self._held[item] = holds - 1
        else:
            self._held.pop(item, None)
        if now < self._last_use.get(item, -NEVER):
            self._set_rank(item, self._rank[item])  # re-offer it if it was held
            return
        self._last_use[item] = now
        self._set_rank(item, self._rank_for(now, next_use))

    def remove(self, item):
        """Forgets ``item`` (it was dropped, or its copy failed)."""
        self._rank.pop(item, None)
        self._last_use.pop(item, None)
        self._held.pop(item, None)
        self._compact_if_needed()

    def forget_next_uses(self):
        """Releases every hold and marks every next use unknown (the order was reset)."""
        self._held.clear()
        self._last_use.clear()
        for item, rank in list(self._rank.items()):
            self._set_rank(item, self._forgotten_rank(rank))

    def _forgotten_rank(self, rank: float) -> float:
        return rank

    def victim(self, incoming_next_use: float) -> Optional[Hashable]:
        """The item to drop to make room for one next used at ``incoming_next_use``.

        Returns:
            The item (still in the set: call :meth:`remove` once it is
            dropped), or ``None`` when nothing should be dropped, so the
            newcomer is not stored.
        """
        if not self.evicts:
            return None
        while self._heap:
            negative, item = self._heap[0]
            if self._rank.get(item) != -negative or item in self._held:
                heapq.heappop(self._heap)  # outdated, or held: use() re-adds
                continue
            return item if self._admits(-negative, incoming_next_use) else None
        return None

    def _set_rank(self, item, rank: float):
        self._rank[item] = rank
        if self.evicts:
            heapq.heappush(self._heap, (-rank, item))
            self._compact_if_needed()

    def _compact_if_needed(self):
        if len(self._heap) > 2 * len(self._rank) + 64:
            self._heap = [(-rank, item) for item, rank in self._rank.items()
                          if item not in self._held]
            heapq.heapify(self._heap)


STRATEGIES: Dict[str, Callable[[], EvictionStrategy]] = {}


def register(cls):
    """Class decorator: makes a strategy available by its ``name``."""
    STRATEGIES[cls.name] = cls
    return cls


@register
class Belady(EvictionStrategy):
    """Drops the item needed farthest in the future; bypasses a newcomer needed last."""

    name = 'belady'

    def _rank_for(self, now, next_use):
        return next_use

    def _admits(self, victim_rank, incoming_next_use):
        return victim_rank > incoming_next_use

    def _forgotten_rank(self, rank):
        return NEVER


@register
class LeastRecentlyUsed(EvictionStrategy):
    """Drops the item used longest ago."""

    name = 'lru'

    def _rank_for(self, now, next_use):
        return -now


@register
class FillOnce(EvictionStrategy):
    """Keeps the first items that fit and never drops one."""

    name = 'fill_once'
    evicts = False

    def _rank_for(self, now, next_use):
        return 0.0


def make_strategy(name: str) -> EvictionStrategy:
    """A new strategy object by registry name.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError('unknown eviction policy {!r}; known: {}'.format(
            name, ', '.join(STRATEGIES))) from None


def next_use(accesses: Sequence[Hashable]) -> List[float]:
    """For each position, the position of the next access to the same item.

    Args:
        accesses: Item ids in access order.

    Returns:
        A list as long as ``accesses``; :data:`NEVER` where the item is not
        used again.
    """
    following = [NEVER] * len(accesses)
    seen = {}
    for position in range(len(accesses) - 1, -1, -1):
        item = accesses[position]
        following[position] = seen.get(item, NEVER)
        seen[item] = position
    return following


def simulate(accesses: Sequence[Hashable], sizes: Mapping[Hashable, int],
             capacity: int, policy: str) -> List[bool]:
    """Replays ``accesses`` through a store of ``capacity`` bytes.

    An access is a hit when the item is stored at that moment; on a miss the
    item is read from shared storage and the policy decides whether to store
    it and what to drop.  The stored bytes never exceed ``capacity``; an item
    larger than ``capacity`` is never stored.

    Args:
        accesses: Item ids in access order (e.g. several epochs of indices).
        sizes: Bytes of each item.
        capacity: Bytes the store may hold.
        policy: A name in :data:`STRATEGIES`.

    Returns:
        One bool per access: ``True`` if it was served from the store.

    Raises:
        ValueError: unknown policy.
    """
    strategy = make_strategy(policy)
    following = next_use(accesses)
    used = 0
    hits = []
    for now, item in enumerate(accesses):
        hit = item in strategy
        hits.append(hit)
        if not hit:
            if sizes[item] > capacity or (
                    isinstance(strategy, Belady) and following[now] == NEVER):
                continue  # cannot be stored, or not worth storing
            while used + sizes[item] > capacity:
                victim = strategy.victim(following[now])
                if victim is None:
                    break
                strategy.remove(victim)
                used -= sizes[victim]
            if used + sizes[item] > capacity:
                continue  # bypass
            used += sizes[item]
        strategy.use(item, now, following[now])
    return hits
