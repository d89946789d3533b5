"""The exactly-once report: which examples committed updates trained on.

Writing: every training example carries its index in the whole training set
(:class:`IndexedDataset`), and the updater's converter
(:func:`logging_converter`) strips it and appends one ``batch`` record per
attempted update to a log (JSON lines, flushed at once, so a killed process
keeps its records): the process id, the update attempted (``iteration``),
the training iterator's epoch and position after the batch, and the indices.
The ImageNet example's ``--example-log PATH`` does this.

Reading: :func:`report` keeps the batches of committed updates (with the
resume points of the job's event logs) and counts, epoch by epoch, how
often each example was used.

An attempt is committed unless the training state went back past it:

* an attempt followed, in the same process, by one for the same or an
  earlier update was rolled back (and retried);
* a process that did not finish (killed, or ended for a restart) is rolled
  back to the first resume of the job after its last attempt (an elastic
  ``resumed``, a ULFM ``recovered``, a restart's ``resumed``, each with the
  iteration training went on from): its attempts for later updates were
  not committed (none if nothing resumed).

Usage::

    python -m chainer_prefetch_bench.testbed.exactly_once EXAMPLE_LOG \\
        --events EVENTS.jsonl [EVENTS.jsonl ...] --examples N --epochs E
"""
import argparse
import json
import os
from collections import defaultdict
from typing import Dict, Iterable, List, Mapping, Sequence

import chainer
import numpy

from chainer_prefetch.resilience.injection import EventLog, read_events

RESUME_EVENTS = ('resumed', 'recovered')


class IndexedDataset(chainer.dataset.DatasetMixin):
    """``base[i]`` with ``i`` appended to the example's tuple.

    Args:
        base: The training dataset (its examples are tuples).
    """

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        return tuple(self.base[i]) + (i,)


def logging_converter(path, updater_of, converter=None):
    """A converter that records the indices of every batch and converts the
    rest of each example with ``converter``; its ``log`` attribute is the
    :class:`EventLog` (write ``finished`` there at the end of training).

    Args:
        path: The log file (shared by all processes; one line per batch).
        updater_of: ``() -> updater`` (the updater is made after the
            converter).
        converter: The converter of the examples without their index
            (default: ``chainer.dataset.concat_examples``).
    """
    log = EventLog(path, os.getpid())
    convert = converter or chainer.dataset.concat_examples

    def logged(batch, device=None):
        updater = updater_of()
        iterator = updater.get_iterator('main')
        log.write('batch', sync=False, iteration=updater.iteration + 1,
                  epoch=iterator.epoch, position=iterator.current_position,
                  indices=[int(example[-1]) for example in batch])
        return convert([example[:-1] for example in batch], device)

    logged.log = log
    return logged


def committed_batches(records: Sequence[Mapping],
                      resumes: Sequence[Mapping]) -> List[Mapping]:
    """The ``batch`` records of committed updates (see the module
    docstring).

    Args:
        records: The example log's records (``batch`` and ``finished``), in
            the order written.
        resumes: Events with ``time`` and ``iteration`` where training went
            on after a change.
    """
    by_process: Dict[int, List[Mapping]] = defaultdict(list)
    finished = set()
    for record in records:
        if record['event'] == 'batch':
            by_process[record['rank']].append(record)
        elif record['event'] == 'finished':
            finished.add(record['rank'])
    resume_points = sorted((r['time'], int(r['iteration'])) for r in resumes)
    kept = []
    for process, batches in by_process.items():
        limit = None  # the iteration a process that died went back to
        if process not in finished:
            after = [iteration for when, iteration in resume_points
                     if when > batches[-1]['time']]
            limit = after[0] if after else -1
        for number, batch in enumerate(batches):
            retried = number + 1 < len(batches) and \
                batches[number + 1]['iteration'] <= batch['iteration']
            lost = limit is not None and batch['iteration'] > limit
            if not retried and not lost:
                kept.append(batch)
    return kept


def uses_per_epoch(batches: Iterable[Mapping], n_examples: int
                   ) -> Dict[int, numpy.ndarray]:
    """How often each example was used, per epoch.

    A batch that crossed an epoch boundary (its iterator's position after it
    is smaller than the batch) gave its last ``position`` examples to the
    new epoch and the others to the one before.
    """
    uses: Dict[int, numpy.ndarray] = defaultdict(
        lambda: numpy.zeros(n_examples, dtype=numpy.int64))
    for batch in batches:
        indices = numpy.asarray(batch['indices'], dtype=numpy.int64)
        epoch, position = int(batch['epoch']), int(batch['position'])
        first_of_new = (len(indices) - position if position < len(indices)
                        else 0)
        numpy.add.at(uses[epoch - 1], indices[:first_of_new], 1)
        numpy.add.at(uses[epoch], indices[first_of_new:], 1)
    return uses


def report(example_log: str, event_logs: Sequence[str], n_examples: int,
           epochs: int) -> List[Dict[str, int]]:
    """Per finished epoch: examples never used, used twice or more, and
    the extra uses.

    Args:
        example_log: The ``--example-log`` file.
        event_logs: The job's event logs (their resume events).
        n_examples: Examples in the training set.
        epochs: Epochs the job trained (all finished).
    """
    records = read_events(example_log)
    resumes = [event for path in event_logs for event in read_events(path)
               if event['event'] in RESUME_EVENTS and 'iteration' in event]
    uses = uses_per_epoch(committed_batches(records, resumes), n_examples)
    rows = []
    for epoch in range(epochs):
        counts = uses[epoch]
        rows.append(dict(epoch=epoch, never=int((counts == 0).sum()),
                         twice=int((counts >= 2).sum()),
                         extra=int(counts.sum() - (counts > 0).sum())))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('example_log')
    parser.add_argument('--events', nargs='+', default=[])
    parser.add_argument('--examples', type=int, required=True)
    parser.add_argument('--epochs', type=int, required=True)
    args = parser.parse_args(argv)
    rows = report(args.example_log, args.events, args.examples, args.epochs)
    print('epoch  never  twice  extra uses')
    for row in rows:
        print('{epoch:5d} {never:6d} {twice:6d} {extra:6d}'.format(**row))
    print(json.dumps(rows))


if __name__ == '__main__':
    main()
