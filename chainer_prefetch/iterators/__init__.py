"""Iterators."""
from chainer_prefetch.iterators.prefetch_multiprocess_iterator import PrefetchMultiprocessIterator  # NOQA
