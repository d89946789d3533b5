"""Splitting a Parquet dataset over ChainerMN ranks by whole row groups.

``chainermn.scatter_dataset`` splits examples by index: with a Parquet
dataset, every rank then needs rows of (almost) every row group, so every
rank reads the whole dataset.  :func:`scatter_row_groups` gives each rank
whole row groups instead, balanced by rows, so that each rank reads only
its own row groups (its share of the bytes) and its
:class:`~chainer_prefetch.datasets.RowGroupWindowOrderSampler` shuffles
within them.

The assignment (:func:`assign_row_groups`) is pure and deterministic: the
row groups, largest first, each go to the rank with the fewest rows so far
(ties: the lowest rank), and each rank keeps its row groups in storage
order.  With ``equal_length`` every rank gets as many examples as the
largest share: a rank with fewer rows repeats some of its own rows (from
the first row of its row groups on, spread over them), as
``scatter_dataset(force_equal_length=True)`` repeats examples, so that
every rank runs the same number of iterations per epoch.
"""
from typing import List, Sequence, Tuple

import numpy


def assign_row_groups(row_group_sizes: Sequence[int], n_ranks: int
                      ) -> List[List[int]]:
    """Row groups for each rank, balanced by rows (see the module docstring).

    Args:
        row_group_sizes: Rows in each row group.
        n_ranks: How many ranks.

    Returns:
        For each rank, its row groups in increasing order.

    Raises:
        ValueError: ``n_ranks`` < 1.
    """
    if n_ranks < 1:
        raise ValueError('n_ranks must be at least 1, got {}'.format(n_ranks))
    sizes = numpy.asarray(row_group_sizes, dtype=numpy.int64)
    totals = [0] * n_ranks
    groups: List[List[int]] = [[] for _ in range(n_ranks)]
    for group in sorted(range(len(sizes)), key=lambda g: (-int(sizes[g]), g)):
        rank = min(range(n_ranks), key=lambda r: (totals[r], r))
        groups[rank].append(group)
        totals[rank] += int(sizes[group])
    return [sorted(assigned) for assigned in groups]


def padded_sizes(sizes: Sequence[int], total: int) -> List[int]:
    """Sizes of row groups grown to ``total`` rows, the extra spread over them.

    Args:
        sizes: Rows each row group holds (those holding none get none).
        total: Rows wanted in all (at least ``sum(sizes)``).

    Returns:
        The padded sizes.

    Raises:
        ValueError: ``total`` is below ``sum(sizes)``, or above 0 with no rows.
    """
    sizes = [int(size) for size in sizes]
    extra = total - sum(sizes)
    if extra < 0:
        raise ValueError('{} rows wanted but the row groups hold {}'.format(
            total, sum(sizes)))
    holding = [position for position, size in enumerate(sizes) if size > 0]
    if extra and not holding:
        raise ValueError('cannot repeat rows of row groups that hold none')
    padded = list(sizes)
    for turn in range(extra):
        padded[holding[turn % len(holding)]] += 1
    return padded


def scatter_row_groups(dataset, comm, equal_length: bool = True):
    """This rank's share of ``dataset``: whole row groups, balanced by rows.

    Every rank calls it (it is collective): rank 0's assignment is broadcast
    so that all ranks use the same one.

    Args:
        dataset: A :class:`~chainer_prefetch.datasets.ParquetDataset`.
        comm: A ChainerMN communicator (or anything with ``rank``, ``size``
            and ``bcast_obj``).
        equal_length: Give every rank as many examples as the largest
            share, repeating a few of its own rows (see the module
            docstring).

    Returns:
        A ``ParquetDataset`` view of this rank's row groups
        (``view.row_groups`` names them), whose ``row_group_sizes`` feed
        the rank's own ``RowGroupWindowOrderSampler``.

    Raises:
        ValueError: there are fewer row groups holding rows than ranks.
    """
    plan = None
    if comm.rank == 0:
        try:
            plan = split_plan(dataset.row_group_sizes, comm.size)
        except ValueError as error:
            plan = str(error)  # every rank raises it, none waits for a plan
    plan = comm.bcast_obj(plan, root=0)
    if isinstance(plan, str):
        raise ValueError(plan)
    assignment, total = plan
    mine = assignment[comm.rank]
    sizes = [int(dataset.row_group_sizes[group]) for group in mine]
    return dataset.row_group_view(
        mine, padded_sizes(sizes, total) if equal_length else None)


def split_plan(row_group_sizes: Sequence[int], n_ranks: int
               ) -> Tuple[List[List[int]], int]:
    """The assignment and the rows of the largest share.

    Raises:
        ValueError: fewer row groups holding rows than ranks.
    """
    holding = int(numpy.count_nonzero(numpy.asarray(row_group_sizes)))
    if holding < n_ranks:
        raise ValueError('{} row groups hold rows: too few for {} ranks (each '
                         'needs one)'.format(holding, n_ranks))
    assignment = assign_row_groups(row_group_sizes, n_ranks)
    total = max(sum(int(row_group_sizes[group]) for group in groups)
                for groups in assignment)
    return assignment, total
