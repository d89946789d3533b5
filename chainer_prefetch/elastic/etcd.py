"""etcd at the edges: connecting to a job's etcd, and a local etcd daemon.

The job's address (``etcd://host:port/job``) is parsed by
:mod:`chainer_prefetch.elastic.etcd_url`, which needs no etcd client.

The Debian package ``etcd-server`` installs etcd 3.4 but does not start it.
:class:`EtcdServer` starts a private one on 127.0.0.1 (free ports, data in
a temporary directory) and stops it; tests and experiments use it, and so
can a user trying the example on one machine
(:mod:`chainer_prefetch.elastic.local_etcd`)::

    python -m chainer_prefetch.elastic.local_etcd    # prints its etcd:// URL

On a cluster, point ``--elastic`` at the site's etcd instead.
"""
import shutil
import socket
import subprocess
import tempfile
import time
from typing import List, Optional

import etcd3gw

from chainer_prefetch.elastic.errors import EtcdUnavailable
from chainer_prefetch.elastic.etcd_url import EtcdUrl

REQUEST_TIMEOUT = 2.0
"""Seconds one request to etcd may take before it counts as a failure."""


def connect(url: EtcdUrl, timeout: float) -> etcd3gw.Etcd3Client:
    """A client of the first endpoint that answers within ``timeout``.

    Raises:
        EtcdUnavailable: none answered (names the endpoints and the job).
    """
    deadline = time.monotonic() + timeout
    last_error = None
    while True:
        for host, port in url.endpoints:
            client = etcd3gw.client(host=host, port=port,
                                    timeout=REQUEST_TIMEOUT)
            try:
                client.status()
                return client
            except Exception as error:  # requests/etcd3gw errors vary
                last_error = error
        if time.monotonic() >= deadline:
            raise EtcdUnavailable(
                'etcd at {} is not reachable (tried for {:.0f} s; job {!r}): '
                'start etcd there or fix the --elastic address; last error: '
                '{}'.format(', '.join('{}:{}'.format(*e) for e in url.endpoints),
                            timeout, url.job, repr(last_error)))
        time.sleep(0.2)


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        # Like etcd: a port whose last connections are closing is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(('127.0.0.1', port))
        except OSError:
            return True
    return False


def free_ports(count: int) -> List[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(('127.0.0.1', 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class EtcdServer:
    """A private etcd daemon on 127.0.0.1 (a context manager).

    Args:
        start_timeout: Seconds to wait for it to answer.
        port: Its client port (default: a free one).

    Attributes:
        port: Its client port (after :meth:`start`).
        directory: Its temporary data directory.
        process: The ``etcd`` process.
    """

    def __init__(self, start_timeout: float = 20.0,
                 port: Optional[int] = None):
        self.start_timeout = start_timeout
        self.requested_port = port
        self.port: Optional[int] = None
        self.directory: Optional[str] = None
        self.process: Optional[subprocess.Popen] = None

    def url(self, job: str) -> str:
        """``etcd://127.0.0.1:PORT/job``."""
        return 'etcd://127.0.0.1:{}/{}'.format(self.port, job)

    def start(self) -> 'EtcdServer':
        """Starts etcd and waits until it answers.

        Raises:
            FileNotFoundError: no ``etcd`` binary (Debian: etcd-server).
            RuntimeError: it exited or did not answer in time.
        """
        if shutil.which('etcd') is None:
            raise FileNotFoundError(
                'no etcd program: install the Debian package etcd-server '
                '(scripts/apt-packages.txt)')
        self.directory = tempfile.mkdtemp(prefix='chainer_prefetch_etcd_')
        self.port, peer = free_ports(2)
        if self.requested_port:
            peer = next(p for p in free_ports(2) if p != self.requested_port)
            self.port = self.requested_port
            if _port_taken(self.port):
                raise RuntimeError(
                    'port {} on 127.0.0.1 is taken (another etcd?): choose '
                    'another --port, or none for a free one'.format(self.port))
        client_url = 'http://127.0.0.1:{}'.format(self.port)
        peer_url = 'http://127.0.0.1:{}'.format(peer)
        self.process = subprocess.Popen(
            ['etcd', '--name', 'local', '--data-dir', self.directory + '/data',
             '--listen-client-urls', client_url,
             '--advertise-client-urls', client_url,
             '--listen-peer-urls', peer_url,
             '--initial-advertise-peer-urls', peer_url,
             '--initial-cluster', 'local=' + peer_url,
             '--log-level', 'error'],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        client = etcd3gw.client(host='127.0.0.1', port=self.port, timeout=1)
        while True:
            if self.process.poll() is not None:
                error = self.process.stderr.read().decode(errors='replace')
                self.stop()
                raise RuntimeError('etcd exited at start: ' + error[-2000:])
            try:
                client.status()
                return self
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError('etcd did not answer within {} s'
                                       .format(self.start_timeout))
                time.sleep(0.05)

    def stop(self) -> None:
        """Stops etcd (SIGTERM, then SIGKILL after 5 s) and removes its
        data (idempotent)."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(5)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process.stderr.close()
            self.process = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def keys(self, prefix: str = '/') -> List[str]:
        """Keys under ``prefix`` (to check that a job left none)."""
        client = etcd3gw.client(host='127.0.0.1', port=self.port, timeout=2)
        return sorted(meta['key'].decode() if isinstance(meta['key'], bytes)
                      else meta['key'] for _, meta in client.get_prefix(prefix))

    def __enter__(self) -> 'EtcdServer':
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
