"""Stage 2 reads the next one-at-a-time copy's origin while it makes the current one.

Orderings are asserted on the order the threads logged what they did (under
a lock), and overlaps by making a step wait for the one it must overlap
with: no assertion depends on how fast a step runs.
"""
import os
import threading

import pytest

from chainer_prefetch.iterators._scheduler import Copy
from chainer_prefetch.staging.copy_threads import READS_AHEAD, CopyThreads, OpenOrigins
from chainer_prefetch.staging.sources import DerivedFile, ReadAhead

WAIT = 10  # seconds any one step may wait before the test fails
#: Seconds a make watches for a read that must not happen while it is made
#: (the test passes however late the read would come; a longer watch only
#: catches a wrong read ahead more surely).
WATCH = 0.5


class Log:
    """What the copy threads did, in the order they did it."""

    def __init__(self):
        self._entries = []
        self._changed = threading.Condition()

    def add(self, *entry):
        with self._changed:
            self._entries.append(entry)
            self._changed.notify_all()

    def entries(self) -> list:
        with self._changed:
            return list(self._entries)

    def position(self, *start) -> int:
        """Where the first entry beginning with ``start`` is."""
        for position, entry in enumerate(self.entries()):
            if entry[:len(start)] == start:
                return position
        raise AssertionError('nothing logged as {}'.format(start))

    def positions(self, *start) -> list:
        return [position for position, entry in enumerate(self.entries())
                if entry[:len(start)] == start]

    def wait_for(self, *start, timeout=None):
        """Waits until an entry beginning with ``start`` is logged.

        Without ``timeout``, fails the test after ``WAIT`` seconds; with
        it, returns whether the entry came in time.
        """
        with self._changed:
            logged = self._changed.wait_for(
                lambda: any(entry[:len(start)] == start for entry in self._entries),
                WAIT if timeout is None else timeout)
        assert logged or timeout is not None, 'waited {} s for {}'.format(WAIT, start)
        return logged


class LoggedFile(DerivedFile):
    """A derived file whose reads ahead and makes are logged.

    ``read_gate`` (an Event) holds its read ahead until set; ``make_gate``
    its make.  ``make_waits_for`` names the copies whose reads ahead must
    happen while it is made: its make ends only once they are logged.
    ``make_watches_for`` names those whose reads must not: its make gives
    them ``WATCH`` seconds to show up (the test then finds them in the log).
    """

    copied_one_at_a_time = True
    read_gate = None
    make_gate = None
    make_waits_for = ()
    make_watches_for = ()

    def __init__(self, name, origin, log):
        super().__init__(name, origin)
        self.log = log

    def read_ahead(self, opened=None):
        origin_stat = os.fstat(opened)
        assert os.path.samestat(origin_stat, os.stat(self.origin))
        if self.read_gate is not None:
            assert self.read_gate.wait(WAIT)
        self.log.add('read', self.name, opened)
        return ReadAhead(self.name, origin_stat, b'read ahead')

    def load_from_origin(self, ahead=None):
        self.log.add('make', self.name, ahead)
        if self.make_gate is not None:
            assert self.make_gate.wait(WAIT)
        for name in self.make_waits_for:
            self.log.wait_for('read', name)
        for name in self.make_watches_for:
            self.log.wait_for('read', name, timeout=WATCH)
        self.log.add('made', self.name)
        return ahead or b'read while made'

    def write_local_form(self, content, out):
        out.write(content)


class Stage2:
    """Real copy threads that write each source's local form into ``folder``."""

    def __init__(self, folder, before_copy=None, local=()):
        self.folder = folder
        self.before_copy = before_copy
        self.done = []  # copy ids made, and what a copy raised
        self.finished = threading.Semaphore(0)
        self.threads = CopyThreads(
            2, self._run, self._post, self._post,
            lambda action, sources: any(s.name not in local for s in sources))

    def _run(self, action, sources, asked_ahead):
        for source in sources:
            if self.before_copy is not None:
                self.before_copy(source)
            path = os.path.join(self.folder, os.path.basename(source.name))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                source.write_local(fd, source.stat_origin(), path)
            finally:
                os.close(fd)
        return action.copy_id

    def _post(self, event):
        self.done.append(event)
        self.finished.release()

    def wait(self, count):
        for _ in range(count):
            assert self.finished.acquire(timeout=WAIT), 'a copy never finished'

    def join(self):
        """Asserts that every thread has ended."""
        for thread in self.threads.threads:
            thread.join(5)
            assert not thread.is_alive(), thread.name

    def stop(self):
        self.threads.stop()
        self.join()


def _origins(tmp_path, count):
    paths = []
    for number in range(count):
        path = str(tmp_path / 'origin-{}'.format(number))
        with open(path, 'wb') as f:
            f.write(b'x' * 10)
        paths.append(path)
    return paths


def _submit(stage, sources):
    for copy_id, source in enumerate(sources):
        stage.threads.submit(Copy(copy_id, copy_id, copy_id, copy_id), [source])


def _logged_files(tmp_path, count, log, kind=LoggedFile):
    return [kind('/virtual/f{}'.format(k), origin, log)
            for k, origin in enumerate(_origins(tmp_path, count))]


def _copy_all(tmp_path, sources, **stage_options) -> Stage2:
    """Submits every copy to real copy threads, waits for them all, stops."""
    stage = Stage2(str(tmp_path), **stage_options)
    try:
        _submit(stage, sources)
        stage.wait(len(sources))
    finally:
        stage.stop()
    return stage


def test_the_next_copy_is_read_while_the_current_one_is_made(tmp_path):
    log = Log()
    sources = _logged_files(tmp_path, 5, log)
    names = [source.name for source in sources]
    for number, source in enumerate(sources):
        # Read while the one before is made, as far as READS_AHEAD ahead of
        # it: each make ends only once those are read.
        source.make_waits_for = names[number + 1:number + 1 + READS_AHEAD]
    stage = _copy_all(tmp_path, sources)
    assert stage.done == list(range(len(sources)))  # in the order submitted
    makes = [entry for entry in log.entries() if entry[0] in ('make', 'made')]
    # one make at a time, in the order submitted, each from what was read ahead
    assert [entry[:2] for entry in makes] == [
        (kind, name) for name in names for kind in ('make', 'made')]
    assert all(entry[2] == b'read ahead' for entry in makes if entry[0] == 'make')
    for current, name in zip(names, names[1 + READS_AHEAD:]):
        # ... and never more than READS_AHEAD ahead of the one being made
        assert log.position('read', name) > log.position('made', current)
    for source in sources:
        with open(os.path.join(str(tmp_path), os.path.basename(source.name)),
                  'rb') as f:
            assert f.read() == b'read ahead'


def _descriptors_of(path):
    """This process's open descriptors of ``path``."""
    found = []
    for name in os.listdir('/proc/self/fd'):
        try:
            if os.readlink('/proc/self/fd/' + name) == path:
                found.append(int(name))
        except OSError:
            pass  # (the listing's own descriptor, closed by now)
    return found


def test_a_file_read_or_made_meanwhile_is_read_ahead_without_opening_it_again(
        tmp_path, monkeypatch):
    log = Log()
    opens = []
    real_open = os.open

    def logged_open(path, *args, **kwargs):
        opens.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, 'open', logged_open)
    first, second, third, fourth, fifth = _origins(tmp_path, 5)
    sources = [LoggedFile('/virtual/a', first, log),
               LoggedFile('/virtual/b', first, log),   # same file as the one before
               LoggedFile('/virtual/c', second, log),  # changes after its read
               LoggedFile('/virtual/d', first, log),   # a, b's file: read recently
               LoggedFile('/virtual/e', third, log),
               LoggedFile('/virtual/f', fourth, log),
               LoggedFile('/virtual/g', fifth, log),
               LoggedFile('/virtual/h', first, log)]   # not read since d

    def change_c(source):
        if source.name == '/virtual/c':
            with open(second, 'ab') as f:
                f.write(b'more')

    _copy_all(tmp_path, sources, before_copy=change_c)
    monkeypatch.undo()
    opened = {entry[1]: entry[2] for entry in log.entries() if entry[0] == 'read'}
    assert list(opened) == [source.name for source in sources]
    # b is read while a is made, through the descriptor a's read opened
    # (opening the file again drops a's pages on FUSE without keep_cache);
    # so is d, read while b may still be made.
    assert opened['/virtual/a'] == opened['/virtual/b'] == opened['/virtual/d']
    origins = (first, second, third, fourth, fifth)
    assert [path for path in opens if path in origins] == [
        first, second, third, fourth, fifth, first]  # for a, c, e, f, g, h
    made = {entry[1]: entry[2] for entry in log.entries() if entry[0] == 'make'}
    assert made == {source.name: (None if source.name == '/virtual/c'  # changed
                                  else b'read ahead') for source in sources}
    # Every descriptor kept open for a next read is closed with the threads.
    assert [_descriptors_of(path) for path in origins] == [[]] * len(origins)


def test_a_cancelled_copy_is_neither_read_ahead_nor_made(tmp_path):
    log = Log()
    sources = _logged_files(tmp_path, 4, log)
    sources[0].read_gate = threading.Event()
    stage = Stage2(str(tmp_path))
    try:
        # The first copy's read holds the threads; the third is cancelled meanwhile.
        _submit(stage, sources)
        assert stage.threads.cancel([2]) == (2,)
        sources[0].read_gate.set()
        stage.wait(3)
    finally:
        sources[0].read_gate.set()
        stage.stop()
    assert stage.done == [0, 1, 3]  # the fourth is made after the third's turn
    assert '/virtual/f2' not in {entry[1] for entry in log.entries()}


@pytest.mark.timeout(30)
def test_stop_ends_both_threads_with_copies_still_queued(tmp_path):
    log = Log()
    sources = _logged_files(tmp_path, 6, log)
    sources[0].make_gate = threading.Event()
    stage = Stage2(str(tmp_path))
    try:
        _submit(stage, sources)
        log.wait_for('make', '/virtual/f0')
        stage.threads.stop()
    finally:
        sources[0].make_gate.set()
    stage.join()
    assert stage.done == [0]  # the copy being made ends; no other starts


def test_a_source_already_local_is_not_read_ahead(tmp_path):
    log = Log()
    _copy_all(tmp_path, _logged_files(tmp_path, 3, log), local={'/virtual/f1'})
    assert [entry[1] for entry in log.entries() if entry[0] == 'read'] == [
        '/virtual/f0', '/virtual/f2']


class FailingRead(LoggedFile):
    def read_ahead(self, opened=None):
        raise RuntimeError('read ahead failed')


def test_a_failing_read_ahead_leaves_the_copy_to_read(tmp_path):
    log = Log()
    stage = _copy_all(tmp_path, _logged_files(tmp_path, 2, log, FailingRead))
    assert stage.done == [0, 1]
    assert [entry[2] for entry in log.entries() if entry[0] == 'make'] == [None, None]


def test_a_copy_with_nothing_read_ahead_reads_alone(tmp_path):
    log = Log()
    origins = _origins(tmp_path, 3)
    sources = [FailingRead('/virtual/f0', origins[0], log)] + [
        LoggedFile('/virtual/f{}'.format(k), origins[k], log) for k in (1, 2)]
    sources[0].make_watches_for = ('/virtual/f1',)
    stage = _copy_all(tmp_path, sources)
    assert stage.done == [0, 1, 2]
    made = {entry[1]: entry for entry in log.entries() if entry[0] == 'make'}
    assert made['/virtual/f0'][2] is None  # it read while it was made ...
    # ... and no read ahead ran meanwhile.
    assert log.position('read', '/virtual/f1') > log.position('made', '/virtual/f0')


def test_what_a_copy_raises_is_reported_and_the_next_copy_made(tmp_path):
    def fail_first(source):
        if source.name == '/virtual/f0':
            raise ValueError('a bug')

    stage = _copy_all(tmp_path, _logged_files(tmp_path, 2, Log()),
                      before_copy=fail_first)
    assert [type(event) for event in stage.done] == [ValueError, int]
    assert stage.done[1] == 1


def test_a_kept_origin_replaced_on_storage_is_opened_again(tmp_path):
    first, second = _origins(tmp_path, 2)
    origins = OpenOrigins(2)
    try:
        kept = origins.open({first})[first]
        assert origins.open({first})[first] == kept  # kept, not reopened
        old_inode = os.fstat(kept).st_ino
        os.replace(second, first)  # a new file at the path
        reopened = origins.open({first})[first]
        assert os.fstat(reopened).st_ino == os.stat(first).st_ino != old_inode
        assert _descriptors_of(first) == [reopened]
        assert _descriptors_of(first + ' (deleted)') == []  # the old one closed
    finally:
        origins.close()
    assert _descriptors_of(first) == []


def test_a_copy_already_local_does_not_hold_back_the_next_read(tmp_path):
    log = Log()
    sources = _logged_files(tmp_path, 3, log)
    # f0 is current locally: its copy reads nothing, so f1 and f2 are read
    # ahead while it is made, as after any copy read ahead (its make ends
    # only once they are).
    sources[0].make_waits_for = ('/virtual/f1', '/virtual/f2')
    stage = _copy_all(tmp_path, sources, local={'/virtual/f0'})
    assert stage.done == [0, 1, 2]
    assert log.positions('read', '/virtual/f0') == []
    assert log.position('read', '/virtual/f2') < log.position('made', '/virtual/f0')


class PiecewiseFile(LoggedFile):
    """A derived file read ahead in pieces queued on stage 2's piece readers.

    Each piece logs ``('piece', name, piece)`` as it starts and
    ``('piece read', name, piece)`` once read.
    """

    pieces = 3
    gate = None  # an Event its pieces wait for, or None
    started = None  # a Semaphore released as each piece starts, or None
    piece_waits_for = {}  # piece -> the entry it waits for before it is read

    def start_read_ahead(self, opened, readers):
        self.log.add('queued', self.name)
        origin_stat = os.fstat(opened)
        return ReadAhead(self.name, origin_stat, b'read ahead', readers.submit(
            self._read_piece, range(self.pieces), 2,
            lambda: self.log.add('released', self.name)))

    def _read_piece(self, piece):
        self.log.add('piece', self.name, piece)
        if self.started is not None:
            self.started.release()
        if self.gate is not None:
            assert self.gate.wait(WAIT)
        if piece in self.piece_waits_for:
            self.log.wait_for(*self.piece_waits_for[piece])
        if 'bad' in self.name:
            raise OSError('cannot read {} piece {}'.format(self.name, piece))
        self.log.add('piece read', self.name, piece)


def _piece_reader_threads():
    return [thread for thread in threading.enumerate()
            if thread.name.startswith('chainer_prefetch-read-')]


def test_reads_queued_in_pieces_overlap_and_each_copy_waits_for_its_own(tmp_path):
    log = Log()
    sources = _logged_files(tmp_path, 4, log, PiecewiseFile)
    last = PiecewiseFile.pieces - 1
    # The copy read ahead behind the first (READS_AHEAD: both queued at once)
    # starts on the thread freed while the first's last piece is still read
    # (three pieces on two threads): that piece ends only once it has.
    sources[0].piece_waits_for = {last: ('piece', sources[1].name, 0)}
    stage = _copy_all(tmp_path, sources)
    assert stage.done == [0, 1, 2, 3]
    assert _piece_reader_threads() == []  # stopped with the copy threads
    entries = log.entries()
    for source in sources:
        read = log.positions('piece read', source.name)
        assert len(read) == PiecewiseFile.pieces
        # made from what was read ahead, once all its pieces were read
        assert log.position('make', source.name, b'read ahead') > max(read)
    # Pieces are read in the order submitted, two at a time: when a piece
    # starts, at most one piece submitted before it (the other thread's) is
    # not read yet.
    submitted = [(source.name, piece) for source in sources
                 for piece in range(PiecewiseFile.pieces)]
    read = set()
    for entry in entries:
        if entry[0] == 'piece':
            before = submitted[:submitted.index(entry[1:])]
            assert len([piece for piece in before if piece not in read]) <= 1, entry
        elif entry[0] == 'piece read':
            read.add(entry[1:])
    # No more than READS_AHEAD are read ahead of the one being made: the
    # third is queued once the first is read.
    assert log.position('queued', sources[1].name) < max(
        log.positions('piece read', sources[0].name))
    assert log.position('queued', sources[2].name) > max(
        log.positions('piece read', sources[0].name))
    released = [entry[1] for entry in entries if entry[0] == 'released']
    assert sorted(released) == sorted(source.name for source in sources)


def test_a_read_whose_pieces_fail_leaves_the_copy_to_read_again(tmp_path):
    log = Log()
    origins = _origins(tmp_path, 4)
    sources = [PiecewiseFile('/virtual/{}'.format(name), origin, log)
               for name, origin in zip(('f0', 'bad1', 'f2', 'f3'), origins)]
    stage = _copy_all(tmp_path, sources)
    assert stage.done == [0, 1, 2, 3]
    made = {entry[1]: entry[2] for entry in log.entries() if entry[0] == 'make'}
    assert made == {
        '/virtual/f0': b'read ahead', '/virtual/bad1': None,
        '/virtual/f2': b'read ahead', '/virtual/f3': b'read ahead'}
    # bad1 read again while it was made, and no read started meanwhile
    # (f2's was queued before).
    assert log.position('piece', '/virtual/f3') > log.position('made', '/virtual/bad1')
    assert _piece_reader_threads() == []


def test_a_copy_cancelled_while_its_pieces_wait_has_them_dropped(tmp_path):
    log = Log()
    origins = _origins(tmp_path, 2)
    first = PiecewiseFile('/virtual/f0', origins[0], log)
    second = PiecewiseFile('/virtual/f1', origins[1], log)
    second.pieces = 4
    second.gate = threading.Event()
    second.started = threading.Semaphore(0)
    stage = Stage2(str(tmp_path))
    try:
        _submit(stage, [first, second])
        for _ in range(2):  # f1's first two pieces hold both threads
            assert second.started.acquire(timeout=WAIT)
        log.wait_for('made', '/virtual/f0')
        # The copy thread now waits for f1's pieces (or soon will).
        assert stage.threads.cancel([1]) == (1,)
        second.gate.set()
        log.wait_for('released', '/virtual/f1')
        stage.wait(1)
    finally:
        second.gate.set()
        stage.stop()
    assert stage.done == [0]
    assert sorted(entry[2] for entry in log.entries() if entry[0] == 'piece'
                  and entry[1] == '/virtual/f1') == [0, 1]  # 2 and 3 dropped
    assert log.positions('make', '/virtual/f1') == []
    assert _piece_reader_threads() == []


@pytest.mark.timeout(30)
def test_stop_with_pieces_still_queued_ends_every_reader_thread(tmp_path):
    log = Log()
    sources = _logged_files(tmp_path, 4, log, PiecewiseFile)
    gate = threading.Event()
    started = threading.Semaphore(0)
    for source in sources:
        source.gate = gate
        source.started = started
    stage = Stage2(str(tmp_path))
    _submit(stage, sources)
    for _ in range(2):  # two pieces of f0 are being read, the rest queued
        assert started.acquire(timeout=WAIT)
    stage.threads.stop()
    gate.set()
    stage.join()
    assert _piece_reader_threads() == []
    assert stage.done == []
    assert len(log.positions('piece')) == 2
