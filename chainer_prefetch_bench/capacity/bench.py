#!/usr/bin/env python
"""A local directory smaller than the dataset, and the next-epoch cache, measured.

Every run reads an ImageNet-like JPEG dataset (``testbed.jpeg_dataset``)
through emulated shared storage (``testbed.storage``, a real FUSE
mount) with PrefetchMultiprocessIterator for several epochs, in a fresh
child process, with an empty local directory and a dropped page cache:

``capacity``   ``local_capacity`` at each fraction of the dataset's bytes
               (default 25/50/75/100%), for each eviction policy: Belady
               (farthest next use, with look-ahead copying), LRU and
               fill-once.
``cache``      the next-epoch cache, off and on, without a local directory
               (every read goes to shared storage) and with one at 50%
               (Belady).

Per epoch it records what the iterator counted for the accesses of that
epoch: bytes read from shared storage (stage-2 copies plus stage-3 reads of
the source), stage-3 reads served from local copies, from the source and
from the next-epoch cache, the epoch's wall time, and the time to its first
minibatches.  Steady state is the mean over epochs 2 and later (epoch 0
fills the directory; epoch 1 still copies what epoch 0 read from the source
while the first copies were queued).

Usage::

    python -m chainer_prefetch_bench.capacity.bench            # full: ~10 min
    python -m chainer_prefetch_bench.capacity.bench --quick    # ~2 min
    python -m chainer_prefetch_bench.capacity.plot results/capacity/capacity.json

Output: a JSON file with every run, and the tables on stdout.
"""
import argparse
import os
import shutil
import statistics
import sys
import time

from chainer_prefetch_bench.testbed import storage
from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.page_cache import drop_page_cache
from chainer_prefetch_bench.testbed.prepare import prepare_jpeg_benchmark
from chainer_prefetch_bench.testbed.processes import answer_child, run_in_child
from chainer_prefetch_bench.testbed.report import write_json

POLICIES = ('belady', 'lru', 'fill_once')
BATCH_SIZE = 32
ORDER_SEED = 0
FIRST_BATCHES = 3  # "time to the first minibatches" of an epoch


# ---------------------------------------------------------------- child side

def run_one(config):
    """Iterates ``config['epochs']`` epochs; returns per-epoch measurements."""
    import chainer
    import numpy
    from chainer.iterators import ShuffleOrderSampler

    from chainer_prefetch import PrefetchMultiprocessIterator
    dataset = chainer.datasets.LabeledImageDataset(config['list_file'],
                                                   config['remote_root'])
    started = time.perf_counter()
    iterator = PrefetchMultiprocessIterator(
        dataset, BATCH_SIZE, n_processes=config['n_processes'],
        order_sampler=ShuffleOrderSampler(numpy.random.RandomState(ORDER_SEED)),
        local_dir=config['local_dir'], n_copy_threads=config['copy_threads'],
        n_copy_ahead=config['copy_ahead'],
        local_capacity=config['capacity_bytes'],
        eviction_policy=config['policy'] or 'belady',
        next_epoch_cache_examples=config['cache_examples'])
    epoch_started = started
    epochs = []
    first_batches = None
    batch_in_epoch = 0
    peak_used = 0
    try:
        while iterator.epoch < config['epochs']:
            iterator.next()
            batch_in_epoch += 1
            now = time.perf_counter()
            if batch_in_epoch == FIRST_BATCHES:
                first_batches = now - epoch_started
            used = iterator.stats['local_bytes_used']
            peak_used = max(peak_used, used or 0)
            if iterator.is_new_epoch:
                epochs.append({'seconds': now - epoch_started,
                               'first_batches_s': first_batches})
                epoch_started, batch_in_epoch = now, 0
    finally:
        stats = iterator.stats
        iterator.finalize()
    for epoch, row in enumerate(epochs):
        row.update(stats['by_epoch'].get(epoch, {}))
    return {'config': {key: value for key, value in config.items()
                       if key not in ('list_file', 'remote_root', 'local_dir')},
            'total_s': time.perf_counter() - started, 'epochs': epochs,
            'peak_local_bytes': peak_used, 'stats': stats}


# ---------------------------------------------------------------- parent side

def plan_runs(args):
    """Every run's settings."""
    runs = []
    for fraction in args.fractions:
        for policy in args.policies:
            runs.append({'kind': 'capacity', 'fraction': fraction,
                         'policy': policy, 'cache_examples': None})
    if args.cache_examples:
        for fraction in (None, 0.5):
            for cache in (None, args.cache_examples):
                runs.append({'kind': 'cache', 'fraction': fraction,
                             'policy': 'belady' if fraction else None,
                             'cache_examples': cache})
    return runs


def steady(run, key):
    """Mean of a per-epoch value over epochs 2 and later (or the last epoch)."""
    rows = run['epochs'][2:] or run['epochs'][-1:]
    return statistics.mean(row[key] for row in rows)


def shared_fraction(row, dataset_bytes):
    """Bytes read from shared storage for the epoch, as a share of the dataset."""
    return (row.get('bytes_copied', 0) + row.get('bytes_from_source', 0)
            ) / dataset_bytes


def local_share(row):
    """Share of stage-3 reads served from local copies (or memory)."""
    local = row.get('examples_from_local', 0) + row.get('examples_from_cache', 0)
    total = local + row.get('examples_from_source', 0)
    return local / total if total else 0.0


def annotate(run, dataset_bytes):
    """Adds the derived per-epoch shares to a run."""
    for row in run['epochs']:
        row['shared_fraction'] = shared_fraction(row, dataset_bytes)
        row['local_share'] = local_share(row)


def print_capacity_table(runs):
    print('\nLocal directory limited to a share of the dataset '
          '(steady state = mean of epochs 2+):')
    print('{:>6} {:<10} {:>16} {:>8} {:>14} {:>12} {:>10}'.format(
        'limit', 'policy', 'shared/epoch', 'ideal', 'stage-3 local',
        'epoch s', 'peak/limit'))
    checks = []
    for run in runs:
        config = run['config']
        if config['kind'] != 'capacity':
            continue
        ideal = 1 - config['fraction']
        shared = steady(run, 'shared_fraction')
        local = steady(run, 'local_share')
        print('{:>5.0f}% {:<10} {:>16.3f} {:>8.2f} {:>13.1f}% {:>12.2f} '
              '{:>10.3f}'.format(
                  100 * config['fraction'], config['policy'], shared, ideal,
                  100 * local, steady(run, 'seconds'),
                  run['peak_local_bytes'] / config['capacity_bytes']))
        if config['policy'] == 'belady':
            checks.append((config['fraction'], shared, ideal, local))
    print('\nTargets for belady (look-ahead copying):')
    for fraction, shared, ideal, local in checks:
        print('  {:>3.0f}%: shared {:.3f} vs ideal {:.2f} (within 0.05: {}); '
              'stage-3 local {:.1f}% (>= 95%: {})'.format(
                  100 * fraction, shared, ideal,
                  'met' if abs(shared - ideal) <= 0.05 else 'MISSED',
                  100 * local, 'met' if local >= 0.95 else 'MISSED'))


def print_cache_table(runs):
    rows = [run for run in runs if run['config']['kind'] == 'cache']
    if not rows:
        return
    print('\nNext-epoch cache (means over epochs 1+; "first batches": time to '
          'the first {} batches of an epoch, median):'.format(FIRST_BATCHES))
    print('{:<16} {:>6} {:>12} {:>14} {:>14} {:>15} {:>9}'.format(
        'local directory', 'cache', 'from cache', 'storage reads',
        'shared bytes', 'first batches', 'epoch s'))
    for run in rows:
        config = run['config']
        later = run['epochs'][1:]
        with_files = config['fraction'] is not None
        print('{:<16} {:>6} {:>12.1f} {:>14.1f} {:>14} {:>14.3f}s {:>9.2f}'
              .format('none' if not with_files else
                      '{:.0f}%, belady'.format(100 * config['fraction']),
                      config['cache_examples'] or 'off',
                      statistics.mean(row.get('examples_from_cache', 0)
                                      for row in later),
                      statistics.mean(row.get('examples_from_source', 0)
                                      for row in later),
                      '{:.3f}'.format(statistics.mean(
                          row['shared_fraction'] for row in later))
                      if with_files else '-',
                      statistics.median(row['first_batches_s'] for row in later),
                      statistics.median(row['seconds'] for row in later)))
    print('"storage reads": examples stage 3 read from shared storage; '
          '"shared bytes": all bytes read from it (copies included), as a '
          'share of the dataset (known only with a local directory).')


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--workdir', default='/tmp/chainer_prefetch_bench')
    parser.add_argument('--n-images', type=int, default=2000)
    parser.add_argument('--epochs', type=int, default=4)
    parser.add_argument('--fractions', default='0.25,0.5,0.75,1.0')
    parser.add_argument('--policies', default=','.join(POLICIES))
    parser.add_argument('--processes', type=int, default=2)
    parser.add_argument('--copy-threads', type=int, default=16)
    parser.add_argument('--copy-ahead', type=int, default=4,
                        help='batches staged ahead; their copies are held '
                        'against the limit until used')
    parser.add_argument('--cache-examples', type=int, default=64,
                        help='next-epoch cache size (0: skip those runs)')
    parser.add_argument('--preset', default='paper',
                        choices=sorted(storage.PRESETS))
    parser.add_argument('--out', default='results/capacity/capacity.json')
    parser.add_argument('--run-timeout', type=float, default=1200)
    parser.add_argument('--quick', action='store_true',
                        help='600 images, 3 epochs, limits 50%% and 100%%')
    args = parser.parse_args(argv)
    if args.quick:
        args.n_images, args.epochs, args.fractions = 600, 3, '0.5,1.0'
    args.fractions = [float(value) for value in args.fractions.split(',')]
    args.policies = [value for value in args.policies.split(',') if value]
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        parser.error('unknown policies: ' + ', '.join(sorted(unknown)))
    if any(not 0 < value <= 1 for value in args.fractions):
        parser.error('fractions must be in (0, 1]')
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if answer_child(argv, run_one):
        return 0
    args = parse_args(argv)
    dataset_dir = prepare_jpeg_benchmark(args.workdir, args.n_images)
    if dataset_dir is None:
        return 2
    list_file = os.path.join(dataset_dir, 'train.txt')
    with open(list_file) as lines:
        names = [line.split()[0] for line in lines if line.strip()]
    dataset_bytes = sum(os.path.getsize(os.path.join(dataset_dir, name))
                        for name in names)
    mountpoint = os.path.join(args.workdir, 'mnt')
    local_dir = os.path.join(args.workdir, 'local')
    os.makedirs(mountpoint, exist_ok=True)
    runs = []
    with storage.mounted(dataset_dir, mountpoint, preset=args.preset):
        for config in plan_runs(args):
            fraction = config['fraction']
            config.update(
                list_file=list_file, remote_root=mountpoint,
                local_dir=None if fraction is None else local_dir,
                capacity_bytes=(None if fraction is None else
                                int(fraction * dataset_bytes)),
                n_processes=args.processes, copy_threads=args.copy_threads,
                copy_ahead=args.copy_ahead, epochs=args.epochs)
            shutil.rmtree(local_dir, ignore_errors=True)
            drop_page_cache(dataset_dir)
            run = run_in_child(__spec__.name, config, args.run_timeout)
            annotate(run, dataset_bytes)
            runs.append(run)
            print('{kind:<8} limit {fraction} {policy} cache {cache_examples}:'
                  ' {seconds}'.format(seconds=', '.join(
                      '{:.1f}s/{:.2f}'.format(row['seconds'],
                                              row['shared_fraction'])
                      for row in run['epochs']), **config), flush=True)
    shutil.rmtree(local_dir, ignore_errors=True)
    report = {'command': 'python -m {} {}'.format(__spec__.name, ' '.join(argv)),
              'machine': machine_description(),
              'preset': args.preset,
              'storage_params': storage.PRESETS[args.preset],
              'n_images': args.n_images, 'dataset_bytes': dataset_bytes,
              'batch_size': BATCH_SIZE, 'runs': runs}
    write_json(args.out, report)
    print_capacity_table(runs)
    print_cache_table(runs)
    print('\nwrote ' + args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
