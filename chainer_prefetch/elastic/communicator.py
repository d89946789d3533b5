"""A ChainerMN communicator over torch.distributed gloo, rebuilt in-process.

:class:`ElasticCommunicator` registers the process in a job in etcd
(:class:`~.membership.Membership`), asks the job's
:class:`~.policy.ScalePolicy` (through the leader) whether to run, and forms
one gloo process group per *generation*: the leader opens a ``TCPStore``,
publishes its address in the generation's record, and every member of the
record builds ``ProcessGroupGloo(PrefixStore('gN', store), rank, size)``
with ranks in the order of the sorted member names.

Every collective is waited for in slices of 0.1 s; between slices the
communicator checks the group is still whole.  A collective therefore
raises :class:`~.errors.MembershipChanged`

* at once when a peer died or left the group (gloo reports the closed
  connection);
* when a member's key expired (a stopped or cut-off member: within the
  lease ``ttl``), or a newer generation was decided;
* after ``collective_timeout`` without progress (a member that hangs with
  its key alive).

An abandoned process group is released in a background thread (its stuck
operation ends at gloo's own timeout, ``collective_timeout``), so the
caller never waits for it.  :meth:`ElasticCommunicator.rebuild` forms the
next group; :class:`~.training.ElasticTraining` does that, and the rest of
a rebuild, for a Chainer trainer.

Arrays cross into torch without a copy (``torch.from_numpy``); gradients
and parameters travel as one flat buffer per dtype.
"""
import atexit
import datetime
import functools
import operator
import pickle
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy
import torch
from chainermn.communicators.communicator_base import CommunicatorBase
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from chainer_prefetch.elastic import plan
from chainer_prefetch.elastic.errors import JobFinished, MembershipChanged, ScaleFailed
from chainer_prefetch.elastic.etcd_url import parse_etcd_url
from chainer_prefetch.elastic.membership import Membership
from chainer_prefetch.elastic.policy import Progress, ScalePolicy, decide
from chainer_prefetch.elastic.settings import ElasticSettings

POLL = datetime.timedelta(seconds=0.1)
THREAD_PREFIX = 'chainer_prefetch-elastic'

EventCallback = Callable[..., None]
"""``on_event(name, **fields)``: told of registration, decisions, groups
formed and abandoned (for logs, experiments and failure injection)."""


def _ignore_event(name: str, **fields) -> None:
    pass


def _to_tensor(array: numpy.ndarray) -> torch.Tensor:
    """The same memory as a tensor (a copy only if not contiguous)."""
    return torch.from_numpy(numpy.ascontiguousarray(array))


def _release(holder: list) -> None:
    holder.clear()  # the process group's destructor runs here


class ElasticCommunicator(CommunicatorBase):
    """ChainerMN communicator for jobs whose members come and go.

    The constructor registers this process and returns once it is a member
    of a group the policy accepted (a process started later joins the
    running job this way).

    Args:
        url: ``etcd://host:port[,host:port]/job``.
        policy: The job's scale policy (lives as long as this object).
        settings: Time limits (:class:`~.settings.ElasticSettings`).
        signature: Settings every member must share (a process whose
            signature differs is refused with a message naming them).
        on_event: ``on_event(name, **fields)`` callback.

    Raises:
        ValueError: a bad URL or setting.
        EtcdUnavailable: etcd not reachable within ``etcd_timeout``.
        IncompatibleMember: the job under this key has another signature.
        ScaleFailed: the policy ended the job, or kept it waiting too long.
        JobFinished: the job ended before this process was needed.
    """

    def __init__(self, url: str, policy: ScalePolicy,
                 settings: Optional[ElasticSettings] = None,
                 signature: Optional[dict] = None,
                 on_event: Optional[EventCallback] = None):
        super().__init__()
        self.url = parse_etcd_url(url)
        self.settings = (settings or ElasticSettings()).validated()
        self.policy = policy
        self.on_event = on_event or _ignore_event
        self.progress = Progress()
        self.record: Optional[plan.Record] = None
        self.generation = -1
        self.rebuilds = 0
        self._pg: Optional[ProcessGroupGloo] = None
        self._store: Optional[TCPStore] = None
        self._leader_store: Optional[TCPStore] = None
        self._rejoins = 0
        self._blocked: Optional[Tuple[frozenset, float]] = None
        # Members left out for not coming to a rebuild: the generation
        # they did not leave.
        self._silent: Dict[str, int] = {}
        self._layout = (0, 1, 0, 1)
        self.membership = Membership(self.url, self.settings,
                                     signature or {})
        self.on_event('registered', member=self.member)
        atexit.register(self.close)
        try:
            self.rebuild()
        except BaseException:
            self.close()
            raise

    # ---- identity ----------------------------------------------------------

    @property
    def member(self) -> str:
        """This process's member name (``host:pid:token``)."""
        return self.membership.name

    @property
    def members(self) -> Tuple[str, ...]:
        """The members of the current group, in rank order."""
        return self.record.members if self.record else ()

    @property
    def rank(self) -> int:
        return self.record.members.index(self.member)

    @property
    def size(self) -> int:
        return len(self.record.members)

    @property
    def intra_rank(self) -> int:
        return self._layout[0]

    @property
    def intra_size(self) -> int:
        return self._layout[1]

    @property
    def inter_rank(self) -> int:
        return self._layout[2]

    @property
    def inter_size(self) -> int:
        return self._layout[3]

    def split(self, color, key):
        raise NotImplementedError(
            'ElasticCommunicator cannot be split: a sub-communicator would '
            'not follow the membership')

    # ---- generations -------------------------------------------------------

    def membership_changed(self) -> Optional[str]:
        """Why the current group should be rebuilt at this iteration
        boundary (None: it should not).

        The group is rebuilt when a member left, a newer generation was
        decided, or the settled membership differs from the group's
        (members and standby members).
        """
        problem = self._group_problem(self.record)
        if problem:
            return problem
        view = self._without_silent(self.membership.settled_view())
        if view is not None and view != self.record.everyone:
            joined = sorted(view - self.record.everyone)
            left = sorted(self.record.everyone - view)
            return 'membership changed (joined: {}; left: {})'.format(
                ', '.join(joined) or '-', ', '.join(left) or '-')
        return None

    def _still_silent(self) -> frozenset:
        """The members left out of a group for not coming to its rebuild
        (:func:`~.plan.silent_members`, by this member or by the leader of
        a group it joined) that have not come since."""
        if not self._silent:
            return frozenset()
        left = self.membership.left()
        return frozenset(member for member, generation in self._silent.items()
                         if left.get(member, -1) < generation)

    def _note_left_out(self, previous: Optional[plan.Record],
                       record: plan.Record) -> None:
        """Notes the members of ``previous`` (this member's last group) that
        ``record``, the group joined, left out and that have not come to the
        rebuild: the leader found them silent, and their keys live on until
        their leases expire (forgets those whose keys are gone)."""
        view = self.membership.view()
        self._silent = {member: generation
                        for member, generation in self._silent.items()
                        if member in view}
        if previous is None:
            return
        left = self.membership.left()
        for member in set(previous.members) - record.everyone:
            if member in view and left.get(member, -1) < previous.generation:
                self._note_silent(member, previous.generation)

    def _note_silent(self, member: str, generation: int) -> None:
        """Notes that ``member`` did not come to the rebuild after
        ``generation`` (the newest such generation counts: a member that
        came back and was lost again is silent again)."""
        self._silent[member] = max(generation, self._silent.get(member, -1))

    def _without_silent(self, view):
        """``view`` without the members still silent (their keys live on
        until their leases expire)."""
        return view if view is None else view - self._still_silent()

    def rebuild(self, failed: bool = False) -> plan.Record:
        """Leaves the current group and joins the next one.

        Args:
            failed: The current group broke (a collective failed): its
                membership is not decided on again until it changes or
                twice the lease has passed.

        Returns:
            The record of the new generation.

        Raises:
            ScaleFailed, JobFinished, EtcdUnavailable: see the class.
        """
        started = time.monotonic()
        broken, previous = None, self.record
        if self.record is not None:
            if failed:
                broken = self.record
                self._blocked = (self.record.everyone,
                                 started + 2 * self.settings.ttl)
            self.rebuilds += 1
        self._leave_group()
        self.membership.announce(self.progress, self.generation)
        after = self.generation
        holding_since = None
        while True:
            membership = self.membership
            blocked = None
            if self._blocked and time.monotonic() < self._blocked[1]:
                blocked = self._blocked[0]
            waited = time.monotonic() - started
            silent = plan.silent_members(broken, membership.left(),
                                         self.member, waited,
                                         self.settings.loss_grace)
            for member in silent:
                self._note_silent(member, broken.generation)
            view = self._without_silent(membership.settled_view())
            step = plan.rendezvous_step(self.member, view, membership.latest(),
                                        after, blocked)
            if step.action != 'hold':
                holding_since = None
            if step.action == 'join':
                if self._form(step.record):
                    self._note_left_out(previous, step.record)
                    self.on_event('formed', generation=self.generation,
                                  size=self.size, group_rank=self.rank,
                                  seconds=time.monotonic() - started)
                    return step.record
                after = step.record.generation
                self._blocked = (frozenset(step.record.members),
                                 time.monotonic() + 2 * self.settings.ttl)
            elif step.action == 'decide':
                self._decide(step.generation, view)
            elif step.action == 'fail':
                raise ScaleFailed('job {!r} ended by its scale policy: {}'
                                  .format(self.url.job, step.record.reason))
            elif step.action == 'done':
                raise JobFinished('job {!r} finished before this member ({}) '
                                  'was needed'.format(self.url.job,
                                                      self.member))
            else:
                if step.action == 'hold' and step.record.verdict == 'wait':
                    holding_since = holding_since or time.monotonic()
                    waited = time.monotonic() - holding_since
                    if waited > self.settings.wait_timeout:
                        raise ScaleFailed(
                            'job {!r}: the scale policy kept it waiting for '
                            '{:.0f} s (wait_timeout): {}'.format(
                                self.url.job, waited, step.record.reason))
                grace_left = self.settings.loss_grace - waited
                membership.wait_for_change(
                    min(0.5, grace_left) if broken and grace_left > 0
                    else 0.5)

    def _decide(self, generation: int, view) -> None:
        """The leader asks the policy and publishes the decision."""
        membership = self.membership
        progress = membership.furthest_progress(view, self.progress)
        decision = decide(self.policy, sorted(view), not membership.ran,
                          progress)
        store = address = None
        if decision.verdict == 'ok':
            host = membership.advertise_host()
            store = TCPStore(host, 0, None, True, timeout=datetime.timedelta(
                seconds=self.settings.rendezvous_timeout),
                wait_for_workers=False)
            address = '{}:{}'.format(host, store.port)
        record = plan.Record(generation, decision.verdict,
                             tuple(decision.members), tuple(decision.standby),
                             address, decision.reason, self.member)
        if membership.publish(record):
            self._leader_store = store
            self.on_event('decided', generation=generation,
                          verdict=decision.verdict, size=len(decision.members),
                          reason=decision.reason)

    def _form(self, record: plan.Record) -> bool:
        """Builds the process group of ``record``; False if it could not
        be formed (a member left, a newer decision, or the timeout)."""
        rank = record.members.index(self.member)
        host, port = record.store.rsplit(':', 1)
        timeout = datetime.timedelta(seconds=self.settings.rendezvous_timeout)
        mine = self._leader_store if record.leader == self.member else None
        result = {}

        def connect():
            try:
                store = mine or TCPStore(host, int(port), None, False,
                                         timeout=timeout)
                result['store'] = store
                result['pg'] = ProcessGroupGloo(
                    PrefixStore('g{}'.format(record.generation), store), rank,
                    len(record.members), datetime.timedelta(
                        seconds=self.settings.collective_timeout))
            except Exception as error:  # reported below
                result['error'] = error

        thread = threading.Thread(target=connect, daemon=True,
                                  name=THREAD_PREFIX + '-rendezvous')
        thread.start()
        deadline = time.monotonic() + self.settings.rendezvous_timeout
        rejoins = self.membership.rejoins
        while thread.is_alive():
            thread.join(0.05)
            problem = self._group_problem(record, rejoins)
            if problem is None and time.monotonic() > deadline:
                problem = 'no group within {} s'.format(
                    self.settings.rendezvous_timeout)
            if problem and thread.is_alive():
                # The thread ends by itself at the store's timeout.
                self.on_event('abandoned', generation=record.generation,
                              reason=problem)
                return False
        if 'error' in result:
            self.on_event('abandoned', generation=record.generation,
                          reason=str(result['error']).splitlines()[0])
            return False
        self._pg, self._store = result['pg'], result['store']
        self.record = record
        self.generation = record.generation
        self._rejoins = rejoins
        self._layout = plan.node_layout(record.members, self.member)
        return True

    def _group_problem(self, record: plan.Record,
                       rejoins: Optional[int] = None) -> Optional[str]:
        membership = self.membership
        missing = set(record.members) - membership.view()
        if missing:
            return 'member(s) left: {}'.format(', '.join(sorted(missing)))
        if membership.rejoins != (self._rejoins if rejoins is None
                                  else rejoins):
            return ('this member lost its lease (it was stopped or cut off '
                    'for longer than {} s)'.format(self.settings.ttl))
        latest = membership.latest()
        if latest is not None and latest.generation > record.generation:
            return 'generation {} was decided ({})'.format(
                latest.generation, latest.reason)
        return None

    def _leave_group(self) -> None:
        """Closes this member's process group and store (no operation is
        in flight: a stuck one was handed to a thread by _abandon)."""
        self._close_group()
        self._store = None
        self._leader_store = None
        self.record = None

    def _close_group(self) -> None:
        """Aborts the process group, which closes its connections, so that
        a peer still inside a collective with this member fails at once
        (dropping the object alone left a peer waiting for gloo's
        timeout)."""
        if self._pg is not None:
            self._pg.abort()
            self._pg = None

    def _abandon(self) -> None:
        """Drops a process group whose operation is stuck, without waiting
        for it (its destructor runs in a thread until gloo's timeout)."""
        if self._pg is not None:
            self._pg.abort()
        holder = [self._pg, self._store]
        self._pg = self._store = None
        threading.Thread(target=_release, args=(holder,), daemon=True,
                         name=THREAD_PREFIX + '-release').start()
        del holder

    def _wait(self, work, what: str) -> None:
        """Waits for a gloo operation in slices, checking the group."""
        deadline = time.monotonic() + self.settings.collective_timeout
        while True:
            try:
                work.wait(POLL)
                return
            except RuntimeError:
                pass  # the slice ended (or the operation failed: below)
            if work.is_completed():
                # Done between the slice's end and now, or failed: a second
                # wait returns at once or raises the operation's error.
                try:
                    work.wait()
                    return
                except RuntimeError as error:
                    # Nothing in flight: closing now tells the peers at once.
                    self._close_group()
                    raise MembershipChanged(
                        '{} failed in generation {}: {}'.format(
                            what, self.generation,
                            str(error).splitlines()[0])) from error
            problem = self._group_problem(self.record)
            if problem is None and time.monotonic() > deadline:
                problem = 'no progress for {} s (a member hangs?)'.format(
                    self.settings.collective_timeout)
            if problem:
                self._abandon()
                raise MembershipChanged('{} abandoned in generation {}: {}'
                                        .format(what, self.generation,
                                                problem))

    def _group(self) -> ProcessGroupGloo:
        if self._pg is None:
            raise MembershipChanged('no group (generation {} was left): '
                                    'call rebuild()'.format(self.generation))
        return self._pg

    # ---- tensors -----------------------------------------------------------

    def _allreduce_sum(self, array: numpy.ndarray, what: str) -> None:
        """Sums a contiguous array over the group, in place."""
        self._wait(self._group().allreduce([_to_tensor(array)]), what)

    def _broadcast(self, array: numpy.ndarray, root: int, what: str) -> None:
        options = torch.distributed.BroadcastOptions()
        options.rootRank = root
        self._wait(self._group().broadcast([_to_tensor(array)], options),
                   what)

    def _allgather(self, array: numpy.ndarray, what: str) -> List[numpy.ndarray]:
        outputs = [torch.empty_like(_to_tensor(array))
                   for _ in range(self.size)]
        self._wait(self._group().allgather([outputs], [_to_tensor(array)]),
                   what)
        return [output.numpy() for output in outputs]

    # ---- objects -----------------------------------------------------------

    def _pickled(self, obj) -> numpy.ndarray:
        return numpy.frombuffer(pickle.dumps(obj, protocol=4), numpy.uint8)

    def bcast_obj(self, obj, max_buf_len=None, root=0):
        length = numpy.zeros(1, numpy.int64)
        if self.rank == root:
            payload = self._pickled(obj).copy()
            length[0] = payload.size
        self._broadcast(length, root, 'bcast_obj')
        if self.rank != root:
            payload = numpy.empty(int(length[0]), numpy.uint8)
        self._broadcast(payload, root, 'bcast_obj')
        return obj if self.rank == root else pickle.loads(payload.tobytes())

    def allgather_obj(self, obj) -> List[Any]:
        """Every member's ``obj``, in rank order, on every member."""
        payload = self._pickled(obj)
        lengths = self._allgather(numpy.array([payload.size], numpy.int64),
                                  'allgather_obj')
        longest = int(max(length[0] for length in lengths))
        padded = numpy.zeros(longest, numpy.uint8)
        padded[:payload.size] = payload
        gathered = self._allgather(padded, 'allgather_obj')
        return [pickle.loads(data[:int(length[0])].tobytes())
                for data, length in zip(gathered, lengths)]

    def gather_obj(self, obj, root=0):
        gathered = self.allgather_obj(obj)
        return gathered if self.rank == root else None

    def allreduce_obj(self, obj):
        return functools.reduce(operator.add, self.allgather_obj(obj))

    def send_obj(self, obj, dest, tag=0):
        payload = self._pickled(obj).copy()
        length = numpy.array([payload.size], numpy.int64)
        self._wait(self._group().send([_to_tensor(length)], dest, tag),
                   'send_obj')
        self._wait(self._group().send([_to_tensor(payload)], dest, tag),
                   'send_obj')

    def recv_obj(self, source, status=None, tag=0):
        length = numpy.zeros(1, numpy.int64)
        self._wait(self._group().recv([_to_tensor(length)], source, tag),
                   'recv_obj')
        payload = numpy.empty(int(length[0]), numpy.uint8)
        self._wait(self._group().recv([_to_tensor(payload)], source, tag),
                   'recv_obj')
        return pickle.loads(payload.tobytes())

    # ---- arrays ------------------------------------------------------------

    def send(self, data, dest, tag):
        arrays = data if isinstance(data, (tuple, list)) else (data,)
        self.send_obj((isinstance(data, (tuple, list)),
                       [(a.shape, a.dtype.str) for a in arrays]), dest, tag)
        for array in arrays:
            self._wait(self._group().send(
                [_to_tensor(numpy.asarray(array))], dest, tag), 'send')

    def recv(self, source, tag):
        is_tuple, headers = self.recv_obj(source, tag=tag)
        arrays = []
        for shape, dtype in headers:
            array = numpy.empty(shape, dtype)
            self._wait(self._group().recv([_to_tensor(array)], source, tag),
                       'recv')
            arrays.append(array)
        return tuple(arrays) if is_tuple else arrays[0]

    def bcast(self, data, max_buf_len=None, root=0):
        header = (data.shape, data.dtype.str) if self.rank == root else None
        shape, dtype = self.bcast_obj(header, root=root)
        array = (numpy.ascontiguousarray(data) if self.rank == root
                 else numpy.empty(shape, dtype))
        self._broadcast(array, root, 'bcast')
        return array

    def gather(self, data, root=0):
        gathered = self.allgather_obj(numpy.asarray(data))
        return tuple(gathered) if self.rank == root else None

    def allgather(self, x):
        return tuple(self.allgather_obj(numpy.asarray(x)))

    def allreduce(self, data):
        array = numpy.array(data, copy=True)
        self._allreduce_sum(array, 'allreduce')
        return array

    def scatter(self, xs, root=0):
        parts = None
        if self.rank == root:
            if len(xs) != self.size:
                raise ValueError('scatter needs {} parts, got {}'.format(
                    self.size, len(xs)))
            parts = [numpy.asarray(x) for x in xs]
        return self.allgather_obj(parts if self.rank == root else None
                                  )[root][self.rank]

    def alltoall(self, xs):
        if len(xs) != self.size:
            raise ValueError('alltoall needs {} parts, got {}'.format(
                self.size, len(xs)))
        everything = self.allgather_obj([numpy.asarray(x) for x in xs])
        return tuple(parts[self.rank] for parts in everything)

    # ---- models ------------------------------------------------------------

    def bcast_data(self, model) -> None:
        """Broadcasts the parameters of ``model`` from rank 0 (one flat
        buffer per dtype)."""
        params = [param for _, param in sorted(model.namedparams())
                  if param.array is not None]
        for group in _by_dtype(params, lambda p: p.array):
            flat = _pack([param.array for param in group])
            self._broadcast(flat, 0, 'bcast_data')
            _unpack(flat, [param.array for param in group])

    def multi_node_mean_grad(self, model, zero_fill=False) -> None:
        """Averages the gradients of ``model`` over the group (one
        allreduce per dtype of a flat buffer)."""
        params = []
        for _, param in sorted(model.namedparams()):
            if param.grad is None and zero_fill and param.array is not None:
                param.grad = param.xp.zeros_like(param.array)
            if param.grad is not None:
                params.append(param)
        for group in _by_dtype(params, lambda p: p.grad):
            flat = _pack([param.grad for param in group])
            self._allreduce_sum(flat, 'multi_node_mean_grad')
            flat /= self.size
            _unpack(flat, [param.grad for param in group])

    # ---- the end -----------------------------------------------------------

    def finish(self) -> None:
        """Ends the job normally: rank 0 records that it is done (standby
        and waiting members then end too), then :meth:`close`."""
        if self.record is not None and self.rank == 0:
            for _ in range(10):
                latest = self.membership.latest()
                generation = max(self.generation,
                                 latest.generation if latest else -1) + 1
                if self.membership.publish(plan.Record(
                        generation, 'done', (), self.record.standby, None,
                        'training finished', self.member)):
                    break
                self.membership.wait_for_change(0.1)
        self.close()

    def close(self) -> None:
        """Leaves the group and the job; the last member deletes the job's
        keys (idempotent; also run at exit).  While members left out for
        not coming to a rebuild still have keys (a member lost less than
        ``ttl`` ago), it waits for their leases to expire first (at most
        ``ttl``), so that the last member sees none and deletes the job's
        keys."""
        self._leave_group()
        try:
            self.membership.wait_until_gone(self._still_silent(),
                                            self.settings.ttl + 1)
        except Exception:  # etcd gone: the leases expire by themselves
            pass
        self.membership.close()
        atexit.unregister(self.close)

    def finalize(self):
        self.close()


def _by_dtype(params: Sequence, array_of) -> List[List]:
    groups = {}
    for param in params:
        groups.setdefault(array_of(param).dtype, []).append(param)
    return list(groups.values())


def _pack(arrays: Sequence[numpy.ndarray]) -> numpy.ndarray:
    return numpy.concatenate([numpy.ravel(array) for array in arrays])


def _unpack(flat: numpy.ndarray, arrays: Sequence[numpy.ndarray]) -> None:
    offset = 0
    for array in arrays:
        array[...] = flat[offset:offset + array.size].reshape(array.shape)
        offset += array.size
