"""Petastorm's own virtual environment, made on first use.

Petastorm 0.13.1 needs ``pyarrow<15`` and declares PySpark, which its
``make_batch_reader`` does not use; the package itself wants the newest
PyArrow that works with NumPy 1.  So Petastorm never enters the project's
environment: the Parquet benchmark makes ``.venv-petastorm`` (beside the
project's ``.venv``) the first time a Petastorm method runs, with Petastorm
installed ``--no-deps`` and only the dependencies its reader imports, plus
this project (``--no-deps``, editable) so that the same measurement code
runs there, in a child process (:func:`~chainer_prefetch_bench.testbed.
processes.run_in_child` with ``python=``).  Chainer is not installed there:
the Petastorm runs import no part of ``chainer_prefetch``.
"""
import hashlib
import json
import os
import subprocess
import sys
import venv
from typing import Dict

PETASTORM = 'petastorm==0.13.1'
"""The Petastorm release compared."""

REQUIREMENTS = (
    'numpy<2', 'pyarrow==14.0.2', 'pandas==2.3.3', 'pillow',
    # What Petastorm's reader imports (it is installed with --no-deps):
    'dill', 'diskcache', 'future', 'psutil', 'pyzmq', 'six', 'fsspec',
    'packaging',
)
"""Everything else installed there (pyarrow<15: Petastorm 0.13.1 fails with 15+)."""

DEFAULT_DIR = '.venv-petastorm'
"""Where the environment goes by default (relative to the working directory)."""

_TIMEOUT = 1200
"""Seconds one pip command may take."""


def project_root() -> str:
    """The source tree this package was installed from (editable or not).

    Returns:
        The folder with ``setup.py``.

    Raises:
        RuntimeError: The package does not run from a source tree.
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(root, 'setup.py')):
        raise RuntimeError(
            'the Petastorm runs install this project into their own '
            'environment and need its source tree; {} has no setup.py '
            '(run from a clone, installed with pip install -e)'.format(root))
    return root


def ensure(directory: str = DEFAULT_DIR) -> str:
    """Make (or reuse) the Petastorm environment; return its Python.

    Reused when it was made from the same requirements and source tree and
    still imports Petastorm; otherwise made again from scratch.

    Args:
        directory: The environment's folder.

    Returns:
        The path of its ``python``.

    Raises:
        RuntimeError: An installation step failed (pip's output tail).
    """
    root = project_root()
    python = os.path.join(os.path.abspath(directory), 'bin', 'python')
    stamp_path = os.path.join(directory, '.installed')
    wanted = hashlib.sha1(json.dumps(
        [PETASTORM, REQUIREMENTS, root]).encode()).hexdigest()
    try:
        with open(stamp_path) as f:
            stamp = f.read().strip()
    except OSError:
        stamp = None
    if stamp == wanted and _imports(python):
        return python
    print('making the Petastorm environment in {} (once)'.format(directory),
          flush=True)
    venv.EnvBuilder(clear=True, with_pip=True).create(directory)
    _pip(python, list(REQUIREMENTS))
    _pip(python, ['--no-deps', PETASTORM])
    _pip(python, ['--no-deps', '-e', root])
    if not _imports(python):
        raise RuntimeError('{} was made but does not import petastorm and '
                           'chainer_prefetch_bench'.format(directory))
    with open(stamp_path, 'w') as f:
        f.write(wanted + '\n')
    return python


def versions(python: str) -> Dict[str, str]:
    """Versions of Petastorm and what it reads with, in that environment.

    Args:
        python: The environment's ``python``.

    Returns:
        ``{'petastorm': ..., 'pyarrow': ..., 'numpy': ..., 'pandas': ...}``.
    """
    code = ('import importlib.metadata as m, json; print(json.dumps({n: '
            'm.version(n) for n in ("petastorm", "pyarrow", "numpy", '
            '"pandas")}))')
    output = subprocess.run([python, '-c', code], capture_output=True,
                            text=True, timeout=60, check=True).stdout
    return json.loads(output)


def _imports(python: str) -> bool:
    if not os.path.exists(python):
        return False
    return subprocess.run(
        [python, '-c', 'import petastorm, chainer_prefetch_bench.parquet.bench'],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        timeout=120).returncode == 0


def _pip(python: str, arguments) -> None:
    command = [python, '-m', 'pip', 'install', '-q'] + list(arguments)
    environment = dict(os.environ)
    environment.pop('PIP_CONSTRAINT', None)  # Chainer's; not installed here
    completed = subprocess.run(command, capture_output=True, text=True,
                               timeout=_TIMEOUT, env=environment)
    if completed.returncode != 0:
        raise RuntimeError('{} failed:\n{}'.format(
            ' '.join(command), (completed.stdout + completed.stderr)[-3000:]))


if __name__ == '__main__':
    print(ensure(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
