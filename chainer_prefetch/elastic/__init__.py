"""Elastic data-parallel training: members join and leave a running job.

Every process registers under a job key in etcd (a leased key per member),
a user :class:`ScalePolicy` decides after each settled change whether the
job runs, waits or fails, and the group, the data split, the learning rate
and the iterators are rebuilt in-process over ``torch.distributed`` gloo.
A process started later with the same job address joins the running job.

* :class:`ElasticCommunicator`: a ChainerMN communicator (etcd membership,
  gloo transport, rebuilt per generation).
* :class:`ElasticTraining`: the in-process rebuild of a Chainer trainer.
* :class:`ScalePolicy`, :class:`FailStop`, :class:`MinMax`: policies.
* :class:`ElasticSettings`: time limits.
* :class:`EtcdServer`: a private local etcd (tests, experiments, trying it).

Needs the ``[elastic]`` extra (torch, etcd3gw) and an etcd server.  See
``docs/elastic.rst``.
"""
try:
    import etcd3gw  # NOQA: F401
    import torch.distributed  # NOQA: F401
except ImportError as error:
    raise ImportError(
        'chainer_prefetch.elastic needs the [elastic] extra: pip install '
        '"chainer_prefetch[elastic]" (torch and etcd3gw; missing: {})'
        .format(error.name)) from error

from chainer_prefetch.elastic.communicator import ElasticCommunicator  # NOQA
from chainer_prefetch.elastic.errors import ElasticError  # NOQA
from chainer_prefetch.elastic.errors import EtcdUnavailable  # NOQA
from chainer_prefetch.elastic.errors import IncompatibleMember  # NOQA
from chainer_prefetch.elastic.errors import JobFinished  # NOQA
from chainer_prefetch.elastic.errors import MembershipChanged  # NOQA
from chainer_prefetch.elastic.errors import ScaleFailed  # NOQA
from chainer_prefetch.elastic.etcd import EtcdServer  # NOQA
from chainer_prefetch.elastic.etcd import parse_etcd_url  # NOQA
from chainer_prefetch.elastic.policy import FailStop  # NOQA
from chainer_prefetch.elastic.policy import MinMax  # NOQA
from chainer_prefetch.elastic.policy import Progress  # NOQA
from chainer_prefetch.elastic.policy import ScalePolicy  # NOQA
from chainer_prefetch.elastic.settings import ElasticSettings  # NOQA
from chainer_prefetch.elastic.training import ElasticTraining  # NOQA
