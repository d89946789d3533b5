"""Is ULFM (the MPI fault-tolerance extension) really active in this job?

mpi4py falls back silently when it is not: ``Comm.Shrink`` becomes a plain
duplicate and ``Comm.Agree`` a non-fault-tolerant allreduce, and with Open
MPI a failed process then aborts the whole job.  So the check asks the MPI
library itself:

1. the loaded ``libmpi`` must export the ULFM functions (``MPIX_Comm_shrink``,
   ``MPIX_Comm_revoke``, ``MPIX_Comm_agree``) that mpi4py binds to, and
2. for Open MPI, fault tolerance must be enabled at run time: the library's
   ``ompi_ftmpi_enabled`` flag, set by ``mpirun --with-ft ulfm`` (the MCA
   parameter ``mpi_ft_enable``).

Other MPI libraries cannot be confirmed and count as inactive.
"""
import ctypes
import re
import warnings
from typing import NamedTuple, Optional

LIBMPI = re.compile(r'/libmpi(_\w+)?\.so')
ULFM_FUNCTIONS = ('MPIX_Comm_shrink', 'MPIX_Comm_revoke', 'MPIX_Comm_agree')


class UlfmStatus(NamedTuple):
    """Result of :func:`ulfm_status`.

    Attributes:
        active: ULFM is compiled in and enabled for this job.
        reason: Why (a sentence for messages).
    """
    active: bool
    reason: str


def loaded_libmpi(maps_path: str = '/proc/self/maps') -> Optional[str]:
    """Path of the ``libmpi`` shared library mapped into this process."""
    try:
        with open(maps_path) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and LIBMPI.search(fields[-1]):
                    return fields[-1]
    except OSError:
        return None
    return None


def ulfm_status() -> UlfmStatus:
    """Checks ULFM in this process (initialises MPI through mpi4py).

    Returns:
        An :class:`UlfmStatus`.
    """
    from chainer_prefetch.resilience._mpi import MPI
    vendor, version = MPI.get_vendor()
    path = loaded_libmpi()
    if path is None:
        return UlfmStatus(False, 'no libmpi is loaded in this process')
    library = ctypes.CDLL(path)
    missing = [name for name in ULFM_FUNCTIONS
               if not hasattr(library, name)]
    if missing:
        return UlfmStatus(False, '{} ({}) lacks {}: mpi4py falls back to '
                          'non-fault-tolerant versions'.format(
                              vendor, path, ', '.join(missing)))
    if vendor != 'Open MPI':
        return UlfmStatus(False, 'cannot confirm that fault tolerance is '
                          'enabled in {} {}'.format(vendor, version))
    try:
        enabled = ctypes.c_bool.in_dll(library, 'ompi_ftmpi_enabled').value
    except ValueError:
        return UlfmStatus(False, 'Open MPI {} has no ompi_ftmpi_enabled flag'
                          .format('.'.join(map(str, version))))
    if not enabled:
        return UlfmStatus(False, 'Open MPI {} has ULFM but it is disabled in '
                          'this job: start it with mpirun --with-ft ulfm'
                          .format('.'.join(map(str, version))))
    return UlfmStatus(True, 'Open MPI {} with ULFM enabled (--with-ft ulfm)'
                      .format('.'.join(map(str, version))))


def check_ulfm(on_missing: str = 'error') -> bool:
    """Enforces the user's choice when ULFM is not active.

    Args:
        on_missing: ``'error'`` raises, ``'fallback'`` warns (the caller then
            uses checkpoint/restart).

    Returns:
        Whether ULFM is active.

    Raises:
        UlfmUnavailable: not active and ``on_missing == 'error'``.
        ValueError: unknown ``on_missing``.
    """
    from chainer_prefetch.resilience.errors import UlfmUnavailable
    if on_missing not in ('error', 'fallback'):
        raise ValueError("on_missing must be 'error' or 'fallback', got {!r}"
                         .format(on_missing))
    status = ulfm_status()
    if status.active:
        return True
    if on_missing == 'error':
        raise UlfmUnavailable('ULFM is not active: ' + status.reason)
    warnings.warn('ULFM is not active ({}); falling back to '
                  'checkpoint/restart'.format(status.reason), RuntimeWarning)
    return False
