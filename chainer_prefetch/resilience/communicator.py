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
from typing import Any, Callable, List, Optional, Sequence, Union

# mpi4py first, for its ImportError that names the extra (ChainerMN's
# communicator imports it too).
from chainer_prefetch.resilience._mpi import MPI  # isort: skip
from chainermn.communicators.naive_communicator import NaiveCommunicator  # isort: skip

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


def start_watchdog(rank: int, settings: WatchdogSettings) -> Watchdog:
    """Starts this process's watchdog (see ``watchdog.py``)."""
    return Watchdog(rank, settings, OPERATIONS)


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


def revoke(comm: MPI.Comm) -> None:
    """Revokes ``comm`` (no error if it already is)."""
    try:
        comm.Revoke()
    except MPI.Exception:
        pass


def release_connections(barrier: MPI.Comm, to_free: Sequence[Optional[MPI.Comm]],
                        intercomms: Sequence[MPI.Intercomm],
                        heartbeat=None) -> None:
    """Prepares ``MPI_Finalize`` after failures or spawns (collective over
    ``barrier`` and each of ``intercomms``).

    Open MPI 5.0.11's ``MPI_Finalize`` waits forever for the dead processes
    and for spawned ones unless, in this order, the failures are acknowledged
    on ``COMM_WORLD``, ``barrier`` and every spawn connection, the members
    meet in a barrier, the communicators are freed, and the spawn connections
    are disconnected in the order they were made (the same on every process).

    Args:
        barrier: The communicator of all living processes of the job.
        to_free: Communicators to free after the barrier (None skipped).
        intercomms: Spawn connections, in the order they were made.
        heartbeat: Watchdog heartbeat (bounds the waits), or None.
    """
    for comm in [MPI.COMM_WORLD, barrier] + list(intercomms):
        try:
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            comm.Ack_failed()
        except (MPI.Exception, NotImplementedError):
            pass  # nothing to acknowledge without ULFM
    GuardedComm(barrier, heartbeat).Barrier()
    living = barrier.Get_group()
    try:
        remote_alive = [remote_members_in(intercomm, living)
                        for intercomm in intercomms]
    finally:
        living.Free()
    for comm in to_free:
        if comm is not None and comm != MPI.COMM_NULL:
            comm.Free()
    for intercomm, alive in zip(intercomms, remote_alive):
        if alive:
            GuardedComm(intercomm, heartbeat).Disconnect()
        else:
            # Every process on the other side is dead and its job is gone:
            # Disconnect would wait for that job forever.
            intercomm.Free()


def remote_members_in(intercomm: MPI.Intercomm, group: MPI.Group) -> int:
    """How many processes of the remote group of ``intercomm`` are in
    ``group``."""
    remote = intercomm.Get_remote_group()
    try:
        common = MPI.Group.Intersection(remote, group)
        try:
            return common.Get_size()
        finally:
            common.Free()
    finally:
        remote.Free()


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
        watchdog: Limits of a new per-rank watchdog process, this process's
            running :class:`Watchdog` (a spare's, kept), or None for none.

    Attributes:
        watchdog: The rank's :class:`Watchdog` (None without one).
        pool: The :class:`~chainer_prefetch.resilience.spares.SparePool`
            this rank trains in (set by the respawn strategy), or None.
    """

    def __init__(self, mpi_comm: Optional[MPI.Comm] = None,
                 watchdog: Union[WatchdogSettings, Watchdog, None]
                 = _DEFAULT_WATCHDOG):
        if mpi_comm is None:
            mpi_comm = MPI.COMM_WORLD.Dup()
        mpi_comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.watchdog = None
        self.repaired = False
        self.pool = None
        if isinstance(watchdog, Watchdog):
            self.watchdog = watchdog
        elif watchdog is not None:
            self.watchdog = start_watchdog(mpi_comm.Get_rank(), watchdog)
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

    def allreduce_obj(self, obj):
        """Sum of ``obj`` over the ranks (ChainerMN's ``allreduce_obj``).

        mpi4py's object ``allreduce`` runs on a private duplicate of the
        communicator, which ``MPI_Comm_revoke`` does not reach: a rank
        waiting there (the multi-node evaluator) would not see a revoke.
        ``allgather`` runs on the communicator itself.
        """
        values = self.mpi_comm.allgather(obj)
        total = values[0]
        for value in values[1:]:
            total = total + value
        return total

    def split(self, color, key):
        raise NotImplementedError(
            'FaultTolerantCommunicator cannot be split: a sub-communicator '
            'would not be repaired after a failure')

    def close(self) -> None:
        """Prepares ``MPI_Finalize`` (idempotent; also run at exit).

        After a repair or with spares, ``MPI_Finalize`` can wait forever for
        the dead and the spawned processes (Open MPI 5.0.11); see
        :func:`release_connections`.  With a pool, training rank 0 first
        dismisses the parked spares, which take part in the same steps.  The
        watchdog then watches ``MPI_Finalize`` itself (bounded by its
        ``call_timeout``) and exits with this process.
        """
        heartbeat = None if self.watchdog is None else self.watchdog.heartbeat
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.dismiss()
            pool.close(training=self.raw)
        elif self.repaired:
            self.repaired = False
            release_connections(self.raw, [self.raw], [], heartbeat)
        if self.watchdog is not None:
            self.watchdog.heartbeat.enter('Finalize')
        atexit.unregister(self.close)

    def stop_watchdog(self) -> None:
        """Stops the watchdog now (for a process that goes on without MPI)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
