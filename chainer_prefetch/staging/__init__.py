"""Stage 2: which files an example reads, and copying them to local storage."""
from chainer_prefetch.staging.dataset_files import DatasetFiles, resolve_dataset_files  # NOQA
from chainer_prefetch.staging.local_directory import (  # NOQA
    LocalDirectory, LocalPathMap, LocalStorageError, SourceFileError)
