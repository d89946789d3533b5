"""What an emulated mount delivers to concurrent readers (files/s, MB/s)."""
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Sequence

from chainer_prefetch_bench.testbed.page_cache import drop_file_cache
from chainer_prefetch_bench.testbed.storage.mount import MountError, running_mount


def _read_whole(path: str) -> int:
    n = 0
    with open(path, 'rb', buffering=0) as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return n
            n += len(chunk)


def calibrate(mountpoint: str, readers: Sequence[int] = (1, 2, 4, 8, 16),
              files: int = 64) -> dict:
    """Measure what the mount delivers to concurrent readers.

    For each reader count, ``files`` distinct files (not read before in
    this calibration while enough exist) have their source pages dropped
    from the page cache and are then read whole by that many threads.

    Args:
        mountpoint: A mount started by :func:`start`.
        readers: Reader-thread counts to measure.
        files: Files read per reader count.

    Returns:
        A dict with ``params``, ``rows`` (readers, files, seconds, files_per_s,
        mb_per_s, daemon_cpu_s) and ``daemon_cpu_s`` for the whole run.
    """
    mount = running_mount(mountpoint)
    rels = sorted(
        os.path.relpath(os.path.join(folder, name), mount.mountpoint)
        for folder, _, names in os.walk(mount.mountpoint) for name in names)
    if not rels:
        raise MountError('no files under {}'.format(mountpoint))
    cpu_start = mount.cpu_seconds()
    rows = []
    next_file = 0
    for n_readers in readers:
        batch = [rels[(next_file + i) % len(rels)] for i in range(files)]
        next_file += files
        for rel in batch:
            drop_file_cache(os.path.join(mount.source, rel))
        cpu_before = mount.cpu_seconds()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n_readers) as pool:
            total = sum(pool.map(
                _read_whole,
                [os.path.join(mount.mountpoint, rel) for rel in batch]))
        seconds = time.perf_counter() - t0
        rows.append({'readers': n_readers, 'files': files,
                     'seconds': round(seconds, 4),
                     'files_per_s': round(files / seconds, 2),
                     'mb_per_s': round(total / seconds / 1e6, 3),
                     'daemon_cpu_s': round(mount.cpu_seconds() - cpu_before,
                                           3)})
    return {'params': asdict(mount.params), 'rows': rows,
            'files_available': len(rels),
            'daemon_cpu_s': round(mount.cpu_seconds() - cpu_start, 3)}


def print_calibration(result: dict) -> None:
    print('params: {}'.format(result['params']))
    print('{:>8} {:>6} {:>9} {:>9} {:>9} {:>12}'.format(
        'readers', 'files', 'seconds', 'files/s', 'MB/s', 'daemon CPU s'))
    for row in result['rows']:
        print('{readers:>8} {files:>6} {seconds:>9.3f} {files_per_s:>9.1f} '
              '{mb_per_s:>9.2f} {daemon_cpu_s:>12.3f}'.format(**row))
    print('daemon CPU seconds during calibration: {:.3f}'.format(
        result['daemon_cpu_s']))
    if result['files_available'] < len(result['rows']) * result['rows'][0][
            'files']:
        print('note: only {} files exist, so some were read more than once'
              .format(result['files_available']))

