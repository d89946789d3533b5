#!/usr/bin/env python
"""What each loader asks of shared storage per epoch, and what it costs.

On a parallel file system every ``stat`` and ``open`` is a round trip to the
metadata server that all nodes share.  This benchmark serves the JPEG
dataset (``testbed.jpeg_dataset``) through the emulated storage with a
preset that charges metadata (``lustre``: 8 ms per lookup or ``stat``,
attributes cached 1 s) and runs, each in a fresh child process, several
epochs of:

``chainer-direct``       Chainer's MultiprocessIterator reading the mount.
``pre-copied``           The dataset copied to local disk first (8 threads;
                         what the copy asks is counted as its epoch 0's),
                         then Chainer's iterator reading the copy.
``ours-directories``     PrefetchMultiprocessIterator from an empty local
                         directory, ``recheck_sources='directories'`` (the
                         default).
``ours-each-epoch``      The same, ``recheck_sources='each_epoch'``.
``ours-never``           The same, ``recheck_sources='never'`` (asks nothing
                         of shared storage once every copy is made: the
                         warm reference).

Runs of the methods alternate (``--repeats``).  Per epoch it reports the
seconds and images/s, the operations the storage daemon served meanwhile
(``getattr``: lookups and stats; ``open``; ``read`` requests; directory
reads), counted exactly by the daemon, and,
for ours, the ``source_stats`` and ``source_opens`` of ``iterator.stats``
(what the iterator asked, by the epoch of the access it asked for).  An
epoch's daemon counts include what was prefetched during it for the next.
The table gives the medians of the first epochs and of the later ones
over every run of a method.

Usage::

    python -m chainer_prefetch_bench.minibatch.metadata --epochs 4 \\
        --out results/metadata/metadata.json
"""
import argparse
import os
import shutil
import statistics
import sys
import time

from chainer_prefetch_bench.minibatch.bench import (
    BATCH_SIZE,
    COPIERS,
    _order_sampler,
    copy_dataset,
    largest_example_bytes,
)
from chainer_prefetch_bench.testbed import storage
from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.page_cache import drop_page_cache
from chainer_prefetch_bench.testbed.prepare import prepare_jpeg_benchmark
from chainer_prefetch_bench.testbed.processes import answer_child, run_in_child, run_order
from chainer_prefetch_bench.testbed.report import write_json
from chainer_prefetch_bench.testbed.storage.counts import read_counts

METHODS = ('chainer-direct', 'pre-copied', 'ours-directories',
           'ours-each-epoch', 'ours-never')
RECHECK = {'ours-directories': 'directories', 'ours-each-epoch': 'each_epoch',
           'ours-never': 'never'}
DIRECTORY_OPS = ('readdir', 'opendir')


def _iterator(method, dataset, config):
    from chainer.iterators import MultiprocessIterator

    import chainer_prefetch
    if method in RECHECK:
        return chainer_prefetch.PrefetchMultiprocessIterator(
            dataset, BATCH_SIZE, n_processes=config['n_processes'],
            order_sampler=_order_sampler(), local_dir=config['local_dir'],
            n_copy_threads=config['n_copy_threads'],
            recheck_sources=RECHECK[method])
    return MultiprocessIterator(dataset, BATCH_SIZE,
                                n_processes=config['n_processes'],
                                order_sampler=_order_sampler(),
                                shared_mem=config['shared_mem'])


def _fs_delta(before, after):
    delta = {name: after[name] - before[name] for name in after}
    delta['directory_reads'] = sum(delta.pop(name) for name in DIRECTORY_OPS)
    return delta


def run_one(config):
    """Runs one method's epochs in this (child) process; returns the result dict."""
    import chainer

    method = config['method']
    counts_path = config['counts_path']
    root = config['remote_root']
    copy = None
    if method == 'pre-copied':
        before = read_counts(counts_path)
        seconds = copy_dataset(config['remote_root'], config['list_file'],
                               config['copy_target'], COPIERS)
        copy = {'seconds': seconds,
                'fs_ops': _fs_delta(before, read_counts(counts_path))}
        root = config['copy_target']
    dataset = chainer.datasets.LabeledImageDataset(config['list_file'], root)
    batches_per_epoch = len(dataset) // BATCH_SIZE
    iterator = _iterator(method, dataset, config)
    epochs = []
    try:
        for _ in range(config['epochs']):
            before = read_counts(counts_path)
            started = time.perf_counter()
            for _ in range(batches_per_epoch):
                next(iterator)
            seconds = time.perf_counter() - started
            epochs.append({'seconds': seconds,
                           'images_per_s': batches_per_epoch * BATCH_SIZE / seconds,
                           'fs_ops': _fs_delta(before, read_counts(counts_path))})
        stats = getattr(iterator, 'stats', None)
    finally:
        if hasattr(iterator, 'finalize'):
            iterator.finalize()
    if stats is not None:
        for number, epoch in enumerate(epochs):
            counted = stats['by_epoch'].get(number, {})
            epoch['asked'] = {name: counted.get(name, 0)
                              for name in ('source_stats', 'source_opens')}
    return {'method': method, 'n_files': len(dataset), 'copy': copy,
            'epochs': epochs,
            'iterator_stats': None if stats is None else {
                name: stats[name] for name in ('source_stats', 'source_opens',
                                               'files_copied',
                                               'files_already_local')}}


def summarize(method_runs, n_directories):
    """One row per method: medians of its first epochs, and of its later ones.

    Args:
        method_runs: The runs of one method (one per repetition).
        n_directories: Directories holding the dataset's files.
    """
    run = method_runs[0]
    n_files = run['n_files']
    firsts = [r['epochs'][0] for r in method_runs]
    later = [epoch for r in method_runs for epoch in r['epochs'][1:]]

    def median(key, sub=None, epochs=later):
        values = [(e[key] if sub is None else e[key][sub]) for e in epochs]
        return statistics.median(values) if values else None

    first = {'seconds': median('seconds', epochs=firsts),
             'fs_ops': {name: median('fs_ops', name, firsts)
                        for name in ('getattr', 'open')}}
    if 'asked' in firsts[0]:
        first['asked'] = {name: median('asked', name, firsts)
                          for name in ('source_stats', 'source_opens')}

    row = {'method': run['method'], 'n_files': n_files,
           'n_directories': n_directories, 'repeats': len(method_runs),
           'first_epoch_s': first['seconds'],
           'first_epoch_fs_getattr': first['fs_ops']['getattr'],
           'first_epoch_fs_open': first['fs_ops']['open'],
           'later_epoch_s': median('seconds'),
           'later_images_per_s': median('images_per_s'),
           'later_fs_getattr': median('fs_ops', 'getattr'),
           'later_fs_open': median('fs_ops', 'open'),
           'later_fs_directory_reads': median('fs_ops', 'directory_reads')}
    if 'asked' in first:
        row['first_epoch_asked_stats'] = first['asked']['source_stats']
        row['first_epoch_asked_opens'] = first['asked']['source_opens']
        row['later_asked_stats'] = median('asked', 'source_stats')
        row['later_asked_opens'] = median('asked', 'source_opens')
    if run['copy'] is not None:
        copies = [r['copy'] for r in method_runs]
        row['copy_s'] = median('seconds', epochs=copies)
        row['copy_fs_getattr'] = median('fs_ops', 'getattr', copies)
        row['copy_fs_open'] = median('fs_ops', 'open', copies)
    if row['later_fs_getattr'] is not None:
        metadata = row['later_fs_getattr'] + row['later_fs_open']
        row['later_metadata_ops_per_file'] = metadata / n_files
    return row


def print_table(rows):
    print('\n{:<18} {:>9} {:>15} {:>9} {:>9} {:>19} {:>15}'.format(
        'method', 'epoch 1 s', 'epoch 1 getattr', 'open', 'later s',
        'later getattr+open', 'asked stat/open'))
    for row in rows:
        asked = ('{:.0f}/{:.0f}'.format(row['later_asked_stats'],
                                        row['later_asked_opens'])
                 if 'later_asked_stats' in row else '-')
        later_ops = ('-' if row['later_fs_getattr'] is None else '{:.0f}+{:.0f}'.format(
            row['later_fs_getattr'], row['later_fs_open']))
        print('{:<18} {:>9.2f} {:>15} {:>9} {:>9} {:>19} {:>15}'.format(
            row['method'], row['first_epoch_s'], row['first_epoch_fs_getattr'],
            row['first_epoch_fs_open'],
            '-' if row['later_epoch_s'] is None else '{:.2f}'.format(
                row['later_epoch_s']), later_ops, asked))
        if 'copy_s' in row:
            print('{:<18} copy {:.2f} s: getattr {}, open {}'.format(
                '', row['copy_s'], row['copy_fs_getattr'], row['copy_fs_open']))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[1])
    parser.add_argument('--epochs', type=int, default=4)
    parser.add_argument('--direct-epochs', type=int, default=2,
                        help='epochs of chainer-direct (slow; the same each epoch)')
    parser.add_argument('--methods', default=','.join(METHODS))
    parser.add_argument('--repeats', type=int, default=1,
                        help='runs of each method, interleaved')
    parser.add_argument('--n-images', type=int, default=2000)
    parser.add_argument('--n-classes', type=int, default=2,
                        help='one folder each; ImageNet has ~1,281 files per folder')
    parser.add_argument('--processes', type=int, default=2)
    parser.add_argument('--copy-threads', type=int, default=16)
    parser.add_argument('--preset', default='lustre',
                        choices=sorted(storage.PRESETS))
    parser.add_argument('--workdir', default='/tmp/chainer_prefetch_bench')
    parser.add_argument('--run-timeout', type=float, default=1800)
    parser.add_argument('--out', default='results/metadata/metadata.json')
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if answer_child(argv, run_one):
        return 0
    args = parse_args(argv)
    dataset_dir = prepare_jpeg_benchmark(args.workdir, args.n_images,
                                         args.n_classes)
    if dataset_dir is None:
        return 2
    list_file = os.path.join(dataset_dir, 'train.txt')
    with open(list_file) as lines:
        n_directories = len({os.path.dirname(line.split()[0])
                             for line in lines if line.strip()})
    mountpoint = os.path.join(args.workdir, 'mnt')
    local_dir = os.path.join(args.workdir, 'local')
    copy_target = os.path.join(args.workdir, 'copy')
    os.makedirs(mountpoint, exist_ok=True)
    runs = []
    methods = args.methods.split(',')
    with storage.mounted(dataset_dir, mountpoint, preset=args.preset) as mount:
        for method in (method for repeat in range(args.repeats)
                       for method in run_order(methods, repeat)):
            for path in (local_dir, copy_target):
                shutil.rmtree(path, ignore_errors=True)
            drop_page_cache(dataset_dir)
            time.sleep(1.5)  # let the kernel's 1 s attribute cache expire
            config = {'method': method, 'list_file': list_file,
                      'remote_root': mountpoint, 'local_dir': local_dir,
                      'copy_target': copy_target,
                      'counts_path': mount.counts_path,
                      'shared_mem': largest_example_bytes(list_file, dataset_dir),
                      'n_processes': args.processes,
                      'n_copy_threads': args.copy_threads,
                      'epochs': (args.direct_epochs if method == 'chainer-direct'
                                 else args.epochs)}
            run = run_in_child(__spec__.name, config, args.run_timeout)
            runs.append(run)
            print('{:<18} epochs: {}'.format(method, ', '.join(
                '{:.2f} s'.format(e['seconds']) for e in run['epochs'])),
                flush=True)
    for path in (local_dir, copy_target):
        shutil.rmtree(path, ignore_errors=True)
    rows = [summarize([run for run in runs if run['method'] == method],
                      n_directories) for method in methods]
    report = {'command': 'python -m {} {}'.format(__spec__.name, ' '.join(argv)),
              'machine': machine_description(), 'preset': args.preset,
              'storage_params': storage.PRESETS[args.preset],
              'n_images': args.n_images, 'n_classes': args.n_classes,
              'n_directories': n_directories,
              'rows': rows, 'runs': runs}
    write_json(args.out, report)
    print_table(rows)
    print('\nwrote ' + args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
