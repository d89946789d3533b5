"""Tests of ParquetDataset on real Parquet files written by the generator."""
import ctypes
import errno
import io
import mmap
import os
import shutil
import threading
import time

import chainer
import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
from PIL import Image

import helpers
from chainer_prefetch.datasets import (
    ParquetColumnError,
    ParquetDataset,
    ParquetFileError,
    ParquetSchemaError,
    RowGroupWindowOrderSampler,
    byte_ranges,
    parquet_dataset,
    row_group_source,
)
from chainer_prefetch_bench.testbed.page_cache import drop_file_cache

ROWS, FILES, ROW_GROUP_ROWS = 90, 3, 10  # files of 30 rows: 10 + 10 + 10


@pytest.fixture(scope='module')
def shop(tmp_path_factory):
    return helpers.make_shop(tmp_path_factory.mktemp('shop'), ROWS, FILES,
                             ROW_GROUP_ROWS)


def _copy_of(shop, tmp_path):
    directory = str(tmp_path / 'copy')
    shutil.copytree(shop, directory)
    return directory


def test_generator_writes_n_rows_over_m_files_with_unique_ids(shop):
    files = sorted(name for name in os.listdir(shop) if name.endswith('.parquet'))
    assert len(files) == FILES
    table = pyarrow.parquet.read_table(shop)
    assert table.num_rows == ROWS
    assert sorted(table.column('id').to_pylist()) == list(range(ROWS))
    metadata = pyarrow.parquet.read_metadata(os.path.join(shop, files[0]))
    assert metadata.num_row_groups == 3
    image = Image.open(io.BytesIO(table.column('image')[5].as_py()))
    assert image.format == 'JPEG' and image.size == (8, 8)


def test_length_schema_and_row_groups_come_from_metadata(shop):
    dataset = ParquetDataset(shop)
    assert len(dataset) == ROWS
    assert dataset.columns == ('id', 'title', 'tokens', 'image', 'brand',
                               'price', 'category')
    assert dataset.column_types['price'] == pyarrow.float32()
    assert dataset.column_types['tokens'] == pyarrow.list_(pyarrow.int32())
    assert dataset.row_group_sizes.tolist() == [10] * 9
    assert dataset.row_group_of(35) == (3, 5)


def test_examples_are_dicts_of_the_rows(shop):
    dataset = ParquetDataset(shop)
    table = pyarrow.parquet.read_table(shop).sort_by('id')
    for index in (0, 9, 10, 47, 89):
        example = dataset[index]
        assert example['id'] == index
        assert example['title'] == table.column('title')[index].as_py()
        assert example['image'] == table.column('image')[index].as_py()
        np.testing.assert_array_equal(
            example['tokens'], table.column('tokens')[index].as_py())
        assert example['tokens'].dtype == np.int32
    assert [example['id'] for example in dataset[3:6]] == [3, 4, 5]


def test_column_selection_tuples_and_transform(shop):
    categories = {'category{:02d}'.format(i): i for i in range(50)}

    def to_label(example):
        image_bytes, category = example
        pixels = np.asarray(Image.open(io.BytesIO(image_bytes)))
        return pixels, categories[category]

    dataset = ParquetDataset(shop, columns=['image', 'category'],
                             as_tuple=True, transform=to_label)
    assert dataset.columns == ('image', 'category')
    pixels, label = dataset[12]
    assert pixels.shape == (8, 8, 3) and 0 <= label < 50
    plain = ParquetDataset(shop, columns=['category', 'id'], as_tuple=True)
    assert plain[12] == (plain[12][0], 12)


def test_each_process_caches_a_bounded_number_of_row_groups(shop):
    dataset = ParquetDataset(shop, cache_row_groups=2)
    for index in range(0, ROWS, 5):
        dataset[index]
    assert len(dataset._caches.row_groups) == 2  # this thread's cache


def test_each_thread_keeps_its_own_row_groups(shop):
    """Loader threads working on different row groups do not evict each other's."""
    dataset = ParquetDataset(shop, cache_row_groups=1)
    dataset[0]
    last = len(dataset.row_group_sizes) - 1
    other = {}

    def read_the_last_row():
        other['value'] = dataset[ROWS - 1]['id']
        other['cached'] = list(dataset._caches.row_groups)

    thread = threading.Thread(target=read_the_last_row)
    thread.start()
    thread.join()
    assert other == {'value': ROWS - 1, 'cached': [last]}
    assert list(dataset._caches.row_groups) == [0]  # not evicted by it


def test_row_groups_of_indices_equal_a_binary_search():
    ends = np.cumsum([5, 1, 7, 3])  # 5, 6, 13, 16
    random = np.random.RandomState(0)
    batches = [np.array([0]), np.array([4, 0, 2]), np.array([5]),
               np.array([4, 5]), np.array([6, 12, 6]), np.array([15, 0])]
    batches += [random.randint(low, high, random.randint(1, 9))
                for low, high in ((0, 5), (6, 13), (0, 16), (13, 16))
                for _ in range(20)]
    for indices in batches:
        groups = parquet_dataset._groups_of(ends, indices)
        np.testing.assert_array_equal(
            groups, np.searchsorted(ends, indices, side='right'))
        assert groups.dtype == np.int64


def test_spark_layout_glob_and_list_of_files(shop, tmp_path):
    root = tmp_path / 'table'
    files = sorted(name for name in os.listdir(shop) if name.endswith('.parquet'))
    for number, name in enumerate(files):
        partition = root / 'part={}'.format(number % 2)
        partition.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(shop, name), str(partition / name))
        (partition / '.{}.crc'.format(name)).write_bytes(b'not parquet')
    (root / '_SUCCESS').write_bytes(b'')
    (root / '_temporary').mkdir()
    (root / '_temporary' / 'junk').write_bytes(b'not parquet')
    spark = ParquetDataset(str(root))
    assert len(spark) == ROWS
    assert spark.columns[-1] == 'part'  # the partition column, after the files'
    # part=0 holds the first and third file, part=1 the second
    assert [spark[i]['part'] for i in (0, 30, 60)] == [0, 0, 1]
    assert len(ParquetDataset(str(root / '*' / 'part-00001.parquet'))) == 30
    listed = [os.path.join(shop, name) for name in files[:2]]
    assert len(ParquetDataset(listed)) == 60


def test_missing_column_lists_the_available_ones(shop):
    with pytest.raises(ParquetColumnError) as raised:
        ParquetDataset(shop, columns=['id', 'colour'])
    message = str(raised.value)
    assert "'colour'" in message
    assert 'available columns: id, title, tokens, image, brand, price, category' \
        in message


def test_files_with_different_schemas_are_named(shop, tmp_path):
    directory = _copy_of(shop, tmp_path)
    odd = os.path.join(directory, 'part-00009.parquet')
    pyarrow.parquet.write_table(pyarrow.table({'id': [1, 2]}), odd)
    with pytest.raises(ParquetSchemaError) as raised:
        ParquetDataset(directory)
    assert os.path.join(directory, 'part-00000.parquet') in str(raised.value)
    assert odd in str(raised.value)


def test_truncated_file_is_named(shop, tmp_path):
    directory = _copy_of(shop, tmp_path)
    victim = os.path.join(directory, 'part-00001.parquet')
    with open(victim, 'r+b') as f:
        f.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(ParquetFileError, match=victim):
        ParquetDataset(directory)


def test_the_footers_of_a_dataset_are_read_at_once(shop, monkeypatch):
    # Each read waits until all three files' reads have begun: read one
    # after the other, the barrier breaks (after its timeout) and opening fails.
    barrier = threading.Barrier(FILES, timeout=10)
    read = parquet_dataset.read_metadata

    def read_when_all_started(path):
        barrier.wait()
        return read(path)

    monkeypatch.setattr(parquet_dataset, 'read_metadata', read_when_all_started)
    dataset = ParquetDataset(shop)
    assert dataset.files == sorted(dataset.files)
    assert [metadata.num_rows for metadata in dataset._metadata] == [30] * FILES
    assert [dataset[i]['id'] for i in (0, 45, 89)] == [0, 45, 89]


def test_the_first_unreadable_footer_is_named_and_later_ones_are_not_read():
    started = []

    def read(item):
        started.append(item)
        if item == 1:
            raise ParquetFileError('file {} is not a readable Parquet file'.format(item))
        time.sleep(0.1)  # 50 s for all of them on 2 threads, were they not dropped
        return item

    with pytest.raises(ParquetFileError, match='file 1 '):
        byte_ranges.map_in_threads(read, list(range(1000)), 2, 'test')
    assert len(started) < 500  # those queued behind the error were dropped
    assert not [thread for thread in threading.enumerate()
                if thread.name.startswith('chainer_prefetch-test')]
    assert byte_ranges.map_in_threads(lambda x: x * x, [3, 1, 2], 2,
                                      'test') == [9, 1, 4]


def test_the_error_raised_is_the_first_failing_item_in_order():
    def read(item):
        if item == 1:
            time.sleep(0.5)  # fails last
        if item in (1, 3):
            raise ParquetFileError('file {} is not readable'.format(item))
        return item

    with pytest.raises(ParquetFileError, match='file 1 '):
        byte_ranges.map_in_threads(read, [0, 1, 2, 3], 4, 'test')


def test_corrupt_data_is_named_when_read_and_metadata_still_works(shop, tmp_path):
    directory = _copy_of(shop, tmp_path)
    victim = os.path.join(directory, 'part-00000.parquet')
    metadata = pyarrow.parquet.read_metadata(victim)
    column = metadata.row_group(1).column(0)  # the 'id' chunk of row group 1
    with open(victim, 'r+b') as f:
        f.seek(column.data_page_offset)
        f.write(b'\xff' * column.total_compressed_size)
    dataset = ParquetDataset(directory, columns=['id'])
    assert len(dataset) == ROWS  # length and schema need no data page
    assert dataset[0]['id'] == 0  # row group 0 is intact
    with pytest.raises(ParquetFileError, match='row group 1 of ' + victim):
        dataset[12]


def test_corrupt_data_in_place_does_not_blame_a_rewrite(shop, tmp_path):
    directory = _copy_of(shop, tmp_path)
    victim = os.path.join(directory, 'part-00000.parquet')
    helpers.corrupt_row_group(victim, 1)
    dataset = ParquetDataset(directory, columns=['id', 'title'])
    with pytest.raises(ParquetFileError) as raised:
        dataset[12]
    assert 'rewritten' not in str(raised.value)
    # Nor a file gone or cut short, whose footer cannot be read.
    cut = os.path.join(directory, 'part-00002.parquet')
    with open(cut, 'r+b') as f:
        f.truncate(100)
    with pytest.raises(ParquetFileError) as raised:
        dataset[85]
    assert 'rewritten' not in str(raised.value)
    os.remove(os.path.join(directory, 'part-00001.parquet'))
    with pytest.raises(ParquetFileError) as raised:
        dataset[45]
    assert 'rewritten' not in str(raised.value)


def test_a_file_rewritten_after_the_dataset_was_made_is_named_as_such(
        shop, tmp_path):
    directory = _copy_of(shop, tmp_path)
    dataset = ParquetDataset(directory, columns=['id', 'title'])
    victim = os.path.join(directory, 'part-00001.parquet')
    # The same schema, other row groups: the footer the dataset read no
    # longer describes the file.
    table = pyarrow.parquet.read_table(victim).slice(0, 25)
    pyarrow.parquet.write_table(table, victim + '.new', row_group_size=7)
    os.replace(victim + '.new', victim)
    with pytest.raises(ParquetFileError,
                       match=r'(?s)row group 2 of {}: .*rewritten after the '
                             r'dataset read its footer'.format(victim)):
        dataset[55]  # row 25 of the file, in its third row group of 10


def test_a_row_group_read_in_parallel_pieces_equals_arrows_own_read(
        shop, monkeypatch):
    monkeypatch.setattr(byte_ranges, 'READ_PIECE_BYTES', 64)  # many pieces
    path = os.path.join(shop, 'part-00001.parquet')
    for columns in (['image', 'title', 'id'], ['tokens', 'price'], ['category']):
        for group in range(3):
            ours = row_group_source.read_row_group(path, group, columns)
            arrows = pyarrow.parquet.ParquetFile(path).read_row_group(
                group, columns=columns)
            assert ours.equals(arrows), (columns, group)


def _cached_pages(path: str) -> np.ndarray:
    """Which pages of ``path`` the page cache holds (``mincore``; the file is ours)."""
    libc = ctypes.CDLL(None)
    with open(path, 'rb') as f:
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            pages = np.zeros(-(-len(mapped) // mmap.PAGESIZE), np.uint8)
            address = pyarrow.py_buffer(mapped).address
            assert libc.mincore(ctypes.c_void_p(address),
                                ctypes.c_size_t(len(mapped)),
                                ctypes.c_void_p(pages.ctypes.data)) == 0
    return (pages & 1).astype(bool)


def _drop_cached_pages(path: str):
    with open(path, 'rb') as f:
        os.fsync(f.fileno())  # (dirty pages are not dropped)
    drop_file_cache(path)
    if _cached_pages(path).any():
        pytest.skip('the page cache of {} cannot be dropped here'.format(path))


def test_column_chunks_are_faulted_into_the_mapping_not_copied(shop, monkeypatch):
    monkeypatch.setattr(byte_ranges, 'READ_PIECE_BYTES', 512)  # many pieces
    path = os.path.join(shop, 'part-00001.parquet')
    metadata = pyarrow.parquet.read_metadata(path)
    columns = ['image', 'id']
    _, chunks = row_group_source.selected_chunks(metadata, 1, columns)
    ranges = byte_ranges.chunk_ranges(chunks, os.path.getsize(path))
    pieces = byte_ranges.pieces_to_read(
        ranges, byte_ranges.read_threads_for(path))
    assert len(pieces) > len(ranges) > 0
    arrows = pyarrow.parquet.ParquetFile(path).read_row_group(1, columns=columns)
    read_at = []
    preadv = os.preadv

    def counted_preadv(fd, buffers, offset, *flags):  # reads for real
        read_at.append(offset)
        return preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, 'preadv', counted_preadv)
    with open(path, 'rb') as probe, mmap.mmap(probe.fileno(), 0,
                                             prot=mmap.PROT_READ) as mapped:
        if not byte_ranges._populate(pyarrow.py_buffer(mapped), 0, 1):
            pytest.skip('this kernel has no MADV_POPULATE_READ (Linux 5.14)')
    _drop_cached_pages(path)
    mapped, _ = byte_ranges.map_column_chunks(path, chunks)
    assert read_at == []  # nothing copied...
    cached = _cached_pages(path)
    for start, end in ranges:  # ... and every page of the chunks read
        assert cached[start // mmap.PAGESIZE:-(-end // mmap.PAGESIZE)].all()
    assert row_group_source.read_row_group(path, 1, columns, metadata,
                                           mapped).equals(arrows)

    # Where faulting fails (a kernel before 5.14), every piece is read.
    monkeypatch.setattr(byte_ranges, '_populate', lambda *args: False)
    del mapped  # (its pages mapped could not be dropped)
    _drop_cached_pages(path)
    mapped, _ = byte_ranges.map_column_chunks(path, chunks)
    assert sorted(read_at) == [start for start, _ in pieces]
    assert row_group_source.read_row_group(path, 1, columns, metadata,
                                           mapped).equals(arrows)


def test_only_the_selected_column_chunks_are_read(tmp_path, monkeypatch):
    path = str(tmp_path / 'wide.parquet')
    rows = 200
    table = pyarrow.table({
        'id': np.arange(rows),
        'blob': [os.urandom(20000) for _ in range(rows)],  # 4 MB between
        'label': np.arange(rows) % 7})
    pyarrow.parquet.write_table(table, path, compression='none')
    metadata = pyarrow.parquet.read_metadata(path)
    _, chunks = row_group_source.selected_chunks(metadata, 0, ['id', 'label'])
    ranges = byte_ranges.chunk_ranges(chunks, os.path.getsize(path))
    assert len(ranges) == 2  # 'blob' lies between them and is not read
    assert sum(end - start for start, end in ranges) < 20000
    monkeypatch.setattr(byte_ranges, 'READ_PIECE_BYTES', 64)
    mapped = byte_ranges.map_column_chunks

    def only_the_ranges(path, chunks):  # every byte outside them spoiled
        whole, opened = mapped(path, chunks)
        content = bytearray(whole.to_pybytes())
        kept = bytearray(b'\xff') * len(content)
        for start, end in byte_ranges.chunk_ranges(chunks, len(content)):
            kept[start:end] = content[start:end]
        return pyarrow.py_buffer(bytes(kept)), opened

    monkeypatch.setattr(row_group_source, 'map_column_chunks', only_the_ranges)
    ours = row_group_source.read_row_group(path, 0, ['id', 'label'])
    assert ours.equals(table.select(['id', 'label']))


def test_a_file_cut_short_after_its_footer_was_read_is_named(shop, tmp_path):
    directory = _copy_of(shop, tmp_path)
    victim = os.path.join(directory, 'part-00002.parquet')
    dataset = ParquetDataset(directory, columns=['image'])  # footers read
    last_group_start = pyarrow.parquet.read_metadata(victim).row_group(
        2).column(0).data_page_offset
    with open(victim, 'r+b') as f:
        f.truncate(last_group_start + 10)
    assert dataset[60]['image']  # row group 0 of the file: whole
    with pytest.raises(ParquetFileError, match='row group 2 of ' + victim):
        dataset[85]


def test_empty_files_are_fine(shop, tmp_path):
    directory = _copy_of(shop, tmp_path)
    schema = pyarrow.parquet.read_schema(os.path.join(shop, 'part-00000.parquet'))
    pyarrow.parquet.write_table(schema.empty_table(),
                                os.path.join(directory, 'part-00000a.parquet'))
    dataset = ParquetDataset(directory)
    assert len(dataset) == ROWS
    assert [dataset[i]['id'] for i in (29, 30, 31)] == [29, 30, 31]
    only_empty = ParquetDataset(os.path.join(directory, 'part-00000a.parquet'))
    assert len(only_empty) == 0 and len(only_empty.row_group_sizes) <= 1


def test_missing_path_and_index_out_of_range(shop, tmp_path):
    with pytest.raises(ParquetFileError, match='nowhere'):
        ParquetDataset(str(tmp_path / 'nowhere'))
    with pytest.raises(IndexError, match='90 rows'):
        ParquetDataset(shop).get_example(ROWS)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_chainer_multiprocess_iterator_sees_every_row_once(shop):
    dataset = ParquetDataset(shop, columns=['id', 'title'], cache_row_groups=3)
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=3,
                                         seed=0)
    iterator = chainer.iterators.MultiprocessIterator(
        dataset, 10, n_processes=2, order_sampler=sampler)
    try:
        for _ in range(2):
            ids = []
            for _ in range(ROWS // 10):
                batch = iterator.next()
                assert len({example['id'] for example in batch}) == 10
                ids.extend(example['id'] for example in batch)
            assert sorted(ids) == list(range(ROWS))
    finally:
        iterator.finalize()


def test_a_file_that_cannot_be_mapped_is_read_by_arrow(shop, monkeypatch):
    # What a FUSE mount with direct_io answers to mmap.
    def refuse(*args, **kwargs):
        raise OSError(errno.ENODEV, 'No such device')

    monkeypatch.setattr(byte_ranges.mmap, 'mmap', refuse)
    path = os.path.join(shop, 'part-00001.parquet')
    ours = row_group_source.read_row_group(path, 1, ['image', 'id'])
    assert ours.equals(pyarrow.parquet.ParquetFile(path).read_row_group(
        1, columns=['image', 'id']))
