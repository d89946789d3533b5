"""Reshuffling across ranks each epoch: exact coverage, the single order, holders, resume."""
import chainer
import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chainer_prefetch import PrefetchMultiprocessIterator, ShuffleAcrossRanks
from helpers import FileBytes


def job_orders(n, size, seed, epoch):
    return [ShuffleAcrossRanks(n, rank, size, seed).order(epoch)
            for rank in range(size)]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), size=st.integers(1, 9), seed=st.integers(0, 99),
       epoch=st.integers(0, 5))
def test_every_example_once_per_epoch_across_the_job_but_the_padding(
        n, size, seed, epoch):
    if n < size:
        with pytest.raises(ValueError, match='cannot split'):
            ShuffleAcrossRanks(n, 0, size, seed)
        return
    orders = job_orders(n, size, seed, epoch)
    length = -(-n // size)
    assert all(len(order) == length for order in orders)
    counts = numpy.bincount(numpy.concatenate(orders), minlength=n)
    assert counts.min() == 1
    assert (counts == 2).sum() == size * length - n
    assert counts.max() <= 2


@settings(max_examples=40, deadline=None)
@given(n=st.integers(8, 300), size=st.integers(1, 6), batch=st.integers(1, 7),
       seed=st.integers(0, 99), epoch=st.integers(0, 3))
def test_each_update_of_the_job_is_a_batch_of_the_single_process_order(
        n, size, batch, seed, epoch):
    if n < size:
        return
    orders = job_orders(n, size, seed, epoch)
    single = ShuffleAcrossRanks(n, 0, 1, seed).order(epoch)
    padded = numpy.concatenate([single, single[:size * len(orders[0]) - n]])
    for update in range(-(-len(orders[0]) // batch)):
        taken = numpy.concatenate([order[update * batch:(update + 1) * batch]
                                   for order in orders])
        expected = padded[update * batch * size:(update + 1) * batch * size]
        assert sorted(taken) == sorted(expected)


def test_orders_differ_by_epoch_and_are_fixed_by_the_seed():
    a = ShuffleAcrossRanks(100, 1, 4, seed=5)
    b = ShuffleAcrossRanks(100, 1, 4, seed=5)
    assert numpy.array_equal(a.order(3), b.order(3))
    assert not numpy.array_equal(a.order(3), a.order(4))
    assert not numpy.array_equal(a.order(3), ShuffleAcrossRanks(
        100, 1, 4, seed=6).order(3))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 120), size=st.integers(1, 6), epoch=st.integers(0, 4))
def test_holders_are_the_ranks_whose_order_has_the_example(n, size, epoch):
    if n < size:
        return
    orders = job_orders(n, size, 0, epoch)
    sampler = ShuffleAcrossRanks(n, 0, size, 0)
    for index in range(n):
        assert sorted(sampler.holders(index, epoch)) == sorted(
            rank for rank in range(size) if index in orders[rank])
    with pytest.raises(IndexError):
        sampler.holders(n, epoch)


def test_the_sampler_follows_the_orders_chainer_passes_it():
    sampler = ShuffleAcrossRanks(50, 2, 3, seed=1)
    order = sampler(numpy.arange(50), 0)
    assert numpy.array_equal(order, sampler.order(0))
    for epoch in range(1, 4):
        order = sampler(order, 17)
        assert numpy.array_equal(order, sampler.order(epoch))


def test_an_order_it_did_not_draw_is_found_by_its_epoch_or_refused():
    drawn = ShuffleAcrossRanks(40, 1, 2, seed=9).order(6)
    fresh = ShuffleAcrossRanks(40, 1, 2, seed=9)
    assert numpy.array_equal(fresh(drawn, 0), fresh.order(7))
    with pytest.raises(ValueError, match='did not draw'):
        ShuffleAcrossRanks(40, 1, 2, seed=10)(drawn, 0)


@pytest.mark.parametrize('size', [1, 3])
def test_iterator_resumed_from_a_snapshot_goes_on_with_the_same_examples(
        tmp_path, size):
    dataset = numpy.arange(31, dtype=numpy.int64)

    def sequences(iterator, batches):
        return [list(iterator.next()) for _ in range(batches)]

    for rank in range(size):
        first = PrefetchMultiprocessIterator(
            dataset, 4, order_sampler=ShuffleAcrossRanks(31, rank, size, 2),
            n_processes=1)
        sequences(first, 9)
        path = str(tmp_path / 'snapshot{}.npz'.format(rank))
        chainer.serializers.save_npz(path, first)
        expected = sequences(first, 12)
        epoch_after = first.epoch
        first.finalize()
        resumed = PrefetchMultiprocessIterator(
            dataset, 4, order_sampler=ShuffleAcrossRanks(31, rank, size, 2),
            n_processes=1)
        chainer.serializers.load_npz(path, resumed)
        assert sequences(resumed, 12) == expected
        assert resumed.epoch == epoch_after
        resumed.finalize()


def test_a_chainer_iterator_uses_it_too():
    sampler = ShuffleAcrossRanks(20, 0, 2, seed=4)
    iterator = chainer.iterators.SerialIterator(
        numpy.arange(20), 5, order_sampler=sampler)
    taken = [int(x) for _ in range(4) for x in iterator.next()]
    assert iterator.epoch == 2
    assert taken == list(sampler.order(0)) + list(sampler.order(1))


def test_every_rank_resumes_its_own_order_from_rank_0s_snapshot(tmp_path):
    dataset = numpy.arange(30, dtype=numpy.int64)
    path = str(tmp_path / 'rank0.npz')
    rank0 = PrefetchMultiprocessIterator(
        dataset, 5, order_sampler=ShuffleAcrossRanks(30, 0, 3, 1),
        n_processes=1)
    for _ in range(3):
        rank0.next()
    chainer.serializers.save_npz(path, rank0)
    rank0.finalize()
    sampler = ShuffleAcrossRanks(30, 2, 3, 1)
    rank2 = PrefetchMultiprocessIterator(dataset, 5, order_sampler=sampler,
                                         n_processes=1)
    chainer.serializers.load_npz(path, rank2)
    assert (rank2.epoch, rank2.current_position) == (1, 5)
    assert list(rank2.next()) == list(sampler.order(1)[5:10])
    rank2.finalize()


def test_another_number_of_ranks_resumes_at_an_epochs_end_only(tmp_path):
    dataset = numpy.arange(30, dtype=numpy.int64)
    saved = {}
    for name, batches in (('end', 2), ('inside', 3)):
        iterator = PrefetchMultiprocessIterator(
            dataset, 5, order_sampler=ShuffleAcrossRanks(30, 0, 3, 1),
            n_processes=1)
        for _ in range(batches):
            iterator.next()
        saved[name] = str(tmp_path / (name + '.npz'))
        chainer.serializers.save_npz(saved[name], iterator)
        iterator.finalize()
    sampler = ShuffleAcrossRanks(30, 1, 2, 1)  # 2 ranks: 15 per epoch
    resumed = PrefetchMultiprocessIterator(dataset, 5, order_sampler=sampler,
                                           n_processes=1)
    chainer.serializers.load_npz(saved['end'], resumed)
    assert list(resumed.next()) == list(sampler.order(1)[:5])
    with pytest.raises(ValueError, match='another number of ranks'):
        chainer.serializers.load_npz(saved['inside'], resumed)
    resumed.finalize()


def test_the_iterator_counts_each_epoch_of_a_rank_by_its_own_length(tmp_path):
    """An epoch of a rank is ceil(n / size) accesses, not len(dataset): the
    batches that cross an epoch's end count each example in its epoch."""
    paths = []
    for i in range(30):
        path = tmp_path / 'shared' / 'f{:02d}'.format(i)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(bytes([i]) * 10)
        paths.append(str(path))

    sampler = ShuffleAcrossRanks(30, 1, 2, 3)  # 15 per epoch
    iterator = PrefetchMultiprocessIterator(
        FileBytes(paths), 4, order_sampler=sampler, n_processes=1,
        local_dir=str(tmp_path / 'local'))
    taken = []
    while iterator.epoch < 2:
        taken += [batch[0] for batch in iterator.next()]
    by_epoch = iterator.stats['by_epoch']
    iterator.finalize()
    for epoch in (0, 1):
        counts = by_epoch[epoch]
        assert counts['examples_from_local'] + counts['examples_from_source'] \
            == 15
    assert taken[:30] == [i for epoch in (0, 1) for i in sampler.order(epoch)]


def test_a_snapshot_of_another_job_is_refused_by_what_fixes_its_orders(
        tmp_path):
    dataset = numpy.arange(20, dtype=numpy.int64)
    path = str(tmp_path / 'snapshot.npz')
    seven = PrefetchMultiprocessIterator(
        dataset, 2, order_sampler=ShuffleAcrossRanks(20, 0, 7, 1),
        n_processes=1)  # 3 examples per rank and epoch
    seven.next()
    chainer.serializers.save_npz(path, seven)
    seven.finalize()
    for sampler, message in (
            (ShuffleAcrossRanks(20, 0, 8, 1), 'another number of ranks'),
            (ShuffleAcrossRanks(20, 0, 7, 2), 'seed=1')):
        other = PrefetchMultiprocessIterator(dataset, 2, order_sampler=sampler,
                                             n_processes=1)
        with pytest.raises(ValueError, match=message):
            chainer.serializers.load_npz(path, other)
        other.finalize()


def test_a_snapshot_without_peers_loads_into_an_iterator_with_peers(tmp_path):
    """strict=False returns None for what a snapshot lacks."""
    import secrets

    from chainer_prefetch import PeerGroup
    files = tmp_path / 'f'
    files.write_bytes(b'x')
    dataset = numpy.arange(12, dtype=numpy.int64)
    path = str(tmp_path / 'snapshot.npz')
    plain = PrefetchMultiprocessIterator(
        dataset, 3, order_sampler=ShuffleAcrossRanks(12, 0, 2, 1),
        n_processes=1)
    plain.next()
    chainer.serializers.save_npz(path, plain)
    plain.finalize()
    sampler = ShuffleAcrossRanks(12, 0, 2, 1)
    group = PeerGroup([0, 1], 0, {}, secrets.token_bytes(32), sampler.holders)
    with_peers = PrefetchMultiprocessIterator(
        dataset, 3, order_sampler=sampler, n_processes=1, peers=group,
        local_dir=str(tmp_path / 'local'))
    for strict in (True, False):
        chainer.serializers.load_npz(path, with_peers, strict=strict)
        assert with_peers.current_position == 3
    assert group.jobs()['first_epochs'].tolist() == [0]
    with_peers.finalize()
    group.close()
