"""The pure core of elastic training: no etcd, no threads, no processes.

* :class:`SettleWindow`: a burst of joins (or leaves) arriving one by one
  becomes one membership, hence one rebuild.
* :class:`Record` and :func:`rendezvous_step`: what a member does next in
  a rebuild, given the settled view and the latest generation record.
* :func:`silent_members`: the members of a broken group that did not
  come to the rebuild in time (left out of the next one).
* :func:`node_layout`: intra/inter ranks from the member names.
* :func:`signature_mismatch`: why a process may not join a job.

The edges (``membership.py``, ``communicator.py``, ``training.py``) feed
these functions what they observe and carry out what they return.
"""
from typing import FrozenSet, Mapping, NamedTuple, Optional, Sequence, Tuple

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


def silent_members(broken: Optional[Record], left: Mapping[str, int],
                   me: str, waited: float, grace: float) -> FrozenSet[str]:
    """The members of the group that broke which have not announced that
    they left it, once this member has waited ``grace`` seconds since it
    saw the group break (none before).

    Every live member of a broken group comes to the rebuild within about
    one iteration: its next collective fails as soon as the others have
    left.  A killed (or stopped) one never does; leaving it out at once,
    instead of waiting for its lease to expire, is what makes a loss cost
    ``grace`` seconds.  A live member slower than ``grace`` is left out
    too and joins again at the next rebuild.

    Args:
        broken: The record of the group that broke (None: none broke).
        left: Per member, the newest generation it announced leaving.
        me: This member (never silent to itself).
        waited: Seconds since this member saw the group break.
        grace: How long live members have to come.
    """
    if broken is None or waited < grace:
        return frozenset()
    return frozenset(member for member in broken.members
                     if member != me
                     and left.get(member, -1) < broken.generation)


def node_layout(members: Sequence[str], me: str) -> Tuple[int, int, int, int]:
    """``(intra_rank, intra_size, inter_rank, inter_size)`` of ``me``, from
    the host part of the names (nodes numbered in rank order)."""
    hosts = [host_of(member) for member in members]
    nodes = list(dict.fromkeys(hosts))
    mine = host_of(me)
    same = [member for member in members if host_of(member) == mine]
    return same.index(me), len(same), nodes.index(mine), len(nodes)


def signature_mismatch(job: Mapping[str, object],
                       mine: Mapping[str, object]) -> Optional[str]:
    """Why a process with settings ``mine`` may not join a job with
    settings ``job`` (None if it may): names each differing setting."""
    keys = sorted(set(job) | set(mine))
    differences = ['{}: job {!r}, this process {!r}'.format(
        key, job.get(key), mine.get(key))
        for key in keys if job.get(key) != mine.get(key)]
    return '; '.join(differences) or None
