"""Multi-process tests of chainer_prefetch.resilience under real MPI.

Every run is started in its own process group with a hard timeout (the
group is stopped on expiry), by ``mpi_launch.run`` or, for the relaunching
launcher's own tests, ``launcher.run_once``, and every test checks that no
process of the run (ranks, replacements, watchdogs, ``prterun``) is left.
Recovery runs use ``mpirun --with-ft ulfm`` (Open MPI 5 from PyPI).
"""
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

import documented
import helpers
from chainer_prefetch.resilience import launcher, supervisor
from chainer_prefetch.resilience.injection import read_events
from chainer_prefetch_bench.testbed import mpi_launch
from test_resilience_policy import processes_with

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 120


def _mpirun(n, arguments, ft=True):
    command = [mpi_launch.mpiexec_path()]
    if ft:
        command += ['--with-ft', 'ulfm']
    return command + ['--oversubscribe', '--bind-to', 'none', '-n', str(n)] \
        + list(arguments)


def _run(command, tmp_path, timeout=RUN_TIMEOUT):
    """Runs ``command``; returns (returncode, output, seconds).  Fails on a
    timeout and when any process mentioning ``tmp_path`` survives."""
    started = time.monotonic()
    returncode, output, timed_out = mpi_launch.run(command, timeout,
                                                   cwd=str(tmp_path))
    elapsed = time.monotonic() - started
    assert not timed_out, 'timed out after {} s:\n{}'.format(
        timeout, output[-5000:])
    leftovers = helpers.wait_until(lambda: not processes_with(str(tmp_path)),
                                   10)
    assert leftovers, 'processes left behind: {}'.format(
        processes_with(str(tmp_path)))
    return returncode, output, elapsed


# ---- launching mpirun: session directories -------------------------------------

def _tmpdir_environment(tmp_path):
    """``mpi_launch.environment()`` with ``TMPDIR`` inside ``tmp_path`` (and
    no session-directory base of an outer launch)."""
    tmpdir = tmp_path / 'tmpdir'
    tmpdir.mkdir()
    env = dict(mpi_launch.environment(), TMPDIR=str(tmpdir))
    env.pop(mpi_launch.SESSION_BASE_VARIABLE, None)
    return env, tmpdir


def _sessions(tmpdir):
    return sorted(p.name for p in tmpdir.glob('ompi.*'))


def _sleeping_ranks(marker):
    return _mpirun(2, [sys.executable, '-c', 'import time; time.sleep(60)',
                       marker], ft=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize('wrapped', [False, True], ids=['mpirun', 'script'])
def test_a_launch_stopped_at_its_timeout_leaves_no_session_directory(
        tmp_path, wrapped):
    # Open MPI 5 leaves $TMPDIR/ompi.<pid> behind when mpirun is killed;
    # a later mpirun that gets the same pid then cannot start.  A job
    # script that runs mpirun (and ends at once on SIGTERM) must not cut
    # mpirun's grace short.
    env, tmpdir = _tmpdir_environment(tmp_path)
    marker = str(tmp_path / 'rank-marker')
    command = _sleeping_ranks(marker)
    if wrapped:
        command = ['bash', '-c', shlex.join(command) + '; true']
    status = launcher.run_once(command, 5, env)
    assert status == -signal.SIGKILL
    assert _sessions(tmpdir) == []
    assert helpers.wait_until(lambda: not processes_with(marker), 10), \
        'ranks left: {}'.format(processes_with(marker))


@pytest.mark.timeout(60)
def test_mpi_launch_keeps_session_directories_out_of_tmpdir(tmp_path):
    env, tmpdir = _tmpdir_environment(tmp_path)
    record = tmp_path / 'session-directory'
    script = ('import os, sys, time\n'
              'open(sys.argv[1], "w").write(os.environ["PMIX_SERVER_TMPDIR"])\n'
              'time.sleep(60)\n')
    command = _mpirun(1, [sys.executable, '-c', script, str(record)],
                      ft=False)
    _, output, timed_out = mpi_launch.run(
        command, 30, cwd=str(tmp_path), env=env,
        done=lambda: record.exists() and record.read_text() != '')
    assert not timed_out, output
    session = record.read_text()
    assert not session.startswith(str(tmpdir)), session
    assert _sessions(tmpdir) == []
    assert helpers.wait_until(lambda: not processes_with(str(record)), 10)


# ---- the ULFM startup check ---------------------------------------------------

CHECK_SCRIPT = '''
import sys
from chainer_prefetch.resilience import check_ulfm, ulfm_status, UlfmUnavailable
status = ulfm_status()
print('ACTIVE' if status.active else 'INACTIVE', status.reason, flush=True)
try:
    check_ulfm(sys.argv[1])
    print('CHECK PASSED', flush=True)
except UlfmUnavailable as error:
    print('CHECK FAILED:', error, flush=True)
'''


@pytest.mark.timeout(180)
def test_ulfm_check_sees_both_outcomes(tmp_path):
    script = tmp_path / 'check.py'
    script.write_text(CHECK_SCRIPT)
    _, output, _ = _run(_mpirun(1, [sys.executable, str(script), 'error']),
                        tmp_path)
    assert 'ACTIVE Open MPI' in output and 'CHECK PASSED' in output, output
    _, output, _ = _run(_mpirun(1, [sys.executable, str(script), 'error'],
                                ft=False), tmp_path)
    assert 'INACTIVE' in output and 'mpirun --with-ft ulfm' in output, output
    assert 'CHECK FAILED: ULFM is not active' in output, output
    _, output, _ = _run(_mpirun(1, [sys.executable, str(script), 'fallback'],
                                ft=False), tmp_path)
    assert 'falling back to checkpoint/restart' in output, output
    assert 'CHECK PASSED' in output, output


# ---- the communicator with ChainerMN's own functions -------------------------

COMMUNICATOR_SCRIPT = '''
import json, os, signal, sys
import numpy, chainer, chainermn
from chainer_prefetch.resilience import recovery, training
from chainer_prefetch.resilience.communicator import FaultTolerantCommunicator
from chainer_prefetch.resilience.errors import ProcessFailure
from chainer_prefetch.resilience.watchdog import WatchdogSettings

comm = FaultTolerantCommunicator(watchdog=WatchdogSettings(5, 30))
result = {}
data = list(range(50)) if comm.rank == 0 else None
shard = chainermn.scatter_dataset(data, comm, shuffle=True, seed=3)
result['shard_as_chainermn'] = (list(shard) == list(training.shard(
    list(range(50)), comm.size, comm.rank, 3)))
numpy.random.seed(comm.rank)  # different initial weights on every rank
model = chainer.links.Linear(3, 2)
optimizer = chainermn.create_multi_node_optimizer(
    chainer.optimizers.SGD(lr=0.1), comm)
optimizer.setup(model)
x = numpy.arange(12, dtype=numpy.float32).reshape(4, 3) * (comm.rank + 1)
for _ in range(3):  # the first update broadcasts (bcast_data), then mean
    optimizer.update(lambda: chainer.functions.sum(model(x)))
weights = comm.gather_obj(model.W.array)
weights_equal = comm.rank != 0 or all(
    numpy.array_equal(w, weights[0]) for w in weights)
result['weights_equal'] = comm.allreduce_obj(int(weights_equal)) == 3
result['allreduce_obj'] = comm.allreduce_obj(comm.rank)
classifier = chainer.links.Classifier(model)
evaluator = chainermn.create_multi_node_evaluator(
    chainer.training.extensions.Evaluator(
        chainer.iterators.SerialIterator(
            chainer.datasets.TupleDataset(x, numpy.zeros(4, numpy.int32)),
            2, repeat=False, shuffle=False), classifier), comm)
reporter = chainer.Reporter()
reporter.add_observer('main', classifier)
with reporter.scope({}):
    result['evaluation'] = sorted(evaluator.evaluate())
if comm.rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    for _ in range(10000):
        comm.allreduce_obj(1)
    result['failure'] = None
except ProcessFailure as failure:
    result['failure'] = [type(failure).__name__, failure.operation]
repair = recovery.shrink(comm)
result['after'] = [comm.size, comm.allreduce_obj(1), repair.failed]
with open(os.path.join(sys.argv[1], 'rank{}.json'.format(comm.rank)), 'w') as f:
    json.dump(result, f)
comm.close()
'''


@pytest.mark.timeout(180)
def test_communicator_survivors_raise_the_same_failure(tmp_path):
    script = tmp_path / 'communicator.py'
    script.write_text(COMMUNICATOR_SCRIPT)
    returncode, output, _ = _run(
        _mpirun(3, [sys.executable, str(script), str(tmp_path)]), tmp_path)
    results = [json.loads((tmp_path / 'rank{}.json'.format(r)).read_text())
               for r in range(2)]
    assert not (tmp_path / 'rank2.json').exists()
    for result in results:
        assert result['shard_as_chainermn'], result
        assert result['weights_equal'], result
        assert result['allreduce_obj'] == 3
        assert result['evaluation'] == ['main/accuracy', 'main/loss']
        # allreduce_obj runs an allgather (which a revoke reaches).
        assert result['failure'] == ['ProcessFailure', 'allgather'], output
        assert result['after'] == [2, 2, [2]], output


# ---- the ImageNet example with each strategy ----------------------------------

def _example(tmp_path, n, strategy, *extra, ft=True, launcher=False,
             timeout=RUN_TIMEOUT, start_method='fork'):
    data = tmp_path / 'data'
    if not data.exists():
        helpers.make_colour_dataset(str(data), n_train=24, n_val=8)
    out = tmp_path / 'out'
    arguments = [sys.executable, mpi_launch.TRAIN_SCRIPT,
                 str(data / 'train.txt'), str(data / 'val.txt'),
                 '--root', str(data), '--arch', 'tiny', '--crop-size', '32',
                 '--batchsize', '8', '--epoch', '3', '--loaderjob', '1',
                 '--iterator', 'multiprocess', '--start-method', start_method,
                 '--out', str(out), '--fault-tolerance', strategy,
                 '--stop-timeout', '2', '--call-timeout', '20'] + list(extra)
    command = _mpirun(n, arguments, ft=ft)
    if launcher:
        command = [sys.executable, '-m', 'chainer_prefetch.resilience.launcher',
                   '--max-restarts', '2', '--timeout', '100', '--'] + command
    returncode, output, elapsed = _run(command, tmp_path, timeout)
    return returncode, output, elapsed, read_events(
        str(out / 'ft_events.jsonl'))


def _failure(mode, rank, iteration):
    """Options that make ``rank`` fail (``mode``) after ``iteration``."""
    return ['--inject-failure', mode, '--inject-rank', str(rank),
            '--inject-iteration', str(iteration)]


def _of(events, name):
    return [e for e in events if e['event'] == name]


@pytest.mark.timeout(180)
def test_respawn_after_kill_gives_identical_parameters(tmp_path):
    # The replacement is spawned at the failure (no spares); every process
    # starts its workers from its own fork server, which it starts after its
    # supervisor's fork.
    returncode, output, _, events = _example(
        tmp_path, 3, 'respawn', *_failure('kill', 1, 4),
        start_method='forkserver')
    assert returncode == 0, output[-5000:]
    assert [e['rank'] for e in _of(events, 'failure')] == [1]
    recovered = _of(events, 'recovered')
    assert sorted(e['rank'] for e in recovered) == [0, 2]
    assert all(e['size'] == 3 and e['failed'] == [1] for e in recovered)
    assert [e['rank'] for e in _of(events, 'joined')] == [1]
    finished = _of(events, 'finished')
    assert sorted(e['rank'] for e in finished) == [0, 1, 2], output[-5000:]
    assert len({e['params_sha1'] for e in finished}) == 1, finished
    assert len({e['iteration'] for e in finished}) == 1


@pytest.mark.timeout(180)
def test_shrink_continues_at_size_two(tmp_path):
    returncode, output, _, events = _example(
        tmp_path, 3, 'shrink', *_failure('kill', 0, 4))
    assert returncode == 0, output[-5000:]
    recovered = _of(events, 'recovered')
    assert sorted(e['old_rank'] for e in recovered) == [1, 2]
    for e in recovered:
        assert (e['size_before'], e['size'], e['failed']) == (3, 2, [0])
        assert e['lr'] == pytest.approx(e['lr_before'] * 2 / 3)  # linear
    finished = _of(events, 'finished')
    assert len(finished) == 2 and all(e['size'] == 2 for e in finished)
    assert len({e['params_sha1'] for e in finished}) == 1
    # The new rank 0 (old rank 1) reports validation after the loss of 0.
    assert _of(events, 'validation')[-1]['time'] > recovered[0]['time']


@pytest.mark.timeout(180)
def test_checkpoint_restart_resumes_from_its_snapshot(tmp_path):
    # No supervisor here: the fork server is started as before.
    returncode, output, _, events = _example(
        tmp_path, 2, 'checkpoint', '--snapshot-interval', '3',
        *_failure('kill', 1, 7), ft=False, launcher=True,
        start_method='forkserver')
    assert returncode == 0, output[-5000:]
    assert 'launch 0 failed' in output
    starts = _of(events, 'start')
    assert sorted((e['restart'], e['rank']) for e in starts) == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    resumed = _of(events, 'resumed')
    assert [e['snapshot'] for e in resumed] == ['snapshot_iter_6'] * 2
    assert all(e['iteration'] == 6 for e in resumed)
    finished = _of(events, 'finished')
    assert len(finished) == 2 and len({e['params_sha1'] for e in finished}) == 1


@pytest.mark.timeout(180)
def test_injected_hang_is_recovered_within_its_bound(tmp_path):
    returncode, output, elapsed, events = _example(
        tmp_path, 3, 'shrink', *_failure('stop', 2, 3))
    assert returncode == 0, output[-5000:]
    assert 'has been stopped for' in output
    failure = _of(events, 'failure')[0]
    recovered = _of(events, 'recovered')
    assert len(recovered) == 2
    # --stop-timeout 2 plus detection and repair.
    assert recovered[0]['time'] - failure['time'] < 2 + 5
    assert all(e['size'] == 2 for e in _of(events, 'finished'))


@pytest.mark.timeout(180)
def test_without_ulfm_respawn_fails_clearly_or_falls_back(tmp_path):
    returncode, output, _, _ = _example(tmp_path, 2, 'respawn', ft=False)
    assert returncode != 0
    assert 'ULFM is not active' in output and '--with-ft ulfm' in output
    returncode, output, _, events = _example(
        tmp_path, 2, 'respawn', '--ulfm-missing', 'fallback',
        '--snapshot-interval', '5', ft=False)
    assert returncode == 0, output[-5000:]
    assert 'falling back to checkpoint/restart' in output
    assert {e['strategy'] for e in _of(events, 'start')} >= {'checkpoint'}
    assert (tmp_path / 'out' / 'snapshot_iter_5').exists()


# ---- a supervised rank that raises ends the job -----------------------------------

class _FakeMPI:
    """What the supervised rank's excepthook reads of ``mpi4py.MPI``."""

    def __init__(self, initialized, finalized=False):
        self.initialized, self.finalized = initialized, finalized
        self.aborted = []
        self.COMM_WORLD = self

    def Is_initialized(self):
        return self.initialized

    def Is_finalized(self):
        return self.finalized

    def Abort(self, status):
        self.aborted.append(status)


@pytest.mark.parametrize('state, aborted', [
    (None, []),                 # MPI not imported: never initialised here
    ((False, False), []),
    ((True, True), []),         # finalized
    ((True, False), [supervisor.ABORT_STATUS]),
])
def test_supervised_rank_aborts_the_job_only_with_mpi_running(
        monkeypatch, capsys, state, aborted):
    monkeypatch.delitem(sys.modules, 'mpi4py.MPI', raising=False)
    mpi = None
    if state is not None:
        mpi = _FakeMPI(*state)
        monkeypatch.setitem(sys.modules, 'mpi4py.MPI', mpi)
    printed = []
    hook = supervisor.abort_job_on_exception(
        'rank 3', lambda *exc_info: printed.append(exc_info[0]))
    hook(ValueError, ValueError('bad data'), None)
    assert printed == [ValueError]  # printed first, as before
    assert (mpi.aborted if mpi else []) == aborted
    assert ('rank 3 (pid {}) raised ValueError; ending the job with '
            'MPI_Abort'.format(os.getpid()) in capsys.readouterr().err) \
        == bool(aborted)
    assert state is not None or 'mpi4py.MPI' not in sys.modules


# ---- the commands of docs/fault_tolerance.rst, "Running it" ----------------------

DOCUMENTED_RUN_TIMEOUT = 420
"""The documented run trains 3 epochs of 960 images: about 45 s on 2
cores with nothing else running."""


def _documented(program):
    """The command of the first literal block of "Running it" in
    docs/fault_tolerance.rst that runs ``program`` (its first word or the
    module after ``python -m``), split into words."""
    block = documented.literal_block('fault_tolerance.rst', 'Running it')
    for command in documented.commands(block):
        words = documented.words(command)
        if words[0] == program or words[1:3] == ['-m', program]:
            return words
    raise AssertionError('{} not in "Running it" of docs/fault_tolerance.rst'
                         .format(program))


def _here(command, tmp_path):
    """``command`` as it runs in ``tmp_path`` (its working directory) on this
    machine: ``mpirun`` and ``python`` are this environment's, and the
    example is reached through ``tmp_path/examples``, a link to the
    repository's, so that every process of the run names ``tmp_path``.  The
    arguments are the documented ones."""
    examples = tmp_path / 'examples'
    if not examples.exists():
        examples.symlink_to(os.path.join(mpi_launch.REPO, 'examples'))
    programs = {'mpirun': mpi_launch.mpiexec_path(),
                'python': sys.executable}
    return [programs.get(word) or (str(tmp_path / word)
                                   if word.startswith('examples/') else word)
            for word in command]


def _documented_data(tmp_path):
    """Generates the documented data set in ``tmp_path/data``."""
    subprocess.run(_here(_documented('chainer_prefetch_bench.fault.gratings'),
                         tmp_path),
                   cwd=str(tmp_path), check=True, timeout=120)


def _replaced(command, option, value):
    """``command`` with ``option``'s value replaced by ``value``."""
    at = command.index(option) + 1
    return command[:at] + [value] + command[at + 1:]


@pytest.mark.timeout(DOCUMENTED_RUN_TIMEOUT + 120)
def test_documented_ulfm_command_recovers_with_the_default_start_method(
        tmp_path):
    command = _documented('mpirun')
    # Workers come from the fork server (the default), started by each rank
    # after its supervisor's fork; the spares (MPI_Comm_spawn) too.
    assert '--start-method' not in command
    assert '--spares' in command
    _documented_data(tmp_path)
    returncode, output, _ = _run(_here(command, tmp_path), tmp_path,
                                 timeout=DOCUMENTED_RUN_TIMEOUT)
    assert returncode == 0, output[-5000:]
    assert 'No child processes' not in output, output[-5000:]
    events = read_events(str(tmp_path / 'result' / 'ft_events.jsonl'))
    assert [(e['rank'], e['iteration']) for e in _of(events, 'failure')] \
        == [(1, 20)]
    recovered = _of(events, 'recovered')
    assert sorted(e['rank'] for e in recovered) == [0, 2], output[-5000:]
    assert all((e['failed'], e['from_spares']) == ([1], 1)
               for e in recovered), recovered
    assert [e['rank'] for e in _of(events, 'joined')] == [1]
    finished = _of(events, 'finished')
    assert sorted(e['rank'] for e in finished) == [0, 1, 2], output[-5000:]
    assert len({e['params_sha1'] for e in finished}) == 1, finished
    assert {e['iteration'] for e in finished} == {120}  # 3 epochs of 40


@pytest.mark.timeout(300)
def test_mpirun_exits_non_zero_when_every_rank_fails(tmp_path):
    # The documented command with crops larger than the 40x40 images: every
    # rank raises at its first batch.  Each is fenced, and ULFM's mpirun
    # leaves ranks killed by a signal out of its status, so the ranks end
    # the job with MPI_Abort.
    _documented_data(tmp_path)
    command = _replaced(_documented('mpirun'), '--crop-size', '48')
    returncode, output, _ = _run(_here(command, tmp_path), tmp_path,
                                 timeout=200)
    assert returncode != 0, output[-5000:]
    assert 'is smaller than the crop size 48' in output, output[-5000:]
    assert 'ending the job with MPI_Abort (status 1)' in output, \
        output[-5000:]
    events = read_events(str(tmp_path / 'result' / 'ft_events.jsonl'))
    assert _of(events, 'finished') == []
