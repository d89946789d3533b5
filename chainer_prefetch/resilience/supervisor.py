"""Fencing a rank that ends without ``MPI_Finalize``.

ULFM (Open MPI 5.0.11) reports a rank that was killed by a signal, and one
that exits with status 0 without ``MPI_Finalize``; PRRTE reports a rank that
exits with another status (``os._exit(1)``, a C library's ``exit(1)``) as
``PMIX_ERR_EXIT_NONZERO_TERM``, which the MPI layer ignores, so the other
ranks wait for it forever.

:func:`supervise`, called before MPI is initialised, splits the process in
two: the parent stays the process that ``mpirun`` started and tracks, and
only waits; the child returns and becomes the MPI rank.  When the rank ends
with a non-zero status or by a signal, the parent fences it: it kills every
process the rank left behind (its loader workers, its watchdog: they are
re-parented to the supervisor, a child subreaper) and then kills itself with
``SIGKILL``, which PRRTE reports as a process failure that ULFM turns into
``MPI_ERR_PROC_FAILED`` on every survivor (they then recover).  Status 0 is
passed on unchanged.  Signals sent to the parent (``SIGTERM`` from
``mpirun``, ``SIGINT``) are passed on to the rank; the rank gets ``SIGKILL``
if its parent dies.

A fenced rank's status is lost: in a job started with ``mpirun --with-ft
ulfm`` PRRTE leaves processes killed by a signal out of ``mpirun``'s exit
status (only a non-zero *exit* counts, and that one ULFM does not report).
So an exception that reaches the top of a supervised rank after MPI was
initialised (an error of the program, not a lost process: respawning would
meet it again) ends the whole job instead: the rank's ``sys.excepthook``
prints it as usual and calls ``MPI_Abort`` on ``COMM_WORLD`` with status
:data:`ABORT_STATUS`, which ``mpirun`` reports.

Only the standard library is used here; nothing may initialise MPI before
the fork, and no thread may run then (the child would inherit a copy of
this process with only the forking thread, and any lock another thread
held stays locked forever).
"""
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

SUPERVISED_VARIABLE = 'CHAINER_PREFETCH_SUPERVISED'
"""Set in the rank's environment (its supervisor's pid)."""

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                     signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)
ABORT_STATUS = 1
"""``MPI_Abort``'s status when a supervised rank raises (Python's status
for an uncaught exception)."""


def _prctl(option: int, value: int) -> bool:
    """Linux ``prctl(option, value)``; False where it is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_verdict(status: int) -> Optional[str]:
    """The pure decision on a rank's ``waitpid`` status.

    Args:
        status: The raw status from ``os.waitpid``.

    Returns:
        None when the rank ended cleanly (exit status 0), else a sentence
        that says how it ended (it is then fenced).
    """
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        return None if code == 0 else 'exited with status {}'.format(code)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = str(number)
        return 'was killed by {}'.format(name)
    return 'ended with status {:#x}'.format(status)


def _children_of(pid: int):
    """Pids whose parent is ``pid`` (from ``/proc``)."""
    found = []
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open('/proc/{}/stat'.format(entry)) as f:
                parent = int(f.read().rsplit(')', 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(entry))
    return found


def kill_leftovers(deadline_seconds: float = 5.0) -> None:
    """Kills and reaps every remaining child of this process (orphans of the
    rank re-parented to it) until none is left or the deadline passes."""
    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        children = _children_of(os.getpid())
        if not children:
            return
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _supervise_child(child: int, describe: str) -> None:
    """The parent's whole life: forward signals, wait, exit like the rank
    (status 0) or fence it.  Never returns."""
    for number in FORWARDED_SIGNALS:
        signal.signal(number, lambda received, _frame: os.kill(child,
                                                                received))
    while True:
        try:
            pid, status = os.waitpid(child, 0)
        except ChildProcessError:
            status = 0xff00  # vanished unobserved: fence it as a failure
            break
        if pid == child:
            break
    verdict = exit_verdict(status)
    for number in FORWARDED_SIGNALS:
        signal.signal(number, signal.SIG_DFL)
    kill_leftovers()
    if verdict is None:
        os._exit(0)
    sys.stderr.write(
        'chainer_prefetch supervisor: {} (pid {}) {} without finalizing; '
        'fencing it so that the other ranks see a process failure\n'.format(
            describe, child, verdict))
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)  # not reached


def abort_job_on_exception(describe: str, previous: Callable) -> Callable:
    """The ``sys.excepthook`` of a supervised rank (see the module
    docstring).

    Args:
        describe: How its message names the rank.
        previous: The hook that prints the exception first (the one in
            place, e.g. ``sys.excepthook``).

    Returns:
        A hook that prints the exception with ``previous`` and then, where
        this process has initialised MPI and not finalized it, ends the job
        with ``MPI_Abort(COMM_WORLD, ABORT_STATUS)``.  Without MPI it does
        nothing more: the rank exits with status 1 and is fenced.
    """
    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        mpi = sys.modules.get('mpi4py.MPI')  # never initialise MPI here
        if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
            return
        sys.stderr.write(
            'chainer_prefetch supervisor: {} (pid {}) raised {}; ending the '
            'job with MPI_Abort (status {})\n'.format(
                describe, os.getpid(), kind.__name__, ABORT_STATUS))
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(ABORT_STATUS)
    return hook


def supervise(describe: Optional[str] = None,
              fork: Callable[[], int] = os.fork) -> int:
    """Runs the rest of this program as a supervised child (see the module
    docstring).  Call it before MPI is initialised and before any thread or
    fork server is started (a fork server belongs to the process that
    starts it); a second call (in the child, or in a process already
    supervised) does nothing.  The child's ``sys.excepthook`` becomes
    :func:`abort_job_on_exception`'s.

    Args:
        describe: How the supervisor's message names the rank (default:
            ``rank N`` from Open MPI's environment).
        fork: ``os.fork`` (replaced in tests).

    Returns:
        The supervisor's pid, in the child (the parent never returns).

    Raises:
        RuntimeError: MPI was already initialised in this process, or
            another thread runs.
    """
    if os.environ.get(SUPERVISED_VARIABLE):
        return int(os.environ[SUPERVISED_VARIABLE])
    if 'mpi4py.MPI' in sys.modules:
        raise RuntimeError('supervise() must run before mpi4py.MPI is '
                           'imported (MPI is initialised at that import)')
    if threading.active_count() > 1:
        raise RuntimeError('supervise() must run before any thread is '
                           'started (it forks): {}'.format(
                               [t.name for t in threading.enumerate()]))
    if describe is None:
        describe = 'rank {}'.format(os.environ.get('OMPI_COMM_WORLD_RANK',
                                                   '?'))
    sys.stdout.flush()
    sys.stderr.flush()
    supervisor = os.getpid()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    child = fork()
    if child != 0:
        _supervise_child(child, describe)
    os.environ[SUPERVISED_VARIABLE] = str(supervisor)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != supervisor:  # the supervisor died before prctl
        os._exit(1)
    sys.excepthook = abort_job_on_exception(describe, sys.excepthook)
    return supervisor
