"""Tests of the storage emulator (testbed.storage): a real FUSE mount, no mocks."""
import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from chainer_prefetch_bench.testbed import jpeg_dataset
from chainer_prefetch_bench.testbed import storage as shared_storage
from chainer_prefetch_bench.testbed.storage import daemon, mount

needs_fuse = pytest.mark.skipif(
    not os.path.exists('/dev/fuse'),
    reason='/dev/fuse is missing: load the fuse kernel module (modprobe '
           'fuse) or pass the device into the container')


@pytest.fixture(scope='module')
def source(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('source'))
    jpeg_dataset.generate(root, n_images=20, n_classes=2, seed=3,
                          progress=False, workers=1)
    return root


@pytest.fixture
def mountpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(mount, 'STATE_DIR', str(tmp_path / 'state'))
    path = str(tmp_path / 'mnt')
    yield path
    shared_storage.stop(path)  # whatever the test did
    assert not shared_storage.is_mounted(path)


def _images(root):
    with open(os.path.join(root, 'train.txt')) as f:
        return [line.split()[0] for line in f]


def _read(path):
    with open(path, 'rb') as f:
        return f.read()


def test_token_bucket_limits_rate():
    bucket = daemon.TokenBucket(rate=1e6, burst=1e5)
    t0 = time.monotonic()
    for _ in range(5):
        bucket.consume(100000)  # 0.5 MB in total, 0.1 MB of it burst
    elapsed = time.monotonic() - t0
    assert 0.35 < elapsed < 5.0  # at least 0.4 MB at 1 MB/s after the burst


def test_presets_are_params():
    for name in shared_storage.PRESETS:
        params = shared_storage.Params.from_preset(name)
        assert params.open_latency_ms > 0 and params.bandwidth_mbps > 0
    with pytest.raises(ValueError):
        shared_storage.Params.from_preset('nope')


@needs_fuse
def test_fuse_usable_here():
    assert shared_storage.fuse_problem() is None


@needs_fuse
def test_same_bytes_and_read_only(source, mountpoint):
    with shared_storage.mounted(source, mountpoint) as mount:
        assert shared_storage.is_mounted(mountpoint)
        assert sorted(os.listdir(mountpoint)) == sorted(os.listdir(source))
        for rel in _images(source) + ['train.txt', 'mean.npy']:
            assert _read(os.path.join(mountpoint, rel)) == _read(
                os.path.join(source, rel))
        first = os.path.join(mountpoint, _images(source)[0])
        for action in (lambda: open(first, 'r+b'),
                       lambda: open(os.path.join(mountpoint, 'new'), 'wb'),
                       lambda: os.mkdir(os.path.join(mountpoint, 'dir')),
                       lambda: os.remove(first)):
            with pytest.raises(OSError) as info:
                action()
            assert info.value.errno == errno.EROFS
        assert mount.cpu_seconds() > 0
    assert not shared_storage.is_mounted(mountpoint)
    assert os.listdir(mountpoint) == []


@needs_fuse
def test_every_open_pays_latency(source, mountpoint):
    path = os.path.join(mountpoint, _images(source)[0])
    with shared_storage.mounted(source, mountpoint, open_latency_ms=60):
        for _ in range(3):  # again and again: no caching of opens
            t0 = time.perf_counter()
            with open(path, 'rb'):
                pass
            assert time.perf_counter() - t0 >= 0.058


@needs_fuse
def test_reread_pays_read_latency(source, mountpoint):
    path = os.path.join(mountpoint, _images(source)[0])
    with shared_storage.mounted(source, mountpoint, read_latency_ms=50):
        for _ in range(2):  # the page cache is dropped at each open
            t0 = time.perf_counter()
            _read(path)
            assert time.perf_counter() - t0 >= 0.048


@needs_fuse
def test_bandwidth_cap(source, mountpoint):
    rate = 2.0  # MB/s
    with shared_storage.mounted(source, mountpoint, bandwidth_mbps=rate):
        t0 = time.perf_counter()
        total = sum(len(_read(os.path.join(mountpoint, rel)))
                    for rel in _images(source)[:8])
        elapsed = time.perf_counter() - t0
    expected = (total - daemon.BURST_BYTES) / (rate * 1e6)
    assert expected > 0.2
    # The bucket makes every byte after the burst wait for its share of the
    # rate; the upper bound leaves a busy machine a second for the rest, and
    # still fails a cap several times lower than asked.
    assert 0.8 * expected < elapsed < 2 * expected + 1.0


@needs_fuse
def test_stale_mount_is_cleaned_by_next_start(source, mountpoint):
    first = shared_storage.start(source, mountpoint, shared_storage.Params())
    os.kill(first.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while mount._daemon_alive(first.pid, mountpoint):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert shared_storage.is_mounted(mountpoint)
    with pytest.raises(OSError) as info:
        os.listdir(mountpoint)
    assert info.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    second = shared_storage.start(source, mountpoint, shared_storage.Params())
    assert second.pid != first.pid
    assert sorted(os.listdir(mountpoint)) == sorted(os.listdir(source))
    assert shared_storage.stop(mountpoint)
    assert not shared_storage.is_mounted(mountpoint)


@needs_fuse
def test_start_refuses_a_live_mount(source, mountpoint):
    with shared_storage.mounted(source, mountpoint):
        with pytest.raises(shared_storage.MountError, match='already'):
            shared_storage.start(source, mountpoint, shared_storage.Params())
        assert shared_storage.is_mounted(mountpoint)


@needs_fuse
def test_command_line(source, tmp_path):
    env = dict(os.environ, SHARED_STORAGE_STATE_DIR=str(tmp_path / 'state'))
    mnt = str(tmp_path / 'cli_mnt')
    def run(*args):
        return subprocess.run([sys.executable, '-m',
                               'chainer_prefetch_bench.testbed.storage']
                              + list(args), env=env,
                              capture_output=True, text=True, timeout=60)

    try:
        started = run('start', source, mnt, '--preset', 'mild',
                      '--open-latency-ms', '5')
        assert started.returncode == 0, started.stderr
        assert shared_storage.is_mounted(mnt)
        status = run('status', mnt)
        assert status.returncode == 0
        assert 'open latency: 5.0 ms' in status.stdout
        assert 'daemon CPU seconds' in status.stdout
        json_path = str(tmp_path / 'cal.json')
        calibrated = run('calibrate', mnt, '--readers', '1,2', '--files', '4',
                         '--json', json_path)
        assert calibrated.returncode == 0, calibrated.stderr
        assert 'files/s' in calibrated.stdout and os.path.exists(json_path)
    finally:
        stopped = run('stop', mnt)
    assert stopped.returncode == 0
    assert not shared_storage.is_mounted(mnt)
    assert os.listdir(mnt) == []
    assert run('status', mnt).returncode == 1
