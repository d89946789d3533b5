"""One row group of a Parquet file: its staged forms, and reading and decoding it.

:class:`RowGroupFile` is the *derived file* (see
:mod:`chainer_prefetch.staging.sources`) that
:class:`~chainer_prefetch.PrefetchMultiprocessIterator` stages for a
:class:`~chainer_prefetch.datasets.ParquetDataset`: the row group with the
selected columns, as an uncompressed Arrow IPC file in the local directory
(:meth:`RowGroupFile.write_local_form`, read back by :func:`read_ipc_file`),
or, with ``local_dir=':memory:'``, as a :class:`DecodedRowGroup` kept in the
training process (:meth:`RowGroupFile.memory_form`).

Reading goes in two steps, so that stage 2 can read one row group while it
decodes the one before: the selected column chunks are read into the page
cache (:mod:`chainer_prefetch.datasets.byte_ranges`), then Arrow decodes
them from a memory map of the file (:func:`open_parquet_file`,
:class:`PooledParquetFile`).  :func:`read_row_group` does both for a
dataset read without staging.
"""
import contextlib
import errno
import functools
import hashlib
import itertools
import os
from typing import Iterator, Optional, Sequence, Tuple

import pyarrow
import pyarrow.ipc
import pyarrow.parquet

from chainer_prefetch.datasets.arrow_columns import StoredColumns, value_converter
from chainer_prefetch.datasets.byte_ranges import (
    map_column_chunks,
    start_reading_column_chunks,
)
from chainer_prefetch.errors import ParquetFileError
from chainer_prefetch.staging.piece_reads import PieceReaders
from chainer_prefetch.staging.sources import DerivedFile, ReadAhead


class RowGroupFile(DerivedFile):
    """One row group of one Parquet file, with some columns, as an Arrow IPC file.

    Its virtual path is ``<file>.rg<index>.<columns digest>.arrow``.  With
    ``local_dir=':memory:'`` its local form is the decoded row group itself
    (:meth:`memory_form`), kept in the training process.  Row
    groups are copied one at a time, in the order needed (see
    :attr:`~chainer_prefetch.staging.sources.Source.copied_one_at_a_time`).

    Args:
        origin: The Parquet file.
        row_group: The row group's index in the file.
        columns: The columns to keep.
    """

    copied_one_at_a_time = True
    has_memory_form = True

    def __init__(self, origin: str, row_group: int, columns: Sequence[str],
                 metadata=None):
        digest = hashlib.sha1('\0'.join(columns).encode('utf-8')).hexdigest()
        super().__init__('{}.rg{:05d}.{}.arrow'.format(origin, row_group,
                                                      digest[:8]), origin)
        self.row_group = row_group
        self.columns = tuple(columns)
        self._metadata = metadata

    def __reduce__(self):
        return type(self), (self.origin, self.row_group, self.columns,
                            self._metadata)

    def describe(self) -> str:
        """``<file> (row group <index>)``, as the dataset's own errors name it."""
        return row_group_label(self.origin, self.row_group)

    def _column_chunks(self):
        metadata = self._metadata
        if metadata is None:
            metadata = self._metadata = read_metadata(self.origin)
        return selected_chunks(metadata, self.row_group, self.columns)

    def decoded_bytes(self) -> int:
        """The selected columns' uncompressed size, as the footer gives it."""
        _, chunks = self._column_chunks()
        return sum(chunk.total_uncompressed_size for chunk in chunks)

    def estimated_local_bytes(self, origin_stat) -> int:
        """:meth:`decoded_bytes` plus :data:`DECODED_MARGIN` of it and room for the IPC framing.

        Arrow takes a little more than the footer's uncompressed size
        (dictionary-encoded strings come out whole): with the margin,
        ``local_capacity`` of N
        times this estimate holds N such row groups.  A form larger still
        is counted at its real size when it is made.
        """
        decoded = self.decoded_bytes()
        return decoded + int(decoded * DECODED_MARGIN) + 4096

    def source_bytes(self, origin_stat) -> int:
        """The columns' compressed size: what reading the row group transfers."""
        _, chunks = self._column_chunks()
        return sum(chunk.total_compressed_size for chunk in chunks)

    def source_bytes_per_example(self, origin_stat) -> int:
        group, _ = self._column_chunks()
        return self.source_bytes(origin_stat) // max(1, group.num_rows)

    def read_ahead(self, opened: Optional[int] = None) -> ReadAhead:
        """Reads the row group's column chunks into the page cache, and maps the file.

        The copy then only decodes (:meth:`load_from_origin`), so stage 2
        reads one row group while it decodes the one before, of the same
        file too.

        Args:
            opened: A descriptor of the Parquet file to read through instead
                of opening it (see :meth:`Source.read_ahead
                <chainer_prefetch.staging.sources.Source.read_ahead>`).
        """
        return self.start_read_ahead(opened, None)

    def start_read_ahead(self, opened: Optional[int],
                         readers: Optional[PieceReaders]) -> ReadAhead:
        """:meth:`read_ahead`, with the pieces queued on ``readers``; returns at once.

        Args:
            opened: As for :meth:`read_ahead`.
            readers: Threads to read the chunks' pieces on, behind the row
                groups read ahead before (``None``: read them now).
        """
        _, chunks = self._column_chunks()
        mapped, origin_stat, pending = start_reading_column_chunks(
            self.origin, chunks, opened, readers)
        return ReadAhead(self.name, origin_stat, mapped, pending)

    def load_from_origin(self, ahead=None) -> 'PooledParquetFile':
        """Opens the Parquet file to decode the row group from.

        :meth:`write_local_form` decodes it.

        Args:
            ahead: The mapped file from :meth:`read_ahead`, or ``None``.

        Raises:
            ParquetFileError: the file cannot be read or is corrupt.
        """
        return open_parquet_file(self.origin, self.row_group, self.columns,
                                 self._metadata, mapped=ahead)

    def write_local_form(self, content: pyarrow.parquet.ParquetFile, out) -> None:
        """Decodes the row group into an uncompressed Arrow IPC file, piece by piece.

        Each piece of :meth:`piece_rows` rows is decoded and written as one
        record batch.  Decoding the row group whole would take its whole
        decoded size of new memory, which Arrow's allocator hands back to
        the kernel soon after it is freed, so that every row group's memory
        would be faulted in and zeroed afresh; piece by piece, each piece
        reuses the memory of the one before
        (:class:`~chainer_prefetch.datasets.arrow_columns.StoredColumns`
        reads the record batches without joining them).

        Arrow writes to the file's descriptor itself (:func:`_native_sink`),
        so that writing takes no GIL.

        Args:
            content: The opened Parquet file (:meth:`load_from_origin`).
            out: The local file, open for writing.

        Raises:
            SourceFileError: a piece of the row group cannot be decoded.
            OSError: the local file cannot be written.
        """
        with content, _native_sink(out) as sink:
            schema, pieces = self._pieces(content)
            with pyarrow.ipc.new_file(sink, schema) as writer:
                for piece in pieces:
                    writer.write_batch(piece)

    def memory_form(self, content: 'PooledParquetFile'
                    ) -> Tuple['DecodedRowGroup', int]:
        """Decodes the row group into a table of pieces, kept in memory.

        The pieces are those :meth:`write_local_form` writes; the table is
        what a loader thread reads instead of the IPC file
        (``local_dir=':memory:'``), without the CPU that writing each row
        group to a local file takes.  It comes as a :class:`DecodedRowGroup`,
        which every loader thread shares, with the columns to cut batches
        from prepared here.

        Args:
            content: The opened Parquet file (:meth:`load_from_origin`).

        Returns:
            The decoded row group and the bytes of its table's buffers.

        Raises:
            SourceFileError: a piece of the row group cannot be decoded.
        """
        with content:
            try:
                content.decode_into(decode_memory_pool())
            except MemoryError:
                raise
            except READ_ERRORS as error:  # (a path opened again)
                raise self.origin_error(error) from error
            schema, pieces = self._pieces(content)
            table = pyarrow.Table.from_batches(list(pieces), schema)
        decoded = DecodedRowGroup(table)
        decoded.columns(self.columns)  # here, once, not in every loader thread
        return decoded, table.get_total_buffer_size()

    def _pieces(self, content: pyarrow.parquet.ParquetFile
                ) -> Tuple[pyarrow.Schema, Iterator[pyarrow.RecordBatch]]:
        """The schema, and the row group decoded piece by piece (:meth:`piece_rows`)."""
        pieces = self._decoded(content.iter_batches(
            batch_size=self.piece_rows(), row_groups=[self.row_group],
            columns=list(self.columns)))
        first = next(pieces, None)
        if first is None:
            return pyarrow.schema([content.schema_arrow.field(name)
                                   for name in self.columns]), iter(())
        return first.schema, itertools.chain([first], pieces)

    def piece_rows(self) -> int:
        """Rows decoded at a time: about :data:`DECODE_BYTES` of the columns' decoded size."""
        group, _ = self._column_chunks()
        return max(1, min(group.num_rows, DECODE_BYTES * group.num_rows
                          // max(1, self.decoded_bytes())))

    def _decoded(self, pieces: Iterator[pyarrow.RecordBatch]
                 ) -> Iterator[pyarrow.RecordBatch]:
        """``pieces``, each error of decoding them raised as a ``SourceFileError``.

        Running out of memory is not the file's fault: ``MemoryError``
        (Arrow's included) goes on as it is.
        """
        try:
            yield from pieces
        except MemoryError:
            raise
        except READ_ERRORS as error:
            raise self.origin_error(error) from error


@contextlib.contextmanager
def _native_sink(out):
    """An Arrow stream that appends to the file ``out`` writes to.

    Arrow writes a Python file object through Python calls, taking the GIL
    for each buffer it writes (several for each piece of a row group), and
    waits for it while other threads of the process (loader threads)
    run Python code.  An empty file, opened again through
    ``/proc/self/fd``, is written by Arrow alone; ``out`` is then moved to
    its new end.  Without ``/proc``, for an object that is not a file, or a
    file that is not empty (the offsets Arrow records start at its own
    first byte), this is ``out`` itself.

    Args:
        out: A binary file object open for writing.
    """
    out.flush()
    sink = None
    try:
        descriptor = out.fileno()
        if out.writable() and out.tell() == 0 == os.fstat(descriptor).st_size:
            sink = pyarrow.OSFile('/proc/self/fd/{}'.format(descriptor), 'ab')
    except (OSError, ValueError):  # no descriptor (io.BytesIO), no /proc
        pass
    if sink is None:
        yield out
        return
    try:
        with sink:
            yield sink
    finally:
        out.seek(0, os.SEEK_END)


#: What PyArrow raises for a file it cannot read or decode.  Its
#: ``ArrowMemoryError`` is one of them (an ``ArrowException``) and a
#: ``MemoryError``: where these are caught, a ``MemoryError`` goes on as it is.
READ_ERRORS = (OSError, pyarrow.ArrowException, ValueError)

#: Bytes of a row group decoded at a time when it is staged (see
#: :meth:`RowGroupFile.write_local_form`), from the footer's uncompressed
#: sizes: small enough that each piece reuses the memory of the one before,
#: large enough that the cost of each record batch stays small beside its
#: rows'.
DECODE_BYTES = 8 << 20

#: Share of a row group's uncompressed size added to its estimated local
#: bytes (see :meth:`RowGroupFile.estimated_local_bytes`).
DECODED_MARGIN = 0.01


def read_row_group(path: str, row_group: int, columns: Sequence[str],
                   metadata=None, mapped=None) -> pyarrow.Table:
    """Reads one row group of a Parquet file, whole.

    Args:
        path, row_group, columns, metadata, mapped: As for
            :func:`open_parquet_file`, which says how it is read.

    Returns:
        The rows as an Arrow table.

    Raises:
        ParquetFileError: the file cannot be read or is corrupt.
    """
    parquet_file = open_parquet_file(path, row_group, columns, metadata, mapped)
    try:
        with parquet_file:
            parquet_file.decode_into(decode_memory_pool())  # a table kept
            return parquet_file.read_row_group(row_group, columns=list(columns))
    except MemoryError:  # (Arrow's too) not the file's fault
        raise
    except READ_ERRORS as error:
        raise _row_group_error(row_group, path, error, metadata) from error


def open_parquet_file(path: str, row_group: int, columns: Sequence[str],
                      metadata=None, mapped=None) -> 'PooledParquetFile':
    """Opens a Parquet file to decode one row group's ``columns`` from memory.

    The selected column chunks are first read into the page cache in
    parallel pieces (see :mod:`chainer_prefetch.datasets.byte_ranges`)
    unless ``mapped`` has them; Arrow then decodes them from a memory map of the file, without
    copying them into a buffer of its own.

    Args:
        path: The Parquet file.
        row_group: Index of the row group.
        columns: Columns to read.
        metadata: The file's ``FileMetaData`` if known (saves reading the
            footer again).
        mapped: The file with the chunks already read, as
            :func:`~chainer_prefetch.datasets.byte_ranges.map_column_chunks`
            returns it (``None``: read them here).

    Raises:
        ParquetFileError: the file cannot be read or is corrupt.
    """
    try:
        footer = read_metadata(path) if metadata is None else metadata
        if mapped is None:
            _, chunks = selected_chunks(footer, row_group, columns)
            mapped, _ = map_column_chunks(path, chunks)
        return PooledParquetFile(mapped, footer)
    except MemoryError:  # (Arrow's too) not the file's fault
        raise
    except READ_ERRORS as error:
        raise _row_group_error(row_group, path, error, metadata) from error


class PooledParquetFile(pyarrow.parquet.ParquetFile):
    """A Parquet file that can decode into a chosen memory pool (:meth:`decode_into`).

    ``ParquetFile`` takes no memory pool; this one keeps its source, so
    that its reader can be replaced by one of the same class
    (``pyarrow.parquet.ParquetReader``) made with a pool.

    Args:
        source: The file: a path or a buffer (a memory map).
        metadata: Its footer (``FileMetaData``).
    """

    def __init__(self, source, metadata):
        super().__init__(source, metadata=metadata, pre_buffer=False)
        self._source = source

    def decode_into(self, pool: Optional[pyarrow.MemoryPool]) -> None:
        """Decodes the arrays read from now on into ``pool``.

        (The scratch buffers of decompressing pages stay in Arrow's
        default pool: they are freed as each page is decoded.)

        Args:
            pool: An Arrow memory pool, or ``None``: the pool it had.
        """
        if pool is None:
            return
        reader = pyarrow.parquet.ParquetReader(memory_pool=pool)
        # As ParquetFile opens its own (its defaults): the same types.
        reader.open(self._source, metadata=self.metadata, pre_buffer=False,
                    arrow_extensions_enabled=True)
        replaced, self.reader = self.reader, reader
        if self._close_source:  # (else the source is the caller's, shared)
            replaced.close()


@functools.lru_cache(maxsize=1)
def decode_memory_pool() -> Optional[pyarrow.MemoryPool]:
    """The Arrow memory pool that row groups kept decoded in memory are decoded into.

    Those are the row groups of ``local_dir=':memory:'``
    (:meth:`RowGroupFile.memory_form`) and those a dataset reads itself
    (:func:`read_row_group`).  Arrow's default pool on Linux, mimalloc,
    takes its memory in transparent huge pages and hands freed memory back
    to the kernel soon after: each row group decoded then faults in fresh
    2 MB pages for the kernel to zero.  Decoded into the C library's pool
    (``malloc``), they cost the kernel far less of that time, so they are
    decoded into it.  Not into jemalloc's: it starts
    background threads, and a process decoding into it under an
    address-space limit (``ulimit -v``, as some batch systems set) cannot
    create them and may abort (``std::bad_alloc``).  Where
    ``ARROW_DEFAULT_MEMORY_POOL`` is set, the user chose: ``None``,
    Arrow's default pool (a pool set in code, ``pyarrow.set_memory_pool``,
    is not seen).

    A row group written to a local file piece by piece
    (:meth:`RowGroupFile.write_local_form`) stays in Arrow's default pool:
    each piece is freed before the next is decoded, so that pool reuses
    one piece's memory throughout.
    """
    if os.environ.get('ARROW_DEFAULT_MEMORY_POOL'):
        return None
    return pyarrow.system_memory_pool()


def return_freed_memory_at_once() -> None:
    """Makes jemalloc (Arrow's default allocator) release freed pages at once.

    By default it keeps them about a second, which, with several row groups
    decoded one after the other, holds several row groups' worth of memory.
    Called in the process that stages row groups (see
    :meth:`~chainer_prefetch.datasets.ParquetDataset.with_file_locations`).
    """
    try:
        pyarrow.jemalloc_set_decay_ms(0)
    except (NotImplementedError, pyarrow.ArrowException):
        pass  # Arrow built without jemalloc


class DecodedRowGroup:
    """A row group's table, with the per-row converters and the columns made on first use.

    Shared by threads: what each makes on first use is the same, so a race
    only makes it twice.

    Args:
        table: The row group's rows.
        schema: The fields of its columns (default: the table's).
    """

    def __init__(self, table: pyarrow.Table,
                 schema: Optional[pyarrow.Schema] = None):
        self.table = table
        self._schema = table.schema if schema is None else schema
        self._row_columns = {}
        self._stored = None

    def value(self, name: str, row: int):
        """One value, as a row read gives it."""
        found = self._row_columns.get(name)
        if found is None:
            found = self._row_columns[name] = (
                self.table.column(name),
                value_converter(self._schema.field(name).type))
        column, convert = found
        return convert(column, row)

    def columns(self, names: Sequence[str]) -> StoredColumns:
        """The columns ``names`` to take rows from (the same names every call)."""
        if self._stored is None:
            self._stored = StoredColumns(self.table, names)
        return self._stored


def read_ipc_file(path: str) -> pyarrow.Table:
    """Memory-maps a row group's local IPC file: no copy, no decompression.

    Args:
        path: The file :meth:`RowGroupFile.write_local_form` wrote.

    Raises:
        FileNotFoundError: the file is gone (its ``filename`` is ``path``).
        ParquetFileError: it cannot be read.
    """
    try:
        return pyarrow.ipc.open_file(pyarrow.memory_map(path)).read_all()
    except FileNotFoundError as error:
        raise FileNotFoundError(errno.ENOENT, 'local row group gone: {}'
                                .format(error), path) from error
    except (OSError, pyarrow.ArrowException) as error:
        raise ParquetFileError('cannot read local row group {}: {}'.format(
            path, error)) from error


def row_group_label(path: str, row_group: int) -> str:
    """How messages name a row group: ``<file> (row group <index>)``."""
    return '{} (row group {})'.format(path, row_group)


def _row_group_error(row_group: int, path: str, error: Exception,
                     metadata=None) -> ParquetFileError:
    """The error for a row group that cannot be read.

    Args:
        row_group, path: Which row group of which file.
        error: What reading or decoding it raised.
        metadata: The footer it was read with, if one read earlier (by the
            dataset): when the file now has another footer, the message
            says that the file changed since, the likely cause.
    """
    changed = ''
    if metadata is not None and _footer_changed(path, metadata):
        changed = ('; the file was rewritten after the dataset read its '
                   'footer: make the dataset again')
    return ParquetFileError('cannot read row group {} of {}: {}{}'.format(
        row_group, path, error, changed))


def _footer_changed(path: str, metadata) -> bool:
    """Whether ``path`` now has another footer than ``metadata`` (``False``: none readable)."""
    try:
        return not pyarrow.parquet.read_metadata(path).equals(metadata)
    except MemoryError:
        raise
    except READ_ERRORS:  # gone, unreadable or truncated: not known to be rewritten
        return False


def selected_chunks(metadata, row_group: int, columns: Sequence[str]):
    """The row group's metadata and those of its column chunks of ``columns``.

    Args:
        metadata: The file's footer (``FileMetaData``).
        row_group: The row group's index in the file.
        columns: The selected columns (a nested column's chunks count under
            its top-level name).
    """
    group = metadata.row_group(row_group)
    wanted = set(columns)
    return group, [group.column(i) for i in range(group.num_columns)
                   if group.column(i).path_in_schema.split('.')[0] in wanted]


def read_metadata(path: str) -> pyarrow.parquet.FileMetaData:
    """The footer of the Parquet file ``path``.

    Raises:
        ParquetFileError: the file cannot be read or is not Parquet.
    """
    try:
        return pyarrow.parquet.read_metadata(path)
    except MemoryError:  # (Arrow's too) not the file's fault
        raise
    except READ_ERRORS as error:
        raise ParquetFileError('{} is not a readable Parquet file: {}'.format(
            path, error)) from error
