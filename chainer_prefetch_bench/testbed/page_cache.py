"""Dropping files from the kernel's page cache, so that "cold" is cold.

``posix_fadvise(POSIX_FADV_DONTNEED)`` needs no privileges (unlike
``/proc/sys/vm/drop_caches``) and touches only the files named.
"""
import contextlib
import os


def drop_file_cache(path: str) -> None:
    """Ask the kernel to drop a file's cached pages (a missing file is skipped).

    Args:
        path: The file.
    """
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_page_cache(*roots: str) -> int:
    """Drops the cached pages of every file under ``roots``.

    Used between benchmark runs so that "cold" is cold
    (``posix_fadvise(POSIX_FADV_DONTNEED)``; needs no privileges).

    Args:
        roots: Folders (missing ones are skipped).

    Returns:
        How many files were visited.
    """
    count = 0
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                drop_file_cache(os.path.join(folder, name))
                count += 1
    return count

