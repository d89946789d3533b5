"""Every example exactly once per epoch through a shrink and restarts, with
the unmodified ImageNet example and real processes (``mpirun --with-ft
ulfm``).

Every training example carries its index (``--example-log``); the batches
of the committed updates are counted epoch by epoch
(``chainer_prefetch_bench.testbed.exactly_once``).  120 examples, 3 ranks,
batch 4: 10 updates per epoch, 3 epochs.
"""
import sys

import pytest

import helpers
from chainer_prefetch.resilience.injection import read_events
from chainer_prefetch_bench.testbed import exactly_once, mpi_launch
from test_resilience_mpi import _failure, _mpirun, _of, _run

pytestmark = pytest.mark.slow

EXAMPLES = 120
EPOCHS = 3


def _arguments(tmp_path, strategy, *extra):
    data = tmp_path / 'data'
    if not data.exists():
        helpers.make_colour_dataset(str(data), n_train=EXAMPLES // 4,
                                    n_val=4)
    return [sys.executable, mpi_launch.TRAIN_SCRIPT,
            str(data / 'train.txt'), str(data / 'val.txt'),
            '--root', str(data), '--arch', 'tiny', '--crop-size', '32',
            '--batchsize', '4', '--val_batchsize', '8',
            '--epoch', str(EPOCHS), '--loaderjob', '1',
            '--iterator', 'multiprocess', '--start-method', 'fork',
            '--out', str(tmp_path / 'out'), '--fault-tolerance', strategy,
            '--stop-timeout', '2', '--call-timeout', '20',
            '--example-log', str(tmp_path / 'examples.jsonl')] + list(extra)


def _counts(tmp_path):
    return exactly_once.report(
        str(tmp_path / 'examples.jsonl'),
        [str(tmp_path / 'out' / 'ft_events.jsonl')], EXAMPLES, EPOCHS)


def _assert_exactly_once(rows, padding):
    """No example missed in any epoch, and at most ``padding`` examples of
    an epoch used twice (the shorter parts after a change repeat one)."""
    assert all(row['never'] == 0 for row in rows), rows
    assert all(row['twice'] <= padding for row in rows), rows


@pytest.mark.timeout(240)
@pytest.mark.parametrize('at', [15, 13])
def test_shrink_mid_epoch_uses_every_example_once(tmp_path, at):
    """Rank 1 is killed after update 15 (half of epoch 1) or 13: the
    survivors train on exactly what the three had left."""
    returncode, output, _ = _run(_mpirun(3, _arguments(
        tmp_path, 'shrink', *_failure('kill', 1, at))), tmp_path, 200)
    assert returncode == 0, output[-5000:]
    events = read_events(str(tmp_path / 'out' / 'ft_events.jsonl'))
    assert [e['size'] for e in _of(events, 'recovered')] == [2, 2]
    # 60 left over 2 ranks: no padding; 3 ranks of 40: none either.
    _assert_exactly_once(_counts(tmp_path), padding=1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize('sizes', [(3, 3), (3, 2)], ids=['3to3', '3to2'])
def test_restart_from_a_mid_epoch_snapshot_at_any_size(tmp_path, sizes):
    """A snapshot after update 13 (epoch 1, 0.3), rank 1 killed after 16;
    the job is started again with the same arguments (no failure) at the
    same or another size and resumes from the snapshot, every rank with the
    group's progress, not rank 0's order."""
    first, second = sizes
    returncode, output, _ = _run(_mpirun(first, _arguments(
        tmp_path, 'checkpoint', '--snapshot-interval', '13',
        *_failure('kill', 1, 16)), ft=False), tmp_path, 200)
    assert returncode != 0, output[-3000:]
    returncode, output, _ = _run(_mpirun(second, _arguments(
        tmp_path, 'checkpoint', '--snapshot-interval', '13'), ft=False),
        tmp_path, 200)
    assert returncode == 0, output[-5000:]
    events = read_events(str(tmp_path / 'out' / 'ft_events.jsonl'))
    resumed = _of(events, 'resumed')
    assert [e['snapshot'] for e in resumed] == ['snapshot_iter_13'] * second
    _assert_exactly_once(_counts(tmp_path), padding=second - 1)
