"""The staged host-to-device copy of the next minibatch (chainer_prefetch.device_copy).

On the CPU the wrapper is a pass-through; its look-ahead bookkeeping (epoch
attributes of the delivered minibatch, snapshots that resume with the
staged minibatch, the end of a non-repeating iterator) runs here with host
buffers standing in for pinned memory, and the CUDA path runs where CuPy
and a GPU are present.
"""
import chainer
import numpy
import pytest
from chainer.iterators import SerialIterator
from chainer.serializers import DictionarySerializer, NpzDeserializer

from chainer_prefetch import PrefetchMultiprocessIterator
from chainer_prefetch.device_copy import StagedDeviceCopy, _HostBackend


def _dataset(n=10):
    return chainer.datasets.TupleDataset(
        numpy.arange(n * 3, dtype=numpy.float32).reshape(n, 3),
        numpy.arange(n, dtype=numpy.int32))


def _epoch_state(iterator):
    return (iterator.epoch, iterator.epoch_detail,
            iterator.previous_epoch_detail, iterator.is_new_epoch,
            iterator.current_position)


def test_cpu_device_is_a_reported_pass_through():
    inner = SerialIterator(_dataset(), 4, shuffle=False)
    wrapped = StagedDeviceCopy(inner, chainer.get_device('@numpy'))
    assert wrapped.mode.startswith('pass-through')
    batch = wrapped.next()
    assert isinstance(batch, list) and len(batch) == 4
    x, t = wrapped.converter(batch, chainer.get_device('@numpy'))
    numpy.testing.assert_array_equal(t, [0, 1, 2, 3])
    assert wrapped.epoch_detail == inner.epoch_detail == 0.4
    assert wrapped.batch_size == 4  # other attributes come from the inner one


@pytest.mark.parametrize('repeat', [True, False])
def test_staged_batches_and_epochs_equal_the_unwrapped_iterator(repeat):
    reference = SerialIterator(_dataset(), 4, repeat=repeat, shuffle=False)
    wrapped = StagedDeviceCopy(
        SerialIterator(_dataset(), 4, repeat=repeat, shuffle=False),
        chainer.get_device('@numpy'), _backend=_HostBackend())
    assert wrapped.mode == 'staged into host buffers'
    for _ in range(3 if not repeat else 8):
        expected = chainer.dataset.concat_examples(reference.next())
        got = wrapped.converter(wrapped.next())
        for e, g in zip(expected, got):
            numpy.testing.assert_array_equal(e, g)
        assert _epoch_state(wrapped) == _epoch_state(reference)
    if not repeat:
        with pytest.raises(StopIteration):
            reference.next()
        with pytest.raises(StopIteration):
            wrapped.next()


def test_a_snapshot_resumes_with_the_staged_batch():
    """The inner iterator is one batch ahead; the snapshot is not.

    (Within one epoch: SerialIterator draws the next epoch's order from
    NumPy's global random state, which no snapshot keeps.)
    """
    def make():
        inner = SerialIterator(_dataset(30), 3, shuffle=True)
        return StagedDeviceCopy(inner, chainer.get_device('@numpy'),
                                _backend=_HostBackend())

    numpy.random.seed(0)
    first = make()
    for _ in range(4):
        first.next()
    saved = {}
    first.serialize(DictionarySerializer(saved))
    expected = [first.converter(first.next())[1].tolist() for _ in range(5)]

    numpy.random.seed(1)
    second = make()
    second.next()  # staged something else, to be dropped on load
    second.serialize(NpzDeserializer(saved))
    got = [second.converter(second.next())[1].tolist() for _ in range(5)]
    assert got == expected


def test_wraps_the_prefetch_iterator_and_finalizes_it(tmp_path):
    inner = PrefetchMultiprocessIterator(_dataset(12), 4, n_processes=2,
                                         repeat=False, shuffle=False)
    wrapped = StagedDeviceCopy(inner, chainer.get_device('@numpy'),
                               _backend=_HostBackend())
    labels = []
    try:
        for batch in wrapped:
            labels += wrapped.converter(batch)[1].tolist()
    finally:
        wrapped.finalize()
    assert labels == list(range(12))
    assert 'files_copied' in wrapped.stats


def test_cuda_path_copies_on_a_side_stream():
    cupy = pytest.importorskip('cupy')
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CuPy without a usable GPU
        pytest.skip('no GPU: {}'.format(error))
    device = chainer.get_device('@cupy:0')
    wrapped = StagedDeviceCopy(SerialIterator(_dataset(), 4, shuffle=False),
                               device)
    assert wrapped.mode == 'pinned copy on a side stream'
    with device:
        x, t = wrapped.converter(wrapped.next())
        assert isinstance(x, cupy.ndarray)
        numpy.testing.assert_array_equal(cupy.asnumpy(t), [0, 1, 2, 3])
        x, t = wrapped.converter(wrapped.next())
        numpy.testing.assert_array_equal(cupy.asnumpy(t), [4, 5, 6, 7])
    wrapped.finalize()
