"""How the learning rate follows the number of data-parallel members.

Pure: no processes, no MPI, no files.  Both recoveries that change the size
of a job use these rules: the elastic rebuild
(:class:`~chainer_prefetch.elastic.training.ElasticTraining`) and the ULFM
shrink (:class:`~chainer_prefetch.resilience.training.FaultTolerantTraining`).
A rule is ``rule(lr, old_size, new_size) -> new lr``; the three below have
names, and any callable of that form may be given instead.
"""
import math
from typing import Callable, Dict, Union

LrRule = Callable[[float, int, int], float]
"""``rule(lr, old_size, new_size) -> new lr``."""


def linear_lr(lr: float, old_size: int, new_size: int) -> float:
    """Linear scaling: the rate is proportional to the global batch.

    Args:
        lr: Current learning rate (for ``old_size`` members).
        old_size: Members before the change.
        new_size: Members after it.

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
    """Keeps the rate whatever the number of members."""
    _check_sizes(old_size, new_size)
    return lr


LR_RULES: Dict[str, LrRule] = {
    'linear': linear_lr, 'sqrt': sqrt_lr, 'constant': constant_lr}


def resolve_lr_rule(rule: Union[str, LrRule]) -> LrRule:
    """A rule from its name (``linear``, ``sqrt``, ``constant``) or itself.

    Args:
        rule: A name of :data:`LR_RULES` or a callable
            ``rule(lr, old_size, new_size)``.

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
