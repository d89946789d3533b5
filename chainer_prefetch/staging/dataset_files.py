"""Which files each example of a dataset reads, and a view that reads them elsewhere.

Stage 2 of :class:`~chainer_prefetch.PrefetchMultiprocessIterator` copies the
files an example needs before stage 3 loads it, and stage 3 then loads the
example from the copies.  Both need to see through the dataset: this module
walks the tree of Chainer dataset wrappers down to the datasets that name
files, and builds a *located view* of the tree: the same datasets, the same
transforms, the same indices, but every file path passed through a function
``locate(source_path) -> path_to_read``.

Datasets understood without any help:

* :class:`chainer.datasets.LabeledImageDataset` and
  :class:`chainer.datasets.ImageDataset` (they name the files),
* :class:`chainer.datasets.SubDataset` (what ``split_dataset*`` and
  ``chainermn.scatter_dataset`` return): index remapping,
* :class:`chainer.datasets.ConcatenatedDataset`,
  :class:`chainer.datasets.TupleDataset`, :class:`chainer.datasets.DictDataset`,
* :class:`chainer.datasets.TransformDataset` and any other object (for example
  a user's :class:`chainer.dataset.DatasetMixin` such as the chainermn ImageNet
  example's ``PreprocessedDataset``) that keeps one or more of the datasets
  above in its attributes and reads example ``i`` of them for its own example
  ``i``.
* any other object that keeps its paths in attributes, one entry per
  example (:mod:`.discovery`); its located view is the dataset itself, and
  the loaders redirect its opens of staged files to the copies
  (:mod:`.open_watch`).

Custom datasets take part through a two-method protocol (plus one optional
method)::

    class MyDataset(chainer.dataset.DatasetMixin):
        def example_files(self, i):
            '''Paths of the files that ``self[i]`` reads.'''
            return [self.paths[i]]

        def with_file_locations(self, locate):
            '''A copy of this dataset that reads ``locate(p)`` for every
            path ``p`` that ``example_files`` names.'''
            clone = copy.copy(self)
            clone.paths = [locate(p) for p in self.paths]
            return clone

        def example_file_groups(self):      # optional
            '''For each example, the number of the group of examples that
            read the same files (e.g. the rows of one Parquet row group),
            as an integer array; they are staged and evicted as one item.'''
            return self.row_group_of_rows

``example_files`` may name plain paths or
:class:`~chainer_prefetch.staging.sources.Source` objects (a
:class:`~chainer_prefetch.staging.sources.DerivedFile` for a local file made
in another form).  It must be a pure query: the iterator calls it as often as
it needs, from any thread.

A dataset with no files anywhere in its tree resolves to ``None``: the
iterator then needs no staging at all.
"""
import abc
import bisect
import copy
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy
from chainer.dataset import DatasetMixin
from chainer.datasets import (
    ConcatenatedDataset,
    DictDataset,
    ImageDataset,
    LabeledImageDataset,
    SubDataset,
    TupleDataset,
)

from chainer_prefetch.staging.discovery import PathField, find_path_attributes
from chainer_prefetch.staging.sources import Source, as_source

Locate = Callable[[str], str]


class DatasetFiles(abc.ABC):
    """The files of a dataset tree, example by example.

    Obtain one with :func:`resolve_dataset_files`.
    """

    @abc.abstractmethod
    def files(self, index: int) -> Tuple[str, ...]:
        """What example ``index`` reads: paths (as the dataset opens them) or sources."""

    def item_of(self) -> Optional[numpy.ndarray]:
        """For each example, the item it belongs to, or ``None`` if each is its own.

        An item is what is staged and evicted as one: examples that read the
        same files (the rows of a Parquet row group) share one.
        """
        return None

    def by_redirection(self) -> bool:
        """Whether the located view reads some copies only because the
        loaders redirect the dataset's ``open`` calls (paths found in its
        attributes, :mod:`.discovery`): the view is then the dataset itself."""
        return False

    @abc.abstractmethod
    def located(self, locate: Locate):
        """The dataset tree, rebuilt to read ``locate(path)`` instead of ``path``.

        Args:
            locate: Maps a source path (one that :meth:`files` returns) to the
                path the view reads instead.  Must be picklable when the
                worker processes are started by ``forkserver`` or ``spawn``.
        """


class ItemSources:
    """``sources_of(item)``: the sources of one item of a dataset's files.

    Args:
        files: The dataset's files.
        item_of: For each example, its item (``None``: each example is one).
    """

    def __init__(self, files: DatasetFiles, item_of: Optional[numpy.ndarray]):
        self._files = files
        self._first_example = None
        if item_of is not None and len(item_of):
            items, first = numpy.unique(item_of, return_index=True)
            self._first_example = numpy.full(int(items.max()) + 1, -1,
                                             dtype=numpy.int64)
            self._first_example[items] = first

    def __call__(self, item: int) -> List[Source]:
        index = item if self._first_example is None else int(
            self._first_example[item])
        return [as_source(named) for named in self._files.files(index)]


class ItemLocalBytes:
    """``item_local_bytes(item)``: an item's local forms as estimated before they are made.

    The sum of its sources' ``estimated_local_bytes``, what the local store
    reserves to make them; remembered per item, and each origin stat'ed
    once (the row groups of a Parquet file share theirs).  Asked for the
    items training reaches, not all at once.  A source whose size cannot be
    known (its origin unreadable) counts 0: its copy fails and names it.

    Args:
        sources_of: The sources of each item.
    """

    def __init__(self, sources_of: ItemSources):
        self._sources_of = sources_of
        self._bytes: Dict[int, int] = {}
        self._stats: Dict[str, os.stat_result] = {}

    def __call__(self, item: int) -> int:
        known = self._bytes.get(item)
        if known is None:
            known = self._bytes[item] = sum(
                self._estimate(source) for source in self._sources_of(item))
        return known

    def _estimate(self, source: Source) -> int:
        try:
            origin_stat = self._stats.get(source.origin)
            if origin_stat is None:
                origin_stat = self._stats[source.origin] = source.stat_origin()
            return source.estimated_local_bytes(origin_stat)
        except (OSError, ValueError):  # (the copy reports it)
            return 0


def resolve_dataset_files(dataset) -> Optional[DatasetFiles]:
    """Finds the files behind ``dataset``.

    Args:
        dataset: Any dataset; see the module docstring for what is understood.

    Returns:
        A :class:`DatasetFiles`, or ``None`` when the dataset reads no files
        that this module can see.
    """
    return _resolve(dataset, set())


def _resolve(dataset, visiting) -> Optional[DatasetFiles]:
    if id(dataset) in visiting:
        return None
    visiting = visiting | {id(dataset)}
    if callable(getattr(dataset, 'example_files', None)) and callable(
            getattr(dataset, 'with_file_locations', None)):
        return _ProtocolFiles(dataset)
    if isinstance(dataset, LabeledImageDataset):
        return _ListedFiles(dataset, '_pairs', _path_of_pair, _replace_pair_path)
    if isinstance(dataset, ImageDataset):
        return _ListedFiles(dataset, '_paths', _path_of_path, _replace_path)
    if isinstance(dataset, SubDataset):
        inner = _resolve(dataset._dataset, visiting)
        return None if inner is None else _SubsetFiles(dataset, inner)
    if isinstance(dataset, ConcatenatedDataset):
        parts = [_resolve(part, visiting) for part in dataset._datasets]
        if not any(parts):
            return None
        return _ConcatenatedFiles(dataset, parts)
    if isinstance(dataset, (TupleDataset, DictDataset)):
        members = _items(dataset._datasets)
        resolved = {key: _resolve(member, visiting) for key, member in members}
        resolved = {key: files for key, files in resolved.items() if files}
        if not resolved:
            return None
        return _ZippedFiles(dataset, '_datasets', resolved)
    return _resolve_attributes(dataset, visiting)


# Entry accessors of the image datasets; module-level so views pickle.
def _path_of_pair(pair):
    return pair[0]


def _replace_pair_path(pair, path):
    return (path,) + tuple(pair[1:])


def _path_of_path(path):
    return path


def _replace_path(old_path, path):
    return path


def _items(members):
    if isinstance(members, dict):
        return list(members.items())
    return list(enumerate(members))


def _is_dataset(value) -> bool:
    return isinstance(value, (DatasetMixin, TupleDataset, DictDataset)) or (
        callable(getattr(value, 'example_files', None)))


def _resolve_attributes(dataset, visiting) -> Optional[DatasetFiles]:
    """A wrapper that keeps inner datasets as attributes and reads the same index."""
    try:
        attributes = vars(dataset)
    except TypeError:
        return None
    resolved = {}
    for name, value in attributes.items():
        if _is_dataset(value):
            files = _resolve(value, visiting)
            if files is not None:
                resolved[name] = files
    if resolved:
        return _WrapperFiles(dataset, resolved)
    fields = find_path_attributes(dataset)
    return _DiscoveredFiles(dataset, fields) if fields else None


class _DiscoveredFiles(DatasetFiles):
    """A dataset that keeps its paths in attributes (:mod:`.discovery`)."""

    def __init__(self, dataset, fields: Tuple[PathField, ...]):
        self._dataset = dataset
        self._fields = fields

    def files(self, index):
        return tuple(field.path(self._dataset, index) for field in self._fields)

    def by_redirection(self):
        return True

    def located(self, locate):
        return self._dataset  # the loaders redirect its opens


class LearnedFiles(DatasetFiles):
    """The files the loaders saw each example of a dataset open.

    For a dataset that builds its paths inside ``get_example`` (and names
    them nowhere else): what its first epoch opened is staged from then on,
    and the loaders redirect its opens to the copies.

    Args:
        dataset: The dataset (the iterator's, at the top of the tree).
        learned: ``{index: paths}``; an index not in it reads no file.
    """

    def __init__(self, dataset, learned: Dict[int, Tuple[str, ...]]):
        self._dataset = dataset
        self._learned = learned

    def files(self, index):
        return self._learned.get(int(index), ())

    def by_redirection(self):
        return True

    def located(self, locate):
        return self._dataset  # the loaders redirect its opens


class _ProtocolFiles(DatasetFiles):

    def __init__(self, dataset):
        self._dataset = dataset

    def files(self, index):
        return tuple(self._dataset.example_files(index))

    def located(self, locate):
        return self._dataset.with_file_locations(locate)

    def item_of(self):
        groups = getattr(self._dataset, 'example_file_groups', None)
        return None if groups is None else numpy.asarray(groups())


class _ListedFiles(DatasetFiles):
    """Chainer's image datasets: a list of entries naming a path under a root."""

    def __init__(self, dataset, list_attribute: str, path_of, replace_path):
        self._dataset = dataset
        self._list_attribute = list_attribute
        self._path_of = path_of
        self._replace_path = replace_path

    def files(self, index):
        entries = getattr(self._dataset, self._list_attribute)
        return (os.path.join(self._dataset._root, self._path_of(entries[index])),)

    def located(self, locate):
        view = copy.copy(self._dataset)
        # os.path.join('', p) == p: the located entries carry whole paths.
        view._root = ''
        setattr(view, self._list_attribute, _LocatedEntries(
            getattr(self._dataset, self._list_attribute), self._dataset._root,
            self._path_of, self._replace_path, locate))
        return view


class _LocatedEntries:
    """A read-only list of entries whose paths are mapped on access.

    Mapping lazily keeps the view as small as the original, however many
    examples the dataset has.
    """

    def __init__(self, entries: Sequence, root: str, path_of, replace_path,
                 locate: Locate):
        self._entries = entries
        self._root = root
        self._path_of = path_of
        self._replace_path = replace_path
        self._locate = locate

    def __len__(self):
        return len(self._entries)

    def __getitem__(self, index):
        entry = self._entries[index]
        source = os.path.join(self._root, self._path_of(entry))
        return self._replace_path(entry, self._locate(source))


class _SubsetFiles(DatasetFiles):

    def __init__(self, subset: SubDataset, inner: DatasetFiles):
        self._subset = subset
        self._inner = inner

    def by_redirection(self):
        return self._inner.by_redirection()

    def files(self, index):
        subset = self._subset
        if not 0 <= index < len(subset):
            raise IndexError('dataset index out of range: {}'.format(index))
        inner_index = subset._start + index
        if subset._order is not None:
            inner_index = subset._order[inner_index]
        return self._inner.files(int(inner_index))

    def located(self, locate):
        view = copy.copy(self._subset)
        view._dataset = self._inner.located(locate)
        return view

    def item_of(self):
        inner = self._inner.item_of()
        if inner is None:
            return None
        subset = self._subset
        positions = numpy.arange(subset._start, subset._start + len(subset))
        if subset._order is not None:
            positions = numpy.asarray(subset._order)[positions]
        return inner[positions]


class _ConcatenatedFiles(DatasetFiles):

    def __init__(self, dataset: ConcatenatedDataset,
                 parts: List[Optional[DatasetFiles]]):
        self._dataset = dataset
        self._parts = parts
        self._starts = []
        start = 0
        for part in dataset._datasets:
            self._starts.append(start)
            start += len(part)

    def by_redirection(self):
        return any(p.by_redirection() for p in self._parts if p is not None)

    def files(self, index):
        which = bisect.bisect_right(self._starts, index) - 1
        part = self._parts[which]
        return () if part is None else part.files(index - self._starts[which])

    def located(self, locate):
        view = copy.copy(self._dataset)
        view._datasets = tuple(
            original if part is None else part.located(locate)
            for original, part in zip(self._dataset._datasets, self._parts))
        return view

    def item_of(self):
        parts = [None if part is None else part.item_of()
                 for part in self._parts]
        if all(items is None for items in parts):
            return None
        joined, offset = [], 0
        for original, items in zip(self._dataset._datasets, parts):
            if items is None:
                items = numpy.arange(len(original))
            joined.append(numpy.asarray(items, dtype=numpy.int64) + offset)
            if len(joined[-1]):
                offset = int(joined[-1].max()) + 1
        return numpy.concatenate(joined)


class _ZippedFiles(DatasetFiles):
    """Datasets read at the same index side by side (TupleDataset, DictDataset)."""

    def __init__(self, dataset, attribute: str, members: Dict):
        self._dataset = dataset
        self._attribute = attribute
        self._members = members

    def by_redirection(self):
        return any(m.by_redirection() for m in self._members.values())

    def files(self, index):
        found = []
        for member in self._members.values():
            found.extend(member.files(index))
        return tuple(found)

    def item_of(self):
        if len(self._members) != 1:
            return None  # the files of several members are staged together
        return next(iter(self._members.values())).item_of()

    def located(self, locate):
        view = copy.copy(self._dataset)
        originals = getattr(self._dataset, self._attribute)
        if isinstance(originals, dict):
            located = dict(originals)
        else:
            located = list(originals)
        for key, member in self._members.items():
            located[key] = member.located(locate)
        if isinstance(originals, tuple):
            located = tuple(located)
        setattr(view, self._attribute, located)
        return view


class _WrapperFiles(_ZippedFiles):
    """A wrapper (TransformDataset, a user's DatasetMixin) whose attributes are datasets."""

    def __init__(self, dataset, members: Dict):
        super().__init__(dataset, None, members)

    def located(self, locate):
        view = copy.copy(self._dataset)
        for name, member in self._members.items():
            setattr(view, name, member.located(locate))
        return view
