"""Code that runs in the stage-3 worker processes.

Each worker holds two views of the dataset: the original one (reads shared
storage) and the located one (reads the local copies; see
:mod:`chainer_prefetch.staging.dataset_files`).  The parent decides per
example which one to use: the located view only once stage 2 has every file
of that example in place, so a worker never opens a file still being written.

Arrays travel back through shared memory when the parent gave a buffer, in
the same packed format as :class:`chainer.iterators.MultiprocessIterator`.
"""
import mmap
import os
import signal
import threading
import time
import traceback

import _posixshmem  # what multiprocessing.shared_memory opens segments with

from chainer.iterators.multiprocess_iterator import _pack

from chainer_prefetch.errors import ExampleLoadError

_PARENT_CHECK_SECONDS = 0.5

_original_dataset = None
_located_dataset = None
_attached_buffers = {}


def initialize_worker(original_dataset, located_dataset):
    """Pool initializer: keeps the datasets and ties the worker's life to its parent.

    Args:
        original_dataset: The dataset as the user gave it.
        located_dataset: The view reading local copies, or ``None``.
    """
    global _original_dataset, _located_dataset
    # Ctrl-C goes to the whole process group; the parent owns shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _original_dataset = original_dataset
    _located_dataset = located_dataset
    parent = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent,),
                     name='exit-with-parent', daemon=True).start()


def _exit_when_orphaned(parent_pid):
    # A SIGKILLed parent cannot stop its workers; they notice and leave.
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_CHECK_SECONDS)
    os._exit(1)


def load_examples(tasks, buffer_name):
    """Loads examples, packing their arrays into shared memory if given.

    When the local copies cannot be read (another process sharing the
    directory evicted one after stage 2 checked it), an example is loaded
    from shared storage instead.

    Args:
        tasks: ``(index, use_local_copies, offset, limit)`` per example:
            the index into the dataset, whether to read through the located
            view, and the example's region ``[offset, limit)`` in the buffer.
        buffer_name (str or None): Name of the shared memory buffer of the
            examples' batch; ``None`` to return arrays by pickling.

    Returns:
        One ``((example, read_locally), None)`` per task, or, from the first
        example that fails, ``(None, ExampleLoadError)`` (with the
        traceback in its message) and nothing after it.
    """
    results = []
    for index, use_local_copies, offset, limit in tasks:
        example = None
        if use_local_copies:
            try:
                example = _located_dataset[index]
            except Exception:
                use_local_copies = False  # the source's error is the one to report
        if not use_local_copies:
            try:
                example = _original_dataset[index]
            except Exception as error:
                results.append((None, ExampleLoadError('{}: {}\n{}'.format(
                    type(error).__name__, error, traceback.format_exc()))))
                break
        if buffer_name is not None:
            example = _pack(example, _attach(buffer_name), offset, limit)
        results.append(((example, use_local_copies), None))
    return results


def _attach(name):
    """Maps the parent's shared memory segment ``name`` into this process.

    ``SharedMemory(name=...)`` would register the segment with a resource
    tracker of this worker (Python < 3.13), which unlinks it when the worker
    exits: the parent's buffer would vanish under it.  The parent alone owns
    the segment, so map it here without registering.
    """
    buffer = _attached_buffers.get(name)
    if buffer is None:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            buffer = memoryview(mmap.mmap(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)
        _attached_buffers[name] = buffer
    return buffer
