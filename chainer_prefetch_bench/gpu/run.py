"""The ImageNet example on a GPU node: iterators, start methods, pinned copy.

Runs ``examples/imagenet/train_imagenet.py`` (ResNet-50 by default, with
``--gpu``) under ``mpiexec`` for every combination of

* ``--iterator``: ``prefetch`` (ours) and ``multiprocess`` (Chainer's);
* ``--start-method``: ``fork`` and ``forkserver``;
* ``--maxtasksperchild``: none and ``--maxtasks`` (workers replaced);
* ``--pinned-copy``: off and on;

each uninstrumented (the example's default), and reports images per second
of the second epoch (``elapsed_time`` of epoch 2 minus epoch 1 in the
example's log: no start-up, one warm epoch).  Then, for each iterator and
pinned copy off/on (``forkserver``, no ``maxtasksperchild``), one run with
``--time-breakdown`` gives the per-iteration split into load, forward,
backward, allreduce and other (mean over ranks, epoch 2).  While each run
goes, /dev/shm is sampled every 0.2 s (peak bytes in use, peak entries)
and checked afterwards for entries the run left behind.

NCCL needs one GPU per rank: the default is one rank (``--ranks 1``, the
``pure_nccl`` communicator with one member); use ``--ranks N`` only with N
GPUs.  ``--cpu`` drops ``--gpu`` (the ``naive`` communicator on the CPU),
to check the script end to end where there is no GPU; pair it with a small
network (``--arch tiny --crop-size 32``).

Usage (``scripts/gpu_check.sh`` runs this on a GPU node)::

    python -m chainer_prefetch_bench.gpu.run --out results/gpu
    python -m chainer_prefetch_bench.gpu.run --cpu --arch tiny --crop-size 32 \\
        --images 256 --batchsize 16 --out results/tmp/gpu_cpu_check

Writes ``OUT/runs.json`` (every run: command, images/s, breakdown,
/dev/shm, the example's output tail, the machine, ``nvidia-smi``) and
``OUT/table.txt``.
"""
import argparse
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

from chainer_prefetch_bench.testbed import jpeg_dataset, mpi_launch
from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.processes import exit_on_sigterm
from chainer_prefetch_bench.testbed.report import write_json

COMPONENTS = ('load', 'forward', 'backward', 'allreduce', 'other')
SHM = '/dev/shm'
SHM_POLL_SECONDS = 0.2


class ShmWatch(object):
    """Samples /dev/shm while a run goes: peak bytes used, peak entries.

    Use as a context manager; afterwards :meth:`result` also names the
    entries that appeared during the run and are still there.
    """

    def __init__(self, path: str = SHM) -> None:
        self.path = path
        self._before = set(self._entries())
        self._peak_bytes = self._peak_entries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _entries(self) -> List[str]:
        with contextlib.suppress(OSError):
            return os.listdir(self.path)
        return []

    def _used_bytes(self) -> int:
        with contextlib.suppress(OSError):
            stat = os.statvfs(self.path)
            return (stat.f_blocks - stat.f_bfree) * stat.f_frsize
        return 0

    def _sample(self) -> None:
        while not self._stop.wait(SHM_POLL_SECONDS):
            self._peak_bytes = max(self._peak_bytes, self._used_bytes())
            self._peak_entries = max(self._peak_entries,
                                     len(self._entries()))

    def __enter__(self) -> 'ShmWatch':
        self._baseline_bytes = self._used_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> Dict:
        """Peak use above the start, and entries left behind.

        Returns:
            ``peak_mb_above_start``, ``peak_entries``, ``left_behind``.
        """
        left = sorted(set(self._entries()) - self._before)
        return {'peak_mb_above_start': round(
                    max(0, self._peak_bytes - self._baseline_bytes) / 1e6, 1),
                'peak_entries': self._peak_entries, 'left_behind': left}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n')[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--out', default='results/gpu')
    parser.add_argument('--work', default='/tmp/chainer_prefetch_gpu_check',
                        help='dataset, local directory, run folders')
    parser.add_argument('--data', default=None,
                        help='a dataset folder with train.txt and val.txt '
                             '(default: generate --images under --work)')
    parser.add_argument('--images', type=int, default=2560,
                        help='training images to generate (per epoch)')
    parser.add_argument('--ranks', type=int, default=1,
                        help='MPI ranks: one GPU each')
    parser.add_argument('--arch', default='resnet50')
    parser.add_argument('--crop-size', type=int, default=224)
    parser.add_argument('--batchsize', type=int, default=32)
    parser.add_argument('--loaderjob', type=int, default=None,
                        help="default: the example's (the rank's share of "
                             'the cores)')
    parser.add_argument('--maxtasks', type=int, default=100,
                        help='the maxtasksperchild value tried')
    parser.add_argument('--iterators', default='prefetch,multiprocess')
    parser.add_argument('--start-methods', default='fork,forkserver')
    parser.add_argument('--no-breakdown', action='store_true',
                        help='skip the --time-breakdown runs')
    parser.add_argument('--cpu', action='store_true',
                        help='drop --gpu (an end-to-end check without a GPU)')
    parser.add_argument('--run-timeout', type=float, default=1800)
    args = parser.parse_args(argv)
    args.iterators = args.iterators.split(',')
    args.start_methods = args.start_methods.split(',')
    return args


def plan(args) -> List[Dict]:
    """Every run: the uninstrumented grid, then the breakdown runs."""
    runs = [dict(iterator=iterator, start_method=start, maxtasks=maxtasks,
                 pinned_copy=pinned, breakdown=False)
            for iterator, start, maxtasks, pinned in itertools.product(
                args.iterators, args.start_methods, (None, args.maxtasks),
                (False, True))]
    if not args.no_breakdown:
        runs += [dict(iterator=iterator, start_method='forkserver',
                      maxtasks=None, pinned_copy=pinned, breakdown=True)
                 for iterator, pinned in itertools.product(
                     args.iterators, (False, True))]
    return runs


def command(args, run: Dict, data: str, out: str, local_dir: str) -> List:
    """The ``mpiexec ... train_imagenet.py`` command line of one run."""
    options = [os.path.join(data, 'train.txt'), os.path.join(data, 'val.txt'),
               '--root', data, '--arch', args.arch,
               '--crop-size', str(args.crop_size),
               '--batchsize', str(args.batchsize), '--val_batchsize',
               str(args.batchsize), '--epoch', '2',
               '--iterator', run['iterator'],
               '--start-method', run['start_method'], '--out', out]
    if os.path.exists(os.path.join(data, 'mean.npy')):
        options += ['--mean', os.path.join(data, 'mean.npy')]
    if not args.cpu:
        options.append('--gpu')
    if args.loaderjob is not None:
        options += ['--loaderjob', str(args.loaderjob)]
    if run['iterator'] == 'prefetch':
        options += ['--local-dir', local_dir]
    if run['maxtasks'] is not None:
        options += ['--maxtasksperchild', str(run['maxtasks'])]
    if run['pinned_copy']:
        options.append('--pinned-copy')
    if run['breakdown']:
        options.append('--time-breakdown')
    return mpi_launch.train_command(args.ranks, options)


def images_per_second(log: List[Dict], images: int) -> Optional[float]:
    """Images/s of epoch 2 from the example's log (None if incomplete)."""
    times = {entry['epoch']: entry['elapsed_time'] for entry in log
             if 'elapsed_time' in entry}
    if 1 not in times or 2 not in times or times[2] <= times[1]:
        return None
    return images / (times[2] - times[1])


def breakdown(out: str, ranks: int) -> Optional[Dict[str, float]]:
    """Mean over ranks of epoch 2's seconds per component."""
    sums = dict.fromkeys(COMPONENTS + ('wall',), 0.0)
    for rank in range(ranks):
        path = os.path.join(out, 'time_breakdown_rank{}.json'.format(rank))
        try:
            with open(path) as f:
                epochs = json.load(f)['epochs']
        except (OSError, ValueError, KeyError):
            return None
        epoch = epochs[-1]
        for key in sums:
            sums[key] += epoch.get(key, 0.0) / ranks
    return {key: round(value, 3) for key, value in sums.items()}


def run_one(args, run: Dict, data: str, n_train: int) -> Dict:
    name = '{iterator}-{start_method}-mt{maxtasks}-pin{pinned}{bd}'.format(
        pinned=int(run['pinned_copy']), bd='-breakdown' if run['breakdown']
        else '', **run)
    out = os.path.join(args.work, 'runs', name)
    local_dir = os.path.join(args.work, 'local')
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(local_dir, ignore_errors=True)
    cmd = command(args, run, data, out, local_dir)
    started = time.perf_counter()
    with ShmWatch() as shm:
        returncode, output, timed_out = mpi_launch.run(cmd, args.run_timeout)
    wall = time.perf_counter() - started
    log = []
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(out, 'log')) as f:
            log = json.load(f)
    rate = images_per_second(log, n_train)
    result = dict(run, name=name, command=' '.join(cmd),
                  returncode=returncode, timed_out=timed_out,
                  wall_s=round(wall, 2),
                  images_per_s=None if rate is None else round(rate, 1),
                  breakdown=breakdown(out, args.ranks) if run['breakdown']
                  else None,
                  shm=shm.result(), output_tail=output[-3000:])
    print('{:<48} {:>8} img/s  wall {:7.1f} s  /dev/shm peak +{} MB{}{}'
          .format(name, '-' if rate is None else '{:.1f}'.format(rate), wall,
                  result['shm']['peak_mb_above_start'],
                  '  LEFT ' + ' '.join(result['shm']['left_behind'])
                  if result['shm']['left_behind'] else '',
                  '' if returncode == 0 else '  FAILED (rc={})'.format(
                      returncode)), flush=True)
    return result


def table(runs: List[Dict]) -> str:
    """Images/s per configuration, with the ratio to Chainer's iterator."""
    lines = ['{:<13} {:<11} {:>9} {:>7} {:>9} {:>12} {:>8}'.format(
        'iterator', 'start', 'maxtasks', 'pinned', 'images/s', 'vs Chainer',
        'shm MB')]
    grid = [run for run in runs if not run['breakdown']]
    chainer_rate = {(r['start_method'], r['maxtasks'], r['pinned_copy']):
                    r['images_per_s'] for r in grid
                    if r['iterator'] == 'multiprocess'}
    for run in grid:
        reference = chainer_rate.get((run['start_method'], run['maxtasks'],
                                      run['pinned_copy']))
        ratio = ('{:.2f}x'.format(run['images_per_s'] / reference)
                 if run['images_per_s'] and reference else '-')
        lines.append('{:<13} {:<11} {:>9} {:>7} {:>9} {:>12} {:>8}'.format(
            run['iterator'], run['start_method'], run['maxtasks'] or '-',
            'on' if run['pinned_copy'] else 'off',
            run['images_per_s'] or 'FAILED', ratio,
            run['shm']['peak_mb_above_start']))
    bd = [run for run in runs if run['breakdown'] and run['breakdown']]
    if bd:
        lines += ['', 'Time breakdown of epoch 2 (s, mean over ranks; '
                  '--time-breakdown synchronises the device per phase):',
                  '{:<13} {:>7} '.format('iterator', 'pinned') + ' '.join(
                      '{:>9}'.format(c) for c in COMPONENTS + ('wall',))]
        for run in bd:
            lines.append('{:<13} {:>7} '.format(
                run['iterator'], 'on' if run['pinned_copy'] else 'off')
                + ' '.join('{:>9.3f}'.format(run['breakdown'][c])
                           for c in COMPONENTS + ('wall',)))
    left = [run['name'] for run in runs if run['shm']['left_behind']]
    lines += ['', '/dev/shm entries left behind: {}'.format(
        ', '.join(left) if left else 'none')]
    return '\n'.join(lines)


def _nvidia_smi() -> Optional[str]:
    if shutil.which('nvidia-smi') is None:
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            ['nvidia-smi', '--query-gpu=name,memory.total,driver_version',
             '--format=csv,noheader'], capture_output=True, text=True,
            timeout=30).stdout.strip()
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    exit_on_sigterm()
    if not args.cpu:
        try:
            import cupy  # noqa: F401
        except ImportError:
            sys.exit('--gpu needs CuPy (pip install cupy-cuda12x), or pass '
                     '--cpu for a check without a GPU')
    data = args.data
    if data is None:
        data = os.path.join(args.work, 'data-{}'.format(args.images))
        if not os.path.exists(os.path.join(data, 'val.txt')):
            jpeg_dataset.generate(data, args.images, 100, 0,
                                  val_images=max(64, args.images // 20))
    with open(os.path.join(data, 'train.txt')) as f:
        n_train = sum(1 for line in f if line.strip())
    runs = []
    report = dict(command='python -m {} {}'.format(__spec__.name,
                                                    ' '.join(argv)),
                  machine=machine_description(), nvidia_smi=_nvidia_smi(),
                  gpu=not args.cpu, ranks=args.ranks, arch=args.arch,
                  crop_size=args.crop_size, batchsize=args.batchsize,
                  train_images=n_train, runs=runs)
    for run in plan(args):
        runs.append(run_one(args, run, data, n_train))
        write_json(os.path.join(args.out, 'runs.json'), report)
    text = report['command'] + '\n\n' + table(runs)
    print('\n' + text)
    with open(os.path.join(args.out, 'table.txt'), 'w') as f:
        f.write(text + '\n')
    return 0 if all(run['returncode'] == 0 for run in runs) else 1


if __name__ == '__main__':
    sys.exit(main())
