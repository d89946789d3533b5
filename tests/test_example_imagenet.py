"""End-to-end runs of examples/imagenet/train_imagenet.py under MPI.

Real runs, no mocks: a small labelled JPEG dataset is written into
``tmp_path`` and the example trains on it with ``mpiexec -n 2`` on the CPU.
The training tests use images whose class is their colour, so that the loss
falls within three epochs whatever the random crops and initialisation.
"""
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import helpers
from chainer_prefetch_bench.testbed import jpeg_dataset as make_dataset
from chainer_prefetch_bench.testbed import mpi_launch

TIMEOUT = 300
EXAMPLE = os.path.join(mpi_launch.REPO, 'examples', 'imagenet')


def _train(tmp_path, train_list, val_list, root, *options):
    """Run the example under ``mpiexec -n 2``; return (log entries, output)."""
    out = tmp_path / 'out'
    output = helpers.run_mpi(mpi_launch.train_command(2, [
        train_list, val_list, '--root', root, '--out', str(out),
        '--arch', 'tiny', '--crop-size', '32', '--batchsize', '8',
        '--val_batchsize', '16', '--loaderjob', '1'] + list(options)),
        str(tmp_path), TIMEOUT)
    with open(str(out / 'log')) as f:
        return json.load(f), output


def _check_learns(log, output, epochs=3):
    assert [entry['epoch'] for entry in log] == list(range(1, epochs + 1)), \
        output[-3000:]
    for entry in log:
        assert 'validation/main/accuracy' in entry, entry
        assert 0.0 <= entry['validation/main/accuracy'] <= 1.0
        assert 'elapsed_time' in entry
    assert log[-1]['main/loss'] < log[0]['main/loss'], log
    # Four classes: chance is 0.25; the colours are trivial to tell apart.
    assert log[-1]['validation/main/accuracy'] > 0.5, log


@pytest.mark.slow
def test_train_prefetch_iterator(tmp_path):
    data = tmp_path / 'data'
    train_list, val_list = helpers.make_colour_dataset(str(data))
    log, output = _train(
        tmp_path, train_list, val_list, str(data), '--epoch', '3',
        '--iterator', 'prefetch', '--local-dir', str(tmp_path / 'local'),
        '--copy-threads', '2')
    _check_learns(log, output)
    assert 'Iterator: prefetch' in output
    # The images were staged: copies of at least every training image.
    staged = [name for _, _, names in os.walk(str(tmp_path / 'local'))
              for name in names if name.endswith('.JPEG')]
    assert len(staged) >= 4 * 48, len(staged)


@pytest.mark.slow
def test_train_multiprocess_iterator_fork(tmp_path):
    data = tmp_path / 'data'
    train_list, val_list = helpers.make_colour_dataset(str(data))
    log, output = _train(
        tmp_path, train_list, val_list, str(data), '--epoch', '3',
        '--iterator', 'multiprocess', '--start-method', 'fork')
    _check_learns(log, output)
    assert 'Iterator: multiprocess, start method: fork' in output


@pytest.mark.slow
def test_generated_dataset_with_mean_and_resume(tmp_path):
    """ImageNet-like files of mixed sizes, a (3, 256, 256) mean, --resume.

    Also the prefetch iterator with the ``fork`` start method (the first
    test uses the default, ``forkserver``).

    It checks that training runs, reports, snapshots and resumes.
    """
    data = tmp_path / 'data'
    make_dataset.generate(str(data), 32, 4, 0, val_images=16,
                          mean_size=20000, workers=1, progress=False)
    assert np.load(str(data / 'mean.npy')).shape == (3, 256, 256)
    args = (str(data / 'train.txt'), str(data / 'val.txt'), str(data),
            '--mean', str(data / 'mean.npy'), '--iterator', 'prefetch',
            '--local-dir', str(tmp_path / 'local'), '--start-method', 'fork')
    log, output = _train(tmp_path, *args, '--epoch', '1')
    assert [entry['epoch'] for entry in log] == [1], output[-3000:]
    snapshot = tmp_path / 'out' / 'snapshot_epoch_1'
    assert snapshot.exists()
    log, output = _train(tmp_path, *args, '--epoch', '2',
                         '--resume', str(snapshot))
    assert [entry['epoch'] for entry in log] == [1, 2], output[-3000:]
    assert log[1]['iteration'] == 2 * log[0]['iteration']
    assert 'validation/main/accuracy' in log[1]


@pytest.mark.slow
def test_train_with_a_capacity_limit_and_the_next_epoch_cache(tmp_path):
    """Half the data fits locally; the next epoch's first examples stay in memory."""
    data = tmp_path / 'data'
    train_list, val_list = helpers.make_colour_dataset(str(data))
    images = [os.path.join(folder, name) for folder, _, names
              in os.walk(str(data)) for name in names if name.endswith('.JPEG')]
    limit = sum(os.path.getsize(path) for path in images) // 2
    local = tmp_path / 'local'
    log, output = _train(
        tmp_path, train_list, val_list, str(data), '--epoch', '3',
        '--iterator', 'prefetch', '--local-dir', str(local),
        '--copy-threads', '2', '--local-capacity', str(limit),
        '--next-epoch-cache', '8', '--time-breakdown')
    _check_learns(log, output)
    staged = sum(os.path.getsize(os.path.join(folder, name))
                 for folder, _, names in os.walk(str(local / 'data'))
                 for name in names)
    assert staged <= limit
    evicted = cached = 0
    for rank in (0, 1):
        with open(str(tmp_path / 'out' / 'time_breakdown_rank{}.json'.format(
                rank))) as f:
            stats = json.load(f)['iterator_stats']
        evicted += stats['files_evicted']
        cached += stats['next_epoch_cache']['hits']
    assert evicted > 0 and cached > 0


def _in_example(code):
    """Run ``code`` with the example's folder as the working directory.

    ``python -c`` imports from its working directory, as ``python
    train_imagenet.py`` does from the script's folder.
    """
    result = subprocess.run([sys.executable, '-c', textwrap.dedent(code)],
                            cwd=EXAMPLE, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_sizes_are_parsed_with_units():
    output = _in_example('''
        import train_imagenet
        assert train_imagenet.parse_bytes('200G') == 200 * 2 ** 30
        assert train_imagenet.parse_bytes('1.5m') == int(1.5 * 2 ** 20)
        assert train_imagenet.parse_bytes('4096') == 4096
        try:
            train_imagenet.parse_bytes('lots')
        except Exception as error:
            print('refused:', error)
        ''')
    assert "refused: not a size: 'LOTS'" in output


def test_default_loaderjob_is_the_share_of_the_cores():
    output = _in_example('''
        from node_resources import default_loaderjob
        shared = set(range(16))
        # 8 ranks free to use all 16 cores: 2 each, not 16 each.
        print(default_loaderjob(shared, [shared] * 8))
        # Each rank bound to its own 4 cores: all 4.
        own = [set(range(4 * r, 4 * r + 4)) for r in range(4)]
        print(default_loaderjob(own[1], own))
        # More ranks than cores: still one loader.
        print(default_loaderjob({0, 1}, [{0, 1}] * 4))
        # Two pairs of ranks, each pair bound to one socket of 8 cores.
        sockets = [set(range(8))] * 2 + [set(range(8, 16))] * 2
        print(default_loaderjob(sockets[2], sockets))
        ''')
    assert output.split() == ['2', '4', '1', '4']


@pytest.mark.slow
def test_defaults_share_the_cores_and_leave_the_run_uninstrumented(tmp_path):
    """No --loaderjob, no --time-breakdown; --pinned-copy passes through on the CPU."""
    data = tmp_path / 'data'
    train_list, val_list = helpers.make_colour_dataset(str(data))
    out = tmp_path / 'out'
    output = helpers.run_mpi(mpi_launch.train_command(2, [
        train_list, val_list, '--root', str(data), '--out', str(out),
        '--arch', 'tiny', '--crop-size', '32', '--batchsize', '8',
        '--val_batchsize', '16', '--epoch', '3', '--pinned-copy',
        '--local-dir', str(tmp_path / 'local'), '--copy-threads', '2']),
        str(tmp_path), TIMEOUT)
    with open(str(out / 'log')) as f:
        log = json.load(f)
    _check_learns(log, output)
    cpus = len(os.sched_getaffinity(0))  # mpi_launch binds to no core
    expected = max(1, cpus // 2)
    assert ('Loader processes per rank: {} (default; {} CPUs available to '
            'rank 0, 2 ranks on its node)'.format(expected, cpus)) in output
    assert 'Pinned copy: pass-through (CPU device: nothing to copy)' in output
    assert not list(out.glob('time_breakdown_rank*.json'))
    assert not any(key.startswith('time/') for key in log[0])


@pytest.mark.slow
def test_shuffle_across_ranks_with_peers_on_two_simulated_nodes(tmp_path):
    """Two ranks, each its own "node" (its own local directory, one MPI
    application context each): every file comes from shared storage about
    once per job, the rest from the other node; a snapshot written by rank
    0 resumes both ranks."""
    data = tmp_path / 'data'
    train_list, val_list = helpers.make_colour_dataset(str(data))
    out = tmp_path / 'out'

    def run(*options):
        common = [train_list, val_list, '--root', str(data), '--out',
                  str(out), '--arch', 'tiny', '--crop-size', '32',
                  '--batchsize', '8', '--val_batchsize', '16',
                  '--loaderjob', '1', '--copy-threads', '2',
                  '--shuffle-across-ranks', '--peers'] + list(options)
        command = [mpi_launch.mpiexec_path(), '--oversubscribe', '--bind-to',
                   'none']
        for node in ('a', 'b'):
            if node == 'b':
                command.append(':')
            command += ['-n', '1', sys.executable, mpi_launch.TRAIN_SCRIPT] + \
                common + ['--local-dir', str(tmp_path / node)]
        output = helpers.run_mpi(command, str(tmp_path), TIMEOUT)
        with open(str(out / 'log')) as f:
            return json.load(f), output

    log, output = run('--epoch', '2')
    assert [entry['epoch'] for entry in log] == [1, 2], output[-3000:]
    reports = [line for line in output.splitlines()
               if ' bytes from peers ' in line]
    assert len(reports) == 2, output[-3000:]
    from_source = sum(int(re.search(r'(\d+) bytes from shared', line)
                          .group(1)) for line in reports)
    from_peers = sum(int(re.search(r'(\d+) bytes from peers', line)
                         .group(1)) for line in reports)
    with open(train_list) as f:
        dataset_bytes = sum(os.path.getsize(os.path.join(
            str(data), line.split()[0])) for line in f)
    assert from_peers > 0, output[-3000:]
    # Each file once from shared storage (a few twice: read by one node
    # before the other had finished its copy), never once per node.
    assert from_source < 1.5 * dataset_bytes, (from_source, dataset_bytes)
    assert from_source + from_peers >= dataset_bytes
    assert 'peers down: none' in reports[0] and 'peers down: none' in reports[1]
    log, output = run('--epoch', '3', '--resume',
                      str(out / 'snapshot_epoch_2'))
    assert [entry['epoch'] for entry in log] == [1, 2, 3], output[-3000:]
    assert log[2]['iteration'] == 3 * log[0]['iteration']
