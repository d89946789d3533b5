"""Warm spares, exact epochs, reporting and fencing under real MPI.

Each run is started by ``mpi_launch.run`` under ``mpirun --with-ft ulfm`` in
its own process group with a hard timeout, and afterwards no process of the
run (ranks, spares, supervisors, watchdogs, ``prterun``) may be left.
"""
import json
import sys

import pytest

from chainer_prefetch.resilience.injection import read_events
from test_resilience_mpi import _example, _failure, _mpirun, _of, _run

pytestmark = pytest.mark.slow

# ---- exact epoch coverage, with the library alone -------------------------

COVERAGE_SCRIPT = '''
import json, os, sys
import numpy, chainer
from chainer_prefetch.resilience.supervisor import supervise
supervise()
from chainer_prefetch.resilience import injection, recovery
from chainer_prefetch.resilience import training as ft
from chainer_prefetch.resilience.communicator import (
    FaultTolerantCommunicator, start_watchdog)
from chainer_prefetch.resilience.spares import SparePool
from chainer_prefetch.resilience.watchdog import WatchdogSettings
import chainermn

out, kind, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
N, BATCH, EPOCHS = 48, 4, 3
settings = WatchdogSettings(5, 30)
events = injection.EventLog(os.path.join(out, 'events.jsonl'), -1)
pool = package = None
if recovery.is_replacement():
    watchdog = start_watchdog(-1, settings)
    pool = SparePool.join(watchdog, events)
    takeover = pool.wait()
    if takeover is None:
        sys.exit(0)
    comm = FaultTolerantCommunicator(takeover.training, watchdog=watchdog)
    package = ft.receive_package(comm, takeover)
else:
    comm = FaultTolerantCommunicator(watchdog=settings)
events.rank = comm.rank
# Example i is (features [i, 1], label i % 2); every rank holds all.
data = chainer.datasets.TupleDataset(
    numpy.stack([numpy.arange(N), numpy.ones(N)], 1).astype(numpy.float32),
    (numpy.arange(N) % 2).astype(numpy.int32))

def make_iterator(shard, sampler):
    if kind == 'prefetch':
        from chainer_prefetch import PrefetchMultiprocessIterator
        return PrefetchMultiprocessIterator(shard, BATCH, n_processes=1,
                                            order_sampler=sampler)
    return chainer.iterators.MultiprocessIterator(
        shard, BATCH, n_processes=1, order_sampler=sampler)

seen = []
def converter(batch, device=None):
    seen[:] = [int(x[0]) for x, _ in batch]  # the last attempt counts
    return chainer.dataset.concat_examples(batch, device)

numpy.random.seed(0)
model = chainer.links.Classifier(chainer.links.Linear(2, 2))
optimizer = chainermn.create_multi_node_optimizer(
    chainer.optimizers.SGD(lr=0.01), comm)
optimizer.setup(model)
updater = chainer.training.updaters.StandardUpdater(
    ft.train_iterator(data, make_iterator, BATCH, comm, 7),
    optimizer, converter=converter)
trainer = chainer.training.Trainer(updater, (EPOCHS, 'epoch'), out)
recoverer = ft.FaultTolerantTraining(
    comm, 'respawn', model, optimizer, updater, data, None, make_iterator,
    trainer=trainer, seed=7, spares=1, pool=pool,
    respawn_command=[sys.executable] + sys.argv, events=events)
if package is not None:
    recoverer.load_package(package, newcomer=True)
per_epoch = N // comm.size // BATCH
inner = updater.update

def update():
    epoch = updater.iteration // per_epoch
    inner()
    with open(os.path.join(out, 'seen{}.txt'.format(comm.rank)), 'a') as f:
        f.write(json.dumps([epoch, seen]) + '\\n')
    if (package is None and comm.rank == 1
            and updater.iteration == kill_at):
        events.write('failure', iteration=updater.iteration)
        injection.fail_now('kill')
updater.update = update
trainer.run()
events.write('finished', iteration=updater.iteration)
comm.close()
'''


@pytest.mark.parametrize('kind', ['multiprocess', 'prefetch'])
@pytest.mark.timeout(200)
def test_every_example_once_per_epoch_after_a_respawn_mid_epoch(tmp_path,
                                                                kind):
    script = tmp_path / 'coverage.py'
    script.write_text(COVERAGE_SCRIPT)
    # 48 examples, 3 ranks, batch 4: 4 iterations per epoch; rank 1 dies
    # after iteration 6, in the middle of epoch 1.
    returncode, output, _ = _run(
        _mpirun(3, [sys.executable, str(script), str(tmp_path), kind, '6']),
        tmp_path, timeout=150)
    assert returncode == 0, output[-5000:]
    events = read_events(str(tmp_path / 'events.jsonl'))
    assert [e['from_spares'] for e in _of(events, 'recovered')] == [1, 1]
    by_epoch = {}
    for rank in range(3):
        lines = (tmp_path / 'seen{}.txt'.format(rank)).read_text().splitlines()
        for epoch, indices in map(json.loads, lines):
            by_epoch.setdefault(epoch, []).extend(indices)
    assert sorted(by_epoch) == [0, 1, 2]
    for epoch, indices in by_epoch.items():
        assert sorted(indices) == list(range(48)), (epoch, sorted(indices))


# ---- warm spares in the ImageNet example ------------------------------------

def _finished_in_sync(events, ranks=(0, 1, 2)):
    finished = _of(events, 'finished')
    assert sorted(e['rank'] for e in finished) == list(ranks), finished
    assert len({e['params_sha1'] for e in finished}) == 1, finished
    assert len({e['iteration'] for e in finished}) == 1, finished


def _parked_cpu_share(events):
    woke = _of(events, 'spare_woke')
    parked = sum(e['parked_seconds'] for e in woke)
    assert parked > 1, woke
    return sum(e['cpu_seconds'] for e in woke) / parked


@pytest.mark.timeout(200)
def test_spare_takes_over_with_identical_parameters(tmp_path):
    returncode, output, _, events = _example(
        tmp_path, 3, 'respawn', '--spares', '1', '--epoch', '4',
        *_failure('kill', 1, 6))
    assert returncode == 0, output[-5000:]
    recovered = _of(events, 'recovered')
    assert sorted(e['rank'] for e in recovered) == [0, 2]
    assert all((e['failed'], e['from_spares'], e['spawned']) == ([1], 1, 0)
               for e in recovered), recovered
    taken = _of(events, 'spare_taken')
    assert [e['role'] for e in taken] == [1]
    assert [e['rank'] for e in _of(events, 'joined')] == [1]
    # A new spare replaced the one taken, and every spare was dismissed.
    assert len(_of(events, 'spares_topped_up')) == 3
    assert len(_of(events, 'spare_parked')) == 2
    _finished_in_sync(events)
    # Parked, a spare sleeps: far from a core's worth of CPU.
    assert _parked_cpu_share(events) < 0.25


@pytest.mark.timeout(240)
def test_two_failures_in_a_row_each_take_a_spare(tmp_path):
    returncode, output, _, events = _example(
        tmp_path, 3, 'respawn', '--spares', '1', '--epoch', '4',
        '--inject-failure', 'kill', '--inject-rank', '1', '2',
        '--inject-iteration', '3', '9', timeout=200)
    assert returncode == 0, output[-5000:]
    assert sorted(e['rank'] for e in _of(events, 'failure')) == [1, 2]
    recovered = _of(events, 'recovered')
    assert sorted(e['failed'][0] for e in recovered) == [1, 1, 2, 2]
    assert all(e['from_spares'] == 1 and e['spawned'] == 0
               for e in recovered), recovered
    assert sorted(e['role'] for e in _of(events, 'spare_taken')) == [1, 2]
    _finished_in_sync(events)


@pytest.mark.timeout(200)
def test_dead_spare_is_noticed_and_replaced(tmp_path):
    returncode, output, _, events = _example(
        tmp_path, 3, 'respawn', '--spares', '1', '--epoch', '4',
        '--inject-spare-failure', '1')
    # PRRTE ends mpirun with the killed spare's status (its job lost its
    # only process) although training finished; the events tell.
    assert 'killed by SIGKILL' in output
    spare_failure = _of(events, 'failure')
    assert [e.get('spare') for e in spare_failure] == [True]
    recovered = _of(events, 'recovered')
    assert sorted(e['rank'] for e in recovered) == [0, 1, 2]
    assert all(e['failed'] == [] and e['spare_failures'] == 1
               for e in recovered), recovered
    assert len(_of(events, 'spares_topped_up')) == 3
    assert len(_of(events, 'spare_parked')) == 2
    _finished_in_sync(events)
    assert returncode in (0, 137), output[-5000:]


# ---- fencing a rank that exits without MPI_Finalize ----------------------------

@pytest.mark.timeout(200)
def test_rank_exiting_without_finalize_is_recovered(tmp_path):
    returncode, output, elapsed, events = _example(
        tmp_path, 3, 'respawn', *_failure('exit', 1, 3))
    assert returncode == 0, output[-5000:]
    assert 'exited with status 1 without finalizing; fencing it' in output
    failure = _of(events, 'failure')[0]
    recovered = _of(events, 'recovered')
    assert sorted(e['rank'] for e in recovered) == [0, 2]
    assert all(e['failed'] == [1] for e in recovered)
    # Recovered at once, not after --call-timeout (20 s).
    assert max(e['time'] for e in recovered) - failure['time'] < 10
    _finished_in_sync(events)


# ---- the report after rank 0 dies under shrink ----------------------------------

@pytest.mark.timeout(200)
def test_report_continues_after_rank_zero_dies_under_shrink(tmp_path):
    returncode, output, _, events = _example(
        tmp_path, 3, 'shrink', *_failure('kill', 0, 5))
    assert returncode == 0, output[-5000:]
    assert 'the report continues on this process' in output
    printed = [line.split()[0] for line in output.replace('\x1b[J', '')
               .splitlines() if line.split() and line.split()[0].isdigit()]
    assert printed[-2:] == ['2', '3'], output[-3000:]
    log = json.loads((tmp_path / 'out' / 'log').read_text())
    assert [entry['epoch'] for entry in log] == [1, 2, 3]
    finished = _of(events, 'finished')
    assert len(finished) == 2 and all(e['size'] == 2 for e in finished)
