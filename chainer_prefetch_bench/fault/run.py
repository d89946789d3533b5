#!/usr/bin/env python
"""Fault-tolerance experiments: recovery time, checkpoint cost, learning
curves with a failure (the paper's Figs. 5-8 and Tables 2-3, at our scale).

Every job is ``examples/imagenet/train_imagenet.py --fault-tolerance ...``
started through the project's job script ``scripts/jobs/local.sh`` (so a
relaunch pays what a user's relaunch pays: bash, ``mpiexec``, Python,
imports, MPI, the example lists, the snapshot), with ``--with-ft ulfm`` for
respawn and shrink, and under the relaunching launcher for
checkpoint/restart.  The network is ``--arch tiny`` on 32x32 crops of the
generated grating task (``fault.gratings``), which it keeps learning for
minutes.  Times come from the jobs' event logs (wall-clock time of every
process, the launcher's included).

Strategies: ``respawn-spares`` (``--spares 1``: a parked spare takes the
failed rank), ``respawn`` (the replacement is started at the failure),
``shrink`` and ``checkpoint`` (snapshots every ``--checkpoint-seconds`` of
training, relaunch through the job script).

* ``recovery``: rank 1 is killed (``SIGKILL``) after ``--fail-at`` seconds
  of training (the trainer's clock, that of the snapshots).  With the
  paper's proportions (a 12 h run, hourly checkpoints, the failure 42 min
  after one) scaled to a ``--run-seconds`` run, checkpoint/restart loses
  0.7 of a checkpoint interval.  Reported per job: *back in the loop*
  (kill to every rank entering the update loop again, the paper's measure)
  and *progress regained* (kill to every rank having finished the first
  iteration that was not done before the kill), with the parts: detect,
  repair (communicator), state, teardown and relaunch (checkpoint), lost
  work, and the spare top-up that follows a respawn with spares.  A queue
  wait before a relaunch is not slept: ``--queue-wait`` is added to the
  checkpoint/restart times in the table, as a stated parameter.
* ``checkpoint``: the cost of one snapshot of the trainer (serialise,
  compress, write and fsync) and of loading it, for ``tiny`` and
  ``resnet50``, in this process.
* ``curves``: validation error against wall time since launch, without a
  failure and with rank 1 killed at ``--curve-fail-at`` seconds of
  training, ``--curve-repeats`` runs each; every job ends at
  ``--curve-seconds`` of wall time; the table gives the best validation
  error reached by the two ``--wall-times`` (median and range).

Usage::

    python -m chainer_prefetch_bench.fault.run --out results/fault \\
        [--sizes 2 3 4] [--repeats 5] [--only recovery checkpoint curves]

Writes ``OUT/recovery.json``, ``OUT/checkpoint_cost.json``,
``OUT/curves.json`` and ``OUT/table.md``; ``chainer_prefetch_bench.fault.plot``
draws the figures from them.
"""
import argparse
import importlib.util
import io
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from chainer_prefetch.resilience.injection import read_events
from chainer_prefetch_bench.fault import gratings
from chainer_prefetch_bench.testbed import mpi_launch

REPO = mpi_launch.REPO
JOB_SCRIPT = os.path.join(REPO, 'scripts', 'jobs', 'local.sh')
STRATEGIES = ('respawn-spares', 'respawn', 'shrink', 'checkpoint')
JOB_TIMEOUT = 300
FAILED_RANK = 1


class Setup:
    """What every job of one experiment shares.

    Args:
        data: The dataset folder (``train.txt``, ``val.txt``).
        batch: Examples per rank and batch.
        lr: ``--lr`` of the example (for a global batch of 256).
        checkpoint_seconds: Seconds of training between snapshots.
        epochs: Epochs the job would train (curve jobs are cut by time).
    """

    def __init__(self, data: str, batch: int, lr: float,
                 checkpoint_seconds: float, epochs: int,
                 mpiexec_args: str = ''):
        self.mpiexec_args = mpiexec_args
        self.data = data
        self.batch = batch
        self.lr = lr
        self.checkpoint_seconds = checkpoint_seconds
        self.epochs = epochs


def job_command(strategy: str, n: int, setup: Setup, out: str,
                options: Sequence[str]):
    """The command line and environment of one job through the job script
    (under the launcher for checkpoint/restart)."""
    env = mpi_launch.environment()
    env.update(
        K=str(n), DATA_ROOT=setup.data, ITERATOR='multiprocess', ARCH='tiny',
        CROP_SIZE='32', BATCHSIZE=str(setup.batch), VAL_BATCHSIZE='200',
        EPOCHS=str(setup.epochs), LOADERJOB='1', OUT=out,
        LOCAL_DIR=os.path.join(out, 'local'), PYTHON=sys.executable,
        MPIEXEC=mpi_launch.mpiexec_path(),
        MPIEXEC_ARGS=' '.join(['--bind-to none', setup.mpiexec_args] + (
            [] if strategy == 'checkpoint' else ['--with-ft ulfm'])))
    arguments = ['--fault-tolerance', strategy.split('-')[0],
                 '--start-method', 'fork', '--lr', str(setup.lr),
                 '--snapshot-seconds', str(setup.checkpoint_seconds),
                 '--stop-timeout', '5', '--call-timeout', '60']
    if strategy == 'respawn-spares':
        arguments += ['--spares', '1']
    command = ['bash', JOB_SCRIPT] + arguments + list(options)
    if strategy == 'checkpoint':
        command = [sys.executable, '-m', 'chainer_prefetch.resilience.launcher',
                   '--max-restarts', '2', '--events',
                   os.path.join(out, 'ft_events.jsonl'), '--'] + command
    return command, env


def run_job(strategy: str, n: int, setup: Setup, out: str,
            options: Sequence[str], seconds: Optional[float] = None,
            done: Optional[Callable[[List[Dict]], bool]] = None) -> Dict:
    """Runs one job; returns its command, launch time and events.

    Args:
        seconds: End the job after this wall time (curves); None: it ends
            when ``done`` says so, within ``JOB_TIMEOUT``.
        done: ``done(events)``: the job has shown what is measured.

    Raises:
        RuntimeError: the job ended or timed out before ``done``.
    """
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    command, env = job_command(strategy, n, setup, out, options)
    events_path = os.path.join(out, 'ft_events.jsonl')
    launched = time.time()
    returncode, output, timed_out = mpi_launch.run(
        command, seconds or JOB_TIMEOUT, cwd=out, env=env,
        done=None if done is None else lambda: done(read_events(events_path)))
    events = read_events(events_path)
    if done is not None and not done(events):
        raise RuntimeError('{} job with {} ranks {}:\n{}'.format(
            strategy, n, 'timed out' if timed_out else
            'ended ({})'.format(returncode), output[-4000:]))
    return dict(command=' '.join(command), launched=launched, events=events,
                returncode=returncode)


# ---- recovery -----------------------------------------------------------------

def _times(events: List[Dict], name: str, after: float, **match) -> List:
    return [e for e in events if e['event'] == name and e['time'] > after
            and all(e.get(k) == v for k, v in match.items())]


def recovery_record(strategy: str, events: List[Dict]) -> Dict:
    """Recovery times and their parts from a job's events (see the module
    docstring)."""
    failure = next(e for e in events if e['event'] == 'failure')
    killed, done = failure['time'], failure['iteration']
    record = dict(failed_iteration=done)
    if strategy == 'checkpoint':
        relaunch = next(e for e in events if e['event'] == 'launch'
                        and e['launch'] == 1)
        teardown = next(e for e in events if e['event'] == 'exit'
                        and e['launch'] == 0)
        entered = _times(events, 'loop_entered', relaunch['time'])
        resumed = _times(events, 'resumed', relaunch['time'])
        progress = [e for e in events if e['event'] in
                    ('first_iteration', 'iteration') and e['rank'] == 0
                    and e['time'] > relaunch['time']
                    and e['iteration'] == done + 1]
        if len(entered) < len(_times(events, 'start', relaunch['time'])):
            raise ValueError('not every rank is back yet')
        back = max(e['time'] for e in entered)
        record.update(
            back_s=back - killed, regain_s=progress[0]['time'] - killed,
            teardown_s=teardown['time'] - killed,
            relaunch_s=back - relaunch['time'],
            lost_iterations=done - resumed[0]['iteration'])
    else:
        recovered = _times(events, 'recovered', killed)
        newcomers = _times(events, 'loop_entered', killed)
        after = _times(events, 'iteration_after_recovery', killed,
                       iteration=done + 1)
        if len(after) < len({e['rank'] for e in recovered + newcomers}):
            raise ValueError('not every rank has iterated yet')
        back = max(e['time'] for e in recovered + newcomers)
        record.update(
            back_s=back - killed,
            regain_s=max(e['time'] for e in after) - killed,
            detect_s=min(e['seen'] for e in recovered) - killed,
            repair_s=max(e['repair_seconds'] for e in recovered),
            state_s=max(e['total_seconds'] - e['repair_seconds']
                        for e in recovered),
            size_after=recovered[0]['size'],
            from_spares=recovered[0].get('from_spares', 0))
        topped = _times(events, 'spares_topped_up', killed)
        if topped:
            record['top_up_s'] = max(e['seconds'] for e in topped)
    record['lost_s'] = record['regain_s'] - record['back_s']
    woke = [e for e in events if e['event'] == 'spare_woke']
    if woke:
        record['spare_parked_s'] = sum(e['parked_seconds'] for e in woke)
        record['spare_cpu_s'] = sum(e['cpu_seconds'] for e in woke)
    return record


def measured(strategy: str, n: int) -> Callable[[List[Dict]], bool]:
    """``done(events)`` of a recovery job: a second after all it measures
    (progress regained; the spare top-up with spares)."""
    def done(events: List[Dict]) -> bool:
        try:
            record = recovery_record(strategy, events)
        except (StopIteration, ValueError, IndexError):
            return False  # not there yet
        if strategy == 'respawn-spares' and 'top_up_s' not in record:
            return False
        killed = next(e['time'] for e in events if e['event'] == 'failure')
        measured = [killed + record['regain_s']] + [
            e['time'] for e in events if e['event'] == 'spares_topped_up']
        return time.time() - max(measured) > 1.0
    return done


def experiment_recovery(setup: Setup, work: str, sizes: Sequence[int],
                        repeats: int, fail_at: float,
                        checkpoint_fail_at: float,
                        strategies: Sequence[str] = STRATEGIES) -> List[Dict]:
    """Every strategy at every size, ``repeats`` times (interleaved, so that
    a slow phase of the machine hits all alike).  Respawn and shrink lose no
    work, so their kill comes after ``fail_at`` seconds of training;
    checkpoint/restart's after ``checkpoint_fail_at``."""
    results = []
    for repeat in range(repeats):
        for n in sizes:
            for strategy in strategies:
                at = checkpoint_fail_at if strategy == 'checkpoint' else fail_at
                options = ['--inject-failure', 'kill', '--inject-rank',
                           str(FAILED_RANK), '--inject-seconds', str(at)]
                job = run_job(strategy, n, setup,
                              os.path.join(work, 'recovery'), options,
                              done=measured(strategy, n))
                record = recovery_record(strategy, job['events'])
                record.update(strategy=strategy, ranks=n, repeat=repeat,
                              command=job['command'])
                print('recovery  {:15s} ranks {} repeat {}: back {:.2f} s, '
                      'regained {:.2f} s'.format(
                          strategy, n, repeat, record['back_s'],
                          record['regain_s']), flush=True)
                results.append(record)
    return results


# ---- one snapshot ----------------------------------------------------------------

def experiment_checkpoint_cost(archs: Sequence[str], repeats: int
                               ) -> List[Dict]:
    """Times one snapshot (model, momentum state, iterator) in parts."""
    import chainer
    from chainer.serializers import DictionarySerializer, NpzDeserializer
    ARCHS = _example_models().ARCHS
    results = []
    for arch in archs:
        model = chainer.links.Classifier(ARCHS[arch](n_class=1000))
        optimizer = chainer.optimizers.MomentumSGD(lr=0.01)
        optimizer.setup(model)
        x = np.zeros((2, 3, 64, 64), np.float32)
        optimizer.update(model, x, np.zeros(2, np.int32))  # momentum state
        iterator = chainer.iterators.SerialIterator(list(range(10)), 2)
        # The updater's state is the trainer snapshot's bulk: the iterator,
        # the optimizer state and (inside the optimizer) the model.
        updater = chainer.training.updaters.StandardUpdater(iterator,
                                                            optimizer)
        folder = tempfile.mkdtemp()
        for repeat in range(repeats):
            started = time.perf_counter()
            serializer = DictionarySerializer()
            updater.serialize(serializer)
            serialised = time.perf_counter()
            buffer = io.BytesIO()
            np.savez_compressed(buffer, **serializer.target)
            compressed = time.perf_counter()
            fd, path = tempfile.mkstemp(dir=folder)
            with os.fdopen(fd, 'wb') as f:
                f.write(buffer.getvalue())
                f.flush()
                written = time.perf_counter()
                os.fsync(f.fileno())
            synced = time.perf_counter()
            with np.load(path) as npz:
                updater.serialize(NpzDeserializer(npz))
            loaded = time.perf_counter()
            os.unlink(path)
            record = dict(arch=arch, repeat=repeat,
                          bytes=len(buffer.getvalue()),
                          serialize_s=serialised - started,
                          compress_s=compressed - serialised,
                          write_s=written - compressed,
                          fsync_s=synced - written,
                          total_s=synced - started,
                          load_s=loaded - synced)
            results.append(record)
            print('checkpoint {:9s} {:.1f} MB: {:.3f} s (load {:.3f} s)'
                  .format(arch, record['bytes'] / 1e6, record['total_s'],
                          record['load_s']), flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    return results


def _example_models():
    """The ImageNet example's ``models`` package, loaded from its folder.

    Registered as ``models``, the name its own imports use.
    """
    path = os.path.join(os.path.dirname(mpi_launch.TRAIN_SCRIPT), 'models',
                        '__init__.py')
    spec = importlib.util.spec_from_file_location(
        'models', path, submodule_search_locations=[os.path.dirname(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its imports of models.* find it here
    spec.loader.exec_module(module)
    return module


# ---- learning curves ---------------------------------------------------------------

CURVE_PLANS = (('no failure', 'respawn-spares', False),
               ('respawn-spares', 'respawn-spares', True),
               ('shrink', 'shrink', True),
               ('checkpoint', 'checkpoint', True))


def experiment_curves(setup: Setup, work: str, n: int, repeats: int,
                      fail_at: float, seconds: float,
                      labels: Sequence[str] = tuple(p[0] for p in CURVE_PLANS)
                      ) -> List[Dict]:
    """Learning-curve jobs: every plan of ``CURVE_PLANS`` named in
    ``labels``, ``repeats`` times (interleaved), each cut at ``seconds`` of
    wall time.

    Args:
        setup: What the jobs share.
        work: Scratch folder (the jobs' output goes to ``work/curves``).
        n: Ranks.
        repeats: Runs of each plan.
        fail_at: Seconds of training before rank 1 is killed.
        seconds: Wall time of every job.
        labels: The plans to run.

    Returns:
        One record per job: its validation errors ``(seconds since launch,
        error, iteration)``, the failure's time and the command.
    """
    runs = []
    for repeat in range(repeats):
        for label, strategy, inject in CURVE_PLANS:
            if label not in labels:
                continue
            options = []
            if inject:
                options = ['--inject-failure', 'kill', '--inject-rank',
                           str(FAILED_RANK), '--inject-seconds', str(fail_at)]
            job = run_job(strategy, n, setup, os.path.join(work, 'curves'),
                          options, seconds=seconds)
            events = job['events']
            validation = [(e['time'] - job['launched'], 1 - e['accuracy'],
                           e['iteration']) for e in events
                          if e['event'] == 'validation']
            failure = [e['time'] - job['launched'] for e in events
                       if e['event'] == 'failure']
            runs.append(dict(label=label, strategy=strategy, ranks=n,
                             repeat=repeat,
                             failure_s=failure[0] if failure else None,
                             validation=validation, command=job['command']))
            print('curves    {:15s} repeat {}: {} validations, best {:.3f}'
                  .format(label, repeat, len(validation),
                          min(v[1] for v in validation)), flush=True)
    return runs


def best_error_by(run: Dict, wall_time: float) -> Optional[float]:
    """Lowest validation error reported by ``wall_time`` (None: none yet)."""
    errors = [error for t, error, _ in run['validation'] if t <= wall_time]
    return min(errors) if errors else None


# ---- the tables -------------------------------------------------------------------

def _median(values):
    return statistics.median(values) if values else float('nan')


def _spread(values, digits: int = 2) -> str:
    if not values:
        return '-'
    return '{0:.{3}f} [{1:.{3}f}-{2:.{3}f}]'.format(
        _median(values), min(values), max(values), digits)


def recovery_table(recovery: List[Dict], queue_wait: float,
                   details: bool = True) -> List[str]:
    sizes = sorted({r['ranks'] for r in recovery})

    def values(strategy, n, key):
        return [r[key] + (queue_wait if strategy == 'checkpoint'
                          and key in ('back_s', 'regain_s') else 0)
                for r in recovery if r['ranks'] == n
                and r['strategy'] == strategy and key in r]
    lines = []
    for key, title in (('back_s', 'Back in the loop: kill to every rank in '
                        'the update loop again'),
                       ('regain_s', 'Progress regained: kill to every rank '
                        'past the last iteration done before the kill')):
        lines += ['## {} (median [min-max] s, n={} per cell{})'.format(
            title, len(values(STRATEGIES[0], sizes[0], key)),
            '; checkpoint/restart includes a queue wait of {:.0f} s'.format(
                queue_wait) if queue_wait else ''), '',
            '| ranks | ' + ' | '.join(STRATEGIES)
            + ' | checkpoint / respawn-spares | checkpoint / respawn |',
            '|---|' + '---|' * (len(STRATEGIES) + 2)]
        for n in sizes:
            medians = {s: _median(values(s, n, key)) for s in STRATEGIES}
            lines.append('| {} | {} | {:.1f}x | {:.1f}x |'.format(
                n, ' | '.join(_spread(values(s, n, key)) for s in STRATEGIES),
                medians['checkpoint'] / medians['respawn-spares'],
                medians['checkpoint'] / medians['respawn']))
        lines.append('')
    if not details:
        return lines
    parts = ('detect_s', 'repair_s', 'state_s', 'teardown_s', 'relaunch_s',
             'lost_s', 'lost_iterations', 'top_up_s')
    lines += ['### Parts (medians), s', '',
              '| strategy | ranks | ' + ' | '.join(p[:-2] if p.endswith('_s')
                                                   else p for p in parts)
              + ' |', '|---|---|' + '---|' * len(parts)]
    for strategy in STRATEGIES:
        for n in sizes:
            cells = []
            for part in parts:
                found = [r[part] for r in recovery if r['ranks'] == n
                         and r['strategy'] == strategy and part in r]
                cells.append('{:.2f}'.format(_median(found)) if found
                             else '-')
            lines.append('| {} | {} | {} |'.format(strategy, n,
                                                   ' | '.join(cells)))
    parked = [r for r in recovery if r.get('spare_parked_s')]
    if parked:
        share = (sum(r['spare_cpu_s'] for r in parked)
                 / sum(r['spare_parked_s'] for r in parked))
        lines += ['', 'Parked spares used {:.2%} of one core ({:.1f} s of '
                  'CPU over {:.0f} s parked, all runs).'.format(
                      share, sum(r['spare_cpu_s'] for r in parked),
                      sum(r['spare_parked_s'] for r in parked))]
    return lines + ['']


def checkpoint_table(cost: List[Dict]) -> List[str]:
    lines = ['## Checkpoint cost (one snapshot of trainer, model and '
             'momentum), median s', '',
             '| arch | MB | serialise | compress | write | fsync | total | '
             'load |', '|---|---|---|---|---|---|---|---|']
    for arch in sorted({r['arch'] for r in cost}, key=lambda a: a != 'tiny'):
        rows = [r for r in cost if r['arch'] == arch]
        lines.append('| {} | {:.2f} | {} |'.format(
            arch, rows[0]['bytes'] / 1e6, ' | '.join(
                '{:.3f}'.format(_median([r[k] for r in rows]))
                for k in ('serialize_s', 'compress_s', 'write_s', 'fsync_s',
                          'total_s', 'load_s'))))
    return lines + ['']


def curves_table(curves: Dict) -> List[str]:
    """Best validation error by each of the wall times, and the wall time at
    which two iterations that every run validated were reached: the first
    validated after every run's failure, and the last."""
    runs, wall_times = curves['runs'], curves['wall_times']
    failures = [r['failure_s'] for r in runs if r['failure_s']]
    labels = [p[0] for p in CURVE_PLANS
              if any(r['label'] == p[0] for r in runs)]
    common = sorted(set.intersection(*(
        {i for _, _, i in r['validation']} for r in runs)))
    after = [i for i in common if all(t > max(failures) for r in runs
                                      for t, _, j in r['validation']
                                      if j == i)]
    shown = sorted({after[0], common[-1]}) if after else common[-1:]
    lines = ['## Best validation error by a wall time since launch, and the '
             'wall time since launch at which an iteration was validated '
             '(median [min-max] of {} runs; failure at {:.0f} s of training, '
             '{:.0f}-{:.0f} s after launch)'.format(
                 max(r['repeat'] for r in runs) + 1, curves['fail_at'],
                 min(failures), max(failures)), '',
             '| run | ' + ' | '.join('error by {:.0f} s'.format(t)
                                    for t in wall_times)
             + ''.join(' | s at iteration {}'.format(i) for i in shown)
             + ' |', '|---|' + '---|' * (len(wall_times) + len(shown))]
    for label in labels:
        mine = [r for r in runs if r['label'] == label]
        cells = []
        for t in wall_times:
            best = [best_error_by(r, t) for r in mine]
            cells.append(_spread([b for b in best if b is not None], 3))
        for iteration in shown:
            cells.append(_spread([t for r in mine for t, _, i in
                                  r['validation'] if i == iteration], 0))
        lines.append('| {} | {} |'.format(label, ' | '.join(cells)))
    return lines + ['']


def table(recovery: List[Dict], cost: List[Dict], curves: Optional[Dict],
          queue_wait: float) -> str:
    lines = []
    if recovery:
        lines += recovery_table(recovery, 0.0)
        if queue_wait:
            lines += recovery_table(recovery, queue_wait, details=False)
    if cost:
        lines += checkpoint_table(cost)
    if curves:
        lines += curves_table(curves)
    return '\n'.join(lines)


def _exit_on_signal(number, _frame):
    """SIGTERM ends the experiment like an exception: the running job is
    stopped on the way out (``mpi_launch.run``)."""
    raise SystemExit(128 + number)


def main(argv: Optional[Sequence[str]] = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_signal)
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', default=os.path.join(REPO, 'results',
                                                      'fault'))
    parser.add_argument('--work', default=None,
                        help='scratch directory (default: a temporary one)')
    parser.add_argument('--sizes', type=int, nargs='+', default=[2, 3, 4])
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--only', nargs='+',
                        choices=('recovery', 'checkpoint', 'curves'),
                        default=['recovery', 'checkpoint', 'curves'])
    parser.add_argument('--no-run', action='store_true',
                        help='only rewrite table.md from the JSON files')
    parser.add_argument('--strategies', nargs='+', choices=STRATEGIES,
                        default=list(STRATEGIES),
                        help='strategies of the recovery jobs')
    parser.add_argument('--mpiexec-args', default='',
                        help='more mpiexec options for every job')
    parser.add_argument('--batch', type=int, default=32,
                        help='examples per rank and batch, curves')
    parser.add_argument('--recovery-batch', type=int, default=8,
                        help='the same, recovery jobs (short iterations: '
                             'the survivors notice a failure at their next '
                             'collective)')
    parser.add_argument('--lr', type=float, default=0.05,
                        help='--lr of the example (for a batch of 256)')
    parser.add_argument('--run-seconds', type=float, default=300.0,
                        help='the run the checkpoint interval is scaled to')
    parser.add_argument('--checkpoint-fraction', type=float, default=1 / 12,
                        help='checkpoint interval / run (paper: 1 h / 12 h)')
    parser.add_argument('--fail-at', type=float, default=6.0,
                        help='seconds of training before the kill in the '
                             'respawn and shrink recovery jobs')
    parser.add_argument('--checkpoint-fail-at', type=float, default=None,
                        help='the same for checkpoint/restart (default: 1.7 '
                             'checkpoint intervals: 0.7 interval after a '
                             'snapshot, as the paper\'s 2 h 42 min)')
    parser.add_argument('--queue-wait', type=float, default=60.0,
                        help='scheduler queue wait added to checkpoint/'
                             'restart in a second table (not slept)')
    parser.add_argument('--curve-ranks', type=int, default=3)
    parser.add_argument('--curve-repeats', type=int, default=3)
    parser.add_argument('--curve-plans', nargs='+',
                        choices=[p[0] for p in CURVE_PLANS],
                        default=[p[0] for p in CURVE_PLANS],
                        help='the curve runs to make')
    parser.add_argument('--curve-seconds', type=float, default=None,
                        help='wall time of a curve job (default: '
                             '--run-seconds + 10)')
    parser.add_argument('--curve-fail-at', type=float, default=None,
                        help='seconds of training before the kill (default: '
                             'the paper\'s 2 h 42 min of 12 h)')
    parser.add_argument('--wall-times', type=float, nargs=2, default=None,
                        help='default: 10/12 and 12/12 of --run-seconds')
    args = parser.parse_args(argv)
    interval = args.run_seconds * args.checkpoint_fraction
    checkpoint_fail_at = args.checkpoint_fail_at or 1.7 * interval
    curve_fail_at = args.curve_fail_at or args.run_seconds * 162 / 720
    wall_times = args.wall_times or [args.run_seconds * 10 / 12,
                                     args.run_seconds]
    os.makedirs(args.out, exist_ok=True)
    work = args.work or tempfile.mkdtemp(prefix='fault_experiments_')

    def path(name):
        return os.path.join(args.out, name)

    def load(name):
        if not os.path.exists(path(name)):
            return None
        with open(path(name)) as f:
            return json.load(f)

    def save(name, value):
        with open(path(name), 'w') as f:
            json.dump(value, f, indent=1)

    if not args.no_run:
        if 'recovery' in args.only:
            data = os.path.join(work, 'data-recovery')
            gratings.generate(data, 1920, 480)
            save('recovery.json', experiment_recovery(
                Setup(data, args.recovery_batch, args.lr, interval, 1000,
                      args.mpiexec_args), work, args.sizes, args.repeats,
                args.fail_at, checkpoint_fail_at, args.strategies))
        if 'checkpoint' in args.only:
            save('checkpoint_cost.json',
                 experiment_checkpoint_cost(['tiny', 'resnet50'], 5))
        if 'curves' in args.only:
            data = os.path.join(work, 'data-curves')
            gratings.generate(data, 8000, 1600)
            seconds = args.curve_seconds or args.run_seconds + 10
            runs = experiment_curves(
                Setup(data, args.batch, args.lr, interval, 1000,
                      args.mpiexec_args), work,
                args.curve_ranks, args.curve_repeats, curve_fail_at, seconds,
                args.curve_plans)
            save('curves.json', dict(runs=runs, wall_times=wall_times,
                                     fail_at=curve_fail_at,
                                     checkpoint_seconds=interval))
    text = table(load('recovery.json') or [],
                 load('checkpoint_cost.json') or [], load('curves.json'),
                 args.queue_wait)
    with open(path('table.md'), 'w') as f:
        f.write(text)
    print(text)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
