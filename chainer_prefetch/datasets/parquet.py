"""A Chainer dataset over Parquet files, read lazily row group by row group.

Example::

    dataset = ParquetDataset('/shared/shopping/', columns=['title', 'image',
                                                         'category'],
                             transform=decode)
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=4)
    iterator = PrefetchMultiprocessIterator(
        dataset, 100, n_processes=2, order_sampler=sampler,
        local_dir='/local/ssd/shopping')

Rows are numbered file after file (files in sorted path order), row group
after row group.  Only the footers are read up front (length, schema, row
groups); rows are read a row group at a time when an example needs them, and
each process (each loader thread) keeps at most ``cache_row_groups`` row
groups (none of those the iterator keeps in memory, ``local_dir=':memory:'``,
which its loader threads share).

**Staged through** :class:`~chainer_prefetch.PrefetchMultiprocessIterator`,
example ``i`` names one *derived file* (see
:mod:`chainer_prefetch.staging.sources`): the row group that holds it, with
the selected columns, as an uncompressed Arrow IPC file.  Stage 2 reads each
row group from shared storage once, decodes it once and writes the IPC file
into the local directory; the worker processes memory-map it, so they share
one copy in the page cache and decompress nothing.  The rows of a row group
are one item of the local store (``example_file_groups``): it is staged and
evicted as one, and the iterator's ``local_capacity`` bounds the local files
like any others (the budget is reserved from the row group's uncompressed
size in the footer and settled with the real size).

With any other iterator (e.g. Chainer's ``MultiprocessIterator``) each process
reads the Parquet files directly, with its own bounded cache.
"""
import bisect
import collections
import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import glob
import hashlib
import itertools
import mmap
import os
import threading
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import numpy
import pyarrow
import pyarrow.ipc
import pyarrow.parquet
from chainer.dataset import DatasetMixin

from chainer_prefetch.columnar import ColumnarBatch, VarColumn, split_by_group
from chainer_prefetch.datasets.arrow_columns import (
    StoredColumns,
    arrow_indices,
    column_of_array,
    is_number_type,
    number_dtype,
)
from chainer_prefetch.datasets.partitions import (
    Partitions,
    base_directory,
    discover_partitions,
)
from chainer_prefetch.errors import (
    ParquetColumnError,
    ParquetFileError,
    ParquetSchemaError,
    example_load_error,
)
from chainer_prefetch.staging.file_systems import on_node_local_storage, read_mounts
from chainer_prefetch.staging.piece_reads import PendingReads, PieceReaders
from chainer_prefetch.staging.sources import DerivedFile, ReadAhead

Paths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


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
            metadata = self._metadata = _read_metadata(self.origin)
        return _selected_chunks(metadata, self.row_group, self.columns)

    def decoded_bytes(self) -> int:
        """The selected columns' uncompressed size, as the footer gives it."""
        _, chunks = self._column_chunks()
        return sum(chunk.total_uncompressed_size for chunk in chunks)

    def estimated_local_bytes(self, origin_stat) -> int:
        """:meth:`decoded_bytes` plus :data:`DECODED_MARGIN` of it and room for the IPC framing.

        Arrow takes a little more than the footer's uncompressed size
        (dictionary-encoded strings come out whole; 0.11% more in the
        benchmark's row groups): with the margin, ``local_capacity`` of N
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
        record batch.  Decoding the row group whole takes its decoded size
        (117 MB in the benchmark) of new memory, which Arrow's allocator hands
        back to the kernel soon after it is freed, so that every row group's
        memory is faulted in and zeroed afresh: 0.1-0.8 s of CPU a row group
        here, against about 0.07 s when each piece reuses the memory of the
        one before (:class:`~chainer_prefetch.datasets.arrow_columns.StoredColumns`
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
        (``local_dir=':memory:'``), without writing each row group to a
        local file (which took more CPU than decoding it, on the
        benchmark's machine).  It comes as a :class:`DecodedRowGroup`,
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
    for each buffer it writes (about twenty for each piece of a row group),
    and waits for it while other threads of the process (loader threads)
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
#: sizes: about 950 rows in the benchmark (pieces of 1,024 rows, 9 MB, were
#: as fast as 256 and 2,048 rows, and 4,096 rows slower).
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
    parallel pieces (see :func:`_piece_reader`) unless ``mapped``
    has them; Arrow then decodes them from a memory map of the file, without
    copying them into a buffer of its own.

    Args:
        path: The Parquet file.
        row_group: Index of the row group.
        columns: Columns to read.
        metadata: The file's ``FileMetaData`` if known (saves reading the
            footer again).
        mapped: The file with the chunks already read, as
            :func:`_map_column_chunks` returns it (``None``: read them here).

    Raises:
        ParquetFileError: the file cannot be read or is corrupt.
    """
    try:
        footer = _read_metadata(path) if metadata is None else metadata
        if mapped is None:
            _, chunks = _selected_chunks(footer, row_group, columns)
            mapped, _ = _map_column_chunks(path, chunks)
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
    2 MB pages for the kernel to zero.  On the benchmark's machine (a
    virtual machine) that took 1.5-1.7 s of kernel time in runs of 1,000
    batches at 48-53 thousand rows/s, against 0.4-0.7 s and 111-133
    thousand rows/s with the row groups decoded into the C library's pool
    or jemalloc's (``docs/parquet_measurements.rst``, "The memory row
    groups are decoded into").  So they are decoded into the C library's
    (``malloc``).  Not jemalloc's: it starts background threads, and a
    process decoding into it under an address-space limit (``ulimit -v``,
    as some batch systems set) printed that it could not create them and,
    in two of six runs of a test, aborted (``std::bad_alloc``).  Where
    ``ARROW_DEFAULT_MEMORY_POOL`` is set, the user chose: ``None``,
    Arrow's default pool (a pool set in code, ``pyarrow.set_memory_pool``,
    is not seen).

    A row group written to a local file piece by piece
    (:meth:`RowGroupFile.write_local_form`) stays in Arrow's default pool:
    each piece is freed before the next is decoded, and decoding them
    into jemalloc's pool gave loader threads 0.87x and 0.98x the rows/s at
    2 workers, 0.75x and 0.83x at 4 (two interleaved comparisons).
    """
    if os.environ.get('ARROW_DEFAULT_MEMORY_POOL'):
        return None
    return pyarrow.system_memory_pool()


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


def _selected_chunks(metadata, row_group: int, columns: Sequence[str]):
    """The row group's metadata and those of its column chunks of ``columns``."""
    group = metadata.row_group(row_group)
    wanted = set(columns)
    return group, [group.column(i) for i in range(group.num_columns)
                   if group.column(i).path_in_schema.split('.')[0] in wanted]


#: Reads of a row group's bytes go in pieces of at least this many bytes...
READ_PIECE_BYTES = 4 << 20
#: ... at most this many at a time from shared storage (or storage of an
#: unknown kind), where each stream waits its latency ...
READ_THREADS = 8
#: ... and this many from a node-local file system (see
#: :mod:`chainer_prefetch.staging.file_systems`), where more streams only
#: make the disk seek: on the benchmark's local disk, 9 row groups were
#: read ahead in 0.68 s with 8 threads, 0.57 s with 2 and 0.50 s with one
#: (``results/parquet/read_threads``), and the pipeline ran about as fast
#: with 1 thread as with 2, and 1.03-1.18x faster than with 8
#: (``local_read_threads``, ``local_read_threads_1_2``).  Set in the
#: training process, which reads row groups ahead (stage 2).
LOCAL_READ_THREADS = 2
#: The footers of a dataset's files are read this many at a time: on
#: shared storage each read waits its latency (8 files through the emulated
#: shared storage, measured once: 0.20 s one after the other, 0.03 s so).
FOOTER_THREADS = 16
#: Selected column chunks closer than this are read as one range (the
#: bytes between them too: one request instead of two).
MERGE_GAP_BYTES = 1 << 20
#: Arrow reads up to this many bytes past a column chunk (files of old
#: parquet-mr writers misstate chunk sizes), so each range covers them.
CHUNK_PADDING_BYTES = 100
#: Bytes each reading thread reads at a time into its scratch buffer.
_SCRATCH_BYTES = 1 << 20


def chunk_ranges(chunks, size: int) -> List[Tuple[int, int]]:
    """The byte ranges to read for ``chunks`` (column chunk metadata) of a file.

    Args:
        chunks: Column chunk metadata of the chunks wanted.
        size: The file's size (a range reaches at most this far past its
            chunk's end, by ``CHUNK_PADDING_BYTES``).

    Returns:
        ``(start, end)`` pairs, sorted; chunks closer than
        ``MERGE_GAP_BYTES`` share one.
    """
    spans = []
    for chunk in chunks:
        start = _chunk_start(chunk)
        end = start + chunk.total_compressed_size  # a file cut short: EIO
        spans.append((start, max(end, min(size, end + CHUNK_PADDING_BYTES))))
    spans.sort()
    merged: List[Tuple[int, int]] = []
    for start, end in spans:
        if merged and start - merged[-1][1] < MERGE_GAP_BYTES:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _map_column_chunks(path: str, chunks, opened: Optional[int] = None
                       ) -> Tuple[Any, os.stat_result]:
    """``path`` with ``chunks`` read into the page cache, as Arrow should read it.

    :func:`start_reading_column_chunks`, waiting for the read.

    Returns:
        ``(mapped, stat)``, as that function returns them.

    Raises:
        OSError: the file cannot be read, or ends inside a chunk.
    """
    mapped, origin_stat, _ = start_reading_column_chunks(path, chunks, opened)
    return mapped, origin_stat


def start_reading_column_chunks(path: str, chunks, opened: Optional[int] = None,
                                readers: Optional[PieceReaders] = None
                                ) -> Tuple[Any, os.stat_result,
                                           Optional[PendingReads]]:
    """``path`` mapped, with ``chunks`` read into the page cache or being read.

    ``mapped`` is a private, read-only memory map of the file: decoding
    from it reads the page cache in place, with no copy into a buffer of
    the process (measured on a 117 MB row group: 0.08 s of CPU to read and
    decode, against 0.17 s reading it into a new buffer first).  Where the
    file cannot be mapped (a FUSE mount with ``direct_io``, a limit on
    address space), it is the path: Arrow then reads the file itself.
    A file truncated on shared storage while it is decoded ends the process
    with ``SIGBUS``, as for any memory-mapped file; a file already shorter
    than its footer says is an ``OSError`` when it is read.

    Args:
        path: The Parquet file.
        chunks: Metadata of the column chunks to read.
        opened: A descriptor of ``path``, open, to read through (duplicated:
            the caller keeps it); ``None`` opens ``path``.
        readers: Threads to read the pieces on, behind those of the row
            groups read ahead before (stage 2's); ``None`` reads them now.

    Returns:
        ``(mapped, stat, pending)``: ``stat`` is the opened file's;
        ``pending`` is ``None`` when the chunks were read here, else the
        reads queued on ``readers``: ``pending.wait()`` before decoding.

    Raises:
        OSError: the file cannot be read, or ends inside a chunk (with
            ``readers``, ``pending.wait()`` raises the read's errors).
        RuntimeError: ``readers`` are closed.
    """
    fd = os.open(path, os.O_RDONLY) if opened is None else os.dup(opened)
    try:
        origin_stat = os.fstat(fd)
        ranges = chunk_ranges(chunks, origin_stat.st_size)
        try:
            mapped = pyarrow.py_buffer(mmap.mmap(
                fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ))
        except (OSError, ValueError):
            mapped = None
        read_piece = _piece_reader(fd, path, mapped)
        threads = read_threads_for(path)
        pieces = pieces_to_read(ranges, threads)
    except BaseException:
        os.close(fd)
        raise
    pending = None
    if readers is None:
        try:
            map_in_threads(read_piece, pieces, threads, 'read')
        finally:
            os.close(fd)
    else:  # the descriptor is closed once the pieces are read
        pending = readers.submit(read_piece, pieces, threads,
                                 functools.partial(os.close, fd))
    return (path if mapped is None else mapped), origin_stat, pending


def _piece_reader(fd: int, path: str, mapped: Optional[pyarrow.Buffer] = None
                  ) -> Callable[[Tuple[int, int]], None]:
    """``read_piece((start, end))``, which reads those bytes of ``fd`` into the page cache.

    The pieces of a row group's chunks (:func:`pieces_to_read`) are read in
    parallel, several at once.

    Shared file systems (Lustre, GPFS, NFS, FUSE) serve one stream of reads
    far below their bandwidth: each request waits its latency.  Reading
    several pieces at once hides that latency (through the emulated shared
    storage: 0.9 s instead of 2.0 s for 88 MB with one stream, and 3.0-3.4 s
    for PyArrow's own reads of the same row group).  A node-local disk
    reads best in one or two streams: there, fewer pieces are read at once
    (:func:`read_threads_for`).

    With the file ``mapped``, each piece's pages are faulted into the
    mapping (``madvise(MADV_POPULATE_READ)``, Linux 5.14): the kernel reads
    them into the page cache and maps them, and nothing is copied.  Reading
    them instead copies every byte into a buffer, and decoding from the
    mapping then faults each page in once more.  For the 9 row groups of
    100,000 rows of the benchmark, from a cold local disk, that was 0.61x
    and 0.76x the kernel time, and 0.88x and 0.98x the wall time, in two
    runs of ``chainer_prefetch_bench.parquet.read_cost`` with 8 threads
    (medians of 15); in a later run (``results/parquet/read_threads``,
    medians of 5) 0.22x the kernel time and 0.67x the wall time with one
    thread, but 0.78x and 1.09x with 2 and 1.29x and 1.23x with 8: faulting
    pieces in on several threads at once costs the kernel more.  Through
    the emulated storage, 9.1-9.4 s either way (a script, twice
    each).  Pages in the page cache already are only mapped.  The pages
    faulted in count in the process's RSS and PSS from then on (shared,
    clean page cache: the kernel can drop them), not only once decoding
    touches them: the row groups read ahead add their compressed size.
    Without a mapping, or where faulting fails, each thread reads its pieces
    into a small scratch buffer that it reuses.

    Args:
        fd: The file, open for reading while pieces are read.
        path: The file's path, for errors.
        mapped: The whole file, memory-mapped, or ``None``.

    Returns:
        The function; it raises ``OSError`` when a read fails or the file
        ends inside the piece.
    """
    def read_piece(piece: Tuple[int, int]) -> None:
        at, end = piece
        if mapped is not None and end <= mapped.size and _populate(
                mapped, at, end):
            return
        scratch = memoryview(bytearray(min(_SCRATCH_BYTES, end - at)))
        while at < end:
            got = os.preadv(fd, [scratch[:end - at]], at)
            if got == 0:
                raise OSError(errno.EIO, 'file ends at {} bytes, inside a '
                              'column chunk (up to {})'.format(at, end), path)
            at += got

    return read_piece


@functools.lru_cache(maxsize=1024)
def _directory_is_node_local(directory: str) -> bool:
    return on_node_local_storage(directory, read_mounts())


def read_threads_for(path: str) -> int:
    """How many threads read a row group of the file ``path`` at once.

    :data:`LOCAL_READ_THREADS` where the file (symbolic links followed)
    is on a node-local file system, :data:`READ_THREADS` elsewhere.  The
    answer is kept per directory in each process: a file system mounted
    over a directory after its first read is not seen.

    Args:
        path: A Parquet file.
    """
    if _directory_is_node_local(os.path.dirname(os.path.realpath(path))):
        return LOCAL_READ_THREADS
    return READ_THREADS


def pieces_to_read(ranges: Sequence[Tuple[int, int]], threads: int
                   ) -> List[Tuple[int, int]]:
    """The pieces of ``ranges`` read at once (see :func:`_piece_reader`).

    Each range is cut into up to ``threads`` pieces of at least
    :data:`READ_PIECE_BYTES` (a shorter range is one piece).

    Args:
        ranges: ``(start, end)`` byte ranges of a file.
        threads: The threads that read them (:func:`read_threads_for`).

    Returns:
        ``(start, end)`` of each piece, in the ranges' order.
    """
    pieces = []
    for start, end in ranges:
        count = max(1, min(threads, (end - start) // READ_PIECE_BYTES))
        bounds = [start + (end - start) * k // count for k in range(count + 1)]
        pieces += zip(bounds, bounds[1:])
    return pieces


#: ``madvise`` advice: fault pages in for reading (Linux 5.14).
_MADV_POPULATE_READ = 22


def _populate(mapped: pyarrow.Buffer, start: int, end: int) -> bool:
    """Faults bytes ``start`` to ``end`` of a memory-mapped file in; whether it worked.

    It fails on kernels before 5.14 and where a page cannot be read (an I/O
    error, a file cut short): the caller then reads the bytes, which names
    the error.  ``ctypes`` gives the GIL up for the call.

    Args:
        mapped: The whole file, memory-mapped.
        start: The first byte.
        end: The byte after the last.
    """
    first = start - start % mmap.PAGESIZE
    return _libc().madvise(ctypes.c_void_p(mapped.address + first),
                           ctypes.c_size_t(end - first),
                           _MADV_POPULATE_READ) == 0


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def map_in_threads(function: Callable[[Any], Any], items: Sequence[Any],
                   max_threads: int, name: str) -> List[Any]:
    """``[function(item) for item in items]``, run by up to ``max_threads`` threads.

    For reads that wait on storage (they release the GIL).  Results are
    collected in the items' order; the first item in that order whose call
    failed has its error raised, once the calls before it are done.  Then,
    or on an interrupt, the items not started are dropped and those
    running are waited for: no thread outlives the call.

    Args:
        function: Called once per item.
        items: The items.
        max_threads: Most threads to run at once (one item: none started).
        name: Part of the threads' names (``chainer_prefetch-<name>_<i>``).

    Returns:
        ``function(item)`` for each item, in order.

    Raises:
        Exception: what ``function`` raised for the first failing item.
    """
    if len(items) <= 1:
        return [function(item) for item in items]
    pool = concurrent.futures.ThreadPoolExecutor(
        min(max_threads, len(items)), thread_name_prefix='chainer_prefetch-'
        + name)
    try:
        return list(pool.map(function, items))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _chunk_start(chunk) -> int:
    """Where a column chunk starts in its file (its dictionary page, if any)."""
    if chunk.has_dictionary_page and chunk.dictionary_page_offset:
        return min(chunk.dictionary_page_offset, chunk.data_page_offset)
    return chunk.data_page_offset


def find_parquet_files(paths: Paths) -> List[str]:
    """The Parquet files named by ``paths``, sorted.

    Args:
        paths: A file, a directory (searched recursively, as Spark and Hive
            write partitioned output: ``key=value/part-*.parquet``), a glob
            pattern, or a list of these.  In directories, names starting with
            ``_`` or ``.`` (``_SUCCESS``, ``.crc`` files) are skipped.

    Returns:
        Absolute paths, sorted, without duplicates.

    Raises:
        ParquetFileError: a path names nothing.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found = set()
    for path in map(os.fspath, paths):
        if os.path.isdir(path):
            found.update(_files_under(path))
        elif os.path.exists(path):
            found.add(os.path.abspath(path))
        else:
            matches = glob.glob(path, recursive=True)
            if not matches:
                raise ParquetFileError('no such Parquet file or directory: '
                                       '{}'.format(path))
            found.update(os.path.abspath(match) for match in matches
                         if os.path.isfile(match))
    return sorted(found)


def _files_under(directory: str) -> Iterable[str]:
    for parent, subdirectories, names in os.walk(directory):
        subdirectories[:] = [name for name in subdirectories
                             if not name.startswith(('_', '.'))]
        for name in names:
            if not name.startswith(('_', '.')):
                yield os.path.abspath(os.path.join(parent, name))


class ParquetDataset(DatasetMixin):
    """Rows of Parquet files as examples, read row by row or a batch at a time.

    Args:
        paths: Files, directories or glob patterns (see
            :func:`find_parquet_files`).
        columns: Columns to read, in this order; ``None`` for all (the
            files' columns, then the partition columns).  Only these must
            have the same type in every file (all of them with ``None``).
        as_tuple: Return each example as a tuple in ``columns`` order instead
            of a dict.
        transform: Applied to each example (dict or tuple) before it is
            returned, in the loaders (decode image bytes, map a label
            to an index, augment).  Must be picklable for ``forkserver``.
        cache_row_groups: Decoded row groups each process (each thread)
            keeps (not counting those kept in memory by the iterator's
            local store, ``local_dir=':memory:'``).  Reading
            directly from the Parquet files with the
            :class:`~chainer_prefetch.datasets.RowGroupWindowOrderSampler`,
            use at least its ``window``: a smaller cache re-reads row groups.
        batch_transform: Applied to the rows of a batch at once, as a
            :class:`~chainer_prefetch.columnar.ColumnarBatch`, after
            ``transform``: returns a ``ColumnarBatch``, or a dict (or tuple)
            of columns, with one entry per row, row ``i`` depending on input
            row ``i`` only (the iterator may split a batch).  A single
            example (``dataset[i]``) goes through it as a batch of one.
        partitioning: ``'hive'`` (default) reads ``key=value`` directories
            as columns (see :mod:`chainer_prefetch.datasets.partitions`);
            ``None`` ignores them.
        partition_types: Arrow types of partition columns, by name, instead
            of inferring them.
        partition_base: The directory below which ``key=value`` directories
            become columns (Spark's ``basePath``).  By default ``paths``
            itself when it is one directory, else the deepest directory
            that holds every file found: give it when a glob or a list of
            files may all lie in one partition (``root/year=2024/*``), so
            that ``year`` stays a column.

    ``get_columns(indices)`` reads many rows at once as columns (vectorised
    takes from each row group); :class:`~chainer_prefetch.PrefetchMultiprocessIterator`
    uses it to load whole batches.  Staged by that iterator, the local
    row-group files are bounded by its ``local_capacity`` (without it they
    grow to the decoded size of the dataset).

    Raises:
        ParquetFileError: a file is missing, truncated or corrupt.
        ParquetSchemaError: two files differ in a selected column (in any
            column without ``columns``) or in their partition directories,
            or a partition column has a file column's name.
        ParquetColumnError: a requested column does not exist.
    """

    def __init__(self, paths: Paths, columns: Optional[Sequence[str]] = None,
                 as_tuple: bool = False,
                 transform: Optional[Callable[[Any], Any]] = None,
                 cache_row_groups: int = 4,
                 batch_transform: Optional[Callable[[ColumnarBatch], Any]] = None,
                 partitioning: Optional[str] = 'hive',
                 partition_types: Optional[Dict[str, pyarrow.DataType]] = None,
                 partition_base: Optional[Union[str, os.PathLike]] = None):
        self.files = find_parquet_files(paths)
        if not self.files:
            raise ParquetFileError('no Parquet files in {}'.format(paths))
        if partitioning not in ('hive', None):
            raise ValueError("partitioning must be 'hive' or None, got {!r}"
                             .format(partitioning))
        if partition_base is not None and partitioning is None:
            raise ValueError('partition_base is given but partitioning is None')
        if isinstance(columns, str):  # one column
            columns = [columns]
        self._metadata = map_in_threads(_read_metadata, self.files,
                                        FOOTER_THREADS, 'footer')
        self.file_schema = _common_schema(self.files, self._metadata, columns)
        self.partitions = (discover_partitions(
            self.files, base_directory(paths, self.files, partition_base),
            partition_types) if partitioning else Partitions((), (), []))
        clashing = set(self.partitions.names) & set(self.file_schema.names)
        if clashing:
            raise ParquetSchemaError(
                'partition column {} is also a column of the files (e.g. {})'
                .format(', '.join(sorted(clashing)), self.files[0]))
        self.schema = pyarrow.schema(list(self.file_schema) +
                                     self.partitions.fields())
        self.columns = _check_columns(self.schema, columns)
        self._file_columns = tuple(name for name in self.columns
                                   if name not in self.partitions.names)
        self.as_tuple = as_tuple
        self.transform = transform
        self.batch_transform = batch_transform
        self.cache_row_groups = max(1, int(cache_row_groups))
        self.row_group_locations: List[Tuple[int, int]] = [
            (file_index, group)
            for file_index, metadata in enumerate(self._metadata)
            for group in range(metadata.num_row_groups)]
        sizes = [self._metadata[file_index].row_group(group).num_rows
                 for file_index, group in self.row_group_locations]
        self._set_row_groups(list(range(len(sizes))), sizes, sizes)
        self._locate: Optional[Callable[[RowGroupFile], Union[str, 'DecodedRowGroup']]] = None
        self._caches = threading.local()

    def _set_row_groups(self, groups: List[int], sizes: Sequence[int],
                        stored: Sequence[int]):
        """Which row groups the examples come from, and how many rows each gives.

        A row group giving more rows than it holds (``sizes[k] > stored[k]``)
        repeats its rows from the first (see :meth:`row_group_view`).
        """
        self.row_groups = numpy.asarray(groups, dtype=numpy.int64)
        self.row_group_sizes = numpy.asarray(sizes, dtype=numpy.int64)
        self._stored_sizes = numpy.asarray(stored, dtype=numpy.int64)
        self._row_group_ends = numpy.cumsum(self.row_group_sizes)
        self._row_group_starts = self._row_group_ends - self.row_group_sizes
        self._row_group_files = {}

    @property
    def column_types(self) -> Dict[str, pyarrow.DataType]:
        """The Arrow type of each selected column."""
        return {name: self.schema.field(name).type for name in self.columns}

    def __len__(self) -> int:
        return int(self._row_group_ends[-1]) if len(self._row_group_ends) else 0

    def row_group_of(self, index: int) -> Tuple[int, int]:
        """The row group holding example ``index`` and the row within it.

        The row group is numbered among this dataset's row groups (those of
        :attr:`row_groups`).

        Raises:
            IndexError: ``index`` is out of range.
        """
        groups, rows = self._locate_rows(numpy.asarray([index]))
        return int(groups[0]), int(rows[0])

    def _locate_rows(self, indices: numpy.ndarray):
        """Row group and row within it of each index, vectorised."""
        indices = numpy.asarray(indices, dtype=numpy.int64)
        size = len(self)
        bad = (indices < 0) | (indices >= size)
        if bad.any():
            raise IndexError('index {} out of range for {} rows'.format(
                int(indices[bad][0]), size))
        groups = _groups_of(self._row_group_ends, indices)
        rows = (indices - self._row_group_starts[groups]) % numpy.maximum(
            self._stored_sizes[groups], 1)
        return groups, rows

    def get_example(self, index: int):
        """Example ``index``: a dict (or tuple) of the selected columns, transformed."""
        if self.batch_transform is not None:
            return self.get_columns([index])[0]
        group, row = self.row_group_of(int(index))
        entry = self._row_group_entry(group)
        file_index = self.row_group_locations[self.row_groups[group]][0]
        values = [self.partitions.value(file_index, name)
                  if name in self.partitions.names else entry.value(name, row)
                  for name in self.columns]
        example = tuple(values) if self.as_tuple else dict(
            zip(self.columns, values))
        if self.transform is not None:
            example = self.transform(example)
        return example

    def get_columns(self, indices: Sequence[int]) -> ColumnarBatch:
        """Rows ``indices``, in that order, as columns: one vectorised take per row group.

        Each row group is read (or memory-mapped, when staged) once per
        process and cached like the rows of :meth:`get_example`; the rows are
        copied out of it by
        :class:`~chainer_prefetch.datasets.arrow_columns.StoredColumns` (rows
        of several row groups are then put in the order asked, one more
        copy).  ``transform`` (per row) and
        ``batch_transform`` apply as for single examples, so ``batch[i]``
        equals ``dataset[indices[i]]``.

        Args:
            indices: Example indices (any order, repeats allowed).

        Returns:
            A :class:`~chainer_prefetch.columnar.ColumnarBatch` of
            ``len(indices)`` rows.

        Raises:
            IndexError: an index is out of range.
            ParquetFileError: a row group cannot be read (the message names
                the file and row group; ``error.index`` is an example in it).
            Exception: what ``transform`` raised, as an
                :class:`~chainer_prefetch.ExampleLoadError` of the same type
                naming the example; what ``batch_transform`` raised, naming
                the batch's examples.
        """
        indices = numpy.asarray(indices, dtype=numpy.int64).reshape(-1)
        if len(indices) == 0:
            raise ValueError('get_columns needs at least one index')
        groups, rows = self._locate_rows(indices)
        columns = self._take_rows(indices, groups, rows)
        columns.update(self._partition_columns(groups))
        form = 'tuple' if self.as_tuple else 'dict'
        batch = ColumnarBatch({name: columns[name] for name in self.columns},
                              form)
        if self.transform is not None:
            batch = self._transform_rows(batch, indices, groups)
        if self.batch_transform is not None:
            batch = self._transform_batch(batch, indices, groups)
        return batch

    def _take_rows(self, indices, groups, rows) -> Dict[str, Any]:
        """The file columns of rows ``rows`` of row groups ``groups``, in order."""
        segments, inverse = split_by_group(groups)
        parts = []
        for group, positions in segments:
            try:
                stored = self._row_group_entry(group).columns(self._file_columns)
            except OSError as error:
                error.index = int(indices[positions[0]])
                raise
            parts.append(stored.take(rows[positions]))
        if inverse is None:
            return parts[0]
        joined = ColumnarBatch.concatenate([ColumnarBatch(part) for part in parts])
        return dict(joined.take(inverse).columns)

    def _partition_columns(self, groups) -> Dict[str, Any]:
        selected = [(column, name) for column, name
                    in enumerate(self.partitions.names) if name in self.columns]
        if not selected:
            return {}
        columns = {}
        files = numpy.asarray([self.row_group_locations[group][0]
                               for group in self.row_groups])[groups]
        for column, name in selected:
            values = [self.partitions.values[file_index][column]
                      for file_index in range(len(self.files))]
            array = pyarrow.array(values, self.partitions.types[column])
            columns[name] = column_of_array(array.take(arrow_indices(files)))
        return columns

    def _transform_rows(self, batch, indices, groups) -> ColumnarBatch:
        examples = []
        for position in range(len(batch)):
            try:
                examples.append(self.transform(batch[position]))
            except Exception as error:
                index = int(indices[position])
                raise example_load_error(error, index, self._files_of(
                    groups[position:position + 1])) from error
        return ColumnarBatch.from_examples(examples)

    def _transform_batch(self, batch, indices, groups) -> ColumnarBatch:
        try:
            result = as_columnar_batch(self.batch_transform(batch), len(batch))
        except Exception as error:
            shown = ', '.join(str(int(index)) for index in indices[:8])
            where = ('batch_transform on {} examples ({}{})'.format(
                len(indices), shown, ', ...' if len(indices) > 8 else ''),)
            raise example_load_error(error, int(indices[0]), where + self._files_of(
                groups)) from error
        return result

    def _files_of(self, groups) -> Tuple[str, ...]:
        return tuple(row_group_label(
            self.files[self.row_group_locations[self.row_groups[group]][0]],
            self.row_group_locations[self.row_groups[group]][1])
            for group in sorted(set(int(group) for group in groups)))

    def row_group_view(self, groups: Sequence[int],
                       sizes: Optional[Sequence[int]] = None) -> 'ParquetDataset':
        """A dataset of some row groups of this one, each maybe padded.

        Args:
            groups: Row groups of this dataset (numbers among
                :attr:`row_groups`), in the order the view numbers its rows.
            sizes: Rows each gives (default: the rows it holds).  A size
                above that repeats its rows from the first, so that ranks
                get equally many examples with every row group read by
                one rank only.

        Returns:
            A ``ParquetDataset`` with the same columns and transforms.

        Raises:
            ValueError: a size is below the rows its row group holds.
        """
        groups = [int(group) for group in groups]
        stored = [int(self._stored_sizes[group]) for group in groups]
        sizes = stored if sizes is None else [int(size) for size in sizes]
        if len(sizes) != len(groups) or any(
                size < held or (held == 0 and size > 0)
                for size, held in zip(sizes, stored)):
            raise ValueError('sizes must not be below the rows of each row '
                             'group ({}), got {}'.format(stored, sizes))
        view = self._clone()
        view._set_row_groups([int(self.row_groups[group]) for group in groups],
                             sizes, stored)
        return view

    # ---- the staging protocol (chainer_prefetch.staging.dataset_files) ----

    def example_files(self, index: int) -> Tuple[RowGroupFile]:
        """The row group of example ``index`` as a derived file to stage."""
        group, _ = self.row_group_of(int(index))
        return (self._row_group_file(group),)

    def example_file_groups(self) -> numpy.ndarray:
        """For each example, its row group: the rows of one are staged as one item."""
        return numpy.repeat(numpy.arange(len(self.row_group_sizes)),
                            self.row_group_sizes)

    def with_file_locations(self, locate: Callable[[RowGroupFile], Union[str, 'DecodedRowGroup']]
                            ) -> 'ParquetDataset':
        """A view that reads each row group from ``locate(row_group_file)``.

        ``locate`` gives the local IPC file's path, or, when the local forms
        are kept in memory (``local_dir=':memory:'``), the
        :class:`DecodedRowGroup`.
        A local form that has gone (evicted by another process, or from
        memory) raises ``FileNotFoundError`` naming it; the iterator's loader
        then reads the row from the Parquet file and counts it as read from
        shared storage.

        Called in the process that stages (the training process), which from
        then on decodes row groups: Arrow's allocator there is told to give
        freed memory back at once (measured: the peak memory of the
        benchmark's loader processes fell from 1.4 to 0.9 GB).
        """
        _return_freed_memory_at_once()
        view = self._clone()
        view._locate = locate
        return view

    # ---- reading ---------------------------------------------------------

    def _row_group_file(self, group: int) -> RowGroupFile:
        derived = self._row_group_files.get(group)
        if derived is None:
            file_index, group_in_file = self.row_group_locations[
                self.row_groups[group]]
            derived = RowGroupFile(self.files[file_index], group_in_file,
                                   self._file_columns, self._metadata[file_index])
            self._row_group_files[group] = derived
        return derived

    def _row_group_entry(self, group: int) -> 'DecodedRowGroup':
        """Row group ``group``: from this thread's cache, from the local store, or read.

        Each thread keeps its own ``cache_row_groups`` row groups, as each
        process does: loader threads working on different row groups do not
        evict each other's.  (Without staging, each loader thread therefore
        decodes the row groups it reads itself, as loader processes do.)
        A row group kept in memory by the local store
        (``local_dir=':memory:'``) is not cached here: every thread reads
        the store's, so that one evicted there is let go as soon as the
        loads reading it end.
        """
        cache = getattr(self._caches, 'row_groups', None)
        if cache is None:
            cache = self._caches.row_groups = collections.OrderedDict()
        cached = cache.get(group)
        if cached is not None:
            cache.move_to_end(group)
            return cached
        if self._locate is not None:
            local = self._locate(self._row_group_file(group))
            if isinstance(local, DecodedRowGroup):
                return local
            table = _read_ipc(local)
        else:
            file_index, group_in_file = self.row_group_locations[
                self.row_groups[group]]
            table = read_row_group(self.files[file_index], group_in_file,
                                   self._file_columns, self._metadata[file_index])
        cached = DecodedRowGroup(table, self.file_schema)
        cache[group] = cached
        while len(cache) > self.cache_row_groups:
            cache.popitem(last=False)
        return cached

    def _clone(self) -> 'ParquetDataset':
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view._caches = threading.local()
        view._row_group_files = {}
        return view

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop('_caches', None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._caches = threading.local()


def _groups_of(ends: numpy.ndarray, indices: numpy.ndarray) -> numpy.ndarray:
    """``numpy.searchsorted(ends, indices, side='right')``, keeping the GIL when it can.

    NumPy's ``searchsorted`` gives the GIL up however few the indices, and
    taking it back waits for the other threads of the process (loader
    threads) to give it up in turn.  When the indices all fall in one row
    group, as a batch of one row group does, two bisections in Python find
    it.

    Args:
        ends: The end of each row group (ascending).
        indices: Indices of rows, each less than ``ends[-1]``.
    """
    if len(indices):
        group = bisect.bisect_right(ends, int(indices.min()))
        if bisect.bisect_right(ends, int(indices.max())) == group:
            return numpy.full(len(indices), group, numpy.int64)
    return numpy.searchsorted(ends, indices, side='right')


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
                _converter(self._schema.field(name).type))
        column, convert = found
        return convert(column, row)

    def columns(self, names: Sequence[str]) -> StoredColumns:
        """The columns ``names`` to take rows from (the same names every call)."""
        if self._stored is None:
            self._stored = StoredColumns(self.table, names)
        return self._stored


def as_columnar_batch(result, rows: int) -> ColumnarBatch:
    """What a ``batch_transform`` returned, as a batch of ``rows`` rows.

    Args:
        result: A ``ColumnarBatch``, a dict of columns (arrays or
            ``VarColumn``), a tuple of them, or one array.
        rows: The rows it must have.

    Raises:
        TypeError: another kind of result.
        ValueError: a column of another length.
    """
    if isinstance(result, ColumnarBatch):
        batch = result
    elif isinstance(result, dict):
        batch = ColumnarBatch(result, 'dict')
    elif isinstance(result, tuple):
        batch = ColumnarBatch({str(i): column for i, column in enumerate(result)},
                              'tuple')
    elif isinstance(result, (numpy.ndarray, VarColumn)):
        batch = ColumnarBatch({'0': result}, 'single')
    else:
        raise TypeError('batch_transform must return a ColumnarBatch, a dict or '
                        'tuple of columns, or an array; got {}'.format(
                            type(result).__name__))
    if len(batch) != rows:
        raise ValueError('batch_transform returned {} rows for {}'.format(
            len(batch), rows))
    return batch


def _return_freed_memory_at_once() -> None:
    """Makes jemalloc (Arrow's default allocator) release freed pages at once.

    By default it keeps them about a second, which, with several row groups
    decoded one after the other, holds several row groups' worth of memory.
    """
    try:
        pyarrow.jemalloc_set_decay_ms(0)
    except (NotImplementedError, pyarrow.ArrowException):
        pass  # Arrow built without jemalloc


def _read_ipc(path: str) -> pyarrow.Table:
    """Memory-maps an Arrow IPC file: no copy, no decompression.

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


def _converter(data_type: pyarrow.DataType) -> Callable[[pyarrow.Array, int], Any]:
    """How to turn one value of a column into a Python/NumPy value.

    A number is a NumPy scalar of the column's dtype, so that Chainer's
    ``concat_examples`` stacks a ``float32`` column into a ``float32`` array
    (Python floats would make it ``float64``, which a ``float32`` link
    refuses), as the columnar path's arrays are.
    """
    if pyarrow.types.is_list(data_type) or pyarrow.types.is_large_list(
            data_type):
        return _list_as_array
    if is_number_type(data_type):
        return functools.partial(_number_as_numpy,
                                 scalar=number_dtype(data_type).type)
    return _as_python


def _list_as_array(column: pyarrow.Array, row: int):
    value = column[row]
    if not value.is_valid:
        return None
    return value.values.to_numpy(zero_copy_only=False)


def _as_python(column: pyarrow.Array, row: int):
    return column[row].as_py()


def _number_as_numpy(column: pyarrow.Array, row: int, scalar: type):
    value = column[row].as_py()
    return None if value is None else scalar(value)


def _read_metadata(path: str):
    try:
        return pyarrow.parquet.read_metadata(path)
    except MemoryError:  # (Arrow's too) not the file's fault
        raise
    except READ_ERRORS as error:
        raise ParquetFileError('{} is not a readable Parquet file: {}'.format(
            path, error)) from error


def _common_schema(files: List[str], metadata: List,
                   columns: Optional[Sequence[str]] = None) -> pyarrow.Schema:
    """The first file's schema, checked against every other file's.

    With ``columns`` given, only those of them that the first file has must
    be the same (name, type, nullability) in every file: files that a
    table's schema evolution gave more columns, or other types in columns
    not selected, are read alike.  Without, whole schemas must be equal.

    Args:
        files: The Parquet files.
        metadata: Their footers, in the same order.
        columns: The selected columns, or ``None`` for all.

    Raises:
        ParquetSchemaError: a file differs from the first (both named, with
            what each has).
    """
    schemas = [item.schema.to_arrow_schema().remove_metadata() for item in metadata]
    first = schemas[0]
    selected = (None if columns is None
                else [name for name in columns if name in first.names])
    for path, schema in zip(files[1:], schemas[1:]):
        if selected is None:
            if not schema.equals(first):
                raise ParquetSchemaError(
                    'schemas differ: {} has ({}) but {} has ({}); to read '
                    'the columns they share, select them with columns='
                    .format(files[0], _describe(first), path, _describe(schema)))
            continue
        differing = [name for name in selected if name not in schema.names
                     or not schema.field(name).equals(first.field(name))]
        if differing:
            raise ParquetSchemaError(
                'schemas differ in the columns selected: {} has ({}) but {} '
                'has ({})'.format(files[0], _describe(first, differing), path,
                                  _describe(schema, differing)))
    return first


def _describe(schema: pyarrow.Schema, names: Optional[Sequence[str]] = None) -> str:
    """``name: type`` of the fields ``names`` (default: all); ``missing`` for one it lacks."""
    described = []
    for name in (schema.names if names is None else names):
        if name not in schema.names:
            described.append('{}: missing'.format(name))
            continue
        field = schema.field(name)
        described.append('{}: {}{}'.format(name, field.type,
                                           '' if field.nullable else ' not null'))
    return ', '.join(described)


def _check_columns(schema: pyarrow.Schema,
                   columns: Optional[Sequence[str]]) -> Tuple[str, ...]:
    available = list(schema.names)
    if columns is None:
        return tuple(available)
    missing = [name for name in columns if name not in available]
    if missing:
        raise ParquetColumnError('no column {} in the Parquet files; available '
                                 'columns: {}'.format(', '.join(map(repr, missing)),
                                                      ', '.join(available)))
    return tuple(columns)
