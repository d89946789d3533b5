"""Where the memory of row groups kept in memory goes, and what handing it back costs.

``ours-memory`` (``local_dir=':memory:'``, loader threads) keeps its row
groups decoded in the training process, in the C library's ``malloc``
(``row_group_source.decode_memory_pool``).  Its peak PSS grows with the rows read
although the row groups kept stay under ``local_capacity``.  This runs it as
the Parquet benchmark does (same dataset, columns, order and capacity) and
samples, inside the run's process every 0.1 s, the process's PSS split into
anonymous and file-backed pages, the C library's heap (``mallinfo2``: bytes
in use and bytes freed but kept), and the bytes Arrow's decode pool holds.

Two ways run side by side: ``keep`` (the product as it is) and ``trim``,
where the sampling thread calls ``malloc_trim(0)`` after every sample,
handing the heap's free pages back to the kernel (as an allocator that
does not keep freed memory would, a tenth of a second late).  Each runs at
the benchmark's 1,000 batches and at ``--growth`` times as many, every run
in a fresh process with the dataset's page cache dropped, alternating.
Memory is in MB of 10^6 bytes, as the benchmark's tables give it::

    python -m chainer_prefetch_bench.parquet.memory_breakdown \\
        --out results/parquet/memory_breakdown

Needs the GNU C library (``mallinfo2``, glibc 2.33).
"""
import argparse
import ctypes
import itertools
import resource
import statistics
import sys
import threading
import time
from typing import Dict, List, Optional

from chainer_prefetch_bench.testbed.page_cache import drop_page_cache
from chainer_prefetch_bench.testbed.processes import answer_child, run_in_child, run_order
from chainer_prefetch_bench.testbed.report import show_results

#: The ways compared: the C library keeping freed memory, or made to hand it back.
WAYS = ('keep', 'trim')
#: Seconds between samples.
SAMPLE_SECONDS = 0.1
MB = 1e6


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks',
        'uordblks', 'fordblks', 'keepcost')]


def _glibc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    try:
        libc.mallinfo2.restype = _MallInfo2
    except AttributeError:
        raise RuntimeError('memory_breakdown needs the GNU C library 2.33 or '
                           'newer (mallinfo2)') from None
    return libc


def _process_pss() -> Dict[str, int]:
    """This process's ``Pss``, ``Pss_Anon`` and ``Pss_File`` in bytes."""
    wanted = {'Pss': 'pss', 'Pss_Anon': 'anon', 'Pss_File': 'file'}
    found = {}
    with open('/proc/self/smaps_rollup') as rollup:
        for line in rollup:
            name, _, value = line.partition(':')
            if name in wanted:
                found[wanted[name]] = int(value.split()[0]) * 1024  # (kB: KiB)
    return found


def sample(libc: ctypes.CDLL, pool) -> Dict[str, float]:
    """One sample of this process's memory, in MB.

    Args:
        libc: The C library (:func:`_glibc`).
        pool: Arrow's decode pool (its ``bytes_allocated``).
    """
    heap = libc.mallinfo2()
    pss = _process_pss()
    return {'pss': pss['pss'] / MB, 'anon': pss['anon'] / MB,
            'file': pss['file'] / MB,
            'heap': (heap.arena + heap.hblkhd) / MB,
            'heap_used': (heap.uordblks + heap.hblkhd) / MB,
            'heap_free': heap.fordblks / MB,
            'pool': pool.bytes_allocated() / MB}


class Sampler:
    """Samples this process's memory on a thread of its own, and trims if asked.

    Used as a context manager: a sample when it is entered, then every
    :data:`SAMPLE_SECONDS` until it is left; an error of the sampling
    thread is raised when it is left.

    With ``trim``, each sample is followed by ``malloc_trim(0)``, which
    hands the heap's free pages back to the kernel (they stay counted as
    freed bytes).

    Args:
        libc: The C library (:func:`_glibc`).
        pool: Arrow's decode pool.
        trim: Whether to trim after each sample.
    """

    def __init__(self, libc: ctypes.CDLL, pool, trim: bool = False):
        self.libc = libc
        self.pool = pool
        self.trim = trim
        self.samples: List[Dict[str, float]] = []
        self.trims = 0
        self.trim_seconds = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name='memory-sampler',
                                        daemon=True)
        self._error: Optional[BaseException] = None

    def observe(self, may_trim: bool = True) -> Dict[str, float]:
        """Takes a sample (then trims, with ``trim`` and ``may_trim``); returns it."""
        one = sample(self.libc, self.pool)
        self.samples.append(one)
        if self.trim and may_trim:
            started = time.perf_counter()
            self.libc.malloc_trim(0)
            self.trim_seconds += time.perf_counter() - started
            self.trims += 1
        return one

    def _watch(self) -> None:
        try:
            while not self._done.wait(SAMPLE_SECONDS):
                self.observe()
        except BaseException as error:  # raised by __exit__
            self._error = error

    def __enter__(self) -> 'Sampler':
        self.observe()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()
        if self._error is not None and exc_info[0] is None:
            raise RuntimeError('sampling the memory failed') from self._error


def run_one(config: Dict) -> Dict:
    """One ``ours-memory`` run of the Parquet benchmark, sampled; returns the peaks.

    The peaks are those of the samples taken while the run lasts (until
    its iterator is finalized); one more sample after it, ``after_finalize``,
    gives what the process keeps.

    Args:
        config: ``way`` (one of :data:`WAYS`), and the Parquet benchmark's
            run configuration (``bench.run_config``) under ``run``.
    """
    import pyarrow

    from chainer_prefetch.datasets import row_group_source
    from chainer_prefetch_bench.parquet import bench
    sampler = Sampler(_glibc(), row_group_source.decode_memory_pool()
                      or pyarrow.default_memory_pool(), trim=config['way'] == 'trim')
    before = resource.getrusage(resource.RUSAGE_SELF)
    with sampler:
        result = bench.run_one(config['run'])
    after = resource.getrusage(resource.RUSAGE_SELF)
    during = list(sampler.samples)  # (the sample after finalize is not one of them)
    final = sampler.observe(may_trim=False)
    peak = max(during, key=lambda one: one['pss'])
    return {'way': config['way'],
            'rows': result['rows'], 'rows_per_s': result['rows_per_s'],
            'cpu_s': result['cpu_s'], 'samples': len(during),
            'kernel_s': round(after.ru_stime - before.ru_stime, 3),
            'minor_faults': after.ru_minflt - before.ru_minflt,
            'trims': sampler.trims, 'trim_s': round(sampler.trim_seconds, 3),
            'peak_pss_mb': round(peak['pss'], 1),
            'at_peak': {name: round(value, 1) for name, value in peak.items()},
            'peak_heap_mb': round(max(one['heap'] for one in during), 1),
            'peak_heap_used_mb': round(max(one['heap_used'] for one in during), 1),
            'peak_heap_free_mb': round(max(one['heap_free'] for one in during), 1),
            'peak_pool_mb': round(max(one['pool'] for one in during), 1),
            'after_finalize': {name: round(value, 1) for name, value in final.items()}}


#: The table's columns: heading, the value of a run, and its decimals.
COLUMNS = (
    ('rows/s', lambda run: run['rows_per_s'], 0),
    ('PSS MB', lambda run: run['peak_pss_mb'], 0),
    ('anon', lambda run: run['at_peak']['anon'], 0),
    ('file', lambda run: run['at_peak']['file'], 0),
    ('in use', lambda run: run['peak_heap_used_mb'], 0),
    ('freed', lambda run: run['peak_heap_free_mb'], 0),
    ('pool', lambda run: run['peak_pool_mb'], 0),
    ('kernel s', lambda run: run['kernel_s'], 2),
    ('faults k', lambda run: run['minor_faults'] / 1000, 0),
    ('trim s', lambda run: run['trim_s'], 2),
)


def format_table(runs: List[Dict]) -> str:
    """Medians of each way's runs at each count of rows, and ``trim`` over ``keep``.

    Each column is the median of its own value over the runs, so the
    columns need not add up.  Peaks while the run lasts: ``PSS MB``, the
    process's, split at that moment into ``anon`` (anonymous memory: the
    heap's resident pages, Python's, the batches') and ``file`` (the
    Parquet files' pages mapped while they are read ahead); the C
    library's heap: ``in use``, allocated, and ``freed``, freed and kept
    for reuse (handed back by a trim or not: a trim leaves them counted);
    ``pool``, the bytes Arrow's decode pool holds (the kept row groups and
    those being decoded).  Over the run: ``kernel s``, the process's
    system CPU time, ``faults k``, its minor page faults in thousands, and
    ``trim s``, the time the sampling thread spent in ``malloc_trim``.

    Args:
        runs: What :func:`run_one` returned, every repeat.
    """
    counts = sorted({run['rows'] for run in runs})
    lines = ['{:<6} {:>9}'.format('way', 'rows') + ''.join(
        '{:>9}'.format(heading) for heading, _, _ in COLUMNS)
        + '  (medians of {} runs)'.format(sum(
            (run['way'], run['rows']) == (WAYS[0], counts[0]) for run in runs))]
    for rows in counts:
        medians = {way: [statistics.median(value(run) for run in runs
                                           if (run['way'], run['rows']) == (way, rows))
                         for _, value, _ in COLUMNS] for way in WAYS}
        for way in WAYS:
            lines.append('{:<6} {:>9}'.format(way, rows) + ''.join(
                '{:>9.{}f}'.format(value, digits)
                for value, (_, _, digits) in zip(medians[way], COLUMNS)))
        lines.append('{:<6} {:>9}'.format('ratio', rows) + ''.join(
            '{:>8.2f}x'.format(trim / keep) if keep else '{:>9}'.format('-')
            for trim, keep in zip(medians['trim'], medians['keep'])))
    return '\n'.join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if answer_child(argv, run_one):
        return 0
    from chainer_prefetch_bench.parquet import bench
    _glibc()
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    bench.add_dataset_arguments(parser, rows=320000, files=8)
    parser.add_argument('--batches', type=int, default=1000,
                        help='batches of 100 of the shorter runs')
    parser.add_argument('--growth', type=int, default=10,
                        help='the longer runs read this many times the rows')
    parser.add_argument('--workers', type=int, default=4, help='loader threads')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--out', default=None,
                        help='folder for memory_breakdown.json and table.txt')
    args = parser.parse_args(argv)
    dataset = bench.generated_dataset(args)
    sizes = bench.row_group_sizes(dataset)
    runs = []
    for repeat in range(args.repeats):
        for batches, way in run_order(itertools.product(
                (args.batches, args.batches * args.growth), WAYS), repeat):
            drop_page_cache(dataset)
            run = run_in_child(__spec__.name, {
                'way': way,
                'run': bench.run_config('ours-memory', args.workers, dataset,
                                        batches, '', sizes)}, timeout=1200)
            runs.append(run)
            print('{way:<5} {rows:>8} rows: {rows_per_s:9.0f} rows/s, peak PSS '
                  '{peak_pss_mb:6.0f} MB, heap {peak_heap_mb:6.0f} MB (in use '
                  '{peak_heap_used_mb:.0f}, freed {peak_heap_free_mb:.0f}), '
                  '{trims} trims'.format(**run), flush=True)
    table = format_table(runs)
    show_results(args.out, __spec__.name, argv, runs, table)
    return 0


if __name__ == '__main__':
    sys.exit(main())
