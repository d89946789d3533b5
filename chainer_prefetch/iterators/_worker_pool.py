"""A small process pool for stage 3 that never loses a task.

Why not ``multiprocessing.Pool`` or ``ProcessPoolExecutor``: a ``Pool``
worker that dies takes its task with it and ``map`` waits forever, and on
Python 3.11 ``ProcessPoolExecutor(max_tasks_per_child=k)`` stalls for k > 1
(and both hang ``MultiprocessIterator(maxtasksperchild=1)`` in practice).
Here every worker has its own pipe, so the pool knows which tasks each worker
holds:

* a task is a call ``function(*args)``; its answer goes to a callback,
  ``on_done(task_id, ok, value)``, called on the collector thread;
* each worker holds at most ``TASKS_PER_WORKER`` tasks (two, so it never
  idles between tasks); the rest wait in the parent;
* a worker retires after ``max_tasks`` tasks: the pool stops giving it work,
  it exits once its answers are sent, and a fresh worker takes its place;
* a worker that dies otherwise (killed, out of memory, crashed initializer)
  fails its own tasks with :class:`~chainer_prefetch.errors.WorkerDiedError`
  naming its pid and exit code, and breaks the pool: every later task fails
  the same way, and no replacement is started until :meth:`WorkerPool.revive`
  (the iterator's ``reset()`` calls it), which replaces every worker;
* file descriptors (the shared-memory buffers) are passed to every worker,
  present and future, with :meth:`WorkerPool.share_fd`.

Start method: workers are forked (cheap, nothing to pickle) only while the
calling process runs no other Python thread; a process with threads (the
copy threads, another iterator, the user's) is not forked, because a thread
holding a lock at fork time leaves the child deadlocked.  Such workers start
from ``forkserver`` instead, or fork with a warning when the dataset cannot
be pickled.  A ``spawn`` or ``forkserver`` default is always respected.

Shutdown (:meth:`WorkerPool.close`): the collector is told to stop, workers
are terminated, then killed if still alive at the deadline; the whole close
takes at most the deadline given.  Workers also exit by themselves when the
owner process dies.
"""
import collections
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import pickle
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional

from chainer_prefetch.errors import WorkerDiedError
from chainer_prefetch.iterators import _forked_server

TASKS_PER_WORKER = 2
_POLL_SECONDS = 0.1
_PARENT_CHECK_SECONDS = 0.5

Callback = Callable[[int, bool, Any], None]


class _Worker:

    def __init__(self, process, connection):
        self.process = process
        self.connection = connection
        self.assigned = 0  # tasks sent over its life
        self.gone = False  # a send failed: the process is dying
        self.died_before_revive = False  # its death was already reported
        self.outstanding: Dict[int, Callback] = {}  # task id -> callback


class WorkerPool:
    """Processes that run ``function(*args)`` tasks; see the module docstring.

    Args:
        n_processes (int): Number of worker processes.
        initializer (callable): Run once in each worker before any task.
        initargs (tuple): Arguments of ``initializer``.
        max_tasks (int or None): Tasks a worker runs before it is replaced;
            ``None`` keeps workers for the pool's life.
    """

    def __init__(self, n_processes: int, initializer: Callable,
                 initargs: tuple, max_tasks: Optional[int] = None):
        self._n_processes = n_processes
        self._initializer = initializer
        self._initargs = initargs
        self._max_tasks = max_tasks
        self._lock = threading.Lock()
        self._workers: List[_Worker] = []
        self._waiting = collections.deque()  # (task id, call, callback)
        self._shared_fds: Dict[Any, int] = {}
        self._broken: Optional[WorkerDiedError] = None
        self._closed = False
        self._owner_pid = os.getpid()
        self._wakeup_reader, self._wakeup_writer = \
            multiprocessing.connection.Pipe(duplex=False)
        try:
            for _ in range(n_processes):
                self._workers.append(self._start_worker())
        except BaseException:
            self.close(time.monotonic() + 5)
            raise
        self._collector = threading.Thread(
            target=self._collect, name='chainer_prefetch-workers', daemon=True)
        self._collector.start()

    def submit(self, task_id: int, function: Callable, args: tuple,
               on_done: Callback):
        """Runs ``function(*args)`` in a worker; ``on_done(task_id, ok, value)`` gets the answer.

        ``ok`` is false and ``value`` the exception when ``function`` raised
        or the worker died (:class:`~chainer_prefetch.errors.WorkerDiedError`).
        """
        with self._lock:
            if self._broken is not None:
                broken = self._broken
            elif self._closed:
                raise RuntimeError('the worker pool is closed')
            else:
                self._waiting.append((task_id, (function, args), on_done))
                self._assign()
                return
        on_done(task_id, False, broken)

    def share_fd(self, key, fd: int):
        """Passes a duplicate of ``fd`` to every worker (also later ones) as ``key``.

        A worker receives it before any task submitted after this call; see
        :func:`shared_fd` for the worker's side.
        """
        with self._lock:
            self._shared_fds[key] = os.dup(fd)
            for worker in self._workers:
                self._send_fd(worker, key, self._shared_fds[key])

    def revive(self) -> bool:
        """After a worker died: starts fresh workers and accepts tasks again.

        Returns:
            Whether the pool was broken (and is revived now).
        """
        with self._lock:
            if self._broken is None or self._closed:
                return False
            # Every old worker goes: others may have been killed with the one
            # that broke the pool and not be reaped yet (or not even dead:
            # a SIGKILL takes a moment), and must not break the new pool.
            for worker in self._workers:
                worker.gone = worker.died_before_revive = True
                if worker.process.is_alive():
                    worker.process.kill()
            self._broken = None
            for _ in range(self._n_processes):
                self._workers.append(self._start_worker())
        self._wakeup_writer.send(None)  # the collector watches the new ones
        return True

    def unshare_fd(self, key):
        """Tells every worker to forget ``key`` (see :meth:`share_fd`)."""
        with self._lock:
            fd = self._shared_fds.pop(key, None)
            if fd is None:
                return
            os.close(fd)
            for worker in self._workers:
                try:
                    worker.connection.send(('drop', key))
                except OSError:
                    worker.gone = True

    def pids(self) -> List[int]:
        """Pids of the current workers."""
        with self._lock:
            return [worker.process.pid for worker in self._workers]

    def close(self, deadline: float):
        """Stops every worker by ``deadline`` (a ``time.monotonic()`` value).

        Running tasks are abandoned (their callbacks are not called).
        Idempotent, and a no-op in any process but the pool's owner.
        """
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
            self._waiting.clear()
        try:
            self._wakeup_writer.send(None)
        except OSError:
            pass
        collector = getattr(self, '_collector', None)
        if collector is not None and collector is not threading.current_thread():
            collector.join(_remaining(deadline))
        for worker in workers:
            if worker.process.is_alive():
                worker.process.terminate()
        for worker in workers:
            worker.process.join(_remaining(deadline))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(1.0)
            worker.connection.close()
        for fd in self._shared_fds.values():
            os.close(fd)
        self._shared_fds.clear()
        self._wakeup_reader.close()
        self._wakeup_writer.close()

    # ---- internals (the lock is held where noted) ---------------------------

    def _start_worker(self) -> _Worker:
        parent_end, child_end = multiprocessing.connection.Pipe()
        args = (child_end, self._initializer, self._initargs, self._max_tasks,
                os.getpid())
        process = _start_process(args)
        child_end.close()
        worker = _Worker(process, parent_end)
        for key, fd in self._shared_fds.items():
            self._send_fd(worker, key, fd)
        return worker

    def _send_fd(self, worker, key, fd):
        """(lock held)"""
        try:
            worker.connection.send(('fd', key))
            multiprocessing.reduction.send_handle(worker.connection, fd,
                                                  worker.process.pid)
        except OSError:
            worker.gone = True  # its sentinel reports it

    def _accepts_work(self, worker) -> bool:
        if worker.gone or len(worker.outstanding) >= TASKS_PER_WORKER:
            return False
        return self._max_tasks is None or worker.assigned < self._max_tasks

    def _assign(self):
        """Sends waiting tasks to workers with room (lock held)."""
        while self._waiting:
            candidates = [w for w in self._workers if self._accepts_work(w)]
            if not candidates:
                return
            worker = min(candidates, key=lambda w: len(w.outstanding))
            task_id, call, on_done = self._waiting.popleft()
            worker.outstanding[task_id] = on_done
            worker.assigned += 1
            try:
                worker.connection.send(('task', task_id) + call)
            except OSError:
                # Died since the collector last looked; its sentinel fires
                # soon and _reap fails this task with WorkerDiedError.
                worker.gone = True

    def _collect(self):
        while True:
            with self._lock:
                if self._closed:
                    return
                connections = {w.connection: w for w in self._workers}
                sentinels = {w.process.sentinel: w for w in self._workers}
            ready = multiprocessing.connection.wait(
                list(connections) + list(sentinels) + [self._wakeup_reader],
                _POLL_SECONDS)
            if self._wakeup_reader in ready:
                self._wakeup_reader.recv()
            finished = []
            for item in ready:
                if item in connections:
                    finished += self._receive(connections[item])
            for item in ready:
                if item in sentinels:
                    finished += self._reap(sentinels[item])
            for on_done, task_id, ok, value in finished:  # outside the lock
                on_done(task_id, ok, value)

    def _receive(self, worker):
        try:
            task_id, ok, value = worker.connection.recv()
        except (EOFError, OSError):
            return []  # the worker is gone; its sentinel reports it
        with self._lock:
            on_done = worker.outstanding.pop(task_id)
            self._assign()
        return [(on_done, task_id, ok, value)]

    def _reap(self, worker):
        """A worker exited: replace it if it retired, else break the pool."""
        finished = []
        while worker.connection.poll():  # answers sent just before exiting
            answer = self._receive(worker)
            if not answer:
                break
            finished += answer
        worker.process.join()
        with self._lock:
            if self._closed:
                return finished
            self._workers.remove(worker)
            worker.connection.close()
            retired = (worker.process.exitcode == 0 and not worker.outstanding
                       and self._max_tasks is not None
                       and worker.assigned >= self._max_tasks)
            if retired and self._broken is None and not worker.died_before_revive:
                try:
                    self._workers.append(self._start_worker())
                except Exception as error:  # e.g. out of memory
                    self._broken = WorkerDiedError(
                        'cannot start a replacement worker: {}'.format(error))
            died = WorkerDiedError(
                'worker process {} exited with code {} holding {} task(s)'.format(
                    worker.process.pid, worker.process.exitcode,
                    len(worker.outstanding)))
            if worker.died_before_revive:  # only its own tasks fail
                finished += [(on_done, task_id, False, died)
                             for task_id, on_done in worker.outstanding.items()]
            elif not retired or self._broken is not None:
                self._broken = self._broken or died
                lost = [(on_done, task_id) for task_id, on_done
                        in worker.outstanding.items()]
                lost += [(on_done, task_id) for task_id, _, on_done
                         in self._waiting]
                self._waiting.clear()
                finished += [(on_done, task_id, False, self._broken)
                             for on_done, task_id in lost]
            self._assign()
        return finished


def _start_process(args) -> multiprocessing.process.BaseProcess:
    """Starts one worker process, never forking a process that runs other threads."""
    method = multiprocessing.get_start_method()
    if method == 'fork' and threading.active_count() > 1:
        method = 'forkserver'
    elif method == 'fork' and _forked_server.main_needs_it():
        # Later loaders (another iterator's, replacements) may have to come
        # from the fork server: fork it now, while no thread runs.
        _forked_server.fork_server_now()
    if method == 'forkserver':
        _preload_worker_code()
        if _forked_server.serving():
            args = _main_by_value(args)
    context = multiprocessing.get_context(method)
    process = context.Process(target=_worker_main, args=args,
                              name='chainer_prefetch-worker', daemon=True)
    try:
        process.start()
    except (TypeError, AttributeError, multiprocessing.reduction.pickle.PicklingError
            ) as error:
        if method == multiprocessing.get_start_method():
            raise
        warnings.warn('the dataset cannot be pickled ({}), so a loader '
                      'process is forked from a process that runs other '
                      'threads, which may deadlock it; make the dataset '
                      'picklable to avoid this'.format(error), RuntimeWarning)
        process = multiprocessing.get_context('fork').Process(
            target=_worker_main, args=args, name='chainer_prefetch-worker',
            daemon=True)
        process.start()
    return process


def _main_by_value(args):
    """``args`` with the initializer's arguments pickled by value where they
    come from the main module.

    The forked fork server holds the main module as it was when it started:
    a class defined (or defined again, as a notebook cell run twice does)
    after that is not there, or is the old one.  ``cloudpickle`` sends such
    classes and functions themselves; everything else goes by reference.
    """
    import cloudpickle
    connection, initializer, initargs, max_tasks, owner_pid = args
    return (connection, _load_and_call,
            (cloudpickle.dumps((initializer, initargs)),), max_tasks,
            owner_pid)


def _load_and_call(pickled: bytes) -> None:
    """In a worker: runs the initializer :func:`_main_by_value` packed."""
    initializer, initargs = pickle.loads(pickled)
    initializer(*initargs)


def start_loader_server() -> None:
    """Starts, in the background, the fork server that loader processes come from.

    A process that runs threads (MPI progress threads, an etcd keep-alive,
    another iterator's copy threads) cannot safely fork its loaders, so they
    come from a fork server; the first iterator that needs it starts it and
    waits for it to import Chainer and this package (about a second on a
    loaded node).  Calling this early (before MPI is initialised, before an
    elastic member registers) does that import meanwhile.  With the ``fork``
    start method and no thread running yet, the server is forked from this
    process instead (:mod:`._forked_server`): nothing to import, and no main
    guard needed.  Safe to call more than once; the server lives as long as
    this process.
    """
    if _forked_server.fork_server_now():
        return
    _preload_worker_code()
    multiprocessing.forkserver.ensure_running()


def _preload_worker_code():
    """Has the fork server import this package once, so its workers start in milliseconds.

    Adds to the modules the user asked the server to preload; has no effect
    once the server runs.
    """
    server = getattr(multiprocessing.forkserver, '_forkserver', None)
    modules = list(getattr(server, '_preload_modules', None) or ['__main__'])
    if __name__ not in modules:
        multiprocessing.forkserver.set_forkserver_preload(modules + [__name__])


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


# ---- the worker process ---------------------------------------------------------

_shared_fds: Dict[Any, int] = {}
_on_drop: List[Callable[[Any], None]] = []  # called with a dropped key


def shared_fd(key) -> int:
    """In a worker: the descriptor the pool shared as ``key`` (see ``share_fd``)."""
    return _shared_fds[key]


def on_drop(forget: Callable[[Any], None]):
    """In a worker: calls ``forget(key)`` when the pool drops a shared descriptor."""
    if forget not in _on_drop:
        _on_drop.append(forget)


def _worker_main(connection, initializer, initargs, max_tasks, owner_pid):
    """Loop of a worker process: run tasks until told to stop or retired."""
    _forked_server.forget_inherited()
    threading.Thread(target=_exit_when_orphaned, args=(owner_pid,),
                     name='exit-with-owner', daemon=True).start()
    initializer(*initargs)
    done = 0
    while max_tasks is None or done < max_tasks:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message[0] == 'fd':
            _shared_fds[message[1]] = multiprocessing.reduction.recv_handle(
                connection)
            continue
        if message[0] == 'drop':
            os.close(_shared_fds.pop(message[1]))
            for forget in _on_drop:
                forget(message[1])
            continue
        _, task_id, function, args = message
        try:
            answer = (task_id, True, function(*args))
        except Exception as error:
            answer = (task_id, False, error)
        try:
            connection.send(answer)
        except Exception as error:  # e.g. an unpicklable result
            connection.send((task_id, False, RuntimeError(
                'cannot send the result back: {}\n{}'.format(
                    error, traceback.format_exc()))))
        done += 1
    connection.close()


def _exit_when_orphaned(owner_pid):
    """A SIGKILLed owner cannot stop its workers: they notice and leave."""
    parent = os.getppid()
    while True:
        time.sleep(_PARENT_CHECK_SECONDS)
        if os.getppid() != parent or not _alive(owner_pid):
            os._exit(1)


def _alive(pid) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
