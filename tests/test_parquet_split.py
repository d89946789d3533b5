"""Row-group-aware splitting for ChainerMN, and the tabular example under ``mpiexec -n 2``."""
import json
import os
import sys

import numpy as np
import pytest

import helpers
from chainer_prefetch.datasets import ParquetDataset, assign_row_groups, scatter_row_groups
from chainer_prefetch.datasets.split import padded_sizes, split_plan
from chainer_prefetch_bench.testbed import mpi_launch
from chainer_prefetch_bench.testbed import parquet_dataset as make_parquet_dataset

EXAMPLE = os.path.join(mpi_launch.REPO, 'examples', 'parquet', 'train_tabular.py')


def test_row_groups_are_balanced_by_rows_and_deterministic():
    sizes = [100, 100, 40, 100, 100, 40, 100, 100, 40]
    assignment = assign_row_groups(sizes, 2)
    assert sorted(sum(assignment, [])) == list(range(len(sizes)))
    totals = [sum(sizes[g] for g in groups) for groups in assignment]
    assert abs(totals[0] - totals[1]) <= 40
    assert assignment == assign_row_groups(sizes, 2)
    assert all(groups == sorted(groups) for groups in assignment)
    assert assign_row_groups(sizes, 1) == [list(range(len(sizes)))]
    three = assign_row_groups([5, 1, 1, 1, 1, 1], 3)
    assert three == [[0], [1, 3, 5], [2, 4]]
    with pytest.raises(ValueError, match='too few'):
        split_plan([10, 0, 10], 3)


def test_padding_spreads_repeats_over_the_row_groups():
    assert padded_sizes([10, 0, 4], 17) == [12, 0, 5]
    assert padded_sizes([3], 3) == [3]
    with pytest.raises(ValueError):
        padded_sizes([3], 2)


class _FakeComm:
    """Rank and size for a split without MPI (the MPI run is below).

    Its broadcast gives every rank what rank 0 computes from ``sizes``.
    """

    def __init__(self, rank, size, sizes):
        self.rank, self.size, self.sizes = rank, size, sizes

    def bcast_obj(self, value, root=0):
        return split_plan(self.sizes, self.size)


@pytest.fixture(scope='module')
def shop(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp('shop'))
    # 3 files of 37 rows in row groups of 10: sizes 10, 10, 10, 7 per file.
    make_parquet_dataset.generate(directory, 111, 3, 10, image_size=8)
    return directory


def test_each_rank_gets_whole_row_groups_padded_from_its_own(shop):
    dataset = ParquetDataset(shop, columns=['id'])
    shares = []
    for rank in range(2):
        shares.append(scatter_row_groups(
            dataset, _FakeComm(rank, 2, dataset.row_group_sizes)))
    assert len(shares[0]) == len(shares[1])
    groups = [set(share.row_groups.tolist()) for share in shares]
    assert groups[0].isdisjoint(groups[1])
    assert groups[0] | groups[1] == set(range(len(dataset.row_group_sizes)))
    for share in shares:
        ids = share.get_columns(np.arange(len(share))).columns['id']
        starts = np.cumsum(dataset.row_group_sizes) - dataset.row_group_sizes
        own = np.concatenate([np.arange(starts[g], starts[g] +
                                        dataset.row_group_sizes[g])
                              for g in share.row_groups])
        # Every own row, and repeats of own rows only.
        assert set(ids.tolist()) == set(own.tolist())
        assert len(ids) - len(own) == len(share) - len(own)
        assert [share[i]['id'] for i in range(len(share))] == ids.tolist()
        # Rows sharing a row group form one item, row group by row group.
        items = share.example_file_groups()
        assert list(items) == sorted(items)
        assert len(set(share.example_files(0)) & set(share.example_files(
            len(share) - 1))) == 0
    unpadded = scatter_row_groups(
        dataset, _FakeComm(1, 2, dataset.row_group_sizes), equal_length=False)
    assert len(unpadded) == sum(int(dataset.row_group_sizes[g])
                                for g in unpadded.row_groups)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize('loaders', ['processes', 'threads', 'memory'])
def test_the_tabular_example_under_mpiexec_two_ranks(tmp_path, loaders):
    data = str(tmp_path / 'table')
    output = helpers.run_mpi(
        [sys.executable, EXAMPLE, data, '--make-data', '--rows', '6000',
         '--row-group-rows', '500'], str(tmp_path), 120)
    record = str(tmp_path / 'record')
    command = [mpi_launch.mpiexec_path(), '--oversubscribe', '--bind-to', 'none',
               '-n', '2', sys.executable, EXAMPLE, data, '--epoch', '3',
               '--batchsize', '50', '--out', str(tmp_path / 'out'),
               '--record', record] + {
                   'processes': ['--local-dir', str(tmp_path / 'local')],
                   'threads': ['--local-dir', str(tmp_path / 'local'),
                               '--loader-threads'],
                   'memory': ['--local-dir', ':memory:', '--local-capacity', '64',
                              '--loader-threads']}[loaders]
    output = helpers.run_mpi(command, str(tmp_path), 300)
    ranks = []
    for rank in range(2):
        with open(os.path.join(record, 'rank{}.json'.format(rank))) as f:
            ranks.append(json.load(f))
    groups = [set(rank['row_groups']) for rank in ranks]
    assert groups[0].isdisjoint(groups[1]), output[-3000:]
    assert len(groups[0] | groups[1]) == 12  # 4 regions x 3 row groups
    assert ranks[0]['rows_per_epoch'] == ranks[1]['rows_per_epoch'] == 3000
    # Partition keys order the files: region r holds ids 1500r..1500r+1499
    # in row groups 3r..3r+2, each of 500 rows.
    for rank in ranks:
        own = {i for g in rank['row_groups'] for i in range(500 * g, 500 * g + 500)}
        ids = rank['ids']
        assert len(ids) == 3 * 3000
        for epoch in range(3):
            seen = ids[3000 * epoch:3000 * (epoch + 1)]
            assert sorted(seen) == sorted(own), 'epoch {}'.format(epoch)
        # Each rank read only its own row groups from the files.
        assert rank['stats']['files_copied'] == len(rank['row_groups'])
    with open(str(tmp_path / 'out' / 'log')) as f:
        log = json.load(f)
    assert [entry['epoch'] for entry in log] == [1, 2, 3]
    assert log[-1]['main/accuracy'] > log[0]['main/accuracy'], log
    assert log[-1]['main/accuracy'] > 0.6, log
