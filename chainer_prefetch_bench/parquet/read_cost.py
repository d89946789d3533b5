"""CPU of staging row groups from a cold page cache: faulted in, or read.

``ParquetDataset`` faults each row group's column chunks into a memory map
of the Parquet file (``madvise(MADV_POPULATE_READ)``) before Arrow decodes
them from it; where the kernel refuses, it reads them with ``preadv`` into a
scratch buffer instead.  This runs both ways side by side on the
benchmark's dataset, each run in a fresh process with the page cache of the
dataset dropped before it, staging the same row groups as
``local_dir=':memory:'`` does (read ahead, then decoded and kept, at most
four at a time; the benchmark's six columns) and timing the run with the
process's own CPU clocks::

    python -m chainer_prefetch_bench.parquet.read_cost --out results/parquet/read_cost

The runs alternate (``read``, ``populate``, then ``populate``, ``read``:
every other repeat runs backwards); the table gives
medians of ``--repeats`` runs and their ratios.  ``--local-read-threads
1,2,8`` runs both ways with each count of threads reading a row group
from a node-local file system (``LOCAL_READ_THREADS``), side by side; the
``read s`` column is the wall time of the reads ahead alone::

    python -m chainer_prefetch_bench.parquet.read_cost --local-read-threads 1,2,8 \\
        --out results/parquet/read_threads
"""
import argparse
import glob
import itertools
import os
import resource
import statistics
import sys
import time
from typing import Dict, List

from chainer_prefetch_bench.testbed.page_cache import drop_page_cache
from chainer_prefetch_bench.testbed.processes import answer_child, run_in_child, run_order
from chainer_prefetch_bench.testbed.report import show_results

#: The ways compared: reading into a scratch buffer (the fallback), and
#: faulting into the memory map (what the dataset does).
WAYS = ('read', 'populate')
#: Row groups kept decoded at once, as the Parquet benchmark's local room.
KEPT = 4


def run_one(config: Dict) -> Dict:
    """Stages ``config['row_groups']`` row groups one way; returns the times.

    Args:
        config: ``way`` (one of :data:`WAYS`), ``dataset`` (a folder of
            Parquet files), ``row_groups`` (how many, file after file),
            ``local_read_threads`` (``None``: the product's).
    """
    import pyarrow.parquet

    from chainer_prefetch.datasets import byte_ranges, row_group_source
    from chainer_prefetch_bench.parquet import bench
    from chainer_prefetch_bench.testbed.parquet_dataset import SCHEMA
    columns = [name for name in SCHEMA.names if name != 'tokens']  # as the benchmark
    if config['way'] == 'read':
        byte_ranges._populate = lambda *args: False  # as where the kernel refuses
    read_threads = bench.use_read_threads(config.get('local_read_threads'),
                                          config['dataset'])
    files = sorted(glob.glob(os.path.join(config['dataset'], '*.parquet')))
    groups = [(path, pyarrow.parquet.read_metadata(path)) for path in files]
    staged = [(path, metadata, group) for path, metadata in groups
              for group in range(metadata.num_row_groups)][:config['row_groups']]
    kept = []
    read_s = 0.0
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for path, metadata, group in staged:
        row_group = row_group_source.RowGroupFile(path, group, columns, metadata)
        reading = time.perf_counter()
        ahead = row_group.read_ahead()
        read_s += time.perf_counter() - reading
        kept.append(row_group.memory_form(row_group.load_from_origin(ahead.value)))
        del kept[:-KEPT]
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {'way': config['way'], 'row_groups': len(staged),
            'local_read_threads': config.get('local_read_threads'),
            'read_threads': read_threads,
            'seconds': round(time.perf_counter() - started, 6),
            'read_s': round(read_s, 6),
            'user_s': round(after.ru_utime - before.ru_utime, 3),
            'kernel_s': round(after.ru_stime - before.ru_stime, 3)}


def format_table(runs: List[Dict]) -> str:
    """Medians of each way's runs (at each count of threads), and ``populate`` over ``read``.

    Args:
        runs: What :func:`run_one` returned, every repeat.
    """
    fields = ('seconds', 'read_s', 'user_s', 'kernel_s')
    counts = list(dict.fromkeys(run.get('local_read_threads') for run in runs))
    medians = {(way, count): {field: statistics.median(
        run.get(field, 0.0) for run in runs
        if (run['way'], run.get('local_read_threads')) == (way, count))
        for field in fields} for way in WAYS for count in counts}
    lines = ['way                 wall s   read s   user s kernel s  (medians of {} runs)'
             .format(sum((run['way'], run.get('local_read_threads'))
                         == (WAYS[0], counts[0]) for run in runs))]
    for count in counts:
        name = '' if count is None else ' {} threads'.format(count)
        for way in WAYS:
            lines.append('{:<18} {seconds:8.3f} {read_s:8.3f} {user_s:8.3f} '
                         '{kernel_s:8.3f}'.format(way + name, **medians[way, count]))
        lines.append('{:<18} {}'.format('ratio' + name, ' '.join(
            '{:7.2f}x'.format(medians['populate', count][field]
                              / max(medians['read', count][field], 1e-9))
            for field in fields)))
    return '\n'.join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if answer_child(argv, run_one):
        return 0
    from chainer_prefetch_bench.parquet import bench
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    bench.add_dataset_arguments(parser, rows=320000, files=8)
    parser.add_argument('--row-groups', type=int, default=9,
                        help='row groups staged a run (default 9: those of '
                        "the Parquet benchmark's 1,000 batches)")
    parser.add_argument('--repeats', type=int, default=5)
    bench.add_read_threads_argument(parser)
    parser.add_argument('--out', default=None,
                        help='folder for read_cost.json and table.txt')
    args = parser.parse_args(argv)
    dataset = bench.generated_dataset(args)
    runs = []
    for repeat in range(args.repeats):
        for count, way in run_order(itertools.product(args.local_read_threads, WAYS),
                                  repeat):
            drop_page_cache(dataset)
            run = run_in_child(__spec__.name, {
                'way': way, 'dataset': dataset, 'row_groups': args.row_groups,
                'local_read_threads': count}, timeout=600)
            runs.append(run)
            print('{way:<8} {read_threads} threads: {seconds:6.3f} s (reads '
                  '{read_s:.3f} s), user {user_s:.3f} s, kernel {kernel_s:.3f} s'
                  .format(**run), flush=True)
    table = format_table(runs)
    show_results(args.out, __spec__.name, argv, runs, table)
    return 0


if __name__ == '__main__':
    sys.exit(main())
