"""The peer tier: a node copies a file from the node that already staged it, before shared storage.

With :class:`~chainer_prefetch.policy.rank_shuffle.ShuffleAcrossRanks`
every rank can tell which rank trained on an example in the previous
epochs, so which node's local directory holds a copy of its files: no
message per file says who holds what.  Stage 2 of a node that needs a file
asks that node first (:class:`PeerGroup`); shared storage stays the
fallback.

Transport: one small TCP server per node (a thread of the node's first
rank, :class:`PeerServer`), the file sent with ``sendfile``.  Not MPI
point-to-point on the job's communicator, because:

* a receive in MPI has no timeout, and a stopped peer (``SIGSTOP``, a node
  swapping) never fails, so the copy thread would wait forever; ULFM
  reports a *dead* process (``MPI_ERR_PROC_FAILED``), not a stopped one,
  and revokes the communicator the serving thread would be blocked on;
* sends and receives from stage 2's copy threads, beside the training's own
  collectives, need ``MPI_THREAD_MULTIPLE``, which some transports run
  slower or not at all;
* a socket has a timeout per call, and a dead or closed peer is a refused or
  reset connection at once.

So a peer that dies, hangs or refuses costs at most one bounded wait
(``timeout`` seconds to connect and between two pieces of the reply, and
the whole file within ``timeout`` plus its size at 1 MiB/s); the group then
marks it down for the rest of the run and reads the source.

What a copy from a peer guarantees, as a copy from the source does: the
server sends the size and modification time of its copy, and the receiving
node accepts it only if both equal those of the source's ``stat``
(``PlainFile.is_current``); it receives exactly that many bytes into its
``.part`` file, stamps it, and renames it into place (the local directory
does that), or reads the source.

What a server serves: only files under its own (trusted) local directory,
only the copies of the files the dataset names for the example asked
(``lookup``), and only to a request that carries the job's token (drawn by
rank 0 and sent to the ranks over the job's communicator when the group is
made).
"""
import hmac
import os
import secrets
import socket
import socketserver
import stat
import struct
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy

from chainer_prefetch.errors import LocalStorageError
from chainer_prefetch.staging.counters import Counters
from chainer_prefetch.staging.sources import PlainFile, Source, local_error, stamp

_MAGIC = b'CPP1'
_TOKEN_BYTES = 32
_REQUEST = struct.Struct('<4s32sqH')  # magic, token, item, name's length
_REPLY = struct.Struct('<BqQ')  # status, size, mtime_ns
_SERVED, _NOT_HELD, _REFUSED = 0, 1, 2
_MAX_NAME_BYTES = 4096
_RECEIVE_BYTES = 1 << 20
#: Seconds a connection stays open without a request.
IDLE_SECONDS = 120.0
#: The slowest transfer rate a peer may keep before it counts as hung.
MIN_BYTES_PER_SECOND = 1 << 20

#: ``lookup(item, name)``: the local path of the copy of the source ``name``
#: of ``item``, or ``None`` (not a source of it, or no copy here).
Lookup = Callable[[int, str], Optional[str]]

#: What :class:`PeerGroup` counts (``PrefetchMultiprocessIterator.stats``).
PEER_COUNTERS = ('files_from_peers', 'bytes_from_peers', 'peer_fallbacks',
                 'peer_wait_seconds', 'files_served', 'bytes_served',
                 'peer_requests_refused')
#: Counters of the longest single wait, kept apart (a maximum, not a sum).
_LONGEST = 'peer_longest_wait_seconds'


class PeerDown(Exception):
    """The peer did not answer in time, refused the connection, or broke it."""


class NotHeld(Exception):
    """The peer answered at once that it has no current copy.

    Attributes:
        reusable: Whether the connection may carry another request.
    """

    def __init__(self, reusable: bool = True):
        super().__init__(reusable)
        self.reusable = reusable


class PeerServer:
    """Serves this node's local copies to the job's other members.

    A thread accepts connections; each connection gets a thread that
    answers one request.  :meth:`close` stops them (a connection's thread
    waits at most ``timeout`` for its client).

    Args:
        host: Address to listen on.
        token: The job's token; a request without it is refused.
        timeout: Seconds a connection may wait for its client.
        counters: Where ``files_served``, ``bytes_served`` and
            ``peer_requests_refused`` are counted.
    """

    def __init__(self, host: str, token: bytes, timeout: float,
                 counters: Counters):
        self.token = token
        self.timeout = timeout
        self.counters = counters
        self.lookup: Optional[Lookup] = None
        self._connections = set()
        self._connections_lock = threading.Lock()
        self._server = _TCPServer((host, 0), _Handler)
        self._server.peer_server = self
        self.address: Tuple[str, int] = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name='peer-server', daemon=True)
        self._thread.start()

    def close(self):
        """Stops accepting, ends every connection, and waits for their threads."""
        if self._thread is None:
            return
        self._server.shutdown()
        with self._connections_lock:
            for connection in self._connections:
                try:  # its thread's wait for the next request ends at once
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._server.server_close()
        self._thread.join()
        self._thread = None

    def answer_all(self, connection: socket.socket):
        """Answers the requests that come on ``connection`` until it closes.

        A connection stays open between requests (at most ``IDLE_SECONDS``
        without one); a request must arrive whole, and its reply be taken,
        within ``timeout``.  A request without the job's token closes it.
        """
        # The reply's header and the file go out at once, not held back
        # for the header's acknowledgement (Nagle's algorithm).
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._connections_lock:
            self._connections.add(connection)
        try:
            while self._thread is not None:
                connection.settimeout(IDLE_SECONDS)
                first = connection.recv(1)
                if not first:
                    return
                connection.settimeout(self.timeout)
                if not self.answer(connection, first):
                    return
        finally:
            with self._connections_lock:
                self._connections.discard(connection)

    def answer(self, connection: socket.socket, first: bytes = b'') -> bool:
        """Answers one request on ``connection`` (whose first byte was ``first``).

        Returns:
            Whether the connection may carry another request.
        """
        head = first + _receive_exactly(connection, _REQUEST.size - len(first),
                                        None)
        magic, token, item, name_length = _REQUEST.unpack(head)
        if (magic != _MAGIC or not hmac.compare_digest(token, self.token)
                or name_length > _MAX_NAME_BYTES):
            self.counters.add(peer_requests_refused=1)
            connection.sendall(_REPLY.pack(_REFUSED, 0, 0))
            return False
        name = _receive_exactly(connection, name_length, None).decode(
            'utf-8', 'surrogateescape')
        lookup = self.lookup
        try:
            path = None if lookup is None else lookup(item, name)
        except (IndexError, ValueError, TypeError):
            self.counters.add(peer_requests_refused=1)
            connection.sendall(_REPLY.pack(_REFUSED, 0, 0))
            return True
        fd = _open_regular(path) if path is not None else None
        if fd is None:
            connection.sendall(_REPLY.pack(_NOT_HELD, 0, 0))
            return True
        with os.fdopen(fd, 'rb') as copy:
            info = os.fstat(copy.fileno())
            connection.sendall(_REPLY.pack(_SERVED, info.st_size,
                                           info.st_mtime_ns))
            sent = connection.sendfile(copy, 0, info.st_size)
        self.counters.add(files_served=1, bytes_served=sent)
        return sent == info.st_size


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = False  # close() waits for them (each bounded by its timeout)
    block_on_close = True
    allow_reuse_address = True


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        try:
            self.server.peer_server.answer_all(self.request)
        except (OSError, struct.error, ValueError):
            pass  # the client sees a short reply and reads the source


def _open_regular(path: str) -> Optional[int]:
    """A descriptor of the regular file ``path`` (not a symlink), or ``None``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


class Closed(PeerDown):
    """The connection was closed or reset before any byte of the reply
    (a kept connection the peer had closed: worth one new connection)."""


def request(connection: socket.socket, token: bytes, item: int, name: str,
            out_fd: int, origin_stat: os.stat_result, destination: str,
            timeout: float) -> int:
    """Asks for the peer's copy of ``name`` (a source of ``item``) on
    ``connection`` and writes it into ``out_fd``.

    Args:
        connection: A connection to the peer's server.
        token: The job's token.
        item: The item (example index) whose source it is.
        name: The source's path.
        out_fd: The empty file to write, at offset 0.
        origin_stat: The source's ``stat``: the copy must have its size and
            modification time.
        destination: The local path (for error messages).
        timeout: Seconds of each wait on the peer; the whole reply within
            ``timeout`` plus its size at :data:`MIN_BYTES_PER_SECOND`.

    Returns:
        Bytes written (the source's size).

    Raises:
        Closed: the connection ended before the reply began.
        PeerDown: no answer in time, a broken connection, or a request
            refused.
        NotHeld: the peer has no copy, or one that is not current
            (``reusable`` says whether the connection may carry another
            request).
        LocalStorageError: ``out_fd`` cannot be written.
    """
    size = origin_stat.st_size
    deadline = time.monotonic() + timeout + size / MIN_BYTES_PER_SECOND
    encoded = name.encode('utf-8', 'surrogateescape')
    try:
        try:
            connection.settimeout(timeout)
            connection.sendall(_REQUEST.pack(_MAGIC, token, item,
                                             len(encoded)) + encoded)
            _bound(connection, deadline, timeout)
            first = connection.recv(_REPLY.size)
        except (ConnectionResetError, BrokenPipeError) as error:
            raise Closed(str(error)) from error
        if not first:
            raise Closed('connection closed')
        status, served_size, mtime_ns = _REPLY.unpack(
            first + _receive_exactly(connection, _REPLY.size - len(first),
                                     deadline, timeout))
        if status == _REFUSED:
            raise PeerDown('the request was refused')
        if status != _SERVED:
            raise NotHeld(True)
        if (served_size, mtime_ns) != (size, origin_stat.st_mtime_ns):
            raise NotHeld(False)  # a stale copy: the source changed since
        _receive_into(connection, out_fd, size, deadline, timeout,
                      destination)
    except (LocalStorageError, PeerDown, NotHeld):
        raise
    except (OSError, struct.error) as error:
        raise PeerDown(str(error) or type(error).__name__) from error
    return size


def fetch(address: Tuple[str, int], token: bytes, item: int, name: str,
          out_fd: int, origin_stat: os.stat_result, destination: str,
          timeout: float) -> int:
    """:func:`request` on a new connection to ``address``, closed afterwards.

    Raises:
        As :func:`request` (``PeerDown`` also when the connection cannot be
        made).
    """
    try:
        connection = socket.create_connection(address, timeout=timeout)
    except OSError as error:
        raise PeerDown(str(error)) from error
    with connection:
        return request(connection, token, item, name, out_fd, origin_stat,
                       destination, timeout)


def _receive_exactly(connection: socket.socket, n_bytes: int,
                     deadline: Optional[float],
                     timeout: Optional[float] = None) -> bytes:
    """``n_bytes`` from ``connection`` (``PeerDown`` if it ends first)."""
    data = bytearray()
    while len(data) < n_bytes:
        _bound(connection, deadline, timeout)
        piece = connection.recv(n_bytes - len(data))
        if not piece:
            raise PeerDown('connection closed after {} of {} bytes'.format(
                len(data), n_bytes))
        data += piece
    return bytes(data)


def _receive_into(connection, out_fd, size, deadline, timeout, destination):
    buffer = bytearray(min(_RECEIVE_BYTES, max(size, 1)))
    view = memoryview(buffer)
    received = 0
    while received < size:
        _bound(connection, deadline, timeout)
        n = connection.recv_into(buffer, min(len(buffer), size - received))
        if n == 0:
            raise PeerDown('connection closed after {} of {} bytes'.format(
                received, size))
        written = 0
        try:
            while written < n:
                written += os.write(out_fd, view[written:n])
        except OSError as error:
            raise local_error(error, destination) from error
        received += n


def _bound(connection, deadline, timeout):
    """Sets the wait of the next call: ``timeout``, and never past ``deadline``."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerDown('no complete answer within the deadline')
    connection.settimeout(min(timeout, left) if timeout else left)


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
        self.from_peer = 0  #: bytes the copy took from a peer

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
    one node; the first of them runs the node's :class:`PeerServer`.
    Close it (or use it as a context manager) when training ends; it is
    closed at exit otherwise.

    Args:
        node_of_rank: Per rank, its node's number.
        node: This rank's node.
        addresses: Per node, its server's ``(host, port)``.
        token: The job's token.
        holders: ``holders(index, epoch)``, the ranks that trained on
            example ``index`` in ``epoch``
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
                 holders: Callable[[int, int], Sequence[int]],
                 server: Optional[PeerServer] = None, timeout: float = 10.0,
                 lookback: int = 2, counters: Optional[Counters] = None,
                 places: Optional[Sequence[str]] = None):
        self.node_of_rank = list(node_of_rank)
        self.places = list(places) if places is not None else None
        self._node_of_place = {} if places is None else {
            place: node for place, node in zip(places, node_of_rank)}
        self._start_epoch = 0
        self._earlier_jobs: List[Tuple[int, int, List[str]]] = []
        self.node = node
        self.addresses = dict(addresses)
        self.token = token
        self.holders = holders
        self.server = server
        self.timeout = timeout
        self.lookback = lookback
        self.counters = counters or Counters(PEER_COUNTERS)
        self._down: Dict[int, str] = {}
        self._longest_wait = 0.0
        self._lock = threading.Lock()
        self._connections = _KeptConnections()
        self._finalizer = weakref.finalize(self, _close, server,
                                           self._connections)

    @classmethod
    def join(cls, comm, local_dir: str,
             holders: Callable[[int, int], Sequence[int]],
             host: Optional[str] = None, timeout: float = 10.0,
             lookback: int = 2) -> 'PeerGroup':
        """Makes the group on every rank of ``comm`` (a collective call).

        Args:
            comm: The job's communicator: a ChainerMN communicator (its
                ``mpi_comm`` is used) or an mpi4py one.
            local_dir: This rank's local directory (the iterator's).
            holders: As for the constructor (``sampler.holders``).
            host: The address this node's server listens on and the others
                connect to (default: ``$CHAINER_PREFETCH_PEER_HOST``, else
                what this host's name resolves to).
            timeout: Seconds of one bounded wait on a peer.
            lookback: Earlier epochs whose holders are asked.
        """
        comm = getattr(comm, 'mpi_comm', comm)  # ChainerMN's mpi4py one
        allgather, bcast = comm.allgather, comm.bcast
        place = (socket.gethostname(),
                 os.path.realpath(os.path.expanduser(local_dir)))
        places = [':'.join(member) for member in allgather(place)]
        place = ':'.join(place)
        nodes = {}
        for member_place in places:
            nodes.setdefault(member_place, len(nodes))
        node_of_rank = [nodes[member_place] for member_place in places]
        leader = node_of_rank.index(nodes[place])
        token = bcast(secrets.token_bytes(_TOKEN_BYTES)
                      if comm.rank == 0 else None)
        counters = Counters(PEER_COUNTERS)
        server = None
        if comm.rank == leader:
            host = host or os.environ.get('CHAINER_PREFETCH_PEER_HOST') or \
                socket.gethostbyname(socket.gethostname())
            server = PeerServer(host, token, timeout, counters)
        served = allgather(None if server is None else server.address)
        addresses = {node_of_rank[member]: tuple(address)
                     for member, address in enumerate(served)
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

    @property
    def peers_down(self) -> Dict[int, str]:
        """Per node marked down, why."""
        with self._lock:
            return dict(self._down)

    def serve(self, lookup: Optional[Lookup]):
        """Lets this node's server answer with ``lookup`` (``None``: it holds nothing)."""
        if self.server is not None:
            self.server.lookup = lookup

    def candidates(self, index: int, epoch: int) -> List[int]:
        """The nodes to ask for ``index``'s files in ``epoch``: those that
        trained on it in the ``lookback`` epochs before, the latest first,
        not this node and none marked down."""
        found: List[int] = []
        for earlier in range(epoch - 1, max(epoch - 1 - self.lookback, -1), -1):
            job = self._job_of(earlier)
            if job is None:
                ranks, nodes = self.holders(index, earlier), self.node_of_rank
            else:
                size, places = job
                ranks = self.holders(index, earlier, size)
                nodes = [self._node_of_place.get(place) for place in places]
            for rank in ranks:
                node = nodes[rank]
                if node is not None and node != self.node and node not in found:
                    found.append(node)
        with self._lock:
            return [node for node in found
                    if node not in self._down and node in self.addresses]

    def copy(self, source: Source, origin_stat: os.stat_result, out_fd: int,
             destination: str, index: int, epoch: int) -> Optional[int]:
        """Copies ``source`` (a file of example ``index``) from a peer that holds it.

        Nodes that answer at once that they hold no current copy are passed
        over; the first that fails to answer in time, refuses or breaks the
        connection is marked down and no other is asked (one bounded wait
        per file).

        Returns:
            Bytes written, or ``None``: read the source (``out_fd`` may hold
            part of a copy then).
        """
        nodes = self.candidates(index, epoch)
        for node in nodes:
            started = time.monotonic()
            try:
                copied = self._request(node, index, source.name, out_fd,
                                       origin_stat, destination)
            except NotHeld:
                continue
            except PeerDown as error:
                waited = time.monotonic() - started
                with self._lock:
                    self._down.setdefault(node, str(error))
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
        jobs = self._earlier_jobs + [(self._start_epoch, len(self.node_of_rank),
                                      self.places or [])]
        return {'first_epochs': numpy.asarray([j[0] for j in jobs], numpy.int64),
                'sizes': numpy.asarray([j[1] for j in jobs], numpy.int64),
                'places': numpy.asarray([p for j in jobs for p in j[2]]
                                        or [''], dtype=str)}

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
        if earlier and earlier[-1][1:] == (len(self.node_of_rank),
                                           self.places or []):
            first = earlier.pop()[0]  # the same job goes on
        else:
            first = epoch
        self._earlier_jobs, self._start_epoch = earlier, first

    def _job_of(self, epoch: int) -> Optional[Tuple[int, List[str]]]:
        """``(size, places)`` of the earlier job that trained ``epoch``, or
        ``None`` when this job did."""
        if epoch >= self._start_epoch:
            return None
        for first, size, places in reversed(self._earlier_jobs):
            if first <= epoch:
                return size, places
        return None

    def _request(self, node, index, name, out_fd, origin_stat, destination):
        """:func:`request` on a kept connection to ``node``, or a new one
        (also when a kept one turns out closed by the peer)."""
        for kept in (True, False):
            connection = self._connections.take(node) if kept else None
            if kept and connection is None:
                continue
            if connection is None:
                try:
                    connection = socket.create_connection(
                        self.addresses[node], timeout=self.timeout)
                except OSError as error:
                    raise PeerDown(str(error)) from error
            try:
                copied = request(connection, self.token, index, name, out_fd,
                                 origin_stat, destination, self.timeout)
            except NotHeld as answer:
                if answer.reusable:
                    self._connections.give_back(node, connection)
                else:
                    connection.close()
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

    def stats(self) -> dict:
        """The counters, ``peer_longest_wait_seconds`` (the longest wait on
        a peer that failed) and ``peers_down`` (per node marked down, why)."""
        values = self.counters.snapshot()
        with self._lock:
            values[_LONGEST] = self._longest_wait
            values['peers_down'] = dict(self._down)
        return values


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
            if not self._closed:
                self._idle.setdefault(node, []).append(connection)
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


__all__ = ['PeerGroup', 'PeerServer', 'PeerCopy', 'PeerDown', 'NotHeld',
           'Closed', 'fetch', 'request', 'make_lookup', 'IDLE_SECONDS',
           'PEER_COUNTERS', 'MIN_BYTES_PER_SECOND']
