#!/usr/bin/env python3
"""Medians over several runs of the Parquet benchmark: table and figure.

Usage::

    python -m chainer_prefetch_bench.parquet.plot results/parquet/run*/bench.json \\
        --out results/parquet
"""
import argparse
import json
import os
import statistics
import sys
from typing import Dict, List

from chainer_prefetch_bench.parquet import bench

_MEDIAN_FIELDS = ('rows_per_s', 'peak_rss_mb', 'peak_pss_mb', 'first_batch_s',
                  'row_groups_per_batch')


def median_runs(reports: List[Dict]) -> List[Dict]:
    """One run per (method, workers): the median of each measured field.

    Args:
        reports: bench.json contents of runs with the same configurations.

    Returns:
        Runs in the order of the first report, with ``repeats`` added.
    """
    grouped = {}
    for report in reports:
        for run in report['runs']:
            grouped.setdefault((run['method'], run['workers']), []).append(run)
    merged = []
    for (method, workers), runs in grouped.items():
        run = dict(runs[0])
        for field in _MEDIAN_FIELDS:
            run[field] = statistics.median(r[field] for r in runs)
        run['duplicates_in_batches'] = sum(r['duplicates_in_batches']
                                           for r in runs)
        run['repeats'] = len(runs)
        merged.append(run)
    return merged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('reports', nargs='+', help='bench.json files')
    parser.add_argument('--out', required=True)
    args = parser.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    merged = dict(reports[0])
    merged['runs'] = median_runs(reports)
    merged['command'] = 'medians of {} runs: {}'.format(
        len(reports), '; '.join(report['command'] for report in reports))
    os.makedirs(args.out, exist_ok=True)
    text = bench.format_table(merged['runs'])
    print(text)
    with open(os.path.join(args.out, 'table_medians.txt'), 'w') as f:
        f.write(merged['command'] + '\n\n' + text + '\n')
    bench.plot(merged, os.path.join(args.out, 'throughput_memory.png'))
    return 0


if __name__ == '__main__':
    sys.exit(main())
