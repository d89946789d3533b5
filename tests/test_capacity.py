"""A local directory smaller than the dataset: limit, eviction policies, shared ledger."""
import fcntl
import multiprocessing
import os
import threading
import time

import numpy
import pytest
from chainer.datasets import LabeledImageDataset
from chainer.iterators.order_samplers import ShuffleOrderSampler

import helpers
from chainer_prefetch import PrefetchMultiprocessIterator
from chainer_prefetch.staging import capacity
from chainer_prefetch.staging.capacity import CapacityLedger, bytes_under
from helpers import assert_examples_equal, make_jpeg_dataset

N_IMAGES = 300
BATCH = 10
COPY_THREADS = 4


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp('source')
    list_file, root, paths = make_jpeg_dataset(root, N_IMAGES, size=24)
    total = sum(os.path.getsize(path) for path in paths)
    return LabeledImageDataset(list_file, root), total, max(
        os.path.getsize(path) for path in paths)


def _iterator(dataset, local_dir, capacity, policy, seed=0, **kwargs):
    return PrefetchMultiprocessIterator(
        dataset, BATCH, n_processes=2, local_dir=str(local_dir),
        local_capacity=capacity, eviction_policy=policy, n_copy_ahead=3,
        n_copy_threads=COPY_THREADS,
        order_sampler=ShuffleOrderSampler(numpy.random.RandomState(seed)),
        **kwargs)


class DirectoryWatcher:
    """Samples, until stopped, the ledger and the bytes of the files under ``root``.

    The ledger is what the limit is enforced on: every copy reserves its
    bytes there before it starts, every eviction gives them back after the
    file is gone.  The walk cannot see the directory at one instant: a file
    evicted after the walk passed its folder and another copied into a
    folder not walked yet are both counted, so a walk may exceed the real
    peak by one file per copy thread evicting and copying meanwhile.
    """

    def __init__(self, root):
        self.root = str(root)
        self.ledger_samples = []
        self.walk_samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def _watch(self):
        ledger = os.path.join(self.root, '.capacity')
        while not self._stop.is_set():
            if os.path.exists(ledger):
                self.ledger_samples.append(capacity.used_bytes(self.root))
            self.walk_samples.append(
                bytes_under(os.path.join(self.root, 'data')))
            self._stop.wait(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()

    def check(self, limit, largest_file, iterators=1):
        assert self.ledger_samples and max(self.ledger_samples) <= limit
        copy_threads = iterators * COPY_THREADS
        assert max(self.walk_samples) <= limit + copy_threads * largest_file
        ledger_now = capacity.used_bytes(self.root)
        assert bytes_under(os.path.join(self.root, 'data')) <= ledger_now


def _run_epochs(iterator, n_epochs, seconds_per_batch=0.0):
    """Iterates ``n_epochs``, checking every batch against the dataset.

    ``seconds_per_batch`` plays a training step, so that copies can keep
    ahead of the consumer even on a loaded machine.
    """
    for _ in range(n_epochs * N_IMAGES // BATCH):
        time.sleep(seconds_per_batch)
        # N_IMAGES % BATCH == 0: a batch never spans two epochs.
        state = iterator._state
        indices = state.order[state.current_position:
                              state.current_position + BATCH]
        batch = iterator.next()
        assert_examples_equal(batch, [iterator.dataset[int(i)]
                                      for i in indices])
    return iterator.stats


def test_a_file_larger_than_the_whole_limit_is_read_from_the_source(
        dataset, tmp_path):
    """No file is sized up front (a stat of every file would cost minutes on
    Lustre); one that cannot fit is simply never staged."""
    data, _, largest = dataset
    with pytest.raises(ValueError, match='eviction_policy'):
        _iterator(data, tmp_path, largest, 'fifo')
    iterator = _iterator(data, tmp_path, largest - 1, 'belady')
    try:
        with DirectoryWatcher(tmp_path) as watcher:
            stats = _run_epochs(iterator, 2)
    finally:
        iterator.finalize()
    watcher.check(largest - 1, largest - 1)
    assert stats['items_too_large'] >= 1
    assert stats['examples_from_source'] >= 2  # that example, both epochs


@pytest.mark.parametrize('policy', ['belady', 'lru', 'fill_once'])
def test_limit_is_never_exceeded_and_examples_are_right(dataset, tmp_path,
                                                        policy):
    data, total, largest = dataset
    limit = total // 2
    iterator = _iterator(data, tmp_path, limit, policy)
    try:
        with DirectoryWatcher(tmp_path) as watcher:
            stats = _run_epochs(iterator, 3)
    finally:
        iterator.finalize()
    watcher.check(limit, largest)
    assert stats['local_bytes_used'] <= limit


def _epoch_shares(stats, total, epoch):
    counts = stats['by_epoch'][epoch]
    reads = counts['examples_from_local'] + counts['examples_from_source']
    shared = counts['bytes_copied'] + counts['bytes_from_source']
    return counts['examples_from_local'] / reads, shared / total


def test_belady_reads_the_minimum_from_shared_storage(dataset, tmp_path):
    """At half the dataset: about half from shared storage per epoch, all reads local."""
    data, total, _ = dataset
    results = {}
    for policy in ('belady', 'lru', 'fill_once'):
        iterator = _iterator(data, tmp_path / policy, total // 2, policy)
        try:
            stats = _run_epochs(iterator, 4, seconds_per_batch=0.02)
        finally:
            iterator.finalize()
        # Epoch 1 still copies what epoch 0 read from the source while the
        # first copies were queued: steady state is from epoch 2.
        results[policy] = [_epoch_shares(stats, total, epoch)
                           for epoch in (2, 3)]
    for local_share, shared_bytes in results['belady']:
        assert shared_bytes == pytest.approx(0.5, abs=0.08), results
        assert local_share >= 0.9, results
    for local_share, shared_bytes in results['fill_once']:
        assert local_share == pytest.approx(0.5, abs=0.05), results
    # LRU drops what random epochs need soon as often as anything else.
    for (_, lru_bytes), (_, belady_bytes) in zip(results['lru'],
                                                  results['belady']):
        assert lru_bytes > belady_bytes + 0.15, results


def test_two_iterators_share_one_limit(dataset, tmp_path):
    """Two iterators on one directory: their copies together stay under the limit."""
    data, total, largest = dataset
    limit = total // 3
    first = _iterator(data, tmp_path, limit, 'belady', seed=1)
    second = _iterator(data, tmp_path, limit, 'belady', seed=2)
    errors = []

    def run(iterator):
        try:
            _run_epochs(iterator, 2)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(it,)) for it in
               (first, second)]
    try:
        with DirectoryWatcher(tmp_path) as watcher:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
    finally:
        first.finalize()
        second.finalize()
    assert not errors, errors
    watcher.check(limit, largest, iterators=2)
    assert first.stats['files_evicted'] + second.stats['files_evicted'] > 0


def test_ledger_is_recounted_by_the_first_user(tmp_path):
    data_root = tmp_path / 'data'
    data_root.mkdir()
    (data_root / 'a').write_bytes(b'x' * 100)
    first = CapacityLedger(str(tmp_path), str(data_root), 1000)
    assert first.used_bytes() == 100
    assert first.reserve(900) and not first.reserve(1)
    second = CapacityLedger(str(tmp_path), str(data_root), 1000)
    assert second.used_bytes() == 1000  # in use: not recounted
    first.close()
    second.close()
    # Nobody uses it now: the reservations that no file holds are dropped.
    third = CapacityLedger(str(tmp_path), str(data_root), 1000)
    assert third.used_bytes() == 100
    third.close()


def _load_in_this_process(original, located, local_root, entries):
    """Runs the loader's code here."""
    from chainer_prefetch.iterators._worker import Loader
    return Loader(original, located, local_root, None).load_examples(
        entries, None, 0)


def test_worker_reads_the_source_when_a_copy_vanished(dataset, tmp_path):
    """Another process may evict a copy between stage 2's check and the read."""
    from chainer_prefetch.iterators._read_from import ReadFrom
    from chainer_prefetch.staging.dataset_files import resolve_dataset_files
    data, _, _ = dataset
    local_root = str(tmp_path / 'evicted')
    located = resolve_dataset_files(data).located(
        lambda path: os.path.join(local_root, os.path.basename(path)))
    [(read_from, example, source_bytes, _, _, _)] = _load_in_this_process(
        data, located, local_root, [(0, 3, True)])
    assert read_from is ReadFrom.FALLBACK and source_bytes == 0  # no files given
    assert_examples_equal([example], [data[3]])


class _BrokenView:
    """A located view whose transform has a bug (it counts its calls)."""

    def __init__(self, calls, error):
        self.calls = calls
        self.error = error

    def __getitem__(self, index):
        self.calls.append(index)
        raise self.error


def test_worker_does_not_retry_an_error_that_is_not_about_a_local_copy(
        dataset, tmp_path):
    """A bug in a transform runs once and is reported; only a vanished local
    copy (an OSError naming a file under the local directory) falls back."""
    data, _, _ = dataset
    local_root = str(tmp_path / 'local')
    for error in (ValueError('bug in a transform'),
                  FileNotFoundError(2, 'elsewhere', '/etc/no-such-file')):
        calls = []
        [(read_from, raised, traceback_text, *_)] = _load_in_this_process(
            data, _BrokenView(calls, error), local_root, [(0, 3, True)])
        assert read_from is None and type(raised) is type(error)
        assert calls == [3] and type(error).__name__ in traceback_text


def test_a_filled_directory_is_reused_without_evictions(dataset, tmp_path):
    """Copies from an earlier run count as local, not as room to make.

    An example the first run read from shared storage in both epochs (its
    copy was not ready in time, as on a loaded machine) has no copy yet: the
    second run copies at most those and evicts nothing.
    """
    data, total, _ = dataset
    first = _iterator(data, tmp_path, total, 'belady')
    try:
        _run_epochs(first, 2)
    finally:
        first.finalize()
    left_by_first = sum(len(names) for _, _, names
                        in os.walk(tmp_path / 'data'))
    assert left_by_first > N_IMAGES // 2
    second = _iterator(data, tmp_path, total, 'belady', seed=4)
    try:
        stats = _run_epochs(second, 1)
    finally:
        second.finalize()
    assert stats['files_evicted'] == 0
    assert stats['files_copied'] <= N_IMAGES - left_by_first
    assert sum(len(names) for _, _, names in os.walk(tmp_path / 'data')
               ) == left_by_first + stats['files_copied']
    assert stats['local_bytes_used'] <= total


def _hold_ledger(root, locked, release):
    """Child: a peer process holding the directory's ledger lock."""
    fd = os.open(os.path.join(root, '.capacity'), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    locked.set()
    release.wait(30)
    os._exit(0)


def test_holds_and_uses_never_wait_for_another_process_s_ledger(
        tmp_path, monkeypatch):
    """A peer holding the ledger lock (stopped, say) blocks only the copies that
    need room, never what the pipeline thread asks of the store."""
    from chainer_prefetch.staging import LocalDirectory, LocalStore, PlainFile
    copier = None  # the thread staging the second file
    waiting = threading.Event()  # it waits for the ledger's lock
    flock_within = capacity._flock_within

    def watched_flock_within(fd, operation, deadline):
        if threading.current_thread() is copier:
            waiting.set()
        return flock_within(fd, operation, deadline)

    monkeypatch.setattr(capacity, '_flock_within', watched_flock_within)
    sources = []
    for name in ('a', 'b'):
        path = str(tmp_path / 'shared' / name)
        helpers.write_random_file(path, 1000)
        sources.append(PlainFile(path))
    root = str(tmp_path / 'local')
    store = LocalStore(LocalDirectory(root), capacity_bytes=10000,
                       sources_of=lambda item: [sources[item]])
    try:
        assert store.stage(0, [sources[0]], now=0).staged
        store.used(0, 0, 100)
        context = multiprocessing.get_context('fork')
        locked, release = context.Event(), context.Event()
        peer = context.Process(target=_hold_ledger, args=(root, locked, release))
        peer.start()
        try:
            assert locked.wait(10)
            copier = threading.Thread(target=store.stage,
                                      args=(1, [sources[1]], 1), daemon=True)
            copier.start()
            assert waiting.wait(30)
            # Bookkeeping goes on while the peer still holds the ledger.
            held = []

            def bookkeeping():
                held.append(store.hold(0, 2))
                store.used(0, 2, 200)
                store.forget_next_uses()
            worker = threading.Thread(target=bookkeeping, daemon=True)
            worker.start()
            worker.join(10)
            assert not worker.is_alive() and held == [True]
            assert copier.is_alive()  # still waiting for the ledger
        finally:
            release.set()
            peer.join(10)
        copier.join(10)
        assert not copier.is_alive()
        assert store.bytes_used() == 2000
    finally:
        store.close()
