"""Where the CPU and the time of a Parquet benchmark run go, per batch, ours against arrow-threads.

Runs configurations of the Parquet benchmark (:func:`bench.run_one`, the
same dataset, columns and batches) each in a fresh child process, with the
page cache of the dataset dropped before it, and clocks the calls that do
each batch's work with the CPU clock of the thread that makes them
(``time.thread_time``, so time spent waiting, for the GIL or for the
disk, does not count).  Per batch:

* ``cut``: cutting the batch out of a decoded row group: ours' loader
  threads' ``load_columns_with`` (``ParquetDataset.get_columns`` and
  the choice of local copies around it); ``arrow-threads``' takes on the
  training thread;
* ``take``: the copy of the rows inside it (``StoredColumns.take``);
* ``scheduler``: ours' bookkeeping (``Scheduler.step``, every event);
* ``pipeline``: the rest of ours' pipeline that runs Python per batch or
  per row group: the executor's actions, the consumer's wait for a
  delivered batch, and the copy threads' calls around Arrow's reading
  and decoding (``RowGroupFile.read_ahead`` and ``memory_form``; Arrow's
  own threads are not clocked);
* ``rest``: the process's CPU (every thread, from the start of the
  benchmark's clock to the end of its teardown) less the above: Arrow's
  decoding, the training loop, starting and stopping.

When the batches come, from the time the training loop gets each:

* ``1st b s``: seconds to the first batch;
* ``stalls``, ``stalled s``: waits of more than :data:`STALL_SECONDS`
  between two batches, and their seconds together (for instance for a row
  group not decoded yet when its first batch is due);
* ``pace ms/b``: the mean wait between two batches that is not a stall:
  the pace at which batches come while their row groups are ready;
* ``decode s``: for ours, the median wall seconds of a row group's
  ``memory_form`` (decoding it into memory, with any reading not done
  ahead and the waits for the GIL; ``arrow-threads`` decodes otherwise,
  and shows 0).

``--take-rows compiled,python`` runs each method both with the compiled
``chainer_prefetch._take_rows`` and with its Python equivalent
(``chainer_prefetch.columnar.TAKE_ROWS``; rows labelled ``python take``),
and gives the ratio of their rows/s.  ``--local-read-threads 2,8`` likewise
runs each with those threads reading a row group from a node-local file
system (``chainer_prefetch.datasets.byte_ranges.LOCAL_READ_THREADS``; rows
labelled ``2 read threads``, ``8 read threads``); each run reports the
threads that read its dataset (``read_threads``: where the dataset is not
on node-local storage, ``READ_THREADS`` whatever the option).

Within each repeat the runs go in the order of ``--methods`` (and of the
options' values), backwards in every other repeat
(``testbed.processes.run_order``), so that no run always follows the
same one.

Per-batch figures divide by the batches consumed (calls for batches
prefetched but not consumed count too, about 0.5% at 1,000 batches); each
clock adds 1-2 us to its call.  Only methods whose loaders are threads of
the training process can be clocked (the calls of loader processes happen
elsewhere).  Methods and worker counts alternate within each repeat; the
table gives medians::

    python -m chainer_prefetch_bench.parquet.cpu_per_batch --out results/parquet/cpu_per_batch
"""
import argparse
import collections
import functools
import itertools
import shutil
import statistics
import sys
import threading
import time
from typing import Dict, List, Sequence

import numpy

from chainer_prefetch_bench.testbed.page_cache import drop_page_cache
from chainer_prefetch_bench.testbed.processes import answer_child, run_in_child, run_order
from chainer_prefetch_bench.testbed.report import show_results

#: What is clocked: label -> (module, class or None for a function, name).
CLOCKED = {
    'load_columns_with': ('chainer_prefetch.iterators._columnar_worker', None,
                          'load_columns_with'),
    'take': ('chainer_prefetch.datasets.arrow_columns', 'StoredColumns', 'take'),
    'scheduler': ('chainer_prefetch.iterators._scheduler', 'Scheduler', 'step'),
    'executor': ('chainer_prefetch.iterators._executor', 'Executor', '_execute'),
    'mailbox': ('chainer_prefetch.iterators._executor', 'Mailbox', 'get'),
    'read_ahead': ('chainer_prefetch.datasets.row_group_source', 'RowGroupFile',
                   'read_ahead'),
    'memory_form': ('chainer_prefetch.datasets.row_group_source', 'RowGroupFile',
                    'memory_form'),
}
#: The labels that make up ``pipeline``.
PIPELINE = ('executor', 'mailbox', 'read_ahead', 'memory_form')
#: The labels whose calls' wall seconds are kept too (``ThreadClocks.wall``).
WALL_TIMED = ('memory_form',)
#: The benchmark's methods that load in the training process.
IN_PROCESS_METHODS = ('ours-memory', 'ours-threads', 'ours-memory-shared',
                      'ours-threads-shared', 'arrow-threads')
#: The table's columns: (field, heading, format).
COLUMNS = (('rows_per_s', 'rows/s', '{:.0f}'),
           ('cpu_us', 'CPU us/b', '{:.0f}'),
           ('cut_us', 'cut us/b', '{:.0f}'),
           ('take_us', 'take us/b', '{:.0f}'),
           ('scheduler_us', 'scheduler us/b', '{:.0f}'),
           ('pipeline_us', 'pipeline us/b', '{:.0f}'),
           ('rest_us', 'rest us/b', '{:.0f}'),
           ('first_batch_s', '1st b s', '{:.2f}'),
           ('stalls', 'stalls', '{:.0f}'),
           ('stalled_s', 'stalled s', '{:.2f}'),
           ('pace_ms', 'pace ms/b', '{:.2f}'),
           ('decode_s', 'decode s', '{:.3f}'))
#: ``--take-rows`` values: what ``chainer_prefetch.columnar.TAKE_ROWS`` is set to.
TAKE_ROWS = ('compiled', 'python')
#: A wait between two batches longer than this is a stall.
STALL_SECONDS = 0.02


class ThreadClocks:
    """CPU seconds and calls of clocked methods, summed over every thread.

    ``wall[label]`` lists the wall seconds of each call of the labels
    clocked with ``keep_wall``.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self.wall = collections.defaultdict(list)

    def clock(self, owner, name: str, label: str, keep_wall: bool = False):
        """Replaces ``owner.name`` with a version that adds its thread CPU to ``label``.

        Args:
            owner: The class (or module) whose method (or function) is clocked.
            name: The method's name.
            label: Where its CPU seconds and calls are counted.
            keep_wall: Also list each call's wall seconds in ``wall[label]``.
        """
        method = getattr(owner, name)

        @functools.wraps(method)
        def clocked(*args, **kwargs):
            started = time.thread_time()
            wall_started = time.perf_counter() if keep_wall else 0.0
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.thread_time() - started
                with self._lock:
                    self.seconds[label] += spent
                    self.calls[label] += 1
                    if keep_wall:
                        self.wall[label].append(time.perf_counter() - wall_started)

        setattr(owner, name, clocked)


def timeline_of(arrivals: Sequence[float]) -> Dict:
    """The first batch, the stalls and the pace between them.

    Args:
        arrivals: When the run started, then when each batch came
            (``time.perf_counter()`` seconds; at least one batch).

    Returns:
        ``first_batch_s``, ``stalls`` (gaps between batches longer than
        :data:`STALL_SECONDS`), ``stalled_s`` (their seconds together) and
        ``pace_ms`` (the mean of the other gaps, in milliseconds; 0 when
        there is none).
    """
    gaps = numpy.diff(numpy.asarray(arrivals[1:], dtype=float))
    stalled = gaps > STALL_SECONDS
    paced = gaps[~stalled]
    return {'first_batch_s': round(arrivals[1] - arrivals[0], 4),
            'stalls': int(stalled.sum()),
            'stalled_s': round(float(gaps[stalled].sum()), 4),
            'pace_ms': round(1e3 * float(paced.mean()) if len(paced) else 0.0, 4)}


def _time_the_batches(bench, arrivals: List[float]):
    """Makes ``bench.run_one`` note when its run starts and each batch comes.

    The start is when the run first asks for a batch (microseconds after
    the benchmark's own clock starts).

    Args:
        bench: The benchmark module, whose batch generator is wrapped.
        arrivals: Where the times go (``time.perf_counter()`` seconds).
    """
    make_batches = bench._batches

    def timed_batches(*args, **kwargs):
        arrivals.append(time.perf_counter())
        batches = make_batches(*args, **kwargs)
        try:
            for batch in batches:
                arrivals.append(time.perf_counter())
                yield batch
        finally:
            batches.close()

    bench._batches = timed_batches


def run_one(config: Dict) -> Dict:
    """One benchmark run with the clocks in place; its result with theirs.

    Args:
        config: A configuration of :func:`bench.run_one`.
    """
    import importlib

    from chainer_prefetch import columnar
    from chainer_prefetch_bench.parquet import bench
    read_threads = bench.use_read_threads(config.get('local_read_threads'),
                                          config['source'])
    take_rows = config.get('take_rows', 'compiled')
    if take_rows == 'python':
        columnar.TAKE_ROWS = columnar.take_rows_python
    elif columnar.TAKE_ROWS is columnar.take_rows_python:
        raise RuntimeError('chainer_prefetch._take_rows was not built (no C compiler '
                           'at installation?): the compiled take cannot be timed')
    clocks = ThreadClocks()
    for label, (module, owner, name) in CLOCKED.items():
        module = importlib.import_module(module)
        clocks.clock(module if owner is None else getattr(module, owner),
                     name, label, keep_wall=label in WALL_TIMED)
    arrivals = []
    _time_the_batches(bench, arrivals)
    result = bench.run_one(config)
    batches = result['rows'] / bench.BATCH_SIZE
    us = {label: 1e6 * seconds / batches for label, seconds in clocks.seconds.items()}
    ours = config['method'].startswith('ours')
    cut = us.get('load_columns_with' if ours else 'take', 0.0)
    scheduler = us.get('scheduler', 0.0)
    pipeline = sum(us.get(label, 0.0) for label in PIPELINE)
    cpu = 1e6 * result['cpu_s'] / batches
    return {'method': config['method'], 'workers': config['workers'],
            'take_rows': take_rows, 'take_rows_function': columnar.TAKE_ROWS.__name__,
            'local_read_threads': config.get('local_read_threads'),
            'read_threads': read_threads,
            'rows_per_s': result['rows_per_s'],
            'seconds': result['seconds'], 'cpu_s': result['cpu_s'],
            'cpu_us': round(cpu, 1), 'cut_us': round(cut, 1),
            'take_us': round(us.get('take', 0.0), 1),
            'scheduler_us': round(scheduler, 1),
            'pipeline_us': round(pipeline, 1),
            'rest_us': round(cpu - cut - scheduler - pipeline, 1),
            **timeline_of(arrivals),
            'decode_s': round(statistics.median(
                clocks.wall['memory_form'] or [0.0]), 4),
            'us_per_batch': {label: round(value, 1) for label, value in us.items()},
            'calls': dict(clocks.calls)}


def label(run: Dict) -> str:
    """The method, with ``python take`` when rows were taken in Python and
    ``N read threads`` when ``--local-read-threads`` set them."""
    return (run['method'] + (' python take' if run.get('take_rows') == 'python' else '')
            + (' {} read threads'.format(run['local_read_threads'])
               if run.get('local_read_threads') else ''))


def format_table(runs: List[Dict]) -> str:
    """Medians per method and worker count, in the order the runs came.

    Where a method ran in several variants (``--take-rows``,
    ``--local-read-threads``), a line per other variant and worker count
    gives the first variant's median rows/s over its.

    Args:
        runs: What :func:`run_one` returned, every repeat.
    """
    keys = list(dict.fromkeys((label(run), run['workers']) for run in runs))
    firsts = {}  # method -> the label of its first variant
    for run in runs:
        firsts.setdefault(run['method'], label(run))
    widths = [max(len(heading), 8) for _, heading, _ in COLUMNS]
    lines = ['{:<26} {:>7} {}   (medians of {} runs)'.format(
        'method', 'workers', ' '.join(heading.rjust(width) for (_, heading, _), width
                                      in zip(COLUMNS, widths)),
        sum((label(run), run['workers']) == keys[0] for run in runs))]
    medians = {}
    for method, workers in keys:
        mine = [run for run in runs if (label(run), run['workers']) == (method, workers)]
        medians[method, workers] = statistics.median(run['rows_per_s'] for run in mine)
        cells = [form.format(statistics.median(run[field] for run in mine)).rjust(width)
                 for (field, _, form), width in zip(COLUMNS, widths)]
        lines.append('{:<26} {:>7} {}'.format(method, workers, ' '.join(cells)))
    methods = {label(run): run['method'] for run in runs}
    for variant, workers in keys:
        first = firsts[methods[variant]]
        if variant != first and (first, workers) in medians:
            lines.append('{} at {} workers: {:.2f}x the rows/s of {}'.format(
                first, workers, medians[first, workers] / medians[variant, workers],
                variant))
    return '\n'.join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if answer_child(argv, run_one):
        return 0
    from chainer_prefetch_bench.parquet import bench
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    bench.add_dataset_arguments(parser, rows=320000, files=8)
    parser.add_argument('--methods', default='ours-memory,arrow-threads',
                        help='benchmark methods that load in the training '
                        'process: {}'.format(', '.join(IN_PROCESS_METHODS)))
    parser.add_argument('--workers', default='1,2,4')
    parser.add_argument('--batches', type=int, default=1000)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--local-dir', default='/dev/shm/bench_parquet_local')
    parser.add_argument('--take-rows', default='compiled',
                        help='how rows are taken: compiled, python, or both '
                        '(compiled,python) side by side')
    bench.add_read_threads_argument(parser)
    parser.add_argument('--out', default=None,
                        help='folder for cpu_per_batch.json and table.txt')
    args = parser.parse_args(argv)
    takes = args.take_rows.split(',')
    if not takes or any(take not in TAKE_ROWS for take in takes):
        parser.error('--take-rows: a list of {}, got {!r}'.format(
            ', '.join(TAKE_ROWS), args.take_rows))
    methods = args.methods.split(',')
    elsewhere = [method for method in methods if method not in IN_PROCESS_METHODS]
    if elsewhere:
        parser.error('--methods: {} cannot be clocked (loader processes, or not '
                     'a method); choose from {}'.format(
                         ', '.join(elsewhere), ', '.join(IN_PROCESS_METHODS)))
    dataset = bench.generated_dataset(args)
    sizes = bench.row_group_sizes(dataset)
    runs = []
    for repeat in range(args.repeats):
        for workers in [int(count) for count in args.workers.split(',')]:
            for method, take, threads in run_order(itertools.product(
                    methods, takes, args.local_read_threads), repeat):
                shutil.rmtree(args.local_dir, ignore_errors=True)
                drop_page_cache(dataset)
                config = bench.run_config(method, workers, dataset, args.batches,
                                          args.local_dir, sizes)
                run = run_in_child(__spec__.name, dict(
                    config, take_rows=take, local_read_threads=threads), timeout=600)
                runs.append(run)
                print('{:<26} '.format(label(run)) + '{workers} workers: '
                      '{rows_per_s:8.0f} rows/s, CPU {cpu_us:.0f} us a batch: cut '
                      '{cut_us:.0f}, take {take_us:.0f}, scheduler {scheduler_us:.0f}, pipeline '
                      '{pipeline_us:.0f}, rest {rest_us:.0f}; first batch '
                      '{first_batch_s:.2f} s, {stalls} stalls ({stalled_s:.2f} '
                      's), {pace_ms:.2f} ms a batch between the others'.format(**run),
                      flush=True)
    table = format_table(runs)
    show_results(args.out, __spec__.name, argv, runs, table)
    return 0


if __name__ == '__main__':
    sys.exit(main())
