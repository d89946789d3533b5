"""Exceptions of elastic training.

Every one names what went wrong and where (the etcd address, the job key,
the member, the setting that differs) so that a job never ends silently.
"""
from chainer_prefetch.errors import ChainerPrefetchError


class ElasticError(ChainerPrefetchError, RuntimeError):
    """Base class of the errors of :mod:`chainer_prefetch.elastic`.

    Also a ``RuntimeError``, as it was before it had the package's base.
    """


class EtcdUnavailable(ElasticError):
    """etcd could not be reached (at start, or for longer than the bound
    ``ElasticSettings.etcd_timeout`` during the run)."""


class IncompatibleMember(ElasticError):
    """A process tried to join a job whose settings differ from its own
    (another model, dataset size or batch size under the same job key)."""


class ScaleFailed(ElasticError):
    """The scale policy said ``'fail'``, or kept the job waiting longer than
    ``ElasticSettings.wait_timeout``: the job ends."""


class JobFinished(ElasticError):
    """The job ended (normally) before this member was given work, e.g. a
    standby member or a process that joined during the last iteration."""


class MembershipChanged(ElasticError):
    """The group of this generation is no longer valid: a member left or
    joined, or a collective failed or made no progress.

    Raised from a collective or at an iteration boundary; the training loop
    (:class:`~chainer_prefetch.elastic.training.ElasticTraining`) catches it
    and rebuilds.  Code that uses the communicator without that class sees
    it as the signal to call ``communicator.rebuild()``.
    """
