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

The policies, the settings, the errors and the job address are pure and
import without the ``[elastic]`` extra.  :class:`ElasticCommunicator`,
:class:`ElasticTraining` and :class:`EtcdServer` need the extra (etcd3gw),
PyTorch (:data:`TORCH_INSTALL`: installed apart, since PyTorch 2.13 declares
``setuptools>=77``, which Chainer 7.8.1 cannot import with) and an etcd
server; they are imported on first use, with an ``ImportError`` that says
what to install when something is missing.  See ``docs/elastic.rst``.
"""
import importlib

from chainer_prefetch._extras import require_extra
from chainer_prefetch.elastic.errors import (
    ElasticError,
    EtcdUnavailable,
    IncompatibleMember,
    JobFinished,
    MembershipChanged,
    ScaleFailed,
)
from chainer_prefetch.elastic.etcd_url import EtcdUrl, parse_etcd_url
from chainer_prefetch.elastic.policy import FailStop, MinMax, Progress, ScalePolicy
from chainer_prefetch.elastic.settings import ElasticSettings

TORCH_INSTALL = ('pip install --no-deps torch==2.13.0 '
                 '--index-url https://download.pytorch.org/whl/cpu')
"""The command that installs PyTorch (CPU wheel, gloo transport) without its
declared ``setuptools>=77``; the ``[elastic]`` extra brings its other
dependencies."""

_NEED_THE_EXTRA = {
    'ElasticCommunicator': 'chainer_prefetch.elastic.communicator',
    'ElasticTraining': 'chainer_prefetch.elastic.training',
    'EtcdServer': 'chainer_prefetch.elastic.etcd',
}
"""The names that need torch and etcd3gw, and the module of each."""

__all__ = ['ElasticError', 'ElasticSettings', 'EtcdUnavailable', 'EtcdUrl',
           'FailStop', 'IncompatibleMember', 'JobFinished',
           'MembershipChanged', 'MinMax', 'Progress', 'ScaleFailed',
           'ScalePolicy', 'TORCH_INSTALL', 'parse_etcd_url'
           ] + sorted(_NEED_THE_EXTRA)


def __getattr__(name: str):
    """Imports a name of :data:`_NEED_THE_EXTRA` on first use (PEP 562).

    Raises:
        ImportError: etcd3gw or torch cannot be imported (the message
            says how to install it).
        AttributeError: no such name.
    """
    module = _NEED_THE_EXTRA.get(name)
    if module is None:
        raise AttributeError('module {!r} has no attribute {!r}'.format(
            __name__, name))
    part = 'chainer_prefetch.elastic.' + name
    require_extra('elastic', part, ['etcd3gw'])
    require_extra('elastic', part, ['torch'], install=TORCH_INSTALL)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
