"""Piece readers: one queue for the pieces of every copy read ahead, read first in first out."""
import concurrent.futures
import threading
import time

import pytest

from chainer_prefetch.staging.piece_reads import PieceReaders

WAIT = 10  # seconds any step may take before the test fails


def _reader_threads():
    return [thread for thread in threading.enumerate()
            if thread.name.startswith('chainer_prefetch-read-')]


class Gated:
    """Pieces that log their start and end, and wait for their gate to open."""

    def __init__(self):
        self.log = []
        self.lock = threading.Lock()
        self.gates = {}
        self.started = threading.Semaphore(0)

    def gate(self, piece):
        with self.lock:
            return self.gates.setdefault(piece, threading.Event())

    def read(self, piece):
        with self.lock:
            self.log.append(('start', piece))
        self.started.release()
        assert self.gate(piece).wait(WAIT), 'piece {} never let through'.format(piece)
        if piece.startswith('bad'):
            raise OSError('cannot read {}'.format(piece))
        with self.lock:
            self.log.append(('end', piece))

    def wait_started(self, count):
        for _ in range(count):
            assert self.started.acquire(timeout=WAIT)

    def starts(self):
        with self.lock:
            return [piece for event, piece in self.log if event == 'start']


def test_the_next_copys_pieces_take_each_thread_freed_after_the_last_of_this_one():
    pieces = Gated()
    released = {'a': threading.Event(), 'b': threading.Event()}
    readers = PieceReaders()
    try:
        first = readers.submit(pieces.read, ['a0', 'a1', 'a2'], 2,
                               released['a'].set)
        second = readers.submit(pieces.read, ['b0', 'b1'], 2,
                                released['b'].set)
        pieces.wait_started(2)
        assert pieces.starts() == ['a0', 'a1']  # two threads for this width
        pieces.gate('a0').set()
        pieces.wait_started(1)
        assert pieces.starts() == ['a0', 'a1', 'a2']  # first in, first out
        pieces.gate('a1').set()
        pieces.wait_started(1)
        # A thread freed while a2 is still read takes the next copy's piece:
        # the storage keeps as many requests in flight between row groups.
        assert pieces.starts() == ['a0', 'a1', 'a2', 'b0']
        assert not released['a'].is_set()
        pieces.gate('a2').set()
        first.wait()
        assert released['a'].wait(WAIT)  # once its last piece is read
        assert not released['b'].is_set()
        pieces.gate('b0').set()
        pieces.gate('b1').set()
        second.wait()
        assert released['b'].wait(WAIT)
    finally:
        for piece in ('a0', 'a1', 'a2', 'b0', 'b1'):
            pieces.gate(piece).set()
        readers.close()
    assert _reader_threads() == []


def test_a_failed_piece_is_raised_in_order_and_the_pieces_not_started_dropped():
    pieces = Gated()
    released = []
    readers = PieceReaders()
    names = ['ok0', 'bad1', 'ok2', 'ok3', 'ok4']
    try:
        pending = readers.submit(pieces.read, names, 2,
                                 lambda: released.append(True))
        pieces.wait_started(2)
        pieces.gate('bad1').set()  # fails while ok0 is still being read
        pieces.wait_started(1)  # ok2, on the thread bad1 freed
        pieces.gate('ok0').set()
        pieces.wait_started(1)  # ok3, on the thread ok0 freed
        with pytest.raises(OSError, match='cannot read bad1'):
            pending.wait()  # ok0 is waited for first (the pieces' order)
        assert ('end', 'ok0') in pieces.log
        assert released == []  # ok2 and ok3 are still being read
        pieces.gate('ok2').set()
        pieces.gate('ok3').set()
    finally:
        readers.close()
    assert released == [True]  # once, when the last piece was done
    # ok4 was dropped when bad1's error was raised.
    assert pieces.starts() == ['ok0', 'bad1', 'ok2', 'ok3']


def test_cancel_drops_the_pieces_not_started_and_releases_when_the_rest_end():
    pieces = Gated()
    released = []
    readers = PieceReaders()
    try:
        pending = readers.submit(pieces.read, ['c0', 'c1', 'c2', 'c3'], 2,
                                 lambda: released.append(True))
        pieces.wait_started(2)
        pending.cancel()
        assert released == []  # c0 and c1 are still being read
        pieces.gate('c0').set()
        pieces.gate('c1').set()
    finally:
        readers.close()
    assert pieces.starts() == ['c0', 'c1']
    assert released == [True]


def test_close_drops_the_queued_pieces_waits_for_those_read_and_refuses_more():
    pieces = Gated()
    released = []
    readers = PieceReaders()
    pending = readers.submit(pieces.read, ['d0', 'd1', 'd2'], 2,
                             lambda: released.append('d'))
    pieces.wait_started(2)
    readers.close(wait=False)  # d2 dropped at once
    pieces.gate('d0').set()
    pieces.gate('d1').set()
    readers.close()  # returns once d0 and d1 are read: no thread outlives it
    assert _reader_threads() == []
    assert sorted(piece for event, piece in pieces.log if event == 'end') == [
        'd0', 'd1']
    assert released == ['d']
    with pytest.raises(concurrent.futures.CancelledError):  # d2 was cancelled
        pending.wait()
    with pytest.raises(RuntimeError, match='closed'):
        readers.submit(pieces.read, ['e0'], 2, lambda: released.append('e'))
    assert released == ['d', 'e']  # what a refused submission read through
    readers.close()  # idempotent


def test_each_width_reads_that_many_pieces_at_once_beside_the_others():
    pieces = Gated()
    readers = PieceReaders()
    try:
        readers.submit(pieces.read, ['w1a', 'w1b'], 1, lambda: None)
        readers.submit(pieces.read, ['w3a', 'w3b', 'w3c', 'w3d'], 3,
                       lambda: None)
        pieces.wait_started(4)
        time.sleep(0.1)  # nothing more starts
        assert sorted(pieces.starts()) == ['w1a', 'w3a', 'w3b', 'w3c']
    finally:
        for piece in ('w1a', 'w1b', 'w3a', 'w3b', 'w3c', 'w3d'):
            pieces.gate(piece).set()
        readers.close()
    assert _reader_threads() == []
