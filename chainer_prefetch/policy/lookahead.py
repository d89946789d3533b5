"""Chainer's iterator state machine, with the next epoch's order drawn one epoch early.

Chainer's ``iterator_statemachine`` asks the order sampler for epoch
``e + 1``'s order when epoch ``e`` ends.  Here the sampler is asked when
epoch ``e`` *starts*, with the same arguments (the order being replaced and
the position the state machine will pass then), and the result is kept in
the state as ``next_order`` until it is used.  So the sequence of orders is
the one Chainer draws from the same random state, but while epoch ``e`` runs
its successor is already known: the whole future access sequence for one to
two epochs is known at every moment, which the next-epoch cache and the
eviction policies use.

Pure functions over a namedtuple, like Chainer's own state machine.
"""
import collections
from typing import Optional

import numpy
from chainer.iterators import _statemachine

#: Chainer's ``IteratorState`` plus ``next_order`` (``None`` when the order
#: is the identity, i.e. no order sampler).
LookaheadState = collections.namedtuple('LookaheadState', (
    'current_position', 'epoch', 'is_new_epoch', 'order', 'next_order'))


def final_position(position: int, batch_size: int, epoch_size: int) -> int:
    """The position the state machine passes to the order sampler at the epoch's end.

    Args:
        position: The state's position now (``< epoch_size``).
        batch_size: Examples per batch.
        epoch_size: Examples per epoch.

    Returns:
        The first ``position + k * batch_size`` whose batch reaches the end
        of the epoch.
    """
    if position + batch_size >= epoch_size:
        return position
    steps = (epoch_size - batch_size - position + batch_size - 1) // batch_size
    return position + steps * batch_size


def draw_next_order(order_sampler, order, position: int, batch_size: int):
    """Asks ``order_sampler`` now for the order that follows ``order``.

    Args:
        order_sampler: Chainer order sampler, ``(order, position) -> order``.
        order: The order of the epoch that has just started (or ``None``).
        position: The state's position in that epoch.
        batch_size: Examples per batch.

    Returns:
        The next epoch's order, or ``None`` when ``order`` is ``None``.

    Raises:
        ValueError: the sampler returned an order of another length.
    """
    if order is None:
        return None
    following = order_sampler(
        order, final_position(position, batch_size, len(order)))
    if len(following) != len(order):
        raise ValueError('The size of order does not match the size of the '
                         'previous order.')
    return following


def initial_state(order_sampler, dataset_length: int, batch_size: int
                  ) -> LookaheadState:
    """The state at the start of epoch 0: a fresh order and its successor.

    Args:
        order_sampler: Chainer order sampler, or ``None`` for index order.
        dataset_length: Examples in the dataset.
        batch_size: Examples per batch.
    """
    if order_sampler is None:
        return LookaheadState(0, 0, False, None, None)
    order = order_sampler(numpy.arange(dataset_length), 0)
    return LookaheadState(0, 0, False, order,
                          draw_next_order(order_sampler, order, 0, batch_size))


def lookahead_statemachine(state: LookaheadState, batch_size: int,
                           repeat: bool, order_sampler, dataset_length: int):
    """One step of Chainer's ``iterator_statemachine``, keeping ``next_order`` drawn.

    Args:
        state: The current :data:`LookaheadState`.
        batch_size, repeat, order_sampler, dataset_length: As for
            ``chainer.iterators._statemachine.iterator_statemachine``.

    Returns:
        ``(new_state, indices)``; ``indices`` is ``None`` at the end of a
        non-repeating iteration.
    """
    upcoming = [state.next_order]

    def take_drawn_order(order, position):
        if upcoming[0] is None:  # batch larger than an epoch: a second wrap
            return order_sampler(order, position)
        following, upcoming[0] = upcoming[0], None
        return following

    base = _statemachine.IteratorState(state.current_position, state.epoch,
                                       state.is_new_epoch, state.order)
    base, indices = _statemachine.iterator_statemachine(
        base, batch_size, repeat, take_drawn_order, dataset_length)
    next_order = upcoming[0]
    if next_order is None and base.order is not None:
        next_order = draw_next_order(order_sampler, base.order,
                                     base.current_position, batch_size)
    return LookaheadState(*base, next_order), indices


def with_next_order(state, order_sampler, batch_size: int,
                    next_order=None) -> LookaheadState:
    """Turns a restored Chainer state into a :data:`LookaheadState`.

    Args:
        state: ``(current_position, epoch, is_new_epoch, order)``.
        order_sampler: Draws ``next_order`` when it is not given.
        batch_size: Examples per batch.
        next_order: The saved next order, if the snapshot had one.
    """
    current_position, epoch, is_new_epoch, order = state[:4]
    if order is None:
        next_order = None
    elif next_order is None or len(next_order) != len(order):
        next_order = draw_next_order(order_sampler, order, current_position,
                                     batch_size)
    return LookaheadState(current_position, epoch, is_new_epoch, order,
                          next_order)


def order_of_epoch(state: LookaheadState, epoch: int,
                   dataset_length: int) -> Optional[numpy.ndarray]:
    """The order of ``epoch`` if the state knows it, else ``None``.

    Args:
        state: A :data:`LookaheadState`.
        epoch: ``state.epoch`` or ``state.epoch + 1``.
        dataset_length: Examples in the dataset (the identity order's size).
    """
    if epoch not in (state.epoch, state.epoch + 1):
        return None
    if state.order is None:
        return numpy.arange(dataset_length)
    return state.order if epoch == state.epoch else state.next_order
