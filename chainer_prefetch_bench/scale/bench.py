#!/usr/bin/env python
"""The iterator at ImageNet scale: construction, memory and CPU per batch.

For datasets of 10,000 to 1,281,167 examples (tiny files: the cost of data
is not what is measured here), each configuration runs in a fresh child
process:

``no-staging``   ``local_dir=None``;
``staging``      a local directory without a limit (``recheck_sources``
                 the default, ``'directories'``);
``staging-each-epoch``
                 the same with ``recheck_sources='each_epoch'``;
``capacity``     a local directory limited to half of the dataset's bytes.

Each run reports the constructor's time, the training process's memory
growth after construction, and, over ``--batches`` batches read from an
empty local directory (cold) and then again in the same order by a new
iterator (warm), the wall time and the training process's own CPU time per
batch (every thread of it, not the loader processes).  A new iterator
compares each copy it finds with its source the first time it uses it; an
epoch after the first does not (with ``'directories'``).  To measure such
a later epoch without running whole epochs of 1.28 million examples, the
warm iterator is told before it starts that every copy was compared in
its epoch 0 (it then behaves as in an epoch after the one that compared
them: one ``stat`` per directory per epoch), after the stamps of every
directory have been read for its epoch 0 (timed apart: ``stamps_s``; see
``_read_stamps``).  With ``--preset`` the files
are read through the emulated shared storage (``testbed.storage``), so
that each ``stat`` and lookup pays the preset's metadata latency.

The capacity bookkeeping at full size is also measured on its own: the
eviction strategy, the future uses and the scheduler's local-copy marks,
filled as a capacity-limited run would fill them after one epoch at 50%,
with ``tracemalloc`` (``bookkeeping`` in the output).

Usage::

    python -m chainer_prefetch_bench.scale.bench --sizes 10000,100000,1281167 \\
        --out results/scale/scale.json
"""
import argparse
import contextlib
import os
import resource
import shutil
import sys
import time

from chainer_prefetch_bench.testbed import storage
from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.processes import (
    answer_child,
    exit_on_sigterm,
    run_in_child,
    run_order,
)
from chainer_prefetch_bench.testbed.report import write_json

BATCH_SIZE = 32
FILE_BYTES = 64
FILES_PER_DIRECTORY = 1000
CONFIGS = ('no-staging', 'staging', 'staging-each-epoch', 'capacity')


class TinyFiles:
    """Examples that are tiny files: each reads its file into a uint8 array.

    Takes part in staging through the two-method protocol.

    Args:
        paths: The files.
    """

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        import numpy
        with open(self.paths[index], 'rb') as f:
            return numpy.frombuffer(f.read(), numpy.uint8)

    def example_files(self, index):
        return (self.paths[index],)

    def with_file_locations(self, locate):
        return TinyFiles(_Located(self.paths, locate))


class _Located:
    """The paths of a dataset, mapped on access (as large as the original)."""

    def __init__(self, paths, locate):
        self._paths = paths
        self._locate = locate

    def __len__(self):
        return len(self._paths)

    def __getitem__(self, index):
        return self._locate(self._paths[index])


def make_files(root: str, n: int) -> str:
    """Writes ``n`` tiny files under ``root`` (once); returns the list file."""
    list_file = os.path.join(root, 'files.txt')
    if os.path.exists(list_file):
        return list_file
    os.makedirs(root, exist_ok=True)
    payload = bytes(range(FILE_BYTES))
    paths = []
    for index in range(n):
        directory = os.path.join(root, 'd{:05d}'.format(
            index // FILES_PER_DIRECTORY))
        if index % FILES_PER_DIRECTORY == 0:
            os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, 'f{:07d}.bin'.format(index))
        with open(path, 'wb') as f:
            f.write(payload)
        paths.append(path)
    with open(list_file + '.tmp', 'w') as f:
        f.write('\n'.join(paths) + '\n')
    os.rename(list_file + '.tmp', list_file)
    return list_file


def _rss_bytes() -> int:
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) * 1024
    return 0


def _timed_batches(iterator, n_batches):
    """(seconds, own CPU seconds) of ``n_batches`` batches."""
    cpu = time.process_time()
    wall = time.perf_counter()
    for _ in range(n_batches):
        batch = next(iterator)
        assert len(batch) == BATCH_SIZE
    return time.perf_counter() - wall, time.process_time() - cpu


def run_one(config):
    """One configuration in this (child) process; returns the result dict."""
    import numpy
    from chainer.iterators import ShuffleOrderSampler

    from chainer_prefetch import PrefetchMultiprocessIterator
    with open(config['list_file']) as lines:
        paths = lines.read().split()
    if config['served_root'] != config['files_root']:  # through the mount
        offset = len(config['files_root'])
        paths = [config['served_root'] + path[offset:] for path in paths]
    dataset = TinyFiles(paths)
    kind = config['config']
    options = {}
    if kind != 'no-staging':
        options['local_dir'] = config['local_dir']
    if kind == 'staging-each-epoch':
        options['recheck_sources'] = 'each_epoch'
    if kind == 'capacity':
        options['local_capacity'] = len(paths) * FILE_BYTES // 2

    def make():
        return PrefetchMultiprocessIterator(
            dataset, BATCH_SIZE, n_processes=2,
            order_sampler=ShuffleOrderSampler(numpy.random.RandomState(0)),
            **options)

    rss_before = _rss_bytes()
    started = time.perf_counter()
    iterator = make()
    construction_s = time.perf_counter() - started
    rss_growth = _rss_bytes() - rss_before
    result = {'config': kind, 'n_examples': len(paths),
              'construction_s': construction_s,
              'rss_growth_mb': rss_growth / 2 ** 20}
    try:
        next(iterator)  # start-up is not a batch
        seconds, cpu = _timed_batches(iterator, config['batches'])
        result.update(cold_ms_per_batch=1000 * seconds / config['batches'],
                      cold_own_cpu_ms_per_batch=1000 * cpu / config['batches'])
    finally:
        iterator.finalize()
    iterator = make()  # the same order: every file is local now
    store = iterator._store
    if store is not None and store.checks is not None:
        store.checks._compared[:] = 0  # as in an epoch after the first
        if store.checks.mode == 'directories':
            result.update(_read_stamps(store.checks, paths))
    try:
        next(iterator)
        seconds, cpu = _timed_batches(iterator, config['batches'])
        result.update(warm_ms_per_batch=1000 * seconds / config['batches'],
                      warm_own_cpu_ms_per_batch=1000 * cpu / config['batches'])
        result['stats'] = {key: value for key, value in iterator.stats.items()
                           if key != 'by_epoch'}
        result['warm_source_stats_per_batch'] = (
            result['stats']['source_stats'] / (config['batches'] + 1))
    finally:
        iterator.finalize()
    result['peak_rss_mb'] = resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def _read_stamps(checks, paths) -> dict:
    """Reads, untimed, the stamp of every directory of ``paths`` for epoch 0.

    An epoch reads each directory's stamp once, the first time it meets
    the directory: over a whole epoch that is one ``stat`` per directory,
    but a window of a few hundred batches at the start of an epoch meets
    every directory of a large dataset.  So the window is timed with the
    stamps read, and the once-per-epoch cost is reported apart: the
    directories and the seconds their stamps took one after the other (the
    copy threads read them in parallel).
    """
    directories = sorted({os.path.dirname(path) for path in paths})
    started = time.perf_counter()
    for directory in directories:
        checks.trusts(0, [os.path.join(directory, 'any')], 0)
    return {'directories': len(directories),
            'stamps_s': time.perf_counter() - started}


def bookkeeping(n_examples: int, share: float = 0.5) -> dict:
    """Memory of the capacity bookkeeping after one epoch at ``share`` of the dataset."""
    import tracemalloc

    import numpy

    from chainer_prefetch.policy import FutureUses, make_strategy
    tracemalloc.start()
    strategy = make_strategy('belady')
    future = FutureUses(n_examples)
    known_local = numpy.full(n_examples, -1, dtype=numpy.int32)
    random = numpy.random.RandomState(0)
    order = random.permutation(n_examples)
    future.add_epoch(0, order)
    future.add_epoch(1, random.permutation(n_examples))
    started = time.perf_counter()
    stored = int(n_examples * share)
    for position in range(n_examples):
        item = int(order[position])
        if len(strategy) >= stored:
            victim = strategy.victim(position)
            if victim is None:
                continue
            strategy.remove(victim)
            known_local[victim] = -1
        strategy.hold(item, position)
        strategy.use(item, position, future.following_use(item, position))
        known_local[item] = 0
    now, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {'n_examples': n_examples, 'stored': len(strategy),
            'current_mb': now / 2 ** 20, 'peak_mb': peak / 2 ** 20,
            'heap_entries': strategy.heap_size,
            'seconds': time.perf_counter() - started}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if answer_child(argv, run_one):
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--sizes', default='10000,100000,1281167')
    parser.add_argument('--configs', default=','.join(CONFIGS))
    parser.add_argument('--batches', type=int, default=300)
    parser.add_argument('--workdir', default='/tmp/chainer_prefetch_scale')
    parser.add_argument('--out', default='results/scale/scale.json')
    parser.add_argument('--run-timeout', type=float, default=1800)
    parser.add_argument('--repeats', type=int, default=1,
                        help='runs of each configuration per size, interleaved')
    parser.add_argument('--preset', choices=sorted(storage.PRESETS),
                        help='read the files through emulated shared storage')
    args = parser.parse_args(argv)
    exit_on_sigterm()  # (a mount is stopped on the way out)
    sizes = [int(size) for size in args.sizes.split(',')]
    configs = [config for config in args.configs.split(',') if config]
    runs, books = [], []
    for size in sizes:
        started = time.perf_counter()
        files_root = os.path.join(args.workdir, 'files-{}'.format(size))
        list_file = make_files(files_root, size)
        print('{} files ready ({:.0f} s)'.format(size, time.perf_counter()
                                                 - started), flush=True)
        with contextlib.ExitStack() as stack:
            served_root = files_root
            if args.preset:
                served_root = os.path.join(args.workdir, 'mnt')
                os.makedirs(served_root, exist_ok=True)
                stack.enter_context(storage.mounted(files_root, served_root,
                                                    preset=args.preset))
            for repeat, config in ((repeat, config)
                                   for repeat in range(args.repeats)
                                   for config in run_order(configs, repeat)):
                local_dir = os.path.join(args.workdir, 'local')
                shutil.rmtree(local_dir, ignore_errors=True)
                time.sleep(1.5 if args.preset else 0)  # (the mount's caches expire)
                result = run_in_child(__spec__.name, {
                    'config': config, 'list_file': list_file,
                    'files_root': files_root, 'served_root': served_root,
                    'local_dir': local_dir, 'batches': args.batches},
                    args.run_timeout)
                result['repeat'] = repeat
                runs.append(result)
                print('{n_examples:>9} {config:<18} construction {construction_s:6.2f} s'
                      ', +{rss_growth_mb:6.1f} MB; cold {cold_ms_per_batch:6.2f} '
                      'ms/batch ({cold_own_cpu_ms_per_batch:5.2f} ms CPU), warm '
                      '{warm_ms_per_batch:6.2f} ms/batch ({warm_own_cpu_ms_per_batch:5.2f} '
                      'ms CPU, {stats_per_batch:.1f} stat){stamps}'.format(
                          stamps='' if 'directories' not in result else
                          '; stamps of {directories} directories {stamps_s:.2f} s'
                          .format(**result),
                          stats_per_batch=result.get('warm_source_stats_per_batch', 0),
                          **result), flush=True)
        shutil.rmtree(os.path.join(args.workdir, 'local'), ignore_errors=True)
        books.append(bookkeeping(size))
        print('{n_examples:>9} capacity bookkeeping at 50%: {stored} stored, '
              '{current_mb:.0f} MB ({peak_mb:.0f} MB peak)'.format(**books[-1]),
              flush=True)
    write_json(args.out, {
        'preset': args.preset,
        'command': 'python -m {} {}'.format(__spec__.name, ' '.join(argv)),
        'machine': machine_description(), 'batch_size': BATCH_SIZE,
        'file_bytes': FILE_BYTES, 'runs': runs, 'bookkeeping': books})
    print('wrote ' + args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
