"""Where the CPU of a Parquet benchmark run goes, per batch: ours against ``arrow-threads``.

Runs configurations of the Parquet benchmark (:func:`bench.run_one`, the
same dataset, columns and batches) each in a fresh child process, with the
page cache of the dataset dropped before it, and clocks the calls that do
each batch's work with the CPU clock of the thread that makes them
(``time.thread_time``, so time spent waiting, for the GIL or for the
disk, does not count):

* ``get_columns``: a batch cut out of a decoded row group
  (``ParquetDataset.get_columns``, on ours' loader threads);
* ``take``: the copy of the rows inside it (``StoredColumns.take``), which
  ``arrow-threads`` calls on the training thread for each batch;
* ``scheduler``: ours' bookkeeping (``Scheduler.step``, every event of the
  pipeline), summed per batch.

Each run also reports its rows/s and the CPU of the whole process (every
thread and loader process, from the start of the benchmark's clock to the
end of its teardown) per batch.  Methods and worker counts alternate
within each repeat; the table gives medians::

    python -m chainer_prefetch_bench.parquet.cpu_per_batch --out results/parquet/cpu_per_batch
"""
import argparse
import collections
import functools
import os
import shutil
import statistics
import sys
import threading
import time
from typing import Dict, List

from chainer_prefetch_bench.testbed.page_cache import drop_page_cache
from chainer_prefetch_bench.testbed.processes import answer_child, run_in_child
from chainer_prefetch_bench.testbed.report import write_json

#: What is clocked: label -> (module, class, method).
CLOCKED = {
    'get_columns': ('chainer_prefetch.datasets.parquet', 'ParquetDataset',
                    'get_columns'),
    'take': ('chainer_prefetch.datasets.arrow_columns', 'StoredColumns', 'take'),
    'scheduler': ('chainer_prefetch.iterators._scheduler', 'Scheduler', 'step'),
}
FIELDS = ('rows_per_s', 'cpu_ms_per_batch', 'get_columns_us', 'take_us',
          'scheduler_us_per_batch')


class ThreadClocks:
    """CPU seconds and calls of clocked methods, summed over every thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.seconds = collections.Counter()
        self.calls = collections.Counter()

    def clock(self, owner, name: str, label: str):
        """Replaces ``owner.name`` with a version that adds its thread CPU to ``label``.

        Args:
            owner: The class whose method is clocked.
            name: The method's name.
            label: Where its CPU seconds and calls are counted.
        """
        method = getattr(owner, name)

        @functools.wraps(method)
        def clocked(*args, **kwargs):
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.thread_time() - started
                with self._lock:
                    self.seconds[label] += spent
                    self.calls[label] += 1

        setattr(owner, name, clocked)


def run_one(config: Dict) -> Dict:
    """One benchmark run with the clocks in place; its result with theirs.

    Args:
        config: A configuration of :func:`bench.run_one`.
    """
    import importlib

    from chainer_prefetch_bench.parquet import bench
    clocks = ThreadClocks()
    for label, (module, owner, name) in CLOCKED.items():
        clocks.clock(getattr(importlib.import_module(module), owner), name, label)
    result = bench.run_one(config)
    batches = result['rows'] / bench.BATCH_SIZE

    def per_call_us(label):
        return (round(1e6 * clocks.seconds[label] / clocks.calls[label], 1)
                if clocks.calls[label] else None)

    return {'method': config['method'], 'workers': config['workers'],
            'rows_per_s': result['rows_per_s'], 'cpu_s': result['cpu_s'],
            'cpu_ms_per_batch': round(1e3 * result['cpu_s'] / batches, 3),
            'get_columns_us': per_call_us('get_columns'),
            'take_us': per_call_us('take'),
            'scheduler_us_per_batch': (round(
                1e6 * clocks.seconds['scheduler'] / batches, 1)
                if clocks.calls['scheduler'] else None),
            'scheduler_steps_per_batch': round(
                clocks.calls['scheduler'] / batches, 2),
            'calls': dict(clocks.calls)}


def format_table(runs: List[Dict]) -> str:
    """Medians per method and worker count."""
    keys = list(dict.fromkeys((run['method'], run['workers']) for run in runs))
    lines = ['{:<14} {:>7} {:>9} {:>12} {:>14} {:>9} {:>16}   (medians of {} runs)'.format(
        'method', 'workers', 'rows/s', 'CPU ms/batch', 'get_columns us',
        'take us', 'scheduler us/b',
        sum((run['method'], run['workers']) == keys[0] for run in runs))]
    for method, workers in keys:
        mine = [run for run in runs
                if (run['method'], run['workers']) == (method, workers)]
        medians = {}
        for field in FIELDS:
            values = [run[field] for run in mine if run[field] is not None]
            medians[field] = statistics.median(values) if values else None
        cells = ['{:9.0f}'.format(medians['rows_per_s']),
                 '{:12.2f}'.format(medians['cpu_ms_per_batch'])] + [
            '{:>{}}'.format('-' if medians[field] is None
                            else '{:.0f}'.format(medians[field]), width)
            for field, width in (('get_columns_us', 14), ('take_us', 9),
                                 ('scheduler_us_per_batch', 16))]
        lines.append('{:<14} {:>7} {}'.format(method, workers, ' '.join(cells)))
    return '\n'.join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if answer_child(argv, run_one):
        return 0
    from chainer_prefetch_bench.parquet import bench
    from chainer_prefetch_bench.testbed import parquet_dataset
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    bench.add_dataset_arguments(parser, rows=320000, files=8)
    parser.add_argument('--methods', default='ours-memory,arrow-threads',
                        help='benchmark methods that run in the training '
                        "process (ours' loader threads, arrow-threads)")
    parser.add_argument('--workers', default='1,2')
    parser.add_argument('--batches', type=int, default=1000)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--local-dir', default='/dev/shm/bench_parquet_local')
    parser.add_argument('--out', default=None,
                        help='folder for cpu_per_batch.json and table.txt')
    args = parser.parse_args(argv)
    dataset = bench.generated_dataset(args)
    columns = [name for name in parquet_dataset.SCHEMA.names if name != 'tokens']
    sizes = bench._row_group_sizes(dataset)
    runs = []
    for _ in range(args.repeats):
        for workers in [int(count) for count in args.workers.split(',')]:
            for method in args.methods.split(','):
                shutil.rmtree(args.local_dir, ignore_errors=True)
                drop_page_cache(dataset)
                run = run_in_child(__spec__.name, {
                    'method': method, 'workers': workers, 'source': dataset,
                    'columns': columns, 'batches': args.batches, 'window': 1,
                    'num_cached_parquet': 1, 'local_dir': args.local_dir,
                    'seed': 0, 'row_group_sizes': sizes, 'copy_ahead': 0,
                    'local_row_groups': 0}, timeout=600)
                runs.append(run)
                print('{method:<14} {workers} workers: {rows_per_s:8.0f} rows/s, '
                      'CPU {cpu_ms_per_batch:.2f} ms/batch, get_columns '
                      '{get_columns_us} us, take {take_us} us, scheduler '
                      '{scheduler_us_per_batch} us/batch'.format(**run),
                      flush=True)
    table = format_table(runs)
    print(table)
    if args.out:
        write_json(os.path.join(args.out, 'cpu_per_batch.json'),
                   {'argv': argv, 'runs': runs})
        with open(os.path.join(args.out, 'table.txt'), 'w') as out:
            out.write('python -m {} {}\n\n{}\n'.format(
                __spec__.name, ' '.join(argv), table))
    return 0


if __name__ == '__main__':
    sys.exit(main())
