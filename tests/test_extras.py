"""What each part of the package needs: the core alone, and the extras.

Each test runs a fresh interpreter in which a dependency is made
unimportable (``sys.modules[name] = None`` makes ``import name`` raise
``ImportError``, as if the package were not installed).
"""
import subprocess
import sys
import textwrap

import pytest


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize('statement,part,module,install', [
    ('import chainer_prefetch.datasets', 'chainer_prefetch.datasets',
     'pyarrow', "pip install 'chainer_prefetch[parquet]'"),
    ('import chainer_prefetch.resilience.communicator',
     'chainer_prefetch.resilience', 'mpi4py', "pip install 'chainer_prefetch[mpi]'"),
    ('from chainer_prefetch.resilience import training',
     'chainer_prefetch.resilience', 'mpi4py', "pip install 'chainer_prefetch[mpi]'"),
    ('from chainer_prefetch.elastic import ElasticTraining',
     'chainer_prefetch.elastic.ElasticTraining', 'etcd3gw',
     "pip install 'chainer_prefetch[elastic]'"),
    ('from chainer_prefetch.elastic import ElasticCommunicator',
     'chainer_prefetch.elastic.ElasticCommunicator', 'torch',
     'pip install --no-deps torch==2.13.0'),
])
def test_a_part_without_its_extra_names_the_extra(statement, part, module, install):
    result = _python('''
        import sys
        sys.modules[{module!r}] = None
        try:
            {statement}
        except ImportError as error:
            print('ImportError:', error)
            print('name:', error.name)
        else:
            print('imported')
        '''.format(module=module, statement=statement))
    assert result.returncode == 0, result.stderr
    assert 'ImportError: {} needs {}'.format(part, module) in result.stdout
    assert install in result.stdout
    assert 'name: {}'.format(module) in result.stdout


def test_the_pure_parts_of_elastic_and_resilience_need_no_extra():
    """Policies, settings, errors, the launcher and the watchdog import
    without mpi4py, torch and etcd3gw; elastic training without mpi4py."""
    result = _python('''
        import subprocess, sys
        for name in ('mpi4py', 'torch', 'etcd3gw'):
            sys.modules[name] = None
        from chainer_prefetch.elastic import FailStop, ElasticSettings, parse_etcd_url
        from chainer_prefetch.elastic import errors, plan, policy
        from chainer_prefetch.resilience import (
            LR_RULES, ProcessFailure, injection, launcher, policy, watchdog)
        from chainer_prefetch.policy import epoch_plan, lr_rules
        code = ('import sys; sys.modules["mpi4py"] = None\\n'
                'from chainer_prefetch.elastic import ElasticTraining\\n'
                'print(ElasticTraining.__name__)')
        print(subprocess.run([sys.executable, '-c', code], check=True,
                             capture_output=True, text=True).stdout.strip())
        ''')
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ['ElasticTraining']


def test_the_iterator_runs_without_any_extra():
    """Only Chainer, NumPy and Pillow: no PyArrow, MPI, PyTorch or plotting."""
    result = _python('''
        import sys
        for name in ('pyarrow', 'mpi4py', 'torch', 'matplotlib', 'mfusepy',
                     'pandas', 'fastparquet', 'psutil', 'etcd3gw'):
            sys.modules[name] = None
        import numpy
        import chainer
        import chainer_prefetch
        dataset = chainer.datasets.TupleDataset(
            numpy.arange(10, dtype=numpy.float32), numpy.arange(10))
        iterator = chainer_prefetch.PrefetchMultiprocessIterator(
            dataset, 4, n_processes=2, repeat=False, shuffle=False)
        try:
            print([len(batch) for batch in iterator])
        finally:
            iterator.finalize()
        ''')
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == '[4, 4, 2]'


def test_the_parts_import_with_their_extras():
    result = _python('''
        import chainer_prefetch.datasets
        import chainer_prefetch.resilience.communicator
        print(chainer_prefetch.datasets.ParquetDataset.__name__,
              chainer_prefetch.resilience.communicator.FaultTolerantCommunicator.__name__)
        ''')
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ['ParquetDataset', 'FaultTolerantCommunicator']
