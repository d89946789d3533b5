#!/usr/bin/env python
"""Fault injection: the iterator's local directory under attack and under faults.

Each scenario runs in a fresh child process with a hard time limit, on a
generated JPEG dataset, and every example delivered is compared with a
direct read of the dataset.  Scenarios are faults (processes killed, disks
full, storage lost or hung, peers stopped, another user planting files) and
bad inputs (options and datasets a user could get wrong).  The table:

* faults tried / survived: the run delivered only correct examples, and
  either went on or ended with the error the scenario expects;
* bad inputs / clear errors: refused with an exception whose message names
  the problem;
* wrong examples served (must be 0), hangs (must be 0), shared-memory
  segments or processes left (must be 0).

Usage (as root: some scenarios mount tmpfs and act as user nobody)::

    python -m chainer_prefetch_bench.local_dir_faults.run \
        --out results/local_dir_faults/faults.json
"""
import argparse
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import warnings

N_IMAGES = 24
BATCH = 4
NOBODY = ['setpriv', '--reuid=nobody', '--regid=nogroup', '--clear-groups']


# ---------------------------------------------------------------- the world

def make_images(root: str, n: int = N_IMAGES) -> str:
    """Small random JPEGs and a LabeledImageDataset list; returns the list file."""
    import numpy
    from PIL import Image
    random = numpy.random.RandomState(0)
    lines = []
    for index in range(n):
        relative = 'c{}/img{:03d}.jpg'.format(index % 3, index)
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pixels = random.randint(0, 256, (24, 24, 3)).astype(numpy.uint8)
        Image.fromarray(pixels).save(path, quality=90)
        lines.append('{} {}\n'.format(relative, index % 3))
    list_file = os.path.join(root, 'train.txt')
    with open(list_file, 'w') as f:
        f.writelines(lines)
    return list_file


def dataset_of(root):
    import chainer
    return chainer.datasets.LabeledImageDataset(
        os.path.join(root, 'train.txt'), root)


def iterator(dataset, local_dir, **options):
    from chainer_prefetch import PrefetchMultiprocessIterator
    settings = dict(repeat=True, shuffle=False, n_processes=2,
                    n_copy_threads=4, local_dir=local_dir, dataset_timeout=None)
    settings.update(options)
    return PrefetchMultiprocessIterator(dataset, BATCH, **settings)


class Checker:
    """Compares delivered examples with direct reads (made once, up front)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.expected = [dataset[i] for i in range(len(dataset))]
        self.checked = self.wrong = 0
        self.position = 0

    def batch(self, batch):
        import numpy
        for example in batch:
            index = self.position % len(self.expected)
            self.position += 1
            self.checked += 1
            if not all(numpy.array_equal(a, b) for a, b in
                       zip(example, self.expected[index])):
                self.wrong += 1

    def run(self, it, n_batches):
        for _ in range(n_batches):
            self.batch(it.next())

    def run_fresh(self, local_dir, n_batches=12, **options) -> dict:
        """Reads ``n_batches`` with a new iterator on ``local_dir``; returns its stats."""
        it = iterator(self.dataset, local_dir, **options)
        try:
            self.run(it, n_batches)
            return it.stats
        finally:
            it.finalize()


def as_nobody(script: str):
    subprocess.run(NOBODY + [sys.executable, '-c', textwrap.dedent(script)],
                   check=True, timeout=60, stdout=subprocess.DEVNULL)


def plant(local_root, shared_root, list_file):
    """As nobody: files at the local paths, with the sources' size and time."""
    as_nobody('''
        import os
        with open({list_file!r}) as lines:
            for line in lines:
                source = os.path.join({shared!r}, line.split()[0])
                local = os.path.join({local!r}, 'data', source.lstrip('/'))
                os.makedirs(os.path.dirname(local), exist_ok=True)
                info = os.stat(source)
                with open(local, 'wb') as f:
                    f.write(b'\\xff' * info.st_size)
                os.utime(local, ns=(info.st_atime_ns, info.st_mtime_ns))
    '''.format(list_file=list_file, shared=shared_root, local=local_root))


# ---------------------------------------------------------------- the faults

def fault_worker_killed(world):
    from chainer_prefetch import WorkerDiedError
    dataset = dataset_of(world['shared'])
    check = Checker(dataset)
    it = iterator(dataset, world['local'])
    try:
        check.run(it, 2)
        for pid in it._executor._pool.pids():
            os.kill(pid, signal.SIGKILL)
        try:
            for _ in range(20):
                check.batch(it.next())
            return {'outcome': 'no error', 'wrong': check.wrong}
        except WorkerDiedError:
            pass
        it.reset()  # fresh workers
        check.position = 0
        check.run(it, 12)
    finally:
        it.finalize()
    return {'outcome': 'survived', 'wrong': check.wrong}


def fault_killed_mid_copy(world):
    """A process SIGKILLed while copying; the next one starts clean."""
    dataset = dataset_of(world['shared'])
    script = textwrap.dedent('''
        import os, sys, time
        from chainer_prefetch_bench.local_dir_faults import run
        from chainer_prefetch.staging import sources
        real = os.sendfile
        def slow(*args):
            time.sleep(0.05)
            return real(*args)
        os.sendfile = slow
        it = run.iterator(run.dataset_of(sys.argv[1]), sys.argv[2])
        print('GO', flush=True)
        it.next()
    ''')
    child = subprocess.Popen([sys.executable, '-c', script, world['shared'],
                              world['local']], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    assert child.stdout.readline().strip() == 'GO'
    time.sleep(0.3)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(10)
    child.stdout.close()
    check = Checker(dataset)
    it = iterator(dataset, world['local'])
    try:
        check.run(it, 12)
        leftovers = it._store.directory.removed_leftovers
    finally:
        it.finalize()
    return {'outcome': 'survived', 'wrong': check.wrong,
            'note': '{} partial copies removed at start'.format(leftovers)}


def _with_tmpfs(world, size, read_only=False):
    mount = os.path.join(world['tmp'], 'mnt-' + size)
    os.makedirs(mount, exist_ok=True)
    options = 'size={}'.format(size) + (',ro' if read_only else '')
    subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', mount],
                   check=True)
    return mount


def _unmount(mount):
    if subprocess.run(['umount', mount], stderr=subprocess.PIPE).returncode:
        subprocess.run(['umount', '-l', mount], stderr=subprocess.PIPE)


def fault_full_disk(world):
    dataset = dataset_of(world['shared'])
    mount = _with_tmpfs(world, '24k')
    check = Checker(dataset)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            error = check.run_fresh(os.path.join(mount, 'local'))[
                'local_storage_error']
    finally:
        _unmount(mount)
    warned = any('stopped' in str(w.message) for w in caught)
    return {'outcome': 'survived' if error and warned else 'no warning',
            'wrong': check.wrong}


def fault_read_only_local_dir(world):
    dataset = dataset_of(world['shared'])
    mount = _with_tmpfs(world, '1m', read_only=True)
    check = Checker(dataset)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            check.run_fresh(os.path.join(mount, 'local'))
    finally:
        _unmount(mount)
    warned = any('unusable' in str(w.message) for w in caught)
    return {'outcome': 'survived' if warned else 'no warning',
            'wrong': check.wrong}


def fault_source_removed(world):
    dataset = dataset_of(world['shared'])
    check = Checker(dataset)
    it = iterator(dataset, world['local'], repeat=False)
    gone = dataset._pairs[13][0]
    os.unlink(os.path.join(world['shared'], gone))
    try:
        check.run(it, 6)
        return {'outcome': 'no error', 'wrong': check.wrong}
    except FileNotFoundError as error:
        named = 'example 13' in str(error) and gone in str(error)
        return {'outcome': 'survived' if named else 'unclear error',
                'wrong': check.wrong, 'note': str(error)[:120]}
    finally:
        it.finalize()


def fault_storage_lost_and_back(world):
    dataset = dataset_of(world['shared'])
    check = Checker(dataset)
    it = iterator(dataset, world['local'])
    moved = world['shared'] + '.away'
    try:
        check.run(it, 1)
        os.rename(world['shared'], moved)
        try:
            for _ in range(12):
                check.batch(it.next())
            outcome = 'no error'
        except OSError as error:
            outcome = 'error named' if world['shared'] in str(error) else \
                'unclear error'
        os.rename(moved, world['shared'])
        it.reset()
        check.position = 0
        check.run(it, 12)
    finally:
        if os.path.exists(moved):
            os.rename(moved, world['shared'])
        it.finalize()
    return {'outcome': 'survived' if outcome == 'error named' else outcome,
            'wrong': check.wrong}


def fault_source_changed(world):
    """A source rewritten during training is copied again the next epoch."""
    dataset = dataset_of(world['shared'])
    it = iterator(dataset, world['local'], n_copy_ahead=1)
    try:
        for _ in range(N_IMAGES // BATCH):  # epoch 0
            it.next()
        make_images_seeded(world['shared'], 5)
        check = Checker(dataset)  # the new content
        for _ in range(N_IMAGES // BATCH):  # epoch 1 (some batches prefetched)
            it.next()
        check.run(it, N_IMAGES // BATCH)  # epoch 2
    finally:
        it.finalize()
    return {'outcome': 'survived', 'wrong': check.wrong}


def make_images_seeded(root, seed):
    import numpy
    from PIL import Image
    random = numpy.random.RandomState(seed)
    with open(os.path.join(root, 'train.txt')) as lines:
        for line in lines:
            pixels = random.randint(0, 256, (24, 24, 3)).astype(numpy.uint8)
            Image.fromarray(pixels).save(os.path.join(root, line.split()[0]),
                                         quality=90)


_HUNG = textwrap.dedent('''
    import os, sys
    import chainer
    from chainer_prefetch import PrefetchMultiprocessIterator
    dataset = chainer.datasets.ImageDataset(sys.argv[2:])
    it = PrefetchMultiprocessIterator(dataset, 2, n_processes=2,
                                      local_dir=sys.argv[1], dataset_timeout=None)
    print('GO', flush=True)
    it.next()
''')


def _hung_storage(world, signal_number):
    fifos = []
    for index in range(6):
        path = os.path.join(world['tmp'], 'hung{}.jpg'.format(index))
        os.mkfifo(path)
        fifos.append(path)
    child = subprocess.Popen([sys.executable, '-c', _HUNG, world['local']]
                             + fifos, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert child.stdout.readline().strip() == 'GO'
        time.sleep(1.5)
        started = time.monotonic()
        os.killpg(child.pid, signal_number)
        child.wait(20)
        took = time.monotonic() - started
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        child.stdout.close()
        for path in fifos:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    return {'outcome': 'survived' if took < 10 else 'slow exit', 'wrong': 0,
            'note': 'exited {:.1f} s after the signal'.format(took)}


def fault_ctrl_c_while_storage_hangs(world):
    return _hung_storage(world, signal.SIGINT)


def fault_sigterm_while_storage_hangs(world):
    return _hung_storage(world, signal.SIGTERM)


def _hold(path, locked, release):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    locked.set()
    release.wait(120)
    os._exit(0)


def fault_peer_stopped_holding_a_copy_lock(world):
    from chainer_prefetch.staging import LocalDirectory
    dataset = dataset_of(world['shared'])
    directory = LocalDirectory(world['local'])
    source = os.path.join(world['shared'], dataset._pairs[0][0])
    part = os.path.join(directory.partial_root, hashlib.sha1(
        directory.path_map.relative(source).encode()).hexdigest() + '.part')
    directory.close()
    context = multiprocessing.get_context('fork')
    locked, release = context.Event(), context.Event()
    peer = context.Process(target=_hold, args=(part, locked, release))
    peer.start()
    check = Checker(dataset)
    try:
        assert locked.wait(10)
        os.kill(peer.pid, signal.SIGSTOP)
        it = iterator(dataset, world['local'])
        try:
            started = time.monotonic()
            check.run(it, 1)  # waits for the lock, bounded, then the source
            took = time.monotonic() - started
            check.run(it, 11)
        finally:
            it.finalize()
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        release.set()
        peer.join(10)
    return {'outcome': 'survived' if took < 40 else 'slow', 'wrong': check.wrong,
            'note': 'first batch after {:.1f} s'.format(took)}


def _reserve_all(root, data_root, done, release):
    from chainer_prefetch.staging.capacity import CapacityLedger
    ledger = CapacityLedger(root, data_root, 10 ** 9)
    ledger.reserve(10 ** 9)
    done.set()
    release.wait(120)
    os._exit(0)


def fault_sharer_killed_holding_reservations(world):
    from chainer_prefetch.staging import LocalDirectory
    dataset = dataset_of(world['shared'])
    directory = LocalDirectory(world['local'])
    context = multiprocessing.get_context('fork')
    done, release = context.Event(), context.Event()
    sharer = context.Process(target=_reserve_all, args=(
        directory.root, directory.data_root, done, release))
    sharer.start()
    assert done.wait(10)
    directory.close()
    check = Checker(dataset)
    it = iterator(dataset, world['local'], local_capacity=10 ** 9)
    try:
        os.kill(sharer.pid, signal.SIGKILL)
        sharer.join(10)
        check.run(it, 12)
        local = it.stats['examples_from_local']
    finally:
        it.finalize()
    return {'outcome': 'survived' if local > 0 else 'starved',
            'wrong': check.wrong}


def _planted_by_nobody(world, planted, local_dir):
    """User nobody makes ``planted`` (mode 0777) and plants the dataset's
    files there with other bytes; then an iterator runs on ``local_dir``."""
    as_nobody('import os; os.makedirs({0!r}); os.chmod({0!r}, 0o777)'.format(
        planted))
    plant(planted, world['shared'], os.path.join(world['shared'], 'train.txt'))
    check = Checker(dataset_of(world['shared']))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        check.run_fresh(local_dir)
    return {'outcome': 'survived', 'wrong': check.wrong}


def fault_other_user_plants_files(world):
    hostile = os.path.join(world['scratch'], 'local')
    return _planted_by_nobody(world, hostile, hostile)


def fault_other_user_guesses_the_private_name(world):
    private = os.path.join(world['scratch'], 'chainer_prefetch-root')
    return _planted_by_nobody(world, private, world['scratch'])


def fault_hard_link_at_the_partial_name(world):
    from chainer_prefetch.staging import LocalDirectory
    dataset = dataset_of(world['shared'])
    directory = LocalDirectory(world['local'])
    outside = os.path.join(world['tmp'], 'precious')
    with open(outside, 'w') as f:
        f.write('keep')
    for relative, _ in dataset._pairs:
        source = os.path.join(world['shared'], relative)
        part = os.path.join(directory.partial_root, hashlib.sha1(
            directory.path_map.relative(source).encode()).hexdigest() + '.part')
        os.link(outside, part)
        break
    directory.close()
    check = Checker(dataset)
    check.run_fresh(world['local'])
    with open(outside) as f:
        intact = f.read() == 'keep'
    return {'outcome': 'survived' if intact else 'overwritten',
            'wrong': check.wrong}


def fault_unusable_capacity_ledger(world):
    dataset = dataset_of(world['shared'])
    os.makedirs(os.path.join(world['local'], '.capacity'))
    check = Checker(dataset)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        check.run_fresh(world['local'], local_capacity=10 ** 8)
    warned = any('capacity ledger' in str(w.message) for w in caught)
    return {'outcome': 'survived' if warned else 'no warning',
            'wrong': check.wrong}


def fault_process_group_killed(world):
    before = set(os.listdir('/dev/shm'))
    script = textwrap.dedent('''
        import sys
        from chainer_prefetch_bench.local_dir_faults import run
        it = run.iterator(run.dataset_of(sys.argv[1]), sys.argv[2],
                          shared_mem=10 ** 5)
        for number in range(10 ** 6):
            it.next()
            if number == 4:
                print('GO', flush=True)
    ''')
    child = subprocess.Popen([sys.executable, '-c', script, world['shared'],
                              world['local']], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    assert child.stdout.readline().strip() == 'GO'
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(10)
    child.stdout.close()
    time.sleep(1)
    return {'outcome': 'survived', 'wrong': 0,
            'segments': len(_new_segments(before))}


FAULTS = [fault_worker_killed, fault_killed_mid_copy, fault_full_disk,
          fault_read_only_local_dir, fault_source_removed,
          fault_storage_lost_and_back, fault_source_changed,
          fault_ctrl_c_while_storage_hangs, fault_sigterm_while_storage_hangs,
          fault_peer_stopped_holding_a_copy_lock,
          fault_sharer_killed_holding_reservations,
          fault_other_user_plants_files,
          fault_other_user_guesses_the_private_name,
          fault_hard_link_at_the_partial_name, fault_unusable_capacity_ledger,
          fault_process_group_killed]


# ---------------------------------------------------------------- bad inputs

def _wrong_size_sampler(order, position):
    return order[:-1]


class _Broken:
    """A dataset whose example 5 fails in the user's code."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if index == 5:
            raise ValueError('bad value in example')
        import numpy
        return numpy.zeros(2, numpy.float32)


BAD_INPUTS = [
    # (name, options or a callable, what the message must contain)
    ('batch_size 0', {'batch_size': 0}, 'batch_size'),
    ('batch_size -3', {'batch_size': -3}, 'batch_size'),
    ('batch_size 2.5', {'batch_size': 2.5}, 'batch_size'),
    ('batch_size "4"', {'batch_size': '4'}, 'batch_size'),
    ('batch_size True', {'batch_size': True}, 'batch_size'),
    ('n_processes 0', {'n_processes': 0}, 'n_processes'),
    ('n_processes -1', {'n_processes': -1}, 'n_processes'),
    ('n_copy_threads 0', {'n_copy_threads': 0}, 'n_copy_threads'),
    ('n_copy_ahead 0', {'n_copy_ahead': 0}, 'n_copy_ahead'),
    ('maxtasksperchild 0', {'maxtasksperchild': 0}, 'maxtasksperchild'),
    ('shared_mem -1', {'shared_mem': -1}, 'shared_mem'),
    ('local_capacity 0', {'local_capacity': 0}, 'local_capacity'),
    ('local_capacity -5', {'local_capacity': -5}, 'local_capacity'),
    ('local_capacity "1G"', {'local_capacity': '1G'}, 'local_capacity'),
    ('eviction_policy fifo', {'eviction_policy': 'fifo'}, 'eviction_policy'),
    ('recheck_sources sometimes', {'recheck_sources': 'sometimes'},
     'recheck_sources'),
    ('next_epoch_cache_examples 0', {'next_epoch_cache_examples': 0},
     'next_epoch_cache_examples'),
    ('next_epoch_cache_bytes -1', {'next_epoch_cache_bytes': -1},
     'next_epoch_cache_bytes'),
    ('shuffle with an order_sampler', {'shuffle': True,
                                       'order_sampler': _wrong_size_sampler},
     'order_sampler'),
    ('an order sampler of the wrong size',
     {'order_sampler': _wrong_size_sampler}, 'size of order'),
    ('local_dir is a file', 'local_dir_file', 'unusable'),
    ('local_dir under a file', 'local_dir_under_file', 'unusable'),
    ('local_dir of another user', 'local_dir_other_user', 'belongs to user'),
    ('local_dir writable by all', 'local_dir_world', 'other users'),
    ('a missing source file', 'missing_source', 'example 2'),
    ('an unreadable (corrupt) image', 'corrupt_source', 'example 3'),
    ('an exception in the user\'s get_example', 'broken_example', 'example 5'),
    ('a list file naming a directory', 'directory_source', 'example 1'),
]


def bad_input(world, name, spec, expect):
    """Runs one bad input; returns (clear error?, message)."""
    from chainer_prefetch import PrefetchMultiprocessIterator
    dataset = dataset_of(world['shared'])
    options = dict(n_processes=2, local_dir=world['local'], repeat=False,
                   shuffle=False, dataset_timeout=None)
    batch_size = BATCH
    if isinstance(spec, dict):
        options.update(spec)
        batch_size = options.pop('batch_size', BATCH)
        if 'order_sampler' in spec and 'shuffle' not in spec:
            options.pop('shuffle')  # the default here, not the user's
    else:
        dataset = _bad_world(world, spec, dataset, options)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            it = PrefetchMultiprocessIterator(dataset, batch_size, **options)
            try:
                for _ in range(N_IMAGES // BATCH + 1):
                    it.next()
            except StopIteration:
                pass
            finally:
                it.finalize()
        messages = [str(w.message) for w in caught]
        hit = [m for m in messages if expect in m]
        return bool(hit), (hit or messages or ['no error, no warning'])[0]
    except Exception as error:  # what the user sees
        return expect in str(error), '{}: {}'.format(type(error).__name__, error)


def _bad_world(world, spec, dataset, options):
    import chainer
    if spec == 'local_dir_file':
        path = os.path.join(world['tmp'], 'a-file')
        open(path, 'w').close()
        options['local_dir'] = path
    elif spec == 'local_dir_under_file':
        path = os.path.join(world['tmp'], 'b-file')
        open(path, 'w').close()
        options['local_dir'] = os.path.join(path, 'local')
    elif spec == 'local_dir_other_user':
        path = os.path.join(world['scratch'], 'theirs')
        as_nobody('import os; os.makedirs({0!r}); os.chmod({0!r}, 0o755)'
                  .format(path))
        options['local_dir'] = path
    elif spec == 'local_dir_world':
        path = os.path.join(world['tmp'], 'world')
        os.makedirs(path)
        os.chmod(path, 0o777)
        options['local_dir'] = path
    elif spec == 'missing_source':
        os.unlink(os.path.join(world['shared'], dataset._pairs[2][0]))
    elif spec == 'corrupt_source':
        with open(os.path.join(world['shared'], dataset._pairs[3][0]), 'wb') as f:
            f.write(b'not a jpeg')
    elif spec == 'broken_example':
        return _Broken(N_IMAGES)
    elif spec == 'directory_source':
        path = os.path.join(world['shared'], dataset._pairs[1][0])
        os.unlink(path)
        os.makedirs(path)
        return chainer.datasets.LabeledImageDataset(
            os.path.join(world['shared'], 'train.txt'), world['shared'])
    return dataset


# ---------------------------------------------------------------- running

def fresh_world(base):
    tmp = tempfile.mkdtemp(dir=base)
    shared = os.path.join(tmp, 'shared')
    make_images(shared)
    scratch = os.path.join(tmp, 'scratch')
    os.makedirs(scratch)
    os.chmod(scratch, 0o1777)
    os.chmod(tmp, 0o755)
    return {'tmp': tmp, 'shared': shared, 'local': os.path.join(tmp, 'local'),
            'scratch': scratch}


def _child(kind, index, base, answer):
    """In a child process: one scenario; puts its result into ``answer``."""
    world = fresh_world(base)
    started = time.monotonic()
    try:
        if kind == 'fault':
            result = FAULTS[index](world)
        else:
            name, spec, expect = BAD_INPUTS[index]
            clear, message = bad_input(world, name, spec, expect)
            result = {'outcome': 'clear error' if clear else 'unclear',
                      'note': message[:160], 'wrong': 0}
    except Exception as error:
        result = {'outcome': 'crashed', 'note': '{}: {}'.format(
            type(error).__name__, error)[:200],
            'traceback': traceback.format_exc(), 'wrong': 0}
    result['seconds'] = time.monotonic() - started
    answer.put(result)


def run_scenario(kind, index, base, timeout):
    context = multiprocessing.get_context('fork')
    answer = context.Queue()
    before_shm = set(os.listdir('/dev/shm'))
    process = context.Process(target=_child, args=(kind, index, base, answer))
    process.start()
    try:
        result = answer.get(timeout=timeout)
    except Exception:
        result = {'outcome': 'hang', 'wrong': 0}
    process.join(10)
    left_processes = 0
    if process.is_alive():
        left_processes = 1
        os.kill(process.pid, signal.SIGKILL)
        process.join()
    time.sleep(0.2)
    result['segments'] = result.get('segments', 0) + len(
        _new_segments(before_shm))
    result['processes_left'] = left_processes + _orphans()
    return result


def _new_segments(before) -> set:
    """Entries of /dev/shm not in ``before``, apart from Open MPI's segments
    (``sm_segment.*``: MPI jobs of others on the node; no scenario runs MPI)."""
    return {name for name in set(os.listdir('/dev/shm')) - before
            if not name.startswith('sm_segment.')}


def _ancestors() -> set:
    """This process and the processes it was started by."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            with open('/proc/{}/stat'.format(pid)) as f:
                pid = int(f.read().rsplit(')', 1)[1].split()[1])
        except OSError:
            break
    return pids


def _orphans() -> int:
    """Processes of the scenarios still running (their command line names us)."""
    count = 0
    mine = _ancestors()
    for pid in os.listdir('/proc'):
        if not pid.isdigit() or int(pid) in mine:
            continue
        try:
            with open('/proc/{}/cmdline'.format(pid), 'rb') as f:
                if b'chainer_prefetch_bench.local_dir_faults' in f.read():
                    count += 1
        except OSError:
            pass
    return count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', default='results/local_dir_faults/faults.json')
    parser.add_argument('--timeout', type=float, default=120)
    parser.add_argument('--workdir', default='/tmp/chainer_prefetch_local_dir_faults')
    args = parser.parse_args(argv)
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    os.chmod(args.workdir, 0o755)
    rows = []
    for kind, scenarios in (('fault', FAULTS), ('bad input', BAD_INPUTS)):
        for index, scenario in enumerate(scenarios):
            name = (scenario.__name__[len('fault_'):].replace('_', ' ')
                    if kind == 'fault' else scenario[0])
            result = run_scenario(kind, index, args.workdir, args.timeout)
            result.update(kind=kind, name=name)
            rows.append(result)
            print('{:<9} {:<45} {:<12} wrong {} segments {} left {}  {}'.format(
                kind, name, result['outcome'], result['wrong'],
                result['segments'], result['processes_left'],
                result.get('note', '')), flush=True)
    faults = [r for r in rows if r['kind'] == 'fault']
    bad = [r for r in rows if r['kind'] == 'bad input']
    table = {
        'faults tried': len(faults),
        'faults survived': sum(r['outcome'] == 'survived' for r in faults),
        'bad inputs': len(bad),
        'clear errors': sum(r['outcome'] == 'clear error' for r in bad),
        'wrong examples served': sum(r['wrong'] for r in rows),
        'hangs': sum(r['outcome'] == 'hang' for r in rows),
        'segments leaked': sum(r['segments'] for r in rows),
        'processes left': sum(r['processes_left'] for r in rows),
    }
    print()
    for key, value in table.items():
        print('{:<24} {}'.format(key, value))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump({'command': 'python -m chainer_prefetch_bench.local_dir_faults.run '
                   + ' '.join(argv or sys.argv[1:]), 'table': table,
                   'rows': rows}, f, indent=1, default=str)
    shutil.rmtree(args.workdir, ignore_errors=True)
    ok = (table['wrong examples served'] == 0 and table['hangs'] == 0
          and table['segments leaked'] == 0)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
