#!/usr/bin/env python
"""Elastic training experiments (the source's Figs. 5-7 at our scale).

Runs the ImageNet example (``--arch tiny``, 32x32 crops, a generated
dataset) as an elastic job of separately started member processes against
a private etcd, and measures:

* ``fixed1``, ``fixed2``, ``fixed4``: epoch vs wall time at a fixed size;
* ``grow``: 2 members, 2 more started when epoch ``--event-epoch`` is done;
* ``shrink``: 4 members, 2 of them SIGKILLed at that point;
* ``grow-plain``, ``shrink-plain``: the same with the plain contiguous
  re-split (``--elastic-plain-split``), to compare shared-storage reads.

Each member has its own local directory (as if on its own node), so what a
re-split moves must come from shared storage again.  For each run it
writes the events of every member, and a summary: the slope (epochs per
second) before and after the change against the fixed-size runs, the time
from the event to every member training again (with its parts), the final
validation accuracy, and the shared-storage reads (files copied plus
examples read directly) of each member after the re-split.

Usage::

    python -m chainer_prefetch_bench.elastic.run --out results/elastic
    python -m chainer_prefetch_bench.elastic.plot results/elastic
"""
import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy

from chainer_prefetch.elastic import EtcdServer
from chainer_prefetch_bench.testbed import jpeg_dataset, mpi_launch

REPO = mpi_launch.REPO
EXAMPLE = mpi_launch.TRAIN_SCRIPT
RUNS = ('fixed1', 'fixed2', 'fixed4', 'grow', 'shrink', 'grow-plain',
        'shrink-plain')


def read_events(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Run:
    """One elastic job: its members, events and outcome."""

    def __init__(self, name, repeat, args, data, work):
        self.name = name
        self.repeat = repeat
        self.args = args
        self.data = data
        self.work = os.path.join(work, '{}.{}'.format(name, repeat))
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        self.events_path = os.path.join(self.work, 'events.jsonl')
        self.members = []
        self.commands = []

    def start_member(self, url):
        index = len(self.members)
        command = [
            sys.executable, EXAMPLE, os.path.join(self.data, 'train.txt'),
            os.path.join(self.data, 'val.txt'), '--root', self.data,
            '--arch', 'tiny', '--crop-size', '32',
            '--batchsize', str(self.args.batchsize), '--val_batchsize', '32',
            '--epoch', str(self.args.epochs), '--loaderjob', '1',
            '--copy-threads', '2', '--start-method', 'fork',
            '--local-dir', os.path.join(self.work, 'local{}'.format(index)),
            '--out', os.path.join(self.work, 'out'), '--elastic', url,
            '--scale-policy', 'minmax:1', '--elastic-ttl', str(self.args.ttl),
            '--elastic-settle', str(self.args.settle),
            '--elastic-events', self.events_path]
        if self.name.endswith('-plain'):
            command.append('--elastic-plain-split')
        self.commands.append(command)
        self.members.append(subprocess.Popen(
            command, stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.work, 'stderr{}.txt'.format(index)),
                        'w'), start_new_session=True))

    def epochs_done(self):
        return max([e['epoch'] for e in read_events(self.events_path)
                    if e['event'] == 'epoch'] or [0])

    def execute(self):
        """Runs the job; every member is killed if it is still there when
        this returns or raises (Ctrl-C included)."""
        try:
            return self._execute()
        finally:
            self._kill_members()

    def _kill_members(self):
        for member in self.members:
            if member.poll() is None:
                os.killpg(member.pid, signal.SIGKILL)
                member.wait()

    def _execute(self):
        kind = self.name.split('-')[0]
        event = None
        with EtcdServer() as server:
            url = server.url(self.name)
            start_size = {'fixed1': 1, 'fixed2': 2, 'fixed4': 4, 'grow': 2,
                          'shrink': 4}[kind]
            for _ in range(start_size):
                self.start_member(url)
            deadline = time.monotonic() + self.args.timeout
            if kind in ('grow', 'shrink'):
                while self.epochs_done() < self.args.event_epoch:
                    self._check(deadline)
                    time.sleep(0.1)
                event = time.time()
                if kind == 'grow':
                    self.start_member(url)
                    self.start_member(url)
                else:
                    for member in self.members[2:]:
                        member.send_signal(signal.SIGKILL)
            codes = []
            for member in self.members:
                codes.append(member.wait(max(1, deadline - time.monotonic())))
            left = server.keys()
        summary = summarize(self.name, read_events(self.events_path), event,
                            codes, left, self.commands[0])
        summary['repeat'] = self.repeat
        return summary

    def _check(self, deadline):
        if time.monotonic() > deadline or all(
                m.poll() is not None for m in self.members):
            raise RuntimeError('run {} ended before its event; see {}'.format(
                self.name, self.work))


def slope(points):
    """Epochs per second of ``[(seconds, epoch)]`` (least squares)."""
    if len(points) < 2:
        return None
    t, e = numpy.array(points, dtype=float).T
    return float(numpy.polyfit(t, e, 1)[0])


def summarize(name, events, event_time, codes, keys_left, command):
    t0 = min(e['time'] for e in events if e['event'] == 'start')
    curve = [(e['time'] - t0, e['epoch'], e['size'], e['accuracy'])
             for e in events if e['event'] == 'epoch']
    finished = [e for e in events if e['event'] == 'finished']
    summary = dict(
        name=name, exit_codes=codes, keys_left=keys_left, command=command,
        curve=curve, wall=max(e['time'] for e in events) - t0,
        final_accuracy=curve[-1][3] if curve else None,
        final_size=finished[0]['size'] if finished else None,
        identical_parameters=len({e['params_sha1'] for e in finished}) == 1,
        slope=slope([(t, e) for t, e, _, _ in curve]))
    if event_time is None:
        return summary
    new_size = finished[0]['size']
    back = [e for e in events if e['event'] == 'resumed'
            and e['size'] == new_size and e['time'] >= event_time]
    generation = min(e['generation'] for e in back)
    back = [e for e in back if e['generation'] == generation]
    back_time = max(e['time'] for e in back)
    storage = {}
    for e in events:
        if e['event'] == 'finished' and e.get('storage'):
            storage[e['rank']] = e['storage']
    reads = {pid: s['files_copied'] + s['examples_from_source']
             for pid, s in storage.items()}
    summary.update(
        event=event_time - t0, back=back_time - t0,
        recovery=back_time - event_time,
        rendezvous=max(e['rendezvous_seconds'] for e in back),
        state=max(e['state_seconds'] for e in back),
        generation=generation,
        slope_before=slope([(t, e) for t, e, _, _ in curve
                            if t <= event_time - t0]),
        slope_after=slope([(t, e) for t, e, _, _ in curve
                           if t >= back_time - t0]),
        shard=back[0]['shard'],
        kept_local=sum(e['kept_local'] for e in back),
        plain_kept_local=sum(e['plain_kept_local'] for e in back),
        reads_after=sum(reads.values()),
        reads_after_by_member=sorted(reads.values()))
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', default='results/elastic')
    parser.add_argument('--runs', default=','.join(RUNS))
    parser.add_argument('--images', type=int, default=480)
    parser.add_argument('--classes', type=int, default=4)
    parser.add_argument('--epochs', type=int, default=12)
    parser.add_argument('--event-epoch', type=float, default=4)
    parser.add_argument('--batchsize', type=int, default=8)
    parser.add_argument('--ttl', type=int, default=3)
    parser.add_argument('--settle', type=float, default=1.0)
    parser.add_argument('--repeats', type=int, default=2)
    parser.add_argument('--timeout', type=float, default=600)
    parser.add_argument('--work', default=None,
                       help='scratch directory (default: a temporary one)')
    args = parser.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix='chainer_prefetch_elastic_')
    data = os.path.join(work, 'data')
    if not os.path.exists(os.path.join(data, 'val.txt')):
        jpeg_dataset.generate(data, args.images, args.classes, 0,
                              val_images=args.images // 4, mean_size=20000,
                              workers=2, progress=False)
    os.makedirs(os.path.join(args.out, 'events'), exist_ok=True)
    results = dict(command=' '.join(sys.argv), settings=vars(args),
                   machine=dict(cpus=os.cpu_count(), python=platform.python_version()),
                   runs=[])
    for repeat in range(args.repeats):
        for name in args.runs.split(','):
            started = time.monotonic()
            run = Run(name, repeat, args, data, work)
            summary = run.execute()
            summary['seconds'] = time.monotonic() - started
            results['runs'].append(summary)
            print(json.dumps({k: v for k, v in summary.items()
                              if k not in ('curve', 'command')}), flush=True)
            with open(os.path.join(args.out, 'elastic.json'), 'w') as f:
                json.dump(results, f, indent=1)
            shutil.copy(run.events_path, os.path.join(
                args.out, 'events', '{}.{}.jsonl'.format(name, repeat)))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
    main()
