"""LocalDirectory on a real file system: copies, crashes, sharing, paths, limits.

No mocks: real files, real processes (fork), real tmpfs mounts (as root).
Where a test needs a crash or a race at an exact point, the *child process
only* is slowed down (small copy chunks, a sleep) so the point is reached
deterministically; the code under test runs unchanged.
"""
import errno
import fcntl
import hashlib
import multiprocessing
import os
import shutil
import signal
import stat
import time

import pytest

import helpers
from chainer_prefetch.staging import local_directory, sources
from chainer_prefetch.staging.local_directory import (
    LocalDirectory,
    LocalStorageError,
    SourceFileError,
)

MB = 1 << 20
FORK = multiprocessing.get_context('fork')


def _part_name(directory, source):
    relative = directory.path_map.relative(source)
    return hashlib.sha1(relative.encode('utf-8', 'surrogateescape')
                        ).hexdigest() + '.part'


def _inside(path, directory):
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return os.path.commonpath([path, directory]) == directory


# ---- copies and validity ------------------------------------------------------

def test_copy_is_identical_and_stamped_then_skipped(tmp_path):
    source = str(tmp_path / 'src' / 'a' / 'file.bin')
    data = helpers.write_random_file(source, 300000)
    os.utime(source, ns=(1500000000123456789, 1600000000987654321))
    directory = LocalDirectory(str(tmp_path / 'local'))

    assert directory.stage(source) == len(data)
    local = directory.local_path(source)
    assert helpers.read_bytes(local) == data
    assert os.stat(local).st_mtime_ns == os.stat(source).st_mtime_ns
    assert directory.is_current(source, os.stat(source))
    # Second time: nothing copied.
    assert directory.stage(source) == 0
    assert os.listdir(directory.partial_root) == []


def test_changed_size_or_mtime_copies_again(tmp_path):
    source = str(tmp_path / 'src' / 'file.bin')
    helpers.write_random_file(source, 10000, seed=1)
    directory = LocalDirectory(str(tmp_path / 'local'))
    assert directory.stage(source) == 10000

    # Same size, new content and mtime.
    data = helpers.write_random_file(source, 10000, seed=2)
    os.utime(source, ns=(1, os.stat(source).st_mtime_ns + 10 ** 9))
    assert not directory.is_current(source, os.stat(source))
    assert directory.stage(source) == 10000
    assert helpers.read_bytes(directory.local_path(source)) == data

    # Different size, same mtime as the copy.
    mtime = os.stat(source).st_mtime_ns
    data = helpers.write_random_file(source, 12345, seed=3)
    os.utime(source, ns=(1, mtime))
    assert directory.stage(source) == 12345
    assert helpers.read_bytes(directory.local_path(source)) == data
    assert directory.stage(source) == 0


def test_missing_source_raises_source_file_error_naming_it(tmp_path):
    directory = LocalDirectory(str(tmp_path / 'local'))
    source = str(tmp_path / 'src' / 'missing.jpg')
    with pytest.raises(SourceFileError) as info:
        directory.stage(source)
    assert source in str(info.value)
    assert info.value.errno == errno.ENOENT
    assert not isinstance(info.value, LocalStorageError)
    assert not os.path.lexists(directory.local_path(source))


def test_source_vanishing_after_stat_leaves_nothing(tmp_path):
    source = str(tmp_path / 'src' / 'gone.bin')
    helpers.write_random_file(source, 5000)
    source_stat = os.stat(source)
    os.unlink(source)
    directory = LocalDirectory(str(tmp_path / 'local'))
    with pytest.raises(SourceFileError) as info:
        directory.stage(source, source_stat)
    assert source in str(info.value)
    assert not os.path.lexists(directory.local_path(source))
    assert os.listdir(directory.partial_root) == []


# ---- crashes and leftovers ------------------------------------------------------

def _slow_copy_child(root, source, started_writer):
    """Child: stages ``source`` in 64 KiB chunks, announcing the first chunk."""
    sources._SENDFILE_BYTES = 64 * 1024
    real_sendfile = os.sendfile
    state = {'announced': False}

    def slow_sendfile(out_fd, in_fd, offset, count):
        sent = real_sendfile(out_fd, in_fd, offset, count)
        if not state['announced']:
            state['announced'] = True
            started_writer.send('writing')
        time.sleep(0.05)
        return sent

    os.sendfile = slow_sendfile
    LocalDirectory(root).stage(source)
    os._exit(0)


@pytest.mark.timeout(60)
def test_kill_mid_copy_leaves_only_a_part_that_start_up_removes(tmp_path):
    source = str(tmp_path / 'src' / 'big.bin')
    data = helpers.write_random_file(source, 4 * MB)
    root = str(tmp_path / 'local')
    reader, writer = FORK.Pipe(duplex=False)
    child = FORK.Process(target=_slow_copy_child, args=(root, source, writer))
    child.start()
    try:
        assert reader.poll(20), 'the child never started copying'
        assert reader.recv() == 'writing'
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(10)
    assert child.exitcode == -signal.SIGKILL

    local = os.path.join(root, 'data', os.path.abspath(source).lstrip('/'))
    assert not os.path.lexists(local), 'partial file under its final name'
    parts = os.listdir(os.path.join(root, '.partial'))
    assert len(parts) == 1 and parts[0].endswith('.part')
    assert 0 < os.path.getsize(os.path.join(root, '.partial', parts[0])) < len(data)

    directory = LocalDirectory(root)
    assert directory.removed_leftovers == 1
    assert os.listdir(directory.partial_root) == []
    assert directory.local_path(source) == local
    assert directory.stage(source) == len(data)
    assert helpers.read_bytes(local) == data


def _hold_lock(path, ready_writer, release_reader):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready_writer.send('locked')
    release_reader.recv()
    os._exit(0)


@pytest.mark.timeout(60)
def test_part_locked_by_a_live_process_is_kept_at_start_up(tmp_path):
    root = str(tmp_path / 'local')
    first = LocalDirectory(root)
    live = os.path.join(first.partial_root, 'a' * 40 + '.part')
    dead = os.path.join(first.partial_root, 'b' * 40 + '.part')
    with open(dead, 'wb') as f:
        f.write(b'left by a crash')
    ready_reader, ready_writer = FORK.Pipe(duplex=False)
    release_reader, release_writer = FORK.Pipe(duplex=False)
    holder = FORK.Process(target=_hold_lock,
                          args=(live, ready_writer, release_reader))
    holder.start()
    try:
        assert ready_reader.poll(20)
        ready_reader.recv()
        second = LocalDirectory(root)
        assert second.removed_leftovers == 1
        assert os.path.exists(live), 'a live copy was removed'
        assert not os.path.exists(dead)
    finally:
        release_writer.send('go')
        holder.join(10)
    # Once its holder is gone, the part is a leftover like any other.
    assert LocalDirectory(root).removed_leftovers == 1
    assert os.listdir(os.path.join(root, '.partial')) == []


def _stage_after_announcing(directory, source, marker, go_reader, result_writer):
    """Child: a rank that copies ``source`` once told to go."""
    original_fill = sources.PlainFile.write_local

    def fill(self, *args):
        with open(marker, 'w'):
            pass  # "I hold the part's lock and am writing into it"
        time.sleep(0.3)
        return original_fill(self, *args)

    original_lock = LocalDirectory._lock

    def lock(self, *args):
        result_writer.send('locking')  # about to try the part's lock
        return original_lock(self, *args)

    sources.PlainFile.write_local = fill
    LocalDirectory._lock = lock
    try:
        go_reader.recv()
        result_writer.send(('ok', directory.stage(source)))
    except BaseException as error:  # report, do not hide
        result_writer.send(('error', repr(error)))
    os._exit(0)


@pytest.mark.timeout(60)
def test_start_up_never_deletes_a_part_another_process_is_filling(
        tmp_path, monkeypatch):
    """Start-up of rank B must not unlink the .part that rank A just locked.

    ``_remove_leftovers`` checks that a leftover is unlocked, *releases* the
    lock, and only then unlinks the name.  A copy that locks the file in that
    gap fills an unlinked file and its rename fails (or renames somebody
    else's partial file into place).  The gap is widened here by letting the
    copying process go exactly there; the code under test is unchanged.
    """
    source = str(tmp_path / 'src' / 'file.bin')
    data = helpers.write_random_file(source, 2 * MB)
    root = str(tmp_path / 'local')
    copier_directory = LocalDirectory(root)  # rank A, already started
    # A leftover of an earlier crashed copy of the same file.
    part = os.path.join(copier_directory.partial_root,
                        _part_name(copier_directory, source))
    with open(part, 'wb') as f:
        f.write(b'stale')

    marker = str(tmp_path / 'filling')
    go_reader, go_writer = FORK.Pipe(duplex=False)
    result_reader, result_writer = FORK.Pipe(duplex=False)
    # Forked now, so it inherits no descriptor of rank B's start-up.
    copier = FORK.Process(target=_stage_after_announcing, args=(
        copier_directory, source, marker, go_reader, result_writer))
    copier.start()
    original_unlink = local_directory._unlink_quietly
    went = []

    def unlink_hook(name, directory_fd):
        if not went:
            went.append(True)
            go_writer.send('go')
            assert result_reader.poll(20) and result_reader.recv() == 'locking'
            # Rank A is at the lock: give it 1 s to take it (it can only if
            # start-up has released it already).
            helpers.wait_until(lambda: os.path.exists(marker), 1)
        return original_unlink(name, directory_fd)

    try:
        monkeypatch.setattr(local_directory, '_unlink_quietly', unlink_hook)
        LocalDirectory(root)  # rank B starts up
        monkeypatch.undo()
        if not went:  # start-up no longer goes through the hook: no race
            go_writer.send('go')
        outcome = 'locking'
        while outcome == 'locking':  # (it announces each attempt)
            assert result_reader.poll(30)
            outcome = result_reader.recv()
    finally:
        copier.join(10)
        if copier.exitcode is None:
            copier.kill()
            copier.join()
    assert outcome == ('ok', len(data)), (
        'rank A failed because rank B unlinked its locked .part: {}'.format(
            outcome))
    assert helpers.read_bytes(copier_directory.local_path(source)) == data
    assert os.listdir(copier_directory.partial_root) == []


# ---- several processes ------------------------------------------------------------

def _stage_all(root, sources, order_seed, barrier, results):
    import random
    directory = LocalDirectory(root)
    order = list(sources)
    random.Random(order_seed).shuffle(order)
    barrier.wait()
    copied = {source: directory.stage(source) for source in order}
    results.send(copied)  # a pipe: sent before os._exit, unlike a Queue
    os._exit(0)


@pytest.mark.timeout(60)
def test_processes_sharing_a_directory_copy_each_file_once(tmp_path):
    sources, contents = [], {}
    for i in range(20):
        source = str(tmp_path / 'src' / 'd{}'.format(i % 4) / 'f{:02d}.bin'.format(i))
        contents[source] = helpers.write_random_file(source, 100000 + 37 * i, seed=i)
        sources.append(source)
    root = str(tmp_path / 'local')
    n_processes = 4
    barrier = FORK.Barrier(n_processes)
    pipes = [FORK.Pipe(duplex=False) for _ in range(n_processes)]
    processes = [FORK.Process(target=_stage_all,
                              args=(root, sources, seed, barrier, writer))
                 for seed, (_, writer) in enumerate(pipes)]
    for process in processes:
        process.start()
    copied = []
    for reader, _ in pipes:
        assert reader.poll(40), 'a staging process did not finish'
        copied.append(reader.recv())
    for process in processes:
        process.join(10)
        assert process.exitcode == 0

    total = sum(len(data) for data in contents.values())
    assert sum(sum(c.values()) for c in copied) == total
    directory = LocalDirectory(root)
    for source, data in contents.items():
        by_process = [c[source] for c in copied]
        assert sorted(by_process) == [0] * (n_processes - 1) + [len(data)], (
            source, by_process)
        assert helpers.read_bytes(directory.local_path(source)) == data
    assert directory.removed_leftovers == 0
    assert os.listdir(directory.partial_root) == []


# ---- paths and symlinks -------------------------------------------------------------

def test_paths_with_dotdot_or_absolute_stay_under_data(tmp_path, monkeypatch):
    target = str(tmp_path / 'a' / 'x.bin')
    data = helpers.write_random_file(target, 1000)
    list_root = str(tmp_path / 'a' / 'b' / 'c')
    os.makedirs(list_root)
    directory = LocalDirectory(str(tmp_path / 'local'))
    monkeypatch.chdir(list_root)
    expected = os.path.join(directory.data_root, target.lstrip('/'))
    spellings = [
        target,                                       # absolute
        os.path.join(list_root, '../../x.bin'),       # list entry ../../x
        str(tmp_path / 'a' / 'b' / '..' / 'x.bin'),   # .. in the middle
        '/..' * 8 + target,                           # climbing above /
        '../../x.bin',                                # relative to the cwd
    ]
    for number, spelling in enumerate(spellings):
        local = directory.local_path(spelling)
        assert local == expected, spelling
        assert _inside(local, directory.data_root)
        copied = directory.stage(spelling)
        assert copied == (len(data) if number == 0 else 0)
    assert helpers.read_bytes(expected) == data
    # Paths that name things outside the tree still map inside data/.
    for spelling in ('../../etc/x', '/../../../etc/passwd', '//etc/x',
                     'a/../../../../../../x'):
        assert _inside(directory.local_path(spelling), directory.data_root)
        assert directory.local_path(spelling) != directory.data_root
    assert helpers.files_under(str(tmp_path / 'local')) == [
        os.path.join('data', target.lstrip('/'))]


def test_symlinked_directory_in_the_mirror_is_refused(tmp_path):
    source = str(tmp_path / 'src' / 'sub' / 'file.bin')
    helpers.write_random_file(source, 4000)
    directory = LocalDirectory(str(tmp_path / 'local'))
    elsewhere = tmp_path / 'elsewhere'
    elsewhere.mkdir()
    mirror_parent = os.path.dirname(directory.local_path(source))  # .../src/sub
    top = os.path.join(directory.data_root, source.lstrip('/').split('/')[0])
    for planted in (mirror_parent, top):  # the deepest directory, the top one
        if os.path.lexists(top):
            shutil.rmtree(top)
        os.makedirs(os.path.dirname(planted), exist_ok=True)
        os.symlink(str(elsewhere), planted)
        with pytest.raises(LocalStorageError) as info:
            directory.stage(source)
        assert info.value.errno in (errno.ELOOP, errno.ENOTDIR)
        assert helpers.files_under(str(elsewhere)) == []
        assert os.listdir(str(elsewhere)) == []
        assert os.path.islink(planted)
        os.unlink(planted)
    assert os.listdir(directory.partial_root) == []


def test_symlink_at_the_final_name_is_replaced_not_followed(tmp_path):
    source = str(tmp_path / 'src' / 'file.bin')
    data = helpers.write_random_file(source, 4000, seed=1)
    victim = str(tmp_path / 'victim.bin')
    victim_data = helpers.write_random_file(victim, 4000, seed=2)
    # Same size and mtime as the source: following the link would make it
    # look like a valid copy.
    source_stat = os.stat(source)
    os.utime(victim, ns=(source_stat.st_atime_ns, source_stat.st_mtime_ns))
    directory = LocalDirectory(str(tmp_path / 'local'))
    local = directory.local_path(source)
    os.makedirs(os.path.dirname(local))
    os.symlink(victim, local)

    assert not directory.is_current(source, source_stat)
    assert directory.stage(source) == len(data)
    assert not os.path.islink(local)
    assert stat.S_ISREG(os.lstat(local).st_mode)
    assert helpers.read_bytes(local) == data
    assert helpers.read_bytes(victim) == victim_data


def test_symlinked_data_or_partial_root_is_refused(tmp_path):
    elsewhere = tmp_path / 'elsewhere'
    elsewhere.mkdir()
    for name in ('data', '.partial'):
        root = tmp_path / ('local_' + name.strip('.'))
        root.mkdir()
        os.symlink(str(elsewhere), str(root / name))
        with pytest.raises(LocalStorageError):
            LocalDirectory(str(root))
    assert os.listdir(str(elsewhere)) == []


# ---- creation, permissions, space ---------------------------------------------------

def test_new_root_and_its_directories_are_private(tmp_path):
    root = str(tmp_path / 'x' / 'y' / 'local')
    directory = LocalDirectory(root)
    source = str(tmp_path / 'src' / 'f.bin')
    helpers.write_random_file(source, 100)
    directory.stage(source)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(directory.data_root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(directory.partial_root).st_mode) == 0o700
    mirror = os.path.dirname(directory.local_path(source))
    while mirror != directory.data_root:
        assert stat.S_IMODE(os.stat(mirror).st_mode) == 0o700, mirror
        mirror = os.path.dirname(mirror)


def test_root_on_a_read_only_mount_is_refused(tmp_path):
    mount = tmp_path / 'ro'
    with helpers.tmpfs(mount, '1m', read_only=True) as mounted:
        if not mounted:
            pytest.skip('cannot mount tmpfs (not root?); root bypasses '
                        'permission bits so there is no other way')
        for root in (str(mount), str(mount / 'job' / 'local')):
            with pytest.raises(LocalStorageError) as info:
                LocalDirectory(root)
            assert info.value.errno == errno.EROFS
            assert root in str(info.value)


def test_existing_root_on_a_mount_turned_read_only_is_refused(tmp_path):
    mount = tmp_path / 'was_rw'
    with helpers.tmpfs(mount, '1m') as mounted:
        if not mounted:
            pytest.skip('cannot mount tmpfs')
        root = str(mount / 'local')
        LocalDirectory(root)  # data/ and .partial/ exist now
        helpers.remount_read_only(mount)
        with pytest.raises(LocalStorageError):
            LocalDirectory(root)


def test_root_under_a_regular_file_is_refused(tmp_path):
    blocker = tmp_path / 'file'
    blocker.write_bytes(b'x')
    for root in (str(blocker), str(blocker / 'local')):
        with pytest.raises(LocalStorageError):
            LocalDirectory(root)


def test_full_disk_leaves_no_final_file_and_no_part(tmp_path, monkeypatch):
    source = str(tmp_path / 'src' / 'big.bin')
    helpers.write_random_file(source, 3 * MB)
    small = helpers.write_random_file(str(tmp_path / 'src' / 'small.bin'), 1000)
    mount = tmp_path / 'small'
    with helpers.tmpfs(mount, '1m') as mounted:
        if not mounted:  # fallback: ENOSPC from local_directory's os.write only
            monkeypatch.setattr(local_directory, 'os', helpers.FullDiskOs(MB))
        directory = LocalDirectory(str(mount / 'local'))
        with pytest.raises(LocalStorageError) as info:
            directory.stage(source)
        assert info.value.errno == errno.ENOSPC
        assert not os.path.lexists(directory.local_path(source))
        assert os.listdir(directory.partial_root) == []
        # The space is given back: a small file still fits.
        small_source = str(tmp_path / 'src' / 'small.bin')
        assert directory.stage(small_source) == len(small)
        assert helpers.read_bytes(directory.local_path(small_source)) == small
