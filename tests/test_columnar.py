"""Columnar batches on their own: columns, rows, the converter, the shared-memory format."""
import pickle
import subprocess
import sys

import chainer
import numpy as np
import pyarrow
import pyarrow.parquet
import pytest

from chainer_prefetch.columnar import (
    ColumnarBatch,
    ColumnConverter,
    VarColumn,
    column_of_values,
    concat_columns,
    positions,
)
from chainer_prefetch.iterators import _columnar_worker


def _batch():
    return ColumnarBatch({
        'id': np.arange(5, dtype=np.int64),
        'x': np.arange(10, dtype=np.float32).reshape(5, 2),
        'title': VarColumn.from_values(['a', 'bc', '', 'déf', 'g'], 'str'),
        'image': VarColumn.from_values([b'\x00\x01', b'', b'xyz', b'\xff', b'q'],
                                       'bytes'),
        'tokens': VarColumn.from_values([np.arange(n, dtype=np.int32)
                                         for n in (3, 0, 1, 2, 5)], 'list'),
    }, 'dict')


def test_rows_are_examples_of_the_columns():
    batch = _batch()
    assert len(batch) == 5
    row = batch[3]
    assert row['id'] == 3 and type(row['id']) is np.int64
    np.testing.assert_array_equal(row['x'], [6, 7])
    assert row['title'] == 'déf' and row['image'] == b'\xff'
    np.testing.assert_array_equal(row['tokens'], [0, 1])
    assert row['tokens'].dtype == np.int32
    assert [example['id'] for example in batch] == [0, 1, 2, 3, 4]
    assert batch[-1]['title'] == 'g'
    with pytest.raises(IndexError, match='5 rows'):
        batch[5]


def test_take_slices_and_concatenate_keep_rows():
    batch = _batch()
    taken = batch.take([4, 0, 4])
    assert [row['title'] for row in taken] == ['g', 'a', 'g']
    assert [row['image'] for row in batch[1:3]] == [b'', b'xyz']
    joined = ColumnarBatch.concatenate([batch[3:], batch[:2]])
    assert [row['id'] for row in joined] == [3, 4, 0, 1]
    assert [list(row['tokens']) for row in joined] == [[0, 1], [0, 1, 2, 3, 4],
                                                       [0, 1, 2], []]
    with pytest.raises(ValueError, match='cannot join'):
        ColumnarBatch.concatenate([batch, batch.with_columns(
            {'id': batch.columns['id']})])


@pytest.mark.parametrize('values', [
    [b'\x00\x01', b'', b'xyz' * 500, b'\xff'],
    ['a', 'bc', '', 'déf'],
    [np.arange(n, dtype=np.int32) for n in (3, 0, 1, 700)],
    [np.linspace(0, 1, n).astype('>f8') for n in (2, 0, 4, 1)],
    [np.array(row, dtype=object) for row in (['a', None], [], [{}], ['x', 5])],
])
def test_var_column_take_gives_each_row_as_it_was(values):
    kind = ('bytes' if isinstance(values[0], bytes) else
            'str' if isinstance(values[0], str) else 'list')
    column = VarColumn.from_values(values, kind)
    rows = [3, 0, 3, 1, 2]
    taken = column.take(rows)
    assert taken.values.dtype == column.values.dtype
    assert not np.shares_memory(taken.values, column.values)
    for got, row in zip(taken, rows):
        if kind == 'list':
            assert got.dtype == values[row].dtype
            assert list(got) == list(values[row])
        else:
            assert got == values[row]
    assert len(column.take([])) == 0


def test_var_columns_match_arrow_both_ways():
    batch = _batch()
    assert batch.columns['title'].to_arrow().to_pylist() == \
        ['a', 'bc', '', 'déf', 'g']
    assert batch.columns['image'].to_arrow().to_pylist() == \
        [b'\x00\x01', b'', b'xyz', b'\xff', b'q']
    tokens = batch.columns['tokens'].to_arrow()
    assert tokens.type == pyarrow.large_list(pyarrow.int32())
    assert tokens.to_pylist()[4] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match='kind'):
        VarColumn(np.zeros(1, np.int64), np.zeros(0, np.uint8), 'text')


def test_examples_become_columns():
    examples = [(np.full((2, 2), i, np.float32), i, 'w{}'.format(i),
                 np.arange(i, dtype=np.int64), {'odd': i})
                for i in range(4)]
    batch = ColumnarBatch.from_examples(examples)
    assert batch.form == 'tuple'
    image, label, word, ragged, other = batch.columns.values()
    assert image.shape == (4, 2, 2) and image.dtype == np.float32
    assert label.dtype == np.int64
    assert isinstance(word, VarColumn) and word.kind == 'str'
    assert isinstance(ragged, VarColumn) and ragged.kind == 'list'
    assert other.dtype == object
    for i, row in enumerate(batch):
        np.testing.assert_array_equal(row[0], examples[i][0])
        assert row[1] == i and row[2] == 'w{}'.format(i) and row[4] == {'odd': i}
    single = ColumnarBatch.from_examples([np.zeros(3), np.ones(3)])
    assert single.form == 'single' and single[1].tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match='same keys'):
        ColumnarBatch.from_examples([{'a': 1}, {'b': 1}])
    mixed = column_of_values([np.zeros(2), np.zeros(3, np.float32)])
    assert mixed.dtype == object  # ragged of two types: kept as objects


def test_the_converter_gives_what_concat_examples_gives():
    batch = ColumnarBatch({'x': np.arange(6, dtype=np.float32).reshape(3, 2),
                           'label': np.array([1, 0, 2], np.int32)}, 'dict')
    expected = chainer.dataset.concat_examples(list(batch))
    got = concat_columns(batch)
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])
        assert got[key].dtype == expected[key].dtype
    as_tuple = ColumnarBatch({'0': batch.columns['x'], '1': batch.columns['label']},
                             'tuple')
    x, label = concat_columns(as_tuple, None)
    np.testing.assert_array_equal(label, [1, 0, 2])
    # Any other batch goes to concat_examples, with padding.
    padded = ColumnConverter(padding=-1)([np.arange(2), np.arange(3)])
    np.testing.assert_array_equal(padded, [[0, 1, -1], [0, 1, 2]])
    assert isinstance(pickle.loads(pickle.dumps(concat_columns)), ColumnConverter)


def test_the_converter_makes_columns_of_rows_with_text():
    # Rows as the row path gives them (e.g. with the next-epoch cache):
    # concat_examples cannot stack str or bytes; the converter gives what
    # the columnar path gives for the same rows.
    rows = [{'id': i, 'title': 'w' * i, 'image': bytes([i]) * 3} for i in range(4)]
    with pytest.raises(TypeError):
        chainer.dataset.concat_examples(rows)
    got = concat_columns(rows)
    expected = ColumnarBatch.from_examples(rows).arrays()
    np.testing.assert_array_equal(got['id'], [0, 1, 2, 3])
    assert isinstance(got['title'], VarColumn) and got['title'].kind == 'str'
    assert got['title'][3] == 'www' and got['image'][2] == b'\x02' * 3
    assert sorted(got) == sorted(expected)
    # A text column whose first value is None (a null) too.
    nullable = concat_columns([{'s': None, 'n': 1}, {'s': 'x', 'n': 2}])
    assert list(nullable['s']) == [None, 'x']
    np.testing.assert_array_equal(nullable['n'], [1, 2])
    as_tuples = concat_columns([(i, 'w') for i in range(3)])
    np.testing.assert_array_equal(as_tuples[0], [0, 1, 2])
    assert list(as_tuples[1]) == ['w', 'w', 'w']
    # Without text, still concat_examples (a plain list of arrays too).
    np.testing.assert_array_equal(concat_columns([np.arange(2), np.arange(2)]),
                                  [[0, 1], [0, 1]])
    # 1-D arrays of different lengths, which concat_examples cannot stack
    # either: a list column, as the columnar path gives it.
    ragged = [{'n': i, 'tokens': np.arange(i, dtype=np.int32)} for i in range(3)]
    with pytest.raises(ValueError):
        chainer.dataset.concat_examples(ragged)
    got = concat_columns(ragged)
    assert isinstance(got['tokens'], VarColumn) and got['tokens'].kind == 'list'
    assert [list(value) for value in got['tokens']] == [[], [0], [0, 1]]
    # Empty rows all: a 2-D array of width 0, as concat_examples gives.
    empty = ColumnarBatch({'t': VarColumn.from_values(
        [np.zeros(0, np.int32)] * 2, 'list')}, 'single')
    assert concat_columns(empty).shape == (2, 0)
    # Offsets that start past the values' first (a column cut out of a
    # longer one), stacked and padded.
    cut = VarColumn(np.array([2, 4, 6], np.int64), np.arange(8, dtype=np.int16), 'list')
    stacked = concat_columns(ColumnarBatch({'t': cut}, 'single'))
    np.testing.assert_array_equal(stacked, [[2, 3], [4, 5]])
    assert stacked.dtype == np.int16
    ragged_cut = VarColumn(np.array([2, 3, 6], np.int64), np.arange(8), 'list')
    np.testing.assert_array_equal(
        ColumnConverter(padding=-1)(ColumnarBatch({'t': ragged_cut}, 'single')),
        [[2, -1, -1], [3, 4, 5]])
    # Dict fields are matched by key, whatever their order in each example.
    reordered = [{'a': np.arange(2), 'b': np.arange(3)},
                 {'b': np.arange(2), 'a': np.arange(3)}]
    got = concat_columns(reordered)
    assert [list(value) for value in got['a']] == [[0, 1], [0, 1, 2]]
    assert [list(value) for value in got['b']] == [[0, 1, 2], [0, 1]]


def test_the_converter_with_padding_gives_rows_and_columns_alike():
    rows = [{'s': 'ab', 't': np.arange(i + 1, dtype=np.int32)} for i in range(3)]
    converter = ColumnConverter(padding=-1)
    from_rows = converter(rows)
    from_columns = converter(ColumnarBatch.from_examples(rows))
    expected = [[0, -1, -1], [0, 1, -1], [0, 1, 2]]
    for got in (from_rows, from_columns):
        np.testing.assert_array_equal(got['t'], expected)
        assert got['t'].dtype == np.int32
        assert isinstance(got['s'], VarColumn) and list(got['s']) == ['ab'] * 3
    # Without text, concat_examples pads, also arrays of more dimensions.
    images = [np.zeros((1, 2)), np.ones((2, 1))]
    np.testing.assert_array_equal(converter(images),
                                  chainer.dataset.concat_examples(images, padding=-1))


def test_columns_cross_a_shared_buffer_and_come_back_equal():
    batch = _batch()
    objects = np.empty(5, dtype=object)
    objects[:] = [{'k': i} for i in range(5)]
    batch = batch.with_columns(dict(batch.columns, extra=objects))
    memory = np.zeros(_columnar_worker.packed_bytes(batch), np.uint8)
    packed, unfit = _columnar_worker.pack_columns(batch, memory)
    assert unfit == 0
    packed = pickle.loads(pickle.dumps(packed))  # what crosses the pipe
    assert pickle.dumps(packed).__len__() < 2000  # a few small objects
    for copy in (False, True):
        back = _columnar_worker.unpack_columns(packed, memory, copy=copy)
        for row, expected in zip(back, batch):
            for key in expected:
                np.testing.assert_array_equal(np.asarray(row[key], dtype=object),
                                              np.asarray(expected[key], dtype=object))
        shares = np.shares_memory(back.columns['x'], memory)
        assert shares != copy


def test_columns_that_do_not_fit_are_left_to_pickling():
    batch = _batch()
    small = np.zeros(64, np.uint8)
    packed, unfit = _columnar_worker.pack_columns(batch, small)
    assert packed is batch
    assert unfit * len(batch) >= _columnar_worker.packed_bytes(batch)
    assert not small.any()  # nothing written


@pytest.mark.parametrize('data_type', [
    pyarrow.int8(), pyarrow.uint16(), pyarrow.int32(), pyarrow.int64(),
    pyarrow.uint64(), pyarrow.float16(), pyarrow.float32(), pyarrow.float64()])
def test_numeric_arrow_columns_equal_arrows_own_numpy_view(data_type):
    """Sliced, chunked and empty arrays give what ``to_numpy`` gives."""
    from chainer_prefetch.datasets.arrow_columns import column_of_array
    whole = pyarrow.array(np.arange(10).astype(data_type.to_pandas_dtype()))
    for array in (whole, whole.slice(3, 5), whole.slice(0, 0),
                  pyarrow.chunked_array([whole.slice(2, 3), whole])):
        column = column_of_array(array)
        expected = (array.to_numpy() if isinstance(array, pyarrow.Array)
                    else array.combine_chunks().to_numpy())
        assert column.dtype == expected.dtype
        np.testing.assert_array_equal(column, expected)


def test_a_loader_reading_columns_imports_no_pandas(tmp_path):
    """Importing pandas cost 0.25 s in every loader process; reading needs none of it.

    Rows and batches, numbers with nulls (an ``object`` column) and
    booleans (packed bits) included.
    """
    path = str(tmp_path / 'part.parquet')
    pyarrow.parquet.write_table(pyarrow.table({
        'x': np.arange(10), 'y': np.arange(10, dtype=np.float32),
        's': [str(i) for i in range(10)],
        'n': pyarrow.array([None] + list(range(1, 10)), pyarrow.int16()),
        'b': np.arange(10) % 3 == 0}), path, row_group_size=4)
    script = ('import sys\n'
              'from chainer_prefetch.datasets import ParquetDataset\n'
              'dataset = ParquetDataset(sys.argv[1])\n'
              'batch = dataset.get_columns([9, 0, 5])\n'
              'print(batch[0], batch[1]["n"], dataset[0]["y"], "pandas" in sys.modules)\n')
    result = subprocess.run([sys.executable, '-c', script, path],
                            stdout=subprocess.PIPE, universal_newlines=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == (
        "{'x': 9, 'y': 9.0, 's': '9', 'n': 9, 'b': True} None 0.0 False")


def test_positions_are_a_read_only_range_that_grows_as_asked():
    small = positions(5)
    assert small.dtype == np.int64 and small.tolist() == [0, 1, 2, 3, 4]
    large = positions(100000)
    assert np.array_equal(large, np.arange(100000))
    assert small.tolist() == [0, 1, 2, 3, 4]  # earlier ranges stay as they were
    assert len(positions(0)) == 0
    with pytest.raises(ValueError):
        large[3] = 7  # shared by every caller: nobody may write into it
