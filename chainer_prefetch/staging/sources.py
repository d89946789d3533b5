"""Sources: a file on shared storage and the local file made from it, one interface.

Stage 2 stages *sources*.  Two kinds share every method, so the local store
(:mod:`chainer_prefetch.staging.local_store`) treats them alike, budget
included:

* :class:`PlainFile`: a file copied byte for byte (what a dataset names with
  a plain path in ``example_files(i)``; :func:`as_source` wraps it);
* :class:`DerivedFile`: a local file *made from* a part of a source file in
  another form, e.g. one row group of a Parquet file decoded once into an
  Arrow IPC file that the loader processes memory-map (no second
  decompression, one copy in the page cache for all of them).  A dataset asks
  for that by naming a :class:`DerivedFile` in ``example_files(i)``;
  subclasses say how to read the part (:meth:`DerivedFile.load_from_origin`)
  and how to write its local form (:meth:`DerivedFile.write_local_form`),
  and may also say how to keep it in memory instead
  (:meth:`DerivedFile.memory_form`, for ``local_dir=':memory:'``).

A source may read its origin *ahead* of its copy (:meth:`Source.read_ahead`):
stage 2 reads the next one-at-a-time source while the current one is being
made, and the copy then uses what was read (:func:`using_reads_ahead`).

Every source has a ``name`` (the path its local copy mirrors: the file's own
path, or a *virtual* path for a derived file, e.g.
``/shared/part-0.parquet.rg00003.arrow``) and an ``origin`` (the real file
on shared storage).  A local file is current while it is a regular file
stamped with the origin's modification time (and, for a plain copy, has the
origin's size): a changed origin makes it stale.
"""
import contextlib
import errno
import os
import stat
import threading
from typing import Any, BinaryIO, Optional, Sequence, Tuple, Union

from chainer_prefetch.errors import LocalStorageError, SourceFileError
from chainer_prefetch.staging import source_ops
from chainer_prefetch.staging.piece_reads import PendingReads, PieceReaders

#: Bytes per ``sendfile`` call (the kernel copies; nothing passes through Python).
_SENDFILE_BYTES = 1 << 24


class Source:
    """A file on shared storage and how its local form is made.

    Attributes:
        name: The path that names the local form.
        origin: The file on shared storage it is made from.
    """

    __slots__ = ()
    name: str
    origin: str
    #: Whether stage 2 copies sources of this kind one at a time, in the
    #: order needed (each copy is large, reads in parallel pieces and may
    #: decode: two at once only delay the first), instead of many at once.
    copied_one_at_a_time = False
    #: Whether the local form can be kept in this process's memory instead
    #: of a file (:meth:`DerivedFile.make_in_memory`; ``local_dir=':memory:'``).
    has_memory_form = False
    #: Whether :meth:`write_local` may be given no ``origin_stat`` and take
    #: it from the origin it opens (``fstat``): a copy then asks shared
    #: storage for one ``open`` instead of a ``stat`` and an ``open``.
    stats_when_opened = False

    def __repr__(self):
        return '{}({!r})'.format(type(self).__name__, self.name)

    def __str__(self):
        return self.name

    def describe(self) -> str:
        """How error messages name the source: its path (``name``) by default."""
        return self.name

    def stat_origin(self) -> os.stat_result:
        """``os.stat`` of the origin.

        Raises:
            SourceFileError: the origin cannot be read (the message names it).
        """
        try:
            return source_ops.stat(self.origin)
        except OSError as error:
            raise source_error(error, self.origin) from error

    def estimated_local_bytes(self, origin_stat: os.stat_result) -> int:
        """Bytes the local form will take, as known before making it."""
        return origin_stat.st_size

    def source_bytes(self, origin_stat: os.stat_result) -> int:
        """Bytes read from shared storage to make the local form."""
        return origin_stat.st_size

    def source_bytes_per_example(self, origin_stat: os.stat_result) -> int:
        """An example's share of :meth:`source_bytes` (when examples share the source)."""
        return self.source_bytes(origin_stat)

    def is_current(self, local_stat: os.stat_result,
                   origin_stat: os.stat_result) -> bool:
        """Whether a local file with ``local_stat`` is this source's current form."""
        return (stat.S_ISREG(local_stat.st_mode)
                and local_stat.st_mtime_ns == origin_stat.st_mtime_ns)

    def read_ahead(self, opened: Optional[int] = None) -> Optional['ReadAhead']:
        """Reads what the next copy needs from the origin, ahead of the copy.

        Called on another thread while the previous copy is being made; the
        copy then starts from what was read (see :func:`using_reads_ahead`).
        Errors are not reported here: the copy reads again and reports them.

        Args:
            opened: A descriptor of the origin, open, to read through instead
                of opening the origin again; the caller keeps and closes it,
                so a read that keeps the file must ``os.dup`` it.  Stage 2
                passes one, kept open while copies read or made recently have
                the same origin: on some file systems, FUSE without
                ``keep_cache`` among them, opening a file drops the pages
                those copies may still be reading.

        Returns:
            What was read, or ``None`` when this kind reads nothing ahead (the
            default).
        """
        return None

    def start_read_ahead(self, opened: int,
                         readers: PieceReaders) -> Optional['ReadAhead']:
        """Starts :meth:`read_ahead`; what stage 2 calls.

        The default reads now (:meth:`read_ahead`).  A kind that reads in
        pieces (Parquet row groups) queues them on ``readers`` instead and
        returns at once, with the read pending (see :meth:`ReadAhead.finish`).

        Args:
            opened: As for :meth:`read_ahead`.
            readers: The threads that read the pieces of every copy read
                ahead, first in, first out.

        Returns:
            As :meth:`read_ahead`.
        """
        return self.read_ahead(opened)

    def write_local(self, out_fd: int, origin_stat: os.stat_result,
                    destination: str) -> int:
        """Writes the local form into the empty, open file ``out_fd``.

        Args:
            out_fd: The file to write (a locked ``.part`` file).
            origin_stat: ``stat_origin()`` taken before reading (``None``
                only where :attr:`stats_when_opened`).
            destination: The final local path (for error messages).

        Returns:
            Bytes written.

        Raises:
            SourceFileError: the origin cannot be read, is corrupt, or changed
                while it was read.
            LocalStorageError: the local form cannot be written, or memory
                ran out making it (``ENOMEM``).
        """
        raise NotImplementedError


class PlainFile(Source):
    """A file copied byte for byte; its copy also has the origin's size.

    Args:
        path: The file on shared storage.
    """

    __slots__ = ('name', 'origin')
    stats_when_opened = True

    def __init__(self, path: str):
        self.name = self.origin = path

    def is_current(self, local_stat, origin_stat):
        return (super().is_current(local_stat, origin_stat)
                and local_stat.st_size == origin_stat.st_size)

    def write_local(self, out_fd, origin_stat, destination):
        try:
            in_fd = source_ops.open_readonly(self.origin)
            try:
                if origin_stat is None:  # (see stats_when_opened)
                    origin_stat = os.fstat(in_fd)
            except OSError:
                os.close(in_fd)
                raise
        except OSError as error:
            raise source_error(error, self.origin) from error
        try:
            copied = _send_all(in_fd, out_fd, self.origin, destination)
        finally:
            os.close(in_fd)
        if copied != origin_stat.st_size:
            raise SourceFileError(
                errno.EIO, 'source {} changed while copying ({} bytes read, '
                '{} expected)'.format(self.origin, copied,
                                      origin_stat.st_size), self.origin)
        stamp(out_fd, origin_stat, destination)
        return copied


class DerivedFile(Source):
    """A local file made from (a part of) ``origin``; subclasses say how.

    Subclasses implement :meth:`load_from_origin` and
    :meth:`write_local_form`, and may refine :meth:`estimated_local_bytes`
    and :meth:`source_bytes` (e.g. from file metadata) for the budget of a
    capacity-limited local directory and for the statistics.

    Args:
        virtual_path: The path that names the local form (it must not be the
            path of a real source file, or the two would share a local copy).
        origin: The source file on shared storage.
    """

    def __init__(self, virtual_path: str, origin: str):
        self.name = virtual_path
        self.origin = origin

    def __reduce__(self):
        return type(self), (self.name, self.origin)

    def __eq__(self, other):
        return type(self) is type(other) and self.name == other.name

    def __hash__(self):
        return hash(self.name)

    def load_from_origin(self, ahead: Any = None) -> Any:
        """Reads the content from ``origin``.

        Args:
            ahead: The ``value`` of this source's :meth:`read_ahead`, when it
                read the origin as it still is; ``None`` to read it all here.

        Raises:
            OSError or ValueError: ``origin`` cannot be read or is corrupt;
                reported as :class:`~chainer_prefetch.errors.SourceFileError`.
        """
        raise NotImplementedError

    def write_local_form(self, content: Any, out: BinaryIO) -> None:
        """Writes ``content`` (from :meth:`load_from_origin`) to ``out``.

        It may go on reading the origin (decoding it as it writes); an
        error of that reading must be raised as :meth:`origin_error`.
        """
        raise NotImplementedError

    def memory_form(self, content: Any) -> Tuple[Any, int]:
        """``content`` (from :meth:`load_from_origin`) as the local form kept in memory.

        For subclasses with :attr:`has_memory_form`.  Errors of reading the
        origin must be raised as :meth:`origin_error`, as in
        :meth:`write_local_form`.

        Returns:
            ``(value, n_bytes)``: what the loaders read instead of a local
            file, and the bytes of memory it holds.
        """
        raise NotImplementedError

    def origin_error(self, error: Exception) -> SourceFileError:
        """``error``, met reading the origin, as the error that names it."""
        return SourceFileError(
            getattr(error, 'errno', None) or errno.EIO,
            'cannot read {} (for {}): {}'.format(self.origin, self.name, error),
            self.origin)

    def write_local(self, out_fd, origin_stat, destination):
        try:
            content = self._load(origin_stat)
            with os.fdopen(os.dup(out_fd), 'wb') as out:
                self.write_local_form(content, out)
            written = os.fstat(out_fd).st_size
        except OSError as error:
            raise local_error(error, destination) from error
        except MemoryError as error:
            raise _out_of_memory(error, destination) from error
        self._check_unchanged(origin_stat)
        stamp(out_fd, origin_stat, destination)
        return written

    def make_in_memory(self, origin_stat: os.stat_result) -> Tuple[Any, int]:
        """The local form made in memory (:meth:`memory_form`), not in a file.

        Args:
            origin_stat: ``stat_origin()`` taken before reading.

        Returns:
            ``(value, n_bytes)`` as :meth:`memory_form` gives them.

        Raises:
            SourceFileError: the origin cannot be read, is corrupt, or changed
                while it was read.
            LocalStorageError: memory ran out (``ENOMEM``).
        """
        try:
            value = self.memory_form(self._load(origin_stat))
        except MemoryError as error:
            raise _out_of_memory(error, self.name) from error
        self._check_unchanged(origin_stat)
        return value

    def _load(self, origin_stat: os.stat_result) -> Any:
        """:meth:`load_from_origin`, from what was read ahead if it is still current."""
        try:
            ahead = _take_read_ahead(self, origin_stat)
            # (a subclass that reads nothing ahead may take no argument)
            return (self.load_from_origin() if ahead is None
                    else self.load_from_origin(ahead))
        except (OSError, ValueError) as error:
            raise self.origin_error(error) from error

    def _check_unchanged(self, origin_stat: os.stat_result):
        """Raises ``SourceFileError`` if the origin changed since ``origin_stat``."""
        try:
            after = source_ops.stat(self.origin)
        except OSError as error:
            raise self.origin_error(error) from error
        if (after.st_size, after.st_mtime_ns) != (origin_stat.st_size,
                                                  origin_stat.st_mtime_ns):
            raise SourceFileError(errno.EIO, '{} changed while it was read'
                                  .format(self.origin), self.origin)


class ReadAhead:
    """What :meth:`Source.read_ahead` read, for the copy of that source.

    Args:
        source_name: The source's ``name``.
        origin_stat: ``os.stat`` of the origin as it was read (of the open
            file): a copy whose origin has changed since reads it again.
        value: What the source's copy takes (for a :class:`DerivedFile`, its
            ``load_from_origin(ahead=value)``).
        pending: The reads ``value`` still waits for, or ``None`` when it is
            read.
    """

    __slots__ = ('source_name', 'origin_stat', 'value', 'pending')

    def __init__(self, source_name: str, origin_stat: os.stat_result,
                 value: Any, pending: Optional[PendingReads] = None):
        self.source_name = source_name
        self.origin_stat = origin_stat
        self.value = value
        self.pending = pending

    def finish(self) -> bool:
        """Waits for the reads still pending.

        A read that failed is not reported here: the copy reads the origin
        again and names the error.

        Returns:
            Whether ``value`` was read (``False`` once a read failed or was
            cancelled; ``value`` is then dropped).
        """
        pending = self.pending  # (kept meanwhile, for cancel())
        if pending is None:
            return self.value is not None
        try:
            pending.wait()
        except Exception:
            self.value = None
            return False
        finally:
            self.pending = None
        return True

    def cancel(self):
        """Drops the reads still pending that no thread has started."""
        if self.pending is not None:
            self.pending.cancel()

    def is_of(self, origin_stat: os.stat_result) -> bool:
        """Whether it was read from the same file, unchanged, as ``origin_stat``."""
        return all(getattr(self.origin_stat, key) == getattr(origin_stat, key)
                   for key in ('st_dev', 'st_ino', 'st_size', 'st_mtime_ns',
                               'st_ctime_ns'))


_reads_ahead = threading.local()


@contextlib.contextmanager
def using_reads_ahead(reads: Sequence[ReadAhead]):
    """Lets the copies made on this thread inside the block start from ``reads``.

    Each read is used at most once, by the copy of its source, and only if
    the origin is still the file it was read from; whatever is left unused
    is dropped when the block ends.

    Args:
        reads: What :meth:`Source.read_ahead` returned for the sources about
            to be copied.
    """
    _reads_ahead.by_name = {read.source_name: read for read in reads}
    try:
        yield
    finally:
        unused, _reads_ahead.by_name = _reads_ahead.by_name, {}
        for read in unused.values():
            read.cancel()


def _take_read_ahead(source: Source, origin_stat: os.stat_result) -> Any:
    """The value read ahead for ``source`` that is still current and read, or ``None``."""
    read = getattr(_reads_ahead, 'by_name', {}).pop(source.name, None)
    if read is None:
        return None
    if not read.is_of(origin_stat):  # the origin changed: read it again
        read.cancel()
        return None
    return read.value if read.finish() else None


def as_source(named: Union[str, os.PathLike, Source]) -> Source:
    """The :class:`Source` for what a dataset's ``example_files`` named."""
    if isinstance(named, Source):
        return named
    return PlainFile(os.fspath(named))


def stamp(fd: int, origin_stat: os.stat_result, destination: str):
    """Gives the local file the origin's times (how it is recognised as current)."""
    try:
        os.utime(fd, ns=(origin_stat.st_atime_ns, origin_stat.st_mtime_ns))
    except OSError as error:
        raise local_error(error, destination) from error


def _send_all(in_fd: int, out_fd: int, source: str, destination: str) -> int:
    """Copies ``in_fd`` to ``out_fd`` inside the kernel; returns the bytes copied.

    A failed read is the source's fault, a failed write the local side's;
    ``sendfile`` reports both as one error, so a failure is attributed by
    reading one byte of the source at the failing offset.
    """
    copied = 0
    while True:
        try:
            sent = os.sendfile(out_fd, in_fd, copied, _SENDFILE_BYTES)
        except OSError as error:
            try:
                os.pread(in_fd, 1, copied)
            except OSError as read_error:
                raise source_error(read_error, source) from read_error
            raise local_error(error, destination) from error
        if sent == 0:
            return copied
        copied += sent


def source_error(error: OSError, source: str) -> SourceFileError:
    """A :class:`SourceFileError` naming ``source``."""
    return SourceFileError(error.errno, 'cannot read {}: {}'.format(
        source, error.strerror or error), source)


def _out_of_memory(error: MemoryError, local_form: str) -> LocalStorageError:
    """Memory ran out making a local form: a failure of the local side, not of the source."""
    return LocalStorageError(errno.ENOMEM, 'out of memory making the local form '
                             '{}: {}'.format(local_form, error), local_form)


def local_error(error: OSError, path: str) -> LocalStorageError:
    """A :class:`LocalStorageError` naming the local ``path``."""
    if isinstance(error, (SourceFileError, LocalStorageError)):
        return error
    return LocalStorageError(error.errno, 'cannot write local copy {}: {}'.format(
        path, error.strerror or error), path)
