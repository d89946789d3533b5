"""The pure core of fault tolerance: no MPI, no processes, no files.

How the learning rate follows the number of ranks, which original ranks
the replacement processes take, who takes which rank when warm spares are
merged in, the order of each rank's examples in each epoch, and which
snapshot a restart loads.  How the examples are split over the ranks, at
any size, is :mod:`chainer_prefetch.policy.epoch_plan`'s.
"""
import math
import os
import re
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy

from chainer_prefetch.policy.epoch_plan import (  # noqa: F401 (their home)
    RankOrderSampler,
    shard_bounds,
    shard_order,
)

LrRule = Callable[[float, int, int], float]
"""``rule(lr, old_size, new_size) -> new lr``."""


def linear_lr(lr: float, old_size: int, new_size: int) -> float:
    """Linear scaling: the rate is proportional to the global batch.

    Args:
        lr: Current learning rate (for ``old_size`` ranks).
        old_size: Ranks before the change.
        new_size: Ranks after it.

    Returns:
        ``lr * new_size / old_size``.
    """
    _check_sizes(old_size, new_size)
    return lr * new_size / old_size


def sqrt_lr(lr: float, old_size: int, new_size: int) -> float:
    """Square-root scaling: ``lr * sqrt(new_size / old_size)``."""
    _check_sizes(old_size, new_size)
    return lr * math.sqrt(new_size / old_size)


def constant_lr(lr: float, old_size: int, new_size: int) -> float:
    """Keeps the rate whatever the number of ranks."""
    _check_sizes(old_size, new_size)
    return lr


LR_RULES: Dict[str, LrRule] = {
    'linear': linear_lr, 'sqrt': sqrt_lr, 'constant': constant_lr}


def resolve_lr_rule(rule: Union[str, LrRule]) -> LrRule:
    """A rule from its name (``linear``, ``sqrt``, ``constant``) or itself.

    Raises:
        ValueError: unknown name.
    """
    if callable(rule):
        return rule
    try:
        return LR_RULES[rule]
    except KeyError:
        raise ValueError('unknown learning-rate rule {!r}; use one of {} or '
                         'a callable(lr, old_size, new_size)'.format(
                             rule, ', '.join(sorted(LR_RULES)))) from None


def _check_sizes(old_size: int, new_size: int) -> None:
    if old_size < 1 or new_size < 1:
        raise ValueError('sizes must be positive, got {} -> {}'.format(
            old_size, new_size))


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
