"""Stage-3 loaders as threads of the training process (``loader_threads=True``).

For datasets whose loading runs mostly outside the GIL (columnar Parquet
batches: Arrow and NumPy copies), threads save what worker processes cost:
pickling each answer, copying each batch into shared memory and out again,
and a process per loader.  :class:`LoaderThreads` has the part of
:class:`~._worker_pool.WorkerPool`'s interface the executor uses for loading
(``submit``, ``revive``, ``close``); the batches need no shared buffers, so
it has no descriptors to pass.

Shutdown: :meth:`LoaderThreads.close` tells the threads to stop and waits for
them until the deadline; a thread still inside a task then (a hung read of
shared storage) is a daemon thread and is abandoned, and its answer is never
delivered.
"""
import queue
import threading
import time
from typing import Any, Callable

Callback = Callable[[int, bool, Any], None]


class LoaderThreads:
    """Threads that run ``function(*args)`` tasks, in the order submitted.

    Args:
        n_threads (int): Number of threads.
    """

    def __init__(self, n_threads: int):
        self._tasks = queue.SimpleQueue()
        self._closed = threading.Event()
        self._threads = [threading.Thread(
            target=self._run, name='chainer_prefetch-loader-{}'.format(number),
            daemon=True) for number in range(n_threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, task_id: int, function: Callable, args: tuple,
               on_done: Callback):
        """Runs ``function(*args)`` on a thread; ``on_done(task_id, ok, value)`` gets the answer.

        ``ok`` is false and ``value`` the exception when ``function`` raised
        (any ``BaseException``: a thread that ended without an answer would
        leave its batch waiting forever).

        Args:
            task_id: Passed back to ``on_done``.
            function: Called on a thread as ``function(*args)``.
            args: Its arguments.
            on_done: Called on that thread with the answer.

        Raises:
            RuntimeError: the threads are closed.
        """
        if self._closed.is_set():
            raise RuntimeError('the loader threads are closed')
        self._tasks.put((task_id, function, args, on_done))

    def revive(self) -> bool:
        """Threads do not die as processes do: nothing to revive (``False``)."""
        return False

    def close(self, deadline: float):
        """Stops the threads by ``deadline`` (a ``time.monotonic()`` value).

        Tasks not started are dropped, and running ones abandoned: their
        callbacks are not called.  Idempotent.

        Args:
            deadline: When to stop waiting for threads still in a task.
        """
        if self._closed.is_set():
            return
        self._closed.set()
        for _ in self._threads:
            self._tasks.put(None)
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self):
        while True:
            task = self._tasks.get()
            if task is None or self._closed.is_set():
                return
            task_id, function, args, on_done = task
            try:
                ok, value = True, function(*args)
            except BaseException as error:  # SystemExit too: never a silent death
                ok, value = False, error
            if not self._closed.is_set():
                on_done(task_id, ok, value)
