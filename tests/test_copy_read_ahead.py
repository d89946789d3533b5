"""Stage 2 reads the next one-at-a-time copy's origin while it makes the current one."""
import os
import threading
import time

import pytest

from chainer_prefetch.iterators._executor import READS_AHEAD, CopyThreads, OpenOrigins
from chainer_prefetch.iterators._scheduler import Copy
from chainer_prefetch.staging.sources import DerivedFile, ReadAhead

MAKE_SECONDS = 0.1  # what each make takes
READ_SECONDS = 0.01  # what each read ahead takes: faster, so it could run far ahead


class LoggedFile(DerivedFile):
    """A derived file whose reads ahead and makes are logged with their times."""

    copied_one_at_a_time = True

    def __init__(self, name, origin, log):
        super().__init__(name, origin)
        self.log = log

    def read_ahead(self, opened=None):
        started = time.monotonic()
        origin_stat = os.fstat(opened)
        assert os.path.samestat(origin_stat, os.stat(self.origin))
        time.sleep(READ_SECONDS)
        self.log.append(('read', self.name, started, time.monotonic(), opened))
        return ReadAhead(self.name, origin_stat, b'read ahead')

    def load_from_origin(self, ahead=None):
        started = time.monotonic()
        time.sleep(MAKE_SECONDS)
        self.log.append(('make', self.name, started, time.monotonic(), ahead))
        return ahead or b'read while made'

    def write_local_form(self, content, out):
        out.write(content)


class Stage2:
    """Real copy threads that write each source's local form into ``folder``."""

    def __init__(self, folder, before_copy=None, local=()):
        self.folder = folder
        self.before_copy = before_copy
        self.done = []
        self.finished = threading.Semaphore(0)
        self.threads = CopyThreads(
            2, self._run, self._post,
            lambda sources: any(s.name not in local for s in sources))

    def _run(self, action, sources):
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
            assert self.finished.acquire(timeout=10), 'a copy never finished'

    def stop(self):
        self.threads.stop()
        for thread in self.threads.threads:
            thread.join(5)
            assert not thread.is_alive(), thread.name


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
    log = []
    sources = _logged_files(tmp_path, 5, log)
    stage = _copy_all(tmp_path, sources)
    assert stage.done == list(range(len(sources)))  # in the order submitted
    reads = {entry[1]: entry for entry in log if entry[0] == 'read'}
    makes = [entry for entry in log if entry[0] == 'make']
    assert [entry[1] for entry in makes] == [s.name for s in sources]
    assert all(ahead == b'read ahead' for *_, ahead in makes)
    for before, after in zip(makes, makes[1:]):
        assert before[3] <= after[2]  # one make at a time
    for current, (_, name, *_rest) in zip(makes, makes[1:]):
        # read while the one before was made ...
        assert reads[name][2] < current[3]
    for current, (_, name, *_rest) in zip(makes, makes[READS_AHEAD:]):
        # ... as far as READS_AHEAD ahead of the one being made ...
        assert reads[name][2] < current[3]
    for current, (_, name, *_rest) in zip(makes, makes[1 + READS_AHEAD:]):
        # ... and never more than READS_AHEAD ahead of the one being made
        assert reads[name][2] >= current[3]
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
    log = []
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
    opened = {entry[1]: entry[4] for entry in log if entry[0] == 'read'}
    assert list(opened) == [source.name for source in sources]
    # b is read while a is made, through the descriptor a's read opened
    # (opening the file again drops a's pages on FUSE without keep_cache);
    # so is d, read while b may still be made.
    assert opened['/virtual/a'] == opened['/virtual/b'] == opened['/virtual/d']
    origins = (first, second, third, fourth, fifth)
    assert [path for path in opens if path in origins] == [
        first, second, third, fourth, fifth, first]  # for a, c, e, f, g, h
    made = {entry[1]: entry[4] for entry in log if entry[0] == 'make'}
    assert made == {source.name: (None if source.name == '/virtual/c'  # changed
                                  else b'read ahead') for source in sources}
    # Every descriptor kept open for a next read is closed with the threads.
    assert [_descriptors_of(path) for path in origins] == [[]] * len(origins)


def test_a_cancelled_copy_is_neither_read_ahead_nor_made(tmp_path):
    log = []
    sources = _logged_files(tmp_path, 3, log)
    stage = Stage2(str(tmp_path))
    try:
        # The first copy holds the threads; the third is cancelled meanwhile.
        _submit(stage, sources)
        assert stage.threads.cancel([2]) == (2,)
        stage.wait(2)
        time.sleep(3 * MAKE_SECONDS)
    finally:
        stage.stop()
    assert stage.done == [0, 1]
    assert '/virtual/f2' not in {entry[1] for entry in log}


@pytest.mark.timeout(30)
def test_stop_ends_both_threads_with_copies_still_queued(tmp_path):
    stage = Stage2(str(tmp_path))
    _submit(stage, _logged_files(tmp_path, 6, []))
    time.sleep(MAKE_SECONDS / 2)
    stage.stop()  # asserts every thread ended
    assert len(stage.done) <= 2


def test_a_source_already_local_is_not_read_ahead(tmp_path):
    log = []
    _copy_all(tmp_path, _logged_files(tmp_path, 3, log), local={'/virtual/f1'})
    assert [entry[1] for entry in log if entry[0] == 'read'] == [
        '/virtual/f0', '/virtual/f2']


class FailingRead(LoggedFile):
    def read_ahead(self, opened=None):
        raise RuntimeError('read ahead failed')


def test_a_failing_read_ahead_leaves_the_copy_to_read(tmp_path):
    log = []
    stage = _copy_all(tmp_path, _logged_files(tmp_path, 2, log, FailingRead))
    assert stage.done == [0, 1]
    assert [entry[4] for entry in log if entry[0] == 'make'] == [None, None]


def test_a_copy_with_nothing_read_ahead_reads_alone(tmp_path):
    log = []
    origins = _origins(tmp_path, 3)
    sources = [FailingRead('/virtual/f0', origins[0], log)] + [
        LoggedFile('/virtual/f{}'.format(k), origins[k], log) for k in (1, 2)]
    stage = _copy_all(tmp_path, sources)
    assert stage.done == [0, 1, 2]
    made = {entry[1]: entry for entry in log if entry[0] == 'make'}
    reads = {entry[1]: entry for entry in log if entry[0] == 'read'}
    assert made['/virtual/f0'][4] is None  # it read while it was made ...
    # ... and no read ahead ran meanwhile.
    assert reads['/virtual/f1'][2] >= made['/virtual/f0'][3]


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
    log = []
    sources = _logged_files(tmp_path, 3, log)
    # f0 is current locally: its copy reads nothing, so f1 and f2 are read
    # ahead while it is made, as after any copy read ahead.
    stage = _copy_all(tmp_path, sources, local={'/virtual/f0'})
    assert stage.done == [0, 1, 2]
    made = {entry[1]: entry for entry in log if entry[0] == 'make'}
    reads = {entry[1]: entry for entry in log if entry[0] == 'read'}
    assert '/virtual/f0' not in reads
    assert reads['/virtual/f2'][2] < made['/virtual/f0'][3]


PIECE_SECONDS = 0.02  # what each piece of a read queued on the piece readers takes


class PiecewiseFile(LoggedFile):
    """A derived file read ahead in pieces queued on stage 2's piece readers."""

    pieces = 3
    gate = None  # an Event its pieces wait for, or None
    started = None  # a Semaphore released as each piece starts, or None

    def start_read_ahead(self, opened, readers):
        self.log.append(('queued', self.name, time.monotonic()))
        origin_stat = os.fstat(opened)
        return ReadAhead(self.name, origin_stat, b'read ahead', readers.submit(
            self._read_piece, range(self.pieces), 2,
            lambda: self.log.append(('released', self.name, time.monotonic()))))

    def _read_piece(self, piece):
        started = time.monotonic()
        if self.started is not None:
            self.started.release()
        if self.gate is not None:
            assert self.gate.wait(10)
        time.sleep(PIECE_SECONDS)
        if 'bad' in self.name:
            raise OSError('cannot read {} piece {}'.format(self.name, piece))
        self.log.append(('piece', self.name, started, time.monotonic(), piece))


def _piece_reader_threads():
    return [thread for thread in threading.enumerate()
            if thread.name.startswith('chainer_prefetch-read-')]


def _wait_for(condition, what):
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, 'waited 10 s for ' + what
        time.sleep(0.005)


def test_reads_queued_in_pieces_overlap_and_each_copy_waits_for_its_own(tmp_path):
    log = []
    sources = _logged_files(tmp_path, 4, log, PiecewiseFile)
    stage = _copy_all(tmp_path, sources)
    assert stage.done == [0, 1, 2, 3]
    assert _piece_reader_threads() == []  # stopped with the copy threads
    pieces = [entry for entry in log if entry[0] == 'piece']
    makes = {entry[1]: entry for entry in log if entry[0] == 'make'}
    for source in sources:
        own = [entry for entry in pieces if entry[1] == source.name]
        assert len(own) == PiecewiseFile.pieces
        # made from what was read ahead, once all its pieces were read
        assert makes[source.name][4] == b'read ahead'
        assert max(entry[3] for entry in own) <= makes[source.name][2]
    # Pieces are read in the order submitted, two at a time ...
    order = sorted(pieces, key=lambda entry: entry[2])
    assert [entry[1] for entry in order] == [
        source.name for source in sources for _ in range(PiecewiseFile.pieces)]
    for entry in order:
        assert sum(other[2] <= entry[2] < other[3] for other in order) <= 2
    # ... the copy read ahead behind the first (READS_AHEAD: both queued at
    # once) starts on the thread freed while the first's last piece is
    # still read (three pieces on two threads) ...
    def first_piece(source):
        return min(entry[2] for entry in pieces if entry[1] == source.name)

    def last_piece(source):
        return max(entry[3] for entry in pieces if entry[1] == source.name)

    assert first_piece(sources[1]) < last_piece(sources[0])
    # ... and no more than READS_AHEAD are read ahead of the one being made:
    # the third is queued once the first is read.
    queued = {entry[1]: entry[2] for entry in log if entry[0] == 'queued'}
    assert queued[sources[1].name] < last_piece(sources[0])
    assert queued[sources[2].name] >= last_piece(sources[0])
    released = [entry[1] for entry in log if entry[0] == 'released']
    assert sorted(released) == sorted(source.name for source in sources)


def test_a_read_whose_pieces_fail_leaves_the_copy_to_read_again(tmp_path):
    log = []
    origins = _origins(tmp_path, 4)
    sources = [PiecewiseFile('/virtual/{}'.format(name), origin, log)
               for name, origin in zip(('f0', 'bad1', 'f2', 'f3'), origins)]
    stage = _copy_all(tmp_path, sources)
    assert stage.done == [0, 1, 2, 3]
    made = {entry[1]: entry for entry in log if entry[0] == 'make'}
    assert {name: entry[4] for name, entry in made.items()} == {
        '/virtual/f0': b'read ahead', '/virtual/bad1': None,
        '/virtual/f2': b'read ahead', '/virtual/f3': b'read ahead'}
    # bad1 read again while it was made, and no read started meanwhile
    # (f2's was queued before).
    assert min(entry[2] for entry in log if entry[0] == 'piece'
               and entry[1] == '/virtual/f3') >= made['/virtual/bad1'][3]
    assert _piece_reader_threads() == []


def test_a_copy_cancelled_while_its_pieces_wait_has_them_dropped(tmp_path):
    log = []
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
            assert second.started.acquire(timeout=10)
        _wait_for(lambda: any(entry[:2] == ('make', '/virtual/f0')
                              for entry in log), 'f0 to be made')
        # The copy thread now waits for f1's pieces.
        assert stage.threads.cancel([1]) == (1,)
        second.gate.set()
        _wait_for(lambda: ('released', '/virtual/f1') in [
            entry[:2] for entry in log], 'f1 to release its file')
        stage.wait(1)
    finally:
        second.gate.set()
        stage.stop()
    assert stage.done == [0]
    assert sorted(entry[4] for entry in log if entry[0] == 'piece'
                  and entry[1] == '/virtual/f1') == [0, 1]  # 2 and 3 dropped
    assert '/virtual/f1' not in [entry[1] for entry in log if entry[0] == 'make']
    assert _piece_reader_threads() == []


@pytest.mark.timeout(30)
def test_stop_with_pieces_still_queued_ends_every_reader_thread(tmp_path):
    log = []
    sources = _logged_files(tmp_path, 4, log, PiecewiseFile)
    gate = threading.Event()
    started = threading.Semaphore(0)
    for source in sources:
        source.gate = gate
        source.started = started
    stage = Stage2(str(tmp_path))
    _submit(stage, sources)
    for _ in range(2):  # two pieces of f0 are being read, the rest queued
        assert started.acquire(timeout=10)
    stage.threads.stop()
    gate.set()
    for thread in stage.threads.threads:
        thread.join(5)
        assert not thread.is_alive(), thread.name
    assert _piece_reader_threads() == []
    assert stage.done == []
    assert len([entry for entry in log if entry[0] == 'piece']) == 2
