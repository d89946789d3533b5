"""What the emulated shared storage adds to each operation, and named presets.

Presets, tuned with ``python -m chainer_prefetch_bench.minibatch.ratio
--batches 40 --repeats 3`` on the 2-core development machine (dataset:
``testbed.jpeg_dataset``, 2,000 train images, mean 110 KB; Chainer
MultiprocessIterator, n_processes=2, batch 32, LabeledImageDataset decoding
with PIL, no resize; one warm-up batch, then 40 timed batches).  Local
reads ran at 390-455 img/s when the machine was otherwise idle (one core
decodes these images at ~430 img/s), and as low as 270 img/s when other
jobs shared the cores, so ratios vary with load; the mounted rates were
stable to +-3%:

* ``paper`` (open 18 ms, read 5 ms, 100 MB/s): the paper's Table 2 ratio,
  480.85 s / 59.49 s = 8.1x.  Mounted 50-53 img/s; ratio 8.1-8.6 against
  an idle machine's local rate (open 17 ms gave 54.4 img/s, ratio 7.3-8.0).
* ``mild`` (open 2 ms, read 0.5 ms, 400 MB/s): about 2x.  Mounted
  202-218 img/s, local 424-448 img/s, ratio 2.06.
* ``lustre`` (metadata 5 ms, open 9 ms, read 5 ms, 100 MB/s, kernel
  cache 1 s): ``paper`` with the cost of metadata.  On Lustre an open and a
  stat are each one round trip to the metadata server, and a stat that
  reports the size also asks the object servers (a glimpse).  A client
  keeps a file's attributes only while it holds the inode's lock, and with
  a dataset much larger than the client's lock cache those locks are gone
  by the next epoch, so the kernel's attribute and name cache is cut to 1 s
  (the FUSE default) instead of an hour: every ``stat`` and every lookup
  of a name not used in the last second pays.  The split between lookup
  and open keeps the paper's per-file cost: reading this dataset through
  LabeledImageDataset costs 1.8 lookups per image (the file's, and most of
  the time its class folder's, visited every ~2.5 s) and one open, 1.8 x 5
  + 9 = 18 ms, as ``paper``'s open.  Measured one after the other (medians
  of 3): ``lustre`` mounted 47.1 img/s, ``paper`` 49.4 img/s, local 259 and
  265 img/s (a loaded machine); with 8 ms lookups and 10 ms opens (1.8 x 8
  + 10 = 24.4 ms per image) ``lustre`` gave 40.2 img/s against ``paper``'s
  48.9.
* For reference, no latency at all: mounted 309-343 img/s, ratio 1.41 (the
  FUSE path itself; the daemon used ~0.6 ms CPU per image read with PIL).

With LabeledImageDataset each image costs one open and about two read
requests (PIL reads the header first, then the rest).  ``calibrate`` with the
paper preset (whole files, plain reads): 1 reader 37 files/s (5 MB/s), 16
readers 490 files/s (57 MB/s, under the 100 MB/s cap), daemon CPU 0.18 s for
320 files; so a prefetcher with many threads hides the latency, as on real
shared storage.

``paper`` and ``mild`` add nothing to metadata operations (lookups, stats,
directory listings) and let the kernel cache attributes and names for an
hour, so only opens and reads pay.
"""
import argparse
from dataclasses import dataclass, fields
from typing import Dict

PRESETS: Dict[str, Dict[str, float]] = {
    'paper': {'open_latency_ms': 18.0, 'read_latency_ms': 5.0,
              'bandwidth_mbps': 100.0},
    'mild': {'open_latency_ms': 2.0, 'read_latency_ms': 0.5,
             'bandwidth_mbps': 400.0},
    'lustre': {'metadata_latency_ms': 5.0, 'open_latency_ms': 9.0,
               'read_latency_ms': 5.0, 'bandwidth_mbps': 100.0,
               'cache_timeout_s': 1.0},
}
"""Named parameter sets; the module docstring says what they emulate."""


@dataclass(frozen=True)
class Params:
    """What the emulated storage adds to each operation.

    Attributes:
        open_latency_ms: Milliseconds added to every open.
        read_latency_ms: Milliseconds added to every read request.
        bandwidth_mbps: Cap on the mount's total read rate in MB/s
            (10^6 bytes); 0 means no cap.
        metadata_latency_ms: Milliseconds added to every attribute request
            (``getattr``: each name lookup and each ``stat`` the kernel does
            not answer from its cache), directory open and directory
            listing request.
        cache_timeout_s: Seconds the kernel keeps attributes and names
            (the mount's ``attr_timeout`` and ``entry_timeout``).
    """

    open_latency_ms: float = 0.0
    read_latency_ms: float = 0.0
    bandwidth_mbps: float = 0.0
    metadata_latency_ms: float = 0.0
    cache_timeout_s: float = 3600.0

    @classmethod
    def from_preset(cls, name: str) -> 'Params':
        """Parameters of a named preset.

        Args:
            name: A key of :data:`PRESETS`.

        Returns:
            The preset's :class:`Params`.
        """
        if name not in PRESETS:
            raise ValueError('unknown preset {!r}; known: {}'.format(
                name, ', '.join(sorted(PRESETS))))
        return cls(**PRESETS[name])


def add_param_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--preset`` and one option per :class:`Params` field to ``parser``.

    Args:
        parser: A parser or subparser.
    """
    parser.add_argument('--preset', choices=sorted(PRESETS))
    parser.add_argument('--open-latency-ms', type=float)
    parser.add_argument('--read-latency-ms', type=float)
    parser.add_argument('--bandwidth-mbps', type=float,
                        help='MB/s for the whole mount; 0: no cap')
    parser.add_argument('--metadata-latency-ms', type=float,
                        help='added to every lookup, stat and directory '
                             'open or listing')
    parser.add_argument('--cache-timeout-s', type=float,
                        help="seconds the kernel caches attributes and names")


def params_from_args(args: argparse.Namespace) -> Params:
    """The :class:`Params` of parsed arguments: the preset, then overrides.

    Args:
        args: Parsed by a parser given :func:`add_param_args`.

    Returns:
        The parameters.
    """
    values = dict(PRESETS[args.preset]) if args.preset else {}
    for field in fields(Params):
        if getattr(args, field.name) is not None:
            values[field.name] = getattr(args, field.name)
    return Params(**values)
