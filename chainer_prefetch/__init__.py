"""chainer_prefetch: feed Chainer training from shared storage at local-disk speed."""
from chainer_prefetch.errors import (  # NOQA
    ChainerPrefetchError, ExampleLoadError, StagingWarning, WorkerDiedError)
from chainer_prefetch.iterators import (  # NOQA
    PlannedIterator, PrefetchMultiprocessIterator, start_loader_server)
from chainer_prefetch.policy.rank_shuffle import ShuffleAcrossRanks  # NOQA
from chainer_prefetch.staging import resolve_dataset_files  # NOQA
from chainer_prefetch.staging.peers import PeerGroup  # NOQA

__version__ = '0.1.0'
