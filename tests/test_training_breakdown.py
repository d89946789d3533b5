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

    for rank in (0, 1):
        path = out / 'time_breakdown_rank{}.json'.format(rank)
        assert path.exists(), output[-3000:]
        with open(str(path)) as f:
            result = json.load(f)
        assert result['rank'] == rank and result['size'] == 2
        epochs = result['epochs']
        assert [e['epoch'] for e in epochs] == [1, 2], epochs
        for epoch in epochs:
            # 16 examples per rank, batch 4.
            assert epoch['iterations'] == 4, epoch
            for key in COMPONENTS:
                assert epoch[key] >= 0, (key, epoch)
            for key, value in epoch['detail'].items():
                assert value >= 0, (key, epoch)
            total = sum(epoch[key] for key in COMPONENTS)
            assert abs(total - epoch['wall']) <= max(0.1 * epoch['wall'],
                                                     0.05), epoch
            assert epoch['forward'] > 0 and epoch['backward'] > 0
        # Two ranks average gradients from the second iteration on.
        assert epochs[1]['allreduce'] > 0, epochs
        assert result['first_iteration_load'] > 0
        assert result['second_iteration_load'] is not None
        assert result['second_iteration_load'] >= 0
        assert result['first_iteration_load'] <= epochs[0]['load'] + 1e-9
        assert result['iterations'] == 8
        stats = result['iterator_stats']
        assert stats['files_copied'] + stats['files_already_local'] > 0
        assert stats['examples_from_local'] + stats['examples_from_source'] \
            >= 16

    with open(str(out / 'log')) as f:
        log = json.load(f)
    assert [entry['epoch'] for entry in log] == [1, 2]
    for entry in log:
        for key in COMPONENTS:
            assert 'time/' + key in entry, entry
            assert entry['time/' + key] >= 0
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
