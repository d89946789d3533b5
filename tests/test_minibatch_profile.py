"""The profile of the minibatch benchmark: how samples become categories."""
import os
import shutil
import subprocess
import sys
import time

import pytest

from chainer_prefetch_bench.minibatch import profile
from chainer_prefetch_bench.minibatch.counters import read_counters, tree_change, tree_counters

LOADER_ROOT = ['BaseProcess.run', '_worker_main', 'load_examples',
               'Loader.load_examples']


@pytest.mark.parametrize('frames, category', [
    (LOADER_ROOT + ['Loader._watched_read', 'LabeledImageDataset.get_example',
                    '_read_image_as_array', 'jpeg_read_scanlines'], 'decode'),
    (LOADER_ROOT + ['pack', 'pack.<locals>.put', 'write_array',
                    '_aligned_strided_to_contig_size4'], 'pack'),
    (['BaseProcess.run', '_worker_main', '_ConnectionBase.send',
      'ForkingPickler.dumps'], 'send'),
    (['BaseProcess.run', '_worker_main', '_ConnectionBase.recv',
      'Connection._recv_bytes', 'os_read', 'read'], 'waiting'),
    (['Thread.run', '_exit_when_orphaned', 'time_sleep', 'clock_nanosleep'],
     'watcher'),
    (LOADER_ROOT + ['tallied', 'Counter.__init__'], 'task'),
    (['_decode_share', 'DatasetMixin.__getitem__', 'get_example'], 'decode'),
    (['worker', '_decode_share', 'pack', 'pack.<locals>.put', 'write_array'],
     'pack'),  # decode-copy-limit's copy
    (['worker', 'SimpleQueue.get', '_ConnectionBase.recv',
      'Connection._recv_bytes', 'read'], 'waiting'),  # a pool's next task
])
def test_loader_samples(frames, category):
    assert profile.classify(frames, 'loader') == category


@pytest.mark.parametrize('frames, category', [
    (['Thread.run', 'WorkerPool._collect', 'WorkerPool._receive',
      '_ConnectionBase.recv'], 'loader I/O'),
    (['Thread.run', 'Executor._run', 'Scheduler.step'], 'pipeline'),
    (['Thread.run', 'CopyThreads._run', 'LocalStore.stage'], 'copy threads'),
    (['main', 'run_one', 'PrefetchMultiprocessIterator.__next__',
      'Executor.get', 'Mailbox.get', 'Condition.wait',
      'lock_PyThread_acquire_lock'], 'waiting'),
    (['main', 'run_one', 'PrefetchMultiprocessIterator.__next__'],
     'consumer'),
    (['<module>', '_find_and_load', '_LoaderBasics.exec_module'], 'start-up'),
    (['Pool._handle_results', '_ConnectionBase.recv', 'read'], 'waiting'),
])
def test_training_process_samples(frames, category):
    assert profile.classify(frames, 'trainer') == category


@pytest.mark.parametrize('symbol, library, category', [
    ('jpeg_read_scanlines', '/usr/lib/x86_64-linux-gnu/libjpeg.so.62',
     'decode'),
    ('ImagingPackRGB', '/venv/PIL/_imaging.cpython-311-x86_64-linux-gnu.so',
     'decode'),
    ('_aligned_contig_cast_ubyte_to_float', '/venv/_multiarray_umath.so',
     'decode'),
    ('_aligned_strided_to_contig_size4', '/venv/_multiarray_umath.so',
     'copy'),
    ('__memmove_avx_unaligned_erms', '/usr/lib/x86_64-linux-gnu/libc.so.6',
     'copy'),
    ('clear_page_erms', '[kernel.kallsyms]', 'page faults'),
    ('shmem_fault', '[kernel.kallsyms]', 'page faults'),
    ('pipe_write', '[kernel.kallsyms]', 'kernel, other'),
    ('_PyEval_EvalFrameDefault', '/usr/lib/libpython3.11.so.1.0', 'python'),
    ('[unknown]', '/usr/bin/python3.11', 'python'),
    ('deflate', '/usr/lib/libcrypto.so.3', 'other'),
])
def test_native_samples(symbol, library, category):
    assert profile.classify_native(symbol, library) == category


def test_py_spy_raw_lines_give_processes_roles_and_counts(tmp_path):
    raw = tmp_path / 'raw.txt'
    trainer = 'process 10:"python -m bench _run {}"'
    loader = 'process 11:"python -m bench _run {}"'
    raw.write_text('\n'.join([
        '{};main (bench.py:1);run_one (bench.py:2) 5'.format(trainer),
        '{};{};_worker_main (w.py:1);load_examples (w.py:2);'
        'LabeledImageDataset.get_example (d.py:3) 7'.format(trainer, loader),
        '{};{};_worker_main (w.py:1);pack (w.py:9) 3'.format(trainer, loader),
        '{};{};_worker_main (w.py:1);pack (w.py:9) 1'.format(trainer, loader),
        'main (bench.py:1) 2',  # no process frame: left out
    ]) + '\n')
    samples, roles = profile.parse_raw(str(raw))
    assert roles == {10: 'trainer', 11: 'loader'}
    assert samples[10] == {'consumer': 5}
    assert samples[11] == {'decode': 7, 'pack': 4}


def test_counters_of_a_process():
    counters = read_counters(os.getpid())
    assert counters['ppid'] == os.getppid()
    assert counters['user_s'] + counters['kernel_s'] > 0
    assert counters['on_cpu_s'] > 0 and counters['runqueue_s'] >= 0
    assert counters['timeslices'] > 0
    assert read_counters(2 ** 22 + 12345) is None  # no such process


def test_the_change_of_a_tree_splits_the_root_from_its_children():
    child = subprocess.Popen([sys.executable, '-c', (
        'import sys\n'
        'print(flush=True)\n'
        'for line in sys.stdin:\n'
        '    b"x" * (64 * 2 ** 20); sum(range(10 ** 7))\n'
        '    print(flush=True)')],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == '\n'  # started; waits for a line
        before = tree_counters(os.getpid())
        assert child.pid in before and os.getpid() in before
        child.stdin.write('go\n')
        child.stdin.flush()
        assert child.stdout.readline() == '\n'  # its work is done
        after = tree_counters(os.getpid())
    finally:
        child.communicate('')
    ours = (os.getpid(), child.pid)  # (not helpers left by earlier tests)
    before = {pid: before[pid] for pid in ours}
    after = {pid: after[pid] for pid in ours}
    change = tree_change(before, after, os.getpid())
    others = change['others']
    assert others['processes'] == 1 and change['root']['processes'] == 1
    assert others['gone'] == 0
    assert others['cpu_s'] > 0.05  # ten million additions
    assert others['minor_faults'] >= 16  # 64 MiB touched (2 MiB pages: 32)
    assert others['timeslices'] >= 1  # woken by the line
    new_only = tree_change({}, after, os.getpid())  # first seen: from zero
    assert new_only['others']['cpu_s'] >= others['cpu_s']
    ended = tree_change(before, {os.getpid(): after[os.getpid()]},
                        os.getpid())
    assert ended['others'] == dict(ended['others'], processes=0, gone=1)
    reused = {**after, child.pid: dict(after[child.pid], started=0)}
    assert tree_change(before, reused, os.getpid())['others']['gone'] == 1


def test_the_tree_watch_sees_children_and_keeps_their_last_counters():
    child = subprocess.Popen([sys.executable, '-c', (
        'import subprocess, sys; subprocess.run([sys.executable, "-c", '
        '"sum(range(3 * 10 ** 7))"]); sys.stdin.read()')],
        stdin=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        with profile.TreeWatch(child.pid, interval=0.05) as watch:
            while len(watch.last) < 2 and time.monotonic() < deadline:
                watch._stop.wait(0.05)
            grandchildren = [pid for pid, c in watch.last.items()
                             if c['ppid'] == child.pid]
            assert grandchildren, 'the watcher never saw the grandchild'
            while any(pid in os.listdir('/proc') for pid in
                      map(str, grandchildren)):
                assert time.monotonic() < deadline
                watch._stop.wait(0.05)
        busy = watch.last[grandchildren[0]]
        assert busy['user_s'] + busy['kernel_s'] > 0
    finally:
        child.communicate(b'')


@pytest.mark.skipif(shutil.which('perf') is None, reason='no perf')
def test_perf_samples_of_a_copying_child(tmp_path):
    data = tmp_path / 'perf.data'
    code = ('import numpy, time\n'
            'a = numpy.ones((600, 800, 3), numpy.float32)\n'
            'b = numpy.empty((3, 600, 800), numpy.float32)\n'
            'end = time.time() + 1.5\n'
            'while time.time() < end:\n'
            '    numpy.copyto(b, a.transpose(2, 0, 1))\n')
    record = subprocess.run(['perf', 'record', '--quiet', '-e', 'cpu-clock',
                             '-F', '499', '-o', str(data), '--',
                             sys.executable, '-c', code],
                            stderr=subprocess.PIPE, text=True)
    if record.returncode != 0:
        pytest.skip('perf cannot record here: ' + record.stderr[-200:])
    seconds = profile.parse_perf(str(data), 499)
    busiest = max(seconds.values(), key=lambda c: sum(c.values()))
    assert busiest['copy'] > 0.5 * sum(busiest.values())
