"""Exceptions of the fault-tolerance layer."""
from typing import Sequence

from chainer_prefetch.errors import ChainerPrefetchError


class ResilienceError(ChainerPrefetchError, RuntimeError):
    """Base class of the errors of :mod:`chainer_prefetch.resilience`.

    Also a ``RuntimeError``, as each of them was before it had the package's
    base.
    """


class ProcessFailure(ResilienceError):
    """A peer process failed; the communicator has been revoked.

    Every surviving rank raises this exception from the collective it was in
    (or from its next one), so all of them can start the same recovery.

    Attributes:
        rank: Rank of the process that raises it (in the broken communicator).
        operation: The MPI call that failed (e.g. ``'Allreduce'``).
        failed_ranks: Ranks known to have failed (may be empty when the
            failure was only seen as a revoked communicator).
    """

    def __init__(self, rank: int, operation: str,
                 failed_ranks: Sequence[int] = (), cause: str = ''):
        self.rank = rank
        self.operation = operation
        self.failed_ranks = tuple(failed_ranks)
        message = 'rank {}: process failure during MPI {}'.format(
            rank, operation)
        if self.failed_ranks:
            message += ' (failed ranks: {})'.format(
                ', '.join(str(r) for r in self.failed_ranks))
        if cause:
            message += ': ' + cause
        super().__init__(message)


class UlfmUnavailable(ResilienceError):
    """ULFM (MPI fault tolerance) is not active in this MPI job."""


class RecoveryFailed(ResilienceError):
    """Recovery from a process failure was impossible (e.g. too few ranks)."""
