"""The dataset a Chainer user writes: a list of image paths opened with PIL.

No ``example_files``, no Chainer image dataset: the iterator finds the
paths in its attributes (``chainer_prefetch.staging.discovery``) and the
loaders read the local copies by redirecting its ``open`` calls.  It
returns what ``chainer.datasets.LabeledImageDataset`` returns for the same
list (float32 CHW image, int32 label), so the two compare side by side.
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
        with Image.open(self.paths[i]) as image:
            array = numpy.asarray(image, dtype=numpy.float32)
        if array.ndim == 2:
            array = array[:, :, numpy.newaxis]
        return array.transpose(2, 0, 1), numpy.int32(self.labels[i])
