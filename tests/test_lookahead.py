"""The look-ahead state machine against Chainer's: same indices, same sampler calls."""
import numpy
import pytest
from chainer import serializers
from chainer.iterators import MultiprocessIterator, _statemachine
from chainer.iterators.order_samplers import ShuffleOrderSampler

from chainer_prefetch import PrefetchMultiprocessIterator
from chainer_prefetch.policy import lookahead as _lookahead


class RecordingSampler:
    """A shuffling sampler that records the positions it is called with."""

    def __init__(self, seed):
        self.random = numpy.random.RandomState(seed)
        self.positions = []

    def __call__(self, order, position):
        self.positions.append(position)
        return self.random.permutation(len(order))


@pytest.mark.parametrize('dataset_length, batch_size', [
    (10, 3), (10, 5), (10, 10), (10, 1), (7, 9), (3, 8), (12, 4)])
@pytest.mark.parametrize('repeat', [True, False])
def test_same_indices_and_sampler_calls_as_chainer(dataset_length, batch_size,
                                                   repeat):
    chainer_sampler = RecordingSampler(3)
    ours_sampler = RecordingSampler(3)
    chainer_state = _statemachine.IteratorState(
        0, 0, False, chainer_sampler(numpy.arange(dataset_length), 0))
    ours = _lookahead.initial_state(ours_sampler, dataset_length, batch_size)
    for step in range(25):
        chainer_state, expected = _statemachine.iterator_statemachine(
            chainer_state, batch_size, repeat, chainer_sampler, dataset_length)
        ours, got = _lookahead.lookahead_statemachine(
            ours, batch_size, repeat, ours_sampler, dataset_length)
        if expected is None:
            assert got is None
            break
        numpy.testing.assert_array_equal(got, expected)
        assert tuple(ours[:3]) == tuple(chainer_state[:3])
        numpy.testing.assert_array_equal(ours.order, chainer_state.order)
    # Ours asks for each order earlier, but with the same arguments.
    calls = len(chainer_sampler.positions)
    assert ours_sampler.positions[:calls] == chainer_sampler.positions


def test_next_order_is_the_order_of_the_next_epoch():
    sampler = ShuffleOrderSampler(numpy.random.RandomState(0))
    state = _lookahead.initial_state(sampler, 9, 4)
    announced = state.next_order
    while state.epoch == 0:
        state, _ = _lookahead.lookahead_statemachine(state, 4, True, sampler, 9)
    numpy.testing.assert_array_equal(state.order, announced)
    assert state.next_order is not None


def test_final_position_matches_the_state_machine():
    for length in range(1, 15):
        for batch in range(1, 17):
            for start in range(length):
                position = start
                while position + batch < length:
                    position += batch
                assert _lookahead.final_position(start, batch, length) == position


def test_without_sampler_the_orders_are_the_identity():
    state = _lookahead.initial_state(None, 5, 2)
    assert state.order is None and state.next_order is None
    numpy.testing.assert_array_equal(
        _lookahead.order_of_epoch(state, 1, 5), numpy.arange(5))
    assert _lookahead.order_of_epoch(state, 2, 5) is None


def test_wrong_size_from_the_sampler_is_refused():
    with pytest.raises(ValueError, match='size of order'):
        _lookahead.initial_state(lambda order, position: order[:-1], 5, 2)


def _iterate_indices(iterator, n_batches):
    return [list(map(int, batch)) for _, batch in
            zip(range(n_batches), iterator)]


def test_next_order_survives_a_snapshot_mid_epoch(tmp_path):
    """A resumed iterator uses the saved next order, not a fresh draw."""
    dataset = numpy.arange(10, dtype=numpy.int64)
    seeded = ShuffleOrderSampler(numpy.random.RandomState(5))
    first = PrefetchMultiprocessIterator(dataset, 4, order_sampler=seeded,
                                         n_processes=1)
    try:
        _iterate_indices(first, 1)
        path = str(tmp_path / 'snapshot.npz')
        serializers.save_npz(path, first)
        expected = _iterate_indices(first, 6)  # into epochs 1 and 2
    finally:
        first.finalize()
    other = ShuffleOrderSampler(numpy.random.RandomState(99))
    resumed = PrefetchMultiprocessIterator(dataset, 4, order_sampler=other,
                                           n_processes=1)
    try:
        serializers.load_npz(path, resumed)
        got = _iterate_indices(resumed, 6)
    finally:
        resumed.finalize()
    # Epochs 0 and 1 come from the snapshot; the batch after the one that
    # ends epoch 1 is the first to use the other sampler's draws.
    assert got[:4] == expected[:4]
    # MultiprocessIterator's snapshot has no next order: resumed with the
    # other sampler, its epoch 1 differs.
    chainer_iterator = MultiprocessIterator(
        dataset, 4, order_sampler=ShuffleOrderSampler(
            numpy.random.RandomState(99)), n_processes=1)
    try:
        serializers.load_npz(path, chainer_iterator)
        assert _iterate_indices(chainer_iterator, 4)[2:] != expected[2:4]
    finally:
        chainer_iterator.finalize()
