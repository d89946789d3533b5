"""What the numbers were measured on, recorded in every result file."""
import contextlib
import glob
import os
import platform
import sys
from typing import Dict

#: Feature bit of a virtio memory balloon that hands the guest's free pages
#: back to the hypervisor (``VIRTIO_BALLOON_F_REPORTING``).
BALLOON_REPORTING_BIT = 5
#: Where the balloon devices bound to their driver appear.
BALLOON_DEVICES = '/sys/bus/virtio/drivers/virtio_balloon/virtio*'


def machine_description() -> Dict:
    """CPUs, memory, Python and kernel of this machine, and its load now.

    Returns:
        A JSON-able dict: ``cpus``, ``cpus_available`` (this process's
        affinity), ``cpu_model``, ``memory_gib``, ``python``, ``kernel``,
        ``platform``, ``hostname``, ``loadavg_at_start``,
        ``free_page_reporting`` (:func:`free_page_reporting`).
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
            'loadavg_at_start': os.getloadavg(),
            'free_page_reporting': free_page_reporting()}


def reports_free_pages(features: str) -> bool:
    """Whether a virtio balloon's ``features`` (its sysfs file: one ``0``
    or ``1`` per feature bit, bit 0 first) include free page reporting.

    Args:
        features: The file's content.
    """
    bits = features.strip()
    return len(bits) > BALLOON_REPORTING_BIT and bits[BALLOON_REPORTING_BIT] == '1'


def free_page_reporting(devices: str = BALLOON_DEVICES) -> bool:
    """Whether this machine is a virtual machine that hands freed memory back to its host.

    With a virtio balloon reporting free pages, memory that the guest's
    processes freed goes back to the hypervisor after a few seconds, and
    touching it again costs the host's page faults as well as the
    guest's: a run that takes fresh memory is slower after runs that freed
    a lot than right after one that freed little.

    Args:
        devices: A glob of the balloon devices bound to their driver.
    """
    for device in glob.glob(devices):
        with contextlib.suppress(OSError):
            with open(os.path.join(device, 'features')) as features:
                if reports_free_pages(features.read()):
                    return True
    return False


def file_system_type(directory: str) -> str:
    """The type of the file system ``directory`` is on or will be made on (``'ext4'``...).

    Args:
        directory: A folder, which need not exist yet.

    Returns:
        The type, or ``''`` when the mount table cannot be read.
    """
    from chainer_prefetch.staging.file_systems import mount_of, read_mounts
    return mount_of(os.path.realpath(directory), read_mounts()).fs_type
