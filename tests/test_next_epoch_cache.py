"""The next-epoch cache: pure bookkeeping, then through the iterator."""
import os

import numpy
import pytest
from chainer import serializers
from chainer.datasets import LabeledImageDataset
from chainer.iterators.order_samplers import ShuffleOrderSampler

from chainer_prefetch import PrefetchMultiprocessIterator
from chainer_prefetch.policy.next_epoch_cache import NextEpochCache
from helpers import assert_examples_equal, make_jpeg_dataset


def test_keeps_only_the_prefix_of_the_next_order():
    cache = NextEpochCache(max_examples=2)
    cache.plan(1, [4, 2, 0, 1, 3])
    assert cache.wants(4, 1) and cache.wants(2, 1) and not cache.wants(0, 1)
    assert not cache.offer(0, 1, 'zero', 1)  # not in the prefix
    assert cache.offer(2, 1, 'two', 1)
    assert cache.offer(4, 1, 'four', 1)
    assert cache.take(4, 1) == 'four'
    assert cache.take(4, 1) is None  # taken once
    assert cache.take(2, 2) is None  # held for epoch 1, not 2
    assert cache.counters['hits'] == 1


def test_byte_bound_keeps_the_earliest_needed():
    cache = NextEpochCache(max_bytes=10)
    cache.plan(1, [5, 6, 7, 8])
    assert cache.offer(8, 1, 'eight', 6)
    assert cache.offer(7, 1, 'seven', 4)
    # 5 comes first in the next order: it replaces 8 (the latest needed).
    assert cache.offer(5, 1, 'five', 6)
    assert not cache.holds(8, 1) and cache.holds(7, 1) and cache.holds(5, 1)
    assert cache.held_bytes == 10
    # 6 would need 7 out, which comes later, but 6 (3 bytes) + 5 + 7 > 10:
    # 7 goes.
    assert cache.offer(6, 1, 'six', 3)
    assert not cache.holds(7, 1)
    assert cache.counters['examples_replaced'] == 2
    assert not cache.offer(5, 1, 'again', 1)  # already held
    assert not NextEpochCache(max_bytes=2).offer(0, 1, 'big', 3)


def test_forget_before_and_bounds_are_checked():
    cache = NextEpochCache(max_examples=5)
    cache.plan(1, [0, 1])
    cache.plan(2, [1, 0])
    cache.offer(0, 1, 'a', 1)
    cache.offer(1, 2, 'b', 1)
    cache.forget_before(2)
    assert not cache.holds(0, 1) and cache.holds(1, 2)
    with pytest.raises(ValueError, match='needs a bound'):
        NextEpochCache()
    with pytest.raises(ValueError, match='positive'):
        NextEpochCache(max_examples=0)


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
    list_file, root, _ = make_jpeg_dataset(tmp_path_factory.mktemp('images'),
                                           60, size=16)
    return LabeledImageDataset(list_file, root)


def _iterator(dataset, seed=0, **kwargs):
    return PrefetchMultiprocessIterator(
        dataset, 8, n_processes=2,
        order_sampler=ShuffleOrderSampler(numpy.random.RandomState(seed)),
        **kwargs)


def _batches(iterator, n):
    return [iterator.next() for _ in range(n)]


@pytest.mark.parametrize('cache_options', [
    {'next_epoch_cache_examples': 12},
    {'next_epoch_cache_bytes': 6 * 16 * 16 * 3 * 4},
])
@pytest.mark.parametrize('with_local_dir', [False, True])
def test_same_batches_with_and_without_the_cache(dataset, tmp_path,
                                                 cache_options,
                                                 with_local_dir):
    local_dir = str(tmp_path / 'local') if with_local_dir else None
    plain = _iterator(dataset, local_dir=local_dir)
    cached = _iterator(dataset, local_dir=local_dir, **cache_options)
    try:
        expected = _batches(plain, 40)  # 5+ epochs of 60
        got = _batches(cached, 40)
        stats = cached.stats
    finally:
        plain.finalize()
        cached.finalize()
    for got_batch, expected_batch in zip(got, expected):
        assert_examples_equal(got_batch, expected_batch)
    hits = [stats['by_epoch'][epoch]['examples_from_cache']
            for epoch in (1, 2, 3, 4)]
    assert all(hit > 0 for hit in hits), stats
    assert stats['next_epoch_cache']['hits'] >= sum(hits)
    assert stats['by_epoch'][0]['examples_from_cache'] == 0
    if 'next_epoch_cache_examples' in cache_options:
        assert max(hits) <= 12


def test_same_order_after_a_snapshot_mid_epoch(dataset, tmp_path):
    """A resumed iterator with the cache continues exactly like one without."""
    reference = _iterator(dataset, seed=3)
    cached = _iterator(dataset, seed=3, next_epoch_cache_examples=10)
    path = os.path.join(str(tmp_path), 'snapshot.npz')
    try:
        _batches(cached, 5)  # mid-epoch 0
        serializers.save_npz(path, cached)
        _batches(reference, 5)
        expected = _batches(reference, 20)
    finally:
        reference.finalize()
        cached.finalize()
    # Resumed with another random state: the saved orders must win.
    resumed = _iterator(dataset, seed=99, next_epoch_cache_examples=10)
    try:
        serializers.load_npz(path, resumed)
        got = _batches(resumed, 20)
    finally:
        resumed.finalize()
    # 5 + 10 batches reach into epoch 2, whose order is drawn after the
    # snapshot; epochs 0 and 1 must match exactly.
    for got_batch, expected_batch in zip(got[:10], expected[:10]):
        assert_examples_equal(got_batch, expected_batch)


def test_cache_options_are_checked(dataset):
    with pytest.raises(ValueError, match='next_epoch_cache_examples'):
        _iterator(dataset, next_epoch_cache_examples=0)
    with pytest.raises(ValueError, match='next_epoch_cache_bytes'):
        _iterator(dataset, next_epoch_cache_bytes=-1)
