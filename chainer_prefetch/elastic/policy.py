"""Scale policies: user code that decides whether a job runs, waits or fails.

After every change of membership that has settled, the leader asks the
job's policy object ``ok2run(hosts, initial)`` (define-by-run: any Python
logic, and the object keeps its state for the whole job):

* ``'ok'``: (re)form the group with the members ``select(hosts)`` returns
  (default: all of them); the others wait as standby members;
* ``'wait'``: hold every member until the membership changes again (bounded
  by ``ElasticSettings.wait_timeout``);
* ``'fail'``: end the job on every member with :class:`ScaleFailed`.

``hosts`` is the sorted list of member names (``host:pid:token``), which
is also the rank order; ``initial`` is True until the job has run once.
Before each call the policy's ``progress`` holds the training progress of
the member furthest ahead (:class:`Progress`), so a rule such as "fail when
fewer than half the members are left before 80% of the run" is a few lines::

    class HalfBefore80(ScalePolicy):
        def __init__(self, n):
            self.n = n
        def ok2run(self, hosts, initial):
            if initial:
                return 'ok' if len(hosts) == self.n else 'wait'
            if len(hosts) < self.n / 2 and self.progress.fraction < 0.8:
                return 'fail'
            return 'ok'

Everything here is pure: no etcd, no processes.
"""
from typing import List, NamedTuple, Optional, Sequence

VERDICTS = ('ok', 'wait', 'fail')


class Progress(NamedTuple):
    """How far training is (as known to the member that asks the policy).

    Attributes:
        iteration: Iterations done.
        epoch_detail: Epochs done (fractional).
        fraction: Share of the whole run done (0 when unknown).
        elapsed: Seconds since the job started.
        eta: Estimated seconds left at the current speed (None: unknown).
        size: Members of the current group (0 before the first one).
    """
    iteration: int = 0
    epoch_detail: float = 0.0
    fraction: float = 0.0
    elapsed: float = 0.0
    eta: Optional[float] = None
    size: int = 0


class ScalePolicy:
    """Base class of scale policies; override :meth:`ok2run`.

    Attributes:
        progress: The latest :class:`Progress` (set before each call).
    """

    progress = Progress()

    def ok2run(self, hosts: Sequence[str], initial: bool) -> str:
        """Whether the job may run with ``hosts``.

        Args:
            hosts: Sorted member names (rank order).
            initial: True until the job has run with some group.

        Returns:
            ``'ok'``, ``'wait'`` or ``'fail'``.
        """
        raise NotImplementedError

    def select(self, hosts: Sequence[str]) -> List[str]:
        """The members that train when the verdict is ``'ok'`` (default:
        all); the rest wait as standby members.  Must keep the order."""
        return list(hosts)

    def describe(self) -> str:
        """A short name for messages (default: the class name)."""
        return type(self).__name__


class FailStop(ScalePolicy):
    """Run with exactly ``n`` members: wait for them at start, fail when one
    is lost (or one too many arrives) afterwards.

    Args:
        n: The number of members.
    """

    def __init__(self, n: int):
        if n < 1:
            raise ValueError('FailStop needs n >= 1, got {}'.format(n))
        self.n = n

    def ok2run(self, hosts: Sequence[str], initial: bool) -> str:
        if len(hosts) == self.n:
            return 'ok'
        return 'wait' if initial else 'fail'

    def describe(self) -> str:
        return 'FailStop({})'.format(self.n)


class MinMax(ScalePolicy):
    """Run while at least ``n_min`` members are there; use at most ``n_max``
    (the others are standby members, taken in when one is lost).  With
    fewer than ``n_min`` every member waits for more.

    Args:
        n_min: Fewest members to train with.
        n_max: Most members to train with (None: no limit).
    """

    def __init__(self, n_min: int, n_max: Optional[int] = None):
        if n_min < 1 or (n_max is not None and n_max < n_min):
            raise ValueError('MinMax needs 1 <= n_min <= n_max, got {}, {}'
                             .format(n_min, n_max))
        self.n_min = n_min
        self.n_max = n_max

    def ok2run(self, hosts: Sequence[str], initial: bool) -> str:
        return 'ok' if len(hosts) >= self.n_min else 'wait'

    def select(self, hosts: Sequence[str]) -> List[str]:
        return list(hosts) if self.n_max is None else list(hosts)[:self.n_max]

    def describe(self) -> str:
        return 'MinMax({}, {})'.format(self.n_min, self.n_max)


class Decision(NamedTuple):
    """What the policy decided for one membership.

    Attributes:
        verdict: ``'ok'``, ``'wait'`` or ``'fail'``.
        members: Members that train (empty unless ``'ok'``).
        standby: Members that wait meanwhile.
        reason: A sentence for the log and for :class:`ScaleFailed`.
    """
    verdict: str
    members: List[str]
    standby: List[str]
    reason: str


def decide(policy: ScalePolicy, hosts: Sequence[str], initial: bool,
           progress: Progress) -> Decision:
    """Asks ``policy`` about ``hosts`` and checks its answers.

    Args:
        policy: The job's policy.
        hosts: Member names (sorted here).
        initial: Whether the job has not run yet.
        progress: Put into ``policy.progress`` before the call.

    Returns:
        The :class:`Decision`.

    Raises:
        ValueError: the policy returned something else than a verdict, or
            a selection that is empty, not a subset of ``hosts`` or out of
            order.
    """
    hosts = sorted(hosts)
    policy.progress = progress
    verdict = policy.ok2run(list(hosts), initial)
    name = policy.describe()
    if verdict not in VERDICTS:
        raise ValueError('{}.ok2run returned {!r}; it must return one of {}'
                         .format(name, verdict, ', '.join(VERDICTS)))
    described = '{} with {} member(s) ({}run)'.format(
        name, len(hosts), 'first ' if initial else '')
    if verdict != 'ok':
        return Decision(verdict, [], hosts, '{}: {}'.format(described, verdict))
    members = list(policy.select(list(hosts)))
    if not members or any(m not in hosts for m in members) or \
            members != sorted(members):
        raise ValueError('{}.select returned {!r}: it must be a non-empty, '
                         'ordered subset of {!r}'.format(name, members, hosts))
    standby = [host for host in hosts if host not in members]
    reason = '{}: ok, {} train'.format(described, len(members))
    if standby:
        reason += ', {} standby'.format(len(standby))
    return Decision('ok', members, standby, reason)


def parse_policy(text: str) -> ScalePolicy:
    """A policy from a command-line value.

    ``failstop:N``, ``minmax:MIN`` or ``minmax:MIN:MAX``, or
    ``package.module:NAME`` naming a :class:`ScalePolicy` subclass (built
    without arguments) or instance.

    Raises:
        ValueError: none of these (the message lists them).
    """
    import importlib
    usage = ('use failstop:N, minmax:MIN[:MAX] or package.module:NAME (a '
             'ScalePolicy subclass or instance)')
    name, _, rest = text.partition(':')
    try:
        if name.lower() == 'failstop':
            return FailStop(int(rest))
        if name.lower() == 'minmax':
            low, _, high = rest.partition(':')
            return MinMax(int(low), int(high) if high else None)
        if rest:
            found = getattr(importlib.import_module(name), rest)
            policy = found() if isinstance(found, type) else found
            if isinstance(policy, ScalePolicy):
                return policy
    except (ValueError, ImportError, AttributeError) as error:
        raise ValueError('bad scale policy {!r} ({}); {}'.format(
            text, error, usage)) from None
    raise ValueError('bad scale policy {!r}; {}'.format(text, usage))
