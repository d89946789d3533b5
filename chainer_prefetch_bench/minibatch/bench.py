#!/usr/bin/env python
"""The 1,000-minibatch benchmark (sec. 4.1 of the source paper), side by side.

Times how long each loader takes to deliver N minibatches of 32 images from
an ImageNet-like JPEG dataset (``testbed.jpeg_dataset``) that sits on emulated
shared storage (``testbed.storage``, a real FUSE mount):

``baseline-local``   Chainer's MultiprocessIterator reading the local copy
                     (the paper's baseline+SSD: the ideal case), with
                     ``shared_mem`` sized for the largest example, as a
                     careful user sets it.
``baseline-remote``  MultiprocessIterator reading through the mount
                     (baseline+Lustre), ``shared_mem`` sized likewise.
``baseline-local-unsized``, ``baseline-remote-unsized``
                     The same with Chainer's default ``shared_mem=None``
                     (sized from the first batch: larger examples are
                     pickled).
``proposed-cold``    PrefetchMultiprocessIterator reading the mount and
                     staging into an empty local directory.
``proposed-warm``    The same with the local directory already filled.
``proposed-learned`` proposed-cold with ``testbed.user_dataset.IdDataset``
                     (paths built inside ``get_example``, as ChainerCV's
                     VOC dataset does): a first epoch learns what each
                     example opens, and the time reported is that of a
                     second epoch of the same length (compare with
                     proposed-warm).
``proposed-cold-user``
                     proposed-cold with the dataset a user writes
                     (``testbed.user_dataset``: a list of paths opened
                     with PIL) instead of ``LabeledImageDataset``: its paths
                     are found in its attributes and its opens redirected
                     to the copies.
``proposed-cold-threads``
                     proposed-cold with ``loader_threads=True``: the JPEGs
                     are decoded by threads of the training process
                     instead of loader processes.
``proposed-warm-never``
                     proposed-warm with ``recheck_sources='never'``
                     (``chainer_prefetch_bench.minibatch.metadata``
                     compares the settings over several epochs).
``prefetch-local``   PrefetchMultiprocessIterator reading the local copy
                     with no staging (the pipeline's own cost).
``copy-then-local``  Copy the whole dataset with 8 parallel copiers, then
                     baseline-local (the paper's Table 3 accounting).
``multithread``      Chainer's MultithreadIterator through the mount.
``torch``            PyTorch's DataLoader through the mount (if installed):
                     its default settings with ``pin_memory=False`` and
                     ``collate_fn=list`` (the images differ in size, so the
                     default collate cannot stack them).
``torch-local``      The same DataLoader reading the local copy: the loaders
                     themselves compared on equal files.
``decode-limit``     No iterator: the loader processes only read and decode
                     their share of the local copies (the machine's limit
                     for the loaders; images/s is what to compare).
``decode-copy-limit``
                     decode-limit, and each example's arrays copied once
                     into memory the process reuses (its pages touched
                     once, at the start): the limit of any loader whose
                     processes hand their arrays over in shared memory, as
                     Chainer's and ours do.
``copy-limit``       No iterator: ``--copy-threads`` threads of the run's
                     process only copy the run's files from the mount into
                     an empty local directory (open, ``sendfile``, close;
                     no lock, rename or check): the CPU that making the
                     local copies costs the process that makes them.  Its
                     ``own_cpu_ms_per_batch`` is what to compare.  It has
                     no loaders: its row pools the runs made beside each
                     loader count and holds for all of them.
``stage-limit``      copy-limit with our copy and its guarantees instead of
                     the plain one (``LocalDirectory.stage``: a ``.part``
                     file under a lock, the copy compared with its source's
                     size, its time stamped, the rename into place) and
                     nothing of the pipeline around it.

With ``--batches`` x 32 beyond one epoch of the dataset (``--n-images``, a
multiple of 32), each run also reports its images/s after its first timed
epoch (``later_images_per_s``): the steady state of a long training run,
where the files are in the page cache and the loaders' memory is mapped.
Those runs of the iterators and the decode limits also report what the
kernel counted for their processes over the epochs after the first
(``later_counters``: ``root``, the process that calls ``next()`` or runs
the decode limit's pool, and ``others``, its descendants: the loader
processes, and helpers such as multiprocessing's resource tracker; CPU
time, minor page faults, times put on a core, time runnable but waiting
for one; see ``chainer_prefetch_bench.minibatch.counters``), printed per
image as a second table (not for a run in which one of them ended).

Our iterators run with their default settings (``shared_mem=None``).
Besides time, each run reports the training process's own CPU time per
batch (``own_cpu_ms_per_batch``: every thread of the process that calls
``next()``, not its loader processes), which on a GPU node is taken from
the training loop.

Every run happens in a fresh child process (so start-up costs are counted
the same way for all) with the same shuffled order of examples.  Before
each run the local directory is emptied and the page cache of every
dataset file (sources and local copies) is dropped with
``posix_fadvise(POSIX_FADV_DONTNEED)``; the mount itself never keeps file
data between opens (see ``testbed.storage``).  Runs are interleaved across
repetitions so that machine noise spreads over all methods.

Usage::

    python -m chainer_prefetch_bench.minibatch.bench --quick   # the README demo
    python -m chainer_prefetch_bench.minibatch.bench --batches 1000 \\
        --processes 2,4,8,16 \\
        --copy-thread-sweep 2,4,8,12,16 --repeats 3 --out results/bench.json

Output: a JSON file with ``runs`` (method, n_processes, n_copy_threads,
n_batches, total_s, first_batch_s, cumulative_s, cpu_s, peak RSS, process
count), the storage ``calibration``, the machine and the command; and a
comparison table on stdout.  ``chainer_prefetch_bench.minibatch.plot`` draws the
figures.
"""
import argparse
import contextlib
import os
import resource
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Tuple

from chainer_prefetch_bench.minibatch.counters import tree_change, tree_counters
from chainer_prefetch_bench.testbed import storage
from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.page_cache import drop_page_cache
from chainer_prefetch_bench.testbed.prepare import prepare_jpeg_benchmark
from chainer_prefetch_bench.testbed.processes import answer_child, run_in_child
from chainer_prefetch_bench.testbed.report import write_json
from chainer_prefetch_bench.testbed.user_dataset import IdDataset, PathListDataset

METHODS = ('baseline-local', 'baseline-remote', 'baseline-local-unsized',
           'baseline-remote-unsized', 'proposed-cold', 'proposed-cold-user',
           'proposed-learned', 'proposed-warm',
           'proposed-warm-never', 'proposed-cold-threads',
           'prefetch-local', 'copy-then-local', 'multithread', 'torch',
           'torch-local', 'decode-limit', 'decode-copy-limit', 'copy-limit',
           'stage-limit')
#: Methods without loader processes: run beside each loader count (so that
#: the machine's changes spread over them too) and summarised over all
#: their runs, as one row for every loader count.
NO_LOADERS = ('copy-limit', 'stage-limit')
BATCH_SIZE = 32
ORDER_SEED = 0
COPIERS = 8


# ---------------------------------------------------------------- child side

def _order_sampler():
    import numpy
    from chainer.iterators import ShuffleOrderSampler
    return ShuffleOrderSampler(numpy.random.RandomState(ORDER_SEED))


def _make_iterator(method, dataset, config):
    from chainer.iterators import MultiprocessIterator, MultithreadIterator

    import chainer_prefetch
    n = config['n_processes']
    if method.startswith('baseline') or method == 'copy-then-local':
        shared_mem = (None if method.endswith('-unsized')
                      else config['shared_mem'])
        return MultiprocessIterator(dataset, BATCH_SIZE, n_processes=n,
                                    order_sampler=_order_sampler(),
                                    shared_mem=shared_mem)
    if method in ('proposed-cold', 'proposed-cold-user', 'proposed-learned',
                  'proposed-warm', 'prefetch-local'):
        return chainer_prefetch.PrefetchMultiprocessIterator(
            dataset, BATCH_SIZE, n_processes=n, order_sampler=_order_sampler(),
            local_dir=None if method == 'prefetch-local' else
            config['local_dir'], n_copy_threads=config['n_copy_threads'])
    if method == 'proposed-warm-never':
        return chainer_prefetch.PrefetchMultiprocessIterator(
            dataset, BATCH_SIZE, n_processes=n, order_sampler=_order_sampler(),
            local_dir=config['local_dir'],
            n_copy_threads=config['n_copy_threads'], recheck_sources='never')
    if method == 'proposed-cold-threads':
        return chainer_prefetch.PrefetchMultiprocessIterator(
            dataset, BATCH_SIZE, n_processes=n, order_sampler=_order_sampler(),
            local_dir=config['local_dir'],
            n_copy_threads=config['n_copy_threads'], loader_threads=True)
    if method == 'multithread':
        return MultithreadIterator(dataset, BATCH_SIZE, n_threads=n,
                                   order_sampler=_order_sampler())
    if method in ('torch', 'torch-local'):
        return _torch_batches(dataset, n)
    raise ValueError('unknown method ' + method)


def _torch_batches(dataset, n_processes):
    import numpy
    import torch.utils.data

    class Wrapped(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, index):
            return dataset[index]

    order = _order_sampler()(numpy.arange(len(dataset)), 0)
    loader = torch.utils.data.DataLoader(
        Wrapped(), batch_size=BATCH_SIZE, sampler=[int(i) for i in order],
        num_workers=n_processes, collate_fn=list, persistent_workers=False)
    return iter(loader)


_copy_memory = {}  # in a decode-copy-limit process: bytes -> its reused memory


def _decode_share(args):
    """In a decode-limit process: reads and decodes every ``step``-th example
    (and with ``copy_bytes``, copies its arrays into that much reused memory,
    as ``_worker.pack`` copies them into a shared buffer)."""
    import chainer
    import numpy

    from chainer_prefetch.iterators import _worker
    list_file, root, start, step, count, copy_bytes = args
    dataset = chainer.datasets.LabeledImageDataset(list_file, root)
    memory = None
    if copy_bytes:  # room for the largest example, every page touched once
        memory = _copy_memory.get(copy_bytes)
        if memory is None:
            memory = _copy_memory[copy_bytes] = numpy.ones(copy_bytes + 4096,
                                                           numpy.uint8)
    for index in range(start, count, step):  # (past the end: the next epoch)
        example = dataset[index % len(dataset)]
        if memory is not None:
            _worker.pack(example, memory, 0, memory.size)
    return 0


def _decode_limit(config):
    """Images/s of n processes that only decode (and copy) their share (no iterator)."""
    import multiprocessing
    count = config['n_batches'] * BATCH_SIZE
    epoch = min(count, len(_list_paths(config['list_file'])))
    n = config['n_processes']
    copy_bytes = (config['shared_mem']
                  if config['method'] == 'decode-copy-limit' else 0)
    cumulative = []
    marks = []  # the process tree's counters at the end of each part
    with multiprocessing.get_context('fork').Pool(n) as pool:
        pool.map(_decode_share, [(config['list_file'], config['local_root'],
                                  0, 1, 0, 0)] * n)  # (imports, untimed)
        started = time.perf_counter()
        for ranges in decode_shares(count, epoch, n):  # epoch 1, the rest
            pool.map(_decode_share, [
                (config['list_file'], config['local_root']) + share
                + (copy_bytes,) for share in ranges], chunksize=1)
            cumulative.append(time.perf_counter() - started)
            started += _look(marks)[0]  # (not the run's time)
    later = _later_rate(count - epoch, cumulative) if epoch % BATCH_SIZE == 0 else None
    return dict(_no_iterator_result(config, cumulative[-1]),
                cumulative_s=cumulative, later_images_per_s=later,
                later_counters=dict(tree_change(*marks, os.getpid()),
                                    images=count - epoch) if later else None)


def _look(marks: list) -> Tuple[float, float]:
    """Appends the counters of this process's tree to ``marks``; returns the
    seconds and the CPU seconds of this process that reading them took."""
    started, cpu_started = time.perf_counter(), time.process_time()
    marks.append(tree_counters(os.getpid()))
    return time.perf_counter() - started, time.process_time() - cpu_started


def decode_shares(count: int, epoch: int, n_processes: int) -> list:
    """The decode limit's tasks: per part of the run (the first epoch, then
    the rest, if any), one ``(start, step, end)`` per process.

    Process ``p`` of a part from ``first`` to ``end`` takes the images
    ``first + p``, ``first + p + n_processes``, ...: together every image
    of ``[0, count)`` once.

    Args:
        count: Images of the run.
        epoch: Images of the dataset (one epoch).
        n_processes: Decoding processes.
    """
    parts = [(0, min(count, epoch))]
    if count > epoch:
        parts.append((epoch, count))
    return [[(first + p, n_processes, end) for p in range(n_processes)]
            for first, end in parts]


def _list_paths(list_file) -> list:
    """The image paths of a ``LabeledImageDataset`` list file, in order."""
    with open(list_file) as lines:
        return [line.split()[0] for line in lines if line.strip()]


def _later_rate(later_images: int, cumulative) -> Optional[float]:
    """Images/s after the first epoch, or ``None`` if the run had one epoch.

    Args:
        later_images: Images delivered after the first epoch.
        cumulative: Seconds from the start to the end of the first epoch,
            then to the end of the run (more marks in between are allowed).
    """
    if later_images <= 0 or len(cumulative) < 2:
        return None
    return later_images / (cumulative[-1] - cumulative[0])


def _no_iterator_result(config, seconds: float) -> dict:
    """The result fields of a run without an iterator (the limits)."""
    return {'method': config['method'], 'n_processes': config['n_processes'],
            'n_copy_threads': config.get('n_copy_threads'),
            'n_batches': config['n_batches'], 'repeat': config['repeat'],
            'total_s': seconds, 'first_batch_s': 0.0, 'copy_s': 0.0,
            'first_epoch_s': None, 'cumulative_s': [seconds], 'cpu_s': 0.0,
            'own_cpu_s': 0.0, 'own_cpu_ms_per_batch': 0.0,
            'images_per_s': config['n_batches'] * BATCH_SIZE / seconds,
            'later_images_per_s': None, 'peak_rss_mb_main': 0.0,
            'peak_rss_mb_largest_child': 0.0,
            'processes': config['n_processes'], 'threads_copy': 0,
            'iterator_stats': None, 'later_counters': None}


def _copy_limit(config):
    """Copies the run's files from the mount with plain threads (``stage-limit``:
    with ``LocalDirectory.stage``); the process's CPU."""
    from chainer_prefetch.staging.local_directory import LocalDirectory

    relatives = _list_paths(config['list_file'])[:config['n_batches']
                                                 * BATCH_SIZE]
    target_root = os.path.join(config['local_dir'], config['method'])
    if config['method'] == 'stage-limit':
        directory = LocalDirectory(target_root)

        def copy(relative):
            directory.stage(os.path.join(config['remote_root'], relative))
    else:
        for folder in {os.path.dirname(relative) for relative in relatives}:
            os.makedirs(os.path.join(target_root, folder), exist_ok=True)

        def copy(relative):
            plain_copy(os.path.join(config['remote_root'], relative),
                       os.path.join(target_root, relative))

    cpu_started = time.process_time()
    started = time.perf_counter()
    with ThreadPoolExecutor(config['n_copy_threads']) as pool:
        list(pool.map(copy, relatives))
    seconds = time.perf_counter() - started
    own_cpu_s = time.process_time() - cpu_started
    return dict(_no_iterator_result(config, seconds), own_cpu_s=own_cpu_s,
                cpu_s=own_cpu_s, threads_copy=config['n_copy_threads'],
                processes=1, images_per_s=len(relatives) / seconds,
                own_cpu_ms_per_batch=1000 * own_cpu_s / config['n_batches'])


def plain_copy(source: str, target: str):
    """Copies the file ``source`` to ``target`` with ``sendfile`` and nothing else."""
    source_fd = os.open(source, os.O_RDONLY)
    try:
        size = os.fstat(source_fd).st_size
        target_fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                            0o600)
        try:
            offset = 0
            while offset < size:
                sent = os.sendfile(target_fd, source_fd, offset, size - offset)
                if sent == 0:
                    raise OSError('{} ended at byte {} of {}'.format(
                        source, offset, size))
                offset += sent
        finally:
            os.close(target_fd)
    finally:
        os.close(source_fd)


def run_one(config):
    """Times one run in this (child) process; returns the result dict."""
    import chainer

    method = config['method']
    if method in ('decode-limit', 'decode-copy-limit'):
        return _decode_limit(config)
    if method in NO_LOADERS:
        return _copy_limit(config)
    started = time.perf_counter()
    copy_s = 0.0
    root = config['remote_root']
    if method in ('baseline-local', 'baseline-local-unsized',
                  'prefetch-local', 'torch-local'):
        root = config['local_root']
    elif method == 'copy-then-local':
        copy_s = copy_dataset(config['remote_root'], config['list_file'],
                              config['copy_target'], COPIERS)
        root = config['copy_target']
    if method == 'proposed-cold-user':
        dataset = PathListDataset(config['list_file'], root)
    elif method == 'proposed-learned':
        dataset = IdDataset(config['list_file'], root)
    else:
        dataset = chainer.datasets.LabeledImageDataset(config['list_file'],
                                                       root)
    own_cpu_started = time.process_time()
    iterator = _make_iterator(method, dataset, config)
    cumulative = []
    first_epoch_s = None
    epoch_batches = min(config['n_batches'], max(1, len(dataset) // BATCH_SIZE))
    whole_batches = len(dataset) % BATCH_SIZE == 0  # (else no epoch ends at a batch)
    marks = []  # the process tree's counters at the end of epoch 1 and of the run
    try:
        if method == 'proposed-learned':  # the epoch that learns, untimed
            for _ in range(config['n_batches']):
                next(iterator)
            first_epoch_s = time.perf_counter() - started
            started = time.perf_counter()
            own_cpu_started = time.process_time()
        for index in range(config['n_batches']):
            batch = next(iterator)
            assert len(batch) == BATCH_SIZE
            cumulative.append(time.perf_counter() - started)
            if whole_batches and epoch_batches < config['n_batches'] and (
                    index in (epoch_batches - 1, config['n_batches'] - 1)):
                seconds, cpu_s = _look(marks)
                started += seconds  # (the look is neither time nor CPU of the run)
                own_cpu_started += cpu_s
        del batch
        own_cpu_s = time.process_time() - own_cpu_started
    finally:
        stats = getattr(iterator, 'stats', None)
        if hasattr(iterator, 'finalize'):
            iterator.finalize()
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        'method': method,
        'n_processes': config['n_processes'],
        'n_copy_threads': config.get('n_copy_threads'),
        'n_batches': config['n_batches'],
        'repeat': config['repeat'],
        'total_s': cumulative[-1],
        'first_batch_s': cumulative[0],
        'copy_s': copy_s,
        'first_epoch_s': first_epoch_s,
        'cumulative_s': [round(t, 4) for t in cumulative],
        'cpu_s': own.ru_utime + own.ru_stime + children.ru_utime
        + children.ru_stime,
        'own_cpu_s': own_cpu_s,
        'own_cpu_ms_per_batch': 1000 * own_cpu_s / config['n_batches'],
        'images_per_s': config['n_batches'] * BATCH_SIZE / (
            cumulative[-1] - copy_s),
        'later_images_per_s': _later_rate(
            (config['n_batches'] - epoch_batches) * BATCH_SIZE,
            [cumulative[epoch_batches - 1], cumulative[-1]])
        if whole_batches else None,
        'peak_rss_mb_main': own.ru_maxrss / 1024,
        'peak_rss_mb_largest_child': children.ru_maxrss / 1024,
        'processes': 1 + (0 if method == 'multithread' else
                          config['n_processes']),
        'threads_copy': (config['n_copy_threads'] if method.startswith(
            'proposed') else COPIERS if method == 'copy-then-local' else 0),
        'iterator_stats': stats,
        'later_counters': dict(tree_change(*marks, os.getpid()), images=(
            config['n_batches'] - epoch_batches) * BATCH_SIZE)
        if marks else None,
    }


def copy_dataset(source_root, list_file, target_root, n_copiers):
    """Copies every file of ``list_file`` with ``n_copiers`` threads; returns seconds."""
    relatives = _list_paths(list_file)
    started = time.perf_counter()

    def copy(relative):
        target = os.path.join(target_root, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(source_root, relative), target)

    with ThreadPoolExecutor(n_copiers) as pool:
        list(pool.map(copy, relatives))
    return time.perf_counter() - started


# ---------------------------------------------------------------- parent side

def fill_local_dir(config):
    """Stages every file for proposed-warm, untimed."""
    import chainer

    from chainer_prefetch.staging import LocalDirectory
    dataset = chainer.datasets.LabeledImageDataset(config['list_file'],
                                                   config['remote_root'])
    directory = LocalDirectory(config['local_dir'])
    sources = [os.path.join(config['remote_root'], path)
               for path, _ in dataset._pairs]
    with ThreadPoolExecutor(COPIERS) as pool:
        list(pool.map(directory.stage, sources))


def largest_example_bytes(list_file, root) -> int:
    """Bytes of the largest example LabeledImageDataset makes (float32 CHW + label).

    Read from the JPEG headers, without decoding: what a careful user sets
    as ``shared_mem``.
    """
    from PIL import Image
    largest = 0
    with open(list_file) as lines:
        for line in lines:
            if line.strip():
                with Image.open(os.path.join(root, line.split()[0])) as image:
                    width, height = image.size
                largest = max(largest, width * height * 3 * 4)
    return largest + 4


def torch_available():
    try:
        import torch  # NOQA: F401
        return True
    except ImportError:
        return False


def plan_runs(args):
    """The list of run configurations, repetitions interleaved."""
    configs = []
    for repeat in range(args.repeats):
        for n_processes in args.processes:
            for method in args.methods:
                configs.append({'method': method, 'n_processes': n_processes,
                                'n_copy_threads': args.copy_threads,
                                'repeat': repeat})
        for n_threads in args.copy_thread_sweep:
            if n_threads == args.copy_threads and 2 in args.processes:
                continue  # already measured above
            configs.append({'method': 'proposed-cold', 'n_processes': 2,
                            'n_copy_threads': n_threads, 'repeat': repeat})
    return configs


def summarize(runs):
    """Median per (method, processes, copy threads); the processes are
    ``None`` for the methods without loaders (:data:`NO_LOADERS`)."""
    groups = {}
    for run in runs:
        key = (run['method'],
               None if run['method'] in NO_LOADERS else run['n_processes'],
               run['n_copy_threads'] if run['method'].startswith('proposed')
               else None)
        groups.setdefault(key, []).append(run)
    summary = {}
    for key, members in groups.items():
        summary[key] = {
            'total_s': statistics.median(r['total_s'] for r in members),
            'first_batch_s': statistics.median(r['first_batch_s']
                                               for r in members),
            'cpu_s': statistics.median(r['cpu_s'] for r in members),
            'own_cpu_ms_per_batch': statistics.median(
                r.get('own_cpu_ms_per_batch', 0.0) for r in members),
            'images_per_s': statistics.median(
                r.get('images_per_s', 0.0) for r in members),
            'later_images_per_s': _median_or_none(
                r.get('later_images_per_s') for r in members),
            'later_per_image': _later_per_image(members),
            'processes': members[0]['processes'],
            'runs': len(members)}
    return summary


def _later_per_image(members) -> Optional[dict]:
    """Medians over runs of the later epochs' counters per image, or
    ``None`` if a run has none (``later_counters`` of :func:`run_one`) or
    one of its processes ended in between: ``root_cpu_ms``, ``loaders_cpu_ms``,
    ``faults`` (all processes), ``timeslices`` (all processes),
    ``runqueue_ms`` (all processes, time runnable without a core)."""
    per_run = []
    for run in members:
        counters = run.get('later_counters')
        if (not counters or not run.get('later_images_per_s')
                or counters['root']['processes'] != 1
                or counters['root'].get('gone') or counters['others'].get('gone')):
            return None  # (a process ended in between: its share is missing)
        images = counters['images']
        root, others = counters['root'], counters['others']
        per_run.append({
            'root_cpu_ms': 1000 * root['cpu_s'] / images,
            'loaders_cpu_ms': 1000 * others['cpu_s'] / images,
            'faults': (root['minor_faults'] + others['minor_faults']) / images,
            'timeslices': (root['timeslices'] + others['timeslices']) / images,
            'runqueue_ms': 1000 * (root['runqueue_s'] + others['runqueue_s'])
            / images})
    return {field: statistics.median(run[field] for run in per_run)
            for field in per_run[0]}


def _median_or_none(values) -> Optional[float]:
    """The median of ``values``, or ``None`` if any is missing."""
    values = list(values)
    if not values or None in values:
        return None
    return statistics.median(values)


def print_table(summary, copy_threads):
    print('\n{:<24} {:>5} {:>7} {:>9} {:>11} {:>7} {:>9} {:>8} {:>9} '
          '{:>9}'.format('method', 'procs', 'threads', 'total s',
                         'first batch', 'CPU s', 'own ms/b', 'img/s',
                         'vs remote', 'vs local'))
    for (method, n, threads), row in _ordered(summary):
        remote = summary.get(('baseline-remote', n, None))
        local = summary.get(('baseline-local', n, None))
        is_limit = method.endswith('-limit')
        print('{:<24} {:>5} {:>7} {:>9.2f} {:>11.3f} {:>7.1f} {:>9.1f} '
              '{:>8.0f} {:>9} {:>9}'.format(
                  method, n or '-', threads or '-', row['total_s'],
                  row['first_batch_s'], row['cpu_s'],
                  row['own_cpu_ms_per_batch'], row['images_per_s'],
                  '-' if is_limit else _ratio(remote, row),
                  '-' if is_limit else _ratio(row, local)))
    print('\n"vs remote": baseline-remote time / this time (higher is '
          'better); "vs local": this time / baseline-local time (1.00 is '
          'local speed); "own ms/b": CPU time of the training process per '
          'batch; the baselines\' shared_mem is sized for the largest '
          'example unless "-unsized".')
    print_later_counters(summary)
    check_targets(summary, copy_threads)


def _ordered(summary):
    """The summary's rows by loader count, then method, then copy threads."""
    return sorted(summary.items(), key=lambda item: (
        item[0][1] or 0, METHODS.index(item[0][0]), item[0][2] or 0))


def print_later_counters(summary):
    """Prints the kernel's counters per image after the first epoch, for
    the rows that have them."""
    rows = [(key, row['later_per_image']) for key, row in _ordered(summary)
            if row['later_per_image']]
    if not rows:
        return
    print('\nAfter the first epoch, per image (medians):\n{:<24} {:>5} {:>9} '
          '{:>10} {:>7} {:>7} {:>9} {:>8}'.format(
              'method', 'procs', 'CPU ms', 'of loaders', 'main', 'faults',
              'on-core', 'queue ms'))
    for (method, n, _), later in rows:
        print('{:<24} {:>5} {:>9.2f} {:>10.2f} {:>7.2f} {:>7.1f} {:>9.2f} '
              '{:>8.2f}'.format(
                  method, n or '-',
                  later['root_cpu_ms'] + later['loaders_cpu_ms'],
                  later['loaders_cpu_ms'], later['root_cpu_ms'],
                  later['faults'], later['timeslices'],
                  later['runqueue_ms']))
    print('"main": the process that calls next() (a decode limit\'s: the '
          'one that hands out the shares); "faults": minor page faults, '
          '"on-core": times a process was put on a core, "queue ms": time '
          'runnable without a core, all processes.')


def _ratio(numerator, denominator):
    if not numerator or not denominator:
        return '-'
    return '{:.2f}x'.format(numerator['total_s'] / denominator['total_s'])


def check_targets(summary, copy_threads):
    """Prints the issue's targets at every process count measured."""
    print('\nTargets (paper in brackets):')
    for n in sorted({n for _, n, _ in summary if n is not None}):
        lines = (_lines_against_chainer(summary, n, copy_threads)
                 + _lines_against_limits(summary, n, copy_threads))
        for text, value, bound, at_least in lines:
            verdict = ''
            if bound is not None:
                met = value >= bound if at_least else value <= bound
                verdict = 'met' if met else 'MISSED'
            print('  {} processes: {:<62} {:6.2f}  {}'.format(
                n, text, value, verdict).rstrip())


def _lines_against_chainer(summary, n, copy_threads) -> list:
    """``(text, value, bound or None, at_least)`` of the targets that compare
    with Chainer's iterator at ``n`` processes (none without baseline-local)."""
    local = summary.get(('baseline-local', n, None))
    if local is None:
        return []
    remote = summary.get(('baseline-remote', n, None))
    cold = summary.get(('proposed-cold', n, copy_threads))
    user = summary.get(('proposed-cold-user', n, copy_threads))
    warm = summary.get(('proposed-warm', n, copy_threads))
    lines = []
    if cold and user:
        lines.append(('proposed-cold-user / proposed-cold <= 1.05',
                      user['total_s'] / cold['total_s'], 1.05, False))
    learned = summary.get(('proposed-learned', n, copy_threads))
    if learned and warm:
        lines.append(('proposed-learned (2nd epoch) / proposed-warm <= 1.05',
                      learned['total_s'] / warm['total_s'], 1.05, False))
    if cold:
        lines.append(('proposed-cold within 1.0x of baseline-local [6.74x]',
                      cold['total_s'] / local['total_s'], 1.0, False))
    if cold and remote:
        lines += [
            ('proposed-cold >= 2x faster than baseline-remote [1.26x]',
             remote['total_s'] / cold['total_s'], 2.0, True),
            ('first batch of proposed-cold / baseline-remote <= 1 [2.1x]',
             cold['first_batch_s'] / remote['first_batch_s'], 1.0, False)]
    if warm:
        lines.append(('proposed-warm / baseline-local <= 1',
                      warm['total_s'] / local['total_s'], 1.0, False))
        lines.append(('own CPU per batch, proposed-warm / baseline-local'
                      ' <= 0.5', warm['own_cpu_ms_per_batch']
                      / local['own_cpu_ms_per_batch'], 0.5, False))
    if cold:
        lines.append(('own CPU per batch, proposed-cold / baseline-local'
                      ' <= 1', cold['own_cpu_ms_per_batch']
                      / local['own_cpu_ms_per_batch'], 1.0, False))
        lines.append(('CPU of all processes, proposed-cold / baseline-local',
                      cold['cpu_s'] / local['cpu_s'], None, False))
    for copies_name in NO_LOADERS:  # no target: bounds of copying in-process
        copies = summary.get((copies_name, None, None))
        if copies and warm:
            lines.append(('own CPU per batch, (proposed-warm + {}) / '
                          'baseline-local'.format(copies_name),
                          (warm['own_cpu_ms_per_batch']
                           + copies['own_cpu_ms_per_batch'])
                          / local['own_cpu_ms_per_batch'], None, False))
    if cold:
        lines.append(('processes proposed / baseline <= 1',
                      cold['processes'] / local['processes'], 1.0, False))
    return lines


def _lines_against_limits(summary, n, copy_threads) -> list:
    """The lines (as :func:`_lines_against_chainer`) that compare ours on
    local files with the decode limits and PyTorch's loader."""
    warm = summary.get(('proposed-warm', n, copy_threads))
    ours = warm or summary.get(('prefetch-local', n, None))
    if ours is None:
        return []
    name = 'proposed-warm' if warm else 'prefetch-local'
    limit = summary.get(('decode-limit', n, None))
    copy_limit = summary.get(('decode-copy-limit', n, None))
    lines = []
    if limit:
        lines.append(('images/s of {} / decode limit >= 0.9'.format(name),
                      ours['images_per_s'] / limit['images_per_s'], 0.9,
                      True))
    if limit and copy_limit:  # no target: the bound of a copy
        lines.append(('decode-copy-limit / decode limit (images/s)',
                      copy_limit['images_per_s'] / limit['images_per_s'],
                      None, True))
    if copy_limit:
        lines.append(('images/s of {} / decode-copy-limit'.format(name),
                      ours['images_per_s'] / copy_limit['images_per_s'],
                      None, True))
    for bound_name, bound in (('decode limit', limit),
                              ('decode-copy-limit', copy_limit)):
        if (bound and bound['later_images_per_s']
                and ours['later_images_per_s']):
            lines.append(('after epoch 1: images/s of {} / {}'.format(
                name, bound_name), ours['later_images_per_s']
                / bound['later_images_per_s'], None, True))
    torch_local = summary.get(('torch-local', n, None))
    if torch_local:
        lines.append(('{} / torch-local time < 1'.format(name),
                      ours['total_s'] / torch_local['total_s'], 1.0, False))
    return lines


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--workdir', default='/tmp/chainer_prefetch_bench',
                        help='dataset, mount point and local directories')
    parser.add_argument('--n-images', type=int, default=None,
                        help='dataset size (default: batches x 32)')
    parser.add_argument('--batches', type=int, default=1000)
    parser.add_argument('--processes', default='2,4,8,16')
    parser.add_argument('--copy-threads', type=int, default=16,
                        help='copy threads of the proposed iterator')
    parser.add_argument('--copy-thread-sweep', default='',
                        help='e.g. 2,4,8,12,16 (proposed-cold, 2 processes)')
    parser.add_argument('--methods', default=','.join(METHODS))
    parser.add_argument('--repeats', type=int, default=1)
    parser.add_argument('--preset', default='paper',
                        choices=sorted(storage.PRESETS))
    parser.add_argument('--out', default='results/bench_minibatch.json')
    parser.add_argument('--run-timeout', type=float, default=1800)
    parser.add_argument('--quick', action='store_true',
                        help='the README demo: 30 batches, 2 processes, '
                        'the main methods, 1 repetition')
    args = parser.parse_args(argv)
    if args.quick:
        args.batches = 30
        args.processes = '2'
        args.methods = ('baseline-local,baseline-remote,proposed-cold,'
                        'proposed-warm,copy-then-local')
    args.processes = [int(n) for n in args.processes.split(',')]
    args.copy_thread_sweep = [int(n) for n in args.copy_thread_sweep.split(',')
                              if n]
    args.methods = [m for m in args.methods.split(',') if m]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error('unknown methods: {}'.format(', '.join(sorted(unknown))))
    torch_methods = [m for m in args.methods if m.startswith('torch')]
    if torch_methods and not torch_available():
        print('note: PyTorch is not installed; skipping {} (pip install '
              'torch for it)'.format(', '.join(torch_methods)))
        args.methods = [m for m in args.methods if m not in torch_methods]
    if args.n_images is None:
        args.n_images = args.batches * BATCH_SIZE
    return args


@contextlib.contextmanager
def bench_environment(workdir, n_images, preset):
    """The dataset, mounted on emulated shared storage, and the runs' common settings.

    Yields ``(base config, mount)``; the mount is taken down on exit.  A run's
    config is the base updated with ``method``, ``n_processes``,
    ``n_copy_threads``, ``n_batches`` and ``repeat`` (see :func:`prepare_run`).
    """
    dataset_dir = prepare_jpeg_benchmark(workdir, n_images)
    if dataset_dir is None:
        raise SystemExit(2)
    list_file = os.path.join(dataset_dir, 'train.txt')
    mountpoint = os.path.join(workdir, 'mnt')
    os.makedirs(mountpoint, exist_ok=True)
    base = {'list_file': list_file, 'local_root': dataset_dir,
            'remote_root': mountpoint,
            'local_dir': os.path.join(workdir, 'local'),
            'copy_target': os.path.join(workdir, 'copy'),
            'shared_mem': largest_example_bytes(list_file, dataset_dir)}
    try:
        with storage.mounted(dataset_dir, mountpoint, preset=preset) as mount:
            yield base, mount
    finally:
        for path in (base['local_dir'], base['copy_target']):
            shutil.rmtree(path, ignore_errors=True)


def prepare_run(config):
    """Before a run: empties the local directories, fills the local
    directory for the warm methods, and drops the dataset's page cache."""
    for path in (config['local_dir'], config['copy_target']):
        shutil.rmtree(path, ignore_errors=True)
    if config['method'].startswith('proposed-warm'):
        fill_local_dir(config)
    drop_page_cache(config['local_root'], config['local_dir'])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if answer_child(argv, run_one):
        return 0
    args = parse_args(argv)
    runs = []
    with bench_environment(args.workdir, args.n_images, args.preset) as (
            base, mount):
        calibration = storage.calibrate(base['remote_root'],
                                        readers=(1, 2, 8), files=32)
        print('storage ({} preset): {}'.format(args.preset, ', '.join(
            '{readers} readers {files_per_s:.0f} files/s {mb_per_s:.1f} MB/s'
            .format(**row) for row in calibration['rows'])))
        for config in plan_runs(args):
            config.update(base, n_batches=args.batches)
            prepare_run(config)
            daemon_cpu_before = mount.cpu_seconds()
            result = run_in_child(__spec__.name, config, args.run_timeout)
            result['storage_daemon_cpu_s'] = (mount.cpu_seconds()
                                              - daemon_cpu_before)
            runs.append(result)
            print('{:<24} procs {:>2} threads {:>2} run {}: {:7.2f} s, first '
                  'batch {:.3f} s, {:.0f} images/s'.format(
                      result['method'], result['n_processes'],
                      result['n_copy_threads'] or '-', result['repeat'],
                      result['total_s'], result['first_batch_s'],
                      result['images_per_s']), flush=True)
    report = {'command': 'python -m {} {}'.format(__spec__.name, ' '.join(argv)),
              'machine': machine_description(), 'preset': args.preset,
              'storage_params': storage.PRESETS[args.preset],
              'calibration': calibration, 'batch_size': BATCH_SIZE,
              'baseline_shared_mem': base['shared_mem'],
              'n_images': args.n_images, 'runs': runs}
    write_json(args.out, report)
    print_table(summarize(runs), args.copy_threads)
    print('\nwrote ' + args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
