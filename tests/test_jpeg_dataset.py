"""Tests of the JPEG dataset generator (testbed.jpeg_dataset) on a tiny dataset."""
import os
import subprocess
import sys

import chainer
import numpy as np
import pytest
from PIL import Image

from chainer_prefetch_bench.testbed import jpeg_dataset as make_dataset


def _files(root):
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, 'rb') as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('dataset'))
    summary = make_dataset.generate(root, n_images=20, n_classes=3, seed=7,
                                    val_images=4, workers=2, progress=False)
    return root, summary


def test_deterministic_whatever_the_workers(dataset, tmp_path):
    root, _ = dataset
    again = str(tmp_path / 'again')
    make_dataset.generate(again, n_images=20, n_classes=3, seed=7,
                          val_images=4, workers=1, progress=False)
    assert _files(root) == _files(again)


def test_other_seed_differs(dataset, tmp_path):
    root, _ = dataset
    other = str(tmp_path / 'other')
    make_dataset.generate(other, n_images=20, n_classes=3, seed=8,
                          val_images=4, progress=False)
    a, b = _files(root), _files(other)
    assert a.keys() == b.keys()
    assert a['train/n000/img_000000.JPEG'] != b['train/n000/img_000000.JPEG']


def test_list_files_load_with_labeled_image_dataset(dataset):
    root, summary = dataset
    n = 0
    for split, count in (('train', 20), ('val', 4)):
        with open(os.path.join(root, split + '.txt')) as f:
            lines = f.read().splitlines()
        assert len(lines) == count
        for line in lines:
            path, label = line.split()
            assert path.startswith(split + '/n00')
            assert path.split('/')[1] == 'n{:03d}'.format(int(label))
        ds = chainer.datasets.LabeledImageDataset(
            os.path.join(root, split + '.txt'), root=root)
        for i in range(len(ds)):
            image, label = ds[i]
            assert image.dtype == np.float32 and image.shape[0] == 3
            assert 0 <= int(label) < 3
            n += 1
    assert n == summary.n_files == 24


def test_images_are_rgb_jpegs_of_varied_shape(dataset):
    root, summary = dataset
    shapes = set()
    total = 0
    for rel in _files(root):
        if rel.endswith('.JPEG'):
            path = os.path.join(root, rel)
            total += os.path.getsize(path)
            with Image.open(path) as image:
                assert image.format == 'JPEG' and image.mode == 'RGB'
                shapes.add(image.size)
    assert total == summary.total_bytes
    assert len(shapes) > 1


def test_mean_size_follows_the_target():
    # Specs only: the mean of the size factors is 1 by construction, so
    # check the spread of shapes and factors over many specs cheaply.
    specs = [make_dataset.image_spec(0, 'train', i, 10) for i in range(2000)]
    factors = np.array([s.size_factor for s in specs])
    assert 0.9 < factors.mean() < 1.1
    widths = np.array([s.width for s in specs])
    heights = np.array([s.height for s in specs])
    assert np.mean((widths == 500) & (heights == 375)) > 0.3
    assert np.mean(heights > widths) > 0.05  # some portrait
    assert np.mean(np.maximum(widths, heights) < 300) > 0.01  # a few small


def test_mean_npy(dataset):
    root, _ = dataset
    mean = np.load(os.path.join(root, 'mean.npy'))
    assert mean.shape == (3, 256, 256) and mean.dtype == np.float32
    assert 0 < mean.mean() < 255


def test_command_line(tmp_path):
    out = tmp_path / 'cli'
    result = subprocess.run(
        [sys.executable, '-m', 'chainer_prefetch_bench.testbed.jpeg_dataset', str(out),
         '--n-images', '6', '--n-classes', '2', '--seed', '1',
         '--mean-size', '50000'],
        capture_output=True, text=True, timeout=60, check=True)
    assert '6 files' in result.stdout and 'mean' in result.stdout
    assert '6/6 images' in result.stderr
    assert (out / 'train.txt').exists() and not (out / 'val.txt').exists()
