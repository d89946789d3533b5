#!/usr/bin/env python3
"""Data-parallel training on a Hive-partitioned Parquet table with ChainerMN.

What it shows, end to end:

* a table written as Spark/Hive does, ``DATA/region=<r>/part-*.parquet``,
  whose ``region`` partition column is read back as a typed (int64) column;
* ``scatter_row_groups``: each rank gets whole row groups, balanced by rows,
  so each reads only its own share of the files;
* columnar batches: ``PrefetchMultiprocessIterator`` loads a whole batch per
  task with ``ParquetDataset.get_columns``, a vectorised ``batch_transform``
  turns the columns into features, and ``concat_columns`` hands them to the
  model without per-row work;
* every row of a rank's share once per epoch
  (``RowGroupWindowOrderSampler``).

The table is synthetic and learnable: 8 features per row and a label that
depends on the features and on the region.  Make it, then train::

    python examples/parquet/train_tabular.py DATA --make-data --rows 40000
    mpiexec -n 2 python examples/parquet/train_tabular.py DATA --epoch 3 \\
        --local-dir /tmp/tabular-local --out /tmp/tabular-out

``--loader-threads`` cuts the batches on threads of each rank instead of in
loader processes; with it, ``--local-dir :memory: --local-capacity 256``
keeps each rank's row groups decoded in memory (256 MB at most) instead
of in local files.

``--record DIR`` writes, per rank, the row groups it was given and the ``id``
of every row it trained on (the tests check the split with it).
"""
import argparse
import json
import os
import sys

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy
from chainer import training
from chainer.training import extensions

import chainer_prefetch
from chainer_prefetch.columnar import ColumnarBatch, concat_columns
from chainer_prefetch.datasets import (
    ParquetDataset,
    RowGroupWindowOrderSampler,
    scatter_row_groups,
)

N_FEATURES = 8
N_REGIONS = 4
N_CLASSES = 3


def make_data(directory: str, rows: int, row_group_rows: int, seed: int = 0):
    """Writes the table: ``region=<r>/part-00000.parquet`` for each region.

    Columns in the files: ``id`` (int64), ``x`` (list<float32> of 8),
    ``label`` (int32); the region is in the directory names only.
    """
    import pyarrow
    import pyarrow.parquet
    random = numpy.random.RandomState(seed)
    weights = random.normal(size=(N_REGIONS, N_FEATURES, N_CLASSES))
    bounds = numpy.linspace(0, rows, N_REGIONS + 1).astype(numpy.int64)
    for region in range(N_REGIONS):
        first, last = int(bounds[region]), int(bounds[region + 1])
        x = random.normal(size=(last - first, N_FEATURES)).astype(numpy.float32)
        label = (x @ weights[region]).argmax(axis=1).astype(numpy.int32)
        table = pyarrow.table({
            'id': numpy.arange(first, last, dtype=numpy.int64),
            'x': pyarrow.FixedSizeListArray.from_arrays(
                x.reshape(-1), N_FEATURES).cast(pyarrow.list_(pyarrow.float32())),
            'label': label})
        folder = os.path.join(directory, 'region={}'.format(region))
        os.makedirs(folder, exist_ok=True)
        pyarrow.parquet.write_table(table, os.path.join(folder, 'part-00000.parquet'),
                                    row_group_size=row_group_rows)


def to_features(batch: ColumnarBatch):
    """The batch transform, vectorised: features, region one-hot, label, id."""
    x = batch.columns['x'].values.reshape(len(batch), N_FEATURES)
    region = numpy.eye(N_REGIONS, dtype=numpy.float32)[batch.columns['region']]
    features = numpy.concatenate([x, region], axis=1)
    return {'features': features, 'label': batch.columns['label'],
            'id': batch.columns['id']}


class TabularClassifier(chainer.Chain):
    """A two-layer perceptron; the row ids pass by unused."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.hidden = L.Linear(N_FEATURES + N_REGIONS, 64)
            self.out = L.Linear(64, N_REGIONS * N_CLASSES)

    def forward(self, features, label, id):
        scores = self.out(F.relu(self.hidden(features)))
        # One head per region would be the "right" model; a wide output
        # layer folded by region keeps the example short.
        scores = F.reshape(scores, (-1, N_REGIONS, N_CLASSES))
        region = self.xp.argmax(chainer.as_array(features)[:, N_FEATURES:], axis=1)
        scores = scores[self.xp.arange(len(region)), region]
        loss = F.softmax_cross_entropy(scores, label)
        chainer.report({'loss': loss, 'accuracy': F.accuracy(scores, label)}, self)
        return loss


class RecordingConverter(chainer.dataset.Converter):
    """``concat_columns`` that also keeps the ids of every batch it converts."""

    def __init__(self):
        self.ids = []

    def __call__(self, batch, device=None):
        arrays = concat_columns(batch, device)
        self.ids.append(numpy.asarray(arrays['id']).copy())
        return arrays


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('data', help='the table directory')
    parser.add_argument('--make-data', action='store_true',
                        help='write the synthetic table into DATA and exit')
    parser.add_argument('--rows', type=int, default=40000)
    parser.add_argument('--row-group-rows', type=int, default=2500)
    parser.add_argument('--batchsize', type=int, default=100)
    parser.add_argument('--epoch', type=int, default=3)
    parser.add_argument('--loaderjob', type=int, default=1)
    parser.add_argument('--loader-threads', action='store_true',
                        help='load batches on --loaderjob threads of each '
                        'rank instead of worker processes')
    parser.add_argument('--window', type=int, default=2,
                        help='row groups shuffled together')
    parser.add_argument('--local-dir', default=None,
                        help='node-local directory for row groups, or :memory: '
                        'with --loader-threads (default: read the files '
                        'directly)')
    parser.add_argument('--local-capacity', type=float, default=None,
                        help='MB of row groups each rank keeps locally '
                        '(required with --local-dir :memory:; default: no '
                        'limit)')
    parser.add_argument('--out', default='result-tabular')
    parser.add_argument('--record', default=None,
                        help='write each rank\'s row groups and ids here')
    parser.add_argument('--seed', type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.make_data:
        make_data(args.data, args.rows, args.row_group_rows, args.seed)
        print('wrote {} rows in {} files under {} (region=<r>/part-00000.parquet, '
              'row groups of {} rows)'.format(args.rows, N_REGIONS, args.data,
                                              args.row_group_rows))
        return 0
    comm = chainermn.create_communicator('naive')
    dataset = ParquetDataset(args.data, columns=['id', 'x', 'label', 'region'],
                             batch_transform=to_features,
                             cache_row_groups=2 * args.window)
    train = scatter_row_groups(dataset, comm)
    if comm.rank == 0:
        print('rows: {}, row groups: {}, columns: {}'.format(
            len(dataset), len(dataset.row_group_sizes), dataset.column_types))
    print('rank {}: row groups {}, {} rows'.format(
        comm.rank, train.row_groups.tolist(), len(train)), flush=True)
    sampler = RowGroupWindowOrderSampler(train.row_group_sizes,
                                         window=args.window,
                                         seed=args.seed + comm.rank)
    train_iter = chainer_prefetch.PrefetchMultiprocessIterator(
        train, args.batchsize, n_processes=args.loaderjob,
        order_sampler=sampler, local_dir=args.local_dir,
        local_capacity=(None if args.local_capacity is None
                        else int(args.local_capacity * 2**20)),
        loader_threads=args.loader_threads)
    model = TabularClassifier()
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.Adam(alpha=0.01), comm)
    optimizer.setup(model)
    converter = RecordingConverter()
    updater = training.updaters.StandardUpdater(train_iter, optimizer,
                                                converter=converter)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), args.out)
    if comm.rank == 0:
        trainer.extend(extensions.LogReport())
        trainer.extend(extensions.PrintReport(
            ['epoch', 'main/loss', 'main/accuracy', 'elapsed_time']))
    try:
        trainer.run()
    finally:
        train_iter.finalize()
    if args.record:
        os.makedirs(args.record, exist_ok=True)
        ids = numpy.concatenate(converter.ids) if converter.ids else []
        with open(os.path.join(args.record, 'rank{}.json'.format(comm.rank)),
                  'w') as f:
            json.dump({'row_groups': train.row_groups.tolist(),
                       'rows_per_epoch': len(train),
                       'ids': [int(i) for i in ids],
                       'stats': {key: value for key, value
                                 in train_iter.stats.items()
                                 if isinstance(value, (int, float))}}, f)
    return 0


if __name__ == '__main__':
    sys.exit(main())
