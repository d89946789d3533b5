"""A node-local directory that holds current local forms of files on shared storage.

Layout under the directory ``root`` given by the user::

    root/data/<absolute source path>   complete local files, mirroring the source tree
    root/.partial/<hash>.part          local files being made (also their locks)

Guarantees:

* **Never a partial file under a final name.**  A local file is written to
  ``.partial/`` and renamed into place only once complete; a crash or kill
  mid-copy leaves only a ``.part`` file, which the next start-up removes
  (unless a live process still holds its lock).
* **Several processes can share one directory** (e.g. four ranks on one node).
  Making a file holds an exclusive ``flock`` on its ``.part`` file; a second
  process wanting the same file waits for the first and then finds it
  complete instead of making it again.
* **Stale files are replaced.**  A local file counts only while it is
  current for its source (see :class:`~chainer_prefetch.staging.sources.Source`:
  stamped with the origin's mtime, and of the origin's size for a copy).
* **Nobody else can write into it** (see :mod:`.trust`): the directory is
  used only when no other user can write to it or to any directory above
  it that could move it; shared scratch space gets a private
  subdirectory.  So no other user can plant a file, a symlink or a hard
  link that would be served, read or written through.
* **Writes stay inside ``root``.**  The local path is the *normalised
  absolute* source path under ``root/data`` (so ``..`` and absolute paths in
  list files cannot climb out), and every directory on the way is opened with
  ``O_NOFOLLOW`` relative to its parent.  A directory created here is mode
  0700; a ``.part`` file with another link to it is never written.
* **Bounded waits.**  A copy that another process holds the lock of (one
  stopped, say) is waited for at most ``lock_timeout`` seconds; then
  :class:`~chainer_prefetch.errors.CopyLockTimeout` tells the caller to read
  the source instead.

Costs: the descriptors of the directories under ``data/`` are kept open (a
bounded cache), so making a file costs about ten system calls besides the
copy itself, which the kernel does (``sendfile``).

Errors are split by side: :class:`~chainer_prefetch.errors.SourceFileError`
when the shared-storage file cannot be read (the caller reads the source
directly and reports the failure),
:class:`~chainer_prefetch.errors.LocalStorageError` when the local side fails
(full, not writable): the caller stops staging and keeps training from shared
storage.
"""
import collections
import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import threading
import time
from typing import Callable, Optional, Union

from chainer_prefetch.errors import (
    CopyLockTimeout,
    LocalStorageError,
    SourceFileError,
    UntrustedLocalDirectoryError,
)
from chainer_prefetch.staging.capacity import CapacityLedger
from chainer_prefetch.staging.sources import Source, as_source, local_error
from chainer_prefetch.staging.trust import check_private, trusted_root

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_LOCK_POLL_SECONDS = 0.01
_OPEN_DIRECTORIES = 256


class LocalPathMap:
    """Maps a source (path or :class:`Source`) to the path of its local form.

    Picklable, so loader processes can use it whatever their start method.

    Args:
        data_root: The ``data`` directory of a :class:`LocalDirectory`.
    """

    def __init__(self, data_root: str):
        self.data_root = data_root

    def relative(self, source: Union[str, Source]) -> str:
        """The local path relative to ``data_root``: never starts with ``/`` or ``..``."""
        name = source.name if isinstance(source, Source) else os.fspath(source)
        return os.path.normpath(os.path.abspath(name)).lstrip(os.sep)

    def __call__(self, source: Union[str, Source]) -> str:
        return os.path.join(self.data_root, self.relative(source))


class LocalDirectory:
    """Makes local forms of sources in a local directory, safely.

    Methods are thread-safe and process-safe (see the module docstring).

    Attributes:
        root: The directory in use: ``local_dir`` resolved, or the private
            subdirectory made in it (see :mod:`.trust`).

    Args:
        root: The local directory (e.g. ``$TMPDIR/job`` on the node's SSD).
            Created with mode 0700 if missing.
        stop_event: Set to make a copy waiting for another process's lock
            give up promptly (raises :class:`InterruptedError`).
        lock_timeout: Seconds a copy waits for another process's copy of the
            same file before giving up (:class:`CopyLockTimeout`).

    Raises:
        UntrustedLocalDirectoryError: another user could write into it.
        LocalStorageError: ``root`` cannot be created or written.
    """

    def __init__(self, root: str, stop_event: Optional[threading.Event] = None,
                 lock_timeout: float = 30.0):
        self.requested = root
        self._stop_event = stop_event or threading.Event()
        self.lock_timeout = lock_timeout
        self._partial_fd = None
        self._directories = None
        try:
            self.root = trusted_root(root)
            self.data_root = os.path.join(self.root, 'data')
            self.partial_root = os.path.join(self.root, '.partial')
            for path in (self.data_root, self.partial_root):
                try:
                    os.mkdir(path, 0o700)
                except FileExistsError:
                    pass
                check_private(path)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, 'not writable', self.root)
            self._partial_fd = os.open(self.partial_root, _DIRECTORY_FLAGS)
            self._directories = _OpenDirectories(self.data_root)
        except UntrustedLocalDirectoryError:
            self.close()
            raise
        except OSError as error:
            self.close()
            raise LocalStorageError(
                error.errno, 'local directory {} is unusable: {}'.format(
                    os.path.abspath(root), error.strerror or error)) from error
        self.path_map = LocalPathMap(self.data_root)
        self.locate = self.path_map  # what the dataset's located view reads with
        self.removed_leftovers = self._remove_leftovers()

    def capacity_ledger(self, limit_bytes: int) -> CapacityLedger:
        """This process's account of the directory's budget (shared by its users).

        Raises:
            OSError: the ledger's files cannot be created or opened.
        """
        return CapacityLedger(self.root, self.data_root, limit_bytes)

    def close(self):
        """Closes the directory descriptors (those in use close when released)."""
        if self._directories is not None:
            self._directories.close()
        if self._partial_fd is not None:
            os.close(self._partial_fd)
            self._partial_fd = None

    def local_path(self, source: Union[str, Source]) -> str:
        """Where the local form of ``source`` lives (whether or not it exists yet)."""
        return self.path_map(source)

    def is_current(self, source: Union[str, Source],
                   origin_stat: os.stat_result) -> bool:
        """Whether a complete, current local form of ``source`` exists."""
        source = as_source(source)
        local = self._local_stat(source)
        return local is not None and source.is_current(local, origin_stat)

    def has_local(self, source: Union[str, Source]) -> bool:
        """Whether a complete local form of ``source`` exists (its source is not looked at)."""
        local = self._local_stat(as_source(source))
        return local is not None and stat.S_ISREG(local.st_mode)

    def _local_stat(self, source: Source) -> Optional[os.stat_result]:
        """``lstat`` of the local form's path, or ``None`` if there is none.

        A check only, by path: no descriptor of its directory is opened
        (with many directories, the copy threads would take turns walking
        them).  The loaders open the same path to read the copy.
        """
        try:
            return os.lstat(self.local_path(source))
        except OSError:
            return None

    def stage(self, source: Union[str, Source],
              origin_stat: Optional[os.stat_result] = None,
              before_rename: Optional[Callable[[int], None]] = None) -> int:
        """Makes sure a current local form of ``source`` exists.

        Args:
            source: What to stage: a path or a
                :class:`~chainer_prefetch.staging.sources.Source`.
            origin_stat: ``source.stat_origin()`` if the caller has it.
                Without it, a source that ``stats_when_opened`` takes it from
                the origin it opens to copy it, and is stat'ed first only if
                a local file is already there to compare.
            before_rename: Called with the bytes written when a new local
                file is complete, just before it is renamed into place (the
                capacity ledger counts it then); an exception from it drops
                the file.

        Returns:
            The bytes written: 0 when a current local form was already there
            (made earlier, or by another process while this one waited).

        Raises:
            SourceFileError: the origin cannot be read.
            LocalStorageError: the local form cannot be written.
            InterruptedError: ``stop_event`` was set while waiting.
            CopyLockTimeout: another process held the copy's lock too long.
        """
        source = as_source(source)
        if origin_stat is None and not source.stats_when_opened:
            origin_stat = source.stat_origin()
        relative = self.path_map.relative(source)
        directory, name = os.path.split(relative)
        try:
            with self._directories.opened(directory, create=True) as fd:
                if _is_current_at(fd, name, source, origin_stat):
                    return 0
                return self._make_locked(source, origin_stat, relative, fd,
                                         name, before_rename)
        except (SourceFileError, LocalStorageError, InterruptedError,
                CopyLockTimeout):
            raise
        except OSError as error:
            raise local_error(error, os.path.join(self.data_root, relative))

    def evict(self, source: Union[str, Source]) -> int:
        """Removes the local form of ``source``, if there is one.

        A process that has it open keeps reading it (the data go when the
        last descriptor closes); one that opens it afterwards finds it
        missing and reads the source instead.

        Returns:
            The size of the removed file, or 0 if there was none (another
            process may have removed it first).
        """
        directory, name = os.path.split(self.path_map.relative(source))
        try:
            with self._directories.opened(directory, create=False) as fd:
                size = os.stat(name, dir_fd=fd, follow_symlinks=False).st_size
                os.unlink(name, dir_fd=fd)
                return size
        except FileNotFoundError:
            return 0
        except OSError as error:
            raise local_error(error, self.local_path(source))

    def _make_locked(self, source, origin_stat, relative, directory_fd, name,
                     before_rename):
        part_name = hashlib.sha1(relative.encode('utf-8', 'surrogateescape')
                                 ).hexdigest() + '.part'
        destination = os.path.join(self.data_root, relative)
        while True:
            part_fd = self._open_part(part_name)
            try:
                self._lock(part_fd, source)
                if not _same_file(part_fd, self._partial_fd, part_name):
                    continue  # renamed or removed while we waited: retry
                try:
                    current = _is_current_at(directory_fd, name, source,
                                             origin_stat)
                except SourceFileError:  # (its origin had to be stat'ed)
                    _unlink_quietly(part_name, self._partial_fd)
                    raise
                if current:
                    _unlink_quietly(part_name, self._partial_fd)
                    return 0
                try:
                    os.ftruncate(part_fd, 0)
                    written = source.write_local(part_fd, origin_stat,
                                                 destination)
                    if before_rename is not None:
                        before_rename(written)
                    os.rename(part_name, name, src_dir_fd=self._partial_fd,
                              dst_dir_fd=directory_fd)
                except BaseException as error:
                    _unlink_quietly(part_name, self._partial_fd)
                    if isinstance(error, OSError):
                        raise local_error(error, destination) from error
                    raise
                return written
            finally:
                os.close(part_fd)  # also releases the lock

    def _lock(self, part_fd, source):
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(part_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if self._stop_event.wait(_LOCK_POLL_SECONDS):
                    raise InterruptedError(
                        'stopped while waiting for another copy of {}'.format(
                            source))
                if time.monotonic() >= deadline:
                    raise CopyLockTimeout(
                        errno.ETIMEDOUT, 'another process held the copy of {} '
                        'for more than {} s (stopped?); reading the source '
                        'instead'.format(source, self.lock_timeout), str(source))

    def _open_part(self, part_name):
        """Opens the ``.part`` file, never one that has another link to it."""
        path = os.path.join(self.partial_root, part_name)
        try:
            fd = os.open(part_name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW,
                         0o600, dir_fd=self._partial_fd)
            info = os.fstat(fd)
            if info.st_nlink == 1 and info.st_uid == os.geteuid():
                return fd
            os.close(fd)
            _unlink_quietly(part_name, self._partial_fd)  # a planted link
            return os.open(part_name, os.O_RDWR | os.O_CREAT | os.O_EXCL
                           | os.O_NOFOLLOW, 0o600, dir_fd=self._partial_fd)
        except OSError as error:
            raise local_error(error, path) from error

    def _remove_leftovers(self) -> int:
        """Removes ``.part`` files that no live process holds; returns how many."""
        removed = 0
        for name in os.listdir(self._partial_fd):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW,
                             dir_fd=self._partial_fd)
            except OSError:
                _unlink_quietly(name, self._partial_fd)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # Unlink while holding the lock: a copier that opened this
                # file meanwhile finds it gone once it gets the lock
                # (_same_file) and starts over with a new one.
                if _unlink_quietly(name, self._partial_fd):
                    removed += 1
            except BlockingIOError:
                pass  # a live copy in another process
            finally:
                os.close(fd)
        return removed


class _OpenDirectories:
    """Descriptors of directories under ``data/``, each reached without following symlinks.

    A bounded cache, most recently used kept; a descriptor in use is never
    closed (a thread stuck in I/O must not find its descriptor number reused).
    """

    def __init__(self, data_root: str):
        self._root_fd = os.open(data_root, _DIRECTORY_FLAGS)
        self._entries = collections.OrderedDict()  # relative dir -> [fd, users]
        self._lock = threading.Lock()
        self._closed = False

    @contextlib.contextmanager
    def opened(self, relative_directory: str, create: bool):
        """The descriptor of ``data/relative_directory``, while in the ``with`` block.

        Raises:
            OSError: a component is missing (and ``create`` is false), is a
                symlink, or cannot be created.
        """
        entry = self._acquire(relative_directory)
        if entry is None:
            fd = self._walk(relative_directory, create)
            entry = self._add(relative_directory, fd)
        try:
            yield entry[0]
        finally:
            self._release(relative_directory, entry)

    def close(self):
        with self._lock:
            self._closed = True
            self._trim(0)
            if self._root_fd is not None:
                os.close(self._root_fd)
                self._root_fd = None

    def _acquire(self, key):
        with self._lock:
            if self._closed:
                raise LocalStorageError(errno.EBADF, 'local directory closed')
            entry = self._entries.get(key)
            if entry is not None:
                entry[1] += 1
                self._entries.move_to_end(key)
            return entry

    def _add(self, key, fd):
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None or self._closed:  # another thread was first
                os.close(fd)
                if entry is None:
                    raise LocalStorageError(errno.EBADF, 'local directory closed')
            else:
                entry = self._entries[key] = [fd, 0]
            entry[1] += 1
            self._trim(_OPEN_DIRECTORIES)
            return entry

    def _release(self, key, entry):
        with self._lock:
            entry[1] -= 1
            if entry[1] == 0 and self._entries.get(key) is not entry:
                os.close(entry[0])  # dropped from the cache while in use

    def _trim(self, size):
        for key in list(self._entries):
            if len(self._entries) <= size:
                return
            fd, users = self._entries[key]
            del self._entries[key]
            if users == 0:
                os.close(fd)

    def _walk(self, relative_directory, create) -> int:
        with self._lock:
            if self._closed:
                raise LocalStorageError(errno.EBADF, 'local directory closed')
            fd = os.dup(self._root_fd)
        try:
            for part in relative_directory.split(os.sep):
                if not part:
                    continue
                if create:
                    try:
                        os.mkdir(part, 0o700, dir_fd=fd)
                    except FileExistsError:
                        pass
                next_fd = os.open(part, _DIRECTORY_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = next_fd
        except BaseException:
            os.close(fd)
            raise
        return fd


def _is_current_at(directory_fd, name, source, origin_stat) -> bool:
    """Whether the local file ``name`` is current; ``origin_stat`` ``None``:
    stat the origin only if there is a local file to compare.

    Raises:
        SourceFileError: the origin had to be stat'ed and cannot be read.
    """
    try:
        local = os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
    except OSError:
        return False
    if origin_stat is None:
        origin_stat = source.stat_origin()
    return source.is_current(local, origin_stat)


def _same_file(fd, directory_fd, name) -> bool:
    try:
        on_disk = os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (on_disk.st_ino, on_disk.st_dev) == (opened.st_ino, opened.st_dev)


def _unlink_quietly(name, directory_fd) -> bool:
    try:
        os.unlink(name, dir_fd=directory_fd)
        return True
    except FileNotFoundError:
        return False
