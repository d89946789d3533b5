"""Hive/Spark partition columns (``key=value`` directories) as typed columns."""
import os

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest

from chainer_prefetch import PrefetchMultiprocessIterator
from chainer_prefetch.columnar import VarColumn, concat_columns
from chainer_prefetch.datasets import (
    ParquetDataset,
    ParquetSchemaError,
    RowGroupWindowOrderSampler,
)


def _write(root, relative, ids, extra=None):
    columns = {'id': pyarrow.array(ids, pyarrow.int64()),
               'value': pyarrow.array([float(i) / 2 for i in ids],
                                      pyarrow.float32())}
    columns.update(extra or {})
    path = os.path.join(str(root), relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pyarrow.parquet.write_table(pyarrow.table(columns), path, row_group_size=2)
    return path


@pytest.fixture
def table(tmp_path):
    root = tmp_path / 'table'
    _write(root, 'year=2020/country=KR/part-0.parquet', [0, 1, 2])
    _write(root, 'year=2020/country=US%2FCA/part-0.parquet', [3, 4])
    _write(root, 'year=2021/country=KR/part-0.parquet', [5, 6, 7])
    _write(root, 'year=2021/country=__HIVE_DEFAULT_PARTITION__/part-0.parquet',
           [8])
    (root / '_SUCCESS').write_bytes(b'')
    return str(root)


def test_partition_keys_become_typed_columns(table):
    dataset = ParquetDataset(table)
    assert dataset.columns == ('id', 'value', 'year', 'country')
    assert dataset.column_types['year'] == pyarrow.int64()
    assert dataset.column_types['country'] == pyarrow.string()
    by_id = {dataset[i]['id']: dataset[i] for i in range(len(dataset))}
    assert by_id[0]['year'] == 2020 and by_id[0]['country'] == 'KR'
    assert by_id[4]['country'] == 'US/CA'  # Hive's %XX escape
    assert by_id[6]['year'] == 2021
    assert by_id[8]['country'] is None  # Hive's null partition
    assert type(by_id[6]['year']) is np.int64  # the column's dtype


def test_partition_columns_in_batches_and_selections(table):
    dataset = ParquetDataset(table, columns=['year', 'id'], as_tuple=True)
    batch = dataset.get_columns(np.arange(len(dataset))[::-1])
    years = batch.columns['year']
    assert isinstance(years, np.ndarray) and years.dtype == np.int64
    for row, index in zip(batch, range(len(dataset) - 1, -1, -1)):
        assert row == dataset[index]
    countries = ParquetDataset(table, columns=['country']).get_columns([0, 3, 8])
    column = countries.columns['country']
    assert not isinstance(column, VarColumn)  # a null: kept as objects
    assert [row['country'] for row in countries] == ['KR', 'US/CA', None]
    plain = ParquetDataset(table, columns=['country']).get_columns([0, 3])
    assert isinstance(plain.columns['country'], VarColumn)
    assert ParquetDataset(table, partitioning=None).columns == ('id', 'value')


def test_types_can_be_given_and_a_bad_value_is_named(table):
    dataset = ParquetDataset(table, partition_types={'year': pyarrow.int16()})
    assert dataset.column_types['year'] == pyarrow.int16()
    assert dataset[0]['year'] in (2020, 2021)
    with pytest.raises(ParquetSchemaError, match="country='KR'.*is not of type int64"):
        ParquetDataset(table, partition_types={'country': pyarrow.int64()})
    with pytest.raises(ParquetSchemaError, match='types given for month'):
        ParquetDataset(table, partition_types={'month': pyarrow.int8()})
    floats = os.path.join(os.path.dirname(table), 'floats')
    _write(floats, 'score=0.5/part-0.parquet', [0])
    _write(floats, 'score=2/part-0.parquet', [1])
    assert ParquetDataset(floats).column_types['score'] == pyarrow.float64()


def test_schema_drift_across_partitions_names_both_files(table):
    drifted = _write(table, 'year=2022/country=KR/part-0.parquet', [9],
                     extra={'colour': pyarrow.array(['red'])})
    with pytest.raises(ParquetSchemaError) as raised:
        ParquetDataset(table)
    message = str(raised.value)
    assert drifted in message
    assert os.path.join(table, 'year=2020', 'country=KR', 'part-0.parquet') in message
    assert 'colour' in message


@pytest.mark.timeout(120)
def test_only_the_columns_selected_must_agree_across_files(table, tmp_path):
    # Schema evolution: a later partition has one more column, and another
    # column of another type; the columns every file has alike are read.
    later = _write(table, 'year=2022/country=KR/part-0.parquet', [9, 10], extra={
        'colour': pyarrow.array(['red', 'blue'])})
    other = os.path.join(table, 'year=2022', 'country=US', 'part-0.parquet')
    os.makedirs(os.path.dirname(other))
    pyarrow.parquet.write_table(pyarrow.table({
        'id': pyarrow.array([11], pyarrow.int64()),
        'value': pyarrow.array([5.5], pyarrow.float64())}), other)
    with pytest.raises(ParquetSchemaError, match='select them with columns='):
        ParquetDataset(table)
    dataset = ParquetDataset(table, columns=['id', 'year'])
    assert sorted(dataset[i]['id'] for i in range(len(dataset))) == list(range(12))
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=2)
    iterator = PrefetchMultiprocessIterator(
        dataset, 4, n_processes=1, order_sampler=sampler, repeat=False,
        local_dir=str(tmp_path / 'local'))
    try:
        ids = [int(i) for batch in iterator for i in concat_columns(batch)['id']]
    finally:
        iterator.finalize()
    assert sorted(ids) == list(range(12))
    # A selected column of another type in one file is named with both files.
    with pytest.raises(ParquetSchemaError) as raised:
        ParquetDataset(table, columns=['id', 'value'])
    message = str(raised.value)
    assert 'value: float' in message and 'value: double' in message
    assert other in message
    # A selected column that the first file has and another lacks.
    with pytest.raises(ParquetSchemaError, match='colour: missing') as raised:
        ParquetDataset([later, other], columns=['colour'])
    assert other in str(raised.value)


def test_partition_directories_that_differ_are_named(table):
    odd = _write(table, 'year=2022/part-0.parquet', [9])
    with pytest.raises(ParquetSchemaError, match='partition directories differ') \
            as raised:
        ParquetDataset(table)
    assert odd in str(raised.value)
    assert 'year=.../country=...' in str(raised.value)


def test_the_base_of_the_partitions_is_the_directory_given_or_partition_base(table):
    # Files of one partition only, found by a glob: their deepest common
    # directory is year=2021, so year is not a column, as Spark reading
    # that directory gives; partition_base (Spark's basePath) keeps it.
    one_year = os.path.join(table, 'year=2021', '*', '*.parquet')
    assert ParquetDataset(one_year).columns == ('id', 'value', 'country')
    dataset = ParquetDataset(one_year, partition_base=table)
    assert dataset.columns == ('id', 'value', 'year', 'country')
    assert sorted({dataset[i]['year'] for i in range(len(dataset))}) == [2021]
    assert ParquetDataset(os.path.join(table, 'year=2021')).columns == (
        'id', 'value', 'country')
    # A glob across partitions reaches down from their common directory.
    both = ParquetDataset(os.path.join(table, '*', 'country=KR', '*.parquet'))
    assert both.columns == ('id', 'value', 'year', 'country')
    with pytest.raises(ValueError, match='partition_base .* does not hold .*'
                       'year=2021'):
        ParquetDataset(one_year, partition_base=os.path.join(table, 'year=2020'))
    with pytest.raises(ValueError, match='is not a directory'):
        ParquetDataset(one_year, partition_base=os.path.join(table, 'nowhere'))
    with pytest.raises(ValueError, match='partitioning is None'):
        ParquetDataset(one_year, partition_base=table, partitioning=None)
    # The base may be spelled otherwise than the files' paths (a link).
    link = table + '-link'
    os.symlink(table, link)
    linked = ParquetDataset(os.path.join(link, 'year=2021', '*', '*.parquet'),
                            partition_base=table)
    assert linked.columns == ('id', 'value', 'year', 'country')
    assert [linked[i]['year'] for i in range(len(linked))] == [2021] * len(linked)


def test_a_partition_named_like_a_column_is_refused(tmp_path):
    root = tmp_path / 'clash'
    _write(root, 'id=1/part-0.parquet', [0, 1])
    with pytest.raises(ParquetSchemaError, match='partition column id is also'):
        ParquetDataset(str(root))
    assert len(ParquetDataset(str(root), partitioning=None)) == 2
