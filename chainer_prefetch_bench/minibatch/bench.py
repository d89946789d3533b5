#!/usr/bin/env python
"""The 1,000-minibatch benchmark (sec. 4.1 of the source paper), side by side.

Times how long each loader takes to deliver N minibatches of 32 images from
an ImageNet-like JPEG dataset (``testbed.jpeg_dataset``) that sits on emulated
shared storage (``testbed.storage``, a real FUSE mount):

``baseline-local``   Chainer's MultiprocessIterator reading the local copy
                     (the paper's baseline+SSD: the ideal case).
``baseline-remote``  MultiprocessIterator reading through the mount
                     (baseline+Lustre).
``proposed-cold``    PrefetchMultiprocessIterator reading the mount and
                     staging into an empty local directory.
``proposed-warm``    The same with the local directory already filled.
``prefetch-local``   PrefetchMultiprocessIterator reading the local copy
                     with no staging (the pipeline's own cost).
``copy-then-local``  Copy the whole dataset with 8 parallel copiers, then
                     baseline-local (the paper's Table 3 accounting).
``multithread``      Chainer's MultithreadIterator through the mount.
``torch``            PyTorch's DataLoader through the mount (if installed).

Every run happens in a fresh child process (so start-up costs are counted
the same way for all) with the same shuffled order of examples.  Before
each run the local directory is emptied and the page cache of every
dataset file (sources and local copies) is dropped with
``posix_fadvise(POSIX_FADV_DONTNEED)``; the mount itself never keeps file
data between opens (see ``testbed.storage``).  Runs are interleaved across
repetitions so that machine noise spreads over all methods.

Usage::

    python -m chainer_prefetch_bench.minibatch.bench --quick   # the README demo
    python -m chainer_prefetch_bench.minibatch.bench --batches 1000 \\
        --processes 2,4,8,16 \\
        --copy-thread-sweep 2,4,8,12,16 --repeats 3 --out results/bench.json

Output: a JSON file with ``runs`` (method, n_processes, n_copy_threads,
n_batches, total_s, first_batch_s, cumulative_s, cpu_s, peak RSS, process
count), the storage ``calibration``, the machine and the command; and a
comparison table on stdout.  ``chainer_prefetch_bench.minibatch.plot`` draws the
figures.
"""
import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from chainer_prefetch_bench.testbed import storage
from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.page_cache import drop_page_cache
from chainer_prefetch_bench.testbed.prepare import prepare_jpeg_benchmark
from chainer_prefetch_bench.testbed.processes import answer_child, run_in_child
from chainer_prefetch_bench.testbed.report import write_json

METHODS = ('baseline-local', 'baseline-remote', 'proposed-cold',
           'proposed-warm', 'prefetch-local', 'copy-then-local',
           'multithread', 'torch')
BATCH_SIZE = 32
ORDER_SEED = 0
COPIERS = 8


# ---------------------------------------------------------------- child side

def _order_sampler():
    import numpy
    from chainer.iterators import ShuffleOrderSampler
    return ShuffleOrderSampler(numpy.random.RandomState(ORDER_SEED))


def _make_iterator(method, dataset, config):
    from chainer.iterators import MultiprocessIterator, MultithreadIterator

    import chainer_prefetch
    n = config['n_processes']
    if method in ('baseline-local', 'baseline-remote', 'copy-then-local'):
        return MultiprocessIterator(dataset, BATCH_SIZE, n_processes=n,
                                    order_sampler=_order_sampler())
    if method in ('proposed-cold', 'proposed-warm', 'prefetch-local'):
        return chainer_prefetch.PrefetchMultiprocessIterator(
            dataset, BATCH_SIZE, n_processes=n, order_sampler=_order_sampler(),
            local_dir=None if method == 'prefetch-local' else
            config['local_dir'], n_copy_threads=config['n_copy_threads'])
    if method == 'multithread':
        return MultithreadIterator(dataset, BATCH_SIZE, n_threads=n,
                                   order_sampler=_order_sampler())
    if method == 'torch':
        return _torch_batches(dataset, n)
    raise ValueError('unknown method ' + method)


def _torch_batches(dataset, n_processes):
    import numpy
    import torch.utils.data

    class Wrapped(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, index):
            return dataset[index]

    order = _order_sampler()(numpy.arange(len(dataset)), 0)
    loader = torch.utils.data.DataLoader(
        Wrapped(), batch_size=BATCH_SIZE, sampler=[int(i) for i in order],
        num_workers=n_processes, collate_fn=list, persistent_workers=False)
    return iter(loader)


def run_one(config):
    """Times one run in this (child) process; returns the result dict."""
    import chainer

    method = config['method']
    started = time.perf_counter()
    copy_s = 0.0
    root = config['remote_root']
    if method in ('baseline-local', 'prefetch-local'):
        root = config['local_root']
    elif method == 'copy-then-local':
        copy_s = copy_dataset(config['remote_root'], config['list_file'],
                              config['copy_target'], COPIERS)
        root = config['copy_target']
    dataset = chainer.datasets.LabeledImageDataset(config['list_file'], root)
    iterator = _make_iterator(method, dataset, config)
    cumulative = []
    try:
        for _ in range(config['n_batches']):
            batch = next(iterator)
            assert len(batch) == BATCH_SIZE
            cumulative.append(time.perf_counter() - started)
    finally:
        stats = getattr(iterator, 'stats', None)
        if hasattr(iterator, 'finalize'):
            iterator.finalize()
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        'method': method,
        'n_processes': config['n_processes'],
        'n_copy_threads': config.get('n_copy_threads'),
        'n_batches': config['n_batches'],
        'repeat': config['repeat'],
        'total_s': cumulative[-1],
        'first_batch_s': cumulative[0],
        'copy_s': copy_s,
        'cumulative_s': [round(t, 4) for t in cumulative],
        'cpu_s': own.ru_utime + own.ru_stime + children.ru_utime
        + children.ru_stime,
        'peak_rss_mb_main': own.ru_maxrss / 1024,
        'peak_rss_mb_largest_child': children.ru_maxrss / 1024,
        'processes': 1 + (0 if method == 'multithread' else
                          config['n_processes']),
        'threads_copy': (config['n_copy_threads'] if method.startswith(
            'proposed') else COPIERS if method == 'copy-then-local' else 0),
        'iterator_stats': stats,
    }


def copy_dataset(source_root, list_file, target_root, n_copiers):
    """Copies every file of ``list_file`` with ``n_copiers`` threads; returns seconds."""
    with open(list_file) as lines:
        relatives = [line.split()[0] for line in lines if line.strip()]
    started = time.perf_counter()

    def copy(relative):
        target = os.path.join(target_root, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(source_root, relative), target)

    with ThreadPoolExecutor(n_copiers) as pool:
        list(pool.map(copy, relatives))
    return time.perf_counter() - started


# ---------------------------------------------------------------- parent side

def fill_local_dir(config):
    """Stages every file for proposed-warm, untimed."""
    import chainer

    from chainer_prefetch.staging import LocalDirectory
    dataset = chainer.datasets.LabeledImageDataset(config['list_file'],
                                                   config['remote_root'])
    directory = LocalDirectory(config['local_dir'])
    sources = [os.path.join(config['remote_root'], path)
               for path, _ in dataset._pairs]
    with ThreadPoolExecutor(COPIERS) as pool:
        list(pool.map(directory.stage, sources))


def torch_available():
    try:
        import torch  # NOQA: F401
        return True
    except ImportError:
        return False


def plan_runs(args):
    """The list of run configurations, repetitions interleaved."""
    configs = []
    for repeat in range(args.repeats):
        for n_processes in args.processes:
            for method in args.methods:
                configs.append({'method': method, 'n_processes': n_processes,
                                'n_copy_threads': args.copy_threads,
                                'repeat': repeat})
        for n_threads in args.copy_thread_sweep:
            if n_threads == args.copy_threads and 2 in args.processes:
                continue  # already measured above
            configs.append({'method': 'proposed-cold', 'n_processes': 2,
                            'n_copy_threads': n_threads, 'repeat': repeat})
    return configs


def summarize(runs):
    """Median per (method, processes, copy threads)."""
    groups = {}
    for run in runs:
        key = (run['method'], run['n_processes'], run['n_copy_threads']
               if run['method'].startswith('proposed') else None)
        groups.setdefault(key, []).append(run)
    summary = {}
    for key, members in groups.items():
        summary[key] = {
            'total_s': statistics.median(r['total_s'] for r in members),
            'first_batch_s': statistics.median(r['first_batch_s']
                                               for r in members),
            'cpu_s': statistics.median(r['cpu_s'] for r in members),
            'processes': members[0]['processes'],
            'runs': len(members)}
    return summary


def print_table(summary, copy_threads):
    print('\n{:<16} {:>5} {:>7} {:>10} {:>12} {:>8} {:>10} {:>10}'.format(
        'method', 'procs', 'threads', 'total s', 'first batch', 'CPU s',
        'vs remote', 'vs local'))
    for (method, n, threads), row in sorted(
            summary.items(), key=lambda item: (item[0][1], METHODS.index(
                item[0][0]), item[0][2] or 0)):
        remote = summary.get(('baseline-remote', n, None))
        local = summary.get(('baseline-local', n, None))
        print('{:<16} {:>5} {:>7} {:>10.2f} {:>12.3f} {:>8.1f} {:>10} '
              '{:>10}'.format(
                  method, n, threads or '-', row['total_s'],
                  row['first_batch_s'], row['cpu_s'],
                  _ratio(remote, row), _ratio(row, local)))
    print('\n"vs remote": baseline-remote time / this time (higher is '
          'better); "vs local": this time / baseline-local time (1.00 is '
          'local speed).')
    check_targets(summary, copy_threads)


def _ratio(numerator, denominator):
    if not numerator or not denominator:
        return '-'
    return '{:.2f}x'.format(numerator['total_s'] / denominator['total_s'])


def check_targets(summary, copy_threads):
    """Prints the issue's targets at every process count measured."""
    print('\nTargets (paper in brackets):')
    for (method, n, _), remote in sorted(summary.items()):
        if method != 'baseline-remote':
            continue
        cold = summary.get(('proposed-cold', n, copy_threads))
        warm = summary.get(('proposed-warm', n, copy_threads))
        local = summary.get(('baseline-local', n, None))
        if not (cold and local):
            continue
        lines = [
            ('proposed-cold >= 2x faster than baseline-remote [1.26x]',
             remote['total_s'] / cold['total_s'], 2.0, True),
            ('proposed-cold within 1.25x of baseline-local [2.45x]',
             cold['total_s'] / local['total_s'], 1.25, False),
            ('first batch of proposed-cold / baseline-remote <= 1 [2.1x]',
             cold['first_batch_s'] / remote['first_batch_s'], 1.0, False)]
        if warm:
            lines.append(('proposed-warm / baseline-local <= 1',
                          warm['total_s'] / local['total_s'], 1.0, False))
        lines.append(('processes proposed / baseline <= 1',
                      cold['processes'] / remote['processes'], 1.0, False))
        for text, value, bound, at_least in lines:
            met = value >= bound if at_least else value <= bound
            print('  {} processes: {:<62} {:6.2f}  {}'.format(
                n, text, value, 'met' if met else 'MISSED'))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--workdir', default='/tmp/chainer_prefetch_bench',
                        help='dataset, mount point and local directories')
    parser.add_argument('--n-images', type=int, default=None,
                        help='dataset size (default: batches x 32)')
    parser.add_argument('--batches', type=int, default=1000)
    parser.add_argument('--processes', default='2,4,8,16')
    parser.add_argument('--copy-threads', type=int, default=16,
                        help='copy threads of the proposed iterator')
    parser.add_argument('--copy-thread-sweep', default='',
                        help='e.g. 2,4,8,12,16 (proposed-cold, 2 processes)')
    parser.add_argument('--methods', default=','.join(METHODS))
    parser.add_argument('--repeats', type=int, default=1)
    parser.add_argument('--preset', default='paper',
                        choices=sorted(storage.PRESETS))
    parser.add_argument('--out', default='results/bench_minibatch.json')
    parser.add_argument('--run-timeout', type=float, default=1800)
    parser.add_argument('--quick', action='store_true',
                        help='the README demo: 30 batches, 2 processes, '
                        'the main methods, 1 repetition')
    args = parser.parse_args(argv)
    if args.quick:
        args.batches = 30
        args.processes = '2'
        args.methods = ('baseline-local,baseline-remote,proposed-cold,'
                        'proposed-warm,copy-then-local')
    args.processes = [int(n) for n in args.processes.split(',')]
    args.copy_thread_sweep = [int(n) for n in args.copy_thread_sweep.split(',')
                              if n]
    args.methods = [m for m in args.methods.split(',') if m]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error('unknown methods: {}'.format(', '.join(sorted(unknown))))
    if 'torch' in args.methods and not torch_available():
        print('note: PyTorch is not installed; skipping the torch method '
              '(pip install torch for it)')
        args.methods.remove('torch')
    if args.n_images is None:
        args.n_images = args.batches * BATCH_SIZE
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
    mountpoint = os.path.join(args.workdir, 'mnt')
    local_dir = os.path.join(args.workdir, 'local')
    copy_target = os.path.join(args.workdir, 'copy')
    os.makedirs(mountpoint, exist_ok=True)
    runs = []
    with storage.mounted(dataset_dir, mountpoint,
                                preset=args.preset) as mount:
        calibration = storage.calibrate(mountpoint, readers=(1, 2, 8),
                                               files=32)
        print('storage ({} preset): {}'.format(args.preset, ', '.join(
            '{readers} readers {files_per_s:.0f} files/s {mb_per_s:.1f} MB/s'
            .format(**row) for row in calibration['rows'])))
        for config in plan_runs(args):
            config.update(n_batches=args.batches, list_file=list_file,
                          local_root=dataset_dir, remote_root=mountpoint,
                          local_dir=local_dir, copy_target=copy_target)
            for path in (local_dir, copy_target):
                shutil.rmtree(path, ignore_errors=True)
            if config['method'] == 'proposed-warm':
                fill_local_dir(config)
            drop_page_cache(dataset_dir, local_dir)
            daemon_cpu_before = mount.cpu_seconds()
            result = run_in_child(__spec__.name, config, args.run_timeout)
            result['storage_daemon_cpu_s'] = (mount.cpu_seconds()
                                              - daemon_cpu_before)
            runs.append(result)
            print('{method:<16} procs {n_processes:>2} threads '
                  '{n_copy_threads:>2} run {repeat}: {total_s:7.2f} s, first '
                  'batch {first_batch_s:.3f} s'.format(**result), flush=True)
    for path in (local_dir, copy_target):
        shutil.rmtree(path, ignore_errors=True)
    report = {'command': 'python -m {} {}'.format(__spec__.name, ' '.join(argv)),
              'machine': machine_description(), 'preset': args.preset,
              'storage_params': storage.PRESETS[args.preset],
              'calibration': calibration, 'batch_size': BATCH_SIZE,
              'n_images': args.n_images, 'runs': runs}
    write_json(args.out, report)
    print_table(summarize(runs), args.copy_threads)
    print('\nwrote ' + args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
