"""Warm spares: replacement processes started ahead, merged in at a failure.

Starting a replacement at a failure (``MPI_Comm_spawn``) takes seconds:
PRRTE starts a Python that imports NumPy, Chainer and ChainerMN and
initialises MPI, and the survivors wait for all of it.  A spare pays that
before any failure:

* The training ranks and the spares share one *pool* communicator (an
  intracommunicator, made by ``Spawn`` + ``Intercomm.Merge``); the training
  communicator is split from it.  ``SparePool.start`` spawns the spares when
  the job starts; each runs the same program, which reaches
  :meth:`SparePool.join` past its imports and MPI initialisation.
* A spare then *parks*: it posts a receive from any source on the pool and
  tests it every :data:`PARK_POLL_SECONDS` with a sleep in between (a
  blocking MPI wait would busy-poll a whole core in Open MPI).
* At a failure the survivors revoke the training communicator and the pool.
  The parked spares wake up (ULFM fails their pending any-source receive,
  ``MPI_ERR_PROC_FAILED_PENDING`` or ``MPI_ERR_REVOKED``), every living
  member shrinks the pool (``MPIX_Comm_shrink``), the roles are gathered,
  and :func:`~chainer_prefetch.resilience.policy.plan_takeover` gives the
  failed training ranks to the lowest spares.  Failed ranks without a spare
  are spawned then (with no spares this is plain detect/respawn).  A split
  of the pool by role makes the new training communicator, every rank with
  its old number.
* Afterwards the training ranks *top up* the pool: the parked spares are
  told by a message, and all members spawn the missing spares together.
* A spare that dies while parked fails the receive of the others and the
  pool check of the training ranks (:meth:`SparePool.check`, a local test of
  a never-matched receive), which revoke the training communicator so that
  every rank repairs at once; the dead spare is then replaced by a top-up.
* At the end training rank 0 dismisses the spares, and every member
  acknowledges the failures, meets in a barrier, frees the communicators
  and disconnects the spawn connections (the order Open MPI 5.0.11's
  ``MPI_Finalize`` needs after failures).
"""
import os
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from chainer_prefetch.resilience import policy
from chainer_prefetch.resilience._mpi import MPI
from chainer_prefetch.resilience.communicator import (
    GuardedComm,
    failed_ranks_of,
    release_connections,
    revoke,
)
from chainer_prefetch.resilience.errors import ProcessFailure
from chainer_prefetch.resilience.injection import EventLog, fail_now
from chainer_prefetch.resilience.watchdog import Watchdog

CONTROL_TAG = 4242
"""Tag of the messages training rank 0 sends to parked spares."""
WATCH_TAG = 4243
"""Tag of a receive that never matches: it fails when a member fails."""
PARK_POLL_SECONDS = 0.01
"""How often a parked spare tests its pending receive."""

TOP_UP = 'top_up'
DISMISS = 'dismiss'


class Takeover(NamedTuple):
    """What a repair of the pool did (every member gets the same).

    Attributes:
        training: The new training communicator (None for a process that
            stays a spare).
        role: This process's training rank, or ``policy.SPARE``.
        old_size: Training ranks before the failure (and after).
        survivors: Training ranks that survived (increasing).
        failed: Training ranks that failed (increasing).
        from_spares: How many failed ranks parked spares took.
        spawned: How many replacements had to be spawned.
        spare_failures: Spares that failed.
    """
    training: Optional[MPI.Intracomm]
    role: int
    old_size: int
    survivors: List[int]
    failed: List[int]
    from_spares: int
    spawned: int
    spare_failures: int


class SparePool:
    """The pool communicator of the training ranks and the warm spares.

    Every member holds one: a training rank through
    :class:`~chainer_prefetch.resilience.training.FaultTolerantTraining`, a
    spare in :meth:`wait`.  Use :meth:`start` (training ranks) and
    :meth:`join` (spares) to make one.

    Args:
        comm: The pool intracommunicator.
        description: The job's settings every member shares (``size``,
            ``wanted``, ``command``, ``roles``, ``generation``).
        heartbeat: The watchdog heartbeat of this process, or None.
        events: Where pool events are recorded, or None.

    Attributes:
        comm: The pool intracommunicator (replaced at each change).
        roles: The role of each member, in pool order.
        size: Training ranks.
        wanted: Spares to keep.
        command: Program and arguments of a spare.
        generation: How many spawns the pool has seen.
        failed: Training ranks that failed in the last repair (what a
            spawned replacement learns at :meth:`join`).
        intercomms: Spawn connections, in the order they were made.
    """

    def __init__(self, comm: MPI.Intracomm, description: Dict[str, Any],
                 heartbeat=None, events: Optional[EventLog] = None):
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.comm = comm
        self.size = int(description['size'])
        self.wanted = int(description['wanted'])
        self.command = list(description['command'])
        self.roles = list(description['roles'])
        self.generation = int(description['generation'])
        self.failed = list(description.get('failed', ()))
        self.heartbeat = heartbeat
        self.events = events
        self.intercomms: List[MPI.Intercomm] = []
        self._watch: Optional[MPI.Request] = None
        self._watch_buffer = bytearray(1)
        self._closed = False

    # ---- making the pool ---------------------------------------------------

    @classmethod
    def start(cls, training: MPI.Intracomm, spares: int,
              command: Sequence[str], heartbeat=None,
              events: Optional[EventLog] = None) -> 'SparePool':
        """Makes the pool at job start (collective over ``training``).

        Args:
            training: The training communicator (its ranks are the roles).
            spares: Spares to keep (0: a pool of the training ranks only,
                and failed ranks are spawned at the failure).
            command: Program and arguments a spare runs.
            heartbeat: Watchdog heartbeat of this rank.
            events: Event log.

        Returns:
            The pool.

        Raises:
            ValueError: a negative number of spares.
            ProcessFailure: a failure meanwhile.
        """
        if spares < 0:
            raise ValueError('spares must be >= 0, got {}'.format(spares))
        size = training.Get_size()
        pool = cls(training.Dup(), dict(
            size=size, wanted=spares, command=list(command),
            roles=list(range(size)), generation=0), heartbeat, events)
        if spares:
            started = time.time()
            pool._spawn([policy.SPARE] * spares)
            pool._record('spares_started', count=spares,
                         seconds=time.time() - started)
        return pool

    @classmethod
    def join(cls, watchdog: Optional[Watchdog] = None,
             events: Optional[EventLog] = None) -> 'SparePool':
        """A spawned process's side of a spawn: joins the pool.

        Args:
            watchdog: This process's watchdog (its heartbeat guards the
                pool calls), or None.
            events: Event log (the rank field is rewritten when the spare
                takes a rank).

        Returns:
            The pool; ``role`` tells whether this process must take a rank
            at once (a spawned replacement) or park (a spare).

        Raises:
            RuntimeError: this process was not spawned.
        """
        parent = MPI.Comm.Get_parent()
        if parent == MPI.COMM_NULL:
            raise RuntimeError('SparePool.join() is for spawned processes')
        heartbeat = None if watchdog is None else watchdog.heartbeat
        parent.Set_errhandler(MPI.ERRORS_RETURN)
        merged = GuardedComm(parent, heartbeat).Merge(high=True)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        description = GuardedComm(merged, heartbeat).bcast(None, root=0)
        pool = cls(merged, description, heartbeat, events)
        pool.intercomms.append(parent)
        pool._connect_leader()
        return pool

    @property
    def role(self) -> int:
        """This process's role: its training rank or ``policy.SPARE``."""
        return self.roles[self.comm.Get_rank()]

    @property
    def spares(self) -> int:
        """Spares in the pool now."""
        return self.roles.count(policy.SPARE)

    def _guarded(self, comm=None) -> GuardedComm:
        return GuardedComm(self.comm if comm is None else comm,
                           self.heartbeat)

    def _description(self) -> Dict[str, Any]:
        return dict(size=self.size, wanted=self.wanted, command=self.command,
                    roles=self.roles, generation=self.generation,
                    failed=self.failed)

    def _record(self, event: str, **fields) -> None:
        if self.events is not None:
            self.events.write(event, pid=os.getpid(), **fields)

    def _spawn(self, new_roles: List[int]) -> None:
        """Spawns one process per entry of ``new_roles`` and merges them in
        (collective over the pool; the newcomers run :meth:`join`)."""
        self._cancel_watch()
        info = MPI.Info.Create()
        info.Set('wdir', os.getcwd())
        try:
            inter = self._guarded().Spawn(
                self.command[0], args=self.command[1:],
                maxprocs=len(new_roles), info=info, root=0)
        finally:
            info.Free()
        self.intercomms.append(inter)
        merged = self._guarded(inter).Merge(high=False)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        old, self.comm = self.comm, merged
        old.Free()
        self.roles = self.roles + list(new_roles)
        self.generation += 1
        self._guarded().bcast(self._description(), root=0)
        self._connect_leader()

    def _connect_leader(self) -> None:
        """Makes every member talk to training rank 0 once, so that its
        later messages to the spares travel on open connections (Open MPI
        5.0.11 crashed opening a connection to a process that had died)."""
        leader = self.roles.index(0) if 0 in self.roles else 0
        self._guarded().gather(None, root=leader)

    # ---- the training ranks' side ----------------------------------------

    def check(self) -> None:
        """Raises :class:`ProcessFailure` (after revoking the pool) if a pool
        member has failed; local and cheap (the training ranks call it
        before every update)."""
        if self._watch is None:
            self._watch = self.comm.Irecv([self._watch_buffer, MPI.BYTE],
                                          source=MPI.ANY_SOURCE, tag=WATCH_TAG)
        try:
            self._watch.Test()
        except MPI.Exception as error:
            self._cancel_watch()
            revoke(self.comm)
            raise ProcessFailure(self.comm.Get_rank(), 'pool check',
                                 failed_ranks_of(self.comm),
                                 error.Get_error_string()) from error

    def _cancel_watch(self) -> None:
        if self._watch is not None:
            try:
                self._watch.Cancel()
                self._watch.Wait()
            except MPI.Exception:
                pass  # failed or revoked: nothing left to wait for
            self._watch = None

    def top_up(self) -> int:
        """Spawns the spares missing from :attr:`wanted` (training ranks,
        all at the same point; rank 0 wakes the parked spares first).

        Returns:
            How many were spawned.
        """
        missing = self.wanted - self.spares
        if missing <= 0:
            return 0
        started = time.time()
        if self.role == 0:
            for index, role in enumerate(self.roles):
                if role == policy.SPARE:
                    self._guarded().send((TOP_UP, missing), dest=index,
                                         tag=CONTROL_TAG)
        self._spawn([policy.SPARE] * missing)
        self._record('spares_topped_up', count=missing,
                     seconds=time.time() - started)
        return missing

    def repair(self) -> Takeover:
        """Repairs the pool after a failure (collective over the living
        members, training ranks and spares alike).

        Returns:
            The :class:`Takeover` (``training`` is this process's new
            training communicator, None if it stays a spare).

        Raises:
            ProcessFailure: another failure meanwhile (call again).
        """
        self._cancel_watch()
        revoke(self.comm)
        old_roles = list(self.roles)
        shrunk = self._guarded().Shrink()
        shrunk.Set_errhandler(MPI.ERRORS_RETURN)
        my_role = self.role
        old, self.comm = self.comm, shrunk
        try:
            old.Free()
        except MPI.Exception:
            pass  # revoked; dropped anyway
        roles = self._guarded().allgather(my_role)
        plan = policy.plan_takeover(self.size, roles)
        self.roles = plan.roles
        self.failed = plan.failed
        spare_failures = (old_roles.count(policy.SPARE)
                          - roles.count(policy.SPARE))
        missing = plan.failed[len(plan.takeover):]
        if missing:
            self._spawn(missing)
        else:
            self._connect_leader()
        survivors = sorted(r for r in roles if r != policy.SPARE)
        return Takeover(self._split(), self.role, self.size, survivors,
                        plan.failed, len(plan.takeover), len(missing),
                        max(0, spare_failures))

    def _split(self) -> Optional[MPI.Intracomm]:
        color, key = policy.split_key(self.role, self.comm.Get_rank())
        training = self._guarded().Split(color, key)
        training.Set_errhandler(MPI.ERRORS_RETURN)
        if self.role == policy.SPARE:
            training.Free()
            return None
        return training

    def dismiss(self) -> None:
        """Training rank 0 tells the parked spares that the job is over (the
        other training ranks do nothing)."""
        if self.role != 0:
            return
        for index, role in enumerate(self.roles):
            if role == policy.SPARE:
                self._guarded().send((DISMISS,), dest=index, tag=CONTROL_TAG)

    # ---- the spares' side -------------------------------------------------

    def park(self, fail_after: Optional[float] = None) -> Optional[tuple]:
        """Waits for a message from training rank 0 without spinning, and
        records how long it waited and how much CPU time this process used
        meanwhile (event ``spare_woke``).

        Args:
            fail_after: Kill this process after that many seconds (failure
                injection for tests and experiments), or None.

        Returns:
            The message, or None when a member failed or the pool was
            revoked (then :meth:`repair`).
        """
        request = self.comm.irecv(source=MPI.ANY_SOURCE, tag=CONTROL_TAG)
        parked, cpu = time.monotonic(), time.process_time()
        message = None
        while True:
            try:
                done, received = request.test()
            except MPI.Exception:
                try:
                    request.Cancel()
                except MPI.Exception:
                    pass
                break
            if done:
                message = received
                break
            if fail_after is not None and (time.monotonic() - parked
                                           >= fail_after):
                self._record('failure', mode='kill', spare=True)
                fail_now('kill')
            time.sleep(PARK_POLL_SECONDS)
        self._record('spare_woke',
                     reason='failure' if message is None else message[0],
                     parked_seconds=time.monotonic() - parked,
                     cpu_seconds=time.process_time() - cpu)
        return message

    def wait(self, fail_after: Optional[float] = None) -> Optional[Takeover]:
        """A spare's life: parks, tops up with the others, repairs after
        failures, until it takes a training rank or is dismissed.

        Args:
            fail_after: See :meth:`park` (only the first park).

        Returns:
            The :class:`Takeover` by which this process took a training rank,
            or None when it was dismissed (the pool is then closed).
        """
        if self.role != policy.SPARE:  # spawned to replace a failed rank
            survivors = sorted(r for r in self.roles
                               if r != policy.SPARE and r not in self.failed)
            return Takeover(self._split(), self.role, self.size, survivors,
                            self.failed, 0, 0, 0)
        self._record('spare_parked', generation=self.generation)
        while True:
            message = self.park(fail_after)
            fail_after = None
            if message is not None and message[0] == DISMISS:
                self.close()
                return None
            if message is not None:  # TOP_UP
                try:
                    self._spawn([policy.SPARE] * int(message[1]))
                    continue
                except ProcessFailure:
                    pass  # a failure during the top-up: repair below
            takeover = self._repair_until_done()
            if takeover.role != policy.SPARE:
                self._record('spare_taken', role=takeover.role,
                             failed=takeover.failed)
                return takeover

    def _repair_until_done(self) -> Takeover:
        while True:
            try:
                return self.repair()
            except ProcessFailure:
                continue

    # ---- the end ------------------------------------------------------------

    def close(self, training: Optional[MPI.Intracomm] = None) -> None:
        """Prepares ``MPI_Finalize`` (every member, at the end; idempotent).

        Args:
            training: This process's training communicator, freed too.
        """
        if self._closed:
            return
        self._closed = True
        self._cancel_watch()
        release_connections(self.comm, [training, self.comm],
                            self.intercomms, self.heartbeat)
        self.intercomms = []
