"""Arrow arrays as the columns of a :class:`~chainer_prefetch.columnar.ColumnarBatch`.

Each column keeps the values a row-by-row read gives (``as_py()``, with
numbers as NumPy scalars of the column's dtype (:func:`as_numpy_scalar`) and
list columns as NumPy arrays; :func:`value_converter` reads one such value),
so that ``batch[i]`` of a columnar read equals the row read of the same row,
value and type:

* integers, floats and booleans without nulls: a NumPy array;
* binary and string columns without nulls: a :class:`VarColumn` of kind
  ``'bytes'`` or ``'str'`` (Arrow's offsets and data, one copy);
* lists of numbers without nulls: a :class:`VarColumn` of kind ``'list'``;
* anything else (nulls, timestamps, decimals, nested types): an ``object``
  array of the values a row read gives.

:class:`StoredColumns` takes rows out of a stored table of one or more
record batches (a staged row group) straight into such columns.
"""
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy
import pyarrow

from chainer_prefetch.columnar import (
    Column,
    StoredRows,
    VarColumn,
    concatenate_var,
    offsets_of,
    split_by_group,
)

#: Variable-length columns of a stored table whose values average fewer
#: bytes a row than this are joined into one column when the table is read
#: (see :class:`StoredColumns`); larger ones stay in its record batches.
LARGE_VALUE_BYTES = 256

_BINARY = (pyarrow.types.is_binary, pyarrow.types.is_large_binary)
_STRING = (pyarrow.types.is_string, pyarrow.types.is_large_string)
_LIST = (pyarrow.types.is_list, pyarrow.types.is_large_list)


def is_number_type(data_type: pyarrow.DataType) -> bool:
    """Whether ``data_type`` holds numbers: integers, floats or booleans."""
    return (pyarrow.types.is_integer(data_type)
            or pyarrow.types.is_floating(data_type)
            or pyarrow.types.is_boolean(data_type))


def as_numpy_scalar(value, data_type: pyarrow.DataType):
    """``value`` as a NumPy scalar of ``data_type``'s dtype if it is a number.

    Rows come so, a number of a ``float32`` column as a ``numpy.float32``,
    so that Chainer's ``concat_examples`` keeps the column's dtype; ``None``
    (a null) and the values of other types are returned as they are.

    Args:
        value: A value as Arrow's ``as_py`` gives it.
        data_type: Its column's Arrow type.
    """
    if value is None or not is_number_type(data_type):
        return value
    return number_dtype(data_type).type(value)


def number_dtype(data_type: pyarrow.DataType) -> numpy.dtype:
    """The NumPy dtype of a number type's values.

    Arrow's ``to_pandas_dtype`` gives it too, but imports pandas, a slow
    import that every loader process would pay.

    Args:
        data_type: An integer, floating point or boolean Arrow type.
    """
    return numpy.dtype(_NUMPY_NAMES.get(str(data_type), str(data_type)))


def column_of_array(array: pyarrow.Array) -> Column:
    """One Arrow array (or chunked array) as a column; see the module docstring."""
    if isinstance(array, pyarrow.ChunkedArray):
        array = (array.chunk(0) if array.num_chunks == 1
                 else array.combine_chunks())
    if pyarrow.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    kind = _kind_of(array)
    if kind == 'number':
        return _number_column(array)
    if kind == 'list':
        return _list_column(array)
    if kind is not None:
        return _var_column(array, kind)
    return _object_column(array)


def _kind_of(array: pyarrow.Array) -> Optional[str]:
    """The kind of column ``array`` (not dictionary-encoded) makes.

    Returns:
        ``'number'``, ``'bytes'``, ``'str'`` or ``'list'``; ``None`` for an
        ``object`` column.
    """
    data_type = array.type
    if array.null_count:
        return None
    if is_number_type(data_type):
        return 'number'
    if any(test(data_type) for test in _STRING):
        return 'str'
    if any(test(data_type) for test in _BINARY):
        return 'bytes'
    if (any(test(data_type) for test in _LIST)
            and is_number_type(data_type.value_type)
            and array.values.null_count == 0):
        return 'list'
    return None


def _number_column(array: pyarrow.Array) -> numpy.ndarray:
    """A numeric array's values as NumPy values, a view of its data buffer.

    ``to_numpy`` gives the same but imports pandas first, a slow import
    that every loader process would pay.  Booleans (packed bits) come unpacked, a copy.
    The values of nulls are whatever the buffer holds.
    """
    dtype = number_dtype(array.type)
    if len(array) == 0:
        return numpy.zeros(0, dtype)
    if pyarrow.types.is_boolean(array.type):
        return _bits(array.buffers()[1], array.offset, len(array))
    return numpy.frombuffer(array.buffers()[1], dtype, count=len(array),
                            offset=array.offset * dtype.itemsize)


def _bits(buffer: pyarrow.Buffer, offset: int, count: int) -> numpy.ndarray:
    """Bits ``offset`` to ``offset + count`` of an Arrow bitmap, as booleans."""
    packed = numpy.frombuffer(buffer, numpy.uint8)
    return numpy.unpackbits(packed, bitorder='little')[offset:offset + count].astype(bool)


#: Arrow's names of the floating types that NumPy spells otherwise.
_NUMPY_NAMES = {'halffloat': 'float16', 'float': 'float32', 'double': 'float64'}


def _offsets(array: pyarrow.Array) -> numpy.ndarray:
    large = (pyarrow.types.is_large_binary(array.type)
             or pyarrow.types.is_large_string(array.type)
             or pyarrow.types.is_large_list(array.type))
    width = 8 if large else 4
    offsets = numpy.frombuffer(array.buffers()[1], numpy.int64 if large
                               else numpy.int32, count=len(array) + 1,
                               offset=array.offset * width)
    return offsets.astype(numpy.int64)


def _var_column(array: pyarrow.Array, kind: str) -> VarColumn:
    offsets = _offsets(array)
    start, end = int(offsets[0]), int(offsets[-1])
    data = array.buffers()[2]
    values = (numpy.frombuffer(data, numpy.uint8)[start:end] if data is not None
              else numpy.zeros(0, numpy.uint8))
    return VarColumn(offsets - start, values, kind)


def _list_column(array: pyarrow.Array) -> VarColumn:
    offsets = _offsets(array)
    start, end = int(offsets[0]), int(offsets[-1])
    values = array.values.slice(start, end - start).to_numpy(
        zero_copy_only=False)
    return VarColumn(offsets - start, numpy.asarray(values), 'list')


def _object_column(array: pyarrow.Array) -> numpy.ndarray:
    if is_number_type(array.type):
        return _numbers_with_nulls(array)
    if any(test(array.type) for test in _LIST):
        values = _python_lists(array)
    else:
        values = array.to_pylist()
    column = numpy.empty(len(values), dtype=object)
    column[:] = values
    return column


def _numbers_with_nulls(array: pyarrow.Array) -> numpy.ndarray:
    """Numbers with nulls as an ``object`` column: NumPy scalars, and ``None``."""
    column = numpy.empty(len(array), dtype=object)
    if array.null_count == len(array):
        return column  # (all None; the data buffer may be missing)
    column[:] = list(_number_column(array))
    column[~_bits(array.buffers()[0], array.offset, len(array))] = None
    return column


def _python_lists(array: pyarrow.Array) -> List[Any]:
    """The values of a list array as NumPy arrays (row reads give these)."""
    return [_list_value(value) for value in array]


def _list_value(value: pyarrow.Scalar) -> Optional[numpy.ndarray]:
    """One value of a list column as a NumPy array; ``None`` for a null."""
    return (value.values.to_numpy(zero_copy_only=False) if value.is_valid
            else None)


def value_converter(data_type: pyarrow.DataType
                    ) -> Callable[[pyarrow.Array, int], Any]:
    """How to turn one value of a column into the value a row read gives.

    A number is a NumPy scalar of the column's dtype, so that Chainer's
    ``concat_examples`` stacks a ``float32`` column into a ``float32`` array
    (Python floats would make it ``float64``, which a ``float32`` link
    refuses), as the columnar path's arrays are; a list is a NumPy array;
    anything else is what Arrow's ``as_py`` gives.

    Args:
        data_type: The column's Arrow type.

    Returns:
        ``convert(column, row)``: the value of row ``row`` of ``column`` (an
        Arrow array or chunked array of that type).
    """
    if any(test(data_type) for test in _LIST):
        return _list_as_array
    if is_number_type(data_type):
        return functools.partial(_number_as_numpy,
                                 scalar=number_dtype(data_type).type)
    return _as_python


def _list_as_array(column: pyarrow.Array, row: int):
    return _list_value(column[row])


def _as_python(column: pyarrow.Array, row: int):
    return column[row].as_py()


def _number_as_numpy(column: pyarrow.Array, row: int, scalar: type):
    value = column[row].as_py()
    return None if value is None else scalar(value)


def columns_of_table(table: pyarrow.Table, names: Sequence[str]
                     ) -> Dict[str, Column]:
    """The named columns of ``table`` (see :func:`column_of_array`)."""
    return {name: column_of_array(table.column(name)) for name in names}


class StoredColumns:
    """Columns of a stored table of one or more record batches, to take rows from.

    ``take(rows)`` gives what ``columns_of_table(table.take(rows), names)``
    gives, without Arrow's ``take``: on a table of several record batches
    that joins each whole column first, copying the whole row group to take
    a few of its rows.  Each value is copied once,
    from the table's memory into the new column:

    * numbers, and variable-length columns of small values (under
      :data:`LARGE_VALUE_BYTES` a row on average), are joined into one
      column per process when this is made (kilobytes a row group), and
      rows are taken from it;
    * variable-length columns of large values (images) stay in the table
      (for a memory-mapped file, the page cache): each row is copied from
      its record batch;
    * columns that need Python objects (nulls, other types) take their rows
      from each record batch with Arrow, then convert only those.

    Args:
        table: The stored table (for instance a memory-mapped IPC file).
        names: The columns to take.
    """

    def __init__(self, table: pyarrow.Table, names: Sequence[str]):
        self.num_rows = table.num_rows
        self._columns = {name: _stored_column(table.column(name))
                         for name in names}

    def take(self, rows: Sequence[int]) -> Dict[str, Column]:
        """The rows ``rows`` (in that order, repeats allowed) of every column."""
        rows = numpy.asarray(rows, dtype=numpy.int64)
        return {name: column[rows] if isinstance(column, numpy.ndarray)
                else column.take(rows)
                for name, column in self._columns.items()}


def _stored_column(column: pyarrow.ChunkedArray
                   ) -> Union[Column, '_VarValues', '_ArrowColumn']:
    chunks = [chunk.dictionary_decode() if pyarrow.types.is_dictionary(
        chunk.type) else chunk for chunk in column.chunks]
    kinds = {_kind_of(chunk) for chunk in chunks}
    if len(chunks) == 0 or len(kinds) != 1 or None in kinds:
        return _ArrowColumn(column)
    parts = [column_of_array(chunk) for chunk in chunks]
    if kinds == {'number'}:
        return numpy.concatenate(parts)
    if sum(part.nbytes for part in parts) < LARGE_VALUE_BYTES * len(column):
        parts = [concatenate_var(parts)]
    return _VarValues(parts)


class _VarValues:
    """A variable-length column: one joined part, or large values left in
    its record batches (one part each)."""

    def __init__(self, parts: Sequence[VarColumn]):
        self._rows = StoredRows(
            [part.values for part in parts],
            numpy.concatenate([part.offsets[:-1] for part in parts]),
            numpy.concatenate([part.offsets[1:] for part in parts]),
            None if len(parts) == 1 else numpy.repeat(
                numpy.arange(len(parts)), [len(part) for part in parts]))
        self._kind = parts[0].kind
        self.n_sources = len(parts)

    def take(self, rows: numpy.ndarray) -> VarColumn:
        offsets, values = self._rows.take(rows)
        return VarColumn(offsets, values, self._kind)


class _ArrowColumn:
    """A column of Python objects: Arrow takes the rows from each record batch."""

    def __init__(self, column: pyarrow.ChunkedArray):
        self._chunks = column.chunks
        self._starts = offsets_of([len(chunk) for chunk in self._chunks])

    def take(self, rows: numpy.ndarray) -> Column:
        if len(self._chunks) == 1:
            return column_of_array(self._chunks[0].take(arrow_indices(rows)))
        segments, inverse = split_by_group(
            numpy.searchsorted(self._starts, rows, side='right') - 1)
        parts = [self._chunks[chunk].take(arrow_indices(
            rows[positions] - self._starts[chunk])) for chunk, positions in segments]
        if inverse is None:
            return column_of_array(parts[0])
        return column_of_array(pyarrow.concat_arrays(parts).take(
            arrow_indices(inverse)))


def arrow_indices(rows: numpy.ndarray) -> pyarrow.Array:
    """Row numbers as an Arrow int64 array over the same memory.

    ``pyarrow.array`` of a NumPy array would import pandas (a slow import,
    in every loader process) just to check whether it was given a pandas
    object.
    """
    rows = numpy.ascontiguousarray(rows, dtype=numpy.int64)
    return pyarrow.Array.from_buffers(pyarrow.int64(), len(rows),
                                      [None, pyarrow.py_buffer(rows)])
