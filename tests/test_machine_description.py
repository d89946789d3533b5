"""What the benchmarks record of the machine: the balloon's free page reporting."""
import os
import shutil
import subprocess

import pytest

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


def test_a_folders_file_system_is_the_one_findmnt_gives_it(tmp_path):
    findmnt = shutil.which('findmnt')  # util-linux: every Debian has it
    if findmnt is None:
        pytest.skip('findmnt is not installed')
    for folder in (str(tmp_path), '/', '/dev/shm'):
        if os.path.isdir(folder):
            expected = subprocess.run(
                [findmnt, '--noheadings', '--output', 'FSTYPE', '--target', folder],
                check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout
            # (mounts stacked on one point: one line each, the visible one last)
            assert machine.file_system_type(folder) == expected.split()[-1], folder
    # A folder not made yet is on the file system of the folder it goes in.
    assert machine.file_system_type(str(tmp_path / 'not' / 'yet')) == (
        machine.file_system_type(str(tmp_path)))
