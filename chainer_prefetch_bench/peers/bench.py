#!/usr/bin/env python
"""The peer tier on simulated nodes of one machine, side by side in one run.

``--nodes`` nodes of ``--ranks-per-node`` ranks (MPI processes under
``mpiexec``), each node with its own local directory, train on one JPEG
dataset through the emulated shared storage (``--preset``, ``paper`` by
default) for ``--epochs`` epochs, reshuffled across ranks every epoch
(:class:`~chainer_prefetch.ShuffleAcrossRanks`), in lockstep.  Methods:

``no-peers``    each node copies what it needs from shared storage;
``peers``       the same with the peer tier (``PeerGroup``);
``warm-local``  every node's local directory already holds the whole
                dataset (filled before the timed run): the epoch time of
                reading local copies only.

For each: the bytes the mount served over the run (its own count, against
the dataset's size), every epoch's time, and what the iterators counted.

``--faults stop,kill`` then runs the peer tier without lockstep while the
first rank of node 1 (its server) stops itself (``SIGSTOP``) or is killed
(``SIGKILL``) a few batches into epoch ``--fault-epoch``: the other ranks
finish that epoch comparing its examples with direct reads (all but those
of the batches that cross an epoch's boundary), and report
their waits on the dead peer; afterwards no process of the run is left and
its port is closed.

``--leave`` instead runs a leave: ``--nodes`` nodes train ``--epochs``
epochs and rank 0 writes a snapshot of the iterator; the last node leaves,
and the others resume from that snapshot (the iterator saves which job
trained which epochs) for one more epoch, without and then with peers.  It
reports the bytes the mount served in that epoch, and the bytes of the
files that only the leaving node held in the two epochs before (what must
come from shared storage).  The epochs' lengths must be whole batches at
both sizes (a snapshot taken inside an epoch does not resume at another
size).

Usage::

    python -m chainer_prefetch_bench.peers.bench --nodes 4 --epochs 5 \\
        --faults stop,kill --out results/peers/peers.json
    python -m chainer_prefetch_bench.peers.bench --n-images 2016 --nodes 3 \\
        --epochs 3 --leave --out results/peers/leave.json
"""
import argparse
import concurrent.futures
import glob
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

from chainer_prefetch.staging.local_directory import LocalDirectory
from chainer_prefetch.staging.sources import PlainFile
from chainer_prefetch_bench.testbed import mpi_launch, storage
from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.prepare import prepare_jpeg_benchmark
from chainer_prefetch_bench.testbed.report import write_json

METHODS = ('no-peers', 'peers', 'warm-local')


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--workdir', default='/tmp/chainer_prefetch_bench',
                        help='where the generated dataset is kept')
    parser.add_argument('--n-images', type=int, default=2000)
    parser.add_argument('--nodes', type=int, default=4)
    parser.add_argument('--ranks-per-node', type=int, default=1)
    parser.add_argument('--epochs', type=int, default=4)
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--loaders', type=int, default=1,
                        help='loader processes per rank')
    parser.add_argument('--copy-threads', type=int, default=8)
    parser.add_argument('--copy-ahead', type=int, default=16,
                        help='batches stage 2 runs ahead')
    parser.add_argument('--preset', default='paper')
    parser.add_argument('--methods', default=','.join(METHODS))
    parser.add_argument('--faults', default='',
                        help='comma-separated: stop, kill')
    parser.add_argument('--fault-epoch', type=int, default=1)
    parser.add_argument('--leave', action='store_true',
                        help='instead of the methods: --nodes nodes train '
                             '--epochs epochs, the last node leaves, and the '
                             'others resume from a snapshot for one epoch, '
                             'without and with peers')
    parser.add_argument('--peer-timeout', type=float, default=2.0)
    parser.add_argument('--timeout', type=float, default=1800)
    parser.add_argument('--out')
    return parser.parse_args(argv)


def node_command(args, mount_root, dataset_dir, local_root, out, peers,
                 fault=None, nodes=None, extra=()):
    """The ``mpiexec`` command line of one run (``nodes``: other than
    ``--nodes``; ``extra``: more arguments of the node program)."""
    ranks = (nodes or args.nodes) * args.ranks_per_node
    command = [mpi_launch.mpiexec_path(), '--oversubscribe', '--bind-to',
               'none', '-n', str(ranks)]
    if fault is not None:
        command += ['--with-ft', 'ulfm']  # the others outlive the victim
    command += [sys.executable, '-m', 'chainer_prefetch_bench.peers.node',
                '--list', os.path.join(dataset_dir, 'train.txt'),
                '--root', mount_root, '--direct-root', dataset_dir,
                '--local-root', local_root,
                '--ranks-per-node', str(args.ranks_per_node),
                '--epochs', str(args.epochs),
                '--batch-size', str(args.batch_size),
                '--loaders', str(args.loaders),
                '--copy-threads', str(args.copy_threads),
                '--copy-ahead', str(args.copy_ahead),
                '--peer-timeout', str(args.peer_timeout), '--out', out]
    if peers:
        command.append('--peers')
    if fault is not None:
        command += ['--fault', fault, '--fault-epoch', str(args.fault_epoch)]
    return command + list(extra)


def fill_local_directories(local_root, nodes, paths):
    """Every node's local directory holds every file (``warm-local``)."""
    for node in range(nodes):
        directory = LocalDirectory(os.path.join(local_root,
                                                'node{}'.format(node)))
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(directory.stage, map(PlainFile, paths)))
        directory.close()


def dataset_paths(dataset_dir, root):
    with open(os.path.join(dataset_dir, 'train.txt')) as f:
        return [os.path.join(root, line.split()[0]) for line in f]


def run_method(args, method, mount, dataset_dir, paths):
    """One run of ``method``; returns its record."""
    local_root = tempfile.mkdtemp(prefix='peers_local_')
    out = os.path.join(local_root, 'result.json')
    try:
        if method == 'warm-local':
            fill_local_directories(local_root, args.nodes, paths)
        before = mount.op_counts()
        started = time.perf_counter()
        ranks = launch(node_command(
            args, mount.mountpoint, dataset_dir, local_root, out,
            method == 'peers'), args.timeout, out)
        wall = time.perf_counter() - started
        after = mount.op_counts()
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
    epoch_seconds = ranks[0]['epoch_seconds']
    return {'method': method, 'wall_seconds': wall,
            'source_bytes': after['read_bytes'] - before['read_bytes'],
            'source_opens': after['open'] - before['open'],
            'epoch_seconds': epoch_seconds, 'ranks': ranks}


def launch(command, timeout, out):
    """Runs one job; returns rank 0's list of the ranks' results."""
    code, output, timed_out = mpi_launch.run(command, timeout)
    if code != 0 or timed_out or not os.path.exists(out):
        raise RuntimeError('the run failed (exit {}, timed out: {}):\n{}'
                           .format(code, timed_out, output[-4000:]))
    with open(out) as f:
        return json.load(f)


def run_leave(args, peers, mount, dataset_dir):
    """``--nodes`` nodes train ``--epochs`` epochs and snapshot; the last
    node leaves, and the others resume from the snapshot for one epoch.

    Returns:
        Its record: the bytes the mount served in each of the two jobs.
    """
    local_root = tempfile.mkdtemp(prefix='peers_leave_')
    snapshot = os.path.join(local_root, 'snapshot.npz')
    record = {'method': 'leave-peers' if peers else 'leave-no-peers',
              'nodes': [args.nodes, args.nodes - 1]}
    try:
        for job, nodes, extra in (
                ('before', args.nodes, ['--snapshot', snapshot]),
                ('after', args.nodes - 1,
                 ['--resume', snapshot, '--epochs', str(args.epochs + 1)])):
            out = os.path.join(local_root, job + '.json')
            before = mount.op_counts()
            ranks = launch(node_command(
                args, mount.mountpoint, dataset_dir, local_root, out, peers,
                nodes=nodes, extra=extra), args.timeout, out)
            after = mount.op_counts()
            record[job] = {
                'source_bytes': after['read_bytes'] - before['read_bytes'],
                'epoch_seconds': ranks[0]['epoch_seconds'],
                'first_epoch': ranks[0]['first_epoch'], 'ranks': ranks}
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
    return record


def run_fault(args, fault, mount, dataset_dir):
    """The peer tier while node 1's server stops or dies; returns its record."""
    local_root = tempfile.mkdtemp(prefix='peers_fault_')
    out = os.path.join(local_root, 'result.json')
    ranks = args.nodes * args.ranks_per_node
    survivors = [rank for rank in range(ranks) if rank != args.ranks_per_node]

    def finished():
        return all(os.path.exists('{}.rank{}'.format(out, rank))
                   for rank in survivors)
    try:
        code, output, timed_out = mpi_launch.run(node_command(
            args, mount.mountpoint, dataset_dir, local_root, out, True,
            fault), args.timeout, done=finished)
        if not finished():
            raise RuntimeError('fault {}: the other ranks did not finish '
                               '(exit {}, timed out: {}):\n{}'.format(
                                   fault, code, timed_out, output[-4000:]))
        results = []
        for rank in survivors:
            with open('{}.rank{}'.format(out, rank)) as f:
                results.append(json.load(f))
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
    victim_address = next((r['peer_address'] for r in results
                           if r['peer_address']), None)
    left = [line for line in _processes() if 'chainer_prefetch_bench.peers.node'
            in line]
    return {'fault': fault, 'ranks': results,
            'checked': sum(r['checked'] for r in results),
            'wrong': sum(r['wrong'] for r in results),
            'peer_fallbacks': sum(r['peers']['peer_fallbacks'] for r in results),
            'peer_wait_seconds': [r['peers']['peer_wait_seconds'] for r in results],
            'peer_longest_wait_seconds': max(
                r['peers']['peer_longest_wait_seconds'] for r in results),
            'peers_down': [r['peers']['peers_down'] for r in results],
            'processes_left': left,
            'victim_port_closed': _port_closed(victim_address),
            'survivor_ports_closed': all(
                _port_closed(r['peer_address']) for r in results)}


def _processes():
    found = []
    for status in glob.glob('/proc/[0-9]*/cmdline'):
        try:
            with open(status, 'rb') as f:
                found.append(f.read().replace(b'\0', b' ').decode(errors='replace'))
        except OSError:
            pass
    return found


def _port_closed(address):
    if address is None:
        return True
    try:
        socket.create_connection(tuple(address), timeout=2).close()
    except OSError:
        return True
    return False


def summary(runs, dataset_bytes):
    """Ratios between the methods of one run."""
    by_method = {run['method']: run for run in runs}
    lines = {}
    for method, run in by_method.items():
        later = run['epoch_seconds'][1:]
        cpu = [rank['later_cpu'] for rank in run['ranks']]
        lines[method] = {
            'source_bytes_per_dataset': run['source_bytes'] / dataset_bytes,
            'first_epoch_seconds': run['epoch_seconds'][0],
            'later_epoch_median_seconds': (statistics.median(later)
                                           if later else None),
            # Every rank's processes, summed: the training processes (copy
            # threads, peer servers) and the loaders.
            'later_cpu_seconds': (None if None in cpu else sum(
                c['root']['cpu_s'] + c['others']['cpu_s'] for c in cpu)),
            'later_training_process_cpu_seconds': (None if None in cpu else sum(
                c['root']['cpu_s'] for c in cpu))}
    ratios = {}
    if 'peers' in lines and 'warm-local' in lines:
        peers_later = by_method['peers']['epoch_seconds'][1:]
        warm_later = by_method['warm-local']['epoch_seconds'][1:]
        ratios['peers_later_epochs_over_warm_local'] = [
            a / b for a, b in zip(peers_later, warm_later)]
        ratios['peers_later_median_over_warm_local_median'] = (
            lines['peers']['later_epoch_median_seconds']
            / lines['warm-local']['later_epoch_median_seconds'])
        if lines['peers']['later_cpu_seconds'] and \
                lines['warm-local']['later_cpu_seconds']:
            ratios['peers_later_cpu_over_warm_local'] = (
                lines['peers']['later_cpu_seconds']
                / lines['warm-local']['later_cpu_seconds'])
    if 'peers' in lines and 'no-peers' in lines:
        ratios['peers_first_epoch_over_no_peers'] = (
            lines['peers']['first_epoch_seconds']
            / lines['no-peers']['first_epoch_seconds'])
        ratios['source_bytes_no_peers_over_peers'] = (
            by_method['no-peers']['source_bytes']
            / max(by_method['peers']['source_bytes'], 1))
    return {'methods': lines, 'ratios': ratios}


def only_on_leaving_node(args, dataset_dir):
    """Bytes of the files whose only holders in the ``lookback`` (2) epochs
    before the leave were ranks of the leaving node: what the others must
    read from shared storage even with peers, unless a rank still in the
    job held them earlier or holds them now."""
    from chainer_prefetch import ShuffleAcrossRanks
    paths = dataset_paths(dataset_dir, dataset_dir)
    size = args.nodes * args.ranks_per_node
    sampler = ShuffleAcrossRanks(len(paths), 0, size, 0)
    leaving = set(range((args.nodes - 1) * args.ranks_per_node, size))
    total = 0
    for index, path in enumerate(paths):
        ranks = set(sampler.holders(index, args.epochs - 1))
        ranks.update(sampler.holders(index, args.epochs - 2))
        if ranks <= leaving:
            total += os.path.getsize(path)
    return total


def print_report(result):
    if result['runs']:
        print_methods(result)
    print_leaves_and_faults(result)


def print_methods(result):
    print('{:<12} {:>15} {:>10} {:>12} {:>12} {:>12}  {}'.format(
        'method', 'source/dataset', 'epoch 1 s', 'later med s',
        'later CPU s', 'training CPU', 'epochs s'))
    for run in result['runs']:
        line = result['summary']['methods'][run['method']]
        later = line['later_epoch_median_seconds']
        print('{:<12} {:>15.2f} {:>10.1f} {:>12} {:>12} {:>12}  {}'.format(
            run['method'], line['source_bytes_per_dataset'],
            line['first_epoch_seconds'],
            '-' if later is None else '{:.1f}'.format(later),
            _seconds(line['later_cpu_seconds']),
            _seconds(line['later_training_process_cpu_seconds']),
            ' '.join('{:.1f}'.format(s) for s in run['epoch_seconds'])))
    for name, value in result['summary']['ratios'].items():
        if isinstance(value, list):
            value = ' '.join('{:.2f}'.format(v) for v in value)
        else:
            value = '{:.2f}'.format(value)
        print('{}: {}'.format(name, value))


def _seconds(value):
    return '-' if value is None else '{:.1f}'.format(value)


def print_leaves_and_faults(result):
    for run in result['leave']:
        print('{}: {} -> {} nodes; shared storage served {:.2f}x the dataset '
              'before, {:.2f}x in the epoch after (files only the leaving '
              'node held: {:.2f}x)'.format(
                  run['method'], run['nodes'][0], run['nodes'][1],
                  run['before']['source_bytes'] / result['dataset_bytes'],
                  run['after']['source_bytes'] / result['dataset_bytes'],
                  result['only_on_the_leaving_node_bytes']
                  / result['dataset_bytes']))
    for fault in result['faults']:
        print('fault {}: {} examples checked, {} wrong; fallbacks {}; waits '
              'summed per rank {} s, longest {:.2f} s; peers down {}; '
              'processes left {}; victim port closed {}'.format(
                  fault['fault'], fault['checked'], fault['wrong'],
                  fault['peer_fallbacks'],
                  ['{:.2f}'.format(w) for w in fault['peer_wait_seconds']],
                  fault['peer_longest_wait_seconds'],
                  fault['peers_down'], len(fault['processes_left']),
                  fault['victim_port_closed']))


def main(argv=None):
    args = parse(argv)
    dataset_dir = prepare_jpeg_benchmark(args.workdir, args.n_images)
    if dataset_dir is None:
        return 1
    methods = [m for m in args.methods.split(',') if m]
    faults = [f for f in args.faults.split(',') if f]
    for method in methods:
        if method not in METHODS:
            raise SystemExit('unknown method {!r}; choose from {}'.format(
                method, ', '.join(METHODS)))
    runs, fault_runs = [], []
    with storage.mounted(dataset_dir, preset=args.preset) as mount:
        paths = dataset_paths(dataset_dir, mount.mountpoint)
        dataset_bytes = sum(os.path.getsize(p) for p in dataset_paths(
            dataset_dir, dataset_dir))
        leave_runs = []
        if args.leave:
            methods = []
            for peers in (False, True):
                print('running a leave, peers: {} ...'.format(peers),
                      flush=True)
                leave_runs.append(run_leave(args, peers, mount, dataset_dir))
        for method in methods:
            print('running {} ...'.format(method), flush=True)
            runs.append(run_method(args, method, mount, dataset_dir, paths))
        for fault in faults:
            print('running fault {} ...'.format(fault), flush=True)
            fault_runs.append(run_fault(args, fault, mount, dataset_dir))
    result = {'command': ' '.join(['python -m chainer_prefetch_bench.peers.bench']
                                  + list(argv if argv is not None
                                         else sys.argv[1:])),
              'machine': machine_description(), 'args': vars(args),
              'dataset_bytes': dataset_bytes, 'n_images': len(paths),
              'runs': runs, 'faults': fault_runs, 'leave': leave_runs,
              'only_on_the_leaving_node_bytes': (
                  only_on_leaving_node(args, dataset_dir) if args.leave
                  else None),
              'summary': summary(runs, dataset_bytes)}
    print_report(result)
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == '__main__':
    sys.exit(main())
