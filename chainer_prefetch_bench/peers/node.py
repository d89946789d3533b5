"""One rank of a simulated node (run under ``mpiexec`` by :mod:`.bench`).

Ranks ``k * ranks_per_node ... (k + 1) * ranks_per_node - 1`` are node
``k``: they share the local directory ``LOCAL_ROOT/node<k>``.  Every rank
trains on the whole dataset through the shared storage's mount, reshuffled
across ranks every epoch (:class:`~chainer_prefetch.ShuffleAcrossRanks`),
in lockstep (an ``allreduce`` per update, as data-parallel training does),
with or without the peer tier.

With ``--fault stop`` or ``--fault kill`` the ranks do not run in lockstep
(a stopped or killed member would stop the others' collectives): the first
rank of node 1, which serves node 1's copies, stops or kills itself after
``--fault-after`` batches of epoch ``--fault-epoch``, and every other rank
finishes that epoch, compares its examples with direct reads of the
source (all but those of the batches that cross an epoch's boundary), and
writes its own result.
"""
import argparse
import glob
import json
import os
import signal
import sys
import time


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--list', required=True, help='train.txt of the dataset')
    parser.add_argument('--root', required=True, help='the mount (shared storage)')
    parser.add_argument('--direct-root', help='the files without the mount (checks)')
    parser.add_argument('--local-root', required=True)
    parser.add_argument('--ranks-per-node', type=int, default=1)
    parser.add_argument('--epochs', type=int, default=4)
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--loaders', type=int, default=1)
    parser.add_argument('--copy-threads', type=int, default=8)
    parser.add_argument('--copy-ahead', type=int, default=16)
    parser.add_argument('--peers', action='store_true')
    parser.add_argument('--peer-timeout', type=float, default=2.0)
    parser.add_argument('--fault', choices=('stop', 'kill'))
    parser.add_argument('--fault-epoch', type=int, default=1)
    parser.add_argument('--fault-after', type=int, default=3)
    parser.add_argument('--snapshot', help='rank 0 saves the iterator here at the end')
    parser.add_argument('--resume', help='every rank loads the iterator from here')
    parser.add_argument('--out', required=True, help='JSON file (per rank with --fault)')
    parser.add_argument('--seed', type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    import chainer_prefetch
    chainer_prefetch.start_loader_server()  # before MPI starts its threads
    import chainer
    import numpy
    from chainer.datasets import LabeledImageDataset
    from mpi4py import MPI

    from chainer_prefetch_bench.minibatch.counters import tree_change, tree_counters

    comm = MPI.COMM_WORLD
    node = comm.rank // args.ranks_per_node
    local_dir = os.path.join(args.local_root, 'node{}'.format(node))
    dataset = LabeledImageDataset(args.list, args.root)
    sampler = chainer_prefetch.ShuffleAcrossRanks(len(dataset), comm.rank,
                                                  comm.size, args.seed)
    peers = None
    if args.peers:
        peers = chainer_prefetch.PeerGroup.join(
            comm, local_dir, sampler.holders, host='127.0.0.1',
            timeout=args.peer_timeout)
    victim = args.fault is not None and comm.rank == args.ranks_per_node
    direct = (LabeledImageDataset(args.list, args.direct_root)
              if args.fault and args.direct_root else None)
    iterator = chainer_prefetch.PrefetchMultiprocessIterator(
        dataset, args.batch_size, order_sampler=sampler, local_dir=local_dir,
        n_processes=args.loaders, n_copy_threads=args.copy_threads,
        n_copy_ahead=args.copy_ahead,
        peers=peers)
    if args.resume:
        chainer.serializers.load_npz(args.resume, iterator)
    first_epoch = iterator.epoch
    comm.Barrier()
    epoch_seconds, checked, wrong, looks = [], 0, 0, []
    started = time.perf_counter()
    while iterator.epoch < args.epochs:
        epoch = iterator.epoch
        batch = iterator.next()
        if args.fault is None:
            comm.allreduce(len(batch))  # the update's collective
        elif epoch == args.fault_epoch:
            if victim and iterator.current_position >= (
                    args.fault_after * args.batch_size):
                os.kill(os.getpid(), signal.SIGSTOP if args.fault == 'stop'
                        else signal.SIGKILL)
            if direct is not None and not iterator.is_new_epoch:
                first = iterator.current_position - len(batch)
                indices = sampler.order(epoch)[first:first + len(batch)]
                for example, index in zip(batch, indices):
                    expected = direct[int(index)]
                    checked += 1
                    wrong += not (numpy.array_equal(example[0], expected[0])
                                  and example[1] == expected[1])
        if iterator.is_new_epoch:
            if args.fault is None:
                comm.Barrier()
            now = time.perf_counter()
            epoch_seconds.append(now - started)
            if args.fault is None and len(epoch_seconds) in (1, args.epochs):
                looks.append(tree_counters(os.getpid()))  # CPU after epoch 1
            started = time.perf_counter()
            if args.fault is not None and epoch == args.fault_epoch:
                break
    if args.snapshot and comm.rank == 0:
        chainer.serializers.save_npz(args.snapshot, iterator)
    stats = iterator.stats
    iterator.finalize()
    result = {
        'rank': comm.rank, 'node': node, 'first_epoch': first_epoch,
        'epoch_seconds': epoch_seconds,
        # CPU of this rank's processes (training process with its copy
        # threads and peer server; loaders) in the epochs after the first.
        'later_cpu': (tree_change(looks[0], looks[-1], os.getpid())
                      if len(looks) == 2 else None),
        'bytes_copied': stats['bytes_copied'],
        'files_copied': stats['files_copied'],
        'examples_from_source': stats['examples_from_source'],
        'bytes_from_source_stage3': sum(
            e['bytes_from_source'] for e in stats['by_epoch'].values()),
        'by_epoch_bytes_copied': {str(e): v['bytes_copied']
                                  for e, v in stats['by_epoch'].items()},
        'peers': stats['peers'], 'checked': checked, 'wrong': wrong,
        'peer_address': (list(peers.server.address) if peers is not None
                         and peers.server is not None else None)}
    if args.fault is not None:
        with open('{}.rank{}'.format(args.out, comm.rank), 'w') as f:
            json.dump(result, f)
        # Serve until every other survivor has finished too, then leave
        # without a collective (the victim is stopped or gone).
        survivors = comm.size - 1
        deadline = time.monotonic() + 600
        while (len(glob.glob(args.out + '.rank*')) < survivors
               and time.monotonic() < deadline):
            time.sleep(0.2)
        if peers is not None:
            peers.close()
        os._exit(0)
    results = comm.gather(result, root=0)
    if peers is not None:
        comm.Barrier()  # nobody stops serving while another still asks
        peers.close()
    if comm.rank == 0:
        with open(args.out, 'w') as f:
            json.dump(results, f)
    return 0


if __name__ == '__main__':
    sys.exit(main())
