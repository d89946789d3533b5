"""Eviction policies of a capacity-limited local store, and future uses: pure code."""
import numpy
import pytest

from chainer_prefetch.policy import (
    NEVER,
    STRATEGIES,
    FutureUses,
    NextEpochCache,
    make_strategy,
    register,
    simulate,
)
from chainer_prefetch.policy.eviction import EvictionStrategy, next_use

UNIT = {item: 1 for item in 'abcde'}


def test_next_use_positions():
    assert next_use('abacb') == [2, 4, float('inf'), float('inf'),
                                 float('inf')]


@pytest.mark.parametrize('policy, expected', [
    # capacity 2, a b c a b c:
    # LRU: every access misses (c evicts a, a evicts b, b evicts c).
    ('lru', [False] * 6),
    # Belady: c is needed last, so it bypasses; a and b hit.
    ('belady', [False, False, False, True, True, False]),
    # fill-once keeps a and b for good.
    ('fill_once', [False, False, False, True, True, False]),
])
def test_hand_computed_cycle(policy, expected):
    assert simulate('abcabc', UNIT, 2, policy) == expected


def test_belady_evicts_the_farthest_next_use():
    # capacity 2, a b c b c a: at c, a is next used at 5, b at 3, c at 4,
    # so a goes and c is stored; b and c hit, a misses.  Fill-once keeps a
    # and b instead: b and a hit, c misses.  An item never used again is not
    # stored at all (a b c b a: c bypasses, b and a hit).
    assert simulate('abcbca', UNIT, 2, 'belady') == \
        [False, False, False, True, True, False]
    assert simulate('abcbca', UNIT, 2, 'fill_once') == \
        [False, False, False, True, False, True]
    assert simulate('abcba', UNIT, 2, 'belady') == \
        [False, False, False, True, True]


def test_sizes_are_respected():
    sizes = {'a': 3, 'b': 2, 'c': 2}
    # capacity 4: a (3) and b (2) never fit together.
    assert simulate('abab', sizes, 4, 'lru') == [False] * 4
    assert simulate('abab', sizes, 4, 'fill_once') == \
        [False, False, True, False]
    hits = simulate('abab', sizes, 4, 'belady')
    assert sum(hits) == 1


def test_an_item_larger_than_the_capacity_is_never_stored():
    hits = simulate('abab', {'a': 5, 'b': 1}, 4, 'belady')
    assert hits == [False, False, False, True]
    with pytest.raises(ValueError, match='unknown eviction policy.*belady'):
        simulate('ab', UNIT, 4, 'fifo')


def test_strategies_come_from_a_registry():
    assert set(STRATEGIES) >= {'belady', 'lru', 'fill_once'}

    @register
    class MostRecentlyUsed(EvictionStrategy):
        name = 'test_mru'

        def _rank_for(self, now, next_use):
            return now

    try:
        hits = simulate('abcabc', UNIT, 2, 'test_mru')
        assert hits == [False, False, False, True, False, True]
    finally:
        del STRATEGIES['test_mru']


def _random_epochs(n_items, n_epochs, seed=0):
    random = numpy.random.RandomState(seed)
    return [int(i) for _ in range(n_epochs)
            for i in random.permutation(n_items)]


@pytest.mark.parametrize('fraction', [0.25, 0.5, 0.75])
def test_random_epochs_local_share(fraction):
    """Steady-state share of reads served locally, epochs 2-5 of 5.

    The best any policy can do in a fresh random epoch is about the share of
    the dataset it holds.  Belady comes close; fill-once holds exactly that
    share; LRU, which drops what was used longest ago, keeps much less.
    """
    n_items, n_epochs = 2000, 5
    accesses = _random_epochs(n_items, n_epochs)
    sizes = {item: 1 for item in range(n_items)}
    capacity = int(fraction * n_items)
    shares = {}
    for policy in ('belady', 'lru', 'fill_once'):
        hits = simulate(accesses, sizes, capacity, policy)
        later = hits[n_items:]
        shares[policy] = sum(later) / len(later)
    assert shares['fill_once'] == pytest.approx(fraction)
    assert shares['belady'] >= fraction - 0.05, shares
    assert shares['lru'] < fraction - 0.15, shares


def test_resident_set_belady_offers_the_farthest_and_bypasses():
    resident = make_strategy('belady')
    resident.use('a', now=0, next_use=10)
    resident.use('b', now=1, next_use=5)
    resident.use('c', now=2, next_use=NEVER)
    assert resident.victim(incoming_next_use=3) == 'c'
    resident.remove('c')
    assert resident.victim(incoming_next_use=3) == 'a'
    # Needed after everything stored: the newcomer is the one left out.
    assert resident.victim(incoming_next_use=11) is None
    resident.use('a', now=10, next_use=12)  # used again: ranked anew
    assert resident.victim(incoming_next_use=6) == 'a'


def test_resident_set_lru_and_fill_once():
    lru = make_strategy('lru')
    for now, item in enumerate('abc'):
        lru.use(item, now=now, next_use=NEVER)
    lru.use('a', now=3, next_use=NEVER)
    assert lru.victim(incoming_next_use=0) == 'b'
    fill_once = make_strategy('fill_once')
    fill_once.use('a', now=0, next_use=1)
    assert fill_once.victim(incoming_next_use=100) is None


def test_resident_set_forget_next_uses_makes_everything_evictable():
    resident = make_strategy('belady')
    resident.use('a', now=0, next_use=2)
    assert resident.victim(incoming_next_use=5) is None
    resident.forget_next_uses()
    assert resident.victim(incoming_next_use=5) == 'a'


def test_future_uses_across_the_epoch_boundary():
    future = FutureUses(epoch_size=4)
    future.add_epoch(0, [2, 0, 3, 1])
    future.add_epoch(1, [1, 3, 0, 2])
    # index 0: position 1 of epoch 0 (access 1), then position 2 of epoch 1.
    assert future.following_use(0, after=0) == 1
    assert future.following_use(0, after=1) == 4 + 2
    assert future.following_use(2, after=0) == 4 + 3
    assert future.following_use(2, after=5) == 7
    # Epoch 2 is not drawn yet.
    assert future.following_use(1, after=4) == NEVER
    future.add_epoch(2, [0, 1, 2, 3])
    assert future.following_use(1, after=4) == 9
    future.add_epoch(3, [0, 1, 2, 3])
    future.add_epoch(4, [0, 1, 2, 3])
    assert future.following_use(0, after=0) == NEVER  # epoch 0 forgotten


def test_future_uses_of_items_shared_by_examples():
    # Examples 0-2 read item 0, examples 3-5 item 1 (say two row groups).
    future = FutureUses(epoch_size=6, item_of=numpy.array([0, 0, 0, 1, 1, 1]))
    future.add_epoch(0, [3, 0, 4, 1, 5, 2])
    future.add_epoch(1, [0, 1, 2, 3, 4, 5])
    assert future.following_use(0, after=1) == 3
    assert future.following_use(0, after=5) == 6  # epoch 1, position 0
    assert future.following_use(1, after=4) == 6 + 3


def test_future_uses_of_an_order_with_repeats():
    future = FutureUses(epoch_size=4)
    future.add_epoch(0, [1, 1, 0, 1])  # a sampler may repeat indices
    assert future.following_use(1, after=0) == 1
    assert future.following_use(1, after=1) == 3
    assert future.following_use(0, after=2) == NEVER


@pytest.mark.parametrize('seed', range(7))
def test_future_uses_equal_a_scan_of_the_orders(seed):
    # Orders with repeats and items shared by examples (the bisections of
    # the sorted form), and permutations (its inverse form), also of items
    # numbered apart from the examples, one each (seeds 5, 6).
    random = numpy.random.RandomState(seed)
    size = 12
    item_of = (random.permutation(size) if seed >= 5
               else random.randint(0, 4, size) if seed % 2 else None)
    future = FutureUses(epoch_size=size, item_of=item_of)
    orders = [random.randint(0, size, size) if seed < 3
              else random.permutation(size) for _ in range(2)]
    for epoch, order in enumerate(orders):
        future.add_epoch(epoch, order)
    accessed = numpy.concatenate(orders)
    if item_of is not None:
        accessed = item_of[accessed]
    for item in range(size):
        for after in range(2 * size):
            later = numpy.flatnonzero(accessed[after + 1:] == item)
            expected = after + 1 + int(later[0]) if len(later) else NEVER
            assert future.following_use(item, after) == expected


@pytest.mark.parametrize('policy', ['belady', 'lru'])
def test_bookkeeping_is_bounded_by_what_is_stored_over_100_epochs(policy):
    """Memory follows the stored items, not the accesses (500 of 1,000 stored)."""
    n_items, capacity = 1000, 500
    strategy = make_strategy(policy)
    future = FutureUses(epoch_size=n_items)
    cache = NextEpochCache(max_examples=50)
    random = numpy.random.RandomState(0)
    orders = [random.permutation(n_items) for _ in range(101)]
    future.add_epoch(0, orders[0])
    for epoch in range(100):
        future.add_epoch(epoch + 1, orders[epoch + 1])
        cache.plan(epoch + 1, orders[epoch + 1])
        cache.forget_before(epoch)
        for position, item in enumerate(orders[epoch]):
            item = int(item)
            now = epoch * n_items + position
            following = future.following_use(item, now)
            cache.take(item, epoch)
            cache.offer(item, epoch + 1, object(), 1)
            if item not in strategy:
                if len(strategy) == capacity:
                    victim = strategy.victim(now)
                    if victim is None:
                        continue
                    strategy.remove(victim)
            strategy.use(item, now, following)
        assert len(strategy) <= capacity
        assert strategy.heap_size <= 2 * len(strategy) + 64
        assert cache.heap_size <= 2 * 50 + 64
        assert len(future._epochs) <= 3
