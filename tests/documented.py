"""The commands the docs show, as a test runs them: as written.

A literal block (``::``) of a section of an ``.rst`` file in ``docs/`` is
run by ``bash`` in a scratch directory in which ``examples`` and
``scripts`` link to the repository's, with this environment's ``python``
and ``mpirun`` first on ``PATH`` -- what a user gets who pastes the block
into a shell at the top of a checkout with the virtual environment active.
"""
import os
import shlex
import sys
from typing import List

from chainer_prefetch_bench.testbed import mpi_launch

DOCS = os.path.join(mpi_launch.REPO, 'docs')


def literal_block(document: str, section: str, number: int = 0) -> str:
    """The text of literal block ``number`` of ``section``, dedented.

    Args:
        document: File name in ``docs/`` (``'elastic.rst'``).
        section: The section's title, as written.
        number: Which block of the section (0: the first).
    """
    with open(os.path.join(DOCS, document)) as f:
        parts = f.read().split('\n{}\n'.format(section), 1)
    assert len(parts) == 2, 'no section {!r} in docs/{}'.format(
        section, document)
    text = parts[1]
    for _ in range(number + 1):
        assert '::\n\n' in text, 'section {!r} of docs/{} has no block {}' \
            .format(section, document, number)
        text = text.split('::\n\n', 1)[1]
    lines = []
    for line in text.splitlines():
        if line and not line.startswith(' '):
            break  # the block ends at the first unindented line
        lines.append(line[4:])
    return '\n'.join(lines).strip() + '\n'


def commands(block: str) -> List[str]:
    """The commands of ``block``: continuation lines joined, comment lines
    and blank lines left out."""
    text = block.replace('\\\n', ' ')
    return [line for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith('#')]


def command_starting(block: str, words: str) -> str:
    """The command of ``block`` that starts with ``words``."""
    found = [c for c in commands(block) if c.startswith(words)]
    assert len(found) == 1, '{} commands start with {!r}'.format(
        len(found), words)
    return found[0]


def words(command: str) -> List[str]:
    """``command`` split as the shell splits it."""
    return shlex.split(command)


def checkout(tmp_path) -> str:
    """``tmp_path`` set up as the top of a checkout; returns it."""
    for name in ('examples', 'scripts'):
        link = tmp_path / name
        if not link.exists():
            link.symlink_to(os.path.join(mpi_launch.REPO, name))
    return str(tmp_path)


def run_in_shell(script: str, tmp_path, timeout: float):
    """Runs ``script`` with ``bash -e`` in :func:`checkout` ``(tmp_path)``.

    Returns:
        ``(returncode, output)``; fails on a timeout (the whole process
        group is stopped first).
    """
    env = mpi_launch.environment()
    env['PATH'] = os.pathsep.join([
        os.path.dirname(sys.executable),
        os.path.dirname(mpi_launch.mpiexec_path()), env['PATH']])
    returncode, output, timed_out = mpi_launch.run(
        ['bash', '-e', '-c', script], timeout, cwd=checkout(tmp_path),
        env=env)
    assert not timed_out, 'timed out after {} s:\n{}'.format(
        timeout, output[-5000:])
    return returncode, output
