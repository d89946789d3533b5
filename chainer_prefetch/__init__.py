"""chainer_prefetch: feed Chainer training from shared storage at local-disk speed."""
from chainer_prefetch.errors import (  # NOQA
    ChainerPrefetchError, ExampleLoadError, WorkerDiedError)
from chainer_prefetch.iterators import PlannedIterator, PrefetchMultiprocessIterator  # NOQA
from chainer_prefetch.staging import resolve_dataset_files  # NOQA

__version__ = '0.1.0'
