"""Every decision of PrefetchMultiprocessIterator's pipeline, as a pure state machine.

:class:`Scheduler` has no threads, no files and no processes:
``step(event) -> actions``.  The executor (:mod:`._executor`) carries the
actions out (copy threads, loader processes, shared memory, the consumer's
mailbox) and feeds what happens back as events.  So every scheduling
decision can be driven and checked by a unit test, deterministically.

It is made of small pure parts, each in a module of its own: the copy
window (:mod:`._copy_window`: copies in flight, items known local, the slow
start, the bytes ahead), the load dispatcher (:mod:`._load_dispatch`: which
ready accesses go to a loader together) and the counters
(:mod:`._pipeline_counts`).  Each event type has one handler, named in the
table ``Scheduler._HANDLERS``.

Accesses
--------
Stage 1 (Chainer's iterator state machine, :mod:`chainer_prefetch.policy.lookahead`)
makes one index list per batch.  Each position of a batch is an *access*,
numbered across epochs (``epoch * len(dataset) + position``), with a status::

    PLANNED -> COPYING --copied---> STAGED ---> LOADING -> LOADED
       |          '-----not staged-> SOURCE ---'       '---> FAILED
       |-- known local --> (HOLDING) --> STAGED
       |-- no local directory -----> SOURCE
       '-- at dispatch, in the next-epoch cache --> CACHED

* ``COPYING``: waiting for its item's copy (stage 2).  An *item* is what is
  staged as one: the files of an example, or a Parquet row group shared by
  many examples; accesses waiting for the same item share one copy.
* ``HOLDING``: known to be local, with a capacity limit: waiting for the
  store to confirm that it keeps the item until it is read (if it dropped
  it meanwhile, the access is planned again).
* ``STAGED``: read through the located view (local copies); ``SOURCE``: read
  from shared storage (no local directory, the copy failed, the policy kept
  the item out, or the batch became the next to deliver before its copy
  started, with a capacity limit).
* ``CACHED``: served by the next-epoch cache (:mod:`chainer_prefetch.policy.next_epoch_cache`).
* A batch is *complete* when every access is ``LOADED`` or ``CACHED``, or one
  ``FAILED``; it is then delivered, in order.

Cursors
-------
Counted in batches since the last reset, and monotone between resets::

    0 <= taken <= delivered <= generated
    delivered - taken     <= n_prefetch        (the mailbox)
    generated - delivered <= copy window <= n_copy_ahead
    loads run only for batches < delivered + the decode window
                                  (DECODE_WINDOW; config.decode_window
                                  for columnar batches)
    item_bytes of the items the batches in flight use <= max_bytes_ahead
                                  (items shared by examples under a
                                  capacity limit; one batch alone may
                                  use more)

The copy window opens one batch per batch delivered ("slow start": at
start-up, copies for batches far ahead would take bandwidth from those the
first batch needs), and opens wholly once stage 2 is idle (no copy in
flight) after a delivery, or after a copy while no load has read or is
to read an example from shared storage: then there is no bandwidth to
take from, and few large items (Parquet row groups) would otherwise be
copied one at a time.  Items that stage 2 copies one at a time in the order
needed skip the slow start (``SchedulerConfig.slow_start``): a copy for a
later batch waits behind the earlier ones anyway.
:meth:`Scheduler.check_invariants` asserts all of this.

Shared memory
-------------
Loader processes write a batch's arrays into its shared buffer (a slot of
``example_bytes`` per example; see :class:`_Buffers`).  The delivered batch's
arrays are views of the buffer (no copy), so the buffer belongs to the
consumer until it drops them; then it is reused.  A buffer is written only
while its batch is in flight, and reused only when its batch has been
delivered and released, or discarded by a reset, *and* every load task
writing into it has answered.  When every buffer the cap allows is taken, a
batch is copied out of its buffer instead.  An example larger than its slot
travels by pickling, and later buffers get larger slots.

Columnar batches
----------------
With ``SchedulerConfig.columnar`` (a dataset with ``get_columns``, see
:mod:`chainer_prefetch.columnar`) a batch's positions are *units*: the rows
of the batch that share an item (a Parquet row group) in one epoch.  A unit
goes through the statuses above as one access (its access number is that
of its last row, its weight the number of its rows), so the bookkeeping per
batch is a few units, not one entry per row.  Once every unit is ready, the
whole batch is one :class:`LoadColumns` task (answer:
:class:`ColumnsLoaded`): the loader process writes its columns into the
batch's buffer (``example_bytes`` per row), and the batch is delivered
(:class:`DeliverColumns`) as one
:class:`~chainer_prefetch.columnar.ColumnarBatch`.  The decode window
is then ``config.decode_window`` batches (one task each; the iterator asks
for two per loader process, so that each has one queued while it loads
another).  The next-epoch cache is not used.
"""
import collections
import dataclasses
import enum
import itertools
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import numpy

from chainer_prefetch.columnar import positions
from chainer_prefetch.iterators._copy_window import CopyWindow
from chainer_prefetch.iterators._load_dispatch import DECODE_WINDOW, LoadDispatcher
from chainer_prefetch.iterators._pipeline_counts import PipelineCounts
from chainer_prefetch.iterators._read_from import ReadFrom
from chainer_prefetch.policy import lookahead
from chainer_prefetch.policy.eviction import NEVER
from chainer_prefetch.policy.future_uses import FutureUses
from chainer_prefetch.policy.next_epoch_cache import NextEpochCache


class Status(enum.Enum):
    """Where an access is (see the module docstring)."""

    PLANNED = 'planned'
    COPYING = 'copying'
    HOLDING = 'holding'
    STAGED = 'staged'
    SOURCE = 'source'
    CACHED = 'cached'
    LOADING = 'loading'
    LOADED = 'loaded'
    FAILED = 'failed'


# ---- events: what the executor reports ---------------------------------------

@dataclasses.dataclass(frozen=True)
class Start:
    """The pipeline starts."""


@dataclasses.dataclass(frozen=True)
class Consumed:
    """The consumer took one delivered item from the mailbox."""

    generation: int


@dataclasses.dataclass(frozen=True)
class Reset:
    """The consumer reset the iterator (``reset()``, ``serialize()``)."""

    state: lookahead.LookaheadState
    generation: int


@dataclasses.dataclass(frozen=True)
class Copied:
    """A copy finished (stage 2) for ``item``, for an access of ``epoch``.

    ``source_ops`` counts what it asked of shared storage (see
    :mod:`chainer_prefetch.staging.source_ops`).
    """

    copy_id: int
    item: int
    staged: bool
    bytes_read: int = 0
    evicted: Tuple[int, ...] = ()
    epoch: int = 0
    source_ops: Dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CopiesCancelled:
    """These copies were cancelled before a thread started them."""

    copy_ids: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Held:
    """The answer to :class:`Hold`: ``(position, item)`` the store keeps, and those it lost."""

    batch_id: int
    kept: Tuple[Tuple[int, int], ...]
    lost: Tuple[Tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """One example loaded by stage 3.

    ``unfit_bytes`` is the example's size when its arrays did not fit its
    slot of the shared buffer (they travelled by pickling), else 0;
    ``source_ops`` counts what loading it asked of shared storage.
    """

    example: Any
    read_from: ReadFrom
    source_bytes: int = 0
    unfit_bytes: int = 0
    source_ops: Dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LoadFailure:
    """One example that failed to load; ``error`` is what ``next()`` raises."""

    error: BaseException


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A load task answered: one result per position, in order.

    A task stops at its first failure: positions after it have no result.
    """

    task_id: int
    results: Tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class ColumnsLoaded:
    """A :class:`LoadColumns` task answered: a :class:`LoadResult` or :class:`LoadFailure`.

    The result's ``example`` is the batch's columns, ``read_from`` where the
    rows read locally came from, ``source_bytes`` what the rest read from
    shared storage, ``unfit_bytes`` the bytes per row needed when the
    columns did not fit the buffer.
    """

    task_id: int
    result: Any


@dataclasses.dataclass(frozen=True)
class Measured:
    """The first delivered batch was measured: the largest example's bytes."""

    example_bytes: int


@dataclasses.dataclass(frozen=True)
class BufferAllocated:
    """The answer to :class:`AllocateBuffer`; ``ok`` is false if it could not be."""

    buffer: int
    ok: bool


@dataclasses.dataclass(frozen=True)
class BufferReleased:
    """The consumer dropped every array of the batch delivered in ``buffer``."""

    buffer: int


@dataclasses.dataclass(frozen=True)
class CacheOffers:
    """Copies of delivered examples for the next-epoch cache: (index, epoch, example, bytes)."""

    offers: Tuple[Tuple[int, int, Any, int], ...]


# ---- actions: what the scheduler asks for -------------------------------------

@dataclasses.dataclass(frozen=True)
class Copy:
    """Stage ``item`` (the files of example ``index``) for access ``access`` of ``epoch``.

    ``check_epoch`` numbers the epoch for the checks of copies against
    their sources: it never goes back, also across a reset (see
    :mod:`._copy_window`).
    """

    copy_id: int
    item: int
    index: int
    access: int
    epoch: int = 0
    check_epoch: int = 0


@dataclasses.dataclass(frozen=True)
class CancelCopies:
    """Cancel these copies if no thread started them (answer: :class:`CopiesCancelled`)."""

    copy_ids: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Hold:
    """Keep items in the local store until they are used (answer: :class:`Held`).

    ``entries`` are ``(position, item, access)``.
    """

    batch_id: int
    entries: Tuple[Tuple[int, int, int], ...]


@dataclasses.dataclass(frozen=True)
class Used:
    """Stage 3 read ``item`` for ``access``; it is next needed at ``next_use``."""

    item: int
    access: int
    next_use: float


@dataclasses.dataclass(frozen=True)
class Load:
    """Load examples in a loader process: ``entries`` are (position, index, read_local)."""

    task_id: int
    batch_id: int
    entries: Tuple[Tuple[int, int, bool], ...]
    buffer: Optional[int]


@dataclasses.dataclass(frozen=True)
class LoadColumns:
    """Load a whole batch as columns in a loader process.

    ``indices`` are the batch's rows in order; ``local`` says for each
    whether to read it through the located view (its item is staged).
    """

    task_id: int
    batch_id: int
    indices: numpy.ndarray
    local: numpy.ndarray
    buffer: Optional[int]


@dataclasses.dataclass(frozen=True)
class AllocateBuffer:
    """Allocate shared buffer ``buffer``: ``example_bytes`` per example of a batch."""

    buffer: int
    example_bytes: int


@dataclasses.dataclass(frozen=True)
class FreeBuffer:
    """Free shared buffer ``buffer`` (nothing uses it any more)."""

    buffer: int


@dataclasses.dataclass(frozen=True)
class Deliver:
    """Put a delivered item into the consumer's mailbox: one subclass per kind."""

    generation: int


@dataclasses.dataclass(frozen=True)
class DeliverExamples(Deliver):
    """A batch of examples, as loaded: to unpack from ``buffer``.

    With ``hand_over`` the examples are views of the buffer, which the
    consumer then holds (answer, later: :class:`BufferReleased`); without,
    they are copied out of it.  ``cache_wants`` lists ``(position, index,
    epoch)`` of the examples the next-epoch cache wants a copy of (answer:
    :class:`CacheOffers`); ``measure`` asks for a :class:`Measured` answer.
    """

    state: lookahead.LookaheadState
    examples: List[Any]
    buffer: Optional[int]
    hand_over: bool
    cache_wants: Tuple[Tuple[int, int, int], ...] = ()
    measure: bool = False


@dataclasses.dataclass(frozen=True)
class DeliverColumns(Deliver):
    """A columnar batch (see :class:`LoadColumns`): to unpack from ``buffer``.

    ``hand_over`` and ``measure`` as for :class:`DeliverExamples`.
    """

    state: lookahead.LookaheadState
    columns: Any
    buffer: Optional[int]
    hand_over: bool
    measure: bool = False


@dataclasses.dataclass(frozen=True)
class DeliverEnd(Deliver):
    """``repeat=False`` and the epoch is over: ``next()`` raises ``StopIteration``."""

    state: lookahead.LookaheadState


@dataclasses.dataclass(frozen=True)
class DeliverFailure(Deliver):
    """A batch (or stage 1) failed: ``next()`` raises ``error``."""

    error: BaseException


@dataclasses.dataclass(frozen=True)
class ForgetNextUses:
    """The order was reset: the local store's next uses are unknown now."""


# ---- configuration ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs to know (all fixed for the iterator's life).

    Args:
        batch_size, repeat, order_sampler, n_prefetch, n_copy_ahead,
        maxtasksperchild: As for the iterator.
        dataset_length: Examples in the dataset.
        epoch_size: Accesses per epoch: the orders' length, when it is not
            ``dataset_length`` (an order sampler that gives each rank a part
            of the dataset, such as ``ShuffleAcrossRanks``).
        n_processes: Loader processes.
        task_slots: Load tasks the loader processes hold at once.
        staging: Whether a local directory is in use.
        limited: Whether it has a capacity limit (then next uses are
            tracked, and the next batch to deliver reads from the source
            what no copy thread has started, unless items are shared).
        item_of: For each example, its item (``None``: the example is the item).
        example_bytes: ``shared_mem`` (``None``: measure the first batch).
        revalidate_each_epoch: A copy known local in one epoch is staged
            again (its source re-checked) in the next.
        columnar: Batches load as columns, one task per batch (see the
            module docstring).
        decode_window: Batches whose examples load at the same time.
        slow_start: Whether the copy window opens one batch per delivery at
            start-up; ``False`` for items that stage 2 copies one at a time
            in the order needed (Parquet row groups), where a copy for a
            later batch cannot take bandwidth from an earlier one.
        max_bytes_ahead: Most bytes (``item_bytes`` of each) that the
            items (of ``item_of``) used by the batches between delivered
            and generated may take together: the local store holds an item
            from its copy until its batches have loaded it, so a copy
            window using more items than ``local_capacity`` holds would
            leave the later ones on shared storage, read there by every
            loader.  ``None``: no limit.  A batch that alone uses more is
            still generated, once no other is in flight.
        item_bytes: ``item_bytes(item)``, an item's estimated local bytes
            (asked once for each item a batch reaches; with
            ``max_bytes_ahead``).
    """

    batch_size: int
    repeat: bool
    order_sampler: Optional[Callable]
    dataset_length: int
    n_processes: int
    n_prefetch: int = 1
    n_copy_ahead: int = 16
    task_slots: int = 4
    maxtasksperchild: Optional[int] = None
    staging: bool = False
    limited: bool = False
    item_of: Optional[numpy.ndarray] = None
    example_bytes: Optional[int] = None
    revalidate_each_epoch: bool = False
    columnar: bool = False
    decode_window: int = DECODE_WINDOW
    slow_start: bool = True
    max_bytes_ahead: Optional[int] = None
    item_bytes: Optional[Callable[[int], int]] = None
    epoch_size: Optional[int] = None

    @property
    def accesses_per_epoch(self) -> int:
        """How accesses are numbered: position ``p`` of epoch ``e`` is
        access ``e * accesses_per_epoch + p``."""
        return self.dataset_length if self.epoch_size is None else \
            self.epoch_size


class _Buffers:
    """Which shared buffer each batch loads into: pure bookkeeping.

    A buffer is *free*, *in flight* (its batch loads into it) or *handed
    over* (the consumer holds the delivered batch's arrays, views of it).
    At most ``cap`` buffers exist; one whose slot size is outdated is freed
    when it comes back instead of being reused.

    Args:
        cap: Most buffers at once.
        example_bytes: Slot size per example (``None``: not known yet;
            0: no shared memory).
    """

    def __init__(self, cap: int, example_bytes: Optional[int]):
        self.cap = cap
        # A user's shared_mem, with room for the alignment of a few arrays.
        self.example_bytes = (example_bytes and
                              -(-example_bytes // 64) * 64 + 256)
        self._ids = itertools.count()
        self._slot_bytes: Dict[int, int] = {}  # every live buffer
        self._free: List[int] = []

    def acquire(self, emit) -> Optional[int]:
        """A buffer for a batch, or ``None`` (pickle, or all are taken).

        Emits :class:`FreeBuffer` for outdated free buffers and
        :class:`AllocateBuffer` for a new one.
        """
        if not self.example_bytes:
            return None
        while self._free:
            buffer = self._free.pop()
            if self._slot_bytes[buffer] == self.example_bytes:
                return buffer
            self._drop(buffer, emit)
        if len(self._slot_bytes) >= self.cap:
            return None
        buffer = next(self._ids)
        self._slot_bytes[buffer] = self.example_bytes
        emit(AllocateBuffer(buffer, self.example_bytes))
        return buffer

    def available(self) -> bool:
        """Whether a batch could get a buffer now."""
        return bool(self.example_bytes) and (
            bool(self._free) or len(self._slot_bytes) < self.cap)

    def release(self, buffer: int, emit):
        """Its batch is done with ``buffer`` (delivered and dropped, or discarded)."""
        if buffer not in self._slot_bytes:
            return  # its allocation failed
        if self._slot_bytes[buffer] == self.example_bytes:
            self._free.append(buffer)
        else:
            self._drop(buffer, emit)

    def failed(self, buffer: int):
        """Allocating ``buffer`` failed: no shared memory from now on."""
        self._slot_bytes.pop(buffer, None)
        self.example_bytes = 0

    def grow(self, needed: int):
        """An example of ``needed`` bytes did not fit: later buffers get room for it."""
        if self.example_bytes and needed > self.example_bytes:
            self.example_bytes = -(-needed * 5 // 4 // 4096) * 4096

    def _drop(self, buffer, emit):
        del self._slot_bytes[buffer]
        emit(FreeBuffer(buffer))


class _Batch:
    """A batch between stage 1 and delivery."""

    def __init__(self, batch_id, indices, state, first_access):
        self.id = batch_id
        self.indices = indices
        self.state = state
        self.first_access = first_access
        size = len(indices)
        self.status = [Status.PLANNED] * size
        self.results: List[Any] = [None] * size
        self.next_uses: Optional[List[float]] = None
        self.ready_local: List[int] = []  # STAGED, not dispatched
        self.ready_source: List[int] = []  # SOURCE, not dispatched
        self.waiting = 0  # accesses in COPYING or HOLDING
        self.holds: List[Tuple[int, int, int]] = []  # Hold entries to send
        self.done = 0  # accesses LOADED or CACHED
        self.outstanding = 0  # load tasks not answered
        self.dispatched = False  # a load task was sent
        self.buffer: Optional[int] = None
        self.error: Optional[BaseException] = None
        self.discarded = False
        self.head_copies_cancelled = False
        self.items: Optional[Set[int]] = None  # counted against max_bytes_ahead

    @property
    def size(self) -> int:
        return len(self.indices)

    @property
    def complete(self) -> bool:
        return self.error is not None or self.done == self.size

    def access(self, position: int) -> int:
        return self.first_access + position

    def weight(self, position: int) -> int:
        """Examples the access at ``position`` stands for."""
        return 1


class _UnitBatch(_Batch):
    """A columnar batch: its positions are units, the rows sharing an item in one epoch.

    Args:
        batch_id, state, first_access: As for :class:`_Batch`.
        rows: The batch's indices, in order.
        keys: For each row, its unit's key (rows with equal keys form a unit).
    """

    def __init__(self, batch_id, rows, state, first_access, keys):
        # One unit without numpy.unique and bincount, which give the GIL up
        # (see chainer_prefetch.columnar.positions).
        if keys[0] == keys[-1] and (keys == keys[0]).all():
            first = numpy.zeros(1, numpy.int64)
            unit_of_row = numpy.zeros(len(rows), numpy.int64)
            last_position = numpy.asarray([len(rows) - 1])
            weights = numpy.asarray([len(rows)])
        else:
            _, first, unit_of_row = numpy.unique(keys, return_index=True,
                                                 return_inverse=True)
            unit_of_row = unit_of_row.reshape(-1)
            _, last_reversed = numpy.unique(keys[::-1], return_index=True)
            last_position = len(rows) - 1 - last_reversed
            weights = numpy.bincount(unit_of_row, minlength=len(first))
        super().__init__(batch_id, rows[first], state, first_access)
        self.rows = rows
        self.unit_of_row = unit_of_row
        self.weights = weights
        self.last_position = last_position
        self.local = numpy.zeros(len(first), dtype=bool)  # read locally
        self.columns: Any = None  # the loaded columns

    def access(self, position: int) -> int:
        return self.first_access + int(self.last_position[position])

    def weight(self, position: int) -> int:
        return int(self.weights[position])


class Scheduler:
    """The pipeline's decisions; see the module docstring.

    It composes the copy window (:class:`CopyWindow`: stage 2 ahead of the
    loads), the load dispatcher (:class:`LoadDispatcher`: stage 3's tasks),
    the shared buffers' bookkeeping (:class:`_Buffers`) and the counters
    (:class:`PipelineCounts`), and keeps the batches in flight.

    Args:
        config: The fixed parameters.
        state: The iterator state to start from.
        cache: The next-epoch cache, or ``None``.

    Attributes:
        taken, delivered, generated: The cursors (see the module docstring).
        counts: The counters ``iterator.stats`` reports.
    """

    def __init__(self, config: SchedulerConfig,
                 state: lookahead.LookaheadState,
                 cache: Optional[NextEpochCache] = None):
        if config.columnar and cache is not None:
            raise ValueError('columnar batches do not use the next-epoch cache')
        if config.max_bytes_ahead is not None and (config.item_of is None
                                                   or config.item_bytes is None):
            raise ValueError('max_bytes_ahead needs item_of and item_bytes')
        self.config = config
        self.cache = cache
        self._state = state
        self._generation = 0
        self._ids = itertools.count()
        # Batches, and for the end of data or stage 1's failure what to
        # deliver in its place (a reset empties it, so the generation it
        # names is still current when delivered).
        self._in_flight: Deque[Any] = collections.deque()
        self._batches: Dict[int, _Batch] = {}  # in flight, and discarded ones still loading
        self._holding: Dict[int, _Batch] = {}  # batches with Hold entries to send
        self._exhausted = False
        self.taken = self.delivered = self.generated = 0
        self._next_indices = None  # stage 1's next step, not taken yet, and its items
        self._loads = LoadDispatcher(config, self._ids)
        self._window = CopyWindow(config, self._loads.decode_window)
        self._buffers = _Buffers(self._loads.decode_window + config.n_prefetch + 2,
                                 config.example_bytes)
        self._cache_epoch = -1  # the cache dropped what epochs before this left
        self._measure_next = config.example_bytes is None
        self._future = (FutureUses(config.accesses_per_epoch, config.item_of)
                        if config.limited else None)
        self.counts = PipelineCounts()
        self._actions: List[Any] = []

    # ---- the one entry point -------------------------------------------------

    def step(self, event) -> List[Any]:
        """Takes one event and returns the actions it leads to, in order."""
        self._actions = []
        self._HANDLERS[type(event)](self, event)
        self._advance()
        actions, self._actions = self._actions, []
        return actions

    def check_invariants(self):
        """Asserts the cursor invariants of the module docstring."""
        config = self.config
        assert 0 <= self.taken <= self.delivered <= self.generated, (
            self.taken, self.delivered, self.generated)
        assert self.delivered - self.taken <= config.n_prefetch
        assert self.generated - self.delivered <= self._window.size()
        assert len(self._in_flight) == self.generated - self.delivered
        batches = [entry for entry in self._in_flight if isinstance(entry, _Batch)]
        self._window.check_invariants(batch.indices for batch in batches)
        for offset, entry in enumerate(self._in_flight):
            if isinstance(entry, _Batch) and offset >= self._loads.decode_window:
                assert not entry.dispatched, 'load outside the decode window'
        for batch in batches:
            assert batch.waiting == (batch.status.count(Status.COPYING)
                                     + batch.status.count(Status.HOLDING))

    # ---- event handlers (see _HANDLERS) -----------------------------------------

    def _on_start(self, event: Start):
        """Nothing to do: every step moves the pipeline along."""

    def _on_consumed(self, event: Consumed):
        if event.generation == self._generation:
            self.taken += 1

    def _on_reset(self, event: Reset):
        for entry in self._in_flight:
            if isinstance(entry, _Batch):
                self._discard(entry)
        self._in_flight.clear()
        cancelled = self._window.reset()
        if cancelled:
            self._emit(CancelCopies(cancelled))
        if self._future is not None:
            self._future.clear()
            self._emit(ForgetNextUses())
        if self.cache is not None:
            self.cache.clear()
            self._cache_epoch = -1
        self._state = event.state
        self._next_indices = None
        self._generation = event.generation
        self._exhausted = False
        self.taken = self.delivered = self.generated = 0

    def _on_copied(self, event: Copied):
        window = self._window
        for item in event.evicted:
            window.forget(item)
        # (what a copy read counts, also when a reset dropped it meanwhile)
        self.counts.copied(event.epoch, event.bytes_read, event.source_ops)
        copy = window.end_copy(event.copy_id)
        if copy is None:
            # Reset meanwhile: end the store's hold for the lost access.
            if event.staged and self.config.limited:
                self._emit(Used(event.item, 0, NEVER))
            return
        epoch = self._epoch_of(copy.access)
        if event.staged:
            window.mark_local(event.item, epoch)
        for batch, position in self._live_waiters(copy):
            if (event.staged and self.config.limited
                    and batch.access(position) != copy.access):
                # The store held the item once, for the access it staged.
                self._hold(batch, position, event.item)
            else:
                self._set_ready(batch, position, local=event.staged)
        window.end_slow_start_if_idle()  # (once its waiters know where they read)

    def _on_copies_cancelled(self, event: CopiesCancelled):
        for copy_id in event.copy_ids:
            copy = self._window.end_copy(copy_id)
            if copy is None:
                continue
            head = self._head_batch()
            replan = []
            for batch, position in self._live_waiters(copy):
                if batch is head:
                    self._set_ready(batch, position, local=False)
                else:
                    batch.waiting -= 1
                    batch.status[position] = Status.PLANNED
                    replan.append((batch, position))
            for batch, position in replan:
                self._plan(batch, position)

    def _on_held(self, event: Held):
        batch = self._batches.get(event.batch_id)
        if batch is None or batch.discarded:
            for _, item in event.kept:  # end the holds of lost accesses
                self._emit(Used(item, 0, NEVER))
            return
        for position, _ in event.kept:
            self._set_ready(batch, position, local=True)
        for position, item in event.lost:
            self._window.forget(item)
            batch.waiting -= 1
            batch.status[position] = Status.PLANNED
            self._plan(batch, position)

    def _on_loaded(self, event: Loaded):
        batch, positions = self._answered(event.task_id)
        if batch is None:
            return
        for offset, position in enumerate(positions):
            result = event.results[offset] if offset < len(event.results) else None
            if not isinstance(result, LoadResult):
                batch.status[position] = Status.FAILED
                if batch.error is None:
                    batch.error = self._failure_of(result)
                continue
            batch.status[position] = Status.LOADED
            batch.results[position] = result.example
            batch.done += 1
            self._count_load(batch, position, result.read_from,
                             result.source_bytes, result.source_ops)
            if result.unfit_bytes:
                self._buffers.grow(result.unfit_bytes)

    def _on_columns_loaded(self, event: ColumnsLoaded):
        batch, units = self._answered(event.task_id)
        if batch is None:
            return
        result = event.result
        if not isinstance(result, LoadResult):
            for unit in units:
                batch.status[unit] = Status.FAILED
            batch.error = self._failure_of(result)
            return
        batch.columns = result.example
        source_bytes, source_ops = result.source_bytes, result.source_ops
        for unit in units:
            batch.status[unit] = Status.LOADED
            batch.done += 1
            read_from = result.read_from if batch.local[unit] else ReadFrom.SOURCE
            self._count_load(batch, unit, read_from,
                             0 if read_from is ReadFrom.LOCAL else source_bytes,
                             source_ops)
            source_ops = None  # counted once
            if read_from is not ReadFrom.LOCAL:
                source_bytes = 0  # counted once
        if result.unfit_bytes:
            self._buffers.grow(result.unfit_bytes)

    def _on_measured(self, event: Measured):
        if self._buffers.example_bytes is None:  # 0: examples without arrays
            self._buffers.example_bytes = event.example_bytes

    def _on_buffer_allocated(self, event: BufferAllocated):
        if not event.ok:
            self._buffers.failed(event.buffer)

    def _on_buffer_released(self, event: BufferReleased):
        self._buffers.release(event.buffer, self._emit)

    def _on_cache_offers(self, event: CacheOffers):
        for index, epoch, example, n_bytes in event.offers:
            self.cache.offer(index, epoch, example, n_bytes)

    #: The handler of each event type (:meth:`step` calls it).
    _HANDLERS = {
        Start: _on_start,
        Consumed: _on_consumed,
        Reset: _on_reset,
        Copied: _on_copied,
        CopiesCancelled: _on_copies_cancelled,
        Held: _on_held,
        Loaded: _on_loaded,
        ColumnsLoaded: _on_columns_loaded,
        Measured: _on_measured,
        BufferAllocated: _on_buffer_allocated,
        BufferReleased: _on_buffer_released,
        CacheOffers: _on_cache_offers,
    }

    def _answered(self, task_id):
        """The batch and positions of an answered load task (batch ``None``: discarded)."""
        batch_id, positions = self._loads.answered(task_id)
        batch = self._batches[batch_id]
        batch.outstanding -= 1
        if batch.discarded:
            self._release_if_idle(batch)
            return None, positions
        return batch, positions

    @staticmethod
    def _failure_of(result) -> BaseException:
        """The error a load answer that is not a :class:`LoadResult` stands for."""
        return (result.error if isinstance(result, LoadFailure)
                else RuntimeError('load task ended early'))

    # ---- moving things along ------------------------------------------------

    def _advance(self):
        while True:
            self._generate()
            self._cancel_head_copies()
            self._dispatch()
            delivered = self._deliver()
            if delivered != 'more':
                # Stop after a delivery that expects an answer (cache offers,
                # the measured size): it is fed back before the next event,
                # so the next batches are dispatched with it.
                self._send_holds()
                return

    def _generate(self):
        """Stage 1 up to the copy window; plans staging for each new access."""
        config = self.config
        window = self._window
        while (not self._exhausted
               and self.generated - self.delivered < window.size()):
            first_access = (self._state.epoch * config.accesses_per_epoch
                            + self._state.current_position)
            try:
                if self._next_indices is None:
                    state, indices = lookahead.lookahead_statemachine(
                        self._state, config.batch_size, config.repeat,
                        config.order_sampler, config.dataset_length)
                    self._next_indices = (state, indices,
                                          window.items_counted(indices))
                state, indices, items = self._next_indices
                if items is not None and not window.has_room_for(
                        items, alone=self.generated == self.delivered):
                    return  # until a delivery frees items
                self._next_indices = None
                self._state = state
                self._register_orders()
            except Exception as error:
                self._push(DeliverFailure(self._generation, error))
                self._exhausted = True
                return
            if indices is None:
                self._push(DeliverEnd(self._generation, self._state))
                self._exhausted = True
                return
            batch = self._new_batch(indices, first_access)
            self._batches[batch.id] = batch
            self._push(batch)
            if items is not None:
                batch.items = items
                window.add_items(items)
            if self._future is not None:
                batch.next_uses = [
                    self._future.following_use(self._item(int(index)),
                                               batch.access(position))
                    for position, index in enumerate(batch.indices)]
            for position in range(batch.size):
                self._plan(batch, position)

    def _new_batch(self, indices, first_access) -> _Batch:
        if not self.config.columnar:
            return _Batch(next(self._ids), indices, self._state, first_access)
        rows = numpy.asarray(indices, dtype=numpy.int64)
        epochs = (first_access + positions(len(rows))
                  ) // self.config.accesses_per_epoch
        if not self.config.staging:
            keys = epochs  # one unit per epoch the batch spans
        else:
            item_of = self.config.item_of
            items = rows if item_of is None else item_of[rows]
            keys = epochs * (self._window.n_items + 1) + items
        return _UnitBatch(next(self._ids), rows, self._state, first_access,
                          keys)

    def _register_orders(self):
        """Tells the future uses and the cache the orders of this epoch and the next."""
        for epoch in (self._state.epoch, self._state.epoch + 1):
            order = lookahead.order_of_epoch(self._state, epoch,
                                             self.config.dataset_length)
            if order is None:
                continue
            if self._future is not None:
                self._future.add_epoch(epoch, order)
            if self.cache is not None and epoch > 0:
                self.cache.plan(epoch, order)

    def _plan(self, batch, position):
        """Decides how one planned access gets its data."""
        index = int(batch.indices[position])
        access = batch.access(position)
        epoch = self._epoch_of(access)
        if not self.config.staging or (self.cache is not None
                                       and self.cache.holds(index, epoch)):
            self._set_ready(batch, position, local=False, counted=False)
            return
        item = self._item(index)
        if self._window.is_local(item, epoch):
            if self.config.limited:
                self._hold(batch, position, item)
            else:
                self._set_ready(batch, position, local=True)
            return
        copy = self._window.copies.get(item)
        if copy is None:
            copy = self._window.start_copy(next(self._ids), item, access)
            self._emit(Copy(copy.copy_id, item, index, access, epoch,
                            self._window.check_epoch(epoch)))
        copy.waiters.append((batch.id, position))
        batch.status[position] = Status.COPYING
        batch.waiting += 1

    def _hold(self, batch, position, item):
        """Asks the store to keep ``item`` for this access (sent by :meth:`_send_holds`)."""
        if batch.status[position] is not Status.COPYING:
            batch.waiting += 1
        batch.status[position] = Status.HOLDING
        batch.holds.append((position, item, batch.access(position)))
        self._holding[batch.id] = batch

    def _send_holds(self):
        for batch in self._holding.values():
            self._emit(Hold(batch.id, tuple(batch.holds)))
            batch.holds = []
        self._holding.clear()

    def _set_ready(self, batch, position, local, counted=True):
        if batch.status[position] in (Status.COPYING, Status.HOLDING):
            batch.waiting -= 1
        batch.status[position] = Status.STAGED if local else Status.SOURCE
        (batch.ready_local if local else batch.ready_source).append(position)
        if not local:
            self._window.reads_source()
        if counted:
            self.counts.planned(batch.weight(position), local)

    def _cancel_head_copies(self):
        """With a capacity limit, the next batch to deliver does not wait for unstarted copies.

        Not for items shared by many examples (row groups): reading one
        from the source would read all of it in each loader process.
        """
        head = self._head_batch()
        if (not self.config.limited or self.config.item_of is not None
                or head is None or head.waiting == 0
                or head.head_copies_cancelled):
            return
        head.head_copies_cancelled = True
        copies = self._window.copies
        copy_ids = {copies[self._item(int(head.indices[position]))].copy_id
                    for position, status in enumerate(head.status)
                    if status is Status.COPYING}
        self._emit(CancelCopies(tuple(sorted(copy_ids))))

    def _dispatch(self):
        """Stage 3 for the batches in the decode window."""
        for offset, entry in enumerate(self._in_flight):
            if offset == self._loads.decode_window or not isinstance(entry, _Batch):
                return
            if entry.error is None:
                self._dispatch_batch(entry)

    def _dispatch_batch(self, batch):
        if isinstance(batch, _UnitBatch):
            self._dispatch_columns(batch)
            return
        if self.cache is not None:
            for ready in (batch.ready_local, batch.ready_source):
                ready[:] = [position for position in ready
                            if not self._take_from_cache(batch, position)]
        if not (batch.ready_local or batch.ready_source):
            return
        if batch.buffer is None and not batch.dispatched:
            batch.buffer = self._buffers.acquire(self._emit)
        for position in batch.ready_source:  # slow reads: one per task
            self._load(batch, (position,))
        batch.ready_source = []
        tasks = self._loads.local_tasks(batch.ready_local, batch.size,
                                        batch.waiting)
        if tasks:
            batch.ready_local = []
        for task in tasks:
            self._load(batch, task)

    def _dispatch_columns(self, batch):
        """A columnar batch is one task, sent once every unit is ready."""
        if batch.dispatched or batch.waiting:
            return
        units = batch.ready_local + batch.ready_source
        batch.local[batch.ready_local] = True
        batch.ready_local, batch.ready_source = [], []
        for unit in units:
            batch.status[unit] = Status.LOADING
        batch.buffer = self._buffers.acquire(self._emit)
        task_id = self._loads.start(batch.id, tuple(units))
        batch.outstanding += 1
        batch.dispatched = True
        self._emit(LoadColumns(task_id, batch.id, batch.rows,
                               batch.local[batch.unit_of_row], batch.buffer))

    def _load(self, batch, positions):
        task_id = self._loads.start(batch.id, positions)
        entries = []
        for position in positions:
            entries.append((position, int(batch.indices[position]),
                            batch.status[position] is Status.STAGED))
            batch.status[position] = Status.LOADING
        batch.outstanding += 1
        batch.dispatched = True
        self._emit(Load(task_id, batch.id, tuple(entries), batch.buffer))

    def _take_from_cache(self, batch, position) -> bool:
        index = int(batch.indices[position])
        epoch = self._epoch_of(batch.access(position))
        if epoch > self._cache_epoch:  # what earlier epochs left is useless
            self._cache_epoch = epoch
            self.cache.forget_before(epoch)
        example = self.cache.take(index, epoch)
        if example is None:
            return False
        batch.status[position] = Status.CACHED
        batch.results[position] = example
        batch.done += 1
        self.counts.from_cache(epoch)
        self._emit_used(batch, position)
        return True

    def _deliver(self) -> str:
        """Delivers the head if it is complete and the mailbox has room.

        Returns:
            ``'more'`` after a delivery, ``'answer'`` after one that expects
            an answer, ``''`` when nothing could be delivered.
        """
        if not self._in_flight or (
                self.delivered - self.taken >= self.config.n_prefetch):
            return ''
        head = self._in_flight[0]
        outcome = 'more'
        if isinstance(head, Deliver):  # the end of data, or stage 1's failure
            self._emit(head)
        elif not head.complete:
            return ''
        elif head.error is not None:
            self._emit(DeliverFailure(self._generation, head.error))
            self._discard(head)
        else:
            if self._deliver_batch(head):
                outcome = 'answer'
            self._discard(head)
        self._window.delivered(head.items if isinstance(head, _Batch) else None)
        self._in_flight.popleft()
        self.delivered += 1
        return outcome

    def _deliver_batch(self, batch) -> bool:
        """Emits the delivery of a loaded batch; returns whether it expects an answer."""
        hand_over = batch.buffer is not None and self._buffers.available()
        if isinstance(batch, _UnitBatch):
            action = DeliverColumns(self._generation, batch.state, batch.columns,
                                    batch.buffer, hand_over,
                                    measure=self._measure_next)
            answer = action.measure
        else:
            action = DeliverExamples(self._generation, batch.state, batch.results,
                                     batch.buffer, hand_over,
                                     cache_wants=self._cache_wants(batch),
                                     measure=self._measure_next)
            answer = action.measure or bool(action.cache_wants)
        self._emit(action)
        self._measure_next = False
        batch.results = None
        if hand_over:
            batch.buffer = None  # the consumer's until BufferReleased
        return answer

    def _cache_wants(self, batch) -> Tuple[Tuple[int, int, int], ...]:
        if self.cache is None:
            return ()
        wants = []
        for position, index in enumerate(batch.indices):
            epoch = self._epoch_of(batch.access(position)) + 1
            if self.cache.wants(int(index), epoch):
                wants.append((position, int(index), epoch))
        return tuple(wants)

    # ---- helpers -------------------------------------------------------------

    def _emit(self, action):
        self._actions.append(action)

    def _emit_used(self, batch, position):
        if self.config.limited:
            self._emit(Used(self._item(int(batch.indices[position])),
                            batch.access(position), batch.next_uses[position]))

    def _push(self, entry):
        self._in_flight.append(entry)
        self.generated += 1

    def _head_batch(self) -> Optional[_Batch]:
        if self._in_flight and isinstance(self._in_flight[0], _Batch):
            return self._in_flight[0]
        return None

    def _item(self, index: int) -> int:
        item_of = self.config.item_of
        return index if item_of is None else int(item_of[index])

    def _epoch_of(self, access: int) -> int:
        return access // self.config.accesses_per_epoch

    def _count_load(self, batch, position, read_from: ReadFrom,
                    source_bytes: int, source_ops=None):
        """Counts a load stage 3 answered; a local copy that was not there is forgotten."""
        self.counts.loaded(self._epoch_of(batch.access(position)),
                           batch.weight(position), read_from, source_bytes,
                           source_ops)
        if read_from is not ReadFrom.LOCAL:
            self._window.reads_source()
        if read_from is ReadFrom.FALLBACK:
            self._window.forget(self._item(int(batch.indices[position])))
        self._emit_used(batch, position)

    def _discard(self, batch):
        """Takes ``batch`` out of the pipeline (delivered, failed or reset)."""
        batch.discarded = True
        self._release_if_idle(batch)

    def _release_if_idle(self, batch):
        if not batch.discarded or batch.outstanding:
            return
        if batch.buffer is not None:
            self._buffers.release(batch.buffer, self._emit)
            batch.buffer = None
        self._batches.pop(batch.id, None)

    def _live_waiters(self, copy):
        """The accesses waiting for ``copy`` whose batch is still in flight."""
        for batch_id, position in copy.waiters:
            batch = self._batches.get(batch_id)
            if batch is not None and not batch.discarded:
                yield batch, position
