"""Running elastic test jobs: a private etcd and member processes.

Every member is ``tests/elastic_worker.py`` in its own session; a job is
always waited for with a hard timeout, then every member is killed if
still there, and the tests check that no process and no etcd key is left.
"""
import json
import os
import signal
import subprocess
import sys
import time

import helpers

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      'elastic_worker.py')


class ElasticJob:
    """Members of one job, their events, and the checks at the end.

    Args:
        url: The job's ``etcd://`` address.
        directory: Where the event log goes.
        options: Worker options shared by every member.
    """

    def __init__(self, url, directory, *options):
        self.url = url
        self.events_path = os.path.join(str(directory), 'events.jsonl')
        self.options = list(options)
        self.processes = []

    def start(self, *options):
        """Starts one member; returns its Popen."""
        process = subprocess.Popen(
            [sys.executable, WORKER, self.url, '--events', self.events_path]
            + self.options + list(options),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
        self.processes.append(process)
        return process

    def events(self, name=None, pid=None):
        if not os.path.exists(self.events_path):
            return []
        with open(self.events_path) as f:
            found = [json.loads(line) for line in f if line.strip()]
        return [e for e in found if (name is None or e['event'] == name)
                and (pid is None or e['rank'] == pid)]

    def wait_for(self, predicate, timeout, what):
        """Waits until ``predicate(self)`` holds; fails after ``timeout``."""
        assert helpers.wait_until(lambda: predicate(self), timeout, 0.1), \
            'timed out after {} s waiting for {}; events: {}'.format(
                timeout, what, self.events()[-12:])

    def resumed_sizes(self, pid):
        return [e['size'] for e in self.events('resumed', pid)]

    def wait(self, timeout):
        """Waits for every member; returns their exit codes (kills all and
        fails on a timeout)."""
        deadline = time.monotonic() + timeout
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise AssertionError('job did not end within {} s; events: {}'
                                     .format(timeout, self.events()[-12:]))
        return codes

    def stderr_of(self, process):
        return process.stderr.read().decode(errors='replace')

    def unexpected_ends(self, codes, expected=(0, -signal.SIGKILL)):
        """The end of the stderr of each member whose exit code is unexpected."""
        return {process.pid: (code, self.stderr_of(process)[-3000:])
                for process, code in zip(self.processes, codes)
                if code not in expected}

    def kill_all(self):
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()

    def assert_clean(self, server):
        """No member process and no key of the job left."""
        for process in self.processes:
            assert process.poll() is not None, 'member {} left running'.format(
                process.pid)
            assert not helpers.is_running(process.pid)
        assert helpers.wait_until(lambda: server.keys() == [], 10), \
            'etcd keys left: {}'.format(server.keys())
