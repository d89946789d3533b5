"""Stage 3 as threads of the training process (``loader_threads=True``).

The iterator with loader threads against the same iterator with loader
processes: the same batches in the same order (row and columnar paths, with
and without staging), resume, errors named, and nothing left running after
``finalize()``, an error or Ctrl-C.  :class:`LoaderThreads` on its own: a
failing task, a hung task at shutdown.
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import chainer
import numpy as np
import pytest

import helpers
from chainer_prefetch import ExampleLoadError, PrefetchMultiprocessIterator
from chainer_prefetch.columnar import ColumnarBatch, concat_columns
from chainer_prefetch.datasets import ParquetDataset, RowGroupWindowOrderSampler
from chainer_prefetch.iterators._loader_threads import LoaderThreads

pytestmark = pytest.mark.timeout(120)
ROWS, ROW_GROUP_ROWS = 120, 10
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope='module')
def shop(tmp_path_factory):
    return helpers.make_shop(tmp_path_factory.mktemp('shop'), ROWS, 3,
                             ROW_GROUP_ROWS)


def _rows(batch):
    """A batch as comparable values: the ids and the image bytes of each row."""
    return [(example['id'], bytes(example['image'])) for example in batch]


def _run(dataset, batches, loader_threads, seed=0, **options):
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=3,
                                         seed=seed)
    iterator = PrefetchMultiprocessIterator(
        dataset, 16, n_processes=2, order_sampler=sampler, n_copy_threads=4,
        loader_threads=loader_threads, **options)
    try:
        got = []
        for _ in range(batches):
            batch = iterator.next()
            got.append((_rows(batch), iterator.epoch_detail,
                        iterator.is_new_epoch, type(batch)))
        return got, iterator.stats, helpers.worker_children()
    finally:
        iterator.finalize()


@pytest.mark.parametrize('columnar', [False, True])
@pytest.mark.parametrize('local', [False, True])
def test_threads_give_the_batches_processes_give(shop, tmp_path, columnar, local):
    dataset = ParquetDataset(shop, columns=['id', 'image', 'price'])
    expected, _, processes = _run(dataset, 17, False, columnar=columnar,
                                  local_dir=str(tmp_path / 'p') if local else None)
    assert len(processes) == 2  # 2 epochs and a bit, by loader processes
    snapshot = helpers.ResourceSnapshot()
    got, stats, processes = _run(dataset, 17, True, columnar=columnar,
                                 local_dir=str(tmp_path / 't') if local else None)
    assert processes == snapshot.children  # none started
    assert got == expected
    assert all((kind is ColumnarBatch) == columnar for *_, kind in got)
    if local:  # read from the staged row groups
        assert stats['by_epoch'][1]['examples_from_local'] == ROWS
    assert helpers.wait_until(lambda: snapshot.leftovers() == (set(), [], []), 10), \
        snapshot.leftovers()


def test_every_row_once_per_epoch_within_a_small_local_capacity(shop, tmp_path):
    dataset = ParquetDataset(shop, columns=['id', 'image'])
    largest = max(dataset.example_files(int(i))[0].estimated_local_bytes(None)
                  for i in range(0, ROWS, ROW_GROUP_ROWS))
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=3,
                                         seed=1)
    iterator = PrefetchMultiprocessIterator(
        dataset, 16, repeat=False, n_processes=2, order_sampler=sampler,
        local_dir=str(tmp_path / 'local'), local_capacity=5 * largest,
        n_copy_ahead=8, loader_threads=True)
    try:
        ids = []
        for batch in iterator:
            batch_ids = concat_columns(batch)['id'].tolist()
            assert len(set(batch_ids)) == len(batch_ids)
            ids.extend(batch_ids)
    finally:
        iterator.finalize()
    assert sorted(ids) == list(range(ROWS))


@pytest.mark.parametrize('resumed_in', ['directory', 'memory'])
def test_resume_mid_epoch_from_a_snapshot_of_loader_processes(shop, tmp_path,
                                                             resumed_in):
    dataset = ParquetDataset(shop, columns=['id'])

    def make(loader_threads):
        sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes,
                                             window=2, seed=3)
        in_memory = loader_threads and resumed_in == 'memory'
        return PrefetchMultiprocessIterator(
            dataset, 16, n_processes=2, order_sampler=sampler,
            local_dir=':memory:' if in_memory else str(tmp_path / 'local'),
            local_capacity=10**9 if in_memory else None,
            loader_threads=loader_threads)

    def ids(iterator, n):
        return [concat_columns(iterator.next())['id'].tolist() for _ in range(n)]

    whole = make(False)
    try:
        expected = ids(whole, 12)
    finally:
        whole.finalize()
    first = make(False)
    try:
        got = ids(first, 5)
        snapshot = {}
        first.serialize(chainer.serializers.DictionarySerializer(snapshot))
    finally:
        first.finalize()
    second = make(True)
    try:
        second.serialize(chainer.serializers.NpzDeserializer(snapshot))
        got.extend(ids(second, 7))
    finally:
        second.finalize()
    assert got == expected


def test_a_failing_example_is_named_and_raised_until_reset():
    dataset = helpers.FailingDataset(20, bad=7)
    iterator = PrefetchMultiprocessIterator(dataset, 4, repeat=False,
                                            shuffle=False, n_processes=2,
                                            loader_threads=True)
    try:
        np.testing.assert_array_equal(iterator.next()[3], [3, 3, 3])
        for _ in range(2):
            with pytest.raises(ValueError, match='broken example here') as raised:
                iterator.next()
            assert isinstance(raised.value, ExampleLoadError)
            assert raised.value.index == 7 and 'example 7' in str(raised.value)
        iterator.reset()
        assert [int(example[0]) for example in iterator.next()] == [0, 1, 2, 3]
    finally:
        iterator.finalize()


def test_options_of_loader_processes_are_refused():
    for option in ({'maxtasksperchild': 10}, {'shared_mem': 2 ** 20}):
        with pytest.raises(ValueError, match='cannot be combined with '
                                             'loader_threads'):
            PrefetchMultiprocessIterator(list(range(10)), 2,
                                         loader_threads=True, **option)


def test_a_failing_task_answers_with_its_exception():
    threads = LoaderThreads(2)
    answers = []
    done = threading.Event()

    def on_done(task_id, ok, value):
        answers.append((task_id, ok, value))
        if len(answers) == 2:
            done.set()

    try:
        threads.submit(1, divmod, (7, 2), on_done)
        threads.submit(2, divmod, (7, 0), on_done)
        assert done.wait(10)
    finally:
        threads.close(time.monotonic() + 5)
    answers.sort(key=lambda answer: answer[0])
    assert answers[0] == (1, True, (3, 1))
    assert answers[1][:2] == (2, False)
    assert isinstance(answers[1][2], ZeroDivisionError)
    with pytest.raises(RuntimeError, match='closed'):
        threads.submit(3, divmod, (1, 1), on_done)


def test_close_abandons_a_hung_task_by_the_deadline():
    threads = LoaderThreads(1)
    started, release = threading.Event(), threading.Event()
    answered, running = [], []

    def hang():
        running.append(threading.current_thread())
        started.set()
        release.wait(30)

    threads.submit(1, hang, (), lambda *answer: answered.append(answer))
    assert started.wait(10)
    began = time.monotonic()
    threads.close(began + 0.5)
    # Back by the deadline, not when the task ends (30 s from now).
    assert time.monotonic() - began < 10
    release.set()
    running[0].join(10)  # the task ends, and with it the thread
    assert not running[0].is_alive()
    assert answered == []  # a task running at close is never answered


_CTRL_C = textwrap.dedent('''
    import signal, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import helpers
    from chainer_prefetch import PrefetchMultiprocessIterator

    class Slow:
        def __len__(self):
            return 1000
        def __getitem__(self, index):
            time.sleep(0.05)
            return index

    it = PrefetchMultiprocessIterator(Slow(), 2, n_processes=2,
                                      loader_threads=True)
    try:
        for number, batch in enumerate(it):
            print('BATCH', number, flush=True)
    finally:
        it.finalize()
        print('THREADS', *sorted(t.name for t in helpers.prefetch_threads()
                                 if t.is_alive()), flush=True)
''')


def test_ctrl_c_ends_the_program_and_its_loader_threads():
    process = subprocess.Popen([sys.executable, '-c', _CTRL_C], cwd=TESTS_DIR,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True, text=True)
    try:
        for line in process.stdout:
            if line.startswith('BATCH 2'):
                break
    finally:
        stdout, stderr = helpers.press_ctrl_c(process)
    assert 'KeyboardInterrupt' in stderr
    assert 'THREADS\n' in stdout, stdout  # none of ours alive after finalize


class _ExitsOnSeven:
    """Example 7 calls ``sys.exit``: a loader thread must not end silently."""

    def __len__(self):
        return 20

    def __getitem__(self, index):
        if index == 7:
            sys.exit('example 7 exits')
        return index


def test_a_task_ending_the_thread_reaches_next_instead_of_a_hang():
    iterator = PrefetchMultiprocessIterator(_ExitsOnSeven(), 4, repeat=False,
                                            shuffle=False, n_processes=2,
                                            loader_threads=True,
                                            dataset_timeout=None)
    try:
        assert iterator.next() == [0, 1, 2, 3]
        with pytest.raises(SystemExit):
            iterator.next()
    finally:
        iterator.finalize()


def test_loader_threads_must_be_a_boolean():
    with pytest.raises(ValueError, match='loader_threads must be True or False'):
        PrefetchMultiprocessIterator(list(range(10)), 2, loader_threads='no')
