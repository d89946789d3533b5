"""Iterators."""
from chainer_prefetch.iterators.planned_iterator import PlannedIterator  # NOQA
from chainer_prefetch.iterators.prefetch_multiprocess_iterator import PrefetchMultiprocessIterator  # NOQA
from chainer_prefetch.iterators._worker_pool import start_loader_server  # NOQA
