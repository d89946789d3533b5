"""The read-ahead slot accounting, stepped by hand: no threads, no files."""
import collections
import random

import pytest

from chainer_prefetch.staging.read_ahead_slots import READS_AHEAD, ReadAheadOutcome, ReadAheadSlots

READ = ReadAheadOutcome.READ
NOT_NEEDED = ReadAheadOutcome.NOT_NEEDED
READS_ITSELF = ReadAheadOutcome.READS_ITSELF


def _read_and_hand_over(slots, copy_id, outcome=READ):
    """The read-ahead thread's steps for one copy that need not wait."""
    assert slots.may_read()
    slots.start_read(copy_id)
    slots.read(copy_id, outcome)
    assert slots.may_hand_over(copy_id)
    slots.hand_over(copy_id)


def test_at_most_the_limit_is_read_ahead_of_the_copy_being_made():
    slots = ReadAheadSlots(2)
    _read_and_hand_over(slots, 0)
    _read_and_hand_over(slots, 1)
    assert slots.read_ahead() == [0, 1]
    assert slots.free == 0
    assert not slots.may_read()  # a third waits ...
    with pytest.raises(RuntimeError):
        slots.start_read(2)
    slots.making(0)  # ... until the first is being made with its read done
    assert slots.held(0) == 0
    assert slots.read_ahead() == [1]
    _read_and_hand_over(slots, 2)
    assert slots.read_ahead() == [1, 2]
    assert not slots.may_read()
    slots.made(0)  # (making it gives nothing more back)
    assert not slots.may_read()
    slots.making(1)
    assert slots.may_read()


def test_the_default_limit_is_reads_ahead():
    slots = ReadAheadSlots()
    assert slots.limit == slots.free == READS_AHEAD
    with pytest.raises(ValueError):
        ReadAheadSlots(0)


def test_one_copy_is_read_at_a_time():
    slots = ReadAheadSlots(2)
    slots.start_read(0)
    assert slots.free == 1
    assert not slots.may_read()  # until 0 is handed over
    with pytest.raises(RuntimeError):
        slots.start_read(1)
    with pytest.raises(RuntimeError):
        slots.may_hand_over(0)  # not read yet
    slots.read(0, READ)
    slots.hand_over(0)
    assert slots.may_read()


def test_copies_are_made_in_the_order_taken():
    slots = ReadAheadSlots(2)
    _read_and_hand_over(slots, 'a')
    _read_and_hand_over(slots, 'b')
    with pytest.raises(RuntimeError):
        slots.making('b')  # 'a' was taken before it
    slots.making('a')
    with pytest.raises(RuntimeError):
        slots.making('b')  # one at a time: 'a' is not made yet
    slots.made('a')
    slots.making('b')
    slots.made('b')
    assert slots.free == 2
    assert slots.read_ahead() == []


def test_a_copy_is_made_only_once_handed_over():
    slots = ReadAheadSlots(2)
    slots.start_read(0)
    with pytest.raises(RuntimeError):
        slots.making(0)
    slots.read(0, READ)
    with pytest.raises(RuntimeError):
        slots.made(0)  # not being made
    with pytest.raises(RuntimeError):
        slots.making(1)  # never taken


def test_a_copy_cancelled_before_its_read_gives_its_slot_back():
    slots = ReadAheadSlots(2)
    _read_and_hand_over(slots, 0)
    slots.start_read(1)
    assert slots.free == 0
    slots.skip(1)  # cancelled: nothing read
    assert slots.free == 1
    assert slots.read_ahead() == [0]
    assert slots.may_read()
    with pytest.raises(RuntimeError):
        slots.making(1)  # it is gone: never made
    _read_and_hand_over(slots, 2)
    slots.making(0)
    slots.made(0)
    slots.making(2)
    slots.made(2)
    assert slots.free == 2


def test_a_copy_cancelled_after_its_read_keeps_its_slot_until_skipped():
    slots = ReadAheadSlots(2)
    _read_and_hand_over(slots, 0)
    _read_and_hand_over(slots, 1)
    # 0 was cancelled while its pieces waited: they were dropped, so its read
    # failed; the make thread still takes it in its turn and skips it.
    slots.making(0, read_failed=True)
    assert slots.held(0) == 1
    assert not slots.may_read()
    slots.made(0)
    assert slots.may_read()
    assert slots.free == 1


def test_a_failed_read_keeps_its_slot_while_the_copy_reads_again():
    slots = ReadAheadSlots(2)
    _read_and_hand_over(slots, 0)
    _read_and_hand_over(slots, 1)
    slots.making(0, read_failed=True)  # 0 reads its origin again
    assert slots.held(0) == 1
    assert slots.read_ahead() == [1]  # the read started before goes on ...
    assert not slots.may_read()  # ... and no further read starts
    slots.made(0)
    assert slots.may_read()
    slots.making(1)  # 1 was read: its slot goes back before it is made
    assert slots.free == 2


def test_a_failed_read_with_no_other_read_ahead_leaves_one_slot():
    slots = ReadAheadSlots(2)
    _read_and_hand_over(slots, 0)
    slots.making(0, read_failed=True)
    assert slots.free == 1  # the read ahead goes on with one slot fewer
    _read_and_hand_over(slots, 1)
    assert not slots.may_read()
    slots.made(0)
    assert slots.may_read()


def test_a_copy_with_nothing_read_ahead_reads_alone():
    slots = ReadAheadSlots(2)
    _read_and_hand_over(slots, 0)
    slots.start_read(1)
    slots.read(1, READS_ITSELF)
    # 1 waits until every copy before it is being made with its read done ...
    assert not slots.may_hand_over(1)
    with pytest.raises(RuntimeError):
        slots.hand_over(1)
    slots.making(0)
    assert slots.may_hand_over(1)
    slots.hand_over(1)
    assert slots.held(1) == 2  # ... takes every slot ...
    assert not slots.may_read()
    slots.made(0)
    slots.making(1)
    assert not slots.may_read()  # ... and no read starts while it is made ...
    assert slots.read_ahead() == []
    slots.made(1)
    assert slots.free == 2  # ... until it is done
    _read_and_hand_over(slots, 2)


def test_a_copy_reading_alone_waits_for_a_copy_before_that_reads_again():
    slots = ReadAheadSlots(2)
    _read_and_hand_over(slots, 0)
    slots.start_read(1)
    slots.read(1, READS_ITSELF)
    slots.making(0, read_failed=True)
    assert not slots.may_hand_over(1)  # 0 still reads
    slots.made(0)
    assert slots.may_hand_over(1)


def test_a_copy_with_nothing_to_read_frees_its_slot_like_one_read():
    slots = ReadAheadSlots(2)
    _read_and_hand_over(slots, 0, NOT_NEEDED)
    _read_and_hand_over(slots, 1)
    slots.making(0)  # its local forms are current: the next is read meanwhile
    assert slots.held(0) == 0
    assert slots.may_read()


def test_a_copy_cannot_be_taken_twice_or_read_twice():
    slots = ReadAheadSlots(3)
    _read_and_hand_over(slots, 0)
    with pytest.raises(RuntimeError):
        slots.start_read(0)
    slots.start_read(1)
    slots.read(1, READ)
    with pytest.raises(RuntimeError):
        slots.read(1, READ)


Copy = collections.namedtuple('Copy', 'copy_id outcome cancelled_before read_failed')


def _run_both_threads(copies, limit, seed):
    """Steps the read-ahead and make threads' protocol in a random interleaving.

    Checks what must hold after every step; returns the copies made, in order.
    """
    slots = ReadAheadSlots(limit)
    rng = random.Random(seed)
    to_read = collections.deque(copies)
    to_make = collections.deque()
    made = []
    reading = None  # (copy, next step) of the read-ahead thread
    being_made = None

    def read_ahead_step():
        nonlocal reading
        if reading is None:
            if not to_read or not slots.may_read():
                return False
            copy = to_read.popleft()
            slots.start_read(copy.copy_id)
            reading = (copy, 'read')
        elif reading[1] == 'read':
            copy = reading[0]
            if copy.cancelled_before:
                slots.skip(copy.copy_id)
                reading = None
            else:
                slots.read(copy.copy_id, copy.outcome)
                reading = (copy, 'hand over')
        else:
            copy = reading[0]
            if not slots.may_hand_over(copy.copy_id):
                return False
            slots.hand_over(copy.copy_id)
            to_make.append(copy)
            reading = None
        return True

    def make_step():
        nonlocal being_made
        if being_made is None:
            if not to_make:
                return False
            being_made = to_make.popleft()
            slots.making(being_made.copy_id, being_made.read_failed)
        else:
            slots.made(being_made.copy_id)
            made.append(being_made.copy_id)
            being_made = None
        return True

    while True:
        steps = [read_ahead_step, make_step]
        rng.shuffle(steps)
        if not (steps[0]() or steps[1]()):
            break
        assert 0 <= slots.free <= limit
        assert len(slots.read_ahead()) <= limit
        if being_made is not None and being_made.outcome is READS_ITSELF:
            assert slots.read_ahead() == []  # it reads alone
    assert reading is None and not to_read and not to_make  # nothing stuck
    assert slots.free == limit  # every slot back
    return made


@pytest.mark.parametrize('limit', [1, 2, 3])
@pytest.mark.parametrize('seed', range(20))
def test_any_interleaving_keeps_the_limit_and_the_order(limit, seed):
    rng = random.Random(seed)
    outcomes = list(ReadAheadOutcome)
    copies = [Copy(number, rng.choice(outcomes), rng.random() < 0.2,
                   rng.random() < 0.2) for number in range(30)]
    made = _run_both_threads(copies, limit, seed)
    assert made == [copy.copy_id for copy in copies if not copy.cancelled_before]
