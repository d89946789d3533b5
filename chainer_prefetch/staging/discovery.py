"""Finding the file paths a user's dataset keeps, without any code in it.

The datasets people write keep their paths the way Chainer's own image
datasets do: an attribute with one entry per example, each entry a path
(``str`` or :class:`os.PathLike`) or a tuple, list or dict one of whose
fields is a path (``(path, label)`` pairs), the paths whole or relative to a
root directory kept in another attribute.  An image and its mask are two
such attributes.  :func:`find_path_attributes` finds them by looking at a
few entries only (construction stays fast at ImageNet's 1.28 million
examples); the paths it finds are checked to name existing files.

What is found says which files each example reads, so stage 2 can copy them
ahead.  The dataset itself is not changed: the loaders read the copies by
redirecting the dataset's own ``open`` calls (see :mod:`.open_watch`).
"""
import os
import stat
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import numpy

from chainer_prefetch.staging import source_ops

SAMPLE = 8
"""Entries looked at per attribute (spread over the whole sequence)."""


class PathField(NamedTuple):
    """One attribute of a dataset that names a file per example.

    Attributes:
        attribute: The attribute's name (``'paths'``, ``'_pairs'``).
        field: Where the path is in an entry: ``None`` (the entry is the
            path), an integer (tuple or list position) or a dict key.
        root: The directory relative paths are joined to (``''``: none).
    """
    attribute: str
    field: Any
    root: str

    def path(self, dataset, index: int) -> str:
        """The path of example ``index`` as the dataset opens it."""
        return os.path.join(self.root, _path_in(
            getattr(dataset, self.attribute)[index], self.field))


def _path_in(entry, field) -> str:
    """The path at ``field`` of ``entry`` (``None``: the entry itself)."""
    return os.fsdecode(os.fspath(entry if field is None else entry[field]))


def sample_indices(length: int, count: int = SAMPLE) -> List[int]:
    """Up to ``count`` distinct indices spread over ``range(length)``."""
    if length <= 0:
        return []
    return sorted(set(numpy.linspace(0, length - 1, min(count, length))
                      .astype(int).tolist()))


def find_path_attributes(dataset) -> Tuple[PathField, ...]:
    """The attributes of ``dataset`` that name one existing file per example.

    Args:
        dataset: Any object with ``__len__`` and attributes (``vars``).

    Returns:
        The fields found, in attribute order; empty when there are none.
    """
    try:
        attributes = vars(dataset)
        length = len(dataset)
    except TypeError:
        return ()
    if length == 0:
        return ()
    roots = _root_candidates(attributes)
    indices = sample_indices(length)
    found = []
    for name, value in attributes.items():
        if not _is_sequence(value) or _length(value) != length:
            continue
        field = _path_field(value, indices)
        if field is _NONE:
            continue
        root = _root_of(value, field, indices, roots)
        if root is not None:
            found.append(PathField(name, field, root))
    return tuple(found)


_NONE = object()


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike, numpy.str_))


def _is_sequence(value) -> bool:
    if isinstance(value, numpy.ndarray):
        return value.ndim == 1 and value.dtype.kind in 'UO'
    return isinstance(value, (list, tuple))


def _length(value) -> Optional[int]:
    try:
        return len(value)
    except TypeError:
        return None


def _field_of(entry):
    """Where the path is in ``entry``, or ``_NONE``."""
    if _is_path(entry):
        return None
    if isinstance(entry, (tuple, list)):
        return next((i for i, v in enumerate(entry) if _is_path(v)), _NONE)
    if isinstance(entry, dict):
        return next((k for k, v in entry.items() if _is_path(v)), _NONE)
    return _NONE


def _path_field(sequence: Sequence, indices: List[int]):
    """The path's place, the same in every sampled entry, or ``_NONE``."""
    fields = {repr(_field_of(sequence[i])) for i in indices}
    if len(fields) != 1:
        return _NONE
    return _field_of(sequence[indices[0]])


def _root_candidates(attributes) -> List[str]:
    """String attributes naming directories: roots relative paths may hang from."""
    return [os.fsdecode(os.fspath(v)) for v in attributes.values()
            if _is_path(v) and os.path.isdir(os.fspath(v))]


def _root_of(sequence, field, indices: List[int],
             roots: List[str]) -> Optional[str]:
    """The root under which every sampled path is a file (``''``: the paths
    as they are), or ``None`` when none fits."""
    paths = [_path_in(sequence[i], field) for i in indices]
    for root in [''] + roots:
        if all(_is_file(os.path.join(root, p)) for p in paths):
            return root
    return None


def _is_file(path: str) -> bool:
    """``os.path.isfile``, counted as a ``stat`` of shared storage."""
    try:
        return stat.S_ISREG(source_ops.stat(path).st_mode)
    except (OSError, ValueError):
        return False
