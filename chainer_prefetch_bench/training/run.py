#!/usr/bin/env python
"""The 10-epoch data-parallel training comparison (paper secs. 4.2-4.4).

Trains ``examples/imagenet/train_imagenet.py`` (``--arch tiny``, CPU,
``naive`` communicator) with K = 1, 2, 4 MPI processes on one machine, on a
dataset made by ``testbed.jpeg_dataset``, three ways:

``baseline-local``
    Chainer's ``MultiprocessIterator`` reading the dataset folder directly
    (the paper's baseline+SSD, i.e. after the dataset was copied);
``baseline-remote``
    ``MultiprocessIterator`` reading the same files through the emulated
    shared storage (``testbed.storage``, a FUSE mount with
    ``--preset paper`` latencies and bandwidth; baseline+Lustre);
``proposed``
    ``--iterator prefetch`` reading the mount, staging to ``--local-dir``,
    which is empty at the start of each run.

It also measures the time of an 8-way parallel copy of the dataset from the
mount to local disk (Table 3), which Fig. 8 adds to baseline-local.

Before every run the local directory is emptied and the page cache of the
dataset files is dropped (``posix_fadvise(DONTNEED)``).  Every run's wall
time (``mpiexec`` start to exit), the per-rank time breakdowns
(``time_breakdown_rank*.json``), the log and the output tail go to
``OUT/raw.json``, rewritten after each run (the runs' own folders, with
their snapshots, stay under ``--work``); ``training.plot``
then writes the figures and tables into ``OUT`` (also run at the end, or
alone with ``--plot-only``).

Default size and why: 1,600 training images (mean 110 KB, ImageNet-like
dimensions; about 176 MB), 80 validation images, crop 32, 32 images per
process and batch, 2 loader processes per rank (the paper's 2), 10 epochs,
so 16,000 training images pass per run.  On this 2-core machine the tiny
network at crop 32 costs about 4 ms per image (forward+backward, one core)
and decoding a JPEG about 2.5 ms, whereas through the ``paper`` preset
(18 ms per open, 5 ms per read request, 100 MB/s) one reader gets only
~25 images/s.  A probe of the same settings with 480 images x 2 epochs,
while another benchmark shared the cores, gave (wall s; train s):

    K=1: local  9.7  (7.5), remote 22.4 (19.8), proposed 10.4 (8.5)
    K=2: local  7.8  (5.6), remote 14.3 (12.3), proposed  9.3 (7.2)
    K=4: local 14.7 (11.9), remote 14.1 (10.8), proposed 14.1 (11.1)

so loading from the mount is most of baseline-remote's time at K=1 (about
2.3x baseline-local) and K=2 (1.8x); at K=4 (12 processes on 2 cores) the
CPU is the bottleneck and 8 loaders hide the latency, as the paper saw
Lustre catch up at 8-16 nodes.  Scaled to 16,000 images per run (x16.7),
the nine runs take about 25 minutes on the loaded machine (K=1 remote
alone ~5.5 minutes), plus ~30 s for the dataset and the copy measurement:
20-30 minutes in all.  The crop is small so that compute does not hide the
I/O (at crop 224 the network alone would take ~10x longer per image); the
smallest generated images are 60 px high, so crops up to 56 work.
``--images`` scales the runtime about linearly.

Usage::

    python -m chainer_prefetch_bench.training.run            # the full set
    python -m chainer_prefetch_bench.training.run --images 256 --epochs 2 \\
        --procs 1,2 --out results/tmp/training_small      # a quick check
    python -m chainer_prefetch_bench.training.run --plot-only --out results/training

Needs FUSE (see ``testbed.storage``) and ``mpiexec`` (Open MPI; as
root, ``OMPI_ALLOW_RUN_AS_ROOT`` and ``..._CONFIRM`` are set for it).
"""
import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from chainer_prefetch_bench.testbed import jpeg_dataset as make_dataset
from chainer_prefetch_bench.testbed import mpi_launch, storage
from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.page_cache import drop_page_cache
from chainer_prefetch_bench.testbed.processes import exit_on_sigterm
from chainer_prefetch_bench.testbed.report import write_json as save

METHODS = ('baseline-local', 'baseline-remote', 'proposed')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--images', type=int, default=1600,
                        help='training images to generate')
    parser.add_argument('--val-images', type=int, default=None,
                        help='validation images (default: images / 20)')
    parser.add_argument('--classes', type=int, default=10)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--epochs', type=int, default=10)
    parser.add_argument('--procs', default='1,2,4',
                        help='comma-separated MPI process counts K')
    parser.add_argument('--methods', default=','.join(METHODS),
                        help='comma-separated subset of ' + ', '.join(METHODS))
    parser.add_argument('--crop-size', type=int, default=32)
    parser.add_argument('--batchsize', type=int, default=32,
                        help='minibatch per process')
    parser.add_argument('--val-batchsize', type=int, default=32)
    parser.add_argument('--loaderjob', type=int, default=2,
                        help='loader processes per iterator (paper: 2)')
    parser.add_argument('--copy-threads', type=int, default=16,
                        help='copy threads of the prefetch iterator')
    parser.add_argument('--copy-ways', type=int, default=8,
                        help='parallel copies for the copy-time measurement '
                             '(Table 3: 8)')
    parser.add_argument('--preset', default='paper',
                        choices=sorted(storage.PRESETS),
                        help='shared-storage emulation preset')
    parser.add_argument('--start-method', default='forkserver',
                        choices=('fork', 'forkserver'))
    parser.add_argument('--run-timeout', type=float, default=1200,
                        help='seconds one training run may take')
    parser.add_argument('--out', default=os.path.join('results', 'training'),
                        help='folder of raw.json, figures and tables')
    parser.add_argument('--work', default=None,
                        help='folder for the dataset, mount point and local '
                             'dir (default: results/tmp/training_work)')
    parser.add_argument('--plot-only', action='store_true',
                        help='only redraw figures and tables from '
                             'OUT/raw.json')
    args = parser.parse_args(argv)
    args.procs = [int(p) for p in args.procs.split(',') if p]
    args.methods = [m for m in args.methods.split(',') if m]
    for method in args.methods:
        if method not in METHODS:
            parser.error('unknown method {!r}'.format(method))
    if args.val_images is None:
        args.val_images = max(args.images // 20, 16)
    if args.work is None:
        args.work = os.path.join(mpi_launch.REPO, 'results', 'tmp',
                                 'training_work')
    return args


# ---------------------------------------------------------------- dataset


def prepare_dataset(args, data_dir):
    """Generate the dataset unless one with the same parameters exists."""
    params = dict(images=args.images, val_images=args.val_images,
                  classes=args.classes, seed=args.seed)
    marker = os.path.join(data_dir, 'dataset_params.json')
    with contextlib.suppress(OSError, ValueError):
        with open(marker) as f:
            saved = json.load(f)
        if saved.get('params') == params:
            print('dataset: reusing {} ({})'.format(data_dir,
                                                    saved['summary']))
            return saved
    shutil.rmtree(data_dir, ignore_errors=True)
    print('dataset: generating {} + {} images in {}'.format(
        args.images, args.val_images, data_dir))
    summary = make_dataset.generate(
        data_dir, args.images, args.classes, args.seed,
        val_images=args.val_images, workers=os.cpu_count(), progress=False)
    print('dataset:', summary)
    files = dataset_files(data_dir)
    sizes = {split: [os.path.getsize(os.path.join(data_dir, rel))
                     for rel in rels] for split, rels in files.items()}
    saved = dict(params=params, summary=str(summary),
                 n_files=summary.n_files, total_bytes=summary.total_bytes,
                 train_bytes=sum(sizes['train']),
                 train_mean_bytes=sum(sizes['train']) / len(sizes['train']),
                 generate_seconds=summary.seconds)
    with open(marker, 'w') as f:
        json.dump(saved, f, indent=1)
    return saved


def dataset_files(data_dir):
    """Relative paths of the images, per split, from the list files."""
    files = {}
    for split in ('train', 'val'):
        path = os.path.join(data_dir, split + '.txt')
        if os.path.exists(path):
            with open(path) as f:
                files[split] = [line.split()[0] for line in f if line.strip()]
    return files


def empty_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def measure_copy(args, data_dir, mount_dir, target):
    """Time an ``args.copy_ways``-way parallel copy of the dataset.

    Copies every image of both lists plus the list files from the mount to
    ``target`` (Table 3 of the paper: 8-way parallel copy per node).
    """
    files = dataset_files(data_dir)
    relpaths = [rel for rels in files.values() for rel in rels]
    relpaths += [name for name in ('train.txt', 'val.txt')
                 if os.path.exists(os.path.join(data_dir, name))]
    empty_dir(target)
    drop_page_cache(data_dir)
    for rel in relpaths:
        os.makedirs(os.path.dirname(os.path.join(target, rel)),
                    exist_ok=True)

    def copy(rel):
        shutil.copyfile(os.path.join(mount_dir, rel),
                        os.path.join(target, rel))
        return os.path.getsize(os.path.join(target, rel))

    start = time.perf_counter()
    with ThreadPoolExecutor(args.copy_ways) as pool:
        total = sum(pool.map(copy, relpaths))
    seconds = time.perf_counter() - start
    shutil.rmtree(target, ignore_errors=True)
    result = dict(files=len(relpaths), bytes=total, seconds=seconds,
                  ways=args.copy_ways,
                  files_per_second=len(relpaths) / seconds,
                  mb_per_second=total / seconds / 1e6)
    print('copy: {files} files, {mb:.1f} MB in {seconds:.2f} s with {ways} '
          'ways ({fps:.0f} files/s, {mbps:.1f} MB/s)'.format(
              mb=total / 1e6, fps=result['files_per_second'],
              mbps=result['mb_per_second'], **result))
    return result


# ---------------------------------------------------------------- runs


def training_command(args, method, procs, data_dir, mount_dir, local_dir,
                     run_out):
    root = data_dir if method == 'baseline-local' else mount_dir
    iterator = 'prefetch' if method == 'proposed' else 'multiprocess'
    cmd = mpi_launch.train_command(procs, [
           os.path.join(data_dir, 'train.txt'),
           os.path.join(data_dir, 'val.txt'),
           '--root', root, '--arch', 'tiny',
           '--crop-size', str(args.crop_size),
           '--batchsize', str(args.batchsize),
           '--val_batchsize', str(args.val_batchsize),
           '--epoch', str(args.epochs), '--loaderjob', str(args.loaderjob),
           '--iterator', iterator, '--start-method', args.start_method,
           '--time-breakdown', '--out', run_out])
    if method == 'proposed':
        cmd += ['--local-dir', local_dir,
                '--copy-threads', str(args.copy_threads)]
    return cmd


def run_training(args, method, procs, data_dir, mount, local_dir, runs_dir):
    run_out = os.path.join(runs_dir, '{}_k{}'.format(method, procs))
    shutil.rmtree(run_out, ignore_errors=True)
    empty_dir(local_dir)
    dropped = drop_page_cache(data_dir)
    cmd = training_command(args, method, procs, data_dir, mount.mountpoint,
                           local_dir, run_out)
    print('run: {} K={} ...'.format(method, procs), flush=True)
    mount_cpu = mount.cpu_seconds()
    children_before = os.times()
    start = time.perf_counter()
    returncode, output, timed_out = mpi_launch.run(cmd, args.run_timeout)
    wall = time.perf_counter() - start
    children_after = os.times()
    breakdowns = []
    for rank in range(procs):
        path = os.path.join(run_out,
                            'time_breakdown_rank{}.json'.format(rank))
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                breakdowns.append(json.load(f))
    log = None
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(run_out, 'log')) as f:
            log = json.load(f)
    result = dict(
        method=method, procs=procs, command=cmd,
        returncode=returncode, timed_out=timed_out,
        wall_seconds=wall,
        cpu_seconds=(children_after.children_user
                     + children_after.children_system
                     - children_before.children_user
                     - children_before.children_system),
        storage_daemon_cpu_seconds=mount.cpu_seconds() - mount_cpu,
        files_dropped_from_cache=dropped,
        breakdown=breakdowns, log=log, output_tail=output[-4000:])
    ok = returncode == 0 and len(breakdowns) == procs
    print('run: {} K={}: {:.1f} s{}'.format(
        method, procs, wall, '' if ok else '  FAILED (rc={}{})\n{}'.format(
            returncode, ', timed out' if timed_out else '',
            output[-2000:])), flush=True)
    return result


def main(argv=None):
    args = parse_args(argv)
    # A SIGTERM (e.g. a job's time limit) still unmounts the emulated storage.
    exit_on_sigterm()
    os.makedirs(args.out, exist_ok=True)
    raw_path = os.path.join(args.out, 'raw.json')
    from chainer_prefetch_bench.training import plot as plot_training
    if args.plot_only:
        return plot_training.main([raw_path, '--out', args.out])

    problem = storage.fuse_problem()
    if problem:
        sys.exit('emulated shared storage unavailable: ' + problem)
    work = os.path.abspath(args.work)
    data_dir = os.path.join(work, 'data')
    mount_dir = os.path.join(work, 'mnt')
    local_dir = os.path.join(work, 'local')
    copy_dir = os.path.join(work, 'copy')
    runs_dir = os.path.join(work, 'runs')  # snapshots etc.; raw.json has
    # the breakdowns and logs
    os.makedirs(work, exist_ok=True)
    os.makedirs(runs_dir, exist_ok=True)

    started = time.time()
    dataset = prepare_dataset(args, data_dir)
    config = {key: value for key, value in vars(args).items()}
    data = dict(config=config, dataset=dataset,
                machine=machine_description(),
                preset=storage.PRESETS[args.preset],
                started=time.strftime('%Y-%m-%d %H:%M:%S'),
                copy=None, runs=[])
    save(raw_path, data)
    with storage.mounted(data_dir, mountpoint=mount_dir,
                                preset=args.preset) as mount:
        data['copy'] = measure_copy(args, data_dir, mount.mountpoint,
                                    copy_dir)
        save(raw_path, data)
        for procs in args.procs:
            for method in args.methods:
                data['runs'].append(run_training(
                    args, method, procs, data_dir, mount, local_dir,
                    runs_dir))
                save(raw_path, data)
    empty_dir(local_dir)
    data['total_seconds'] = time.time() - started
    save(raw_path, data)
    print('raw results: {} ({:.0f} s in all)'.format(
        raw_path, data['total_seconds']))
    return plot_training.main([raw_path, '--out', args.out])


if __name__ == '__main__':
    sys.exit(main())
