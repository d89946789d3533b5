"""Counts of the operations the emulated storage's daemon serves.

The daemon (started with ``--counts-file PATH``) keeps one little-endian
int64 slot per name in :data:`OP_NAMES` in a small file that it maps with
``mmap``; any process may read the file at any time with :func:`read_counts`.
A count is incremented while the operation is served, before the daemon
replies, so a reader that looks after the caller's system call returned
sees it.

What each count means (one FUSE request from the kernel to the daemon,
which is what a parallel file system's client sends to its servers):

``getattr``     attribute requests: every name lookup (the kernel resolving a
                path component whose entry is not cached) and every
                ``stat``/``fstat`` whose attributes are not cached; with the
                high-level FUSE API a lookup arrives as ``getattr`` too.
``getattr_fh``  the part of ``getattr`` that carries an open file's handle:
                the kernel refreshing a file's size while reading near its
                end once the cached attributes expired (an ``fstat`` of a
                descriptor arrives without the handle).
``open``        file opens.
``read``        read requests (the kernel merges and splits ``read()`` calls
                into requests of up to 128 KiB through its readahead).
``read_bytes``  bytes returned by those read requests.
``readdir``     directory listing requests.
``opendir``     directory opens.
``readlink``    symbolic link reads.
``access``      ``access()`` permission checks.
``statfs``      file system statistics (``statvfs``, ``df``).
"""
import mmap
import os
import struct
import threading
from typing import Dict, Mapping

OP_NAMES = ('getattr', 'getattr_fh', 'open', 'read', 'read_bytes',
            'readdir', 'opendir', 'readlink', 'access', 'statfs')
"""The counts kept, in the order of their slots in the file."""

_SLOT = struct.Struct('<q')
_ALL = struct.Struct('<{}q'.format(len(OP_NAMES)))


class OpCounter:
    """The daemon's side: create the counts file and add to its slots.

    The file is created or truncated to zeroes.  Thread-safe.

    Args:
        path: The counts file.
    """

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, _ALL.size)
            self._map = mmap.mmap(fd, _ALL.size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._values = [0] * len(OP_NAMES)
        self._index = {name: i for i, name in enumerate(OP_NAMES)}
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the count ``name``.

        Args:
            name: One of :data:`OP_NAMES`.
            n: Amount to add.
        """
        i = self._index[name]
        with self._lock:
            self._values[i] += n
            _SLOT.pack_into(self._map, i * _SLOT.size, self._values[i])


def read_counts(path: str) -> Dict[str, int]:
    """The counts in a file written by :class:`OpCounter`.

    Args:
        path: The counts file.

    Returns:
        A dict from each name of :data:`OP_NAMES` to its count.
    """
    with open(path, 'rb') as f:
        data = f.read(_ALL.size)
    if len(data) < _ALL.size:  # the daemon has not sized it yet
        data = data.ljust(_ALL.size, b'\0')
    return dict(zip(OP_NAMES, _ALL.unpack(data)))


def counts_delta(before: Mapping[str, int],
                 after: Mapping[str, int]) -> Dict[str, int]:
    """The operations served between two readings of the counts.

    Args:
        before: Counts read first.
        after: Counts read later.

    Returns:
        ``after[name] - before[name]`` for each name of ``after``.
    """
    return {name: after[name] - before.get(name, 0) for name in after}
