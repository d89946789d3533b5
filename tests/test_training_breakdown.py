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
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, 'examples', 'imagenet')
SCRIPT = os.path.join(EXAMPLE, 'train_imagenet.py')
JOBS = os.path.join(REPO, 'scripts', 'jobs')
COMPONENTS = ('load', 'forward', 'backward', 'allreduce', 'other')
TIMEOUT = 240


def _load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _make_dataset(root, n_train=32, n_val=16, size=40, n_class=4, seed=0):
    """Small noisy JPEGs; returns (train list, val list)."""
    rng = np.random.default_rng(seed)
    lists = []
    for split, n in (('train', n_train), ('val', n_val)):
        lines = []
        for i in range(n):
            label = i % n_class
            rel = '{}/c{}/{:03d}.JPEG'.format(split, label, i)
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            pixels = rng.integers(0, 256, (size, size, 3)).astype(np.uint8)
            Image.fromarray(pixels).save(path, quality=90)
            lines.append('{} {}\n'.format(rel, label))
        path = os.path.join(root, split + '.txt')
        with open(path, 'w') as f:
            f.writelines(lines)
        lists.append(path)
    return lists


def _mpiexec():
    candidate = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if os.path.exists(candidate):
        return candidate
    found = shutil.which('mpiexec')
    if found is None:
        pytest.skip('mpiexec not found')
    return found


def _env():
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(
        [REPO] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
    env['PATH'] = os.pathsep.join(
        [os.path.dirname(sys.executable), env.get('PATH', '')])
    if hasattr(os, 'geteuid') and os.geteuid() == 0:
        env['OMPI_ALLOW_RUN_AS_ROOT'] = '1'
        env['OMPI_ALLOW_RUN_AS_ROOT_CONFIRM'] = '1'
    return env


def _run(cmd, cwd, env=None):
    proc = subprocess.Popen(cmd, cwd=str(cwd), env=env or _env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail('timed out after {} s:\n{}'.format(
            TIMEOUT, output.decode(errors='replace')[-5000:]))
    output = output.decode(errors='replace')
    assert proc.returncode == 0, output[-5000:]
    return output


# ---------------------------------------------------------------- MPI run


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_breakdown_two_ranks_prefetch(tmp_path):
    data = str(tmp_path / 'data')
    train_list, val_list = _make_dataset(data)
    out = tmp_path / 'out'
    output = _run([_mpiexec(), '--oversubscribe', '-n', '2', sys.executable,
                   SCRIPT, train_list, val_list, '--root', data,
                   '--out', str(out), '--arch', 'tiny', '--crop-size', '32',
                   '--batchsize', '4', '--val_batchsize', '8',
                   '--loaderjob', '1', '--epoch', '2',
                   '--iterator', 'prefetch',
                   '--local-dir', str(tmp_path / 'local'),
                   '--copy-threads', '2'], tmp_path)

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


def test_job_script_headers():
    with open(os.path.join(JOBS, 'pbs.sh')) as f:
        pbs = f.read()
    with open(os.path.join(JOBS, 'slurm.sh')) as f:
        slurm = f.read()
    assert '#PBS -l select=' in pbs
    assert '#SBATCH --nodes=' in slurm and '--ntasks-per-node=4' in slurm
    for text in (pbs, slurm):
        assert 'LOCAL_DIR=${LOCAL_DIR:-' in text
        assert 'ppr:$PROCS_PER_NODE:node' in text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_job_script_runs(tmp_path):
    data = str(tmp_path / 'data')
    _make_dataset(data, n_train=16, n_val=8)
    env = _env()
    env.update(K='2', EPOCHS='1', DATA_ROOT=data, OUT=str(tmp_path / 'out'),
               LOCAL_DIR=str(tmp_path / 'local'), PYTHON=sys.executable,
               MPIEXEC=_mpiexec(), BATCHSIZE='4')
    _run(['bash', os.path.join(JOBS, 'local.sh')], tmp_path, env)
    assert (tmp_path / 'out' / 'time_breakdown_rank1.json').exists()
    with open(str(tmp_path / 'out' / 'log')) as f:
        assert [entry['epoch'] for entry in json.load(f)] == [1]


# ---------------------------------------------------------------- unit


class _Clock(object):
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_breakdown_accounting():
    module = _load_module('time_breakdown_under_test',
                          os.path.join(EXAMPLE, 'time_breakdown.py'))
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
    breakdown.end_epoch()
    # Epoch 2: one iteration, closed by the next start only.
    breakdown.start_iteration(2)
    breakdown.add('load', 0.5)
    clock.now += 2.0
    assert breakdown.current_epoch()['other'] == pytest.approx(1.5)
    breakdown.end_iteration()
    breakdown.end_epoch()

    data = breakdown.to_dict()
    first, second = data['epochs']
    assert first['epoch'] == 1 and second['epoch'] == 2
    assert first['load'] == 5.0 and first['forward'] == 4.0
    assert first['backward'] == 6.0 and first['allreduce'] == 1.0
    assert first['other'] == pytest.approx(20.0 - 16.0)
    assert first['detail']['update'] == 0.5
    assert sum(first[k] for k in COMPONENTS) == pytest.approx(first['wall'])
    assert data['first_iteration_load'] == 4.0
    assert data['second_iteration_load'] == 1.0
    assert data['totals']['iterations'] == 3
    assert data['totals']['wall'] == pytest.approx(22.0)


def test_communicator_wrapper_times_allreduce_once():
    module = _load_module('time_breakdown_under_test2',
                          os.path.join(EXAMPLE, 'time_breakdown.py'))
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


def test_plot_training_from_synthetic_raw(tmp_path):
    """The figures and tables from a hand-made raw.json (no training)."""
    plot = _load_module('plot_training_under_test',
                        os.path.join(REPO, 'scripts', 'plot_training.py'))

    def breakdown(scale, first_load):
        epochs = []
        for e in (1, 2):
            rec = dict(epoch=e, iterations=5, load=(3.0 if e == 1 else 0.1)
                       * scale, forward=1.0, backward=1.5, allreduce=0.2,
                       other=0.5 * scale, detail={})
            rec['wall'] = sum(rec[k] for k in COMPONENTS)
            epochs.append(rec)
        totals = {k: sum(r[k] for r in epochs)
                  for k in COMPONENTS + ('wall', 'iterations')}
        return dict(epochs=epochs, totals=totals,
                    first_iteration_load=first_load,
                    second_iteration_load=0.01)

    runs = []
    for k in (1, 2):
        for method, scale in (('baseline-local', 1.0),
                              ('baseline-remote', 3.0), ('proposed', 1.2)):
            bds = [breakdown(scale, 0.5 * scale) for _ in range(k)]
            runs.append(dict(method=method, procs=k, returncode=0,
                             timed_out=False, breakdown=bds,
                             wall_seconds=bds[0]['totals']['wall'] + 2))
    raw = dict(config=dict(epochs=2, batchsize=8),
               dataset=dict(train_mean_bytes=110000.0),
               copy=dict(seconds=1.5, files=20, bytes=2200000, ways=8,
                         files_per_second=13.3), runs=runs)
    raw_path = tmp_path / 'raw.json'
    raw_path.write_text(json.dumps(raw))
    assert plot.main([str(raw_path), '--out', str(tmp_path)]) == 0
    for name in ('fig7_total_time.png', 'fig8_total_with_copy.png',
                 'fig9_breakdown_baseline-local.png',
                 'fig10_breakdown_baseline-remote.png',
                 'fig11_breakdown_proposed.png', 'table4.txt', 'tableA.txt',
                 'targets.txt'):
        assert (tmp_path / name).stat().st_size > 0, name
    targets = (tmp_path / 'targets.txt').read_text()
    assert 'epoch-1 time proposed / baseline-local' in targets
    assert 'first-iteration load proposed / baseline-remote' in targets
