"""Stage 2's copy threads, and how one-at-a-time copies are read ahead.

:class:`CopyThreads` runs the copies the scheduler asks for (each one
``LocalStore.stage`` of one item, called through ``run``).  Copying waits on
I/O, which releases the GIL, so threads add no process.

.. rubric:: Note: the read-ahead protocol

Threads (all daemon threads, started by :class:`CopyThreads`):

* ``n_threads`` **copy threads** make every copy whose sources are not
  ``copied_one_at_a_time``, any number at once, in no set order.  No slot is
  involved.  The rest of this note is about the other copies (such as
  Parquet row groups).
* The **read-ahead thread** takes the one-at-a-time copies in the order
  submitted and reads each one's origins ahead
  (:meth:`~chainer_prefetch.staging.sources.Source.start_read_ahead`; a
  read in pieces is queued on the shared
  :class:`~chainer_prefetch.staging.piece_reads.PieceReaders` and returns at
  once), then hands the copy over to the make thread.
* The **make thread** (``copy-alone``) takes them in the order handed over,
  waits for each one's pieces, and makes it from what was read.

Slots: ``READS_AHEAD`` of them, counted by
:class:`~chainer_prefetch.staging.read_ahead_slots.ReadAheadSlots` (pure),
which a condition variable of :class:`CopyThreads` guards; the read-ahead
thread waits on it, and the make thread notifies it at each change.

1. Before reading a copy, the read-ahead thread takes one slot, waiting
   until one is free (until the copy ``READS_AHEAD`` before this one is
   being made).
2. A copy cancelled by then gives its slot back at once; nothing is read.
3. Otherwise its origins are read ahead, and the outcome decides:

   * *read* (or still being read in pieces), or *not needed* (its local
     forms are current, so the copy reads nothing): the copy keeps its one
     slot and goes to the make thread;
   * *reads itself* (no source reads ahead, or starting a read failed, say
     the origin could not be opened): the copy will read while it is made,
     alone.  The read-ahead thread takes every other slot too, waiting until
     every copy before it is made, or being made with its read done, and
     only then hands it over.  No read starts until it is made.

4. The make thread waits for the copy's pieces.  If all were read (or there
   was nothing to read), the copy's slot goes back *before* it is made: the
   next copy is read while this one is made.  If a piece failed, or was
   cancelled, the copy keeps its slot while it reads its origins again:
   the reads started before go on, but the read ahead has one slot fewer
   until it is made.
5. Once the copy is made, or skipped because it was cancelled, every slot it
   still holds goes back.

Cancellation (:meth:`CopyThreads.cancel`) succeeds for a copy no thread has
started to make.  Before its read, step 2 applies.  After it, the copy's
pieces not yet started are dropped (also while the make thread waits for
them); the make thread still takes the copy in its turn, finds the read
failed or finished, skips the copy, and gives its slot back (steps 4-5), so
the order and the count hold.  A copy read ahead but not yet made is not
started, so a cancelled one is never made.

Stop (:meth:`CopyThreads.stop`) cancels every copy not started, closes the
piece readers (pieces not started are dropped) and queues an end for each
thread.  The make thread skips what is left, giving back its slots, so the
read-ahead thread never waits forever for a slot; each thread ends after
its current copy.  A thread stuck in a hung read of shared storage is not
waited for (the executor joins them all by one deadline).  When the
read-ahead thread ends, it closes the origins it kept open and the piece
readers.

What holds:

* At most ``READS_AHEAD`` one-at-a-time copies are being read or read ahead
  beyond the one being made; so at most that many copies' pieces are
  queued.
* One-at-a-time copies are made one at a time, in the order submitted.
* A copy that reads itself reads alone: no read ahead runs while it is made.
* Every slot taken goes back exactly once, for a copy made, skipped or
  cancelled.
* A copy's origin that is also that of a copy read or made meanwhile is
  read through the descriptor already open (:class:`OpenOrigins`).
"""
import collections
import functools
import itertools
import os
import queue
import threading
from typing import Sequence, Tuple

from chainer_prefetch.staging import source_ops
from chainer_prefetch.staging.piece_reads import PieceReaders
from chainer_prefetch.staging.read_ahead_slots import READS_AHEAD, ReadAheadOutcome, ReadAheadSlots
from chainer_prefetch.staging.sources import ReadAhead, Source, using_reads_ahead

__all__ = ['READS_AHEAD', 'CopyThreads', 'OpenOrigins']


class CopyThreads:
    """Threads that run stage-2 copies; a copy not started yet can be cancelled.

    Copies of sources whose ``copied_one_at_a_time`` is set (such as Parquet
    row groups) are made one after the other, in the order submitted: each
    already reads in parallel pieces and decodes, so two at once would only
    share the disk and the cores and both finish late, where one at a time
    finishes the one needed first early.  Two threads serve them as a
    pipeline: one reads the next copy's origin ahead while the other makes
    the current one from what was read, so reading and decoding overlap.  At
    most ``READS_AHEAD`` copies are read ahead of the one being made: two,
    so that a small copy read fast does not leave the storage idle while a
    large one is decoded.  Pieces of the copies read ahead are read first in,
    first out, so the next copy's pieces are read as soon as threads are
    free from this one's.  A copy whose origin file is that of a copy read
    or made meanwhile is read through the descriptor that copy's read
    opened, kept open: on some file systems, FUSE without ``keep_cache``
    among them, opening a file again drops the pages the other copy is
    decoding.  The module's note tells the protocol step by step.

    Only sources that still need a copy are read ahead (``needs_copy``): in
    later epochs, stage 2 finds most row groups current and reads nothing.

    The other copies run on ``n_threads`` threads at once (many small files:
    the latency of each hides behind the others).

    Args:
        n_threads: How many threads run the other copies.
        run: ``run(copy_action, sources, asked_ahead) -> event``, called on
            a copy thread; ``copy_action`` has a ``copy_id``;
            ``asked_ahead`` is what reading it ahead asked of shared storage
            (counts of :mod:`~chainer_prefetch.staging.source_ops`), or
            ``None``.
        post: Where events go.
        post_error: ``post_error(error)``, called on a copy thread with what
            ``run`` raised (a bug: it must reach the consumer).
        needs_copy: ``needs_copy(copy_action, sources) -> bool``, whether
            a copy would read their origins (not when the local forms are
            current).
    """

    def __init__(self, n_threads: int, run, post, post_error, needs_copy):
        self._run_copy = run
        self._post = post
        self._post_error = post_error
        self._needs_copy = needs_copy
        self._n_threads = n_threads  # beside the read-ahead and copy-alone ones
        self._tasks = queue.SimpleQueue()
        self._tasks_alone = queue.SimpleQueue()
        self._to_make = queue.SimpleQueue()  # (action, sources, reads, asked ahead)
        self._slots = ReadAheadSlots(READS_AHEAD)
        self._slots_changed = threading.Condition()  # guards _slots
        self._piece_readers = PieceReaders()  # closed by the read-ahead thread
        self._lock = threading.Lock()
        self._queued = {}  # copy id -> action, not started yet
        self._pending_reads = {}  # copy id -> its reads ahead, until it is made
        targets = [(self._read_ahead_loop, 'read-ahead'),
                   (self._make_loop, 'copy-alone')] + [
            (self._loop, 'copy-{}'.format(i)) for i in range(n_threads)]
        self.threads = [threading.Thread(target=self._reporting_errors,
                                         args=(target,), daemon=True,
                                         name='chainer_prefetch-' + name)
                        for target, name in targets]
        for thread in self.threads:
            thread.start()

    def submit(self, action, sources: Sequence[Source]):
        """Queues the copy of ``sources``, the files of ``action``'s item."""
        with self._lock:
            self._queued[action.copy_id] = action
        alone = any(source.copied_one_at_a_time for source in sources)
        (self._tasks_alone if alone else self._tasks).put((action, sources))

    def cancel(self, copy_ids) -> tuple:
        """Cancels the copies no thread has started; returns their ids.

        The pieces of their reads ahead that no thread has started are
        dropped, also while the copy thread waits for them.
        """
        with self._lock:
            cancelled = tuple(copy_id for copy_id in copy_ids
                              if self._queued.pop(copy_id, None) is not None)
            reads = [self._pending_reads.pop(copy_id, ()) for copy_id in cancelled]
        for read in itertools.chain.from_iterable(reads):
            read.cancel()
        return cancelled

    def stop(self):
        """Asks every thread to stop after its current copy."""
        with self._lock:
            self._queued.clear()
        self._piece_readers.close(wait=False)  # (the read-ahead thread waits)
        self._tasks_alone.put(None)
        for _ in range(self._n_threads):
            self._tasks.put(None)

    def _is_queued(self, copy_id) -> bool:
        with self._lock:
            return copy_id in self._queued

    def _start(self, action) -> bool:
        """Marks the copy started; ``False`` if it was cancelled."""
        with self._lock:
            return self._queued.pop(action.copy_id, None) is not None

    def _make(self, action, sources: Sequence[Source], reads=(),
              asked_ahead=None):
        try:
            with using_reads_ahead(reads):
                event = self._run_copy(action, sources, asked_ahead)
        except BaseException as error:  # a bug must reach next()
            self._post_error(error)
        else:
            self._post(event)

    def _reporting_errors(self, loop):
        """Runs a thread's ``loop``; what it raises goes to ``post_error``."""
        try:
            loop()
        except BaseException as error:  # a bug must reach next(), not hang it
            self._post_error(error)

    def _loop(self):
        while True:
            task = self._tasks.get()
            if task is None:
                return
            if self._start(task[0]):
                self._make(*task)

    def _tell_slots(self, change, *args):
        """Tells the slots ``change(*args)`` and wakes the read-ahead thread."""
        with self._slots_changed:
            change(*args)
            self._slots_changed.notify_all()

    def _read_ahead_loop(self):
        """Reads the one-at-a-time copies' origins ahead, in order (steps 1-3 of the note)."""
        open_origins = OpenOrigins(READS_AHEAD + 1)
        slots = self._slots
        try:
            while True:
                task = self._tasks_alone.get()
                if task is None:
                    self._to_make.put(None)
                    return
                copy_id = task[0].copy_id
                with self._slots_changed:
                    self._slots_changed.wait_for(slots.may_read)
                    slots.start_read(copy_id)
                if not self._is_queued(copy_id):  # cancelled
                    self._tell_slots(slots.skip, copy_id)
                    continue
                with source_ops.tallied() as asked_ahead:
                    outcome, reads = self._read_ahead(task[0], task[1],
                                                      open_origins)
                if reads:
                    self._keep_pending(copy_id, reads)
                with self._slots_changed:  # (a copy that reads itself waits here)
                    slots.read(copy_id, outcome)
                    self._slots_changed.wait_for(
                        functools.partial(slots.may_hand_over, copy_id))
                    slots.hand_over(copy_id)
                self._to_make.put(task + (reads, dict(asked_ahead)))
                reads = None  # (owned by the make thread now)
        finally:
            try:
                open_origins.close()
            finally:  # (a copy waiting for its reads: cancelled)
                self._piece_readers.close()

    def _keep_pending(self, copy_id, reads: Sequence[ReadAhead]):
        """Keeps ``reads`` for :meth:`cancel`; cancels them if the copy was cancelled meanwhile."""
        with self._lock:
            wanted = copy_id in self._queued
            if wanted:
                self._pending_reads[copy_id] = reads
        if not wanted:
            for read in reads:
                read.cancel()

    def _read_ahead(self, action, sources: Sequence[Source],
                    open_origins: 'OpenOrigins'
                    ) -> Tuple[ReadAheadOutcome, list]:
        """What was read ahead for ``sources``.

        Args:
            action: The copy.
            sources: The sources of one copy.
            open_origins: The origins kept open, through which they are read.

        Returns:
            The outcome, and the reads (empty unless it is ``READ``).
        """
        reads = []
        try:
            if not self._needs_copy(action, sources):
                return ReadAheadOutcome.NOT_NEEDED, []
            opened = open_origins.open({source.origin for source in sources})
            for source in sources:
                read = source.start_read_ahead(opened[source.origin],
                                               self._piece_readers)
                if isinstance(read, ReadAhead):
                    reads.append(read)
        except Exception:  # the copy reads again and names the file
            for read in reads:
                read.cancel()
            return ReadAheadOutcome.READS_ITSELF, []
        if not reads:
            return ReadAheadOutcome.READS_ITSELF, []
        return ReadAheadOutcome.READ, reads

    def _make_loop(self):
        """Makes the one-at-a-time copies from what was read ahead for them (steps 4-5)."""
        slots = self._slots
        while True:
            task = self._to_make.get()
            if task is None:
                return
            action, sources, reads, asked_ahead = task
            task = None
            read_failed = False
            if reads:  # their pieces may still be queued or being read
                # Each is waited for; a failed one is dropped, and the copy reads again.
                read_failed = not all([read.finish() for read in reads])
                with self._lock:
                    self._pending_reads.pop(action.copy_id, None)
            self._tell_slots(slots.making, action.copy_id, read_failed)
            if self._start(action):
                self._make(action, sources, reads, asked_ahead)
            reads = None  # the maps read ahead go now, not after the next copy
            self._tell_slots(slots.made, action.copy_id)


class OpenOrigins:
    """The origin files of the last copies read ahead, kept open.

    Reading a copy's origin through a descriptor already open, rather than
    opening the file again, keeps the pages that copies read before from the
    same file may still be decoding (see :class:`CopyThreads`).

    Args:
        recent: How many of the last copies read keep their origins open
            (the copy being read, those read ahead before it, and the one
            being made).
    """

    def __init__(self, recent: int):
        self._recent = collections.deque(maxlen=recent)  # their origins
        self._descriptors = {}  # origin -> open descriptor

    def open(self, origins) -> dict:
        """Descriptors of ``origins``, kept or opened now; closes those no copy recent uses.

        A kept descriptor whose file is no longer the one at its path (the
        origin was replaced) is closed and the path opened again.

        Args:
            origins: The origin paths of the copy about to be read.

        Returns:
            ``{origin: descriptor}``; the descriptors stay this object's.

        Raises:
            OSError: an origin cannot be opened.
        """
        self._recent.append(frozenset(origins))
        in_use = frozenset().union(*self._recent)
        for origin in list(self._descriptors):
            if origin not in in_use or (origin in origins and not _still_at(
                    self._descriptors[origin], origin)):
                os.close(self._descriptors.pop(origin))
        for origin in origins:
            if origin not in self._descriptors:
                self._descriptors[origin] = source_ops.open_readonly(origin)
        return {origin: self._descriptors[origin] for origin in origins}

    def close(self):
        """Closes every descriptor held."""
        descriptors, self._descriptors = self._descriptors, {}
        for descriptor in descriptors.values():
            os.close(descriptor)


def _still_at(descriptor: int, path: str) -> bool:
    """Whether the open file ``descriptor`` is still the file at ``path``."""
    try:
        return os.path.samestat(os.fstat(descriptor), source_ops.stat(path))
    except OSError:
        return False
