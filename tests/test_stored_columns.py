"""StoredColumns: rows taken from tables of one or more record batches.

Every kind of column (numbers, small and large strings and bytes, lists,
nulls, dictionaries, timestamps) must come out as ``columns_of_table`` makes
it from Arrow's own ``take`` of the joined table.
"""
import datetime

import numpy as np
import pyarrow
import pytest

from chainer_prefetch import columnar
from chainer_prefetch.columnar import VarColumn
from chainer_prefetch.datasets import arrow_columns
from chainer_prefetch.datasets.arrow_columns import StoredColumns, columns_of_table

ROWS = 50


def _table():
    rng = np.random.default_rng(0)
    large = [bytes(rng.integers(0, 256, size=int(n), dtype=np.uint8))
             for n in rng.integers(300, 900, size=ROWS)]
    return pyarrow.table({
        'id': pyarrow.array(np.arange(ROWS, dtype=np.int64)),
        'price': pyarrow.array(rng.random(ROWS).astype(np.float32)),
        'flag': pyarrow.array([i % 3 == 0 for i in range(ROWS)]),
        'title': pyarrow.array(['title {}'.format(i) for i in range(ROWS)]),
        'image': pyarrow.array(large, pyarrow.binary()),
        'caption': pyarrow.array(['word ' * (60 + i) for i in range(ROWS)],
                                 pyarrow.large_string()),
        'tokens': pyarrow.array([list(range(i % 7)) for i in range(ROWS)],
                                pyarrow.list_(pyarrow.int32())),
        # short values of other widths, some of them empty
        'code': pyarrow.array([bytes([i % 256]) * (i % 3) for i in range(ROWS)],
                              pyarrow.binary()),
        'note': pyarrow.array(['' if i % 4 == 0 else 'n{}'.format(i)
                               for i in range(ROWS)]),
        'levels': pyarrow.array([list(range(-(i % 5), 0)) for i in range(ROWS)],
                                pyarrow.list_(pyarrow.int8())),
        'weights': pyarrow.array([[0.5 * j for j in range(i % 3)]
                                  for i in range(ROWS)],
                                 pyarrow.list_(pyarrow.float64())),
        'mask': pyarrow.array([[j % 2 == 0 for j in range(i % 4)]
                               for i in range(ROWS)],
                              pyarrow.list_(pyarrow.bool_())),
        'embedding': pyarrow.array(
            [rng.random(100).astype(np.float32) for _ in range(ROWS)],
            pyarrow.list_(pyarrow.float32())),
        'maybe': pyarrow.array([None if i % 5 == 0 else 'm{}'.format(i)
                                for i in range(ROWS)]),
        'brand': pyarrow.array(['b{}'.format(i % 4) for i in range(ROWS)]
                               ).dictionary_encode(),
        'when': pyarrow.array([datetime.datetime(2020, 1, 1 + i % 28)
                               for i in range(ROWS)], pyarrow.timestamp('s')),
    })


def _in_batches(table, rows_per_batch):
    return pyarrow.Table.from_batches(table.to_batches(rows_per_batch))


def _assert_same_column(got, expected):
    if isinstance(expected, VarColumn):
        assert isinstance(got, VarColumn) and got.kind == expected.kind
        np.testing.assert_array_equal(got.offsets, expected.offsets)
        np.testing.assert_array_equal(got.values, expected.values)
        assert got.values.dtype == expected.values.dtype
        assert got.values.flags.writeable  # a copy, the batch's own
    else:
        assert isinstance(got, np.ndarray) and got.dtype == expected.dtype
        assert got.shape == expected.shape
        for got_value, expected_value in zip(got, expected):
            assert type(got_value) is type(expected_value)
            if isinstance(expected_value, np.ndarray):
                np.testing.assert_array_equal(got_value, expected_value)
            else:
                assert got_value == expected_value


@pytest.mark.parametrize('take_rows', ['compiled', 'python'])
@pytest.mark.parametrize('rows_per_batch', [ROWS, 7, 1])
def test_rows_taken_equal_arrows_take_of_the_joined_table(rows_per_batch, take_rows,
                                                          monkeypatch):
    if take_rows == 'python':  # what StoredRows does where nothing was compiled
        monkeypatch.setattr(columnar, 'TAKE_ROWS', columnar.take_rows_python)
    table = _table()
    stored = StoredColumns(_in_batches(table, rows_per_batch), table.column_names)
    rng = np.random.default_rng(1)
    for rows in ([3], [49, 0, 7, 7, 21, 13], rng.integers(0, ROWS, size=100),
                 rng.permutation(ROWS)):
        rows = np.asarray(rows)
        got = stored.take(rows)
        expected = columns_of_table(table.take(pyarrow.array(rows)),
                                    table.column_names)
        assert list(got) == table.column_names
        for name in table.column_names:
            _assert_same_column(got[name], expected[name])


def test_large_values_stay_in_the_table_and_small_ones_are_joined():
    table = _in_batches(_table(), 7)
    stored = StoredColumns(table, ['title', 'image', 'caption', 'tokens',
                                   'embedding', 'maybe', 'id', 'code', 'levels',
                                   'weights', 'mask'])
    kinds = {name: _kind(column) for name, column in stored._columns.items()}
    assert kinds == {'title': 'joined', 'image': 'in 8 batches',
                     'caption': 'in 8 batches', 'tokens': 'joined',
                     'embedding': 'in 8 batches', 'maybe': '_ArrowColumn',
                     'id': 'ndarray', 'code': 'joined',
                     'levels': 'joined', 'weights': 'joined',
                     'mask': 'joined'}
    # A value taken from the table is a copy: the table can go.
    image = stored.take([3, 10]).get('image')
    start = image.values.ctypes.data
    for chunk in table.column('image').chunks:
        for buffer in chunk.buffers():
            if buffer is not None:
                assert not buffer.address <= start < buffer.address + buffer.size
    assert bytes(image[1]) == table.column('image')[10].as_py()


def _kind(column) -> str:
    """How StoredColumns keeps a column: 'joined' (one array of values),
    'in N batches' (left in the table's record batches), or the class."""
    if type(column).__name__ == '_VarValues':
        return ('joined' if column.n_sources == 1
                else 'in {} batches'.format(column.n_sources))
    return type(column).__name__


def test_the_threshold_between_large_and_small_values(monkeypatch):
    table = _in_batches(_table(), 7)
    monkeypatch.setattr(arrow_columns, 'LARGE_VALUE_BYTES', 10**6)
    joined = StoredColumns(table, ['image'])
    monkeypatch.setattr(arrow_columns, 'LARGE_VALUE_BYTES', 1)
    kept = StoredColumns(table, ['title'])
    assert _kind(joined._columns['image']) == 'joined'
    assert _kind(kept._columns['title']) == 'in 8 batches'
    rows = np.array([40, 2, 2, 33])
    expected = columns_of_table(_table().take(pyarrow.array(rows)),
                                ['image', 'title'])
    _assert_same_column(joined.take(rows)['image'], expected['image'])
    _assert_same_column(kept.take(rows)['title'], expected['title'])


def test_a_column_with_nulls_in_some_record_batches_only():
    values = ['v{}'.format(i) for i in range(20)]
    values[15] = None  # in the third batch of 7 rows only
    table = _in_batches(pyarrow.table({'text': values}), 7)
    stored = StoredColumns(table, ['text'])
    got = stored.take([15, 0, 8])['text']
    assert got.dtype == object and list(got) == [None, 'v0', 'v8']
