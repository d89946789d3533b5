"""One measurement per fresh child process, and SIGTERM that unwinds.

Every benchmark run happens in a fresh Python process, so that start-up
costs count the same way for every method and nothing (imports, page cache
of the interpreter, leaked workers) carries over from one run to the next.
The parent runs ``python -m MODULE _run CONFIG_JSON``; the module's
``main`` hands that to :func:`answer_child`, which prints the run's result as
the last line of JSON.  The child gets its own session, and the whole
session is killed if the run times out or the parent is interrupted, so no
worker outlives its run.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Iterable, Optional, Sequence

MEMORY_POLL_SECONDS = 0.2
"""How often :func:`run_in_child` samples the memory of the child's tree."""


def run_order(items: Iterable, repeat: int) -> list:
    """The runs of one repeat, in the order they run.

    Repeat 0 keeps the first order; every other repeat runs it backwards,
    and each pair of repeats starts one place further on.  A run's speed
    can depend on the runs just before it (memory they freed, caches they
    filled): so each run follows its neighbours on both sides in turn,
    instead of always the same one.

    Args:
        items: The runs of a repeat, in their first order.
        repeat: The repeat's number (0 first).
    """
    items = list(items)
    if items:
        start = (repeat // 2) % len(items)
        items = items[start:] + items[:start]
    return items[::-1] if repeat % 2 else items


def run_in_child(module: str, config: Dict, timeout: float,
                 python: Optional[str] = None,
                 sample_memory: bool = False,
                 environment: Optional[Dict[str, str]] = None) -> Dict:
    """Run one measurement in a fresh process; return its result.

    Args:
        module: The module whose ``main`` answers ``_run CONFIG`` (see
            :func:`answer_child`), e.g.
            ``'chainer_prefetch_bench.minibatch.bench'``.
        config: The run's settings (JSON-able).
        timeout: Seconds before the child's whole session is killed.
        python: The interpreter (default: this one); another virtual
            environment's, for a peer whose dependencies conflict with ours.
        sample_memory: Also sample the summed RSS and PSS of the child and
            all its descendants every :data:`MEMORY_POLL_SECONDS` and add the
            peaks as ``peak_rss_mb`` and ``peak_pss_mb`` (needs psutil),
            and every sample as ``memory_trace``: ``[seconds since the
            child started, PSS MB]`` pairs.
        environment: Variables to set in the child's environment (on top
            of this process's).

    Returns:
        The dict the child printed.

    Raises:
        RuntimeError: The child failed (its stderr's tail is in the message).
        subprocess.TimeoutExpired: It ran past ``timeout`` (it was killed).
    """
    child = subprocess.Popen(
        [python or sys.executable, '-m', module, '_run', json.dumps(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env=dict(os.environ, **(environment or {})))
    started = time.monotonic()
    peak = {'rss': 0, 'pss': 0}
    trace = []
    done = threading.Event()

    def sample():
        while not done.wait(MEMORY_POLL_SECONDS):
            memory = tree_memory(child.pid)
            for key in peak:
                peak[key] = max(peak[key], memory[key])
            trace.append([round(time.monotonic() - started, 2),
                          round(memory['pss'] / 1e6, 1)])

    sampler = threading.Thread(target=sample, daemon=True)
    if sample_memory:
        sampler.start()
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise
    finally:
        done.set()
        if sample_memory:
            sampler.join()
    # Workers the run left behind (it should leave none) go with it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    if child.returncode != 0:
        raise RuntimeError('run {} failed (exit status {}):\n{}'.format(
            config.get('method', config), child.returncode, stderr[-3000:]))
    lines = stdout.strip().splitlines()
    if not lines:
        raise RuntimeError('run {} printed no result:\n{}'.format(
            config.get('method', config), stderr[-3000:]))
    result = json.loads(lines[-1])
    if sample_memory:
        result['peak_rss_mb'] = round(peak['rss'] / 1e6, 1)
        result['peak_pss_mb'] = round(peak['pss'] / 1e6, 1)
        result['memory_trace'] = trace
    return result


def answer_child(argv: Sequence[str], run: Callable[[Dict], Dict]) -> bool:
    """The child side of :func:`run_in_child`.

    Args:
        argv: The module's arguments.
        run: The function measuring one run: ``run(config) -> dict``.

    Returns:
        ``True`` if ``argv`` was ``_run CONFIG``: the run's result has been
        printed (and flushed) as the last line, in JSON.
    """
    if list(argv[:1]) != ['_run']:
        return False
    print(json.dumps(run(json.loads(argv[1]))), flush=True)
    return True


def tree_memory(pid: int) -> Dict[str, int]:
    """Summed RSS and PSS (bytes) of ``pid`` and all its descendants.

    PSS counts a page shared by several processes once, split among them.

    Args:
        pid: The root process.

    Returns:
        ``{'rss': bytes, 'pss': bytes}`` (zeros if the process is gone).
    """
    import psutil
    rss = pss = 0
    try:
        root = psutil.Process(pid)
        processes = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return {'rss': 0, 'pss': 0}
    for process in processes:
        with contextlib.suppress(OSError, psutil.Error):
            with open('/proc/{}/smaps_rollup'.format(process.pid)) as rollup:
                for line in rollup:
                    if line.startswith('Rss:'):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith('Pss:'):
                        pss += int(line.split()[1]) * 1024
    return {'rss': rss, 'pss': pss}


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so mounts and workers are stopped.

    A job's time limit sends SIGTERM; with this, ``finally`` blocks and
    context managers (the emulated mount, the iterators) still run.
    Processes forked from this one (iterator workers) keep the default
    action, since their parents stop them with SIGTERM.
    """
    main_pid = os.getpid()

    def handler(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
