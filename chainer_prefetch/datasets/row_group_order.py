"""Row-group-aware epoch orders for Parquet datasets: a Chainer order sampler.

A Parquet file is read a *row group* at a time (decompressing one column
chunk means decompressing all of it), so a fully random order over rows reads
every row group once per row: hopeless on shared storage.  Reading files in a
fixed order is the other extreme: fast, but batches then hold neighbouring
rows only.

:class:`RowGroupWindowOrderSampler` sits between the two:

1. shuffle the order of the row groups;
2. cut that order into *windows* of ``window`` consecutive row groups;
3. shuffle the rows within each window, and concatenate the windows.

Every epoch is a permutation of all rows (sampling *without* replacement:
each row exactly once per epoch, so no batch can hold a row twice), reading
stays row-group local (at any time only the row groups of one window, plus
the next one at a window boundary, are needed), and ``window`` bounds memory
and local disk: a larger window mixes more row groups into each batch at the
cost of more row groups held at once.

The sampler is a pure callable in the slot of Chainer's order samplers,
``(current_order, current_position) -> new_order``.  The next order is a
function of ``seed`` and of ``current_order`` alone (the RNG is seeded with
both), so it is deterministic for a seed and needs no state of its own:
Chainer's iterators serialize the current epoch's ``order``, and an iterator
restored from a snapshot therefore draws exactly the epochs the original
would have drawn, with no change to the iterator's ``serialize``.
"""
import hashlib
from typing import Sequence

import numpy


class RowGroupWindowOrderSampler:
    """Shuffles row groups, then rows within windows of ``window`` row groups.

    Use it as the ``order_sampler`` of a Chainer iterator over a dataset whose
    examples are stored row group after row group (rows ``0 .. n0-1`` in row
    group 0, the next ``n1`` rows in row group 1, and so on), such as
    :class:`chainer_prefetch.datasets.ParquetDataset`::

        sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes,
                                             window=4, seed=0)
        iterator = PrefetchMultiprocessIterator(
            dataset, 100, order_sampler=sampler, local_dir=...)

    Args:
        row_group_sizes: Rows in each row group, in storage order (empty row
            groups are allowed).
        window: Row groups whose rows are shuffled together (K >= 1).
            Memory and local disk hold about ``2 * window`` row groups.
        seed: Seed of the pseudo-random orders.

    Raises:
        ValueError: ``window`` < 1 or a negative row-group size.
    """

    def __init__(self, row_group_sizes: Sequence[int], window: int = 4,
                 seed: int = 0):
        sizes = numpy.asarray(row_group_sizes, dtype=numpy.int64)
        if window < 1:
            raise ValueError('window must be at least 1, got {}'.format(window))
        if sizes.ndim != 1 or (sizes < 0).any():
            raise ValueError('row_group_sizes must be non-negative counts')
        self.row_group_sizes = sizes
        self.window = int(window)
        self.seed = int(seed)
        self._starts = numpy.concatenate([[0], numpy.cumsum(sizes)[:-1]])

    def __call__(self, current_order: numpy.ndarray,
                 current_position: int) -> numpy.ndarray:
        """The order of the next epoch.

        Args:
            current_order: The order of the epoch that ends (Chainer passes
                ``numpy.arange(n)`` before the first epoch).
            current_position: Ignored (Chainer's signature).

        Returns:
            A permutation of ``range(sum(row_group_sizes))``.

        Raises:
            ValueError: ``current_order`` has another length than the dataset.
        """
        total = int(self.row_group_sizes.sum())
        if len(current_order) != total:
            raise ValueError(
                'the order has {} entries but the row groups hold {} rows'
                .format(len(current_order), total))
        random = numpy.random.default_rng(
            [self.seed, _digest(current_order)])
        groups = random.permutation(len(self.row_group_sizes))
        windows = []
        for first in range(0, len(groups), self.window):
            rows = numpy.concatenate(
                [numpy.arange(self._starts[group],
                              self._starts[group] + self.row_group_sizes[group])
                 for group in groups[first:first + self.window]])
            windows.append(random.permutation(rows))
        if not windows:
            return numpy.zeros(0, dtype=numpy.int64)
        return numpy.concatenate(windows)


def _digest(order: numpy.ndarray) -> int:
    """A 64-bit fingerprint of an order (the epoch's seed material)."""
    data = numpy.ascontiguousarray(order, dtype=numpy.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), 'little')


def row_group_of_rows(row_group_sizes: Sequence[int]) -> numpy.ndarray:
    """The row group of every row, for rows stored row group after row group.

    Args:
        row_group_sizes: Rows in each row group, in storage order.

    Returns:
        An array as long as the number of rows.
    """
    sizes = numpy.asarray(row_group_sizes, dtype=numpy.int64)
    return numpy.repeat(numpy.arange(len(sizes)), sizes)


def row_groups_per_batch(order: numpy.ndarray,
                         row_group_sizes: Sequence[int],
                         batch_size: int) -> numpy.ndarray:
    """Shuffle quality: how many distinct row groups each batch draws from.

    Args:
        order: An epoch's order of rows.
        row_group_sizes: Rows in each row group, in storage order.
        batch_size: Rows per batch (the last batch may be shorter).

    Returns:
        One count per batch.
    """
    groups = row_group_of_rows(row_group_sizes)[numpy.asarray(order)]
    return numpy.array([len(numpy.unique(groups[start:start + batch_size]))
                        for start in range(0, len(groups), batch_size)])
