"""Shared helpers of the tests.

Everything here touches the real system: files, /proc, /dev/shm, mounts.
"""
import contextlib
import errno
import glob
import os
import platform
import re
import signal
import subprocess
import threading
import time

import numpy
from PIL import Image

THREAD_PREFIX = 'chainer_prefetch'


# ---- files and datasets ------------------------------------------------------

def write_random_file(path, size, seed=0):
    """Writes ``size`` random bytes to ``path``; returns the bytes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = numpy.random.RandomState(seed).bytes(size)
    with open(path, 'wb') as f:
        f.write(data)
    return data


def make_shop(directory, rows, files, row_group_rows):
    """A small generated shopping dataset (8x8 images) in ``directory``; returns it."""
    from chainer_prefetch_bench.testbed import parquet_dataset
    parquet_dataset.generate(str(directory), rows, files, row_group_rows,
                             image_size=8)
    return str(directory)


def corrupt_row_group(path, group):
    """Overwrites the first column chunk of row group ``group`` of a Parquet file.

    The footer stays intact, so the file opens and only that row group
    fails to decode.
    """
    import pyarrow.parquet
    chunk = pyarrow.parquet.read_metadata(path).row_group(group).column(0)
    with open(path, 'r+b') as f:
        f.seek(chunk.data_page_offset)
        f.write(b'\xff' * chunk.total_compressed_size)


def read_bytes(path):
    with open(path, 'rb') as f:
        return f.read()


def make_jpeg_dataset(directory, n_images, size=32, seed=0, quality=90,
                      list_name='train.txt'):
    """Writes ``n_images`` random-noise JPEGs and a LabeledImageDataset list.

    Returns:
        (list_file, root, absolute paths of the images in list order)
    """
    random = numpy.random.RandomState(seed)
    root = str(directory)
    lines, paths = [], []
    for i in range(n_images):
        relative = os.path.join('class{}'.format(i % 3), 'img{:03d}.jpg'.format(i))
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pixels = random.randint(0, 256, (size, size, 3)).astype(numpy.uint8)
        # Written aside, then renamed into place: a dataset rewritten while
        # an iterator runs never shows a half-written image.
        Image.fromarray(pixels).save(path + '.new', format='JPEG',
                                     quality=quality)
        os.replace(path + '.new', path)
        lines.append('{} {}\n'.format(relative, i % 3))
        paths.append(path)
    list_file = os.path.join(root, list_name)
    with open(list_file, 'w') as f:
        f.writelines(lines)
    return list_file, root, paths


COLOURS = [(220, 40, 40), (40, 200, 40), (40, 60, 220), (230, 220, 40)]


def make_colour_dataset(root, n_train=48, n_val=16, size=40, seed=0):
    """Write ``n_train``/``n_val`` noisy JPEGs per class of solid colour.

    Returns the paths of ``train.txt`` and ``val.txt`` (lines ``path
    label`` relative to ``root``).
    """
    rng = numpy.random.default_rng(seed)
    lists = []
    for split, n in (('train', n_train), ('val', n_val)):
        lines = []
        for label, colour in enumerate(COLOURS):
            folder = os.path.join(root, split, 'c{}'.format(label))
            os.makedirs(folder, exist_ok=True)
            for i in range(n):
                noise = rng.integers(-40, 41, (size, size, 3))
                pixels = numpy.clip(numpy.array(colour) + noise, 0, 255)
                rel = '{}/c{}/{:04d}.JPEG'.format(split, label, i)
                Image.fromarray(pixels.astype(numpy.uint8)).save(
                    os.path.join(root, rel), quality=90)
                lines.append('{} {}\n'.format(rel, label))
        path = os.path.join(root, split + '.txt')
        with open(path, 'w') as f:
            f.writelines(lines)
        lists.append(path)
    return lists


class FailingDataset:
    """``n`` small arrays; ``get_example(bad)`` raises ValueError."""

    def __init__(self, n, bad):
        self.n = n
        self.bad = bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError('broken example here')
        return numpy.full((3,), i, dtype=numpy.float32)


class FileBytes:
    """A user's dataset: a list of paths, each example a file's bytes."""

    def __init__(self, paths):
        self.paths = list(paths)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        with open(self.paths[index], 'rb') as f:
            return f.read()


def run_mpi(command, cwd, timeout):
    """Runs an MPI command line (see testbed/mpi_launch.py); returns its output.

    Fails the test with the output's tail on a non-zero exit or a timeout.
    """
    from chainer_prefetch_bench.testbed import mpi_launch
    returncode, output, timed_out = mpi_launch.run(command, timeout, cwd=cwd)
    assert not timed_out, 'timed out after {} s:\n{}'.format(
        timeout, output[-5000:])
    assert returncode == 0, output[-5000:]
    return output


def assert_examples_equal(got, expected):
    """Compares two lists of examples (tuples of arrays / scalars)."""
    assert len(got) == len(expected)
    for got_example, expected_example in zip(got, expected):
        assert len(got_example) == len(expected_example)
        for got_item, expected_item in zip(got_example, expected_example):
            numpy.testing.assert_array_equal(numpy.asarray(got_item),
                                             numpy.asarray(expected_item))


def files_under(directory):
    """Every non-directory entry under ``directory`` (relative paths)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in filenames:
            found.append(os.path.relpath(os.path.join(dirpath, name), directory))
    return sorted(found)


# ---- mounts -------------------------------------------------------------------

@contextlib.contextmanager
def tmpfs(path, size, read_only=False):
    """Mounts a tmpfs of ``size`` at ``path``; yields whether the mount worked.

    Always unmounts on exit.
    """
    path = str(path)
    os.makedirs(path, exist_ok=True)
    options = 'size={}'.format(size) + (',ro' if read_only else '')
    result = subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', path],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if result.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        if subprocess.run(['umount', path], stderr=subprocess.PIPE).returncode:
            subprocess.run(['umount', '-l', path], stderr=subprocess.PIPE)


def remount_read_only(path):
    subprocess.run(['mount', '-o', 'remount,ro', str(path)], check=True)


class FullDiskOs:
    """Stand-in for the ``os`` module *of local_directory only* whose ``write``
    fails with ENOSPC after ``capacity`` bytes (fallback when tmpfs cannot be
    mounted)."""

    def __init__(self, capacity):
        self._capacity = capacity
        self._written = 0
        self._lock = threading.Lock()

    def write(self, fd, data):
        with self._lock:
            room = self._capacity - self._written
            if room <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            count = os.write(fd, memoryview(data)[:room])
            self._written += count
            return count

    def __getattr__(self, name):
        return getattr(os, name)


# ---- processes, threads, shared memory --------------------------------------

def _read(path, mode='r'):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


def children(pid=None):
    """Pids of the (direct) children of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    found = set()
    for task in glob.glob('/proc/{}/task/*/children'.format(pid)):
        text = _read(task)
        if text:
            found.update(int(p) for p in text.split())
    return found


def is_resource_tracker(pid):
    """Whether ``pid`` is one of multiprocessing's long-lived helpers.

    The resource tracker, and the fork server that starts loader processes
    when the owner runs other threads (Python's, or the one forked from a
    script without a main guard).
    """
    cmdline = _read('/proc/{}/cmdline'.format(pid), 'rb') or b''
    comm = _read('/proc/{}/comm'.format(pid), 'rb') or b''
    return (b'resource_tracker' in cmdline or b'forkserver' in cmdline
            or comm.strip() == b'cp-forkserver')  # _forked_server.NAME


def descendants(pid=None):
    """Children, grandchildren... of ``pid`` (default: this process)."""
    found, todo = set(), [os.getpid() if pid is None else pid]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def worker_children(pid=None):
    """Descendants except multiprocessing's helpers (loader processes, in effect).

    Loader processes started by the fork server are its children, not ours.
    """
    return {child for child in descendants(pid)
            if not is_resource_tracker(child)}


def is_running(pid):
    """Whether ``pid`` exists and is not a zombie."""
    status = _read('/proc/{}/stat'.format(pid))
    if status is None:
        return False
    state = status.rsplit(')', 1)[1].split()[0]
    return state not in ('Z', 'X')


def press_ctrl_c(process, timeout=30):
    """SIGINT to the process group of ``process`` (started in a new session), as Ctrl-C.

    Returns:
        ``(stdout, stderr)`` once it ended; it is killed if it has not
        ended in ``timeout`` seconds (and the timeout raised).
    """
    try:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the whole group
        return process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_until(predicate, timeout, interval=0.02):
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


_OPENAT = {'x86_64': 257, 'aarch64': 56}


def threads_in_open(pid='self'):
    """Threads of process ``pid`` waiting in the ``openat`` system call.

    A thread opening a FIFO nobody writes waits there, as on a hung file
    system.  Skips the test where the call's number is not known.
    """
    number = _OPENAT.get(platform.machine())
    if number is None:
        import pytest  # not at the top: scripts the tests start import helpers
        pytest.skip('openat number unknown on ' + platform.machine())
    tasks = glob.glob('/proc/{}/task/*/syscall'.format(pid))
    return sum(1 for task in tasks
               if (_read(task) or '').split()[:1] == [str(number)])


def prefetch_threads():
    return {thread for thread in threading.enumerate()
            if thread.name.startswith(THREAD_PREFIX)}


SHM_PREFIXES = ('psm_', 'sem.mp-', 'pym-', 'chainer_prefetch')
"""Names in /dev/shm that this package and Python's multiprocessing make."""


def new_shm_names(before):
    """Names in /dev/shm, not in ``before``, that the tests' processes make.

    Other processes on the machine may come and go in /dev/shm meanwhile:
    only names with :data:`SHM_PREFIXES` count.
    """
    return sorted(name for name in set(os.listdir('/dev/shm')) - before
                  if name.startswith(SHM_PREFIXES))


def shm_segments():
    return set(glob.glob('/dev/shm/psm_*'))


def mapped_segments(pid='self'):
    """Shared-memory segments mapped into a process: ``/dev/shm/psm_*`` paths
    and anonymous ``memfd:`` segments (as ``memfd:<name>:<inode>``); other
    processes on the machine may create their own, so only these are ours."""
    found = set()
    for line in (_read('/proc/{}/maps'.format(pid)) or '').splitlines():
        match = re.search(r'(/dev/shm/psm_\w+)', line)
        if match:
            found.add(match.group(1))
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith('/memfd:'):
            found.add('memfd:{}:{}'.format(fields[5][len('/memfd:'):],
                                           fields[4]))
    return found


class ResourceSnapshot:
    """What exists before an iterator starts: compare with :meth:`leftovers`."""

    def __init__(self):
        self.children = worker_children()
        self.threads = prefetch_threads()
        self.mapped_before = mapped_segments()
        self.ours = set()

    def record(self):
        """Remembers the segments this process maps now (call while running)."""
        self.ours |= mapped_segments() - self.mapped_before
        return self.ours

    def new_children(self):
        return worker_children() - self.children

    def leftovers(self):
        """(new child pids, new live prefetch threads, our shm segments left)."""
        still_mapped = mapped_segments() - self.mapped_before
        return (self.new_children(),
                sorted(t.name for t in prefetch_threads() - self.threads
                       if t.is_alive()),
                sorted(still_mapped | {s for s in self.ours
                                       if s.startswith('/') and os.path.exists(s)}))

    def assert_clean(self):
        pids, threads, segments = self.leftovers()
        assert pids == set(), 'child processes left behind: {}'.format(pids)
        assert threads == [], 'threads left behind: {}'.format(threads)
        assert segments == [], 'shared memory left behind: {}'.format(segments)
