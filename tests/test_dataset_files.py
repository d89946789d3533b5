"""Finding the files behind Chainer's dataset wrappers, and located views."""
import copy
import os
import pickle

import chainer
import numpy
import pytest
from chainer.datasets import (
    ConcatenatedDataset,
    DictDataset,
    ImageDataset,
    LabeledImageDataset,
    SubDataset,
    TransformDataset,
    TupleDataset,
    split_dataset,
    split_dataset_random,
)
from PIL import Image

from chainer_prefetch import resolve_dataset_files
from chainer_prefetch.staging import LocalPathMap

N_IMAGES = 6


@pytest.fixture
def images(tmp_path):
    """Source images, and copies under a LocalPathMap whose pixels differ.

    Reading the located view therefore gives the inverted image: a test can
    tell which file was read.
    """
    root = tmp_path / 'source'
    (root / 'a').mkdir(parents=True)
    pairs = []
    for i in range(N_IMAGES):
        relative = 'a/{}.png'.format(i)
        pixels = numpy.full((4, 5, 3), 10 * i, dtype=numpy.uint8)
        Image.fromarray(pixels).save(str(root / relative))
        pairs.append((relative, i))
    path_map = LocalPathMap(str(tmp_path / 'local' / 'data'))
    for relative, _ in pairs:
        source = os.path.join(str(root), relative)
        local = path_map(source)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        inverted = 255 - numpy.asarray(Image.open(source))
        Image.fromarray(inverted).save(local)
    return str(root), pairs, path_map


def _labeled(images):
    root, pairs, _ = images
    return LabeledImageDataset(pairs, root)


def _assert_view_reads_copies(dataset, view, n):
    for i in range(n):
        original = dataset[i]
        located = view[i]
        original_image = _first_image(original)
        located_image = _first_image(located)
        numpy.testing.assert_array_equal(located_image, 255 - original_image)


def _first_image(example):
    if isinstance(example, dict):
        example = example['image']
    while isinstance(example, tuple):
        example = example[0]
    return example


def test_labeled_image_dataset(images):
    root, pairs, path_map = images
    dataset = LabeledImageDataset(pairs, root)
    files = resolve_dataset_files(dataset)
    assert files.files(3) == (os.path.join(root, 'a/3.png'),)
    view = files.located(path_map)
    _assert_view_reads_copies(dataset, view, N_IMAGES)
    assert view[2][1] == 2 and view[2][1].dtype == numpy.int32
    assert dataset._root == root  # the original is untouched


def test_image_dataset(images):
    root, pairs, path_map = images
    dataset = ImageDataset([path for path, _ in pairs], root)
    files = resolve_dataset_files(dataset)
    assert files.files(0) == (os.path.join(root, 'a/0.png'),)
    view = files.located(path_map)
    numpy.testing.assert_array_equal(view[4], 255 - dataset[4])


def test_absolute_and_dotdot_paths_resolve_to_the_real_source(images):
    root, pairs, path_map = images
    absolute = os.path.join(root, 'a/1.png')
    dotted = os.path.join('..', os.path.basename(root), 'a/2.png')
    dataset = LabeledImageDataset([(absolute, 1), (dotted, 2)], root)
    files = resolve_dataset_files(dataset)
    assert files.files(0) == (absolute,)
    assert os.path.normpath(files.files(1)[0]) == os.path.join(root, 'a/2.png')
    view = files.located(path_map)
    numpy.testing.assert_array_equal(view[1][0], 255 - dataset[1][0])


@pytest.mark.parametrize('split', ['split_dataset', 'random', 'ordered'])
def test_sub_datasets_map_indices(images, split):
    dataset = _labeled(images)
    if split == 'split_dataset':
        _, subset = split_dataset(dataset, 2)
        expected = [2, 3, 4, 5]
    elif split == 'random':
        subset, _ = split_dataset_random(dataset, 4, seed=1)
        expected = [int(i) for i in subset._order[:4]]
    else:  # what chainermn.scatter_dataset builds: an order and a range
        order = numpy.array([5, 3, 1, 0, 2, 4])
        subset = SubDataset(dataset, 1, 4, order)
        expected = [3, 1, 0]
    files = resolve_dataset_files(subset)
    for i, index in enumerate(expected):
        assert files.files(i) == (
            os.path.join(dataset._root, 'a/{}.png'.format(index)),)
    with pytest.raises(IndexError):
        files.files(len(subset))
    _assert_view_reads_copies(subset, files.located(images[2]), len(subset))


def test_transform_and_user_wrapper(images):
    class Preprocessed(chainer.dataset.DatasetMixin):
        """Like the chainermn ImageNet example's PreprocessedDataset."""

        def __init__(self, base):
            self.base = base
            self.crop = 2

        def __len__(self):
            return len(self.base)

        def get_example(self, i):
            image, label = self.base[i]
            return image[:, :self.crop, :self.crop], label

    dataset = TransformDataset(Preprocessed(_labeled(images)),
                               lambda example: (example[0] * 2, example[1]))
    files = resolve_dataset_files(dataset)
    assert files.files(1)[0].endswith('a/1.png')
    view = files.located(images[2])
    assert isinstance(view, TransformDataset)
    for i in range(N_IMAGES):
        numpy.testing.assert_array_equal(view[i][0],
                                         (255 - dataset[i][0] / 2) * 2)


def test_concatenated_with_a_dataset_without_files(images):
    arrays = numpy.arange(3)
    dataset = ConcatenatedDataset(arrays, _labeled(images))
    files = resolve_dataset_files(dataset)
    assert files.files(1) == ()
    assert files.files(3)[0].endswith('a/0.png')
    view = files.located(images[2])
    assert view[2] == 2
    numpy.testing.assert_array_equal(view[4][0], 255 - dataset[4][0])


def test_tuple_and_dict_datasets(images):
    labeled = _labeled(images)
    labels = numpy.arange(N_IMAGES) * 7
    for dataset in (TupleDataset(labeled, labels),
                    DictDataset(image=ImageDataset(
                        [p for p, _ in images[1]], images[0]), label=labels)):
        files = resolve_dataset_files(dataset)
        assert len(files.files(2)) == 1 and files.files(2)[0].endswith('2.png')
        view = files.located(images[2])
        for i in range(N_IMAGES):
            example = view[i]
            label = example[1] if isinstance(example, tuple) else example['label']
            assert label == labels[i]
        _assert_view_reads_copies(dataset, view, N_IMAGES)


def test_protocol_for_custom_datasets(images):
    root, pairs, path_map = images

    class Custom(chainer.dataset.DatasetMixin):
        def __init__(self, paths):
            self.paths = paths

        def __len__(self):
            return len(self.paths)

        def get_example(self, i):
            with open(self.paths[i], 'rb') as f:
                return numpy.frombuffer(f.read(), dtype=numpy.uint8)

        def example_files(self, i):
            return [self.paths[i]]

        def with_file_locations(self, locate):
            clone = copy.copy(self)
            clone.paths = [locate(p) for p in self.paths]
            return clone

    dataset = Custom([os.path.join(root, p) for p, _ in pairs])
    files = resolve_dataset_files(dataset)
    assert files.files(4) == (dataset.paths[4],)
    view = files.located(path_map)
    assert view.paths[4] == path_map(dataset.paths[4])


@pytest.mark.parametrize('dataset', [
    numpy.arange(5), [1, 2, 3], TupleDataset(numpy.arange(3), numpy.arange(3)),
    TransformDataset(numpy.arange(4), lambda x: x + 1)])
def test_datasets_without_files_resolve_to_none(dataset):
    assert resolve_dataset_files(dataset) is None


def test_located_views_survive_pickling(images):
    """Workers started by forkserver/spawn receive the view pickled."""
    root, pairs, path_map = images
    subset, _ = split_dataset_random(
        TransformDataset(LabeledImageDataset(pairs, root), _double_image),
        4, seed=0)
    view = resolve_dataset_files(subset).located(path_map)
    restored = pickle.loads(pickle.dumps(view))
    for i in range(len(subset)):
        numpy.testing.assert_array_equal(restored[i][0], view[i][0])


def test_cycles_in_attributes_do_not_recurse_forever(images):
    class Wrapper(chainer.dataset.DatasetMixin):
        def __init__(self, base):
            self.base = base
            self.myself = self

        def __len__(self):
            return len(self.base)

        def get_example(self, i):
            return self.base[i]

    files = resolve_dataset_files(Wrapper(_labeled(images)))
    assert files.files(0)[0].endswith('a/0.png')


def _double_image(example):
    return example[0] * 2, example[1]
