"""A per-rank watchdog process that bounds hangs the MPI library cannot see.

ULFM reports a process that was killed, but not one that is stopped
(``SIGSTOP``, a hung node) nor, with Open MPI 5, one that exits without
``MPI_Finalize``: the other ranks then wait in their collective forever.
A thread cannot help, because a rank blocked inside MPI may hold the GIL.
So each rank starts a small watchdog *process* and tells it, through a
shared-memory heartbeat, when it enters and leaves an MPI call:

* if the rank is stopped (state ``T`` in ``/proc``) for ``stop_timeout``
  seconds, the watchdog kills it with ``SIGKILL``; the other ranks then see
  an ordinary process failure and recover;
* if the rank has been inside one MPI call for ``call_timeout`` seconds (a
  peer hung or vanished unnoticed), the watchdog prints which rank and call,
  and kills the rank: the job ends with that message instead of hanging.

The watchdog exits when its rank exits.  Run as a module it is the watchdog
process itself (``python .../resilience/watchdog.py``).
"""
import argparse
import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from typing import NamedTuple, Optional, Sequence

HEARTBEAT_FORMAT = '<di'  # entry time (time.monotonic, 0 = outside), op
HEARTBEAT_SIZE = struct.calcsize(HEARTBEAT_FORMAT)
POLL_SECONDS = 0.1


class WatchdogSettings(NamedTuple):
    """Time limits of the watchdog (seconds; ``None`` disables one check).

    Attributes:
        stop_timeout: A rank stopped this long is killed (becomes a failure
            that ULFM reports to the others).
        call_timeout: A rank inside one MPI call this long is killed with a
            message (the job ends).  Must exceed the longest legitimate wait,
            e.g. a snapshot written by rank 0 or the start of a replacement.
    """
    stop_timeout: Optional[float] = 10.0
    call_timeout: Optional[float] = 120.0


class Heartbeat:
    """The rank's side: marks entry into and exit from MPI calls.

    The heartbeat is anonymous shared memory (``memfd``), handed to the
    watchdog process as an inherited descriptor: it has no name in
    ``/dev/shm``, so nothing is left behind even when the rank and its
    watchdog are both killed.

    Args:
        operations: Names of the calls (their index is what is stored).
    """

    def __init__(self, operations: Sequence[str]):
        self.operations = list(operations)
        self._index = {name: i for i, name in enumerate(self.operations)}
        self._map: Optional[mmap.mmap] = None
        self.fd: Optional[int] = os.memfd_create('chainer_prefetch_heartbeat')
        try:
            os.ftruncate(self.fd, HEARTBEAT_SIZE)
            self._map = mmap.mmap(self.fd, HEARTBEAT_SIZE)
        except BaseException:
            self.close()
            raise

    def enter(self, operation: str) -> None:
        """Records that the rank enters ``operation`` now."""
        struct.pack_into(HEARTBEAT_FORMAT, self._map, 0, time.monotonic(),
                         self._index.get(operation, -1))

    def leave(self) -> None:
        """Records that the rank is outside MPI."""
        struct.pack_into(HEARTBEAT_FORMAT, self._map, 0, 0.0, -1)

    def close(self) -> None:
        """Unmaps the heartbeat and closes its descriptor (idempotent)."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Watchdog:
    """Owns the watchdog process of this rank.

    Args:
        rank: Rank shown in messages.
        settings: Time limits.
        operations: Names of the MPI calls the heartbeat reports.
    """

    def __init__(self, rank: int, settings: WatchdogSettings,
                 operations: Sequence[str]):
        self.heartbeat = Heartbeat(operations)
        self.process: Optional[subprocess.Popen] = None
        # Started by path: only the standard library is imported (fast).
        command = [sys.executable, os.path.abspath(__file__),
                   '--pid', str(os.getpid()), '--rank', str(rank),
                   '--heartbeat-fd', str(self.heartbeat.fd),
                   '--operations', ','.join(operations)]
        if settings.stop_timeout is not None:
            command += ['--stop-timeout', str(settings.stop_timeout)]
        if settings.call_timeout is not None:
            command += ['--call-timeout', str(settings.call_timeout)]
        try:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                            pass_fds=(self.heartbeat.fd,))
        except BaseException:
            self.heartbeat.close()
            raise

    def stop(self) -> None:
        """Stops the watchdog process, removes the heartbeat (idempotent)."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None
        self.heartbeat.close()


def process_state(pid: int) -> Optional[str]:
    """The one-letter state of ``pid`` from ``/proc`` (None: gone)."""
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            return f.read().rsplit(')', 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def decide(state: Optional[str], stopped_for: float, call_started: float,
           now: float, stop_timeout: Optional[float],
           call_timeout: Optional[float]) -> Optional[str]:
    """The pure decision of one watchdog poll.

    Args:
        state: Process state letter (None: the rank is gone).
        stopped_for: Seconds the rank has been seen stopped without pause.
        call_started: ``time.monotonic()`` at entry into the current MPI
            call, 0 when outside MPI.
        now: ``time.monotonic()`` now.
        stop_timeout, call_timeout: Limits (None: no limit).

    Returns:
        ``'exit'`` (rank gone), ``'stopped'``, ``'call'`` (kill the rank for
        that reason) or None (keep watching).
    """
    if state is None or state in ('Z', 'X'):
        return 'exit'
    if (stop_timeout is not None and state == 'T'
            and stopped_for >= stop_timeout):
        return 'stopped'
    if (call_timeout is not None and call_started > 0 and state != 'T'
            and now - call_started >= call_timeout):
        return 'call'
    return None


def watch(pid: int, rank: int, heartbeat_fd: int, operations: Sequence[str],
          stop_timeout: Optional[float], call_timeout: Optional[float]) -> int:
    """The watchdog loop; returns the process exit status.

    Args:
        pid: The rank's process.
        rank: Its rank (shown in messages).
        heartbeat_fd: The heartbeat's descriptor, inherited from the rank.
        operations: Names of the MPI calls the heartbeat reports.
        stop_timeout, call_timeout: As in :class:`WatchdogSettings`.
    """
    shared = mmap.mmap(heartbeat_fd, HEARTBEAT_SIZE, access=mmap.ACCESS_READ)
    os.close(heartbeat_fd)
    stopped_since = None
    try:
        while True:
            if os.getppid() != pid:
                return 0
            state = process_state(pid)
            now = time.monotonic()
            if state == 'T':
                stopped_since = now if stopped_since is None else stopped_since
            else:
                stopped_since = None
            call_started, operation = struct.unpack_from(
                HEARTBEAT_FORMAT, shared, 0)
            verdict = decide(state, 0.0 if stopped_since is None
                             else now - stopped_since, call_started, now,
                             stop_timeout, call_timeout)
            if verdict == 'exit':
                return 0
            if verdict is not None:
                name = (operations[operation]
                        if 0 <= operation < len(operations) else 'call')
                if verdict == 'stopped':
                    message = ('rank {} (pid {}) has been stopped for '
                               '{:.1f} s '
                               '(limit {} s): killing it so that the other '
                               'ranks see a process failure'.format(
                                   rank, pid, now - stopped_since,
                                   stop_timeout))
                else:
                    message = ('rank {} (pid {}): MPI {} made no progress for '
                               '{:.1f} s (limit {} s): a peer hung or exited '
                               'without finalizing; ending this rank'.format(
                                   rank, pid, name, now - call_started,
                                   call_timeout))
                sys.stderr.write('chainer_prefetch watchdog: {}\n'.format(
                    message))
                sys.stderr.flush()
                os.kill(pid, signal.SIGKILL)
                return 0
            time.sleep(POLL_SECONDS)
    finally:
        shared.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--pid', type=int, required=True)
    parser.add_argument('--rank', type=int, required=True)
    parser.add_argument('--heartbeat-fd', type=int, required=True)
    parser.add_argument('--operations', default='')
    parser.add_argument('--stop-timeout', type=float, default=None)
    parser.add_argument('--call-timeout', type=float, default=None)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rank decides
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return watch(args.pid, args.rank, args.heartbeat_fd,
                 args.operations.split(','), args.stop_timeout,
                 args.call_timeout)


if __name__ == '__main__':
    sys.exit(main())
