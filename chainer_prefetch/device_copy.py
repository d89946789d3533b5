"""Copy the next minibatch to the GPU while the current one trains.

The role of PyTorch's ``pin_memory`` thread, for Chainer's updaters: when
the trainer takes minibatch *k* from the iterator, minibatch *k + 1* is
taken too, concatenated on the host (``concat_examples``) into page-locked
(*pinned*) host memory, and its host-to-device copy is issued on a separate
CUDA stream.  The copy then runs while the device computes minibatch *k*,
and the converter of minibatch *k + 1* only makes the compute stream wait
for that copy's event (pageable memory would force a synchronous copy)::

    train_iter = StagedDeviceCopy(
        PrefetchMultiprocessIterator(train, 32, ...), device)
    updater = StandardUpdater(train_iter, optimizer,
                              converter=train_iter.converter, device=device)

On a CPU device (``@numpy``) there is nothing to copy: the wrapper passes
batches straight through and :attr:`StagedDeviceCopy.mode` says so.

What the wrapper keeps exact, although it runs one minibatch ahead:

* ``epoch``, ``epoch_detail``, ``previous_epoch_detail``, ``is_new_epoch``
  and ``current_position`` are those of the minibatch last *delivered*, as
  the inner iterator reported them right after producing it;
* ``serialize`` writes the inner iterator's state from before the staged
  minibatch was taken, so a snapshot resumes with that minibatch, not after
  it; loading a snapshot drops the staged minibatch;
* ``finalize`` finalizes the inner iterator; an exception while staging
  reaches the caller of ``next()`` that asked for that minibatch.

The staging runs on the trainer's thread: the host work for minibatch
*k + 1* (waiting for the inner iterator, concatenating into pinned memory)
happens before minibatch *k*'s kernels are queued, while the device is still
busy with what was queued before; only the device copy itself overlaps.
"""
from typing import Any, Callable, Dict, List, Optional

import numpy
from chainer import serializer as serializer_module
from chainer.dataset import convert
from chainer.dataset import iterator as iterator_module
from chainer.serializers import DictionarySerializer

_EPOCH_ATTRIBUTES = ('epoch', 'epoch_detail', 'previous_epoch_detail',
                     'is_new_epoch', 'current_position')


class _StagedBatch(object):
    """A minibatch converted to device arrays, whose copy may be in flight.

    Attributes:
        arrays: The converted minibatch (array, tuple or dict of arrays) on
            the target device.
        ready: The event recorded after the copy (``None``: already done).
        epoch_state: The inner iterator's epoch attributes right after it
            produced this minibatch.
        state_before: The inner iterator's serialized state before it
            produced this minibatch.
    """

    def __init__(self, arrays, ready, epoch_state, state_before):
        self.arrays = arrays
        self.ready = ready
        self.epoch_state = epoch_state
        self.state_before = state_before


class _HostBackend(object):
    """Staging into host buffers (the device is the CPU): for tests only.

    The same double-buffered copies as on a GPU, with NumPy arrays standing
    in for pinned memory and device arrays, and no streams or events.
    """

    name = 'host'

    def empty_pinned(self, shape, dtype):
        return numpy.empty(shape, dtype)

    def copy_to_device(self, pinned):
        return pinned.copy(), None

    def wait(self, event):
        pass


class _CupyBackend(object):
    """Pinned host buffers, a side stream and events of one CUDA device."""

    name = 'cupy'

    def __init__(self, device):
        import cupy
        self._cupy = cupy
        self._device = device
        with device.device:
            self._stream = cupy.cuda.Stream(non_blocking=True)

    def empty_pinned(self, shape, dtype):
        dtype = numpy.dtype(dtype)
        count = int(numpy.prod(shape))
        memory = self._cupy.cuda.alloc_pinned_memory(max(1, count) *
                                                     dtype.itemsize)
        return numpy.frombuffer(memory, dtype, count).reshape(shape)

    def copy_to_device(self, pinned):
        with self._device.device, self._stream:
            array = self._cupy.empty(pinned.shape, pinned.dtype)
            array.set(pinned, stream=self._stream)
            return array, self._stream.record()

    def wait(self, event):
        if event is not None:
            self._cupy.cuda.get_current_stream().wait_event(event)


class StagedDeviceCopy(iterator_module.Iterator):
    """An iterator wrapper that stages the next minibatch on the device.

    Args:
        iterator: The training iterator (any Chainer iterator).
        device: The device the model runs on (``chainer.get_device(...)``).
            With a CPU device the wrapper is a pass-through.
        converter: Turns a list of examples into arrays on the host
            (default ``concat_examples``); called with ``device=None``.
        padding: ``padding`` of ``concat_examples``.

    Attributes:
        mode: What the wrapper does, for logs: ``'pinned copy on a side
            stream'`` or ``'pass-through (CPU device: nothing to copy)'``.
    """

    def __init__(self, iterator, device, converter: Callable = None,
                 padding: Any = None, _backend=None) -> None:
        self.iterator = iterator
        self.device = device
        self._host_converter = converter or convert.concat_examples
        self._padding = padding
        if _backend is not None:
            self._backend = _backend
        elif getattr(device, 'xp', numpy) is not numpy:
            self._backend = _CupyBackend(device)
        else:
            self._backend = None
        self.mode = ('pass-through (CPU device: nothing to copy)'
                     if self._backend is None else
                     'pinned copy on a side stream' if self._backend.name ==
                     'cupy' else 'staged into host buffers')
        self._pending: Optional[_StagedBatch] = None
        self._ended = False
        self._delivered: Dict[str, Any] = {}
        self._pinned: Dict[Any, List[numpy.ndarray]] = {}
        self._turn = 0

    # ---------------------------------------------------------- iteration

    def __next__(self):
        if self._backend is None:
            return self.iterator.next()
        if self._pending is None and not self._ended:
            self._pending = self._stage()
        if self._pending is None:
            raise StopIteration
        current = self._pending
        self._pending = None
        self._delivered = current.epoch_state
        if not self._ended:
            self._pending = self._stage()  # its copy overlaps this batch
        return current

    next = __next__

    def _stage(self) -> Optional[_StagedBatch]:
        state_before = self._inner_state()
        try:
            batch = self.iterator.next()
        except StopIteration:
            self._ended = True
            return None
        epoch_state = {name: getattr(self.iterator, name, None)
                       for name in _EPOCH_ATTRIBUTES}
        host = self._host_converter(batch, None, self._padding)
        self._turn ^= 1  # two buffers: the other may still be copying
        arrays, events = [], []

        def stage_array(key, array):
            pinned = self._pinned_buffer(key, array)
            numpy.copyto(pinned, array)
            on_device, event = self._backend.copy_to_device(pinned)
            events.append(event)
            return on_device

        arrays = _map_arrays(host, stage_array)
        return _StagedBatch(arrays, events[-1] if events else None,
                            epoch_state, state_before)

    def _pinned_buffer(self, key, array):
        slot = (key, array.shape, array.dtype.str, self._turn)
        if slot not in self._pinned:
            self._pinned[slot] = self._backend.empty_pinned(array.shape,
                                                            array.dtype)
        return self._pinned[slot]

    def converter(self, batch, device=None):
        """The updater's converter: arrays of a minibatch on the device.

        Args:
            batch: What :meth:`next` returned (a staged minibatch, or a list
                of examples in pass-through mode).
            device: The target device (used in pass-through mode).

        Returns:
            The minibatch's arrays on the device.
        """
        if isinstance(batch, _StagedBatch):
            self._backend.wait(batch.ready)
            return batch.arrays
        return convert.concat_examples(batch, device, self._padding)

    # ---------------------------------------------------------- state

    def _inner_state(self) -> Dict[str, Any]:
        target: Dict[str, Any] = {}
        self.iterator.serialize(DictionarySerializer(target))
        return target

    def serialize(self, serializer) -> None:
        """Write the state a resume needs, or load one.

        Args:
            serializer: A Chainer serializer or deserializer.
        """
        if isinstance(serializer, serializer_module.Deserializer):
            self.iterator.serialize(serializer)
            self._pending = None
            self._ended = False
            self._delivered = {}
            return
        if self._pending is None:
            self.iterator.serialize(serializer)
            return
        for key, value in self._pending.state_before.items():
            serializer(key, value)

    def reset(self) -> None:
        """Reset the inner iterator and drop the staged minibatch."""
        self.iterator.reset()
        self._pending = None
        self._ended = False
        self._delivered = {}

    def finalize(self) -> None:
        """Finalize the inner iterator and free the pinned buffers."""
        self._pending = None
        self.__dict__.get('_pinned', {}).clear()
        inner = self.__dict__.get('iterator')
        if inner is not None:
            inner.finalize()

    def __getattr__(self, name):
        # Epoch attributes of the delivered minibatch; the rest (batch_size,
        # dataset, stats, ...) from the inner iterator.
        if name in _EPOCH_ATTRIBUTES:
            delivered = self.__dict__.get('_delivered')
            if delivered and self.__dict__.get('_backend') is not None:
                return delivered[name]
        if name == 'iterator':
            raise AttributeError(name)
        return getattr(self.iterator, name)


def _map_arrays(converted, function):
    """Apply ``function(key, array)`` to each array of a converted batch."""
    if isinstance(converted, tuple):
        return tuple(function(i, array) for i, array in enumerate(converted))
    if isinstance(converted, dict):
        return {key: function(key, array) for key, array in converted.items()}
    return function(None, converted)
