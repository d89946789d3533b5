"""The columnar batch path on real Parquet files with real loader processes.

``ParquetDataset.get_columns`` against ``get_example``, and
``PrefetchMultiprocessIterator`` delivering columnar batches against the
row path (``columnar=False``): the same examples, every row once per epoch,
resume mid-epoch, and bad input named in the error.
"""
import io
import os
import shutil

import chainer
import numpy as np
import pyarrow
import pyarrow.ipc
import pyarrow.parquet
import pytest
from PIL import Image

import helpers
from chainer_prefetch import ExampleLoadError, PrefetchMultiprocessIterator
from chainer_prefetch.columnar import (
    ColumnarBatch,
    ColumnConverter,
    VarColumn,
    concat_columns,
)
from chainer_prefetch.datasets import (
    ParquetDataset,
    ParquetFileError,
    RowGroupWindowOrderSampler,
    row_group_source,
)

ROWS, FILES, ROW_GROUP_ROWS = 120, 3, 10  # 12 row groups


@pytest.fixture(scope='module')
def shop(tmp_path_factory):
    return helpers.make_shop(tmp_path_factory.mktemp('shop'), ROWS, FILES,
                             ROW_GROUP_ROWS)


def _same_example(got, expected):
    if isinstance(expected, dict):
        assert sorted(got) == sorted(expected)
        pairs = [(got[key], expected[key]) for key in expected]
    elif isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == len(expected)
        pairs = list(zip(got, expected))
    else:
        pairs = [(got, expected)]
    for got_value, expected_value in pairs:
        if isinstance(expected_value, np.ndarray):
            np.testing.assert_array_equal(got_value, expected_value)
            assert got_value.dtype == expected_value.dtype
        else:
            assert got_value == expected_value
            assert type(got_value) is type(expected_value)


def test_get_columns_gives_the_rows_get_example_gives(shop):
    dataset = ParquetDataset(shop)
    indices = [57, 3, 119, 3, 64, 10, 9]  # across row groups, a repeat
    batch = dataset.get_columns(indices)
    assert isinstance(batch, ColumnarBatch) and len(batch) == len(indices)
    assert isinstance(batch.columns['image'], VarColumn)
    assert batch.columns['id'].dtype == np.int64
    for row, index in zip(batch, indices):
        _same_example(row, dataset[index])
    as_tuple = ParquetDataset(shop, columns=['category', 'id', 'tokens'],
                              as_tuple=True)
    for row, index in zip(as_tuple.get_columns(indices), indices):
        _same_example(row, as_tuple[index])
    with pytest.raises(IndexError, match='120 rows'):
        dataset.get_columns([0, ROWS])


def test_a_batch_across_row_groups_with_nulls_in_some_only(tmp_path):
    path = str(tmp_path / 'nulls.parquet')
    pyarrow.parquet.write_table(pyarrow.table({
        'id': list(range(8)),
        'text': ['a', 'b', 'c', 'd', None, 'f', 'g', 'h'],
        'count': [1, 2, 3, 4, 5, None, 7, 8],
        'tokens': pyarrow.array([[1], [2, 2], [], [4], None, [6], [7], [8]],
                                pyarrow.list_(pyarrow.int64())),
    }), path, row_group_size=4)  # nulls in the second row group only
    dataset = ParquetDataset(path)
    indices = [0, 4, 1, 5, 2, 6]
    batch = dataset.get_columns(indices)
    for row, index in zip(batch, indices):
        _same_example(row, dataset[index])
    assert batch[1]['text'] is None and batch[3]['count'] is None


def _first_batches(path):
    """The first batch of 6 rows of the file ``path`` on each path: ``{columnar: batch}``."""
    dataset = ParquetDataset(path)
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=3)
    batches = {}
    for columnar in (False, True):
        iterator = PrefetchMultiprocessIterator(
            dataset, 6, n_processes=1, order_sampler=sampler, columnar=columnar)
        try:
            batches[columnar] = iterator.next()
        finally:
            iterator.finalize()
    return batches


@pytest.mark.timeout(120)
def test_numbers_keep_their_column_dtype_through_chainer_converters(tmp_path):
    # Chainer's float32 links refuse float64: a float32 column must reach the
    # model as float32 whichever path and converter carry it.
    path = str(tmp_path / 'numbers.parquet')
    pyarrow.parquet.write_table(pyarrow.table({
        'x': pyarrow.array(np.arange(12) / 4, pyarrow.float32()),
        'y': pyarrow.array(np.arange(12) / 8, pyarrow.float32()),
        'label': pyarrow.array(np.arange(12) % 3, pyarrow.int32()),
        'flag': pyarrow.array(np.arange(12) % 2 == 0),
        'half': pyarrow.array(np.arange(12), pyarrow.float16()),
    }), path, row_group_size=4)
    dataset = ParquetDataset(path)
    dtypes = {'x': np.float32, 'y': np.float32, 'label': np.int32,
              'flag': np.bool_, 'half': np.float16}
    assert type(dataset[5]['x']) is np.float32 and dataset[5]['x'] == 1.25
    link = chainer.links.Linear(2, 3)
    for columnar, batch in _first_batches(path).items():
        for converter in (chainer.dataset.concat_examples, concat_columns):
            arrays = converter(batch)
            assert {name: array.dtype for name, array in arrays.items()} == {
                name: np.dtype(dtype) for name, dtype in dtypes.items()}, (
                columnar, converter)
            features = np.stack([arrays['x'], arrays['y']], axis=1)
            assert link(features).dtype == np.float32


@pytest.mark.timeout(120)
def test_list_columns_reach_the_model_alike_on_both_paths(tmp_path):
    # A list column whose rows have one length is the 2-D array
    # concat_examples stacks, from either path; of different lengths, a
    # VarColumn (concat_examples cannot stack it), or padded as
    # concat_examples pads it.
    path = str(tmp_path / 'lists.parquet')
    ragged = [list(range(i % 3)) for i in range(12)]
    pyarrow.parquet.write_table(pyarrow.table({
        'features': pyarrow.array([[i, i + 0.5, i + 1, i + 1.5] for i in range(12)],
                                  pyarrow.list_(pyarrow.float32())),
        'tokens': pyarrow.array(ragged, pyarrow.list_(pyarrow.int32())),
    }), path, row_group_size=4)
    padded_converter = ColumnConverter(padding=-1)
    for columnar, batch in _first_batches(path).items():
        rows = list(batch)
        arrays = concat_columns(batch)
        features = chainer.dataset.concat_examples(
            [{'features': row['features']} for row in rows])['features']
        assert features.shape == (6, 4) and features.dtype == np.float32
        np.testing.assert_array_equal(arrays['features'], features)
        assert arrays['features'].dtype == np.float32, columnar
        assert isinstance(arrays['tokens'], VarColumn), columnar
        assert [list(value) for value in arrays['tokens']] == [
            list(row['tokens']) for row in rows]
        padded = padded_converter(batch)
        expected = chainer.dataset.concat_examples(rows, padding=-1)
        for name in ('features', 'tokens'):
            np.testing.assert_array_equal(padded[name], expected[name])
            assert padded[name].dtype == expected[name].dtype, (columnar, name)


def _decode(example):
    pixels = np.asarray(Image.open(io.BytesIO(example['image'])),
                        dtype=np.float32)
    return pixels, np.int32(example['id'] % 7)


def _scale(batch):
    pixels, label = batch.columns.values()
    return {'pixels': pixels / 255, 'label': label}


def test_per_row_and_per_batch_transforms(shop):
    dataset = ParquetDataset(shop, columns=['image', 'id'], transform=_decode,
                             batch_transform=_scale)
    batch = dataset.get_columns([5, 77, 31])
    assert batch.form == 'dict' and batch.names == ('pixels', 'label')
    assert batch.columns['pixels'].shape == (3, 8, 8, 3)
    assert batch.columns['pixels'].max() <= 1
    np.testing.assert_array_equal(batch.columns['label'], [5, 0, 3])
    _same_example(batch[1], dataset[77])  # dataset[i] is a batch of one


def _iterate(dataset, columnar, batches, seed=0, **options):
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=3,
                                         seed=seed)
    iterator = PrefetchMultiprocessIterator(
        dataset, 16, n_processes=2, order_sampler=sampler, columnar=columnar,
        n_copy_threads=4, **options)
    try:
        got = []
        for _ in range(batches):
            batch = iterator.next()
            assert isinstance(batch, ColumnarBatch) == columnar
            got.append((list(batch), iterator.epoch_detail))
        return got
    finally:
        iterator.finalize()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize('local', [False, True])
def test_columnar_batches_equal_the_row_path(shop, tmp_path, local):
    dataset = ParquetDataset(shop, columns=['id', 'title', 'image', 'price',
                                            'tokens'])
    options = {'local_dir': str(tmp_path / 'local')} if local else {}
    rows = _iterate(dataset, False, 17, **options)  # 2 epochs and a bit
    columns = _iterate(dataset, True, 17, **options)
    for (row_batch, row_detail), (column_batch, column_detail) in zip(
            rows, columns):
        assert row_detail == column_detail
        assert len(row_batch) == len(column_batch)
        for got, expected in zip(column_batch, row_batch):
            _same_example(got, expected)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_row_groups_staged_in_pieces_give_the_rows_of_the_parquet_files(
        shop, tmp_path, monkeypatch):
    dataset = ParquetDataset(shop, columns=['id', 'title', 'image', 'price',
                                            'tokens'])
    expected = _iterate(dataset, False, 17)  # read from the Parquet files
    decoded = max(group.decoded_bytes()
                  for group in map(dataset._row_group_file,
                                   range(len(dataset.row_group_sizes))))
    monkeypatch.setattr(row_group_source, 'DECODE_BYTES',  # 4 record batches
                        3 * decoded // ROW_GROUP_ROWS + 1)
    for columnar in (False, True):
        local = str(tmp_path / 'local-{}'.format(columnar))
        got = _iterate(dataset, columnar, 17, local_dir=local)
        assert [detail for _, detail in got] == [
            detail for _, detail in expected]
        for (batch, _), (expected_batch, _) in zip(got, expected):
            assert len(batch) == len(expected_batch)
            for example, expected_example in zip(batch, expected_batch):
                _same_example(example, expected_example)
        staged = [os.path.join(folder, name)
                  for folder, _, names in os.walk(local)
                  for name in names if name.endswith('.arrow')]
        assert staged and all(pyarrow.ipc.open_file(pyarrow.memory_map(
            path)).num_record_batches == 4 for path in staged)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_transforms_in_the_loaders_and_the_converter(shop, tmp_path):
    dataset = ParquetDataset(shop, columns=['image', 'id'], transform=_decode,
                             batch_transform=_scale)
    snapshot = helpers.ResourceSnapshot()
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=2)
    iterator = PrefetchMultiprocessIterator(
        dataset, 20, n_processes=2, order_sampler=sampler,
        local_dir=str(tmp_path / 'local'), local_capacity=2**24)
    try:
        batch = iterator.next()
        snapshot.record()
        arrays = concat_columns(batch)
        assert arrays['pixels'].shape == (20, 8, 8, 3)
        assert arrays['pixels'].dtype == np.float32
        # What Chainer's own converter makes of the rows, the same arrays.
        expected = chainer.dataset.concat_examples(list(batch))
        for key in expected:
            np.testing.assert_array_equal(arrays[key], expected[key])
        del batch, arrays, expected
    finally:
        iterator.finalize()
    assert helpers.wait_until(lambda: snapshot.leftovers() == (set(), [], []), 10), \
        snapshot.leftovers()


def _epoch_ids(iterator):
    ids = []
    for batch in iterator:
        batch_ids = concat_columns(batch)['id'].tolist()
        assert len(set(batch_ids)) == len(batch_ids)
        ids.extend(batch_ids)
    return ids


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_row_once_per_epoch_each_row_group_read_once(shop, tmp_path):
    dataset = ParquetDataset(shop, columns=['id', 'image'])
    n_groups = len(dataset.row_group_sizes)
    largest = max(dataset.example_files(int(i))[0].estimated_local_bytes(None)
                  for i in range(0, ROWS, ROW_GROUP_ROWS))
    # With room for every row group, each is made once and every row read
    # from it; with room for 8 of 12, the copy window (8 batches: about four
    # windows of 3 row groups) runs past the room, so a row group may be
    # left to the source for some rows, or evicted and made again (timing
    # decides): every row still comes once.
    for epoch_seed, room in ((0, n_groups), (1, 8)):
        local = str(tmp_path / 'local{}'.format(epoch_seed))
        sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes,
                                             window=3, seed=epoch_seed)
        iterator = PrefetchMultiprocessIterator(
            dataset, 16, repeat=False, n_processes=2, order_sampler=sampler,
            local_dir=local, local_capacity=room * largest, n_copy_ahead=8)
        try:
            assert sorted(_epoch_ids(iterator)) == list(range(ROWS))
            stats = iterator.stats
        finally:
            iterator.finalize()
        counts = stats['by_epoch'][0]
        assert counts['examples_from_local'] + \
            counts['examples_from_source'] == ROWS
        if room == n_groups:
            assert stats['files_copied'] == n_groups
            assert counts['examples_from_local'] == ROWS


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_mid_epoch_continues_with_the_same_rows(shop, tmp_path):
    dataset = ParquetDataset(shop, columns=['id'])

    def make():
        sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes,
                                             window=2, seed=3)
        return PrefetchMultiprocessIterator(
            dataset, 16, n_processes=2, order_sampler=sampler,
            local_dir=str(tmp_path / 'local'))

    def ids(batch):
        return concat_columns(batch)['id'].tolist()

    whole = make()
    try:
        expected = [ids(whole.next()) for _ in range(12)]
    finally:
        whole.finalize()
    first = make()
    try:
        got = [ids(first.next()) for _ in range(5)]  # mid-epoch 0
        snapshot = {}
        first.serialize(chainer.serializers.DictionarySerializer(snapshot))
    finally:
        first.finalize()
    second = make()
    try:
        second.serialize(chainer.serializers.NpzDeserializer(snapshot))
        got.extend(ids(second.next()) for _ in range(7))
    finally:
        second.finalize()
    assert got == expected
    epoch0 = sum(got[:8], [])[:ROWS]  # 120 rows: 7.5 batches of 16
    assert sorted(epoch0) == list(range(ROWS))


def _corrupt_row_group(directory, file_number, group):
    path = os.path.join(directory, 'part-{:05d}.parquet'.format(file_number))
    helpers.corrupt_row_group(path, group)
    return path


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize('local, loader_threads', [
    (None, False), (None, True), ('dir', False), ('dir', True), ('memory', True)])
def test_a_corrupt_row_group_is_named(shop, tmp_path, local, loader_threads):
    directory = str(tmp_path / 'shop')
    shutil.copytree(shop, directory)
    victim = _corrupt_row_group(directory, 1, 2)  # rows 60..69
    dataset = ParquetDataset(directory, columns=['id', 'title'])
    with pytest.raises(ParquetFileError, match='row group 2 of ' + victim):
        dataset.get_columns([0, 65, 1])
    iterator = PrefetchMultiprocessIterator(
        dataset, 30, n_processes=2, shuffle=False, repeat=False,
        local_dir={None: None, 'dir': str(tmp_path / 'local'),
                   'memory': ':memory:'}[local],
        local_capacity=10**9 if local == 'memory' else None,
        loader_threads=loader_threads)
    try:
        iterator.next()  # rows 0..29
        iterator.next()  # rows 30..59
        with pytest.raises(ParquetFileError) as raised:
            iterator.next()  # rows 60..89
    finally:
        iterator.finalize()
    assert isinstance(raised.value, ExampleLoadError)
    assert 'row group 2 of ' + victim in str(raised.value)
    assert 60 <= raised.value.index < 70
    # The example's files are known without staging too.
    assert victim + ' (row group 2)' in raised.value.files, raised.value.files


def _fails_on_row_17(example):
    if example['id'] == 17:
        raise ValueError('cannot use row 17')
    return example


def _fails_on_batches(batch):
    raise KeyError('no column "label"')


def _row_17_failing(iterator) -> ExampleLoadError:
    """What the second batch (rows 10..19, in order) of ``iterator`` raises; finalizes it."""
    try:
        iterator.next()
        with pytest.raises(ValueError, match='cannot use row 17') as raised:
            iterator.next()
    finally:
        iterator.finalize()
    assert isinstance(raised.value, ExampleLoadError)
    assert raised.value.index == 17
    return raised.value


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize('loader_threads', [False, True])
def test_a_transform_failing_on_one_row_is_named(shop, loader_threads):
    dataset = ParquetDataset(shop, columns=['id'], transform=_fails_on_row_17)
    with pytest.raises(ValueError, match='cannot use row 17') as raised:
        dataset.get_columns([3, 17, 4])
    assert raised.value.index == 17
    assert 'part-00000.parquet (row group 1)' in str(raised.value)
    error = _row_17_failing(PrefetchMultiprocessIterator(
        dataset, 10, n_processes=2, shuffle=False,
        loader_threads=loader_threads))
    assert 'example 17' in str(error)
    batch_failing = ParquetDataset(shop, columns=['id'],
                                   batch_transform=_fails_on_batches)
    with pytest.raises(KeyError) as raised:
        batch_failing.get_columns([40, 41, 50])
    message = str(raised.value)
    assert 'batch_transform on 3 examples (40, 41, 50)' in message
    assert 'part-00001.parquet (row group 0)' in message
    assert 'part-00001.parquet (row group 1)' in message


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_row_failing_on_the_row_path_is_named_by_its_file_and_row_group(
        shop, tmp_path):
    # Staged row groups are local files with virtual names; the error names
    # the Parquet file and row group, as on the columnar path.
    dataset = ParquetDataset(shop, columns=['id'], transform=_fails_on_row_17)
    error = _row_17_failing(PrefetchMultiprocessIterator(
        dataset, 10, n_processes=2, shuffle=False, columnar=False,
        local_dir=str(tmp_path / 'local')))
    (named,) = error.files
    assert named.endswith('part-00000.parquet (row group 1)'), named
    assert named in str(error)


def test_columnar_is_the_default_unless_the_next_epoch_cache_is_on(shop):
    from chainer_prefetch.iterators._settings import IteratorSettings
    dataset = ParquetDataset(shop, columns=['id'])
    assert IteratorSettings(dataset, 4).columnar
    assert not IteratorSettings(dataset, 4, columnar=False).columnar
    cached = IteratorSettings(dataset, 4, next_epoch_cache_examples=8)
    assert not cached.columnar  # the cache keeps rows: the row path
    with pytest.raises(ValueError, match='next-epoch cache'):
        IteratorSettings(dataset, 4, next_epoch_cache_examples=8, columnar=True)
    with pytest.raises(ValueError, match='get_columns'):
        IteratorSettings(list(range(10)), 4, columnar=True)
