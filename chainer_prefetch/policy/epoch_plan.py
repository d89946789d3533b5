"""Which examples each member of a data-parallel job trains on, at any size.

Pure: no processes, no MPI, no files.

An :class:`EpochPlan` says, from one iteration of the run on, what every
member's training iterator holds: its *shard* (the dataset indices of its
iterator's dataset; every shard has the same length ``L``) and its order in
the plan's epoch.  The orders of the later epochs are drawn by
:class:`RankOrderSampler` from that order, exactly as the iterator draws
them.  The members of a data-parallel job take one batch each per update, so
they advance in lockstep, and every member can compute what every member --
dead or alive -- consumed by any iteration (:meth:`EpochPlan.consumed`).

At a change of the group (an elastic join or leave, a ULFM shrink, a restart
from a snapshot at the same or another size) :func:`plan_rest` splits the
examples of the current epoch that no committed update consumed among the new
members, each exactly once, and puts the consumed ones in the places of the
shards that this epoch has already passed, so that the next epochs see every
example exactly once too.  Preferring the examples a member already holds
local copies of is a second step (:func:`deal`) that only decides *who* gets
an example, never *whether*.

The guarantee (checked by the property tests): every example is consumed
exactly once per epoch, except for the padding that equal shard lengths
need:

* in an epoch without a change, ``size * L - n_examples`` examples (fewer
  than ``size``) are consumed twice, as with
  ``chainermn.scatter_dataset(force_equal_length=True)``;
* in the epoch of a change, at most ``size - 1`` more (the remaining
  examples are split into parts whose sizes differ by at most one, and the
  shorter parts repeat one example).
"""
import hashlib
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy

PLAN_KEYS = ('n_examples', 'seed', 'batch_size', 'iteration', 'epoch',
             'position', 'consumed_before', 'shards', 'orders')


def shard_order(n_examples: int,
                seed: Optional[int]) -> Optional[numpy.ndarray]:
    """The permutation ``chainermn.scatter_dataset(shuffle=True, seed=seed)``
    applies before splitting (``None``: no shuffle)."""
    if seed is None:
        return None
    return numpy.random.RandomState(seed).permutation(n_examples)


def shard_bounds(n_examples: int, size: int, rank: int) -> Tuple[int, int]:
    """``(begin, end)`` of ``rank``'s shard, as ``chainermn.scatter_dataset``
    computes it with ``force_equal_length=True`` (equal lengths; the last
    shards may wrap around and repeat examples).

    Raises:
        ValueError: ``rank`` outside ``[0, size)``.
    """
    if not 0 <= rank < size:
        raise ValueError('rank {} outside [0, {})'.format(rank, size))
    length = -(-n_examples // size)
    begin = n_examples * rank // size
    return begin, begin + length


def shard_length(n_examples: int, size: int) -> int:
    """Examples per member per epoch: ``ceil(n_examples / size)``.

    Raises:
        ValueError: fewer examples than members, or no member.
    """
    if size < 1 or n_examples < size:
        raise ValueError('cannot split {} examples over {} members'.format(
            n_examples, size))
    return -(-n_examples // size)


class RankOrderSampler:
    """A Chainer order sampler whose orders any process can recompute.

    The order of an epoch is a permutation seeded by ``(seed, rank)`` and the
    previous epoch's order, so the order of every epoch of every member is a
    pure function of its first order (:meth:`EpochPlan.order_of`).
    ``current_position`` is ignored.

    Args:
        seed: Seed of the job.
        rank: The member whose orders this sampler draws.
    """

    def __init__(self, seed: int, rank: int):
        self.seed = int(seed)
        self.rank = int(rank)

    def __call__(self, current_order: numpy.ndarray,
                 current_position: int) -> numpy.ndarray:
        digest = hashlib.sha1(numpy.asarray(
            [self.seed, self.rank, len(current_order)], numpy.int64).tobytes())
        digest.update(numpy.ascontiguousarray(current_order,
                                              numpy.int64).tobytes())
        state = numpy.random.RandomState(
            int.from_bytes(digest.digest()[:4], 'little'))
        return state.permutation(len(current_order))


class EpochPlan(NamedTuple):
    """What every member's training iterator holds from ``iteration`` on.

    Attributes:
        n_examples: Examples in the whole dataset.
        seed: Seed of the orders (``RankOrderSampler(seed, member)``).
        batch_size: Examples each member takes per update.
        iteration: The updater's iteration the plan starts at.
        epoch: The epoch at ``iteration``.
        position: Every member's position in ``epoch`` at ``iteration``.
        consumed_before: Examples of ``epoch`` consumed before ``iteration``
            (boolean, one per example).
        shards: Per member (rank order), its dataset indices (one length).
        orders: Per member, its order of ``epoch`` over its shard.
    """
    n_examples: int
    seed: int
    batch_size: int
    iteration: int
    epoch: int
    position: int
    consumed_before: numpy.ndarray
    shards: Tuple[numpy.ndarray, ...]
    orders: Tuple[numpy.ndarray, ...]

    @property
    def size(self) -> int:
        """Members."""
        return len(self.shards)

    @property
    def length(self) -> int:
        """Examples per member per epoch."""
        return len(self.shards[0])

    def where(self, iteration: int) -> Tuple[int, int]:
        """``(epoch, position)`` of every member after ``iteration`` updates.

        Raises:
            ValueError: ``iteration`` before the plan's start.
        """
        if iteration < self.iteration:
            raise ValueError('iteration {} is before the plan, which starts '
                             'at {}'.format(iteration, self.iteration))
        reached = self.position + (iteration - self.iteration) * \
            self.batch_size
        return self.epoch + reached // self.length, reached % self.length

    def order_of(self, member: int, epoch: int) -> numpy.ndarray:
        """``member``'s order over its shard in ``epoch`` (>= the plan's)."""
        if epoch < self.epoch:
            raise ValueError('epoch {} is before the plan, which starts in '
                             'epoch {}'.format(epoch, self.epoch))
        sampler = RankOrderSampler(self.seed, member)
        order = self.orders[member]
        for _ in range(epoch - self.epoch):
            order = sampler(order, 0)
        return order

    def sequence_of(self, member: int, epoch: int) -> numpy.ndarray:
        """The dataset indices ``member`` consumes in ``epoch``, in order."""
        return self.shards[member][self.order_of(member, epoch)]

    def consumed(self, iteration: int) -> Tuple[int, numpy.ndarray]:
        """``(epoch, mask)``: the examples of the epoch reached after
        ``iteration`` updates that the group has consumed (the batches of
        every member up to that update, the padding counted once)."""
        epoch, position = self.where(iteration)
        start = 0
        if epoch == self.epoch:
            # The places before the plan's position were passed before it:
            # what they held is in consumed_before, not in the shards.
            mask, start = self.consumed_before.copy(), self.position
        else:
            mask = numpy.zeros(self.n_examples, dtype=bool)
        for member in range(self.size):
            mask[self.sequence_of(member, epoch)[start:position]] = True
        return epoch, mask

    def to_arrays(self) -> Dict[str, numpy.ndarray]:
        """The plan as arrays (for a message or a snapshot)."""
        return dict(
            n_examples=numpy.asarray(self.n_examples),
            seed=numpy.asarray(self.seed),
            batch_size=numpy.asarray(self.batch_size),
            iteration=numpy.asarray(self.iteration),
            epoch=numpy.asarray(self.epoch),
            position=numpy.asarray(self.position),
            consumed_before=numpy.packbits(self.consumed_before),
            shards=numpy.stack(self.shards), orders=numpy.stack(self.orders))

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, numpy.ndarray]) -> 'EpochPlan':
        """The plan :meth:`to_arrays` gave."""
        n = int(arrays['n_examples'])
        return cls(n, int(arrays['seed']), int(arrays['batch_size']),
                   int(arrays['iteration']), int(arrays['epoch']),
                   int(arrays['position']),
                   numpy.unpackbits(numpy.asarray(
                       arrays['consumed_before'], numpy.uint8))[:n].astype(
                           bool),
                   tuple(numpy.asarray(arrays['shards'], numpy.int64)),
                   tuple(numpy.asarray(arrays['orders'], numpy.int64)))


def start_plan(n_examples: int, size: int, seed: Optional[int],
               batch_size: int,
               shuffle: bool = True, iteration: int = 0,
               epoch: int = 0) -> EpochPlan:
    """The plan of a job that starts an epoch with ``size`` members: the
    shards of ``chainermn.scatter_dataset(shuffle=shuffle, seed=seed,
    force_equal_length=True)`` and the first orders the iterators draw with
    :class:`RankOrderSampler`.

    Args:
        n_examples: Examples in the dataset.
        size: Members.
        seed: Seed of the shuffle before splitting and of the orders (None:
            no shuffle, orders seeded with 0).
        batch_size: Examples per member per update.
        shuffle: Shuffle before splitting (only with a seed).
        iteration: The updater's iteration at the start.
        epoch: The epoch that starts.
    """
    shard_length(n_examples, size)
    base = shard_order(n_examples, seed if shuffle else None)
    seed = 0 if seed is None else seed
    if base is None:
        base = numpy.arange(n_examples)
    shards, orders = [], []
    for member in range(size):
        begin, end = shard_bounds(n_examples, size, member)
        shard = base[numpy.arange(begin, end) % n_examples]
        shards.append(shard.astype(numpy.int64))
        orders.append(RankOrderSampler(seed, member)(
            numpy.arange(len(shard)), 0))
    return EpochPlan(n_examples, int(seed), int(batch_size), int(iteration),
                     int(epoch), 0, numpy.zeros(n_examples, dtype=bool),
                     tuple(shards), tuple(orders))


def part_sizes(n_items: int, parts: int) -> List[int]:
    """Sizes of ``parts`` parts of ``n_items`` that differ by at most one
    (the larger ones first)."""
    return [n_items // parts + (1 if part < n_items % parts else 0)
            for part in range(parts)]


def deal(items: numpy.ndarray, sizes: Sequence[int],
         held: Optional[Sequence[Optional[numpy.ndarray]]] = None
         ) -> List[numpy.ndarray]:
    """Splits ``items`` into parts of ``sizes``, each member first taking
    the items it holds.

    A partition by construction: every item goes to exactly one part.  In
    member order, each member takes the items it holds that nobody took
    yet, in the order of ``items``, up to its size; then the rest of
    ``items``, in order, fills the parts in member order.

    Args:
        items: The items (distinct dataset indices).
        sizes: The size of each part; they must add up to ``len(items)``.
        held: Per member, a boolean mask over the dataset of the examples
            its local copies hold (None: nothing).

    Returns:
        The parts, each in the order of ``items``.
    """
    items = numpy.asarray(items, dtype=numpy.int64)
    if sum(sizes) != len(items):
        raise ValueError('part sizes {} do not add up to {} items'.format(
            list(sizes), len(items)))
    taken = numpy.zeros(len(items), dtype=bool)
    chosen: List[numpy.ndarray] = []
    for member, size in enumerate(sizes):
        mask = None if held is None else held[member]
        if mask is None or size == 0:
            chosen.append(numpy.zeros(0, dtype=numpy.int64))
            continue
        mine = numpy.flatnonzero(mask[items] & ~taken)[:size]
        taken[mine] = True
        chosen.append(mine)
    rest = numpy.flatnonzero(~taken)
    parts, used = [], 0
    for member, size in enumerate(sizes):
        need = size - len(chosen[member])
        positions = numpy.sort(numpy.concatenate(
            [chosen[member], rest[used:used + need]]))
        used += need
        parts.append(items[positions])
    return parts


def remaining_order(n_examples: int, seed: int, epoch: int,
                    iteration: int) -> numpy.ndarray:
    """The order in which :func:`plan_rest` deals the examples: a
    permutation fixed by the seed, the epoch and the iteration."""
    key = numpy.asarray([seed, epoch, iteration, n_examples], numpy.int64)
    digest = hashlib.sha1(key.tobytes()).digest()
    return numpy.random.RandomState(
        int.from_bytes(digest[:4], 'little')).permutation(n_examples)


def plan_rest(n_examples: int, seed: int, batch_size: int, iteration: int,
              epoch: int, consumed: numpy.ndarray, size: int,
              held: Optional[Sequence[Optional[numpy.ndarray]]] = None
              ) -> EpochPlan:
    """The plan for ``size`` members from a point where the examples
    ``consumed`` of ``epoch`` were consumed.

    Each member gets ``L = ceil(n_examples / size)`` places.  The examples
    not consumed are dealt into parts whose sizes differ by at most one, and
    the shorter parts repeat one of their examples, so that every member
    has ``r`` of them: they fill the last ``r`` places, in a fixed random
    order, and the plan starts at position ``L - r``.  The consumed examples
    fill the places before (and the one left in a shorter part), so the
    shards hold every example for the next epochs.

    Args:
        n_examples: Examples in the dataset.
        seed: Seed of the orders.
        batch_size: Examples per member per update.
        iteration: The updater's iteration the plan starts at.
        epoch: The current epoch.
        consumed: Boolean mask of the examples of ``epoch`` consumed by
            committed updates.
        size: Members of the new group.
        held: Per member, a mask of the examples its local copies hold (a
            preference only); None: none.

    Returns:
        The :class:`EpochPlan`.
    """
    length = shard_length(n_examples, size)
    consumed = numpy.asarray(consumed, dtype=bool)
    if consumed.shape != (n_examples,):
        raise ValueError('consumed mask of {} entries for {} examples'.format(
            consumed.shape, n_examples))
    order = remaining_order(n_examples, seed, epoch, iteration)
    rest = order[~consumed[order]]
    if len(rest) == 0:
        return start_plan(n_examples, size, seed, batch_size,
                          iteration=iteration, epoch=epoch + 1)
    done = order[consumed[order]]
    rest_sizes = part_sizes(len(rest), size)
    per_member = rest_sizes[0]
    position = length - per_member
    # Places left for the consumed examples: the `position` places before
    # the rest, and the one a shorter part leaves.  There are
    # len(done) + padding of them; the padding (fewer than `size`) goes to
    # the members with most places, at most one each.
    places = [position + per_member - rest_size for rest_size in rest_sizes]
    padding = sum(places) - len(done)
    padded = sorted(range(size), key=lambda m: (-places[m], -m))[:padding]
    done_sizes = [places[m] - (m in padded) for m in range(size)]
    rest_parts = deal(rest, rest_sizes, held)
    done_parts = deal(done, done_sizes, held)
    shards = []
    for member in range(size):
        before = done_parts[member][:position]
        after = numpy.concatenate([rest_parts[member],
                                   done_parts[member][position:]])
        shard = numpy.concatenate([before, after])
        filler = shard[0] if len(shard) else rest[0]
        shard = numpy.concatenate([
            before, numpy.full(position - len(before), filler, numpy.int64),
            after, numpy.full(per_member - len(after), filler, numpy.int64)])
        shards.append(shard.astype(numpy.int64))
    orders = tuple(numpy.arange(length) for _ in range(size))
    return EpochPlan(n_examples, int(seed), int(batch_size), int(iteration),
                     int(epoch), position, consumed.copy(), tuple(shards),
                     orders)


def replan(plan: EpochPlan, iteration: int, size: int,
           held: Optional[Sequence[Optional[numpy.ndarray]]] = None,
           batch_size: Optional[int] = None) -> EpochPlan:
    """The plan for ``size`` members after ``iteration`` committed updates
    of ``plan`` (the batches of a later update, which a failure aborted,
    go back to the examples still to consume).

    Args:
        plan: The plan the group trained on.
        iteration: The last committed update.
        size: Members of the new group.
        held: Per new member, a mask of the examples its local copies hold.
        batch_size: The new batch size (default: the plan's).
    """
    epoch, consumed = plan.consumed(iteration)
    return plan_rest(plan.n_examples, plan.seed,
                     plan.batch_size if batch_size is None else batch_size,
                     iteration, epoch, consumed, size, held)


def held_masks(plan: Optional[EpochPlan], localities: Sequence[str],
               new_localities: Sequence[str]) -> List[Optional[numpy.ndarray]]:
    """What each new member's place holds now: the shards of ``plan``'s
    members with the same locality (a member's shard is what its iterator
    stages; what an earlier plan gave it and this one moved away is not
    counted).

    Args:
        plan: The plan the group trained on (None: nothing is held).
        localities: Per member of ``plan``, where its local copies are.
        new_localities: Per new member, where its local copies are.
    """
    if plan is None:
        return [None] * len(new_localities)
    by_place: Dict[str, numpy.ndarray] = {}
    for member, place in enumerate(localities):
        mask = by_place.setdefault(
            place, numpy.zeros(plan.n_examples, dtype=bool))
        mask[plan.shards[member]] = True
    return [by_place.get(place) for place in new_localities]
