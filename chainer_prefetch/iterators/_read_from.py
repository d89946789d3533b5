"""Where stage 3 read an example: the loaders' answer and the scheduler's count."""
import enum


class ReadFrom(enum.Enum):
    """Where stage 3 read an example.

    A loader (:mod:`._worker`, :mod:`._columnar_worker`) answers it for
    each example or columnar batch; the scheduler counts it
    (:class:`._pipeline_counts.PipelineCounts`) and forgets a local copy
    that was not there (``FALLBACK``).
    """

    LOCAL = 'local'  #: through the located view (the local copies)
    SOURCE = 'source'  #: from shared storage, as the scheduler asked
    FALLBACK = 'fallback'  #: local copy unreadable (evicted meanwhile): source
