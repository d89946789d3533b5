"""How many loader processes each rank gets by default: its share of the cores.

Chainer's ``MultiprocessIterator`` (and ours) start one worker per core when
``n_processes`` is None: with 8 ranks on a node, 8 x all cores workers.  The
example's ``--loaderjob`` defaults instead to the cores this rank may run on
divided among the ranks of the node that may run on the same cores: with
every rank free to use every core (``--bind-to none``), cores / ranks per
node (ChainerMN's ``intra_size``); with each rank bound to its own cores
(``mpirun --bind-to core/socket``), all of its cores.
"""
import os
import platform
from typing import Iterable, Sequence, Set, Tuple


def cpus_available() -> Set[int]:
    """The CPUs this process may run on (its affinity mask).

    Returns:
        CPU numbers.
    """
    if hasattr(os, 'sched_getaffinity'):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def default_loaderjob(own_cpus: Iterable[int],
                      node_cpus: Sequence[Iterable[int]]) -> int:
    """Loader processes for one rank: its cores over the ranks sharing them.

    Args:
        own_cpus: The CPUs this rank may run on.
        node_cpus: The CPUs of every rank on this node (this rank included).

    Returns:
        At least 1: ``len(own_cpus)`` divided by how many ranks of the node
        may run on any of those CPUs, rounded down.
    """
    own = set(own_cpus)
    sharing = sum(1 for cpus in node_cpus if own & set(cpus))
    return max(1, len(own) // max(1, sharing))


def node_cpu_sets(allgather) -> Tuple[Set[int], list]:
    """This rank's CPUs and those of every rank on the same host.

    Args:
        allgather: ``mpi4py``'s ``comm.allgather`` of the job's communicator.

    Returns:
        ``(own_cpus, [cpus of each rank on this host])``.
    """
    own = cpus_available()
    host = platform.node()
    everyone = allgather((host, sorted(own)))
    return own, [set(cpus) for name, cpus in everyone if name == host]
