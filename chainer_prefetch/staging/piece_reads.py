"""Threads that read the pieces of several copies read ahead, first submitted first read.

Stage 2 reads a row group ahead in parallel pieces (see
:func:`chainer_prefetch.datasets.byte_ranges.start_reading_column_chunks`).  When
each row group's read starts its own threads and waits for all of them, the
storage idles twice per row group: while the last pieces finish on fewer
streams than it needs, and while the next file is opened and its first
requests wait their latency.  :class:`PieceReaders` keeps the threads, and
one queue per width (pieces read at once) for all the copies read ahead: a
thread that finishes a piece of one row group takes the next piece in its
queue, of the next row group if this one has none left, so the streams stay
busy from one row group to the next.  Each queue is first in, first out, so
the row group needed first is still read first: reading the next one at the
same time with an equal share would delay it.
"""
import concurrent.futures
import threading
from typing import Any, Callable, Dict, List, Sequence


class PendingReads:
    """The pieces of one copy's read ahead, read or waiting for a thread.

    Args:
        futures: One per piece, in the pieces' order.
        release: Called once, when every piece is read, failed or cancelled
            (it closes what the reads read through, such as a descriptor).
    """

    def __init__(self, futures: Sequence[concurrent.futures.Future],
                 release: Callable[[], None]):
        self._futures = list(futures)
        self._release = release
        self._lock = threading.Lock()
        self._left = len(self._futures)
        if not self._futures:
            release()
        for future in self._futures:
            future.add_done_callback(self._piece_done)

    def _piece_done(self, _future):
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._release()

    def wait(self) -> None:
        """Waits until every piece is read.

        Raises:
            Exception: what reading the first failing piece, in the pieces'
                order, raised (``concurrent.futures.CancelledError`` for a
                piece cancelled); the pieces not started are cancelled then.
        """
        try:
            for future in self._futures:
                future.result()
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Drops the pieces no thread has started; those being read finish."""
        for future in self._futures:
            future.cancel()


class PieceReaders:
    """Threads that read pieces of files, in the order submitted.

    One group of threads per width (how many pieces are read at once, as
    :func:`~chainer_prefetch.datasets.byte_ranges.read_threads_for` chooses it
    for the file's storage), started at its first piece.  :meth:`close`
    stops them all; a piece submitted after is refused.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._pools: Dict[int, concurrent.futures.ThreadPoolExecutor] = {}
        self._closed = False

    def submit(self, read_piece: Callable[[Any], None], pieces: Sequence[Any],
               threads: int, release: Callable[[], None]) -> PendingReads:
        """Queues ``read_piece(piece)`` for each piece, behind every piece queued before.

        Args:
            read_piece: Reads one piece (it releases the GIL while it waits).
            pieces: The pieces of one copy, in the order to read them.
            threads: How many pieces of this width are read at once.
            release: Called once when every piece is done (see
                :class:`PendingReads`), also when the submission is refused.

        Returns:
            The pending reads.

        Raises:
            RuntimeError: the readers are closed.
        """
        futures: List[concurrent.futures.Future] = []
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError('the piece readers are closed')
                pool = self._pools.get(threads)
                if pool is None:
                    pool = self._pools[threads] = (
                        concurrent.futures.ThreadPoolExecutor(
                            threads, thread_name_prefix='chainer_prefetch-'
                            'read-{}'.format(threads)))
                for piece in pieces:
                    futures.append(pool.submit(read_piece, piece))
        except BaseException:  # released once the pieces queued are done
            PendingReads(futures, release).cancel()
            raise
        return PendingReads(futures, release)

    def close(self, wait: bool = True) -> None:
        """Cancels the pieces not started and refuses new ones; idempotent.

        Args:
            wait: Whether to wait for the pieces being read, until every
                thread has ended (``False`` returns at once; a later call
                with ``True`` waits).
        """
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
        for pool in pools:
            pool.shutdown(wait=wait, cancel_futures=True)
