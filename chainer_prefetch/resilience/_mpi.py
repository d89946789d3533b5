"""mpi4py's ``MPI`` for the modules that call MPI, or an ``ImportError``
that names the ``[mpi]`` extra.

Importing it initialises MPI (mpi4py's default), so only the modules that
talk to other ranks import it; the rest of :mod:`chainer_prefetch.resilience`
(the policies, the launcher, the watchdog, failure injection) imports
without mpi4py.
"""
from chainer_prefetch._extras import require_extra

require_extra('mpi', 'chainer_prefetch.resilience', ['mpi4py'])

from mpi4py import MPI  # noqa: E402

__all__ = ['MPI']
