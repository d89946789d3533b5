#!/usr/bin/env python
"""Emulated shared storage (Lustre/GPFS stand-in) through a real FUSE mount.

pip packages: ``mfusepy`` (pure-Python ctypes binding; loads libfuse2 when
present, else libfuse3).  Debian packages: ``fuse3`` (fusermount, kernel
helper) and ``libfuse2``; see scripts/requirements-storage.txt and
scripts/apt-packages.txt.

SOURCE is mounted read-only at MOUNTPOINT by a daemon process that adds

* a latency per ``open`` (metadata round trip to the servers),
* a latency per ``read`` request the kernel sends (data round trip), and
* a bandwidth cap for the whole mount, shared by all readers (token bucket
  with a 256 KiB burst).

Baseline loaders and chainer_prefetch read the same POSIX paths unchanged.

Subcommands::

    start SOURCE MOUNTPOINT [--preset paper|mild | --open-latency-ms X
                             --read-latency-ms Y --bandwidth-mbps Z]
    stop MOUNTPOINT
    status MOUNTPOINT
    calibrate MOUNTPOINT [--readers 1,2,4,8,16] [--files N] [--json PATH]
    ratio DATASET_DIR [--preset NAME | ...] [--batches 30] [--repeats 1]

Design choices:

* The kernel page cache is kept, but FUSE drops a file's cached pages on every
  ``open`` unless the daemon sets ``keep_cache``, which it does not.  So
  every open of a file goes to the daemon and pays the open latency, and its
  data comes through the daemon again (read latency and bandwidth paid once
  per open), as on a parallel file system serving a dataset much larger
  than client memory; within one open, kernel readahead still turns many
  small ``read()`` calls into a few large FUSE requests (128 KiB each), as
  Lustre's client readahead does.  ``direct_io`` is not used: it would turn
  every small application read into a request and overstate the cost.
* Latency is ``time.sleep`` in libfuse's worker threads (multi-threaded FUSE
  loop), so concurrent requests overlap like requests to many storage
  servers, and the daemon uses almost no CPU (see ``status``/``calibrate``).
* Stat and directory listing are free, and the kernel caches attributes
  and names for an hour; only open and read pay.

Presets, tuned with ``ratio --batches 40 --repeats 3`` on the 2-core
development machine (dataset: make_dataset.py, 2,000 train images, mean
110 KB; Chainer MultiprocessIterator, n_processes=2, batch 32,
LabeledImageDataset decoding with PIL, no resize; one warm-up batch, then 40
timed batches).  Local reads ran at 390-455 img/s when the machine was
otherwise idle (one core decodes these images at ~430 img/s), and as low as
270 img/s when other jobs shared the cores, so ratios vary with load; the
mounted rates were stable to +-3%:

* ``paper`` (open 18 ms, read 5 ms, 100 MB/s): the paper's Table 2 ratio,
  480.85 s / 59.49 s = 8.1x.  Mounted 50-53 img/s; ratio 8.1-8.6 against
  an idle machine's local rate (open 17 ms gave 54.4 img/s, ratio 7.3-8.0).
* ``mild`` (open 2 ms, read 0.5 ms, 400 MB/s): about 2x.  Mounted
  202-218 img/s, local 424-448 img/s, ratio 2.06.
* For reference, no latency at all: mounted 309-343 img/s, ratio 1.41 (the
  FUSE path itself; the daemon used ~0.6 ms CPU per image read with PIL).

With LabeledImageDataset each image costs one open and about two read
requests (PIL reads the header first, then the rest).  ``calibrate`` with the
paper preset (whole files, plain reads): 1 reader 37 files/s (5 MB/s), 16
readers 490 files/s (57 MB/s, under the 100 MB/s cap), daemon CPU 0.18 s for
320 files; so a prefetcher with many threads hides the latency, as on real
shared storage.

The daemon runs in its own session, keeps a state file and a log under
``$SHARED_STORAGE_STATE_DIR`` (default ``/tmp/shared_storage``) keyed by
the mount point, and ``stop``/the next ``start`` clean up a stale mount left
by a killed daemon ("Transport endpoint is not connected").
"""
import argparse
import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional, Sequence

PRESETS: Dict[str, Dict[str, float]] = {
    'paper': {'open_latency_ms': 18.0, 'read_latency_ms': 5.0,
              'bandwidth_mbps': 100.0},
    'mild': {'open_latency_ms': 2.0, 'read_latency_ms': 0.5,
             'bandwidth_mbps': 400.0},
}
"""Named parameter sets; see the module docstring for what they emulate."""

BURST_BYTES = 256 * 1024
"""Bytes the bandwidth token bucket may hold (the largest burst)."""

STATE_DIR = os.environ.get(
    'SHARED_STORAGE_STATE_DIR',
    os.path.join(tempfile.gettempdir(), 'shared_storage'))
"""Folder of the daemons' state and log files."""

_COMMAND_TIMEOUT = 5.0
"""Seconds any helper command (fusermount, umount) may take."""


@dataclass(frozen=True)
class Params:
    """What the emulated storage adds to each operation.

    Attributes:
        open_latency_ms: Milliseconds added to every open.
        read_latency_ms: Milliseconds added to every read request.
        bandwidth_mbps: Cap on the mount's total read rate in MB/s
            (10^6 bytes); 0 means no cap.
    """

    open_latency_ms: float = 0.0
    read_latency_ms: float = 0.0
    bandwidth_mbps: float = 0.0

    @classmethod
    def from_preset(cls, name: str) -> 'Params':
        """Parameters of a named preset.

        Args:
            name: A key of :data:`PRESETS`.

        Returns:
            The preset's :class:`Params`.
        """
        if name not in PRESETS:
            raise ValueError('unknown preset {!r}; known: {}'.format(
                name, ', '.join(sorted(PRESETS))))
        return cls(**PRESETS[name])


@dataclass
class Mount:
    """A running emulated mount.

    Attributes:
        source: Folder served.
        mountpoint: Where it is mounted.
        pid: Process id of the FUSE daemon.
        params: The emulation parameters.
        log_path: The daemon's log file.
    """

    source: str
    mountpoint: str
    pid: int
    params: Params
    log_path: str

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) the daemon has used so far."""
        return process_cpu_seconds(self.pid)


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
                '`pip install -r scripts/requirements-storage.txt`.')
    except OSError as exc:
        return ('libfuse cannot be loaded ({}).  Install it: '
                '`apt-get install -y libfuse2 fuse3`.'.format(exc))
    return None


def _fusermount() -> Optional[str]:
    return shutil.which('fusermount3') or shutil.which('fusermount')


# ---------------------------------------------------------------- daemon


class TokenBucket:
    """A thread-safe token bucket limiting bytes per second.

    Args:
        rate: Bytes per second; 0 or less disables the limit.
        burst: Largest number of tokens the bucket holds.
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def consume(self, n: int) -> None:
        """Take ``n`` tokens, sleeping as long as the bucket is in debt.

        Args:
            n: Bytes transferred.
        """
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst,
                               self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            debt = -self._tokens
        if debt > 0:
            time.sleep(debt / self.rate)


class ThrottledPassthrough:
    """Read-only FUSE operations over a folder, with added latency.

    The mount is made with the ``ro`` option, so the kernel refuses writes
    before they reach the daemon; ``open`` refuses write access as well.

    Args:
        source: Folder to serve.
        params: The emulation parameters.
    """

    use_ns = True  # mfusepy: timestamps in nanoseconds

    def __init__(self, source: str, params: Params) -> None:
        self.source = os.path.realpath(source)
        self.open_latency = params.open_latency_ms / 1000
        self.read_latency = params.read_latency_ms / 1000
        self.bucket = TokenBucket(params.bandwidth_mbps * 1e6, BURST_BYTES)

    def _real(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip('/'))

    def getattr(self, path: str, fh: Optional[int] = None) -> dict:
        st = os.lstat(self._real(path)) if fh is None else os.fstat(fh)
        attrs = {key: getattr(st, key) for key in (
            'st_mode', 'st_nlink', 'st_uid', 'st_gid', 'st_size', 'st_ino',
            'st_blocks', 'st_blksize')}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns,
                     st_ctime=st.st_ctime_ns)
        return attrs

    def readdir(self, path: str, fh: int) -> List[str]:
        return ['.', '..'] + os.listdir(self._real(path))

    def readlink(self, path: str) -> str:
        return os.readlink(self._real(path))

    def access(self, path: str, amode: int) -> int:
        if amode & os.W_OK:
            raise OSError(errno.EROFS, 'read-only file system')
        if not os.access(self._real(path), amode):
            raise OSError(errno.EACCES, 'permission denied')
        return 0

    def statfs(self, path: str) -> dict:
        st = os.statvfs(self._real(path))
        return {key: getattr(st, key) for key in (
            'f_bsize', 'f_frsize', 'f_blocks', 'f_bfree', 'f_bavail',
            'f_files', 'f_ffree', 'f_favail', 'f_flag', 'f_namemax')}

    def open(self, path: str, flags: int) -> int:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, 'read-only file system')
        time.sleep(self.open_latency)
        return os.open(self._real(path), os.O_RDONLY)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        time.sleep(self.read_latency)
        data = os.pread(fh, size, offset)
        self.bucket.consume(len(data))
        return data

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0


def _serve(source: str, mountpoint: str, params: Params) -> None:
    """Run the FUSE loop in the foreground until unmounted or signalled."""
    import mfusepy
    # libfuse handles SIGTERM/SIGINT/SIGHUP itself: it leaves its loop and
    # unmounts.
    # Attributes and names are cached by the kernel for an hour (the data
    # are read-only): fewer getattr/lookup calls keep the daemon's CPU low.
    mfusepy.FUSE(ThrottledPassthrough(source, params), mountpoint,
                 foreground=True, nothreads=False, ro=True,
                 fsname='shared_storage:' + os.path.realpath(source),
                 subtype='shared_storage', attr_timeout=3600,
                 entry_timeout=3600)


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
                 Params(**state['params']), state['log_path'])


def is_mounted(mountpoint: str) -> bool:
    """Whether a FUSE file system is mounted at ``mountpoint``.

    Reads /proc/self/mountinfo only, so it never blocks on a hung mount.

    Args:
        mountpoint: Path to check.

    Returns:
        True if a ``fuse*`` file system is mounted there.
    """
    real = os.path.realpath(mountpoint)
    with open('/proc/self/mountinfo') as f:
        for line in f:
            fields = line.split()
            sep = fields.index('-')
            point = re.sub(r'\\([0-7]{3})',
                           lambda m: chr(int(m.group(1), 8)), fields[4])
            if point == real and fields[sep + 1].startswith('fuse'):
                return True
    return False


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
    return '_serve' in argv and os.path.realpath(mountpoint) in argv


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
    with open(log_path, 'wb') as log:
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), '_serve', source,
             real, '--open-latency-ms', repr(params.open_latency_ms),
             '--read-latency-ms', repr(params.read_latency_ms),
             '--bandwidth-mbps', repr(params.bandwidth_mbps)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True)
    _CHILDREN[real] = child
    mount = Mount(source, real, child.pid, params, log_path)
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
        **params: ``open_latency_ms``, ``read_latency_ms``,
            ``bandwidth_mbps``.

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


# ---------------------------------------------------------------- calibrate


def _drop_cache(path: str) -> None:
    """Ask the kernel to drop a file's cached pages."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_page_cache(*roots: str) -> int:
    """Drops the cached pages of every file under ``roots``.

    Used between benchmark runs so that "cold" is cold
    (``posix_fadvise(POSIX_FADV_DONTNEED)``; needs no privileges).

    Args:
        roots: Folders (missing ones are skipped).

    Returns:
        How many files were visited.
    """
    count = 0
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                _drop_cache(os.path.join(folder, name))
                count += 1
    return count


def _read_whole(path: str) -> int:
    n = 0
    with open(path, 'rb', buffering=0) as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return n
            n += len(chunk)


def calibrate(mountpoint: str, readers: Sequence[int] = (1, 2, 4, 8, 16),
              files: int = 64) -> dict:
    """Measure what the mount delivers to concurrent readers.

    For each reader count, ``files`` distinct files (not read before in
    this calibration while enough exist) have their source pages dropped
    from the page cache and are then read whole by that many threads.

    Args:
        mountpoint: A mount started by :func:`start`.
        readers: Reader-thread counts to measure.
        files: Files read per reader count.

    Returns:
        A dict with ``params``, ``rows`` (readers, files, seconds, files_per_s,
        mb_per_s, daemon_cpu_s) and ``daemon_cpu_s`` for the whole run.
    """
    state = _read_state(mountpoint)
    if state is None or not _daemon_alive(state['pid'], mountpoint):
        raise MountError('no running emulated mount at {}'.format(mountpoint))
    mount = _mount_from_state(state)
    rels = sorted(
        os.path.relpath(os.path.join(folder, name), mount.mountpoint)
        for folder, _, names in os.walk(mount.mountpoint) for name in names)
    if not rels:
        raise MountError('no files under {}'.format(mountpoint))
    cpu_start = mount.cpu_seconds()
    rows = []
    next_file = 0
    for n_readers in readers:
        batch = [rels[(next_file + i) % len(rels)] for i in range(files)]
        next_file += files
        for rel in batch:
            _drop_cache(os.path.join(mount.source, rel))
        cpu_before = mount.cpu_seconds()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n_readers) as pool:
            total = sum(pool.map(
                _read_whole,
                [os.path.join(mount.mountpoint, rel) for rel in batch]))
        seconds = time.perf_counter() - t0
        rows.append({'readers': n_readers, 'files': files,
                     'seconds': round(seconds, 4),
                     'files_per_s': round(files / seconds, 2),
                     'mb_per_s': round(total / seconds / 1e6, 3),
                     'daemon_cpu_s': round(mount.cpu_seconds() - cpu_before,
                                           3)})
    return {'params': asdict(mount.params), 'rows': rows,
            'files_available': len(rels),
            'daemon_cpu_s': round(mount.cpu_seconds() - cpu_start, 3)}


def _print_calibration(result: dict) -> None:
    print('params: {}'.format(result['params']))
    print('{:>8} {:>6} {:>9} {:>9} {:>9} {:>12}'.format(
        'readers', 'files', 'seconds', 'files/s', 'MB/s', 'daemon CPU s'))
    for row in result['rows']:
        print('{readers:>8} {files:>6} {seconds:>9.3f} {files_per_s:>9.1f} '
              '{mb_per_s:>9.2f} {daemon_cpu_s:>12.3f}'.format(**row))
    print('daemon CPU seconds during calibration: {:.3f}'.format(
        result['daemon_cpu_s']))
    if result['files_available'] < len(result['rows']) * result['rows'][0][
            'files']:
        print('note: only {} files exist, so some were read more than once'
              .format(result['files_available']))


# ---------------------------------------------------------------- ratio


def time_iterator(dataset_dir: str, batches: int, batch_size: int = 32,
                  n_processes: int = 2) -> float:
    """Images per second Chainer's MultiprocessIterator delivers.

    Reads ``dataset_dir/train.txt`` with LabeledImageDataset (PIL decode, no
    resize); one warm-up batch, then ``batches`` timed batches.

    Args:
        dataset_dir: Dataset root (local folder or mount point).
        batches: Batches timed.
        batch_size: Images per batch.
        n_processes: Iterator worker processes.

    Returns:
        Images per second over the timed batches.
    """
    import chainer
    dataset = chainer.datasets.LabeledImageDataset(
        os.path.join(dataset_dir, 'train.txt'), root=dataset_dir)
    iterator = chainer.iterators.MultiprocessIterator(
        dataset, batch_size, repeat=True, shuffle=False,
        n_processes=n_processes)
    with warnings.catch_warnings():
        # Workers (forked, so they inherit this filter) pickle the examples
        # that exceed the shared memory sized from the first batch; that is
        # the same on both paths and only noise here.
        warnings.filterwarnings('ignore', 'Shared memory size is too small')
        try:
            iterator.next()
            t0 = time.perf_counter()
            for _ in range(batches):
                iterator.next()
            return batches * batch_size / (time.perf_counter() - t0)
        finally:
            iterator.finalize()


def measure_ratio(dataset_dir: str, params: Params, batches: int = 30,
                  batch_size: int = 32, n_processes: int = 2,
                  repeats: int = 1) -> dict:
    """How much slower MultiprocessIterator is through the emulated mount.

    Local and mounted runs alternate ``repeats`` times; the medians are
    compared, which damps noise from other load on the machine.

    Args:
        dataset_dir: Dataset made by scripts/make_dataset.py.
        params: The emulation parameters.
        batches: Batches timed per run.
        batch_size: Images per batch.
        n_processes: Iterator worker processes.
        repeats: Runs on each path.

    Returns:
        A dict with ``local_img_s``, ``mount_img_s`` (medians, and all runs
        in ``local_runs``/``mount_runs``), ``ratio`` (local rate over mount
        rate), ``daemon_cpu_s`` (during the mounted runs) and ``params``.
    """
    local_runs, mount_runs = [], []
    cpu = 0.0
    with mounted(dataset_dir, **asdict(params)) as mount:
        for _ in range(repeats):
            local_runs.append(time_iterator(dataset_dir, batches, batch_size,
                                            n_processes))
            cpu0 = mount.cpu_seconds()
            mount_runs.append(time_iterator(mount.mountpoint, batches,
                                            batch_size, n_processes))
            cpu += mount.cpu_seconds() - cpu0
    local, remote = statistics.median(local_runs), statistics.median(
        mount_runs)
    return {'params': asdict(params), 'local_img_s': round(local, 2),
            'mount_img_s': round(remote, 2), 'ratio': round(local / remote, 2),
            'local_runs': [round(v, 2) for v in local_runs],
            'mount_runs': [round(v, 2) for v in mount_runs],
            'daemon_cpu_s': round(cpu, 3)}


# ---------------------------------------------------------------- CLI


def _add_param_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--preset', choices=sorted(PRESETS))
    parser.add_argument('--open-latency-ms', type=float)
    parser.add_argument('--read-latency-ms', type=float)
    parser.add_argument('--bandwidth-mbps', type=float,
                        help='MB/s for the whole mount; 0: no cap')


def _params_from_args(args: argparse.Namespace) -> Params:
    values = dict(PRESETS[args.preset]) if args.preset else {}
    for name in ('open_latency_ms', 'read_latency_ms', 'bandwidth_mbps'):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return Params(**values)


def _cmd_status(mountpoint: str) -> int:
    state = _read_state(mountpoint)
    mounted_now = is_mounted(mountpoint)
    if state is None:
        print('{}: not started by this script (mounted: {})'.format(
            mountpoint, mounted_now))
        return 1
    mount = _mount_from_state(state)
    alive = _daemon_alive(mount.pid, mount.mountpoint)
    print('mountpoint: {}\nsource: {}\nmounted: {}\npid: {} ({})\n'
          'open latency: {} ms\nread latency: {} ms\nbandwidth: {} MB/s\n'
          'daemon CPU seconds: {:.3f}\nlog: {}'.format(
              mount.mountpoint, mount.source, mounted_now, mount.pid,
              'running' if alive else 'dead', mount.params.open_latency_ms,
              mount.params.read_latency_ms,
              mount.params.bandwidth_mbps or 'unlimited',
              mount.cpu_seconds() if alive else 0.0, mount.log_path))
    return 0 if alive and mounted_now else 1


def _exit_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so mounts and workers are stopped.

    Processes forked from this one (iterator workers) keep the default
    action, since their parents stop them with SIGTERM.
    """
    main_pid = os.getpid()

    def handler(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    parser = argparse.ArgumentParser(
        description='Emulated shared storage through a FUSE mount.')
    sub = parser.add_subparsers(dest='command', required=True)
    p = sub.add_parser('start', help='mount in the background')
    p.add_argument('source')
    p.add_argument('mountpoint')
    _add_param_args(p)
    p = sub.add_parser('stop', help='unmount and stop the daemon')
    p.add_argument('mountpoint')
    p = sub.add_parser('status', help='show parameters, pid and CPU time')
    p.add_argument('mountpoint')
    p = sub.add_parser('calibrate', help='measure files/s and MB/s')
    p.add_argument('mountpoint')
    p.add_argument('--readers', default='1,2,4,8,16')
    p.add_argument('--files', type=int, default=64)
    p.add_argument('--json', help='also write the results here')
    p = sub.add_parser('ratio', help='MultiprocessIterator slowdown')
    p.add_argument('dataset_dir')
    _add_param_args(p)
    p.add_argument('--batches', type=int, default=30)
    p.add_argument('--batch-size', type=int, default=32)
    p.add_argument('--processes', type=int, default=2)
    p.add_argument('--repeats', type=int, default=1,
                   help='alternating runs per path; medians are compared')
    p = sub.add_parser('_serve', help=argparse.SUPPRESS)
    p.add_argument('source')
    p.add_argument('mountpoint')
    _add_param_args(p)
    args = parser.parse_args(argv)

    if args.command == '_serve':
        _serve(args.source, args.mountpoint, _params_from_args(args))
        return 0
    if args.command in ('start', 'calibrate', 'ratio'):
        problem = fuse_problem()
        if problem:
            print('FUSE is not usable: ' + problem, file=sys.stderr)
            return 2
    _exit_on_sigterm()
    try:
        if args.command == 'start':
            mount = start(args.source, args.mountpoint,
                          _params_from_args(args))
            print('mounted {} at {} (pid {}, {})'.format(
                mount.source, mount.mountpoint, mount.pid,
                asdict(mount.params)))
        elif args.command == 'stop':
            if not stop(args.mountpoint):
                print('nothing was mounted at {}'.format(args.mountpoint))
        elif args.command == 'status':
            return _cmd_status(args.mountpoint)
        elif args.command == 'calibrate':
            result = calibrate(args.mountpoint,
                               [int(v) for v in args.readers.split(',')],
                               args.files)
            _print_calibration(result)
            if args.json:
                with open(args.json, 'w') as f:
                    json.dump(result, f, indent=2)
        else:
            result = measure_ratio(args.dataset_dir, _params_from_args(args),
                                   args.batches, args.batch_size,
                                   args.processes, args.repeats)
            print(json.dumps(result))
    except MountError as exc:
        print('error: {}'.format(exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print('interrupted', file=sys.stderr)
        return 130
    return 0


if __name__ == '__main__':
    sys.exit(main())
