"""The pure core of elastic training, and the communicator's ChainerMN checks.

The policies, the settle window, the rendezvous steps, the locality-keeping
split and the address parsing are pure functions, tested here without etcd
or processes, and without the ``[elastic]`` extra (torch, etcd3gw).  The
communicator is tested with three real processes and a real etcd
(``elastic_comm_checks.py``); those tests need the extra.
"""
import importlib
import os
import subprocess
import sys

import pytest

import helpers
from chainer_prefetch.elastic import (
    ElasticSettings,
    FailStop,
    MinMax,
    ScalePolicy,
    parse_etcd_url,
)
from chainer_prefetch.elastic.plan import (
    Record,
    SettleWindow,
    node_layout,
    rendezvous_step,
    signature_mismatch,
    silent_members,
)
from chainer_prefetch.elastic.policy import Progress, decide, parse_policy


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


needs_the_extra = pytest.mark.skipif(
    not (_importable('torch') and _importable('etcd3gw')),
    reason='needs the [elastic] extra (torch, etcd3gw)')

A, B, C, D = 'h:1:a', 'h:2:b', 'h:3:c', 'h:4:d'


def test_failstop_and_minmax():
    assert FailStop(3).ok2run([A, B], True) == 'wait'
    assert FailStop(3).ok2run([A, B], False) == 'fail'
    assert FailStop(3).ok2run([A, B, C], False) == 'ok'
    policy = MinMax(2, 3)
    assert policy.ok2run([A], False) == 'wait'
    assert policy.ok2run([A, B, C, D], False) == 'ok'
    decision = decide(policy, [D, C, B, A], False, Progress())
    assert decision.members == [A, B, C] and decision.standby == [D]
    with pytest.raises(ValueError):
        MinMax(3, 2)


def test_a_policy_reads_progress():
    class HalfBefore80(ScalePolicy):
        def ok2run(self, hosts, initial):
            if len(hosts) < 2 and self.progress.fraction < 0.8:
                return 'fail'
            return 'ok'
    assert decide(HalfBefore80(), [A], False,
                  Progress(fraction=0.5)).verdict == 'fail'
    assert decide(HalfBefore80(), [A], False,
                  Progress(fraction=0.9)).verdict == 'ok'


def test_bad_policy_answers_are_named():
    class Bad(ScalePolicy):
        def ok2run(self, hosts, initial):
            return 'yes'
    with pytest.raises(ValueError, match="Bad.ok2run returned 'yes'"):
        decide(Bad(), [A], True, Progress())


def test_parse_policy():
    assert parse_policy('failstop:4').n == 4
    assert (parse_policy('minmax:2:4').n_min, parse_policy('minmax:2').n_max) \
        == (2, None)
    with pytest.raises(ValueError, match='failstop:N'):
        parse_policy('sometimes')
    with pytest.raises(ValueError, match='bad scale policy'):
        parse_policy('no_such_module:Policy')


def test_settle_window_makes_a_burst_one_change():
    window = SettleWindow(1.0)
    window.observe(frozenset([A]), 0.0)
    assert window.settled(1.0) == {A}
    for t, view in ((2.0, [A, B]), (2.3, [A, B, C]), (2.6, [A, B, C, D])):
        window.observe(frozenset(view), t)
        assert window.settled(t + 0.5) is None
    assert window.settled(3.6) == {A, B, C, D}


def test_rendezvous_steps():
    view = frozenset([A, B])
    ok = Record(1, 'ok', (A, B), (), '127.0.0.1:1', '', A)
    # No record yet: the smallest name decides, the others wait.
    assert rendezvous_step(A, view, None, -1) == ('decide', None, 0)
    assert rendezvous_step(B, view, None, -1).action == 'wait'
    assert rendezvous_step(B, None, None, -1).action == 'wait'
    # A new record with this member: join it.
    assert rendezvous_step(B, view, ok, 0).action == 'join'
    # Done with it (it broke): decide the next, unless the view is blocked.
    assert rendezvous_step(A, view, ok, 1).generation == 2
    assert rendezvous_step(A, view, ok, 1, blocked_view=view).action == 'wait'
    # A member of the record left: a new decision, skipping the stale one.
    assert rendezvous_step(A, frozenset([A]), ok, 0).generation == 2
    # Waiting and standby members hold while nothing changes.
    wait = Record(2, 'wait', (), (A, B), None, 'too few', A)
    assert rendezvous_step(B, view, wait, 1).action == 'hold'
    assert rendezvous_step(A, frozenset([A, B, C]), wait, 1).generation == 3
    standby = Record(3, 'ok', (A,), (B,), 'x:1', '', A)
    assert rendezvous_step(B, view, standby, 2).action == 'hold'
    for verdict in ('fail', 'done'):
        end = Record(4, verdict, (), (), None, 'why', A)
        assert rendezvous_step(B, view, end, 3).action == verdict


def test_members_that_do_not_come_to_a_rebuild_are_left_out_after_grace():
    broken = Record(4, 'ok', (A, B, C), (D,), 'x:1', '', A)
    left = {A: 4, C: 3, D: -1}  # B never came (killed); C still in gen 3
    assert silent_members(broken, left, A, 0.2, 0.5) == frozenset()
    assert silent_members(broken, left, A, 0.6, 0.5) == {B, C}
    assert silent_members(broken, {**left, C: 4}, A, 0.6, 0.5) == {B}
    assert silent_members(broken, {}, B, 0.6, 0.5) == {A, C}  # never me
    assert silent_members(None, left, A, 9.0, 0.5) == frozenset()


def test_node_layout():
    members = ['a:1:x', 'a:2:y', 'b:1:z']
    assert node_layout(members, 'a:2:y') == (1, 2, 0, 2)
    assert node_layout(members, 'b:1:z') == (0, 1, 1, 2)


def test_signature_mismatch_names_settings():
    assert signature_mismatch({'a': 1}, {'a': 1}) is None
    assert signature_mismatch({'a': 1, 'b': 2}, {'a': 1, 'b': 3}) == \
        'b: job 2, this process 3'


def test_urls_and_settings():
    url = parse_etcd_url('etcd://e1:2379,e2:2380/my-job')
    assert url.endpoints == (('e1', 2379), ('e2', 2380)) and url.job == 'my-job'
    assert str(url) == 'etcd://e1:2379,e2:2380/my-job'
    for bad in ('http://e1:2379/job', 'etcd://e1/job', 'etcd://e1:2379/',
                'etcd://e1:2379/a b'):
        with pytest.raises(ValueError, match='etcd://'):
            parse_etcd_url(bad)
    with pytest.raises(ValueError, match='ttl'):
        ElasticSettings(ttl=0).validated()
    with pytest.raises(ValueError, match='whole seconds'):
        ElasticSettings(ttl=1.5).validated()


def _run_members(mode, count):
    """Runs ``elastic_comm_checks.py MODE`` as ``count`` members of one job
    and checks that every one succeeded and nothing was left."""
    from chainer_prefetch.elastic import EtcdServer
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          'elastic_comm_checks.py')
    with EtcdServer() as server:
        processes = [subprocess.Popen(
            [sys.executable, script, server.url(mode), mode],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for _ in range(count)]
        try:
            outputs = [p.communicate(timeout=90)[0].decode() for p in processes]
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, output in zip(processes, outputs):
            assert p.returncode == 0, output[-3000:]
            assert not helpers.is_running(p.pid)
        assert helpers.wait_until(lambda: server.keys() == [], 10), server.keys()


@needs_the_extra
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_communicator_passes_the_chainermn_checks():
    _run_members('checks', 3)


@needs_the_extra
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_leaving_at_a_boundary_releases_a_blocked_peer():
    _run_members('leave', 2)
