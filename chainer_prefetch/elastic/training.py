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
3. splits the dataset again over the new size, keeping on each node the
   examples it already has local copies of (:func:`~.plan.locality_split`);
4. rescales the learning rate by a rule (``lr_rule(lr, old_size,
   new_size)``, linear by default; any callable);
5. rebuilds the iterators at the same fraction of the epoch and goes on.

An evaluation cut by a change is skipped (the next one runs).  Every
rebuild is appended to :attr:`ElasticTraining.history` with its times and
the shared-storage reads of the iterator it replaced.
"""
import time
from typing import Any, Callable, Dict, List, Optional, Union

import chainer
import numpy
from chainer.serializers import DictionarySerializer, NpzDeserializer

from chainer_prefetch.elastic import plan
from chainer_prefetch.elastic.communicator import ElasticCommunicator
from chainer_prefetch.elastic.errors import MembershipChanged
from chainer_prefetch.elastic.policy import Progress
from chainer_prefetch.resilience.policy import (
    LrRule,
    resolve_lr_rule,
    resume_position,
    shard_bounds,
    shard_order,
)

IteratorFactory = Callable[[Any], Any]
"""``factory(dataset) -> iterator`` (the old iterator is finalized)."""

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


def serialized(target) -> Dict[str, numpy.ndarray]:
    """The state of a link, optimizer or iterator as a dict of arrays."""
    serializer = DictionarySerializer()
    target.serialize(serializer)
    return serializer.target


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


def subset(dataset, indices: numpy.ndarray):
    """``dataset[indices]`` as a ``SubDataset`` (which the prefetching
    iterator sees through); ``indices`` may repeat."""
    order = numpy.zeros(len(dataset), dtype=numpy.int64)
    order[:len(indices)] = indices
    return chainer.datasets.SubDataset(dataset, 0, len(indices), order)


def _held_mask(n_examples: int, indices) -> numpy.ndarray:
    mask = numpy.zeros(n_examples, dtype=bool)
    mask[numpy.asarray(list(indices), dtype=numpy.int64)] = True
    return numpy.packbits(mask)


def _held_indices(n_examples: int, packed: numpy.ndarray) -> numpy.ndarray:
    return numpy.flatnonzero(numpy.unpackbits(packed)[:n_examples])


class ElasticTraining:
    """Keeps a Chainer trainer running while members come and go.

    Construct it after the communicator, model, multi-node optimizer,
    updater, trainer and evaluator; it synchronises the state at once (a
    joining process receives it here).

    Args:
        comm: The elastic communicator.
        model: The model (a link).
        optimizer: The multi-node optimizer.
        updater: The updater (its ``'main'`` iterator is replaced).
        train: The whole training dataset (every member holds it).
        make_train_iterator: Builds an iterator over a shard.
        val: The whole validation dataset, or None.
        make_val_iterator: Builds a validation iterator over a shard.
        evaluator: The multi-node evaluator extension, or None.
        trainer: The trainer (its triggers are realigned), or None.
        seed: Shuffle of the examples before splitting (None: none).
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
                 train, make_train_iterator: IteratorFactory, val=None,
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
        self.held = numpy.zeros(0, dtype=numpy.int64)
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
        n = len(self.train)
        infos = comm.allgather_obj((self.updater.iteration, self.locality,
                                    _held_mask(n, self.held)))
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
        self.updater.iteration = int(package['iteration'])
        held: Dict[str, numpy.ndarray] = {}
        for _, locality, mask in infos:
            if self.keep_local:
                held[locality] = numpy.union1d(held.get(locality, []),
                                               _held_indices(n, mask))
        split = plan.locality_split(
            n, [info[1] for info in infos], held, shard_order(n, self.seed),
            shard_bounds)
        shard = split.shards[comm.rank]
        reads = self._replace_iterators(shard, package)
        old_size = package['size'] or comm.size
        lr_before = package['lr']
        self.optimizer.lr = self.lr_rule(lr_before, old_size, comm.size)
        self.held = numpy.union1d(self.held, shard)
        self.trained_size = comm.size
        if self.trainer is not None:
            reset_triggers(self.trainer)
        record = dict(
            generation=comm.generation, reason=reason, size=comm.size,
            group_rank=comm.rank, old_size=old_size, source=source,
            iteration=self.updater.iteration, lr_before=lr_before,
            lr=self.optimizer.lr, shard=len(shard),
            kept_local=split.kept_local[comm.rank],
            plain_kept_local=split.plain_kept_local[comm.rank],
            previous_storage=reads,
            rendezvous_seconds=formed - started,
            state_seconds=time.monotonic() - formed,
            total_seconds=time.monotonic() - started)
        self.history.append(record)
        self.on_event('resumed', **record)

    def _package(self) -> Dict[str, Any]:
        iterator = self.updater.get_iterator('main')
        return dict(model=serialized(self.model),
                    optimizer=serialized(self.optimizer.actual_optimizer),
                    iteration=self.updater.iteration,
                    epoch=iterator.epoch, epoch_detail=iterator.epoch_detail,
                    lr=self.optimizer.lr, size=self.trained_size)

    def _replace_iterators(self, shard: numpy.ndarray,
                           package: Dict[str, Any]
                           ) -> Optional[Dict[str, int]]:
        """New iterators over ``shard`` at the source's epoch position;
        returns the storage counters of the replaced one (if known)."""
        old = self.updater.get_iterator('main')
        reads = storage_reads(old)
        iterator = self.make_train_iterator(subset(self.train, shard))
        epoch = int(package['epoch'])
        fraction = float(package['epoch_detail']) - epoch
        length = len(shard)
        position = resume_position(int(round(fraction * length)), length,
                                   length)
        state = serialized(iterator)
        state.update(current_position=numpy.asarray(position),
                     epoch=numpy.asarray(epoch),
                     is_new_epoch=numpy.asarray(False),
                     previous_epoch_detail=numpy.asarray(
                         epoch + position / length))
        deserialize(iterator, state, strict=False)
        self.updater._iterators['main'] = iterator
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
