"""A byte budget for a local directory, shared by every process that uses it.

Several iterators (say the four ranks on one node, or a training and a
validation iterator) may share one local directory.  The limit is per
directory and enforced jointly: the bytes held under ``data/`` are counted
in one small ledger file, ``root/.capacity``, and every copy *reserves* its
bytes there before it starts (under an exclusive ``flock``), so the sum of
all processes' copies never exceeds the limit; whoever drops a copy gives its
bytes back.  A reservation that cannot be made is the caller's cue to evict
something of its own or to leave the file on shared storage.

The ledger only over-counts, never under-counts: a process killed between
reserving and copying leaves bytes reserved that no file holds.  The next
time a process opens the directory while no other process uses it (a shared
``flock`` on ``root/.capacity.users`` tells), the ledger is recounted from
the files themselves.
"""
import errno
import fcntl
import os
import struct
import threading

_LEDGER = '.capacity'
_USERS = '.capacity.users'
_FORMAT = '<Q'


class CapacityLedger:
    """Reserves and releases bytes of one directory's budget.

    Thread-safe and process-safe.  Keep the object alive while the
    directory is in use (it holds the "in use" lock); :meth:`close` lets go.

    Args:
        root: The local directory (as given to ``LocalDirectory``).
        data_root: The directory whose files count (``root/data``).
        limit_bytes: The budget.  Every process sharing the directory
            should pass the same limit; each checks its own reservations
            against the limit it was given.
    """

    def __init__(self, root: str, data_root: str, limit_bytes: int):
        self.limit_bytes = int(limit_bytes)
        self._lock = threading.Lock()
        self._users_fd = os.open(os.path.join(root, _USERS),
                                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        self._ledger_path = os.path.join(root, _LEDGER)
        self._ledger_fd = os.open(self._ledger_path,
                                  os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            alone = False
        if alone:
            with self._locked():
                self._write(bytes_under(data_root))
        fcntl.flock(self._users_fd, fcntl.LOCK_SH)  # downgrade: in use

    def reserve(self, n_bytes: int) -> bool:
        """Takes ``n_bytes`` of the budget if they are free.

        Returns:
            ``True`` if reserved; ``False`` if the limit would be exceeded.
        """
        with self._locked():
            used = self._read()
            if used + n_bytes > self.limit_bytes:
                return False
            self._write(used + n_bytes)
            return True

    def release(self, n_bytes: int):
        """Gives ``n_bytes`` back (a copy was dropped or never made)."""
        with self._locked():
            self._write(max(0, self._read() - n_bytes))

    def used_bytes(self) -> int:
        """Bytes currently counted against the budget (also after :meth:`close`)."""
        if self._ledger_fd is None:
            fd = os.open(self._ledger_path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                with _FileLock(self._lock, fd):
                    return _read_used(fd)
            finally:
                os.close(fd)
        with self._locked():
            return self._read()

    def close(self):
        """Releases the ledger's file descriptors (and the "in use" lock)."""
        for name in ('_ledger_fd', '_users_fd'):
            fd = getattr(self, name, None)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)

    def __del__(self):
        self.close()

    def _locked(self):
        return _FileLock(self._lock, self._ledger_fd)

    def _read(self) -> int:
        return _read_used(self._ledger_fd)

    def _write(self, used: int):
        written = os.pwrite(self._ledger_fd, struct.pack(_FORMAT, used), 0)
        if written != 8:
            raise OSError(errno.EIO, 'short write to the capacity ledger')


class _FileLock:
    """A thread lock plus an exclusive ``flock`` on a file, as one context."""

    def __init__(self, thread_lock, fd):
        self._thread_lock = thread_lock
        self._fd = fd

    def __enter__(self):
        self._thread_lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread_lock.release()
            raise

    def __exit__(self, *exc_info):
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()


def _read_used(fd) -> int:
    data = os.pread(fd, struct.calcsize(_FORMAT), 0)
    return struct.unpack(_FORMAT, data)[0] if len(data) == 8 else 0


def bytes_under(directory: str) -> int:
    """Sum of the sizes of the files under ``directory`` (vanishing ones skipped)."""
    total = 0
    for path, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.lstat(os.path.join(path, name)).st_size
            except OSError:
                pass
    return total
