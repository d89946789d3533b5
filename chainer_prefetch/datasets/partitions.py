"""Hive/Spark partition columns: ``key=value`` directories as typed columns.

Spark and Hive write a table partitioned by some columns as directories
``root/year=2020/country=KR/part-*.parquet`` and leave those columns out of
the files.  :func:`discover_partitions` reads them back from the paths:

* the keys are the ``key=value`` directory names between the dataset's base
  directory and each file, in order; every file must have the same keys;
* values are URL-unquoted (Hive escapes ``/``, ``=`` and others as ``%XX``);
  ``__HIVE_DEFAULT_PARTITION__`` (Hive's name for null) is ``None``;
* each column's type is inferred from all its values, as Spark infers
  numbers: 64-bit integers if every value is one, else 64-bit floats if
  every value is a number, else strings (dates and timestamps too, which
  Spark would infer); ``types`` overrides the inference per key.
"""
import os
import re
import urllib.parse
from typing import List, Mapping, Optional, Sequence, Tuple

import pyarrow

from chainer_prefetch.datasets.arrow_columns import as_numpy_scalar
from chainer_prefetch.errors import ParquetSchemaError

#: Hive's directory value for a null partition value.
NULL_VALUE = '__HIVE_DEFAULT_PARTITION__'

_INTEGER = re.compile(r'[+-]?\d+\Z')


class Partitions:
    """The partition columns of a dataset's files.

    Attributes:
        names: The partition keys, in directory order.
        types: The Arrow type of each.
        values: For each file, its values as the path gives them (Python
            ``int``, ``float``, ``str`` or ``None``), one per key.
    """

    def __init__(self, names: Sequence[str], types: Sequence[pyarrow.DataType],
                 values: Sequence[Tuple]):
        self.names = tuple(names)
        self.types = tuple(types)
        self.values = [tuple(file_values) for file_values in values]

    def fields(self) -> List[pyarrow.Field]:
        """The partition columns as schema fields."""
        return [pyarrow.field(name, data_type)
                for name, data_type in zip(self.names, self.types)]

    def value(self, file_index: int, name: str):
        """The value of partition column ``name`` for file ``file_index``, as a row gives it.

        A number comes as a NumPy scalar of the column's type, as the files'
        numbers do (:func:`~chainer_prefetch.datasets.arrow_columns.as_numpy_scalar`).
        """
        column = self.names.index(name)
        return as_numpy_scalar(self.values[file_index][column], self.types[column])


def base_directory(paths, files: Sequence[str], given=None) -> Optional[str]:
    """The directory partition keys are read below.

    Args:
        paths: What the user passed (a path or a list of them).
        files: The files found (absolute paths).
        given: The directory the user named for it (``partition_base``,
            as Spark's ``basePath``), or ``None``.

    Returns:
        ``given`` when given; else ``paths`` itself when it is one
        directory; else the deepest directory that holds every file;
        ``None`` without files.

    Raises:
        ValueError: ``given`` is not a directory, or does not hold a file
            (the first such file is named).
    """
    if given is not None:
        base = os.path.abspath(os.fspath(given))
        if not os.path.isdir(base):
            raise ValueError('partition_base {} is not a directory'.format(base))
        if files:  # spelled as the files are (symbolic links)
            base = _directory_above(files[0], base) or base
        outside = [path for path in files
                   if os.path.commonpath([base, os.path.abspath(path)]) != base]
        if outside:
            raise ValueError('partition_base {} does not hold {}'.format(
                base, outside[0]))
        return base
    if isinstance(paths, (str, os.PathLike)) and os.path.isdir(paths):
        return os.path.abspath(os.fspath(paths))
    if not files:
        return None
    return os.path.commonpath([os.path.dirname(path) for path in files])


def _directory_above(path: str, directory: str) -> Optional[str]:
    """The directory above ``path`` that is ``directory``, as ``path`` spells it, or ``None``."""
    above = os.path.dirname(os.path.abspath(path))
    while True:
        if os.path.samefile(above, directory):
            return above
        parent = os.path.dirname(above)
        if parent == above:
            return None
        above = parent


def discover_partitions(files: Sequence[str], base: Optional[str],
                        types: Optional[Mapping[str, pyarrow.DataType]] = None
                        ) -> Partitions:
    """Reads the partition columns of ``files`` from their directories.

    Args:
        files: Absolute paths of the Parquet files.
        base: The directory under which ``key=value`` names count.
        types: Arrow types to use instead of inferring them, by key.

    Returns:
        The :class:`Partitions` (no columns when the paths have none).

    Raises:
        ParquetSchemaError: two files have different keys (naming both), a
            key is repeated, or a value cannot be read as the given type.
    """
    pairs = [_key_values(path, base) for path in files]
    if not files:
        return Partitions((), (), [])
    keys = [key for key, _ in pairs[0]]
    if len(set(keys)) != len(keys):
        raise ParquetSchemaError('partition key repeated in the path of {}: {}'
                                 .format(files[0], ', '.join(keys)))
    for path, found in zip(files[1:], pairs[1:]):
        other = [key for key, _ in found]
        if other != keys:
            raise ParquetSchemaError(
                'partition directories differ: {} is under {} but {} is under '
                '{}'.format(files[0], _describe_keys(keys), path,
                            _describe_keys(other)))
    raw = [[value for _, value in found] for found in pairs]
    types = dict(types or {})
    unknown = set(types) - set(keys)
    if unknown:
        raise ParquetSchemaError('types given for {} but the partition keys are '
                                 '{}'.format(', '.join(sorted(unknown)),
                                             _describe_keys(keys)))
    column_types = []
    for column, key in enumerate(keys):
        values = [file_values[column] for file_values in raw]
        column_types.append(types.get(key) or _infer_type(values))
    converted = [[_convert(value, data_type, key, path) for value, data_type, key
                  in zip(file_values, column_types, keys)]
                 for file_values, path in zip(raw, files)]
    return Partitions(keys, column_types, converted)


def _key_values(path: str, base: Optional[str]) -> List[Tuple[str, Optional[str]]]:
    directory = os.path.dirname(path)
    relative = '' if base is None else os.path.relpath(directory, base)
    if relative in ('', os.curdir) or relative.startswith(os.pardir):
        return []
    found = []
    for name in relative.split(os.sep):
        key, equals, value = name.partition('=')
        if not equals or not key:
            continue
        value = urllib.parse.unquote(value)
        found.append((urllib.parse.unquote(key),
                      None if value == NULL_VALUE else value))
    return found


def _describe_keys(keys: Sequence[str]) -> str:
    return '/'.join('{}=...'.format(key) for key in keys) or 'no key=value directory'


def _infer_type(values: Sequence[Optional[str]]) -> pyarrow.DataType:
    present = [value for value in values if value is not None]
    if not present:
        return pyarrow.string()
    if all(_INTEGER.match(value) for value in present):
        return pyarrow.int64()
    try:
        for value in present:
            float(value)
    except ValueError:
        return pyarrow.string()
    return pyarrow.float64()


def _convert(value: Optional[str], data_type: pyarrow.DataType, key: str,
             path: str):
    if value is None:
        return None
    try:
        return pyarrow.scalar(value).cast(data_type).as_py()
    except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError) as error:
        raise ParquetSchemaError('partition value {}={!r} of {} is not of type {}: {}'
                                 .format(key, value, path, data_type, error)
                                 ) from error

