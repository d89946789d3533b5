"""Arrow arrays as the columns of a :class:`~chainer_prefetch.columnar.ColumnarBatch`.

Each column keeps the values a row-by-row read gives (``as_py()``; list
columns as NumPy arrays), so that ``batch[i]`` of a columnar read equals the
row read of the same row:

* integers, floats and booleans without nulls: a NumPy array (its rows come
  as Python numbers);
* binary and string columns without nulls: a :class:`VarColumn` of kind
  ``'bytes'`` or ``'str'`` (Arrow's offsets and data, one copy);
* lists of numbers without nulls: a :class:`VarColumn` of kind ``'list'``;
* anything else (nulls, timestamps, decimals, nested types): an ``object``
  array of the Python values.
"""
from typing import Any, Dict, List, Sequence

import numpy
import pyarrow

from chainer_prefetch.columnar import Column, VarColumn

_BINARY = (pyarrow.types.is_binary, pyarrow.types.is_large_binary)
_STRING = (pyarrow.types.is_string, pyarrow.types.is_large_string)
_LIST = (pyarrow.types.is_list, pyarrow.types.is_large_list)


def is_number_type(data_type: pyarrow.DataType) -> bool:
    """Whether values of ``data_type`` are Python numbers (or booleans)."""
    return (pyarrow.types.is_integer(data_type)
            or pyarrow.types.is_floating(data_type)
            or pyarrow.types.is_boolean(data_type))


def column_of_array(array: pyarrow.Array) -> Column:
    """One Arrow array (or chunked array) as a column; see the module docstring."""
    if isinstance(array, pyarrow.ChunkedArray):
        array = (array.chunk(0) if array.num_chunks == 1
                 else array.combine_chunks())
    data_type = array.type
    if pyarrow.types.is_dictionary(data_type):
        array = array.dictionary_decode()
        data_type = array.type
    if array.null_count == 0:
        if is_number_type(data_type):
            return _number_column(array)
        if any(test(data_type) for test in _BINARY + _STRING):
            return _var_column(array, 'str' if any(
                test(data_type) for test in _STRING) else 'bytes')
        if (any(test(data_type) for test in _LIST)
                and is_number_type(data_type.value_type)
                and array.values.null_count == 0):
            return _list_column(array)
    return _object_column(array)


def _number_column(array: pyarrow.Array) -> numpy.ndarray:
    """A numeric array without nulls as a NumPy view of its data buffer.

    ``to_numpy`` gives the same view but imports pandas first (about
    0.25 s in every loader process); booleans (packed bits) still take it.
    """
    if pyarrow.types.is_boolean(array.type):
        return array.to_numpy(zero_copy_only=False)
    dtype = numpy.dtype(_NUMPY_NAMES.get(str(array.type), str(array.type)))
    if len(array) == 0:
        return numpy.zeros(0, dtype)
    return numpy.frombuffer(array.buffers()[1], dtype, count=len(array),
                            offset=array.offset * dtype.itemsize)


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
    if any(test(array.type) for test in _LIST):
        values = _python_lists(array)
    else:
        values = array.to_pylist()
    column = numpy.empty(len(values), dtype=object)
    column[:] = values
    return column


def _python_lists(array: pyarrow.Array) -> List[Any]:
    """The values of a list array as NumPy arrays (row reads give these)."""
    return [None if not value.is_valid else
            value.values.to_numpy(zero_copy_only=False) for value in array]


def columns_of_table(table: pyarrow.Table, names: Sequence[str]
                     ) -> Dict[str, Column]:
    """The named columns of ``table`` (see :func:`column_of_array`)."""
    return {name: column_of_array(table.column(name)) for name in names}
