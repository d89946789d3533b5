"""Optional parts of the package and the extra that installs each.

``pip install chainer_prefetch`` brings what the iterator needs (Chainer,
NumPy, Pillow).  Other parts need more, installed with an extra::

    pip install 'chainer_prefetch[parquet]'   # chainer_prefetch.datasets
    pip install 'chainer_prefetch[mpi]'       # chainer_prefetch.resilience's MPI
    pip install 'chainer_prefetch[elastic]'   # chainer_prefetch.elastic, with
                                              # PyTorch installed apart

A part imported without its extra raises an ``ImportError`` that names the
extra to install, instead of a bare "No module named ..." from deep inside.
"""
import importlib
from typing import Optional, Sequence


def require_extra(extra: str, part: str, modules: Sequence[str],
                  install: Optional[str] = None) -> None:
    """Import ``modules``; on failure, tell which extra installs them.

    Args:
        extra: The extra of ``setup.py`` that installs the modules.
        part: The package that needs them (named in the message).
        modules: Top-level modules to import (importing them must not start
            anything: e.g. ``mpi4py``, not ``mpi4py.MPI``).
        install: The command that installs them, where the extra does not
            (default: ``pip install 'chainer_prefetch[EXTRA]'``).

    Raises:
        ImportError: A module cannot be imported; the message names the
            module, the part and the command that installs it.
    """
    if install is None:
        install = "pip install 'chainer_prefetch[{}]'".format(extra)
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ImportError(
                "{} needs {}, which cannot be imported ({}); install it with "
                "{}".format(part, module, error, install),
                name=module) from error
