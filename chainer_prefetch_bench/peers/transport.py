#!/usr/bin/env python
"""How fast the peer tier's transport moves files on loopback, against MPI point-to-point.

Files in a local directory (in the page cache) are copied into another
local directory three ways, one after the other in one run:

``local``     ``sendfile`` from file to file in one process (the bound);
``tcp``       :meth:`chainer_prefetch.PeerGroup.copy` (what stage 2
              calls; connections kept between files) from a
              :class:`~chainer_prefetch.staging.peer_transport.PeerServer` in another
              process, with 1 and with 8 threads;
``mpi``       ``mpiexec -n 2``: rank 1 reads each file and ``Send`` s it,
              rank 0 ``Recv`` s it into a buffer and writes it (one thread,
              as a peer transport on MPI would run in a copy thread).

Each moves one large file (``--large-mib``) and ``--small-files`` files of
``--small-kib`` each; reported as MB/s and files/s.

Usage::

    python -m chainer_prefetch_bench.peers.transport --out results/peers/transport.json
"""
import argparse
import concurrent.futures
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

from chainer_prefetch.staging.counters import Counters
from chainer_prefetch.staging.peer_transport import PeerServer
from chainer_prefetch.staging.peers import PEER_COUNTERS, PeerGroup
from chainer_prefetch.staging.sources import PlainFile
from chainer_prefetch_bench.testbed import mpi_launch
from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.report import write_json


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--large-mib', type=int, default=256)
    parser.add_argument('--small-files', type=int, default=2000)
    parser.add_argument('--small-kib', type=int, default=110)
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--out')
    parser.add_argument('--serve', nargs=2, metavar=('TOKEN', 'FILE_LIST'),
                        help=argparse.SUPPRESS)
    parser.add_argument('--mpi', nargs=2, metavar=('FILE_LIST', 'TARGET'),
                        help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_files(root, args):
    os.makedirs(root)
    large = os.path.join(root, 'large.bin')
    with open(large, 'wb') as f:
        for _ in range(args.large_mib):
            f.write(os.urandom(1 << 20))
    small = []
    for i in range(args.small_files):
        path = os.path.join(root, 's{:05d}.bin'.format(i))
        with open(path, 'wb') as f:
            f.write(os.urandom(args.small_kib << 10))
        small.append(path)
    return large, small


def serve(token_hex, file_list):
    """The server process: serves the listed files (item = line number)."""
    with open(file_list) as f:
        paths = f.read().split('\n')
    server = PeerServer('127.0.0.1', bytes.fromhex(token_hex), 10.0,
                        Counters(PEER_COUNTERS))
    server.lookup = lambda item, name: paths[item] if paths[item] == name else None
    print(server.address[1], flush=True)
    sys.stdin.read()
    server.close()


def copy_local(paths, target):
    for path in paths:
        with open(path, 'rb') as src, open(os.path.join(
                target, os.path.basename(path)), 'wb') as dst:
            size = os.fstat(src.fileno()).st_size
            sent = 0
            while sent < size:
                sent += os.sendfile(dst.fileno(), src.fileno(), sent,
                                    size - sent)


def copy_tcp(port, token, items, target, threads):
    """Each file through :meth:`PeerGroup.copy` (kept connections), as stage 2 does."""
    group = PeerGroup([0, 1], 0, {1: ('127.0.0.1', port)}, token,
                      lambda index, epoch: [1], timeout=10.0)

    def one(item_path):
        item, path = item_path
        with open(os.path.join(target, os.path.basename(path)), 'wb') as out:
            if group.copy(PlainFile(path), os.stat(path), out.fileno(),
                          out.name, item, [1]) is None:
                raise RuntimeError('the peer did not send ' + path)
    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, items))
    finally:
        group.close()


def mpi_side(file_list, target):
    """Both ranks of the MPI copy; rank 0 prints the seconds it took."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    with open(file_list) as f:
        paths = [p for p in f.read().split('\n') if p]
    comm.Barrier()
    started = time.perf_counter()
    for path in paths:
        if comm.rank == 1:
            with open(path, 'rb') as f:
                data = f.read()
            comm.send(len(data), dest=0)
            comm.Send([data, MPI.BYTE], dest=0)
        else:
            size = comm.recv(source=1)
            buffer = bytearray(size)
            comm.Recv([buffer, MPI.BYTE], source=1)
            with open(os.path.join(target, os.path.basename(path)), 'wb') as f:
                f.write(buffer)
    comm.Barrier()
    if comm.rank == 0:
        print('seconds', time.perf_counter() - started, flush=True)


METHODS = ('local', 'tcp-1', 'tcp-8', 'mpi')


def measure(method, paths, items, list_file, target, port, token):
    """Seconds ``method`` takes to copy ``paths`` into ``target``."""
    if method == 'mpi':
        return run_mpi(list_file, target)  # timed inside, without the start
    started = time.perf_counter()
    if method == 'local':
        copy_local(paths, target)
    else:
        copy_tcp(port, token, items, target, int(method.split('-')[1]))
    return time.perf_counter() - started


def main(argv=None):
    args = parse(argv)
    if args.serve:
        return serve(*args.serve)
    if args.mpi:
        return mpi_side(*args.mpi)
    work = tempfile.mkdtemp(prefix='peer_transport_')
    try:
        large, small = make_files(os.path.join(work, 'files'), args)
        cases = {'large': [large], 'small': small}
        lists = {}
        for name, paths in cases.items():
            lists[name] = os.path.join(work, name + '.txt')
            with open(lists[name], 'w') as f:
                f.write('\n'.join(paths))
        token = secrets.token_bytes(32)
        all_paths = [large] + small
        with open(os.path.join(work, 'all.txt'), 'w') as f:
            f.write('\n'.join(all_paths))
        server = subprocess.Popen(
            [sys.executable, '-m', 'chainer_prefetch_bench.peers.transport',
             '--serve', token.hex(), os.path.join(work, 'all.txt')],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            rows = []
            for repeat in range(args.repeats):
                for name, paths in cases.items():
                    n_bytes = sum(os.path.getsize(p) for p in paths)
                    items = [(all_paths.index(p), p) for p in paths]
                    for method in METHODS:
                        target = os.path.join(work, 'out')
                        os.makedirs(target)
                        seconds = measure(method, paths, items, lists[name],
                                          target, port, token)
                        shutil.rmtree(target)
                        rows.append({'repeat': repeat, 'files': name,
                                     'method': method, 'seconds': seconds,
                                     'mb_per_s': n_bytes / seconds / 1e6,
                                     'files_per_s': len(paths) / seconds})
        finally:
            server.stdin.close()
            server.wait(60)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rows)
    if args.out:
        write_json(args.out, {'command': 'python -m chainer_prefetch_bench.'
                              'peers.transport ' + ' '.join(
                                  argv if argv is not None else sys.argv[1:]),
                              'machine': machine_description(),
                              'args': vars(args), 'rows': rows,
                              'medians': medians(rows)})
    return 0


def run_mpi(file_list, target):
    command = [mpi_launch.mpiexec_path(), '--oversubscribe', '--bind-to',
               'none', '-n', '2', sys.executable, '-m',
               'chainer_prefetch_bench.peers.transport', '--mpi', file_list,
               target]
    code, output, timed_out = mpi_launch.run(command, 600)
    if code != 0 or timed_out:
        raise RuntimeError('the MPI copy failed:\n' + output[-3000:])
    return float(output.split('seconds')[-1].split()[0])


def medians(rows):
    import statistics
    found = {}
    for row in rows:
        found.setdefault((row['files'], row['method']), []).append(row)
    return [{'files': files, 'method': method,
             'mb_per_s': statistics.median(r['mb_per_s'] for r in group),
             'files_per_s': statistics.median(r['files_per_s'] for r in group)}
            for (files, method), group in found.items()]


def report(rows):
    print('{:<6} {:<7} {:>10} {:>10}'.format('files', 'method', 'MB/s', 'files/s'))
    for row in medians(rows):
        print('{:<6} {:<7} {:>10.0f} {:>10.0f}'.format(
            row['files'], row['method'], row['mb_per_s'], row['files_per_s']))


if __name__ == '__main__':
    sys.exit(main())
