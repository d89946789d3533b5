"""The printed report on whichever process is rank 0 now.

ChainerMN examples register ``LogReport`` and ``PrintReport`` on rank 0
only, so the report stops when rank 0 dies under shrink, and a replacement
of rank 0 starts an empty one.  Here every rank keeps both extensions (each
accumulates its own observations), and :class:`RankZeroReports` lets only
the current rank 0 write the log file and print: after a shrink the lowest
surviving rank, which becomes rank 0, takes over where the old one stopped
(it prints the header again with a note), and a replacement of rank 0 gets
the log so far with the recovery package (:meth:`state`, :meth:`load`).

Chainer 7.8.1 keeps the file name and the stream in ``LogReport._log_name``
and ``PrintReport._out``; this module sets those.
"""
import io
import json
import sys
from typing import Any, Dict, Optional

import chainer
from chainer.training import extensions


class RankZeroReports(chainer.training.Extension):
    """Keeps LogReport/PrintReport output on the current rank 0.

    Register it on every rank, with the report extensions themselves (also
    on every rank); it runs before them at every iteration.

    Args:
        comm: The (fault-tolerant) communicator; its ``rank`` may change.
        log_report: The ``LogReport`` of this rank.
        print_report: The ``PrintReport`` of this rank, or None.
        out: Where rank 0 prints (default: standard output).
    """

    trigger = (1, 'iteration')
    priority = chainer.training.PRIORITY_EDITOR
    name = 'RankZeroReports'

    def __init__(self, comm, log_report: extensions.LogReport,
                 print_report: Optional[extensions.PrintReport] = None,
                 out=None):
        self.comm = comm
        self.log_report = log_report
        self.print_report = print_report
        self.out = out if out is not None else sys.stdout
        self._log_name = log_report._log_name
        self._header = None if print_report is None else print_report._header
        self._reporting: Optional[bool] = None
        self.takeovers = 0
        self.follow()

    def follow(self) -> None:
        """Points the output at the file and stream on rank 0 only (and
        notes a takeover on the new rank 0)."""
        reporting = self.comm.rank == 0
        if reporting == self._reporting:
            return
        took_over = reporting and self._reporting is False
        self._reporting = reporting
        self.log_report._log_name = self._log_name if reporting else None
        if self.print_report is None:
            return
        self.print_report._out = self.out if reporting else _Discard()
        if took_over:
            self.takeovers += 1
            self.out.write('(the report continues on this process, rank 0 '
                           'since a failure)\n')
            self.print_report._header = self._header

    def __call__(self, trainer) -> None:
        self.follow()

    def state(self) -> Dict[str, Any]:
        """The log so far (what a replacement of rank 0 needs)."""
        return dict(log=json.dumps(self.log_report.log))

    def load(self, state: Dict[str, Any]) -> None:
        """Takes the log of :meth:`state`; nothing already in it is printed
        again."""
        self.log_report._log = json.loads(state['log'])
        if self.print_report is not None:
            self.print_report._log_len = len(self.log_report._log)


class _Discard(io.TextIOBase):
    """A text stream that drops everything (the silent ranks' report)."""

    def write(self, text: str) -> int:
        return len(text)
