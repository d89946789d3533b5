"""One member of an elastic test job (started by tests/test_elastic_jobs.py).

A small classifier on a generated dataset, trained with
``chainer_prefetch.elastic``; events (rebuilds, the end with a SHA-1 of the
parameters, errors) go to ``--events`` as JSON lines.  ``--kill-at
EVENT:GENERATION`` makes the process SIGKILL itself right after the
communicator reports EVENT for GENERATION (e.g. ``decided:1``: the leader
dies mid-rebuild), ``--kill-at EVENT:size=N`` right after it reports EVENT
for a group of N members (the generation a size is reached at depends on
whether the first members started within one settle window).
``--kill-after-iteration N`` makes it SIGKILL itself right after it
committed update N, or the first update after the job has had
``--hold-until-size`` members if that comes later.  ``--example-log
PATH`` logs the indices of every batch
(``chainer_prefetch_bench.testbed.exactly_once``).
``--hold-until-size N`` slows training (0.5 s per iteration, for at most
60 s) until the job has had N members, so that a member started later
joins before the job ends however slowly it starts.
"""
import argparse
import hashlib
import os
import signal
import sys
import time

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy
from chainer import training
from chainer.training import extensions

from chainer_prefetch import elastic
from chainer_prefetch.elastic.policy import parse_policy
from chainer_prefetch.resilience.injection import EventLog
from chainer_prefetch_bench.testbed.exactly_once import IndexedDataset, logging_converter


class MLP(chainer.Chain):
    def __init__(self, width):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(8, width)
            self.l2 = L.Linear(width, 2)

    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))


def make_dataset(n, seed):
    rng = numpy.random.RandomState(seed)
    labels = rng.randint(0, 2, n).astype(numpy.int32)
    x = (rng.normal(0, 1, (n, 8)) + labels[:, None]).astype(numpy.float32)
    return chainer.datasets.TupleDataset(x, labels)


def digest(model):
    sha = hashlib.sha1()
    for name, param in sorted(model.namedparams()):
        sha.update(name.encode())
        sha.update(numpy.ascontiguousarray(param.array).tobytes())
    return sha.hexdigest()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('url')
    parser.add_argument('--policy', default='minmax:1')
    parser.add_argument('--epochs', type=float, default=3)
    parser.add_argument('--examples', type=int, default=240)
    parser.add_argument('--width', type=int, default=16)
    parser.add_argument('--batchsize', type=int, default=8)
    parser.add_argument('--events', required=True)
    parser.add_argument('--ttl', type=int, default=2)
    parser.add_argument('--settle', type=float, default=1.0)
    parser.add_argument('--collective-timeout', type=float, default=20)
    parser.add_argument('--wait-timeout', type=float, default=60)
    parser.add_argument('--etcd-timeout', type=float, default=5)
    parser.add_argument('--iteration-sleep', type=float, default=0.0)
    parser.add_argument('--kill-at', default=None)
    parser.add_argument('--hold-until-size', type=int, default=0)
    parser.add_argument('--kill-after-iteration', type=int, default=0)
    parser.add_argument('--example-log', default=None)
    args = parser.parse_args()
    events = EventLog(args.events, os.getpid())

    def on_event(name, **fields):
        events.write(name, **fields)
        if args.kill_at in ('{}:{}'.format(name, fields.get('generation')),
                            '{}:size={}'.format(name, fields.get('size'))):
            os.kill(os.getpid(), signal.SIGKILL)

    settings = elastic.ElasticSettings(
        ttl=args.ttl, settle=args.settle,
        collective_timeout=args.collective_timeout,
        rendezvous_timeout=args.collective_timeout,
        wait_timeout=args.wait_timeout, etcd_timeout=args.etcd_timeout)
    signature = dict(model='mlp', width=args.width, examples=args.examples,
                     batchsize=args.batchsize)
    try:
        comm = elastic.ElasticCommunicator(
            args.url, parse_policy(args.policy), settings, signature,
            on_event)
        train = make_dataset(args.examples, 0)
        converter = chainer.dataset.concat_examples
        if args.example_log:
            train = IndexedDataset(train)
            converter = logging_converter(args.example_log, lambda: updater)
        val = make_dataset(64, 1)
        model = L.Classifier(MLP(args.width))
        optimizer = chainermn.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(lr=0.05), comm)
        optimizer.setup(model)

        def train_iterator(shard, order_sampler=None):
            return chainer.iterators.SerialIterator(
                shard, args.batchsize, order_sampler=order_sampler)

        def val_iterator(shard):
            return chainer.iterators.SerialIterator(
                shard, args.batchsize, repeat=False, shuffle=False)

        updater = training.updaters.StandardUpdater(
            train_iterator(train), optimizer, converter=converter)
        trainer = training.Trainer(updater, (args.epochs, 'epoch'),
                                   out=os.path.dirname(args.events))
        evaluator = chainermn.create_multi_node_evaluator(
            extensions.Evaluator(val_iterator(val), model), comm)
        trainer.extend(evaluator, trigger=(1, 'epoch'))
        held = {'reached': False, 'until': time.monotonic() + 60}

        def size_reached():
            held['reached'] = held['reached'] or (
                comm.size >= args.hold_until_size)
            return held['reached']

        def pace(_):
            holding = not size_reached() and time.monotonic() < held['until']
            time.sleep(0.5 if holding else args.iteration_sleep)

        if args.kill_after_iteration:
            def die(trainer):
                if (updater.iteration >= args.kill_after_iteration
                        and size_reached()):
                    os.kill(os.getpid(), signal.SIGKILL)
            trainer.extend(die, trigger=(1, 'iteration'), name='die')
        if args.iteration_sleep or args.hold_until_size:
            trainer.extend(pace, trigger=(1, 'iteration'), name='sleep')
        elastic_training = elastic.ElasticTraining(
            comm, model, optimizer, updater, train, train_iterator, val,
            val_iterator, evaluator, trainer, epochs=args.epochs)
        trainer.run()
        if args.example_log:
            converter.log.write('finished', iteration=updater.iteration)
        events.write('finished', iteration=updater.iteration,
                     size=comm.size, generation=comm.generation,
                     params_sha1=digest(model),
                     rebuilds=len(elastic_training.history) - 1)
        elastic_training.finish()
    except elastic.JobFinished as end:
        events.write('job_finished', message=str(end))
        return 0
    except elastic.ElasticError as error:
        events.write('error', type=type(error).__name__, message=str(error))
        sys.stderr.write('{}: {}\n'.format(type(error).__name__, error))
        return 3
    return 0


if __name__ == '__main__':
    sys.exit(main())
