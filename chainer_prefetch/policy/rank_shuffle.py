"""Reshuffle across ranks every epoch: one permutation of the dataset per epoch, split by rank.

Pure: no processes, no MPI, no files.

:class:`ShuffleAcrossRanks` is a Chainer order sampler for a data-parallel
job whose every rank holds the *whole* dataset (not a
``chainermn.scatter_dataset`` shard).  In epoch ``e`` the job draws one
permutation ``P_e`` of all ``n`` examples, fixed by ``(seed, e)``, pads it
to ``size * L`` places (``L = ceil(n / size)``) by repeating its first
``size * L - n`` entries, and rank ``r`` takes the places ``r, r + size, r +
2 * size, ...`` -- what PyTorch's ``DistributedSampler`` with ``set_epoch``
does.  So:

* every example is trained on exactly once per epoch across the job, except
  the padding: ``size * L - n`` examples (fewer than ``size``) twice;
* update ``k`` of the job (every rank's batch ``k`` of size ``B``) consumes
  exactly batch ``k`` of a single-process run's order ``P_e`` at batch size
  ``size * B``: the job's order is the single process's, split by rank;
* any process can tell which rank held an example in an earlier epoch
  (:meth:`ShuffleAcrossRanks.holders`), which is how a node knows which
  other node already has a local copy of it (:mod:`chainer_prefetch.staging.peers`).

The sampler finds the epoch of the order it is given (Chainer passes only
the order): it remembers the orders it drew, and an order it never drew is
looked up among the epochs' orders, at the cost of drawing them.  A
:class:`~chainer_prefetch.PrefetchMultiprocessIterator` restored from a
snapshot takes its order from the sampler (:meth:`order_of_epoch`) by the
epoch the snapshot saved, so every rank may load the snapshot rank 0 wrote,
and a snapshot taken at the end of an epoch resumes at another number of
ranks.
"""
import hashlib
import threading
from typing import Dict, List, Optional

import numpy

#: How many epochs an order the sampler did not draw is looked up among.
SEARCHED_EPOCHS = 1000
#: How many epochs' places of every example :meth:`ShuffleAcrossRanks.holders`
#: keeps (each ``8 * n_examples`` bytes): the epochs the peer tier asks about
#: from the current and the next epoch, with two earlier epochs each.
KEPT_EPOCHS = 4


class ShuffleAcrossRanks:
    """Chainer order sampler: each epoch one permutation of the whole dataset, split by rank.

    Give every rank the whole dataset and its own sampler (same ``seed``):
    ``PrefetchMultiprocessIterator(dataset, batch_size,
    order_sampler=ShuffleAcrossRanks(len(dataset), comm.rank, comm.size,
    seed))``.  An epoch of the iterator then has ``L = ceil(n / size)``
    examples.

    Args:
        n_examples: Examples in the dataset (every rank's, the same).
        rank: This process's rank.
        size: Ranks in the job.
        seed: Seed of the job's permutations (the same on every rank).

    Raises:
        ValueError: fewer examples than ranks, or ``rank`` outside
            ``[0, size)``.
    """

    def __init__(self, n_examples: int, rank: int, size: int, seed: int = 0):
        n_examples, rank, size = int(n_examples), int(rank), int(size)
        if size < 1 or not 0 <= rank < size:
            raise ValueError('rank {} outside [0, {})'.format(rank, size))
        if n_examples < size:
            raise ValueError('cannot split {} examples over {} ranks'.format(
                n_examples, size))
        self.n_examples = n_examples
        self.rank = rank
        self.size = size
        self.seed = int(seed)
        self.length = -(-n_examples // size)
        self._epoch_of_digest: Dict[bytes, int] = {}
        self._positions: Dict[int, numpy.ndarray] = {}
        self._lock = threading.Lock()  # holders() runs on copy threads

    def permutation(self, epoch: int) -> numpy.ndarray:
        """The job's permutation of all examples in ``epoch`` (what a single process trains on)."""
        key = numpy.asarray([self.seed, epoch, self.n_examples], numpy.int64)
        digest = hashlib.sha1(key.tobytes()).digest()
        state = numpy.random.RandomState(int.from_bytes(digest[:4], 'little'))
        return state.permutation(self.n_examples)

    def order(self, epoch: int, rank: Optional[int] = None) -> numpy.ndarray:
        """``rank``'s order of ``epoch`` (by default this sampler's): ``L`` indices."""
        rank = self.rank if rank is None else rank
        places = numpy.arange(rank, self.size * self.length, self.size)
        return self.permutation(epoch)[places % self.n_examples]

    def __call__(self, current_order: numpy.ndarray,
                 current_position: int) -> numpy.ndarray:
        epoch = self.epoch_of(current_order) + 1
        following = self.order(epoch)
        self._remember(following, epoch)
        return following

    def epoch_of(self, order: numpy.ndarray) -> int:
        """The epoch whose order (of this rank) ``order`` is; -1 for the
        identity of the dataset's length, which Chainer passes to draw the
        first order.

        Raises:
            ValueError: ``order`` is no order of this rank in the first
                :data:`SEARCHED_EPOCHS` epochs.
        """
        order = numpy.asarray(order)
        with self._lock:
            known = self._epoch_of_digest.get(_digest(order))
        if known is not None:
            return known
        if len(order) == self.n_examples and numpy.array_equal(
                order, numpy.arange(self.n_examples)):
            return -1
        if len(order) == self.length:
            for epoch in range(SEARCHED_EPOCHS):
                if numpy.array_equal(self.order(epoch), order):
                    self._remember(order, epoch)
                    return epoch
        raise ValueError(
            'ShuffleAcrossRanks(n_examples={}, rank={}, size={}, seed={}) got '
            'an order of {} entries that it did not draw in the first {} '
            'epochs: restore it from the snapshot of the iterator it was made '
            'for (its serialize()), with the same seed, rank and size'.format(
                self.n_examples, self.rank, self.size, self.seed, len(order),
                SEARCHED_EPOCHS))

    def holders(self, index: int, epoch: int,
                size: Optional[int] = None) -> List[int]:
        """The ranks that trained on example ``index`` in ``epoch`` (one,
        two for a padding example).

        Args:
            index: The example.
            epoch: The epoch.
            size: The number of ranks of the job that trained ``epoch``, if
                not this one's (a run resumed at another size).

        Raises:
            IndexError: ``index`` outside the dataset.
        """
        if not 0 <= index < self.n_examples:
            raise IndexError('example {} outside a dataset of {}'.format(
                index, self.n_examples))
        size = self.size if size is None else size
        padding = size * -(-self.n_examples // size) - self.n_examples
        place = int(self._places(epoch)[index])
        ranks = [place % size]
        if place < padding:
            ranks.append((place + self.n_examples) % size)
        return ranks

    def job(self) -> Dict[str, int]:
        """``n_examples``, ``size`` and ``seed``: what fixes the orders
        (saved in the iterator's snapshot, compared when it is restored)."""
        return {'n_examples': self.n_examples, 'size': self.size,
                'seed': self.seed}

    def order_of_epoch(self, epoch: int) -> numpy.ndarray:
        """This rank's order of ``epoch``: what an iterator restored from a
        snapshot (written by any rank) takes instead of the snapshot's order
        (``PrefetchMultiprocessIterator.serialize`` asks for it)."""
        order = self.order(epoch)
        self._remember(order, epoch)
        return order

    def __getstate__(self):
        state = dict(self.__dict__)
        del state['_lock']
        state['_positions'] = {}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _remember(self, order: numpy.ndarray, epoch: int) -> None:
        digest = _digest(order)
        with self._lock:
            self._epoch_of_digest[digest] = epoch
            if len(self._epoch_of_digest) > 4:  # the iterator holds two
                oldest = min(self._epoch_of_digest,
                             key=self._epoch_of_digest.get)
                del self._epoch_of_digest[oldest]

    def _places(self, epoch: int) -> numpy.ndarray:
        """Per example, its place in ``epoch``'s permutation (the last
        :data:`KEPT_EPOCHS` epochs asked for are kept)."""
        with self._lock:
            places = self._positions.pop(epoch, None)
            if places is not None:
                self._positions[epoch] = places  # the most recently used
                return places
        places = numpy.empty(self.n_examples, numpy.int64)
        places[self.permutation(epoch)] = numpy.arange(self.n_examples)
        with self._lock:
            self._positions[epoch] = places
            while len(self._positions) > KEPT_EPOCHS:
                del self._positions[next(iter(self._positions))]
        return places


def _digest(order: numpy.ndarray) -> bytes:
    return hashlib.sha1(numpy.ascontiguousarray(order, numpy.int64).tobytes()
                        ).digest()
