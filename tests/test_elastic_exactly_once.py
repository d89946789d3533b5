"""Every example exactly once per epoch through elastic joins and losses,
with a real etcd and real member processes (``elastic_worker.py``).

Every example carries its index (``--example-log``); the batches of the
committed updates are counted epoch by epoch
(``chainer_prefetch_bench.testbed.exactly_once``).  240 examples, batch 8
per member, 5 epochs.
"""
import os
import signal

import pytest

pytest.importorskip('torch')
pytest.importorskip('etcd3gw')

from chainer_prefetch.elastic import EtcdServer  # NOQA: E402
from chainer_prefetch_bench.testbed import exactly_once  # NOQA: E402
from elastic_jobs import ElasticJob  # NOQA: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = 240
EPOCHS = 5


@pytest.fixture
def etcd():
    with EtcdServer() as server:
        yield server


def _job(etcd, tmp_path, *options):
    return ElasticJob(etcd.url('job'), tmp_path, '--ttl', '2', '--settle',
                      '1', '--iteration-sleep', '0.1', '--epochs',
                      str(EPOCHS), '--examples', str(EXAMPLES),
                      '--example-log', str(tmp_path / 'examples.jsonl'),
                      *options)


def _last_iteration(job):
    """The newest update any member attempted."""
    log = os.path.join(os.path.dirname(job.events_path), 'examples.jsonl')
    return max((r['iteration'] for r in exactly_once.read_events(log)
                if r['event'] == 'batch'), default=0)


def _counts(job, tmp_path):
    rows = exactly_once.report(str(tmp_path / 'examples.jsonl'),
                               [job.events_path], EXAMPLES, EPOCHS)
    assert all(row['never'] == 0 for row in rows), rows
    # The padding of equal shards (240 over 3: none) and the shorter parts
    # of the rest after each change (at most size - 1 each).
    assert all(row['twice'] <= 4 for row in rows), rows
    return rows


def _finished(job, codes, expected):
    assert sorted(codes) == sorted(expected), [
        job.stderr_of(p)[-2000:] for p in job.processes]


def test_a_join_mid_epoch_trains_every_example_once(etcd, tmp_path):
    job = _job(etcd, tmp_path)
    try:
        first = [job.start(), job.start()]
        job.wait_for(lambda j: all(2 in j.resumed_sizes(p.pid)
                                   for p in first), 60, 'two training')
        job.wait_for(lambda j: _last_iteration(j) >= 20, 60, 'epoch 1')
        job.start()
        codes = job.wait(180)
    finally:
        job.kill_all()
    _finished(job, codes, [0, 0, 0])
    assert any(e['size'] == 3 for e in job.events('resumed'))
    _counts(job, tmp_path)
    job.assert_clean(etcd)


def test_a_member_killed_mid_epoch_loses_no_example(etcd, tmp_path):
    job = _job(etcd, tmp_path, '--hold-until-size', '3')
    try:
        job.start()
        job.start('--kill-after-iteration', '14')
        job.start()
        codes = job.wait(180)
    finally:
        job.kill_all()
    _finished(job, codes, [0, 0, -signal.SIGKILL])
    _counts(job, tmp_path)
    job.assert_clean(etcd)


def test_a_join_then_a_loss_keeps_every_later_epoch_exact(etcd, tmp_path):
    """The case that lost examples for the rest of the run: two members, a
    third joins, then one of the first two is killed."""
    job = _job(etcd, tmp_path, '--hold-until-size', '3')
    try:
        job.start('--kill-after-iteration', '25')
        job.start()
        job.wait_for(lambda j: _last_iteration(j) >= 1, 60, 'training')
        job.start()
        codes = job.wait(180)
    finally:
        job.kill_all()
    _finished(job, codes, [0, 0, -signal.SIGKILL])
    sizes = [e['size'] for e in job.events('resumed')]
    assert 3 in sizes and sizes[-1] == 2, sizes
    _counts(job, tmp_path)
    job.assert_clean(etcd)
