"""Stage 2: which files an example reads, and making their local forms.

* :mod:`.dataset_files`: the files behind Chainer's dataset wrappers (pure);
* :mod:`.sources`: plain files and derived files, one interface;
* :mod:`.local_directory`: the safe local directory (partial files, locks,
  atomic renames, no symlink followed);
* :mod:`.capacity`: the byte budget shared by every process of a directory;
* :mod:`.local_memory`: local forms kept in the training process's memory
  instead (``local_dir=':memory:'``), with a budget of their own;
* :mod:`.local_store`: directory + budget + eviction policy, what stage 2
  calls;
* :mod:`.copy_threads`: the threads that run the copies, and the note on
  how one-at-a-time copies (row groups) are read ahead;
  :mod:`.read_ahead_slots` keeps the count of that read ahead (pure);
  :mod:`.piece_reads` reads their pieces.
"""
from chainer_prefetch.errors import LocalStorageError, SourceFileError  # NOQA
from chainer_prefetch.staging.dataset_files import (  # NOQA
    DatasetFiles, resolve_dataset_files)
from chainer_prefetch.staging.local_directory import (  # NOQA
    LocalDirectory, LocalPathMap)
from chainer_prefetch.staging.local_memory import LocalMemory  # NOQA
from chainer_prefetch.staging.local_store import LocalStore  # NOQA
from chainer_prefetch.staging.sources import (  # NOQA
    DerivedFile, PlainFile, Source, as_source)
