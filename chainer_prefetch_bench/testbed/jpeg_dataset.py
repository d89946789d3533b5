#!/usr/bin/env python
"""Generate a synthetic ImageNet-like dataset of JPEG files.

The files stand in for ImageNet when benchmarking data loading: their
dimensions and sizes are spread like ImageNet's (mostly 500x375 or 500x333
landscape, some portrait, a few small and a few large images; mean file size
about 110 KB), but their content is cheap to make: a smooth random colour
field plus uniform noise.  Each image is encoded at the JPEG quality that
brings its size closest to a per-image target size drawn from a log-normal
distribution, so the mean file size follows ``--mean-size``.

Layout written under ``OUT_DIR``::

    train/n000/img_000000.JPEG ...   training images, one folder per class
    val/n000/img_000000.JPEG ...     validation images (with --val-images)
    train.txt, val.txt               "relative/path label" per line (paths
                                     relative to OUT_DIR), the format that
                                     chainer.datasets.LabeledImageDataset
                                     reads
    mean.npy                         (3, 256, 256) float32 mean image of (a
                                     sample of) the training images resized
                                     to 256x256, as the chainermn ImageNet
                                     example's --mean expects

Everything is deterministic: the same arguments give byte-identical files,
whatever the number of worker processes.

Usage::

    python -m chainer_prefetch_bench.testbed.jpeg_dataset OUT_DIR --n-images 2000 --n-classes 10 \\
        --seed 0 [--val-images 200] [--mean-size 110000] [--workers 2]
"""
import argparse
import io
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

MEAN_IMAGE_SIZE = 256
"""Side of the square images that mean.npy is computed over."""

CHUNK = 16
"""Images per work unit; fixed so that results do not depend on workers."""

QUALITY_RANGE = (40, 98)
"""JPEG qualities searched for the one nearest an image's target size."""

SIZE_SIGMA = 0.45
"""Standard deviation of log(file size / expected size) across images."""

# (probability, kind) of the image shapes, roughly as in ImageNet's train set.
_SHAPE_KINDS = (
    (0.42, 'landscape_4_3'),
    (0.20, 'landscape_3_2'),
    (0.13, 'landscape_other'),
    (0.14, 'portrait'),
    (0.05, 'square'),
    (0.04, 'small'),
    (0.02, 'large'),
)

_SPLIT_STREAM = {'train': 0, 'val': 1}


@dataclass(frozen=True)
class ImageSpec:
    """What one image will be, drawn from its own random stream.

    Attributes:
        split: ``'train'`` or ``'val'``.
        index: Index of the image within its split.
        label: Class label.
        width: Width in pixels.
        height: Height in pixels.
        size_factor: Log-normal factor (mean 1) scaling the image's target
            bytes per pixel.
    """

    split: str
    index: int
    label: int
    width: int
    height: int
    size_factor: float

    def relpath(self, n_classes: int) -> str:
        """Path of the image relative to the dataset root.

        Args:
            n_classes: Number of classes (sets the width of folder names).

        Returns:
            A path like ``train/n003/img_000042.JPEG``.
        """
        digits = max(3, len(str(n_classes - 1)))
        return '{}/n{:0{}d}/img_{:06d}.JPEG'.format(
            self.split, self.label, digits, self.index)


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, _SPLIT_STREAM[split], index])


def _draw_shape(rng: np.random.Generator) -> Tuple[int, int]:
    """Draw (width, height) of one image."""
    probs = np.array([p for p, _ in _SHAPE_KINDS])
    pick = rng.choice(len(_SHAPE_KINDS), p=probs / probs.sum())
    kind = _SHAPE_KINDS[pick][1]
    if kind == 'landscape_4_3':
        return 500, 375
    if kind == 'landscape_3_2':
        return 500, 333
    if kind == 'landscape_other':
        return 500, int(rng.integers(250, 500))
    if kind == 'portrait':
        return int(rng.choice([375, 333, int(rng.integers(250, 500))])), 500
    if kind == 'square':
        side = int(rng.integers(200, 501))
        return side, side
    if kind == 'small':
        return int(rng.integers(80, 300)), int(rng.integers(60, 300))
    width = int(rng.integers(600, 1300))
    return width, width * 3 // 4


def image_spec(seed: int, split: str, index: int, n_classes: int) -> ImageSpec:
    """Draw the specification of one image.

    Args:
        seed: Dataset seed.
        split: ``'train'`` or ``'val'``.
        index: Index of the image within its split.
        n_classes: Number of classes; labels cycle through them.

    Returns:
        The image's :class:`ImageSpec`.
    """
    rng = _rng(seed, split, index)
    width, height = _draw_shape(rng)
    factor = float(np.exp(rng.normal(-SIZE_SIGMA ** 2 / 2, SIZE_SIGMA)))
    return ImageSpec(split, index, index % n_classes, width, height, factor)


def _render(spec: ImageSpec, target_bpp: float,
            rng: np.random.Generator) -> Image.Image:
    """Make the pixels: a smooth colour field plus uniform noise.

    The field leans towards a colour of the image's class, so a network can
    learn the labels (training examples report a falling loss).
    """
    grid_w, grid_h = (int(v) for v in rng.integers(2, 12, size=2))
    class_colour = np.random.default_rng([spec.label]).integers(0, 256, 3)
    coarse = (rng.integers(0, 256, (grid_h, grid_w, 3)) + class_colour) // 2
    coarse = coarse.astype(np.uint8)
    field = Image.fromarray(coarse).resize((spec.width, spec.height),
                                           Image.BICUBIC)
    # More noise for images that must be larger files: the quality search
    # then lands in the middle of its range instead of at an end.
    amplitude = int(np.clip(80 * target_bpp * rng.uniform(0.7, 1.3), 6, 120))
    noise = rng.integers(-amplitude, amplitude + 1,
                         (spec.height, spec.width, 3), dtype=np.int16)
    pixels = np.asarray(field, dtype=np.int16) + noise
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), 'RGB')


def _encode(image: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    image.save(buf, 'JPEG', quality=quality)
    return buf.getvalue()


def encode_to_size(image: Image.Image, target_bytes: float) -> bytes:
    """Encode an image as JPEG at the quality whose size is nearest a target.

    Args:
        image: RGB image.
        target_bytes: Wanted file size in bytes.

    Returns:
        The JPEG bytes.
    """
    cache = {}

    def size_at(quality: int) -> int:
        if quality not in cache:
            cache[quality] = _encode(image, quality)
        return len(cache[quality])

    lo, hi = QUALITY_RANGE
    while lo < hi:  # smallest quality whose size reaches the target
        mid = (lo + hi) // 2
        if size_at(mid) < target_bytes:
            lo = mid + 1
        else:
            hi = mid
    candidates = [q for q in (lo - 1, lo) if q >= QUALITY_RANGE[0]]
    best = min(candidates, key=lambda q: abs(size_at(q) - target_bytes))
    return cache[best]


def _make_chunk(job: Tuple[str, str, Sequence[ImageSpec], int, float, int,
                           Sequence[int]]):
    """Write one chunk of images; return their sizes and a partial mean sum.

    Args:
        job: (out_dir, split, specs, n_classes, bytes_per_pixel, seed,
            indices of specs whose images enter the mean image).

    Returns:
        (list of file sizes, float64 sum of 256x256 CHW images, count).
    """
    out_dir, split, specs, n_classes, bytes_per_pixel, seed, mean_indices = job
    sizes = []
    mean_sum = np.zeros((3, MEAN_IMAGE_SIZE, MEAN_IMAGE_SIZE), np.float64)
    mean_count = 0
    for spec in specs:
        # A stream separate from the spec's own, so specs can be drawn alone.
        rng = np.random.default_rng(
            [seed, _SPLIT_STREAM[split], spec.index, 1])
        target_bpp = bytes_per_pixel * spec.size_factor
        data = encode_to_size(_render(spec, target_bpp, rng),
                              target_bpp * spec.width * spec.height)
        path = os.path.join(out_dir, spec.relpath(n_classes))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, 'wb') as f:
            f.write(data)
        sizes.append(len(data))
        if spec.index in mean_indices:
            with Image.open(io.BytesIO(data)) as decoded:
                small = decoded.convert('RGB').resize(
                    (MEAN_IMAGE_SIZE, MEAN_IMAGE_SIZE), Image.BILINEAR)
            mean_sum += np.asarray(small, np.float64).transpose(2, 0, 1)
            mean_count += 1
    return sizes, mean_sum, mean_count


class _Progress:
    """A one-line text progress bar on stderr."""

    def __init__(self, total: int, width: int = 40) -> None:
        self.total = max(total, 1)
        self.width = width
        self.start = time.perf_counter()
        self.last_draw = 0.0

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if done < self.total and now - self.last_draw < 0.2:
            return
        self.last_draw = now
        frac = done / self.total
        filled = int(self.width * frac)
        elapsed = now - self.start
        sys.stderr.write('\r[{}{}] {}/{} images {:5.1f}s'.format(
            '#' * filled, '.' * (self.width - filled), done, self.total,
            elapsed))
        if done >= self.total:
            sys.stderr.write('\n')
        sys.stderr.flush()


def _chunks(specs: List[ImageSpec]) -> Iterator[List[ImageSpec]]:
    for start in range(0, len(specs), CHUNK):
        yield specs[start:start + CHUNK]


@dataclass
class Summary:
    """What :func:`generate` wrote.

    Attributes:
        n_files: Number of JPEG files.
        total_bytes: Their total size.
        seconds: Wall-clock time taken.
    """

    n_files: int
    total_bytes: int
    seconds: float

    @property
    def mean_kb(self) -> float:
        """Mean file size in KB (1000 bytes)."""
        return self.total_bytes / max(self.n_files, 1) / 1000

    def __str__(self) -> str:
        return '{} files, {:.1f} MB total, mean {:.1f} KB, {:.1f} s'.format(
            self.n_files, self.total_bytes / 1e6, self.mean_kb, self.seconds)


def generate(out_dir: str, n_images: int, n_classes: int, seed: int,
             val_images: int = 0, mean_size: float = 110000,
             mean_samples: int = 1000, workers: Optional[int] = None,
             progress: bool = True) -> Summary:
    """Generate the dataset.

    Args:
        out_dir: Folder to write into (created if missing; existing files of
            the same names are overwritten).
        n_images: Number of training images.
        n_classes: Number of classes (labels ``0 .. n_classes-1``).
        seed: Seed; the same arguments give byte-identical files.
        val_images: Number of validation images; 0 writes no val split.
        mean_size: Wanted mean JPEG file size in bytes.
        mean_samples: At most this many training images (evenly spaced)
            enter ``mean.npy``.
        workers: Worker processes; ``None`` uses one per CPU.
        progress: Whether to draw a progress bar on stderr.

    Returns:
        A :class:`Summary` of the files written.
    """
    if n_images < 1 or n_classes < 1:
        raise ValueError('n_images and n_classes must be positive')
    start = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    splits = [('train', n_images)] + ([('val', val_images)]
                                      if val_images > 0 else [])
    specs = {split: [image_spec(seed, split, i, n_classes) for i in range(n)]
             for split, n in splits}
    # Scale bytes per pixel so that the expected mean file size is mean_size.
    all_specs = [s for split_specs in specs.values() for s in split_specs]
    mean_pixels = np.mean([s.width * s.height for s in all_specs])
    bytes_per_pixel = mean_size / mean_pixels
    step = max(1, n_images // max(mean_samples, 1))
    mean_indices = set(range(0, n_images, step)[:mean_samples])

    jobs = []
    for split, split_specs in specs.items():
        wanted = mean_indices if split == 'train' else set()
        for chunk in _chunks(split_specs):
            jobs.append((out_dir, split, chunk, n_classes, bytes_per_pixel,
                         seed, {s.index for s in chunk} & wanted))

    bar = _Progress(len(all_specs)) if progress else None
    sizes: List[int] = []
    mean_sum = np.zeros((3, MEAN_IMAGE_SIZE, MEAN_IMAGE_SIZE), np.float64)
    mean_count = 0
    n_workers = workers or os.cpu_count() or 1
    with multiprocessing.Pool(n_workers) as pool:
        # imap keeps job order, so the float sums are added in a fixed order.
        for chunk_sizes, chunk_sum, chunk_count in pool.imap(_make_chunk,
                                                             jobs):
            sizes.extend(chunk_sizes)
            mean_sum += chunk_sum
            mean_count += chunk_count
            if bar:
                bar.update(len(sizes))

    for split, split_specs in specs.items():
        with open(os.path.join(out_dir, split + '.txt'), 'w') as f:
            for s in split_specs:
                f.write('{} {}\n'.format(s.relpath(n_classes), s.label))
    np.save(os.path.join(out_dir, 'mean.npy'),
            (mean_sum / mean_count).astype(np.float32))
    return Summary(len(sizes), sum(sizes), time.perf_counter() - start)


def cached_dataset(workdir: str, n_images: int, n_classes: int = 100) -> str:
    """The benchmarks' dataset of ``n_images`` training images (made once).

    Seed 0, kept as ``WORKDIR/dataset-N`` (100 classes) or
    ``WORKDIR/dataset-N-cC`` for later runs.

    Args:
        workdir: Where the dataset is kept.
        n_images: Training images.
        n_classes: Classes, one folder each.

    Returns:
        The dataset's folder (with ``train.txt``).
    """
    name = 'dataset-{}'.format(n_images)
    if n_classes != 100:
        name += '-c{}'.format(n_classes)
    dataset_dir = os.path.join(workdir, name)
    if not os.path.exists(os.path.join(dataset_dir, 'train.txt')):
        print('generating {} images into {}'.format(n_images, dataset_dir))
        generate(dataset_dir, n_images, n_classes=n_classes, seed=0)
    return dataset_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    parser = argparse.ArgumentParser(
        description='Generate an ImageNet-like dataset of JPEG files.')
    parser.add_argument('out_dir')
    parser.add_argument('--n-images', type=int, required=True)
    parser.add_argument('--n-classes', type=int, required=True)
    parser.add_argument('--seed', type=int, required=True)
    parser.add_argument('--val-images', type=int, default=0)
    parser.add_argument('--mean-size', type=float, default=110000,
                        help='wanted mean file size in bytes')
    parser.add_argument('--mean-samples', type=int, default=1000,
                        help='training images averaged into mean.npy')
    parser.add_argument('--workers', type=int, default=None,
                        help='worker processes (default: one per CPU)')
    args = parser.parse_args(argv)
    summary = generate(args.out_dir, args.n_images, args.n_classes, args.seed,
                       val_images=args.val_images, mean_size=args.mean_size,
                       mean_samples=args.mean_samples, workers=args.workers)
    print(summary)
    return 0


if __name__ == '__main__':
    sys.exit(main())
