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

The dataset's parts have modules of their own: the row group as a file to
stage, and its decoding (:mod:`~chainer_prefetch.datasets.row_group_source`);
the reads of its bytes (:mod:`~chainer_prefetch.datasets.byte_ranges`);
Arrow columns as NumPy and Python values
(:mod:`~chainer_prefetch.datasets.arrow_columns`); and the partition
columns (:mod:`~chainer_prefetch.datasets.partitions`).
"""
import bisect
import collections
import glob
import os
import threading
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import numpy
import pyarrow
from chainer.dataset import DatasetMixin

from chainer_prefetch.columnar import ColumnarBatch, VarColumn, split_by_group
from chainer_prefetch.datasets.arrow_columns import arrow_indices, column_of_array
from chainer_prefetch.datasets.byte_ranges import map_in_threads
from chainer_prefetch.datasets.partitions import (
    Partitions,
    base_directory,
    discover_partitions,
)
from chainer_prefetch.datasets.row_group_source import (
    DecodedRowGroup,
    RowGroupFile,
    read_ipc_file,
    read_metadata,
    read_row_group,
    return_freed_memory_at_once,
    row_group_label,
)
from chainer_prefetch.errors import (
    ParquetColumnError,
    ParquetFileError,
    ParquetSchemaError,
    example_load_error,
)

Paths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

#: The footers of a dataset's files are read this many at a time: on
#: shared storage each read waits its latency, and reading them at once
#: overlaps the waits.
FOOTER_THREADS = 16


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
        self._metadata = map_in_threads(read_metadata, self.files,
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
        :class:`~chainer_prefetch.datasets.DecodedRowGroup`.
        A local form that has gone (evicted by another process, or from
        memory) raises ``FileNotFoundError`` naming it; the iterator's loader
        then reads the row from the Parquet file and counts it as read from
        shared storage.

        Called in the process that stages (the training process), which from
        then on decodes row groups one after the other: Arrow's allocator
        there is told to give freed memory back at once
        (:func:`~chainer_prefetch.datasets.row_group_source.return_freed_memory_at_once`),
        so that it does not hold several row groups' memory.
        """
        return_freed_memory_at_once()
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
            table = read_ipc_file(local)
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
