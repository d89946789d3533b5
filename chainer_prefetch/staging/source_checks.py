"""When stage 2 compares a local copy with its source again (``recheck_sources``).

A local copy is *current* while it has its source's size and modification
time.  Comparing them takes a ``stat`` of the source: on a parallel file
system, a round trip to the metadata server.  Settings:

``'directories'`` (the default)
    A copy checked in this run is trusted in a later epoch while the
    directory that holds its source is unchanged.  Each epoch, the first
    copy of a directory that the epoch meets reads the directory's stamp
    (inode, modification and change time: one ``stat``); only the copies
    of a directory whose stamp moved are compared with their sources again.
    A directory's times move when a name in it is created, renamed or
    removed, so this notices a source *replaced by rename* (how ``rsync``,
    ``mv`` and most tools replace a file) or *deleted*, within the epoch
    that follows plus the look-ahead; it does **not** notice a source
    rewritten in place under the same name (``cp new old``, a program
    opening it for writing), which changes no directory.  The directory is
    that of the source's path: for a source that is a symbolic link, the
    link's, not its target's.  A stamp read
    less than :data:`RECENT_SECONDS` after the directory's last change
    (file systems keep times at one-second resolution, and clocks differ)
    is not trusted; the copies of that directory are compared again until
    a later epoch reads a settled stamp.  Cost: one ``stat`` per directory
    per epoch (ImageNet: 1,000 directories for 1.28 million files).
``'each_epoch'``
    Every copy is compared with its source once per epoch: one ``stat`` per
    file per epoch, and a source changed in any way is noticed.
``'never'``
    A copy is compared with its source only the first time this run uses
    it.

In every setting, a copy found in the local directory (made by an earlier
job) is compared with its source the first time this run uses it, and a
copy made in this run is current when made.

:class:`SourceChecks` keeps, per item, the epoch in which its copies were
last compared with their sources, and per directory its last stamp and
the epoch since which it has not moved.  It is thread-safe: the copy
threads ask it at once.
"""
import os
import threading
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy

from chainer_prefetch.staging import source_ops

#: The settings of ``recheck_sources``.
RECHECK = ('directories', 'each_epoch', 'never')

#: A directory stamp this recent (seconds since its last change) is not
#: trusted: a change in the same second may leave the times as they were.
RECENT_SECONDS = 2.0

Stamp = Tuple[int, int, int, int]  # (device, inode, mtime_ns, ctime_ns)


class _Directory:
    """What is known of one source directory."""

    __slots__ = ('lock', 'epoch', 'stamp', 'settled_since')

    def __init__(self):
        self.lock = threading.Lock()
        self.epoch = -1  # the epoch of the last stamp read
        self.stamp: Optional[Stamp] = None
        # The first epoch of a run of settled, equal stamps up to ``epoch``;
        # None: the last stamp moved, was recent, or could not be read.
        self.settled_since: Optional[int] = None


class SourceChecks:
    """Decides whether an item's local copies need comparing with their sources.

    Epochs here are *check epochs* (see
    :mod:`chainer_prefetch.iterators._copy_window`): they never go back, also
    when the iterator is reset or a snapshot is restored.

    Args:
        mode: One of :data:`RECHECK`.
        n_items: Items in the dataset (an item is staged as one).
        stat: ``stat(path) -> os.stat_result`` of a directory on shared
            storage (counted by :mod:`~chainer_prefetch.staging.source_ops`).
        clock: Seconds since the epoch, comparable with the file system's
            times.
    """

    def __init__(self, mode: str, n_items: int,
                 stat: Callable[[str], os.stat_result] = source_ops.stat,
                 clock: Callable[[], float] = time.time):
        if mode not in RECHECK:
            raise ValueError('recheck_sources must be one of {}, got {!r}'
                             .format(', '.join(RECHECK), mode))
        self.mode = mode
        self._stat = stat
        self._clock = clock
        self._compared = numpy.full(n_items, -1, dtype=numpy.int32)
        self._directories: Dict[str, _Directory] = {}
        self._lock = threading.Lock()  # guards _directories' keys and _compared

    def trusts(self, item: int, origins: Sequence[str], epoch: int) -> bool:
        """Whether the local copies of ``item`` may be used in ``epoch`` without comparing them.

        With ``'directories'``, reads the stamp of each origin's directory
        the first time ``epoch`` asks about it, before any source of the
        directory is compared in that epoch; so call it before comparing.

        Args:
            item: The item.
            origins: Its source files on shared storage.
            epoch: The epoch of the access it is staged for.
        """
        if self.mode != 'directories':
            return False
        compared = int(self._compared[item])
        trusted = compared >= 0
        for directory in {os.path.dirname(origin) or '.' for origin in origins}:
            since = self._settled_since(directory, epoch)
            trusted = trusted and since is not None and since <= compared
        return trusted

    def compared(self, item: int, epoch: int):
        """Every local copy of ``item`` was found current (or made) for an access of ``epoch``."""
        with self._lock:
            self._compared[item] = max(int(self._compared[item]), epoch)

    def forget(self, item: int):
        """``item``'s local copies are gone or stale: compare them before trusting them again."""
        with self._lock:
            self._compared[item] = -1

    def _settled_since(self, path: str, epoch: int) -> Optional[int]:
        """The first epoch since which ``path``'s stamp has stood, read once per epoch."""
        with self._lock:
            directory = self._directories.get(path)
            if directory is None:
                directory = self._directories[path] = _Directory()
        with directory.lock:
            if directory.epoch < epoch:
                self._read_stamp(path, directory, epoch)
            return directory.settled_since

    def _read_stamp(self, path: str, directory: _Directory, epoch: int):
        try:
            info = self._stat(path)
        except OSError:
            stamp = None
        else:
            stamp = (info.st_dev, info.st_ino, info.st_mtime_ns,
                     info.st_ctime_ns)
        settled = stamp is not None and (
            self._clock() - max(stamp[2], stamp[3]) / 1e9 >= RECENT_SECONDS)
        if not settled:
            directory.settled_since = None
        elif stamp != directory.stamp or directory.settled_since is None:
            directory.settled_since = epoch
        directory.stamp = stamp
        directory.epoch = epoch
