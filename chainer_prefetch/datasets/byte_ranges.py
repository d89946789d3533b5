"""A Parquet file's column chunks read into the page cache, in parallel pieces.

Decoding a row group needs the bytes of its selected column chunks.  They
are read here before Arrow decodes them, so that the read can run ahead of
the decoding (stage 2 reads one row group while it decodes the one before)
and so that the storage serves several requests at once:

* :func:`chunk_ranges`: the byte ranges of the chunks, neighbours merged;
* :func:`pieces_to_read`: each range cut into pieces read at once, as many
  as :func:`read_threads_for` chooses for the file's storage;
* :func:`start_reading_column_chunks`: the file memory-mapped and its
  pieces faulted into the mapping (``madvise(MADV_POPULATE_READ)`` through
  the C library), read on threads of this call (:func:`map_in_threads`) or
  queued on stage 2's :class:`~chainer_prefetch.staging.piece_reads.PieceReaders`.

Arrow then decodes the row group from the mapping
(:mod:`chainer_prefetch.datasets.row_group_source`), without copying the
chunks into a buffer of its own.
"""
import concurrent.futures
import ctypes
import errno
import functools
import mmap
import os
from typing import Any, Callable, List, Optional, Sequence, Tuple

import pyarrow

from chainer_prefetch.staging.file_systems import on_node_local_storage, read_mounts
from chainer_prefetch.staging.piece_reads import PendingReads, PieceReaders

#: Reads of a row group's bytes go in pieces of at least this many bytes...
READ_PIECE_BYTES = 4 << 20
#: ... at most this many at a time from shared storage (or storage of an
#: unknown kind), where each stream waits its latency ...
READ_THREADS = 8
#: ... and this many from a node-local file system (see
#: :mod:`chainer_prefetch.staging.file_systems`), which serves one or two
#: streams best: more streams only make the disk seek, and faulting pages
#: in on more threads at once costs the kernel more.  Row groups are read
#: ahead in the training process (stage 2): set it there.
LOCAL_READ_THREADS = 2
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


def _chunk_start(chunk) -> int:
    """Where a column chunk starts in its file (its dictionary page, if any)."""
    if chunk.has_dictionary_page and chunk.dictionary_page_offset:
        return min(chunk.dictionary_page_offset, chunk.data_page_offset)
    return chunk.data_page_offset


def map_column_chunks(path: str, chunks, opened: Optional[int] = None
                      ) -> Tuple[Any, os.stat_result]:
    """``path`` with ``chunks`` read into the page cache, as Arrow should read it.

    :func:`start_reading_column_chunks`, waiting for the read.

    Args:
        path, chunks, opened: As for that function.

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
    from it reads the page cache in place, where reading the chunks into a
    buffer of the process first would copy every byte once more.  Where the
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
    several pieces at once hides that latency.  A node-local disk reads
    best in one or two streams: there, fewer pieces are read at once
    (:func:`read_threads_for`).

    With the file ``mapped``, each piece's pages are faulted into the
    mapping (``madvise(MADV_POPULATE_READ)``, Linux 5.14): the kernel reads
    them into the page cache and maps them, and nothing is copied.  Reading
    them instead copies every byte into a buffer, and decoding from the
    mapping then faults each page in once more.  Faulting pieces in on
    several threads at once costs the kernel more than on one, another
    reason for few threads on a local disk.  Pages in the page cache
    already are only mapped.  The pages faulted in count in the process's
    RSS and PSS from then on (shared, clean page cache: the kernel can drop
    them), not only once decoding touches them: the row groups read ahead
    add their compressed size.  Without a mapping, or where faulting fails,
    each thread reads its pieces into a small scratch buffer that it reuses.

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
