"""A node-local directory that holds verified copies of files from shared storage.

Layout under the directory ``root`` given by the user::

    root/data/<absolute source path>   complete copies, mirroring the source tree
    root/.partial/<hash>.part          copies in progress (also the copy locks)

Guarantees:

* **Never a partial file under a final name.**  A copy is written to
  ``.partial/`` and renamed into place only once every byte arrived; a crash
  or kill mid-copy leaves only a ``.part`` file, which the next start-up
  removes (unless a live process still holds its lock).
* **Several processes can share one directory** (e.g. four ranks on one node).
  Each copy holds an exclusive ``flock`` on its ``.part`` file; a second
  process wanting the same file waits for the first and then finds the copy
  complete instead of copying it again.
* **Stale copies are replaced.**  A copy counts as valid only while its size
  and modification time equal the source's (the copy is stamped with the
  source's mtime).
* **Writes stay inside ``root``.**  The copy's path is the *normalised
  absolute* source path under ``root/data`` (so ``..`` and absolute paths in
  list files cannot climb out), and every directory on the way is opened with
  ``O_NOFOLLOW`` relative to its parent, so a symlink planted in a shared
  directory cannot redirect a write.  A directory created here is mode 0700.

Errors are split by side: :class:`SourceFileError` when the shared-storage
file cannot be read (the caller reads the source directly and reports the
failure), :class:`LocalStorageError` when the local side fails (full, not
writable): the caller stops staging and keeps training from shared storage.
"""
import errno
import fcntl
import hashlib
import os
import stat
import threading
from typing import Optional

from chainer_prefetch.staging import derived_files

_COPY_CHUNK_BYTES = 1 << 20
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_LOCK_POLL_SECONDS = 0.01


class SourceFileError(OSError):
    """A file on shared storage could not be read."""


class LocalStorageError(OSError):
    """The local directory cannot take a copy (full, read-only, no permission)."""


class LocalPathMap:
    """Maps a source path to the path of its copy under a local directory.

    Picklable, so worker processes can use it whatever their start method.

    Args:
        data_root: The ``data`` directory of a :class:`LocalDirectory`.
    """

    def __init__(self, data_root: str):
        self.data_root = data_root

    def relative(self, source: str) -> str:
        """The copy's path relative to ``data_root``: never starts with ``/`` or ``..``."""
        return os.path.normpath(os.path.abspath(source)).lstrip(os.sep)

    def __call__(self, source: str) -> str:
        return os.path.join(self.data_root, self.relative(source))


class LocalDirectory:
    """Copies files from shared storage into a local directory, safely.

    Methods are thread-safe and process-safe (see the module docstring).

    Args:
        root: The local directory (e.g. ``$TMPDIR/job`` on the node's SSD).
            Created with mode 0700 if missing.
        stop_event: Set to make a copy waiting for another process's lock
            give up promptly (raises :class:`InterruptedError`).

    Raises:
        LocalStorageError: ``root`` cannot be created or written.
    """

    def __init__(self, root: str, stop_event: Optional[threading.Event] = None):
        self.root = os.path.abspath(root)
        self.data_root = os.path.join(self.root, 'data')
        self.partial_root = os.path.join(self.root, '.partial')
        self.path_map = LocalPathMap(self.data_root)
        self._stop_event = stop_event or threading.Event()
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            for path in (self.data_root, self.partial_root):
                try:
                    os.mkdir(path, 0o700)
                except FileExistsError:
                    pass
                _check_real_directory(path)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, 'not writable', self.root)
        except OSError as error:
            raise LocalStorageError(
                error.errno, 'local directory {} is unusable: {}'.format(
                    self.root, error.strerror or error)) from error
        self.removed_leftovers = self._remove_leftovers()

    def local_path(self, source: str) -> str:
        """Where the copy of ``source`` lives (whether or not it exists yet)."""
        return self.path_map(source)

    def stage(self, source: str, source_stat: Optional[os.stat_result] = None
              ) -> int:
        """Makes sure a valid copy of ``source`` exists locally.

        Args:
            source: Path of the file on shared storage.
            source_stat: ``os.stat(source)`` if the caller has it already.

        Returns:
            The number of bytes copied: 0 when a valid copy was already there
            (made earlier, or by another process while this one waited).

        Raises:
            SourceFileError: ``source`` cannot be read.
            LocalStorageError: the copy cannot be written locally.
            InterruptedError: ``stop_event`` was set while waiting.
        """
        if source_stat is None:
            source_stat = stat_source(getattr(source, 'origin', source))
        if self.is_valid(source, source_stat):
            return 0  # one lstat; workers read this path the same way
        relative = self.path_map.relative(source)
        directory_fd = self._open_parent(relative)
        name = os.path.basename(relative)
        try:
            if _is_valid_copy(directory_fd, name, source_stat, source):
                return 0
            return self._copy_locked(source, source_stat, relative,
                                     directory_fd, name)
        finally:
            os.close(directory_fd)

    def is_valid(self, source: str, source_stat: os.stat_result) -> bool:
        """Whether a complete copy of ``source`` matching ``source_stat`` exists."""
        try:
            local = os.lstat(self.local_path(source))
        except OSError:
            return False
        return _matches(local, source_stat, source)

    def evict(self, source: str) -> int:
        """Removes the copy of ``source``, if there is one.

        A process that has the copy open keeps reading it (the data go when
        the last descriptor closes); one that opens it afterwards finds it
        missing and reads ``source`` instead.

        Returns:
            The size of the removed copy, or 0 if there was none (another
            process may have removed it first).
        """
        relative = self.path_map.relative(source)
        try:
            directory_fd = self._open_parent(relative)
        except LocalStorageError:
            return 0
        name = os.path.basename(relative)
        try:
            size = os.stat(name, dir_fd=directory_fd,
                           follow_symlinks=False).st_size
            os.unlink(name, dir_fd=directory_fd)
            return size
        except FileNotFoundError:
            return 0
        except OSError as error:
            raise _local_error(error, self.local_path(source))
        finally:
            os.close(directory_fd)

    def _copy_locked(self, source, source_stat, relative, directory_fd, name):
        part_name = hashlib.sha1(relative.encode('utf-8', 'surrogateescape')
                                 ).hexdigest() + '.part'
        partial_fd = self._open_local(self.partial_root)
        try:
            while True:
                part_fd = self._open_part(partial_fd, part_name)
                try:
                    self._lock(part_fd, source)
                    if not _same_file(part_fd, partial_fd, part_name):
                        continue  # renamed or removed while we waited: retry
                    if _is_valid_copy(directory_fd, name, source_stat, source):
                        _unlink_quietly(part_name, partial_fd)
                        return 0
                    try:
                        copied = self._fill(part_fd, source, source_stat)
                        os.rename(part_name, name, src_dir_fd=partial_fd,
                                  dst_dir_fd=directory_fd)
                    except BaseException as error:
                        _unlink_quietly(part_name, partial_fd)
                        if isinstance(error, (SourceFileError,
                                              LocalStorageError)):
                            raise
                        if isinstance(error, OSError):
                            raise _local_error(error, self.local_path(source))
                        raise
                    return copied
                finally:
                    os.close(part_fd)  # also releases the lock
        finally:
            os.close(partial_fd)

    def _fill(self, part_fd, source, source_stat) -> int:
        """Copies ``source`` into the locked ``.part`` file; returns bytes copied."""
        destination = self.local_path(source)
        try:
            os.ftruncate(part_fd, 0)
        except OSError as error:
            raise _local_error(error, destination)
        if hasattr(source, 'write_local_form'):
            return derived_files.fill(part_fd, source, source_stat, destination)
        copied = 0
        try:
            source_file = open(source, 'rb', buffering=0)
        except OSError as error:
            raise _source_error(error, source) from error
        with source_file:
            while True:
                try:
                    chunk = source_file.read(_COPY_CHUNK_BYTES)
                except OSError as error:
                    raise _source_error(error, source) from error
                if not chunk:
                    break
                try:
                    view = memoryview(chunk)
                    while view:
                        written = os.write(part_fd, view)
                        view = view[written:]
                except OSError as error:
                    raise _local_error(error, destination)
                copied += len(chunk)
        if copied != source_stat.st_size:
            raise SourceFileError(
                errno.EIO, 'source {} changed while copying ({} bytes read, '
                '{} expected)'.format(source, copied, source_stat.st_size),
                source)
        try:
            os.utime(part_fd, ns=(source_stat.st_atime_ns,
                                  source_stat.st_mtime_ns))
        except OSError as error:
            raise _local_error(error, destination)
        return copied

    def _lock(self, part_fd, source):
        while True:
            try:
                fcntl.flock(part_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if self._stop_event.wait(_LOCK_POLL_SECONDS):
                    raise InterruptedError(
                        'stopped while waiting for another copy of ' + source)

    def _open_part(self, partial_fd, part_name):
        try:
            return os.open(part_name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW,
                           0o600, dir_fd=partial_fd)
        except OSError as error:
            raise _local_error(error, os.path.join(self.partial_root, part_name))

    def _open_local(self, path):
        try:
            return os.open(path, _DIRECTORY_FLAGS)
        except OSError as error:
            raise _local_error(error, path)

    def _open_parent(self, relative: str) -> int:
        """Opens (creating) the directory of ``relative`` without following symlinks."""
        fd = self._open_local(self.data_root)
        try:
            for part in os.path.dirname(relative).split(os.sep):
                if not part:
                    continue
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
                next_fd = os.open(part, _DIRECTORY_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = next_fd
        except OSError as error:
            os.close(fd)
            raise _local_error(error, os.path.join(self.data_root, relative))
        return fd

    def _remove_leftovers(self) -> int:
        """Removes ``.part`` files that no live process holds; returns how many."""
        removed = 0
        partial_fd = self._open_local(self.partial_root)
        try:
            for name in os.listdir(partial_fd):
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW,
                                 dir_fd=partial_fd)
                except OSError:
                    _unlink_quietly(name, partial_fd)
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    # Unlink while holding the lock: a copier that opened
                    # this file meanwhile finds it gone once it gets the
                    # lock (_same_file) and starts over with a new one.
                    if _unlink_quietly(name, partial_fd):
                        removed += 1
                except BlockingIOError:
                    pass  # a live copy in another process
                finally:
                    os.close(fd)
        finally:
            os.close(partial_fd)
        return removed


def stat_source(source: str) -> os.stat_result:
    """``os.stat(source)``, raising :class:`SourceFileError` naming the file."""
    try:
        return os.stat(source)
    except OSError as error:
        raise _source_error(error, source) from error


def _check_real_directory(path):
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(
            errno.ENOTDIR, 'not a real directory (symlink?)', path)


def _matches(local: os.stat_result, source: os.stat_result,
             path: str = '') -> bool:
    # A derived file's size is not the source's (derived_files).
    sized = not hasattr(path, 'write_local_form')
    return (stat.S_ISREG(local.st_mode)
            and (local.st_size == source.st_size or not sized)
            and local.st_mtime_ns == source.st_mtime_ns)


def _is_valid_copy(directory_fd, name, source_stat, source='') -> bool:
    try:
        local = os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
    except OSError:
        return False
    return _matches(local, source_stat, source)


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


def _source_error(error: OSError, source: str) -> SourceFileError:
    return SourceFileError(error.errno, 'cannot read {}: {}'.format(
        source, error.strerror), source)


def _local_error(error: OSError, path: str) -> LocalStorageError:
    return LocalStorageError(error.errno, 'cannot write local copy {}: {}'.format(
        path, error.strerror or error), path)

