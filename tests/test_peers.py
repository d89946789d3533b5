"""The peer tier with real processes and sockets: copies from a peer, and each way a peer fails."""
import contextlib
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from chainer_prefetch.staging import peer_transport
from chainer_prefetch.staging.counters import Counters
from chainer_prefetch.staging.local_directory import LocalDirectory
from chainer_prefetch.staging.local_store import LocalStore
from chainer_prefetch.staging.peer_transport import PeerServer
from chainer_prefetch.staging.peers import PEER_COUNTERS, PeerGroup
from chainer_prefetch.staging.sources import PlainFile
from helpers import FileBytes, write_random_file

NODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'peer_node.py')
TIMEOUT = 1.0


@pytest.fixture
def dataset(tmp_path):
    paths = []
    for i, size in enumerate((0, 1, 4096, 300000, 1 << 20)):
        path = str(tmp_path / 'shared' / 'f{}.bin'.format(i))
        write_random_file(path, size, seed=i)
        paths.append(path)
    return paths


class Node:
    """A peer node in its own process (tests/peer_node.py)."""

    def __init__(self, tmp_path, paths, token):
        self.local_dir = str(tmp_path / 'node_local')
        self.process = subprocess.Popen(
            [sys.executable, NODE, self.local_dir, token.hex()] + paths,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self.process.stdout.readline())
        self.directory = LocalDirectory(self.local_dir)

    def copy_of(self, path):
        return self.directory.local_path(path)

    def stop(self):
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.stdin.close()
            self.process.wait(30)
        self.directory.close()


@pytest.fixture
def node(tmp_path, dataset):
    token = secrets.token_bytes(32)
    started = Node(tmp_path, dataset, token)
    started.token = token
    yield started
    started.stop()


def client(tmp_path, node, token=None):
    group = PeerGroup([0, 1], 0, {1: ('127.0.0.1', node.port)},
                      token or node.token, lambda index, epoch: [1],
                      timeout=TIMEOUT)
    store = LocalStore(LocalDirectory(str(tmp_path / 'client_local')),
                       peers=group)
    return group, store


def stage(store, paths, item):
    return store.stage(item, [PlainFile(paths[item])], order_epoch=1)


def local_bytes(store, path):
    with open(store.directory.local_path(path), 'rb') as f:
        return f.read()


def source_bytes(path):
    with open(path, 'rb') as f:
        return f.read()


def test_files_come_from_the_peer_byte_for_byte_and_count_no_shared_read(
        tmp_path, dataset, node):
    group, store = client(tmp_path, node)
    for item, path in enumerate(dataset):
        result = stage(store, dataset, item)
        assert result.staged and result.bytes_read == 0
        assert local_bytes(store, path) == source_bytes(path)
        assert os.stat(store.directory.local_path(path)).st_mtime_ns == \
            os.stat(path).st_mtime_ns
    counts = group.stats()
    assert counts['files_from_peers'] == len(dataset)
    assert counts['bytes_from_peers'] == sum(map(os.path.getsize, dataset))
    assert counts['peer_fallbacks'] == 0 and counts['peers_down'] == {}
    assert store.counters.snapshot()['bytes_copied'] == 0
    # Once made, the copy is current: nobody is asked again.
    assert stage(store, dataset, 3).bytes_read == 0
    assert group.stats()['files_from_peers'] == len(dataset)
    store.close()


def test_a_copy_evicted_meanwhile_is_read_from_the_source_without_a_wait(
        tmp_path, dataset, node):
    os.unlink(node.copy_of(dataset[3]))
    group, store = client(tmp_path, node)
    result = stage(store, dataset, 3)
    assert result.staged and result.bytes_read == os.path.getsize(dataset[3])
    assert local_bytes(store, dataset[3]) == source_bytes(dataset[3])
    counts = group.stats()
    assert counts['peer_fallbacks'] == 1 and counts['peer_wait_seconds'] == 0
    assert counts['peers_down'] == {}  # still asked for the others
    assert stage(store, dataset, 4).bytes_read == 0
    store.close()


def test_a_stale_copy_on_the_peer_is_not_taken(tmp_path, dataset, node):
    write_random_file(dataset[2], 4096, seed=77)  # the source changed
    os.utime(dataset[2], ns=(1, 10 ** 18))
    group, store = client(tmp_path, node)
    result = stage(store, dataset, 2)
    assert result.bytes_read == 4096
    assert local_bytes(store, dataset[2]) == source_bytes(dataset[2])
    assert group.stats()['files_from_peers'] == 0
    store.close()


def test_a_file_that_is_not_the_examples_source_is_not_served(
        tmp_path, dataset, node):
    outside = str(tmp_path / 'not_in_dataset')
    write_random_file(outside, 100)
    target = str(tmp_path / 'received')
    with open(target, 'wb') as out:
        with pytest.raises(peer_transport.NotHeld):  # another example's file
            peer_transport.fetch(('127.0.0.1', node.port), node.token, 0,
                            dataset[1], out.fileno(), os.stat(dataset[1]),
                            target, TIMEOUT)
        with pytest.raises(peer_transport.NotHeld):  # no file of the dataset
            peer_transport.fetch(('127.0.0.1', node.port), node.token, 0, outside,
                            out.fileno(), os.stat(outside), target, TIMEOUT)
        with pytest.raises(peer_transport.NotHeld):  # no such example
            peer_transport.fetch(('127.0.0.1', node.port), node.token, 99,
                            dataset[0], out.fileno(), os.stat(dataset[0]),
                            target, TIMEOUT)
    assert os.path.getsize(target) == 0


def test_a_request_without_the_jobs_token_is_refused(tmp_path, dataset, node):
    group, store = client(tmp_path, node, token=secrets.token_bytes(32))
    result = stage(store, dataset, 4)
    assert result.staged and result.bytes_read == os.path.getsize(dataset[4])
    assert local_bytes(store, dataset[4]) == source_bytes(dataset[4])
    assert group.stats()['peers_down'].keys() == {1}
    store.close()
    node.process.stdin.close()
    assert "'peer_requests_refused': 1" in node.process.stdout.read()


def test_a_stopped_peer_costs_one_bounded_wait_then_is_not_asked(
        tmp_path, dataset, node):
    group, store = client(tmp_path, node)
    os.kill(node.process.pid, signal.SIGSTOP)
    started = time.monotonic()
    result = stage(store, dataset, 4)
    waited = time.monotonic() - started
    assert result.staged and result.bytes_read == os.path.getsize(dataset[4])
    assert local_bytes(store, dataset[4]) == source_bytes(dataset[4])
    counts = group.stats()
    assert counts['peers_down'].keys() == {1} and counts['peer_fallbacks'] == 1
    assert TIMEOUT * 0.5 <= counts['peer_wait_seconds'] <= waited
    assert waited < TIMEOUT + 10  # one wait, not one per file or per piece
    for item in range(4):  # the peer is down: no more waits
        assert stage(store, dataset, item).staged
    assert group.stats()['peer_fallbacks'] == 1
    assert group.candidates(0, 1) == []
    store.close()


@pytest.mark.parametrize('how', ['kill', 'close'])
def test_a_dead_or_closed_peer_is_a_refused_connection_at_once(
        tmp_path, dataset, node, how):
    if how == 'kill':
        node.process.kill()
    else:
        node.process.stdin.close()
    node.process.wait(30)
    group, store = client(tmp_path, node)
    result = stage(store, dataset, 3)
    assert result.staged and local_bytes(store, dataset[3]) == \
        source_bytes(dataset[3])
    counts = group.stats()
    assert counts['peers_down'].keys() == {1} and counts['peer_wait_seconds'] < TIMEOUT
    store.close()


@contextlib.contextmanager
def fake_peer(tmp_path, path, send_body):
    """A peer that answers one request for ``path`` with the right size and
    modification time, then ``send_body(connection, stop)``; yields the
    client's group and store."""
    info = os.stat(path)
    listener = socket.create_server(('127.0.0.1', 0))
    stop = threading.Event()

    def answer():
        connection, _ = listener.accept()
        with connection:
            connection.recv(4096)
            connection.sendall(struct.pack('<Bqq', 0, info.st_size,
                                           info.st_mtime_ns))
            send_body(connection, stop)

    thread = threading.Thread(target=answer)
    thread.start()
    group = PeerGroup([0, 1], 0, {1: listener.getsockname()},
                      secrets.token_bytes(32), lambda index, epoch: [1],
                      timeout=TIMEOUT)
    store = LocalStore(LocalDirectory(str(tmp_path / 'client_local')),
                       peers=group)
    try:
        yield group, store
    finally:
        stop.set()
        thread.join()
        listener.close()
        store.close()


def test_a_peer_that_breaks_off_mid_file_leaves_no_byte_of_it(
        tmp_path, dataset):
    """A peer that announces the right size and mtime and sends half."""
    path = dataset[4]

    def half(connection, stop):
        connection.sendall(b'\0' * (os.path.getsize(path) // 2))

    with fake_peer(tmp_path, path, half) as (group, store):
        result = stage(store, dataset, 4)
        assert result.staged and result.bytes_read == os.path.getsize(path)
        assert local_bytes(store, path) == source_bytes(path)
        assert group.stats()['peers_down'].keys() == {1}
        assert os.listdir(store.directory.partial_root) == []


def test_closing_a_server_leaves_no_thread_and_no_port(tmp_path, dataset):
    server = PeerServer('127.0.0.1', secrets.token_bytes(32), TIMEOUT,
                        Counters(PEER_COUNTERS))
    address = server.address
    socket.create_connection(address, timeout=TIMEOUT).close()
    server.close()
    assert not [thread for thread in threading.enumerate()
                if thread.name == 'peer-server']
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=TIMEOUT)


def test_the_iterator_checks_how_it_is_given_peers(tmp_path, dataset):
    import pickle
    import warnings

    from chainer_prefetch import PrefetchMultiprocessIterator, ShuffleAcrossRanks, StagingWarning
    files = FileBytes(dataset)
    sampler = ShuffleAcrossRanks(len(files), 0, 2, 0)
    other = ShuffleAcrossRanks(len(files), 0, 2, 1)
    group = PeerGroup([0, 1], 0, {}, secrets.token_bytes(32), other.holders)
    with pytest.raises(ValueError, match='local_dir'):
        PrefetchMultiprocessIterator(files, 2, order_sampler=sampler,
                                     peers=group)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        iterator = PrefetchMultiprocessIterator(
            files, 2, order_sampler=sampler, peers=group, n_processes=1,
            local_dir=str(tmp_path / 'local'))
    assert any(issubclass(w.category, StagingWarning)
               and 'another order sampler' in str(w.message) for w in caught)
    assert iterator.stats['peers']['peers_down'] == {}
    iterator.finalize()
    with pytest.raises(TypeError, match='cannot be pickled'):
        pickle.dumps(group)
    group.close()


def test_after_a_restart_at_another_size_the_nodes_still_there_are_asked():
    from chainer_prefetch import ShuffleAcrossRanks
    n = 60
    before = PeerGroup([0, 1, 2], 0, {0: ('h', 1), 1: ('h', 2), 2: ('h', 3)},
                       b'', ShuffleAcrossRanks(n, 0, 3, 5).holders,
                       places=['h:/a', 'h:/b', 'h:/c'])
    saved = before.jobs()
    # Two ranks now, on the nodes of the old ranks 1 and 0 (in that order).
    sampler = ShuffleAcrossRanks(n, 0, 2, 5)
    after = PeerGroup([0, 1], 0, {0: ('h', 2), 1: ('h', 1)}, b'',
                      sampler.holders, places=['h:/b', 'h:/a'])
    after.resume(2, saved)
    old = ShuffleAcrossRanks(n, 0, 3, 5)
    new_node_of_old_rank = {0: 1, 1: 0, 2: None}  # /c left the job

    def expected(index, epoch):
        found = []
        for earlier in (epoch - 1, epoch - 2):
            if earlier >= 2:  # the new job's epochs
                ranks = sampler.holders(index, earlier)
                nodes = {0: 0, 1: 1}
            else:
                ranks = old.holders(index, earlier)
                nodes = new_node_of_old_rank
            for rank in ranks:
                if nodes[rank] not in (None, 0, *found):
                    found.append(nodes[rank])
        return found

    for index in range(n):
        for epoch in (2, 3):
            assert after.candidates(index, epoch) == expected(index, epoch)
    # The same job resumed: nothing changes.
    again = PeerGroup([0, 1, 2], 0, before.addresses, b'', old.holders,
                      places=['h:/a', 'h:/b', 'h:/c'])
    again.resume(2, saved)
    assert again.jobs()['first_epochs'].tolist() == [0]


def test_a_node_that_cannot_serve_fails_join_on_every_rank(tmp_path):
    from chainer_prefetch_bench.testbed import mpi_launch
    script = tmp_path / 'join.py'
    script.write_text(
        'import os, sys\n'
        'from mpi4py import MPI\n'
        'from chainer_prefetch import PeerGroup\n'
        'comm = MPI.COMM_WORLD\n'
        'local = os.path.join(sys.argv[1], "node%d" % comm.rank)\n'
        'try:\n'
        '    PeerGroup.join(comm, local, lambda i, e: [0])\n'
        'except OSError as error:\n'
        '    print("rank %d raised: %s" % (comm.rank, error), flush=True)\n')
    env = mpi_launch.environment()
    env['CHAINER_PREFETCH_PEER_HOST'] = '192.0.2.1'  # not this machine's
    code, output, timed_out = mpi_launch.run(
        [mpi_launch.mpiexec_path(), '--oversubscribe', '-n', '2',
         sys.executable, str(script), str(tmp_path)], 120, env=env)
    assert not timed_out and code == 0, output[-3000:]
    for rank in (0, 1):
        assert 'rank {} raised: node '.format(rank) in output, output[-3000:]
    assert "cannot serve on '192.0.2.1'" in output


def test_a_job_of_several_hosts_refuses_loopback_servers():
    from chainer_prefetch.staging.peers import _problem
    one_host = ['a:/x', 'a:/y']
    two_hosts = ['a:/x', 'b:/x']
    served = [('127.0.0.1', 5), ('127.0.0.1', 6)]
    assert _problem(served, one_host) is None
    assert 'loopback' in _problem(served, two_hosts)
    assert _problem([('10.0.0.1', 5), ('10.0.0.2', 6)], two_hosts) is None
    assert _problem(['node 1 (b:/x) cannot serve', None], two_hosts) == \
        'node 1 (b:/x) cannot serve'


def test_a_node_serves_on_the_address_of_the_interface_named(monkeypatch):
    from chainer_prefetch.staging.peers import _default_host
    monkeypatch.delenv('CHAINER_PREFETCH_PEER_HOST', raising=False)
    assert _default_host('lo') == '127.0.0.1'
    monkeypatch.setenv('CHAINER_PREFETCH_PEER_INTERFACE', 'lo')
    assert _default_host(None) == '127.0.0.1'
    with pytest.raises(OSError, match="interface 'no-such-if0'"):
        _default_host('no-such-if0')
    monkeypatch.setenv('CHAINER_PREFETCH_PEER_HOST', '10.1.2.3')
    assert _default_host('lo') == '10.1.2.3'


class OpensByName:
    """A user's dataset that builds each path in ``get_example``."""

    def __init__(self, root, n):
        self.root, self.n = root, n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        with open(os.path.join(self.root, 'f{}.bin'.format(index)), 'rb') as f:
            return f.read()


def test_files_learned_in_the_first_epoch_are_not_asked_of_peers(
        tmp_path, dataset):
    import warnings

    from chainer_prefetch import PrefetchMultiprocessIterator, ShuffleAcrossRanks, StagingWarning
    files = OpensByName(os.path.dirname(dataset[0]), len(dataset))
    sampler = ShuffleAcrossRanks(len(files), 0, 1, 0)
    group = PeerGroup([0], 0, {}, secrets.token_bytes(32), sampler.holders)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        iterator = PrefetchMultiprocessIterator(
            files, 2, order_sampler=sampler, peers=group, n_processes=1,
            local_dir=str(tmp_path / 'local'))
        taken = [example for _ in range(5) for example in iterator.next()]
    assert any('names no files per example, so no peer is asked'
               in str(w.message) for w in caught
               if issubclass(w.category, StagingWarning))
    assert taken == [source_bytes(dataset[i])
                     for epoch in (0, 1) for i in sampler.order(epoch)]
    stats = iterator.stats
    iterator.finalize()
    assert stats['peers']['files_from_peers'] == 0
    assert stats['by_epoch'][1]['examples_from_local'] > 0  # learned, staged
    group.close()


def test_a_peer_that_sends_too_slowly_costs_the_file_but_stays_up(
        tmp_path, dataset):
    path = dataset[4]  # 1 MiB: its deadline is TIMEOUT + 1 s

    def trickle(connection, stop):
        while not stop.wait(0.3):
            try:
                connection.sendall(b'\0' * 1024)
            except OSError:
                return

    with fake_peer(tmp_path, path, trickle) as (group, store):
        result = stage(store, dataset, 4)
        assert result.staged and local_bytes(store, path) == \
            source_bytes(path)
        counts = group.stats()
        assert counts['peers_down'] == {} and counts['peer_fallbacks'] == 1
        assert counts['peer_longest_wait_seconds'] < TIMEOUT + 1 + 10


def test_a_full_local_disk_while_receiving_stops_staging_not_the_peer(
        tmp_path, dataset, node):
    import helpers
    mount = tmp_path / 'small_disk'
    with helpers.tmpfs(mount, '512k') as mounted:
        if not mounted:
            pytest.skip('cannot mount a tmpfs here (mount needs root)')
        group = PeerGroup([0, 1], 0, {1: ('127.0.0.1', node.port)},
                          node.token, lambda index, epoch: [1],
                          timeout=TIMEOUT)
        store = LocalStore(LocalDirectory(str(mount / 'local')), peers=group)
        result = stage(store, dataset, 4)  # 1 MiB into 512 KiB
        assert not result.staged
        assert 'No space left' in store.disabled, store.disabled
        assert group.stats()['peers_down'] == {}  # the local side failed
        assert os.listdir(store.directory.partial_root) == []
        assert not os.path.exists(store.directory.local_path(dataset[4]))
        store.close()
