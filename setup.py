"""Install chainer_prefetch.

Chainer 7.8.1 ships only as a source distribution whose setup.py imports
``pkg_resources``; it builds only with ``setuptools<70`` installed and pip's
``--no-build-isolation``.  Install it first (``.ci/run`` and README.rst show
the commands), then this package.  Chainer 7.8.1 uses NumPy APIs removed in
NumPy 2, hence ``numpy<2``.
"""
from setuptools import find_packages, setup

setup(
    name='chainer_prefetch',
    version='0.1.0',
    description=('Prefetching multiprocess iterator for Chainer: stage files '
                 'from shared storage to node-local storage while training'),
    packages=find_packages(include=['chainer_prefetch', 'chainer_prefetch.*']),
    python_requires='>=3.9',
    install_requires=[
        'chainer==7.8.1',
        'numpy<2',
        'pillow',
        'mpi4py>=4',
    ],
    extras_require={
        'test': ['pytest', 'pytest-timeout'],
        'gpu': ['cupy'],
        # chainer_prefetch.elastic; needs an etcd server (Debian etcd-server)
        'elastic': ['torch', 'etcd3gw'],
    },
)
