#!/usr/bin/env python3
"""Generates a synthetic shopping-like Parquet dataset.

Columns: ``id`` (int64, 0..N-1, unique), ``title`` (string), ``tokens``
(list<int32>), ``image`` (JPEG bytes), ``brand`` (string), ``price``
(float32), ``category`` (string).  N rows are spread over M files
``part-00000.parquet`` ... (rows in id order), written row group by row group
so memory stays bounded.

Example (about 2.4 GB)::

    python -m chainer_prefetch_bench.testbed.parquet_dataset /data/shopping --rows 300000 \\
        --files 16 --row-group-mb 120

The default row group is just under 128 MB, one HDFS block, as Parquet
writers on HDFS recommend.
"""
import argparse
import io
import json
import os
import sys
import time
from typing import Dict

import numpy
import pyarrow
import pyarrow.parquet
from PIL import Image

SCHEMA = pyarrow.schema([
    ('id', pyarrow.int64()),
    ('title', pyarrow.string()),
    ('tokens', pyarrow.list_(pyarrow.int32())),
    ('image', pyarrow.binary()),
    ('brand', pyarrow.string()),
    ('price', pyarrow.float32()),
    ('category', pyarrow.string()),
])
N_CATEGORIES = 50
_WORDS = ('cotton shirt slim fit denim jacket wool coat running shoes leather '
          'bag wireless earbuds stainless bottle ceramic mug organic tea '
          'vitamin gel pen notebook desk lamp usb cable phone case kids '
          'winter summer sale new premium classic mini pro max').split()


class JpegMaker:
    """Makes a distinct JPEG per row: a random colour ramp over shifted noise.

    Args:
        image_size: Side of the square images in pixels.
        seed: Seed of the noise fields.
    """

    def __init__(self, image_size: int, seed: int, n_noise_fields: int = 8):
        random = numpy.random.RandomState(seed)
        self.image_size = image_size
        self._ramp = numpy.linspace(0, 1, image_size, dtype=numpy.float32)
        self._noise = random.normal(
            0, 40, (n_noise_fields, image_size, image_size, 3)
        ).astype(numpy.float32)

    def __call__(self, random: numpy.random.RandomState) -> bytes:
        field = self._noise[random.randint(len(self._noise))]
        field = numpy.roll(field, random.randint(self.image_size, size=2), (0, 1))
        base = random.randint(0, 256, 3).astype(numpy.float32)
        pixels = base * self._ramp[:, None, None] + field
        buffer = io.BytesIO()
        Image.fromarray(numpy.clip(pixels, 0, 255).astype(numpy.uint8)).save(
            buffer, format='JPEG', quality=90)
        return buffer.getvalue()


def make_rows(first_id: int, count: int, make_jpeg: JpegMaker,
              random: numpy.random.RandomState) -> pyarrow.Table:
    """``count`` rows with ids ``first_id ..``."""
    ids = numpy.arange(first_id, first_id + count, dtype=numpy.int64)
    words = random.randint(0, len(_WORDS), (count, 6))
    titles = [' '.join(_WORDS[w] for w in row) for row in words]
    lengths = random.randint(8, 33, count)
    offsets = numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)
    token_values = random.randint(0, 30000, int(offsets[-1])).astype(numpy.int32)
    tokens = pyarrow.ListArray.from_arrays(offsets, token_values)
    image_bytes = [make_jpeg(random) for _ in range(count)]
    brands = ['brand{:03d}'.format(b) for b in random.randint(0, 200, count)]
    prices = random.lognormal(3.0, 1.0, count).astype(numpy.float32)
    categories = ['category{:02d}'.format(c)
                  for c in random.randint(0, N_CATEGORIES, count)]
    return pyarrow.Table.from_arrays(
        [pyarrow.array(ids), pyarrow.array(titles), tokens,
         pyarrow.array(image_bytes, pyarrow.binary()), pyarrow.array(brands),
         pyarrow.array(prices), pyarrow.array(categories)], schema=SCHEMA)


def rows_per_row_group(row_group_bytes: int, make_jpeg: JpegMaker) -> int:
    """Rows that fit in ``row_group_bytes`` (estimated from a sample)."""
    sample = make_rows(0, 200, make_jpeg, numpy.random.RandomState(0))
    return max(1, int(row_group_bytes / (sample.nbytes / 200)))


def generate(directory: str, rows: int, files: int, row_group_rows: int,
             image_size: int = 64, seed: int = 0) -> Dict:
    """Writes the dataset; returns a summary (also written as ``_dataset.json``).

    Args:
        directory: Output directory (created).
        rows: Rows in all (N).
        files: Files to spread them over (M).
        row_group_rows: Rows per row group.
        image_size: Side of the square JPEG images in pixels.
        seed: Seed of the content.

    Returns:
        A dict with the parameters, the bytes written and the seconds taken.
    """
    os.makedirs(directory, exist_ok=True)
    make_jpeg = JpegMaker(image_size, seed)
    random = numpy.random.RandomState(seed + 1)
    started = time.perf_counter()
    bounds = numpy.linspace(0, rows, files + 1).astype(numpy.int64)
    total_bytes = 0
    for index in range(files):
        path = os.path.join(directory, 'part-{:05d}.parquet'.format(index))
        with pyarrow.parquet.ParquetWriter(path, SCHEMA) as writer:
            for first in range(int(bounds[index]), int(bounds[index + 1]),
                               row_group_rows):
                count = min(row_group_rows, int(bounds[index + 1]) - first)
                writer.write_table(make_rows(first, count, make_jpeg, random),
                                   row_group_size=count)
        total_bytes += os.path.getsize(path)
    summary = {'rows': rows, 'files': files, 'row_group_rows': row_group_rows,
               'image_size': image_size, 'seed': seed, 'bytes': total_bytes,
               'seconds': round(time.perf_counter() - started, 1)}
    with open(os.path.join(directory, '_dataset.json'), 'w') as f:
        json.dump(summary, f, indent=1)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('directory')
    parser.add_argument('--rows', type=int, default=100000)
    parser.add_argument('--files', type=int, default=8)
    group = parser.add_mutually_exclusive_group()
    group.add_argument('--row-group-mb', type=float, default=120.0,
                       help='row-group size in MB (default 120: just under '
                       'one 128 MB HDFS block)')
    group.add_argument('--row-group-rows', type=int,
                       help='rows per row group (overrides --row-group-mb)')
    parser.add_argument('--image-size', type=int, default=64)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)
    if args.rows < 0 or args.files < 1:
        parser.error('--rows must be >= 0 and --files >= 1')
    row_group_rows = args.row_group_rows or rows_per_row_group(
        int(args.row_group_mb * 1e6), JpegMaker(args.image_size, args.seed))
    summary = generate(args.directory, args.rows, args.files, row_group_rows,
                       args.image_size, args.seed)
    print(json.dumps(summary))
    return 0


if __name__ == '__main__':
    sys.exit(main())
