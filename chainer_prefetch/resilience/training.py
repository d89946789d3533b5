"""In-process recovery for a Chainer trainer (detect/respawn, detect/shrink).

:class:`FaultTolerantTraining` wraps the updater's ``update`` and the
multi-node evaluator's ``evaluate``: when either raises
:class:`~chainer_prefetch.resilience.errors.ProcessFailure` on a survivor,
it repairs the communicator with the chosen strategy, makes the state of
all ranks identical again, and retries, so ``trainer.run()`` goes on
without a rollback:

* ``respawn``: replacements take the failed ranks (same size, same order);
  the lowest surviving rank sends the model, the optimizer state, the
  iteration, the learning rate and its iterator position to every rank
  (survivors load the model and optimizer too, since a collective may have
  completed on some ranks and failed on others).
* ``shrink``: the survivors re-split the dataset over the new size (the
  split of ``chainermn.scatter_dataset``), resume at the same fraction of
  the epoch, and scale the learning rate with a rule (linear by default).

Every rank holds the whole (small) example lists, so any rank can build any
shard and the replacements get them with the state.
"""
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Union

import chainer
import numpy
from chainer.serializers import DictionarySerializer, NpzDeserializer

from chainer_prefetch.resilience import policy, recovery
from chainer_prefetch.resilience.communicator import FaultTolerantCommunicator
from chainer_prefetch.resilience.errors import ProcessFailure
from chainer_prefetch.resilience.injection import EventLog

STRATEGIES = ('respawn', 'shrink')
ITERATOR_POSITION_KEYS = ('current_position', 'epoch', 'is_new_epoch',
                          'previous_epoch_detail')

IteratorFactory = Callable[[Any], Any]
"""``factory(shard_dataset) -> iterator``."""


def to_state(target) -> Dict[str, numpy.ndarray]:
    """Serialises a link, optimizer or iterator into a dict of arrays."""
    serializer = DictionarySerializer()
    target.serialize(serializer)
    return serializer.target


def load_state(target, state: Dict[str, Any], keys=None) -> None:
    """Loads a dict from :func:`to_state` into ``target`` (only ``keys``)."""
    if keys is not None:
        state = {k: v for k, v in state.items() if k in keys}
    target.serialize(NpzDeserializer(state, strict=keys is None))


def shard(dataset, size: int, rank: int, seed: Optional[int]):
    """``rank``'s shard of ``dataset``, as ``chainermn.scatter_dataset`` with
    ``shuffle=seed is not None`` and ``seed`` makes it."""
    begin, end = policy.shard_bounds(len(dataset), size, rank)
    return chainer.datasets.SubDataset(
        dataset, begin, end, policy.shard_order(len(dataset), seed))


class FaultTolerantTraining:
    """Recovers a trainer in-process after a process failure.

    Args:
        comm: The communicator of the optimizer and evaluator.
        strategy: ``'respawn'`` or ``'shrink'``.
        model: The model (a link).
        optimizer: The multi-node optimizer.
        updater: The updater (its ``'main'`` iterator is replaced on shrink).
        train: The whole training dataset (every rank holds it).
        val: The whole validation dataset, or None.
        make_train_iterator, make_val_iterator: Build an iterator over a
            shard (the old one is finalized when replaced).
        evaluator: The multi-node evaluator extension, or None.
        trainer: The trainer (a replacement's triggers are set to the
            position it receives), or None.
        seed: Seed of the training shuffle before splitting (None: none).
        lr_rule: Learning-rate rule on shrink (name or callable).
        respawn_command: Program and arguments of a replacement (default:
            this Python with ``sys.argv``).
        min_size: Fewest ranks shrink may continue with.
        setup: Picklable object the replacements need to build the model
            (e.g. the class count), sent with the state.
        events: Event log (recoveries are recorded there).
        log: Where messages go (rank 0 only prints).
    """

    def __init__(self, comm: FaultTolerantCommunicator, strategy: str, model,
                 optimizer, updater, train, val,
                 make_train_iterator: IteratorFactory,
                 make_val_iterator: Optional[IteratorFactory] = None,
                 evaluator=None, trainer=None, seed: Optional[int] = 0,
                 lr_rule: Union[str, policy.LrRule] = 'linear',
                 respawn_command: Optional[List[str]] = None,
                 min_size: int = 1, setup: Any = None,
                 events: Optional[EventLog] = None, log=None):
        if strategy not in STRATEGIES:
            raise ValueError('strategy must be one of {}, got {!r}'.format(
                ', '.join(STRATEGIES), strategy))
        self.comm = comm
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.updater = updater
        self.train = train
        self.val = val
        self.make_train_iterator = make_train_iterator
        self.make_val_iterator = make_val_iterator
        self.evaluator = evaluator
        self.trainer = trainer
        self.seed = seed
        self.lr_rule = policy.resolve_lr_rule(lr_rule)
        self.respawn_command = respawn_command or [sys.executable] + sys.argv
        self.min_size = min_size
        self.setup = setup
        self.events = events
        self.log = log if log is not None else self._print
        self.recoveries: List[Dict[str, Any]] = []
        self._resumed_after_recovery = None  # False: recovered, not resumed
        self._install()

    def _print(self, message: str) -> None:
        if self.comm.rank == 0:
            print(message, flush=True)

    def _install(self) -> None:
        """Wraps ``updater.update`` and ``evaluator.evaluate`` (instance
        attributes, which is what ``Trainer.run`` and the evaluator call)."""
        self.updater.update = self._retrying(self.updater.update)
        if self.evaluator is not None:
            self.evaluator.evaluate = self._skipping(self.evaluator.evaluate)

    def _retrying(self, function: Callable) -> Callable:
        """``function`` that recovers and runs again after a failure."""
        def retried(*args, **kwargs):
            while True:
                try:
                    result = function(*args, **kwargs)
                except ProcessFailure as failure:
                    self.recover(failure)
                    continue
                if self._resumed_after_recovery is False:
                    # Back in the training loop: the first iteration done.
                    self._resumed_after_recovery = True
                    if self.events is not None:
                        self.events.write('iteration_after_recovery',
                                          iteration=self.updater.iteration)
                return result
        return retried

    def _skipping(self, evaluate: Callable) -> Callable:
        """``evaluate`` that recovers and skips this evaluation after a
        failure (a replacement starts with an update, so every rank must
        go on with the next update, not with a new evaluation)."""
        def skipped(*args, **kwargs):
            try:
                return evaluate(*args, **kwargs)
            except ProcessFailure as failure:
                while True:
                    try:
                        self.recover(failure)
                        break
                    except ProcessFailure as another:
                        failure = another
                self.log('validation at iteration {} skipped (failure during '
                         'evaluation)'.format(self.updater.iteration))
                return {}
        return skipped

    # ---- recovery ---------------------------------------------------------

    def recover(self, failure: ProcessFailure) -> Dict[str, Any]:
        """Repairs the communicator and the training state.

        Args:
            failure: The exception raised on this rank.

        Returns:
            A record of the recovery (also appended to ``recoveries``).

        Raises:
            RecoveryFailed: too few survivors for shrink.
            ProcessFailure: a failure during the repair that the caller may
                retry (the retry loop does).
        """
        started = time.perf_counter()
        old_rank, old_size = self.comm.rank, self.comm.size
        lr_before = self.optimizer.lr
        if self.strategy == 'respawn':
            repair = recovery.respawn(self.comm, self.respawn_command[0],
                                      self.respawn_command[1:])
        else:
            repair = recovery.shrink(self.comm, self.min_size)
        repaired = time.perf_counter()
        # After respawn the lowest survivor has its old rank; after shrink
        # the survivors are ranks 0..size-1.
        root = repair.survivors[0] if repair.replaced else 0
        package = None
        if self.comm.rank == root:
            package = self.state_package(with_examples=repair.replaced)
        package = self.comm.bcast_obj(package, root=root)
        self.load_package(package, newcomer=False)
        if not repair.replaced:
            self._reshard(old_size)
        record = dict(
            strategy=self.strategy, old_rank=old_rank, new_rank=self.comm.rank,
            size_before=old_size, size=self.comm.size, failed=repair.failed,
            operation=failure.operation, lr_before=lr_before,
            lr=self.optimizer.lr, iteration=self.updater.iteration,
            repair_seconds=repaired - started,
            total_seconds=time.perf_counter() - started)
        self.recoveries.append(record)
        self._resumed_after_recovery = False
        if self.events is not None:
            self.events.write('recovered', **record)
        self.log('recovered from the failure of rank(s) {} by {} in {:.2f} s '
                 '(size {} -> {}, iteration {}, lr {:.4g} -> {:.4g})'.format(
                     ', '.join(map(str, repair.failed)), self.strategy,
                     record['total_seconds'], old_size, self.comm.size,
                     self.updater.iteration, lr_before, self.optimizer.lr))
        return record

    def state_package(self, with_examples: bool = True) -> Dict[str, Any]:
        """What a rank needs to continue: setup, model, optimizer,
        iteration, learning rate, iterator position and (for replacements)
        the example lists."""
        package = dict(
            setup=self.setup, model=to_state(self.model),
            optimizer=to_state(self.optimizer.actual_optimizer),
            iteration=self.updater.iteration, lr=self.optimizer.lr,
            size=self.comm.size,
            iterator=to_state(self.updater.get_iterator('main')))
        if with_examples:
            package.update(train=self.train, val=self.val)
        return package

    def load_package(self, package: Dict[str, Any], newcomer: bool) -> None:
        """Loads model, optimizer, iteration and learning rate; a newcomer
        also takes the iterator position and skips the first broadcast of
        ``create_multi_node_optimizer`` (its model is already in sync)."""
        load_state(self.model, package['model'])
        load_state(self.optimizer.actual_optimizer, package['optimizer'])
        self.updater.iteration = int(package['iteration'])
        self.optimizer.lr = package['lr']
        if newcomer:
            load_state(self.updater.get_iterator('main'), package['iterator'])
            self.optimizer.is_changed(self.model)
            if self.trainer is not None:
                resync_triggers(self.trainer)

    def _reshard(self, old_size: int) -> None:
        """After shrink: new shards, same fraction of the epoch, new lr."""
        size, rank = self.comm.size, self.comm.rank
        old_iterator = self.updater.get_iterator('main')
        old_length = len(old_iterator.dataset)
        train_iterator = self.make_train_iterator(
            shard(self.train, size, rank, self.seed))
        state = to_state(train_iterator)
        state['current_position'] = numpy.asarray(policy.resume_position(
            old_iterator.current_position, old_length,
            len(train_iterator.dataset)))
        state['epoch'] = numpy.asarray(old_iterator.epoch)
        state['is_new_epoch'] = numpy.asarray(False)
        state['previous_epoch_detail'] = numpy.asarray(
            old_iterator.epoch + int(state['current_position'])
            / len(train_iterator.dataset))
        load_state(train_iterator, state)
        self.updater._iterators['main'] = train_iterator
        old_iterator.finalize()
        if self.evaluator is not None and self.val is not None:
            old_val = self.evaluator.get_iterator('main')
            self.evaluator._iterators['main'] = self.make_val_iterator(
                shard(self.val, size, rank, None))
            old_val.finalize()
        self.optimizer.lr = self.lr_rule(self.optimizer.lr, old_size, size)


def resync_triggers(trainer) -> None:
    """Makes the triggers of a trainer that starts in the middle of a run
    fire like those of the running ones.

    A new ``IntervalTrigger`` remembers epoch 0 as its last position and
    would fire at once (e.g. a validation the others do not run, which
    deadlocks its collective).  The value -1 tells Chainer's triggers to take
    the previous position from the updater instead.
    """
    triggers = [entry.trigger for entry in trainer._extensions.values()]
    triggers.append(trainer.stop_trigger)
    for trigger in triggers:
        if hasattr(trigger, '_previous_epoch_detail'):
            trigger._previous_epoch_detail = -1.
        if hasattr(trigger, '_previous_iteration'):
            trigger._previous_iteration = -1


def receive_package(comm: FaultTolerantCommunicator,
                    repair: recovery.Repair) -> Dict[str, Any]:
    """A replacement's receipt of :meth:`FaultTolerantTraining.state_package`
    (sent by the lowest surviving rank right after the repair)."""
    return comm.bcast_obj(None, root=repair.survivors[0])
