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
each process keeps at most ``cache_row_groups`` row groups.

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
import contextlib
import errno
import glob
import hashlib
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy
import pyarrow
import pyarrow.ipc
import pyarrow.parquet
from chainer.dataset import DatasetMixin

from chainer_prefetch.errors import ParquetColumnError, ParquetFileError, ParquetSchemaError
from chainer_prefetch.staging.sources import DerivedFile

Paths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


class RowGroupFile(DerivedFile):
    """One row group of one Parquet file, with some columns, as an Arrow IPC file.

    Its virtual path is ``<file>.rg<index>.<columns digest>.arrow``.

    Args:
        origin: The Parquet file.
        row_group: The row group's index in the file.
        columns: The columns to keep.
    """

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

    def _column_chunks(self):
        metadata = self._metadata
        if metadata is None:
            metadata = self._metadata = _read_metadata(self.origin)
        group = metadata.row_group(self.row_group)
        wanted = set(self.columns)
        return group, [group.column(i) for i in range(group.num_columns)
                       if group.column(i).path_in_schema.split('.')[0] in wanted]

    def estimated_local_bytes(self, origin_stat) -> int:
        """The columns' uncompressed size in the footer (plus room for the IPC framing)."""
        _, chunks = self._column_chunks()
        return sum(chunk.total_uncompressed_size for chunk in chunks) + 4096

    def source_bytes(self, origin_stat) -> int:
        """The columns' compressed size: what reading the row group transfers."""
        _, chunks = self._column_chunks()
        return sum(chunk.total_compressed_size for chunk in chunks)

    def source_bytes_per_example(self, origin_stat) -> int:
        group, _ = self._column_chunks()
        return self.source_bytes(origin_stat) // max(1, group.num_rows)

    def load_from_origin(self) -> pyarrow.Table:
        """Reads and decodes the row group from the Parquet file."""
        return read_row_group(self.origin, self.row_group, self.columns)

    def write_local_form(self, content: pyarrow.Table, out) -> None:
        """Writes ``content`` as an uncompressed Arrow IPC file."""
        with pyarrow.ipc.new_file(out, content.schema) as writer:
            writer.write_table(content)


def read_row_group(path: str, row_group: int, columns: Sequence[str],
                   metadata=None) -> pyarrow.Table:
    """Reads one row group of a Parquet file.

    Args:
        path: The Parquet file.
        row_group: Index of the row group.
        columns: Columns to read.
        metadata: The file's ``FileMetaData`` if known (saves reading the
            footer again).

    Returns:
        The rows as an Arrow table.

    Raises:
        ParquetFileError: the file cannot be read or is corrupt.
    """
    try:
        parquet_file = pyarrow.parquet.ParquetFile(path, metadata=metadata)
        with parquet_file:
            return parquet_file.read_row_group(row_group, columns=list(columns))
    except (OSError, pyarrow.ArrowException, ValueError) as error:
        raise ParquetFileError('cannot read row group {} of {}: {}'.format(
            row_group, path, error)) from error


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
    """Rows of Parquet files as examples.

    Args:
        paths: Files, directories or glob patterns (see
            :func:`find_parquet_files`).
        columns: Columns to read, in this order; ``None`` for all.
        as_tuple: Return each example as a tuple in ``columns`` order instead
            of a dict.
        transform: Applied to each example (dict or tuple) before it is
            returned, in the worker processes (decode image bytes, map a label
            to an index, augment).  Must be picklable for ``forkserver``.
        cache_row_groups: Decoded row groups each process keeps.  Reading
            directly from the Parquet files with the
            :class:`~chainer_prefetch.datasets.RowGroupWindowOrderSampler`,
            use at least its ``window``: a smaller cache re-reads row groups.

    Staged by ``PrefetchMultiprocessIterator``, the local row-group files are
    bounded by the iterator's ``local_capacity`` (without it they grow to
    the decoded size of the dataset).

    Raises:
        ParquetFileError: a file is missing, truncated or corrupt.
        ParquetSchemaError: two files have different schemas.
        ParquetColumnError: a requested column does not exist.
    """

    def __init__(self, paths: Paths, columns: Optional[Sequence[str]] = None,
                 as_tuple: bool = False,
                 transform: Optional[Callable[[Any], Any]] = None,
                 cache_row_groups: int = 4):
        self.files = find_parquet_files(paths)
        if not self.files:
            raise ParquetFileError('no Parquet files in {}'.format(paths))
        self._metadata = [_read_metadata(path) for path in self.files]
        self.schema = _common_schema(self.files, self._metadata)
        self.columns = _check_columns(self.schema, columns)
        self.as_tuple = as_tuple
        self.transform = transform
        self.cache_row_groups = max(1, int(cache_row_groups))
        self.row_group_locations: List[Tuple[int, int]] = [
            (file_index, group)
            for file_index, metadata in enumerate(self._metadata)
            for group in range(metadata.num_row_groups)]
        self.row_group_sizes = numpy.array(
            [self._metadata[file_index].row_group(group).num_rows
             for file_index, group in self.row_group_locations],
            dtype=numpy.int64)
        self._row_group_ends = [int(end) for end in
                                numpy.cumsum(self.row_group_sizes)]
        self._row_group_files = {}
        self._locate: Optional[Callable[[str], str]] = None
        self._cache = collections.OrderedDict()

    @property
    def column_types(self) -> Dict[str, pyarrow.DataType]:
        """The Arrow type of each selected column."""
        return {name: self.schema.field(name).type for name in self.columns}

    def __len__(self) -> int:
        return self._row_group_ends[-1] if self._row_group_ends else 0

    def row_group_of(self, index: int) -> Tuple[int, int]:
        """The row group holding example ``index`` and the row within it.

        Raises:
            IndexError: ``index`` is out of range.
        """
        if not 0 <= index < len(self):
            raise IndexError('index {} out of range for {} rows'.format(
                index, len(self)))
        group = bisect.bisect_right(self._row_group_ends, index)
        start = self._row_group_ends[group] - int(self.row_group_sizes[group])
        return group, index - start

    def get_example(self, index: int):
        """Example ``index``: a dict (or tuple) of the selected columns, transformed."""
        group, row = self.row_group_of(int(index))
        columns = self._row_group_columns(group)
        values = [convert(column, row) for column, convert in columns]
        if self.as_tuple:
            example = tuple(values)
        else:
            example = dict(zip(self.columns, values))
        if self.transform is not None:
            example = self.transform(example)
        return example

    # ---- the staging protocol (chainer_prefetch.staging.dataset_files) ----

    def example_files(self, index: int) -> Tuple[RowGroupFile]:
        """The row group of example ``index`` as a derived file to stage."""
        group, _ = self.row_group_of(int(index))
        return (self._row_group_file(group),)

    def example_file_groups(self) -> numpy.ndarray:
        """For each example, its row group: the rows of one are staged as one item."""
        return numpy.repeat(numpy.arange(len(self.row_group_sizes)),
                            self.row_group_sizes)

    def with_file_locations(self, locate: Callable[[str], str]
                            ) -> 'ParquetDataset':
        """A view that reads each row group from ``locate(row_group_file)``.

        A local file that has gone (evicted by another process) raises
        ``FileNotFoundError`` naming it; the iterator's loader then reads
        the row from the Parquet file and counts it as read from shared
        storage.

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
            file_index, group_in_file = self.row_group_locations[group]
            derived = RowGroupFile(self.files[file_index], group_in_file,
                                   self.columns, self._metadata[file_index])
            self._row_group_files[group] = derived
        return derived

    def _row_group_columns(self, group: int):
        cached = self._cache.get(group)
        if cached is not None:
            with contextlib.suppress(KeyError):  # threads may race here
                self._cache.move_to_end(group)
            return cached
        table = self._read_row_group(group)
        cached = [(_single_chunk(table.column(name)),
                   _converter(self.schema.field(name).type))
                  for name in self.columns]
        self._cache[group] = cached
        while len(self._cache) > self.cache_row_groups:
            with contextlib.suppress(KeyError):
                self._cache.popitem(last=False)
        return cached

    def _read_row_group(self, group: int) -> pyarrow.Table:
        file_index, group_in_file = self.row_group_locations[group]
        if self._locate is not None:
            return _read_ipc(self._locate(self._row_group_file(group)))
        return read_row_group(self.files[file_index], group_in_file,
                              self.columns, self._metadata[file_index])

    def _clone(self) -> 'ParquetDataset':
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view._cache = collections.OrderedDict()
        return view

    def __getstate__(self):
        state = dict(self.__dict__)
        state['_cache'] = collections.OrderedDict()
        return state


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


def _single_chunk(column: pyarrow.ChunkedArray) -> pyarrow.Array:
    if column.num_chunks == 1:
        return column.chunk(0)
    return column.combine_chunks()


def _converter(data_type: pyarrow.DataType) -> Callable[[pyarrow.Array, int], Any]:
    """How to turn one value of a column into a Python/NumPy value."""
    if pyarrow.types.is_list(data_type) or pyarrow.types.is_large_list(
            data_type):
        return _list_as_array
    return _as_python


def _list_as_array(column: pyarrow.Array, row: int):
    value = column[row]
    if not value.is_valid:
        return None
    return value.values.to_numpy(zero_copy_only=False)


def _as_python(column: pyarrow.Array, row: int):
    return column[row].as_py()


def _read_metadata(path: str):
    try:
        return pyarrow.parquet.read_metadata(path)
    except (OSError, pyarrow.ArrowException, ValueError) as error:
        raise ParquetFileError('{} is not a readable Parquet file: {}'.format(
            path, error)) from error


def _common_schema(files: List[str], metadata: List) -> pyarrow.Schema:
    schemas = [item.schema.to_arrow_schema() for item in metadata]
    first = schemas[0].remove_metadata()
    for path, schema in zip(files[1:], schemas[1:]):
        if not schema.remove_metadata().equals(first):
            raise ParquetSchemaError(
                'schemas differ: {} has ({}) but {} has ({})'.format(
                    files[0], _describe(first), path, _describe(schema)))
    return first


def _describe(schema: pyarrow.Schema) -> str:
    return ', '.join('{}: {}'.format(field.name, field.type) for field in schema)


def _check_columns(schema: pyarrow.Schema,
                   columns: Optional[Sequence[str]]) -> Tuple[str, ...]:
    available = list(schema.names)
    if columns is None:
        return tuple(available)
    if isinstance(columns, str):
        columns = [columns]
    missing = [name for name in columns if name not in available]
    if missing:
        raise ParquetColumnError('no column {} in the Parquet files; available '
                                 'columns: {}'.format(', '.join(map(repr, missing)),
                                                      ', '.join(available)))
    return tuple(columns)
