"""Where the time of a data-parallel training iteration goes.

Per iteration and per rank the time is split into five components (the
paper's Figs. 9-11, sec. 4.4):

``load``
    time inside the training iterator's ``next()`` (waiting for the
    minibatch);
``forward``
    the loss computation (``loss_func(*in_arrays)``);
``backward``
    ``loss.backward()`` (with the gradients cleared just before it);
``allreduce``
    the gradient averaging of ChainerMN's multi-node optimizer: time inside
    the communicator's ``multi_node_mean_grad`` (which
    ``_MultiNodeOptimizer.update`` calls in ChainerMN 7.8.1), its deprecated
    alias ``allreduce_grad``, and ``_multi_node_mean_grad_async`` (the
    double-buffering optimizer; there only the launch is timed).  It
    includes the time a rank waits there for slower ranks;
``other``
    the rest of the iteration's wall time: the converter
    (``concat_examples``), the optimizer update and hooks, the first
    iteration's parameter broadcast (``bcast_data``), the trainer's
    extensions (evaluation, logging, snapshots) and the loop itself.

An iteration's wall time runs from the end of the previous iteration (the
start of the first ``update_core`` for the first) to the moment the last
extension of this iteration has run, so the components of an epoch sum to
its wall time exactly; ``other`` is what is left after the measured ones.
The ``detail`` of each epoch in the JSON splits ``other`` further
(``convert``, ``update``, ``bcast``, ``extensions``).

Usage (``train_imagenet.py`` does this)::

    updater = TimedUpdater(train_iter, optimizer, device=device)
    trainer = training.Trainer(updater, ...)
    install_time_breakdown(trainer, updater, path, rank=comm.rank,
                           info={...})

Results:

* ``path`` (e.g. ``result/time_breakdown_rank0.json``), rewritten at the
  end of every epoch: one record per epoch with the sums of the components
  (seconds), the iteration count and the wall time, the first and second
  iterations' load times, and the training iterator's ``stats`` when it has
  them (``chainer_prefetch.PrefetchMultiprocessIterator``).
* ``chainer.reporter`` values ``time/load``, ``time/forward``,
  ``time/backward``, ``time/allreduce``, ``time/other`` and ``time/wall``:
  the sums over the epoch, reported once, at the epoch's last iteration, so
  that a ``LogReport`` triggered every epoch logs the epoch sums (with a
  shorter log interval they appear in the entries that contain an epoch's
  end).  They are reported just before ``LogReport`` runs, so they miss
  the few milliseconds that ``LogReport``, ``PrintReport`` and
  ``snapshot`` take in that last iteration; the JSON has those too.

On a GPU, pass ``synchronize`` (``train_imagenet.py`` passes the CUDA
device's ``synchronize``) so that asynchronous kernels are charged to the
phase that launched them.
"""

import json
import os
import time

import chainer
from chainer.dataset import convert
from chainer.training import extension, updaters

COMPONENTS = ('load', 'forward', 'backward', 'allreduce', 'other')
"""The five components, in the paper's order reversed (bottom of a bar)."""

DETAILS = ('convert', 'update', 'bcast', 'extensions')
"""Parts of ``other`` that are timed as well (reported in ``detail``)."""

_TIMED = ('load', 'forward', 'backward', 'allreduce') + DETAILS

_ALLREDUCE_METHODS = ('multi_node_mean_grad', 'allreduce_grad',
                      '_multi_node_mean_grad_async')
_BCAST_METHODS = ('bcast_data',)


class TimeBreakdown(object):
    """Accumulates per-iteration phase times into per-epoch sums.

    ``start_iteration`` opens an iteration, ``add`` charges seconds to a
    phase, ``end_iteration`` closes it (its ``other`` is the wall time not
    charged to any of ``load``/``forward``/``backward``/``allreduce``) and
    ``end_epoch`` files the epoch's sums into :attr:`epochs`.

    Args:
        clock: Function returning seconds (monotonic).
    """

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.epochs = []
        self.first_iteration_load = None
        self.second_iteration_load = None
        self.first_iteration = None
        self.iterations = 0
        self.started_at = None
        self._boundary = None
        self._iteration = None
        self._epoch_number = None
        self._epoch = None

    @staticmethod
    def _empty_epoch(number):
        record = dict.fromkeys(COMPONENTS, 0.0)
        record.update(epoch=number, iterations=0, wall=0.0,
                      detail=dict.fromkeys(DETAILS, 0.0))
        return record

    @property
    def in_iteration(self):
        """Whether an iteration is open."""
        return self._iteration is not None

    def start_iteration(self, epoch):
        """Opens an iteration of epoch ``epoch`` (1-based)."""
        now = self.clock()
        if self._boundary is None:
            self._boundary = self.started_at = now
        if self._iteration is not None:
            # Nobody closed the previous one (no extension installed).
            self.end_iteration(now)
        if self._epoch is not None and self._epoch_number != epoch:
            self.end_epoch()
        if self._epoch is None:
            self._epoch_number = epoch
            self._epoch = self._empty_epoch(epoch)
        self._iteration = dict.fromkeys(_TIMED, 0.0)

    def add(self, phase, seconds):
        """Charges ``seconds`` to ``phase`` of the open iteration."""
        if self._iteration is not None:
            self._iteration[phase] += seconds

    def _components(self, iteration, now):
        wall = now - self._boundary
        values = {key: iteration[key] for key in COMPONENTS[:-1]}
        values['other'] = wall - sum(values.values())
        return values, wall

    def end_iteration(self, now=None):
        """Closes the open iteration at ``now`` (default: the clock)."""
        if self._iteration is None:
            return
        if now is None:
            now = self.clock()
        iteration, self._iteration = self._iteration, None
        values, wall = self._components(iteration, now)
        epoch = self._epoch
        for key, value in values.items():
            epoch[key] += value
        for key in DETAILS:
            epoch['detail'][key] += iteration[key]
        epoch['wall'] += wall
        epoch['iterations'] += 1
        self.iterations += 1
        if self.iterations == 1:
            self.first_iteration_load = iteration['load']
            self.first_iteration = dict(values, wall=wall)
        elif self.iterations == 2:
            self.second_iteration_load = iteration['load']
        self._boundary = now

    def end_epoch(self):
        """Files the open epoch (if any) into :attr:`epochs`."""
        if self._epoch is not None and self._epoch['iterations']:
            self.epochs.append(self._epoch)
        self._epoch = None
        self._epoch_number = None

    def current_epoch(self, now=None):
        """Sums of the open epoch so far, the open iteration included."""
        if self._epoch is None:
            return None
        record = dict(self._epoch, detail=dict(self._epoch['detail']))
        if self._iteration is not None:
            if now is None:
                now = self.clock()
            values, wall = self._components(self._iteration, now)
            for key, value in values.items():
                record[key] += value
            record['wall'] += wall
            record['iterations'] += 1
        return record

    def to_dict(self):
        """Everything recorded, as JSON-ready data."""
        epochs = list(self.epochs)
        totals = dict.fromkeys(COMPONENTS + ('wall',), 0.0)
        totals['iterations'] = 0
        for record in epochs:
            for key in totals:
                totals[key] += record[key]
        return {
            'components': list(COMPONENTS),
            'epochs': epochs,
            'totals': totals,
            'iterations': self.iterations,
            'first_iteration_load': self.first_iteration_load,
            'second_iteration_load': self.second_iteration_load,
            'first_iteration': self.first_iteration,
        }


def _timed_method(obj, name, breakdown, phase, guard):
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        if guard[0]:  # nested call (e.g. allreduce_grad -> mean_grad)
            return original(*args, **kwargs)
        guard[0] = True
        start = breakdown.clock()
        try:
            return original(*args, **kwargs)
        finally:
            guard[0] = False
            breakdown.add(phase, breakdown.clock() - start)

    timed.__wrapped__ = original
    setattr(obj, name, timed)


def time_communicator(communicator, breakdown):
    """Charges the communicator's gradient allreduce to ``allreduce``.

    The methods are replaced on the instance only; ``bcast_data`` (the
    multi-node optimizer's first-iteration broadcast) goes to the
    ``bcast`` detail of ``other``.
    """
    guard = [False]
    for name in _ALLREDUCE_METHODS:
        if hasattr(communicator, name):
            _timed_method(communicator, name, breakdown, 'allreduce', guard)
    for name in _BCAST_METHODS:
        if hasattr(communicator, name):
            _timed_method(communicator, name, breakdown, 'bcast', guard)


class TimedUpdater(updaters.StandardUpdater):
    """``StandardUpdater`` that times load, forward, backward, allreduce.

    It does what ``StandardUpdater.update_core`` does, but computes the loss
    and calls ``backward()`` itself, then ``optimizer.update()`` without a
    loss function (which is how ``_MultiNodeOptimizer`` averages the
    gradients and updates), so each phase can be timed.

    Args:
        iterator, optimizer, converter, device, loss_func, **kwargs: As for
            :class:`~chainer.training.updaters.StandardUpdater`.
        synchronize (callable): Called before each time stamp (e.g. a CUDA
            device's ``synchronize``); ``None`` for the CPU.

    Attributes:
        breakdown (TimeBreakdown): The recorded times.
    """

    def __init__(self, iterator, optimizer, converter=convert.concat_examples,
                 device=None, loss_func=None, synchronize=None, **kwargs):
        super(TimedUpdater, self).__init__(
            iterator, optimizer, converter=converter, device=device,
            loss_func=loss_func, **kwargs)
        self.breakdown = TimeBreakdown()
        self._synchronize = synchronize
        communicator = getattr(optimizer, 'communicator', None)
        if communicator is not None:
            time_communicator(communicator, self.breakdown)

    def _now(self):
        if self._synchronize is not None:
            self._synchronize()
        return self.breakdown.clock()

    def update_core(self):
        breakdown = self.breakdown
        iterator = self._iterators['main']
        optimizer = self._optimizers['main']
        # The batch next() returns belongs to this epoch (1-based).
        breakdown.start_iteration(iterator.epoch + 1)

        t0 = self._now()
        batch = iterator.next()
        t1 = self._now()
        in_arrays = convert._call_converter(
            self.converter, batch, self.input_device)
        t2 = self._now()

        loss_func = self.loss_func or optimizer.target
        if isinstance(in_arrays, tuple):
            loss = loss_func(*in_arrays)
        elif isinstance(in_arrays, dict):
            loss = loss_func(**in_arrays)
        else:
            loss = loss_func(in_arrays)
        t3 = self._now()

        target = optimizer.target
        if getattr(optimizer, '_use_cleargrads', True):
            target.cleargrads()
        else:
            target.zerograds()
        loss.backward(loss_scale=getattr(optimizer, '_loss_scale', None))
        del loss
        t4 = self._now()

        # _MultiNodeOptimizer: allreduce (timed by time_communicator) and
        # the actual update; bcast_data instead on the first call.
        allreduce_before = breakdown._iteration['allreduce']
        bcast_before = breakdown._iteration['bcast']
        optimizer.update()
        t5 = self._now()
        communication = (breakdown._iteration['allreduce'] - allreduce_before
                         + breakdown._iteration['bcast'] - bcast_before)

        if self.auto_new_epoch and iterator.is_new_epoch:
            optimizer.new_epoch(auto=True)

        breakdown.add('load', t1 - t0)
        breakdown.add('convert', t2 - t1)
        breakdown.add('forward', t3 - t2)
        breakdown.add('backward', t4 - t3)
        breakdown.add('update', max(t5 - t4 - communication, 0.0))
        self._update_end = self._now()


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class _ReportBreakdown(extension.Extension):
    """Reports the epoch sums, at an epoch's end, before ``LogReport``."""

    trigger = 1, 'iteration'
    priority = extension.PRIORITY_READER + 1
    name = 'time_breakdown_report'

    def __init__(self, updater):
        self._updater = updater

    def __call__(self, trainer):
        updater = self._updater
        if not updater.is_new_epoch:
            return
        record = updater.breakdown.current_epoch()
        if record is None:
            return
        values = {'time/' + key: record[key]
                  for key in COMPONENTS + ('wall',)}
        chainer.reporter.report(values)


class _CloseIteration(extension.Extension):
    """Closes the iteration after every other extension; writes the JSON."""

    trigger = 1, 'iteration'
    priority = -1000  # after snapshot (-100) and everything else
    name = 'time_breakdown_close'

    def __init__(self, updater, path, info, iterator, clock_origin=None):
        self._updater = updater
        self._path = path
        self._info = info
        self._iterator = iterator
        self._clock_origin = clock_origin

    def __call__(self, trainer):
        updater = self._updater
        breakdown = updater.breakdown
        if not breakdown.in_iteration:
            return
        now = breakdown.clock()
        end = getattr(updater, '_update_end', None)
        if end is not None:
            breakdown.add('extensions', now - end)
        breakdown.end_iteration(now)
        if updater.is_new_epoch:
            breakdown.end_epoch()
            self.write()

    def write(self):
        data = dict(self._info)
        breakdown = self._updater.breakdown
        data.update(breakdown.to_dict())
        if self._clock_origin is not None and breakdown.started_at:
            # From the start of main() to the first iteration's start.
            data['setup_seconds'] = breakdown.started_at - self._clock_origin
        stats = getattr(self._iterator, 'stats', None)
        if isinstance(stats, dict):
            # Read before Trainer.run finalizes the iterator.
            data['iterator_stats'] = _jsonable(stats)
        directory = os.path.dirname(self._path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        partial = self._path + '.partial'
        with open(partial, 'w') as f:
            json.dump(data, f, indent=1)
        os.replace(partial, self._path)


def install_time_breakdown(trainer, updater, path, info=None,
                           clock_origin=None):
    """Adds the reporting and JSON-writing extensions to ``trainer``.

    Args:
        trainer: The trainer, whose updater is ``updater``.
        updater (TimedUpdater): The updater recording the times.
        path (str): Where to write the JSON (rewritten every epoch).
        info (dict): Extra keys for the JSON (rank, size, options...).
        clock_origin (float): ``time.perf_counter()`` taken when the
            script started; the JSON then has ``setup_seconds``, the time
            from it to the first iteration.
    """
    trainer.extend(_ReportBreakdown(updater))
    trainer.extend(_CloseIteration(updater, path, info or {},
                                   updater.get_iterator('main'),
                                   clock_origin))
