"""The pure core of elastic training: no etcd, no threads, no processes.

* :class:`SettleWindow`: a burst of joins (or leaves) arriving one by one
  becomes one membership, hence one rebuild.
* :class:`Record` and :func:`rendezvous_step`: what a member does next in
  a rebuild, given the settled view and the latest generation record.
* :func:`node_layout`: intra/inter ranks from the member names.
* :func:`locality_split`: equal-length shards that keep each node's
  examples where it already has local copies, as far as the split allows.
* :func:`signature_mismatch`: why a process may not join a job.

The edges (``membership.py``, ``communicator.py``, ``training.py``) feed
these functions what they observe and carry out what they return.
"""
from typing import Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy

MEMBER_SEPARATOR = ':'


def member_name(host: str, pid: int, token: str) -> str:
    """The name of a member: ``host:pid:token`` (sorting names sorts by
    host first, so the members of a node get neighbouring ranks)."""
    return MEMBER_SEPARATOR.join((host, str(pid), token))


def host_of(member: str) -> str:
    """The host part of a member name."""
    return member.rsplit(MEMBER_SEPARATOR, 2)[0]


class SettleWindow:
    """Tells when the membership has stopped changing.

    A view is *settled* once it has stayed the same for ``seconds``; N joins
    arriving within that window of each other produce one settled view.

    Args:
        seconds: The settle window.
    """

    def __init__(self, seconds: float):
        if seconds < 0:
            raise ValueError('settle window must be >= 0 s, got {}'.format(
                seconds))
        self.seconds = seconds
        self.view: Optional[FrozenSet[str]] = None
        self.changed_at = float('-inf')

    def observe(self, view: FrozenSet[str], now: float) -> bool:
        """Records the membership seen at ``now``; returns whether it
        differs from the previous one."""
        view = frozenset(view)
        if view == self.view:
            return False
        self.view = view
        self.changed_at = now
        return True

    def settled(self, now: float) -> Optional[FrozenSet[str]]:
        """The view if it has not changed for the window, else None."""
        if self.view is None or now - self.changed_at < self.seconds:
            return None
        return self.view

    def remaining(self, now: float) -> float:
        """Seconds until the current view settles (0 if it has)."""
        return max(0.0, self.changed_at + self.seconds - now)


class Record(NamedTuple):
    """The leader's decision for one generation (stored once, atomically).

    Attributes:
        generation: Increasing number.
        verdict: ``'ok'``, ``'wait'``, ``'fail'`` or ``'done'`` (the job
            finished).
        members: Members that form the group, in rank order.
        standby: Members that wait meanwhile.
        store: ``host:port`` of the rendezvous store (``'ok'`` only).
        reason: A sentence for the log.
        leader: The member that decided.
    """
    generation: int
    verdict: str
    members: Tuple[str, ...]
    standby: Tuple[str, ...] = ()
    store: Optional[str] = None
    reason: str = ''
    leader: str = ''

    def to_dict(self) -> dict:
        return dict(self._asdict(), members=list(self.members),
                    standby=list(self.standby))

    @classmethod
    def from_dict(cls, data: Mapping) -> 'Record':
        return cls(int(data['generation']), data['verdict'],
                   tuple(data['members']), tuple(data.get('standby', ())),
                   data.get('store'), data.get('reason', ''),
                   data.get('leader', ''))

    @property
    def everyone(self) -> FrozenSet[str]:
        """Members and standby members."""
        return frozenset(self.members) | frozenset(self.standby)


class Step(NamedTuple):
    """What :func:`rendezvous_step` tells a member to do.

    Attributes:
        action: ``'join'`` (form the group of ``record``), ``'hold'`` (wait
            for a change: verdict ``wait`` or standby), ``'fail'``,
            ``'done'``, ``'decide'`` (this member is the leader: decide
            ``generation``) or ``'wait'`` (for the view to settle or for
            the leader's record).
        record: The record concerned (join, hold, fail, done).
        generation: The generation to decide (decide).
    """
    action: str
    record: Optional[Record] = None
    generation: int = 0


def rendezvous_step(me: str, view: Optional[FrozenSet[str]],
                    latest: Optional[Record], after: int,
                    blocked_view: Optional[FrozenSet[str]] = None) -> Step:
    """The next step of a member in a rebuild.

    Args:
        me: This member's name.
        view: The settled membership (None while it is still changing).
        latest: The newest record in etcd (None if there is none).
        after: The newest generation this member has finished with (it
            never joins that one or an older one again).
        blocked_view: A membership that just failed to form a group (its
            leases have not expired yet): not decided on again.

    Returns:
        The :class:`Step`.
    """
    base = after
    if latest is not None and latest.generation > after:
        if latest.verdict in ('fail', 'done'):
            return Step(latest.verdict, latest)
        if latest.verdict == 'ok' and me in latest.members and (
                view is None or set(latest.members) <= view):
            return Step('join', latest)
        if view is not None and view == latest.everyone:
            return Step('hold', latest)
        if view is None and me in latest.everyone:
            return Step('hold', latest)
        base = latest.generation
    elif latest is not None:
        base = max(after, latest.generation)
    if view is None or me not in view or view == blocked_view:
        return Step('wait')
    if me == min(view):
        return Step('decide', generation=base + 1)
    return Step('wait')


def node_layout(members: Sequence[str], me: str) -> Tuple[int, int, int, int]:
    """``(intra_rank, intra_size, inter_rank, inter_size)`` of ``me``, from
    the host part of the names (nodes numbered in rank order)."""
    hosts = [host_of(member) for member in members]
    nodes = list(dict.fromkeys(hosts))
    mine = host_of(me)
    same = [member for member in members if host_of(member) == mine]
    return same.index(me), len(same), nodes.index(mine), len(nodes)


class Split(NamedTuple):
    """Result of :func:`locality_split`.

    Attributes:
        shards: Per member (rank order), the dataset indices of its shard
            (all of one length).
        kept_local: Per member, how many of its indices its node already
            held.
        plain_kept_local: The same for the plain contiguous split of
            ``chainermn.scatter_dataset`` (for comparison).
    """
    shards: List[numpy.ndarray]
    kept_local: List[int]
    plain_kept_local: List[int]


def locality_split(n_examples: int, localities: Sequence[str],
                   held: Mapping[str, numpy.ndarray],
                   order: Optional[numpy.ndarray] = None,
                   plain_bounds=None) -> Split:
    """Splits ``n_examples`` over the members, keeping local copies local.

    Every member gets ``ceil(n / size)`` indices (as
    ``chainermn.scatter_dataset(force_equal_length=True)``: the shorter
    shards repeat some of their own), every example is in some shard, and
    each member first takes the examples its node (``localities[rank]``)
    already holds (dealt in turns to the members of the node), then the
    rest in ``order``.  Deterministic: every member computes the same.

    Args:
        n_examples: Examples in the dataset.
        localities: Per member (rank order), the name of the place its
            local copies are in (members with the same name share them).
        held: Per locality, the indices it holds copies of.
        order: Permutation used to order the unassigned examples (e.g.
            ``scatter_dataset``'s shuffle), or None.
        plain_bounds: ``bounds(n, size, rank) -> (begin, end)`` of the
            plain split, to count what it would have kept local.

    Returns:
        The :class:`Split`.
    """
    size = len(localities)
    if size < 1 or n_examples < size:
        raise ValueError('cannot split {} examples over {} members'.format(
            n_examples, size))
    quota = [n_examples // size + (1 if r < n_examples % size else 0)
             for r in range(size)]
    owner = numpy.full(n_examples, -1, dtype=numpy.int64)
    shards: List[List[int]] = [[] for _ in range(size)]
    by_place: Dict[str, List[int]] = {}
    for rank, place in enumerate(localities):
        by_place.setdefault(place, []).append(rank)
    for place, ranks in by_place.items():
        candidates = numpy.unique(numpy.asarray(held.get(place, ()),
                                                dtype=numpy.int64))
        candidates = candidates[(candidates >= 0) & (candidates < n_examples)]
        for turn, rank in enumerate(ranks):
            mine = candidates[turn::len(ranks)][:quota[rank]]
            shards[rank].extend(int(i) for i in mine)
            owner[mine] = rank
    kept = [len(shard) for shard in shards]
    rest = numpy.arange(n_examples) if order is None else numpy.asarray(order)
    rest = rest[owner[rest] < 0]
    position = 0
    for rank in range(size):
        need = quota[rank] - len(shards[rank])
        shards[rank].extend(int(i) for i in rest[position:position + need])
        position += need
    length = max(quota)
    padded = []
    for rank in range(size):
        shard = shards[rank]
        shard = shard + shard[:length - len(shard)]
        padded.append(numpy.asarray(shard, dtype=numpy.int64))
    plain = []
    if plain_bounds is not None:
        base = numpy.arange(n_examples) if order is None else numpy.asarray(
            order)
        for rank, place in enumerate(localities):
            begin, end = plain_bounds(n_examples, size, rank)
            indices = base[numpy.arange(begin, end) % n_examples]
            plain.append(int(numpy.isin(indices, held.get(place, ())).sum()))
    return Split(padded, kept, plain)


def signature_mismatch(job: Mapping[str, object],
                       mine: Mapping[str, object]) -> Optional[str]:
    """Why a process with settings ``mine`` may not join a job with
    settings ``job`` (None if it may): names each differing setting."""
    keys = sorted(set(job) | set(mine))
    differences = ['{}: job {!r}, this process {!r}'.format(
        key, job.get(key), mine.get(key))
        for key in keys if job.get(key) != mine.get(key)]
    return '; '.join(differences) or None
