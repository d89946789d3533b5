#!/usr/bin/env python
"""Exactly-once report of the elastic and fault benchmarks.

Runs the unmodified ImageNet example (``--arch tiny --crop-size 32``, batch
8 per member, a generated dataset of ``--images`` training JPEGs) through
each membership change once, with ``--example-log`` (every example carries
its training-set index), and reports per case:

* how many examples were never used and how many twice or more, counted
  from the committed updates (``chainer_prefetch_bench.testbed.
  exactly_once``), in the epoch of the change and at most in any later
  epoch;
* the seconds from the event (the kill; an elastic joiner's registration
  in etcd; for ULFM and restarts the failure event, logged by the killed
  rank just before it dies) to the first update at the new size: the time
  of the last batch record of the first committed update after the
  resume point (every member of the new group had its batch then);
* for the elastic cases, every member's reads from shared storage from
  the change to its end, as counted by its ``PrefetchMultiprocessIterator``
  (``files_copied + examples_from_source`` of the shard iterator of each
  generation after the change), against ``needed``: the examples it
  trained after the change that its local directory held no copy of when
  it resumed (a copy's ``st_ctime``), the least it had to read.  The
  counters are per generation, not per epoch, so the reads of the next
  epoch alone cannot be told apart from those of the rest of the change's
  epoch and of the later epochs; ``needed_by_epoch`` in the report says
  in which epochs the examples not held were first trained.

The cases:

* ``elastic-join``: 2 members, a third joins at 0.50 of epoch 1 (the two
  wait after that update until the joiner is settled:
  ``--elastic-hold-at``);
* ``elastic-kill``: 3 members, one SIGKILLs itself at 0.35 of epoch 1
  (``--elastic-kill-at iteration:N``);
* ``ulfm-shrink-0.50``, ``ulfm-shrink-0.30``: ``mpirun --with-ft ulfm``,
  3 ranks, rank 1 killed at 0.50 / 0.30 of epoch 1, the job shrinks to 2;
* ``restart-3-3``, ``restart-3-2``: ``--fault-tolerance checkpoint``, a
  snapshot at 0.30 of epoch 1, rank 1 killed at 0.60; the job is started
  again at 3 or 2 ranks and resumes from the snapshot;
* ``elastic-join-kill``: 2 members, a third joins at 0.50 of epoch 0, then
  one of the first two SIGKILLs itself at 0.35 of epoch 1 (the locality
  split of the re-plan).

Every elastic member has its own ``--local-dir`` (as if on its own node)
and a private etcd; they start together (a scale policy of this module
holds the first group until all have registered).

Usage::

    python -m chainer_prefetch_bench.fault.exactly_once \\
        --out results/exactly_once [--cases elastic-join,ulfm-shrink-0.50]

Writes ``OUT/report.json``, ``OUT/table.txt`` and every case's logs under
``OUT/logs/CASE/``, and prints the table.
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
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

import numpy

from chainer_prefetch.resilience.injection import read_events
from chainer_prefetch_bench.testbed import exactly_once, jpeg_dataset, mpi_launch

MODULE = 'chainer_prefetch_bench.fault.exactly_once'
COMMAND = 'python -m ' + MODULE
POLICY_PREFIX = 'START_WITH_'
"""``START_WITH_N`` of this module: the elastic cases' scale policy."""


class Case(NamedTuple):
    """One membership change.

    Attributes:
        name: Identifier (``--cases``).
        kind: ``elastic``, ``ulfm`` or ``restart``.
        label: Its line in the table.
        sizes: Group sizes, e.g. ``(2, 3)`` or ``(2, 3, 2)``.
        at: Fraction of the change's epoch done at the change.
    """
    name: str
    kind: str
    label: str
    sizes: Sequence[int]
    at: float


CASES = (
    Case('elastic-join', 'elastic', 'elastic join', (2, 3), 0.5),
    Case('elastic-kill', 'elastic', 'elastic SIGKILL', (3, 2), 0.35),
    Case('ulfm-shrink-0.50', 'ulfm', 'ULFM shrink', (3, 2), 0.5),
    Case('ulfm-shrink-0.30', 'ulfm', 'ULFM shrink', (3, 2), 0.3),
    Case('restart-3-3', 'restart', 'restart from snapshot', (3, 3), 0.3),
    Case('restart-3-2', 'restart', 'restart from snapshot', (3, 2), 0.3),
    Case('elastic-join-kill', 'elastic', 'elastic join, then SIGKILL',
         (2, 3, 2), 0.35),
)


def __getattr__(name: str):
    """``START_WITH_N``: a scale policy that forms the first group only
    once N members are there, then runs with any number (so that the
    members of a case start together however slowly they start).  Built
    on first use: reading a report needs no torch."""
    if not name.startswith(POLICY_PREFIX):
        raise AttributeError(name)
    from chainer_prefetch.elastic.policy import ScalePolicy

    class StartWith(ScalePolicy):
        def ok2run(self, hosts, initial):
            needed = int(name[len(POLICY_PREFIX):]) if initial else 1
            return 'ok' if len(hosts) >= needed else 'wait'

        def describe(self):
            return name
    return StartWith()


# ---- the report of one case (pure) ---------------------------------------------

def updates_per_epoch(n_examples: int, size: int, batch: int) -> int:
    """Updates of an epoch without a change (equal shards of
    ``ceil(n / size)``).

    Args:
        n_examples: Examples in the training set.
        size: Members.
        batch: Examples per member and update.
    """
    return -(-(-(-n_examples // size)) // batch)


def resume_after(events: Sequence[Mapping], event_time: float,
                 size: Optional[int] = None) -> Optional[Mapping]:
    """The first resume (``resumed``, ``recovered``) after ``event_time``,
    of a group of ``size`` where the event says its size.

    Args:
        events: The job's events.
        event_time: Time of the change's event.
        size: The new size (None: any).
    """
    found = [e for e in events if e['event'] in exactly_once.RESUME_EVENTS
             and 'iteration' in e and e['time'] > event_time
             and (size is None or e.get('size', size) == size)]
    return min(found, key=lambda e: e['time']) if found else None


def new_size_seconds(batches: Sequence[Mapping], iteration: int,
                     event_time: float) -> Optional[float]:
    """Seconds from ``event_time`` to the last batch record of committed
    update ``iteration + 1`` (None: no such update)."""
    times = [b['time'] for b in batches
             if b['iteration'] == iteration + 1 and b['time'] > event_time]
    return max(times) - event_time if times else None


def change_epoch(batches: Sequence[Mapping], iteration: int,
                 n_examples: int):
    """``(epoch, fraction)``: the epoch training went on in after
    ``iteration`` committed updates, and the share of its examples the
    committed updates up to there had used."""
    last = [b for b in batches if b['iteration'] == iteration]
    if not last:
        return 0, 0.0
    epoch = int(last[0]['epoch'])
    uses = exactly_once.uses_per_epoch(
        [b for b in batches if b['iteration'] <= iteration], n_examples)
    return epoch, float((uses[epoch] > 0).sum()) / n_examples


def _reads(counters: Optional[Mapping]) -> Optional[int]:
    if counters is None:
        return None
    return int(counters['files_copied'] + counters['examples_from_source'])


def storage_after(events: Sequence[Mapping], generation: int
                  ) -> Dict[int, Optional[int]]:
    """Per member (process id) that finished: its shared-storage reads from
    the change (the forming of ``generation``) to its end, from the
    counters of one shard iterator per generation (the ``resumed`` events'
    ``previous_storage``, the ``finished`` event's ``storage``); None where
    the iterator counts none."""
    reads = {}
    for end in (e for e in events if e['event'] == 'finished'):
        member = end['rank']
        parts = [end.get('storage')] + [
            e['previous_storage'] for e in events
            if e['event'] == 'resumed' and e['rank'] == member
            and e['generation'] > generation]
        counted = [_reads(part) for part in parts]
        reads[member] = None if None in counted else sum(counted)
    return reads


def needed_after(batches: Sequence[Mapping], iteration: int,
                 held: Mapping[int, numpy.ndarray]
                 ) -> Dict[int, Dict[int, int]]:
    """Per member (process id) and epoch: the examples it trained after
    ``iteration`` that it held no local copy of at the change and had not
    trained since (the least it must read from shared storage).

    Args:
        batches: The committed batch records.
        iteration: Committed updates at the change.
        held: Per member, which examples it held local copies of at the
            change (one boolean per example).
    """
    needed = {}
    for member, holds in held.items():
        seen = numpy.array(holds, dtype=bool)
        after = exactly_once.uses_per_epoch(
            [b for b in batches
             if b['rank'] == member and b['iteration'] > iteration],
            len(seen))
        per_epoch = {}
        for epoch in sorted(after):
            used = after[epoch] > 0
            if used.any():
                per_epoch[epoch] = int((used & ~seen).sum())
            seen |= used
        needed[member] = per_epoch
    return needed


def resume_times(events: Sequence[Mapping], generation: int
                 ) -> Dict[int, float]:
    """When each member (process id) resumed in ``generation``.

    Args:
        events: The elastic job's events.
        generation: The generation formed at the change.
    """
    return {e['rank']: e['time'] for e in events
            if e['event'] == 'resumed' and e['generation'] == generation}


def summarize(rows: Sequence[Mapping], batches: Sequence[Mapping],
              events: Sequence[Mapping], event_time: float,
              new_size: Optional[int], n_examples: int,
              members: Sequence[int] = (),
              held: Optional[Mapping[int, numpy.ndarray]] = None) -> Dict:
    """The report of one case.

    Args:
        rows: :func:`chainer_prefetch_bench.testbed.exactly_once.report`'s
            rows (one per epoch).
        batches: The committed batch records (``committed_batches``).
        events: The job's events (resumes; elastic ``finished`` and
            ``resumed`` with storage counters).
        event_time: Time of the change's event.
        new_size: The group's size after it (None: any).
        n_examples: Examples in the training set.
        members: Process ids in start order (the order of the storage
            columns; others follow).
        held: For the elastic cases, per member, the examples it held
            local copies of when it resumed at the change
            (:func:`held_copies`): the shared-storage reads are reported,
            with what they had to be at least.

    Raises:
        ValueError: nothing resumed after the event.
    """
    resume = resume_after(events, event_time, new_size)
    if resume is None:
        raise ValueError('no resume at size {} after the event'.format(
            new_size))
    iteration = int(resume['iteration'])
    epoch, fraction = change_epoch(batches, iteration, n_examples)
    later = [row for row in rows if row['epoch'] > epoch]
    summary = dict(
        resume_iteration=iteration, change_epoch=epoch, at=fraction,
        never=rows[epoch]['never'], twice=rows[epoch]['twice'],
        later_never=max([r['never'] for r in later], default=None),
        later_twice=max([r['twice'] for r in later], default=None),
        later_epochs=[r['epoch'] for r in later],
        seconds=new_size_seconds(batches, iteration, event_time),
        epochs=list(rows))
    if held is not None:
        reads = storage_after(events, resume.get('generation', -1))
        needed = needed_after(batches, iteration, held)
        order = list(members) + sorted(set(reads) - set(members))
        summary['storage'] = [
            dict(member=member, reads=reads[member],
                 needed=sum(needed.get(member, {}).values()),
                 needed_by_epoch={str(k): v for k, v in
                                  needed.get(member, {}).items()},
                 held_at_change=int(numpy.sum(held.get(member, 0))))
            for member in order if member in reads]
    return summary


def _cell(value, form='{}'):
    return '-' if value is None else form.format(value)


TABLE_HEADER = (
    '{:<28} {:>7} {:>5}  {:>13}  {:>13}  {:>9}  {}\n'
    '{:<28} {:>7} {:>5}  {:>6} {:>6}  {:>6} {:>6}  {:>9}  {}').format(
        '', '', '', "change's epoch", 'later (max)', 'event ->',
        'shared-storage reads after the change',
        'case', 'sizes', 'at', 'never', 'twice', 'never', 'twice',
        'new size', 'per member: read/needed')


def table_line(case: Mapping) -> str:
    """One case of the table (see :data:`TABLE_HEADER`).

    Args:
        case: A case of ``report.json`` (``name``, ``label``, ``sizes``,
            and the :func:`summarize` fields or an ``error``).
    """
    sizes = '->'.join(str(s) for s in case['sizes'])
    if case.get('error'):
        return '{:<28} {:>7}  FAILED ({}): {}'.format(
            case['label'], sizes, case['name'], case['error'])
    storage = case.get('storage')
    reads = 'not counted' if storage is None else ', '.join(
        '{}/{}'.format(_cell(m['reads']), m['needed']) for m in storage)
    return '{:<28} {:>7} {:>5.2f}  {:>6} {:>6}  {:>6} {:>6}  {:>9}  {}'.format(
        case['label'], sizes, case['at'], case['never'], case['twice'],
        _cell(case['later_never']), _cell(case['later_twice']),
        _cell(case['seconds'], '{:.2f} s'), reads)


def format_table(report: Mapping) -> str:
    """The table of ``report.json`` (a title line, the header, one line per
    case).

    Args:
        report: ``{'settings': {...}, 'cases': [...]}``.
    """
    settings = report['settings']
    title = ('Exactly once through membership changes: {} training examples, '
             'batch {} per member, {} epochs, change in epoch 1').format(
                 settings['images'], settings['batchsize'], settings['epochs'])
    lines = [title, TABLE_HEADER] + [table_line(c) for c in report['cases']]
    return '\n'.join(lines) + '\n'


def held_copies(local_dir: str, sources: Sequence[str], before: float
                ) -> numpy.ndarray:
    """Which of ``sources`` had a local copy in ``local_dir`` made before
    ``before`` (a copy's ``st_ctime`` is when it was renamed into place).

    Args:
        local_dir: A member's ``--local-dir``.
        sources: The training examples' files, in dataset order.
        before: A time (``time.time()``).
    """
    from chainer_prefetch.staging.local_directory import LocalPathMap
    path_of = LocalPathMap(os.path.join(local_dir, 'data'))
    held = numpy.zeros(len(sources), dtype=bool)
    for index, source in enumerate(sources):
        try:
            held[index] = os.stat(path_of(source)).st_ctime < before
        except FileNotFoundError:
            pass
    return held


# ---- running the cases --------------------------------------------------------

class Runner:
    """Runs the cases (see the module docstring).

    Args:
        args: The parsed command line.
        data: The dataset folder.
        work: Scratch folder.
    """

    def __init__(self, args, data: str, work: str):
        self.args = args
        self.data = data
        self.work = work

    def example_arguments(self, folder: str) -> List[str]:
        """Arguments of the example shared by every case."""
        a = self.args
        return [os.path.join(self.data, 'train.txt'),
                os.path.join(self.data, 'val.txt'), '--root', self.data,
                '--arch', 'tiny', '--crop-size', '32',
                '--batchsize', str(a.batchsize), '--val_batchsize', '32',
                '--epoch', str(a.epochs), '--loaderjob', '1',
                '--start-method', 'fork', '--out', os.path.join(folder, 'out'),
                '--example-log', os.path.join(folder, 'examples.jsonl')]

    def updates(self, size: int) -> int:
        return updates_per_epoch(self.args.images, size, self.args.batchsize)

    def at(self, size: int, fraction: float) -> int:
        """Updates into an epoch of ``size`` members at ``fraction``."""
        return int(round(fraction * self.updates(size)))

    def run(self, case: Case) -> Dict:
        """Runs one case; returns its entry of ``report.json``."""
        folder = os.path.join(self.work, case.name)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        started = time.monotonic()
        entry = dict(name=case.name, label=case.label, sizes=case.sizes,
                     planned_at=case.at)
        try:
            if case.kind == 'elastic':
                event_time, events, members, extra = self.elastic(case, folder)
            else:
                event_time, events, members, extra = self.mpi(case, folder)
            entry.update(extra)
            log = os.path.join(folder, 'examples.jsonl')
            records = read_events(log)
            resumes = [e for e in events if e['event'] in
                       exactly_once.RESUME_EVENTS and 'iteration' in e]
            batches = exactly_once.committed_batches(records, resumes)
            rows = exactly_once.report(log, [self.events_path(case, folder)],
                                       self.args.images, self.args.epochs)
            held = None
            if case.kind == 'elastic':
                held = self.held(folder, events, event_time, case.sizes[-1],
                                 members)
            entry.update(summarize(
                rows, batches, events, event_time, case.sizes[-1],
                self.args.images, members, held))
        except Exception as error:  # reported in the table, others go on
            entry['error'] = '{}: {}'.format(type(error).__name__, error)
        entry['seconds_total'] = time.monotonic() - started
        return entry

    def held(self, folder: str, events: Sequence[Mapping],
             event_time: float, new_size: int, members: Sequence[int]
             ) -> Dict[int, numpy.ndarray]:
        """Per member of the new group, the training examples its local
        directory (``local<start index>``) held when it resumed at the
        change."""
        resume = resume_after(events, event_time, new_size)
        if resume is None:
            return {}
        with open(os.path.join(self.data, 'train.txt')) as f:
            sources = [os.path.join(self.data, line.split()[0])
                       for line in f if line.strip()]
        when = resume_times(events, resume['generation'])
        return {pid: held_copies(os.path.join(folder, 'local{}'.format(i)),
                                 sources, when[pid])
                for i, pid in enumerate(members) if pid in when}

    def events_path(self, case: Case, folder: str) -> str:
        name = 'events.jsonl' if case.kind == 'elastic' else os.path.join(
            'out', 'ft_events.jsonl')
        return os.path.join(folder, name)

    # ---- elastic --------------------------------------------------------

    def elastic(self, case: Case, folder: str):
        """Runs an elastic case; returns ``(event time, events, member
        pids, extra fields)``."""
        from chainer_prefetch.elastic import EtcdServer
        first, second = case.sizes[0], case.sizes[1]
        options = [[] for _ in range(first)]
        hold = None
        if case.name == 'elastic-join':
            hold = self.updates(first) + self.at(first, 0.5)
        elif case.name == 'elastic-kill':
            options[1] = ['--elastic-kill-at', 'iteration:{}'.format(
                self.updates(first) + self.at(first, case.at))]
        elif case.name == 'elastic-join-kill':
            hold = self.at(first, 0.5)
            rest = -(-(self.args.images - hold * first * self.args.batchsize)
                     // second)
            end_of_epoch = hold + -(-rest // self.args.batchsize)
            options[0] = ['--elastic-kill-at', 'iteration:{}'.format(
                end_of_epoch + self.at(second, case.at))]
        if hold is not None:
            options = [o + ['--elastic-hold-at', str(hold)] for o in options]
        events_path = self.events_path(case, folder)
        log = os.path.join(folder, 'examples.jsonl')
        members: List[subprocess.Popen] = []
        commands = []
        with EtcdServer() as server:
            url = server.url(case.name)

            def start(extra):
                index = len(members)
                command = [sys.executable, mpi_launch.TRAIN_SCRIPT] + \
                    self.example_arguments(folder) + [
                        '--iterator', 'prefetch', '--copy-threads', '2',
                        '--local-dir', os.path.join(folder, 'local{}'.format(
                            index)),
                        '--elastic', url, '--scale-policy',
                        '{}:{}{}'.format(MODULE, POLICY_PREFIX, first),
                        '--elastic-ttl', str(self.args.ttl),
                        '--elastic-settle', str(self.args.settle),
                        '--elastic-events', events_path] + extra
                commands.append(command)
                members.append(subprocess.Popen(
                    command, stdout=subprocess.DEVNULL,
                    stderr=open(os.path.join(folder, 'stderr{}.txt'.format(
                        index)), 'w'),
                    start_new_session=True, env=mpi_launch.environment()))

            deadline = time.monotonic() + self.args.timeout
            try:
                for extra in options:
                    start(extra)
                if hold is not None:
                    while max((r['iteration'] for r in read_events(log)
                               if r['event'] == 'batch'), default=0) < hold:
                        if time.monotonic() > deadline or any(
                                m.poll() is not None for m in members):
                            raise RuntimeError('ended before update {}'
                                               .format(hold))
                        time.sleep(0.1)
                    start([])
                codes = [m.wait(max(1, deadline - time.monotonic()))
                         for m in members]
            finally:
                for member in members:
                    if member.poll() is None:
                        os.killpg(member.pid, signal.SIGKILL)
                        member.wait()
            keys_left = server.keys()
        events = read_events(events_path)
        pids = [m.pid for m in members]
        if hold is not None:
            joiner = pids[first]
            event_time = next(e['time'] for e in events
                              if e['event'] == 'registered'
                              and e['rank'] == joiner)
        if 'kill' in case.name:
            event_time = next(e['time'] for e in events
                              if e['event'] == 'killed')
        expected = sorted([-signal.SIGKILL] * ('kill' in case.name) + [0] * (
            len(members) - ('kill' in case.name)))
        if sorted(codes) != expected:
            raise RuntimeError('exit codes {} (see {})'.format(codes, folder))
        return event_time, events, pids, dict(
            commands=[' '.join(c) for c in commands], exit_codes=codes,
            etcd_keys_left=len(keys_left))

    # ---- mpirun ---------------------------------------------------------

    def mpi(self, case: Case, folder: str):
        """Runs a ULFM or restart case; returns ``(event time, events,
        (), extra fields)``."""
        first, second = case.sizes
        common = self.example_arguments(folder) + [
            '--iterator', 'multiprocess', '--stop-timeout', '2',
            '--call-timeout', '20']
        if case.kind == 'ulfm':
            kill = self.updates(first) + self.at(first, case.at)
            launches = [(first, True, common + [
                '--fault-tolerance', 'shrink'] + self.failure(kill), 0)]
        else:
            snapshot = self.updates(first) + self.at(first, case.at)
            kill = self.updates(first) + self.at(first, 2 * case.at)
            checkpoint = common + ['--fault-tolerance', 'checkpoint',
                                   '--snapshot-interval', str(snapshot)]
            launches = [(first, False, checkpoint + self.failure(kill), None),
                        (second, False, checkpoint, 0)]
        runs = []
        for size, ulfm, arguments, wanted in launches:
            command = mpi_launch.train_command(size, arguments)
            if ulfm:
                command[1:1] = ['--with-ft', 'ulfm']
            code, output, timed_out = mpi_launch.run(
                command, self.args.timeout, cwd=folder)
            with open(os.path.join(folder, 'output{}.txt'.format(
                    len(runs))), 'w') as f:
                f.write(output)
            runs.append(dict(command=' '.join(command), returncode=code,
                             timed_out=timed_out))
            if timed_out or (wanted is not None and code != wanted) or (
                    wanted is None and code == 0):
                raise RuntimeError('launch {} ended with {}{}: {}'.format(
                    len(runs), code, ' (timed out)' if timed_out else '',
                    output.strip().splitlines()[-1:]))
        events = read_events(self.events_path(case, folder))
        event_time = next(e['time'] for e in events if e['event'] == 'failure')
        return event_time, events, (), dict(launches=runs)

    @staticmethod
    def failure(iteration: int) -> List[str]:
        return ['--inject-failure', 'kill', '--inject-rank', '1',
                '--inject-iteration', str(iteration)]


def source_state() -> Dict:
    """The checkout measured: its commit and the files that differ from
    it (read with git; nothing is changed)."""
    def git(*arguments):
        return subprocess.run(['git'] + list(arguments), cwd=mpi_launch.REPO,
                              capture_output=True, text=True).stdout
    try:
        return dict(commit=git('rev-parse', 'HEAD').strip(),
                    changed=git('status', '--porcelain').splitlines())
    except OSError as error:
        return dict(error=str(error))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', default='results/exactly_once')
    parser.add_argument('--cases', default=','.join(c.name for c in CASES))
    parser.add_argument('--images', type=int, default=480)
    parser.add_argument('--classes', type=int, default=4)
    parser.add_argument('--epochs', type=int, default=4)
    parser.add_argument('--batchsize', type=int, default=8)
    parser.add_argument('--ttl', type=int, default=3)
    parser.add_argument('--settle', type=float, default=1.0)
    parser.add_argument('--timeout', type=float, default=300,
                        help='seconds per launch')
    parser.add_argument('--work', default=None,
                        help='scratch directory (default: a temporary one)')
    args = parser.parse_args(argv)
    chosen = args.cases.split(',')
    unknown = set(chosen) - {c.name for c in CASES}
    if unknown:
        parser.error('unknown cases: {}'.format(', '.join(sorted(unknown))))
    work = args.work or tempfile.mkdtemp(prefix='chainer_prefetch_once_')
    data = os.path.join(work, 'data')
    if not os.path.exists(os.path.join(data, 'val.txt')):
        jpeg_dataset.generate(data, args.images, args.classes, 0,
                              val_images=args.images // 5, mean_size=20000,
                              workers=2, progress=False)
    os.makedirs(args.out, exist_ok=True)
    report = dict(command=' '.join([COMMAND] + (
                      sys.argv[1:] if argv is None else list(argv))),
                  settings=vars(args),
                  machine=dict(cpus=os.cpu_count(),
                               python=platform.python_version()),
                  cases=[])
    report['source'] = source_state()
    runner = Runner(args, data, work)
    for case in CASES:
        if case.name not in chosen:
            continue
        entry = runner.run(case)
        report['cases'].append(entry)
        print(table_line(entry), flush=True)
        logs = os.path.join(args.out, 'logs', case.name)
        shutil.rmtree(logs, ignore_errors=True)
        os.makedirs(logs)
        folder = os.path.join(work, case.name)
        for name in sorted(os.listdir(folder)):
            if name.endswith(('.jsonl', '.txt')):
                shutil.copy(os.path.join(folder, name), logs)
        events = runner.events_path(case, folder)
        if case.kind != 'elastic' and os.path.exists(events):
            shutil.copy(events, logs)
        with open(os.path.join(args.out, 'report.json'), 'w') as f:
            json.dump(report, f, indent=1)
    text = format_table(report)
    with open(os.path.join(args.out, 'table.txt'), 'w') as f:
        f.write(text)
    print(text)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
    main()
