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

See ``docs/fault_tolerance.rst``.  Needs ``mpi4py`` and Open MPI:
``pip install 'chainer_prefetch[mpi]'``.
"""
from chainer_prefetch._extras import require_extra

require_extra('mpi', 'chainer_prefetch.resilience', ['mpi4py'])

from chainer_prefetch.resilience.errors import (  # noqa: E402
    ProcessFailure,
    RecoveryFailed,
    UlfmUnavailable,
)
from chainer_prefetch.resilience.policy import LR_RULES  # noqa: E402
from chainer_prefetch.resilience.ulfm import check_ulfm, ulfm_status  # noqa: E402
from chainer_prefetch.resilience.watchdog import WatchdogSettings  # noqa: E402

__all__ = ['LR_RULES', 'ProcessFailure', 'RecoveryFailed', 'UlfmUnavailable',
           'WatchdogSettings', 'check_ulfm', 'ulfm_status']
