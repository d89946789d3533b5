"""The peer tier's benchmarks, small and real: nodes under mpiexec on FUSE, faults, loopback."""
import contextlib
import io
import json
import os

import pytest

from chainer_prefetch_bench.peers import bench, transport

needs_fuse = pytest.mark.skipif(
    not os.path.exists('/dev/fuse'),
    reason='/dev/fuse is missing: load the fuse kernel module (modprobe '
           'fuse) or pass the device into the container')


@needs_fuse
@pytest.mark.slow
def test_three_nodes_read_the_dataset_about_once_and_survive_a_dead_server(
        tmp_path):
    out = str(tmp_path / 'peers.json')
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert bench.main([
            '--workdir', str(tmp_path), '--n-images', '96', '--nodes', '3',
            '--epochs', '3', '--batch-size', '8', '--copy-ahead', '2',
            '--methods', 'no-peers,peers', '--faults', 'stop,kill',
            '--peer-timeout', '1', '--out', out]) == 0
    with open(out) as f:
        result = json.load(f)
    runs = {run['method']: run for run in result['runs']}
    dataset = result['dataset_bytes']
    # The mount's own count: with peers about once, without once per node
    # that met the file (three epochs of three nodes: well above once).
    assert runs['peers']['source_bytes'] < 1.5 * dataset
    assert runs['no-peers']['source_bytes'] > 1.5 * dataset
    assert len(runs['peers']['epoch_seconds']) == 3
    assert sum(rank['peers']['bytes_from_peers']
               for rank in runs['peers']['ranks']) > 0
    for fault in result['faults']:
        assert fault['checked'] > 0 and fault['wrong'] == 0, fault['fault']
        assert fault['processes_left'] == [] and fault['victim_port_closed']
        for down in fault['peers_down']:
            assert set(down) <= {'1'}, fault  # only the victim's node
        assert fault['peer_longest_wait_seconds'] < 1 + 10  # one bounded wait
    assert 'source_bytes_no_peers_over_peers' in printed.getvalue()


@pytest.mark.slow
def test_loopback_transport_copies_every_file_three_ways(tmp_path):
    out = str(tmp_path / 'transport.json')
    with contextlib.redirect_stdout(io.StringIO()):
        assert transport.main(['--large-mib', '2', '--small-files', '20',
                               '--small-kib', '8', '--repeats', '1',
                               '--out', out]) == 0
    with open(out) as f:
        result = json.load(f)
    methods = {(row['files'], row['method']) for row in result['medians']}
    assert methods == {(files, method) for files in ('large', 'small')
                       for method in transport.METHODS}
    assert all(row['mb_per_s'] > 0 for row in result['medians'])


@needs_fuse
@pytest.mark.slow
def test_after_a_node_leaves_the_others_resume_and_read_shared_storage_less(
        tmp_path):
    out = str(tmp_path / 'leave.json')
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench.main([
            '--workdir', str(tmp_path), '--n-images', '96', '--nodes', '3',
            '--epochs', '2', '--batch-size', '8', '--copy-ahead', '1',
            '--leave', '--out', out]) == 0
    with open(out) as f:
        result = json.load(f)
    runs = {run['method']: run for run in result['leave']}
    for run in runs.values():
        assert run['after']['first_epoch'] == 2
        assert len(run['after']['ranks']) == 2
        assert len(run['after']['epoch_seconds']) == 1
    assert (runs['leave-peers']['after']['source_bytes']
            <= runs['leave-no-peers']['after']['source_bytes'])
    assert sum(rank['peers']['bytes_from_peers']
               for rank in runs['leave-peers']['after']['ranks']) > 0
