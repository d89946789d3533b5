"""A ChainerMN communicator that turns process failures into one exception.

:class:`FaultTolerantCommunicator` is ChainerMN's ``naive`` CPU
communicator whose ``mpi_comm`` is wrapped by :class:`GuardedComm`: every
MPI call goes through the guard, which

* reports entry and exit to the rank's watchdog (see ``watchdog.py``), and
* on ``MPI_ERR_PROC_FAILED`` / ``MPI_ERR_REVOKED`` revokes the communicator
  (so that no survivor stays blocked in a collective) and raises
  :class:`~chainer_prefetch.resilience.errors.ProcessFailure`.

Everything ChainerMN builds on ``mpi_comm`` (``create_multi_node_optimizer``,
``scatter_dataset``, ``bcast_data``, ``allreduce_obj``, the multi-node
evaluator) therefore raises the same exception on every survivor.  After a
recovery, :meth:`FaultTolerantCommunicator.repair` swaps in the repaired MPI
communicator, in place, so the optimizer and evaluator that hold this object
keep working.
"""
import atexit
from typing import Any, Callable, List, Optional

from chainermn.communicators.naive_communicator import NaiveCommunicator
from mpi4py import MPI

from chainer_prefetch.resilience.errors import ProcessFailure
from chainer_prefetch.resilience.watchdog import Watchdog, WatchdogSettings

_DEFAULT_WATCHDOG = WatchdogSettings()
"""The watchdog's default settings (an immutable tuple, shared safely)."""

FAILURE_CLASSES = frozenset(
    getattr(MPI, name) for name in
    ('ERR_PROC_FAILED', 'ERR_PROC_FAILED_PENDING', 'ERR_REVOKED')
    if hasattr(MPI, name))

UNGUARDED = frozenset((
    'Revoke', 'Is_revoked', 'Get_failed', 'Ack_failed', 'Get_rank',
    'Get_size', 'Get_group', 'Get_info', 'Get_name', 'Set_name', 'Free',
    'Is_inter', 'Get_topology', 'Set_errhandler', 'Get_errhandler', 'py2f'))
"""mpi4py methods that never wait for a peer."""

OPERATIONS = (
    'Allreduce', 'allreduce', 'Bcast', 'bcast', 'Gatherv', 'gather',
    'Allgatherv', 'allgather', 'Scatterv', 'scatter', 'Alltoallv', 'alltoall',
    'Send', 'Ssend', 'send', 'ssend', 'Recv', 'recv', 'Barrier', 'barrier',
    'Split', 'Dup', 'Shrink', 'Agree', 'Spawn', 'Merge', 'Create',
    'Disconnect', 'Finalize')
"""Names the heartbeat can report (others appear as ``call``)."""


def failed_ranks_of(comm: MPI.Comm) -> List[int]:
    """Ranks of ``comm`` that ULFM knows have failed (empty if unknown)."""
    try:
        failed = comm.Get_failed()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return []
    try:
        if failed.Get_size() == 0:
            return []
        group = comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(
                failed, list(range(failed.Get_size())), group)
        finally:
            group.Free()
        return sorted(r for r in ranks if r != MPI.UNDEFINED)
    finally:
        failed.Free()


class GuardedComm:
    """Proxy of an mpi4py communicator whose calls are guarded (see above).

    Args:
        comm: The mpi4py communicator.
        heartbeat: ``enter(name)`` / ``leave()`` of the watchdog, or None.
    """

    def __init__(self, comm: MPI.Comm, heartbeat=None):
        self.comm = comm
        self._heartbeat = heartbeat

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.comm, name)
        if name in UNGUARDED or not callable(attribute):
            return attribute
        return self._guard(name, attribute)

    def _guard(self, name: str, method: Callable) -> Callable:
        def guarded(*args, **kwargs):
            if self._heartbeat is not None:
                self._heartbeat.enter(name)
            try:
                return method(*args, **kwargs)
            except MPI.Exception as error:
                if error.Get_error_class() not in FAILURE_CLASSES:
                    raise
                rank = self.comm.Get_rank()
                try:
                    self.comm.Revoke()
                except MPI.Exception:
                    pass  # already revoked
                raise ProcessFailure(rank, name, failed_ranks_of(self.comm),
                                     error.Get_error_string()) from error
            finally:
                if self._heartbeat is not None:
                    self._heartbeat.leave()
        guarded.__name__ = name
        return guarded


class FaultTolerantCommunicator(NaiveCommunicator):
    """ChainerMN ``naive`` communicator that survives process failures.

    Args:
        mpi_comm: The mpi4py communicator (default: a duplicate of
            ``COMM_WORLD``).
        watchdog: Limits of the per-rank watchdog process, or None for none.

    Attributes:
        watchdog: The rank's :class:`Watchdog` (None without one).
    """

    def __init__(self, mpi_comm: Optional[MPI.Comm] = None,
                 watchdog: Optional[WatchdogSettings] = _DEFAULT_WATCHDOG):
        if mpi_comm is None:
            mpi_comm = MPI.COMM_WORLD.Dup()
        mpi_comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.watchdog = None
        self.repaired = False
        self._intercomms: List[MPI.Intercomm] = []
        if watchdog is not None:
            self.watchdog = Watchdog(mpi_comm.Get_rank(), watchdog, OPERATIONS)
        atexit.register(self.close)
        heartbeat = None if self.watchdog is None else self.watchdog.heartbeat
        try:
            super().__init__(GuardedComm(mpi_comm, heartbeat))
        except BaseException:
            self.stop_watchdog()
            raise

    @property
    def raw(self) -> MPI.Comm:
        """The mpi4py communicator itself (unguarded)."""
        return self.mpi_comm.comm

    def guard(self, comm: MPI.Comm) -> GuardedComm:
        """``comm`` with the same guard (for the recovery protocols)."""
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        heartbeat = None if self.watchdog is None else self.watchdog.heartbeat
        return GuardedComm(comm, heartbeat)

    def repair(self, mpi_comm: MPI.Comm) -> None:
        """Replaces the broken MPI communicator by a repaired one, in place.

        The old one is freed; ranks, sizes and the node layout are recomputed.
        """
        old = self.raw
        self.mpi_comm = self.guard(mpi_comm)
        self.repaired = True
        self._init_ranks()
        try:
            old.Free()
        except MPI.Exception:
            pass  # a revoked communicator may refuse; it is dropped anyway

    def split(self, color, key):
        raise NotImplementedError(
            'FaultTolerantCommunicator cannot be split: a sub-communicator '
            'would not be repaired after a failure')

    def keep_connection(self, intercomm: MPI.Intercomm) -> None:
        """Remembers an inter-communicator to processes started by
        ``Spawn``; :meth:`close` disconnects it (``MPI_Finalize`` waits for
        that)."""
        self._intercomms.append(intercomm)
        self.repaired = True

    def close(self) -> None:
        """Prepares ``MPI_Finalize`` (idempotent; also run at exit).

        After a repair, ``MPI_Finalize`` can wait forever for the dead
        processes of ``COMM_WORLD`` and for the spawned ones (Open MPI
        5.0.11): the failures are acknowledged on ``COMM_WORLD``, the
        repaired communicator is freed after a barrier, and the spawn
        connections are disconnected in the order they were made (the same
        on every rank).  The watchdog then watches
        ``MPI_Finalize`` itself (bounded by its ``call_timeout``) and exits
        with this process.
        """
        if self.repaired:
            self.repaired = False
            try:
                MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)
                MPI.COMM_WORLD.Ack_failed()
            except (MPI.Exception, NotImplementedError):
                pass  # nothing to acknowledge without ULFM
            # This order (barrier, free, then disconnect) is the one that
            # lets MPI_Finalize return; the communicator is unusable after.
            self.mpi_comm.Barrier()
            self.raw.Free()
            intercomms, self._intercomms = self._intercomms, []
            for intercomm in intercomms:
                self.guard(intercomm).Disconnect()
        if self.watchdog is not None:
            self.watchdog.heartbeat.enter('Finalize')
        atexit.unregister(self.close)

    def stop_watchdog(self) -> None:
        """Stops the watchdog now (for a process that goes on without MPI)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
