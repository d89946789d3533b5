"""The minibatch benchmark's limits and its later-epoch rates (real runs on a FUSE mount)."""
import contextlib
import io
import json
import os

import pytest

from chainer_prefetch_bench.minibatch import bench

needs_fuse = pytest.mark.skipif(
    not os.path.exists('/dev/fuse'),
    reason='/dev/fuse is missing: load the fuse kernel module (modprobe '
           'fuse) or pass the device into the container')


def test_later_rate_is_the_images_after_the_first_epoch_per_second():
    assert bench._later_rate(640, [2.0, 4.0]) == 320.0
    assert bench._later_rate(640, [2.0, 3.0, 6.0]) == 160.0
    assert bench._later_rate(0, [2.0, 2.0]) is None  # one epoch
    assert bench._later_rate(640, [2.0]) is None


def test_median_or_none_needs_every_run():
    assert bench._median_or_none([3.0, 1.0, 2.0]) == 2.0
    assert bench._median_or_none([3.0, None]) is None
    assert bench._median_or_none([]) is None


@pytest.mark.parametrize('count, epoch, n', [
    (64, 64, 2), (128, 64, 2), (200, 64, 3), (96, 64, 3), (30, 64, 4)])
def test_decode_shares_take_every_image_of_the_run_once(count, epoch, n):
    parts = bench.decode_shares(count, epoch, n)
    assert len(parts) == (2 if count > epoch else 1)
    assert all(len(part) == n for part in parts)
    taken = [index for part in parts for start, step, end in part
             for index in range(start, end, step)]
    assert sorted(taken) == list(range(count))
    first_epoch = [index for start, step, end in parts[0]
                   for index in range(start, end, step)]
    assert sorted(first_epoch) == list(range(min(count, epoch)))


@pytest.mark.parametrize('method', ['copy-limit', 'stage-limit'])
def test_copy_limits_copy_the_runs_files(tmp_path, method):
    source = tmp_path / 'source'
    names = ['a/{}.jpg'.format(i) for i in range(40)] + ['b/x.jpg']
    for i, name in enumerate(names):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(os.urandom(1000 + i))
    (tmp_path / 'train.txt').write_text(
        ''.join('{} 0\n'.format(name) for name in names))
    config = {'list_file': str(tmp_path / 'train.txt'),
              'remote_root': str(source), 'local_dir': str(tmp_path / 'local'),
              'n_copy_threads': 4, 'n_batches': 1, 'n_processes': 2,
              'repeat': 0, 'method': method}
    result = bench._copy_limit(config)
    copied = tmp_path / 'local' / method
    files = [path for path in copied.rglob('*') if path.is_file()
             and '.partial' not in path.parts and path.suffix == '.jpg']
    assert len(files) == 32  # one batch of 32
    for name in names[:32]:  # (stage-limit's: under the source's path)
        [copy] = [path for path in files
                  if str(path).endswith(os.sep + name)]
        assert copy.read_bytes() == (source / name).read_bytes()
    assert result['processes'] == 1 and result['threads_copy'] == 4
    assert result['images_per_s'] == pytest.approx(32 / result['total_s'])
    assert result['own_cpu_ms_per_batch'] == pytest.approx(
        1000 * result['own_cpu_s'])


def test_plain_copy_copies_every_byte(tmp_path):
    data = os.urandom(300_000)
    (tmp_path / 'source').write_bytes(data)
    bench.plain_copy(str(tmp_path / 'source'), str(tmp_path / 'target'))
    assert (tmp_path / 'target').read_bytes() == data
    with pytest.raises(FileNotFoundError):
        bench.plain_copy(str(tmp_path / 'missing'), str(tmp_path / 'other'))


def _row(**values):
    row = {'total_s': 10.0, 'first_batch_s': 0.1, 'cpu_s': 40.0,
           'own_cpu_ms_per_batch': 20.0, 'images_per_s': 100.0,
           'later_images_per_s': None, 'processes': 3, 'runs': 3}
    row.update(values)
    return row


def test_targets_show_the_bounds_without_a_verdict():
    summary = {
        ('baseline-local', 2, None): _row(own_cpu_ms_per_batch=20.0),
        ('proposed-cold', 2, 16): _row(own_cpu_ms_per_batch=30.0,
                                       cpu_s=38.0),
        ('proposed-warm', 2, 16): _row(own_cpu_ms_per_batch=8.0,
                                       images_per_s=80.0,
                                       later_images_per_s=90.0),
        ('copy-limit', None, None): _row(own_cpu_ms_per_batch=16.0),
        ('decode-limit', 2, None): _row(images_per_s=100.0,
                                        later_images_per_s=120.0),
    }
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.check_targets(summary, 16)
    printed = [line for line in out.getvalue().splitlines()
               if line.startswith('  2 processes: ')]

    def line(start):
        [found] = [text for text in printed
                   if text[len('  2 processes: '):].startswith(start)]
        return found.rstrip()

    bound = line('own CPU per batch, (proposed-warm + copy-limit)')
    assert bound.endswith('1.20')  # (8 + 16) / 20, no verdict
    assert line('CPU of all processes').endswith('0.95')
    assert line('after epoch 1: images/s of proposed-warm / decode limit'
                ).endswith('0.75')
    assert line('own CPU per batch, proposed-cold').endswith(
        '1.50  MISSED')


def test_targets_against_the_limits_need_no_baseline():
    summary = {
        ('prefetch-local', 8, None): _row(images_per_s=60.0, total_s=5.0,
                                          later_images_per_s=70.0),
        ('decode-limit', 8, None): _row(images_per_s=100.0,
                                        later_images_per_s=100.0),
        ('decode-copy-limit', 8, None): _row(images_per_s=80.0,
                                             later_images_per_s=70.0),
        ('copy-limit', None, None): _row(),
    }
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.check_targets(summary, 16)
    printed = [line.rstrip() for line in out.getvalue().splitlines()
               if 'processes:' in line]
    assert all(line.startswith('  8 processes: ') for line in printed)
    assert printed[0].endswith('0.60  MISSED')  # prefetch-local / decode limit
    assert any('after epoch 1' in line and 'decode-copy-limit' in line
               and line.endswith('1.00') for line in printed)
    assert not any('baseline-local' in line for line in printed)


def _run_with_counters(root_cpu_s, loaders_cpu_s, images=320):
    part = {'minor_faults': 640, 'runqueue_s': 0.032, 'timeslices': 32,
            'processes': 1, 'gone': 0}
    return {'method': 'prefetch-local', 'n_processes': 2,
            'n_copy_threads': None, 'total_s': 9.0, 'first_batch_s': 0.1,
            'cpu_s': 18.0, 'images_per_s': 100.0, 'later_images_per_s': 110.0,
            'processes': 3, 'later_counters': {
                'images': images, 'root': dict(part, cpu_s=root_cpu_s),
                'others': dict(part, cpu_s=loaders_cpu_s, processes=2)}}


def test_later_counters_are_summarized_per_image_and_printed():
    runs = [_run_with_counters(0.32, 1.6), _run_with_counters(0.64, 3.2),
            _run_with_counters(0.96, 4.8)]
    summary = bench.summarize(runs)
    later = summary[('prefetch-local', 2, None)]['later_per_image']
    assert later['root_cpu_ms'] == pytest.approx(2.0)  # 640 ms / 320 images
    assert later['loaders_cpu_ms'] == pytest.approx(10.0)
    assert later['faults'] == pytest.approx(4.0)  # both parts, 1280 / 320
    assert later['timeslices'] == pytest.approx(0.2)
    assert later['runqueue_ms'] == pytest.approx(0.2)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.print_later_counters(summary)
    [row] = [line for line in out.getvalue().splitlines()
             if line.startswith('prefetch-local')]
    assert row.split()[2:] == ['12.00', '10.00', '2.00', '4.0', '0.20',
                               '0.20']
    without = dict(runs[0], later_counters=None)  # one run without: no row
    assert bench.summarize([without] + runs[1:])[
        ('prefetch-local', 2, None)]['later_per_image'] is None
    ended = _run_with_counters(0.32, 1.6)  # a loader ended in between
    ended['later_counters']['others']['gone'] = 1
    assert bench.summarize([ended] + runs[1:])[
        ('prefetch-local', 2, None)]['later_per_image'] is None


@needs_fuse
def test_limits_run_on_a_real_mount_and_time_the_later_epochs(tmp_path):
    """copy-limit copies the run's files; decode-limit over two epochs times
    the second apart, as an iterator's run does."""
    out = tmp_path / 'runs.json'
    assert bench.main([
        '--workdir', str(tmp_path / 'work'), '--n-images', '64',
        '--batches', '4', '--processes', '1', '--preset', 'mild',
        '--methods', 'decode-limit,copy-limit,prefetch-local',
        '--out', str(out)]) == 0
    runs = {run['method']: run for run in json.loads(out.read_text())['runs']}
    copies = runs['copy-limit']
    assert copies['processes'] == 1 and copies['threads_copy'] == 16
    assert copies['later_images_per_s'] is None
    for method in ('decode-limit', 'prefetch-local'):
        run = runs[method]
        assert run['images_per_s'] == pytest.approx(128 / run['total_s'])
    # 2 batches (64 images) after the first epoch of 2 batches
    marks = runs['prefetch-local']['cumulative_s']
    assert runs['prefetch-local']['later_images_per_s'] == pytest.approx(
        64 / (marks[3] - marks[1]), rel=0.01)
    marks = runs['decode-limit']['cumulative_s']
    assert len(marks) == 2
    assert runs['decode-limit']['later_images_per_s'] == pytest.approx(
        64 / (marks[1] - marks[0]), rel=0.01)
    assert copies['later_counters'] is None
    for method in ('decode-limit', 'prefetch-local'):  # one loader process
        counters = runs[method]['later_counters']
        assert counters['images'] == 64
        assert counters['root']['processes'] == 1
        assert counters['others']['processes'] == 1
        assert counters['others']['cpu_s'] > 0  # it decoded 64 images
    assert not os.path.exists(tmp_path / 'work' / 'local')  # cleaned up
