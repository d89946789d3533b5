"""Whether a Parquet benchmark run's speed depends on the runs before it.

Runs ``--method`` right after the ``--before`` methods (run one after the
other, their results kept but not compared), then once more right after
itself, ``--repeats`` times; each run as the Parquet benchmark runs it (a
fresh process, the dataset's page cache dropped, memory sampled).  The
table gives the medians of both and their ratio.  On a virtual machine
that hands freed memory back to its host (``free_page_reporting`` in
:func:`~chainer_prefetch_bench.testbed.machine.machine_description`), a
run that takes much fresh memory can be slower after runs that freed a
lot::

    python -m chainer_prefetch_bench.parquet.run_history --method ours-memory \\
        --before ours-local,ours-threads --out results/parquet/run_history
"""
import argparse
import statistics
import sys
from typing import Dict, List

from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.report import write_results


def format_table(runs: List[Dict], method: str, before: List[str]) -> str:
    """Medians of ``method`` after ``before`` and after itself, and their ratio.

    Args:
        runs: Every run, each with its ``position`` (``'before'``,
            ``'after'`` or ``'again'``).
        method: The method compared.
        before: The methods run before it.
    """
    def rows_per_s(position):
        return [run['rows_per_s'] for run in runs
                if run['position'] == position and run['method'] == method]

    after, again = rows_per_s('after'), rows_per_s('again')
    lines = ['{:<44} {:>9}   runs (thousand rows/s)'.format(
        'run (medians of {})'.format(len(after)), 'rows/s')]
    for name, values in (('{} after {}'.format(method, '+'.join(before)), after),
                         ('{} after itself'.format(method), again)):
        lines.append('{:<44} {:>9.0f}   {}'.format(name, statistics.median(values), ', '.join(
            '{:.0f}'.format(value / 1000) for value in values)))
    lines.append('after {} / after itself: {:.2f}x'.format(
        '+'.join(before), statistics.median(after) / statistics.median(again)))
    return '\n'.join(lines)


def main(argv=None) -> int:
    from chainer_prefetch_bench.parquet import bench
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    bench.add_dataset_arguments(parser, rows=320000, files=8)
    parser.add_argument('--method', default='ours-memory')
    parser.add_argument('--before', default='ours-local,ours-threads',
                        help='methods run right before each timed pair')
    parser.add_argument('--workers', type=int, default=2)
    parser.add_argument('--batches', type=int, default=1000)
    parser.add_argument('--repeats', type=int, default=6)
    parser.add_argument('--local-dir', default='/dev/shm/bench_parquet_local')
    parser.add_argument('--out', default=None,
                        help='folder for run_history.json and table.txt')
    args = parser.parse_args(argv)
    before = args.before.split(',')
    def runs_here(method):  # on local files, in this environment
        return not method.startswith('petastorm') and not method.endswith('-shared')

    unknown = [method for method in [args.method] + before
               if method not in bench.METHODS or not runs_here(method)]
    if unknown:
        parser.error('not a method on local files in this environment: {} '
                     '(choose from {})'.format(', '.join(unknown), ', '.join(
                         method for method in bench.METHODS if runs_here(method))))
    dataset = bench.generated_dataset(args)
    sizes = bench.row_group_sizes(dataset)
    machine = machine_description()
    print('free page reporting: {}'.format(machine['free_page_reporting']), flush=True)
    runs = []
    for _ in range(args.repeats):
        for method, position in [(name, 'before') for name in before] + [
                (args.method, 'after'), (args.method, 'again')]:
            config = bench.run_config(method, args.workers, dataset, args.batches,
                                      args.local_dir, sizes)
            run = dict(bench.measure(config, dataset, args.local_dir, timeout=600),
                       position=position)
            runs.append(run)
            print('{:<6} {:<14} {:8.0f} rows/s'.format(
                position, method, run['rows_per_s']), flush=True)
    table = format_table(runs, args.method, before)
    print(table)
    if args.out:
        write_results(args.out, __spec__.name, argv, runs, table, machine=machine)
    return 0


if __name__ == '__main__':
    sys.exit(main())
