"""Local forms kept in the training process's memory: ``local_dir=':memory:'``.

With loader threads (``loader_threads=True``) the loaders run in the
training process, so a local form need not be a file: stage 2 can keep it
in memory, where the loader threads read it.  For Parquet row groups that
saves writing each decoded row group to a local file, which can cost more
CPU than reading and decoding it.

:class:`LocalMemory` stands where :class:`~.local_directory.LocalDirectory`
stands in a :class:`~.local_store.LocalStore`: the same methods (stage,
check, evict), and a :class:`MemoryLedger` for the byte budget in place of
the directory's ledger file.  The store's eviction policy keeps the budget
(``local_capacity``) as it keeps a directory's.

Only sources with an in-memory form can be kept
(:attr:`~.sources.Source.has_memory_form`: Parquet row groups).  A copy of
another (a dataset that mixes row groups and plain files) is refused with
:class:`~chainer_prefetch.errors.LocalStorageError`, which makes the store
read every item from shared storage from then on, as for a full disk; so
is a copy for which memory ran out (``ENOMEM``).
"""
import errno
import os
import threading
from typing import Any, Dict, Optional, Union

from chainer_prefetch.errors import LocalStorageError
from chainer_prefetch.staging.sources import Source, as_source

#: The ``local_dir`` that keeps local forms in memory (SQLite's name for it).
MEMORY = ':memory:'
_WAIT_SECONDS = 0.05


class MemoryLedger:
    """The byte budget of a :class:`LocalMemory`; the methods of ``CapacityLedger``.

    Thread-safe.  Bytes are counted from reservation (estimate) to
    settlement (real size) as the directory's ledger counts them, in this
    process only.  Once closed, nothing is kept and nothing counts: it
    reserves nothing more, and a copy that ends later adds nothing.

    Args:
        limit_bytes: The budget.
    """

    def __init__(self, limit_bytes: int):
        self.limit_bytes = int(limit_bytes)
        self._lock = threading.Lock()
        self._reserved = self._settled = 0
        self._closed = False

    def reserve(self, n_bytes: int) -> bool:
        """Reserves ``n_bytes`` if they fit under the limit (never once closed)."""
        with self._lock:
            if self._closed or (self._reserved + self._settled + n_bytes
                                > self.limit_bytes):
                return False
            self._reserved += n_bytes
            return True

    def release(self, n_bytes: int):
        """Gives back a reservation that was not used."""
        self._count(reserved=-n_bytes)

    def settle(self, reserved: int, written: int):
        """A local form of ``written`` bytes, reserved as ``reserved``, is about to be kept."""
        self._count(reserved=-reserved, settled=written)

    def freed(self, n_bytes: int):
        """A kept local form of ``n_bytes`` was dropped (evicted)."""
        self._count(settled=-n_bytes)

    def used_bytes(self) -> int:
        """Bytes counted against the budget now (0 once closed)."""
        with self._lock:
            return self._reserved + self._settled

    def close(self):
        """The forms are dropped: nothing counts any more."""
        with self._lock:
            self._closed = True
            self._reserved = self._settled = 0

    def _count(self, reserved: int = 0, settled: int = 0):
        with self._lock:
            if not self._closed:  # (reservations never go below 0, as in CapacityLedger)
                self._reserved = max(0, self._reserved + reserved)
                self._settled += settled


class _Form:
    """A kept local form: the value, its bytes, and the origin it was made from."""

    __slots__ = ('value', 'n_bytes', 'origin_key')

    def __init__(self, value: Any, n_bytes: int, origin_key: tuple):
        self.value = value
        self.n_bytes = n_bytes
        self.origin_key = origin_key


def _origin_key(origin_stat: os.stat_result) -> tuple:
    return (origin_stat.st_ino, origin_stat.st_size, origin_stat.st_mtime_ns)


class LocalMemory:
    """Keeps local forms of sources in this process's memory; see the module docstring.

    Thread-safe: stage 2's threads make forms while loader threads read
    them (:meth:`form_of`).  A loader thread that holds a form keeps it
    alive after it is evicted, as a process that has a local file open
    keeps reading it.

    Attributes:
        root, data_root: ``':memory:'``; errors about a form that is not
            kept name ``':memory:/<source name>'``.

    Args:
        stop_event: Set to make a copy that waits for another thread's copy
            of the same source give up (raises :class:`InterruptedError`).
    """

    def __init__(self, stop_event: Optional[threading.Event] = None):
        self.root = self.data_root = MEMORY
        self._stop_event = stop_event or threading.Event()
        self._changed = threading.Condition()
        self._forms: Dict[str, _Form] = {}
        self._making = set()
        self._closed = False

    def capacity_ledger(self, limit_bytes: int) -> MemoryLedger:
        """The ledger that keeps this memory's budget."""
        return MemoryLedger(limit_bytes)

    def close(self):
        """Drops every kept form, and keeps none from now on.

        Loader threads still holding a form keep it; a copy still running
        ends without keeping its form.
        """
        with self._changed:
            self._closed = True
            self._forms.clear()
            self._changed.notify_all()

    def locate(self, source: Union[str, Source]) -> Any:
        """What the dataset's located view reads for ``source``.

        The kept form of a source that has one (:meth:`form_of`, looked up
        when the view reads it); for another, its own path, since none is
        ever kept (a view that resolves its paths when it is made, as the
        datasets of plain files do, then reads the files themselves).
        """
        source = as_source(source)
        return self.form_of(source) if source.has_memory_form else source.name

    def local_path(self, source: Union[str, Source]) -> str:
        """The name of ``source``'s form in messages: ``':memory:/<name>'``."""
        return MEMORY + '/' + as_source(source).name.lstrip('/')

    def is_current(self, source: Union[str, Source],
                   origin_stat: os.stat_result) -> bool:
        """Whether a form of ``source`` made from the origin as it is now is kept."""
        with self._changed:
            return self._is_current(as_source(source).name, origin_stat)

    def has_local(self, source: Union[str, Source]) -> bool:
        """Whether a form of ``source`` is kept (its origin is not looked at)."""
        with self._changed:
            return as_source(source).name in self._forms

    def _is_current(self, name, origin_stat) -> bool:
        form = self._forms.get(name)
        return form is not None and form.origin_key == _origin_key(origin_stat)

    def form_of(self, source: Union[str, Source]) -> Any:
        """The kept form of ``source``.

        Raises:
            FileNotFoundError: none is kept (never made, or evicted); its
                ``filename`` is :meth:`local_path`.
        """
        with self._changed:
            form = self._forms.get(as_source(source).name)
        if form is None:
            raise FileNotFoundError(errno.ENOENT, 'local form not in memory '
                                    '(not made yet, or evicted)',
                                    self.local_path(source))
        return form.value

    def stage(self, source: Union[str, Source],
              origin_stat: Optional[os.stat_result] = None,
              before_rename=None) -> int:
        """Makes sure a current form of ``source`` is kept.

        Args:
            source: A source with :attr:`~.sources.Source.has_memory_form`.
            origin_stat: ``source.stat_origin()`` if the caller has it.
            before_rename: Called with the form's bytes once it is made, just
                before it is kept (the ledger counts it then); an exception
                from it drops the form.

        Returns:
            The form's bytes, or 0 when a current one was kept already.

        Raises:
            SourceFileError: the origin cannot be read.
            LocalStorageError: ``source`` has no in-memory form, or memory
                ran out.
            InterruptedError: ``stop_event`` was set while waiting, or
                :meth:`close` was called.
        """
        source = as_source(source)
        if not source.has_memory_form:
            raise LocalStorageError(
                errno.EINVAL, "{} cannot be kept in memory (local_dir="
                "':memory:' keeps Parquet row groups only)".format(source),
                self.local_path(source))
        if origin_stat is None:
            origin_stat = source.stat_origin()
        with self._changed:
            self._check_open(source)
            while source.name in self._making:  # another thread makes it
                if self._stop_event.is_set():
                    raise InterruptedError('stopped while waiting for another '
                                           'copy of {}'.format(source))
                self._changed.wait(_WAIT_SECONDS)
                self._check_open(source)
            if self._is_current(source.name, origin_stat):
                return 0
            self._making.add(source.name)
        try:
            value, n_bytes = source.make_in_memory(origin_stat)
            if before_rename is not None:
                before_rename(n_bytes)  # (a closed ledger counts nothing)
            with self._changed:
                self._check_open(source)
                self._forms[source.name] = _Form(value, n_bytes,
                                                 _origin_key(origin_stat))
            return n_bytes
        finally:
            with self._changed:
                self._making.discard(source.name)
                self._changed.notify_all()

    def _check_open(self, source):
        if self._closed:
            raise InterruptedError('closed: {} is not kept'.format(source))

    def evict(self, source: Union[str, Source]) -> int:
        """Drops the kept form of ``source``; returns its bytes (0 if none)."""
        with self._changed:
            form = self._forms.pop(as_source(source).name, None)
        return 0 if form is None else form.n_bytes
