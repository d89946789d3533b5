"""The recipes of docs/elastic.rst and docs/fault_tolerance.rst, run as
written (see ``documented.py``); the ULFM ``mpirun`` command of "Running
it" is run by ``test_resilience_mpi.py``."""
import glob
import os
import shutil

import pytest

from chainer_prefetch.resilience.injection import read_events
from documented import command_starting, literal_block, run_in_shell

pytestmark = pytest.mark.slow

MEMBERS_LOCAL_DIRS = ['/tmp/m0', '/tmp/m1', '/tmp/m2', '/tmp/m3']
"""The local directories the elastic recipe names."""


def _events(tmp_path, pattern):
    paths = glob.glob(str(tmp_path / pattern))
    assert len(paths) == 1, (pattern, paths)
    return read_events(paths[0])


def _one_model(finished, count):
    """``count`` processes finished with the same parameters."""
    assert len(finished) == count, finished
    assert len({e['params_sha1'] for e in finished}) == 1, finished


@pytest.mark.timeout(600)
def test_elastic_recipe_grows_the_job_from_two_to_four(tmp_path):
    pytest.importorskip('torch')
    pytest.importorskip('etcd3gw')
    for path in MEMBERS_LOCAL_DIRS:
        shutil.rmtree(path, ignore_errors=True)
    block = literal_block('elastic.rst', 'Trying it on one machine')
    try:
        returncode, output = run_in_shell(block, tmp_path, timeout=480)
    finally:
        for path in MEMBERS_LOCAL_DIRS:
            shutil.rmtree(path, ignore_errors=True)
    assert returncode == 0, output[-5000:]
    events = _events(tmp_path, 'result/elastic_events.jsonl')
    sizes = [e['size'] for e in events if e['event'] == 'resumed']
    assert 2 in sizes and sizes[-1] == 4, sizes
    _one_model([e for e in events if e['event'] == 'finished'], 4)
    assert not any(e['event'] == 'error' for e in events), events


def _fault_block():
    return literal_block('fault_tolerance.rst', 'Running it')


def _documented_data(block, tmp_path):
    returncode, output = run_in_shell(command_starting(
        block, 'python -m chainer_prefetch_bench.fault.gratings'),
        tmp_path, timeout=120)
    assert returncode == 0, output[-5000:]


@pytest.mark.timeout(600)
def test_job_script_command_trains_with_respawn(tmp_path):
    block = _fault_block()
    _documented_data(block, tmp_path)
    returncode, output = run_in_shell(
        command_starting(block, 'K=3 DATA_ROOT=data'), tmp_path, timeout=420)
    assert returncode == 0, output[-5000:]
    events = _events(tmp_path, 'result/local_multiprocess_k3/ft_events.jsonl')
    assert not any(e['event'] == 'failure' for e in events), events
    _one_model([e for e in events if e['event'] == 'finished'], 3)


@pytest.mark.timeout(600)
def test_launcher_command_trains_with_snapshots(tmp_path):
    block = _fault_block()
    _documented_data(block, tmp_path)
    returncode, output = run_in_shell(command_starting(
        block, 'python -m chainer_prefetch.resilience.launcher'), tmp_path,
        timeout=420)
    assert returncode == 0, output[-5000:]
    out = tmp_path / 'result' / 'local_multiprocess_k3'
    events = _events(tmp_path, 'result/local_multiprocess_k3/ft_events.jsonl')
    _one_model([e for e in events if e['event'] == 'finished'], 3)
    snapshots = sorted(os.path.basename(p)
                       for p in glob.glob(str(out / 'snapshot_iter_*')))
    assert snapshots == ['snapshot_iter_120', 'snapshot_iter_40',
                         'snapshot_iter_80'], os.listdir(str(out))
