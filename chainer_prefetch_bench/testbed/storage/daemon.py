"""The emulated storage's FUSE daemon: a read-only pass-through with latency.

Started by :func:`chainer_prefetch_bench.testbed.storage.mount.start` as
``python -m chainer_prefetch_bench.testbed.storage.daemon SOURCE MOUNTPOINT
--open-latency-ms X --read-latency-ms Y --bandwidth-mbps Z``; runs in the
foreground until unmounted or signalled.
"""
import argparse
import errno
import os
import threading
import time
from typing import List, Optional, Sequence

from chainer_prefetch_bench.testbed.storage.presets import Params

BURST_BYTES = 256 * 1024
"""Bytes the bandwidth token bucket may hold (the largest burst)."""


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


def serve(source: str, mountpoint: str, params: Params) -> None:
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Serve SOURCE at MOUNTPOINT until unmounted.

    Args:
        argv: ``SOURCE MOUNTPOINT --open-latency-ms X --read-latency-ms Y
            --bandwidth-mbps Z`` (default: ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('source')
    parser.add_argument('mountpoint')
    parser.add_argument('--open-latency-ms', type=float, default=0.0)
    parser.add_argument('--read-latency-ms', type=float, default=0.0)
    parser.add_argument('--bandwidth-mbps', type=float, default=0.0)
    args = parser.parse_args(argv)
    serve(args.source, args.mountpoint,
          Params(args.open_latency_ms, args.read_latency_ms,
                 args.bandwidth_mbps))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
