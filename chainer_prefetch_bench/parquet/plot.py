#!/usr/bin/env python3
"""Medians over several runs of the Parquet benchmark: table and figure.

Usage::

    python -m chainer_prefetch_bench.parquet.plot results/parquet/run*/bench.json \\
        --out results/parquet
"""
import argparse
import json
import os
import sys
from typing import Dict, List

from chainer_prefetch_bench.parquet import bench


def median_runs(reports: List[Dict]) -> List[Dict]:
    """One run per (method, workers, rows) over every run of ``reports``: medians.

    Args:
        reports: bench.json contents of runs with the same configurations.
    """
    return bench.median_runs([run for report in reports
                              for run in report['runs']])


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
    merged['runs'] = [run for report in reports for run in report['runs']]
    merged['medians'] = median_runs(reports)
    merged['command'] = 'medians over {} reports: {}'.format(
        len(reports), '; '.join(report['command'] for report in reports))
    os.makedirs(args.out, exist_ok=True)
    text = bench.format_table(merged['medians'])
    print(text)
    with open(os.path.join(args.out, 'table_medians.txt'), 'w') as f:
        f.write(merged['command'] + '\n\n' + text + '\n')
    bench.plot(merged, os.path.join(args.out, 'throughput_memory.png'))
    return 0


if __name__ == '__main__':
    sys.exit(main())
