"""The pure core of fault tolerance: no MPI, no processes, no files.

Which original ranks the replacement processes take, who takes which rank
when warm spares are merged in, the order of each rank's examples in each
epoch, and which snapshot a restart loads.  What elastic training uses too
lives in :mod:`chainer_prefetch.policy`: how the examples are split over
the ranks at any size (:mod:`~chainer_prefetch.policy.epoch_plan`) and how
the learning rate follows their number
(:mod:`~chainer_prefetch.policy.lr_rules`).
"""
import os
import re
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy

from chainer_prefetch.policy.epoch_plan import RankOrderSampler


def failed_ranks(old_size: int, survivor_ranks: Sequence[int]) -> List[int]:
    """Original ranks that no survivor holds, in increasing order.

    Raises:
        ValueError: a survivor rank outside ``[0, old_size)`` or repeated.
    """
    survivors = list(survivor_ranks)
    if len(set(survivors)) != len(survivors) or any(
            not 0 <= r < old_size for r in survivors):
        raise ValueError('bad survivor ranks {} for size {}'.format(
            survivors, old_size))
    return sorted(set(range(old_size)) - set(survivors))


SPARE = -1
"""The role of a warm spare in a pool (a training process has its rank)."""


class PoolPlan(NamedTuple):
    """Who does what after a failure in a pool of training ranks and spares.

    Attributes:
        failed: Training ranks that no living pool member holds (sorted).
        takeover: ``{pool index: training rank}`` for the spares that take a
            failed rank (the lowest spares take the lowest ranks).
        shortfall: Failed ranks left without a spare (to be spawned).
        roles: The role of every pool member after the takeover (its
            training rank, or :data:`SPARE`), in pool order.
    """
    failed: List[int]
    takeover: Dict[int, int]
    shortfall: int
    roles: List[int]


def plan_takeover(size: int, roles: Sequence[int]) -> PoolPlan:
    """Assigns the failed training ranks to the living spares.

    Args:
        size: Training ranks before the failure.
        roles: Role of each living pool member, in pool order: its training
            rank in ``[0, size)`` or :data:`SPARE`.

    Returns:
        The :class:`PoolPlan`.

    Raises:
        ValueError: a role outside ``[0, size)`` (other than a spare) or a
            training rank held twice.
    """
    held = [r for r in roles if r != SPARE]
    if len(set(held)) != len(held) or any(not 0 <= r < size for r in held):
        raise ValueError('bad roles {} for {} training ranks'.format(
            list(roles), size))
    failed = sorted(set(range(size)) - set(held))
    spares = [i for i, r in enumerate(roles) if r == SPARE]
    takeover = dict(zip(spares, failed))
    new_roles = [takeover.get(i, r) for i, r in enumerate(roles)]
    return PoolPlan(failed, takeover, len(failed) - len(takeover), new_roles)


def split_key(role: int, pool_index: int) -> Tuple[int, int]:
    """``(color, key)`` of ``MPI_Comm_split`` that makes the training
    communicator (color 0, ordered by training rank) and leaves the spares
    apart (color 1, pool order)."""
    return (1, pool_index) if role == SPARE else (0, role)


def epoch_order(n_examples: int, seed: int, rank: int,
                epoch: int) -> numpy.ndarray:
    """The order of ``epoch`` (0-based) of an iterator over ``n_examples``
    that uses ``RankOrderSampler(seed, rank)`` from its start.

    Raises:
        ValueError: a negative epoch.
    """
    if epoch < 0:
        raise ValueError('epoch must be >= 0, got {}'.format(epoch))
    sampler = RankOrderSampler(seed, rank)
    order = sampler(numpy.arange(n_examples), 0)
    for _ in range(epoch):
        order = sampler(order, 0)
    return order


SNAPSHOT_PATTERN = re.compile(r'^snapshot_iter_(\d+)$')


def snapshot_name(iteration: int) -> str:
    """File name of the periodic snapshot taken after ``iteration``."""
    return 'snapshot_iter_{}'.format(iteration)


def latest_snapshot(names: Sequence[str]) -> Optional[str]:
    """The snapshot with the highest iteration among file names (or None)."""
    best, best_iteration = None, -1
    for name in names:
        match = SNAPSHOT_PATTERN.match(os.path.basename(name))
        if match and int(match.group(1)) > best_iteration:
            best, best_iteration = name, int(match.group(1))
    return best
