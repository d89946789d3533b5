"""Scripts without ``if __name__ == '__main__':`` and ``python -c`` code,
which Chainer's ``MultiprocessIterator`` runs: a training iterator and a
validation iterator, the second one's loaders started while the first one's
threads run (so from the fork server, which here is forked from the script
instead of importing it again)."""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent('''
    import sys
    import chainer
    import numpy
    from chainer_prefetch import PrefetchMultiprocessIterator

    with open(sys.argv[1], 'a') as runs:  # once per run of this code
        runs.write('ran\\n')

    class Squares(chainer.dataset.DatasetMixin):  # defined in __main__
        def __len__(self):
            return 40

        def get_example(self, i):
            return numpy.float32(i * i)

    train = PrefetchMultiprocessIterator(Squares(), 8, n_processes=2)
    val = PrefetchMultiprocessIterator(Squares(), 8, n_processes=2,
                                       repeat=False, shuffle=False)
    seen = []
    for _ in range(5):
        seen.extend(float(v) for v in train.next())
    validated = [float(v) for batch in val for v in batch]
    train.finalize()
    val.finalize()
    assert sorted(seen) == [float(i * i) for i in range(40)], seen
    assert validated == [float(i * i) for i in range(40)], validated
    print('DONE', flush=True)
''')


@pytest.mark.timeout(300)
@pytest.mark.parametrize('how', ['script', 'dash_c'])
def test_two_iterators_without_a_main_guard(tmp_path, how):
    runs = tmp_path / 'runs.txt'
    if how == 'script':
        script = tmp_path / 'train.py'
        script.write_text(SCRIPT)
        command = [sys.executable, str(script), str(runs)]
    else:
        command = [sys.executable, '-c', SCRIPT, str(runs)]
    result = subprocess.run(command, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.stdout.strip() == 'DONE', result.stdout
    assert runs.read_text() == 'ran\n'  # the code ran once, not again


NOTEBOOK = textwrap.dedent('''
    import chainer
    import numpy
    from chainer_prefetch import PrefetchMultiprocessIterator

    class Values(chainer.dataset.DatasetMixin):  # a first cell
        def __len__(self):
            return 16

        def get_example(self, i):
            return numpy.float32(i)

    train = PrefetchMultiprocessIterator(Values(), 4, n_processes=2)
    first = train.next()

    class Values(chainer.dataset.DatasetMixin):  # the cell edited, run again
        def __len__(self):
            return 16

        def get_example(self, i):
            return numpy.float32(-i)

    class Later(chainer.dataset.DatasetMixin):  # a cell run afterwards
        def __len__(self):
            return 16

        def get_example(self, i):
            return numpy.float32(i * 10)

    again = PrefetchMultiprocessIterator(Values(), 4, n_processes=2,
                                         repeat=False, shuffle=False)
    later = PrefetchMultiprocessIterator(Later(), 4, n_processes=2,
                                         repeat=False, shuffle=False)
    assert [float(v) for b in again for v in b] == [-i for i in range(16)]
    assert [float(v) for b in later for v in b] == [i * 10 for i in range(16)]
    for iterator in (train, again, later):
        iterator.finalize()
    print('DONE', flush=True)
''')


@pytest.mark.timeout(300)
@pytest.mark.parametrize('how', ['dash_c', 'stdin'])
def test_classes_defined_after_the_first_iterator_started(tmp_path, how):
    """As in a notebook: a class defined, or defined again, after the fork
    server started reaches the loaders as it is now (by value)."""
    if how == 'stdin':
        command, given = [sys.executable, '-'], NOTEBOOK
    else:
        command, given = [sys.executable, '-c', NOTEBOOK], None
    result = subprocess.run(command, input=given, capture_output=True,
                            text=True, timeout=240, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.stdout.strip() == 'DONE', result.stdout
