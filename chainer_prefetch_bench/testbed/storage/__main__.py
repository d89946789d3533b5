"""Command line of the storage emulator: start, stop, status, calibrate.

``python -m chainer_prefetch_bench.testbed.storage --help``
"""
import argparse
import contextlib
import json
import sys
from dataclasses import asdict
from typing import Optional, Sequence

from chainer_prefetch_bench.testbed.processes import exit_on_sigterm
from chainer_prefetch_bench.testbed.storage.calibration import calibrate, print_calibration
from chainer_prefetch_bench.testbed.storage.mount import (
    MountError,
    daemon_alive,
    fuse_problem,
    is_mounted,
    read_mount,
    start,
    stop,
)
from chainer_prefetch_bench.testbed.storage.presets import add_param_args, params_from_args


def _cmd_status(mountpoint: str) -> int:
    mount = read_mount(mountpoint)
    mounted_now = is_mounted(mountpoint)
    if mount is None:
        print('{}: not started by this script (mounted: {})'.format(
            mountpoint, mounted_now))
        return 1
    alive = daemon_alive(mount)
    print('mountpoint: {}\nsource: {}\nmounted: {}\npid: {} ({})\n'
          'open latency: {} ms\nread latency: {} ms\nbandwidth: {} MB/s\n'
          'metadata latency: {} ms\ncache timeout: {} s\n'
          'daemon CPU seconds: {:.3f}\nlog: {}'.format(
              mount.mountpoint, mount.source, mounted_now, mount.pid,
              'running' if alive else 'dead', mount.params.open_latency_ms,
              mount.params.read_latency_ms,
              mount.params.bandwidth_mbps or 'unlimited',
              mount.params.metadata_latency_ms, mount.params.cache_timeout_s,
              mount.cpu_seconds() if alive else 0.0, mount.log_path))
    with contextlib.suppress(MountError):
        print('operations served: ' + ', '.join(
            '{}={}'.format(name, n) for name, n in mount.op_counts().items()))
    return 0 if alive and mounted_now else 1



def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    parser = argparse.ArgumentParser(
        description='Emulated shared storage through a FUSE mount.')
    sub = parser.add_subparsers(dest='command', required=True)
    p = sub.add_parser('start', help='mount in the background')
    p.add_argument('source')
    p.add_argument('mountpoint')
    add_param_args(p)
    p = sub.add_parser('stop', help='unmount and stop the daemon')
    p.add_argument('mountpoint')
    p = sub.add_parser('status', help='show parameters, pid and CPU time')
    p.add_argument('mountpoint')
    p = sub.add_parser('calibrate', help='measure files/s and MB/s')
    p.add_argument('mountpoint')
    p.add_argument('--readers', default='1,2,4,8,16')
    p.add_argument('--files', type=int, default=64)
    p.add_argument('--json', help='also write the results here')
    args = parser.parse_args(argv)

    if args.command in ('start', 'calibrate'):
        problem = fuse_problem()
        if problem:
            print('FUSE is not usable: ' + problem, file=sys.stderr)
            return 2
    exit_on_sigterm()
    try:
        if args.command == 'start':
            mount = start(args.source, args.mountpoint,
                          params_from_args(args))
            print('mounted {} at {} (pid {}, {})'.format(
                mount.source, mount.mountpoint, mount.pid,
                asdict(mount.params)))
        elif args.command == 'stop':
            if not stop(args.mountpoint):
                print('nothing was mounted at {}'.format(args.mountpoint))
        elif args.command == 'status':
            return _cmd_status(args.mountpoint)
        else:
            result = calibrate(args.mountpoint,
                               [int(v) for v in args.readers.split(',')],
                               args.files)
            print_calibration(result)
            if args.json:
                with open(args.json, 'w') as f:
                    json.dump(result, f, indent=2)
    except MountError as exc:
        print('error: {}'.format(exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print('interrupted', file=sys.stderr)
        return 130
    return 0


if __name__ == '__main__':
    sys.exit(main())
