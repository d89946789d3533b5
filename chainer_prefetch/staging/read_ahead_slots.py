"""The slot accounting of stage 2's read ahead: pure, no threads, no I/O.

:class:`~chainer_prefetch.staging.copy_threads.CopyThreads` reads the origins
of one-at-a-time copies ahead on one thread and makes the copies on another;
the note at the top of :mod:`chainer_prefetch.staging.copy_threads` tells the
whole protocol.  This module keeps its count: the threads ask
:class:`ReadAheadSlots` what they may do (:meth:`~ReadAheadSlots.may_read`,
:meth:`~ReadAheadSlots.may_hand_over`) and tell it what they did; the
condition variable they wait on stays with them.
"""
import enum
from typing import Dict, List, Optional

#: One-at-a-time copies read ahead of the one being made, at most.
READS_AHEAD = 2


class ReadAheadOutcome(enum.Enum):
    """What reading a copy's origin ahead came to."""

    #: Read, or queued in pieces that the make thread waits for.
    READ = 'read'
    #: The local forms are current: the copy reads nothing.
    NOT_NEEDED = 'not needed'
    #: Nothing read (no source reads ahead, or starting the read failed):
    #: the copy reads while it is made, alone.
    READS_ITSELF = 'reads itself'


class _Copy:
    """One copy the read-ahead thread has taken and the make thread not yet made."""

    __slots__ = ('slots', 'outcome', 'phase')

    def __init__(self):
        self.slots = 1
        self.outcome: Optional[ReadAheadOutcome] = None
        self.phase = 'reading'  # then 'handed over', then 'making'


class ReadAheadSlots:
    """Which one-at-a-time copy may be read ahead now, and the slots each holds.

    ``limit`` slots exist.  A copy takes one to be read, and gives it back
    when the make thread starts it with everything read (so the next copy is
    read meanwhile); a copy whose read failed keeps it until it is made, and
    a copy that reads itself takes every slot until it is made.  Hence at
    most ``limit`` copies are read ahead of the one being made.

    Every method checks the order the protocol allows and raises
    ``RuntimeError`` on a call out of it (a bug of the caller).

    Args:
        limit: How many slots exist (``READS_AHEAD``).
    """

    def __init__(self, limit: int = READS_AHEAD):
        if limit < 1:
            raise ValueError('limit must be at least 1, not {}'.format(limit))
        self.limit = limit
        self._copies: Dict[object, _Copy] = {}  # in the order taken
        self._reading = None  # the copy the read-ahead thread has not handed over

    # ---- what the threads ask -------------------------------------------------

    @property
    def free(self) -> int:
        """Slots no copy holds."""
        return self.limit - sum(copy.slots for copy in self._copies.values())

    def held(self, copy_id) -> int:
        """Slots ``copy_id`` holds (0 once made, or when unknown)."""
        copy = self._copies.get(copy_id)
        return 0 if copy is None else copy.slots

    def read_ahead(self) -> List:
        """The copies being read or read ahead, not yet being made, first taken first."""
        return [copy_id for copy_id, copy in self._copies.items()
                if copy.phase != 'making']

    def may_read(self) -> bool:
        """Whether the read-ahead thread may take the next copy (:meth:`start_read`).

        Not while the last copy taken is not handed over, nor while no slot
        is free.
        """
        return self._reading is None and self.free > 0

    def may_hand_over(self, copy_id) -> bool:
        """Whether ``copy_id``, read (:meth:`read`), may go to the make thread.

        A copy read, or with nothing to read, may at once; one that reads
        itself once every other slot is free: when every copy taken before it
        is being made with its read done, or made.
        """
        copy = self._copy(copy_id, 'reading')
        if copy.outcome is None:
            raise RuntimeError('copy {!r} is not read yet'.format(copy_id))
        if copy.outcome is ReadAheadOutcome.READS_ITSELF:
            return self.free >= self.limit - copy.slots
        return True

    # ---- what the read-ahead thread tells -------------------------------------------

    def start_read(self, copy_id):
        """The read-ahead thread takes ``copy_id``: it holds a slot while read.

        Raises:
            RuntimeError: :meth:`may_read` is false, or ``copy_id`` is taken.
        """
        if not self.may_read():
            raise RuntimeError('no copy may be read ahead now')
        if copy_id in self._copies:
            raise RuntimeError('copy {!r} is taken already'.format(copy_id))
        self._copies[copy_id] = _Copy()
        self._reading = copy_id

    def skip(self, copy_id):
        """``copy_id`` was cancelled before its read: its slot goes back."""
        self._copy(copy_id, 'reading')
        del self._copies[copy_id]
        self._reading = None

    def read(self, copy_id, outcome: ReadAheadOutcome):
        """``copy_id``'s read ahead came to ``outcome``; see :meth:`may_hand_over`."""
        copy = self._copy(copy_id, 'reading')
        if copy.outcome is not None:
            raise RuntimeError('copy {!r} is read already'.format(copy_id))
        copy.outcome = ReadAheadOutcome(outcome)

    def hand_over(self, copy_id):
        """``copy_id`` goes to the make thread; one that reads itself takes every slot.

        Raises:
            RuntimeError: :meth:`may_hand_over` is false.
        """
        if not self.may_hand_over(copy_id):
            raise RuntimeError('copy {!r} must wait for every slot'.format(copy_id))
        copy = self._copies[copy_id]
        if copy.outcome is ReadAheadOutcome.READS_ITSELF:
            copy.slots = self.limit
        copy.phase = 'handed over'
        self._reading = None

    # ---- what the make thread tells ---------------------------------------------------

    def making(self, copy_id, read_failed: bool = False):
        """The make thread starts ``copy_id`` (made, or skipped if cancelled).

        A copy whose read is done (or had nothing to read) gives its slot
        back now, so that the next copy is read while it is made.

        Args:
            copy_id: The first copy handed over and not yet made.
            read_failed: Whether a read of the copy failed or was cancelled
                (it reads again while made, and keeps its slot until then).

        Raises:
            RuntimeError: ``copy_id`` is not the first copy taken, or is not
                handed over.
        """
        copy = self._copy(copy_id, 'handed over')
        if next(iter(self._copies)) != copy_id:
            raise RuntimeError('copy {!r} is made before {!r}, taken before it'
                               .format(copy_id, next(iter(self._copies))))
        if copy.outcome is not ReadAheadOutcome.READS_ITSELF and not read_failed:
            copy.slots = 0
        copy.phase = 'making'

    def made(self, copy_id):
        """``copy_id`` is made (or skipped): every slot it still holds goes back."""
        self._copy(copy_id, 'making')
        del self._copies[copy_id]

    def _copy(self, copy_id, phase: str) -> _Copy:
        copy = self._copies.get(copy_id)
        if copy is None or copy.phase != phase:
            raise RuntimeError('copy {!r} is {}, not {}'.format(
                copy_id, 'not taken' if copy is None else copy.phase, phase))
        return copy
