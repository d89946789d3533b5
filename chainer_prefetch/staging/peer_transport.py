"""How a node's copies travel to another node: a small TCP server per node and its requests.

Protocol (one request after another on a kept connection):

* request: ``CPP1``, the job's 32-byte token, the example (item), the size
  and modification time (ns) of the source as the asking node sees it, and
  the source's path;
* reply: a status and the size and modification time of the copy; with
  ``SERVED``, exactly that many bytes follow, sent with ``sendfile``.

The server answers ``SERVED`` only with a regular file (not a symlink)
under its local directory that is the copy of that source of that example
(``lookup``) and has the size and time asked for; ``NOT_HELD`` otherwise,
at once, so a stale or missing copy costs no transfer.  A request without
the job's token is ``REFUSED`` and its connection closed.

Every wait is bounded: the asking side waits at most ``timeout`` to
connect and for each part of the reply, and for the whole file at most
``timeout`` plus its size at :data:`MIN_BYTES_PER_SECOND`; the server gives
a request ``timeout`` to arrive whole, and closes a connection idle for
:data:`IDLE_SECONDS`.
"""
import contextlib
import hmac
import os
import socket
import socketserver
import stat
import struct
import threading
import time
from typing import Callable, Optional, Tuple

from chainer_prefetch.errors import ChainerPrefetchError, LocalStorageError
from chainer_prefetch.staging.counters import Counters
from chainer_prefetch.staging.sources import local_error

MAGIC = b'CPP1'
TOKEN_BYTES = 32
# magic, token, item, size, mtime_ns, the path's length
_REQUEST = struct.Struct('<4s32sqqqH')
_REPLY = struct.Struct('<Bqq')  # status, size, mtime_ns
SERVED, NOT_HELD, REFUSED = 0, 1, 2
_MAX_NAME_BYTES = 4096
_RECEIVE_BYTES = 1 << 20
#: Seconds a server keeps a connection open without a request.
IDLE_SECONDS = 120.0
#: The slowest whole-file rate a peer may keep before the copy gives up.
MIN_BYTES_PER_SECOND = 1 << 20

#: ``lookup(item, name)``: the local path of the copy of the source ``name``
#: of ``item``, or ``None`` (not one of its sources, or no copy here).
Lookup = Callable[[int, str], Optional[str]]


class PeerDown(ChainerPrefetchError):
    """The peer did not answer in time, refused the connection or the
    request, or broke the connection (stage 2 reads the source then; it
    does not reach the user)."""


class Closed(PeerDown):
    """The connection was closed or reset before any byte of the reply (a
    kept connection the peer had closed: worth one new connection)."""


class TooSlow(PeerDown):
    """The peer sent, but not the whole file by its deadline."""


class NotHeld(ChainerPrefetchError):
    """The peer answered at once that it has no current copy (stage 2 asks
    the next peer or reads the source; it does not reach the user)."""


class PeerServer:
    """Serves this node's local copies to the job's other members.

    A thread accepts connections; each connection gets a thread that
    answers its requests until the connection closes or idles.
    :meth:`close` ends them all.

    Args:
        host: Address to listen on.
        token: The job's token; a request without it is refused.
        timeout: Seconds a request may take to arrive, and each send.
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
        self._lock = threading.Lock()
        self._closing = False
        self._server = _TCPServer((host, 0), _Handler)
        self._server.peer_server = self
        self.address: Tuple[str, int] = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name='peer-server', daemon=True)
        self._thread.start()

    def close(self):
        """Stops accepting, ends every connection, and waits for their threads."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            connections = list(self._connections)
        self._server.shutdown()
        for connection in connections:
            _shut(connection)  # its thread's wait for a request ends at once
        self._server.server_close()  # joins the connections' threads
        self._thread.join()

    def answer_all(self, connection: socket.socket):
        """Answers the requests that come on ``connection`` until it closes."""
        with self._lock:
            if self._closing:
                return
            self._connections.add(connection)
        try:
            # The reply's header and the file go out at once, not held back
            # for the header's acknowledgement (Nagle's algorithm).
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                connection.settimeout(IDLE_SECONDS)
                first = connection.recv(1)
                if not first or not self.answer(connection, first):
                    return
        finally:
            with self._lock:
                self._connections.discard(connection)

    def answer(self, connection: socket.socket, first: bytes) -> bool:
        """Answers one request on ``connection`` (whose first byte was ``first``).

        Returns:
            Whether the connection may carry another request.
        """
        deadline = time.monotonic() + self.timeout
        head = first + receive_exactly(connection, _REQUEST.size - 1,
                                       deadline, self.timeout)
        magic, token, item, size, mtime_ns, name_length = _REQUEST.unpack(head)
        if (magic != MAGIC or not hmac.compare_digest(token, self.token)
                or name_length > _MAX_NAME_BYTES):
            self.counters.add(peer_requests_refused=1)
            connection.sendall(_REPLY.pack(REFUSED, 0, 0))
            return False
        name = receive_exactly(connection, name_length, deadline,
                               self.timeout).decode('utf-8', 'surrogateescape')
        lookup = self.lookup
        try:
            path = None if lookup is None else lookup(item, name)
        except Exception:  # the dataset's error for this example only
            path = None
        fd = None if path is None else _open_regular(path)
        if fd is None:
            connection.sendall(_REPLY.pack(NOT_HELD, 0, 0))
            return True
        with os.fdopen(fd, 'rb') as copy:
            info = os.fstat(copy.fileno())
            if (info.st_size, info.st_mtime_ns) != (size, mtime_ns):
                connection.sendall(_REPLY.pack(NOT_HELD, 0, 0))  # stale
                return True
            connection.sendall(_REPLY.pack(SERVED, info.st_size,
                                           info.st_mtime_ns))
            sent = connection.sendfile(copy, 0, info.st_size)
        self.counters.add(files_served=1, bytes_served=sent)
        return sent == info.st_size


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True  # an unclosed server does not hold up the exit
    block_on_close = True  # close() still waits for them
    allow_reuse_address = True
    request_queue_size = socket.SOMAXCONN


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        try:
            self.server.peer_server.answer_all(self.request)
        except (OSError, struct.error, PeerDown):
            pass  # the client sees a short reply and reads the source


def _shut(connection: socket.socket):
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


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
        TooSlow: the file did not arrive whole by its deadline.
        PeerDown: no answer in time, a broken connection, a request
            refused, or a reply out of step.
        NotHeld: the peer has no current copy (the connection may carry
            another request).
        LocalStorageError: ``out_fd`` cannot be written.
    """
    size = origin_stat.st_size
    deadline = time.monotonic() + timeout + size / MIN_BYTES_PER_SECOND
    encoded = name.encode('utf-8', 'surrogateescape')
    try:
        try:
            connection.settimeout(timeout)
            connection.sendall(_REQUEST.pack(
                MAGIC, token, item, size, origin_stat.st_mtime_ns,
                len(encoded)) + encoded)
            first = connection.recv(_REPLY.size)
        except (ConnectionResetError, BrokenPipeError) as error:
            raise Closed(str(error)) from error
        if not first:
            raise Closed('connection closed')
        status, served_size, mtime_ns = _REPLY.unpack(
            first + receive_exactly(connection, _REPLY.size - len(first),
                                    deadline, timeout))
        if status == NOT_HELD:
            raise NotHeld()
        if status == REFUSED:
            raise PeerDown('the request was refused (not the job\'s token?)')
        if status != SERVED or (served_size, mtime_ns) != (
                size, origin_stat.st_mtime_ns):
            raise PeerDown('a reply out of step (status {}, {} bytes)'.format(
                status, served_size))
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
        As :func:`request` (``PeerDown`` also when no connection is made).
    """
    with connect(address, timeout) as connection:
        return request(connection, token, item, name, out_fd, origin_stat,
                       destination, timeout)


def connect(address: Tuple[str, int], timeout: float) -> socket.socket:
    """A new connection to ``address``.

    Raises:
        PeerDown: refused, or not made within ``timeout``.
    """
    try:
        return socket.create_connection(address, timeout=timeout)
    except OSError as error:
        raise PeerDown(str(error)) from error


def receive_exactly(connection: socket.socket, n_bytes: int,
                    deadline: float, timeout: float) -> bytes:
    """``n_bytes`` from ``connection`` by ``deadline`` (``PeerDown`` if it ends first)."""
    data = bytearray()
    while len(data) < n_bytes:
        with _bounded(connection, deadline, timeout):
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
        with _bounded(connection, deadline, timeout):
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


@contextlib.contextmanager
def _bounded(connection, deadline, timeout):
    """Waits in the block for ``timeout`` at most, and never past ``deadline``.

    Raises:
        TooSlow: the deadline passed (the peer was sending, but slowly).
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise TooSlow('not all of the reply within the deadline')
    connection.settimeout(min(timeout, left))
    try:
        yield
    except TimeoutError as error:
        if left < timeout:  # the deadline, not the peer's silence, ended it
            raise TooSlow('not all of the reply within the deadline') \
                from error
        raise
