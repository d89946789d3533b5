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

With ``--before-local-dirs A,B`` it compares instead the local directories
the ``--before`` methods stage into: each repeat runs them into ``A`` and
then ``--method``, and the same into ``B`` (in the other order every other
repeat).  Every run empties its local directory before and after it, as
the benchmark does, so what a ``--before`` run staged is freed right
before the timed run.  For instance, after runs that staged into a tmpfs
against the machine's disk::

    python -m chainer_prefetch_bench.parquet.run_history --method ours-memory \\
        --before ours-threads --workers 4 --repeats 8 \\
        --before-local-dirs /dev/shm/bench_parquet_local,/tmp/bench_parquet/local \\
        --out results/parquet/run_history_local_dirs
"""
import argparse
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from chainer_prefetch_bench.testbed.machine import file_system_type, machine_description
from chainer_prefetch_bench.testbed.report import show_results


def run_sequence(method: str, before: List[str], local_dirs: List[str],
                 repeat: int) -> List[Tuple[str, str, str]]:
    """The runs of one repeat: ``(method, position, local directory)``.

    With one local directory: the ``before`` methods, then ``method``
    (position ``'after'``) and ``method`` again (``'again'``).  With
    two: for each directory, the ``before`` methods and then ``method``
    (position ``'after DIRECTORY'``), in reverse order every other repeat.

    Args:
        method: The method timed.
        before: The methods run before it.
        local_dirs: The local directories to compare (two), or one.
        repeat: The repeat's number (0 first).
    """
    if len(local_dirs) == 1:
        return [(name, 'before', local_dirs[0]) for name in before] + [
            (method, 'after', local_dirs[0]), (method, 'again', local_dirs[0])]
    order = local_dirs if repeat % 2 == 0 else local_dirs[::-1]
    return [run for directory in order for run in
            [(name, 'before', directory) for name in before]
            + [(method, 'after ' + directory, directory)]]


def format_table(runs: List[Dict], method: str, before: List[str],
                 local_dirs: Sequence[str] = (),
                 file_systems: Optional[Dict[str, str]] = None) -> str:
    """Medians of ``method`` after ``before`` and after itself, and their ratio.

    With two ``local_dirs``: the medians of ``method`` after ``before``
    staged into each, and the first over the second (with one, or none:
    after ``before`` and after itself).

    Args:
        runs: Every run, each with its ``position`` (:func:`run_sequence`).
        method: The method compared.
        before: The methods run before it.
        local_dirs: The local directories of the runs (:func:`run_sequence`).
        file_systems: The file system type of each of them, shown beside it
            (none where it is empty: not known).
    """
    def rows_per_s(position):
        return [run['rows_per_s'] for run in runs
                if run['position'] == position and run['method'] == method]

    after_before = '{} after {}'.format(method, '+'.join(before))
    if len(local_dirs) > 1:
        kinds = file_systems or {}
        compared = []
        for directory in local_dirs:
            kind = kinds.get(directory)
            name = '{} staged into {}{}'.format(
                after_before, directory, ' ({})'.format(kind) if kind else '')
            compared.append((name, rows_per_s('after ' + directory)))
        ratio_name = 'into {} / into {}'.format(local_dirs[0], local_dirs[1])
    else:
        compared = [(after_before, rows_per_s('after')),
                    ('{} after itself'.format(method), rows_per_s('again'))]
        ratio_name = 'after {} / after itself'.format('+'.join(before))
    width = max(44, *(len(name) for name, _ in compared))
    lines = ['{:<{}} {:>9}   runs (thousand rows/s)'.format(
        'run (medians of {})'.format(len(compared[0][1])), width, 'rows/s')]
    for name, values in compared:
        lines.append('{:<{}} {:>9.0f}   {}'.format(
            name, width, statistics.median(values),
            ', '.join('{:.0f}'.format(value / 1000) for value in values)))
    lines.append('{}: {:.2f}x'.format(ratio_name, statistics.median(compared[0][1])
                                      / statistics.median(compared[1][1])))
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
    parser.add_argument('--before-local-dirs', default=None,
                        help='compare these local directories (comma-separated) '
                             'for the --before runs, instead of --local-dir and '
                             'the method after itself')
    parser.add_argument('--out', default=None,
                        help='folder for run_history.json and table.txt')
    args = parser.parse_args(argv)
    before = args.before.split(',')
    local_dirs = [args.local_dir]
    if args.before_local_dirs is not None:
        local_dirs = args.before_local_dirs.split(',')
        if (len(local_dirs) != 2 or not all(local_dirs) or len(
                {os.path.realpath(directory) for directory in local_dirs}) != 2):
            parser.error('--before-local-dirs needs two different directories, '
                         'got {!r}'.format(args.before_local_dirs))
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
    file_systems = {directory: file_system_type(directory) for directory in local_dirs}
    width = max(len(position) for _, position, _ in run_sequence(
        args.method, before, local_dirs, 0))
    runs = []
    for repeat in range(args.repeats):
        for method, position, local_dir in run_sequence(args.method, before,
                                                        local_dirs, repeat):
            config = bench.run_config(method, args.workers, dataset, args.batches,
                                      local_dir, sizes)
            run = dict(bench.measure(config, dataset, local_dir, timeout=600),
                       position=position, local_dir=local_dir)
            runs.append(run)
            print('{:<{}} {:<14} {:8.0f} rows/s'.format(
                position, width, method, run['rows_per_s']), flush=True)
    table = format_table(runs, args.method, before, local_dirs, file_systems)
    show_results(args.out, __spec__.name, argv, runs, table, machine=machine,
                 file_systems=file_systems)
    return 0


if __name__ == '__main__':
    sys.exit(main())
