"""Which file system a path is on, and whether it is the node's own.

Reading is tuned by the kind of storage: a node-local disk (ext4, XFS,
tmpfs) serves one or two sequential streams best, where more streams only
make it seek, while a shared file system (Lustre, GPFS, NFS, a FUSE mount)
serves each stream far below its bandwidth, each request waiting its
latency, so that many streams at once read faster.

The mount table comes from ``/proc/self/mountinfo`` (:func:`read_mounts`);
finding a path's mount in it (:func:`mount_of`) and judging its type
(:func:`is_node_local`) are pure.

The judgement goes by the file system's type alone: ext4 or XFS on a
network block device (a cloud volume, Ceph RBD, iSCSI) counts as
node-local, and a local disk behind FUSE (``fuseblk``,
``fuse-overlayfs``) as shared.  Only the number of threads reading a row
group ahead depends on it, never what is read.
"""
import os
import re
from typing import List, NamedTuple, Sequence

#: File system types of storage attached to the node itself.
NODE_LOCAL_TYPES = frozenset({
    'bcachefs', 'btrfs', 'exfat', 'ext2', 'ext3', 'ext4', 'f2fs', 'jfs',
    'ntfs3', 'overlay', 'ramfs', 'reiserfs', 'tmpfs', 'vfat', 'xfs', 'zfs'})

#: The kernel's table of this process's mounts.
MOUNTINFO = '/proc/self/mountinfo'


class Mount(NamedTuple):
    """One mount: where it is and its file system type (``ext4``, ``lustre``, ``fuse.sshfs``)."""

    point: str
    fs_type: str


def parse_mountinfo(text: str) -> List[Mount]:
    """The mounts of a ``/proc/<pid>/mountinfo`` text, in its order.

    Args:
        text: The file's content: per line, the mount point is the fifth
            field (spaces and other characters escaped as ``\\040``), and
            the type follows the ``-`` separator.

    Raises:
        ValueError: a line lacks those fields.
    """
    mounts = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        try:
            separator = fields.index('-', 6)
            point, fs_type = fields[4], fields[separator + 1]
        except (ValueError, IndexError):
            raise ValueError('mountinfo line {} is not a mount: {!r}'.format(
                number, line)) from None
        mounts.append(Mount(_unescape(point), fs_type))
    return mounts


def _unescape(field: str) -> str:
    return re.sub(r'\\([0-7]{3})', lambda match: chr(int(match.group(1), 8)),
                  field)


def read_mounts(path: str = MOUNTINFO) -> List[Mount]:
    """This process's mounts (:func:`parse_mountinfo` of ``path``); ``[]`` where unreadable.

    Mount points are decoded as paths are (``os.fsdecode``), so that they
    compare equal to ``os.path.realpath`` of a path under them whatever
    bytes they hold.

    Args:
        path: The mount table to read.
    """
    try:
        with open(path, 'rb') as table:
            return parse_mountinfo(os.fsdecode(table.read()))
    except (OSError, ValueError):
        return []


def mount_of(path: str, mounts: Sequence[Mount]) -> Mount:
    """The mount ``path`` is on: the last in the table whose point is ``path`` or above it.

    The table lists a mount after the one it is mounted on, so the last
    covering mount is the deepest one, unless a mount made later over a
    point above it hides it (``/mnt`` mounted over ``/mnt/data``), or
    several are stacked on one point: then the later one is what ``path``
    reaches, and the last in the table too.

    Args:
        path: An absolute path, symbolic links resolved.
        mounts: The mount table (:func:`read_mounts`).

    Returns:
        The mount; ``Mount('', '')`` when no mount covers ``path`` (an
        empty table).
    """
    found = Mount('', '')
    for mount in mounts:
        point = mount.point.rstrip('/')
        if path == mount.point or path.startswith(point + '/'):
            found = mount
    return found


def is_node_local(fs_type: str) -> bool:
    """Whether a file system of type ``fs_type`` is storage of the node itself.

    FUSE mounts count as shared (they serve remote storage: sshfs,
    object stores, the benchmark's emulated shared storage); so does an
    unknown type.

    Args:
        fs_type: A type as the mount table names it.
    """
    return fs_type in NODE_LOCAL_TYPES


def on_node_local_storage(path: str, mounts: Sequence[Mount]) -> bool:
    """Whether ``path`` is on a node-local file system (:func:`is_node_local`).

    Args:
        path: A file or directory (resolved here).
        mounts: The mount table (:func:`read_mounts`).
    """
    return is_node_local(mount_of(os.path.realpath(path), mounts).fs_type)
