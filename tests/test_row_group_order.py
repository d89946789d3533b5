"""Tests of the row-group window order sampler (a pure function of its input)."""
import chainer
import numpy as np
import pytest
from chainer import serializers

from chainer_prefetch.datasets import RowGroupWindowOrderSampler, row_groups_per_batch
from chainer_prefetch.datasets.row_group_order import row_group_of_rows

SIZES = [7, 0, 10, 10, 3, 10, 1, 10, 9]


def _epochs(sampler, n_epochs):
    order = np.arange(sum(sampler.row_group_sizes))
    orders = []
    for _ in range(n_epochs):
        order = sampler(order, 0)
        orders.append(order)
    return orders


@pytest.mark.parametrize('window', [1, 2, 3, 4, 9, 20])
def test_every_epoch_is_a_permutation(window):
    sampler = RowGroupWindowOrderSampler(SIZES, window=window, seed=3)
    for order in _epochs(sampler, 4):
        assert sorted(order.tolist()) == list(range(sum(SIZES)))


@pytest.mark.parametrize('window', [1, 2, 4])
def test_rows_are_shuffled_only_within_windows_of_k_row_groups(window):
    sizes = [size for size in SIZES if size]  # every group shows in the order
    sampler = RowGroupWindowOrderSampler(sizes, window=window, seed=5)
    groups_of_rows = row_group_of_rows(sizes)
    for order in _epochs(sampler, 3):
        groups = groups_of_rows[order]
        # Cut the order into windows: each holds whole row groups, at most K.
        seen, position = set(), 0
        while position < len(groups):
            window_groups = set()
            # The window's row groups: the next K groups in first-use order.
            for group in groups[position:]:
                if group not in window_groups:
                    if len(window_groups) == window:
                        break
                    window_groups.add(group)
            rows = sum(sizes[group] for group in window_groups)
            segment = groups[position:position + rows]
            assert set(segment.tolist()) == window_groups
            assert not window_groups & seen
            seen |= window_groups
            position += rows
        assert seen == set(range(len(sizes)))


def test_rows_within_a_window_are_mixed():
    sizes = [50] * 8
    order = RowGroupWindowOrderSampler(sizes, window=4, seed=0)(
        np.arange(400), 0)
    counts = row_groups_per_batch(order, sizes, 25)
    assert counts.mean() > 3  # a batch of 25 draws from ~4 row groups
    assert counts.max() <= 4  # never more than a window (windows hold 200)
    sequential = row_groups_per_batch(np.arange(400), sizes, 25)
    assert sequential.max() == 1


def test_deterministic_for_a_seed_and_new_every_epoch():
    first = _epochs(RowGroupWindowOrderSampler(SIZES, window=2, seed=11), 3)
    again = _epochs(RowGroupWindowOrderSampler(SIZES, window=2, seed=11), 3)
    other = _epochs(RowGroupWindowOrderSampler(SIZES, window=2, seed=12), 3)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert any((a != b).any() for a, b in zip(first, other))
    assert (first[0] != first[1]).any() and (first[1] != first[2]).any()


def test_resume_from_a_snapshot_continues_the_same_sequence(tmp_path):
    dataset = np.arange(sum(SIZES))
    batch_size = 8

    def make_iterator():
        return chainer.iterators.SerialIterator(
            dataset, batch_size, order_sampler=RowGroupWindowOrderSampler(
                SIZES, window=3, seed=7))

    reference = make_iterator()
    expected = [reference.next() for _ in range(40)]

    interrupted = make_iterator()
    for _ in range(17):  # mid-epoch of the third epoch
        interrupted.next()
    snapshot = str(tmp_path / 'iterator.npz')
    serializers.save_npz(snapshot, interrupted)
    resumed = make_iterator()
    # A fresh sampler: anything it remembered would be lost here.
    serializers.load_npz(snapshot, resumed)
    continued = [resumed.next() for _ in range(40 - 17)]
    assert [list(batch) for batch in continued] == [
        list(batch) for batch in expected[17:]]


def test_an_epoch_has_no_duplicate_within_a_batch():
    sizes = [100] * 6
    order = RowGroupWindowOrderSampler(sizes, window=2, seed=1)(
        np.arange(600), 0)
    for start in range(0, 600, 100):
        batch = order[start:start + 100]
        assert len(set(batch.tolist())) == len(batch)


def test_empty_dataset_and_bad_arguments():
    assert len(RowGroupWindowOrderSampler([], window=2)(np.arange(0), 0)) == 0
    with pytest.raises(ValueError, match='window'):
        RowGroupWindowOrderSampler([3], window=0)
    with pytest.raises(ValueError, match='non-negative'):
        RowGroupWindowOrderSampler([3, -1])
    with pytest.raises(ValueError, match='3 rows'):
        RowGroupWindowOrderSampler([3])(np.arange(4), 0)
