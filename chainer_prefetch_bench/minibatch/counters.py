"""The kernel's counters of a process tree, read from ``/proc``.

Per process: CPU time (user and kernel), minor page faults, time runnable
but waiting for a core and the number of times it was put on a core
(``/proc/PID/task/*/schedstat``, summed over its threads).  Used by the
minibatch benchmark (the counters of the epochs after the first) and by its
profiler (:mod:`chainer_prefetch_bench.minibatch.profile`).
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
    """CPU, run-queue and fault counters of process ``pid`` (``None`` if gone)."""
    try:
        fields = _stat_fields(pid)
        run_s = wait_s = 0.0
        timeslices = 0
        for task in os.listdir('/proc/{}/task'.format(pid)):
            with open('/proc/{}/task/{}/schedstat'.format(pid, task)) as file:
                on_cpu_ns, waiting_ns, slices = file.read().split()
            run_s += int(on_cpu_ns) / 1e9
            wait_s += int(waiting_ns) / 1e9
            timeslices += int(slices)
    except (OSError, ValueError):
        return None
    return {'ppid': int(fields[1]), 'minor_faults': int(fields[7]),
            'user_s': int(fields[11]) / _CLOCK_TICKS,
            'kernel_s': int(fields[12]) / _CLOCK_TICKS,
            'on_cpu_s': run_s, 'runqueue_s': wait_s, 'timeslices': timeslices}


def tree_counters(root: int) -> Dict[int, dict]:
    """The counters of ``root`` and of every living descendant, by pid.

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
    pending = [root]
    while pending:  # only the tree's processes are read in full
        pid = pending.pop()
        read = read_counters(pid)
        if read is not None:
            counters[pid] = read
        pending.extend(children.get(pid, ()))
    return counters


def tree_change(before: Mapping[int, dict], after: Mapping[int, dict],
                root: int) -> Dict[str, dict]:
    """What the tree's processes counted between two :func:`tree_counters`.

    Returns ``{'root': totals, 'others': totals}``, each with the fields of
    :data:`TOTALS` (``cpu_s`` is the time on a core) and ``processes``.  A
    process first seen in ``after`` counts from zero; one gone by
    ``after`` is not counted.

    Args:
        before: The earlier counters.
        after: The later counters.
        root: The pid whose counts go to ``'root'``.
    """
    totals = {part: dict.fromkeys(TOTALS + ('processes',), 0)
              for part in ('root', 'others')}
    for pid, now in after.items():
        then = before.get(pid, {})
        part = totals['root' if pid == root else 'others']
        part['processes'] += 1
        part['cpu_s'] += now['on_cpu_s'] - then.get('on_cpu_s', 0.0)
        for field in ('minor_faults', 'runqueue_s', 'timeslices'):
            part[field] += now[field] - then.get(field, 0)
    return totals
