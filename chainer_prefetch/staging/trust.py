"""Which local directory may hold copies: only one no other user can write into.

Node-local scratch space is often one world-writable directory for every
user of the node.  A copy is served because its size and modification time
equal its source's, so anyone who could write into the local directory
could plant a file with a source's size and time and have it served as
training data.  The rules, checked when a local directory is opened:

* The path is resolved once (a ``LOCAL_DIR`` that is a symlink, as site
  scratch links often are, is followed then) and everything after uses the
  resolved path, whose every component is a real directory.
* Every ancestor of the directory is owned by root or by this user, and if
  others may write to it, it has the sticky bit (``/tmp``, ``/scratch``:
  then nobody else can rename or remove what is in it).
* The directory itself is used as it is when it is owned by this user and
  no one else may write to it.  A directory others may write to (with the
  sticky bit, owned by root or this user) is not used itself: a private
  subdirectory ``chainer_prefetch-<user>`` (mode 0700) inside it is.  Any
  other directory is refused with a message that says why.
* ``data/`` and ``.partial/`` inside are this user's, mode 0700.

Pure decisions over ``os.stat_result`` values, plus :func:`trusted_root`,
which walks the path.
"""
import errno
import getpass
import os
import stat
from typing import Optional, Tuple

from chainer_prefetch.errors import UntrustedLocalDirectoryError

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _owner_ok(info: os.stat_result, uid: int) -> bool:
    return info.st_uid in (0, uid)


def ancestor_problem(info: os.stat_result, uid: int) -> Optional[str]:
    """Why an ancestor directory with ``info`` is not safe, or ``None``."""
    if not stat.S_ISDIR(info.st_mode):
        return 'is not a directory'
    if not _owner_ok(info, uid):
        return 'belongs to user {}'.format(info.st_uid)
    if info.st_mode & _OTHERS_WRITE and not info.st_mode & stat.S_ISVTX:
        return ('can be written by other users and has no sticky bit (they '
                'could rename what is in it)')
    return None


def directory_use(info: os.stat_result, uid: int) -> Tuple[str, Optional[str]]:
    """How a directory with ``info`` may be used.

    Returns:
        ``('use', None)``: it is private; ``('subdirectory', None)``: it is
        shared scratch space, use a private subdirectory; ``('refuse',
        why)``.
    """
    if not stat.S_ISDIR(info.st_mode):
        return 'refuse', 'is not a directory'
    if info.st_uid == uid and not info.st_mode & _OTHERS_WRITE:
        return 'use', None
    if _owner_ok(info, uid) and info.st_mode & stat.S_ISVTX:
        return 'subdirectory', None
    if not _owner_ok(info, uid):
        return 'refuse', 'belongs to user {}'.format(info.st_uid)
    return 'refuse', ('can be written by other users (mode {:o}); use a '
                      'directory of your own with mode 0700'.format(
                          stat.S_IMODE(info.st_mode)))


def private_name(uid: int) -> str:
    """The private subdirectory's name for this user."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(uid)
    return 'chainer_prefetch-{}'.format(user)


def trusted_root(path: str, uid: Optional[int] = None) -> str:
    """The directory to keep copies in for the requested ``path``, created if missing.

    Args:
        path: The ``local_dir`` the user gave.
        uid: The user (default: this process's effective user).

    Returns:
        The resolved, trusted directory (``path`` itself, or a private
        subdirectory of it).

    Raises:
        UntrustedLocalDirectoryError: another user could write into it.
        OSError: it cannot be created.
    """
    uid = os.geteuid() if uid is None else uid
    real = os.path.realpath(os.path.abspath(path))
    for ancestor in _ancestors(real):
        try:
            info = os.lstat(ancestor)
        except FileNotFoundError:
            os.mkdir(ancestor, 0o700)  # ours, private
            info = os.lstat(ancestor)
        _require_directory(info, ancestor)
        problem = ancestor_problem(info, uid)
        if problem:
            raise _untrusted(path, ancestor, problem)
    try:
        os.mkdir(real, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(real)
    _require_directory(info, real)
    use, problem = directory_use(info, uid)
    if use == 'refuse':
        raise _untrusted(path, real, problem)
    if use == 'use':
        return real
    private = os.path.join(real, private_name(uid))
    try:
        os.mkdir(private, 0o700)
    except FileExistsError:
        pass
    use, problem = directory_use(os.lstat(private), uid)
    if use != 'use':
        raise _untrusted(path, private, problem or 'is not private')
    return private


def check_private(path: str, uid: Optional[int] = None):
    """Refuses a directory inside the local directory that is not this user's and private.

    Raises:
        UntrustedLocalDirectoryError: it is a symlink, another user's, or
            writable by others.
    """
    uid = os.geteuid() if uid is None else uid
    use, problem = directory_use(os.lstat(path), uid)
    if use != 'use':
        raise _untrusted(path, path, problem or 'is not private')


def _require_directory(info: os.stat_result, path: str):
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, 'not a directory', path)


def _ancestors(real: str):
    """The directories above ``real``, from ``/`` down."""
    found = []
    current = os.path.dirname(real)
    while True:
        found.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            return reversed(found)
        current = parent


def _untrusted(requested, where, why) -> UntrustedLocalDirectoryError:
    return UntrustedLocalDirectoryError(
        1, 'local directory {}: {} {}; copies there could be replaced by '
        'another user, so none is used'.format(requested, where, why), where)
