#!/usr/bin/env python
"""Data-parallel ImageNet training with ChainerMN and a prefetching iterator.

Each MPI process (rank) trains a replica of the model on its own shard of
the training set; gradients are averaged with ChainerMN after every
iteration.  Images are read through ``chainer_prefetch.
PrefetchMultiprocessIterator`` (the default, ``--iterator prefetch``), which
copies the files a rank will need soon from slow shared storage (``--root``)
to a node-local directory (``--local-dir``) with ``--copy-threads`` threads
while the loader processes decode the ones already copied.  ``--iterator
multiprocess`` uses Chainer's own ``MultiprocessIterator`` instead, for
comparison.

Usage (K processes, e.g. one per GPU; the lists are ``<path> <label>`` lines
as read by ``chainer.datasets.LabeledImageDataset``)::

    mpiexec -n K python train_imagenet.py train.txt val.txt \\
        --root /shared/imagenet --mean mean.npy --arch resnet50 \\
        --batchsize 32 --epoch 90 --loaderjob 4 \\
        --local-dir /local/ssd/$USER/prefetch --copy-threads 16 --gpu

    # CPU smoke test, 2 processes on one machine:
    mpiexec --oversubscribe -n 2 python train_imagenet.py train.txt val.txt \\
        --root data --arch tiny --crop-size 32 --batchsize 8 --epoch 3

    # resume from the snapshot written at the end of epoch 2:
    mpiexec -n K python train_imagenet.py ... --resume result/snapshot_epoch_2

Notes:

* Only rank 0 reads the image lists; ``chainermn.scatter_dataset`` sends each
  rank its shard (``--seed`` fixes the shuffle, so a resumed run gets the
  same shards).
* The learning rate follows the linear scaling rule: ``--lr`` is the rate
  for a global batch of 256 and is multiplied by
  ``batchsize * n_processes / 256``.
* ``--mean`` is optional.  A mean image of shape ``(3, H, W)`` (e.g. the
  ``(3, 256, 256)`` file of Chainer's example) is cropped together with the
  image when both have the same size, and centre-cropped to ``--crop-size``
  otherwise; without it, 128 is subtracted.  Pixel values are then scaled
  by 1/255.
* Without ``--gpu`` the model runs on the CPU and the communicator defaults
  to ``naive`` (the only CPU-capable one in ChainerMN 7.8.1; ``flat`` needs
  CuPy).  With ``--gpu`` each rank uses GPU ``intra_rank`` and the
  communicator defaults to ``pure_nccl``; CuPy is imported only then.
* ``--loaderjob`` (loader processes per iterator) defaults to this rank's
  share of the node's cores (``node_resources.py``): the cores it may run
  on divided among the ranks of the node that share them, instead of
  Chainer's one worker per core for every rank.
* ``--pinned-copy`` (with ``--gpu``): the next minibatch is concatenated
  into pinned host memory and copied to the GPU on a side stream while the
  current one trains (``chainer_prefetch.device_copy``); a pass-through
  on the CPU.
* Time breakdown (``time_breakdown.py``, ``--time-breakdown``; off by
  default, since on a GPU it synchronises the device at every phase
  boundary and slows training): every rank splits each
  iteration's wall time into load (inside the iterator's ``next()``),
  forward, backward, allreduce (the communicator's gradient averaging) and
  other, sums them per epoch and writes ``OUT/time_breakdown_rank{R}.json``
  at the end of every epoch (with the first and second iterations' load
  times and, for the prefetch iterator, its ``stats``).  The epoch sums are
  also reported as ``time/load``, ``time/forward``, ``time/backward``,
  ``time/allreduce``, ``time/other`` (and ``time/wall``), so they appear in
  ``OUT/log`` and in the printed report.
* ``--start-method`` (default ``forkserver``) selects how the iterators
  start their worker processes.  With InfiniBand (verbs), calling ``fork()``
  in a process that has already initialised MPI can crash the child or
  silently corrupt memory registered with the network card (see the Open MPI
  FAQ on fork and OpenFabrics).  With ``forkserver`` the script therefore
  starts the fork server (by launching a dummy process) *before* MPI is
  initialised by ``chainermn.create_communicator``, and every later worker
  is forked from that clean, MPI-free server.  ``fork`` is faster to start
  and fine on machines without InfiniBand (e.g. shared memory or TCP only).
  With ``--fault-tolerance respawn|shrink`` each rank first splits off its
  supervisor (``supervise()``, a fork of the still single-threaded process)
  and starts the fork server only then: the server must be a child of the
  rank itself, which waits for it (``os.waitpid``) before every worker.
"""

import argparse
import multiprocessing
import os
import random
import sys
import time

import chainer
import chainermn
import numpy as np
from chainer import training
from chainer.training import extensions

# ``models``, ``node_resources`` and ``time_breakdown`` live next to this
# script: Python puts a script's folder first on its path (and the
# forkserver's children inherit that path).
from elastic_training import add_elastic_arguments
from models import ARCHS
from node_resources import cpus_available, default_loaderjob, node_cpu_sets
from time_breakdown import COMPONENTS, TimedUpdater, install_time_breakdown

CPU_COMMUNICATORS = ('naive',)
"""ChainerMN 7.8.1 communicators that work without CuPy."""

SUPERVISED_STRATEGIES = ('respawn', 'shrink')
"""``--fault-tolerance`` strategies whose ranks run under a supervisor."""


class PreprocessedDataset(chainer.dataset.DatasetMixin):
    """Labelled images with cropping, flipping, mean subtraction and scaling.

    ``self.base`` is the underlying ``LabeledImageDataset``; the prefetching
    iterator uses it to find the files behind each example.
    """

    def __init__(self, path, root, mean, crop_size, random=True):
        self.base = chainer.datasets.LabeledImageDataset(path, root)
        if mean is None:
            self.mean = None
        else:
            mean = np.asarray(mean, dtype=np.float32)
            if mean.ndim == 1:  # per-channel mean
                mean = mean[:, None, None]
            self.mean = mean
        self.crop_size = crop_size
        self.random = random

    def __len__(self):
        return len(self.base)

    def _mean_for(self, shape, top, left):
        """The mean to subtract from the crop at (top, left) of an image."""
        c = self.crop_size
        mean = self.mean
        if mean is None:
            return np.float32(128)
        if mean.shape[1:] == (1, 1):
            return mean
        if mean.shape[1:] == shape[1:]:
            # Same size as the image: take the same window (as Chainer does).
            return mean[:, top:top + c, left:left + c]
        _, mh, mw = mean.shape
        if mh < c or mw < c:
            raise ValueError('mean image {} is smaller than the crop size {}'
                             .format(mean.shape, c))
        mt = (mh - c) // 2
        ml = (mw - c) // 2
        return mean[:, mt:mt + c, ml:ml + c]

    def get_example(self, i):
        image, label = self.base[i]
        if image.shape[0] == 1:  # greyscale
            image = np.repeat(image, 3, axis=0)
        elif image.shape[0] == 4:  # RGBA
            image = image[:3]
        c = self.crop_size
        _, h, w = image.shape
        if h < c or w < c:
            raise ValueError('image {} ({}x{}) is smaller than the crop size '
                             '{}'.format(i, h, w, c))
        if self.random:
            top = random.randint(0, h - c)
            left = random.randint(0, w - c)
        else:
            top = (h - c) // 2
            left = (w - c) // 2
        crop = image[:, top:top + c, left:left + c]
        crop = crop - self._mean_for(image.shape, top, left)
        if self.random and random.randint(0, 1):
            crop = crop[:, :, ::-1]
        crop *= np.float32(1.0 / 255.0)
        return np.ascontiguousarray(crop, dtype=np.float32), label


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Data-parallel ImageNet training with ChainerMN and '
                    'node-local prefetching',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('train', help='training image-label list file')
    parser.add_argument('val', help='validation image-label list file')
    parser.add_argument('--arch', '-a', choices=sorted(ARCHS),
                        default='resnet50', help='network architecture')
    parser.add_argument('--batchsize', '-B', type=int, default=32,
                        help='minibatch size per process')
    parser.add_argument('--val_batchsize', '--val-batchsize', '-b',
                        dest='val_batchsize', type=int, default=250,
                        help='validation minibatch size per process')
    parser.add_argument('--epoch', '-E', type=int, default=10,
                        help='number of epochs to train')
    parser.add_argument('--lr', type=float, default=0.1,
                        help='learning rate for a global batch of 256 '
                             '(scaled linearly with the global batch)')
    parser.add_argument('--momentum', type=float, default=0.9)
    parser.add_argument('--weight-decay', type=float, default=1e-4)
    parser.add_argument('--crop-size', type=int, default=224,
                        help='side of the square crop fed to the network')
    parser.add_argument('--n-class', type=int, default=None,
                        help='number of classes (default: 1 + the largest '
                             'label in the training list)')
    parser.add_argument('--initmodel', help='initialise the model from an '
                                            'npz file')
    parser.add_argument('--loaderjob', '-j', type=int, default=None,
                        help='data loading processes per iterator (default: '
                             "this rank's share of the node's cores)")
    parser.add_argument('--mean', '-m', default=None,
                        help='mean image (.npy); if absent, subtract 128')
    parser.add_argument('--root', '-R', default='.',
                        help='root directory of the image files')
    parser.add_argument('--out', '-o', default='result',
                        help='output directory')
    parser.add_argument('--resume', '-r', default='',
                        help='resume the trainer from this snapshot')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed for shuffling the dataset before '
                             'scattering it')
    parser.add_argument('--gpu', '-g', action='store_true',
                        help='use GPU intra_rank of each node (needs CuPy)')
    parser.add_argument('--communicator', default=None,
                        help='ChainerMN communicator: naive, flat, '
                             'pure_nccl, ... (default: pure_nccl with --gpu, '
                             'naive otherwise; only naive works without '
                             '--gpu)')
    parser.add_argument('--iterator', choices=('prefetch', 'multiprocess'),
                        default='prefetch',
                        help='chainer_prefetch.PrefetchMultiprocessIterator '
                             'or chainer.iterators.MultiprocessIterator')
    parser.add_argument('--local-dir', default=None,
                        help='node-local staging directory of the prefetch '
                             'iterator (shared by the ranks of a node)')
    parser.add_argument('--copy-threads', type=int, default=16,
                        help='copy threads of the prefetch iterator')
    parser.add_argument('--shuffle-across-ranks', action='store_true',
                        help='every rank holds the whole training set and '
                             'the job reshuffles it across ranks every '
                             'epoch (chainer_prefetch.ShuffleAcrossRanks) '
                             'instead of scattering fixed shards')
    parser.add_argument('--peers', action='store_true',
                        help='with --shuffle-across-ranks and --local-dir: '
                             'copy each file from the node that trained on '
                             'it before, before shared storage '
                             '(chainer_prefetch.PeerGroup)')
    parser.add_argument('--local-capacity', type=parse_bytes, default=None,
                        help='limit of the copies under --local-dir, e.g. '
                             '200G (all ranks of a node share it); the '
                             'examples needed farthest ahead are evicted')
    parser.add_argument('--next-epoch-cache', type=int, default=None,
                        help='examples of the next epoch each training '
                             'iterator keeps in memory (prefetch iterator)')
    parser.add_argument('--start-method', choices=('fork', 'forkserver'),
                        default='forkserver',
                        help='multiprocessing start method (see the module '
                             'docstring)')
    parser.add_argument('--maxtasksperchild', type=int, default=None,
                        help='replace a loader process after this many '
                             'tasks (both iterators; default: never)')
    parser.add_argument('--time-breakdown', action='store_true',
                        help='time load/forward/backward/allreduce/other of '
                             'every iteration (synchronises the GPU at each '
                             'phase) and write OUT/time_breakdown_rank*.json')
    parser.add_argument('--pinned-copy', action='store_true',
                        help='copy the next minibatch to the GPU through '
                             'pinned memory on a side stream while the '
                             'current one trains (a pass-through on the CPU)')
    parser.add_argument('--test', action='store_true',
                        help='log and validate every 10 iterations')
    parser.add_argument('--progress', action='store_true',
                        help='show a progress bar on rank 0')
    parser.add_argument('--example-log', default=None, metavar='PATH',
                        help='append the training-set indices of every '
                             'attempted update to PATH (--fault-tolerance '
                             'and --elastic; counted by chainer_prefetch_bench.'
                             'testbed.exactly_once)')
    add_fault_tolerance_arguments(parser)
    add_elastic_arguments(parser)
    args = parser.parse_args(argv)
    if args.peers and not (args.shuffle_across_ranks and args.local_dir
                           and args.iterator == 'prefetch'):
        parser.error('--peers needs --shuffle-across-ranks, --local-dir and '
                     'the prefetch iterator')
    if args.shuffle_across_ranks and (args.fault_tolerance or args.elastic):
        parser.error('--shuffle-across-ranks is not combined with '
                     '--fault-tolerance or --elastic (they split the '
                     'dataset by their own plan)')
    return args


def add_fault_tolerance_arguments(parser):
    """Options of ``--fault-tolerance`` (see train_fault_tolerant)."""
    group = parser.add_argument_group(
        'fault tolerance (docs/fault_tolerance.rst)')
    group.add_argument('--fault-tolerance',
                       choices=('respawn', 'shrink', 'checkpoint'),
                       default=None,
                       help='recover from a failed process in-process '
                            '(respawn, shrink; needs mpirun --with-ft ulfm) '
                            'or by snapshots and a relaunch (checkpoint)')
    group.add_argument('--ulfm-missing', choices=('error', 'fallback'),
                       default='error',
                       help='without ULFM, stop (error) or fall back to '
                            'checkpoint/restart with a warning')
    group.add_argument('--lr-rule', choices=('linear', 'sqrt', 'constant'),
                       default='linear',
                       help='learning rate after shrink, from the new size')
    group.add_argument('--min-size', type=int, default=1,
                       help='fewest ranks shrink may continue with')
    group.add_argument('--spares', type=int, default=0,
                       help='warm spare processes kept parked (respawn): a '
                            'failed rank is taken by a spare instead of a '
                            'process started at the failure')
    group.add_argument('--snapshot-interval', type=int, default=50,
                       help='iterations between snapshots (checkpoint)')
    group.add_argument('--snapshot-seconds', type=float, default=None,
                       help='seconds of training between snapshots '
                            '(checkpoint; replaces --snapshot-interval)')
    group.add_argument('--stop-timeout', type=float, default=10.0,
                       help='seconds a stopped (SIGSTOP) rank may stay so '
                            'before it is killed and recovered from')
    group.add_argument('--call-timeout', type=float, default=120.0,
                       help='seconds a rank may wait in one MPI call before '
                            'the job ends with a message')
    group.add_argument('--ft-events', default=None,
                       help='event log (JSON lines; default '
                            'OUT/ft_events.jsonl)')
    group.add_argument('--inject-failure', choices=('kill', 'stop', 'exit'),
                       default=None,
                       help='make --inject-rank fail once: SIGKILL, SIGSTOP '
                            'or exit without MPI_Finalize')
    group.add_argument('--inject-rank', type=int, nargs='+', default=[1],
                       help='one or more ranks, each failing once')
    group.add_argument('--inject-iteration', type=int, nargs='+',
                       default=None, help='one per --inject-rank, or one')
    group.add_argument('--inject-seconds', type=float, default=None,
                       help='fail this many seconds after training started')
    group.add_argument('--inject-spare-failure', type=float, default=None,
                       metavar='SECONDS',
                       help='the first spare is killed after parking this '
                            'long')


def set_start_method(method, iterator):
    """Pick the start method and start the fork server now.

    Must run before MPI is initialised, and after ``supervise()`` where the
    rank is supervised: the fork server is a child of the process that
    starts it, and only that process can use it.  ``prefetch``: the
    iterator's loaders come from the fork server whenever this process runs
    threads (MPI's, etcd's, the other iterator's), whatever the method, so
    the server is started (in the background) for both.  Setting the method
    alone does not launch the fork server, so for Chainer's iterator a
    dummy process is started and joined.
    """
    multiprocessing.set_start_method(method, force=True)
    if iterator == 'prefetch':
        import chainer_prefetch
        chainer_prefetch.start_loader_server()
    elif method == 'forkserver':
        p = multiprocessing.Process()
        p.start()
        p.join()


def parse_bytes(text):
    """``'200G'`` -> bytes; suffixes K, M, G, T (powers of 1024) or none."""
    units = {'K': 2 ** 10, 'M': 2 ** 20, 'G': 2 ** 30, 'T': 2 ** 40}
    text = text.strip().upper().rstrip('B')
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            'not a size: {!r} (e.g. 500M, 200G)'.format(text)) from None
    if value < 1:
        raise argparse.ArgumentTypeError('size must be positive: ' + text)
    return int(value)


def set_loaderjob(args, comm, collective=True):
    """Fill in ``--loaderjob``: this rank's share of the node's cores.

    With ``collective`` the ranks exchange their CPU sets (a collective call
    of every rank); without, every rank of the node is assumed to share this
    rank's CPUs (the fault-tolerant path, where a replacement joins later).
    """
    if collective:
        own, node = node_cpu_sets(comm.mpi_comm.allgather)
    else:
        own = cpus_available()
        node = [own] * comm.intra_size
    chosen = args.loaderjob is None
    if chosen:
        args.loaderjob = default_loaderjob(own, node)
    if comm.rank == 0:
        print('Loader processes per rank: {} ({}; {} CPUs available to '
              'rank 0, {} ranks on its node)'.format(
                  args.loaderjob, 'default' if chosen else '--loaderjob',
                  len(own), len(node)))


def make_iterator(args, dataset, batch_size, train, order_sampler=None,
                  peers=None):
    kwargs = dict(repeat=train, shuffle=train, n_processes=args.loaderjob,
                  maxtasksperchild=args.maxtasksperchild)
    if order_sampler is not None:
        kwargs.update(shuffle=None, order_sampler=order_sampler)
    if args.iterator == 'multiprocess':
        return chainer.iterators.MultiprocessIterator(
            dataset, batch_size, **kwargs)
    import chainer_prefetch
    # One directory for both iterators and all ranks of a node: copies are
    # keyed by source path and guarded by file locks, and the capacity limit
    # is enforced jointly over all of them.
    return chainer_prefetch.PrefetchMultiprocessIterator(
        dataset, batch_size, local_dir=args.local_dir,
        n_copy_threads=args.copy_threads,
        local_capacity=args.local_capacity,
        next_epoch_cache_examples=args.next_epoch_cache if train else None,
        peers=peers, **kwargs)


def main(argv=None):
    main_started = time.perf_counter()
    args = parse_args(argv)
    if args.communicator is None:
        args.communicator = 'pure_nccl' if args.gpu else 'naive'
    if args.gpu:
        try:
            import cupy  # NOQA: F401
        except ImportError:
            sys.exit('--gpu needs CuPy, which is not installed')
    elif args.communicator not in CPU_COMMUNICATORS:
        # ChainerMN 7.8.1's flat (and other) communicators pack gradients
        # into CuPy buffers and fail without a GPU.
        sys.exit('communicator {!r} needs --gpu; on the CPU use one of {}'
                 .format(args.communicator, ', '.join(CPU_COMMUNICATORS)))

    if args.fault_tolerance is not None and (args.gpu or
                                             args.communicator != 'naive'):
        # Checked before supervise(): an exit of a supervised rank is fenced,
        # and ULFM's mpirun leaves a fenced rank out of its exit status.
        sys.exit('--fault-tolerance runs on the CPU with the naive '
                 'communicator (drop --gpu / --communicator)')
    if args.fault_tolerance in SUPERVISED_STRATEGIES:
        # First the supervisor's fork (see train_fault_tolerant): the rank
        # is the child, and it starts its own fork server below.
        from chainer_prefetch.resilience.supervisor import supervise
        supervise()
    # Before MPI initialisation (inside create_communicator); see docstring.
    set_start_method(args.start_method, args.iterator)

    if args.fault_tolerance is not None:
        return train_fault_tolerant(args)
    if args.elastic is not None:
        from elastic_training import train_elastic
        return train_elastic(args, sys.modules[__name__])

    comm = chainermn.create_communicator(args.communicator)
    if args.gpu:
        device = chainer.get_device('@cupy:{}'.format(comm.intra_rank))
    else:
        device = chainer.get_device('@numpy')
    device.use()
    set_loaderjob(args, comm)

    # Only rank 0 reads the lists; the shards are scattered below.
    mean = np.load(args.mean) if args.mean else None
    if comm.rank == 0:
        train = PreprocessedDataset(args.train, args.root, mean,
                                    args.crop_size)
        val = PreprocessedDataset(args.val, args.root, mean,
                                  args.crop_size, random=False)
        n_class = args.n_class
        if n_class is None:
            n_class = 1 + max(int(label) for _, label in train.base._pairs)
    else:
        train = val = n_class = None
    n_class = comm.bcast_obj(n_class)

    global_batch = args.batchsize * comm.size
    lr = args.lr * global_batch / 256.0
    if comm.rank == 0:
        print('==========================================')
        print('Processes: {}'.format(comm.size))
        print('Communicator: {}'.format(args.communicator))
        print('Device: {}'.format(device))
        print('Arch: {}, classes: {}, crop: {}'.format(
            args.arch, n_class, args.crop_size))
        print('Minibatch: {} per process, {} global'.format(
            args.batchsize, global_batch))
        print('Learning rate: {} ({} for 256)'.format(lr, args.lr))
        print('Epochs: {}'.format(args.epoch))
        print('Iterator: {}, start method: {}'.format(
            args.iterator, args.start_method))
        print('Train examples: {}, val examples: {}'.format(
            len(train), len(val)))
        print('==========================================')
        sys.stdout.flush()

    train_sampler = peers = None
    if args.shuffle_across_ranks:
        # Every rank holds the whole training set; the sampler splits one
        # permutation per epoch by rank.
        train = comm.bcast_obj(train)
        import chainer_prefetch
        train_sampler = chainer_prefetch.ShuffleAcrossRanks(
            len(train), comm.rank, comm.size, args.seed)
        if args.peers:
            peers = chainer_prefetch.PeerGroup.join(
                comm, args.local_dir, train_sampler.holders)
    else:
        train = chainermn.scatter_dataset(train, comm, shuffle=True,
                                          seed=args.seed)
    val = chainermn.scatter_dataset(val, comm)

    model = chainer.links.Classifier(ARCHS[args.arch](n_class=n_class))
    if args.initmodel:
        chainer.serializers.load_npz(args.initmodel, model.predictor)
    model.to_device(device)

    train_iter = make_iterator(args, train, args.batchsize, True,
                               train_sampler, peers)
    val_iter = make_iterator(args, val, args.val_batchsize, False)
    staging_iter = train_iter
    converter = chainer.dataset.concat_examples
    if args.pinned_copy:
        from chainer_prefetch.device_copy import StagedDeviceCopy
        train_iter = StagedDeviceCopy(train_iter, device)
        converter = train_iter.converter
        if comm.rank == 0:
            print('Pinned copy: {}'.format(train_iter.mode))

    optimizer = make_optimizer(args, model, comm)

    if args.time_breakdown:
        # Times load / forward / backward / allreduce / other per iteration
        # (see time_breakdown.py); on a GPU each phase ends with a sync.
        updater = TimedUpdater(
            train_iter, optimizer, converter=converter, device=device,
            synchronize=device.device.synchronize if args.gpu else None)
    else:
        updater = training.updaters.StandardUpdater(
            train_iter, optimizer, converter=converter, device=device)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), args.out)
    if args.time_breakdown:
        install_time_breakdown(
            trainer, updater,
            os.path.join(args.out,
                         'time_breakdown_rank{}.json'.format(comm.rank)),
            info=dict(rank=comm.rank, size=comm.size,
                      intra_rank=comm.intra_rank, inter_size=comm.inter_size,
                      iterator=args.iterator, arch=args.arch,
                      batchsize=args.batchsize, crop_size=args.crop_size,
                      loaderjob=args.loaderjob,
                      copy_threads=args.copy_threads,
                      local_dir=args.local_dir, root=args.root,
                      pinned_copy=args.pinned_copy,
                      start_method=args.start_method,
                      train_examples=len(train), epochs=args.epoch),
            clock_origin=main_started)

    interval = (10, 'iteration') if args.test else (1, 'epoch')
    evaluator = extensions.Evaluator(val_iter, model, device=device)
    trainer.extend(chainermn.create_multi_node_evaluator(evaluator, comm),
                   trigger=interval)

    # Output extensions only on rank 0 (the model is the same on all ranks).
    if comm.rank == 0:
        trainer.extend(extensions.snapshot(
            filename='snapshot_epoch_{.updater.epoch}'),
            trigger=(1, 'epoch'))
        trainer.extend(extensions.LogReport(trigger=interval))
        trainer.extend(extensions.observe_lr(), trigger=interval)
        trainer.extend(extensions.PrintReport([
            'epoch', 'iteration', 'main/loss', 'validation/main/loss',
            'main/accuracy', 'validation/main/accuracy', 'lr',
            'elapsed_time'] + (['time/' + key for key in COMPONENTS]
                               if args.time_breakdown else [])),
            trigger=interval)
        if args.progress:
            trainer.extend(extensions.ProgressBar(update_interval=10))

    if args.resume:
        # Every rank loads the snapshot written by rank 0.
        chainer.serializers.load_npz(args.resume, trainer)

    # Trainer.run finalizes the updater's and the evaluator's iterators.
    try:
        trainer.run()
        if peers is not None:
            report_peers(comm, staging_iter.stats)
            # Every rank has finished: no copy thread of another finds this
            # node gone and marks it down.
            comm.mpi_comm.Barrier()
    finally:
        if peers is not None:
            peers.close()


def report_peers(comm, stats):
    """Prints, per rank, what the training iterator read from shared
    storage and from the other nodes."""
    peer = stats['peers']
    print('rank {}: {} bytes from shared storage ({} files), {} bytes from '
          'peers ({} files), {} fallbacks to shared storage, peers down: {}'
          .format(comm.rank, stats['bytes_copied'], stats['files_copied'],
                  peer['bytes_from_peers'], peer['files_from_peers'],
                  peer['peer_fallbacks'], sorted(peer['peers_down']) or 'none'),
          flush=True)


def make_optimizer(args, model, comm):
    """The multi-node MomentumSGD of ``--fault-tolerance`` and
    ``--elastic`` (learning rate scaled to the global batch)."""
    lr = args.lr * args.batchsize * comm.size / 256.0
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=lr, momentum=args.momentum), comm)
    optimizer.setup(model)
    if args.weight_decay > 0:
        optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(
            args.weight_decay))
    return optimizer


def shard_iterator_factories(args):
    """``(train_iterator(shard, order_sampler=None), val_iterator(shard))``
    factories (``order_sampler``: the exact epochs of ``--fault-tolerance``)."""
    def train_iterator(shard, order_sampler=None):
        return make_iterator(args, shard, args.batchsize, True, order_sampler)

    def val_iterator(shard):
        return make_iterator(args, shard, args.val_batchsize, False)
    return train_iterator, val_iterator


def train_fault_tolerant(args):
    """Training that survives a failed rank (``--fault-tolerance``).

    * ``respawn`` / ``shrink``: the communicator is
      ``chainer_prefetch.resilience``'s fault-tolerant one (CPU, ``naive``);
      a failure is repaired in-process by ``FaultTolerantTraining``.  Every
      rank keeps the whole example lists (they are small) so that any shard
      can be rebuilt.  Each rank runs under a supervisor process (started
      by ``main()`` before the fork server) that fences it if it ends
      without finalizing; an exception it raises ends the whole job.  With
      ``--spares N``, N spare processes of this program wait parked
      (``SparePool``) and take failed ranks; a spare or a replacement
      receives the example lists with the model, optimizer state, iteration
      and iterator position.
    * ``checkpoint``: rank 0 writes ``OUT/snapshot_iter_N`` every
      ``--snapshot-interval`` iterations (or ``--snapshot-seconds``) and
      every rank loads the latest one at start;
      ``python -m chainer_prefetch.resilience.launcher`` relaunches the job
      after a failure.

    Events (failure, recovery, start, first iteration, validation) go to
    ``--ft-events`` for the experiments.
    """
    from chainer_prefetch.resilience import injection, launcher, policy
    from chainer_prefetch.resilience.watchdog import WatchdogSettings
    started = time.time()
    from chainer_prefetch.resilience import recovery
    from chainer_prefetch.resilience import training as ft_training
    from chainer_prefetch.resilience.communicator import FaultTolerantCommunicator, start_watchdog
    from chainer_prefetch.resilience.errors import ProcessFailure
    from chainer_prefetch.resilience.reporting import RankZeroReports
    from chainer_prefetch.resilience.spares import SparePool
    from chainer_prefetch.resilience.ulfm import check_ulfm
    watchdog = WatchdogSettings(args.stop_timeout, args.call_timeout)
    strategy = args.fault_tolerance
    events = injection.EventLog(
        args.ft_events or os.path.join(args.out, 'ft_events.jsonl'), -1)
    package = pool = None
    if recovery.is_replacement():
        spare_watchdog = start_watchdog(-1, watchdog)
        pool = SparePool.join(spare_watchdog, events)
        first_spare = (pool.generation == 1 and pool.role == policy.SPARE
                       and pool.roles.index(policy.SPARE)
                       == pool.comm.Get_rank())
        takeover = pool.wait(args.inject_spare_failure if first_spare
                             else None)
        if takeover is None:  # dismissed at the end of the job
            spare_watchdog.heartbeat.enter('Finalize')
            return
        comm = FaultTolerantCommunicator(takeover.training,
                                         watchdog=spare_watchdog)
        package = ft_training.receive_package(comm, takeover)
        train, val = package['train'], package['val']
        n_class = package['setup']
    else:
        comm = FaultTolerantCommunicator(watchdog=watchdog)
        if strategy != 'checkpoint' and not check_ulfm(args.ulfm_missing):
            strategy = 'checkpoint'
        mean = np.load(args.mean) if args.mean else None
        lists = None
        if comm.rank == 0:
            train = PreprocessedDataset(args.train, args.root, mean,
                                        args.crop_size)
            val = PreprocessedDataset(args.val, args.root, mean,
                                      args.crop_size, random=False)
            n_class = args.n_class or 1 + max(
                int(label) for _, label in train.base._pairs)
            lists = (train, val, n_class)
        train, val, n_class = comm.bcast_obj(lists)
    events.rank = comm.rank
    restart = launcher.restart_count()
    events.write('start', strategy=strategy, size=comm.size, restart=restart,
                 replacement=package is not None, started=started)

    device = chainer.get_device('@numpy')
    set_loaderjob(args, comm, collective=False)
    model = chainer.links.Classifier(ARCHS[args.arch](n_class=n_class))
    optimizer = make_optimizer(args, model, comm)
    train_iterator, val_iterator = shard_iterator_factories(args)
    train, converter = with_example_log(args, train, lambda: updater)
    # Every rank can recompute every rank's orders (exact epochs through a
    # recovery), and a snapshot holds the whole group's progress (a restart
    # at any size resumes every example exactly once).
    updater = training.updaters.StandardUpdater(
        ft_training.train_iterator(train, train_iterator, args.batchsize,
                                   comm, args.seed),
        optimizer, converter=converter, device=device)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), args.out)
    interval = (10, 'iteration') if args.test else (1, 'epoch')
    evaluator = chainermn.create_multi_node_evaluator(
        extensions.Evaluator(val_iterator(ft_training.shard(
            val, comm.size, comm.rank, None)), model, device=device), comm)
    trainer.extend(evaluator, trigger=interval)
    # Every rank keeps the report; only the current rank 0 writes it.
    log_report = extensions.LogReport(trigger=interval)
    print_report = extensions.PrintReport([
        'epoch', 'iteration', 'main/loss', 'validation/main/loss',
        'validation/main/accuracy', 'lr', 'elapsed_time'])
    reports = RankZeroReports(comm, log_report, print_report)
    for extension in (reports, log_report):
        trainer.extend(extension)
    trainer.extend(extensions.observe_lr(), trigger=interval)
    trainer.extend(print_report, trigger=interval)

    if strategy == 'checkpoint':
        if comm.rank == 0:
            trainer.extend(extensions.snapshot(
                filename='snapshot_iter_{.updater.iteration}'),
                trigger=snapshot_trigger(args))
        latest = None
        if os.path.isdir(args.out):
            latest = policy.latest_snapshot(sorted(os.listdir(args.out)))
        if latest is not None:
            chainer.serializers.load_npz(os.path.join(args.out, latest),
                                         trainer)
            events.write('resumed', snapshot=latest,
                         iteration=updater.iteration)
    else:
        recoverer = ft_training.FaultTolerantTraining(
            comm, strategy, model, optimizer, updater, train, val,
            train_iterator, val_iterator, evaluator=evaluator,
            trainer=trainer, seed=args.seed, lr_rule=args.lr_rule,
            respawn_command=[sys.executable, os.path.abspath(sys.argv[0])]
            + sys.argv[1:], spares=args.spares, pool=pool,
            min_size=args.min_size, setup=n_class, reports=reports,
            events=events)
        if package is not None:
            recoverer.load_package(package, newcomer=True)
            events.write('joined', iteration=updater.iteration)

    if args.inject_failure and package is None and restart == 0:
        for number, target in enumerate(args.inject_rank):
            at = args.inject_iteration or [None]
            trainer.extend(injection.FailureInjector(
                comm.rank, target, args.inject_failure,
                at[min(number, len(at) - 1)], args.inject_seconds, events),
                name='FailureInjector{}'.format(number))
    trainer.extend(_progress_events(events, comm))
    trainer.extend(_validation_event(events, comm), trigger=interval)
    try:
        trainer.run()
    except ProcessFailure as failure:
        # checkpoint/restart: end this launch; the launcher relaunches it.
        sys.stderr.write('{}; ending the job for a restart\n'.format(failure))
        sys.stderr.flush()
        comm.close()
        os._exit(1)
    if args.example_log:
        converter.log.write('finished', iteration=updater.iteration)
    events.write('finished', iteration=updater.iteration, size=comm.size,
                 params_sha1=_parameters_digest(model))
    comm.close()


def with_example_log(args, train, updater_of):
    """``(train, converter)``: with ``--example-log``, the training set
    with each example's index and the converter that logs them
    (``chainer_prefetch_bench.testbed.exactly_once``); else both
    unchanged."""
    if not args.example_log:
        return train, chainer.dataset.concat_examples
    from chainer_prefetch_bench.testbed.exactly_once import IndexedDataset, logging_converter
    return IndexedDataset(train), logging_converter(args.example_log,
                                                    updater_of)


def snapshot_trigger(args):
    """Every ``--snapshot-seconds`` of training, else every
    ``--snapshot-interval`` iterations."""
    if args.snapshot_seconds is not None:
        return training.triggers.TimeTrigger(args.snapshot_seconds)
    return (args.snapshot_interval, 'iteration')


def _progress_events(events, comm):
    """Records when this process enters the training loop, its first
    iteration, and (rank 0, not forced to disk) every iteration."""
    done = []

    def initialize(trainer):
        events.write('loop_entered', iteration=trainer.updater.iteration)

    @training.make_extension(trigger=(1, 'iteration'),
                             priority=training.PRIORITY_READER,
                             initializer=initialize)
    def progress(trainer):
        if not done:
            done.append(True)
            events.write('first_iteration',
                         iteration=trainer.updater.iteration)
        elif comm.rank == 0:
            events.write('iteration', iteration=trainer.updater.iteration,
                         sync=False)
    return progress


def _parameters_digest(model):
    """SHA-1 of the model's parameters (equal on all ranks when in sync)."""
    import hashlib
    digest = hashlib.sha1()
    for name, param in sorted(model.namedparams()):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(param.array).tobytes())
    return digest.hexdigest()


def _validation_event(events, comm):
    """Records validation results with the wall-clock time (on whichever
    process is rank 0 now, so the record survives the loss of rank 0)."""
    @training.make_extension(priority=training.PRIORITY_READER)
    def validation(trainer):
        observation = trainer.observation
        if comm.rank == 0 and 'validation/main/accuracy' in observation:
            events.write(
                'validation', iteration=trainer.updater.iteration,
                epoch=trainer.updater.epoch_detail,
                loss=float(observation['validation/main/loss']),
                accuracy=float(observation['validation/main/accuracy']))
    return validation


if __name__ == '__main__':
    sys.exit(main())
