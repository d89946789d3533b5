"""What a loader's ``get_example`` opens, seen from inside, and where it reads.

Stage 3 loads each example inside :func:`watching`, which

* records every file the loading thread opens for reading through Python
  (``open``, ``io.open``, ``os.open``, ``pathlib``: they all raise the
  ``open`` audit event that :func:`sys.addaudithook` sees), so that the
  loader can tell which files an example really read: the local copies, or
  shared storage after all (a wrapper that reads another index than its
  own, a dataset's method bound to the original object);
* redirects the ``open`` calls of this thread for reading a file that stage
  2 staged for the example to its local copy (``builtins.open`` and
  ``io.open``, which ``PIL.Image.open``, ``numpy.load`` and ``pathlib``
  use), so that a dataset that keeps its paths to itself reads the copies
  unchanged.

Files opened for writing, and opens on other threads, are never touched.
Limits: a C library that opens files itself (``cv2.imread``, HDF5) is
neither seen nor redirected; ``os.open`` is seen but not redirected.

The hook and the redirection are installed in a process once, the first
time :func:`watching` runs there (in the loader processes, or in the
training process with loader threads); outside :func:`watching` they cost
one attribute lookup per audit event or ``open``.
"""
import builtins
import contextlib
import io
import os
import sys
import threading
from typing import Dict, List, Optional

_state = threading.local()
_installed = False
_install_lock = threading.Lock()
_original_open = io.open
_WRITE_MODES = frozenset('wax+')


def _reading(mode, flags) -> bool:
    if mode is not None:
        return not _WRITE_MODES.intersection(str(mode))
    return flags is None or (flags & (os.O_WRONLY | os.O_RDWR)) == 0


def _audit(event, args):
    if event != 'open':
        return
    opened = getattr(_state, 'opened', None)
    if opened is None:
        return
    path, mode, flags = args
    if isinstance(path, (str, bytes, os.PathLike)) and _reading(mode, flags):
        opened.append(os.fsdecode(path))


def _open(file, mode='r', *args, **kwargs):
    redirect = getattr(_state, 'redirect', None)
    if redirect and isinstance(file, (str, bytes, os.PathLike)) and \
            _reading(mode, None):
        target = redirect.get(os.path.abspath(os.fsdecode(file)))
        if target is not None:
            file = target
    return _original_open(file, mode, *args, **kwargs)


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        sys.addaudithook(_audit)
        builtins.open = io.open = _open
        _installed = True


def stop_redirecting() -> None:
    """Ends the redirection of :func:`watching` early (this thread): a copy
    that vanished is read from its source."""
    _state.redirect = None


@contextlib.contextmanager
def watching(redirect: Optional[Dict[str, str]] = None):
    """Records the files this thread opens for reading meanwhile.

    Args:
        redirect: ``{absolute source path: local path}``: opens for reading
            of these sources read the local paths instead.

    Yields:
        The list the opened paths are appended to (as given to ``open``).
    """
    _install()
    opened: List[str] = []
    _state.opened, _state.redirect = opened, redirect
    try:
        yield opened
    finally:
        _state.opened = _state.redirect = None


# ---- what the opens of one example mean ------------------------------------------

#: Kinds of findings (see :meth:`OpenCheck.check`).
SOURCE_READ = 'source_read'
NOT_SEEN = 'not_seen'
UNSTAGED = 'unstaged'
UNNAMED = 'unnamed'

_SYSTEM_SUFFIXES = ('.py', '.pyc', '.so', '.pth')

SILENT_EXAMPLES = 8
"""Examples in a row that open nothing, in a loader that never saw one of
its redirected opens, before their files count as read unseen (NOT_SEEN)."""


def _system_prefixes():
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, '/proc', '/sys',
                '/dev', '/etc', '/usr'}
    return tuple(os.path.join(p, '') for p in prefixes if p)


class OpenCheck:
    """Judges what one example opened against what stage 2 staged for it.

    Picklable (the loader processes get a copy).

    Args:
        local_root: The directory of the local copies (``None``: no staging).
        locate: Maps a source path to its local copy (``None``: copies are
            not plain files, nothing is redirected).
        source_root: The directory the dataset's files share, or ``None``
            (they share none but ``/``): files opened under it that were not
            staged for the example are reported.
        by_redirection: Whether the copies are read by redirecting opens
            only (an example that opens none of its files through Python
            then read them some other way, not seen).
    """

    def __init__(self, local_root: Optional[str], locate=None,
                 source_root: Optional[str] = None,
                 by_redirection: bool = False):
        self.local_root = None if local_root is None else os.path.join(
            local_root, '')
        self.locate = locate
        self.source_root = None if source_root is None else os.path.join(
            source_root, '')
        self.by_redirection = by_redirection
        self._system = _system_prefixes()
        # Per process: whether a redirected open was ever seen here, and how
        # many examples in a row opened nothing since the start.
        self._redirect_seen = False
        self._silent = 0

    @staticmethod
    def expected(files) -> Optional[Dict[str, str]]:
        """``{absolute path: path as named}`` of the plain files in ``files``
        (what an example reads; ``None``: the dataset names no files)."""
        if files is None:
            return None
        return {os.path.abspath(f): f for f in files if isinstance(f, str)}

    def redirect(self, expected: Optional[Dict[str, str]],
                 read_local: bool) -> Optional[Dict[str, str]]:
        """The redirection of :func:`watching` for an example that reads
        ``expected`` (:meth:`expected`) from its copies if ``read_local``."""
        if not read_local or self.locate is None or not expected:
            return None
        return {path: self.locate(named) for path, named in expected.items()}

    def check(self, expected: Optional[Dict[str, str]], read_local: bool,
              opened: List[str]):
        """``(read_source, finding)`` for an example.

        Args:
            expected: What stage 2 knew the example reads (:meth:`expected`;
                ``None``: the dataset names no files at all).
            read_local: Whether its copies were staged and read.
            opened: The paths it opened for reading (:func:`watching`).

        Returns:
            ``read_source``: it read shared storage although its copies were
            staged; ``finding``: ``None`` or ``(kind, path)``, the first of
            ``SOURCE_READ`` (it opened a staged file's source),
            ``UNSTAGED`` (it opened a file under the dataset's directory
            that was not staged for it), ``NOT_SEEN`` (by redirection, it
            and the ``SILENT_EXAMPLES - 1`` before it in this process
            opened nothing through Python, and no redirected open was ever
            seen here) and ``UNNAMED`` (the dataset names no files but
            opened some: then ``path`` is every such file, sorted).
        """
        paths = [os.path.abspath(p) for p in opened]
        if expected is None:
            found = tuple(sorted({p for p in paths if self._user_file(p)}))
            return False, (UNNAMED, found) if found else None
        unstaged = None
        if self.source_root is not None:
            unstaged = next((p for p in paths if p not in expected
                             and not self._local(p)
                             and p.startswith(self.source_root)), None)
        if read_local:
            leaked = next((p for p in paths if p in expected), None)
            if leaked is not None:
                return True, (SOURCE_READ, leaked)
            if unstaged is not None:
                return True, (UNSTAGED, unstaged)
            if self.by_redirection and expected:
                if any(self._local(p) for p in paths):
                    self._redirect_seen = True
                elif not self._redirect_seen and self._silent_again(paths):
                    return True, (NOT_SEEN, sorted(expected)[0])
        return False, None if unstaged is None else (UNSTAGED, unstaged)

    def source_opens(self, expected: Optional[Dict[str, str]],
                     opened: List[str]) -> int:
        """How many of the paths an example opened were on shared storage.

        Args:
            expected: What stage 2 knew the example reads (:meth:`expected`).
            opened: The paths it opened for reading (:func:`watching`).

        Returns:
            The opens of its own files and of files under the dataset's
            directory (or, for a dataset that names no files, of any file
            outside the system's directories), local copies excluded.
        """
        count = 0
        for path in map(os.path.abspath, opened):
            if self._local(path):
                continue
            if ((expected is not None and path in expected)
                    or (self.source_root is not None
                        and path.startswith(self.source_root))
                    or (expected is None and self._user_file(path))):
                count += 1
        return count

    def _silent_again(self, paths: List[str]) -> bool:
        """Whether, with no redirected open ever seen in this process, this
        example is one more that opened nothing: after ``SILENT_EXAMPLES`` in
        a row its files are taken to be read where no redirection reaches
        (a C library); before, it may have come from the dataset's own
        cache, and counts as local."""
        self._silent = 0 if paths else self._silent + 1
        return self._silent >= SILENT_EXAMPLES

    def _local(self, path: str) -> bool:
        return self.local_root is not None and path.startswith(self.local_root)

    def _user_file(self, path: str) -> bool:
        return not (path.startswith(self._system)
                    or path.endswith(_SYSTEM_SUFFIXES) or self._local(path))
