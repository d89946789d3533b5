"""``train_imagenet.py --elastic``: training whose members come and go.

Every process is started on its own (by hand, ``srun``, ``qsub``, or
``mpirun`` used only as a launcher) with the same ``--elastic
etcd://HOST:PORT/JOB`` address; a process started later with the same
arguments joins the running job, and a lost one is left behind, as the
``--scale-policy`` decides (``minmax:MIN[:MAX]``, ``failstop:N`` or
``package.module:Policy``).  See ``docs/elastic.rst``.

Every process reads the list files itself (the dataset is on shared
storage); the model, the optimizer state, the iteration and the learning
rate come from the member furthest ahead at every rebuild.  Events (start,
rebuilds, epochs, validation, end with a SHA-1 of the parameters) are
appended to ``--elastic-events`` (default ``OUT/elastic_events.jsonl``).
"""
import os
import signal
import socket
import sys
import time

import chainer
import chainermn
import numpy as np
from chainer import training
from chainer.training import extensions


def add_elastic_arguments(parser):
    """Options of ``--elastic``."""
    group = parser.add_argument_group('elastic training (docs/elastic.rst)')
    group.add_argument('--elastic', default=None, metavar='URL',
                       help='etcd://HOST:PORT[,HOST:PORT]/JOB: join (or '
                            'start) the elastic job JOB')
    group.add_argument('--scale-policy', default='minmax:1',
                       help='minmax:MIN[:MAX], failstop:N or '
                            'package.module:Policy')
    group.add_argument('--elastic-ttl', type=int, default=3,
                       help='seconds a lost member keeps its key')
    group.add_argument('--elastic-settle', type=float, default=1.0,
                       help='seconds the membership must be still before a '
                            'rebuild (a burst of joins = one rebuild)')
    group.add_argument('--elastic-loss-grace', type=float, default=0.5,
                       help='seconds the members of a group whose '
                            'collective failed have to come to the rebuild; '
                            'the others are left out at once (a live one '
                            'slower than this joins again afterwards)')
    group.add_argument('--elastic-timeout', type=float, default=60.0,
                       help='bound on a collective without progress and on '
                            'forming a group')
    group.add_argument('--elastic-wait-timeout', type=float, default=600.0,
                       help='bound on a wait ordered by the policy')
    group.add_argument('--elastic-plain-split', action='store_true',
                       help='re-split contiguously, ignoring local copies '
                            '(for comparison)')
    group.add_argument('--elastic-events', default=None,
                       help='event log (default OUT/elastic_events.jsonl)')
    group.add_argument('--elastic-kill-at', default=None,
                       metavar='EVENT:GENERATION',
                       help='SIGKILL this process right after EVENT of '
                            'GENERATION (tests: decided:1 kills the leader '
                            'mid-rebuild), or iteration:N: right after it '
                            'committed update N (benchmarks: a loss at a '
                            'known point of an epoch; a "killed" event is '
                            'logged first)')
    group.add_argument('--elastic-hold-at', type=int, default=None,
                       metavar='N',
                       help='after update N, wait (at most '
                            '--elastic-wait-timeout) until a membership '
                            'change is pending (benchmarks: a member started '
                            'meanwhile joins exactly at update N)')


def train_elastic(args, example):
    """Trains as a member of the elastic job ``args.elastic``.

    Args:
        args: The example's parsed arguments.
        example: The ``train_imagenet`` module (its dataset class,
            architectures, optimizer and iterator factories, digest).

    Returns:
        The process's exit status (0: the job finished; 3: it failed, with
        the reason on stderr).
    """
    from chainer_prefetch import elastic
    from chainer_prefetch.elastic.policy import parse_policy
    from chainer_prefetch.elastic.training import storage_reads
    from chainer_prefetch.resilience.injection import EventLog
    if args.gpu or args.communicator != 'naive':
        sys.exit('--elastic runs on the CPU (gloo); drop --gpu / '
                 '--communicator')
    try:  # bad input: a message, not a traceback
        elastic.parse_etcd_url(args.elastic)
        policy = parse_policy(args.scale_policy)
        settings = elastic.ElasticSettings(
            ttl=args.elastic_ttl, settle=args.elastic_settle,
            loss_grace=args.elastic_loss_grace,
            collective_timeout=args.elastic_timeout,
            rendezvous_timeout=args.elastic_timeout,
            wait_timeout=args.elastic_wait_timeout).validated()
    except ValueError as error:
        sys.exit('train_imagenet.py: {}'.format(error))
    events = EventLog(args.elastic_events or os.path.join(
        args.out, 'elastic_events.jsonl'), os.getpid())

    def on_event(name, **fields):
        events.write(name, **fields)
        if args.elastic_kill_at == '{}:{}'.format(
                name, fields.get('generation')):
            os.kill(os.getpid(), signal.SIGKILL)

    mean = np.load(args.mean) if args.mean else None
    train = example.PreprocessedDataset(args.train, args.root, mean,
                                        args.crop_size)
    val = example.PreprocessedDataset(args.val, args.root, mean,
                                      args.crop_size, random=False)
    n_class = args.n_class or 1 + max(
        int(label) for _, label in train.base._pairs)
    signature = dict(arch=args.arch, n_class=n_class,
                     crop_size=args.crop_size, batchsize=args.batchsize,
                     train=len(train), val=len(val), epochs=args.epoch,
                     lr=args.lr, seed=args.seed)
    events.write('start', local_dir=args.local_dir)
    try:
        comm = elastic.ElasticCommunicator(
            args.elastic, policy, settings, signature, on_event)
        model = chainer.links.Classifier(
            example.ARCHS[args.arch](n_class=n_class))
        optimizer = example.make_optimizer(args, model, comm)
        train_iterator, val_iterator = example.shard_iterator_factories(args)
        train, converter = example.with_example_log(args, train,
                                                    lambda: updater)
        # Placeholders: ElasticTraining builds the real iterators over this
        # member's shard when the group is formed.
        updater = training.updaters.StandardUpdater(
            chainer.iterators.SerialIterator(train, args.batchsize), optimizer,
            converter=converter)
        trainer = training.Trainer(updater, (args.epoch, 'epoch'), args.out)
        evaluator = chainermn.create_multi_node_evaluator(
            extensions.Evaluator(chainer.iterators.SerialIterator(
                val, args.val_batchsize, repeat=False), model), comm)
        interval = (10, 'iteration') if args.test else (1, 'epoch')
        trainer.extend(evaluator, trigger=interval)
        trainer.extend(_epoch_event(events, comm), trigger=interval)
        trainer.extend(_scripted_change(args, comm, events))
        locality = '{}:{}'.format(socket.gethostname(),
                                  os.path.abspath(args.local_dir or '-'))
        run = elastic.ElasticTraining(
            comm, model, optimizer, updater, train, train_iterator, val,
            val_iterator, evaluator, trainer, seed=args.seed,
            lr_rule=args.lr_rule, locality=locality, epochs=args.epoch,
            keep_local=not args.elastic_plain_split, on_event=on_event)
        trainer.run()
        if args.example_log:
            converter.log.write('finished', iteration=updater.iteration)
        events.write('finished', iteration=updater.iteration, size=comm.size,
                     params_sha1=example._parameters_digest(model),
                     storage=storage_reads(updater.get_iterator('main')))
        run.finish()
        return 0
    except elastic.JobFinished as end:
        events.write('job_finished', message=str(end))
        print(end, flush=True)
        return 0
    except elastic.ElasticError as error:
        events.write('error', type=type(error).__name__, message=str(error))
        sys.stderr.write('{}: {}\n'.format(type(error).__name__, error))
        return 3


def _epoch_event(events, comm):
    """Records, on the current rank 0, each validation with the epoch and
    the wall-clock time (the epoch-vs-time curves of the experiments)."""
    @training.make_extension(priority=training.PRIORITY_READER)
    def epoch_event(trainer):
        if comm.rank != 0:
            return
        observation = trainer.observation
        events.write('epoch', iteration=trainer.updater.iteration,
                     epoch=trainer.updater.epoch_detail, size=comm.size,
                     accuracy=_number(observation.get(
                         'validation/main/accuracy')),
                     loss=_number(observation.get('main/loss')))
    return epoch_event


def _scripted_change(args, comm, events):
    """``--elastic-kill-at iteration:N`` and ``--elastic-hold-at N``: a
    loss or a join at a known update."""
    kind, _, value = (args.elastic_kill_at or '').partition(':')
    kill = int(value) if kind == 'iteration' else None

    @training.make_extension(trigger=(1, 'iteration'))
    def scripted_change(trainer):
        iteration = trainer.updater.iteration
        if iteration == kill:
            events.write('killed', iteration=iteration)
            os.kill(os.getpid(), signal.SIGKILL)
        if iteration == args.elastic_hold_at:
            deadline = time.monotonic() + args.elastic_wait_timeout
            while (comm.membership_changed() is None
                   and time.monotonic() < deadline):
                time.sleep(0.05)
    return scripted_change


def _number(value):
    return None if value is None else float(chainer.as_array(value))
