"""The emulated storage's FUSE daemon: a read-only pass-through with latency.

Started by :func:`chainer_prefetch_bench.testbed.storage.mount.start` as
``python -m chainer_prefetch_bench.testbed.storage.daemon SOURCE MOUNTPOINT
--open-latency-ms X --read-latency-ms Y --bandwidth-mbps Z
--metadata-latency-ms M --cache-timeout-s T [--counts-file PATH]``; runs in
the foreground until unmounted or signalled.  With ``--counts-file`` it
counts the operations it serves there (:mod:`.counts`).
"""
import argparse
import errno
import os
import threading
import time
from typing import List, Optional, Sequence

from chainer_prefetch_bench.testbed.storage.counts import OpCounter
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


class _NoCounter:
    """Stands in for :class:`OpCounter` when nothing is counted."""

    def add(self, name: str, n: int = 1) -> None:
        pass


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class ThrottledPassthrough:
    """Read-only FUSE operations over a folder, with added latency.

    The mount is made with the ``ro`` option, so the kernel refuses writes
    before they reach the daemon; ``open`` refuses write access as well.
    Every operation is counted when it starts being served (``read_bytes``
    once the data are read), so the counts include failed ones (a lookup
    of a missing name is a ``getattr`` that fails).

    Args:
        source: Folder to serve.
        params: The emulation parameters.
        counts_file: File to keep the operation counts in
            (:class:`~.counts.OpCounter`); None counts nothing.
    """

    use_ns = True  # mfusepy: timestamps in nanoseconds

    def __init__(self, source: str, params: Params,
                 counts_file: Optional[str] = None) -> None:
        self.source = os.path.realpath(source)
        self.open_latency = params.open_latency_ms / 1000
        self.read_latency = params.read_latency_ms / 1000
        self.metadata_latency = params.metadata_latency_ms / 1000
        self.bucket = TokenBucket(params.bandwidth_mbps * 1e6, BURST_BYTES)
        self.counter = (OpCounter(counts_file) if counts_file
                        else _NoCounter())

    def _real(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip('/'))

    def getattr(self, path: str, fh: Optional[int] = None) -> dict:
        # A lookup and a stat, with or without a handle, are each a round
        # trip to the metadata server.
        self.counter.add('getattr')
        if fh is not None:
            self.counter.add('getattr_fh')
        _sleep(self.metadata_latency)
        st = os.lstat(self._real(path)) if fh is None else os.fstat(fh)
        attrs = {key: getattr(st, key) for key in (
            'st_mode', 'st_nlink', 'st_uid', 'st_gid', 'st_size', 'st_ino',
            'st_blocks', 'st_blksize')}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns,
                     st_ctime=st.st_ctime_ns)
        return attrs

    def opendir(self, path: str) -> int:
        self.counter.add('opendir')
        _sleep(self.metadata_latency)
        return 0

    def readdir(self, path: str, fh: int) -> List[str]:
        self.counter.add('readdir')
        _sleep(self.metadata_latency)
        return ['.', '..'] + os.listdir(self._real(path))

    def readlink(self, path: str) -> str:
        self.counter.add('readlink')
        return os.readlink(self._real(path))

    def access(self, path: str, amode: int) -> int:
        self.counter.add('access')
        if amode & os.W_OK:
            raise OSError(errno.EROFS, 'read-only file system')
        if not os.access(self._real(path), amode):
            raise OSError(errno.EACCES, 'permission denied')
        return 0

    def statfs(self, path: str) -> dict:
        self.counter.add('statfs')
        st = os.statvfs(self._real(path))
        return {key: getattr(st, key) for key in (
            'f_bsize', 'f_frsize', 'f_blocks', 'f_bfree', 'f_bavail',
            'f_files', 'f_ffree', 'f_favail', 'f_flag', 'f_namemax')}

    def open(self, path: str, flags: int) -> int:
        self.counter.add('open')
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, 'read-only file system')
        _sleep(self.open_latency)
        return os.open(self._real(path), os.O_RDONLY)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        self.counter.add('read')
        _sleep(self.read_latency)
        data = os.pread(fh, size, offset)
        self.counter.add('read_bytes', len(data))
        self.bucket.consume(len(data))
        return data

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0


def serve(source: str, mountpoint: str, params: Params,
          counts_file: Optional[str] = None) -> None:
    """Run the FUSE loop in the foreground until unmounted or signalled.

    Args:
        source: Folder to serve.
        mountpoint: Where to mount it.
        params: The emulation parameters.
        counts_file: File to keep the operation counts in; None counts
            nothing.
    """
    import mfusepy
    operations = ThrottledPassthrough(source, params, counts_file)
    # libfuse handles SIGTERM/SIGINT/SIGHUP itself: it leaves its loop and
    # unmounts.
    # The kernel keeps attributes and names for params.cache_timeout_s;
    # until then a stat or a lookup does not reach the daemon.
    mfusepy.FUSE(operations, mountpoint,
                 foreground=True, nothreads=False, ro=True,
                 fsname='shared_storage:' + os.path.realpath(source),
                 subtype='shared_storage',
                 attr_timeout=params.cache_timeout_s,
                 entry_timeout=params.cache_timeout_s)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Serve SOURCE at MOUNTPOINT until unmounted.

    Args:
        argv: ``SOURCE MOUNTPOINT --open-latency-ms X --read-latency-ms Y
            --bandwidth-mbps Z --metadata-latency-ms M --cache-timeout-s T
            [--counts-file PATH]`` (default: ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('source')
    parser.add_argument('mountpoint')
    parser.add_argument('--open-latency-ms', type=float, default=0.0)
    parser.add_argument('--read-latency-ms', type=float, default=0.0)
    parser.add_argument('--bandwidth-mbps', type=float, default=0.0)
    parser.add_argument('--metadata-latency-ms', type=float, default=0.0)
    parser.add_argument('--cache-timeout-s', type=float, default=3600.0)
    parser.add_argument('--counts-file',
                        help='keep the operation counts in this file')
    args = parser.parse_args(argv)
    serve(args.source, args.mountpoint,
          Params(open_latency_ms=args.open_latency_ms,
                 read_latency_ms=args.read_latency_ms,
                 bandwidth_mbps=args.bandwidth_mbps,
                 metadata_latency_ms=args.metadata_latency_ms,
                 cache_timeout_s=args.cache_timeout_s),
          args.counts_file)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
