"""Derived files: local files made from a part of a source file, staged like copies.

Stage 2 normally copies whole files.  Some formats are better staged in
pieces and in another form: one row group of a Parquet file, decoded once
into an Arrow IPC file that worker processes memory-map (no second
decompression, one copy in the page cache for all of them).  A dataset asks
for that by naming, in ``example_files(i)``, a :class:`DerivedFile` instead
of a plain path.  A derived file is a ``str`` (its *virtual path*, which maps
to a local path like any other source path, e.g.
``/shared/part-0.parquet.rg00003.arrow``) that also says

* ``origin``: the real file on shared storage it is made from,
* ``load_from_origin()``: how to read its content from the origin,
* ``write_local_form(content, out)``: how to write that content locally.

:class:`~chainer_prefetch.staging.LocalDirectory` stages it with the same
guarantees as a copy: written to ``.partial/`` under an exclusive ``flock``
and renamed into place when complete, so workers never see a partial file;
other processes wanting it wait and reuse it.  A local derived file is valid
while its modification time equals the origin's (it is stamped with it):
its size differs from the origin's, so size is not compared; a changed
origin (new mtime) makes every file derived from it stale.
"""
import errno
import os
from typing import Any, BinaryIO


class DerivedFile(str):
    """A file made from (a part of) ``origin``; subclasses say how.

    Subclasses must implement :meth:`load_from_origin` and
    :meth:`write_local_form` (``abc`` cannot enforce that on a ``str``
    subclass, whose ``__new__`` skips the check, so the base methods raise
    ``NotImplementedError``).

    Args:
        virtual_path: The path that names the local form (it must not be the
            path of a real source file, or the two would share a local copy).
        origin: The source file on shared storage.
    """

    origin: str

    def __new__(cls, virtual_path: str, origin: str):
        derived = super().__new__(cls, virtual_path)
        derived.origin = origin
        return derived

    def __reduce__(self):
        return type(self), (str(self), self.origin)

    def load_from_origin(self) -> Any:
        """Reads the content from ``origin``.

        Raises:
            OSError or ValueError: ``origin`` cannot be read or is corrupt;
                reported as :class:`~chainer_prefetch.staging.SourceFileError`.
        """
        raise NotImplementedError

    def write_local_form(self, content: Any, out: BinaryIO) -> None:
        """Writes ``content`` (from :meth:`load_from_origin`) to ``out``."""
        raise NotImplementedError


def fill(part_fd: int, derived: DerivedFile, origin_stat: os.stat_result,
         destination: str) -> int:
    """Writes the local form of ``derived`` into the locked ``.part`` file.

    Called by ``LocalDirectory`` in place of a byte copy.

    Args:
        part_fd: The open, locked, empty ``.part`` file.
        derived: What to make.
        origin_stat: ``os.stat(derived.origin)`` taken before reading.
        destination: The final local path (for error messages).

    Returns:
        Bytes written.

    Raises:
        SourceFileError: the origin cannot be read, is corrupt, or changed
            while it was read.
        LocalStorageError: the local form cannot be written.
    """
    # Imported here: local_directory imports this module.
    from chainer_prefetch.staging.local_directory import (
        LocalStorageError, SourceFileError, _local_error)
    try:
        content = derived.load_from_origin()
        after = os.stat(derived.origin)
    except (OSError, ValueError) as error:
        raise SourceFileError(
            getattr(error, 'errno', None) or errno.EIO,
            'cannot read {} (for {}): {}'.format(derived.origin, derived,
                                                 error),
            derived.origin) from error
    if (after.st_size, after.st_mtime_ns) != (origin_stat.st_size,
                                              origin_stat.st_mtime_ns):
        raise SourceFileError(errno.EIO, '{} changed while it was read'
                              .format(derived.origin), derived.origin)
    try:
        with os.fdopen(os.dup(part_fd), 'wb') as out:
            derived.write_local_form(content, out)
        os.utime(part_fd, ns=(origin_stat.st_atime_ns,
                              origin_stat.st_mtime_ns))
        return os.fstat(part_fd).st_size
    except OSError as error:
        if isinstance(error, (SourceFileError, LocalStorageError)):
            raise
        raise _local_error(error, destination)
