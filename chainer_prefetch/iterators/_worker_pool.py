"""A small process pool for stage 3 that never loses a task.

Why not ``multiprocessing.Pool`` or ``ProcessPoolExecutor``: a ``Pool``
worker that dies takes its task with it and ``map`` waits forever, and on
Python 3.11 ``ProcessPoolExecutor(max_tasks_per_child=k)`` stalls for k > 1
(and both hang ``MultiprocessIterator(maxtasksperchild=1)`` in practice).
Here every worker has its own pipe, so the pool knows which tasks each worker
holds:

* a task is a call ``function(*args)`` answered by a
  :class:`concurrent.futures.Future`;
* each worker holds at most ``TASKS_PER_WORKER`` tasks (two, so it never
  idles between tasks); the rest wait in the parent;
* a worker retires after ``max_tasks`` tasks: the pool stops giving it work,
  it exits once its answers are sent, and a fresh worker takes its place;
* a worker that dies otherwise (killed, out of memory, crashed initializer)
  fails its own tasks with :class:`WorkerDiedError` naming its pid and exit
  code, and breaks the pool: every later task fails the same way, and no
  replacement is started (a crashing initializer would crash again).

One collector thread receives answers and watches the workers' sentinels.
"""
import collections
import concurrent.futures
import itertools
import multiprocessing
import multiprocessing.connection
import os
import threading
import traceback

TASKS_PER_WORKER = 2
_POLL_SECONDS = 0.1
_STOP_SECONDS = 5.0


class WorkerDiedError(RuntimeError):
    """A worker process ended without answering its tasks."""


class _Worker:

    def __init__(self, process, connection):
        self.process = process
        self.connection = connection
        self.assigned = 0  # tasks sent over its life
        self.gone = False  # a send failed: the process is dying
        self.outstanding = {}  # task id -> future


class WorkerPool:
    """Processes that run ``function(*args)`` tasks; see the module docstring.

    Args:
        n_processes (int): Number of worker processes.
        initializer (callable): Run once in each worker before any task.
        initargs (tuple): Arguments of ``initializer``.
        max_tasks (int or None): Tasks a worker runs before it is replaced;
            ``None`` keeps workers for the pool's life.
        context: A ``multiprocessing`` context (start method).
    """

    def __init__(self, n_processes, initializer, initargs, max_tasks=None,
                 context=None):
        self._context = context or multiprocessing.get_context()
        self._initializer = initializer
        self._initargs = initargs
        self._max_tasks = max_tasks
        self._lock = threading.Lock()
        self._workers = []
        self._waiting = collections.deque()  # (task id, future, call)
        self._task_ids = itertools.count()
        self._broken = None
        self._closed = False
        self._owner_pid = os.getpid()
        for _ in range(n_processes):
            self._workers.append(self._start_worker())
        self._wakeup_reader, self._wakeup_writer = \
            multiprocessing.connection.Pipe(duplex=False)
        self._collector = threading.Thread(
            target=self._collect, name='chainer_prefetch-workers', daemon=True)
        self._collector.start()

    def submit(self, function, *args) -> concurrent.futures.Future:
        """Runs ``function(*args)`` in a worker.

        Returns:
            A future for the result.  It fails with :class:`WorkerDiedError`
            if the worker died, or with the exception ``function`` raised.
        """
        future = concurrent.futures.Future()
        with self._lock:
            if self._broken is not None:
                future.set_exception(self._broken)
                return future
            if self._closed:
                raise RuntimeError('the worker pool is closed')
            self._waiting.append((next(self._task_ids), future,
                                  (function, args)))
            self._assign()
        return future

    def pids(self):
        """Pids of the current workers."""
        with self._lock:
            return [worker.process.pid for worker in self._workers]

    def close(self):
        """Stops every worker now (running tasks are abandoned).

        Idempotent, and a no-op in any process but the pool's owner.
        """
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
            futures = [future for worker in workers
                       for future in worker.outstanding.values()]
            futures += [future for _, future, _ in self._waiting]
            self._waiting.clear()
        self._wakeup_writer.send(None)
        if self._collector is not threading.current_thread():
            self._collector.join(_STOP_SECONDS)
        for worker in workers:
            if worker.process.is_alive():
                worker.process.terminate()
        for worker in workers:
            worker.process.join(_STOP_SECONDS)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.connection.close()
        self._wakeup_reader.close()
        self._wakeup_writer.close()
        for future in futures:
            future.cancel()

    # ---- internals (the lock is held where noted) ---------------------------

    def _start_worker(self) -> _Worker:
        parent_end, child_end = multiprocessing.connection.Pipe()
        process = self._context.Process(
            target=_worker_main,
            args=(child_end, self._initializer, self._initargs,
                  self._max_tasks),
            name='chainer_prefetch-worker', daemon=True)
        process.start()
        child_end.close()
        return _Worker(process, parent_end)

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
            task_id, future, call = self._waiting.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            worker.outstanding[task_id] = future
            worker.assigned += 1
            try:
                worker.connection.send((task_id,) + call)
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
            for future, ok, value in finished:  # outside the lock
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)

    def _receive(self, worker):
        try:
            task_id, ok, value = worker.connection.recv()
        except (EOFError, OSError):
            return []  # the worker is gone; its sentinel reports it
        with self._lock:
            future = worker.outstanding.pop(task_id)
            self._assign()
        return [(future, ok, value)]

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
            if retired and self._broken is None:
                self._workers.append(self._start_worker())
            else:
                self._broken = self._broken or WorkerDiedError(
                    'worker process {} exited with code {} holding {} '
                    'task(s)'.format(worker.process.pid,
                                     worker.process.exitcode,
                                     len(worker.outstanding)))
                lost = list(worker.outstanding.values())
                lost += [future for _, future, _ in self._waiting]
                self._waiting.clear()
                finished += [(future, False, self._broken) for future in lost]
            self._assign()
        return finished


def _worker_main(connection, initializer, initargs, max_tasks):
    """Loop of a worker process: run tasks until told to stop or retired."""
    initializer(*initargs)
    done = 0
    while max_tasks is None or done < max_tasks:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        task_id, function, args = message
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
