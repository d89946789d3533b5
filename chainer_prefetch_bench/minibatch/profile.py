#!/usr/bin/env python
"""Where the loader processes' and the training process's cores go, per run.

Runs one run of :mod:`chainer_prefetch_bench.minibatch.bench` (the same
dataset, mount, page-cache drop and child process) under a sampling
profiler, and reads every process's counters from ``/proc`` while it runs:
CPU time split into user and kernel, time runnable but waiting for a core
(``/proc/PID/task/*/schedstat``), sleeping (the rest of its life: blocked,
or, in a virtual machine, its core given to another machine), and minor
page faults.  Each process's CPU time is then divided among categories in
proportion to its samples.

``perf`` (``perf record -e cpu-clock``: a sample only while a process is on
a core; native functions and the kernel's):

``decode``          libjpeg, PIL, and numpy's uint8-to-float32 conversion:
                    the dataset's own work, the machine's limit;
``copy``            numpy's strided copies and ``memcpy`` (in a loader: the
                    examples into the batch's shared buffer);
``page faults``     the kernel mapping and zeroing pages;
``kernel, other``   system calls, pipes, scheduling;
``python``          the interpreter (our task loop, pickling, the
                    dataset's Python);
``other``           anything else.

``py-spy`` (``py-spy record --subprocesses --native --idle``: every thread
at each tick, running, runnable or blocked; Python frames):

Loader processes (``decode-limit``'s processes too): ``decode`` (the
dataset's ``get_example``), ``pack`` (our copy into the shared buffer),
``send`` (pickling and sending the answer), ``task`` (the rest of our task
loop), ``start-up``, ``other``.  The training process: ``consumer``
(``next()`` and the benchmark's loop), ``pipeline`` (the scheduler and the
executor's thread), ``loader I/O`` (sending tasks, receiving answers),
``copy threads`` (stage 2), ``start-up``, ``other``.  Samples whose
innermost frames are a blocking call (``poll``, a lock, a queue, a loader's
read of its next task) count as waiting, not CPU; a loader's share of them
is the time it waited for a task.  A process that waits for a core is
sampled where it was stopped, so with more loaders than cores py-spy's
shares lean towards the points where processes give up their core (the
write of an answer, which wakes the training process); ``perf``'s do not.

Usage::

    python -m chainer_prefetch_bench.minibatch.profile --processes 2,8 \\
        --methods proposed-warm,decode-limit --batches 200 \\
        --out results/minibatch/profile.json

Needs ``py-spy`` (``pip install py-spy``) and ``perf`` (Debian's
``linux-perf``), and the right to trace the child (root, or
``kernel.yama.ptrace_scope`` 0 and ``kernel.perf_event_paranoid`` 1).
"""
import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

from chainer_prefetch_bench.minibatch import bench
from chainer_prefetch_bench.minibatch.counters import tree_counters
from chainer_prefetch_bench.testbed.machine import machine_description
from chainer_prefetch_bench.testbed.report import write_json

LOADER_CATEGORIES = ('decode', 'pack', 'send', 'task', 'start-up', 'other')
TRAINER_CATEGORIES = ('consumer', 'pipeline', 'loader I/O', 'copy threads',
                      'start-up', 'other')

#: Innermost named frames that mean a thread is blocked, not computing.
_BLOCKING = frozenset((
    'poll', 'select_poll_poll_impl', 'epoll_wait', 'select', 'clock_nanosleep',
    'time_sleep', 'sem_wait', 'sem_timedwait', 'sem_clockwait',
    'pthread_cond_wait', 'pthread_cond_timedwait', 'pthread_cond_clockwait',
    'PyThread_acquire_lock_timed', 'lock_PyThread_acquire_lock',
    '_queue_SimpleQueue_get_impl', 'do_futex_wait', 'futex_wait',
    'waitpid', 'os_waitpid_impl', 'accept', 'sock_accept'))


# ------------------------------------------------------------- the counters

class TreeWatch:
    """Keeps the last counters of every process under ``root`` until stopped.

    Args:
        root: The process whose descendants are watched (itself included).
        interval: Seconds between looks.
    """

    def __init__(self, root: int, interval: float = 0.2):
        self.root = root
        self.interval = interval
        self.last = {}  # pid -> counters, first seen, last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name='tree-watch')

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()

    def _watch(self):
        while not self._stop.is_set():
            now = time.monotonic()
            for pid, counters in tree_counters(self.root).items():
                first = self.last.get(pid, {}).get('first_seen', now)
                self.last[pid] = dict(counters, first_seen=first,
                                      last_seen=now)
            self._stop.wait(self.interval)


# ------------------------------------------------------------- the samples

def parse_raw(path: str):
    """py-spy's raw output: ``{pid: Counter(category -> samples)}`` per role.

    Returns ``(samples, roles)``: ``samples[pid]`` counts each category
    (and ``'waiting'``), ``roles[pid]`` is ``'trainer'`` for the process
    that calls ``next()`` (the first process under py-spy) and ``'loader'``
    for its descendants.
    """
    samples = collections.defaultdict(collections.Counter)
    roles = {}
    with open(path) as file:
        for line in file:
            stack, _, count = line.rstrip('\n').rpartition(' ')
            frames = stack.split(';')
            pids = [int(re.match(r'process (\d+)', frame).group(1))
                    for frame in frames if frame.startswith('process ')]
            if not pids:
                continue  # a sample py-spy could not place in a process
            names = [frame.split(' (', 1)[0] for frame in frames
                     if not frame.startswith('process ')]
            pid = pids[-1]
            roles[pid] = 'trainer' if len(pids) == 1 else 'loader'
            samples[pid][classify(names, roles[pid])] += int(count)
    return samples, roles


def classify(names, role: str) -> str:
    """The category of one sample (its function names, outermost first)."""
    named = [name for name in names if not name.startswith('0x')]
    present = set(named)
    if '_exit_when_orphaned' in present:
        return 'watcher'  # a loader's thread that sleeps
    if any(name in _BLOCKING for name in named[-3:]):
        return 'waiting'
    if role == 'loader':
        if present & {'pack', 'write_array', 'pack_columns'}:
            return 'pack'
        if '_decode_share' in present or any(
                name.endswith('get_example') for name in named):
            return 'decode'
        if 'worker' in present and present & {'_ConnectionBase.recv',
                                               'Connection._recv_bytes'}:
            return 'waiting'  # decode-limit's pool process, reading its next task
        if '_worker_main' in present and (
                present & {'_send_bytes', 'Connection._send_bytes',
                           '_ConnectionBase.send', 'ForkingPickler.dumps'}):
            return 'send'
        if '_worker_main' in present and (present & {
                '_ConnectionBase.recv', 'Connection._recv_bytes'}) and not (
                    present & {'recv_handle'}):
            return 'waiting'  # blocked reading its next task
        if present & {'_find_and_load', 'exec_module',
                      '_LoaderBasics.exec_module', 'initialize_worker'}:
            return 'start-up'
        if present & {'_worker_main', 'Loader.load_examples',
                      'load_examples', 'worker'}:
            return 'task'
        return 'other'
    if 'Pool._handle_results' in present:
        return 'waiting'  # decode-limit's parent, reading its pool's answers
    if present & {'_find_and_load', '_LoaderBasics.exec_module',
                  '_call_with_frames_removed'} and 'run_one' not in present:
        return 'start-up'
    joined = ' '.join(named)
    if 'CopyThreads' in joined or 'LocalStore' in joined:
        return 'copy threads'
    if 'WorkerPool.' in joined:
        return 'loader I/O'
    if 'Scheduler' in joined or 'Executor._run' in joined:
        return 'pipeline'
    if 'run_one' in present:
        return 'consumer'
    return 'other'


#: What ``perf`` sees on a core, by native function: the categories.
PERF_CATEGORIES = ('decode', 'copy', 'page faults', 'kernel, other',
                   'python', 'other')
_DECODE_LIBRARIES = ('libjpeg', '_imaging', 'libz.', 'libpng', 'libtiff',
                     'libwebp', 'libopenjp')
_FAULT_WORDS = ('fault', 'clear_page', 'folio', 'shmem', 'memcg', 'lru',
                '_pte', 'alloc_pages', 'rmqueue', 'page_from_freelist',
                'zap_', 'free_pages', 'tlb')


def classify_native(symbol: str, library: str) -> str:
    """The category of one ``perf`` sample (its function and library)."""
    if library == '[kernel.kallsyms]':
        if any(word in symbol for word in _FAULT_WORDS):
            return 'page faults'
        return 'kernel, other'
    if any(name in library for name in _DECODE_LIBRARIES) or \
            symbol.startswith('_aligned_contig_cast_ubyte'):
        return 'decode'  # libjpeg, PIL, and the float32 conversion
    if symbol.startswith(('_aligned_strided_to_contig', '__memmove',
                          '__memcpy')):
        return 'copy'  # into shared memory (loaders), out of pipes
    if 'libpython' in library or os.path.basename(library).startswith(
            'python'):
        return 'python'
    return 'other'


def parse_perf(data_path: str, rate: int):
    """``perf record`` data: ``{pid: Counter(category -> CPU seconds)}``."""
    script = subprocess.run(
        ['perf', 'script', '-i', data_path, '-F', 'pid,ip,sym,dso'],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        check=True).stdout
    seconds = collections.defaultdict(collections.Counter)
    for line in script.splitlines():
        match = re.match(r'\s*(\d+)\s+[0-9a-f]+\s+(.*?)\s+\(([^()]*)\)\s*$',
                         line)
        if match:
            pid, symbol, library = match.groups()
            seconds[int(pid)][classify_native(symbol, library)] += 1 / rate
    return seconds


# ------------------------------------------------------------- one run

def profile_run(config, profiler: Optional[str], rate: int, raw_path: str,
                timeout: float):
    """Runs ``config`` under ``profiler``; returns its result and per-process table.

    Args:
        config: The run (see :mod:`~chainer_prefetch_bench.minibatch.bench`).
        profiler: ``'py-spy'`` (Python frames, every thread, running or
            not), ``'perf'`` (native functions, on a core only) or ``None``
            (the ``/proc`` counters only).
        rate: Samples per second.
        raw_path: Where the profiler's samples go.
        timeout: Seconds before the run is killed.
    """
    command = [sys.executable, '-m', bench.__spec__.name, '_run',
               json.dumps(config)]
    if profiler == 'py-spy':
        command = ['py-spy', 'record', '--subprocesses', '--native', '--idle',
                   '--format', 'raw', '--rate', str(rate), '--output',
                   raw_path, '--'] + command
    elif profiler == 'perf':
        command = ['perf', 'record', '--quiet', '-e', 'cpu-clock', '-F',
                   str(rate), '-o', raw_path, '--'] + command
    started = time.monotonic()
    spy = subprocess.Popen(command, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        with TreeWatch(spy.pid) as watch:
            out, err = spy.communicate(timeout=timeout)
    except BaseException:  # the profiler, the run and its loaders
        os.killpg(spy.pid, signal.SIGKILL)
        spy.wait()
        raise
    wall_s = time.monotonic() - started
    answers = [line for line in out.splitlines() if line.startswith('{')]
    if spy.returncode != 0 or not answers:
        raise RuntimeError('the profiled run failed (exit {}):\n{}'.format(
            spy.returncode, (out + err)[-3000:]))
    result = json.loads(answers[-1])
    if profiler is None:
        trainer = spy.pid
    else:
        trainer = min((pid for pid, counters in watch.last.items()
                       if counters['ppid'] == spy.pid), default=None)
        if trainer is None:
            raise RuntimeError('the run under {} ended before it could be '
                               'watched'.format(profiler))
        watch.last.pop(spy.pid, None)
    roles = {pid: 'trainer' if pid == trainer else 'loader'
             for pid in watch.last}
    samples = {}
    if profiler == 'py-spy':
        samples = parse_raw(raw_path)[0]
    elif profiler == 'perf':
        samples = parse_perf(raw_path, rate)
    processes = []
    for pid, counters in watch.last.items():
        counts = samples.get(pid, collections.Counter())
        role = roles[pid]
        cpu_s = counters['user_s'] + counters['kernel_s']
        if profiler == 'perf':
            categories = PERF_CATEGORIES
            busy = sum(counts.values()) or 1
        else:
            categories = (LOADER_CATEGORIES if role == 'loader'
                          else TRAINER_CATEGORIES)
            busy = sum(n for category, n in counts.items()
                       if category not in ('waiting', 'watcher')) or 1
        alive_s = counters['last_seen'] - counters['first_seen']
        processes.append({
            'pid': pid, 'role': role, 'alive_s': alive_s, 'cpu_s': cpu_s,
            'user_s': counters['user_s'], 'kernel_s': counters['kernel_s'],
            'runqueue_s': counters['runqueue_s'],
            'sleeping_s': max(0.0, alive_s - counters['on_cpu_s']
                              - counters['runqueue_s']),
            'minor_faults': counters['minor_faults'],
            'samples': dict(counts),
            'cpu_s_by_category': {category: cpu_s * counts.get(category, 0)
                                  / busy for category in categories}})
    return {'config': config, 'profiler': profiler, 'result': result,
            'wall_s': wall_s, 'processes': processes}


def summarize(profile):
    """Per role: the processes' mean seconds per category, on-CPU split, waits."""
    rows = {}
    for role in ('loader', 'trainer'):
        members = [p for p in profile['processes'] if p['role'] == role]
        if not members:
            continue
        if role == 'loader':  # not a fork server, nor decode-limit's parent
            members = [p for p in members if p['cpu_s']
                       > 0.2 * max(q['cpu_s'] for q in members)]
        if not members:
            continue
        n = len(members)
        row = {'processes': n}
        for key in ('alive_s', 'cpu_s', 'user_s', 'kernel_s', 'runqueue_s',
                    'sleeping_s', 'minor_faults'):
            row[key] = sum(p[key] for p in members) / n
        categories = list(members[0]['cpu_s_by_category'])
        row['by_category'] = {c: sum(p['cpu_s_by_category'][c]
                                     for p in members) / n
                              for c in categories}
        row['idle_share'] = None
        if profile['profiler'] == 'py-spy':
            # py-spy samples every thread at each tick, running or not: the
            # share of a task thread's samples that wait for a task.
            main_thread = sum(sum(n for c, n in p['samples'].items()
                                  if c != 'watcher') for p in members)
            if main_thread:
                row['idle_share'] = sum(p['samples'].get('waiting', 0)
                                        for p in members) / main_thread
        rows[role] = row
    return rows


def print_summary(label, profile):
    result, rows = profile['result'], profile['summary']
    images = result['n_batches'] * bench.BATCH_SIZE
    print('\n{} ({} loader processes, {}): {:.2f} s, {:.0f} images/s'.format(
        label, result['n_processes'], profile['profiler'] or 'no profiler',
        result['total_s'], result['images_per_s']))
    for role, row in rows.items():
        cpu = row['cpu_s'] or 1
        print('  {:<8} x{:<2} alive {:6.2f} s  on CPU {:6.2f} s (kernel '
              '{:4.0%})  waiting for a core {:5.2f} s  sleeping {:5.2f} s  '
              'faults {:7.0f}'.format(
                  role, row['processes'], row['alive_s'], row['cpu_s'],
                  row['kernel_s'] / cpu, row['runqueue_s'],
                  row['sleeping_s'], row['minor_faults']))
        if profile['profiler'] is None:
            continue
        per_image = images / row['processes']
        print('           ms of CPU per image: ' + '  '.join(
            '{} {:.2f} ({:.0%})'.format(c, 1000 * s / per_image, s / cpu)
            for c, s in row['by_category'].items()))
        if row['idle_share'] is not None and role == 'loader':
            print('           waiting for a task: {:.0%} of the samples of '
                  'the task thread'.format(row['idle_share']))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--workdir', default='/tmp/chainer_prefetch_bench')
    parser.add_argument('--batches', type=int, default=200)
    parser.add_argument('--processes', default='2,8')
    parser.add_argument('--methods',
                        default='proposed-warm,decode-limit,decode-copy-limit')
    parser.add_argument('--copy-threads', type=int, default=16)
    parser.add_argument('--profilers', default='py-spy,perf',
                        help='one run per method and profiler: py-spy, perf, '
                        'none (the /proc counters only)')
    parser.add_argument('--rate', type=int, default=0,
                        help='samples per second (default: 50 for py-spy, '
                        '499 for perf)')
    parser.add_argument('--preset', default='paper')
    parser.add_argument('--out', default='results/minibatch/profile.json')
    parser.add_argument('--run-timeout', type=float, default=900)
    args = parser.parse_args(argv)
    args.processes = [int(n) for n in args.processes.split(',')]
    args.methods = [m for m in args.methods.split(',') if m]
    unknown = set(args.methods) - set(bench.METHODS)
    if unknown:
        parser.error('unknown methods: ' + ', '.join(sorted(unknown)))
    args.profilers = [None if p == 'none' else p
                      for p in args.profilers.split(',') if p]
    for profiler in args.profilers:
        if profiler not in (None, 'py-spy', 'perf'):
            parser.error('unknown profiler ' + profiler)
        if profiler and shutil.which(profiler) is None:
            parser.error('{} is not installed ({})'.format(profiler, {
                'py-spy': 'pip install py-spy',
                'perf': 'apt-get install linux-perf'}[profiler]))
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    profiles = []
    raw_dir = os.path.splitext(args.out)[0] + '_raw'
    os.makedirs(raw_dir, exist_ok=True)
    with bench.bench_environment(args.workdir, args.batches * bench.BATCH_SIZE,
                                 args.preset) as (base, _):
        for n_processes in args.processes:
            for profiler in args.profilers:
                for method in args.methods:
                    config = dict(base, method=method,
                                  n_processes=n_processes,
                                  n_copy_threads=args.copy_threads, repeat=0,
                                  n_batches=args.batches)
                    bench.prepare_run(config)
                    rate = args.rate or {'perf': 499}.get(profiler, 50)
                    raw_path = os.path.join(raw_dir, '{}-{}-{}.{}'.format(
                        method, n_processes, profiler,
                        'data' if profiler == 'perf' else 'txt'))
                    profile = profile_run(config, profiler, rate, raw_path,
                                          args.run_timeout)
                    profile['summary'] = summarize(profile)
                    print_summary(method, profile)
                    profiles.append(profile)
    write_json(args.out, {
        'command': 'python -m {} {}'.format(__spec__.name, ' '.join(argv)),
        'machine': machine_description(), 'profiles': profiles})
    print('\nwrote {} (the samples in {})'.format(args.out, raw_dir))
    return 0


if __name__ == '__main__':
    sys.exit(main())
