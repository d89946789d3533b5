"""The epoch plan: every example exactly once per epoch through any change.

Pure: a simulated group consumes its batches in lockstep from the plan, and
at random iterations of random epochs members join, leave, are shrunk away
or the job restarts from a snapshot at another size.  Each example is
counted every time a member's batch takes it, epoch by epoch.
"""
from collections import defaultdict

import chainer
import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chainer_prefetch import PrefetchMultiprocessIterator
from chainer_prefetch.iterators.planned_iterator import PlannedIterator
from chainer_prefetch.policy.epoch_plan import (
    EpochPlan,
    RankOrderSampler,
    deal,
    held_masks,
    plan_rest,
    replan,
    shard_bounds,
    start_plan,
)


def consume(plan, begin, end, counts, sizes):
    """Counts the examples of updates ``begin + 1 .. end`` of ``plan``,
    member by member, taking each batch from the member's own sequence
    across epoch boundaries (as Chainer's iterators fill a batch); notes
    the group's size in every epoch it trains in."""
    orders = {}  # member -> (epoch, order), advanced one epoch at a time

    def sequence(member, epoch):
        known, order = orders.get(member, (plan.epoch, plan.orders[member]))
        sampler = RankOrderSampler(plan.seed, member)
        for _ in range(epoch - known):
            order = sampler(order, 0)
        orders[member] = epoch, order
        return plan.shards[member][order]

    for iteration in range(begin, end):
        for member in range(plan.size):
            epoch, position = plan.where(iteration)
            need = plan.batch_size
            while need:
                taken = sequence(member, epoch)[position:position + need]
                numpy.add.at(counts[epoch], taken, 1)
                sizes[epoch].add(plan.size)
                need -= len(taken)
                epoch, position = epoch + 1, 0


class Run:
    """A simulated job: members with localities, a plan, counts per epoch."""

    def __init__(self, n, size, batch, seed=3):
        self.n = n
        self.plan = start_plan(n, size, seed, batch)
        self.places = ['node{}'.format(m) for m in range(size)]
        self.next_place = size
        self.iteration = 0
        self.counts = defaultdict(lambda: numpy.zeros(n, dtype=int))
        self.changes = defaultdict(list)  # epoch -> new sizes
        self.sizes = defaultdict(set)  # epoch -> sizes it trained at

    def train(self, updates):
        consume(self.plan, self.iteration, self.iteration + updates,
                self.counts, self.sizes)
        self.iteration += updates

    def change(self, kind, member=0):
        """``join``, ``leave`` (member ``member`` is lost: elastic leave or
        ULFM shrink) or ``restart`` (a new job of ``member + 1`` members
        with nothing held)."""
        places = list(self.places)
        if kind == 'join':
            places.append('node{}'.format(self.next_place))
            self.next_place += 1
        elif kind == 'leave':
            if len(places) == 1:
                return
            del places[member % len(places)]
        size = len(places) if kind != 'restart' else member % 4 + 1
        if size > self.n:
            return
        held = (held_masks(self.plan, self.places, places)
                if kind != 'restart' else None)
        epoch, _ = self.plan.where(self.iteration)
        self.plan = replan(self.plan, self.iteration, size, held)
        if kind == 'restart':
            places = ['node{}'.format(self.next_place + m)
                      for m in range(size)]
            self.next_place += size
        self.places = places
        self.changes[epoch].append(size)

    def check(self):
        """Every finished epoch: each example at least once, and no more
        repeats than the padding rule allows."""
        last, _ = self.plan.where(self.iteration)
        for epoch in range(last):
            counts = self.counts[epoch]
            assert (counts >= 1).all(), 'epoch {}: {} never used'.format(
                epoch, numpy.flatnonzero(counts == 0))
            repeats = int(counts.sum()) - self.n
            if not self.changes[epoch]:
                continue
            # The padding of the plan the epoch started with, and the
            # shorter parts of the rest at each change.
            bound = sum(size - 1 for size in self.changes[epoch]) + \
                max(self.sizes[epoch]) - 1
            assert repeats <= bound, (epoch, repeats, bound)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 90), size=st.integers(1, 4),
       batch=st.integers(1, 9),
       steps=st.lists(st.tuples(st.integers(0, 30),
                                st.sampled_from(['join', 'leave', 'restart']),
                                st.integers(0, 7)), max_size=6),
       tail=st.integers(0, 60))
def test_every_example_once_per_epoch_through_any_changes(
        n, size, batch, steps, tail):
    if size > n:
        size = n
    run = Run(n, size, batch)
    for updates, kind, member in steps:
        run.train(updates)
        run.change(kind, member)
    run.train(tail)
    run.check()


@pytest.mark.parametrize('n,size', [(480, 3), (480, 2), (10, 3), (7, 4)])
def test_an_epoch_without_change_repeats_only_the_padding(n, size):
    run = Run(n, size, batch=5)
    run.train(3 * -(-n // size) // 5 + 2)
    length = -(-n // size)
    for epoch in range(2):
        counts = run.counts[epoch]
        assert (counts >= 1).all() and counts.max() <= 2
        assert counts.sum() - n == size * length - n


def test_the_start_is_scatter_datasets_split():
    plan = start_plan(10, 3, seed=5, batch_size=2)
    order = numpy.random.RandomState(5).permutation(10)
    for rank in range(3):
        begin, end = shard_bounds(10, 3, rank)
        numpy.testing.assert_array_equal(plan.shards[rank],
                                         order[begin:end])


def test_a_join_then_a_loss_keeps_every_example_in_one_shard():
    """The case that lost 80 of 480 examples for the rest of the run: two
    members, a third joins, then one of the first two is lost."""
    run = Run(480, 2, batch=8)
    run.train(15)
    run.change('join')
    run.train(20)
    run.change('leave', member=0)
    run.train(200)
    run.check()
    last, _ = run.plan.where(run.iteration)
    for epoch in range(2, last):
        counts = run.counts[epoch]
        assert (counts == 1).all(), epoch
    shards = numpy.concatenate(run.plan.shards)
    assert len(numpy.unique(shards)) == 480


def test_a_change_mid_epoch_keeps_the_rest_of_each_survivors_part():
    """What a survivor had still to consume stays with it where the sizes
    allow (its local copies are staged), and a joiner takes only its part."""
    run = Run(480, 2, batch=8)
    run.train(10)  # 80 of 240 per member consumed
    before = run.plan
    epoch, consumed = before.consumed(run.iteration)
    run.change('join')
    after = run.plan
    for member in (0, 1):
        own_rest = set(before.sequence_of(member, epoch)[80:])
        new_rest = set(after.shards[member][after.position:])
        assert new_rest <= own_rest
    joiner = after.shards[2][after.position:]
    # 320 left over 3: the joiner's part of 106 takes a consumed example
    # (counted padding) to make 107 like the others.
    assert consumed[joiner].sum() == 1 and len(set(joiner)) == 107
    # The next epoch: the old members keep what they held.
    for member in (0, 1):
        assert numpy.isin(after.shards[member], before.shards[member]).all()


@pytest.mark.parametrize('n,old,new', [(100, 4, 2), (100, 2, 4), (101, 3, 4),
                                       (7, 1, 3)])
def test_a_new_epoch_keeps_local_copies_local(n, old, new):
    """Re-split at an epoch boundary: every member first takes what its
    node holds, as far as the equal lengths allow."""
    before = start_plan(n, old, 0, 4)
    places = ['node{}'.format(r) for r in range(old)]
    new_places = ['node{}'.format(r) for r in range(new)]
    held = held_masks(before, places, new_places)
    iteration = -(-n // old)  # batch 4: four epochs later, at a boundary
    after = replan(before, iteration, new, held)
    plain = replan(before, iteration, new)
    assert after.position == 0 and after.length == -(-n // new)
    assert set(numpy.concatenate(after.shards)) == set(range(n))
    kept = [int(held[r][after.shards[r]].sum()) if held[r] is not None
            else 0 for r in range(new)]
    plain_kept = [int(held[r][plain.shards[r]].sum()) if held[r] is not None
                  else 0 for r in range(new)]
    best = sum(min(int(held[r].sum()), n // new)
               for r in range(min(old, new)))
    assert sum(kept) >= best and sum(kept) >= sum(plain_kept)


def test_members_of_one_node_share_its_copies():
    before = start_plan(100, 2, 0, 5, shuffle=False)  # node n0 holds 0..49
    held = held_masks(before, ['n0', 'n1'], ['n0', 'n0', 'n2', 'n2'])
    after = replan(before, 20, 4, held)  # at the start of epoch 2
    kept = [int(held[r][after.shards[r]].sum()) if held[r] is not None
            else 0 for r in range(4)]
    assert kept == [25, 25, 0, 0]


def test_deal_is_a_partition_that_prefers_what_is_held():
    items = numpy.arange(20)
    held = [numpy.zeros(20, bool), numpy.zeros(20, bool)]
    held[0][[1, 2, 3]] = True
    held[1][[2, 3, 4, 5]] = True  # 2 and 3 held by both: one takes them
    parts = deal(items, [10, 10], held)
    assert sorted(numpy.concatenate(parts).tolist()) == list(range(20))
    assert {1, 2, 3} <= set(parts[0].tolist())
    assert {4, 5} <= set(parts[1].tolist())
    with pytest.raises(ValueError, match='add up'):
        deal(items, [10, 9])


def test_plan_round_trips_through_arrays():
    plan = replan(start_plan(50, 3, 1, 4), 5, 2)
    again = EpochPlan.from_arrays(plan.to_arrays())
    assert again.where(9) == plan.where(9)
    for member in range(2):
        numpy.testing.assert_array_equal(again.sequence_of(member, 3),
                                         plan.sequence_of(member, 3))
    numpy.testing.assert_array_equal(again.consumed(7)[1],
                                     plan.consumed(7)[1])


def test_too_few_examples_for_the_size_are_named():
    with pytest.raises(ValueError, match='cannot split 2 examples over 3'):
        plan_rest(2, 0, 1, 0, 0, numpy.zeros(2, bool), 3)


def serial(shard, order_sampler):
    return chainer.iterators.SerialIterator(shard, 3,
                                            order_sampler=order_sampler)


def prefetching(shard, order_sampler):
    return PrefetchMultiprocessIterator(shard, 3, n_processes=1,
                                        order_sampler=order_sampler)


@pytest.mark.parametrize('make', [serial, prefetching])
@pytest.mark.parametrize('change', [None, 'rest'])
def test_an_iterator_follows_the_plan(make, change):
    """A member's PlannedIterator (over Chainer's SerialIterator or ours)
    yields exactly the plan's sequences, across epochs."""
    plan = start_plan(23, 2, seed=4, batch_size=3)
    if change:
        plan = replan(plan, 5, 3)
    for member in range(plan.size):
        iterator = PlannedIterator(numpy.arange(23), make, plan, member)
        try:
            seen = numpy.concatenate([iterator.next() for _ in range(30)])
        finally:
            iterator.finalize()
        assert iterator.iteration == plan.iteration + 30
        expected = numpy.concatenate(
            [plan.sequence_of(member, plan.epoch)[plan.position:]]
            + [plan.sequence_of(member, e)
               for e in range(plan.epoch + 1, plan.epoch + 15)])[:90]
        numpy.testing.assert_array_equal(seen, expected)


def _snapshot(iterator):
    serializer = chainer.serializers.DictionarySerializer()
    iterator.serialize(serializer)
    return serializer.target


@pytest.mark.parametrize('size', [3, 2, 4])
def test_a_snapshot_resumes_the_group_at_any_size(size):
    """Rank 0's snapshot after 7 updates of 3 ranks (epoch 1) resumes a
    group of ``size``: what they train on next is exactly what the three
    had not used of the epoch."""
    ranks = [PlannedIterator.start(numpy.arange(50), serial, 3, 3, rank,
                                   seed=2) for rank in range(3)]
    # 17 examples per rank and epoch: 7 batches of 3 are epoch 0 and the
    # first 4 of epoch 1.
    streams = [numpy.concatenate([iterator.next() for _ in range(7)])
               for iterator in ranks]
    used = numpy.zeros(50, bool)
    for stream in streams:
        used[stream[17:]] = True
    state = _snapshot(ranks[0])
    resumed = [PlannedIterator.start(numpy.arange(50), serial, 3, size, rank)
               for rank in range(size)]
    for iterator in resumed:
        iterator.serialize(chainer.serializers.NpzDeserializer(state))
    assert resumed[0].iteration == 7 and resumed[0].epoch == 1
    rest = []
    for iterator in resumed:
        while iterator.epoch == 1:
            batch = iterator.next()
            if iterator.epoch == 2:  # the batch crossed into epoch 2
                batch = batch[:len(batch) - iterator.current_position]
            rest.extend(batch)
    counts = numpy.bincount(rest, minlength=50) + used
    assert (counts >= 1).all() and (counts - 1).sum() <= size - 1


def test_a_snapshot_that_cannot_be_resumed_says_why():
    iterator = PlannedIterator.start(numpy.arange(5), serial, 3, 3, 0)
    state = _snapshot(iterator)
    big = PlannedIterator.start(numpy.arange(6), serial, 3, 2, 0)
    with pytest.raises(ValueError, match='dataset of 5 examples, this job '
                                         'has 6'):
        big.serialize(chainer.serializers.NpzDeserializer(state))
    chainers = _snapshot(chainer.iterators.SerialIterator(numpy.arange(5),
                                                          3))
    with pytest.raises(ValueError, match='written by another iterator'):
        iterator.serialize(chainer.serializers.NpzDeserializer(chainers))


def test_reset_goes_back_to_the_start_of_the_plan():
    iterator = PlannedIterator.start(numpy.arange(20), serial, 3, 2, 1, seed=5)
    first = iterator.next()
    iterator.next()
    iterator.reset()
    assert iterator.iteration == 0 and iterator.epoch == 0
    numpy.testing.assert_array_equal(iterator.next(), first)
    with pytest.raises(ValueError, match='the plan is of 20 examples, the '
                                         'dataset has 21'):
        PlannedIterator(numpy.arange(21), serial, iterator.plan, 0)
