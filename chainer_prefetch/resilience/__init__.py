"""Fault-tolerant data-parallel training with ULFM (MPI fault tolerance).

* :class:`FaultTolerantCommunicator`: a ChainerMN CPU communicator whose
  every survivor raises :class:`ProcessFailure` when a rank fails.
* :class:`FaultTolerantTraining`: in-process recovery of a trainer by
  ``respawn`` (replacements) or ``shrink`` (continue with the survivors).
* :func:`check_ulfm`: startup check that ULFM is really active.
* :class:`FailureInjector`: kill, stop or end a rank for tests and
  experiments.
* ``python -m chainer_prefetch.resilience.launcher``: checkpoint/restart
  (relaunches a failed ``mpirun`` job, which resumes from its snapshot).

See ``docs/fault_tolerance.rst``.  The modules that talk to other ranks
(``communicator``, ``recovery``, ``spares``, ``training``, and
:func:`check_ulfm` when called) need ``mpi4py`` and Open MPI, ``pip install
'chainer_prefetch[mpi]'``, and raise an ``ImportError`` that says so
without them; the rest imports without mpi4py.
"""
from chainer_prefetch.policy.lr_rules import LR_RULES
from chainer_prefetch.resilience.errors import (
    ProcessFailure,
    RecoveryFailed,
    ResilienceError,
    UlfmUnavailable,
)
from chainer_prefetch.resilience.ulfm import check_ulfm, ulfm_status
from chainer_prefetch.resilience.watchdog import WatchdogSettings

__all__ = ['LR_RULES', 'ProcessFailure', 'RecoveryFailed', 'ResilienceError',
           'UlfmUnavailable', 'WatchdogSettings', 'check_ulfm', 'ulfm_status']
