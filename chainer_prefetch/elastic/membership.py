"""This process's membership of a job, kept in etcd (the edge).

Keys under ``/chainer_prefetch/elastic/JOB/``:

``config``
    The job's settings (the signature every member must share) and the id
    of the *job lease*; created atomically by the first process.
``members/NAME``
    One key per member, on the member's own lease (``ttl``): it vanishes
    when the member dies, hangs or is cut off.
``gen/NNNNNNNNNN``
    The leader's decision for each generation (:class:`~.plan.Record`),
    created atomically, so one generation has one decision.

``config`` and ``gen/`` are on the job lease, which every member refreshes:
if every member dies they expire with it, and the last member to leave
normally deletes the whole prefix.  No key outlives the job.

One thread per member (``chainer_prefetch-elastic-membership``) refreshes
the leases, reads the job's keys whenever etcd's watch reports a change (and
every quarter second otherwise), and feeds the :class:`~.plan.SettleWindow`.
It stops in :meth:`Membership.close`.
"""
import json
import os
import secrets
import socket
import threading
import time
from typing import Dict, FrozenSet, Mapping, Optional

import etcd3gw
from etcd3gw.watch import Watcher

from chainer_prefetch.elastic.errors import EtcdUnavailable, IncompatibleMember, JobFinished
from chainer_prefetch.elastic.etcd import connect
from chainer_prefetch.elastic.etcd_url import EtcdUrl
from chainer_prefetch.elastic.plan import Record, SettleWindow, member_name, signature_mismatch
from chainer_prefetch.elastic.policy import Progress
from chainer_prefetch.elastic.settings import ElasticSettings

POLL_SECONDS = 0.25
JOB_LEASE_FACTOR = 10
"""The job lease lasts this many member leases (at least 30 s)."""


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Membership:
    """Registers this process in a job and watches the others.

    Args:
        url: The job's etcd address.
        settings: Time limits.
        signature: Settings every member of the job must share (e.g. model
            parameter shapes, dataset size, batch size).

    Raises:
        EtcdUnavailable: etcd not reachable within ``etcd_timeout``.
        IncompatibleMember: the job under this key has another signature.
        JobFinished: the job under this key has just ended.
    """

    def __init__(self, url: EtcdUrl, settings: ElasticSettings,
                 signature: Mapping[str, object]):
        self.url = url
        self.settings = settings
        self.client = connect(url, settings.etcd_timeout)
        self.name = member_name(socket.gethostname(), os.getpid(),
                                secrets.token_hex(3))
        self.prefix = url.prefix
        self.signature = dict(signature)
        self.rejoins = 0
        self._changed = threading.Condition()
        self._window = SettleWindow(settings.settle)
        self._view: FrozenSet[str] = frozenset()
        self._latest: Optional[Record] = None
        self._progress: Dict[str, dict] = {}
        self._left: Dict[str, int] = {}
        self.ran = False
        self._error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._watcher: Optional[Watcher] = None
        self._job_lease = self._join_job()
        self._lease = None
        self._last_progress: Optional[Progress] = None
        self._last_left = -1
        try:
            self._register()
            self._read()
            self._thread = threading.Thread(
                target=self._run, name='chainer_prefetch-elastic-membership',
                daemon=True)
            self._thread.start()
        except BaseException:
            self._revoke()
            raise

    # ---- keys --------------------------------------------------------------

    def _key(self, *parts: str) -> str:
        return self.prefix + '/'.join(parts)

    def _join_job(self) -> etcd3gw.Lease:
        """Creates the job's config, or checks this process against it."""
        mine = json.loads(json.dumps(self.signature))  # as stored
        job_ttl = max(30, JOB_LEASE_FACTOR * self.settings.ttl)
        deadline = time.monotonic() + self.settings.etcd_timeout
        while True:
            lease = self.client.lease(job_ttl)
            config = dict(signature=mine, job_lease=lease.id)
            if self.client.create(self._key('config'), json.dumps(config),
                                  lease=lease):
                return lease
            lease.revoke()
            stored = self.client.get(self._key('config'))
            if stored:
                config = json.loads(_text(stored[0]))
                mismatch = signature_mismatch(config['signature'], mine)
                if mismatch:
                    raise IncompatibleMember(
                        'this process cannot join job {!r} at {}: {}'.format(
                            self.url.job, self.url, mismatch))
                job_lease = etcd3gw.Lease(int(config['job_lease']),
                                          client=self.client)
                if job_lease.refresh() > 0:
                    latest = self._latest_record()
                    if latest is not None and latest.verdict == 'done':
                        raise JobFinished('job {!r} at {} has just finished'
                                          .format(self.url.job, self.url))
                    return job_lease
            if time.monotonic() > deadline:
                raise EtcdUnavailable('the config of job {!r} at {} keeps '
                                      'vanishing'.format(self.url.job,
                                                         self.url))
            time.sleep(0.1)  # the job is ending: its config will go

    def _register(self, progress: Optional[Progress] = None,
                  left: int = -1) -> None:
        if self._lease is None or self._lease.refresh() <= 0:
            self._lease = self.client.lease(self.settings.ttl)
        value = dict(host=socket.gethostname(), pid=os.getpid(),
                     progress=None if progress is None else progress._asdict(),
                     left=left)
        self.client.put(self._key('members', self.name), json.dumps(value),
                        lease=self._lease)
        self._last_progress = progress
        self._last_left = left

    def _latest_record(self) -> Optional[Record]:
        records = self.client.get_prefix(self._key('gen/'),
                                         sort_order='descend',
                                         sort_target='key')
        if not records:
            return None
        return Record.from_dict(json.loads(_text(records[0][0])))

    def _read(self) -> None:
        """Reads members and the latest record; feeds the settle window."""
        view, latest, progress, left, ran = set(), None, {}, {}, False
        for value, meta in self.client.get_prefix(self.prefix):
            key = _text(meta['key'])[len(self.prefix):]
            if key.startswith('members/'):
                name = key[len('members/'):]
                view.add(name)
                fields = json.loads(_text(value))
                progress[name] = fields.get('progress')
                left[name] = fields.get('left', -1)
            elif key.startswith('gen/'):
                record = Record.from_dict(json.loads(_text(value)))
                ran = ran or record.verdict == 'ok'
                if latest is None or record.generation > latest.generation:
                    latest = record
        with self._changed:
            self._view = frozenset(view)
            self._latest = latest
            self._progress = progress
            self._left = left
            self.ran = ran
            self._window.observe(self._view, time.monotonic())
            self._changed.notify_all()

    # ---- the thread --------------------------------------------------------

    def _run(self) -> None:
        refresh_every = self.settings.ttl / 4.0
        next_refresh = time.monotonic() + refresh_every
        lost_since = None
        while not self._stop.is_set():
            self._wake.wait(POLL_SECONDS)
            self._wake.clear()
            if self._stop.is_set():
                break
            now = time.monotonic()
            try:
                if now >= next_refresh:
                    self._refresh_leases()
                    next_refresh = now + refresh_every
                if self._watcher is None:
                    self._watcher = Watcher(
                        self.client, self.prefix, self._on_event,
                        range_end=_prefix_end(self.prefix))
                self._read()
                lost_since = None
            except Exception as error:  # etcd down or a request failed
                self._drop_watcher()
                if lost_since is None:
                    lost_since = now
                elif now - lost_since > self.settings.etcd_timeout:
                    self._fail(EtcdUnavailable(
                        'lost etcd at {} for more than {} s during the run of '
                        'job {!r} (last error: {})'.format(
                            self.url, self.settings.etcd_timeout,
                            self.url.job, error)))
                    return
        self._drop_watcher()

    def _refresh_leases(self) -> None:
        if self._lease.refresh() <= 0:
            # Expired (this process was stopped or cut off for longer than
            # the lease): register again; the current group is void.
            self.rejoins += 1
            self._register(self._last_progress, self._last_left)
        self._job_lease.refresh()

    def _on_event(self, event) -> None:
        self._wake.set()

    def _drop_watcher(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    def _fail(self, error: BaseException) -> None:
        with self._changed:
            self._error = error
            self._changed.notify_all()

    # ---- what the communicator asks -----------------------------------------

    def check(self) -> None:
        """Raises the error of the thread, if any (etcd lost)."""
        if self._error is not None:
            raise self._error

    def view(self) -> FrozenSet[str]:
        """The members whose keys exist now."""
        self.check()
        return self._view

    def settled_view(self) -> Optional[FrozenSet[str]]:
        """The members, once they have not changed for the settle window."""
        self.check()
        with self._changed:
            return self._window.settled(time.monotonic())

    def latest(self) -> Optional[Record]:
        """The newest generation record."""
        self.check()
        return self._latest

    def wait_for_change(self, timeout: float) -> None:
        """Sleeps until the keys change, the view settles, or ``timeout``."""
        with self._changed:
            remaining = self._window.remaining(time.monotonic())
            if remaining > 0:
                timeout = min(timeout, remaining + 0.01)
            self._changed.wait(timeout)

    def _retrying(self, what: str, call, *args, **kwargs):
        """``call(*args, **kwargs)``, retried while etcd does not answer.

        Raises:
            EtcdUnavailable: no answer within ``etcd_timeout``.
        """
        deadline = time.monotonic() + self.settings.etcd_timeout
        while True:
            self.check()
            try:
                return call(*args, **kwargs)
            except Exception as error:  # requests/etcd3gw errors vary
                if time.monotonic() > deadline:
                    raise EtcdUnavailable(
                        'lost etcd at {} for more than {} s during the run '
                        'of job {!r} ({}: {!r})'.format(
                            self.url, self.settings.etcd_timeout,
                            self.url.job, what, error)) from error
                time.sleep(0.2)

    def announce(self, progress: Progress, left: int = -1) -> None:
        """Publishes this member's training progress (at each rebuild), for
        the leader's policy, and the generation it is leaving."""
        self._retrying('announce', self._register, progress, left)

    def left(self) -> Dict[str, int]:
        """Per member, the newest generation it announced leaving."""
        self.check()
        return dict(self._left)

    def furthest_progress(self, members, own: Progress) -> Progress:
        """The progress of the member of ``members`` furthest ahead."""
        known = [Progress(**p) for name, p in self._progress.items()
                 if p and name in members]
        return max(known + [own], key=lambda p: p.iteration)

    def publish(self, record: Record) -> bool:
        """Stores ``record`` if its generation has none yet (atomically);
        returns whether it did."""
        created = self._retrying(
            'publish', self.client.create,
            self._key('gen', '{:010d}'.format(record.generation)),
            json.dumps(record.to_dict()), lease=self._job_lease)
        if created:
            self._wake.set()
        return created

    def advertise_host(self) -> str:
        """The address other members can reach this process at."""
        if self.settings.advertise_host:
            return self.settings.advertise_host
        host, port = self.url.endpoints[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return probe.getsockname()[0]

    # ---- the end -----------------------------------------------------------

    def wait_until_gone(self, members, timeout: float) -> None:
        """Waits until none of ``members`` has a key, at most ``timeout``
        seconds."""
        deadline = time.monotonic() + timeout
        while members & self.view() and time.monotonic() < deadline:
            self.wait_for_change(min(0.25, deadline - time.monotonic()))

    def close(self) -> None:
        """Stops the thread, deletes this member's key and, if it was the
        last member, every key of the job (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(5)
        self._revoke()

    def _revoke(self) -> None:
        try:
            if self._lease is not None:
                self._lease.revoke()
            if not self.client.get_prefix(self._key('members/')):
                self.client.delete_prefix(self.prefix)
        except Exception:
            pass  # etcd gone: the leases expire by themselves


def _prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)
