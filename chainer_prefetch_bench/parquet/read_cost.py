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

The runs alternate (``read``, ``populate``, ``read``, ...); the table gives
medians of ``--repeats`` runs and their ratios.
"""
import argparse
import glob
import os
import resource
import statistics
import sys
import time
from typing import Dict, List

from chainer_prefetch_bench.testbed.page_cache import drop_page_cache
from chainer_prefetch_bench.testbed.processes import answer_child, run_in_child
from chainer_prefetch_bench.testbed.report import write_results

#: The ways compared: reading into a scratch buffer (the fallback), and
#: faulting into the memory map (what the dataset does).
WAYS = ('read', 'populate')
#: Row groups kept decoded at once, as the Parquet benchmark's local room.
KEPT = 4


def run_one(config: Dict) -> Dict:
    """Stages ``config['row_groups']`` row groups one way; returns the times.

    Args:
        config: ``way`` (one of :data:`WAYS`), ``dataset`` (a folder of
            Parquet files), ``row_groups`` (how many, file after file).
    """
    import pyarrow.parquet

    from chainer_prefetch.datasets import parquet
    from chainer_prefetch_bench.testbed.parquet_dataset import SCHEMA
    columns = [name for name in SCHEMA.names if name != 'tokens']  # as the benchmark
    if config['way'] == 'read':
        parquet._populate = lambda *args: False  # as where the kernel refuses
    files = sorted(glob.glob(os.path.join(config['dataset'], '*.parquet')))
    groups = [(path, pyarrow.parquet.read_metadata(path)) for path in files]
    staged = [(path, metadata, group) for path, metadata in groups
              for group in range(metadata.num_row_groups)][:config['row_groups']]
    kept = []
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for path, metadata, group in staged:
        row_group = parquet.RowGroupFile(path, group, columns, metadata)
        ahead = row_group.read_ahead()
        kept.append(row_group.memory_form(row_group.load_from_origin(ahead.value)))
        del kept[:-KEPT]
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {'way': config['way'], 'row_groups': len(staged),
            'seconds': round(time.perf_counter() - started, 3),
            'user_s': round(after.ru_utime - before.ru_utime, 3),
            'kernel_s': round(after.ru_stime - before.ru_stime, 3)}


def format_table(runs: List[Dict]) -> str:
    """Medians of each way's runs, and ``populate`` over ``read``."""
    fields = ('seconds', 'user_s', 'kernel_s')
    medians = {way: {field: statistics.median(run[field] for run in runs
                                              if run['way'] == way)
                     for field in fields} for way in WAYS}
    lines = ['way        wall s   user s kernel s  (medians of {} runs)'.format(
        sum(run['way'] == WAYS[0] for run in runs))]
    for way in WAYS:
        lines.append('{:<8} {seconds:8.3f} {user_s:8.3f} {kernel_s:8.3f}'.format(
            way, **medians[way]))
    lines.append('{:<8} {}'.format('ratio', ' '.join(
        '{:7.2f}x'.format(medians['populate'][field] / max(medians['read'][field], 1e-9))
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
    parser.add_argument('--out', default=None,
                        help='folder for read_cost.json and table.txt')
    args = parser.parse_args(argv)
    dataset = bench.generated_dataset(args)
    runs = []
    for _ in range(args.repeats):
        for way in WAYS:
            drop_page_cache(dataset)
            run = run_in_child(__spec__.name, {
                'way': way, 'dataset': dataset,
                'row_groups': args.row_groups}, timeout=600)
            runs.append(run)
            print('{way:<8} {seconds:6.3f} s, user {user_s:.3f} s, kernel '
                  '{kernel_s:.3f} s'.format(**run), flush=True)
    table = format_table(runs)
    print(table)
    if args.out:
        write_results(args.out, __spec__.name, argv, runs, table)
    return 0


if __name__ == '__main__':
    sys.exit(main())
