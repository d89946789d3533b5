"""Checks of a staging set-up made once, when an iterator is built.

Each looks at a few examples only (:func:`.discovery.sample_indices`), so
that building an iterator over 1.28 million examples stays fast.
"""
import os
from typing import List, Optional

from chainer_prefetch.staging import source_ops
from chainer_prefetch.staging.dataset_files import DatasetFiles
from chainer_prefetch.staging.discovery import sample_indices


def sampled_paths(files: DatasetFiles, length: int) -> List[str]:
    """The plain file paths (not Parquet row groups) of a few examples."""
    paths = []
    for index in sample_indices(length):
        paths.extend(os.path.abspath(f) for f in files.files(index)
                     if isinstance(f, str))
    return paths


def source_root(paths: List[str]) -> Optional[str]:
    """The directory ``paths`` share (``None``: none but ``/``, or no paths)."""
    if not paths:
        return None
    root = os.path.commonpath([os.path.dirname(p) for p in paths])
    return None if root == os.path.dirname(root) else root


def check_apart(local_dir: str, root: Optional[str]) -> None:
    """Refuses a local directory that overlaps the dataset's directory.

    Copies made inside the dataset's own tree would be a second copy of the
    dataset on shared storage, and a dataset that lists its directory (one
    class per subdirectory) would find the staging directories as classes.

    Args:
        local_dir: The iterator's ``local_dir``.
        root: :func:`source_root` of the dataset's files.

    Raises:
        ValueError: they overlap (the message names both).
    """
    if root is None:
        return
    local = os.path.realpath(local_dir)
    source = os.path.realpath(root)
    if _within(local, source) or _within(source, local):
        raise ValueError(
            'local_dir {!r} overlaps the directory of the dataset\'s files '
            '({!r}): the copies would land in the dataset on shared storage '
            '(and a dataset listing its directory would find them); give a '
            'directory on the node\'s local disk, outside the dataset, e.g. '
            'under $TMPDIR'.format(local_dir, root))


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(os.path.join(directory, ''))


def missing_files(paths: List[str]) -> Optional[str]:
    """The first of ``paths`` if none of them exists, else ``None``."""
    if paths and not any(map(_exists, paths)):
        return paths[0]
    return None


def _exists(path: str) -> bool:
    try:
        source_ops.stat(path)
    except (OSError, ValueError):
        return False
    return True


def smallest_bytes(paths: List[str]) -> Optional[int]:
    """The size of the smallest existing file of ``paths`` (``None``: none)."""
    sizes = []
    for path in paths:
        try:
            sizes.append(source_ops.stat(path).st_size)
        except (OSError, ValueError):
            pass
    return min(sizes) if sizes else None
