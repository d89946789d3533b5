"""Code that runs in the stage-3 loaders, and the shared-memory format.

A :class:`Loader` holds two views of the dataset: the original one (reads
shared storage) and the located one (reads the local copies; see
:mod:`chainer_prefetch.staging.dataset_files`).  The scheduler decides per
example which one to use: the located view only once stage 2 has every file
of that example in place, so a loader never opens a file still being written.

The loaders are worker processes (each holds one :class:`Loader`, made by
:func:`initialize_worker`; the pool calls :func:`load_examples` and
:func:`._columnar_worker.load_columns`), or threads of the training process
sharing one (``loader_threads``; their tasks call its methods directly).

Falling back: when the located view fails with an ``OSError`` *about a file
under the local directory* (another process sharing the directory evicted
it after stage 2 checked it), the example is read from shared storage
instead and reported as such.  Any other exception is the dataset's and is
reported, never retried: a bug in a transform runs once.

Arrays travel back from a worker process through a shared-memory buffer when
one is given: each example has a region ``[offset, offset + example_bytes)``
of the buffer, and its arrays (the example itself, or the arrays directly in
a tuple, list or dict) are written there and replaced by :class:`Packed`
markers.  An array that does not fit travels by pickling.
"""
import math
import mmap
import os
import pickle
import signal
import traceback
from typing import Any, Callable, Optional

import numpy

from chainer_prefetch.iterators import _worker_pool
from chainer_prefetch.iterators._read_from import ReadFrom
from chainer_prefetch.staging import open_watch, source_ops
from chainer_prefetch.staging.open_watch import OpenCheck
from chainer_prefetch.staging.sources import as_source

#: Arrays start at multiples of this in a shared buffer.
_ALIGN = 64


class Loader:
    """What a loader reads with: the dataset's two views.

    Args:
        original_dataset: The dataset as the user gave it.
        located_dataset: The view reading local copies, or ``None``.
        local_root: The directory the located view reads under, or ``None``.
        dataset_files: The dataset's files (to count the bytes of examples
            read from shared storage), or ``None``.
        open_check: Judges the files each example opens (``None``: no
            staging was asked for; nothing is watched).
        buffer_of: Maps a shared buffer's key to its bytes (in a worker
            process); ``None`` where batches need no shared buffer (threads).
    """

    def __init__(self, original_dataset, located_dataset, local_root,
                 dataset_files, open_check: Optional[OpenCheck] = None,
                 buffer_of: Optional[Callable] = None):
        self.original_dataset = original_dataset
        self.located_dataset = located_dataset
        self.local_root = (None if local_root is None
                           else os.path.join(local_root, ''))
        self.dataset_files = dataset_files
        self.open_check = open_check
        self._buffer_of = buffer_of

    def buffer(self, key) -> Optional[numpy.ndarray]:
        """The bytes of shared buffer ``key`` (``None``: no buffer, pickle)."""
        if key is None:
            return None
        if self._buffer_of is None:
            raise ValueError('shared buffer {!r} given to a loader without '
                             'shared memory'.format(key))
        return self._buffer_of(key)

    def load_examples(self, entries, buffer_key, example_bytes):
        """Loads examples; the answer of one load task.

        Args:
            entries: ``(position, index, read_local)`` per example: its
                position in the batch (its region of the buffer), its index,
                and whether to read through the located view.
            buffer_key: Key of the batch's shared buffer (see
                ``WorkerPool.share_fd``), or ``None`` to pickle the arrays.
            example_bytes: Bytes of each example's region of the buffer.

        Returns:
            One ``(read_from, example, source_bytes, unfit_bytes, finding,
            source_ops)`` per entry (``read_from``: a :class:`ReadFrom`;
            ``unfit_bytes``: the example's size if its arrays did not fit
            its region, else 0; ``finding``: what its opens showed, see
            :meth:`OpenCheck.check`; ``source_ops``: what it asked of
            shared storage, see
            :mod:`~chainer_prefetch.staging.source_ops`), or, from the first example that
            fails, ``(None, exception, traceback_text)`` and nothing after
            it.
        """
        buffer = self.buffer(buffer_key)
        results = []
        for position, index, read_local in entries:
            with source_ops.tallied() as asked:
                try:
                    read_from, example, finding = self._watched_read(
                        index, read_local)
                except Exception as error:
                    results.append((None, _picklable(error),
                                    traceback.format_exc()))
                    break
                source_bytes = (0 if read_from is ReadFrom.LOCAL
                                else self.source_bytes([index]))
            unfit = 0
            if buffer is not None:
                start = position * example_bytes
                example, unfit = pack(example, buffer, start,
                                      start + example_bytes)
            results.append((read_from, example, source_bytes, unfit, finding,
                            dict(asked)))
        return results

    def _watched_read(self, index, read_local):
        """``(read_from, example, finding)``: :meth:`_read` with the opens
        watched and judged by ``open_check`` (see ``OpenCheck.check``)."""
        check = self.open_check
        if check is None:
            return self._read(index, read_local) + (None,)
        expected = check.expected(None if self.dataset_files is None
                                  else self.dataset_files.files(index))
        with open_watch.watching(check.redirect(expected, read_local)) \
                as opened:
            read_from, example = self._read(index, read_local)
        source_ops.count('source_opens', check.source_opens(expected, opened))
        read_source, finding = check.check(expected, read_from is ReadFrom.LOCAL,
                                           opened)
        return ReadFrom.SOURCE if read_source else read_from, example, finding

    def _read(self, index, read_local):
        """``(read_from, example)``: the located view for ``read_local``,
        the source after a vanished copy, else the original."""
        if read_local:
            try:
                return ReadFrom.LOCAL, self.located_dataset[index]
            except OSError as error:
                if not self.about_local_file(error):
                    raise
                open_watch.stop_redirecting()
                return ReadFrom.FALLBACK, self.original_dataset[index]
        return ReadFrom.SOURCE, self.original_dataset[index]

    def about_local_file(self, error: OSError) -> bool:
        """Whether ``error`` is about a file under the local directory."""
        name = error.filename
        return (self.local_root is not None and isinstance(name, str)
                and name.startswith(self.local_root))

    def source_bytes(self, indices) -> int:
        """Bytes of shared storage that reading examples ``indices`` cost (an estimate).

        Examples that share a file (the rows of one row group) count it once.
        """
        if self.dataset_files is None:
            return 0
        per_file = {}
        total = 0
        for index in indices:
            for named in self.dataset_files.files(int(index)):
                if named not in per_file:
                    source = as_source(named)
                    try:
                        per_file[named] = source.source_bytes_per_example(
                            source.stat_origin())
                    except OSError:
                        per_file[named] = 0
                total += per_file[named]
        return total


# ---- in a worker process ---------------------------------------------------------

_loader: Optional[Loader] = None
_buffers = {}


def initialize_worker(original_dataset, located_dataset, local_root,
                      dataset_files, open_check):
    """Pool initializer: keeps the datasets (the arguments of :class:`Loader`)."""
    global _loader
    # Ctrl-C goes to the whole process group; the owner process stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_pool.on_drop(drop_buffer)
    _loader = Loader(original_dataset, located_dataset, local_root,
                     dataset_files, open_check, _buffer)


def load_examples(entries, buffer_key, example_bytes):
    """The task of a worker process: :meth:`Loader.load_examples`."""
    return _loader.load_examples(entries, buffer_key, example_bytes)


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError('{}: {}'.format(type(error).__name__, error))


def _buffer(key) -> numpy.ndarray:
    buffer = _buffers.get(key)
    if buffer is None:
        fd = _worker_pool.shared_fd(key)
        buffer = _buffers[key] = numpy.frombuffer(
            mmap.mmap(fd, os.fstat(fd).st_size), numpy.uint8)
    return buffer


def drop_buffer(key):
    """The pool dropped shared buffer ``key``: unmap it (called by the worker loop)."""
    _buffers.pop(key, None)


# ---- the shared-memory format ---------------------------------------------------

class Packed:
    """An array written into a shared buffer at ``offset``."""

    __slots__ = ('dtype', 'shape', 'offset')

    def __init__(self, dtype, shape, offset):
        self.dtype = dtype
        self.shape = shape
        self.offset = offset

    def __reduce__(self):
        return Packed, (self.dtype, self.shape, self.offset)

    def __len__(self):
        return self.shape[0]

    def unpack(self, memory: numpy.ndarray, copy: bool) -> numpy.ndarray:
        """The array in ``memory``: a view, or a copy with ``copy``."""
        size = math.prod(self.shape) * self.dtype.itemsize
        array = memory[self.offset:self.offset + size].view(
            self.dtype).reshape(self.shape)
        return array.copy() if copy else array


def example_bytes(example) -> int:
    """Bytes of the arrays of ``example`` (what a deep copy of it holds)."""
    return sum(array.nbytes for array in _arrays(example))


def slot_bytes(example) -> int:
    """Bytes a region of a shared buffer needs to hold ``example`` (see :func:`pack`)."""
    return sum(region_bytes(array) for array in _arrays(example))


def aligned(offset: int) -> int:
    """The first offset from ``offset`` where an array may start in a shared buffer."""
    return -(-offset // _ALIGN) * _ALIGN


def region_bytes(array: numpy.ndarray) -> int:
    """Bytes ``array`` may take in a shared buffer, its alignment included."""
    return aligned(array.nbytes) + _ALIGN


def write_array(array: numpy.ndarray, buffer: numpy.ndarray, start: int) -> Packed:
    """Copies ``array`` into ``buffer`` at the aligned offset ``start``; returns its marker."""
    target = buffer[start:start + array.nbytes].view(array.dtype)
    numpy.copyto(target.reshape(array.shape), array)
    return Packed(array.dtype, array.shape, start)


def _arrays(example):
    if isinstance(example, numpy.ndarray):
        return [example]
    if type(example) in (tuple, list):
        return [value for value in example if isinstance(value, numpy.ndarray)]
    if type(example) is dict:
        return [value for value in example.values()
                if isinstance(value, numpy.ndarray)]
    return []


def pack(example, buffer: numpy.ndarray, offset: int, limit: int):
    """Writes the arrays of ``example`` into ``buffer[offset:limit]`` (one copy each).

    Returns:
        ``(packed example, unfit_bytes)``: ``unfit_bytes`` is the example's
        size when an array did not fit (it stays in the example, to be
        pickled), else 0.
    """
    unfit = False

    def put(value):
        nonlocal offset, unfit
        if not isinstance(value, numpy.ndarray) or value.dtype.hasobject:
            return value
        start = aligned(offset)
        if start + value.nbytes > limit:
            unfit = True
            return value
        offset = start + value.nbytes
        return write_array(value, buffer, start)

    if isinstance(example, numpy.ndarray):
        packed = put(example)
    elif type(example) in (tuple, list):
        packed = type(example)(put(value) for value in example)
    elif type(example) is dict:
        packed = {key: put(value) for key, value in example.items()}
    else:
        packed = example
    return packed, (slot_bytes(example) if unfit else 0)


def unpack(example, memory: numpy.ndarray, copy: bool = False) -> Any:
    """Replaces :class:`Packed` markers by arrays of ``memory`` (views, or copies)."""
    def get(value):
        return value.unpack(memory, copy) if type(value) is Packed else value

    if type(example) is Packed:
        return get(example)
    if type(example) in (tuple, list):
        return type(example)(get(value) for value in example)
    if type(example) is dict:
        return {key: get(value) for key, value in example.items()}
    return example
