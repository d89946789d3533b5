"""Benchmarks and experiments of chainer_prefetch, and the testbed they share.

``testbed/`` holds what every experiment needs: the emulated shared storage
(a FUSE mount with latency and a bandwidth cap), the synthetic JPEG and
Parquet datasets, the child-process harness, MPI launching, page-cache
dropping, the machine description and report writing.  Each experiment is
a folder with ``bench.py`` (or ``run.py``) and ``plot.py``, run as::

    python -m chainer_prefetch_bench.minibatch.bench --quick
    python -m chainer_prefetch_bench.minibatch.plot results/demo/bench_minibatch.json

Installed with the package; its dependencies are the ``bench`` extra
(``pip install 'chainer_prefetch[bench]'``).  ``results/README.md`` has the
command of every committed result.
"""
