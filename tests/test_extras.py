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


@pytest.mark.parametrize('part,module,extra', [
    ('chainer_prefetch.datasets', 'pyarrow', 'parquet'),
    ('chainer_prefetch.resilience', 'mpi4py', 'mpi'),
])
def test_a_part_without_its_extra_names_the_extra(part, module, extra):
    result = _python('''
        import sys
        sys.modules[{module!r}] = None
        try:
            import {part}
        except ImportError as error:
            print('ImportError:', error)
            print('name:', error.name)
        else:
            print('imported')
        '''.format(module=module, part=part))
    assert result.returncode == 0, result.stderr
    assert 'ImportError: {} needs {}'.format(part, module) in result.stdout
    assert "pip install 'chainer_prefetch[{}]'".format(extra) in result.stdout
    assert 'name: {}'.format(module) in result.stdout


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
        import chainer_prefetch.resilience
        print(chainer_prefetch.datasets.ParquetDataset.__name__,
              chainer_prefetch.resilience.ProcessFailure.__name__)
        ''')
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ['ParquetDataset', 'ProcessFailure']
