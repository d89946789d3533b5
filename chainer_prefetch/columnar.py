"""Batches held as columns: what a columnar dataset returns and the iterator delivers.

A dataset opts in to columnar loading with one method,
``get_columns(indices) -> ColumnarBatch``: the rows ``indices``, in that
order, as whole columns.  :class:`~chainer_prefetch.PrefetchMultiprocessIterator`
then hands each loader process a whole batch at once, and the columns come
back through shared memory as arrays (no per-row Python objects, no
pickling); ``next()`` returns a :class:`ColumnarBatch`.

A :class:`ColumnarBatch` is a sequence of examples, so everything that takes
a list of examples takes it (``len(batch)``, ``batch[i]``, iteration, and
Chainer's ``concat_examples`` converter, which then gathers row by row).
:data:`concat_columns` is the converter that uses the columns directly: it
returns the same structure as ``concat_examples`` (a dict, a tuple or one
array) without touching rows.

Columns are:

* ``numpy.ndarray``: one entry per row along the first axis (numbers,
  booleans, fixed-shape arrays, or ``object`` for anything else);
* :class:`VarColumn`: variable-length values (``bytes``, ``str`` or 1-D
  arrays such as token lists) as Arrow lays them out: an ``offsets`` array
  (``int64``, one more than the rows) and a ``values`` array.
"""
import collections.abc
import itertools
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy
from chainer.dataset import Converter, concat_examples, to_device

try:  # compiled at installation where a C compiler is found (setup.py)
    from chainer_prefetch import _take_rows
except ImportError:  # pragma: no cover (the tests require it built)
    _take_rows = None

#: Forms of the examples a batch holds: dicts, tuples or single values.
FORMS = ('dict', 'tuple', 'single')

_KINDS = ('bytes', 'str', 'list')


class VarColumn:
    """A column of variable-length values as ``offsets`` and ``values``.

    Row ``i`` is ``values[offsets[i]:offsets[i + 1]]``: ``bytes`` (kind
    ``'bytes'``), ``str`` decoded from UTF-8 (``'str'``) or a 1-D array
    (``'list'``).

    Args:
        offsets: ``int64`` array of ``len + 1`` non-decreasing positions.
        values: 1-D array (``uint8`` for bytes and strings).
        kind: ``'bytes'``, ``'str'`` or ``'list'``.

    Raises:
        ValueError: ``kind`` is unknown or the arrays do not fit together.
    """

    __slots__ = ('offsets', 'values', 'kind')

    def __init__(self, offsets: numpy.ndarray, values: numpy.ndarray,
                 kind: str):
        if kind not in _KINDS:
            raise ValueError('kind must be one of {}, got {!r}'.format(
                ', '.join(_KINDS), kind))
        offsets = numpy.asarray(offsets)
        if offsets.ndim != 1 or len(offsets) == 0 or offsets.dtype != numpy.int64:
            raise ValueError('offsets must be a non-empty 1-D int64 array')
        if values.ndim != 1:
            raise ValueError('values must be a 1-D array')
        self.offsets = offsets
        self.values = values
        self.kind = kind

    @classmethod
    def from_values(cls, items: Sequence[Any], kind: str,
                    dtype=None) -> 'VarColumn':
        """A column of Python values (``bytes``, ``str`` or 1-D arrays).

        Args:
            items: The values, one per row.
            kind: What they are (see the class).
            dtype: Element type of ``'list'`` values (default: the first's).
        """
        if kind == 'str':
            items = [item.encode('utf-8') for item in items]
        if kind == 'list':
            arrays = [numpy.asarray(item, dtype=dtype) for item in items]
            dtype = arrays[0].dtype if arrays and dtype is None else dtype
            values = (numpy.concatenate(arrays).astype(dtype, copy=False)
                      if arrays else numpy.zeros(0, dtype or numpy.float32))
            lengths = [len(array) for array in arrays]
        else:
            values = numpy.frombuffer(b''.join(items), numpy.uint8)
            lengths = [len(item) for item in items]
        offsets = numpy.zeros(len(lengths) + 1, numpy.int64)
        numpy.cumsum(lengths, out=offsets[1:])
        return cls(offsets, values, kind)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, row):
        if isinstance(row, (int, numpy.integer)):
            size = len(self)
            if row < 0:
                row += size
            if not 0 <= row < size:
                raise IndexError('row {} out of range for {} rows'.format(
                    row, size))
            value = self.values[self.offsets[row]:self.offsets[row + 1]]
            if self.kind == 'list':
                return value
            value = value.tobytes()
            return value.decode('utf-8') if self.kind == 'str' else value
        return self.take(numpy.arange(len(self))[row])

    def __iter__(self):
        return (self[row] for row in range(len(self)))

    def __repr__(self):
        return 'VarColumn({} rows of {}, {} values)'.format(
            len(self), self.kind, len(self.values))

    @property
    def nbytes(self) -> int:
        """Bytes of the two arrays."""
        return self.offsets.nbytes + self.values.nbytes

    def lengths(self) -> numpy.ndarray:
        """The length of every row (in values)."""
        return numpy.diff(self.offsets)

    def take(self, rows: Sequence[int]) -> 'VarColumn':
        """The rows ``rows``, in that order, as a new compact column.

        Each call checks (and copies) the whole column's offsets: to take
        rows from a large column many times, keep a :class:`StoredRows`.
        """
        offsets, values = StoredRows([self.values], self.offsets[:-1],
                                     self.offsets[1:]).take(rows)
        return VarColumn(offsets, values, self.kind)

    def tolist(self) -> List[Any]:
        """The rows as Python values (``bytes``, ``str`` or arrays)."""
        return list(self)

    def to_arrow(self):
        """The column as a PyArrow array, without copying.

        Returns:
            ``large_binary``, ``large_string`` or ``large_list`` array.
        """
        import pyarrow
        offsets = pyarrow.py_buffer(self.offsets)
        values = pyarrow.py_buffer(self.values)
        if self.kind == 'list':
            element = pyarrow.from_numpy_dtype(self.values.dtype)
            inner = pyarrow.Array.from_buffers(element, len(self.values),
                                               [None, values])
            return pyarrow.LargeListArray.from_arrays(
                pyarrow.Array.from_buffers(pyarrow.int64(), len(self.offsets),
                                           [None, offsets]), inner)
        kind = (pyarrow.large_string() if self.kind == 'str'
                else pyarrow.large_binary())
        return pyarrow.Array.from_buffers(kind, len(self), [None, offsets, values])


Column = Union[numpy.ndarray, VarColumn]

#: ``numpy.arange`` of int64, read-only, that :func:`positions` slices.
_POSITIONS = numpy.arange(0, dtype=numpy.int64)


def positions(count: int) -> numpy.ndarray:
    """``numpy.arange(count)`` (int64), read-only, without giving the GIL up.

    ``numpy.arange`` (like ``unique``, ``bincount``, ``concatenate``,
    ``searchsorted`` and ``astype``) gives the GIL up however small its
    result, and taking it back waits for the other threads of the process
    to give it up in turn: up to the interpreter's switch interval (5 ms)
    while one of them runs Python, where the call itself takes a
    microsecond.  Threads that handle every batch (loader threads, the
    pipeline thread) slice a shared range instead.

    Args:
        count: How many positions (0 to ``count - 1``).
    """
    global _POSITIONS
    found = _POSITIONS
    if count > len(found):
        found = numpy.arange(max(count, 2 * len(found)), dtype=numpy.int64)
        found.flags.writeable = False
        _POSITIONS = found  # (threads racing here make equal ranges)
    return found[:count]


def offsets_of(lengths: Sequence[int]) -> numpy.ndarray:
    """Where each of consecutive pieces of ``lengths`` starts, and the end."""
    offsets = numpy.zeros(len(lengths) + 1, numpy.int64)
    numpy.cumsum(lengths, out=offsets[1:])
    return offsets


def split_by_group(groups: numpy.ndarray
                   ) -> Tuple[List[Tuple[int, numpy.ndarray]], Optional[numpy.ndarray]]:
    """The positions of the rows of each group, and how to put the groups back.

    For rows taken group by group (a part per row group, per record batch):
    the parts joined in the order returned, then taken at ``inverse``, are
    the rows in their first order.

    Args:
        groups: The group of each row (at least one row).

    Returns:
        ``(segments, inverse)``: ``segments`` lists ``(group, positions)``
        in increasing group order, each group's positions in their order;
        ``inverse`` is ``None`` when all rows are of one group.
    """
    if (groups == groups[0]).all():  # (argsort gives the GIL up, even here)
        return [(int(groups[0]), positions(len(groups)))], None
    order = numpy.argsort(groups, kind='stable')
    segments = numpy.split(order, numpy.flatnonzero(numpy.diff(groups[order])) + 1)
    inverse = numpy.empty(len(order), numpy.int64)
    inverse[order] = positions(len(order))
    return [(int(groups[members[0]]), members) for members in segments], inverse


class StoredRows:
    """Variable-length rows stored in arrays of one dtype, to take rows from.

    Stored row ``r`` is ``sources[source_of_row[r]][starts[r]:ends[r]]``
    (the values of one of several record batches, say).  :meth:`take`
    joins the rows asked for into one new array in a single call that holds
    the GIL throughout (:data:`TAKE_ROWS`): the compiled
    ``chainer_prefetch._take_rows`` where it was built at installation (a C
    compiler and Python's headers), else :func:`take_rows_python`, which
    finds each row's byte range and slices it in Python.  The compiled one
    takes no interpreter step per row, which is most of the cost for short
    values (strings, token lists).  Assigning NumPy slices row by row would
    also give the GIL up and take it back for every row, which costs far
    more than the copy while other threads of the process wait for it, as
    loader threads do.

    Args:
        sources: One-dimensional arrays of values (one dtype).
        starts: For each stored row, where its values start in its source.
        ends: For each stored row, where its values end.
        source_of_row: For each stored row, the index of its source
            (``None``: every row is of the first).

    Raises:
        ValueError: the arrays differ in length, or a stored row is not
            within its source (the first such row named).
    """

    def __init__(self, sources: Sequence[numpy.ndarray], starts: numpy.ndarray,
                 ends: numpy.ndarray, source_of_row: Optional[numpy.ndarray] = None):
        self.dtype = sources[0].dtype
        self._arrays = [numpy.ascontiguousarray(source, self.dtype) for source in sources]
        self._bytes = None if self.dtype.hasobject else [
            memoryview(source.view(numpy.uint8)) for source in self._arrays]
        # Copies of their own, read-only: what was checked stays so.
        self._starts, self._ends = _checked_copy(starts), _checked_copy(ends)
        self._source_of_row = (None if source_of_row is None
                               else _checked_copy(source_of_row))
        lengths = {len(self._starts), len(self._ends),
                   len(self._starts if source_of_row is None else self._source_of_row)}
        if len(lengths) != 1:
            raise ValueError('starts, ends and source_of_row differ in length: {}, {}, '
                             '{}'.format(len(self._starts), len(self._ends),
                                         None if source_of_row is None
                                         else len(self._source_of_row)))
        self._check_within_sources()

    def _check_within_sources(self) -> None:
        sizes = numpy.array([len(source) for source in self._arrays], numpy.int64)
        which = (numpy.zeros(len(self._starts), numpy.int64)
                 if self._source_of_row is None else self._source_of_row)
        known = (which >= 0) & (which < len(sizes))
        bad = ~known | (self._starts < 0) | (self._ends < self._starts) | (
            self._ends > sizes[numpy.where(known, which, 0)])
        if bad.any():
            row = int(numpy.flatnonzero(bad)[0])
            raise ValueError('stored row {}: values {} to {} of source {} of {} are not '
                             'within it'.format(row, self._starts[row], self._ends[row],
                                                which[row], len(sizes)))

    def __len__(self) -> int:
        return len(self._starts)

    def take(self, rows: Sequence[int]) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """The stored rows ``rows``, in that order (repeats allowed), joined.

        Args:
            rows: Stored row numbers (``0`` to ``len(self) - 1``).

        Returns:
            ``(offsets, values)``: ``int64`` positions of each row in
            ``values`` (one more than the rows) and a new array of the
            rows' values, one row after the other; both writable.

        Raises:
            IndexError: a row out of range, named.
            ValueError: ``rows`` is not one-dimensional.
        """
        rows = _int64(rows)
        if rows.ndim != 1:
            raise ValueError('rows must be one-dimensional, not of shape {}'.format(
                rows.shape))
        if self._bytes is None:  # references, not bytes, to copy
            offsets, slices = _row_slices(self._arrays, self._source_of_row,
                                          self._starts, self._ends, rows)
            return offsets, numpy.concatenate([numpy.empty(0, self.dtype)] + slices)
        offsets, values = TAKE_ROWS(self._bytes, self._source_of_row, self._starts,
                                    self._ends, rows, self.dtype.itemsize)
        return (numpy.frombuffer(offsets, numpy.int64),
                numpy.frombuffer(values, self.dtype))


def take_rows_python(sources: List[memoryview], source_of_row: Optional[numpy.ndarray],
                     starts: numpy.ndarray, ends: numpy.ndarray, rows: numpy.ndarray,
                     width: int) -> Tuple[numpy.ndarray, bytearray]:
    """What the compiled ``take_rows`` does (:class:`StoredRows`), in Python.

    The stored rows must be within their sources (:class:`StoredRows`
    checks them once; the compiled one checks them again before copying).

    Args:
        sources: The sources' bytes.
        source_of_row: For each stored row, its source (``None``: the first).
        starts: For each stored row, where its values start (``int64``).
        ends: For each stored row, where its values end (``int64``).
        rows: The stored rows to take (``int64``).
        width: Bytes of one value.

    Returns:
        ``(offsets, values)``: the ``int64`` position of each row in the
        values, and the rows' bytes.

    Raises:
        IndexError: a row out of range, named.
    """
    offsets, slices = _row_slices(sources, source_of_row, starts, ends, rows, width)
    return offsets, bytearray().join(slices)


#: What :meth:`StoredRows.take` calls: the compiled ``take_rows`` where it is
#: built, else :func:`take_rows_python` (a benchmark sets this to compare them).
TAKE_ROWS = take_rows_python if _take_rows is None else _take_rows.take_rows


def _check_rows(rows: numpy.ndarray, count: int) -> None:
    """Raises IndexError naming the first of ``rows`` outside ``0`` to ``count - 1``."""
    bad = (rows < 0) | (rows >= count)
    if bad.any():
        raise IndexError('row {} out of range for {} rows'.format(
            int(rows[numpy.flatnonzero(bad)[0]]), count))


def _checked_copy(values) -> numpy.ndarray:
    """A read-only ``int64`` copy of ``values``."""
    copy = numpy.array(values, dtype=numpy.int64)
    copy.flags.writeable = False
    return copy


def _int64(values) -> numpy.ndarray:
    """``values`` as a contiguous ``int64`` array (no copy when it is one)."""
    return numpy.ascontiguousarray(values, dtype=numpy.int64)


def _row_slices(sources: list, source_of_row: Optional[numpy.ndarray], starts: numpy.ndarray,
                ends: numpy.ndarray, rows: numpy.ndarray, width: int = 1):
    """The offsets of stored rows ``rows`` and their slices of their sources.

    Args:
        sources: Arrays (``width`` 1) or their bytes (``width`` bytes a value).
        source_of_row: For each stored row, its source (``None``: the first).
        starts: For each stored row, where its values start.
        ends: For each stored row, where its values end.
        rows: The stored rows to take.
        width: Bytes of one value when ``sources`` are bytes.

    Returns:
        ``(offsets, slices)``: the ``int64`` position (in values) of each
        row once joined, and each row's slice, in order.

    Raises:
        IndexError: a row out of range, named.
    """
    _check_rows(rows, len(starts))
    firsts, lasts = starts[rows], ends[rows]
    offsets = offsets_of(lasts - firsts)
    if width != 1:  # positions of values to positions of bytes
        firsts, lasts = firsts * width, lasts * width
    each = (itertools.repeat(sources[0]) if source_of_row is None
            else map(sources.__getitem__, source_of_row[rows].tolist()))
    return offsets, [source[first:last] for source, first, last
                     in zip(each, firsts.tolist(), lasts.tolist())]


class ColumnarBatch(collections.abc.Sequence):
    """Rows of a batch held as columns; a sequence of examples.

    ``batch[i]`` is row ``i`` as an example of ``form``: a dict of the
    columns (``'dict'``), a tuple in column order (``'tuple'``) or the one
    column's value (``'single'``); an array column gives NumPy scalars of
    its dtype or arrays (``column[i]``), as a row-by-row Parquet read does.

    Args:
        columns: Column name to column, in order; every column has the same
            number of rows.
        form: ``'dict'``, ``'tuple'`` or ``'single'``.

    Raises:
        ValueError: columns of different lengths, an unknown form, or
            ``'single'`` with more than one column.
    """

    def __init__(self, columns: Mapping[str, Column], form: str = 'dict'):
        if form not in FORMS:
            raise ValueError('form must be one of {}, got {!r}'.format(
                ', '.join(FORMS), form))
        self.columns: Dict[str, Column] = dict(columns)
        if form == 'single' and len(self.columns) != 1:
            raise ValueError('a batch of single values has one column, not '
                             '{}'.format(len(self.columns)))
        lengths = {name: len(column) for name, column in self.columns.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError('columns of different lengths: {}'.format(lengths))
        self._length = next(iter(lengths.values()), 0)
        self.form = form

    @property
    def names(self) -> Tuple[str, ...]:
        """The column names, in order."""
        return tuple(self.columns)

    @property
    def nbytes(self) -> int:
        """Bytes of the columns' arrays (``object`` columns count their pointers only)."""
        return sum(column.nbytes for column in self.columns.values())

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, row):
        if not isinstance(row, (int, numpy.integer)):
            return self.take(numpy.arange(self._length)[row])
        if row < 0:
            row += self._length
        if not 0 <= row < self._length:
            raise IndexError('row {} out of range for {} rows'.format(
                row, self._length))
        values = [column[row] for column in self.columns.values()]
        if self.form == 'dict':
            return dict(zip(self.columns, values))
        if self.form == 'tuple':
            return tuple(values)
        return values[0]

    def __repr__(self):
        return 'ColumnarBatch({} rows; {})'.format(self._length, ', '.join(
            '{}: {}'.format(name, _describe(column))
            for name, column in self.columns.items()))

    def take(self, rows: Sequence[int]) -> 'ColumnarBatch':
        """The rows ``rows``, in that order, as a new batch."""
        rows = numpy.asarray(rows, dtype=numpy.int64)
        return ColumnarBatch({name: column.take(rows) if isinstance(
            column, VarColumn) else column[rows]
            for name, column in self.columns.items()}, self.form)

    def with_columns(self, columns: Mapping[str, Column],
                     form: Optional[str] = None) -> 'ColumnarBatch':
        """A batch of other columns, in this batch's form unless ``form`` is given."""
        return ColumnarBatch(columns, form or self.form)

    def arrays(self, device=None, padding=None):
        """The columns in the structure ``concat_examples`` returns.

        Array columns are sent to ``device``.  A list column (a
        :class:`VarColumn` of 1-D arrays) whose rows all have one length
        is sent as a 2-D array, as ``concat_examples`` stacks such rows;
        with ``padding``, rows of different lengths are padded with it to
        the longest, as ``concat_examples(batch, padding=...)`` pads them.
        Other :class:`VarColumn` columns (``bytes``, ``str``, lists of
        different lengths without ``padding``) and ``object`` columns stay
        on the host as they are.

        Args:
            device: A Chainer device specifier, or ``None`` to keep the arrays
                where they are.
            padding: The value that pads list columns, or ``None``.

        Returns:
            A dict (form ``'dict'``), a tuple (``'tuple'``) or one column.
        """
        sent = [column if isinstance(column, VarColumn) or
                column.dtype == object else to_device(device, column)
                for column in (_stacked(column, padding)
                               for column in self.columns.values())]
        if self.form == 'dict':
            return dict(zip(self.columns, sent))
        if self.form == 'tuple':
            return tuple(sent)
        return sent[0]

    @classmethod
    def from_examples(cls, examples: Sequence[Any]) -> 'ColumnarBatch':
        """Examples (dicts, tuples or single values, all of one form) as columns.

        Each field becomes an array column when its values are numbers or
        arrays of one shape and type, a :class:`VarColumn` when they are all
        ``bytes``, all ``str`` or 1-D arrays of one type and varying
        length, and an ``object`` column otherwise.

        Raises:
            ValueError: examples of different forms or fields.
        """
        return cls._of_fields(*_fields_of(examples))

    @classmethod
    def _of_fields(cls, form: str, names: List[str],
                   fields: List[list]) -> 'ColumnarBatch':
        """The batch of the fields :func:`_fields_of` split examples into."""
        return cls({name: column_of_values(values)
                    for name, values in zip(names, fields)}, form)

    @classmethod
    def concatenate(cls, batches: Sequence['ColumnarBatch']) -> 'ColumnarBatch':
        """Batches of the same columns, one after the other.

        Raises:
            ValueError: the batches have different columns or forms.
        """
        first = batches[0]
        for batch in batches[1:]:
            if batch.names != first.names or batch.form != first.form:
                raise ValueError('cannot join batches of columns {} and {}'
                                 .format(first.names, batch.names))
        if len(batches) == 1:
            return first
        columns = {name: _concatenate([batch.columns[name] for batch in batches])
                   for name in first.names}
        return cls(columns, first.form)


def _fields_of(examples: Sequence[Any]) -> Tuple[str, List[str], List[list]]:
    """``(form, names, fields)`` of examples: the values of each field, by name.

    Raises:
        ValueError: no examples, or examples of different forms or fields.
    """
    if len(examples) == 0:
        raise ValueError('no examples to make a batch of')
    first = examples[0]
    if type(first) is dict:
        if any(type(example) is not dict or example.keys() != first.keys()
               for example in examples):
            raise ValueError('examples of a batch must be dicts with the '
                             'same keys')
        names = list(first)
        return 'dict', names, [[example[name] for example in examples]
                               for name in names]
    if type(first) is tuple:
        if any(type(example) is not tuple or len(example) != len(first)
               for example in examples):
            raise ValueError('examples of a batch must be tuples of one length')
        return ('tuple', [str(i) for i in range(len(first))],
                [list(values) for values in zip(*examples)])
    return 'single', ['0'], [list(examples)]


def column_of_values(values: List[Any]) -> Column:
    """One column from its values (see :meth:`ColumnarBatch.from_examples`)."""
    first = values[0]
    if all(type(value) is bytes for value in values):
        return VarColumn.from_values(values, 'bytes')
    if all(type(value) is str for value in values):
        return VarColumn.from_values(values, 'str')
    if isinstance(first, numpy.ndarray):
        if all(isinstance(value, numpy.ndarray) and value.shape == first.shape
               and value.dtype == first.dtype for value in values):
            if first.dtype != object:
                return numpy.stack(values)
        elif all(isinstance(value, numpy.ndarray) and value.ndim == 1
                 and value.dtype == first.dtype != object for value in values):
            return VarColumn.from_values(values, 'list', first.dtype)
    elif isinstance(first, (bool, int, float, numpy.number, numpy.bool_)):
        array = numpy.asarray(values)
        if array.dtype != object and array.ndim == 1:
            return array
    column = numpy.empty(len(values), dtype=object)
    column[:] = values
    return column


def _concatenate(parts: Sequence[Column]) -> Column:
    """Columns one after the other; of different kinds, as an ``object`` column.

    Parts of one column can differ in kind when they come from different
    sources (a row group with nulls gives ``object``, one without gives a
    ``VarColumn`` or numbers): the result then holds every row's value as
    a row read gives it (``bytes``, ``str``, arrays, NumPy scalars).
    """
    if all(isinstance(part, VarColumn) for part in parts):
        if len({part.kind for part in parts}) == 1:
            return concatenate_var(parts)
    elif not any(isinstance(part, VarColumn) for part in parts):
        if len({part.dtype == object for part in parts}) == 1:
            return numpy.concatenate(parts)
    values = [value for part in parts for value in part]
    column = numpy.empty(len(values), dtype=object)
    column[:] = values
    return column


def concatenate_var(parts: Sequence[VarColumn]) -> VarColumn:
    """Variable-length columns of one kind, one after the other, as one column."""
    offsets = [parts[0].offsets]
    end = parts[0].offsets[-1]
    for part in parts[1:]:
        offsets.append(part.offsets[1:] - part.offsets[0] + end)
        end = offsets[-1][-1] if len(offsets[-1]) else end
    values = numpy.concatenate([part.values[part.offsets[0]:part.offsets[-1]]
                                for part in parts])
    joined = numpy.concatenate(offsets)
    return VarColumn(joined - joined[0], values, parts[0].kind)


def _stacked(column: Column, padding=None) -> Column:
    """A list column as the 2-D array ``concat_examples`` makes of its rows, where it can.

    Args:
        column: Any column; only a ``'list'`` :class:`VarColumn` changes.
        padding: Pads rows of different lengths to the longest (``None``:
            such a column stays as it is).
    """
    if not isinstance(column, VarColumn) or column.kind != 'list':
        return column
    lengths = column.lengths()
    width = int(lengths.max()) if len(lengths) else 0
    values = column.values[column.offsets[0]:column.offsets[-1]]
    if (lengths == width).all():
        return values.reshape(len(lengths), width)
    if padding is None:
        return column
    padded = numpy.full((len(lengths), width), padding, dtype=values.dtype)
    padded[numpy.arange(width) < lengths[:, None]] = values
    return padded


def _describe(column: Column) -> str:
    if isinstance(column, VarColumn):
        return column.kind
    return '{}{}'.format(column.dtype, list(column.shape[1:]) or '')


class ColumnConverter(Converter):
    """Chainer converter for batches from columnar datasets (and any other).

    A :class:`ColumnarBatch` becomes the structure Chainer's
    ``concat_examples`` makes of its rows (a dict, a tuple or one array),
    taken straight from its columns (:meth:`ColumnarBatch.arrays`): array
    columns, and list columns whose rows have one length (2-D), are sent
    to the device; other :class:`VarColumn` and ``object`` columns stay on
    the host (decode them in the dataset's transform, or in the model).
    Without ``padding``, a list column's rows may have one length in one
    batch (a 2-D array) and not in the next (a :class:`VarColumn`), as
    ``concat_examples`` stacks the first and fails on the second: give
    ``padding`` for lists of varying length, and every batch of them is a
    padded 2-D array.

    Any other batch (a list of examples) goes to ``concat_examples``,
    except what it cannot stack: examples with ``str`` or ``bytes`` values,
    and, without ``padding``, examples whose arrays differ in shape in a
    field (rows of a Parquet dataset on the row path, e.g. with the
    next-epoch cache).  Those are made columns first
    (:meth:`ColumnarBatch.from_examples`: 1-D arrays of different lengths
    a list column, other arrays of different shapes an ``object``
    column), as the columnar path delivers them, so a model gets the same
    arrays from either path.  Use it as the updater's and evaluator's
    ``converter``; it pickles, so it also works with ``forkserver``.

    Args:
        padding: Pads the rows of list columns of different lengths, as
            ``concat_examples`` pads them (``None``: such columns come as
            :class:`VarColumn`).
    """

    def __init__(self, padding=None):
        self.padding = padding

    def __call__(self, batch, device=None):
        if isinstance(batch, ColumnarBatch):
            return batch.arrays(device, self.padding)
        if len(batch):
            split = _fields_of(batch)  # (ValueError: mixed forms or fields)
            if _needs_columns(split[2], self.padding):
                return ColumnarBatch._of_fields(*split).arrays(device, self.padding)
        return concat_examples(batch, device, self.padding)


def _needs_columns(fields: List[list], padding) -> bool:
    """Whether examples go through columns rather than ``concat_examples``.

    Args:
        fields: Their values, field by field (:func:`_fields_of`).
        padding: The converter's padding: without it, arrays of different
            shapes in a field need columns too.

    Returns:
        ``True`` when a field holds ``str`` or ``bytes``, or, without
        ``padding``, arrays of different shapes.
    """
    for values in fields:
        if any(isinstance(value, (str, bytes)) for value in values):
            return True
        head = values[0]
        if padding is None and isinstance(head, numpy.ndarray) and any(
                not isinstance(value, numpy.ndarray) or value.shape != head.shape
                for value in values):
            return True
    return False


#: The converter for columnar batches (see :class:`ColumnConverter`).
concat_columns = ColumnConverter()
