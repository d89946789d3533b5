"""In-process recovery for a Chainer trainer (detect/respawn, detect/shrink).

:class:`FaultTolerantTraining` wraps the updater's ``update`` and the
multi-node evaluator's ``evaluate``: when either raises
:class:`~chainer_prefetch.resilience.errors.ProcessFailure` on a survivor,
it repairs the communicator with the chosen strategy, makes the state of
all ranks identical again, and retries, so ``trainer.run()`` goes on
without a rollback:

* ``respawn``: the failed ranks are taken by warm spares parked in the
  pool (``spares.py``), or spawned when there is no spare left; every rank
  keeps its number.  The lowest surviving rank sends the model, the
  optimizer state, the iteration, the learning rate and its iterator
  position to every rank (survivors load the model and optimizer too, since
  a collective may have completed on some ranks and failed on others).
  Afterwards the training ranks top the pool up to the wanted number of
  spares, and before every update they check that no spare has died.
* ``shrink``: the survivors plan the rest of the epoch for the new size
  (:func:`~chainer_prefetch.policy.epoch_plan.replan`: the examples no
  committed update consumed are split over the survivors exactly once, each
  first keeping what it had still to train on) and scale the learning rate
  with a rule (linear by default).

Exact epochs: every rank's training iterator is a
:class:`~chainer_prefetch.iterators.planned_iterator.PlannedIterator`
(:func:`train_iterator`), whose plan tells every rank's order of every
epoch.  After a failure every rank goes back to the last update the sender
committed -- the batches of the aborted update, on every rank, dead or
alive, are not consumed -- and the update is retried, on the same plan
(respawn) or on the survivors' new one (shrink).  So no example of the epoch
is skipped or repeated, the replacement's included.

Every rank holds the whole (small) example lists, so any rank can build any
shard and the replacements get them with the state.
"""
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Union

import chainer
import numpy
from chainer.serializers import NpzDeserializer

from chainer_prefetch.iterators.planned_iterator import (
    PlannedIterator,
    ShardIteratorFactory,
    serialized,
)
from chainer_prefetch.policy.epoch_plan import (
    EpochPlan,
    held_masks,
    replan,
    shard_bounds,
    shard_order,
)
from chainer_prefetch.policy.lr_rules import LrRule, resolve_lr_rule
from chainer_prefetch.resilience import recovery
from chainer_prefetch.resilience.communicator import FaultTolerantCommunicator, revoke
from chainer_prefetch.resilience.errors import ProcessFailure
from chainer_prefetch.resilience.injection import EventLog
from chainer_prefetch.resilience.spares import SparePool, Takeover

STRATEGIES = ('respawn', 'shrink')

IteratorFactory = Callable[[Any], Any]
"""``factory(shard_dataset) -> iterator``."""


def load_state(target, state: Dict[str, Any], keys=None) -> None:
    """Loads a dict from :func:`serialized` into ``target`` (only ``keys``)."""
    if keys is not None:
        state = {k: v for k, v in state.items() if k in keys}
    target.serialize(NpzDeserializer(state, strict=keys is None))


def load_optimizer_state(optimizer, state: Dict[str, Any]) -> None:
    """Loads an optimizer state from :func:`serialized` of another rank.

    The sender may not have updated some parameters yet (a failure during
    the first update), so their state is absent: it is reset here too (it
    is initialised again at the next update) instead of keeping this rank's.
    """
    updated = {key.rsplit('/', 1)[0] for key in state
               if '/' in key and not key.endswith('/t')}
    for path, param in optimizer.target.namedparams():
        if param.update_rule is not None and path.lstrip('/') not in updated:
            param.update_rule._state = None
    optimizer.serialize(NpzDeserializer(state, strict=False))


def shard(dataset, size: int, rank: int, seed: Optional[int]):
    """``rank``'s shard of ``dataset``, as ``chainermn.scatter_dataset`` with
    ``shuffle=seed is not None`` and ``seed`` makes it."""
    begin, end = shard_bounds(len(dataset), size, rank)
    return chainer.datasets.SubDataset(
        dataset, begin, end, shard_order(len(dataset), seed))


def train_iterator(dataset, make_iterator: ShardIteratorFactory,
                   batch_size: int, comm, seed: Optional[int]
                   ) -> PlannedIterator:
    """This rank's training iterator at the start of a job: over the shard
    of ``chainermn.scatter_dataset(dataset, shuffle=seed is not None,
    seed=seed)``, with orders every rank can recompute.

    Args:
        dataset: The whole training dataset.
        make_iterator: ``factory(shard, order_sampler) -> iterator``.
        batch_size: Examples per rank per update.
        comm: The communicator (its size and rank).
        seed: Seed of the shuffle before splitting and of the orders (None:
            no shuffle, orders seeded with 0).
    """
    return PlannedIterator.start(dataset, make_iterator, batch_size,
                                 comm.size, comm.rank, seed)


class FaultTolerantTraining:
    """Recovers a trainer in-process after a process failure.

    Args:
        comm: The communicator of the optimizer and evaluator.
        strategy: ``'respawn'`` or ``'shrink'``.
        model: The model (a link).
        optimizer: The multi-node optimizer.
        updater: The updater (its ``'main'`` iterator is moved or replaced).
        train: The whole training dataset (every rank holds it).
        val: The whole validation dataset, or None.
        make_train_iterator: Builds the training iterator over a shard
            with an order sampler (``factory(shard, order_sampler)``); the
            updater's ``'main'`` iterator must be a :class:`PlannedIterator`
            made with it (:func:`train_iterator`).
        make_val_iterator: Builds a validation iterator over a shard (the
            old one is finalized when replaced).
        evaluator: The multi-node evaluator extension, or None.
        trainer: The trainer (a replacement's triggers are set to the
            position it receives), or None.
        seed: Seed of the shuffle before splitting and of the orders
            (None: no shuffle before splitting, orders seeded by 0).
        lr_rule: Learning-rate rule on shrink (name or callable).
        respawn_command: Program and arguments of a spare or replacement
            (default: this Python with ``sys.argv``).
        spares: Warm spares to keep (respawn; 0 spawns at the failure).
        pool: The pool this process already belongs to (a spare that took
            a rank); None makes one (collective) with ``spares``.
        min_size: Fewest ranks shrink may continue with.
        setup: Picklable object the replacements need to build the model
            (e.g. the class count), sent with the state.
        reports: The :class:`~chainer_prefetch.resilience.reporting.
            RankZeroReports` of this rank, or None (its log is sent to a
            replacement of rank 0).
        events: Event log (recoveries are recorded there).
        log: Where messages go (rank 0 only prints).
    """

    def __init__(self, comm: FaultTolerantCommunicator, strategy: str, model,
                 optimizer, updater, train, val,
                 make_train_iterator: ShardIteratorFactory,
                 make_val_iterator: Optional[IteratorFactory] = None,
                 evaluator=None, trainer=None, seed: Optional[int] = 0,
                 lr_rule: Union[str, LrRule] = 'linear',
                 respawn_command: Optional[List[str]] = None,
                 spares: int = 0, pool: Optional[SparePool] = None,
                 min_size: int = 1, setup: Any = None, reports=None,
                 events: Optional[EventLog] = None, log=None):
        if strategy not in STRATEGIES:
            raise ValueError('strategy must be one of {}, got {!r}'.format(
                ', '.join(STRATEGIES), strategy))
        if spares and strategy != 'respawn':
            raise ValueError('spares are for the respawn strategy')
        if not isinstance(updater.get_iterator('main'), PlannedIterator):
            raise TypeError(
                "the updater's 'main' iterator must be a PlannedIterator "
                '(resilience.training.train_iterator(...)) so that every '
                'rank can recompute what every rank consumed; got {}'.format(
                    type(updater.get_iterator('main')).__name__))
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
        self.lr_rule = resolve_lr_rule(lr_rule)
        self.respawn_command = respawn_command or [sys.executable] + sys.argv
        self.min_size = min_size
        self.setup = setup
        self.reports = reports
        self.events = events
        self.log = log if log is not None else self._print
        self.recoveries: List[Dict[str, Any]] = []
        self._resumed_after_recovery = None  # False: recovered, not resumed
        self._top_up_due = False
        self.pool = pool
        if strategy == 'respawn' and pool is None:
            heartbeat = (None if comm.watchdog is None
                         else comm.watchdog.heartbeat)
            self.pool = SparePool.start(comm.raw, spares,
                                        self.respawn_command, heartbeat,
                                        events)
        comm.pool = self.pool
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
                    self._between_updates()
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

    def _between_updates(self) -> None:
        """Checks the spares and, once training has resumed after a
        recovery, tops the pool up (every rank at the same update)."""
        if self.pool is None:
            return
        if self._top_up_due and self._resumed_after_recovery:
            self._top_up_due = False
            self.pool.top_up()
        try:
            self.pool.check()
        except ProcessFailure:
            revoke(self.comm.raw)  # every rank leaves its next collective
            raise

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
        seen = time.time()
        started = time.perf_counter()
        old_rank, old_size = self.comm.rank, self.comm.size
        lr_before = self.optimizer.lr
        details: Dict[str, Any] = {}
        if self.strategy == 'respawn':
            takeover = self.pool.repair()
            self.comm.repair(takeover.training)
            root = takeover.survivors[0]
            failed, replaced = takeover.failed, True
            details = dict(from_spares=takeover.from_spares,
                           spawned=takeover.spawned,
                           spare_failures=takeover.spare_failures)
        else:
            repair = recovery.shrink(self.comm, self.min_size)
            root, failed, replaced = 0, repair.failed, False
        repaired = time.perf_counter()
        package = None
        if self.comm.rank == root:
            package = self.state_package(with_examples=replaced)
        package = self.comm.bcast_obj(package, root=root)
        if not replaced:
            package['plan'] = self._shrunk_plan(package, repair.survivors)
        self.load_package(package, newcomer=False)
        if not replaced:
            self._shrink_validation()
            self.optimizer.lr = self.lr_rule(self.optimizer.lr, old_size,
                                             self.comm.size)
        record = dict(
            strategy=self.strategy, old_rank=old_rank, new_rank=self.comm.rank,
            size_before=old_size, size=self.comm.size, failed=failed,
            operation=failure.operation, lr_before=lr_before,
            lr=self.optimizer.lr, iteration=self.updater.iteration,
            seen=seen, repair_seconds=repaired - started,
            total_seconds=time.perf_counter() - started, **details)
        self.recoveries.append(record)
        self._after_repair()
        if self.events is not None:
            self.events.write('recovered', **record)
        if failed:
            what = 'the failure of rank(s) {}'.format(
                ', '.join(map(str, failed)))
        else:
            what = 'the loss of a spare'
        self.log('recovered from {} by {} in {:.2f} s (size {} -> {}, '
                 'iteration {}, lr {:.4g} -> {:.4g}{})'.format(
                     what, self.strategy, record['total_seconds'], old_size,
                     self.comm.size, self.updater.iteration, lr_before,
                     self.optimizer.lr, _spare_note(details)))
        return record

    def _after_repair(self) -> None:
        """Notes (on every rank, newcomers too) that training resumes now
        and that the pool is to be topped up once it has."""
        self._resumed_after_recovery = False
        self._top_up_due = (self.pool is not None
                            and self.pool.spares < self.pool.wanted)

    def state_package(self, with_examples: bool = True) -> Dict[str, Any]:
        """What a rank needs to continue: setup, model, optimizer, the
        iteration of the last committed update, learning rate, the epoch
        plan, the report log and (for replacements) the example lists."""
        package = dict(
            setup=self.setup, model=serialized(self.model),
            optimizer=serialized(self.optimizer.actual_optimizer),
            iteration=self.updater.iteration, lr=self.optimizer.lr,
            size=self.comm.size,
            plan=self.updater.get_iterator('main').plan.to_arrays())
        if with_examples:
            package.update(train=self.train, val=self.val)
            if self.reports is not None:
                package['reports'] = self.reports.state()
        return package

    def load_package(self, package: Dict[str, Any], newcomer: bool) -> None:
        """Loads model, optimizer, iteration and learning rate, and puts the
        training iterator at the package's iteration of its plan; a newcomer
        also takes the report log and skips the first broadcast of
        ``create_multi_node_optimizer`` (its model is already in sync)."""
        load_state(self.model, package['model'])
        load_optimizer_state(self.optimizer.actual_optimizer,
                             package['optimizer'])
        iteration = self.updater.iteration = int(package['iteration'])
        self.optimizer.lr = package['lr']
        self.updater.get_iterator('main').follow(
            EpochPlan.from_arrays(package['plan']), self.comm.rank, iteration)
        if newcomer:
            self._after_repair()
            if self.reports is not None and 'reports' in package:
                self.reports.load(package['reports'])
            self.optimizer.is_changed(self.model)
            if self.trainer is not None:
                resync_triggers(self.trainer)

    def _shrunk_plan(self, package: Dict[str, Any],
                     survivors: List[int]) -> Dict[str, numpy.ndarray]:
        """The plan of the survivors (their original ranks, in order) from
        the package's iteration on: each first keeps what it had still to
        train on."""
        old = EpochPlan.from_arrays(package['plan'])
        held = held_masks(old, [str(rank) for rank in range(old.size)],
                          [str(rank) for rank in survivors])
        return replan(old, int(package['iteration']), len(survivors),
                      held).to_arrays()

    def _shrink_validation(self) -> None:
        """The validation iterator over this rank's shard of the new size."""
        if self.evaluator is None or self.val is None:
            return
        old_val = self.evaluator.get_iterator('main')
        self.evaluator._iterators['main'] = self.make_val_iterator(
            shard(self.val, self.comm.size, self.comm.rank, None))
        old_val.finalize()


def _spare_note(details: Dict[str, Any]) -> str:
    if not details:
        return ''
    return '; {} from spares, {} spawned'.format(details['from_spares'],
                                                 details['spawned'])


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
                    takeover: Takeover) -> Dict[str, Any]:
    """A replacement's receipt of :meth:`FaultTolerantTraining.state_package`
    (sent by the lowest surviving rank right after the repair)."""
    return comm.bcast_obj(None, root=takeover.survivors[0])
