"""Emulated shared storage (Lustre/GPFS stand-in) through a real FUSE mount.

pip packages: ``mfusepy`` (pure-Python ctypes binding; loads libfuse2 when
present, else libfuse3), in ``pip install 'chainer_prefetch[bench]'``.
Debian packages: ``fuse3`` (fusermount, kernel helper) and ``libfuse2``
(scripts/apt-packages.txt).

SOURCE is mounted read-only at MOUNTPOINT by a daemon process that adds

* a latency per ``open`` (metadata round trip to the servers),
* a latency per ``read`` request the kernel sends (data round trip),
* a latency per metadata request: name lookup, ``stat`` and directory
  listing that the kernel does not answer from its cache (0 in the ``paper``
  and ``mild`` presets), and
* a bandwidth cap for the whole mount, shared by all readers (token bucket
  with a 256 KiB burst);

and counts every operation it serves (:meth:`Mount.op_counts`).

Baseline loaders and chainer_prefetch read the same POSIX paths unchanged.

The parts, one concern each:

``presets``       :class:`Params` and the named presets (and how they were
                  tuned);
``daemon``        the FUSE file system (latency, bandwidth cap), run as
                  ``python -m chainer_prefetch_bench.testbed.storage.daemon``;
``counts``        the operation counts the daemon keeps in a mapped file;
``mount``         the mount's life cycle: start the daemon, wait for the
                  mount, stop it, clean up a stale mount, the state files;
``calibration``   what the mount delivers to concurrent readers.

How much slower Chainer's iterator is through a preset is measured by
``python -m chainer_prefetch_bench.minibatch.ratio``.

Command line (``python -m chainer_prefetch_bench.testbed.storage``)::

    start SOURCE MOUNTPOINT [--preset paper|mild|lustre]
                            [--open-latency-ms X] [--read-latency-ms Y]
                            [--bandwidth-mbps Z] [--metadata-latency-ms M]
                            [--cache-timeout-s T]
    stop MOUNTPOINT
    status MOUNTPOINT
    calibrate MOUNTPOINT [--readers 1,2,4,8,16] [--files N] [--json PATH]

Design choices:

* The kernel page cache is kept, but FUSE drops a file's cached pages on every
  ``open`` unless the daemon sets ``keep_cache``, which it does not.  So
  every open of a file goes to the daemon and pays the open latency, and its
  data comes through the daemon again (read latency and bandwidth paid once
  per open), as on a parallel file system serving a dataset much larger
  than client memory; within one open, kernel readahead still turns many
  small ``read()`` calls into a few large FUSE requests (128 KiB each), as
  Lustre's client readahead does.  ``direct_io`` is not used: it would turn
  every small application read into a request and overstate the cost.
* Latency is ``time.sleep`` in libfuse's worker threads (multi-threaded FUSE
  loop), so concurrent requests overlap like requests to many storage
  servers, and the daemon uses almost no CPU (see ``status``/``calibrate``).
* The kernel caches attributes and names for ``cache_timeout_s`` (an hour
  by default, 1 s in the ``lustre`` preset); what it answers from its cache
  never reaches the daemon and costs nothing, as on a client holding the
  inode's lock.  With the high-level FUSE API a name lookup reaches the
  daemon as ``getattr``, so the metadata latency is charged on ``getattr``
  (lookups and stats, with or without a file handle), ``opendir`` and
  ``readdir``.
"""
from chainer_prefetch_bench.testbed.storage.calibration import calibrate
from chainer_prefetch_bench.testbed.storage.counts import OP_NAMES, counts_delta
from chainer_prefetch_bench.testbed.storage.mount import (
    Mount,
    MountError,
    fuse_problem,
    is_mounted,
    mounted,
    process_cpu_seconds,
    start,
    stop,
)
from chainer_prefetch_bench.testbed.storage.presets import PRESETS, Params

__all__ = ['OP_NAMES', 'PRESETS', 'Mount', 'MountError', 'Params', 'calibrate',
           'counts_delta', 'fuse_problem', 'is_mounted', 'mounted',
           'process_cpu_seconds', 'start', 'stop']
