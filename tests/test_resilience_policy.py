"""The pure core of chainer_prefetch.resilience and its single-process edges
(the watchdog process, the relaunching launcher): none of them needs mpi4py."""
import os
import signal
import subprocess
import sys
import time

import numpy
import pytest
from chainermn.datasets.scatter import scatter_index

import helpers
from chainer_prefetch.policy import lr_rules
from chainer_prefetch.policy.epoch_plan import shard_bounds, shard_order
from chainer_prefetch.resilience import launcher, policy
from chainer_prefetch.resilience.injection import (
    EventLog,
    FailureInjector,
    injection_due,
    read_events,
)
from chainer_prefetch.resilience.watchdog import decide


class _SizeRank:
    """What ``chainermn.scatter_index`` reads of a communicator on its root
    (``size``, ``rank``; it only sends to the others)."""

    def __init__(self, size):
        self.size = size
        self.rank = 0
        self.sent = {}

    def send_obj(self, obj, dest):
        self.sent[dest] = obj


@pytest.mark.parametrize('n', [1, 7, 64, 100, 257])
@pytest.mark.parametrize('size', [1, 2, 3, 4])
def test_shard_bounds_match_chainermn(n, size):
    comm = _SizeRank(size)
    mine = scatter_index(n, comm)
    expected = dict(comm.sent)
    expected[0] = mine
    for rank in range(size):
        assert shard_bounds(n, size, rank) == expected[rank]


def test_shard_bounds_rejects_bad_rank():
    with pytest.raises(ValueError, match='rank 3 outside'):
        shard_bounds(10, 3, 3)


def test_shard_order_is_scatter_dataset_permutation():
    numpy.testing.assert_array_equal(
        shard_order(50, 7), numpy.random.RandomState(7).permutation(50))
    assert shard_order(50, None) is None


def test_lr_rules():
    assert lr_rules.linear_lr(0.3, 3, 2) == pytest.approx(0.2)
    assert lr_rules.sqrt_lr(0.4, 4, 1) == pytest.approx(0.2)
    assert lr_rules.constant_lr(0.3, 3, 2) == 0.3
    assert lr_rules.resolve_lr_rule('linear') is lr_rules.linear_lr
    custom = lambda lr, old, new: lr / 10  # NOQA: E731
    assert lr_rules.resolve_lr_rule(custom) is custom
    with pytest.raises(ValueError, match="unknown learning-rate rule 'cubic'"):
        lr_rules.resolve_lr_rule('cubic')
    with pytest.raises(ValueError, match='sizes must be positive'):
        lr_rules.linear_lr(0.1, 0, 2)


def test_failed_ranks():
    assert policy.failed_ranks(4, [3, 0]) == [1, 2]
    assert policy.failed_ranks(3, [0, 1, 2]) == []
    with pytest.raises(ValueError, match='bad survivor ranks'):
        policy.failed_ranks(3, [0, 0])
    with pytest.raises(ValueError, match='bad survivor ranks'):
        policy.failed_ranks(3, [5])


def test_takeover_gives_failed_ranks_to_the_lowest_spares():
    spare = policy.SPARE
    # Pool order: ranks 0, 2, 3 survive; rank 1 failed; two spares.
    plan = policy.plan_takeover(4, [0, 2, 3, spare, spare])
    assert plan.failed == [1] and plan.shortfall == 0
    assert plan.takeover == {3: 1}
    assert plan.roles == [0, 2, 3, 1, spare]
    # Two failures, one spare: one rank is left to spawn.
    plan = policy.plan_takeover(4, [2, 0, spare])
    assert (plan.failed, plan.takeover, plan.shortfall) == ([1, 3], {2: 1}, 1)
    # No training failure: a spare died; nobody is taken.
    plan = policy.plan_takeover(3, [0, 1, 2, spare])
    assert (plan.failed, plan.takeover, plan.shortfall) == ([], {}, 0)
    # No spares at all (spares=0): every failed rank is spawned.
    assert policy.plan_takeover(3, [0, 2]).shortfall == 1
    with pytest.raises(ValueError, match='bad roles'):
        policy.plan_takeover(3, [0, 0, spare])
    with pytest.raises(ValueError, match='bad roles'):
        policy.plan_takeover(3, [3])


def test_split_key_orders_training_ranks_and_sets_spares_apart():
    assert policy.split_key(2, 0) == (0, 2)
    assert policy.split_key(policy.SPARE, 5) == (1, 5)


@pytest.mark.parametrize('kind', ['serial', 'multiprocess'])
def test_rank_order_sampler_orders_are_recomputable(kind):
    """The orders a real iterator draws with RankOrderSampler are
    epoch_order(...) for every epoch, different per rank and seed."""
    import chainer
    n, batch = 10, 5
    sampler = policy.RankOrderSampler(3, 1)
    if kind == 'serial':
        iterator = chainer.iterators.SerialIterator(
            list(range(n)), batch, order_sampler=sampler)
    else:
        iterator = chainer.iterators.MultiprocessIterator(
            list(range(n)), batch, n_processes=1, order_sampler=sampler)
    try:
        for epoch in range(4):
            seen = iterator.next() + iterator.next()
            assert seen == list(policy.epoch_order(n, 3, 1, epoch)), epoch
    finally:
        iterator.finalize()
    orders = {tuple(policy.epoch_order(n, seed, rank, 0))
              for seed in (3, 4) for rank in (0, 1)}
    assert len(orders) == 4
    assert sorted(policy.epoch_order(n, 3, 1, 2)) == list(range(n))
    with pytest.raises(ValueError, match='epoch must be >= 0'):
        policy.epoch_order(n, 3, 1, -1)


def test_latest_snapshot():
    names = ['log', 'snapshot_iter_5', 'snapshot_iter_40', 'snapshot_iter_9',
             'snapshot_epoch_3', 'snapshot_iter_40.tmp']
    assert policy.latest_snapshot(names) == 'snapshot_iter_40'
    assert policy.latest_snapshot(['log']) is None
    assert policy.snapshot_name(12) == 'snapshot_iter_12'


def test_watchdog_decision():
    assert decide(None, 0, 0, 10, 1, 1) == 'exit'
    assert decide('Z', 0, 0, 10, 1, 1) == 'exit'
    assert decide('T', 0.5, 0, 10, 1, 1) is None
    assert decide('T', 1.0, 0, 10, 1, 1) == 'stopped'
    assert decide('T', 100, 0, 10, None, 1) is None  # check disabled
    assert decide('S', 0, 9.5, 10, 1, 1) is None
    assert decide('S', 0, 9.0, 10, 1, 1) == 'call'
    assert decide('R', 0, 0.0, 1e6, 1, 1) is None  # outside MPI
    assert decide('S', 0, 1.0, 1e6, 1, None) is None


def test_injection_due():
    assert not injection_due(4, 0.0, 5, None)
    assert injection_due(5, 0.0, 5, None)
    assert injection_due(0, 3.0, None, 2.5)
    assert not injection_due(100, 1.0, None, 2.5)


def test_failure_injector_rejects_bad_plans():
    with pytest.raises(ValueError, match='failure mode'):
        FailureInjector(0, 0, 'explode', at_iteration=1)
    with pytest.raises(ValueError, match='an iteration or a time'):
        FailureInjector(0, 0, 'kill')


def test_event_log_round_trip(tmp_path):
    path = str(tmp_path / 'sub' / 'events.jsonl')
    log = EventLog(path, rank=2)
    log.write('failure', iteration=3)
    log.write('recovered', size=2)
    events = read_events(path)
    assert [e['event'] for e in events] == ['failure', 'recovered']
    assert events[0]['rank'] == 2 and events[0]['iteration'] == 3
    assert events[0]['time'] <= events[1]['time']
    assert read_events(str(tmp_path / 'missing')) == []


def test_restart_count():
    assert launcher.restart_count({}) == 0
    assert launcher.restart_count({'CHAINER_PREFETCH_RESTART': '2'}) == 2
    with pytest.raises(ValueError, match='not an integer'):
        launcher.restart_count({'CHAINER_PREFETCH_RESTART': 'x'})


@pytest.mark.timeout(60)
def test_launcher_relaunches_until_success(tmp_path):
    # Fails in launches 0 and 1, succeeds in launch 2 (real processes).
    command = [sys.executable, '-c',
               'import os, sys; sys.exit(0 if os.environ["CHAINER_PREFETCH_'
               'RESTART"] == "2" else 3)']
    events = EventLog(str(tmp_path / 'events.jsonl'), -1)
    assert launcher.relaunch(command, max_restarts=5, events=events) == 0
    record = [(e['event'], e['launch'], e.get('status'))
              for e in read_events(events.path)]
    assert record == [('launch', 0, None), ('exit', 0, 3), ('launch', 1, None),
                      ('exit', 1, 3), ('launch', 2, None), ('exit', 2, 0)]
    assert launcher.relaunch(command, max_restarts=1) == 3  # gives up


@pytest.mark.timeout(60)
def test_launcher_ends_its_launch_when_terminated(tmp_path):
    base = str(tmp_path / 'launch')
    marker = base + '-child'  # only in the launched grandchild's arguments
    script = ('import subprocess, sys, time; subprocess.Popen([sys.executable,'
              ' "-c", "import time; time.sleep(300)", {!r} + "-child"]); '
              'time.sleep(300)'.format(base))
    env = dict(os.environ, PYTHONPATH=helpers_repo())
    process = subprocess.Popen(
        [sys.executable, '-m', 'chainer_prefetch.resilience.launcher', '--',
         sys.executable, '-c', script], env=env)
    assert helpers.wait_until(lambda: processes_with(marker), 20)
    process.terminate()
    assert process.wait(timeout=20) == 128 + signal.SIGTERM
    assert helpers.wait_until(lambda: not processes_with(marker), 10), \
        'the launch survived its launcher'


@pytest.mark.timeout(60)
def test_a_second_sigterm_does_not_cut_the_launch_stop_short(tmp_path):
    marker = tmp_path / 'stubborn-launch'  # written once SIGTERM is ignored
    script = ('import signal, sys, time; signal.signal(signal.SIGTERM, '
              'signal.SIG_IGN); open(sys.argv[1], "w").close(); '
              'time.sleep(300)')
    env = dict(os.environ, PYTHONPATH=helpers_repo())
    process = subprocess.Popen(
        [sys.executable, '-m', 'chainer_prefetch.resilience.launcher', '--',
         sys.executable, '-c', script, str(marker)], env=env)
    assert helpers.wait_until(marker.exists, 20)
    process.terminate()
    time.sleep(1)  # within the launch's grace
    process.terminate()
    assert process.wait(timeout=20) == 128 + signal.SIGTERM
    assert helpers.wait_until(lambda: not processes_with(str(marker)), 10), \
        'the launch that ignores SIGTERM survived its launcher'


def test_launcher_kills_a_launch_past_its_timeout(tmp_path):
    marker = str(tmp_path / 'grandchild-marker')
    # The launch starts a grandchild in the same process group, then hangs.
    command = [sys.executable, '-c',
               'import subprocess, sys, time; subprocess.Popen([sys.executable,'
               ' "-c", "import time; time.sleep(300)", {!r}]); '
               'time.sleep(300)'.format(marker)]
    started = time.monotonic()
    status = launcher.relaunch(command, max_restarts=0, timeout=2)
    assert status == -9
    assert time.monotonic() - started < 20
    assert helpers.wait_until(lambda: not processes_with(marker), 10), \
        'a process of the killed launch survived'


def processes_with(text):
    """Pids of live processes whose command line contains ``text``."""
    found = []
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            with open('/proc/{}/cmdline'.format(pid), 'rb') as f:
                cmdline = f.read()
        except OSError:
            continue
        if (text.encode() in cmdline and int(pid) != os.getpid()
                and helpers.is_running(int(pid))):
            found.append(int(pid))
    return found


WATCHED_SCRIPT = r'''
import os, signal, sys, time
from chainer_prefetch.resilience.watchdog import Watchdog, WatchdogSettings
mode = sys.argv[1]
dog = Watchdog(7, WatchdogSettings(stop_timeout=1.0, call_timeout=1.5),
               ['Allreduce'])
print(dog.process.pid, flush=True)
if mode == 'stop':
    os.kill(os.getpid(), signal.SIGSTOP)
elif mode == 'call':
    dog.heartbeat.enter('Allreduce')
    time.sleep(60)
elif mode == 'busy':  # inside and outside MPI, never too long
    for _ in range(20):
        dog.heartbeat.enter('Allreduce'); time.sleep(0.1); dog.heartbeat.leave()
    dog.stop()
    print('stopped cleanly', flush=True)
elif mode == 'vanish':
    os._exit(0)
elif mode == 'kill_both':
    os.kill(dog.process.pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
'''


def _watched(tmp_path, mode):
    """Runs WATCHED_SCRIPT; returns its result, its watchdog's pid, seconds taken.

    Also checks that nothing named was left in ``/dev/shm`` (the heartbeat
    is anonymous shared memory).
    """
    script = tmp_path / 'watched.py'
    script.write_text(WATCHED_SCRIPT)
    env = dict(os.environ, PYTHONPATH=helpers_repo())
    before = _shm_names()
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            timeout=30, universal_newlines=True)
    elapsed = time.monotonic() - started
    watchdog_pid = int(result.stdout.split()[0])
    assert helpers.wait_until(lambda: not helpers.is_running(watchdog_pid), 5)
    assert not _shm_names() - before
    return result, watchdog_pid, elapsed


def _shm_names():
    """The heartbeat-like names in /dev/shm (a named heartbeat would show here)."""
    return {name for name in os.listdir('/dev/shm')
            if name.startswith('chainer_prefetch')}


def helpers_repo():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(60)
def test_watchdog_kills_a_stopped_rank(tmp_path):
    result, _, elapsed = _watched(tmp_path, 'stop')
    assert result.returncode == -9
    assert 'rank 7' in result.stderr and 'has been stopped for' in result.stderr
    assert elapsed < 15


@pytest.mark.timeout(60)
def test_watchdog_ends_a_rank_stuck_in_mpi(tmp_path):
    result, _, elapsed = _watched(tmp_path, 'call')
    assert result.returncode == -9
    assert 'rank 7' in result.stderr
    assert 'MPI Allreduce made no progress for' in result.stderr
    assert elapsed < 15


@pytest.mark.timeout(60)
def test_watchdog_leaves_a_healthy_rank_alone_and_stops(tmp_path):
    result, _, _ = _watched(tmp_path, 'busy')
    assert result.returncode == 0, result.stderr
    assert 'stopped cleanly' in result.stdout


@pytest.mark.timeout(60)
def test_watchdog_exits_when_its_rank_vanishes(tmp_path):
    result, _, _ = _watched(tmp_path, 'vanish')
    assert result.returncode == 0


@pytest.mark.timeout(60)
def test_a_rank_and_its_watchdog_both_killed_leave_nothing(tmp_path):
    """SIGKILL of both (as a job's end can do) runs no cleanup code at all."""
    result, _, _ = _watched(tmp_path, 'kill_both')
    assert result.returncode == -9


# ---- the supervisor that fences a rank ending without finalizing -------------

def test_exit_verdict():
    from chainer_prefetch.resilience.supervisor import exit_verdict
    assert exit_verdict(0) is None
    assert exit_verdict(1 << 8) == 'exited with status 1'
    assert exit_verdict(signal.SIGKILL) == 'was killed by SIGKILL'


SUPERVISED_SCRIPT = r'''
import os, signal, subprocess, sys, time
from chainer_prefetch.resilience.supervisor import supervise
mode = sys.argv[1]
supervisor = supervise('rank 5')
assert supervise() == supervisor  # a second call does nothing
leftover = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
print(os.getpid(), supervisor, leftover.pid, flush=True)
if mode == 'exit1':
    os._exit(1)
elif mode == 'kill':
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == 'term':  # the supervisor passes SIGTERM on to the rank
    os.kill(supervisor, signal.SIGTERM)
    time.sleep(30)
leftover.kill(); leftover.wait()
'''


@pytest.mark.parametrize('mode, returncode, fenced', [
    ('exit1', -signal.SIGKILL, 'exited with status 1'),
    ('kill', -signal.SIGKILL, 'was killed by SIGKILL'),
    ('term', -signal.SIGKILL, 'was killed by SIGTERM'),
    ('clean', 0, None),
])
@pytest.mark.timeout(60)
def test_supervisor_fences_an_unclean_end(tmp_path, mode, returncode, fenced):
    script = tmp_path / 'supervised.py'
    script.write_text(SUPERVISED_SCRIPT)
    env = dict(os.environ, PYTHONPATH=helpers_repo())
    env.pop('CHAINER_PREFETCH_SUPERVISED', None)
    result = subprocess.run([sys.executable, str(script), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            timeout=45, universal_newlines=True)
    rank, supervisor, leftover = map(int, result.stdout.split()[:3])
    assert supervisor != rank
    assert result.returncode == returncode, result.stderr
    if fenced:
        assert ('supervisor: rank 5 (pid {}) {} without finalizing; fencing'
                .format(rank, fenced)) in result.stderr
    else:
        assert 'fencing' not in result.stderr
    # Nothing of the rank is left (the sleeping child was killed).
    assert helpers.wait_until(lambda: not helpers.is_running(leftover), 5)
    assert not helpers.is_running(rank)


def test_supervise_refuses_after_mpi_initialisation(monkeypatch):
    from chainer_prefetch.resilience import supervisor
    monkeypatch.delenv(supervisor.SUPERVISED_VARIABLE, raising=False)
    monkeypatch.setitem(sys.modules, 'mpi4py.MPI', sys)
    with pytest.raises(RuntimeError, match='before mpi4py.MPI is imported'):
        supervisor.supervise(fork=lambda: pytest.fail('forked'))


# ---- the report on the current rank 0 ----------------------------------------

class _Rank:
    """What RankZeroReports reads of a communicator: its current rank."""

    def __init__(self, rank):
        self.rank = rank


def _trainer_with_reports(out_dir, comm, stream, epochs=4):
    import chainer
    from chainer.training import extensions

    from chainer_prefetch.resilience.reporting import RankZeroReports
    model = chainer.links.Classifier(chainer.links.Linear(2, 2))
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(model)
    data = chainer.datasets.TupleDataset(
        numpy.ones((8, 2), numpy.float32), numpy.zeros(8, numpy.int32))
    updater = chainer.training.updaters.StandardUpdater(
        chainer.iterators.SerialIterator(data, 4), optimizer)
    trainer = chainer.training.Trainer(updater, (epochs, 'epoch'),
                                       str(out_dir))
    log_report = extensions.LogReport()
    print_report = extensions.PrintReport(['epoch', 'main/loss'],
                                          out=stream)
    reports = RankZeroReports(comm, log_report, print_report, out=stream)
    trainer.extend(reports)
    trainer.extend(log_report)
    trainer.extend(print_report)
    return trainer, reports


def test_report_follows_rank_zero(tmp_path):
    import io
    import json
    stream = io.StringIO()
    comm = _Rank(1)  # becomes rank 0 after epoch 2, as after a shrink
    trainer, reports = _trainer_with_reports(tmp_path, comm, stream)

    @chainer_extension(trigger=(2, 'epoch'))
    def shrink(trainer):
        comm.rank = 0
    trainer.extend(shrink)
    trainer.run()
    text = stream.getvalue().replace('\x1b[J', '')
    rows = [line.split()[0] for line in text.splitlines()
            if line.split() and line.split()[0].isdigit()]
    assert rows == ['3', '4'], text
    assert 'the report continues on this process' in text
    assert text.count('main/loss') == 1  # the header, once, on rank 0
    assert reports.takeovers == 1
    log = json.loads((tmp_path / 'log').read_text())
    assert [entry['epoch'] for entry in log] == [1, 2, 3, 4]


def test_report_state_goes_to_a_replacement_of_rank_zero(tmp_path):
    import io
    import json
    first, _ = _trainer_with_reports(tmp_path / 'a', _Rank(0), io.StringIO(),
                                     epochs=2)
    first.run()
    sent = first.get_extension('RankZeroReports').state()
    stream = io.StringIO()
    second, reports = _trainer_with_reports(tmp_path / 'b', _Rank(0), stream,
                                            epochs=1)
    reports.load(sent)
    assert len(reports.log_report.log) == 2
    second.run()
    rows = [line.split()[0] for line in stream.getvalue().replace(
        '\x1b[J', '').splitlines() if line.split()
        and line.split()[0].isdigit()]
    assert len(rows) == 1, stream.getvalue()  # the received log not again
    log = json.loads((tmp_path / 'b' / 'log').read_text())
    assert len(log) == 3 and log[:2] == first.get_extension(
        'LogReport').log

def chainer_extension(**kwargs):
    import chainer
    return chainer.training.make_extension(**kwargs)
