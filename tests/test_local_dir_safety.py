"""The local directory under attack and under faults: real processes, files, users.

Another user is played by ``nobody`` through ``setpriv`` (the tests run as
root, as CI does).  Every example an iterator delivers is compared with a
direct read of the dataset: the iterator must never serve bytes that are not
the source's.
"""
import fcntl
import multiprocessing
import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

import chainer
import pytest

import helpers
from chainer_prefetch import PrefetchMultiprocessIterator, WorkerDiedError
from chainer_prefetch.errors import CopyLockTimeout, UntrustedLocalDirectoryError
from chainer_prefetch.staging import LocalDirectory, LocalStore, PlainFile
from chainer_prefetch.staging.capacity import CapacityLedger

pytestmark = pytest.mark.timeout(120)

N_IMAGES = 12
NOBODY = ['setpriv', '--reuid=nobody', '--regid=nogroup', '--clear-groups']


@pytest.fixture
def tmp_path():
    """Like pytest's ``tmp_path``, but where user nobody can reach it.

    pytest's base directory is private to its user (mode 0700), so another
    user could not even look into the directories these tests give it.
    """
    path = tempfile.mkdtemp(prefix='chainer_prefetch-safety-')
    os.chmod(path, 0o755)
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def images(tmp_path):
    shared = tmp_path / 'shared'
    list_file, root, paths = helpers.make_jpeg_dataset(shared, N_IMAGES)
    return chainer.datasets.LabeledImageDataset(list_file, root), paths


def _as_nobody(script):
    """Runs a Python ``script`` as user nobody; returns its stdout."""
    return subprocess.run(NOBODY + [sys.executable, '-c', textwrap.dedent(script)],
                          check=True, stdout=subprocess.PIPE, text=True,
                          timeout=60).stdout


def _read_all(dataset, local_dir, **options):
    """Every batch of one epoch, in index order, and the iterator's stats."""
    it = PrefetchMultiprocessIterator(
        dataset, 3, repeat=False, shuffle=False, n_processes=2,
        n_copy_threads=2, local_dir=local_dir, dataset_timeout=None, **options)
    try:
        examples = [example for batch in it for example in batch]
        return examples, it.stats
    finally:
        it.finalize()


def _plant(directory, sources, local_root):
    """As nobody: files at the local paths of ``sources``, of the sources'
    size and mtime but other bytes (what a hostile user would try)."""
    _as_nobody('''
        import os
        for source in {sources!r}:
            local = os.path.join({local_root!r}, 'data',
                                 os.path.abspath(source).lstrip('/'))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            info = os.stat(source)
            with open(local, 'wb') as f:
                f.write(b'\\xff' * info.st_size)
            os.utime(local, ns=(info.st_atime_ns, info.st_mtime_ns))
    '''.format(sources=sources, local_root=local_root))


def _world_writable(path, sticky=False):
    """A directory of user nobody that every user can write in."""
    os.makedirs(str(path))
    nobody = pwd.getpwnam('nobody')
    os.chown(str(path), nobody.pw_uid, nobody.pw_gid)
    os.chmod(str(path), 0o1777 if sticky else 0o777)


def test_a_directory_another_user_can_write_is_never_used(images, tmp_path):
    dataset, paths = images
    scratch = tmp_path / 'scratch'
    scratch.mkdir()
    os.chmod(str(scratch), 0o1777)  # shared scratch space, as /tmp
    hostile = scratch / 'local'
    _world_writable(hostile)  # another user's directory, mode 0777
    _plant(hostile, paths, str(hostile))
    with pytest.warns(UserWarning, match='belongs to user 65534'):
        examples, stats = _read_all(dataset, str(hostile))
    helpers.assert_examples_equal(examples, [dataset[i] for i in range(N_IMAGES)])
    assert stats['examples_from_local'] == 0  # nothing of it was read


def test_shared_scratch_gets_a_private_subdirectory_nobody_can_plant_into(
        images, tmp_path):
    dataset, paths = images
    scratch = tmp_path / 'scratch'
    scratch.mkdir()
    os.chmod(str(scratch), 0o1777)
    # The other user guesses the private name and plants files there first.
    planted = scratch / 'chainer_prefetch-root'
    _world_writable(planted)
    _plant(planted, paths, str(planted))
    with pytest.warns(UserWarning, match='chainer_prefetch-root'):
        examples, _ = _read_all(dataset, str(scratch))
    helpers.assert_examples_equal(examples, [dataset[i] for i in range(N_IMAGES)])
    # Without the planted directory: the private one is made and used, and
    # the other user can put nothing in it.
    other = tmp_path / 'scratch2'
    other.mkdir()
    os.chmod(str(other), 0o1777)
    examples, stats = _read_all(dataset, str(other))
    helpers.assert_examples_equal(examples, [dataset[i] for i in range(N_IMAGES)])
    private = other / 'chainer_prefetch-root'
    assert stats['files_copied'] == N_IMAGES
    assert os.stat(str(private)).st_mode & 0o777 == 0o700
    with pytest.raises(subprocess.CalledProcessError):
        _plant(private, paths[:1], str(private))


def test_an_ancestor_another_user_can_rename_in_is_refused(images, tmp_path):
    dataset, _ = images
    # Ours but writable by all without the sticky bit: anyone can rename
    # our directory away and put theirs in its place.
    hostile = tmp_path / 'everyones'
    hostile.mkdir()
    os.chmod(str(hostile), 0o777)
    local = hostile / 'mine' / 'local'
    os.makedirs(str(local), mode=0o700)
    with pytest.raises(UntrustedLocalDirectoryError, match='no sticky bit'):
        LocalDirectory(str(local))
    # An ancestor of another user: refused whatever its mode.
    theirs = tmp_path / 'theirs'
    _world_writable(theirs, sticky=True)
    os.makedirs(str(theirs / 'mine'), mode=0o700)
    with pytest.raises(UntrustedLocalDirectoryError, match='belongs to user 65534'):
        LocalDirectory(str(theirs / 'mine'))
    with pytest.warns(UserWarning, match='no sticky bit'):
        examples, _ = _read_all(dataset, str(local))
    helpers.assert_examples_equal(examples, [dataset[i] for i in range(N_IMAGES)])


def test_a_local_dir_that_is_a_symlink_is_resolved_once_and_checked(
        images, tmp_path):
    dataset, _ = images
    target = tmp_path / 'ssd' / 'job'
    target.mkdir(parents=True, mode=0o700)
    link = tmp_path / 'local'
    link.symlink_to(target)
    directory = LocalDirectory(str(link))
    assert directory.root == str(target)  # used through the real path
    directory.close()
    examples, stats = _read_all(dataset, str(link))
    assert stats['files_copied'] == N_IMAGES
    assert os.path.isdir(str(target / 'data'))
    # A link to another user's directory is refused like the directory.
    hostile = tmp_path / 'theirs'
    _world_writable(hostile)
    bad = tmp_path / 'bad'
    bad.symlink_to(hostile)
    with pytest.raises(UntrustedLocalDirectoryError):
        LocalDirectory(str(bad))


def test_a_hard_link_at_the_partial_name_is_never_written_through(tmp_path):
    source = str(tmp_path / 'shared' / 'a.bin')
    data = helpers.write_random_file(source, 5000)
    outside = str(tmp_path / 'precious.txt')
    with open(outside, 'w') as f:
        f.write('keep me')
    directory = LocalDirectory(str(tmp_path / 'local'))
    import hashlib
    relative = directory.path_map.relative(source)
    part = os.path.join(directory.partial_root, hashlib.sha1(
        relative.encode()).hexdigest() + '.part')
    os.link(outside, part)
    assert directory.stage(source) == len(data)
    assert helpers.read_bytes(directory.local_path(source)) == data
    with open(outside) as f:
        assert f.read() == 'keep me'


def test_a_changed_source_is_copied_again_in_the_next_epoch(images, tmp_path):
    dataset, paths = images
    local = str(tmp_path / 'local')
    for recheck, expect_new in (('each_epoch', True), ('never', False)):
        original = [dataset[i] for i in range(N_IMAGES)]
        it = PrefetchMultiprocessIterator(
            dataset, 3, shuffle=False, n_processes=2, n_copy_ahead=1,
            local_dir=local + recheck, recheck_sources=recheck)
        try:
            for _ in range(4):  # epoch 0
                it.next()
            helpers.make_jpeg_dataset(os.path.dirname(os.path.dirname(
                paths[0])), N_IMAGES, seed=recheck == 'never' and 9 or 8)
            changed = [dataset[i] for i in range(N_IMAGES)]
            examples = []
            while it.epoch < 3:  # epochs 1 and 2
                examples.extend(it.next())
        finally:
            it.finalize()
        # Batches of epoch 1 made before the change may be the old ones;
        # epoch 2 was staged after it.
        last = examples[-N_IMAGES:]
        expected = changed if expect_new else original
        helpers.assert_examples_equal(last, expected)


def _hold_copy_lock(part_path, locked, release):
    """Child: a peer process that holds a copy's lock, then is stopped."""
    fd = os.open(part_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    locked.set()
    release.wait(60)
    os._exit(0)


def test_a_peer_stopped_holding_a_copy_lock_is_waited_for_a_bounded_time(
        tmp_path):
    source = str(tmp_path / 'shared' / 'a.bin')
    helpers.write_random_file(source, 5000)
    directory = LocalDirectory(str(tmp_path / 'local'), lock_timeout=1.0)
    import hashlib
    part = os.path.join(directory.partial_root, hashlib.sha1(
        directory.path_map.relative(source).encode()).hexdigest() + '.part')
    context = multiprocessing.get_context('fork')
    locked, release = context.Event(), context.Event()
    peer = context.Process(target=_hold_copy_lock, args=(part, locked, release))
    peer.start()
    try:
        assert locked.wait(10)
        os.kill(peer.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(CopyLockTimeout, match='stopped'):
            directory.stage(source)
        assert 0.9 < time.monotonic() - started < 5
        store = LocalStore(directory)
        started = time.monotonic()
        assert not store.stage(0, [PlainFile(source)]).staged  # read the source
        assert store.counters.snapshot()['files_lock_timeouts'] == 1
        assert time.monotonic() - started < 5
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        release.set()
        peer.join(10)
        directory.close()


def _reserve_and_wait(root, data_root, reserved, release):
    ledger = CapacityLedger(root, data_root, 10 ** 6)
    assert ledger.reserve(600000)
    reserved.set()
    release.wait(60)
    os._exit(0)


def test_reservations_die_with_their_owner(tmp_path):
    root = str(tmp_path / 'local')
    directory = LocalDirectory(root)
    survivor = CapacityLedger(directory.root, directory.data_root, 10 ** 6)
    try:
        context = multiprocessing.get_context('fork')
        reserved, release = context.Event(), context.Event()
        sharer = context.Process(target=_reserve_and_wait, args=(
            directory.root, directory.data_root, reserved, release))
        sharer.start()
        assert reserved.wait(10)
        assert survivor.used_bytes() == 600000
        assert not survivor.reserve(500000)
        os.kill(sharer.pid, signal.SIGKILL)  # killed holding the reservation
        sharer.join(10)
        assert survivor.used_bytes() == 0
        assert survivor.reserve(900000)
        survivor.settle(900000, 800000)
        assert survivor.used_bytes() == 800000
    finally:
        survivor.close()
        directory.close()


def test_an_unusable_capacity_ledger_warns_and_reads_the_source(images, tmp_path):
    dataset, _ = images
    local = tmp_path / 'local'
    LocalDirectory(str(local)).close()
    os.mkdir(str(local / '.capacity'))  # cannot be opened as a file
    with pytest.warns(UserWarning, match='capacity ledger'):
        examples, stats = _read_all(dataset, str(local), local_capacity=10 ** 8)
    helpers.assert_examples_equal(examples, [dataset[i] for i in range(N_IMAGES)])
    assert stats['examples_from_local'] == 0


def test_a_missing_source_with_a_limit_is_named_by_next_not_the_constructor(
        images, tmp_path):
    dataset, paths = images
    os.unlink(paths[7])
    it = PrefetchMultiprocessIterator(
        dataset, 3, repeat=False, shuffle=False, n_processes=2,
        local_dir=str(tmp_path / 'local'), local_capacity=10 ** 8)
    try:
        with pytest.raises(FileNotFoundError) as info:
            for _ in range(4):
                it.next()
        assert 'example 7' in str(info.value) and paths[7] in str(info.value)
    finally:
        it.finalize()


def test_valid_copies_are_used_after_the_local_side_fails(images, tmp_path):
    """A full disk stops new copies, not the use of the ones already there."""
    dataset, paths = images
    mount = tmp_path / 'small'
    mount.mkdir()
    with helpers.tmpfs(str(mount), '512k'):
        local = str(mount / 'local')
        half = chainer.datasets.SubDataset(dataset, 0, N_IMAGES // 2)
        _read_all(half, local)  # the first half is copied
        with open(str(mount / 'filler'), 'wb') as f:  # then the disk fills
            try:
                f.write(b'\0' * (1 << 20))
            except OSError:
                pass
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            examples, stats = _read_all(dataset, local)
    helpers.assert_examples_equal(examples, [dataset[i] for i in range(N_IMAGES)])
    assert stats['local_storage_error'] is not None
    assert stats['examples_from_local'] >= N_IMAGES // 2


def test_reset_after_a_worker_died_starts_fresh_workers(images, tmp_path):
    dataset, _ = images
    it = PrefetchMultiprocessIterator(dataset, 2, n_processes=2, shuffle=False,
                                      local_dir=str(tmp_path / 'local'))
    try:
        first = it.next()
        for pid in it._executor._pool.pids():
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            for _ in range(20):
                it.next()
        it.reset()
        helpers.assert_examples_equal(it.next(), first)
        for _ in range(8):
            it.next()
    finally:
        it.finalize()


_KILLED_SCRIPT = textwrap.dedent('''
    import sys, time
    import numpy
    from chainer_prefetch import PrefetchMultiprocessIterator
    dataset = [numpy.full((64, 1024), i, numpy.float32) for i in range(64)]
    it = PrefetchMultiprocessIterator(dataset, 8, n_processes=2)
    for number in range(1000):
        it.next()
        if number == 5:
            print('RUNNING', flush=True)
        time.sleep(0.01)
''')


def _shared_memory_of_group(group):
    """The /dev/shm files the processes of process group ``group`` map or hold open."""
    paths = set()
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open('/proc/%s/stat' % pid) as f:
                if int(f.read().rsplit(')', 1)[1].split()[2]) != group:
                    continue
            with open('/proc/%s/maps' % pid) as f:
                paths.update(line.split(None, 5)[5].strip() for line in f
                             if '/dev/shm/' in line)
            for fd in os.listdir('/proc/%s/fd' % pid):
                target = os.readlink('/proc/%s/fd/%s' % (pid, fd))
                if target.startswith('/dev/shm/'):
                    paths.add(target)
        except (OSError, IndexError):
            continue  # the process ended meanwhile
    return {path.replace(' (deleted)', '') for path in paths}


def test_sigkill_of_the_whole_process_group_leaves_no_shared_memory():
    before = set(os.listdir('/dev/shm'))
    process = subprocess.Popen([sys.executable, '-c', _KILLED_SCRIPT],
                               stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        assert process.stdout.readline().strip() == 'RUNNING'
        used = _shared_memory_of_group(process.pid)
        os.killpg(process.pid, signal.SIGKILL)  # what a scheduler does
        process.wait(10)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.stdout.close()
    time.sleep(0.5)
    assert not [path for path in used if os.path.exists(path)]
    # Nor anything else new that the processes could have made.
    assert helpers.new_shm_names(before) == []


_HUNG_SCRIPT = textwrap.dedent('''
    import os, signal, sys
    # Ctrl-C raises KeyboardInterrupt, as in a terminal, even when these
    # tests were started with SIGINT ignored (in the background).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import chainer
    from chainer_prefetch import PrefetchMultiprocessIterator
    fifos = sys.argv[1:]
    dataset = chainer.datasets.ImageDataset(fifos)
    it = PrefetchMultiprocessIterator(dataset, 2, n_processes=2,
                                      local_dir=os.environ['LOCAL_DIR'],
                                      dataset_timeout=None)
    print('STARTED', flush=True)
    it.next()  # hangs: the storage does not answer
''')


@pytest.mark.parametrize('signal_number', [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_while_shared_storage_hangs_ends_the_job(
        tmp_path, signal_number):
    fifos = []
    (tmp_path / 'shared').mkdir()  # the local directory is not inside it
    for i in range(6):
        path = str(tmp_path / 'shared' / 'hung{}.jpg'.format(i))
        os.mkfifo(path)
        fifos.append(path)
    env = dict(os.environ, LOCAL_DIR=str(tmp_path / 'local'))
    process = subprocess.Popen([sys.executable, '-c', _HUNG_SCRIPT] + fifos,
                               stdout=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        assert process.stdout.readline().strip() == 'STARTED'
        # Copies blocked in open() on the FIFOs, as on a hung file system.
        assert helpers.wait_until(
            lambda: helpers.threads_in_open(process.pid) >= 2, 30), \
            helpers.threads_in_open(process.pid)
        started = time.monotonic()
        os.killpg(process.pid, signal_number)
        process.wait(15)
        assert time.monotonic() - started < 10
        assert helpers.wait_until(lambda: not helpers.worker_children(
            process.pid), 5)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        process.stdout.close()
        for path in fifos:  # free anything still blocked on them
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def _info(mode, uid):
    return os.stat_result((mode, 0, 0, 0, uid, 0, 0, 0, 0, 0))


def test_which_directories_are_trusted():
    from chainer_prefetch.staging import trust
    me, other = 1000, 1001
    directory = 0o040000
    assert trust.directory_use(_info(directory | 0o700, me), me) == ('use', None)
    assert trust.directory_use(_info(directory | 0o755, me), me) == ('use', None)
    # Shared scratch space: a private subdirectory.
    assert trust.directory_use(_info(directory | 0o1777, 0), me)[0] == \
        'subdirectory'
    assert trust.directory_use(_info(directory | 0o1777, me), me)[0] == \
        'subdirectory'
    # Writable by others without the sticky bit, or another user's: refused.
    for info in (_info(directory | 0o777, me), _info(directory | 0o775, me),
                 _info(directory | 0o700, other), _info(directory | 0o1777, other)):
        use, why = trust.directory_use(info, me)
        assert use == 'refuse' and why
    # Ancestors: root's or mine, sticky if others may write.
    assert trust.ancestor_problem(_info(directory | 0o755, 0), me) is None
    assert trust.ancestor_problem(_info(directory | 0o1777, 0), me) is None
    assert 'sticky' in trust.ancestor_problem(_info(directory | 0o777, 0), me)
    assert 'belongs' in trust.ancestor_problem(_info(directory | 0o755, other), me)
