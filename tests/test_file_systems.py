"""Which file system a path is on, and how many threads read a row group from it.

The mount-table logic is tested on texts; the choice of threads on real
files: the node's disk, a tmpfs mounted here and the emulated shared storage
(a real FUSE mount).
"""
import os

import pyarrow.parquet
import pytest

import helpers
from chainer_prefetch.datasets import byte_ranges, row_group_source
from chainer_prefetch.staging import file_systems
from chainer_prefetch.staging.file_systems import Mount
from chainer_prefetch_bench.testbed import storage as shared_storage
from chainer_prefetch_bench.testbed.storage import mount as emulated_mount

MOUNTINFO = '\n'.join([
    '27 1 254:0 / / rw,relatime - ext4 /dev/vda rw',
    '25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=4k',
    '30 25 0:27 / /dev/shm rw,relatime shared:7 - fuse.emulated emu rw',
    '40 27 0:40 / /mnt/lustre rw master:3 shared:9 - lustre 10.0.0.1@o2ib:/fs rw',
    '41 27 0:41 / /mnt/lustre2 rw - xfs /dev/sdb rw',
    r'42 27 0:42 / /mnt/my\040data rw - nfs4 server:/data rw',
    '',
])


def test_the_mount_table_is_parsed_with_its_escapes_and_optional_fields():
    mounts = file_systems.parse_mountinfo(MOUNTINFO)
    assert mounts == [Mount('/', 'ext4'), Mount('/dev/shm', 'tmpfs'),
                      Mount('/dev/shm', 'fuse.emulated'),
                      Mount('/mnt/lustre', 'lustre'), Mount('/mnt/lustre2', 'xfs'),
                      Mount('/mnt/my data', 'nfs4')]


def test_a_line_that_is_not_a_mount_is_named():
    with pytest.raises(ValueError, match='line 2'):
        file_systems.parse_mountinfo('27 1 254:0 / / rw - ext4 /dev/vda rw\n'
                                     '27 1 254:0 / / rw ext4\n')


@pytest.mark.parametrize('path, point, fs_type', [
    ('/', '/', 'ext4'),
    ('/home/user/data.parquet', '/', 'ext4'),
    ('/mnt/lustre', '/mnt/lustre', 'lustre'),
    ('/mnt/lustre/imagenet/part-0.parquet', '/mnt/lustre', 'lustre'),
    ('/mnt/lustre2/part-0.parquet', '/mnt/lustre2', 'xfs'),
    ('/mnt/lustre_old/part-0.parquet', '/', 'ext4'),  # /mnt/lustre: no prefix
    ('/mnt/my data/part-0.parquet', '/mnt/my data', 'nfs4'),
    ('/dev/shm/x', '/dev/shm', 'fuse.emulated'),  # the last mounted of a stack
])
def test_a_path_is_on_the_deepest_mount_above_it(path, point, fs_type):
    mounts = file_systems.parse_mountinfo(MOUNTINFO)
    assert file_systems.mount_of(path, mounts) == Mount(point, fs_type)


def test_a_mount_made_later_over_a_point_above_hides_the_one_below():
    mounts = [Mount('/', 'ext4'), Mount('/mnt/data', 'nfs4'), Mount('/mnt', 'tmpfs')]
    assert file_systems.mount_of('/mnt/data/x', mounts) == Mount('/mnt', 'tmpfs')
    mounts = [Mount('/', 'ext4'), Mount('/mnt', 'tmpfs'), Mount('/mnt/data', 'nfs4')]
    assert file_systems.mount_of('/mnt/data/x', mounts) == Mount('/mnt/data', 'nfs4')
    assert file_systems.mount_of('/mnt/x', mounts) == Mount('/mnt', 'tmpfs')


def test_mount_points_are_decoded_as_paths_are(tmp_path):
    table = tmp_path / 'mountinfo'
    table.write_bytes(b'27 1 254:0 / / rw - ext4 /dev/vda rw\n'
                      b'40 27 0:40 / /mnt/caf\xe9 rw - lustre fs rw\n')
    mounts = file_systems.read_mounts(str(table))
    assert mounts[1] == Mount(os.fsdecode(b'/mnt/caf\xe9'), 'lustre')
    assert file_systems.mount_of(os.fsdecode(b'/mnt/caf\xe9/x'), mounts).fs_type == 'lustre'


def test_no_mount_table_means_no_mount():
    assert file_systems.mount_of('/data', []) == Mount('', '')
    assert file_systems.read_mounts('/nonexistent/mountinfo') == []


@pytest.mark.parametrize('fs_type, local', [
    ('ext4', True), ('xfs', True), ('tmpfs', True), ('overlay', True),
    ('btrfs', True), ('lustre', False), ('gpfs', False), ('nfs4', False),
    ('fuse.emulated', False), ('fuse', False), ('cifs', False), ('', False)])
def test_node_local_types(fs_type, local):
    assert file_systems.is_node_local(fs_type) is local


def _parquet_file(directory):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(str(directory), 'part-0.parquet')
    pyarrow.parquet.write_table(pyarrow.table({'id': list(range(100))}), path)
    return path


def _threads_of_a_read(path, monkeypatch):
    """The threads ``start_reading_column_chunks`` used for a real read of ``path``."""
    used = []
    real = byte_ranges.map_in_threads

    def recorded(function, items, max_threads, name):
        used.append((name, max_threads))
        return real(function, items, max_threads, name)

    monkeypatch.setattr(byte_ranges, 'map_in_threads', recorded)
    try:
        table = row_group_source.read_row_group(path, 0, ['id'])
    finally:
        monkeypatch.setattr(byte_ranges, 'map_in_threads', real)
    assert table.column('id').to_pylist() == list(range(100))
    return [threads for name, threads in used if name == 'read']


def _skip_unless_node_local(path):
    if not file_systems.on_node_local_storage(str(path), file_systems.read_mounts()):
        pytest.skip('{} is not on a node-local file system here'.format(path))


@pytest.fixture
def mount_table(monkeypatch):
    """Gives the dataset module a mount table of the test's own (the answers
    per directory forgotten before and after)."""
    def use(mounts):
        monkeypatch.setattr(byte_ranges, 'read_mounts', lambda: list(mounts))
        byte_ranges._directory_is_node_local.cache_clear()

    yield use
    byte_ranges._directory_is_node_local.cache_clear()


def test_the_threads_follow_the_mount_table(tmp_path, mount_table):
    shared, local = tmp_path / 'lustre', tmp_path / 'scratch'
    path = _parquet_file(shared)
    _parquet_file(local)
    link = local / 'linked.parquet'
    os.symlink(path, str(link))
    mount_table([Mount('/', 'ext4'), Mount(str(shared), 'lustre')])
    assert byte_ranges.read_threads_for(path) == byte_ranges.READ_THREADS
    # A link on local storage to a file on the shared one: the file counts.
    assert byte_ranges.read_threads_for(str(link)) == byte_ranges.READ_THREADS
    assert byte_ranges.read_threads_for(
        str(local / 'part-0.parquet')) == byte_ranges.LOCAL_READ_THREADS
    mount_table([])  # no table (no /proc): every file counts as shared
    assert byte_ranges.read_threads_for(
        str(local / 'part-0.parquet')) == byte_ranges.READ_THREADS


def test_this_machines_disk_is_read_with_the_local_threads(tmp_path, monkeypatch):
    _skip_unless_node_local(tmp_path)
    path = _parquet_file(tmp_path / 'disk')
    byte_ranges._directory_is_node_local.cache_clear()
    assert byte_ranges.read_threads_for(path) == byte_ranges.LOCAL_READ_THREADS
    assert _threads_of_a_read(path, monkeypatch) == [
        byte_ranges.LOCAL_READ_THREADS]


def test_a_tmpfs_mounted_here_is_node_local(tmp_path, monkeypatch):
    with helpers.tmpfs(tmp_path / 'ram', '16m') as mounted:
        if not mounted:
            pytest.skip('cannot mount tmpfs (not root?)')
        path = _parquet_file(tmp_path / 'ram')
        assert file_systems.mount_of(
            os.path.realpath(path), file_systems.read_mounts()) == Mount(
                str(tmp_path / 'ram'), 'tmpfs')
        assert _threads_of_a_read(path, monkeypatch) == [
            byte_ranges.LOCAL_READ_THREADS]


@pytest.mark.skipif(not os.path.exists('/dev/fuse'),
                    reason='/dev/fuse is missing: no FUSE mount possible')
def test_the_emulated_shared_storage_is_read_with_the_shared_threads(
        tmp_path, monkeypatch):
    source = tmp_path / 'source'
    _parquet_file(source)
    monkeypatch.setattr(emulated_mount, 'STATE_DIR', str(tmp_path / 'state'))
    mountpoint = str(tmp_path / 'mnt')
    with shared_storage.mounted(str(source), mountpoint):
        path = os.path.join(mountpoint, 'part-0.parquet')
        assert file_systems.mount_of(
            path, file_systems.read_mounts()).fs_type.startswith('fuse')
        assert not file_systems.on_node_local_storage(
            path, file_systems.read_mounts())
        assert _threads_of_a_read(path, monkeypatch) == [
            byte_ranges.READ_THREADS]
    assert not shared_storage.is_mounted(mountpoint)
