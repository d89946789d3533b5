"""Row groups staged as Arrow IPC files: LocalDirectory and the full iterator."""
import errno
import gc
import io
import multiprocessing
import os
import pickle
import time

import pyarrow
import pyarrow.ipc
import pyarrow.parquet
import pytest

import helpers
from chainer_prefetch import PrefetchMultiprocessIterator
from chainer_prefetch.datasets import (
    ParquetDataset,
    RowGroupFile,
    RowGroupWindowOrderSampler,
    row_group_source,
)
from chainer_prefetch.staging import (
    LocalDirectory,
    LocalStorageError,
    SourceFileError,
    resolve_dataset_files,
)
from chainer_prefetch.staging.dataset_files import ItemLocalBytes, ItemSources
from chainer_prefetch.staging.sources import using_reads_ahead
from chainer_prefetch_bench.testbed import parquet_dataset as make_parquet_dataset

ROWS, FILES, ROW_GROUP_ROWS = 120, 3, 10  # 12 row groups


@pytest.fixture
def shop(tmp_path):
    return helpers.make_shop(tmp_path / 'shared', ROWS, FILES, ROW_GROUP_ROWS)


def _part(shop, number=0):
    return os.path.join(shop, 'part-{:05d}.parquet'.format(number))


def _arrow_files(root):
    return sorted(os.path.join(folder, name)
                  for folder, _, names in os.walk(root)
                  for name in names if name.endswith('.arrow'))


def test_a_row_group_is_staged_as_an_ipc_file_equal_to_the_rows(shop, tmp_path):
    directory = LocalDirectory(str(tmp_path / 'local'))
    derived = RowGroupFile(_part(shop), 2, ('id', 'tokens'))
    copied = directory.stage(derived)
    local = directory.local_path(derived)
    assert copied == os.path.getsize(local) > 0
    staged = pyarrow.ipc.open_file(pyarrow.memory_map(local)).read_all()
    expected = pyarrow.parquet.ParquetFile(_part(shop)).read_row_group(
        2, columns=['id', 'tokens'])
    assert staged.equals(expected)
    assert os.stat(local).st_mtime_ns == os.stat(_part(shop)).st_mtime_ns
    assert directory.stage(derived) == 0  # valid: not made again
    assert os.listdir(directory.partial_root) == []
    other_columns = RowGroupFile(_part(shop), 2, ('id',))
    assert directory.local_path(other_columns) != local


@pytest.fixture
def decode_pool_chosen_again(monkeypatch):
    """The decode pool chosen afresh from the environment, and after the test."""
    choose = row_group_source.decode_memory_pool
    monkeypatch.delenv('ARROW_DEFAULT_MEMORY_POOL', raising=False)
    choose.cache_clear()
    yield monkeypatch
    choose.cache_clear()


def _gained(pools, action):
    """What ``action()`` returned, and the bytes each of ``pools`` gained meanwhile."""
    gc.collect()  # (no earlier test's table freed meanwhile)
    before = [pool.bytes_allocated() for pool in pools]
    result = action()
    return result, [pool.bytes_allocated() - b for pool, b in zip(pools, before)]


def test_row_groups_kept_in_memory_are_decoded_into_mallocs_pool_not_mimallocs(
        shop, decode_pool_chosen_again):
    assert row_group_source.decode_memory_pool().backend_name == 'system'
    default = pyarrow.default_memory_pool()
    if default.backend_name == 'system':
        pytest.skip('Arrow\'s default pool is the C library\'s here')
    counted = pyarrow.proxy_memory_pool(row_group_source.decode_memory_pool())
    decode_pool_chosen_again.setattr(row_group_source, 'decode_memory_pool',
                                     lambda: counted)
    derived = RowGroupFile(_part(shop), 2, ('id', 'title', 'tokens'))
    (decoded, size), (in_pool, in_default) = _gained(
        [counted, default], lambda: derived.memory_form(derived.load_from_origin()))
    assert in_pool >= size > 0
    assert in_default < size
    expected = pyarrow.parquet.ParquetFile(_part(shop)).read_row_group(
        2, columns=['id', 'title', 'tokens'])
    assert decoded.table.equals(expected)
    rows, (in_pool, in_default) = _gained(  # the dataset's own reads too
        [counted, default], lambda: row_group_source.read_row_group(
            _part(shop), 3, ['id', 'title']))
    assert in_pool >= rows.get_total_buffer_size() > in_default


def test_row_groups_written_to_local_files_are_decoded_in_the_default_pool(
        shop, tmp_path, decode_pool_chosen_again):
    counted = pyarrow.proxy_memory_pool(pyarrow.system_memory_pool())
    decode_pool_chosen_again.setattr(row_group_source, 'decode_memory_pool',
                                     lambda: counted)
    directory = LocalDirectory(str(tmp_path / 'local'))
    assert directory.stage(RowGroupFile(_part(shop), 2, ('id', 'title'))) > 0
    assert counted.num_allocations() == 0
    RowGroupFile(_part(shop), 3, ('id',)).memory_form(
        RowGroupFile(_part(shop), 3, ('id',)).load_from_origin())
    assert counted.num_allocations() > 0


def test_a_default_pool_the_user_chose_decodes_the_row_groups(
        shop, decode_pool_chosen_again):
    decode_pool_chosen_again.setenv('ARROW_DEFAULT_MEMORY_POOL', 'system')
    assert row_group_source.decode_memory_pool() is None
    derived = RowGroupFile(_part(shop), 2, ('id', 'title'))
    (_, size), (in_default,) = _gained(
        [pyarrow.default_memory_pool()],
        lambda: derived.memory_form(derived.load_from_origin()))
    assert in_default >= size > 0


def test_row_groups_kept_in_memory_keep_the_types_of_those_written(
        tmp_path, decode_pool_chosen_again):
    # Written without Arrow's schema (as Spark writes): the types come from
    # Parquet's logical types, here UUID and JSON.
    path = str(tmp_path / 'logical.parquet')
    pyarrow.parquet.write_table(pyarrow.table({
        'u': pyarrow.array([bytes(range(i, i + 16)) for i in range(3)],
                           pyarrow.uuid()),
        'j': pyarrow.array(['{"a": 1}'] * 3, pyarrow.json_())}),
        path, store_schema=False)
    derived = RowGroupFile(path, 0, ('u', 'j'))
    directory = LocalDirectory(str(tmp_path / 'local'))
    directory.stage(derived)
    written = pyarrow.ipc.open_file(directory.local_path(derived)).read_all()
    decoded, _ = derived.memory_form(derived.load_from_origin())
    assert decoded.table.equals(written)
    assert written.schema.field('u').type == pyarrow.uuid()


def test_a_row_group_file_pickles_as_itself(shop):
    derived = RowGroupFile(_part(shop), 1, ('id', 'title'))
    copy = pickle.loads(pickle.dumps(derived))
    assert copy == derived and isinstance(copy, RowGroupFile)
    assert (copy.origin, copy.row_group, copy.columns) == (
        _part(shop), 1, ('id', 'title'))


def test_a_changed_source_makes_the_local_row_group_stale(shop, tmp_path):
    directory = LocalDirectory(str(tmp_path / 'local'))
    derived = RowGroupFile(_part(shop), 0, ('id',))
    directory.stage(derived)
    stat = os.stat(_part(shop))
    os.utime(_part(shop), ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert directory.stage(derived) > 0  # made again from the new source


def test_a_corrupt_source_is_named_and_leaves_nothing(shop, tmp_path):
    directory = LocalDirectory(str(tmp_path / 'local'))
    metadata = pyarrow.parquet.read_metadata(_part(shop))
    chunk = metadata.row_group(1).column(0)
    with open(_part(shop), 'r+b') as f:
        f.seek(chunk.data_page_offset)
        f.write(b'\xff' * chunk.total_compressed_size)
    derived = RowGroupFile(_part(shop), 1, ('id',))
    with pytest.raises(SourceFileError, match=_part(shop)):
        directory.stage(derived)
    assert not os.path.exists(directory.local_path(derived))
    assert os.listdir(directory.partial_root) == []


def _decode_three_rows_at_a_time(monkeypatch, derived):
    decoded = derived.decoded_bytes()
    monkeypatch.setattr(row_group_source, 'DECODE_BYTES',
                        3 * decoded // ROW_GROUP_ROWS + 1)


def test_a_row_group_is_decoded_and_written_in_pieces(shop, tmp_path, monkeypatch):
    directory = LocalDirectory(str(tmp_path / 'local'))
    derived = RowGroupFile(_part(shop), 1, ('image', 'id', 'tokens'))
    assert derived.piece_rows() == ROW_GROUP_ROWS  # 8 MiB: the whole row group
    _decode_three_rows_at_a_time(monkeypatch, derived)
    assert derived.piece_rows() == 3
    directory.stage(derived)
    reader = pyarrow.ipc.open_file(pyarrow.memory_map(
        directory.local_path(derived)))
    assert [reader.get_batch(i).num_rows
            for i in range(reader.num_record_batches)] == [3, 3, 3, 1]
    expected = pyarrow.parquet.ParquetFile(_part(shop)).read_row_group(
        1, columns=['image', 'id', 'tokens'])
    assert reader.read_all().equals(expected)
    assert reader.schema.names == ['image', 'id', 'tokens']


def test_a_row_group_written_to_a_file_object_equals_the_one_arrow_writes_itself(
        shop, tmp_path):
    # A real file is written by Arrow through its descriptor; an object
    # without one (BytesIO) through Python calls: the same bytes either way.
    derived = RowGroupFile(_part(shop), 1, ('image', 'id', 'tokens'))
    in_memory = io.BytesIO()
    derived.write_local_form(derived.load_from_origin(), in_memory)
    path = str(tmp_path / 'row_group.arrow')
    with _CountedWrites(path, 'wb') as out:
        derived.write_local_form(derived.load_from_origin(), out)
        assert out.calls == 0  # not one write through Python
    with open(path, 'rb') as written:
        assert written.read() == in_memory.getvalue()
    expected = pyarrow.parquet.ParquetFile(_part(shop)).read_row_group(
        1, columns=['image', 'id', 'tokens'])
    assert pyarrow.ipc.open_file(pyarrow.py_buffer(
        in_memory.getvalue())).read_all().equals(expected)
    # After bytes already written (still in the file object's buffer), the
    # row group goes after them, and the file object goes on at its end.
    with open(path, 'wb') as out:
        out.write(b'head')
        derived.write_local_form(derived.load_from_origin(), out)
        out.write(b'tail')
    with open(path, 'rb') as written:
        content = written.read()
    assert content[:4] == b'head' and content[-4:] == b'tail'
    assert pyarrow.ipc.open_file(pyarrow.py_buffer(
        content[4:-4])).read_all().equals(expected)


def test_a_full_device_fails_a_row_group_with_enospc(shop):
    derived = RowGroupFile(_part(shop), 1, ('image', 'id'))
    with open('/dev/full', 'wb') as out:
        with pytest.raises(OSError) as info:
            derived.write_local_form(derived.load_from_origin(), out)
    assert info.value.errno == errno.ENOSPC


class _CountedWrites(io.FileIO):
    calls = 0

    def write(self, data):
        self.calls += 1
        return super().write(data)


def test_a_row_group_larger_than_the_free_local_space_is_named_and_leaves_nothing(
        tmp_path):
    shared = str(tmp_path / 'shared')
    make_parquet_dataset.generate(shared, 200, 1, 200, image_size=64)
    derived = RowGroupFile(_part(shared), 0, ('image',))
    assert derived.estimated_local_bytes(None) > 256 * 1024
    mount = tmp_path / 'small'
    with helpers.tmpfs(mount, '256k') as mounted:
        if not mounted:
            pytest.skip('cannot mount tmpfs (not root?)')
        directory = LocalDirectory(str(mount / 'local'))
        with pytest.raises(LocalStorageError) as info:
            directory.stage(derived)
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == directory.local_path(derived)
        assert not os.path.lexists(directory.local_path(derived))
        assert os.listdir(directory.partial_root) == []


def test_a_row_group_corrupt_after_its_first_piece_is_named_and_leaves_nothing(
        shop, tmp_path, monkeypatch):
    # One row per page: the first pieces decode, a later one does not.
    path = str(tmp_path / 'paged.parquet')
    pyarrow.parquet.write_table(
        pyarrow.parquet.read_table(_part(shop), columns=['id', 'title']), path,
        row_group_size=ROW_GROUP_ROWS, data_page_size=1, write_batch_size=1,
        compression='none')
    chunk = pyarrow.parquet.read_metadata(path).row_group(0).column(1)
    half = chunk.total_compressed_size // 2  # from inside the 5th page on
    with open(path, 'r+b') as f:
        f.seek(chunk.data_page_offset + half)
        f.write(b'\xff' * half)
    derived = RowGroupFile(path, 0, ('id', 'title'))
    monkeypatch.setattr(row_group_source, 'DECODE_BYTES', 1)  # a row at a time
    assert derived.piece_rows() == 1
    first = next(derived.load_from_origin().iter_batches(
        batch_size=2, row_groups=[0], columns=['id', 'title']))
    assert first.num_rows == 2  # the first piece is whole
    directory = LocalDirectory(str(tmp_path / 'local'))
    with pytest.raises(SourceFileError, match=path):
        directory.stage(derived)
    assert not os.path.exists(directory.local_path(derived))
    assert os.listdir(directory.partial_root) == []


def _stage_in_child(local_root, derived, barrier, results):
    barrier.wait()
    results.put(LocalDirectory(local_root).stage(derived))


@pytest.mark.timeout(60)
def test_two_processes_make_a_row_group_once(shop, tmp_path):
    local_root = str(tmp_path / 'local')
    derived = RowGroupFile(_part(shop), 0, ('id', 'image', 'title'))
    context = multiprocessing.get_context('fork')
    barrier, results = context.Barrier(2), context.Queue()
    children = [context.Process(target=_stage_in_child,
                                args=(local_root, derived, barrier, results))
                for _ in range(2)]
    for child in children:
        child.start()
    try:
        copied = sorted(results.get(timeout=30) for _ in children)
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
    assert copied[0] == 0 and copied[1] > 0


def test_the_located_view_names_a_local_file_that_is_gone(shop, tmp_path):
    """The loader falls back to the source, and counts it, on this error."""
    directory = LocalDirectory(str(tmp_path / 'local'))
    dataset = ParquetDataset(shop, columns=['id'])
    view = dataset.with_file_locations(directory.local_path)
    (derived,) = dataset.example_files(15)
    directory.stage(derived)
    assert view[15]['id'] == 15
    os.unlink(directory.local_path(derived))
    view._caches.row_groups.clear()  # this thread's cache
    with pytest.raises(FileNotFoundError) as info:
        view[15]
    assert info.value.filename == directory.local_path(derived)


def test_rows_of_a_row_group_form_one_item(shop):
    dataset = ParquetDataset(shop, columns=['id'])
    groups = dataset.example_file_groups()
    assert len(groups) == ROWS
    assert list(groups[:ROW_GROUP_ROWS + 1]) == [0] * ROW_GROUP_ROWS + [1]
    files = resolve_dataset_files(dataset)
    assert list(files.item_of()) == list(groups)
    assert files.files(3) == files.files(7) != files.files(10)


def test_a_row_group_reports_its_sizes_from_the_footer(shop):
    derived = RowGroupFile(_part(shop), 1, ('id', 'image'))
    origin_stat = derived.stat_origin()
    compressed = derived.source_bytes(origin_stat)
    assert 0 < compressed < origin_stat.st_size
    assert derived.source_bytes_per_example(origin_stat) == \
        compressed // ROW_GROUP_ROWS
    table = pyarrow.parquet.ParquetFile(_part(shop)).read_row_group(
        1, columns=['id', 'image'])
    assert derived.estimated_local_bytes(origin_stat) >= table.nbytes


def _one_epoch(dataset, local_root, seed, window, capacity=None):
    """Runs one epoch (repeat=False); returns the ids and the iterator's stats."""
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes,
                                         window=window, seed=seed)
    iterator = PrefetchMultiprocessIterator(
        dataset, 10, repeat=False, n_processes=2, order_sampler=sampler,
        local_dir=local_root, n_copy_threads=4, n_copy_ahead=2,
        local_capacity=capacity)
    ids = []
    try:
        for batch in iterator:
            batch_ids = [example['id'] for example in batch]
            assert len(set(batch_ids)) == len(batch_ids)
            ids.extend(batch_ids)
            if capacity is not None:
                assert _bytes(_arrow_files(local_root)) <= capacity
        return ids, iterator.stats
    finally:
        iterator.finalize()


def _bytes(paths):
    """Bytes of the files still there (the store may evict one meanwhile)."""
    total = 0
    for path in paths:
        try:
            total += os.path.getsize(path)
        except FileNotFoundError:
            pass
    return total


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_row_groups_live_under_the_capacity_limit_each_read_once_per_epoch(
        shop, tmp_path):
    window = 2
    dataset = ParquetDataset(shop, columns=['id', 'image'])
    n_groups = len(dataset.row_group_sizes)
    # Unlimited: every row group staged once; their local sizes.
    unlimited = str(tmp_path / 'unlimited')
    ids, stats = _one_epoch(dataset, unlimited, seed=4, window=window)
    assert sorted(ids) == list(range(ROWS))
    assert stats['files_copied'] == n_groups
    sizes = [os.path.getsize(path) for path in _arrow_files(unlimited)]
    assert len(sizes) == n_groups
    assert stats['local_bytes_written'] == sum(sizes)
    assert stats['bytes_copied'] < sum(sizes)  # compressed reads, decoded files
    # Room for half of them, two epochs: still each row group read once per
    # epoch, every row from a local file, the limit never exceeded, old
    # ones evicted.
    capacity = (n_groups // 2) * max(sizes)
    local_root = str(tmp_path / 'local')
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes,
                                         window=window, seed=5)
    iterator = PrefetchMultiprocessIterator(
        dataset, 10, n_processes=2, order_sampler=sampler,
        local_dir=local_root, n_copy_threads=4, n_copy_ahead=2,
        local_capacity=capacity)
    try:
        ids = []
        while iterator.epoch < 2:
            ids.extend(example['id'] for example in iterator.next())
            assert _bytes(_arrow_files(local_root)) <= capacity
        stats = iterator.stats
    finally:
        iterator.finalize()
    assert sorted(ids[:ROWS]) == sorted(ids[ROWS:]) == list(range(ROWS))
    assert stats['local_bytes_used'] <= capacity
    assert stats['files_evicted'] >= n_groups // 2
    for epoch in (0, 1):
        counts = stats['by_epoch'][epoch]
        assert counts['examples_from_local'] == ROWS, stats
    # Copied at most once per epoch, and epoch 1 reuses some of what epoch 0
    # left (about half when copies keep ahead; on a loaded machine, which
    # ones are still there when the consumer reaches them varies).
    assert stats['files_copied'] < 2 * n_groups


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize('local', ['directory', ':memory:'])
def test_a_copy_window_longer_than_the_capacity_leaves_no_row_group_on_shared_storage(
        shop, tmp_path, local):
    # The default n_copy_ahead (16 batches of 10 rows) spans every row group
    # of the dataset; room for 3 of them.  Stage 1 stays within what the
    # store holds, so every row of both epochs is read from a local copy.
    dataset = ParquetDataset(shop, columns=['id', 'image'])
    files = resolve_dataset_files(dataset)
    item_bytes = ItemLocalBytes(ItemSources(files, files.item_of()))
    estimates = [RowGroupFile(_part(shop, number), group, ['id', 'image'])
                 .estimated_local_bytes(None)
                 for number in range(FILES) for group in range(4)]
    assert [item_bytes(item) for item in range(12)] == estimates
    capacity = 3 * max(estimates)
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=2,
                                         seed=6)
    iterator = PrefetchMultiprocessIterator(
        dataset, 10, n_processes=2, order_sampler=sampler,
        local_dir=str(tmp_path / 'local') if local == 'directory' else local,
        loader_threads=local == ':memory:', local_capacity=capacity)
    try:
        ids = []
        while iterator.epoch < 2:
            ids.extend(int(example['id']) for example in iterator.next())
        stats = iterator.stats
    finally:
        iterator.finalize()
    assert sorted(ids[:ROWS]) == sorted(ids[ROWS:2 * ROWS]) == list(range(ROWS))
    for epoch in (0, 1):
        counts = stats['by_epoch'][epoch]
        assert counts['examples_from_local'] == ROWS, stats
    assert stats['items_bypassed'] == 0, stats


@pytest.mark.parametrize('one_at_a_time', [True, False])
def test_row_groups_are_copied_one_at_a_time_in_the_order_needed(
        shop, tmp_path, monkeypatch, one_at_a_time):
    # Each copy is made slow enough that copies on several threads overlap;
    # the row groups' own flag keeps them one at a time (False shows the
    # overlap the check would see).
    assert RowGroupFile.copied_one_at_a_time is True
    monkeypatch.setattr(RowGroupFile, 'copied_one_at_a_time', one_at_a_time)
    spans = []
    read = RowGroupFile.load_from_origin

    def slow_read(self, ahead=None):
        started = time.monotonic()
        time.sleep(0.05)
        content = read(self, ahead)
        spans.append((started, time.monotonic(), self.row_group, self.origin))
        return content

    monkeypatch.setattr(RowGroupFile, 'load_from_origin', slow_read)
    dataset = ParquetDataset(shop, columns=['id'])
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=1,
                                         seed=3)
    iterator = PrefetchMultiprocessIterator(
        dataset, 10, repeat=False, n_processes=1, order_sampler=sampler,
        local_dir=str(tmp_path / 'local'), n_copy_threads=4, n_copy_ahead=6)
    try:
        ids = [example['id'] for batch in iterator for example in batch]
    finally:
        iterator.finalize()
    assert sorted(ids) == list(range(ROWS))
    spans.sort()
    overlaps = sum(later[0] < earlier[1]
                   for earlier, later in zip(spans, spans[1:]))
    if not one_at_a_time:
        assert overlaps > 0
        return
    assert overlaps == 0
    first_needed = []  # row groups in the order the batches reach them
    for index in ids:
        file_index, group_in_file = dataset.row_group_locations[
            dataset.row_group_of(index)[0]]
        group = (dataset.files[file_index], group_in_file)
        if group not in first_needed:
            first_needed.append(group)
    assert [(origin, group) for _, _, group, origin in spans] == first_needed


def test_a_row_group_read_ahead_is_staged_alike_and_a_replaced_file_read_again(
        shop, tmp_path, monkeypatch):
    directory = LocalDirectory(str(tmp_path / 'local'))
    derived = RowGroupFile(_part(shop), 1, ('id', 'image'))
    expected = pyarrow.parquet.ParquetFile(_part(shop)).read_row_group(
        1, columns=['id', 'image'])
    ahead = derived.read_ahead()
    assert ahead.source_name == derived.name
    reads = []
    monkeypatch.setattr(row_group_source, 'map_column_chunks',
                        lambda *args: reads.append(args))
    with using_reads_ahead([ahead]):
        directory.stage(derived)
    assert reads == []  # only decoded: the chunks were read ahead
    monkeypatch.undo()
    staged = pyarrow.ipc.open_file(pyarrow.memory_map(
        directory.local_path(derived))).read_all()
    assert staged.equals(expected)
    # The file is replaced by another one after the read ahead: the copy
    # decodes the new file, not the pages read ahead of the old one.
    ahead = RowGroupFile(_part(shop), 2, ('id', 'image')).read_ahead()
    other = RowGroupFile(_part(shop), 2, ('id', 'image'))  # new footer
    replacement = pyarrow.parquet.read_table(_part(shop, 1))
    pyarrow.parquet.write_table(replacement, _part(shop) + '.new',
                                row_group_size=ROW_GROUP_ROWS)
    os.rename(_part(shop) + '.new', _part(shop))
    with using_reads_ahead([ahead]):
        directory.stage(other)
    staged = pyarrow.ipc.open_file(pyarrow.memory_map(
        directory.local_path(other))).read_all()
    assert staged.equals(replacement.select(['id', 'image']).slice(
        2 * ROW_GROUP_ROWS, ROW_GROUP_ROWS).combine_chunks())


def test_a_row_group_is_read_ahead_through_a_file_already_open(
        shop, tmp_path, monkeypatch):
    directory = LocalDirectory(str(tmp_path / 'local'))
    derived = RowGroupFile(_part(shop), 1, ('id', 'image'))
    opened = os.open(_part(shop), os.O_RDONLY)
    try:
        def no_open(path, *args, **kwargs):
            raise AssertionError('opened {} again'.format(path))

        monkeypatch.setattr(os, 'open', no_open)
        ahead = derived.read_ahead(opened)
        monkeypatch.undo()
        os.fstat(opened)  # still open: the caller's to close
    finally:
        os.close(opened)
    monkeypatch.setattr(row_group_source, 'map_column_chunks', None)
    with using_reads_ahead([ahead]):
        directory.stage(derived)  # decodes what was read ahead, reads nothing
    monkeypatch.undo()
    staged = pyarrow.ipc.open_file(pyarrow.memory_map(
        directory.local_path(derived))).read_all()
    assert staged.equals(pyarrow.parquet.ParquetFile(_part(shop)).read_row_group(
        1, columns=['id', 'image']))


def test_row_groups_skip_the_copy_windows_slow_start_and_plain_files_keep_it(
        shop, tmp_path):
    import chainer

    from helpers import make_jpeg_dataset
    list_file, root, _ = make_jpeg_dataset(tmp_path / 'images', 4, size=8)
    datasets = {False: ParquetDataset(shop, columns=['id']),
                True: chainer.datasets.LabeledImageDataset(list_file, root)}
    for slow_start, dataset in datasets.items():
        iterator = PrefetchMultiprocessIterator(
            dataset, 2, n_processes=1, local_dir=str(tmp_path / 'local'))
        try:
            iterator.next()
            config = iterator._executor._scheduler.config
            assert config.slow_start is slow_start, type(dataset).__name__
        finally:
            iterator.finalize()
