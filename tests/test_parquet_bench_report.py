"""The Parquet benchmark's report: runs of ours at several windows stay apart."""
import json
import os
import subprocess
import sys

import pytest

import helpers
from chainer_prefetch.staging import file_systems
from chainer_prefetch_bench.parquet import (
    bench,
    cpu_per_batch,
    memory_breakdown,
    read_cost,
    run_history,
)
from chainer_prefetch_bench.testbed import machine, processes


def _run(method, window, rows_per_s, workers=2):
    return {'method': method, 'window': window, 'workers': workers,
            'rows': 100000, 'rows_per_s': rows_per_s, 'peak_rss_mb': 1.0,
            'peak_pss_mb': 1.0, 'peak_local_mb': 0.0, 'first_batch_s': 0.5,
            'row_groups_per_batch': 1.0, 'duplicates_in_batches': 0}


def test_medians_are_taken_per_window_and_compared_with_the_same_peer():
    runs = [_run('ours-local', 1, speed) for speed in (30.0, 50.0, 40.0)]
    runs += [_run('ours-local', 4, speed) for speed in (10.0, 20.0, 30.0)]
    runs += [_run('petastorm', None, speed) for speed in (20.0, 20.0, 20.0)]
    medians = {bench.label(run): run for run in bench.median_runs(runs)}
    assert sorted(medians) == ['ours-local w1', 'ours-local w4', 'petastorm']
    assert medians['ours-local w1']['rows_per_s'] == 40.0
    assert medians['ours-local w4']['rows_per_s'] == 20.0
    assert medians['ours-local w1']['repeats'] == 3
    table = bench.format_table(list(medians.values()))
    line_w1 = next(line for line in table.splitlines()
                   if line.startswith('ours-local w1'))
    assert '2.00x' in line_w1


def test_a_report_without_windows_reads_as_before():
    runs = [_run('petastorm', None, 20.0), _run('ours-local', None, 30.0)]
    del runs[1]['window']
    assert [bench.label(run) for run in bench.median_runs(runs)] == [
        'petastorm', 'ours-local']


def test_every_ours_method_runs_at_every_window_and_the_others_once():
    args = bench.parse_args(['--window', '1,4', '--methods',
                             'ours-local,petastorm,ours-shared'])
    assert bench._variants(args) == [
        ('ours-local', 1, 1, 'default', None), ('ours-local', 4, 1, 'default', None),
        ('petastorm', 4, 1, 'default', None), ('ours-shared', 1, 1, 'default', None),
        ('ours-shared', 4, 1, 'default', None)]


def test_ours_runs_at_every_prefetch_and_is_labelled_by_the_others():
    args = bench.parse_args(['--window', '1', '--prefetch', '1,4', '--methods',
                             'ours-memory,petastorm'])
    variants = bench._variants(args)
    assert variants == [('ours-memory', 1, 1, 'default', None),
                        ('ours-memory', 1, 4, 'default', None),
                        ('petastorm', 1, 1, 'default', None)]
    configs = [bench.run_config(method, 2, '/data', 10, '/local', [5],
                                window=window, prefetch=prefetch)
               for method, window, prefetch, _, _ in variants]
    assert [config['prefetch'] for config in configs] == [1, 4, 1]
    runs = [dict(_run(method, window, 30.0), prefetch=prefetch)
            for method, window, prefetch, _, _ in variants]
    runs[-1].update(window=None, prefetch=None)  # as _timed_run records Petastorm's
    runs.append(dict(runs[1], rows_per_s=50.0))
    medians = {bench.label(run): run for run in bench.median_runs(runs)}
    assert sorted(medians) == ['ours-memory w1', 'ours-memory w1 prefetch4',
                               'petastorm']
    assert medians['ours-memory w1 prefetch4']['rows_per_s'] == 40.0
    with pytest.raises(SystemExit):
        bench.parse_args(['--prefetch', '0'])


def test_every_method_runs_at_every_memory_setting_compared_within_it():
    args = bench.parse_args(['--window', '1', '--methods',
                             'ours-local,petastorm',
                             '--arrow-memory', 'default,retain'])
    assert bench._variants(args) == [
        ('ours-local', 1, 1, 'default', None), ('petastorm', 1, 1, 'default', None),
        ('ours-local', 1, 1, 'retain', None), ('petastorm', 1, 1, 'retain', None)]
    runs = [dict(_run('ours-local', 1, 30.0), arrow_memory='default'),
            dict(_run('petastorm', None, 20.0), arrow_memory='default'),
            dict(_run('ours-local', 1, 60.0), arrow_memory='retain'),
            dict(_run('petastorm', None, 40.0), arrow_memory='retain')]
    table = bench.format_table(bench.median_runs(runs))
    vs_peer = {' '.join(line.split()[:-10]): line.split()[-8]
               for line in table.splitlines()[1:5]}
    assert vs_peer == {'ours-local w1': '1.50x', 'petastorm': '-',
                       'ours-local w1 retain': '1.50x', 'petastorm retain': '-'}


def test_an_unknown_memory_setting_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(['--arrow-memory', 'default,keep'])
    assert 'unknown setting(s) keep' in capsys.readouterr().err


def test_every_method_runs_at_every_switch_interval_compared_within_it():
    args = bench.parse_args(['--window', '1', '--methods', 'ours-memory,petastorm',
                             '--switch-interval', 'default,0.0001'])
    assert bench._variants(args) == [
        ('ours-memory', 1, 1, 'default', None), ('petastorm', 1, 1, 'default', None),
        ('ours-memory', 1, 1, 'default', 0.0001),
        ('petastorm', 1, 1, 'default', 0.0001)]
    runs = [dict(_run('ours-memory', 1, 30.0), switch_interval=None),
            dict(_run('petastorm', None, 20.0), switch_interval=None),
            dict(_run('ours-memory', 1, 60.0), switch_interval=0.0001),
            # as read back from the interpreter by an older version
            dict(_run('petastorm', None, 24.0), switch_interval=9.999999999999999e-05)]
    table = bench.format_table(bench.median_runs(runs))
    vs_peer = {' '.join(line.split()[:-10]): line.split()[-8]
               for line in table.splitlines()[1:5]}
    assert vs_peer == {'ours-memory w1': '1.50x', 'petastorm': '-',
                       'ours-memory w1 switch0.1ms': '2.50x',
                       'petastorm switch0.1ms': '-'}
    assert 'sys.setswitchinterval(N / 1000)' in table


@pytest.mark.parametrize('value', ['0', '-0.001', 'fast', '1e-7', 'inf', 'nan'])
def test_a_switch_interval_that_is_not_a_positive_number_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(['--switch-interval', 'default,' + value])
    assert "--switch-interval: '{}' is neither".format(value) in capsys.readouterr().err


def test_quick_sets_defaults_that_the_options_given_override():
    quick = bench.parse_args(['--quick'])
    assert (quick.rows, quick.workers, quick.growth, quick.repeats) == (
        8000, [1, 2], [3], 1)
    args = bench.parse_args(['--quick', '--workers', '1', '--growth', '0',
                             '--coverage-epochs', '0', '--rows', '4000'])
    assert (args.rows, args.workers, args.growth, args.coverage_epochs,
            args.batches) == (4000, [1], [], 0, 20)


def test_the_benchmark_runs_each_method_at_each_switch_interval(tmp_path):
    out = tmp_path / 'out'
    assert bench.main([
        '--quick', '--workdir', str(tmp_path / 'work'), '--rows', '2000',
        '--files', '2', '--methods', 'arrow-threads', '--workers', '1',
        '--growth', '0', '--coverage-epochs', '0', '--batches', '3',
        '--switch-interval', 'default,0.0003', '--out', str(out)]) == 0
    report = json.loads((out / 'bench.json').read_text())
    assert [(run['method'], run['switch_interval'], run['rows'])
            for run in report['runs']] == [('arrow-threads', None, 300),
                                           ('arrow-threads', 0.0003, 300)]
    table = (out / 'table.txt').read_text()
    assert 'arrow-threads switch0.3ms' in table


def test_a_run_has_its_switch_interval_while_it_lasts(tmp_path):
    from chainer_prefetch_bench.testbed import parquet_dataset
    directory = str(tmp_path / 'shop')
    parquet_dataset.generate(directory, 250, 3, 40, image_size=8)
    before = sys.getswitchinterval()
    results = [bench.run_one(bench.run_config(
        'arrow-threads', 1, directory, 2, str(tmp_path / 'local'),
        bench.row_group_sizes(directory), switch_interval=interval))
        for interval in (0.0002, None)]
    assert [result['rows'] for result in results] == [200, 200]
    assert results[0]['switch_interval'] == 0.0002
    assert results[1]['switch_interval'] is None
    assert sys.getswitchinterval() == before
    assert bench.label(results[0]) == 'arrow-threads switch0.2ms'


def test_ours_runs_report_the_rate_they_read_the_parquet_files_at(tmp_path):
    from chainer_prefetch_bench.testbed import parquet_dataset
    directory = str(tmp_path / 'shop')
    parquet_dataset.generate(directory, 250, 3, 40, image_size=8)
    ours, arrow = [bench.run_one(bench.run_config(
        method, 1, directory, 2, str(tmp_path / 'local'),
        bench.row_group_sizes(directory))) for method in ('ours-threads', 'arrow-threads')]
    copied = ours['staging']['bytes_copied']
    assert copied > 0
    # bytes copied from the Parquet files over the run's seconds, in MB/s
    # (the seconds rounded to the millisecond in the result).
    assert ours['source_mb_per_s'] == pytest.approx(
        copied / ours['seconds'] / 1e6, rel=0.05, abs=0.01)
    assert arrow['source_mb_per_s'] is None  # no staging counters


def test_a_run_gets_the_environment_of_its_memory_setting(tmp_path):
    (tmp_path / 'print_environment.py').write_text(
        'import os, sys\n'
        'from chainer_prefetch_bench.testbed.processes import answer_child\n'
        'answer_child(sys.argv[1:], lambda config: {\n'
        '    name: os.environ.get(name) for name in config["names"]})\n')
    names = sorted(bench.ARROW_MEMORY['retain'])
    result = processes.run_in_child(
        'print_environment', {'names': names}, 60,
        environment=dict(bench.ARROW_MEMORY['retain'],
                         PYTHONPATH=str(tmp_path)))
    assert result == bench.ARROW_MEMORY['retain']
    assert processes.run_in_child(
        'print_environment', {'names': names}, 60,
        environment=dict(bench.ARROW_MEMORY['default'],
                         PYTHONPATH=str(tmp_path))) == {
            name: os.environ.get(name) for name in names}


def test_the_cpu_column_shows_the_median_and_a_dash_for_runs_without_it():
    runs = [dict(_run('petastorm', None, 20.0), cpu_s=cpu)
            for cpu in (4.0, 6.0, 5.0)]
    old = _run('ours-local', 1, 30.0)  # a bench.json from before cpu_s
    table = bench.format_table(bench.median_runs(runs + [old]))
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:3]}
    assert rows['petastorm'][4] == '5.0'
    assert rows['ours-local'][5] == '-'


def test_cpu_seconds_count_a_child_that_ended():
    before = bench._cpu_seconds()
    child = subprocess.run(
        [sys.executable, '-c', 'import time\nsum(range(5_000_000))\n'
         'print(time.process_time())'],
        check=True, capture_output=True, text=True)
    assert bench._cpu_seconds() - before >= float(child.stdout)


def test_later_epochs_are_timed_from_the_first_epochs_end():
    # 1,000 rows per epoch; 2,500 read in 10 s, the first epoch ended at 4 s.
    assert bench._later_epochs_rows_per_s(2500, 10.0, 1000, [4.0, 8.0]) == 250.0
    assert bench._later_epochs_rows_per_s(900, 10.0, 1000, []) is None
    assert bench._later_epochs_rows_per_s(1000, 10.0, 1000, [10.0]) is None
    runs = [dict(_run('ours-local', 1, 10.0), later_epochs_rows_per_s=60.0),
            dict(_run('petastorm', None, 10.0), later_epochs_rows_per_s=20.0),
            dict(_run('petastorm', None, 10.0), later_epochs_rows_per_s=None)]
    medians = bench.median_runs(runs)
    table = bench.format_later_epochs(medians)
    line = next(line for line in table.splitlines()
                if line.startswith('ours-local w1'))
    assert line.split()[-1] == '3.00x'  # the run without it is left out


def test_runs_of_an_older_version_without_a_field_do_not_pull_its_median():
    runs = [dict(_run('petastorm', None, 20.0), cpu_s=cpu) for cpu in (4.0, 6.0)]
    runs.append(_run('petastorm', None, 20.0))  # no cpu_s
    assert bench.median_runs(runs)[0]['cpu_s'] == 5.0


def test_the_storage_bound_is_bandwidth_over_bytes_per_row_and_each_shared_run_its_share(
        tmp_path):
    import pyarrow
    import pyarrow.parquet
    table = pyarrow.table({'id': list(range(1000)),
                           'blob': [bytes([k % 251]) * 500 for k in range(1000)]})
    pyarrow.parquet.write_table(table, str(tmp_path / 'part-0.parquet'),
                                row_group_size=250, compression='none')
    per_row = bench._source_bytes_per_row(str(tmp_path), ['blob'])
    assert 500 <= per_row < 520  # each value and its length, little else
    assert bench._source_bytes_per_row(str(tmp_path), ['id']) < 20
    assert bench.storage_bound(500.0, 100) == 200000.0
    assert bench.storage_bound(500.0, 0) is None
    runs = [dict(_run('ours-shared', 1, 150000.0), source_mb_per_s=mb_per_s)
            for mb_per_s in (80.0, 90.0, 95.0)]
    runs += [_run('petastorm-shared', None, 50000.0), _run('ours-local', 1, 300000.0)]
    text = bench.format_storage_bound({
        'storage_bound_rows_per_s': 200000.0, 'storage_bandwidth_mbps': 100,
        'source_bytes_per_row': 500.0, 'medians': bench.median_runs(runs)})
    assert '200,000 rows/s' in text
    shares = {line.split()[0]: line.split(' of the bound')[0].split()[-1]
              for line in text.splitlines()[1:]}
    assert shares == {'ours-shared': '75%', 'petastorm-shared': '25%'}
    # Ours' median bytes read from the mount, as a share of its bandwidth.
    assert text.splitlines()[1].endswith("of the bound; read 90.0 MB/s, 90% of the mount's")
    assert text.splitlines()[2].endswith('25% of the bound')
    assert 'no storage bound' in bench.format_storage_bound(
        {'storage_bound_rows_per_s': None, 'medians': []})


def test_the_in_process_reference_loader_reads_every_row_once_per_epoch(tmp_path):
    import numpy

    from chainer_prefetch_bench.testbed import parquet_dataset
    directory = str(tmp_path / 'shop')
    parquet_dataset.generate(directory, 250, 3, 40, image_size=8)  # 9 row groups
    config = {'workers': 2, 'source': directory, 'seed': 3}
    batches = bench._arrow_threads_batches(config, ['id', 'title', 'image'])
    try:
        ids = [numpy.asarray(next(batches)) for _ in range(5)]  # two epochs
    finally:
        batches.close()
    assert [len(batch) for batch in ids] == [100] * 5
    ids = numpy.concatenate(ids)
    assert sorted(ids[:250]) == sorted(ids[250:]) == list(range(250))
    assert list(ids[:250]) != list(ids[250:])  # a new order each epoch


def test_growth_factors_are_parsed_and_the_longest_runs_are_drawn(tmp_path):
    assert bench.parse_args(['--growth', '10,30']).growth == [10, 30]
    assert bench.parse_args(['--growth', '0']).growth == []
    runs = [dict(_run('ours-memory', 1, 30.0), rows=rows,
                 memory_trace=[[0.2, 100.0], [0.4, 120.0]],
                 local_trace=[[0.2, 0.0], [0.4, 0.0]])
            for rows in (100000, 1000000)]
    path = str(tmp_path / 'memory_growth.png')
    bench.plot_growth({'growth_runs': runs, 'local_dir_in_memory': True}, path)
    assert os.path.getsize(path) > 0


def _tiny_dataset(tmp_path) -> list:
    """Options of a generated dataset of 600 rows in 2 files (a few row groups)."""
    return ['--workdir', str(tmp_path), '--rows', '600', '--files', '2',
            '--row-group-mb', '0.5', '--image-size', '16']


@pytest.mark.timeout(300)
def test_the_read_cost_runs_both_ways_on_the_same_row_groups(tmp_path):
    out = tmp_path / 'out'
    assert read_cost.main(_tiny_dataset(tmp_path) + [
        '--row-groups', '2', '--repeats', '2', '--out', str(out)]) == 0
    runs = json.loads((out / 'read_cost.json').read_text())['runs']
    # Every other repeat runs backwards.
    assert [run['way'] for run in runs] == ['read', 'populate', 'populate', 'read']
    assert {run['row_groups'] for run in runs} == {2}
    table = (out / 'table.txt').read_text()
    assert 'medians of 2 runs' in table and 'ratio' in table


def test_the_read_cost_table_gives_medians_and_ratios():
    runs = [{'way': way, 'seconds': seconds, 'user_s': 1.0, 'kernel_s': kernel}
            for way, seconds, kernel in (('read', 2.0, 0.8), ('populate', 1.0, 0.2),
                                         ('read', 4.0, 0.4), ('populate', 1.5, 0.1),
                                         ('read', 3.0, 0.6), ('populate', 9.0, 0.3))]
    lines = read_cost.format_table(runs).splitlines()
    # (runs of an earlier version have no read_s: 0)
    assert lines[1].split() == ['read', '3.000', '0.000', '1.000', '0.600']
    assert lines[2].split() == ['populate', '1.500', '0.000', '1.000', '0.200']
    assert lines[3].split() == ['ratio', '0.50x', '0.00x', '1.00x', '0.33x']


@pytest.mark.timeout(300)
def test_the_memory_breakdown_runs_both_ways_at_both_lengths(tmp_path):
    out = tmp_path / 'out'
    assert memory_breakdown.main(_tiny_dataset(tmp_path) + [
        '--batches', '2', '--growth', '3', '--workers', '2',
        '--repeats', '1', '--out', str(out)]) == 0
    runs = json.loads((out / 'memory_breakdown.json').read_text())['runs']
    assert [(run['way'], run['rows']) for run in runs] == [
        ('keep', 200), ('trim', 200), ('keep', 600), ('trim', 600)]
    for run in runs:
        # (trimmed after every sample but the one after finalize)
        assert run['trims'] == (run['samples'] if run['way'] == 'trim' else 0)
        at_peak = run['at_peak']
        assert at_peak['anon'] + at_peak['file'] <= at_peak['pss'] + 1
        assert 0 < run['peak_heap_used_mb'] <= run['peak_heap_mb']
        assert run['minor_faults'] > 0
    lines = (out / 'table.txt').read_text().splitlines()
    assert [line.split()[:2] for line in lines[3:]] == [
        ['keep', '200'], ['trim', '200'], ['ratio', '200'],
        ['keep', '600'], ['trim', '600'], ['ratio', '600']]


class _FakeLibc:
    def __init__(self):
        self.trims = 0

    def malloc_trim(self, pad):
        self.trims += 1


def test_the_sampler_trims_after_every_sample_while_the_run_lasts(monkeypatch):
    monkeypatch.setattr(memory_breakdown, 'SAMPLE_SECONDS', 0.01)
    monkeypatch.setattr(memory_breakdown, 'sample', lambda libc, pool: {'pss': 1.0})
    libc = _FakeLibc()
    with memory_breakdown.Sampler(libc, None, trim=True) as sampler:
        assert helpers.wait_until(lambda: len(sampler.samples) > 3, 30)
    sampler.observe(may_trim=False)
    assert len(sampler.samples) > 3
    assert sampler.trims == libc.trims == len(sampler.samples) - 1
    never = memory_breakdown.Sampler(libc, None)
    never.observe()
    assert never.trims == 0 and libc.trims == sampler.trims


def test_the_run_peaks_leave_out_the_sample_after_finalize(monkeypatch):
    from chainer_prefetch_bench.parquet import bench as bench_module
    monkeypatch.setattr(memory_breakdown, 'SAMPLE_SECONDS', 0.01)
    taken = []

    def growing(libc, pool):  # every sample larger than the one before
        taken.append(1)
        return dict.fromkeys(('pss', 'anon', 'file', 'heap', 'heap_used',
                              'heap_free', 'pool'), float(len(taken)))

    monkeypatch.setattr(memory_breakdown, 'sample', growing)

    def run(config):  # lasts several samples
        assert helpers.wait_until(lambda: len(taken) > 3, 30)
        return {'rows': 100, 'rows_per_s': 1.0, 'cpu_s': 0.1}

    monkeypatch.setattr(bench_module, 'run_one', run)
    result = memory_breakdown.run_one({'way': 'keep', 'run': {}})
    assert result['samples'] > 2 and result['samples'] + 1 == len(taken)
    assert result['after_finalize']['pss'] == len(taken)
    for peak in ('peak_pss_mb', 'peak_heap_used_mb', 'peak_heap_free_mb', 'peak_pool_mb'):
        assert result[peak] == len(taken) - 1, peak


def test_an_error_of_the_sampling_thread_reaches_the_run(monkeypatch):
    monkeypatch.setattr(memory_breakdown, 'SAMPLE_SECONDS', 0.01)
    calls = []

    def failing(libc, pool):
        calls.append(1)
        if len(calls) > 1:
            raise OSError('smaps_rollup unreadable')
        return {'heap_free': 0.0}

    monkeypatch.setattr(memory_breakdown, 'sample', failing)
    with pytest.raises(RuntimeError, match='sampling the memory failed') as caught:
        with memory_breakdown.Sampler(_FakeLibc(), None):
            assert helpers.wait_until(lambda: len(calls) > 1, 30)
    assert isinstance(caught.value.__cause__, OSError)


def test_the_memory_breakdown_table_gives_medians_and_ratios():
    def run(way, rows, rows_per_s, anon):
        return {'way': way, 'rows': rows, 'rows_per_s': rows_per_s,
                'peak_pss_mb': anon + 100.0,
                'at_peak': {'anon': anon, 'file': 100.0},
                'peak_heap_mb': 0.0, 'peak_heap_used_mb': 0.0,
                'peak_heap_free_mb': 0.0, 'peak_pool_mb': 0.0,
                'kernel_s': 0.5, 'minor_faults': 2000,
                'trim_s': 0.25 if way == 'trim' else 0.0}
    runs = [run('keep', 10, speed, 500.0) for speed in (100.0, 300.0, 200.0)]
    runs += [run('trim', 10, speed, 250.0) for speed in (50.0, 150.0, 100.0)]
    runs += [run('keep', 100, 400.0, 900.0), run('trim', 100, 100.0, 300.0)]
    lines = memory_breakdown.format_table(runs).splitlines()
    assert 'medians of 3 runs' in lines[0]
    assert lines[1].split()[:5] == ['keep', '10', '200', '600', '500']
    assert lines[1].split()[9:] == ['0.50', '2', '0.00']  # kernel s, faults k, trim s
    assert lines[3].split()[:6] == ['ratio', '10', '0.50x', '0.58x', '0.50x', '1.00x']
    assert lines[6].split()[:5] == ['ratio', '100', '0.25x', '0.40x', '0.33x']
    assert lines[6].split()[-1] == '-'  # no time trimming kept: no ratio


def _skip_unless_node_local(path):
    if not file_systems.on_node_local_storage(str(path), file_systems.read_mounts()):
        pytest.skip('{} is not on a node-local file system here'.format(path))


def test_the_read_cost_compares_the_threads_reading_local_files(tmp_path, capsys):
    _skip_unless_node_local(tmp_path)
    out = tmp_path / 'out'
    assert read_cost.main(_tiny_dataset(tmp_path) + [
        '--row-groups', '2', '--repeats', '1', '--local-read-threads', '1,3',
        '--out', str(out)]) == 0
    runs = json.loads((out / 'read_cost.json').read_text())['runs']
    assert [(run['way'], run['local_read_threads'], run['read_threads'])
            for run in runs] == [('read', 1, 1), ('populate', 1, 1),
                                 ('read', 3, 3), ('populate', 3, 3)]
    assert all(0 < run['read_s'] <= run['seconds'] for run in runs)
    lines = (out / 'table.txt').read_text().splitlines()
    names = [' '.join(line.split()[:-4]) for line in lines[3:]]
    assert names == ['read 1 threads', 'populate 1 threads', 'ratio 1 threads',
                     'read 3 threads', 'populate 3 threads', 'ratio 3 threads']


@pytest.mark.timeout(300)
def test_the_cpu_per_batch_clocks_the_calls_of_each_method(tmp_path):
    import statistics
    out = tmp_path / 'out'
    assert cpu_per_batch.main(_tiny_dataset(tmp_path) + [
        '--batches', '3', '--workers', '1', '--repeats', '2', '--local-dir',
        str(tmp_path / 'local'), '--out', str(out)]) == 0
    runs = json.loads((out / 'cpu_per_batch.json').read_text())['runs']
    # Every other repeat runs backwards.
    assert [run['method'] for run in runs] == ['ours-memory', 'arrow-threads',
                                               'arrow-threads', 'ours-memory']
    ours_runs = [run for run in runs if run['method'] == 'ours-memory']
    reference_runs = [run for run in runs if run['method'] == 'arrow-threads']
    for ours in ours_runs:
        # Ours cuts each batch on a loader thread (get_columns, which takes
        # the rows), and steps its scheduler several times a batch.
        assert ours['calls']['load_columns_with'] >= 3
        assert ours['calls']['take'] >= ours['calls']['load_columns_with']
        assert ours['calls']['scheduler'] >= 2 * 3
        assert ours['calls']['memory_form'] >= 1  # a row group staged
        assert 0 < ours['take_us'] <= ours['cut_us']
        assert ours['scheduler_us'] > 0 and ours['pipeline_us'] > 0
    for reference in reference_runs:  # takes on the training thread, nothing else
        assert set(reference['calls']) == {'take'}
        assert reference['calls']['take'] >= 3
        assert reference['cut_us'] == reference['take_us'] > 0
        assert reference['scheduler_us'] == reference['pipeline_us'] == 0
    for run in runs:  # the process's CPU over the 3 batches
        assert run['cpu_us'] == pytest.approx(1e6 * run['cpu_s'] / 3, abs=0.1)
        # The first batch, the stalls and the other 2 - stalls gaps between
        # the 3 batches make up the run's seconds.
        assert run['first_batch_s'] > 0 and run['pace_ms'] >= 0
        assert 0 <= run['stalls'] <= 2
        assert (run['first_batch_s'] + run['stalled_s']
                + (2 - run['stalls']) * run['pace_ms'] / 1e3
                == pytest.approx(run['seconds'], abs=0.02))
    assert all(ours['decode_s'] > 0 for ours in ours_runs)
    assert all(reference['decode_s'] == 0 for reference in reference_runs)
    lines = (out / 'table.txt').read_text().splitlines()
    assert 'medians of 2 runs' in lines[2]
    for line, mine in ((lines[3], ours_runs), (lines[4], reference_runs)):
        cells = line.split()
        assert cells[:2] == [mine[0]['method'], '1']
        assert cells[2:] == [form.format(statistics.median(
            run[field] for run in mine)) for field, _, form in cpu_per_batch.COLUMNS]


def test_the_timeline_counts_stalls_and_the_pace_between_them():
    # Start at 10 s; batches at 10.5, 10.51, 10.52, a stall of 0.3 s to
    # 10.82, then 10.84.
    timeline = cpu_per_batch.timeline_of([10.0, 10.5, 10.51, 10.52, 10.82, 10.84])
    assert timeline['first_batch_s'] == pytest.approx(0.5)
    assert timeline['stalls'] == 1
    assert timeline['stalled_s'] == pytest.approx(0.3)
    assert timeline['pace_ms'] == pytest.approx((10 + 10 + 20) / 3, abs=1e-3)
    alone = cpu_per_batch.timeline_of([1.0, 1.25])
    assert (alone['first_batch_s'], alone['stalls'], alone['pace_ms']) == (0.25, 0, 0)
    stalled = cpu_per_batch.timeline_of([0.0, 0.1, 0.2])
    assert (stalled['stalls'], stalled['pace_ms']) == (1, 0)


def _cpu_per_batch_side_by_side(tmp_path, *option) -> tuple:
    """``ours-memory`` at 1 worker, once each way of ``option``: the runs and the table's lines."""
    out = tmp_path / 'out'
    assert cpu_per_batch.main(_tiny_dataset(tmp_path) + [
        '--batches', '3', '--workers', '1', '--repeats', '1', '--methods', 'ours-memory',
        *option, '--local-dir', str(tmp_path / 'local'), '--out', str(out)]) == 0
    return (json.loads((out / 'cpu_per_batch.json').read_text())['runs'],
            (out / 'table.txt').read_text().splitlines())


def test_the_cpu_per_batch_compares_the_compiled_take_with_pythons(tmp_path, capsys):
    runs, lines = _cpu_per_batch_side_by_side(tmp_path, '--take-rows', 'compiled,python')
    # Each run's child process took rows as asked.
    assert [(run['take_rows'], run['take_rows_function']) for run in runs] == [
        ('compiled', 'take_rows'), ('python', 'take_rows_python')]
    assert all(run['calls']['take'] >= 3 for run in runs)
    assert lines[3].split()[:2] == ['ours-memory', '1']
    assert lines[4].split()[:4] == ['ours-memory', 'python', 'take', '1']
    ratio = runs[0]['rows_per_s'] / runs[1]['rows_per_s']
    assert lines[5] == ('ours-memory at 1 workers: {:.2f}x the rows/s of ours-memory '
                        'python take'.format(ratio))
    with pytest.raises(SystemExit):
        cpu_per_batch.main(['--take-rows', 'compiled,c'])
    assert "--take-rows: a list of compiled, python, got 'compiled,c'" in (
        capsys.readouterr().err)


def test_the_cpu_per_batch_compares_the_threads_reading_local_files(tmp_path, capsys):
    _skip_unless_node_local(tmp_path)
    runs, lines = _cpu_per_batch_side_by_side(tmp_path, '--local-read-threads', '2,8')
    # The dataset is on this machine's disk: each child read it with the
    # threads asked for.
    assert [(run['local_read_threads'], run['read_threads']) for run in runs] == [
        (2, 2), (8, 8)]
    assert lines[3].split()[:5] == ['ours-memory', '2', 'read', 'threads', '1']
    assert lines[4].split()[:5] == ['ours-memory', '8', 'read', 'threads', '1']
    ratio = runs[0]['rows_per_s'] / runs[1]['rows_per_s']
    assert lines[5] == ('ours-memory 2 read threads at 1 workers: {:.2f}x the rows/s '
                        'of ours-memory 8 read threads'.format(ratio))
    for bad in ('0,2', 'two'):
        with pytest.raises(SystemExit):
            cpu_per_batch.main(['--local-read-threads', bad])
        assert 'argument --local-read-threads: a list of positive counts, got {!r}'.format(
            bad) in capsys.readouterr().err


def test_the_cpu_per_batch_refuses_methods_with_loader_processes(capsys):
    with pytest.raises(SystemExit):
        cpu_per_batch.main(['--methods', 'ours-memory,ours-local'])
    assert 'ours-local cannot be clocked' in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_the_run_history_times_a_method_after_others_and_after_itself(tmp_path, capsys):
    out = tmp_path / 'out'
    assert run_history.main(_tiny_dataset(tmp_path) + [
        '--batches', '3', '--repeats', '2', '--before', 'ours-threads',
        '--local-dir', str(tmp_path / 'local'), '--out', str(out)]) == 0
    runs = json.loads((out / 'run_history.json').read_text())['runs']
    assert [(run['position'], run['method']) for run in runs] == [
        ('before', 'ours-threads'), ('after', 'ours-memory'),
        ('again', 'ours-memory')] * 2
    assert all(run['rows'] == 300 and run['peak_pss_mb'] > 0 for run in runs)
    lines = (out / 'table.txt').read_text().splitlines()
    assert lines[3].split()[:3] == ['ours-memory', 'after', 'ours-threads']
    assert lines[4].split()[:3] == ['ours-memory', 'after', 'itself']
    after = sorted(run['rows_per_s'] for run in runs if run['position'] == 'after')
    again = sorted(run['rows_per_s'] for run in runs if run['position'] == 'again')
    assert lines[5] == 'after ours-threads / after itself: {:.2f}x'.format(
        (after[0] + after[1]) / (again[0] + again[1]))
    assert json.loads((out / 'run_history.json').read_text())['machine'][
        'free_page_reporting'] in (True, False)
    for bad in ('petastorm', 'ours-memory-shared'):
        with pytest.raises(SystemExit):
            run_history.main(['--before', bad])
        assert 'not a method on local files in this environment: {}'.format(
            bad) in capsys.readouterr().err


def test_the_run_history_compares_the_local_directories_runs_before_staged_into(
        tmp_path, capsys, monkeypatch):
    out = tmp_path / 'out'
    first, second = str(tmp_path / 'first'), str(tmp_path / 'second')
    measured = []  # (method, the configuration's local directory, measure's)
    measure = bench.measure

    def recording_measure(config, dataset_dir, local_dir, timeout, **kwargs):
        measured.append((config['method'], config['local_dir'], local_dir))
        return measure(config, dataset_dir, local_dir, timeout, **kwargs)

    monkeypatch.setattr(bench, 'measure', recording_measure)
    assert run_history.main(_tiny_dataset(tmp_path) + [
        '--batches', '3', '--repeats', '2', '--before', 'ours-threads',
        '--before-local-dirs', '{},{}'.format(first, second),
        '--out', str(out)]) == 0
    # Every other repeat starts with the other directory; each run has its
    # directory.
    order = [first, second, second, first]
    assert measured == [(method, directory, directory) for directory in order
                        for method in ('ours-threads', 'ours-memory')]
    runs = json.loads((out / 'run_history.json').read_text())['runs']
    expected = []
    for directory in order:
        expected += [('before', 'ours-threads', directory),
                     ('after ' + directory, 'ours-memory', directory)]
    assert [(run['position'], run['method'], run['local_dir'])
            for run in runs] == expected
    assert all(run['rows'] == 300 for run in runs)
    kind = machine.file_system_type(first)
    assert json.loads((out / 'run_history.json').read_text())['file_systems'] == {
        first: kind, second: kind}
    lines = (out / 'table.txt').read_text().splitlines()
    assert lines[3].split()[:6] == ['ours-memory', 'after', 'ours-threads', 'staged',
                                    'into', first]
    assert lines[3].split()[6] == lines[4].split()[6] == '({})'.format(kind)
    assert lines[4].split()[5] == second

    def median(directory):
        values = sorted(run['rows_per_s'] for run in runs
                        if run['position'] == 'after ' + directory)
        return (values[0] + values[1]) / 2

    assert lines[5] == 'into {} / into {}: {:.2f}x'.format(
        first, second, median(first) / median(second))
    for bad in (first, '{},{}'.format(first, first), '{},{}/'.format(first, first),
                '{},'.format(first), '{},{},{}'.format(first, second, tmp_path)):
        with pytest.raises(SystemExit):
            run_history.main(['--before-local-dirs', bad])
        assert ('--before-local-dirs needs two different directories, got {!r}'.format(
            bad)) in capsys.readouterr().err


def test_every_other_repeat_runs_backwards_and_each_pair_starts_further_on():
    orders = [''.join(processes.run_order('abcd', repeat)) for repeat in range(6)]
    assert orders == ['abcd', 'dcba', 'bcda', 'adcb', 'cdab', 'badc']
    # Over the first three repeats (the full benchmark's), 'b' follows 'a',
    # 'c' and 'a' again, and 'c' follows 'b', 'd' and 'b'.
    assert processes.run_order(iter([1, 2]), 1) == [2, 1]  # any iterable
    assert processes.run_order([], 3) == []
