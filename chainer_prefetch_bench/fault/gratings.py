"""A generated image task that a small network learns for minutes on a CPU.

The learning curves with a failure (the paper's Figs. 7-8) only say
something if validation accuracy is still rising when the failure hits and
after it.  Colour-coded classes (``testbed.jpeg_dataset``) are learned
within the first epoch, so this task asks for learned oriented filters:
each class is one orientation of a sinusoidal grating (``n_classes``
orientations over 180 degrees, each jittered a little) with a random spatial
frequency, phase, contrast and tint, buried in strong Gaussian noise.  With
16 classes the orientations are 11.25 degrees apart, and ``tiny`` at 32x32
crops climbs from chance for several minutes here.

Writes JPEG files ``OUT/train/cNN/NNNNNN.JPEG`` (and ``val/``), ``train.txt`` and
``val.txt`` (``relative/path label``, the format of
``chainer.datasets.LabeledImageDataset``).  Deterministic for a seed.

Usage::

    python -m chainer_prefetch_bench.fault.gratings OUT --train 8000 \\
        --val 1600 [--classes 16] [--size 40] [--noise 90] [--seed 0]
"""
import argparse
import os
import sys
from typing import NamedTuple, Optional, Sequence

import numpy as np
from PIL import Image


class GratingTask(NamedTuple):
    """The settings of the task.

    Attributes:
        n_classes: Orientations (classes) over 180 degrees.
        size: Side of the square images, pixels.
        noise: Standard deviation of the Gaussian pixel noise.
        contrast: ``(low, high)`` amplitude range, times 60 grey levels.
        jitter: Standard deviation of the orientation jitter, radians.
        frequency: ``(low, high)`` spatial frequency, cycles per pixel.
    """
    n_classes: int = 16
    size: int = 40
    noise: float = 90.0
    contrast: Sequence[float] = (0.1, 0.5)
    jitter: float = 0.05
    frequency: Sequence[float] = (0.12, 0.3)


def render(task: GratingTask, labels: np.ndarray,
           rng: np.random.Generator) -> np.ndarray:
    """Images of the given labels, ``(n, size, size, 3)`` uint8."""
    n = len(labels)
    theta = labels * np.pi / task.n_classes + rng.normal(0, task.jitter, n)
    frequency = rng.uniform(*task.frequency, n)[:, None, None]
    phase = rng.uniform(0, 2 * np.pi, n)[:, None, None]
    y, x = np.mgrid[0:task.size, 0:task.size]
    along = (x[None] * np.cos(theta)[:, None, None]
             + y[None] * np.sin(theta)[:, None, None])
    wave = np.sin(2 * np.pi * frequency * along + phase)
    contrast = rng.uniform(*task.contrast, n)[:, None, None, None]
    tint = rng.uniform(0.5, 1.5, (n, 1, 1, 3))
    pixels = (128 + wave[..., None] * contrast * tint * 60
              + rng.normal(0, task.noise, (n, task.size, task.size, 3)))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def write_split(root: str, split: str, n_images: int, task: GratingTask,
                seed: int) -> str:
    """Writes one split's JPEG files and list; returns the list's path."""
    rng = np.random.default_rng([seed, 0 if split == 'train' else 1])
    labels = np.arange(n_images) % task.n_classes
    lines = []
    for start in range(0, n_images, 500):
        chunk = labels[start:start + 500]
        for offset, image in enumerate(render(task, chunk, rng)):
            index = start + offset
            relative = '{}/c{:02d}/{:06d}.JPEG'.format(
                split, labels[index], index)
            path = os.path.join(root, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            Image.fromarray(image).save(path, quality=90)
            lines.append('{} {}\n'.format(relative, labels[index]))
    listing = os.path.join(root, split + '.txt')
    with open(listing, 'w') as f:
        f.writelines(lines)
    return listing


DEFAULT_TASK = GratingTask()


def generate(root: str, n_train: int, n_val: int,
             task: GratingTask = DEFAULT_TASK, seed: int = 0) -> None:
    """Writes the dataset under ``root`` (skipped if its lists exist)."""
    if all(os.path.exists(os.path.join(root, name))
           for name in ('train.txt', 'val.txt')):
        return
    write_split(root, 'train', n_train, task, seed)
    write_split(root, 'val', n_val, task, seed)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('out')
    parser.add_argument('--train', type=int, default=8000)
    parser.add_argument('--val', type=int, default=1600)
    parser.add_argument('--classes', type=int, default=16)
    parser.add_argument('--size', type=int, default=40)
    parser.add_argument('--noise', type=float, default=90.0)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)
    generate(args.out, args.train, args.val,
             GratingTask(n_classes=args.classes, size=args.size,
                         noise=args.noise), args.seed)
    return 0


if __name__ == '__main__':
    sys.exit(main())
