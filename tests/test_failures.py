"""PrefetchMultiprocessIterator when things go wrong, on real files and processes.

Datasets are real JPEGs read by chainer.datasets.LabeledImageDataset; local
directories are real directories or small tmpfs mounts; workers are real
processes that are really killed.  Every test that starts processes has a
timeout, and checks that what it started is gone afterwards.
"""
import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import chainer
import numpy
import pytest
from chainer.dataset import DatasetMixin

import helpers
from chainer_prefetch import ExampleLoadError, PrefetchMultiprocessIterator
from chainer_prefetch.staging import local_directory

pytestmark = pytest.mark.timeout(60)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
N_IMAGES = 12


@pytest.fixture
def images(tmp_path):
    list_file, root, paths = helpers.make_jpeg_dataset(tmp_path / 'shared', N_IMAGES)
    return list_file, root, paths


def _dataset(images):
    list_file, root, _ = images
    return chainer.datasets.LabeledImageDataset(list_file, root)


def _iterator(dataset, local_dir, batch_size=3, **options):
    settings = dict(repeat=False, shuffle=False, n_processes=2,
                    n_copy_threads=2, n_copy_ahead=2, dataset_timeout=None,
                    local_dir=local_dir)
    settings.update(options)
    return PrefetchMultiprocessIterator(dataset, batch_size, **settings)


def _read_all(iterator):
    examples = []
    for batch in iterator:
        examples.extend(batch)
    return examples


def _direct(dataset):
    return [dataset[i] for i in range(len(dataset))]


class SlowDataset(DatasetMixin):
    """No files: every example takes ``delay`` seconds."""

    def __init__(self, n, delay):
        self.n = n
        self.delay = delay

    def __len__(self):
        return self.n

    def get_example(self, i):
        time.sleep(self.delay)
        return numpy.full(4, i, numpy.float32), numpy.int32(i)


# ---- correct data, and the local directory ----------------------------------

def test_batches_equal_the_dataset_and_second_run_copies_nothing(images, tmp_path):
    dataset = _dataset(images)
    local_dir = str(tmp_path / 'local')
    expected = _direct(dataset)
    with _iterator(dataset, local_dir) as it:
        helpers.assert_examples_equal(_read_all(it), expected)
        stats = it.stats
    assert stats['examples_from_local'] > 0
    assert stats['files_copied'] == N_IMAGES
    assert stats['local_storage_error'] is None
    for path in images[2]:
        local = os.path.join(local_dir, 'data', path.lstrip('/'))
        assert helpers.read_bytes(local) == helpers.read_bytes(path)

    with _iterator(dataset, local_dir) as it:
        helpers.assert_examples_equal(_read_all(it), expected)
        stats = it.stats
    assert stats['files_copied'] == 0
    assert stats['files_already_local'] == N_IMAGES
    assert stats['examples_from_local'] == N_IMAGES


def test_full_local_directory_warns_once_and_reads_the_source(tmp_path, monkeypatch):
    list_file, root, paths = helpers.make_jpeg_dataset(
        tmp_path / 'shared', 24, size=96, quality=95)
    total = sum(os.path.getsize(p) for p in paths)
    dataset = chainer.datasets.LabeledImageDataset(list_file, root)
    mount = tmp_path / 'small'
    with helpers.tmpfs(mount, '64k') as mounted:
        assert total > 3 * 64 * 1024, ('the dataset must not fit', total)
        if not mounted:  # fallback: ENOSPC from local_directory's os.write only
            monkeypatch.setattr(local_directory, 'os', helpers.FullDiskOs(64 * 1024))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            with _iterator(dataset, str(mount / 'local'), batch_size=4) as it:
                examples = _read_all(it)
                stats = it.stats
        helpers.assert_examples_equal(examples, _direct(dataset))
        about_local = [w for w in caught if issubclass(w.category, UserWarning)
                       and 'local directory' in str(w.message)]
        assert len(about_local) == 1, [str(w.message) for w in caught]
        assert stats['local_storage_error'] is not None
        assert 'No space left' in stats['local_storage_error']
        assert stats['examples_from_source'] > 0
        assert os.listdir(str(mount / 'local' / '.partial')) == []
        # Whatever is under a final name is a complete copy.
        data_root = str(mount / 'local' / 'data')
        for relative in helpers.files_under(data_root):
            source = '/' + relative
            assert helpers.read_bytes(os.path.join(data_root, relative)) == \
                helpers.read_bytes(source)


def test_uncreatable_local_directory_warns_at_construction(images, tmp_path):
    blocker = tmp_path / 'a_file'
    blocker.write_bytes(b'x')
    dataset = _dataset(images)
    with pytest.warns(UserWarning, match='local directory') as caught:
        it = _iterator(dataset, str(blocker / 'local'))
    assert str(blocker / 'local') in str(caught[0].message)
    with it:
        helpers.assert_examples_equal(_read_all(it), _direct(dataset))
        assert it.stats['examples_from_local'] == 0
        assert it.stats['examples_from_source'] == N_IMAGES


# ---- errors reach next() ---------------------------------------------------------

def test_missing_source_file_raises_sticky_error_until_reset(images, tmp_path):
    dataset = _dataset(images)
    bad_index = 7  # third batch of 3
    missing = images[2][bad_index]
    expected = _direct(dataset)
    os.unlink(missing)
    with _iterator(dataset, str(tmp_path / 'local')) as it:
        started = time.monotonic()
        got = []
        with pytest.raises(ExampleLoadError) as info:
            for _ in range(10):
                got.extend(it.next())
        assert time.monotonic() - started < 10
        message = str(info.value)
        assert re.search(r'\b{}\b'.format(bad_index), message), message
        assert missing in message
        helpers.assert_examples_equal(got, expected[:6])
        assert it.stats['files_failed_source'] >= 1
        # Sticky.
        with pytest.raises(ExampleLoadError) as again:
            it.next()
        assert missing in str(again.value)
        # reset() clears it: the first batch comes again.
        it.reset()
        helpers.assert_examples_equal(it.next(), expected[:3])


def test_exception_in_get_example_names_the_index(tmp_path):
    dataset = helpers.FailingDataset(12, bad=5)
    with _iterator(dataset, str(tmp_path / 'local'), batch_size=2) as it:
        started = time.monotonic()
        with pytest.raises(ExampleLoadError) as info:
            for _ in range(10):
                it.next()
        assert time.monotonic() - started < 10
    message = str(info.value)
    assert re.search(r'\bexample 5\b', message), message
    assert 'broken example here' in message
    # The dataset's own type, as with MultiprocessIterator, and the loader's
    # traceback as the cause.
    assert isinstance(info.value, ValueError)
    assert 'get_example' in str(info.value.__cause__) or \
        '__getitem__' in str(info.value.__cause__)


def test_killed_worker_raises_instead_of_hanging(images, tmp_path):
    """A worker killed by the system: ExampleLoadError saying so, never a hang.

    Killed while idle, the dead worker is the first one the pool gives the
    next task to; whether the pool's collector thread notices the death
    before that task is sent is a race, so this is repeated.  Each round
    must end in ExampleLoadError (not BrokenPipeError, not a stall).
    """
    dataset = _dataset(images)
    for round_number in range(10):
        snapshot = helpers.ResourceSnapshot()
        it = _iterator(dataset, str(tmp_path / 'local'), batch_size=2,
                       repeat=True, dataset_timeout=5)
        try:
            with warnings.catch_warnings():
                # A stalled next() raises instead of hanging the test.
                warnings.simplefilter('error', it.TimeoutWarning)
                it.next()
                workers = snapshot.new_children()
                assert len(workers) == 2, workers
                assert helpers.wait_until(snapshot.record, 5)
                time.sleep(0.1)  # every task answered: the workers are idle
                victim = min(workers)
                os.kill(victim, signal.SIGKILL)
                started = time.monotonic()
                with pytest.raises(ExampleLoadError) as info:
                    for _ in range(50):
                        it.next()
                assert time.monotonic() - started < 10
            message = str(info.value)
            assert 'died' in message and str(victim) in message, message
        finally:
            it.finalize()
        snapshot.assert_clean()


def _slowly(example):
    time.sleep(0.02)
    return example


# ---- clean shutdown -----------------------------------------------------------------

def _start(images, tmp_path):
    it = _iterator(_dataset(images), str(tmp_path / 'local'), batch_size=2,
                   repeat=True, shuffle=True)
    it.next()
    it.next()
    return it


def _assert_was_running(snapshot):
    helpers.wait_until(snapshot.record, 5)  # buffers follow the first batch
    pids, threads, segments = snapshot.leftovers()
    assert len(pids) == 2 and threads and segments, (pids, threads, segments)
    return pids


def test_finalize_stops_everything(images, tmp_path):
    snapshot = helpers.ResourceSnapshot()
    it = _start(images, tmp_path)
    workers = _assert_was_running(snapshot)
    it.finalize()
    snapshot.assert_clean()
    assert not any(helpers.is_running(pid) for pid in workers)
    with pytest.raises(RuntimeError):
        it.next()


def test_garbage_collection_stops_everything(images, tmp_path):
    snapshot = helpers.ResourceSnapshot()
    it = _start(images, tmp_path)
    workers = _assert_was_running(snapshot)
    del it
    gc.collect()
    snapshot.assert_clean()
    assert not any(helpers.is_running(pid) for pid in workers)


def test_exception_in_training_loop_inside_with_stops_everything(images, tmp_path):
    snapshot = helpers.ResourceSnapshot()
    with pytest.raises(ZeroDivisionError):
        with _iterator(_dataset(images), str(tmp_path / 'local'), batch_size=2,
                       repeat=True) as it:
            for number, batch in enumerate(it):
                assert len(batch) == 2
                if number == 3:
                    _assert_was_running(snapshot)
                    raise ZeroDivisionError('an error in the training loop')
    # A delivered batch views shared memory until the user drops it.
    del it, batch
    snapshot.assert_clean()


_SCRIPT = textwrap.dedent('''
    import os, signal, sys, time
    # Ctrl-C raises KeyboardInterrupt, as in a terminal, even when these
    # tests were started with SIGINT ignored (in the background).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import chainer
    import helpers
    from chainer_prefetch import PrefetchMultiprocessIterator

    def slow(example):
        time.sleep(0.05)
        return example

    base = chainer.datasets.LabeledImageDataset({list_file!r}, {root!r})
    dataset = chainer.datasets.TransformDataset(base, slow)
    it = PrefetchMultiprocessIterator(
        dataset, 2, n_processes=2, local_dir={local_dir!r}, n_copy_threads=2,
        n_copy_ahead=2)
    for number, batch in enumerate(it):  # a training loop
        if number == 4:  # buffers come after the first batch is measured
            print('WORKERS', *sorted(helpers.worker_children()), flush=True)
            print('SEGMENTS', *sorted(helpers.mapped_segments()), flush=True)
        print('BATCH', number, flush=True)
''')


def _run_script(images, tmp_path):
    list_file, root, _ = images
    script = _SCRIPT.format(list_file=list_file, root=root,
                            local_dir=str(tmp_path / 'local'))
    # `python -c` imports from its working directory: helpers from tests/.
    process = subprocess.Popen([sys.executable, '-c', script], cwd=TESTS_DIR,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True, text=True)
    workers = segments = None
    for line in process.stdout:
        if line.startswith('WORKERS'):
            workers = [int(p) for p in line.split()[1:]]
        if line.startswith('SEGMENTS'):
            segments = line.split()[1:]
        if line.startswith('BATCH 5'):
            break
    assert workers is not None and len(workers) == 2, process.stderr.read()
    assert all(helpers.is_running(pid) for pid in workers)
    # Anonymous memory: mapped while running, no name in /dev/shm to leave.
    assert segments and all(s.startswith('memfd:') for s in segments)
    return process, workers, segments


def test_ctrl_c_ends_the_program_and_its_workers(images, tmp_path):
    process, workers, segments = _run_script(images, tmp_path)
    _, stderr = helpers.press_ctrl_c(process)
    assert 'KeyboardInterrupt' in stderr
    # Finished by the program itself (not by orphan detection later).
    assert [pid for pid in workers if helpers.is_running(pid)] == []


def test_workers_exit_when_the_main_process_is_killed(images, tmp_path):
    process, workers, _ = _run_script(images, tmp_path)
    try:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(5)
        gone = helpers.wait_until(
            lambda: not any(helpers.is_running(pid) for pid in workers), 5)
        assert gone, [pid for pid in workers if helpers.is_running(pid)]
    finally:
        for pid in workers:
            if helpers.is_running(pid):
                os.kill(pid, signal.SIGKILL)
        process.stdout.close()
        process.stderr.close()


# ---- bounded look-ahead and sharing ---------------------------------------------------

def test_copy_ahead_is_bounded(tmp_path):
    list_file, root, _ = helpers.make_jpeg_dataset(tmp_path / 'shared', 40, size=16)
    dataset = chainer.datasets.LabeledImageDataset(list_file, root)
    batch_size, ahead = 2, 2
    with _iterator(dataset, str(tmp_path / 'local'), batch_size=batch_size,
                   repeat=True, n_copy_ahead=ahead) as it:
        def staged():
            stats = it.stats
            return stats['examples_staged'] + stats['examples_not_staged']

        for consumed in range(1, 9):
            it.next()
            # Stages 1-2 run at least the next batch ahead...
            assert helpers.wait_until(
                lambda n=(consumed + 1) * batch_size: staged() >= n, 30), \
                (consumed, it.stats)
            time.sleep(0.15)  # a slow training step: time to run further
            # ...and never more than consumed + n_prefetch ready +
            # n_copy_ahead in flight.
            assert staged() <= (consumed + ahead + 1) * batch_size, \
                (consumed, it.stats)


def test_two_iterators_share_one_local_directory(images, tmp_path):
    dataset = _dataset(images)
    expected = _direct(dataset)
    local_dir = str(tmp_path / 'local')
    first = _iterator(dataset, local_dir, batch_size=2)
    second = _iterator(_dataset(images), local_dir, batch_size=2)
    got = {first: [], second: []}
    try:
        running = [first, second]
        while running:
            for it in list(running):
                try:
                    got[it].extend(it.next())
                except StopIteration:
                    running.remove(it)
        stats = [first.stats, second.stats]
    finally:
        first.finalize()
        second.finalize()
    helpers.assert_examples_equal(got[first], expected)
    helpers.assert_examples_equal(got[second], expected)
    assert sum(s['files_copied'] for s in stats) == N_IMAGES, stats
    assert sum(s['files_copied'] + s['files_already_local']
               for s in stats) == 2 * N_IMAGES, stats
    assert os.listdir(os.path.join(local_dir, '.partial')) == []



# ---- bounded shutdown, shared memory, start methods -------------------------------

def _parent_of(pid):
    """The parent's pid of ``pid``, or ``None`` if it has ended."""
    stat = helpers._read('/proc/{}/stat'.format(pid))
    return None if stat is None else int(stat.rsplit(')', 1)[1].split()[1])


def test_finalize_keeps_one_deadline_while_shared_storage_hangs(tmp_path):
    """Every copy thread stuck opening a source (a FIFO nobody writes behaves
    like a hung file system): finalize() still returns within its deadline."""
    from chainer_prefetch.iterators._executor import STOP_SECONDS
    shared = tmp_path / 'shared'
    shared.mkdir()
    fifos = []
    for i in range(8):
        path = str(shared / 'hung{}.jpg'.format(i))
        os.mkfifo(path)
        fifos.append(path)
    dataset = chainer.datasets.ImageDataset(fifos)
    it = _iterator(dataset, str(tmp_path / 'local'), batch_size=2,
                   n_copy_threads=4)
    consumer = threading.Thread(target=_next_quietly, args=(it,), daemon=True)
    consumer.start()
    # Every copy thread blocked in open() on a FIFO.
    assert helpers.wait_until(lambda: helpers.threads_in_open() >= 4, 30), \
        helpers.threads_in_open()
    try:
        started = time.monotonic()
        it.finalize()
        took = time.monotonic() - started
        assert took < STOP_SECONDS + 1.0, took
        consumer.join(5)
        assert not consumer.is_alive()  # next() ended too (with an error)
    finally:
        for path in fifos:  # release the stuck threads: EOF for each reader
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: nobody has it open for reading
                pass


def _next_quietly(it):
    try:
        it.next()
    except Exception:
        pass


def test_shared_memory_is_anonymous_not_in_dev_shm(tmp_path):
    """Buffers are memfd segments: the size of /dev/shm (64 MB in containers)
    does not matter, and nothing is left there, even after a SIGKILL."""
    before = set(os.listdir('/dev/shm'))
    snapshot = helpers.ResourceSnapshot()
    dataset = [numpy.full((256, 1024), i, numpy.float32) for i in range(16)]
    it = PrefetchMultiprocessIterator(dataset, 4, n_processes=2,
                                      shared_mem=2 ** 20)
    try:
        for _ in range(6):
            batch = it.next()
            assert all(example.shape == (256, 1024) for example in batch)
        assert helpers.wait_until(snapshot.record, 5)
        assert all(segment.startswith('memfd:chainer_prefetch-batch')
                   for segment in snapshot.ours), snapshot.ours
        assert helpers.new_shm_names(before) == []
    finally:
        it.finalize()
    del batch  # delivered arrays view the memory until dropped
    snapshot.assert_clean()


def test_shared_memory_larger_than_the_machine_warns_and_pickles():
    dataset = [numpy.full(8, i, numpy.float32) for i in range(8)]
    it = PrefetchMultiprocessIterator(dataset, 4, n_processes=2, shuffle=False,
                                      shared_mem=2 ** 45)
    try:
        with pytest.warns(RuntimeWarning, match='examples travel by pickling'):
            batches = [it.next() for _ in range(2)]
    finally:
        it.finalize()
    got = numpy.concatenate([numpy.stack(batch) for batch in batches])
    numpy.testing.assert_array_equal(got[:, 0], numpy.arange(8))


def test_workers_are_never_forked_from_a_process_running_threads():
    """With another thread running (here a user's; also the iterator's own
    threads when maxtasksperchild replaces a worker), loader processes come
    from the fork server, not from fork()."""
    stop = threading.Event()
    user_thread = threading.Thread(target=stop.wait, daemon=True)
    user_thread.start()
    it = PrefetchMultiprocessIterator(numpy.arange(20), 2, n_processes=2,
                                      maxtasksperchild=2)
    try:
        seen = set()
        for _ in range(15):
            it.next()
            seen.update(it._executor._pool.pids())
        assert len(seen) > 2  # workers were replaced
        # The parents of the workers running (one may end between the two
        # looks, or all be between replacements: then take another batch).
        parents = set()
        for _ in range(50):
            parents = {_parent_of(pid) for pid in seen if helpers.is_running(pid)}
            parents.discard(None)
            if parents:
                break
            it.next()
            seen.update(it._executor._pool.pids())
        assert parents, 'no worker seen running'
        assert os.getpid() not in parents, parents
    finally:
        stop.set()
        it.finalize()
