"""Tests of the storage emulator (testbed.storage): a real FUSE mount, no mocks."""
import argparse
import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from chainer_prefetch_bench.testbed import jpeg_dataset
from chainer_prefetch_bench.testbed import storage as shared_storage
from chainer_prefetch_bench.testbed.storage import daemon, mount, presets

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


def test_presets_keep_their_values_and_lustre_charges_metadata():
    Params = shared_storage.Params
    assert Params.from_preset('paper') == Params(
        open_latency_ms=18.0, read_latency_ms=5.0, bandwidth_mbps=100.0,
        metadata_latency_ms=0.0, cache_timeout_s=3600.0)
    assert Params.from_preset('mild') == Params(
        open_latency_ms=2.0, read_latency_ms=0.5, bandwidth_mbps=400.0,
        metadata_latency_ms=0.0, cache_timeout_s=3600.0)
    lustre = Params.from_preset('lustre')
    assert lustre == Params(
        metadata_latency_ms=5.0, open_latency_ms=9.0, read_latency_ms=5.0,
        bandwidth_mbps=100.0, cache_timeout_s=1.0)


def test_param_args_override_the_preset():
    parser = argparse.ArgumentParser()
    presets.add_param_args(parser)
    params = presets.params_from_args(parser.parse_args(
        ['--preset', 'paper', '--metadata-latency-ms', '3',
         '--cache-timeout-s', '0.5']))
    assert params == shared_storage.Params(
        open_latency_ms=18.0, read_latency_ms=5.0, bandwidth_mbps=100.0,
        metadata_latency_ms=3.0, cache_timeout_s=0.5)
    assert presets.params_from_args(parser.parse_args([])) == (
        shared_storage.Params())


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
def test_uncached_stat_reaches_daemon_and_pays_metadata_latency(
        source, mountpoint):
    path = os.path.join(mountpoint, 'train.txt')
    with shared_storage.mounted(source, mountpoint, metadata_latency_ms=50,
                                cache_timeout_s=0) as storage_mount:
        t0 = time.perf_counter()
        for _ in range(10):
            before = storage_mount.op_counts()
            os.stat(path)
            delta = shared_storage.counts_delta(before, storage_mount.op_counts())
            assert delta['getattr'] >= 1
        assert time.perf_counter() - t0 >= 0.4


@needs_fuse
def test_cached_stat_does_not_reach_daemon(source, mountpoint):
    path = os.path.join(mountpoint, _images(source)[0])
    with shared_storage.mounted(source, mountpoint) as storage_mount:
        before = storage_mount.op_counts()
        os.stat(path)
        first = storage_mount.op_counts()
        assert first['getattr'] > before['getattr']  # the lookups
        os.stat(path)
        assert storage_mount.op_counts() == first


@needs_fuse
def test_counts_open_and_bytes_read(source, mountpoint):
    rel = _images(source)[1]
    size = os.path.getsize(os.path.join(source, rel))
    with shared_storage.mounted(source, mountpoint) as storage_mount:
        assert set(storage_mount.op_counts()) == set(shared_storage.OP_NAMES)
        before = storage_mount.op_counts()
        assert len(_read(os.path.join(mountpoint, rel))) == size
        delta = shared_storage.counts_delta(before, storage_mount.op_counts())
        assert delta['open'] == 1
        assert delta['read_bytes'] == size
        assert delta['read'] >= 1
        counts_dir = os.path.dirname(storage_mount.counts_path)
        assert os.path.isdir(counts_dir)
    assert not os.path.exists(counts_dir)
    with pytest.raises(shared_storage.MountError):
        storage_mount.op_counts()


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
        assert 'cache timeout: 3600.0 s' in status.stdout
        assert 'operations served: getattr=' in status.stdout
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
