"""Checkpoint/restart: relaunch a failed ``mpirun`` job until it succeeds.

Usage (``SIGTERM`` or Ctrl-C to the launcher ends the running launch too)::

    python -m chainer_prefetch.resilience.launcher --max-restarts 3 \\
        --timeout 3600 -- mpirun -n 4 python train_imagenet.py ... \\
        --fault-tolerance checkpoint

The job must resume by itself from its latest snapshot (the ImageNet
example does with ``--fault-tolerance checkpoint``).  Each launch runs in
its own process group, stopped whole (SIGTERM, then SIGKILL) when it
ends, fails or runs past ``--timeout``, so no rank of a failed launch
survives into the next one.
The launch count is passed to the job as ``CHAINER_PREFETCH_RESTART``
(0 for the first launch); failure injection only happens in launch 0.
"""
import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from chainer_prefetch.resilience.injection import EventLog

RESTART_VARIABLE = 'CHAINER_PREFETCH_RESTART'


def restart_count(environ: Optional[Dict[str, str]] = None) -> int:
    """The launch number of this job (0 outside the launcher)."""
    value = (os.environ if environ is None else environ).get(
        RESTART_VARIABLE, '0')
    try:
        return int(value)
    except ValueError:
        raise ValueError('{}={!r} is not an integer'.format(
            RESTART_VARIABLE, value)) from None


STOP_GRACE_SECONDS = 5.0
"""How long a stopped launch has between SIGTERM and SIGKILL."""


def stop_group(process: subprocess.Popen,
               grace: float = STOP_GRACE_SECONDS) -> None:
    """Stops the process group led by ``process`` and reaps its leader.

    SIGTERM to the whole group first, so that ``mpirun`` (the leader, or
    started by it in the same group, as a job script does) can stop its
    ranks and remove its session directory: Open MPI 5 leaves
    ``$TMPDIR/ompi.<pid>`` behind when killed, and a later ``mpirun`` that
    gets the same pid then fails to start with "The PMIx server's listener
    thread failed to start".  SIGKILL to whatever of the group is still
    running ``grace`` seconds later, also when a second signal or Ctrl-C
    interrupts the wait.

    Args:
        process: The group's leader (started with ``start_new_session``).
        grace: Seconds the group has to end after SIGTERM.
    """
    group_ended = False
    try:
        group_ended = not _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while not group_ended and time.monotonic() < deadline:
            time.sleep(0.05)
            process.poll()  # a leader that has exited no longer counts
            group_ended = not _signal_group(process, 0)
    finally:
        if not group_ended:
            _signal_group(process, signal.SIGKILL)
        process.wait()


def _signal_group(process: subprocess.Popen, number: int) -> bool:
    """Sends signal ``number`` (0: none, a check) to the group ``process``
    leads; returns False when no process of the group is left."""
    try:
        os.killpg(process.pid, number)
    except ProcessLookupError:
        return False
    return True


def run_once(command: Sequence[str], timeout: Optional[float],
             env: Dict[str, str]) -> int:
    """Runs one launch in its own process group.

    Args:
        command: The launch's command line.
        timeout: Seconds it may run (None: no limit).
        env: Its environment.

    Returns:
        Its exit status; ``-SIGKILL`` after a timeout, whatever the stopped
        launch exited with.
    """
    process = subprocess.Popen(list(command), env=env, start_new_session=True)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.stderr.write('launcher: launch ran past {} s; stopping it\n'
                         .format(timeout))
        return -signal.SIGKILL
    finally:
        # Whatever happened (success, failure, timeout, Ctrl-C), nothing of
        # this launch may outlive it.
        stop_group(process)


def relaunch(command: Sequence[str], max_restarts: int,
             timeout: Optional[float] = None,
             events: Optional[EventLog] = None,
             run: Callable = run_once) -> int:
    """Runs ``command`` until it exits with 0, at most ``1 + max_restarts``
    times.

    Args:
        command: The job's command line (e.g. ``mpirun ...``).
        max_restarts: Relaunches allowed after failures.
        timeout: Seconds each launch may run (None: no limit).
        events: Records each launch and its end.
        run: Runs one launch (``run_once``).

    Returns:
        The exit status of the last launch.
    """
    status = 0
    for launch in range(max_restarts + 1):
        env = dict(os.environ)
        env[RESTART_VARIABLE] = str(launch)
        if events is not None:
            events.write('launch', launch=launch)
        status = run(command, timeout, env)
        if events is not None:
            events.write('exit', launch=launch, status=status)
        if status == 0:
            return 0
        next_step = ('relaunching' if launch < max_restarts
                     else 'no restarts left')
        sys.stderr.write('launcher: launch {} failed with status {}; {}\n'
                         .format(launch, status, next_step))
    return status


def _exit_on_signal(number, _frame):
    """SIGTERM/SIGHUP end the launcher like an exception, so that the
    running launch's process group is stopped on the way out; later ones
    are ignored, so that they cannot cut that short."""
    for ignored in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(ignored, signal.SIG_IGN)
    raise SystemExit(128 + number)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, _exit_on_signal)
    if '--' not in argv:
        sys.exit('usage: python -m chainer_prefetch.resilience.launcher '
                 '[options] -- COMMAND ...')
    split = argv.index('--')
    parser = argparse.ArgumentParser(
        prog='python -m chainer_prefetch.resilience.launcher',
        description='Relaunch a failed job (checkpoint/restart).')
    parser.add_argument('--max-restarts', type=int, default=3)
    parser.add_argument('--timeout', type=float, default=None,
                        help='seconds one launch may run')
    parser.add_argument('--events', default=None,
                        help='append launch events (JSON lines) here')
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        parser.error('no command after --')
    return relaunch(command, args.max_restarts, args.timeout,
                    EventLog(args.events, -1) if args.events else None)


if __name__ == '__main__':
    sys.exit(main())
