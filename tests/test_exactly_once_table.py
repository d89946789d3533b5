"""The exactly-once benchmark's report (chainer_prefetch_bench.fault.
exactly_once): the table from logs written by hand; no processes."""
import json

import numpy
import pytest

from chainer_prefetch_bench.fault import exactly_once as bench
from chainer_prefetch_bench.testbed import exactly_once

EXAMPLES = 8
A, B, C = 101, 102, 103  # process ids: two members, then a joiner


def _batch(member, iteration, when, indices, epoch, position):
    return dict(event='batch', time=when, rank=member, iteration=iteration,
                indices=indices, epoch=epoch, position=position)


def _counters(copied, from_source=0):
    return dict(files_copied=copied, examples_from_source=from_source,
                examples_from_local=0)


# Batch 2, 8 examples: two members train epoch 0 and half of epoch 1; C
# registers at t=3.5 and the group of 3 resumes at update 3; C's first batch
# repeats example 3; in epoch 2 examples 3 and 7 are left out.  B's first
# attempt of update 4 was retried (not committed).
RECORDS = [
    _batch(A, 1, 1.0, [0, 1], 0, 2), _batch(B, 1, 1.0, [4, 5], 0, 2),
    _batch(A, 2, 2.0, [2, 3], 1, 0), _batch(B, 2, 2.0, [6, 7], 1, 0),
    _batch(A, 3, 3.0, [0, 1], 1, 2), _batch(B, 3, 3.0, [4, 5], 1, 2),
    _batch(B, 4, 4.5, [0, 1], 1, 4),
    _batch(A, 4, 5.0, [2, 3], 1, 4), _batch(B, 4, 5.2, [6, 7], 1, 4),
    _batch(C, 4, 5.5, [3], 1, 4),
    _batch(A, 5, 6.0, [0, 1, 2], 2, 3), _batch(B, 5, 6.0, [4, 5], 2, 2),
    _batch(C, 5, 6.0, [6], 2, 1),
] + [dict(event='finished', time=7.0, rank=m, iteration=5) for m in (A, B, C)]


def _resumed(member, generation, size, when, iteration, previous):
    return dict(event='resumed', time=when, rank=member,
                generation=generation, size=size, iteration=iteration,
                previous_storage=previous)


EVENTS = [
    _resumed(A, 0, 2, 0.5, 0, None), _resumed(B, 0, 2, 0.5, 0, None),
    dict(event='registered', time=3.5, rank=C),
    _resumed(A, 1, 3, 4.0, 3, _counters(4)),
    _resumed(B, 1, 3, 4.0, 3, _counters(4)),
    _resumed(C, 1, 3, 4.1, 3, None),
    dict(event='finished', time=7.0, rank=A, storage=_counters(0, 1)),
    dict(event='finished', time=7.0, rank=B, storage=_counters(0)),
    dict(event='finished', time=7.0, rank=C, storage=_counters(3)),
]


def _write(path, records):
    path.write_text(''.join(json.dumps(r) + '\n' for r in records))
    return str(path)


@pytest.fixture
def summary(tmp_path):
    log = _write(tmp_path / 'examples.jsonl', RECORDS)
    events = _write(tmp_path / 'events.jsonl', EVENTS)
    rows = exactly_once.report(log, [events], EXAMPLES, 3)
    batches = exactly_once.committed_batches(
        RECORDS, [e for e in EVENTS if e['event'] == 'resumed'])
    held = {A: numpy.arange(EXAMPLES) < 4, B: numpy.arange(EXAMPLES) >= 4,
            C: numpy.arange(EXAMPLES) == 3}  # C had copied example 3
    return bench.summarize(rows, batches, EVENTS, 3.5, 3, EXAMPLES,
                           members=[A, B, C], held=held)


def test_a_case_counts_its_change_epoch_and_the_later_ones(summary):
    assert summary['resume_iteration'] == 3
    assert (summary['change_epoch'], summary['at']) == (1, 0.5)
    assert (summary['never'], summary['twice']) == (0, 1)
    assert summary['later_epochs'] == [2]
    assert (summary['later_never'], summary['later_twice']) == (2, 0)
    # From the registration to the last batch of update 4 (C's).
    assert summary['seconds'] == pytest.approx(2.0)


def test_storage_reads_after_the_change_against_the_examples_needed(summary):
    assert [(m['member'], m['reads'], m['needed'], m['held_at_change'])
            for m in summary['storage']] == [
                (A, 1, 0, 4), (B, 0, 0, 4), (C, 3, 1, 1)]
    # C's first example was its local copy, its second read from storage.
    assert summary['storage'][2]['needed_by_epoch'] == {'1': 0, '2': 1}


def test_the_resume_of_the_new_size_after_the_event():
    events = [dict(event='recovered', time=1.0, size=2, iteration=4),
              dict(event='resumed', time=2.0, size=3, iteration=6),
              dict(event='resumed', time=3.0, size=2, iteration=9),
              dict(event='resumed', time=4.0, iteration=12)]
    assert bench.resume_after(events, 1.5, 2)['iteration'] == 9
    assert bench.resume_after(events, 0.5, 2)['iteration'] == 4
    # An event without a size (a restart's) is of any size.
    assert bench.resume_after(events, 3.5, 3)['iteration'] == 12
    assert bench.resume_after(events, 4.5) is None
    with pytest.raises(ValueError):
        bench.summarize([], [], events, 4.5, 2, EXAMPLES)


def test_the_table_has_a_line_per_case(summary):
    report = dict(
        settings=dict(images=EXAMPLES, batchsize=2, epochs=3),
        cases=[dict(summary, name='elastic-join', label='elastic join',
                    sizes=[2, 3]),
               dict(summary, name='ulfm-shrink-0.50', label='ULFM shrink',
                    sizes=[3, 2], storage=None, seconds=None),
               dict(name='restart-3-2', label='restart from snapshot',
                    sizes=[3, 2], error='RuntimeError: launch 2 ended')])
    lines = bench.format_table(report).splitlines()
    assert len(lines) == 1 + 2 + 3
    assert '8 training examples, batch 2 per member, 3 epochs' in lines[0]
    join = lines[3].split()
    assert join[:8] == ['elastic', 'join', '2->3', '0.50', '0', '1', '2', '0']
    assert join[8:] == ['2.00', 's', '1/0,', '0/0,', '3/1']
    assert lines[4].split()[-4:] == ['0', '-', 'not', 'counted']
    assert 'FAILED (restart-3-2): RuntimeError: launch 2 ended' in lines[5]


def test_updates_per_epoch():
    assert bench.updates_per_epoch(480, 2, 8) == 30
    assert bench.updates_per_epoch(480, 3, 8) == 20
    assert bench.updates_per_epoch(10, 3, 2) == 2


def test_the_elastic_cases_start_together():
    pytest.importorskip('torch')
    from chainer_prefetch.elastic.policy import parse_policy
    policy = parse_policy('chainer_prefetch_bench.fault.exactly_once:'
                          'START_WITH_3')
    assert policy.ok2run(['a', 'b'], True) == 'wait'
    assert policy.ok2run(['a', 'b', 'c'], True) == 'ok'
    assert policy.ok2run(['a'], False) == 'ok'
    with pytest.raises(AttributeError):
        getattr(bench, 'NOT_A_POLICY')
