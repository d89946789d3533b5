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

Each policy here is a pure function over an access sequence: no files, no
threads.  ``simulate`` replays a sequence and says, access by access, whether
the file was local, so the policies can be compared on paper before any of
them moves a byte.

Policies:

* ``'belady'``: farthest next use, with bypass (optimal for equal sizes);
* ``'lru'``: least recently used;
* ``'fill_once'``: keep the first files that fit, never evict (the
  "MinIO" cache of CoorDL).
"""
import collections
import heapq
from typing import Hashable, List, Mapping, Sequence

POLICIES = ('belady', 'lru', 'fill_once')
_NEVER = float('inf')


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


def simulate(accesses: Sequence[Hashable], sizes: Mapping[Hashable, int],
             capacity: int, policy: str) -> List[bool]:
    """Replays ``accesses`` through a cache of ``capacity`` bytes.

    An access is a hit when the item is stored at that moment; on a miss the
    item is read from shared storage and the policy decides whether to store
    it and what to drop.  The stored bytes never exceed ``capacity``.

    Args:
        accesses: Item ids in access order (e.g. several epochs of indices).
        sizes: Bytes of each item.
        capacity: Bytes the cache may hold.
        policy: One of :data:`POLICIES`.

    Returns:
        One bool per access: ``True`` if it was served from the cache.

    Raises:
        ValueError: unknown policy, or an item larger than the capacity.
    """
    if policy not in POLICIES:
        raise ValueError('unknown policy {!r}; known: {}'.format(
            policy, ', '.join(POLICIES)))
    largest = max((sizes[item] for item in set(accesses)), default=0)
    if largest > capacity:
        raise ValueError('capacity {} bytes is smaller than the largest file '
                         '({} bytes)'.format(capacity, largest))
    if policy == 'belady':
        return _belady(accesses, sizes, capacity)
    if policy == 'lru':
        return _lru(accesses, sizes, capacity)
    return _fill_once(accesses, sizes, capacity)


def _belady(accesses, sizes, capacity):
    following = next_use(accesses)
    stored = {}  # item -> its next use
    farthest = []  # heap of (-next use, item); stale entries skipped
    used = 0
    hits = []
    for position, item in enumerate(accesses):
        upcoming = following[position]
        if item in stored:
            hits.append(True)
            stored[item] = upcoming
            heapq.heappush(farthest, (-upcoming, item))
            continue
        hits.append(False)
        if upcoming == _NEVER:
            continue  # not needed again: never worth storing
        size = sizes[item]
        while used + size > capacity:
            negative, victim = heapq.heappop(farthest)
            if stored.get(victim) != -negative:
                continue  # stale entry
            if -negative < upcoming:
                heapq.heappush(farthest, (negative, victim))
                break  # the new item is needed last: bypass it
            del stored[victim]
            used -= sizes[victim]
        if used + size <= capacity:
            stored[item] = upcoming
            used += size
            heapq.heappush(farthest, (-upcoming, item))
    return hits


def _lru(accesses, sizes, capacity):
    stored = collections.OrderedDict()
    used = 0
    hits = []
    for item in accesses:
        if item in stored:
            hits.append(True)
            stored.move_to_end(item)
            continue
        hits.append(False)
        while used + sizes[item] > capacity:
            _, victim_size = stored.popitem(last=False)
            used -= victim_size
        stored[item] = sizes[item]
        used += sizes[item]
    return hits


def _fill_once(accesses, sizes, capacity):
    stored = set()
    used = 0
    hits = []
    for item in accesses:
        if item in stored:
            hits.append(True)
            continue
        hits.append(False)
        if used + sizes[item] <= capacity:
            stored.add(item)
            used += sizes[item]
    return hits
