"""Everything that uses the known future order: pure, no threads, no files.

* :mod:`.lookahead`: Chainer's iterator state machine with the next epoch's
  order drawn one epoch early;
* :mod:`.future_uses`: when each stored item is used next;
* :mod:`.next_epoch_cache`: the examples the next epoch needs first;
* :mod:`.eviction`: what a capacity-limited local store keeps (strategies
  behind a registry);

and what the recoveries of a data-parallel job (elastic training, ULFM,
restart from a snapshot) share, with no MPI, torch or etcd:

* :mod:`.epoch_plan`: which examples each member trains on, at any size,
  and where a resumed run stands in its epoch;
* :mod:`.lr_rules`: how the learning rate follows the number of members.
"""
from chainer_prefetch.policy.eviction import (  # NOQA
    NEVER, STRATEGIES, EvictionStrategy, make_strategy, register, simulate)
from chainer_prefetch.policy.future_uses import FutureUses  # NOQA
from chainer_prefetch.policy.next_epoch_cache import NextEpochCache  # NOQA
