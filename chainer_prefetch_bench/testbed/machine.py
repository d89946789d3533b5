"""What the numbers were measured on, recorded in every result file."""
import contextlib
import os
import platform
import sys
from typing import Dict


def machine_description() -> Dict:
    """CPUs, memory, Python and kernel of this machine, and its load now.

    Returns:
        A JSON-able dict: ``cpus``, ``cpus_available`` (this process's
        affinity), ``cpu_model``, ``memory_gib``, ``python``, ``kernel``,
        ``platform``, ``hostname``, ``loadavg_at_start``.
    """
    memory_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open('/proc/meminfo') as meminfo:
            memory_kb = int(meminfo.readline().split()[1])
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open('/proc/cpuinfo') as cpuinfo:
            for line in cpuinfo:
                if line.startswith('model name'):
                    cpu = line.split(':', 1)[1].strip()
                    break
    return {'cpus': os.cpu_count(),
            'cpus_available': len(os.sched_getaffinity(0)),
            'cpu_model': cpu, 'memory_gib': round(memory_kb / 2**20, 1),
            'python': sys.version.split()[0], 'kernel': platform.release(),
            'platform': platform.platform(), 'hostname': platform.node(),
            'loadavg_at_start': os.getloadavg()}
