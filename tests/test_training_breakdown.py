"""The per-iteration time breakdown of examples/imagenet, and the job scripts.

Real runs, no mocks: ``mpiexec -n 2`` trains the tiny network for two
epochs on a small JPEG dataset written into ``tmp_path`` with the prefetch
iterator, and the per-rank JSON and the LogReport log are checked.  The
unit tests of ``TimeBreakdown`` use a hand-driven clock.
"""
import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import helpers
from chainer_prefetch_bench.testbed import mpi_launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, 'examples', 'imagenet')
JOBS = os.path.join(REPO, 'scripts', 'jobs')
COMPONENTS = ('load', 'forward', 'backward', 'allreduce', 'other')
DETAILS = ('convert', 'update', 'bcast', 'extensions')
TIMEOUT = 240


def _load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(command, cwd, env=None):
    if env is None:
        return helpers.run_mpi(command, str(cwd), TIMEOUT)
    returncode, output, timed_out = mpi_launch.run(command, TIMEOUT,
                                                   cwd=str(cwd), env=env)
    assert not timed_out and returncode == 0, output[-5000:]
    return output


# ---------------------------------------------------------------- MPI run


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_breakdown_two_ranks_prefetch(tmp_path):
    data = str(tmp_path / 'data')
    train_list, val_list = helpers.make_colour_dataset(data, n_train=8,
                                                       n_val=4)
    out = tmp_path / 'out'
    output = _run(mpi_launch.train_command(2, [
                   train_list, val_list, '--root', data,
                   '--out', str(out), '--arch', 'tiny', '--crop-size', '32',
                   '--batchsize', '4', '--val_batchsize', '8',
                   '--loaderjob', '1', '--epoch', '2', '--time-breakdown',
                   '--iterator', 'prefetch',
                   '--local-dir', str(tmp_path / 'local'),
                   '--copy-threads', '2']), tmp_path)

    results = {}
    for rank in (0, 1):
        path = out / 'time_breakdown_rank{}.json'.format(rank)
        assert path.exists(), output[-3000:]
        with open(str(path)) as f:
            result = json.load(f)
        results[rank] = result
        assert result['rank'] == rank and result['size'] == 2
        assert result['components'] == list(COMPONENTS)
        epochs = result['epochs']
        assert [e['epoch'] for e in epochs] == [1, 2], epochs
        for epoch in epochs:
            assert set(epoch) == set(COMPONENTS) | {
                'epoch', 'iterations', 'wall', 'detail'}, epoch
            assert set(epoch['detail']) == set(DETAILS), epoch
            # 16 examples per rank, batch 4.
            assert epoch['iterations'] == 4, epoch
            # Every iteration waits for a batch, computes, converts,
            # updates and runs the extensions: each of these takes time.
            for key in ('load', 'forward', 'backward', 'other'):
                assert epoch[key] > 0, (key, epoch)
            for key in ('convert', 'update', 'extensions'):
                assert epoch['detail'][key] > 0, (key, epoch)
            # The components split the wall time; the details are parts of
            # ``other``, timed over intervals apart from the components.
            total = sum(epoch[key] for key in COMPONENTS)
            assert total == pytest.approx(epoch['wall'], rel=1e-6), epoch
            assert sum(epoch['detail'].values()) <= epoch['other'] + 1e-6, \
                epoch
        # The multi-node optimizer broadcasts the parameters at its first
        # update and averages the gradients at every later one.
        assert epochs[0]['detail']['bcast'] > 0, epochs
        assert epochs[1]['detail']['bcast'] == 0, epochs
        assert epochs[0]['allreduce'] > 0 and epochs[1]['allreduce'] > 0, \
            epochs
        # The first two iterations belong to the first epoch.
        first, second = (result['first_iteration_load'],
                         result['second_iteration_load'])
        assert first > 0 and second > 0, result
        assert first + second <= epochs[0]['load'] + 1e-9, result
        assert result['first_iteration']['load'] == first
        assert sum(result['first_iteration'][key] for key in COMPONENTS) \
            == pytest.approx(result['first_iteration']['wall'], rel=1e-6)
        assert result['iterations'] == 8
        totals = result['totals']
        assert totals['iterations'] == 8
        for key in COMPONENTS + ('wall',):
            assert totals[key] == pytest.approx(
                sum(epoch[key] for epoch in epochs), rel=1e-6), key
        stats = result['iterator_stats']
        assert stats['files_copied'] + stats['files_already_local'] > 0
        assert stats['examples_from_local'] + stats['examples_from_source'] \
            >= 16

    # Rank 0's log has the epoch sums, reported at the epoch's last
    # iteration: the phases timed by then are those of the JSON; ``other``
    # and the wall time miss only the rest of that iteration's extensions.
    with open(str(out / 'log')) as f:
        log = json.load(f)
    assert [entry['epoch'] for entry in log] == [1, 2]
    for entry, epoch in zip(log, results[0]['epochs']):
        for key in ('load', 'forward', 'backward', 'allreduce'):
            assert entry['time/' + key] == pytest.approx(epoch[key],
                                                         rel=1e-6), key
        assert 0 < entry['time/other'] <= epoch['other'] + 1e-6, entry
        assert 0 < entry['time/wall'] <= epoch['wall'] + 1e-6, entry
        assert sum(entry['time/' + key] for key in COMPONENTS) == \
            pytest.approx(entry['time/wall'], rel=1e-6), entry
    # The printed report has the columns.
    assert 'time/load' in output and 'time/allreduce' in output


# ---------------------------------------------------------------- scripts


def _job_scripts():
    return sorted(glob.glob(os.path.join(JOBS, '*.sh')))


def test_job_scripts_exist():
    names = {os.path.basename(path) for path in _job_scripts()}
    assert {'local.sh', 'pbs.sh', 'slurm.sh'} <= names, names


@pytest.mark.parametrize('path', _job_scripts(),
                         ids=[os.path.basename(p) for p in _job_scripts()])
def test_job_script_syntax(path):
    result = subprocess.run(['bash', '-n', path], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=30)
    assert result.returncode == 0, result.stdout.decode(errors='replace')


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_job_script_runs(tmp_path):
    data = str(tmp_path / 'data')
    helpers.make_colour_dataset(data, n_train=4, n_val=2)
    env = mpi_launch.environment()
    env.update(K='2', EPOCHS='1', DATA_ROOT=data, OUT=str(tmp_path / 'out'),
               LOCAL_DIR=str(tmp_path / 'local'), PYTHON=sys.executable,
               MPIEXEC=mpi_launch.mpiexec_path(), BATCHSIZE='4')
    _run(['bash', os.path.join(JOBS, 'local.sh')], tmp_path, env)
    assert (tmp_path / 'out' / 'time_breakdown_rank1.json').exists()
    with open(str(tmp_path / 'out' / 'log')) as f:
        assert [entry['epoch'] for entry in json.load(f)] == [1]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize('scheduler', ['pbs', 'slurm'])
def test_cluster_job_scripts_run_on_one_node(tmp_path, scheduler):
    """pbs.sh / slurm.sh outside a scheduler: one node, CPU, 2 ranks."""
    data = str(tmp_path / 'data')
    helpers.make_colour_dataset(data, n_train=4, n_val=2)
    env = mpi_launch.environment()
    for name in list(env):
        if name.startswith(('PBS_', 'SLURM_')):
            del env[name]
    env.update(REPO=mpi_launch.REPO, DATA_ROOT=data, MEAN='',
               LOCAL_DIR=str(tmp_path / 'local'), OUT=str(tmp_path / 'out'),
               PROCS_PER_NODE='2', EPOCHS='1', ARCH='tiny', CROP_SIZE='32',
               BATCHSIZE='4', LOADERJOB='1', COPY_THREADS='2', GPU_ARGS='',
               PYTHON=sys.executable, MPIRUN=mpi_launch.mpiexec_path())
    _run(['bash', os.path.join(JOBS, scheduler + '.sh')], tmp_path, env)
    assert (tmp_path / 'out' / 'time_breakdown_rank1.json').exists()
    staged = [name for _, _, names in os.walk(str(tmp_path / 'local'))
              for name in names if name.endswith('.JPEG')]
    assert staged


# ---------------------------------------------------------------- unit


class _Clock(object):
    """A clock that moves only when the test moves it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _time_breakdown():
    return _load_module('time_breakdown_under_test',
                        os.path.join(EXAMPLE, 'time_breakdown.py'))


def test_time_breakdown_accounting():
    module = _time_breakdown()
    assert module.COMPONENTS == COMPONENTS and module.DETAILS == DETAILS
    clock = _Clock()
    breakdown = module.TimeBreakdown(clock=clock)
    # Epoch 1: two iterations of 10 s wall each.
    for load in (4.0, 1.0):
        breakdown.start_iteration(1)
        breakdown.add('load', load)
        breakdown.add('forward', 2.0)
        breakdown.add('backward', 3.0)
        breakdown.add('allreduce', 0.5)
        breakdown.add('update', 0.25)
        clock.now += 10.0
        breakdown.end_iteration()
    partial = breakdown.current_epoch()
    assert partial['iterations'] == 2 and partial['wall'] == 20.0
    # Epoch 2: one iteration; the open one counts in current_epoch.
    breakdown.start_iteration(2)
    breakdown.add('load', 0.5)
    clock.now += 2.0
    assert breakdown.current_epoch()['other'] == pytest.approx(1.5)
    assert breakdown.current_epoch()['iterations'] == 1
    breakdown.end_iteration()
    breakdown.end_epoch()

    data = breakdown.to_dict()
    first, second = data['epochs']
    assert first['epoch'] == 1 and second['epoch'] == 2
    assert first['load'] == 5.0 and first['forward'] == 4.0
    assert first['backward'] == 6.0 and first['allreduce'] == 1.0
    assert first['other'] == pytest.approx(20.0 - 16.0)
    assert first['detail'] == {'convert': 0.0, 'update': 0.5, 'bcast': 0.0,
                               'extensions': 0.0}
    assert sum(first[k] for k in COMPONENTS) == pytest.approx(first['wall'])
    assert data['first_iteration_load'] == 4.0
    assert data['second_iteration_load'] == 1.0
    assert data['first_iteration'] == {'load': 4.0, 'forward': 2.0,
                                       'backward': 3.0, 'allreduce': 0.5,
                                       'other': 0.5, 'wall': 10.0}
    assert data['iterations'] == data['totals']['iterations'] == 3
    assert data['totals']['wall'] == pytest.approx(22.0)


def test_an_iteration_nobody_closed_is_closed_by_the_next_one():
    clock = _Clock()
    breakdown = _time_breakdown().TimeBreakdown(clock=clock)
    breakdown.start_iteration(1)
    breakdown.add('load', 1.0)
    clock.now += 3.0
    breakdown.start_iteration(2)  # closes the first, files epoch 1
    clock.now += 1.0
    breakdown.end_iteration()
    breakdown.end_epoch()
    first, second = breakdown.to_dict()['epochs']
    assert (first['epoch'], first['wall'], first['other']) == (1, 3.0, 2.0)
    assert (second['epoch'], second['wall'], second['other']) == (2, 1.0, 1.0)
    # Outside an iteration nothing is charged, and an empty epoch is not filed.
    breakdown.add('load', 5.0)
    breakdown.end_epoch()
    assert len(breakdown.to_dict()['epochs']) == 2


def test_communicator_wrapper_times_allreduce_once():
    module = _time_breakdown()
    clock = _Clock()
    breakdown = module.TimeBreakdown(clock=clock)

    class Communicator(object):
        def multi_node_mean_grad(self, model, zero_fill=False):
            clock.now += 1.0

        def allreduce_grad(self, model, zero_fill=False):
            self.multi_node_mean_grad(model, zero_fill)  # nested: once

        def bcast_data(self, model):
            clock.now += 0.5

    comm = Communicator()
    module.time_communicator(comm, breakdown)
    breakdown.start_iteration(1)
    comm.multi_node_mean_grad(None)
    comm.allreduce_grad(None)
    comm.bcast_data(None)
    clock.now += 1.0
    breakdown.end_iteration()
    breakdown.end_epoch()
    epoch = breakdown.to_dict()['epochs'][0]
    assert epoch['allreduce'] == 2.0
    assert epoch['detail']['bcast'] == 0.5
    assert epoch['other'] == pytest.approx(1.5)
    assert epoch['wall'] == 3.5
