"""Every exception class of chainer_prefetch has one root, ChainerPrefetchError.

The walk runs in a fresh interpreter (importing the MPI modules would
initialise MPI in the test process; there it is told not to) and imports
every module of the package that imports with the extras installed here.
"""
import json
import subprocess
import sys
import textwrap

import pytest

from chainer_prefetch.elastic.errors import ElasticError, MembershipChanged
from chainer_prefetch.errors import ChainerPrefetchError
from chainer_prefetch.resilience.errors import ProcessFailure, ResilienceError

WALK = '''
    import importlib, inspect, json, pkgutil, sys
    try:
        import mpi4py
        mpi4py.rc.initialize = mpi4py.rc.finalize = False
    except ImportError:  # without the [mpi] extra
        pass
    import chainer_prefetch

    def classes(namespace):
        for value in list(vars(namespace).values()):
            if inspect.isclass(value) and value.__module__.startswith(
                    'chainer_prefetch'):
                yield value
                yield from classes(value)  # nested classes

    modules, skipped, found = [], {}, {}
    for info in pkgutil.walk_packages(chainer_prefetch.__path__,
                                      'chainer_prefetch.',
                                      onerror=lambda name: None):
        try:
            module = importlib.import_module(info.name)
        except ImportError as error:  # an extra that is not installed here
            skipped[info.name] = str(error)
            continue
        modules.append(info.name)
        for cls in classes(module):
            if issubclass(cls, BaseException):
                found['{}.{}'.format(cls.__module__, cls.__qualname__)] = [
                    '{}.{}'.format(base.__module__, base.__qualname__)
                    for base in cls.__mro__]
    json.dump({'modules': modules, 'skipped': skipped, 'found': found},
              sys.stdout)
'''


@pytest.fixture(scope='module')
def walked():
    result = subprocess.run([sys.executable, '-c', textwrap.dedent(WALK)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_exception_class_has_the_package_root(walked):
    root = 'chainer_prefetch.errors.ChainerPrefetchError'
    assert {'chainer_prefetch.errors', 'chainer_prefetch.elastic.errors',
            'chainer_prefetch.resilience.errors'} <= set(walked['modules'])
    outside = [name for name, mro in walked['found'].items()
               if root not in mro
               and 'builtins.Warning' not in mro  # warnings are not errors
               and not name.rsplit('.', 1)[1].startswith('_')]  # never escape
    assert outside == [], outside
    assert len(walked['found']) > 20, sorted(walked['found'])


def test_errors_that_were_runtime_errors_still_are():
    for cls in (ElasticError, MembershipChanged, ResilienceError, ProcessFailure):
        assert issubclass(cls, ChainerPrefetchError) and issubclass(cls, RuntimeError)
    failure = ProcessFailure(1, 'Allreduce', [2])
    assert isinstance(failure, RuntimeError)
    assert str(failure) == 'rank 1: process failure during MPI Allreduce (failed ranks: 2)'
