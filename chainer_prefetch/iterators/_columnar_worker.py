"""Columnar batches in the loaders, and their shared-memory format.

A dataset with ``get_columns(indices)`` (see :mod:`chainer_prefetch.columnar`)
loads a whole batch in one call.  :func:`load_columns_with` is the task a
loader runs for it (:func:`load_columns` in a worker process): it reads the
rows whose items are staged through the located view and the others from the
source (the same split and the same fallback as
:meth:`._worker.Loader.load_examples`).  A worker process then writes every
column into the batch's shared buffer, one after the other at aligned
offsets:

* an array column as its bytes (:class:`_worker.Packed`);
* a :class:`~chainer_prefetch.columnar.VarColumn` as its offsets, then its
  values (:class:`PackedVar`);
* an ``object`` column is not written: it travels by pickling.

The answer is the batch with :class:`_worker.Packed`/:class:`PackedVar` in
place of the columns written, so only a few small objects are pickled.
When the columns do not fit the buffer, nothing is written: the batch is
pickled, and the answer says how many bytes per row it needed, so later
buffers are made larger.  A loader thread hands the batch over as it is.
"""
import traceback

import numpy

from chainer_prefetch.columnar import ColumnarBatch, VarColumn
from chainer_prefetch.iterators import _worker
from chainer_prefetch.iterators._read_from import ReadFrom
from chainer_prefetch.staging import source_ops


class PackedVar:
    """A :class:`VarColumn` written into a shared buffer."""

    __slots__ = ('offsets', 'values', 'kind')

    def __init__(self, offsets: _worker.Packed, values: _worker.Packed, kind: str):
        self.offsets = offsets
        self.values = values
        self.kind = kind

    def __reduce__(self):
        return PackedVar, (self.offsets, self.values, self.kind)

    def __len__(self):
        return len(self.offsets) - 1

    def unpack(self, memory: numpy.ndarray, copy: bool) -> VarColumn:
        return VarColumn(self.offsets.unpack(memory, copy),
                         self.values.unpack(memory, copy), self.kind)


def _arrays_of(column):
    if isinstance(column, VarColumn):
        return [column.offsets, column.values]
    if column.dtype.hasobject:
        return []
    return [column]


def packed_bytes(batch: ColumnarBatch) -> int:
    """Bytes a shared buffer needs to hold the columns of ``batch``."""
    return sum(_worker.region_bytes(array)
               for column in batch.columns.values()
               for array in _arrays_of(column))


def pack_columns(batch: ColumnarBatch, buffer: numpy.ndarray):
    """Writes the columns of ``batch`` into ``buffer`` (one copy each).

    Returns:
        ``(packed batch, unfit_bytes)``: the batch with its columns replaced
        by :class:`_worker.Packed`/:class:`PackedVar`, and 0; or, when they do
        not fit, the batch itself and the bytes per row it needs.
    """
    needed = packed_bytes(batch)
    if needed > len(buffer):
        return batch, -(-needed // max(1, len(batch)))
    offset = 0

    def put(array):
        nonlocal offset
        start = _worker.aligned(offset)
        offset = start + array.nbytes
        return _worker.write_array(array, buffer, start)

    columns = {}
    for name, column in batch.columns.items():
        if isinstance(column, VarColumn):
            columns[name] = PackedVar(put(column.offsets), put(column.values),
                                      column.kind)
        elif column.dtype.hasobject:
            columns[name] = column
        else:
            columns[name] = put(numpy.ascontiguousarray(column))
    return batch.with_columns(columns), 0


def unpack_columns(packed: ColumnarBatch, memory, copy: bool = False
                   ) -> ColumnarBatch:
    """The batch with its packed columns read from ``memory`` (views, or copies)."""
    if memory is None:
        return packed
    return packed.with_columns({
        name: column.unpack(memory, copy)
        if isinstance(column, (_worker.Packed, PackedVar)) else column
        for name, column in packed.columns.items()})


def _read(loader: _worker.Loader, indices: numpy.ndarray, local: numpy.ndarray):
    """The batch's columns and where the local rows came from."""
    original, located = loader.original_dataset, loader.located_dataset
    if not local.any():
        return original.get_columns(indices), ReadFrom.SOURCE
    read_from = ReadFrom.LOCAL
    if local.all():
        try:
            return located.get_columns(indices), read_from
        except OSError as error:
            if not loader.about_local_file(error):
                raise
            return original.get_columns(indices), ReadFrom.FALLBACK
    positions = numpy.flatnonzero(local)
    others = numpy.flatnonzero(~local)
    try:
        from_local = located.get_columns(indices[positions])
    except OSError as error:
        if not loader.about_local_file(error):
            raise
        return original.get_columns(indices), ReadFrom.FALLBACK
    from_source = original.get_columns(indices[others])
    joined = ColumnarBatch.concatenate([from_local, from_source])
    order = numpy.empty(len(indices), dtype=numpy.int64)
    order[numpy.concatenate([positions, others])] = numpy.arange(len(indices))
    return joined.take(order), read_from


def load_columns_with(loader: _worker.Loader, indices: numpy.ndarray,
                      local: numpy.ndarray, buffer_key):
    """Loads one batch as columns; the answer of one ``LoadColumns`` task.

    Args:
        loader: The views to read with.
        indices: The batch's rows, in order.
        local: For each row, whether to read it through the located view.
        buffer_key: Key of the batch's shared buffer, or ``None`` to pickle
            (or, in a loader thread, to hand the columns over as they are).

    Returns:
        ``(read_from, batch, source_bytes, unfit_bytes, source_ops)``
        (``source_ops``: the ``stat`` calls that counting ``source_bytes``
        asked of shared storage; what pyarrow opens is not seen), or, if loading
        failed, ``(None, exception, traceback_text, index)`` where ``index``
        is the failing example's index when the dataset named it (else the
        batch's first).
    """
    try:
        batch, read_from = _read(loader, indices, local)
        if not isinstance(batch, ColumnarBatch) or len(batch) != len(indices):
            raise TypeError('get_columns must return a ColumnarBatch of {} rows, '
                            'got {!r}'.format(len(indices), batch))
    except Exception as error:
        index = getattr(error, 'index', None)
        return (None, _worker._picklable(error), traceback.format_exc(),
                int(indices[0]) if index is None else index)
    with source_ops.tallied() as asked:
        source_bytes = loader.source_bytes(indices[~local])
    unfit = 0
    buffer = loader.buffer(buffer_key)
    if buffer is not None:
        batch, unfit = pack_columns(batch, buffer)
    return read_from, batch, source_bytes, unfit, dict(asked)


def load_columns(indices: numpy.ndarray, local: numpy.ndarray, buffer_key):
    """The task of a worker process: :func:`load_columns_with` its loader."""
    return load_columns_with(_worker._loader, indices, local, buffer_key)
