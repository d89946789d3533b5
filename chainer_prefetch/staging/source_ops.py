"""What this package asks of shared storage, counted where it is asked.

On a parallel file system every ``stat`` and every ``open`` is a round trip
to the metadata server, shared by every node of every job.  Each such call
that the package makes on a source (a file of the dataset on shared
storage) goes through :func:`stat` or :func:`open_readonly`, which count it;
the opens of the dataset's own files that stage 3 sees (see
:mod:`chainer_prefetch.staging.open_watch`) are counted with
:func:`count`.

Counts go to the *tallies* open on the calling thread (:func:`tallied`),
so that a copy, a load or a constructor learns exactly what it asked, and
the iterator can report them per epoch (``stats['by_epoch']``).  Calls
made outside any tally are not counted.  What a C library opens by itself
(``cv2.imread``, pyarrow reading a Parquet file) is not seen.
"""
import collections
import contextlib
import os
import threading
from typing import Iterator

#: The counts, as they appear in ``iterator.stats``.
SOURCE_OPS = ('source_stats', 'source_opens')

_thread = threading.local()


def count(op: str, n: int = 1) -> None:
    """Adds ``n`` operations of kind ``op`` (one of :data:`SOURCE_OPS`) to the open tallies.

    Args:
        op: ``'source_stats'`` or ``'source_opens'``.
        n: How many.
    """
    for tally in getattr(_thread, 'tallies', ()):
        tally[op] += n


@contextlib.contextmanager
def tallied() -> Iterator[collections.Counter]:
    """Counts the operations this thread asks of shared storage inside the block.

    Tallies nest: an operation counts in every tally open on the thread.

    Yields:
        A ``collections.Counter`` keyed by :data:`SOURCE_OPS`, filled as the
        block runs.
    """
    tally = collections.Counter()
    tallies = getattr(_thread, 'tallies', None)
    if tallies is None:
        tallies = _thread.tallies = []
    tallies.append(tally)
    try:
        yield tally
    finally:
        tallies.remove(tally)


def stat(path: str) -> os.stat_result:
    """``os.stat(path)`` of a path on shared storage, counted.

    Args:
        path: A source file or one of its directories.

    Raises:
        OSError: As ``os.stat``.
    """
    count('source_stats')
    return os.stat(path)


def open_readonly(path: str) -> int:
    """``os.open(path, os.O_RDONLY)`` of a source, counted.

    Args:
        path: A source file.

    Returns:
        The descriptor (the caller closes it).

    Raises:
        OSError: As ``os.open``.
    """
    count('source_opens')
    return os.open(path, os.O_RDONLY)
