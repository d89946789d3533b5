"""Repairing the training communicator by shrinking it.

:func:`shrink` is the MPI edge of detect/shrink: the survivors continue
alone (``MPIX_Comm_shrink``).  Detect/respawn lives in ``spares.py`` (the
failed ranks are taken by warm spares, or spawned); :func:`is_replacement`
tells a process that one of them started it.
"""
from typing import List, NamedTuple

from chainer_prefetch.resilience import policy
from chainer_prefetch.resilience._mpi import MPI
from chainer_prefetch.resilience.communicator import FaultTolerantCommunicator
from chainer_prefetch.resilience.errors import RecoveryFailed


class Repair(NamedTuple):
    """What a repair did.

    Attributes:
        old_size: Ranks before the failure.
        survivors: Original ranks of the survivors (increasing).
        failed: Original ranks that failed.
        replaced: Whether replacements took the failed ranks (False for
            shrink).
    """
    old_size: int
    survivors: List[int]
    failed: List[int]
    replaced: bool


def shrink(comm: FaultTolerantCommunicator, min_size: int = 1) -> Repair:
    """Continues with the survivors only.

    Args:
        comm: The communicator with a failure (revoked).
        min_size: Fewest ranks to continue with.

    Returns:
        The :class:`Repair`; ``comm`` now spans the survivors.

    Raises:
        RecoveryFailed: fewer than ``min_size`` survivors.
        ProcessFailure: another failure during the repair.
    """
    old_rank, old_size = comm.rank, comm.size
    shrunk = comm.mpi_comm.Shrink()
    survivors = comm.guard(shrunk).allgather(old_rank)
    if len(survivors) < min_size:
        shrunk.Free()
        raise RecoveryFailed('only {} of {} ranks survived, fewer than {}'
                             .format(len(survivors), old_size, min_size))
    # Shrink keeps the survivors' relative order: ranks stay increasing.
    comm.repair(shrunk)
    return Repair(old_size, sorted(survivors),
                  policy.failed_ranks(old_size, survivors), False)


def is_replacement() -> bool:
    """Whether this process was spawned (a spare or a replacement)."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL
