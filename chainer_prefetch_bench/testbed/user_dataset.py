"""The datasets a Chainer user writes: a list of image paths opened with PIL
(:class:`PathListDataset`), or ids joined to a root inside ``get_example``
as ChainerCV's VOC and COCO datasets do (:class:`IdDataset`).

No ``example_files``, no Chainer image dataset.  The iterator finds the
paths of the first in its attributes (``chainer_prefetch.staging.discovery``);
those of the second it learns from the files its first epoch opens.  The
loaders read the local copies by redirecting their ``open`` calls.  Both
return what ``chainer.datasets.LabeledImageDataset`` returns for the same
list (float32 CHW image, int32 label), so they compare side by side.
"""
import os

import chainer
import numpy
from PIL import Image


class PathListDataset(chainer.dataset.DatasetMixin):
    """Images listed in a ``LabeledImageDataset`` list file.

    Args:
        list_file: Lines of ``relative_path label``.
        root: The directory the paths are relative to.
    """

    def __init__(self, list_file: str, root: str):
        self.paths = []
        self.labels = []
        with open(list_file) as f:
            for line in f:
                name, label = line.split()
                self.paths.append(os.path.join(root, name))
                self.labels.append(int(label))

    def __len__(self):
        return len(self.paths)

    def get_example(self, i):
        return _image_and_label(self.paths[i], self.labels[i])


def _image_and_label(path, label):
    with Image.open(path) as image:
        array = numpy.asarray(image, dtype=numpy.float32)
    if array.ndim == 2:
        array = array[:, :, numpy.newaxis]
    return array.transpose(2, 0, 1), numpy.int32(label)


class IdDataset(chainer.dataset.DatasetMixin):
    """The images of a list file, kept as ids (the path without its
    extension) and joined to the root inside ``get_example``.

    Args:
        list_file: Lines of ``relative_path label``.
        root: The directory the paths are relative to.
    """

    def __init__(self, list_file: str, root: str):
        self._root_dir = root
        self._ids = []
        self._extensions = []
        self._labels = []
        with open(list_file) as f:
            for line in f:
                name, label = line.split()
                stem, extension = os.path.splitext(name)
                self._ids.append(stem)
                self._extensions.append(extension)
                self._labels.append(int(label))

    def __len__(self):
        return len(self._ids)

    def get_example(self, i):
        path = os.path.join(self._root_dir, self._ids[i] + self._extensions[i])
        return _image_and_label(path, self._labels[i])
