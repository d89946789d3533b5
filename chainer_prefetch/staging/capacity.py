"""A byte budget for a local directory, shared by every process that uses it.

Several iterators (say the four ranks on one node, or a training and a
validation iterator) may share one local directory.  The limit is per
directory and enforced jointly.  What counts::

    used = baseline + sum(settled of every account) + sum(reserved of live accounts)

* ``root/.capacity`` holds the *baseline*: the bytes under ``data/`` when the
  directory was last recounted.
* Every process using the directory has an *account*, a small file in
  ``root/.capacity.d/`` that it alone writes and on which it holds an
  exclusive ``flock`` while it lives.  ``reserved``: bytes it reserved for
  copies in progress; ``settled``: bytes it added to (copies made) or freed
  from (evictions) the directory since the baseline.
* A copy *reserves* its estimated size first, under a short global lock on
  ``root/.capacity`` (a reservation that does not fit is the caller's cue to
  evict or to leave the file on shared storage); when the copy is complete,
  just before it is renamed into place, its real size is *settled*.

A process that dies (killed, out of memory) holds no lock any more: its
reservations stop counting at once, while what it settled (files really on
disk) still counts; the next reservation folds its account into the baseline
and removes it.  When a process opens the directory and no other uses it (a
shared ``flock`` on ``root/.capacity.users`` tells), the baseline is
recounted from the files themselves.

Waits are bounded: the global lock is waited for at most ``lock_timeout``
seconds (a peer stopped while holding it, say by SIGSTOP); then the
reservation fails, and the file is read from shared storage instead.
"""
import errno
import fcntl
import os
import struct
import threading
import time
import uuid

_LEDGER = '.capacity'
_ACCOUNTS = '.capacity.d'
_USERS = '.capacity.users'
_BASELINE = struct.Struct('<q')
_ACCOUNT = struct.Struct('<qq')  # settled (signed), reserved
_POLL_SECONDS = 0.005


class CapacityLedger:
    """This process's account of one directory's budget; see the module docstring.

    Thread-safe.  Keep the object alive while the directory is in use;
    :meth:`close` lets go (the account's reservations end; what it settled
    stays counted).

    Args:
        root: The local directory (as given to ``LocalDirectory``).
        data_root: The directory whose files count (``root/data``).
        limit_bytes: The budget.  Every process sharing the directory
            should pass the same limit; each checks its own reservations
            against the limit it was given.
        lock_timeout: Seconds to wait for the global lock before a
            reservation fails.

    Raises:
        OSError: the ledger's files cannot be created or opened.
    """

    def __init__(self, root: str, data_root: str, limit_bytes: int,
                 lock_timeout: float = 10.0):
        self.limit_bytes = int(limit_bytes)
        self.lock_timeout = lock_timeout
        self._lock = threading.Lock()  # this process's account
        self._reserving = threading.Lock()  # one reservation at a time here
        self._settled = self._reserved = 0
        self._root = root
        self._ledger_path = os.path.join(root, _LEDGER)
        self._accounts = os.path.join(root, _ACCOUNTS)
        self._users_fd = self._ledger_fd = self._account_fd = None
        try:
            self._users_fd = _open(os.path.join(root, _USERS))
            self._ledger_fd = _open(self._ledger_path)
            try:
                os.mkdir(self._accounts, 0o700)
            except FileExistsError:
                pass
            try:
                fcntl.flock(self._users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True
            except BlockingIOError:
                alone = False
            if alone:
                self._recount(data_root)
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)  # downgrade: in use
            self._account_fd = self._open_account()
        except BaseException:
            self.close()
            raise

    # ---- what the local store calls ------------------------------------------

    def reserve(self, n_bytes: int) -> bool:
        """Reserves ``n_bytes`` if they fit under the limit.

        Returns:
            ``False`` if the limit would be exceeded, or the global lock
            could not be had within ``lock_timeout``.
        """
        deadline = time.monotonic() + self.lock_timeout
        # flock excludes other processes only: threads of this one share the
        # descriptor, so they take turns on a thread lock first.
        if not self._reserving.acquire(timeout=self.lock_timeout):
            return False
        try:
            if not _flock_within(self._ledger_fd, fcntl.LOCK_EX, deadline):
                return False
            try:
                used = _sum(self._ledger_fd, self._accounts, fold_dead=True)
                if used + n_bytes > self.limit_bytes:
                    return False
                with self._lock:
                    self._reserved += n_bytes
                    self._write_account()
                return True
            finally:
                fcntl.flock(self._ledger_fd, fcntl.LOCK_UN)
        finally:
            self._reserving.release()

    def release(self, n_bytes: int):
        """Gives back a reservation that was not used (a copy failed or was dropped)."""
        with self._lock:
            self._reserved = max(0, self._reserved - n_bytes)
            self._write_account()

    def settle(self, reserved: int, written: int):
        """A copy of ``written`` bytes, reserved as ``reserved``, is about to be in place."""
        with self._lock:
            self._reserved = max(0, self._reserved - reserved)
            self._settled += written
            self._write_account()

    def freed(self, n_bytes: int):
        """A file of ``n_bytes`` under ``data/`` was removed (evicted)."""
        with self._lock:
            self._settled -= n_bytes
            self._write_account()

    def used_bytes(self) -> int:
        """Bytes counted against the budget now (every process), also after :meth:`close`.

        A snapshot as :func:`used_bytes` takes it (through a descriptor of
        its own, so that its shared lock never meets this object's).
        """
        return used_bytes(self._root)  # the module's function

    def close(self):
        """Ends this account (its reservations stop counting) and lets go of the files."""
        for name in ('_account_fd', '_ledger_fd', '_users_fd'):
            fd = getattr(self, name, None)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)

    def __del__(self):
        self.close()

    # ---- internals -------------------------------------------------------------

    def _open_account(self) -> int:
        """Creates this process's account, locked before anyone can see it."""
        name = '{}.{}'.format(os.getpid(), uuid.uuid4().hex[:12])
        hidden = os.path.join(self._accounts, '.' + name)
        fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.pwrite(fd, _ACCOUNT.pack(0, 0), 0)
            os.rename(hidden, os.path.join(self._accounts, name))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write_account(self):
        written = os.pwrite(self._account_fd,
                            _ACCOUNT.pack(self._settled, self._reserved), 0)
        if written != _ACCOUNT.size:
            raise OSError(errno.EIO, 'short write to a capacity account')

    def _recount(self, data_root):
        """Alone: the baseline becomes the files on disk; old accounts go."""
        fcntl.flock(self._ledger_fd, fcntl.LOCK_EX)
        try:
            for name in os.listdir(self._accounts):
                try:
                    os.unlink(os.path.join(self._accounts, name))
                except FileNotFoundError:
                    pass
            os.pwrite(self._ledger_fd, _BASELINE.pack(bytes_under(data_root)),
                      0)
        finally:
            fcntl.flock(self._ledger_fd, fcntl.LOCK_UN)


def used_bytes(root: str, wait_seconds: float = 1.0) -> int:
    """The bytes counted against the budget of the directory ``root`` now.

    Reads the ledger without taking part in it (no account is opened).  The
    accounts are read one after the other, so the read holds the global lock
    shared: no reservation can grow the sum meanwhile, and a file evicted by
    one process and the reservation another made with its room are never
    both counted.  If the lock cannot be had within ``wait_seconds`` (a peer
    stopped while holding it), the accounts are read without it, and the sum
    may then count such a file twice.

    Args:
        root: The local directory.
        wait_seconds: How long to wait for the shared lock.
    """
    fd = os.open(os.path.join(root, _LEDGER), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        locked = _flock_within(fd, fcntl.LOCK_SH,
                               time.monotonic() + wait_seconds)
        try:
            return _sum(fd, os.path.join(root, _ACCOUNTS), fold_dead=False)
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _flock_within(fd: int, operation: int, deadline: float) -> bool:
    """Takes ``flock(fd, operation)``, polling until ``deadline``; False if not had."""
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_SECONDS)


def _sum(ledger_fd, accounts, fold_dead) -> int:
    """Baseline + settled + live reservations; ``fold_dead``: dead accounts join the baseline."""
    baseline = _read(ledger_fd, _BASELINE, (0,))[0]
    total = baseline
    folded = 0
    for name in os.listdir(accounts):
        if name.startswith('.'):
            continue  # an account being created
        path = os.path.join(accounts, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue
        try:
            settled, reserved = _read(fd, _ACCOUNT, (0, 0))
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                alive = False
            except BlockingIOError:
                alive = True
            total += settled + (reserved if alive else 0)
            if not alive and fold_dead:
                folded += settled
                os.unlink(path)
        finally:
            os.close(fd)
    if folded:
        os.pwrite(ledger_fd, _BASELINE.pack(baseline + folded), 0)
    return total


def _open(path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)


def _read(fd, layout: struct.Struct, default: tuple) -> tuple:
    data = os.pread(fd, layout.size, 0)
    return layout.unpack(data) if len(data) == layout.size else default


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
