"""The common start of the JPEG benchmarks: signals, FUSE, the dataset."""
import sys
from typing import Optional

from chainer_prefetch_bench.testbed import storage
from chainer_prefetch_bench.testbed.jpeg_dataset import cached_dataset
from chainer_prefetch_bench.testbed.processes import exit_on_sigterm


def prepare_jpeg_benchmark(workdir: str, n_images: int,
                           n_classes: int = 100) -> Optional[str]:
    """Make SIGTERM unwind, check FUSE, and make (once) the dataset.

    Args:
        workdir: Where the dataset is kept.
        n_images: Training images of the dataset.
        n_classes: Its classes (one folder each).

    Returns:
        The dataset's folder (with ``train.txt``), or ``None`` when FUSE is
        not usable here (the reason and the fix are printed).
    """
    exit_on_sigterm()
    problem = storage.fuse_problem()
    if problem:
        print('FUSE is not usable here: ' + problem, file=sys.stderr)
        return None
    return cached_dataset(workdir, n_images, n_classes)
