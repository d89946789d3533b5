#!/usr/bin/env python3
"""Parquet loaders side by side: rows/s, peak memory, coverage, shuffle quality.

On one generated shopping-like dataset (``testbed.parquet_dataset``),
batch 100, for each number of loader workers:

* ``ours-local``: ParquetDataset + RowGroupWindowOrderSampler +
  PrefetchMultiprocessIterator loading columnar batches (row groups staged
  as Arrow IPC files into an empty local directory, each batch cut out of
  them by one loader process and handed over as columns in shared memory),
  Parquet files on local disk; the training loop's converter
  (``concat_columns``) takes the columns;
* ``ours-shared``: the same, Parquet files read through the emulated shared
  storage (``testbed.storage``, FUSE);
* ``ours-threads``, ``ours-threads-shared``: as ``ours-local`` and
  ``ours-shared`` with loader threads in the training process
  (``loader_threads=True``): batches are cut out of the staged row groups
  there, with no pickling and no copy through shared memory;
* ``ours-memory``, ``ours-memory-shared``: as ``ours-threads`` and
  ``ours-threads-shared`` with the row groups kept decoded in the training
  process's memory (``local_dir=':memory:'``) instead of staged as files,
  under the same ``local_capacity``;
* ``ours-rows``: as ``ours-local`` on the row path (``columnar=False``:
  one example dict per row);
* ``ours-chainer``: ParquetDataset + the same sampler + Chainer's
  MultiprocessIterator (each worker reads Parquet itself, bounded cache);
* ``petastorm``: Petastorm's ``make_batch_reader`` (thread pool,
  row-group and row shuffling), its row-group-sized column batches cut into
  batches of 100 rows (columnar: no per-row objects);
* ``petastorm-rows``: the same, each batch turned into 100 row dicts (the
  examples Chainer's training loop would get from a row loader);
* ``petastorm-shared``: ``petastorm`` through the emulated shared storage;
* ``arrow-threads``: no staging and no loader processes, for reference:
  PyArrow in the training process, ``workers`` threads decoding the next
  row groups (in the pieces ours stages them in) while
  the current one is cut into batches (``StoredColumns``), row groups and
  rows shuffled as Petastorm does.  Only the work every loader must do (read,
  decode, cut batches out): what this machine allows, against which the
  cost of ours' loader processes and local files can be read;
* ``blog``: the blog's loader reimplemented: worker processes each cache
  ``num_cached_parquet`` files drawn at random, shuffle inside the cache and
  build whole batches of 100 rows from it (fastparquet, rows as dicts); files
  are drawn with replacement, so rows repeat within an epoch;
  ``blog-shared``: the same through the emulated shared storage.

``--window`` is how many row groups ours shuffles together (its
``RowGroupWindowOrderSampler``); with several (``--window 1,4``) every ours
method runs at each, labelled ``ours-local w1``, ``ours-local w4``.  Window 1
shuffles as Petastorm does (row groups in random order, rows within each):
every batch comes from one row group, the ``RG/batch`` column shows it.
``--arrow-memory default,retain,mimalloc`` likewise runs every method with
Arrow's allocators at their defaults, keeping freed memory for the next row
group, and with mimalloc as every method's allocator (``ARROW_MEMORY``),
labelled ``petastorm``, ``petastorm retain``, ``petastorm mimalloc``; each
is compared with Petastorm at the same setting.  ``--switch-interval
default,0.0001`` likewise runs every method with the interpreter's switch
interval at its default (5 ms) and at 0.1 ms (``sys.setswitchinterval`` in
the run's process, as a training script would call it), labelled
``petastorm``, ``petastorm switch0.1ms``.

Every configuration runs ``--repeats`` times, interleaved (repeat 1 of
every configuration, then repeat 2, ...), and the table shows medians;
ratios compare with Petastorm on the same storage at the same workers.

Every method reads the same six columns (all but ``tokens``: Petastorm's
``make_batch_reader`` fails on variable-length list columns).

Each run is a fresh child process; its clock starts once the method's
libraries are imported (a training job has them imported anyway).  The
parent samples the memory of the child and all its descendants (sum of RSS
and of PSS, which counts a page shared by several processes once) every
0.2 s and reports the peaks, and
the bytes in ours' local directory (``peak_local_mb``: memory too when the
directory is on tmpfs).  The page cache of the dataset is dropped before
each run.  ``cpu_s`` is the CPU time (user and system) of the run's
threads and processes, from the start of its clock to the end of its
teardown.  ``--growth K`` (or several, ``--growth 10,30``) adds runs of
``--growth-methods`` (default ``ours-local``) reading 1 and K times the
rows, to show that their memory stays flat; ``memory_growth.png`` draws
the memory of each of the longest over its run (PSS, plus the local
directory when it is on a tmpfs).

Coverage (the blog's Tables 4 and 5) is measured by running the loaders on
the ``id`` column for several epochs' worth of batches: the share of distinct
rows seen after each epoch's worth, and the share of distinct ids per batch.

Petastorm runs in its own virtual environment (``.venv-petastorm``, made on
first use by ``petastorm_env``: it needs ``pyarrow<15``), in the same kind of
child process as the other methods.

Usage::

    python -m chainer_prefetch_bench.parquet.bench            # full run (see --help)
    python -m chainer_prefetch_bench.parquet.bench --quick    # a few minutes
"""
import argparse
import glob
import json
import math
import multiprocessing
import os
import queue
import shutil
import signal
import statistics
import sys
import threading
import time
from typing import Dict, List, Optional

from chainer_prefetch_bench.parquet import petastorm_env
from chainer_prefetch_bench.testbed import parquet_dataset, storage
from chainer_prefetch_bench.testbed.machine import (
    file_system_type,
    free_page_reporting,
    machine_description,
)
from chainer_prefetch_bench.testbed.page_cache import drop_page_cache
from chainer_prefetch_bench.testbed.processes import (
    answer_child,
    exit_on_sigterm,
    run_in_child,
    run_order,
)
from chainer_prefetch_bench.testbed.report import write_json

BATCH_SIZE = 100
METHODS = ('ours-local', 'ours-shared', 'ours-threads', 'ours-threads-shared',
           'ours-memory', 'ours-memory-shared', 'ours-rows', 'ours-chainer', 'petastorm',
           'petastorm-rows', 'petastorm-shared', 'arrow-threads', 'blog',
           'blog-shared')
#: What each method is compared with (same storage, same workers).
PEERS = {'ours-local': 'petastorm', 'ours-shared': 'petastorm-shared',
         'ours-threads': 'petastorm', 'ours-threads-shared': 'petastorm-shared',
         'ours-memory': 'petastorm', 'ours-memory-shared': 'petastorm-shared',
         'ours-rows': 'petastorm', 'ours-chainer': 'petastorm',
         'petastorm-rows': 'petastorm', 'arrow-threads': 'petastorm',
         'blog': 'petastorm',
         'blog-shared': 'petastorm-shared'}
#: Ours' ``n_prefetch`` (``--prefetch``): finished batches kept ready for the
#: training loop; 1, Chainer's default.
PREFETCH = 1

#: ``--arrow-memory``: environment of a run for Arrow's memory allocators.
#: "retain" keeps the memory freed by one row group's decoding for the next
#: instead of handing it back to the kernel (mimalloc, the default
#: allocator of the product's PyArrow; jemalloc, that of Petastorm's PyArrow
#: 14; the product decodes the row groups it keeps in memory into the C
#: library's pool, ``row_group_source.decode_memory_pool``).  "mimalloc" makes mimalloc
#: every method's allocator, the product's decoding included (as before it
#: chose that pool).
ARROW_MEMORY = {
    'default': {},
    'retain': {'MIMALLOC_PURGE_DELAY': '-1',
               'JE_ARROW_MALLOC_CONF': 'dirty_decay_ms:-1,muzzy_decay_ms:-1'},
    'mimalloc': {'ARROW_DEFAULT_MEMORY_POOL': 'mimalloc'},
}


# ---------------------------------------------------------------- the loaders

def _open_ours(config: Dict, columns: List[str]):
    """Ours: an iterator yielding lists of example dicts."""
    import chainer

    from chainer_prefetch import PrefetchMultiprocessIterator
    from chainer_prefetch.datasets import ParquetDataset, RowGroupWindowOrderSampler
    from chainer_prefetch.staging.local_memory import MEMORY
    window = config['window']
    dataset = ParquetDataset(config['source'], columns=columns,
                             cache_row_groups=window)
    # Local room for 2 * window + 2 row groups, as the earlier LRU of the
    # dataset kept: the local store evicts by the known order within it.
    largest = max(group.estimated_local_bytes(None)
                  for group in _row_group_files(dataset))
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes,
                                         window=window, seed=config['seed'])
    if config['method'] == 'ours-chainer':
        iterator = chainer.iterators.MultiprocessIterator(
            dataset, BATCH_SIZE, n_processes=config['workers'],
            order_sampler=sampler)
    else:
        # Stage two row groups' worth of batches ahead: the next row group
        # is decoded while the current one is read, and the one after it
        # read ahead meanwhile.  (A window's worth made ahead row groups
        # that the run never reached, and, beyond the local room, evicted
        # some to make again.)
        ahead = config.get('copy_ahead') or 2 * -(-int(max(
            dataset.row_group_sizes)) // BATCH_SIZE)
        iterator = PrefetchMultiprocessIterator(
            dataset, BATCH_SIZE, n_processes=config['workers'],
            order_sampler=sampler, local_dir=(
                MEMORY if config['method'].startswith('ours-memory')
                else config['local_dir']),
            local_capacity=(config.get('local_row_groups') or 2 * window + 2)
            * largest, n_copy_ahead=ahead,
            n_prefetch=config.get('prefetch') or PREFETCH,
            columnar=config['method'] != 'ours-rows',
            loader_threads=config['method'].startswith(('ours-threads',
                                                        'ours-memory')))
    return iterator, dataset


def _ours_batches(config: Dict, columns: List[str], staging: Dict):
    from chainer_prefetch.columnar import concat_columns
    iterator, dataset = _open_ours(config, columns)
    try:
        while True:
            batch = iterator.next()
            if config['method'] in ('ours-rows', 'ours-chainer'):
                yield [example['id'] for example in batch]
            else:  # columns, as the training loop's converter takes them
                yield concat_columns(batch)['id']
    finally:
        staging.update(getattr(iterator, 'stats', {}))
        iterator.finalize()


def _petastorm_batches(config: Dict, columns: List[str]):
    from petastorm import make_batch_reader
    with make_batch_reader('file://' + config['source'],
                           schema_fields=columns,
                           workers_count=config['workers'],
                           shuffle_row_groups=True, shuffle_rows=True,
                           seed=config['seed'], num_epochs=None) as reader:
        pending = {}
        for row_group in reader:
            chunk = row_group._asdict()
            for name, values in chunk.items():
                pending[name] = (values if name not in pending else
                                 _concatenate(pending[name], values))
            while len(pending['id']) >= BATCH_SIZE:
                batch = {name: values[:BATCH_SIZE]
                         for name, values in pending.items()}
                pending = {name: values[BATCH_SIZE:]
                           for name, values in pending.items()}
                if config['method'] == 'petastorm-rows':
                    yield [row['id'] for row in _rows(batch)]
                else:
                    yield batch['id'].tolist()


def _arrow_threads_batches(config: Dict, columns: List[str]):
    """Batches cut in this process from row groups that threads decode ahead.

    ``workers`` threads each decode one of the next row groups; every epoch
    draws a new order of the row groups, and of the rows within each (a
    batch that a row group ends goes on with the next one).
    """
    import collections
    import concurrent.futures

    import numpy
    import pyarrow
    import pyarrow.parquet

    from chainer_prefetch.columnar import ColumnarBatch
    from chainer_prefetch.datasets.arrow_columns import StoredColumns
    from chainer_prefetch.datasets.row_group_source import (
        PooledParquetFile,
        RowGroupFile,
        decode_memory_pool,
    )
    files = sorted(glob.glob(os.path.join(config['source'], '*.parquet')))
    footers = {path: pyarrow.parquet.read_metadata(path) for path in files}
    groups = [(path, group) for path in files
              for group in range(footers[path].num_row_groups)]
    random = numpy.random.default_rng(config['seed'])

    def decode(path_and_group):
        path, group = path_and_group
        rows = RowGroupFile(path, group, columns, footers[path]).piece_rows()
        with pyarrow.memory_map(path) as mapped, PooledParquetFile(
                mapped, footers[path]) as parquet_file:
            parquet_file.decode_into(decode_memory_pool())  # as ours kept in memory
            pieces = list(parquet_file.iter_batches(
                batch_size=rows, row_groups=[group], columns=columns))
        return StoredColumns(pyarrow.Table.from_batches(pieces), columns)

    def drawn_groups():
        while True:
            yield from (groups[i] for i in random.permutation(len(groups)))

    order = drawn_groups()
    with concurrent.futures.ThreadPoolExecutor(config['workers']) as pool:
        pending = collections.deque(pool.submit(decode, next(order))
                                    for _ in range(config['workers']))
        try:
            parts, held = [], 0  # the rows of the next batch so far
            while True:
                stored = pending.popleft().result()
                pending.append(pool.submit(decode, next(order)))
                rows = random.permutation(stored.num_rows)
                start = 0
                while start < len(rows):
                    taken = rows[start:start + BATCH_SIZE - held]
                    parts.append(ColumnarBatch(stored.take(taken)))
                    start += len(taken)
                    held += len(taken)
                    if held == BATCH_SIZE:
                        yield ColumnarBatch.concatenate(parts).columns['id']
                        parts, held = [], 0
        finally:
            for future in pending:
                future.cancel()


def _rows(columns: Dict) -> List[Dict]:
    """A columnar batch as one dict per row (what Chainer's loop consumes)."""
    names = list(columns)
    return [dict(zip(names, values))
            for values in zip(*(columns[name].tolist() for name in names))]


def _concatenate(first, second):
    import numpy
    return numpy.concatenate([first, second])


def _blog_worker(files, columns, num_cached, seed, out_queue, stop_event):
    """One worker of the blog's loader: whole batches from its own file cache."""
    import fastparquet
    import numpy
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out_queue.cancel_join_thread()  # exit even with batches left unread
    random = numpy.random.RandomState(seed)
    while not stop_event.is_set():
        chosen = random.choice(len(files), min(num_cached, len(files)),
                               replace=False)
        frame = _concat_frames([fastparquet.ParquetFile(files[i]).to_pandas(
            columns=columns) for i in chosen])
        rows = frame.iloc[random.permutation(len(frame))]
        for start in range(0, len(rows) - BATCH_SIZE + 1, BATCH_SIZE):
            batch = rows.iloc[start:start + BATCH_SIZE].to_dict('records')
            while not stop_event.is_set():
                try:
                    out_queue.put([row['id'] for row in batch] if
                                  columns == ['id'] else batch, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if stop_event.is_set():
                return


def _concat_frames(frames):
    import pandas
    return pandas.concat(frames, ignore_index=True)


def _blog_batches(config: Dict, columns: List[str]):
    """The blog's loader with ``workers`` processes; batches in arrival order."""
    files = sorted(glob.glob(os.path.join(config['source'], '*.parquet')))
    context = multiprocessing.get_context('fork')
    out_queue = context.Queue(maxsize=2 * config['workers'])
    stop_event = context.Event()
    workers = [context.Process(
        target=_blog_worker, daemon=True,
        args=(files, columns, config['num_cached_parquet'],
              config['seed'] * 1000 + rank, out_queue, stop_event))
        for rank in range(config['workers'])]
    for worker in workers:
        worker.start()
    try:
        while True:
            try:
                batch = out_queue.get(timeout=60)
            except queue.Empty:
                dead = [w.pid for w in workers if not w.is_alive()]
                raise RuntimeError('blog loader: no batch for 60 s (dead '
                                   'workers: {})'.format(dead))
            yield batch if columns == ['id'] else [row['id'] for row in batch]
    finally:
        stop_event.set()
        for worker in workers:
            worker.join(5)
            if worker.is_alive():
                worker.kill()
                worker.join()


def _batches(config: Dict, columns: List[str], staging: Dict):
    if config['method'].startswith('ours'):
        return _ours_batches(config, columns, staging)
    if config['method'].startswith('petastorm'):
        return _petastorm_batches(config, columns)
    if config['method'] == 'arrow-threads':
        return _arrow_threads_batches(config, columns)
    return _blog_batches(config, columns)


# ---------------------------------------------------------------- one run

def _import_libraries(method: str) -> None:
    """Imports what ``method`` needs, so that the clock measures loading only.

    A training job has these imported anyway; the time to import them
    (about a second for Chainer, or for Petastorm with pandas) is not the
    loader's.
    """
    if method.startswith('ours'):
        import chainer  # noqa: F401

        import chainer_prefetch.columnar  # noqa: F401
        import chainer_prefetch.datasets  # noqa: F401
    elif method.startswith('petastorm'):
        import petastorm  # noqa: F401
    elif method == 'arrow-threads':
        import pyarrow.parquet  # noqa: F401

        import chainer_prefetch.datasets  # noqa: F401
    else:
        import fastparquet  # noqa: F401
        import pandas  # noqa: F401


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process and of its children that ended.

    Counts every thread (Petastorm's pool, Arrow's) and the loader processes
    of ours (ended and reaped when the iterator is finalized).
    """
    import resource
    return sum(usage.ru_utime + usage.ru_stime for usage in (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN)))


def _later_epochs_rows_per_s(rows: int, seconds: float, n_rows: int,
                             epoch_seconds: List[float]) -> Optional[float]:
    """Rows/s after the first epoch's worth of rows (``None`` if none followed).

    Args:
        rows: Rows read in the run.
        seconds: The run's duration.
        n_rows: Rows of one epoch.
        epoch_seconds: When each whole epoch's worth of rows was reached.
    """
    if not epoch_seconds or rows <= n_rows or seconds <= epoch_seconds[0]:
        return None
    return round((rows - n_rows) / (seconds - epoch_seconds[0]), 1)


#: The columns every timed run reads: all but ``tokens``, because
#: Petastorm's ``make_batch_reader`` cannot return variable-length lists.
TIMED_COLUMNS = [name for name in parquet_dataset.SCHEMA.names if name != 'tokens']


def run_config(method: str, workers: int, source: str, batches: int,
               local_dir: str, sizes: List[int], window: int = 1,
               arrow_memory: str = 'default', num_cached_parquet: int = 1,
               copy_ahead: int = 0, local_row_groups: int = 0,
               switch_interval: Optional[float] = None,
               prefetch: int = PREFETCH) -> Dict:
    """The configuration of one timed run, as :func:`run_one` takes it.

    Args:
        method: One of :data:`METHODS`.
        workers: Loader processes or threads.
        source: The folder of Parquet files (or the emulated storage's mount).
        batches: Batches of :data:`BATCH_SIZE` to time.
        local_dir: Ours' local directory.
        sizes: Rows of each row group (:func:`row_group_sizes`).
        window: Row groups ours shuffles together.
        arrow_memory: A setting of :data:`ARROW_MEMORY`.
        num_cached_parquet: Files in each worker's cache (blog).
        copy_ahead: Ours' ``n_copy_ahead`` in batches (0: the rows of the
            largest row group).
        local_row_groups: Ours' ``local_capacity`` in row groups (0: twice
            the window and 2).
        switch_interval: ``sys.setswitchinterval`` of the run's process in
            seconds (``None``: the interpreter's default).
        prefetch: Ours' ``n_prefetch``: finished batches kept ready.
    """
    return {'method': method, 'workers': workers, 'source': source,
            'arrow_memory': arrow_memory, 'switch_interval': switch_interval,
            'columns': TIMED_COLUMNS,
            'batches': batches, 'window': window,
            'num_cached_parquet': num_cached_parquet, 'local_dir': local_dir,
            'seed': 0, 'row_group_sizes': sizes, 'copy_ahead': copy_ahead,
            'local_row_groups': local_row_groups, 'prefetch': prefetch}


def run_one(config: Dict) -> Dict:
    """Runs one configuration in this process; returns its measurements.

    Imports no part of ``chainer_prefetch`` unless an ``ours`` method or
    ``arrow-threads`` runs (the Petastorm environment has no Chainer): the
    row-group layout comes in ``config['row_group_sizes']``.  The
    interpreter's switch interval is ``config['switch_interval']`` seconds
    (``None``: left as it is) while the run lasts; the result gives the
    interval in force when the first batch came.
    """
    switch_interval = sys.getswitchinterval()
    if config.get('switch_interval'):
        sys.setswitchinterval(config['switch_interval'])
    try:
        return _timed_run(config)
    finally:
        sys.setswitchinterval(switch_interval)


def _timed_run(config: Dict) -> Dict:
    import numpy
    columns = config['columns']
    sizes = numpy.asarray(config['row_group_sizes'], dtype=numpy.int64)
    row_group_of_id = numpy.repeat(numpy.arange(len(sizes)), sizes)
    n_rows = int(sizes.sum())
    _import_libraries(config['method'])
    started = time.perf_counter()
    cpu_started = _cpu_seconds()
    first_batch_s = switch_interval = None
    rows = duplicates_in_batches = 0
    groups_per_batch = []
    seen = numpy.zeros(n_rows, dtype=bool)
    coverage = []
    epoch_seconds = []  # when each whole epoch's worth of rows was reached
    staging = {}  # what stage 2 did (ours)
    batches = _batches(config, columns, staging)
    try:
        for number, ids in enumerate(batches, 1):
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - started
                switch_interval = round(sys.getswitchinterval(), 6)  # (whole us)
            ids = numpy.asarray(ids, dtype=numpy.int64)
            rows += len(ids)
            # Counted in sets: numpy.unique gives the GIL up, and taking it
            # back would make this loop wait for the loaders' threads.
            duplicates_in_batches += len(ids) - len(set(ids.tolist()))
            groups_per_batch.append(len(set(row_group_of_id[ids].tolist())))
            seen[ids] = True
            if rows >= (len(epoch_seconds) + 1) * n_rows:
                epoch_seconds.append(time.perf_counter() - started)
            if config.get('epochs') and rows >= (len(coverage) + 1) * n_rows:
                coverage.append(float(seen.mean()))
                if len(coverage) == config['epochs']:
                    break
            if not config.get('epochs') and number == config['batches']:
                break
        seconds = time.perf_counter() - started
    finally:
        batches.close()
    cpu_seconds = _cpu_seconds() - cpu_started
    return {'method': config['method'], 'workers': config['workers'],
            'window': (config['window'] if config['method'].startswith('ours')
                       else None),
            'prefetch': (config.get('prefetch', PREFETCH)
                         if config['method'].startswith('ours') else None),
            'arrow_memory': config.get('arrow_memory', 'default'),
            'switch_interval': (switch_interval if config.get('switch_interval')
                                else None),
            'rows': rows, 'seconds': round(seconds, 3),
            'rows_per_s': round(rows / seconds, 1),
            'cpu_s': round(cpu_seconds, 2),
            'later_epochs_rows_per_s': _later_epochs_rows_per_s(
                rows, seconds, n_rows, epoch_seconds),
            'first_batch_s': round(first_batch_s, 3),
            'duplicates_in_batches': int(duplicates_in_batches),
            'unique_ids_per_batch': 1 - duplicates_in_batches / rows,
            'row_groups_per_batch': float(numpy.mean(groups_per_batch)),
            'row_groups_used': int(len(numpy.unique(row_group_of_id[seen]))),
            'staging': staging,
            # Bytes ours copied from the Parquet files (counted when the
            # iterator is closed, after the last batch) over the run's seconds.
            'source_mb_per_s': (round(staging['bytes_copied'] / seconds / 1e6, 2)
                                if staging.get('bytes_copied') else None),
            'coverage_per_epoch': coverage}




# ---------------------------------------------------------------- backends

def compare_backends(files: List[str], repeats: int = 3) -> List[Dict]:
    """Reads every row group of ``files`` with PyArrow and with fastparquet.

    PyArrow yields Arrow tables (what the dataset uses); fastparquet yields
    pandas frames, so PyArrow is also timed with ``to_pandas()``.
    """
    import fastparquet
    import pyarrow
    import pyarrow.parquet
    column_sets = {'title (string)': ['title'],
                   'all columns': parquet_dataset.SCHEMA.names}

    def pyarrow_read(columns, to_pandas):
        for path in files:
            parquet_file = pyarrow.parquet.ParquetFile(path)
            for group in range(parquet_file.num_row_groups):
                table = parquet_file.read_row_group(group, columns=columns)
                if to_pandas:
                    table.to_pandas()

    def fastparquet_read(columns):
        for path in files:
            for _ in fastparquet.ParquetFile(path).iter_row_groups(
                    columns=columns):
                pass

    readers = {
        'pyarrow {} (Arrow)'.format(pyarrow.__version__):
            lambda columns: pyarrow_read(columns, False),
        'pyarrow {} (pandas)'.format(pyarrow.__version__):
            lambda columns: pyarrow_read(columns, True),
        'fastparquet {} (pandas)'.format(fastparquet.__version__):
            fastparquet_read,
    }
    results = []
    for label, columns in column_sets.items():
        for reader, read in readers.items():
            best = math.inf
            for _ in range(repeats):
                started = time.perf_counter()
                read(columns)
                best = min(best, time.perf_counter() - started)
            results.append({'columns': label, 'reader': reader,
                            'seconds': round(best, 4)})
    return results


# ---------------------------------------------------------------- report

MEDIAN_FIELDS = ('rows_per_s', 'peak_rss_mb', 'peak_pss_mb', 'peak_local_mb',
                 'first_batch_s', 'row_groups_per_batch', 'cpu_s',
                 'later_epochs_rows_per_s', 'source_mb_per_s')


#: Width of the method column of the tables (``ours-threads-shared w1 switch0.1ms``).
LABEL_WIDTH = 34


def label(run: Dict) -> str:
    """The method of a run, with ours' window, and ours' ``n_prefetch``, the
    memory setting and switch interval when not the defaults (``ours-local
    w4``, ``ours-memory w1 prefetch4``, ``petastorm retain``, ``ours-memory
    w1 switch0.1ms``)."""
    name = run['method']
    if run.get('window') is not None:
        name += ' w{}'.format(run['window'])
    # (None for other methods, and in results that did not record it: 1.)
    prefetch = run.get('prefetch')
    if prefetch is not None and prefetch != PREFETCH:
        name += ' prefetch{}'.format(prefetch)
    if run.get('arrow_memory', 'default') != 'default':
        name += ' ' + run['arrow_memory']
    interval = _switch_interval(run)
    if interval:
        name += ' switch{:g}ms'.format(interval * 1000)
    return name


def _switch_interval(run: Dict) -> Optional[float]:
    """The switch interval a run had, in whole microseconds (``None``: the default)."""
    interval = run.get('switch_interval')
    return round(interval, 6) if interval else None


def median_runs(runs: List[Dict]) -> List[Dict]:
    """One run per (method and window, workers, batches): the median of each measured field.

    Duplicates are summed; ``repeats`` and ``rows_per_s_all`` (every value)
    are added.  Order: that of the first occurrences.
    """
    grouped = {}
    for run in runs:
        key = (label(run), run['workers'], run['rows'])
        grouped.setdefault(key, []).append(run)
    merged = []
    for group in grouped.values():
        run = dict(group[0])
        for field in MEDIAN_FIELDS:
            # Fields a run did not measure (None, or absent from the
            # bench.json of an older version) do not count.
            values = [r[field] for r in group if r.get(field) is not None]
            run[field] = (statistics.median(values) if values
                          else group[0].get(field, 0.0))
        run['duplicates_in_batches'] = sum(r['duplicates_in_batches']
                                           for r in group)
        run['rows_per_s_all'] = [r['rows_per_s'] for r in group]
        run['repeats'] = len(group)
        merged.append(run)
    return merged


def format_table(runs: List[Dict]) -> str:
    """The throughput table (medians), with ratios to Petastorm on the same storage."""
    lines = ['{} {:>7} {:>9} {:>10} {:>6} {:>9} {:>9} {:>9} {:>8} {:>9} {:>8}'
             .format('method'.ljust(LABEL_WIDTH), 'workers', 'rows/s', 'vs peer',
                     'CPU s', 'RSS MB', 'PSS MB', 'local MB', '1st b s',
                     'dup/batch', 'RG/batch')]
    for run in runs:
        ratio = _vs_peer(run, runs, 'rows_per_s')
        cpu = ('{:>6.1f}'.format(run['cpu_s']) if run.get('cpu_s')
               else '{:>6}'.format('-'))  # runs from before it was measured
        lines.append('{} {:>7} {:>9.0f} {} {} {:>9.0f} {:>9.0f} {:>9.0f} '
                     '{:>8.2f} {:>9} {:>8.2f}'.format(
                         label(run).ljust(LABEL_WIDTH), run['workers'], run['rows_per_s'],
                         ratio, cpu, run['peak_rss_mb'], run['peak_pss_mb'],
                         run.get('peak_local_mb', 0), run['first_batch_s'],
                         run['duplicates_in_batches'],
                         run['row_groups_per_batch']))
    lines.append('"vs peer": rows/s over Petastorm\'s on the same storage at the '
                 'same workers and settings (petastorm for local files, '
                 'petastorm-shared through the emulated storage); "CPU s": CPU '
                 "time of all the run's threads and processes")
    if any(_switch_interval(run) for run in runs):
        lines.append('"switchNms": the run\'s process had '
                     'sys.setswitchinterval(N / 1000) (default 5 ms; loader '
                     'processes started by forkserver keep 5 ms)')
    return '\n'.join(lines)


def _vs_peer(run: Dict, runs: List[Dict], field: str) -> str:
    """``run[field]`` over that of Petastorm on the same storage and workers
    (and memory setting and switch interval)."""
    base = next((peer.get(field) for peer in runs
                 if peer['method'] == PEERS.get(run['method'])
                 and peer['workers'] == run['workers']
                 and peer.get('arrow_memory') == run.get('arrow_memory')
                 and _switch_interval(peer) == _switch_interval(run)),
                None)
    return ('{:>9.2f}x'.format(run[field] / base) if base and run.get(field)
            else '{:>10}'.format('-'))


def format_later_epochs(runs: List[Dict]) -> str:
    """Rows/s after the first epoch's worth (medians), against Petastorm's."""
    lines = ['{} {:>7} {:>9} {:>10}'.format(
        'method'.ljust(LABEL_WIDTH), 'workers', 'rows/s', 'vs peer')]
    for run in runs:
        lines.append('{} {:>7} {:>9.0f} {}'.format(
            label(run).ljust(LABEL_WIDTH), run['workers'], run['later_epochs_rows_per_s'],
            _vs_peer(run, runs, 'later_epochs_rows_per_s')))
    return '\n'.join(lines)


def format_growth(runs: List[Dict]) -> str:
    """Memory of ours as the rows read grow."""
    lines = ['{} {:>7} {:>10} {:>9} {:>9} {:>9}'.format(
        'method'.ljust(LABEL_WIDTH), 'workers', 'rows', 'rows/s', 'PSS MB', 'local MB')]
    for run in runs:
        lines.append('{} {:>7} {:>10} {:>9.0f} {:>9.0f} {:>9.0f}'.format(
            label(run).ljust(LABEL_WIDTH), run['workers'], run['rows'], run['rows_per_s'],
            run['peak_pss_mb'], run.get('peak_local_mb', 0)))
    return '\n'.join(lines)


def format_coverage(coverage_runs: List[Dict]) -> str:
    """Coverage per epoch's worth (Table 4) and distinct ids per batch (Table 5)."""
    epochs = max(len(run['coverage_per_epoch']) for run in coverage_runs)
    header = '{:<22}'.format('unique rows after') + ''.join(
        '{:>8}'.format('{} ep'.format(e + 1)) for e in range(epochs)) + (
        '{:>16}'.format('ids/batch uniq'))
    lines = [header]
    for run in coverage_runs:
        lines.append('{:<22}'.format('{} ({} workers)'.format(
            run['method'], run['workers'])) + ''.join(
            '{:>7.1f}%'.format(100 * share)
            for share in run['coverage_per_epoch']) + ' ' * 8 * (
            epochs - len(run['coverage_per_epoch'])) + '{:>15.2f}%'.format(
            100 * run['unique_ids_per_batch']))
    lines.append('{:<22}'.format('1 - e^-k (formula)') + ''.join(
        '{:>7.1f}%'.format(100 * (1 - math.exp(-(e + 1))))
        for e in range(epochs)))
    lines.append('{:<22}'.format('blog, Table 4') + ''.join(
        '{:>7}%'.format(share) for share in (63, 87, 95, 98, 99)[:epochs]))
    return '\n'.join(lines)


def plot(report: Dict, path: str) -> None:
    """Rows/s and peak PSS per method against workers."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.5))
    medians = report.get('medians') or median_runs(report['runs'])
    for name in dict.fromkeys(label(run) for run in medians):
        runs = [run for run in medians if label(run) == name]
        style = '--' if runs[0]['method'].endswith('-shared') else '-'
        workers = [run['workers'] for run in runs]
        speed.plot(workers, [run['rows_per_s'] for run in runs], 'o' + style,
                   label=name)
        memory.plot(workers, [run['peak_pss_mb'] + _tmpfs_mb(report, run)
                              for run in runs], 'o' + style, label=name)
    speed.set(xlabel='loader workers', ylabel='rows/s (batch 100), median',
              title='Throughput (dashed: emulated shared storage)')
    memory.set(xlabel='loader workers',
               ylabel='peak PSS of all processes (+ tmpfs) MB',
               title='Memory')
    for axes in (speed, memory):
        axes.set_xticks(sorted({run['workers'] for run in report['runs']}))
        axes.grid(alpha=0.3)
    speed.legend(fontsize=8)
    figure.suptitle('{rows:,} rows, {files} files, {row_groups} row groups, '
                    '{gb:.1f} GB'.format(**report['dataset_summary']))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_growth(report: Dict, path: str) -> None:
    """Memory over the run of the growth runs that read the most rows."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import numpy
    runs = [run for run in report['growth_runs'] if run.get('memory_trace')]
    if not runs:
        return
    most = max(run['rows'] for run in runs)
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for run in (run for run in runs if run['rows'] == most):
        seconds, pss = numpy.asarray(run['memory_trace'], dtype=float).reshape(-1, 2).T
        if _tmpfs_mb(report, run):
            local = numpy.asarray(run['local_trace'], dtype=float)
            pss = pss + numpy.interp(seconds, local[:, 0], local[:, 1]) * 2**20 / 1e6
            name = label(run) + ' (PSS + tmpfs)'
        else:
            name = label(run) + ' (PSS)'
        axes.plot(seconds, pss, label=name)
    axes.set(xlabel='seconds since the run started ({:,} rows read in each)'.format(most),
             ylabel='MB', title='Memory over a run, {} workers'.format(runs[0]['workers']))
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _tmpfs_mb(report: Dict, run: Dict) -> float:
    """The local directory's peak bytes when it lives in memory (tmpfs)."""
    return run.get('peak_local_mb', 0) if report.get('local_dir_in_memory') else 0


# ---------------------------------------------------------------- main

def add_dataset_arguments(parser: argparse.ArgumentParser, rows: int = 400000,
                          files: int = 16) -> None:
    """The options of the generated dataset (:func:`generated_dataset` reads them).

    Args:
        parser: The parser to add ``--workdir``, ``--rows``, ``--files``,
            ``--row-group-mb`` and ``--image-size`` to.
        rows: Default of ``--rows``.
        files: Default of ``--files``.
    """
    parser.add_argument('--workdir', default='/tmp/bench_parquet')
    parser.add_argument('--rows', type=int, default=rows)
    parser.add_argument('--files', type=int, default=files)
    parser.add_argument('--row-group-mb', type=float, default=120.0)
    parser.add_argument('--image-size', type=int, default=96)


def add_read_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--local-read-threads``: the product's threads reading a row group
    from a node-local file system, a list of counts run side by side
    (``args.local_read_threads``; ``[None]``: the product's default).

    Args:
        parser: The parser to add it to.
    """
    def counts(value: str) -> List[Optional[int]]:
        refused = argparse.ArgumentTypeError(
            'a list of positive counts, got {!r}'.format(value))
        try:
            parsed = [int(count) for count in value.split(',')] if value else [None]
        except ValueError:
            raise refused from None
        if any(count is not None and count < 1 for count in parsed):
            raise refused
        return parsed

    parser.add_argument('--local-read-threads', type=counts, default=[None],
                        help='threads reading a row group from a node-local '
                        'file system, a list side by side (2,8); default: '
                        "the product's")


def use_read_threads(count: Optional[int], dataset_dir: str) -> int:
    """Sets the product's ``LOCAL_READ_THREADS`` in this (a run's) process;
    returns the threads that will read ``dataset_dir``'s row groups.

    Args:
        count: The threads for node-local storage (``None``: the product's
            default).
        dataset_dir: The folder of Parquet files the run reads.
    """
    from chainer_prefetch.datasets import byte_ranges, find_parquet_files
    if count:
        byte_ranges.LOCAL_READ_THREADS = count
    return byte_ranges.read_threads_for(find_parquet_files(dataset_dir)[0])


def generated_dataset(args: argparse.Namespace) -> str:
    """The dataset of :func:`add_dataset_arguments`' options: its folder (made if missing)."""
    return _generated(args.workdir, args.rows, args.files, args.row_group_mb,
                      args.image_size)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--quick', action='store_true',
                        help='tiny dataset, few batches, workers 1 and 2 '
                        '(under a minute); options given as well still apply')
    add_dataset_arguments(parser)
    parser.add_argument('--local-dir', default=None,
                        help='the local directory of ours (default: WORKDIR/local)')
    parser.add_argument('--out', default='results/parquet')
    parser.add_argument('--batches', type=int, default=1000,
                        help='timed batches of 100 per run')
    parser.add_argument('--repeats', type=int, default=3,
                        help='runs of every configuration (medians reported)')
    parser.add_argument('--growth', default='10',
                        help='also run --growth-methods at the most workers '
                        'reading once and this many times the rows (several: '
                        '10,30; 0: not)')
    parser.add_argument('--growth-methods', default='ours-local',
                        help='the methods of the growth runs (ours only)')
    parser.add_argument('--local-row-groups', type=int, default=0,
                        help="ours' local_capacity in row groups (0: twice "
                        'the window and 2; the number of row groups keeps '
                        'every one staged for the later epochs)')
    parser.add_argument('--copy-ahead', type=int, default=0,
                        help="ours' n_copy_ahead in batches (0: the rows of "
                        'the largest row group)')
    parser.add_argument('--prefetch', default=str(PREFETCH),
                        help="ours' n_prefetch, finished batches kept ready "
                        "(Chainer's default is 1): one number, or several "
                        '(each ours method runs at each)')
    parser.add_argument('--workers', default='1,2,4')
    parser.add_argument('--methods', default=','.join(METHODS))
    parser.add_argument('--window', default='4',
                        help='row groups shuffled together by ours: one '
                        'number, or several (each ours method runs at each); '
                        "1 is Petastorm's shuffle (each batch from one row "
                        'group)')
    parser.add_argument('--switch-interval', default='default',
                        help='comma-separated switch intervals of the runs\' '
                        'processes in seconds, or default (5 ms); each method '
                        'runs at each')
    parser.add_argument('--arrow-memory', default='default',
                        help='memory setting of every run, or several (each '
                        'method runs at each): default, retain (Arrow '
                        'keeps freed memory for the next row group) or '
                        'mimalloc (every allocation in mimalloc); see '
                        'ARROW_MEMORY')
    parser.add_argument('--num-cached-parquet', type=int, default=2,
                        help="files in each worker's cache (blog)")
    parser.add_argument('--coverage-epochs', type=int, default=5,
                        help="epochs' worth of batches for the coverage runs "
                        '(0: no coverage runs)')
    parser.add_argument('--coverage-rows', type=int, default=200000)
    parser.add_argument('--coverage-files', type=int, default=400,
                        help='files of the coverage dataset (the blog had '
                        '2,000: the share of rows seen moves file by file)')
    parser.add_argument('--preset', default='paper',
                        choices=sorted(storage.PRESETS))
    parser.add_argument('--run-timeout', type=float, default=900)
    parser.add_argument('--petastorm-venv', default=petastorm_env.DEFAULT_DIR,
                        help="Petastorm's own environment (made on first use)")
    args = parser.parse_args(argv)
    if args.quick:  # new defaults: the options given still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    args.workers = [int(w) for w in args.workers.split(',')]
    args.windows = [int(w) for w in str(args.window).split(',')]
    args.prefetches = [int(n) for n in str(args.prefetch).split(',')]
    if min(args.prefetches) < 1:
        parser.error('--prefetch: at least 1 batch, got {}'.format(args.prefetch))
    args.prefetch = args.prefetches[0]  # growth and coverage runs
    args.window = max(args.windows)  # growth and coverage runs
    args.methods = args.methods.split(',')
    args.growth = [int(factor) for factor in str(args.growth).split(',')
                   if int(factor) > 0]
    args.growth_methods = args.growth_methods.split(',')
    if not all(method.startswith('ours') and method in METHODS
               for method in args.growth_methods):
        parser.error('--growth-methods: ours methods only, got {}'.format(
            ','.join(args.growth_methods)))
    args.arrow_memory = args.arrow_memory.split(',')
    unknown = set(args.arrow_memory) - set(ARROW_MEMORY)
    if unknown:
        parser.error('--arrow-memory: unknown setting(s) {}; choose from {}'
                     .format(', '.join(sorted(unknown)),
                             ', '.join(ARROW_MEMORY)))
    args.switch_intervals = []
    for value in args.switch_interval.split(','):
        try:
            interval = None if value == 'default' else float(value)
        except ValueError:
            interval = 0.0
        if interval is not None and not 1e-6 <= interval <= 60:
            parser.error('--switch-interval: {!r} is neither default nor a '
                         'number of seconds from 0.000001 (the interpreter '
                         'keeps whole microseconds) to 60'.format(value))
        args.switch_intervals.append(interval)
    return args


#: The defaults ``--quick`` sets.
QUICK = {'rows': 8000, 'files': 4, 'row_group_mb': 4.0, 'image_size': 64,
         'batches': 20, 'workers': '1,2', 'coverage_epochs': 2,
         'coverage_rows': 8000, 'coverage_files': 40, 'repeats': 1,
         'growth': '3'}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if answer_child(argv, run_one):
        # Petastorm leaves threads behind that sometimes abort the
        # interpreter's teardown ("terminate called without an active
        # exception"); the result is out, so skip the teardown.
        os._exit(0)
    args = parse_args(argv)
    exit_on_sigterm()
    petastorm_python = None
    if any(method.startswith('petastorm') for method in args.methods):
        petastorm_python = petastorm_env.ensure(args.petastorm_venv)
    dataset_dir = generated_dataset(args)
    summary = _dataset_summary(dataset_dir)
    print('dataset: {rows:,} rows, {files} files, {row_groups} row groups of '
          '{row_group_rows} rows, {gb:.2f} GB'.format(**summary), flush=True)
    if free_page_reporting():
        print('note: this virtual machine hands freed memory back to its host '
              '(virtio-balloon free page reporting): memory taken afresh costs '
              'more after runs that freed a lot, so a run depends on the runs '
              'before it',
              flush=True)
    files = sorted(glob.glob(os.path.join(dataset_dir, '*.parquet')))
    backends = compare_backends(files[:2] if len(files) > 2 else files)
    for row in backends:
        print('read {columns:<15} {reader:<28} {seconds:.3f} s'.format(**row))
    mountpoint = os.path.join(args.workdir, 'mnt')
    local_dir = args.local_dir or os.path.join(args.workdir, 'local')
    os.makedirs(mountpoint, exist_ok=True)
    runs, coverage_runs, growth_runs = [], [], []
    sizes = row_group_sizes(dataset_dir)

    def config_for(method, workers, batches, source, window=args.window,
                   arrow_memory=args.arrow_memory[0],
                   switch_interval=args.switch_intervals[0],
                   prefetch=args.prefetch):
        return run_config(method, workers, source, batches, local_dir, sizes,
                          window=window, arrow_memory=arrow_memory,
                          num_cached_parquet=args.num_cached_parquet,
                          copy_ahead=args.copy_ahead,
                          local_row_groups=args.local_row_groups,
                          prefetch=prefetch,
                          switch_interval=switch_interval)

    with storage.mounted(dataset_dir, mountpoint, preset=args.preset):
        for repeat in range(args.repeats):
            for workers in args.workers:
                for method, window, prefetch, memory, switch in run_order(
                        _variants(args), repeat):
                    source = (mountpoint if method.endswith('-shared')
                              else dataset_dir)
                    result = measure(config_for(method, workers, args.batches,
                                                 source, window, memory, switch,
                                                 prefetch),
                                      dataset_dir, local_dir, args.run_timeout,
                                      petastorm_python)
                    result['repeat'] = repeat
                    del result['memory_trace'], result['local_trace']  # (growth runs keep theirs)
                    runs.append(result)
                    print('{} workers {workers}: {rows_per_s:8.0f} '
                          'rows/s, CPU {cpu_s:5.1f} s, peak PSS {peak_pss_mb:6.0f} '
                          'MB, local {peak_local_mb:5.0f} MB'.format(
                              label(result).ljust(LABEL_WIDTH), **result),
                          flush=True)
    for method in args.growth_methods if args.growth else ():
        for factor in sorted({1, *args.growth}):
            result = measure(config_for(method, max(args.workers),
                                         args.batches * factor, dataset_dir),
                              dataset_dir, local_dir, args.run_timeout * factor)
            growth_runs.append(result)
            print('growth {} x{}: {rows} rows, peak PSS {peak_pss_mb:.0f} MB, '
                  'local {peak_local_mb:.0f} MB'.format(method, factor, **result),
                  flush=True)
    coverage_dir = coverage_summary = None
    if args.coverage_epochs:
        coverage_dir = _generated(args.workdir, args.coverage_rows,
                                  args.coverage_files, args.row_group_mb, 8)
        coverage_summary = _dataset_summary(coverage_dir)
    for method in ('blog', 'ours-local') if coverage_dir else ():
        config = {'method': method, 'workers': 2, 'source': coverage_dir,
                  'columns': ['id'], 'epochs': args.coverage_epochs,
                  'window': args.window, 'seed': 1,
                  'num_cached_parquet': args.num_cached_parquet,
                  'local_dir': local_dir,
                  'row_group_sizes': row_group_sizes(coverage_dir)}
        result = measure(config, coverage_dir, local_dir, args.run_timeout)
        coverage_runs.append(result)
        print('coverage {method}: {coverage_per_epoch}'.format(**result),
              flush=True)
    bytes_per_row = _source_bytes_per_row(dataset_dir, TIMED_COLUMNS)
    bandwidth = storage.Params.from_preset(args.preset).bandwidth_mbps
    report = {'command': 'python -m {} {}'.format(__spec__.name, ' '.join(argv)),
              'machine': machine_description(),
              'dataset_summary': summary, 'preset': args.preset,
              'source_bytes_per_row': bytes_per_row,
              'storage_bandwidth_mbps': bandwidth,
              'storage_bound_rows_per_s': storage_bound(bytes_per_row,
                                                        bandwidth),
              'coverage_dataset_summary': coverage_summary,
              'window': args.window, 'batch_size': BATCH_SIZE,
              'ours_n_prefetch': args.prefetches,
              'backends': backends, 'runs': runs,
              'medians': median_runs(runs), 'repeats': args.repeats,
              'growth_runs': growth_runs, 'coverage_runs': coverage_runs,
              'local_dir': local_dir,
              'local_dir_in_memory': _on_tmpfs(local_dir),
              'versions': _versions(petastorm_python)}
    _write_report(report, args.out)
    return 0


def _variants(args):
    """``(method, window, prefetch, arrow memory, switch interval)`` of every
    run of one repeat: ours at each window and ``n_prefetch``, every method
    at each memory setting and switch interval."""
    return [(method, window, prefetch, memory, switch)
            for switch in args.switch_intervals
            for memory in args.arrow_memory
            for method in args.methods
            for window in (args.windows if method.startswith('ours')
                           else [args.window])
            for prefetch in (args.prefetches if method.startswith('ours')
                             else [args.prefetch])]


def _generated(workdir: str, rows: int, files: int, row_group_mb: float,
               image_size: int) -> str:
    """The generated dataset of these parameters (made if missing)."""
    directory = os.path.join(workdir, 'shop-{}-{}-{}-{}'.format(
        rows, files, row_group_mb, image_size))
    if not os.path.exists(os.path.join(directory, '_dataset.json')):
        print('generating a dataset into', directory, flush=True)
        parquet_dataset.main([directory, '--rows', str(rows), '--files',
                                   str(files), '--row-group-mb',
                                   str(row_group_mb), '--image-size',
                                   str(image_size)])
    return directory


def measure(config: Dict, dataset_dir: str, local_dir: str, timeout: float,
            petastorm_python: Optional[str] = None) -> Dict:
    """One timed run, as every run of the benchmark: in a fresh process, memory sampled.

    The local directory is emptied and the dataset's page cache dropped
    first; the directory's size is sampled while the run lasts.

    Args:
        config: The run (:func:`run_config`).
        dataset_dir: The dataset (its page cache is dropped).
        local_dir: Ours' local directory.
        timeout: Seconds before the run is killed.
        petastorm_python: The interpreter of Petastorm's environment, for
            its methods.

    Returns:
        The run's result (:func:`run_one`), with ``peak_local_mb`` and
        ``local_trace`` added.
    """
    shutil.rmtree(local_dir, ignore_errors=True)
    drop_page_cache(dataset_dir)
    python = (petastorm_python if config['method'].startswith('petastorm')
              else None)
    trace = []  # [seconds, MB] of the local directory
    started = time.monotonic()
    done = threading.Event()

    def sample():  # the local directory's bytes (memory, on a tmpfs)
        while not done.wait(0.2):
            trace.append([round(time.monotonic() - started, 2),
                          round(_bytes_under(local_dir) / 2**20, 1)])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = run_in_child(
            __spec__.name, config, timeout, python=python, sample_memory=True,
            environment=ARROW_MEMORY[config.get('arrow_memory', 'default')])
    finally:
        done.set()
        sampler.join()
    result['peak_local_mb'] = max((mb for _, mb in trace), default=0.0)
    result['local_trace'] = trace
    shutil.rmtree(local_dir, ignore_errors=True)
    return result


def _on_tmpfs(directory: str) -> bool:
    """Whether ``directory`` (or the folder it will be made in) is a tmpfs."""
    return file_system_type(directory) == 'tmpfs'


def _bytes_under(directory: str) -> int:
    total = 0
    for folder, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                pass
    return total


def row_group_sizes(dataset_dir: str) -> List[int]:
    """Rows of each row group, in the order ParquetDataset numbers rows."""
    from chainer_prefetch.datasets import ParquetDataset
    return [int(size) for size in
            ParquetDataset(dataset_dir, columns=['id']).row_group_sizes]


def _dataset_summary(dataset_dir: str) -> Dict:
    import pyarrow.parquet
    files = sorted(glob.glob(os.path.join(dataset_dir, '*.parquet')))
    metadata = [pyarrow.parquet.read_metadata(path) for path in files]
    with open(os.path.join(dataset_dir, '_dataset.json')) as f:
        generated = json.load(f)
    return {'rows': sum(m.num_rows for m in metadata), 'files': len(files),
            'row_groups': sum(m.num_row_groups for m in metadata),
            'row_group_rows': generated['row_group_rows'],
            'gb': sum(os.path.getsize(path) for path in files) / 1e9,
            'image_size': generated['image_size']}


def _row_group_files(dataset) -> List:
    """The ``RowGroupFile`` of each non-empty row group of a ``ParquetDataset``."""
    import numpy
    firsts = numpy.cumsum(dataset.row_group_sizes) - dataset.row_group_sizes
    return [dataset.example_files(int(first))[0] for first, size
            in zip(firsts, dataset.row_group_sizes) if size]


def _source_bytes_per_row(dataset_dir: str, columns: List[str]) -> float:
    """Compressed bytes of ``columns`` per row: what reading a row costs the storage."""
    from chainer_prefetch.datasets import ParquetDataset
    dataset = ParquetDataset(dataset_dir, columns=columns)
    total = sum(group.source_bytes(None) for group in _row_group_files(dataset))
    return total / max(1, len(dataset))


def storage_bound(bytes_per_row: float, bandwidth_mbps: float) -> Optional[float]:
    """The most rows/s any loader can read through storage of ``bandwidth_mbps``.

    Args:
        bytes_per_row: Compressed bytes of the columns read, per row.
        bandwidth_mbps: The storage's cap in MB/s (0: none).

    Returns:
        Rows/s, or ``None`` without a cap.
    """
    if not bandwidth_mbps or not bytes_per_row:
        return None
    return bandwidth_mbps * 1e6 / bytes_per_row


def format_storage_bound(report: Dict) -> str:
    """What share of the emulated storage's bound each shared method reached.

    The bound counts the bytes of the rows read; a loader reads whole row
    groups, more than that.  For ours, which counts the bytes it copies, the
    share of the mount's bandwidth its run used from start to end follows
    (the bytes of whole row groups, over the run's seconds).
    """
    bound = report.get('storage_bound_rows_per_s')
    if not bound:
        return 'no bandwidth cap: no storage bound'
    lines = ['Through the emulated storage ({:.0f} MB/s for the mount, {:,.0f} '
             'compressed bytes per row) no loader can read more than {:,.0f} '
             'rows/s from the Parquet files (rows/s from local copies in later '
             'epochs can pass it):'.format(report['storage_bandwidth_mbps'],
                              report['source_bytes_per_row'], bound)]
    for run in report['medians']:
        if run['method'].endswith('-shared'):
            line = '{} {:>7} {:>9.0f} {:>8.0%} of the bound'.format(
                label(run).ljust(LABEL_WIDTH), run['workers'],
                run['rows_per_s'], run['rows_per_s'] / bound)
            if run.get('source_mb_per_s'):
                line += '; read {:.1f} MB/s, {:.0%} of the mount\'s'.format(
                    run['source_mb_per_s'],
                    run['source_mb_per_s'] / report['storage_bandwidth_mbps'])
            lines.append(line)
    return '\n'.join(lines)


def _versions(petastorm_python) -> Dict[str, str]:
    import importlib.metadata
    versions = {name: importlib.metadata.version(name) for name in (
        'pyarrow', 'fastparquet', 'numpy', 'pandas', 'chainer')}
    if petastorm_python:
        versions['petastorm_env'] = petastorm_env.versions(petastorm_python)
    return versions


def _write_report(report: Dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    table = 'Medians of {} runs:\n{}'.format(report['repeats'],
                                             format_table(report['medians']))
    later = [run for run in report['medians']
             if run.get('later_epochs_rows_per_s')]
    if later:
        table += ("\n\nRows/s after the first epoch's worth of rows:\n"
                  + format_later_epochs(later))
    if report.get('growth_runs'):
        table += '\n\nMemory as the rows read grow:\n' + format_growth(
            report['growth_runs'])
    if any(run['method'].endswith('-shared') for run in report['medians']):
        table += '\n\n' + format_storage_bound(report)
    coverage = (format_coverage(report['coverage_runs'])
                if report['coverage_runs'] else 'no coverage runs')
    backends = '\n'.join('{columns:<15} {reader:<28} {seconds:8.3f} s'.format(
        **row) for row in report['backends'])
    text = '\n\n'.join([report['command'], table, coverage,
                        'Reading every row group of two files:\n' + backends])
    print('\n' + text)
    write_json(os.path.join(out, 'bench.json'), report)
    with open(os.path.join(out, 'table.txt'), 'w') as f:
        f.write(text + '\n')
    plot(report, os.path.join(out, 'throughput_memory.png'))
    if report.get('growth_runs'):
        plot_growth(report, os.path.join(out, 'memory_growth.png'))


if __name__ == '__main__':
    sys.exit(main())
