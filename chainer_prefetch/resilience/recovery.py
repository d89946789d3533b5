"""Repairing the communicator after a failure: shrink, respawn, join.

These are the MPI edges of the strategies; what they decide (which ranks
failed, which rank a replacement takes) comes from ``policy.py``.

* :func:`shrink`: the survivors continue alone (``MPI_Comm_shrink``).
* :func:`respawn`: shrink, spawn one replacement per failed rank, merge the
  inter-communicator and split it by original rank, so every rank keeps its
  number.  The replacements run :func:`join` when they start.
"""
import os
from typing import List, NamedTuple, Optional, Sequence, Tuple

from mpi4py import MPI

from chainer_prefetch.resilience import policy
from chainer_prefetch.resilience.communicator import FaultTolerantCommunicator
from chainer_prefetch.resilience.errors import RecoveryFailed
from chainer_prefetch.resilience.watchdog import WatchdogSettings


class Repair(NamedTuple):
    """What a repair did.

    Attributes:
        old_size: Ranks before the failure.
        survivors: Original ranks of the survivors (increasing).
        failed: Original ranks that failed.
        replaced: Whether replacements took the failed ranks.
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


def respawn(comm: FaultTolerantCommunicator, command: str,
            arguments: Sequence[str]) -> Repair:
    """Replaces the failed ranks by new processes; ranks keep their numbers.

    Args:
        comm: The communicator with a failure (revoked).
        command: Program the replacements run (e.g. ``sys.executable``).
        arguments: Its arguments (e.g. the training script and ``sys.argv``).

    Returns:
        The :class:`Repair`; ``comm`` has the old size and rank order.

    Raises:
        ProcessFailure: another failure during the repair.
        MPI.Exception: ``Spawn`` failed (e.g. no slot for the replacement).
    """
    old_rank, old_size = comm.rank, comm.size
    shrunk = comm.mpi_comm.Shrink()
    guarded = comm.guard(shrunk)
    survivors = guarded.allgather(old_rank)
    failed = policy.failed_ranks(old_size, survivors)
    info = MPI.Info.Create()
    info.Set('wdir', os.getcwd())
    try:
        inter = guarded.Spawn(command, args=list(arguments),
                              maxprocs=len(failed), info=info, root=0)
    finally:
        info.Free()
    merged = comm.guard(inter).Merge(high=False)
    comm.keep_connection(inter)
    guarded_merged = comm.guard(merged)
    guarded_merged.bcast({'failed': failed, 'survivors': sorted(survivors),
                          'old_size': old_size}, root=0)
    restored = guarded_merged.Split(0, old_rank)
    merged.Free()
    shrunk.Free()
    comm.repair(restored)
    return Repair(old_size, sorted(survivors), failed, True)


def is_replacement() -> bool:
    """Whether this process was spawned by :func:`respawn`."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def join(watchdog: Optional[WatchdogSettings]
         ) -> Tuple[FaultTolerantCommunicator, Repair]:
    """A replacement's side of :func:`respawn`.

    Args:
        watchdog: Watchdog settings for the new communicator (None: none).

    Returns:
        ``(communicator in the original rank order, the Repair)``.

    Raises:
        RuntimeError: this process was not spawned by :func:`respawn`.
    """
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise RuntimeError('join() is for processes started by respawn()')
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    plan = merged.bcast(None, root=0)
    n_survivors = len(plan['survivors'])
    rank = policy.newcomer_rank(plan['failed'],
                                merged.Get_rank() - n_survivors)
    restored = merged.Split(0, rank)
    merged.Free()
    comm = FaultTolerantCommunicator(restored, watchdog)
    comm.keep_connection(parent)
    return comm, Repair(plan['old_size'], plan['survivors'], plan['failed'],
                        True)
