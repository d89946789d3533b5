"""What watching a loader's opens costs per example.

Stage 3 loads every example of a staged dataset inside
``chainer_prefetch.staging.open_watch.watching`` (an audit hook records the
files it opens; its opens of staged files are redirected to the copies) and
judges the opens with ``OpenCheck.check``.  This times, in one process, the
loads of the benchmarks' JPEGs (``testbed.user_dataset``, read from a local
copy) with and without that, alternating, and reports the medians per
example; then the same for loads that only open a file and read one byte
(the cost itself, not hidden in a decode)::

    python -m chainer_prefetch_bench.minibatch.watch_cost [--images 512]

Output: per kind of load, the microseconds per example without and with
watching and the difference (also as a share of a load), plus ``--out``
JSON.
"""
import argparse
import os
import statistics
import time

from chainer_prefetch.staging.open_watch import OpenCheck, watching
from chainer_prefetch_bench.testbed import jpeg_dataset
from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.report import write_json
from chainer_prefetch_bench.testbed.user_dataset import PathListDataset


class FirstByte(PathListDataset):
    """Loads that open the file and read one byte: no decode."""

    def get_example(self, i):
        with open(self.paths[i], 'rb') as f:
            return f.read(1)


def _plain(dataset, indices):
    for i in indices:
        dataset[i]


def _watched(dataset, indices, check):
    for i in indices:
        expected = check.expected((dataset.paths[i],))
        with watching(check.redirect(expected, True)) as opened:
            dataset[i]
        check.check(expected, True, opened)


def measure(dataset, repeats: int):
    """Median seconds per example, ``(plain, watched)``."""
    root = os.path.dirname(os.path.dirname(dataset.paths[0]))
    # The copies are the files themselves: locate() maps a path to itself.
    check = OpenCheck('/nonexistent-local-root', lambda path: path, root)
    indices = range(len(dataset))
    _plain(dataset, indices)  # page cache and imports
    plain, watched = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        _plain(dataset, indices)
        plain.append((time.perf_counter() - started) / len(dataset))
        started = time.perf_counter()
        _watched(dataset, indices, check)
        watched.append((time.perf_counter() - started) / len(dataset))
    return statistics.median(plain), statistics.median(watched)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--workdir', default='/tmp/chainer_prefetch_bench')
    parser.add_argument('--images', type=int, default=512)
    parser.add_argument('--repeats', type=int, default=7)
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    folder = jpeg_dataset.cached_dataset(args.workdir, args.images)
    list_file = os.path.join(folder, 'train.txt')
    rows = {}
    for name, dataset in (('JPEG decode', PathListDataset(list_file, folder)),
                          ('first byte', FirstByte(list_file, folder))):
        plain, watched = measure(dataset, args.repeats)
        extra = watched - plain
        rows[name] = dict(plain_us=plain * 1e6, watched_us=watched * 1e6,
                          extra_us=extra * 1e6)
        print('{:<12} without watching {:8.1f} us/example, with {:8.1f}: '
              '{:+6.1f} us ({:+.1%})'.format(name, plain * 1e6, watched * 1e6,
                                             extra * 1e6, extra / plain))
    print('(medians of {} passes over {} JPEGs)'.format(args.repeats,
                                                       len(dataset)))
    if args.out:
        write_json(args.out, dict(rows=rows, images=len(dataset),
                                  repeats=args.repeats,
                                  machine=machine_description()))

if __name__ == '__main__':
    main()
