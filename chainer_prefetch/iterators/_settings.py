"""The options of PrefetchMultiprocessIterator, validated once, in one frozen object."""
import dataclasses
import multiprocessing
import os
import re
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import numpy
from chainer.iterators.order_samplers import ShuffleOrderSampler

from chainer_prefetch.errors import StagingWarning
from chainer_prefetch.policy.eviction import STRATEGIES
from chainer_prefetch.staging.local_memory import MEMORY
from chainer_prefetch.staging.source_checks import RECHECK


@dataclasses.dataclass(frozen=True)
class IteratorSettings:
    """Every option of :class:`~chainer_prefetch.PrefetchMultiprocessIterator`.

    The fields are the iterator's arguments (documented there).  After
    construction ``order_sampler`` is the sampler in use (``shuffle`` turned
    into a ``ShuffleOrderSampler``, or ``None`` for index order) and
    ``n_processes`` a number (of loader threads with ``loader_threads``,
    and then ``shared_mem`` 0: no shared memory).

    Raises:
        ValueError: an option is out of range, both ``shuffle`` and
            ``order_sampler`` are given, or ``loader_threads`` comes with
            ``maxtasksperchild`` or ``shared_mem``.
    """

    dataset: Any
    batch_size: int
    repeat: bool = True
    shuffle: Optional[bool] = None
    n_processes: Optional[int] = None
    n_prefetch: int = 1
    shared_mem: Optional[int] = None
    order_sampler: Optional[Callable] = None
    dataset_timeout: Optional[float] = 30.0
    maxtasksperchild: Optional[int] = None
    local_dir: Optional[str] = None
    n_copy_threads: int = 16
    n_copy_ahead: int = 16
    local_capacity: Optional[int] = None
    eviction_policy: str = 'belady'
    next_epoch_cache_examples: Optional[int] = None
    next_epoch_cache_bytes: Optional[int] = None
    recheck_sources: str = 'directories'
    columnar: Optional[bool] = None
    loader_threads: bool = False
    peers: Any = None

    def __post_init__(self):
        object.__setattr__(self, 'local_dir', _local_dir(self.local_dir))
        for name in ('batch_size', 'n_copy_threads', 'n_copy_ahead'):
            _check_positive_int(name, getattr(self, name))
        for name in ('n_processes', 'maxtasksperchild', 'local_capacity',
                     'next_epoch_cache_examples', 'next_epoch_cache_bytes'):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.shared_mem is not None and self.shared_mem != 0:
            _check_positive_int('shared_mem', self.shared_mem,
                                '(or 0: pickle every batch)')
        if not isinstance(self.loader_threads, bool):
            raise ValueError('loader_threads must be True or False, got {!r}'
                             .format(self.loader_threads))
        if self.local_dir == MEMORY and not (self.loader_threads
                                             and self.local_capacity):
            raise ValueError(
                "local_dir={!r} keeps row groups in the training process's "
                'memory, where only loader threads read them: it needs '
                'loader_threads=True and local_capacity (bytes of memory to '
                'use), got loader_threads={!r}, local_capacity={!r}'.format(
                    MEMORY, self.loader_threads, self.local_capacity))
        if self.loader_threads:
            for name in ('maxtasksperchild', 'shared_mem'):
                if getattr(self, name):
                    raise ValueError(
                        '{} applies to loader processes; it cannot be combined '
                        'with loader_threads=True'.format(name))
            # Loader threads hand batches over in this process's memory.
            object.__setattr__(self, 'shared_mem', 0)
        if self.peers is not None and (self.local_dir is None
                                       or self.local_dir == MEMORY):
            raise ValueError('peers copy files into a local directory: give '
                             'local_dir a directory, got {!r}'.format(
                                 self.local_dir))
        if self.recheck_sources not in RECHECK:
            raise ValueError('recheck_sources must be one of {}, got {!r}'
                             .format(', '.join(RECHECK), self.recheck_sources))
        if self.eviction_policy not in STRATEGIES:
            raise ValueError('eviction_policy must be one of {}, got {!r}'
                             .format(', '.join(STRATEGIES), self.eviction_policy))
        sampler = self.order_sampler
        if self.shuffle is not None:
            if sampler is not None:
                raise ValueError('`shuffle` is not `None` and a custom '
                                 '`order_sampler` is set. Please set '
                                 '`shuffle` to `None` to use the custom '
                                 'order sampler.')
            if self.shuffle:
                sampler = ShuffleOrderSampler()
        elif sampler is None:
            sampler = ShuffleOrderSampler()
        object.__setattr__(self, 'order_sampler', sampler)
        has_columns = callable(getattr(self.dataset, 'get_columns', None))
        if self.columnar and not has_columns:
            raise ValueError('columnar=True needs a dataset with get_columns(indices); '
                             '{} has none'.format(type(self.dataset).__name__))
        columnar = (has_columns and not self.next_epoch_cache
                    if self.columnar is None else self.columnar)
        if columnar and self.next_epoch_cache:
            raise ValueError('the next-epoch cache does not apply to columnar '
                             'batches; pass columnar=False to load row by row')
        object.__setattr__(self, 'columnar', bool(columnar))
        object.__setattr__(self, 'n_processes',
                           self.n_processes or multiprocessing.cpu_count())
        object.__setattr__(self, 'n_prefetch', max(self.n_prefetch, 1))

    @property
    def next_epoch_cache(self) -> bool:
        """Whether the next-epoch cache is on."""
        return (self.next_epoch_cache_examples is not None
                or self.next_epoch_cache_bytes is not None)

    def copy_settings(self) -> 'IteratorSettings':
        """The settings of a copy: the same sampler object, as Chainer's ``__copy__`` does."""
        return dataclasses.replace(self, shuffle=None)



FIELDS = frozenset(field.name for field in dataclasses.fields(IteratorSettings))


def _check_positive_int(name, value, alternative=''):
    if isinstance(value, bool) or not isinstance(value, (int, numpy.integer)) \
            or value < 1:
        raise ValueError('{} must be a positive integer{}, got {!r}'.format(
            name, ' ' + alternative if alternative else '', value))


_WARNED_PATHS: Dict[str, str] = {}
_VARIABLE = re.compile(r'\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)')


def _local_dir(local_dir):
    """``local_dir`` as a string with ``~`` expanded (warns about ``$NAME``)."""
    if local_dir is None or local_dir == MEMORY:
        return local_dir
    try:
        path = os.fspath(local_dir)
    except TypeError:
        raise TypeError('local_dir must be a path (str or os.PathLike), '
                        'None or {!r}, got {!r}'.format(MEMORY, local_dir))
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    variable = _VARIABLE.search(path)
    path = os.path.expanduser(path)
    if variable and path not in _WARNED_PATHS:
        name = variable.group(1).strip('{}')
        unset = name not in os.environ
        _WARNED_PATHS[path] = (
            'local_dir {!r} contains {!r}, which {}: the copies go to a '
            'directory literally named {!r}; {}'.format(
                path, variable.group(0),
                'is not set in this environment' if unset
                else 'Python does not expand', variable.group(0),
                'set {} (the job scheduler sets TMPDIR on most clusters) or '
                'give a path'.format(name) if unset else
                'expand it yourself (os.path.expandvars(...), or an '
                'f-string with os.environ[...])'))
        warnings.warn(_WARNED_PATHS[path], StagingWarning, stacklevel=5)
    return path


def local_dir_warnings(local_dir) -> Tuple[str, ...]:
    """The warnings given about ``local_dir`` (see ``_local_dir``)."""
    message = _WARNED_PATHS.get(local_dir)
    return () if message is None else (message,)
