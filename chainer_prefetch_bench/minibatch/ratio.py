"""How much slower Chainer's MultiprocessIterator is through an emulated mount.

The measurement the storage presets were tuned with (see
``testbed.storage.presets``): local and mounted runs alternate; medians of
images per second are compared.

Usage::

    python -m chainer_prefetch_bench.minibatch.ratio DATASET_DIR --preset paper \\
        [--batches 30] [--repeats 1] [--processes 2]
"""
import argparse
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict
from typing import Optional, Sequence

from chainer_prefetch_bench.testbed import storage
from chainer_prefetch_bench.testbed.processes import exit_on_sigterm
from chainer_prefetch_bench.testbed.storage.presets import add_param_args, params_from_args


def time_iterator(dataset_dir: str, batches: int, batch_size: int = 32,
                  n_processes: int = 2) -> float:
    """Images per second Chainer's MultiprocessIterator delivers.

    Reads ``dataset_dir/train.txt`` with LabeledImageDataset (PIL decode, no
    resize); one warm-up batch, then ``batches`` timed batches.

    Args:
        dataset_dir: Dataset root (local folder or mount point).
        batches: Batches timed.
        batch_size: Images per batch.
        n_processes: Iterator worker processes.

    Returns:
        Images per second over the timed batches.
    """
    import chainer
    dataset = chainer.datasets.LabeledImageDataset(
        os.path.join(dataset_dir, 'train.txt'), root=dataset_dir)
    iterator = chainer.iterators.MultiprocessIterator(
        dataset, batch_size, repeat=True, shuffle=False,
        n_processes=n_processes)
    with warnings.catch_warnings():
        # Workers (forked, so they inherit this filter) pickle the examples
        # that exceed the shared memory sized from the first batch; that is
        # the same on both paths and only noise here.
        warnings.filterwarnings('ignore', 'Shared memory size is too small')
        try:
            iterator.next()
            t0 = time.perf_counter()
            for _ in range(batches):
                iterator.next()
            return batches * batch_size / (time.perf_counter() - t0)
        finally:
            iterator.finalize()


def measure_ratio(dataset_dir: str, params: storage.Params, batches: int = 30,
                  batch_size: int = 32, n_processes: int = 2,
                  repeats: int = 1) -> dict:
    """How much slower MultiprocessIterator is through the emulated mount.

    Local and mounted runs alternate ``repeats`` times; the medians are
    compared, which damps noise from other load on the machine.

    Args:
        dataset_dir: Dataset made by ``testbed.jpeg_dataset``.
        params: The emulation parameters.
        batches: Batches timed per run.
        batch_size: Images per batch.
        n_processes: Iterator worker processes.
        repeats: Runs on each path.

    Returns:
        A dict with ``local_img_s``, ``mount_img_s`` (medians, and all runs
        in ``local_runs``/``mount_runs``), ``ratio`` (local rate over mount
        rate), ``daemon_cpu_s`` (during the mounted runs) and ``params``.
    """
    local_runs, mount_runs = [], []
    cpu = 0.0
    with storage.mounted(dataset_dir, **asdict(params)) as mount:
        for _ in range(repeats):
            local_runs.append(time_iterator(dataset_dir, batches, batch_size,
                                            n_processes))
            cpu0 = mount.cpu_seconds()
            mount_runs.append(time_iterator(mount.mountpoint, batches,
                                            batch_size, n_processes))
            cpu += mount.cpu_seconds() - cpu0
    local, remote = statistics.median(local_runs), statistics.median(
        mount_runs)
    return {'params': asdict(params), 'local_img_s': round(local, 2),
            'mount_img_s': round(remote, 2), 'ratio': round(local / remote, 2),
            'local_runs': [round(v, 2) for v in local_runs],
            'mount_runs': [round(v, 2) for v in mount_runs],
            'daemon_cpu_s': round(cpu, 3)}



def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('dataset_dir')
    add_param_args(parser)
    parser.add_argument('--batches', type=int, default=30)
    parser.add_argument('--batch-size', type=int, default=32)
    parser.add_argument('--processes', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=1,
                        help='alternating runs per path; medians are compared')
    args = parser.parse_args(argv)
    problem = storage.fuse_problem()
    if problem:
        print('FUSE is not usable: ' + problem, file=sys.stderr)
        return 2
    exit_on_sigterm()
    result = measure_ratio(args.dataset_dir, params_from_args(args),
                           args.batches, args.batch_size, args.processes,
                           args.repeats)
    print(json.dumps(result))
    return 0


if __name__ == '__main__':
    sys.exit(main())
