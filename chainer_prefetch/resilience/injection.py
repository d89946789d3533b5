"""Failure injection for tests and experiments, and the event log.

:class:`FailureInjector` is a trainer extension, registered on every rank,
that makes one chosen rank fail once, at an iteration or after some wall
time: ``kill`` (``SIGKILL``), ``stop`` (``SIGSTOP``, a hung process) or
``exit`` (``os._exit(1)`` without ``MPI_Finalize``).  Replacements and
restarted jobs never inject again.

:class:`EventLog` appends timestamped JSON lines (wall-clock time, so that
events of different processes and of relaunched jobs can be compared) that
the experiment script reads to measure recovery times.
"""
import json
import os
import signal
import time
from typing import Optional

import chainer

FAILURE_MODES = ('kill', 'stop', 'exit')


def fail_now(mode: str) -> None:
    """Makes this process fail now: ``kill`` (``SIGKILL``), ``stop``
    (``SIGSTOP``) or ``exit`` (``os._exit(1)``, without ``MPI_Finalize``).

    Raises:
        ValueError: unknown mode.
    """
    if mode == 'kill':
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == 'stop':
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == 'exit':
        os._exit(1)
    else:
        raise ValueError('failure mode must be one of {}, got {!r}'.format(
            ', '.join(FAILURE_MODES), mode))


def injection_due(iteration: int, elapsed: float, at_iteration: Optional[int],
                  at_seconds: Optional[float]) -> bool:
    """Whether a failure planned at an iteration or a time is due now."""
    if at_iteration is not None and iteration >= at_iteration:
        return True
    return at_seconds is not None and elapsed >= at_seconds


class EventLog:
    """Appends events (one JSON object per line) to a file.

    Args:
        path: The file (created; None: events are dropped).
        rank: Written into every event.
    """

    def __init__(self, path: Optional[str], rank: int):
        self.path = path
        self.rank = rank

    def write(self, event: str, sync: bool = True, **fields) -> None:
        """Writes ``event`` now, forced to disk unless ``sync`` is False (an
        event may be the last one of the process)."""
        if self.path is None:
            return
        record = dict(event=event, time=time.time(), rank=self.rank, **fields)
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(self.path, 'a') as f:
            f.write(json.dumps(record) + '\n')
            f.flush()
            if sync:
                os.fsync(f.fileno())


def read_events(path: str) -> list:
    """The events of an :class:`EventLog` file (missing file: none)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class FailureInjector(chainer.training.Extension):
    """Makes ``rank`` fail once (see the module docstring).

    Args:
        rank: This process's rank.
        target_rank: The rank that fails.
        mode: ``kill``, ``stop`` or ``exit``.
        at_iteration: Fail after this iteration (or None).
        at_seconds: Fail once the trainer has trained this many seconds
            (``trainer.elapsed_time``, the clock of Chainer's ``TimeTrigger``
            and of the snapshots), or None.
        events: Where the failure is recorded before it happens.

    Raises:
        ValueError: unknown mode, or neither a time nor an iteration.
    """

    trigger = (1, 'iteration')
    priority = chainer.training.PRIORITY_WRITER
    name = 'FailureInjector'

    def __init__(self, rank: int, target_rank: int, mode: str = 'kill',
                 at_iteration: Optional[int] = None,
                 at_seconds: Optional[float] = None,
                 events: Optional[EventLog] = None):
        if mode not in FAILURE_MODES:
            raise ValueError('failure mode must be one of {}, got {!r}'.format(
                ', '.join(FAILURE_MODES), mode))
        if at_iteration is None and at_seconds is None:
            raise ValueError('give the failure an iteration or a time')
        self.rank = rank
        self.target_rank = target_rank
        self.mode = mode
        self.at_iteration = at_iteration
        self.at_seconds = at_seconds
        self.events = events

    def __call__(self, trainer) -> None:
        if self.rank != self.target_rank or not injection_due(
                trainer.updater.iteration, trainer.elapsed_time,
                self.at_iteration, self.at_seconds):
            return
        if self.events is not None:
            self.events.write('failure', mode=self.mode,
                              iteration=trainer.updater.iteration)
        fail_now(self.mode)
