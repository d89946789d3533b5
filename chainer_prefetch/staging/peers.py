"""The peer tier: a node copies a file from the node that already staged it, before shared storage.

With :class:`~chainer_prefetch.policy.rank_shuffle.ShuffleAcrossRanks`
every rank can tell which rank trained on an example in the previous
epochs, so which node's local directory holds a copy of its files: no
message per file says who holds what.  Stage 2 of a node that needs a file
asks those nodes first (:class:`PeerGroup`); shared storage stays the
fallback.

The transport (:mod:`.peer_transport`) is one small TCP server per node (a
thread of the node's first rank), files sent with ``sendfile`` over
connections kept between files.  Not MPI point-to-point on the job's
communicator, because:

* a receive in MPI has no timeout, and a stopped peer (``SIGSTOP``, a node
  swapping) never fails, so the copy thread would wait forever; ULFM
  reports a *dead* process (``MPI_ERR_PROC_FAILED``), not a stopped one,
  and revokes the communicator the serving thread would be blocked on;
* sends and receives from stage 2's copy threads, beside the training's own
  collectives, need ``MPI_THREAD_MULTIPLE``, which some transports run
  slower or not at all;
* a socket has a timeout per call, and a dead or closed peer is a refused or
  reset connection at once.

So a peer that dies, hangs or refuses costs at most one bounded wait; the
group then marks it down for the rest of the run (with a
:class:`~chainer_prefetch.StagingWarning`) and reads the source.

What a copy from a peer guarantees, as a copy from the source does: the
asking node sends the size and modification time of the source's ``stat``,
the peer serves only a copy with both, and the asking node receives exactly
that many bytes into its ``.part`` file, stamps it, and renames it into
place (the local directory does that), or reads the source.

What a server serves: only files under its own (trusted) local directory,
only the copies of the files the dataset names for the example asked
(``lookup``), and only to a request that carries the job's token (drawn by
rank 0 and sent to the ranks over the job's communicator when the group is
made).
"""
import fcntl
import ipaddress
import os
import secrets
import socket
import struct
import threading
import time
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy

from chainer_prefetch.errors import StagingWarning
from chainer_prefetch.staging.counters import Counters
from chainer_prefetch.staging.peer_transport import (
    TOKEN_BYTES,
    Closed,
    Lookup,
    NotHeld,
    PeerDown,
    PeerServer,
    TooSlow,
    connect,
    request,
)
from chainer_prefetch.staging.sources import PlainFile, Source, local_error, stamp

#: What :class:`PeerGroup` counts (``PrefetchMultiprocessIterator.stats``).
PEER_COUNTERS = ('files_from_peers', 'bytes_from_peers', 'peer_fallbacks',
                 'peer_wait_seconds', 'files_served', 'bytes_served',
                 'peer_requests_refused')
#: Connections to one node kept open between requests, at most.
KEPT_CONNECTIONS = 8
_SIOCGIFADDR = 0x8915  # Linux: an interface's address


class PeerCopy(Source):
    """A plain file's copy made from a peer's copy when one is there, else from the source.

    Args:
        source: The :class:`PlainFile`.
        copy_from_peers: ``(source, origin_stat, out_fd, destination) ->
            bytes or None`` (:meth:`PeerGroup.copy` for the item).
    """

    __slots__ = ('name', 'origin', 'source', 'copy_from_peers', 'from_peer')
    stats_when_opened = False  # the peer's copy is compared with the stat

    def __init__(self, source: PlainFile, copy_from_peers: Callable):
        self.name, self.origin = source.name, source.origin
        self.source = source
        self.copy_from_peers = copy_from_peers
        #: Bytes the copy took from a peer, or ``None``: from the source.
        self.from_peer: Optional[int] = None

    def is_current(self, local_stat, origin_stat):
        return self.source.is_current(local_stat, origin_stat)

    def write_local(self, out_fd, origin_stat, destination):
        copied = self.copy_from_peers(self.source, origin_stat, out_fd,
                                      destination)
        if copied is not None:
            stamp(out_fd, origin_stat, destination)
            self.from_peer = copied
            return copied
        try:  # what a failed peer left goes
            os.ftruncate(out_fd, 0)
            os.lseek(out_fd, 0, os.SEEK_SET)
        except OSError as error:
            raise local_error(error, destination) from error
        return self.source.write_local(out_fd, origin_stat, destination)


class PeerGroup:
    """The job's nodes, their servers, and which of them holds a file.

    Made by :meth:`join` on every rank (a collective call); given to
    :class:`~chainer_prefetch.PrefetchMultiprocessIterator` as ``peers``.
    Ranks whose ``local_dir`` is the same directory of the same host form
    one node; the first of them runs the node's
    :class:`~chainer_prefetch.staging.peer_transport.PeerServer`.  Close it
    (or use it as a context manager) when training ends.

    Args:
        node_of_rank: Per rank, its node's number.
        node: This rank's node.
        addresses: Per node, its server's ``(host, port)``.
        token: The job's token.
        holders: ``holders(index, epoch[, size])``, the ranks that trained
            on example ``index`` in ``epoch`` (in a job of ``size`` ranks)
            (:meth:`ShuffleAcrossRanks.holders`).
        server: This node's server, if this rank runs it.
        timeout: Seconds of one bounded wait on a peer.
        lookback: How many earlier epochs' holders are asked (the most
            recent first).
        counters: Where the counters go (the server's, shared).
        places: Per rank, its node's place (``host:local directory``), by
            which the nodes of an earlier job of a resumed run are found.
    """

    def __init__(self, node_of_rank: Sequence[int], node: int,
                 addresses: Dict[int, Tuple[str, int]], token: bytes,
                 holders: Callable[..., Sequence[int]],
                 server: Optional[PeerServer] = None, timeout: float = 10.0,
                 lookback: int = 2, counters: Optional[Counters] = None,
                 places: Optional[Sequence[str]] = None):
        self.node_of_rank = list(node_of_rank)
        self.node = node
        self.addresses = dict(addresses)
        self.token = token
        self.holders = holders
        self.server = server
        self.timeout = timeout
        self.lookback = lookback
        self.counters = counters or Counters(PEER_COUNTERS)
        self.places = list(places) if places is not None else None
        self._node_of_place = {} if places is None else {
            place: member_node
            for place, member_node in zip(places, node_of_rank)}
        # (first epoch of this job, earlier jobs' (first epoch, size, places))
        self._jobs: Tuple[int, List[Tuple[int, int, List[str]]]] = (0, [])
        self._down: Dict[int, str] = {}
        self._longest_wait = 0.0
        self._lock = threading.Lock()
        self._connections = _KeptConnections()
        self._finalizer = weakref.finalize(self, _close, server,
                                           self._connections)

    @classmethod
    def join(cls, comm, local_dir: str, holders: Callable[..., Sequence[int]],
             host: Optional[str] = None, timeout: float = 10.0,
             lookback: int = 2, interface: Optional[str] = None
             ) -> 'PeerGroup':
        """Makes the group on every rank of ``comm`` (a collective call).

        Args:
            comm: The job's communicator: a ChainerMN communicator (its
                ``mpi_comm`` is used) or an mpi4py one.
            local_dir: This rank's local directory (the iterator's).
            holders: As for the constructor (``sampler.holders``).
            host: The address this node's server listens on and the others
                connect to (default: ``$CHAINER_PREFETCH_PEER_HOST``, else
                the address of ``interface``, else what this host's name
                resolves to).
            timeout: Seconds of one bounded wait on a peer.
            lookback: Earlier epochs whose holders are asked.
            interface: A network interface (``ib0``, ``eth0``) whose IPv4
                address each node serves on (default:
                ``$CHAINER_PREFETCH_PEER_INTERFACE``): one name for every
                node of a job script.

        Raises:
            OSError: a node's server could not listen (on every rank, naming
                the node).
            ValueError: the job spans several hosts and a server listens on
                a loopback address, which the other hosts cannot reach.
        """
        comm = getattr(comm, 'mpi_comm', comm)  # ChainerMN's mpi4py one
        place = '{}:{}'.format(socket.gethostname(), os.path.realpath(
            os.path.expanduser(local_dir)))
        places = comm.allgather(place)
        nodes: Dict[str, int] = {}
        for member_place in places:
            nodes.setdefault(member_place, len(nodes))
        node_of_rank = [nodes[member_place] for member_place in places]
        token = comm.bcast(secrets.token_bytes(TOKEN_BYTES)
                           if comm.rank == 0 else None)
        counters = Counters(PEER_COUNTERS)
        server, answer = None, None
        if comm.rank == node_of_rank.index(nodes[place]):
            try:
                host = host or _default_host(interface)
                server = PeerServer(host, token, timeout, counters)
                answer = server.address
            except OSError as error:
                answer = 'node {} ({}) cannot serve on {}: {}'.format(
                    nodes[place], place, repr(host) if host else
                    'the address of its network interface', error)
        answers = comm.allgather(answer)
        problem = _problem(answers, places)
        if problem is not None:
            if server is not None:
                server.close()
            raise (ValueError if 'loopback' in problem else OSError)(problem)
        addresses = {node_of_rank[member]: tuple(address)
                     for member, address in enumerate(answers)
                     if address is not None}
        return cls(node_of_rank, nodes[place], addresses, token, holders,
                   server, timeout, lookback, counters, places)

    def __reduce__(self):
        raise TypeError('a PeerGroup holds this process\'s connections and '
                        'server and cannot be pickled: make it with '
                        'PeerGroup.join in the process that trains')

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def close(self):
        """Closes the kept connections and stops this node's server (if
        this rank runs it)."""
        self._finalizer()

    def serve(self, lookup: Optional[Lookup]):
        """Lets this node's server answer with ``lookup`` (``None``: it holds nothing)."""
        if self.server is not None:
            self.server.lookup = lookup

    def candidates(self, index: int, epoch: int) -> List[int]:
        """The nodes to ask for ``index``'s files in ``epoch``: those that
        trained on it in the ``lookback`` epochs before, the latest first,
        not this node and none marked down."""
        start, earlier_jobs = self._jobs
        found: List[int] = []
        for earlier in range(epoch - 1, max(epoch - 1 - self.lookback, -1), -1):
            job = _job_of(earlier, start, earlier_jobs)
            if job is None:
                ranks, nodes = self.holders(index, earlier), self.node_of_rank
            else:
                size, places = job
                ranks = self.holders(index, earlier, size)
                nodes = [self._node_of_place.get(place) for place in places]
            for rank in ranks:
                node = nodes[rank] if rank < len(nodes) else None
                if node not in (None, self.node) and node not in found:
                    found.append(node)
        with self._lock:
            return [node for node in found
                    if node not in self._down and node in self.addresses]

    def copy(self, source: Source, origin_stat: os.stat_result, out_fd: int,
             destination: str, index: int, nodes: Sequence[int]
             ) -> Optional[int]:
        """Copies ``source`` (a file of example ``index``) from the first of
        ``nodes`` (:meth:`candidates`) that has a current copy.

        Nodes that answer at once that they have none are passed over; the
        first that fails to answer in time, refuses or breaks the
        connection is marked down and no other is asked (one bounded wait
        per file).  One that sends too slowly is not marked down.

        Returns:
            Bytes written, or ``None``: read the source (``out_fd`` may hold
            part of a copy then).
        """
        for node in nodes:
            started = time.monotonic()
            try:
                copied = self._request(node, index, source.name, out_fd,
                                       origin_stat, destination)
            except NotHeld:
                continue
            except PeerDown as error:
                waited = time.monotonic() - started
                if not isinstance(error, TooSlow):
                    self._mark_down(node, '{}:{} (node {}), asked for {} of '
                                    'example {}: {}'.format(
                                        *self.addresses[node], node,
                                        source.name, index, error))
                with self._lock:
                    self._longest_wait = max(self._longest_wait, waited)
                self.counters.add(peer_fallbacks=1, peer_wait_seconds=waited)
                return None
            self.counters.add(files_from_peers=1, bytes_from_peers=copied)
            return copied
        if nodes:
            self.counters.add(peer_fallbacks=1)
        return None

    def jobs(self) -> Dict[str, numpy.ndarray]:
        """Which job trained which epochs, as arrays for a snapshot: per
        job (this one last) its first epoch, its size and its ranks'
        places."""
        start, earlier_jobs = self._jobs
        jobs = earlier_jobs + [(start, len(self.node_of_rank),
                                self.places or [''] * len(self.node_of_rank))]
        return {'first_epochs': numpy.asarray([j[0] for j in jobs], numpy.int64),
                'sizes': numpy.asarray([j[1] for j in jobs], numpy.int64),
                'places': numpy.asarray([p for j in jobs for p in j[2]],
                                        dtype=str)}

    def resume(self, epoch: int, jobs: Optional[Dict[str, numpy.ndarray]]):
        """Learns from a snapshot which jobs trained the epochs before
        ``epoch`` (:meth:`jobs` of the group that wrote it), so that after
        a restart at another size, or on other nodes, the nodes still in
        the job that hold a file are asked.

        Args:
            epoch: The epoch the resumed iterator is in.
            jobs: The snapshot's arrays, or ``None`` (a snapshot without
                them: earlier epochs count as this job's).
        """
        earlier: List[Tuple[int, int, List[str]]] = []
        if jobs is not None:
            places = [str(place) for place in jobs['places']]
            taken = 0
            for first, size in zip(jobs['first_epochs'], jobs['sizes']):
                earlier.append((int(first), int(size),
                                places[taken:taken + int(size)]))
                taken += int(size)
            earlier = [job for job in earlier if job[0] < epoch]
        mine = (len(self.node_of_rank),
                self.places or [''] * len(self.node_of_rank))
        if earlier and earlier[-1][1:] == mine:
            start = earlier.pop()[0]  # the same job goes on
        else:
            start = epoch
        self._jobs = (start, earlier)  # one assignment: copy threads read it

    def stats(self) -> dict:
        """The counters, ``peer_longest_wait_seconds`` (the longest wait on
        a peer that failed) and ``peers_down`` (per node marked down, why)."""
        values = self.counters.snapshot()
        with self._lock:
            values['peer_longest_wait_seconds'] = self._longest_wait
            values['peers_down'] = dict(self._down)
        return values

    def _mark_down(self, node: int, reason: str):
        with self._lock:
            if node in self._down:
                return
            self._down[node] = reason
        warnings.warn('peer node marked down for the rest of the run, its '
                      'files are read from shared storage: {}'.format(reason),
                      StagingWarning)

    def _request(self, node, index, name, out_fd, origin_stat, destination):
        """:func:`request` on a kept connection to ``node``, or a new one
        (also when a kept one turns out closed by the peer)."""
        for kept in (True, False):
            connection = (self._connections.take(node) if kept
                          else connect(self.addresses[node], self.timeout))
            if connection is None:
                continue
            try:
                copied = request(connection, self.token, index, name, out_fd,
                                 origin_stat, destination, self.timeout)
            except NotHeld:
                self._connections.give_back(node, connection)
                raise
            except Closed:
                connection.close()
                if kept:
                    continue
                raise
            except BaseException:
                connection.close()
                raise
            self._connections.give_back(node, connection)
            return copied
        raise AssertionError('unreachable')


def _default_host(interface: Optional[str]) -> str:
    """The address a node serves on when ``join`` is given no ``host``.

    Raises:
        OSError: the interface has no IPv4 address (or does not exist).
    """
    host = os.environ.get('CHAINER_PREFETCH_PEER_HOST')
    if host:
        return host
    interface = interface or os.environ.get('CHAINER_PREFETCH_PEER_INTERFACE')
    if not interface:
        return socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack('256s', interface.encode()[:15])
        try:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
        except OSError as error:
            raise OSError(error.errno, 'network interface {!r}: {}'.format(
                interface, error.strerror)) from error
    return socket.inet_ntoa(answer[20:24])


def _job_of(epoch: int, start: int, earlier_jobs
            ) -> Optional[Tuple[int, List[str]]]:
    """``(size, places)`` of the earlier job that trained ``epoch``, or
    ``None`` when this job (which started in epoch ``start``) did."""
    if epoch >= start:
        return None
    for first, size, places in reversed(earlier_jobs):
        if first <= epoch:
            return size, places
    return None


def _problem(answers, places) -> Optional[str]:
    """Why the servers of :meth:`PeerGroup.join` cannot be used, or ``None``."""
    errors = [answer for answer in answers if isinstance(answer, str)]
    if errors:
        return '; '.join(errors)
    hosts = {place.split(':', 1)[0] for place in places}
    loopback = [tuple(answer) for answer in answers if answer is not None
                and ipaddress.ip_address(answer[0]).is_loopback]
    if len(hosts) > 1 and loopback:
        return ('the job spans {} hosts, but a node serves on the loopback '
                'address {}:{} (what its host name resolves to), which the '
                'other hosts cannot reach: give PeerGroup.join host= or set '
                'CHAINER_PREFETCH_PEER_HOST to the node\'s address on the '
                'network the nodes share'.format(len(hosts), *loopback[0]))
    return None


class _KeptConnections:
    """Connections to peers between two requests, per node (thread-safe)."""

    def __init__(self):
        self._idle: Dict[int, List[socket.socket]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def take(self, node: int) -> Optional[socket.socket]:
        with self._lock:
            idle = self._idle.get(node)
            return idle.pop() if idle else None

    def give_back(self, node: int, connection: socket.socket):
        with self._lock:
            idle = self._idle.setdefault(node, [])
            if not self._closed and len(idle) < KEPT_CONNECTIONS:
                idle.append(connection)
                return
        connection.close()

    def close(self):
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()


def _close(server: Optional[PeerServer], connections: _KeptConnections):
    connections.close()
    if server is not None:
        server.close()


def make_lookup(sources_of: Callable[[int], Sequence[Source]],
                local_path: Callable[[Source], str]) -> Lookup:
    """The server's ``lookup`` for a dataset and a local directory.

    Args:
        sources_of: The sources of an item (the dataset's files of an
            example).
        local_path: Where a source's local copy is.
    """
    def lookup(item: int, name: str) -> Optional[str]:
        for source in sources_of(item):
            if isinstance(source, PlainFile) and source.name == name:
                return local_path(source)
        return None
    return lookup


__all__ = ['PeerGroup', 'PeerCopy', 'make_lookup', 'PEER_COUNTERS',
           'KEPT_CONNECTIONS']
