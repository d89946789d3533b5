"""Python's fork server, but forked from this process instead of started anew.

Loader processes are never forked from a process that runs threads; they
then come from :mod:`multiprocessing.forkserver`.  Python starts that server
as a new interpreter that imports the main module again (``__mp_main__``):
a script without ``if __name__ == '__main__':`` then runs its training a
second time inside the server, and classes defined in ``python -c`` code or
a notebook cannot be found when a loader unpickles the dataset.

With the ``fork`` start method, :func:`fork_server_now` instead forks the
server from this process while it still runs no other thread: the server
(and every loader it forks later) has the main module as it is, imports
included, so nothing is imported again and a loader starts in milliseconds.
It is the same server program (``multiprocessing.forkserver.main``) and
protocol; only its start differs.  Where this process already runs threads,
or the start method is ``forkserver`` or ``spawn`` (chosen to keep the
loaders away from this process's state), Python's own start is left alone.
"""
import ctypes
import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import re
import signal
import socket
import sys
import threading
from multiprocessing import util

NAME = b'cp-forkserver'
"""The server's process name (``/proc/PID/comm``, ``ps -o comm``)."""

_GUARD = re.compile(r"""__name__\s*==\s*['"]__main__['"]""")


@functools.lru_cache(maxsize=None)  # (the main module does not change)
def main_needs_it() -> bool:
    """Whether Python's own fork server cannot serve this main module: code
    from ``python -c``, a notebook or the interactive prompt (no file to
    import), or a script without a main guard (importing it trains)."""
    path = getattr(sys.modules.get('__main__'), '__file__', None)
    if path is None:
        return True
    try:
        with open(path, errors='replace') as script:
            return _GUARD.search(script.read()) is None
    except OSError:  # (standard input, a file since removed)
        return True


def fork_server_now() -> bool:
    """Forks the fork server from this process if it is safe and useful now.

    Returns:
        Whether the server now running was forked from this process.
    """
    if multiprocessing.get_start_method() != 'fork' \
            or threading.active_count() > 1:
        return False
    server = multiprocessing.forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            pid, _ = os.waitpid(server._forkserver_pid, os.WNOHANG)
            if not pid:
                return getattr(server, '_chainer_prefetch_forked', False)
            os.close(server._forkserver_alive_fd)
            server._forkserver_address = server._forkserver_alive_fd = None
            server._forkserver_pid = None
        multiprocessing.resource_tracker.ensure_running()
        if threading.active_count() > 1:  # (the tracker starts no thread)
            return False
        with socket.socket(socket.AF_UNIX) as listener:
            address = multiprocessing.connection.arbitrary_address('AF_UNIX')
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            # Every client holds the write end of the "alive" pipe: the
            # server ends when the read end sees all of them gone.
            alive_r, alive_w = os.pipe()
            try:
                pid = os.fork()
            except BaseException:
                os.close(alive_r)
                os.close(alive_w)
                raise
            if pid == 0:  # the server
                _serve(listener.fileno(), alive_r, alive_w)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
        server._chainer_prefetch_forked = True
    return True


def serving() -> bool:
    """Whether the fork server now running was forked from this process."""
    server = multiprocessing.forkserver._forkserver
    return (server._forkserver_pid is not None
            and getattr(server, '_chainer_prefetch_forked', False))


def forget_inherited() -> None:
    """In a process forked from a fork server's client: closes the client's
    end of the server's "alive" pipe, so the server ends with its client."""
    server = multiprocessing.forkserver._forkserver
    fd = server._forkserver_alive_fd
    if fd is not None:
        server._forkserver_alive_fd = None
        server._forkserver_address = server._forkserver_pid = None
        try:
            os.close(fd)
        except OSError:
            pass


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The forked server's life; never returns."""
    code = 1
    try:
        os.close(alive_w)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:  # PR_SET_NAME: tell it apart from the training process
            ctypes.CDLL(None).prctl(15, ctypes.c_char_p(NAME), 0, 0, 0)
        except (OSError, AttributeError):
            pass
        _main_file_as_clients_name_it()
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
        code = 0
    finally:
        os._exit(code)


def _main_file_as_clients_name_it() -> None:
    """In the server: gives the main module the absolute ``__file__`` its
    clients send with every start, so that a loader takes the main module it
    has as that file instead of running it again (for ``python -`` the name
    ``<stdin>`` becomes a path that does not exist)."""
    main = sys.modules.get('__main__')
    path = getattr(main, '__file__', None)
    original = multiprocessing.process.ORIGINAL_DIR
    if path is not None and not os.path.isabs(path) and original is not None:
        main.__file__ = os.path.normpath(os.path.join(original, path))
