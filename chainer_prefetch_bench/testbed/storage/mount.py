"""The emulated storage mount's life cycle: start, wait, stop, clean up.

:func:`start` runs the daemon (:mod:`.daemon`) in its own session and
returns once the mount shows the source's entries; :func:`stop` asks it to
leave, kills it after a timeout, and unmounts whatever is left (lazily if
busy); :func:`mounted` does both around a ``with`` block.  Each mount keeps
a state file and a log under ``$SHARED_STORAGE_STATE_DIR`` (default
``/tmp/shared_storage``) keyed by the mount point, so that ``stop`` (also
from another process) and the next ``start`` clean up a stale mount left by
a killed daemon ("Transport endpoint is not connected").

Each mount started by :func:`start` also has a counts file, in a folder of
its own that :func:`stop` removes, where the daemon counts the operations
it serves; :meth:`Mount.op_counts` reads it and
:func:`~.counts.counts_delta` tells what was served between two readings.
The counts, one per name of :data:`~.counts.OP_NAMES`:

* ``getattr``: attribute requests, i.e. every name lookup (a path component
  whose entry the kernel does not hold, or has held longer than the cache
  timeout) and every ``stat``/``fstat`` whose attributes are not cached;
* ``getattr_fh``: the part of ``getattr`` that carries an open file's
  handle (the kernel refreshing the size while reading near the end of a
  file whose cached attributes expired);
* ``open``: file opens (every ``open()``: the kernel does not cache them);
* ``read`` and ``read_bytes``: read requests (up to 128 KiB each after the
  kernel's readahead) and the bytes they returned;
* ``readdir`` and ``opendir``: directory listing requests and directory
  opens;
* ``readlink``, ``access``, ``statfs``: the system calls of those names
  (``access`` only for checks the kernel forwards).

An operation is counted while it is served, before the daemon replies, so
a reading taken after the caller's system call returned includes it.
"""
import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional, Sequence

from chainer_prefetch_bench.testbed.storage.counts import read_counts
from chainer_prefetch_bench.testbed.storage.presets import PRESETS, Params

DAEMON_MODULE = 'chainer_prefetch_bench.testbed.storage.daemon'
"""The module the daemon runs as (``python -m``)."""

STATE_DIR = os.environ.get(
    'SHARED_STORAGE_STATE_DIR',
    os.path.join(tempfile.gettempdir(), 'shared_storage'))
"""Folder of the daemons' state and log files."""

_COMMAND_TIMEOUT = 5.0
"""Seconds any helper command (fusermount, umount) may take."""


@dataclass
class Mount:
    """A running emulated mount.

    Attributes:
        source: Folder served.
        mountpoint: Where it is mounted.
        pid: Process id of the FUSE daemon.
        params: The emulation parameters.
        log_path: The daemon's log file.
        counts_path: The file where the daemon counts the operations it
            serves (removed by :func:`stop`).
    """

    source: str
    mountpoint: str
    pid: int
    params: Params
    log_path: str
    counts_path: Optional[str] = None

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) the daemon has used so far."""
        return process_cpu_seconds(self.pid)

    def op_counts(self) -> Dict[str, int]:
        """The operations the daemon has served since it started.

        The module docstring says what each count means.

        Returns:
            A dict from each name of :data:`~.counts.OP_NAMES` to its count.

        Raises:
            MountError: The mount has no counts file (it was stopped).
        """
        if self.counts_path is None:
            raise MountError('the mount at {} keeps no operation counts'
                             .format(self.mountpoint))
        try:
            return read_counts(self.counts_path)
        except FileNotFoundError:
            raise MountError('no operation counts for {}: the mount was '
                             'stopped'.format(self.mountpoint)) from None


class MountError(RuntimeError):
    """Raised when a mount cannot be started or stopped."""


# ---------------------------------------------------------------- checks


def fuse_problem() -> Optional[str]:
    """Tell why FUSE cannot be used here, and how to fix it.

    Returns:
        ``None`` when FUSE looks usable, else a message with the reason and
        the fix.
    """
    if not sys.platform.startswith('linux'):
        return 'FUSE emulation needs Linux (this is {}).'.format(sys.platform)
    if not os.path.exists('/dev/fuse'):
        return ('/dev/fuse is missing.  Load the kernel module '
                '(`modprobe fuse`, as root); in a container, start it with '
                '`--device /dev/fuse --cap-add SYS_ADMIN` (Docker) or '
                'equivalent.')
    if not os.access('/dev/fuse', os.R_OK | os.W_OK):
        return ('/dev/fuse is not readable and writable by this user.  Run '
                'as root, or `chmod 666 /dev/fuse` / add the user to the '
                'group owning it.')
    if _fusermount() is None:
        return ('fusermount is not installed.  Install the Debian package '
                'fuse3: `apt-get install -y fuse3 libfuse2`.')
    try:
        import mfusepy  # noqa: F401  (loads libfuse)
    except ImportError:
        return ('The Python package mfusepy is not installed: '
                "`pip install 'chainer_prefetch[bench]'`.")
    except OSError as exc:
        return ('libfuse cannot be loaded ({}).  Install it: '
                '`apt-get install -y libfuse2 fuse3`.'.format(exc))
    return None


def _fusermount() -> Optional[str]:
    return shutil.which('fusermount3') or shutil.which('fusermount')



# ---------------------------------------------------------------- state


def _state_paths(mountpoint: str):
    real = os.path.realpath(mountpoint)
    key = '{}-{}'.format(os.path.basename(real) or 'root',
                         hashlib.sha1(real.encode()).hexdigest()[:12])
    base = os.path.join(STATE_DIR, key)
    return base + '.json', base + '.log'


def _read_state(mountpoint: str) -> Optional[dict]:
    state_path, _ = _state_paths(mountpoint)
    try:
        with open(state_path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _mount_from_state(state: dict) -> Mount:
    return Mount(state['source'], state['mountpoint'], state['pid'],
                 Params(**state['params']), state['log_path'],
                 state.get('counts_path'))


_COUNTS_DIR_MARK = '.counts-'
"""Part of the name of every counts folder :func:`start` makes."""

_COUNTS_FILE = 'counts'
"""Name of the counts file in its folder."""


def _make_counts_dir(mountpoint: str) -> str:
    """A fresh folder for the counts file of the mount at ``mountpoint``."""
    state_path, _ = _state_paths(mountpoint)
    return tempfile.mkdtemp(
        prefix=os.path.basename(state_path)[:-len('.json')]
        + _COUNTS_DIR_MARK, dir=STATE_DIR)


def _remove_counts_dir(counts_path: Optional[str]) -> None:
    """Remove the folder of a counts file made by :func:`start`."""
    if not counts_path or os.path.basename(counts_path) != _COUNTS_FILE:
        return
    folder = os.path.dirname(counts_path)
    if _COUNTS_DIR_MARK in os.path.basename(folder):
        shutil.rmtree(folder, ignore_errors=True)


def read_mount(mountpoint: str) -> Optional[Mount]:
    """The mount :func:`start` recorded for ``mountpoint``, alive or not.

    Args:
        mountpoint: The mount point.

    Returns:
        The recorded :class:`Mount`, or ``None`` if none was recorded.
    """
    state = _read_state(mountpoint)
    return None if state is None else _mount_from_state(state)


def daemon_alive(mount: Mount) -> bool:
    """Whether the daemon of ``mount`` still runs.

    Args:
        mount: A mount from :func:`start` or :func:`read_mount`.

    Returns:
        True if its process is alive and serves that mount point.
    """
    return _daemon_alive(mount.pid, mount.mountpoint)


def running_mount(mountpoint: str) -> Mount:
    """The running emulated mount at ``mountpoint``.

    Args:
        mountpoint: The mount point.

    Returns:
        Its :class:`Mount`.

    Raises:
        MountError: No daemon started by :func:`start` serves it.
    """
    mount = read_mount(mountpoint)
    if mount is None or not daemon_alive(mount):
        raise MountError('no running emulated mount at {}'.format(mountpoint))
    return mount


def is_mounted(mountpoint: str) -> bool:
    """Whether a FUSE file system is mounted at ``mountpoint``.

    Reads /proc/self/mountinfo only, so it never blocks on a hung mount.

    Args:
        mountpoint: Path to check.

    Returns:
        True if a ``fuse*`` file system is mounted there.
    """
    from chainer_prefetch.staging.file_systems import read_mounts
    real = os.path.realpath(mountpoint)
    return any(mount.point == real and mount.fs_type.startswith('fuse')
               for mount in read_mounts())


def _proc_stat(pid: int) -> Optional[List[str]]:
    """Fields of /proc/PID/stat after the command name, or None."""
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            return f.read().rsplit(')', 1)[1].split()
    except (OSError, IndexError):
        return None


def _daemon_alive(pid: int, mountpoint: str) -> bool:
    """Whether ``pid`` is a live (not zombie) daemon serving ``mountpoint``."""
    fields = _proc_stat(pid)
    if fields is None or fields[0] in ('Z', 'X'):
        return False
    try:
        with open('/proc/{}/cmdline'.format(pid), 'rb') as f:
            argv = f.read().decode(errors='replace').split('\0')
    except OSError:
        return False
    return DAEMON_MODULE in argv and os.path.realpath(mountpoint) in argv


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process, from /proc/PID/stat.

    Args:
        pid: Process id.

    Returns:
        CPU seconds so far (0.0 if the process is gone).
    """
    fields = _proc_stat(pid)
    if fields is None:
        return 0.0
    # Fields 14 and 15 of stat (utime, stime); fields[0] is field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


# ---------------------------------------------------------------- start/stop

_CHILDREN: Dict[str, subprocess.Popen] = {}
"""Daemons started by this process, by real mount point, to reap on stop."""


def _run_quietly(argv: Sequence[str]) -> bool:
    try:
        return subprocess.run(argv, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL,
                              timeout=_COMMAND_TIMEOUT).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _unmount(mountpoint: str) -> None:
    """Unmount, falling back to a lazy unmount; never blocks for long."""
    fusermount = _fusermount() or 'fusermount'
    for argv in ([fusermount, '-u', mountpoint], ['umount', mountpoint],
                 [fusermount, '-u', '-z', mountpoint],
                 ['umount', '-l', mountpoint]):
        if not is_mounted(mountpoint):
            return
        _run_quietly(argv)
    if is_mounted(mountpoint):
        raise MountError('could not unmount {}'.format(mountpoint))


def _wait_gone(pid: int, mountpoint: str, timeout: float) -> bool:
    real = os.path.realpath(mountpoint)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        child = _CHILDREN.get(real)
        if child is not None and child.poll() is not None:
            return True
        if not _daemon_alive(pid, mountpoint):
            return True
        time.sleep(0.02)
    return False


def _is_stale(mountpoint: str) -> bool:
    """Whether the FUSE mount at ``mountpoint`` has lost its daemon."""
    try:
        # Not stat: the kernel may answer it from cached attributes.
        os.listdir(mountpoint)
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO)
    return False


def stop(mountpoint: str, timeout: float = 10.0) -> bool:
    """Unmount and stop the daemon; also clears a stale mount.

    Asks the daemon to leave (SIGTERM: libfuse unmounts and exits), kills it
    if it has not gone after ``timeout`` seconds, then unmounts whatever is
    left (lazily if busy).  Never waits much longer than ``timeout``.

    Args:
        mountpoint: The mount point.
        timeout: Seconds to wait for the daemon to exit before SIGKILL.

    Returns:
        True if something was stopped or unmounted.
    """
    real = os.path.realpath(mountpoint)
    state = _read_state(real)
    acted = False
    if state is not None and _daemon_alive(state['pid'], real):
        acted = True
        pid = state['pid']
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not _wait_gone(pid, real, timeout):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, real, 2.0)
    child = _CHILDREN.pop(real, None)
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=2.0)
    if is_mounted(real):
        acted = True
        _unmount(real)
    if state is not None:
        _remove_counts_dir(state.get('counts_path'))
    for path in _state_paths(real):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return acted


def start(source: str, mountpoint: str, params: Params,
          timeout: float = 15.0) -> Mount:
    """Mount ``source`` at ``mountpoint`` through the emulator, in background.

    Returns once the mount shows the source's entries.  A stale mount left
    by a killed daemon is unmounted first.

    Args:
        source: Folder to serve.
        mountpoint: Folder to mount on (created if missing).
        params: The emulation parameters.
        timeout: Seconds to wait for the mount to come up.

    Returns:
        The running :class:`Mount`.

    Raises:
        MountError: If FUSE is unusable, the mount point is taken, or the
            daemon fails to mount in time.
    """
    problem = fuse_problem()
    if problem:
        raise MountError(problem)
    source = os.path.realpath(source)
    real = os.path.realpath(mountpoint)
    if not os.path.isdir(source):
        raise MountError('source {} is not a folder'.format(source))
    state = _read_state(real)
    if is_mounted(real):
        if state is not None and _daemon_alive(state['pid'], real):
            raise MountError('{} is already mounted by pid {}; stop it '
                             'first'.format(real, state['pid']))
        if state is None and not _is_stale(real):
            raise MountError('{} has a FUSE file system not started by this '
                             'script; unmount it first'.format(real))
        stop(real)  # stale: its daemon was killed
    elif state is not None:
        stop(real)  # daemon without a mount, or leftover files
    os.makedirs(real, exist_ok=True)
    if os.listdir(real):
        raise MountError('mount point {} is not empty'.format(real))

    os.makedirs(STATE_DIR, exist_ok=True)
    state_path, log_path = _state_paths(real)
    counts_path = os.path.join(_make_counts_dir(real), _COUNTS_FILE)
    try:
        with open(log_path, 'wb') as log:
            child = subprocess.Popen(
                [sys.executable, '-m', DAEMON_MODULE, source, real,
                 '--open-latency-ms', repr(params.open_latency_ms),
                 '--read-latency-ms', repr(params.read_latency_ms),
                 '--bandwidth-mbps', repr(params.bandwidth_mbps),
                 '--metadata-latency-ms', repr(params.metadata_latency_ms),
                 '--cache-timeout-s', repr(params.cache_timeout_s),
                 '--counts-file', counts_path],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True)
    except BaseException:
        _remove_counts_dir(counts_path)
        raise
    _CHILDREN[real] = child
    mount = Mount(source, real, child.pid, params, log_path, counts_path)
    with open(state_path, 'w') as f:
        json.dump(dict(asdict(mount), params=asdict(params)), f)
    try:
        _wait_ready(mount, child, bool(os.listdir(source)), timeout)
    except BaseException:
        stop(real)
        raise
    return mount


def _wait_ready(mount: Mount, child: subprocess.Popen, expect_entries: bool,
                timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            with open(mount.log_path, errors='replace') as f:
                log = f.read()[-2000:]
            raise MountError('FUSE daemon exited with status {}:\n{}'.format(
                child.returncode, log))
        if is_mounted(mount.mountpoint) and (
                not expect_entries or os.listdir(mount.mountpoint)):
            return
        time.sleep(0.02)
    raise MountError('{} did not come up within {:.0f} s; see {}'.format(
        mount.mountpoint, timeout, mount.log_path))


@contextlib.contextmanager
def mounted(source: str, mountpoint: Optional[str] = None,
            preset: Optional[str] = None, **params: float) -> Iterator[Mount]:
    """Mount for the duration of a ``with`` block; always unmounts.

    Args:
        source: Folder to serve.
        mountpoint: Where to mount; a fresh temporary folder if None
            (removed afterwards).
        preset: Name of a preset in :data:`PRESETS`; keyword parameters
            override its values.
        **params: Fields of :class:`Params` (``open_latency_ms``,
            ``read_latency_ms``, ``bandwidth_mbps``, ``metadata_latency_ms``,
            ``cache_timeout_s``).

    Yields:
        The running :class:`Mount`.
    """
    values = dict(PRESETS[preset]) if preset else {}
    values.update(params)
    with contextlib.ExitStack() as stack:
        if mountpoint is None:
            mountpoint = stack.enter_context(
                tempfile.TemporaryDirectory(prefix='shared_storage_'))
        mount = start(source, mountpoint, Params(**values))
        stack.callback(stop, mountpoint)
        yield mount

