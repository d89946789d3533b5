"""Counters that several threads add to."""
import threading
from typing import Sequence


class Counters:
    """Counters updated from several threads; read a consistent copy with :meth:`snapshot`.

    Args:
        names: The counters, all starting at 0.
    """

    def __init__(self, names: Sequence[str]):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, **amounts):
        """Adds to counters, e.g. ``add(files_copied=1, bytes_copied=n)``."""
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount

    def snapshot(self) -> dict:
        """The counters as a new dict."""
        with self._lock:
            return dict(self._values)
