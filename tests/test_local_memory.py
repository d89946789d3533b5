"""Row groups kept decoded in the training process (``local_dir=':memory:'``).

:class:`LocalMemory` and its ledger alone, under a :class:`LocalStore`
with a budget, and the iterator with loader threads: the same batches as
loader processes reading staged files, every row once per epoch within a
small capacity, errors named, bad options refused, and the memory let go
at ``finalize()``.  (Resume from a snapshot is in ``test_loader_threads``,
a corrupt row group in ``test_parquet_columnar``.)
"""
import errno
import gc
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import weakref

import chainer
import pyarrow
import pyarrow.parquet
import pytest

import helpers
from chainer_prefetch import PrefetchMultiprocessIterator
from chainer_prefetch.columnar import concat_columns
from chainer_prefetch.datasets import ParquetDataset, RowGroupFile, RowGroupWindowOrderSampler
from chainer_prefetch.staging import (
    LocalDirectory,
    LocalMemory,
    LocalStorageError,
    LocalStore,
    SourceFileError,
    as_source,
)
from chainer_prefetch.staging.local_memory import MEMORY, MemoryLedger

pytestmark = pytest.mark.timeout(120)
ROWS, FILES, ROW_GROUP_ROWS = 120, 3, 10  # 12 row groups of 10 rows


@pytest.fixture(scope='module')
def shop(tmp_path_factory):
    return helpers.make_shop(tmp_path_factory.mktemp('shop'), ROWS, FILES,
                             ROW_GROUP_ROWS)


@pytest.fixture
def own_shop(shop, tmp_path):
    """A copy of the dataset that a test may change."""
    directory = str(tmp_path / 'shop')
    shutil.copytree(shop, directory)
    return directory


def _part(shop, number=0):
    return os.path.join(shop, 'part-{:05d}.parquet'.format(number))


# ---- LocalMemory and its ledger ---------------------------------------------------

def test_a_row_group_is_kept_as_the_table_of_its_rows(shop):
    memory = LocalMemory()
    derived = RowGroupFile(_part(shop), 2, ('id', 'tokens', 'image'))
    origin = os.stat(_part(shop))
    assert not memory.is_current(derived, origin)
    n_bytes = memory.stage(derived)
    kept = memory.form_of(derived)
    expected = pyarrow.parquet.ParquetFile(_part(shop)).read_row_group(
        2, columns=['id', 'tokens', 'image'])
    assert kept.table.equals(expected)
    assert n_bytes == kept.table.get_total_buffer_size() > 0
    assert memory.is_current(derived, origin)
    assert memory.stage(derived) == 0  # current: not made again
    assert memory.form_of(derived) is kept
    assert memory.evict(derived) == n_bytes
    assert memory.evict(derived) == 0
    with pytest.raises(FileNotFoundError) as raised:
        memory.form_of(derived)
    assert raised.value.filename == MEMORY + '/' + derived.name.lstrip('/')


def test_a_changed_origin_makes_the_kept_row_group_stale(own_shop):
    memory = LocalMemory()
    derived = RowGroupFile(_part(own_shop), 0, ('id',))
    memory.stage(derived)
    old = memory.form_of(derived)
    stat = os.stat(_part(own_shop))
    os.utime(_part(own_shop), ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert not memory.is_current(derived, os.stat(_part(own_shop)))
    assert memory.stage(derived) > 0  # made again from the new origin
    assert memory.form_of(derived) is not old


def test_a_corrupt_row_group_is_named_and_nothing_is_kept(own_shop):
    helpers.corrupt_row_group(_part(own_shop), 1)
    memory = LocalMemory()
    derived = RowGroupFile(_part(own_shop), 1, ('id',))
    with pytest.raises(SourceFileError, match=_part(own_shop)):
        memory.stage(derived)
    with pytest.raises(FileNotFoundError):
        memory.form_of(derived)


def test_a_file_without_a_memory_form_is_refused_and_the_store_reads_sources(tmp_path):
    path = str(tmp_path / 'plain.bin')
    helpers.write_random_file(path, 1000)
    memory = LocalMemory()
    with pytest.raises(LocalStorageError) as raised:
        memory.stage(path)
    assert raised.value.errno == errno.EINVAL and 'plain.bin' in str(raised.value)
    store = LocalStore(memory)
    assert not store.stage(0, [as_source(path)]).staged
    assert 'cannot be kept in memory' in store.disabled


def test_the_ledger_counts_reservations_and_kept_bytes():
    ledger = MemoryLedger(100)
    assert ledger.reserve(60) and not ledger.reserve(41)
    ledger.settle(60, 70)  # larger than estimated
    assert ledger.used_bytes() == 70
    assert ledger.reserve(30) and not ledger.reserve(1)
    ledger.release(30)
    ledger.freed(70)
    assert ledger.used_bytes() == 0


def test_a_budget_of_two_row_groups_evicts_by_next_use(shop):
    dataset = ParquetDataset(shop, columns=['id', 'image'])
    groups = [dataset.example_files(group * ROW_GROUP_ROWS)[0]
              for group in range(4)]
    memory = LocalMemory()
    sizes = []
    for derived in groups:
        sizes.append(memory.stage(derived))
        memory.evict(derived)
    limit = sizes[0] + sizes[1] + max(sizes) // 2  # two row groups, not three
    store = LocalStore(memory, limit, 'belady', lambda item: [groups[item]])
    peak = 0
    for access, item in enumerate([0, 1, 2, 0, 3, 1]):
        result = store.stage(item, [groups[item]], access)
        assert result.staged
        store.used(item, access, float('inf'))
        peak = max(peak, store.bytes_used())
        kept = [g for g in range(4) if memory.is_current(groups[g], os.stat(
            groups[g].origin))]
        assert sum(sizes[g] for g in kept) == store.bytes_used() <= limit
    assert peak <= limit
    assert store.counters.snapshot()['files_evicted'] >= 3


def test_n_estimates_hold_n_row_groups_in_memory_and_in_files(tmp_path):
    # Row groups of 1,000 rows: Arrow's form takes more than the footer's
    # uncompressed size (a dictionary-encoded category comes out whole).
    shop = helpers.make_shop(tmp_path / 'shop', 2000, 1, 1000)
    dataset = ParquetDataset(shop, columns=['id', 'title', 'category', 'image'])
    groups = [dataset.example_files(group * 1000)[0] for group in range(2)]
    limit = sum(group.estimated_local_bytes(None) for group in groups)
    for where in (LocalMemory(), LocalDirectory(str(tmp_path / 'local'))):
        store = LocalStore(where, limit, 'belady', lambda item: [groups[item]])
        for item in range(2):
            assert store.stage(item, [groups[item]], item).staged, where
        counters = store.counters.snapshot()
        assert counters['files_copied'] == 2, where
        assert counters['files_evicted'] == counters['items_bypassed'] == 0, where
        assert 0 < store.bytes_used() <= limit
        if isinstance(where, LocalMemory):  # more than the footer's sizes
            assert store.bytes_used() > sum(group.decoded_bytes() + 4096
                                            for group in groups)
        store.close()


def test_evicted_row_groups_are_let_go_once_their_loads_end(shop, monkeypatch):
    made = []
    memory_form = RowGroupFile.memory_form

    def recorded(self, content):
        form = memory_form(self, content)
        made.extend([weakref.ref(form[0]), weakref.ref(form[0].table)])
        return form

    monkeypatch.setattr(RowGroupFile, 'memory_form', recorded)
    dataset = ParquetDataset(shop, columns=['id', 'image'], cache_row_groups=4)
    iterator = _iterator(dataset, MEMORY, True, capacity=2 * _largest(dataset),
                         n_copy_ahead=4)
    try:
        for _ in range(2 * ROWS // 16):
            iterator.next()
        memory = iterator._store.directory

        def only_kept_ones_live():
            gc.collect()
            live = {id(ref()) for ref in made if ref() is not None}
            kept = {id(part) for form in list(memory._forms.values())
                    for part in (form.value, form.value.table)}
            return live <= kept

        # (loader threads kept their last row groups in their own caches)
        assert helpers.wait_until(only_kept_ones_live, 10)
        assert iterator.stats['files_evicted'] > 0
    finally:
        iterator.finalize()


def test_two_threads_staging_one_row_group_make_it_once(shop):
    class Counted(RowGroupFile):
        made = 0

        def memory_form(self, content):
            type(self).made += 1
            return super().memory_form(content)

    memory = LocalMemory()
    derived = Counted(_part(shop), 0, ('id', 'image'))
    results = []
    start = threading.Barrier(2)

    def stage():
        start.wait()
        results.append(memory.stage(derived))

    threads = [threading.Thread(target=stage) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert Counted.made == 1
    assert sorted(results)[0] == 0 < sorted(results)[1]


# ---- the iterator ----------------------------------------------------------------

def _ids_and_images(batch):
    columns = concat_columns(batch)
    return [(int(i), bytes(image)) for i, image in zip(columns['id'],
                                                        columns['image'])]


def _iterator(dataset, local_dir, loader_threads, capacity=None, seed=0,
              **options):
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=2,
                                         seed=seed)
    return PrefetchMultiprocessIterator(
        dataset, 16, n_processes=2, order_sampler=sampler,
        local_dir=local_dir, local_capacity=capacity,
        loader_threads=loader_threads, **options)


def _largest(dataset):
    return max(dataset.example_files(group * ROW_GROUP_ROWS)[0]
               .estimated_local_bytes(None) for group in range(ROWS // ROW_GROUP_ROWS))


def test_memory_gives_the_batches_staged_files_give(shop, tmp_path):
    dataset = ParquetDataset(shop, columns=['id', 'image', 'price'])
    files = _iterator(dataset, str(tmp_path / 'local'), False)
    try:
        expected = [_ids_and_images(files.next()) for _ in range(17)]
    finally:
        files.finalize()
    snapshot = helpers.ResourceSnapshot()
    memory = _iterator(dataset, MEMORY, True, capacity=100 * _largest(dataset))
    try:
        got = [_ids_and_images(memory.next()) for _ in range(17)]
        stats = memory.stats
        assert snapshot.children == helpers.worker_children()  # no process
    finally:
        memory.finalize()
    assert got == expected
    assert stats['by_epoch'][1]['examples_from_local'] == ROWS
    assert stats['files_copied'] == ROWS // ROW_GROUP_ROWS  # each once
    assert not os.path.exists(MEMORY)  # not a directory
    assert helpers.wait_until(lambda: snapshot.leftovers() == (set(), [], []), 10), \
        snapshot.leftovers()


def test_memory_on_the_row_path_gives_the_rows(shop):
    dataset = ParquetDataset(shop, columns=['id', 'title'])
    iterator = PrefetchMultiprocessIterator(
        dataset, 16, repeat=False, shuffle=False, n_processes=2,
        local_dir=MEMORY, local_capacity=100 * _largest(dataset),
        loader_threads=True, columnar=False)
    try:
        rows = [example for batch in iterator for example in batch]
    finally:
        iterator.finalize()
    assert rows == [dataset[index] for index in range(ROWS)]


def test_every_row_once_per_epoch_within_two_row_groups_of_memory(shop):
    dataset = ParquetDataset(shop, columns=['id', 'image'])
    capacity = 2 * _largest(dataset)
    iterator = _iterator(dataset, MEMORY, True, capacity=capacity, seed=4,
                         n_copy_ahead=4)
    try:
        ids = []
        for _ in range(2 * ROWS // 16):  # two epochs exactly (one batch straddles)
            ids.extend(i for i, _ in _ids_and_images(iterator.next()))
            assert iterator.stats['local_bytes_used'] <= capacity
        stats = iterator.stats
    finally:
        iterator.finalize()
    assert sorted(ids[:ROWS]) == sorted(ids[ROWS:]) == list(range(ROWS))
    for start in range(0, 2 * ROWS, 16):  # no row twice in a batch of one epoch
        if not start < ROWS < start + 16:
            assert len(set(ids[start:start + 16])) == 16
    assert stats['files_evicted'] > 0
    assert stats['examples_from_local'] > 0


def test_finalize_lets_the_row_groups_go(shop):
    dataset = ParquetDataset(shop, columns=['id'])
    iterator = _iterator(dataset, MEMORY, True, capacity=100 * _largest(dataset))
    iterator.next()
    memory = iterator._store.directory
    first = dataset.example_files(int(concat_columns(iterator.next())['id'][0]))[0]
    assert memory.form_of(first) is not None
    iterator.finalize()
    with pytest.raises(FileNotFoundError):
        memory.form_of(first)
    assert iterator.stats['local_bytes_used'] == 0


@pytest.mark.parametrize('options, message', [
    ({'loader_threads': False, 'local_capacity': 10**9}, 'needs loader_threads=True'),
    ({'loader_threads': True}, 'local_capacity'),
])
def test_memory_without_loader_threads_or_capacity_is_refused(shop, options, message):
    dataset = ParquetDataset(shop, columns=['id'])
    with pytest.raises(ValueError, match=message):
        PrefetchMultiprocessIterator(dataset, 4, local_dir=MEMORY, **options)


def test_memory_for_a_dataset_of_plain_files_is_refused(tmp_path):
    root = str(tmp_path / 'images')
    os.makedirs(root)
    paths = []
    for number in range(4):
        paths.append(os.path.join(root, '{}.bin'.format(number)))
        helpers.write_random_file(paths[-1], 100, seed=number)
    dataset = _Files(paths)
    with pytest.raises(ValueError, match='0.bin, which has no in-memory form'):
        PrefetchMultiprocessIterator(dataset, 2, local_dir=MEMORY,
                                     local_capacity=10**6, loader_threads=True)


class _Files(chainer.dataset.DatasetMixin):
    """Examples that are files (the staging protocol of plain files)."""

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def get_example(self, index):
        with open(self.paths[index], 'rb') as f:
            return f.read()

    def example_files(self, index):
        return (self.paths[index],)

    def with_file_locations(self, locate):
        return _Files([locate(path) for path in self.paths])


def test_a_copy_that_ends_after_close_is_not_kept(shop):
    made, release = threading.Event(), threading.Event()

    class Slow(RowGroupFile):
        def memory_form(self, content):
            form = super().memory_form(content)
            made.set()
            release.wait(30)
            return form

    memory = LocalMemory()
    derived = Slow(_part(shop), 0, ('id', 'image'))
    store = LocalStore(memory, 10**9, 'belady', lambda item: [derived])
    results = []
    thread = threading.Thread(target=lambda: results.append(store.stage(0, [derived])))
    thread.start()
    assert made.wait(30)
    store.close()
    release.set()
    thread.join(30)
    assert not results[0].staged
    assert store.bytes_used() == 0
    with pytest.raises(FileNotFoundError):
        memory.form_of(derived)
    with pytest.raises(InterruptedError):
        memory.stage(derived)


def test_running_out_of_memory_is_a_local_failure_not_the_files(tmp_path):
    # A row group of 400 values of 2 MiB of zeros: a few kilobytes in the
    # file, 800 MiB decoded.  It is written by one child process; another,
    # which may map only 64 MiB more than it has mapped once everything is
    # imported, decodes it and fails for real (a process that had made the
    # table itself would still hold the memory its allocator kept).
    path = str(tmp_path / 'zeros.parquet')
    write = textwrap.dedent('''
        import sys, pyarrow, pyarrow.parquet
        pyarrow.parquet.write_table(pyarrow.table({
            'id': list(range(400)), 'blob': [bytes(2 << 20)] * 400}),
            sys.argv[1], row_group_size=400, compression='zstd')
    ''')
    stage = textwrap.dedent('''
        import errno, os, resource, sys
        from chainer_prefetch.datasets import ParquetDataset, ParquetFileError, RowGroupFile
        from chainer_prefetch.staging import LocalDirectory, LocalMemory, LocalStorageError
        source = RowGroupFile(sys.argv[1], 0, ('id', 'blob'))
        directory = LocalDirectory(sys.argv[2])
        with open('/proc/self/status') as status:
            mapped = [int(line.split()[1]) * 1024 for line in status
                      if line.startswith('VmSize')][0]
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (64 << 20), hard))
        for where in (LocalMemory(), directory):
            try:
                where.stage(source)
            except LocalStorageError as error:
                assert error.errno == errno.ENOMEM, error
                assert source.name in str(error), error
                print(type(where).__name__, 'ENOMEM')
            assert not os.listdir(directory.partial_root)
        try:  # reading the row group from the file: the same, not the file's fault
            ParquetDataset(sys.argv[1]).get_columns([0])
        except MemoryError as error:
            assert not isinstance(error, ParquetFileError), error
            print('read MemoryError')
        # Done: no teardown, where Arrow's threads, cut short of address
        # space, sometimes abort the process ("terminate called ...").
        sys.stdout.flush()
        os._exit(0)
    ''')
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    outputs = []
    for script, arguments in ((write, [path]), (stage, [path, str(tmp_path / 'local')])):
        done = subprocess.run([sys.executable, '-c', script] + arguments,
                              capture_output=True, text=True, timeout=60,
                              env=environment)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert outputs[1].split() == ['LocalMemory', 'ENOMEM', 'LocalDirectory', 'ENOMEM',
                                  'read', 'MemoryError']


def test_a_dataset_mixing_row_groups_and_plain_files_reads_from_source(shop, tmp_path):
    paths = []
    for number in range(8):
        paths.append(str(tmp_path / '{}.bin'.format(number)))
        helpers.write_random_file(paths[-1], 100, seed=number)
    rows = ParquetDataset(shop, columns=['id'])
    dataset = chainer.datasets.ConcatenatedDataset(
        chainer.datasets.TransformDataset(rows, lambda row: row['id']),
        chainer.datasets.TransformDataset(_Files(paths), len))
    iterator = PrefetchMultiprocessIterator(
        dataset, 16, repeat=False, shuffle=False, n_processes=2,
        local_dir=MEMORY, local_capacity=100 * _largest(rows),
        loader_threads=True, columnar=False)
    try:
        with pytest.warns(UserWarning, match='cannot be kept in memory'):
            got = [example for batch in iterator for example in batch]
        stats = iterator.stats
    finally:
        iterator.finalize()
    assert got == list(range(ROWS)) + [100] * 8
    assert 'cannot be kept in memory' in stats['local_storage_error']
