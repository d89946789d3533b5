"""The iterator with the datasets users write themselves (real files, real
loader processes): staged with no code in the dataset, or told why not.

The shapes: a list of paths opened with PIL; ``(path, label)`` pairs under
a root; two path lists (an image and its mask); a NumPy array of paths;
``pathlib.Path`` entries; a dict per example; a ChainerCV-like sliceable
dataset whose getters are methods bound to it (chainercv 0.13.1 does not
build on Python 3.11 as shipped, so its shape is reproduced here); each
also under ``SubDataset`` (what ``chainermn.scatter_dataset`` returns) and
``TransformDataset``.  A local copy is proven read by removing the sources
after the first epoch (``recheck_sources='never'``): a read of shared
storage would then fail.
"""
import copy
import glob
import os
import pathlib
import shutil
import time
import warnings

import chainer
import numpy
import pytest
from chainer.datasets import SubDataset, TransformDataset
from PIL import Image

from chainer_prefetch import PrefetchMultiprocessIterator, StagingWarning

N = 12


def _write_images(directory, n=N, prefix='img'):
    os.makedirs(directory, exist_ok=True)
    names = []
    for i in range(n):
        name = '{}{:03d}.png'.format(prefix, i)
        Image.fromarray(numpy.full((4, 4, 3), i, dtype=numpy.uint8)).save(
            os.path.join(directory, name))
        names.append(name)
    return names


def _read(path):
    with Image.open(path) as image:
        return int(numpy.asarray(image)[0, 0, 0])


class PathList(chainer.dataset.DatasetMixin):
    """The dataset everyone writes: a list of paths, opened with PIL."""

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def get_example(self, i):
        return _read(self.paths[i])


class PairsUnderRoot(chainer.dataset.DatasetMixin):
    def __init__(self, pairs, root):
        self.pairs = pairs
        self.root = root

    def __len__(self):
        return len(self.pairs)

    def get_example(self, i):
        name, label = self.pairs[i]
        return _read(os.path.join(self.root, name)) + 0 * label


class ImageAndMask(chainer.dataset.DatasetMixin):
    def __init__(self, images, masks):
        self.images = images
        self.masks = masks

    def __len__(self):
        return len(self.images)

    def get_example(self, i):
        return _read(self.images[i]) + 100 * _read(self.masks[i])


class DictEntries(chainer.dataset.DatasetMixin):
    def __init__(self, entries):
        self.entries = entries

    def __len__(self):
        return len(self.entries)

    def get_example(self, i):
        return _read(self.entries[i]['file'])


class BoundGetters(chainer.dataset.DatasetMixin):
    """ChainerCV's sliceable shape: getters kept as bound methods."""

    def __init__(self, paths):
        self.img_paths = paths
        self._getters = [(self._get_image, 'img')]

    def __len__(self):
        return len(self.img_paths)

    def _get_image(self, i):
        return _read(self.img_paths[i])

    def get_example(self, i):
        return self._getters[0][0](i)


def _iterate(dataset, local_dir, epochs, after_first=None, **options):
    """Values of ``epochs`` epochs in index order; ``after_first()`` runs
    once the first epoch is done."""
    options = dict(dict(n_processes=2), **options)
    iterator = PrefetchMultiprocessIterator(
        dataset, 4, shuffle=False, local_dir=str(local_dir),
        recheck_sources='never', n_copy_ahead=2, **options)
    values = []
    try:
        for epoch in range(epochs):
            while True:
                values.extend(iterator.next())
                if iterator.is_new_epoch:
                    break
            if epoch == 0 and after_first is not None:
                after_first()
    finally:
        iterator.finalize()
    return values, iterator.stats


def _shapes(tmp_path):
    """name -> (dataset, expected values, files per example)."""
    data = tmp_path / 'data'
    names = _write_images(str(data))
    masks = _write_images(str(data / 'masks'), prefix='mask')
    paths = [str(data / n) for n in names]
    mask_paths = [str(data / 'masks' / m) for m in masks]
    values = list(range(N))
    return {
        'list': (PathList(paths), values, 1),
        'pairs_under_root': (PairsUnderRoot([(n, 0) for n in names],
                                            str(data)), values, 1),
        'image_and_mask': (ImageAndMask(paths, mask_paths),
                           [101 * v for v in values], 2),
        'numpy_array': (PathList(numpy.array(paths)), values, 1),
        'pathlib': (PathList([pathlib.Path(p) for p in paths]), values, 1),
        'dict_entries': (DictEntries([{'file': p, 'label': 0}
                                      for p in paths]), values, 1),
        'bound_getters': (BoundGetters(paths), values, 1),
    }


SHAPES = ['list', 'pairs_under_root', 'image_and_mask', 'numpy_array',
          'pathlib', 'dict_entries', 'bound_getters']


@pytest.mark.parametrize('wrapper', ['plain', 'subdataset', 'transform'])
@pytest.mark.parametrize('shape', SHAPES)
def test_a_users_dataset_is_staged_and_read_locally(tmp_path, shape, wrapper):
    dataset, expected, files_each = _shapes(tmp_path)[shape]
    if wrapper == 'subdataset':
        dataset = SubDataset(dataset, 4, N)
        expected = expected[4:]
    elif wrapper == 'transform':
        dataset = TransformDataset(dataset, lambda v: v + 1000)
        expected = [v + 1000 for v in expected]
    with warnings.catch_warnings():
        warnings.simplefilter('error', StagingWarning)
        values, stats = _iterate(
            dataset, tmp_path / 'local', 2,
            after_first=lambda: shutil.rmtree(str(tmp_path / 'data')))
    assert values == expected * 2
    assert stats['files_copied'] == files_each * len(expected)
    assert stats['by_epoch'][1]['examples_from_source'] == 0
    assert stats['by_epoch'][1]['examples_from_local'] == len(expected)
    assert stats['staging_warnings'] == []


class LocatedCopyKeepsBoundGetter(BoundGetters):
    """The documented protocol, implemented the way ChainerCV's datasets
    make it go wrong: the copy's getter is still bound to the original."""

    def example_files(self, i):
        return [self.img_paths[i]]

    def with_file_locations(self, locate):
        clone = copy.copy(self)
        clone.img_paths = [locate(p) for p in self.img_paths]
        return clone


def test_a_located_copy_with_bound_getters_reads_the_copies(tmp_path):
    paths = [str(tmp_path / 'data' / n)
             for n in _write_images(str(tmp_path / 'data'))]
    with warnings.catch_warnings():
        warnings.simplefilter('error', StagingWarning)
        values, stats = _iterate(
            LocatedCopyKeepsBoundGetter(paths), tmp_path / 'local', 2,
            after_first=lambda: shutil.rmtree(str(tmp_path / 'data')))
    assert values == list(range(N)) * 2
    assert stats['by_epoch'][1]['examples_from_local'] == N


class Reversed(chainer.dataset.DatasetMixin):
    """A wrapper that reads another index of its dataset than its own."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        return self.base[len(self.base) - 1 - i]


def test_a_wrapper_reading_other_indices_is_warned_and_counted(tmp_path):
    paths = [str(tmp_path / 'data' / n)
             for n in _write_images(str(tmp_path / 'data'))]
    with pytest.warns(StagingWarning, match=r'Reversed: example \d+ opened .*'
                      r'img\d+\.png, which was not staged for it'):
        values, stats = _iterate(Reversed(PathList(paths)),
                                 tmp_path / 'local', 2)
    assert values == list(reversed(range(N))) * 2  # the data stays right
    assert stats['examples_from_local'] == 0
    assert stats['by_epoch'][1]['examples_from_source'] == N
    assert len(stats['staging_warnings']) == 1


class ExampleFilesNamesOthers(PathList):
    def example_files(self, i):
        return [self.paths[i] + '.missing']

    def with_file_locations(self, locate):
        return self


def test_example_files_naming_no_existing_file_is_warned(tmp_path):
    paths = [str(tmp_path / 'data' / n)
             for n in _write_images(str(tmp_path / 'data'))]
    with pytest.warns(StagingWarning, match='none of the files its examples '
                      r'name exists \(e.g. .*img000.png.missing\)'):
        iterator = PrefetchMultiprocessIterator(
            ExampleFilesNamesOthers(paths), 4, local_dir=str(
                tmp_path / 'local'), n_processes=1)
    iterator.finalize()


class BuildsItsPaths(chainer.dataset.DatasetMixin):
    """VOC-like: joins a root and an id inside get_example."""

    def __init__(self, root, ids):
        self._root_dir = root + '/'
        self._ids = ids

    def __len__(self):
        return len(self._ids)

    def get_example(self, i):
        return _read(self._root_dir + self._ids[i] + '.png')


@pytest.mark.parametrize('wrapper', ['plain', 'subdataset', 'transform'])
def test_a_dataset_building_its_paths_is_learned_and_staged(tmp_path,
                                                             wrapper):
    """VOC-like: epoch 0 reads shared storage (and is warned about), the
    files its examples opened are staged from epoch 1 on."""
    data = str(tmp_path / 'data')
    ids = [n[:-4] for n in _write_images(data)]
    dataset, expected = BuildsItsPaths(data, ids), list(range(N))
    if wrapper == 'subdataset':
        dataset, expected = SubDataset(dataset, 4, N), expected[4:]
    elif wrapper == 'transform':
        dataset = TransformDataset(dataset, lambda v: v + 1000)
        expected = [v + 1000 for v in expected]
    with pytest.warns(StagingWarning, match=r'\w+ names no files this '
                      r'iterator can find, but example \d+ opened .*learned'):
        values, stats = _iterate(
            dataset, tmp_path / 'local', 3,
            after_first=None)
    assert values == expected * 3
    epochs = stats['by_epoch']
    assert epochs[0]['examples_from_source'] == len(expected)
    assert epochs[0]['examples_from_local'] == 0
    assert epochs[1]['examples_from_local'] + epochs[1][
        'examples_from_source'] >= len(expected)
    assert epochs[2]['examples_from_local'] == len(expected)
    assert stats['files_copied'] == len(expected)


def _local_files(local):
    return sorted(os.path.basename(path) for path in glob.glob(
        os.path.join(str(local), 'data', '**', '*.png'), recursive=True))


def test_a_learned_dataset_is_copied_during_the_epoch_that_learns_it(
        tmp_path):
    """The copies are made while the first epoch runs, so the second reads
    local files from its first batch; each file is copied once."""
    data = str(tmp_path / 'data')
    names = _write_images(data)
    ids = [n[:-4] for n in names]
    local = tmp_path / 'local'
    iterator = PrefetchMultiprocessIterator(
        BuildsItsPaths(data, ids), 4, shuffle=False, n_processes=2,
        local_dir=str(local))
    try:
        with pytest.warns(StagingWarning):
            first = [v for _ in range(N // 4) for v in iterator.next()]
        # The epoch is consumed; the planned pipeline starts only with the
        # next batch, so what is under local_dir now was copied early.
        deadline = time.monotonic() + 60
        while _local_files(local) != sorted(names):
            assert time.monotonic() < deadline, _local_files(local)
            time.sleep(0.05)
        second = [v for _ in range(N // 4) for v in iterator.next()]
        stats = iterator.stats
    finally:
        iterator.finalize()
    assert first == second == list(range(N))
    assert stats['by_epoch'][1]['examples_from_local'] == N
    assert stats['files_copied'] == N
    assert stats['by_epoch'][0]['bytes_copied'] == stats['bytes_copied'] > 0
    # Every file read in the learning epoch counts (and those of a few
    # examples of the next epoch, prefetched before the pipeline restarted).
    sizes = sum(os.path.getsize(os.path.join(data, n)) for n in names)
    assert stats['bytes_copied'] == sizes
    assert sizes <= stats['by_epoch'][0]['bytes_from_source'] < 2 * sizes


def test_a_learned_dataset_under_its_local_dir_is_not_copied(tmp_path):
    """Files found inside the dataset's own tree are never copied there:
    nothing is made under local_dir, and the epoch's end warns."""
    data = str(tmp_path / 'data')
    ids = [n[:-4] for n in _write_images(data)]
    local = tmp_path / 'data' / 'cache'
    with pytest.warns(StagingWarning, match='overlaps the directory'):
        values, stats = _iterate(BuildsItsPaths(data, ids), local, 2)
    assert values == list(range(N)) * 2
    assert stats['files_copied'] == 0
    assert not local.exists()


def test_a_learned_dataset_with_a_capacity_is_copied_in_its_second_epoch(
        tmp_path):
    """With local_capacity the copies are left to the eviction policy:
    none is made while the first epoch learns."""
    data = str(tmp_path / 'data')
    ids = [n[:-4] for n in _write_images(data)]
    with pytest.warns(StagingWarning, match='learned'):
        values, stats = _iterate(BuildsItsPaths(data, ids), tmp_path / 'local',
                                 3, local_capacity=10 ** 8)
    assert values == list(range(N)) * 3
    epochs = stats['by_epoch']
    assert epochs[0]['bytes_copied'] == 0
    assert epochs[1]['bytes_copied'] > 0
    # Under a budget the restarted pipeline starts as a cold one: the first
    # accesses it plans may read shared storage, their copies made later.
    assert epochs[2]['examples_from_local'] > 0
    assert 0 < stats['files_copied'] <= N


def test_a_learned_dataset_reads_its_copies_when_the_sources_are_gone(
        tmp_path):
    data = str(tmp_path / 'data')
    ids = [n[:-4] for n in _write_images(data)]
    iterator = PrefetchMultiprocessIterator(
        BuildsItsPaths(data, ids), 4, shuffle=False, n_processes=2,
        local_dir=str(tmp_path / 'local'), recheck_sources='never')
    try:
        with pytest.warns(StagingWarning):
            first = [v for _ in range(3) for v in iterator.next()]
        second = [v for _ in range(3) for v in iterator.next()]  # copies made
        shutil.rmtree(data)
        third = [v for _ in range(3) for v in iterator.next()]
    finally:
        iterator.finalize()
    assert first == second == third == list(range(N))


def test_an_in_memory_dataset_gets_no_warning_and_no_directory(tmp_path):
    dataset = chainer.datasets.TupleDataset(numpy.arange(N), numpy.arange(N))
    with warnings.catch_warnings():
        warnings.simplefilter('error', StagingWarning)
        values, stats = _iterate(dataset, tmp_path / 'local', 2)
    assert [int(v[0]) for v in values] == list(range(N)) * 2
    assert stats['staging_warnings'] == []
    assert not (tmp_path / 'local').exists()


@pytest.mark.parametrize('where', ['inside', 'equal', 'parent'])
def test_a_local_dir_overlapping_the_dataset_is_refused(tmp_path, where):
    data = tmp_path / 'data'
    paths = [str(data / n) for n in _write_images(str(data))]
    local = {'inside': data / 'cache', 'equal': data,
             'parent': tmp_path}[where]
    with pytest.raises(ValueError, match='overlaps the directory of the '
                       "dataset's files"):
        PrefetchMultiprocessIterator(PathList(paths), 4,
                                     local_dir=str(local), n_processes=1)
    assert not (data / 'cache').exists()
    assert sorted(os.listdir(str(data))) == sorted(
        os.path.basename(p) for p in paths)


def test_stats_keep_their_counts_after_finalize(tmp_path):
    paths = [str(tmp_path / 'data' / n)
             for n in _write_images(str(tmp_path / 'data'))]
    _, stats_before = _iterate(PathList(paths), tmp_path / 'local', 1)
    # _iterate read stats after finalize(): the counts are there.
    assert stats_before['examples_from_local'] \
        + stats_before['examples_from_source'] >= N
    assert 0 in stats_before['by_epoch']


def test_a_capacity_below_every_file_is_warned(tmp_path):
    paths = [str(tmp_path / 'data' / n)
             for n in _write_images(str(tmp_path / 'data'))]
    with pytest.warns(StagingWarning, match=r'local_capacity=10 bytes is '
                      r'smaller than each file'):
        iterator = PrefetchMultiprocessIterator(
            PathList(paths), 4, local_dir=str(tmp_path / 'local'),
            local_capacity=10, n_processes=1)
    iterator.finalize()


def test_local_dir_expands_the_home_and_warns_about_variables(
        tmp_path, monkeypatch):
    monkeypatch.setenv('HOME', str(tmp_path / 'home'))
    paths = [str(tmp_path / 'data' / n)
             for n in _write_images(str(tmp_path / 'data'))]
    iterator = PrefetchMultiprocessIterator(
        PathList(paths), 4, local_dir='~/stage', n_processes=1)
    assert iterator.local_dir == str(tmp_path / 'home' / 'stage')
    iterator.finalize()
    monkeypatch.setenv('USER', 'someone')
    with pytest.warns(StagingWarning, match=r"contains '\$USER', which "
                      'Python does not expand'):
        iterator = PrefetchMultiprocessIterator(
            PathList(paths), 4, local_dir=str(tmp_path / '$USER' / 'x'),
            n_processes=1)
    iterator.finalize()
    assert "contains '$USER'" in iterator.stats['staging_warnings'][0]
    # os.path.expandvars leaves a variable that is not set as it is.
    monkeypatch.delenv('TMPDIR', raising=False)
    with pytest.warns(StagingWarning, match=r"contains '\$TMPDIR', which is "
                      'not set in this environment.*set TMPDIR'):
        iterator = PrefetchMultiprocessIterator(
            PathList(paths), 4, n_processes=1, local_dir=os.path.expandvars(
                str(tmp_path / '$TMPDIR' / 'x')))
    iterator.finalize()


class CachesDecoded(PathList):
    """Opens each file once per loader process, then serves its cache."""

    def __init__(self, paths):
        super().__init__(paths)
        self.cache = {}

    def get_example(self, i):
        if i not in self.cache:
            self.cache[i] = _read(self.paths[i])
        return self.cache[i]


def test_a_dataset_serving_its_own_cache_is_not_reported(tmp_path):
    paths = [str(tmp_path / 'data' / n)
             for n in _write_images(str(tmp_path / 'data'))]
    with warnings.catch_warnings():
        warnings.simplefilter('error', StagingWarning)
        values, stats = _iterate(CachesDecoded(paths), tmp_path / 'local', 3,
                                 n_processes=1)
    assert values == list(range(N)) * 3
    assert stats['examples_from_source'] == 0


class ReadsWithC(PathList):
    """Reads its files through C's stdio, which no redirection reaches."""

    def get_example(self, i):
        import ctypes
        libc = ctypes.CDLL(None)
        libc.fopen.restype = ctypes.c_void_p
        handle = libc.fopen(os.fsencode(self.paths[i]), b'rb')
        assert handle, self.paths[i]
        libc.fclose(ctypes.c_void_p(handle))
        return i


def test_files_read_by_a_c_library_are_reported_and_counted(tmp_path):
    paths = [str(tmp_path / 'data' / n)
             for n in _write_images(str(tmp_path / 'data'))]
    with pytest.warns(StagingWarning, match=r"opened none of its files .* "
                      "through Python's open"):
        values, stats = _iterate(ReadsWithC(paths), tmp_path / 'local', 2,
                                 n_processes=1)
    assert values == list(range(N)) * 2
    # The first examples might have come from a cache; from the eighth on,
    # every example of the loader counts as read from shared storage.
    assert stats['examples_from_source'] >= 2 * N - 7


def test_a_missing_file_raises_with_its_name_and_index(tmp_path):
    paths = [str(tmp_path / 'data' / n)
             for n in _write_images(str(tmp_path / 'data'))]
    os.remove(paths[2])  # (not among the entries discovery looks at)
    iterator = PrefetchMultiprocessIterator(
        PathList(paths), 4, shuffle=False, n_processes=1,
        local_dir=str(tmp_path / 'local'))
    try:
        with pytest.raises(FileNotFoundError) as raised:
            iterator.next()
    finally:
        iterator.finalize()
    assert raised.value.filename == paths[2]
    assert raised.value.index == 2
    assert 'example 2' in str(raised.value)
