"""What the benchmarks record of the machine: the balloon's free page reporting."""
import os

from chainer_prefetch_bench.testbed import machine

# A balloon's sysfs features as this project's virtual machines show them:
# stats, deflate on OOM, free page reporting and bit 7 (bits 1, 2, 5, 7),
# then bit 32 (VIRTIO_F_VERSION_1).
REPORTING = '0110010100000000000000000000000010' + '0' * 94 + '\n'


def test_the_reporting_bit_is_bit_five_from_the_left():
    assert machine.reports_free_pages(REPORTING)
    assert not machine.reports_free_pages('0110000100000000\n')
    assert not machine.reports_free_pages('01100\n')  # too short to have it
    assert not machine.reports_free_pages('')


def test_a_bound_balloon_that_reports_makes_the_machine_report(tmp_path):
    driver = tmp_path / 'virtio_balloon'
    pattern = str(driver / 'virtio*')
    assert not machine.free_page_reporting(pattern)  # no balloon at all
    for name, features in (('virtio0', '0110000000\n'), ('virtio3', REPORTING)):
        os.makedirs(str(driver / name))
        (driver / name / 'features').write_text(features)
    assert machine.free_page_reporting(pattern)
    (driver / 'virtio3' / 'features').write_text('0110000000\n')
    assert not machine.free_page_reporting(pattern)



def test_a_folders_file_system_is_the_one_the_mount_table_gives_it(tmp_path):
    from chainer_prefetch.staging import file_systems
    mounts = file_systems.read_mounts()
    assert machine.file_system_type(str(tmp_path)) == file_systems.mount_of(
        os.path.realpath(str(tmp_path)), mounts).fs_type
    # A folder not made yet is on the file system of the folder it goes in.
    assert machine.file_system_type(str(tmp_path / 'not' / 'yet')) == (
        machine.file_system_type(str(tmp_path)))
    with open('/proc/self/mounts') as mounts:  # read here without the library
        shm = [line.split()[2] for line in mounts if line.split()[1] == '/dev/shm']
    if shm:  # a tmpfs on Linux machines that have it
        assert machine.file_system_type('/dev/shm/not-made') == shm[-1]
