"""A member's training iterator that follows the job's epoch plan.

:class:`PlannedIterator` wraps the iterator a user builds over one shard
(Chainer's ``SerialIterator`` or ``MultiprocessIterator``, or
:class:`~chainer_prefetch.PrefetchMultiprocessIterator`) and rebuilds it when
the group changes (:meth:`PlannedIterator.follow`), so that the updater keeps
one iterator object through every change.

Its snapshot is the job's, not the member's: :meth:`PlannedIterator.
serialize` writes which examples of the current epoch the whole group has
consumed, and reading a snapshot re-plans the rest of the epoch for the
group that reads it, at the same or another size.  So Chainer's usual
``extensions.snapshot`` on rank 0 and ``chainer.serializers.load_npz(path,
trainer)`` on every rank resume every example exactly once.
"""
from typing import Any, Callable, Dict, Optional

import chainer
import numpy
from chainer.serializers import DictionarySerializer, NpzDeserializer

from chainer_prefetch.policy.epoch_plan import EpochPlan, RankOrderSampler, plan_rest, start_plan

ShardIteratorFactory = Callable[[Any, RankOrderSampler], Any]
"""``factory(shard_dataset, order_sampler) -> iterator`` over one shard
(``repeat=True``, drawing its orders with ``order_sampler``)."""

SNAPSHOT_KEYS = ('n_examples', 'seed', 'size', 'iteration', 'epoch',
                 'consumed')


def subset(dataset, indices: numpy.ndarray):
    """``dataset[indices]`` as a ``SubDataset`` (which the prefetching
    iterator sees through); ``indices`` may repeat."""
    order = numpy.zeros(len(dataset), dtype=numpy.int64)
    order[:len(indices)] = indices
    return chainer.datasets.SubDataset(dataset, 0, len(indices), order)


def serialized(target) -> Dict[str, numpy.ndarray]:
    """The state of a link, optimizer or iterator as a dict of arrays."""
    serializer = DictionarySerializer()
    target.serialize(serializer)
    return serializer.target


class PlannedIterator(chainer.dataset.Iterator):
    """The training iterator of one member of a data-parallel group.

    Args:
        dataset: The whole training dataset (every member holds it).
        make_iterator: Builds the iterator over a shard with an order
            sampler (:data:`ShardIteratorFactory`).
        plan: The job's :class:`~chainer_prefetch.policy.epoch_plan.
            EpochPlan`.
        rank: This member's rank in the plan's group.
        iteration: The updater's iteration to start at (default: the
            plan's start).
    """

    def __init__(self, dataset, make_iterator: ShardIteratorFactory,
                 plan: EpochPlan, rank: int,
                 iteration: Optional[int] = None):
        self.iterator = None
        if len(dataset) != plan.n_examples:
            raise ValueError('the plan is of {} examples, the dataset has {}'
                             .format(plan.n_examples, len(dataset)))
        self.dataset = dataset
        self.make_iterator = make_iterator
        self.follow(plan, rank, iteration)

    @classmethod
    def start(cls, dataset, make_iterator: ShardIteratorFactory,
              batch_size: int, size: int, rank: int,
              seed: Optional[int] = 0,
              shuffle: bool = True) -> 'PlannedIterator':
        """The iterator of ``rank`` in a group of ``size`` at the start of a
        job: the shards of ``chainermn.scatter_dataset(dataset, shuffle=
        shuffle, seed=seed, force_equal_length=True)``.

        Args:
            dataset: The whole training dataset.
            make_iterator: See the class.
            batch_size: Examples per member per update.
            size: Members of the group.
            rank: This member's rank.
            seed: Seed of the split and of the orders (None: no shuffle,
                orders seeded with 0).
            shuffle: Shuffle before splitting.
        """
        return cls(dataset, make_iterator,
                   start_plan(len(dataset), size, seed, batch_size, shuffle),
                   rank)

    def follow(self, plan: EpochPlan, rank: int,
               iteration: Optional[int] = None) -> None:
        """Trains as member ``rank`` of ``plan`` from ``iteration`` on (the
        iterator over the shard is built anew; the old one is finalized).

        Args:
            plan: The plan.
            rank: This member's rank in the plan's group.
            iteration: The updater's iteration (default: the plan's start).
        """
        if not 0 <= rank < plan.size:
            raise ValueError('rank {} outside a group of {}'.format(
                rank, plan.size))
        iteration = plan.iteration if iteration is None else iteration
        epoch, position = plan.where(iteration)
        iterator = self.make_iterator(
            subset(self.dataset, plan.shards[rank]),
            RankOrderSampler(plan.seed, rank))
        if iterator.batch_size != plan.batch_size:
            raise ValueError('the iterator takes batches of {}, the plan of '
                             '{}'.format(iterator.batch_size, plan.batch_size))
        state = dict(order=plan.order_of(rank, epoch),
                     current_position=position, epoch=epoch,
                     is_new_epoch=False,
                     previous_epoch_detail=epoch + position / plan.length)
        iterator.serialize(NpzDeserializer(
            {key: numpy.asarray(value) for key, value in state.items()},
            strict=False))
        old, self.iterator = self.iterator, iterator
        self.plan, self.rank, self.iteration = plan, rank, iteration
        if old is not None:
            old.finalize()

    # ---- the iterator protocol ------------------------------------------

    def __next__(self):
        batch = self.iterator.next()
        self.iteration += 1
        return batch

    next = __next__

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def epoch(self) -> int:
        return self.iterator.epoch

    @property
    def epoch_detail(self) -> float:
        return self.iterator.epoch_detail

    @property
    def previous_epoch_detail(self) -> Optional[float]:
        return self.iterator.previous_epoch_detail

    @property
    def is_new_epoch(self) -> bool:
        return self.iterator.is_new_epoch

    @property
    def current_position(self) -> int:
        return self.iterator.current_position

    @property
    def repeat(self) -> bool:
        return True

    def __getattr__(self, name):
        # Anything else (``stats``, ``n_processes``...) is the shard
        # iterator's.
        if name == 'iterator':
            raise AttributeError(name)
        return getattr(self.iterator, name)

    def reset(self) -> None:
        """Goes back to the start of the plan it follows."""
        self.follow(self.plan, self.rank)

    def finalize(self) -> None:
        if self.iterator is not None:
            self.iterator.finalize()

    # ---- snapshots --------------------------------------------------------

    def serialize(self, serializer) -> None:
        """Writes the group's progress in the epoch (which examples every
        member has consumed), or reads it and re-plans the rest of the epoch
        for this group (of any size).

        Raises:
            ValueError: the snapshot is of another dataset, holds no plan
                (written by another iterator), or cannot be split over this
                group; the message names both sizes.
        """
        if not isinstance(serializer, chainer.serializer.Deserializer):
            epoch, consumed = self.plan.consumed(self.iteration)
            serializer('n_examples', self.plan.n_examples)
            serializer('seed', self.plan.seed)
            serializer('size', self.plan.size)
            serializer('iteration', self.iteration)
            serializer('epoch', epoch)
            serializer('consumed', numpy.packbits(consumed))
            return
        try:
            saved = {key: serializer(key, None) for key in SNAPSHOT_KEYS}
        except KeyError as error:
            raise ValueError(
                'the snapshot holds no epoch plan of the training iterator '
                '({}); it was written by another iterator than '
                'PlannedIterator'.format(error)) from None
        n_examples, size = int(saved['n_examples']), int(saved['size'])
        if n_examples != self.plan.n_examples:
            raise ValueError('the snapshot is of a dataset of {} examples, '
                             'this job has {}'.format(
                                 n_examples, self.plan.n_examples))
        consumed = numpy.unpackbits(numpy.asarray(
            saved['consumed'], numpy.uint8))[:n_examples].astype(bool)
        try:
            plan = plan_rest(n_examples, int(saved['seed']),
                             self.plan.batch_size, int(saved['iteration']),
                             int(saved['epoch']), consumed, self.plan.size)
        except ValueError as error:
            raise ValueError('a snapshot of {} members cannot be resumed by '
                             '{}: {}'.format(size, self.plan.size, error)
                             ) from None
        self.follow(plan, self.rank)
