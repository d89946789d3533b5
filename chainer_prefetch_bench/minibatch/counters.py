"""The kernel's counters of a process tree, read from ``/proc``.

Per process: CPU time (user and kernel, its exited threads included), minor
page faults, and per thread, time runnable but waiting for a core and the
number of times it was put on a core (``/proc/PID/task/*/schedstat``).
Used by the minibatch benchmark (the counters of the epochs after the
first) and by its profiler (:mod:`chainer_prefetch_bench.minibatch.profile`).
"""
import collections
import os
from typing import Dict, Mapping, Optional

_CLOCK_TICKS = os.sysconf('SC_CLK_TCK')

#: The summed fields of :func:`tree_change`.
TOTALS = ('cpu_s', 'minor_faults', 'runqueue_s', 'timeslices')


def _stat_fields(pid: int):
    """The fields of ``/proc/PID/stat`` after the command name: field n of
    the file is element n - 3 (raises ``OSError`` if the process is gone)."""
    with open('/proc/{}/stat'.format(pid)) as file:
        return file.read().rsplit(')', 1)[1].split()


def read_counters(pid: int) -> Optional[dict]:
    """CPU, run-queue and fault counters of process ``pid`` (``None`` if gone).

    ``on_cpu_s``, ``runqueue_s`` and ``timeslices`` sum its living threads
    (``threads``: the same per thread id); ``user_s`` and ``kernel_s`` also
    count the threads that have exited.  ``started`` tells a pid reused by
    another process apart.
    """
    try:
        fields = _stat_fields(pid)
        tasks = os.listdir('/proc/{}/task'.format(pid))
    except (OSError, ValueError):
        return None
    threads = {}
    for task in tasks:
        try:
            with open('/proc/{}/task/{}/schedstat'.format(pid, task)) as file:
                on_cpu_ns, waiting_ns, slices = map(int, file.read().split())
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        threads[int(task)] = (on_cpu_ns / 1e9, waiting_ns / 1e9, slices)
    return {'ppid': int(fields[1]), 'started': int(fields[19]),
            'minor_faults': int(fields[7]),
            'user_s': int(fields[11]) / _CLOCK_TICKS,
            'kernel_s': int(fields[12]) / _CLOCK_TICKS,
            'on_cpu_s': sum(thread[0] for thread in threads.values()),
            'runqueue_s': sum(thread[1] for thread in threads.values()),
            'timeslices': sum(thread[2] for thread in threads.values()),
            'threads': threads}


def tree_counters(root: int) -> Dict[int, dict]:
    """The counters of ``root`` and of every living descendant, by pid
    (empty if ``root`` is gone).

    Args:
        root: The process whose tree is read (itself included).
    """
    children = collections.defaultdict(list)
    for name in os.listdir('/proc'):
        if name.isdigit():
            try:
                parent = int(_stat_fields(int(name))[1])
            except (OSError, ValueError, IndexError):
                continue
            children[parent].append(int(name))
    counters = {}
    pending, seen = [root], set()
    while pending:  # only the tree's processes are read in full
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        read = read_counters(pid)
        if read is not None:
            counters[pid] = read
        pending.extend(children.get(pid, ()))
    return counters


def tree_change(before: Mapping[int, dict], after: Mapping[int, dict],
                root: int) -> Dict[str, dict]:
    """What the tree's processes counted between two :func:`tree_counters`.

    Returns ``{'root': totals, 'others': totals}``, each with the fields of
    :data:`TOTALS`, ``processes`` (counted in ``after``) and ``gone`` (in
    ``before``, not in ``after``: what they counted in between is missing).
    ``cpu_s`` is user and kernel time; the run-queue and time-slice
    counts are those of the threads living at both looks.  A process first
    seen in ``after`` counts from zero.

    Args:
        before: The earlier counters.
        after: The later counters.
        root: The pid whose counts go to ``'root'``.
    """
    totals = {part: dict.fromkeys(TOTALS + ('processes', 'gone'), 0)
              for part in ('root', 'others')}
    for pid, then in before.items():
        now = after.get(pid)
        if now is None or now['started'] != then['started']:
            totals['root' if pid == root else 'others']['gone'] += 1
    for pid, now in after.items():
        then = before.get(pid)
        if then is None or then['started'] != now['started']:
            then = {'user_s': 0.0, 'kernel_s': 0.0, 'minor_faults': 0,
                    'threads': {}}
        part = totals['root' if pid == root else 'others']
        part['processes'] += 1
        part['cpu_s'] += (now['user_s'] + now['kernel_s']
                          - then['user_s'] - then['kernel_s'])
        part['minor_faults'] += now['minor_faults'] - then['minor_faults']
        for tid, (_, waiting_s, slices) in now['threads'].items():
            _, waited_s, sliced = then['threads'].get(tid, (0.0, 0.0, 0))
            part['runqueue_s'] += waiting_s - waited_s
            part['timeslices'] += slices - sliced
    return totals
