"""In-process rebuild of a Chainer trainer on every accepted membership change.

:class:`ElasticTraining` wraps the updater's ``update`` and the multi-node
evaluator's ``evaluate``.  Before each update it asks the communicator
whether the membership changed (a settled join or leave, a newer
generation); an update or evaluation that raises
:class:`~.errors.MembershipChanged` (a member died or hangs) is caught.
Either way every member then

1. forms the next group (``communicator.rebuild()``: settle window, the
   leader's policy decision, the gloo rendezvous);
2. finds the member furthest ahead (highest iteration; a collective may
   have completed on some members and failed on others) and takes from it
   the model, the optimizer state, the iteration, the epoch position and the
   learning rate -- a process that joins starts with no state and receives
   it here;
3. plans the rest of the epoch for the new group
   (:func:`~chainer_prefetch.policy.epoch_plan.replan`): the examples of
   the epoch that no committed update consumed -- the batches of an update
   that a failure aborted included, on every member, dead or alive -- are
   split over the new members exactly once, each member first taking the
   examples its node holds local copies of; the consumed ones fill the
   shards for the next epochs, so every example is trained on once per
   epoch through the change;
4. rescales the learning rate by a rule (``lr_rule(lr, old_size,
   new_size)``, linear by default; any callable);
5. moves its :class:`~chainer_prefetch.iterators.planned_iterator.
   PlannedIterator` to its part of the new plan and goes on.

An evaluation cut by a change is skipped (the next one runs).  Every
rebuild is appended to :attr:`ElasticTraining.history` with its times and
the shared-storage reads of the iterator it replaced.
"""
import time
from typing import Any, Callable, Dict, List, Optional, Union

import numpy
from chainer.serializers import NpzDeserializer

from chainer_prefetch.elastic import plan
from chainer_prefetch.elastic.communicator import ElasticCommunicator
from chainer_prefetch.elastic.errors import MembershipChanged
from chainer_prefetch.elastic.policy import Progress
from chainer_prefetch.iterators.planned_iterator import (
    PlannedIterator,
    ShardIteratorFactory,
    serialized,
    subset,
)
from chainer_prefetch.policy.epoch_plan import (
    EpochPlan,
    held_masks,
    replan,
    shard_bounds,
    start_plan,
)
from chainer_prefetch.policy.lr_rules import LrRule, resolve_lr_rule

IteratorFactory = Callable[[Any], Any]
"""``factory(dataset) -> iterator`` of the validation shards (the old
iterator is finalized)."""

STORAGE_STATS = ('files_copied', 'examples_from_source', 'examples_from_local')
"""Counters of ``PrefetchMultiprocessIterator.stats`` kept per generation:
shared-storage reads are ``files_copied`` (stage 2) plus
``examples_from_source`` (stage 3)."""


def storage_reads(iterator) -> Optional[Dict[str, int]]:
    """The storage counters of an iterator (None if it has no ``stats``)."""
    stats = getattr(iterator, 'stats', None)
    if stats is None:
        return None
    return {key: int(stats.get(key, 0)) for key in STORAGE_STATS}


def deserialize(target, state: Dict[str, Any], strict: bool = True) -> None:
    """Loads a dict from :func:`serialized` into ``target``."""
    target.serialize(NpzDeserializer(state, strict=strict))


def reset_triggers(trainer) -> None:
    """Makes interval triggers take their previous position from the
    updater (a rebuilt or newly joined trainer would otherwise fire, or not,
    unlike the others, and deadlock a validation)."""
    triggers = [entry.trigger for entry in trainer._extensions.values()]
    for trigger in triggers + [trainer.stop_trigger]:
        if hasattr(trigger, '_previous_epoch_detail'):
            trigger._previous_epoch_detail = -1.
        if hasattr(trigger, '_previous_iteration'):
            trigger._previous_iteration = -1


class ElasticTraining:
    """Keeps a Chainer trainer running while members come and go.

    Construct it after the communicator, model, multi-node optimizer,
    updater, trainer and evaluator; it synchronises the state at once (a
    joining process receives it here).

    Args:
        comm: The elastic communicator.
        model: The model (a link).
        optimizer: The multi-node optimizer.
        updater: The updater.  Its ``'main'`` iterator gives the batch size
            per member and is replaced by a
            :class:`~chainer_prefetch.iterators.planned_iterator.
            PlannedIterator`.
        train: The whole training dataset (every member holds it).
        make_train_iterator: Builds the iterator over a shard with an order
            sampler (``factory(shard, order_sampler)``, ``repeat=True``).
        val: The whole validation dataset, or None.
        make_val_iterator: Builds a validation iterator over a shard.
        evaluator: The multi-node evaluator extension, or None.
        trainer: The trainer (its triggers are realigned), or None.
        seed: Shuffle of the examples before splitting and seed of the
            orders (None: no shuffle, orders seeded with 0).
        lr_rule: ``'linear'``, ``'sqrt'``, ``'constant'`` or a callable
            ``rule(lr, old_size, new_size)``; may be changed at any time
            (attribute ``lr_rule``).
        locality: Where this member's local copies are (members with the
            same value share them, e.g. ``host:local_dir``); default: the
            host.
        epochs: Length of the run, for the policy's progress (or None).
        keep_local: Keep local copies local when re-splitting (False: the
            plain contiguous split, for comparison).
        on_event: ``on_event(name, **fields)`` callback.
    """

    def __init__(self, comm: ElasticCommunicator, model, optimizer, updater,
                 train, make_train_iterator: ShardIteratorFactory, val=None,
                 make_val_iterator: Optional[IteratorFactory] = None,
                 evaluator=None, trainer=None, seed: Optional[int] = 0,
                 lr_rule: Union[str, LrRule] = 'linear',
                 locality: Optional[str] = None,
                 epochs: Optional[float] = None, keep_local: bool = True,
                 on_event=None):
        self.comm = comm
        self.model = model
        self.optimizer = optimizer
        self.updater = updater
        self.train = train
        self.make_train_iterator = make_train_iterator
        self.val = val
        self.make_val_iterator = make_val_iterator
        self.evaluator = evaluator
        self.trainer = trainer
        self.seed = seed
        self.lr_rule = resolve_lr_rule(lr_rule)
        self.locality = locality or plan.host_of(comm.member)
        self.epochs = epochs
        self.keep_local = keep_local
        self.on_event = on_event or comm.on_event
        self.history: List[Dict[str, Any]] = []
        self.batch_size = updater.get_iterator('main').batch_size
        self.localities: List[str] = []  # of the plan's members
        self.trained_size: Optional[int] = None
        self.started = time.monotonic()
        self._install()
        self._synchronize(time.monotonic(), 'start')

    # ---- hooks -------------------------------------------------------------

    def _install(self) -> None:
        update = self.updater.update

        def elastic_update():
            while True:
                reason = self.comm.membership_changed()
                if reason is not None:
                    self.rebuild(reason, failed=False)
                    continue
                try:
                    result = update()
                except MembershipChanged as change:
                    self.rebuild(str(change), failed=True)
                    continue
                self._record_progress()
                return result

        self.updater.update = elastic_update
        if self.evaluator is not None:
            evaluate = self.evaluator.evaluate

            def elastic_evaluate():
                try:
                    return evaluate()
                except MembershipChanged as change:
                    self.rebuild(str(change), failed=True)
                    return {}

            self.evaluator.evaluate = elastic_evaluate

    def _record_progress(self) -> None:
        elapsed = time.monotonic() - self.started
        epoch_detail = self.updater.epoch_detail
        fraction = epoch_detail / self.epochs if self.epochs else 0.0
        eta = None
        if 0 < fraction < 1:
            eta = elapsed * (1 - fraction) / fraction
        self.comm.progress = Progress(self.updater.iteration, epoch_detail,
                                      fraction, elapsed, eta, self.comm.size)

    # ---- rebuild -----------------------------------------------------------

    def rebuild(self, reason: str, failed: bool) -> None:
        """Forms the next group and synchronises the state (see the module
        docstring)."""
        started = time.monotonic()
        self.on_event('rebuild', reason=reason, failed=failed,
                      iteration=self.updater.iteration,
                      generation=self.comm.generation)
        self.comm.rebuild(failed=failed)
        self._synchronize(started, reason)

    def _synchronize(self, started: float, reason: str) -> None:
        while True:
            try:
                self._take_state(started, reason)
                return
            except MembershipChanged as change:
                self.on_event('rebuild', reason=str(change), failed=True,
                              iteration=self.updater.iteration,
                              generation=self.comm.generation)
                self.comm.rebuild(failed=True)

    def _take_state(self, started: float, reason: str) -> None:
        comm = self.comm
        formed = time.monotonic()
        infos = comm.allgather_obj((self.updater.iteration, self.locality))
        iterations = [info[0] for info in infos]
        source = int(numpy.argmax(iterations))
        package = comm.bcast_obj(
            self._package() if comm.rank == source else None, root=source)
        if comm.rank != source:
            deserialize(self.model, package['model'])
            # Before the first update the optimizer has no state to send.
            deserialize(self.optimizer.actual_optimizer, package['optimizer'],
                        strict=False)
        # Parameters are in sync: the first update must not broadcast.
        self.optimizer.is_changed(self.model)
        # The source's last update is committed: the others' copies of the
        # model are replaced by its, so their batches count as consumed.
        iteration = self.updater.iteration = int(package['iteration'])
        localities = [info[1] for info in infos]
        new_plan, held, plain = self._plan(package, iteration, localities)
        reads = self._replace_iterators(new_plan)
        old_size = package['size'] or comm.size
        lr_before = package['lr']
        self.optimizer.lr = self.lr_rule(lr_before, old_size, comm.size)
        self.localities = localities
        self.trained_size = comm.size
        if self.trainer is not None:
            reset_triggers(self.trainer)
        shard = new_plan.shards[comm.rank]
        mine = held[comm.rank]
        epoch, position = new_plan.where(iteration)
        record = dict(
            generation=comm.generation, reason=reason, size=comm.size,
            group_rank=comm.rank, old_size=old_size, source=source,
            iteration=iteration, epoch=epoch, position=position,
            lr_before=lr_before, lr=self.optimizer.lr, shard=len(shard),
            kept_local=0 if mine is None else int(mine[shard].sum()),
            plain_kept_local=0 if mine is None else int(
                mine[plain.shards[comm.rank]].sum()),
            previous_storage=reads,
            rendezvous_seconds=formed - started,
            state_seconds=time.monotonic() - formed,
            total_seconds=time.monotonic() - started)
        self.history.append(record)
        self.on_event('resumed', **record)

    def _plan(self, package: Dict[str, Any], iteration: int,
              localities: List[str]):
        """``(plan, held, plain)``: the plan of the new group from the
        source's (a fresh one when nobody has trained yet), what each new
        member's place holds, and the plan that ignores it (to count what
        keeping local copies local saves)."""
        size = self.comm.size
        if package['plan'] is None:
            fresh = start_plan(len(self.train), size, self.seed,
                               self.batch_size, iteration=iteration)
            return fresh, [None] * size, fresh
        old = EpochPlan.from_arrays(package['plan'])
        held = held_masks(old, package['localities'], localities)
        plain = replan(old, iteration, size)
        if not self.keep_local:
            return plain, held, plain
        return replan(old, iteration, size, held), held, plain

    def _package(self) -> Dict[str, Any]:
        iterator = self.updater.get_iterator('main')
        planned = isinstance(iterator, PlannedIterator)
        return dict(model=serialized(self.model),
                    optimizer=serialized(self.optimizer.actual_optimizer),
                    iteration=self.updater.iteration,
                    plan=iterator.plan.to_arrays() if planned else None,
                    localities=self.localities,
                    lr=self.optimizer.lr, size=self.trained_size)

    def _replace_iterators(self, new_plan: EpochPlan
                           ) -> Optional[Dict[str, int]]:
        """Moves the training iterator to this member's part of
        ``new_plan`` (and splits the validation set over the new group);
        returns the storage counters of the shard iterator replaced."""
        old = self.updater.get_iterator('main')
        reads = storage_reads(old)
        if isinstance(old, PlannedIterator):
            old.follow(new_plan, self.comm.rank)
        else:  # the placeholder the updater was built with
            self.updater._iterators['main'] = PlannedIterator(
                self.train, self.make_train_iterator, new_plan,
                self.comm.rank)
            old.finalize()
        if self.evaluator is not None and self.val is not None:
            old_val = self.evaluator.get_iterator('main')
            begin, end = shard_bounds(len(self.val), self.comm.size,
                                      self.comm.rank)
            self.evaluator._iterators['main'] = self.make_val_iterator(
                subset(self.val, numpy.arange(begin, end) % len(self.val)))
            old_val.finalize()
        return reads

    def finish(self) -> None:
        """Ends the job normally (see ``ElasticCommunicator.finish``)."""
        self.comm.finish()
