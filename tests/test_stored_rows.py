"""StoredRows: variable-length rows taken out of one or more arrays.

The compiled ``chainer_prefetch._take_rows`` and its Python equivalent must
give the same rows, and both must refuse rows and stored rows out of range
by name, before anything is copied.
"""
import mmap
import sys

import numpy as np
import pytest

from chainer_prefetch import columnar
from chainer_prefetch.columnar import StoredRows, VarColumn, take_rows_python

try:
    from chainer_prefetch import _take_rows
except ImportError:  # installed without a C compiler: the Python tests still run
    _take_rows = None

IMPLEMENTATIONS = {'python': take_rows_python}
if _take_rows is not None:
    IMPLEMENTATIONS['compiled'] = _take_rows.take_rows
compiled_only = pytest.mark.skipif(_take_rows is None, reason='not compiled')


@pytest.fixture(params=['compiled', 'python'])
def take_rows(request, monkeypatch):
    """Each implementation in turn, as the one StoredRows calls."""
    if request.param not in IMPLEMENTATIONS:
        pytest.skip('not compiled')
    monkeypatch.setattr(columnar, 'TAKE_ROWS', IMPLEMENTATIONS[request.param])
    return request.param


def test_the_compiled_form_is_built_and_used():
    # setup.py builds it where a C compiler is found (README.rst's setup
    # installs one); without it StoredRows falls back to Python.  This
    # fails, rather than skips, where it was not built.
    assert _take_rows is not None, 'chainer_prefetch._take_rows was not built'
    assert columnar.TAKE_ROWS is _take_rows.take_rows


def _stored(dtype, n_sources=3, seed=0):
    """Sources of random values and their rows (some empty), row by row."""
    rng = np.random.default_rng(seed)
    sources = [rng.integers(0, 100, size=int(size)).astype(dtype)
               for size in rng.integers(0, 60, size=n_sources)]
    starts, ends, which, expected = [], [], [], []
    for source_index, source in enumerate(sources):
        cuts = np.sort(rng.integers(0, len(source) + 1, size=8))
        for start, end in zip(cuts[:-1], cuts[1:]):
            starts.append(start)
            ends.append(end)
            which.append(source_index)
            expected.append(source[start:end])
    return sources, np.array(starts), np.array(ends), np.array(which), expected


@pytest.mark.parametrize('dtype', [np.uint8, np.int32, np.float64, 'S3'])
def test_rows_of_several_sources_in_any_order_with_repeats(take_rows, dtype):
    sources, starts, ends, which, expected = _stored(dtype)
    stored = StoredRows(sources, starts, ends, which)
    rng = np.random.default_rng(1)
    for rows in ([], [0], [5, 5, 0, 20, 5], rng.integers(0, len(stored), size=200),
                 rng.permutation(len(stored))):
        offsets, values = stored.take(rows)
        assert offsets.dtype == np.int64 and values.dtype == np.dtype(dtype)
        assert list(offsets) == [0] + list(np.cumsum([len(expected[r]) for r in rows]))
        for i, row in enumerate(rows):
            np.testing.assert_array_equal(values[offsets[i]:offsets[i + 1]], expected[row])
        values[:] = 0 if values.dtype.kind != 'S' else b''  # a writable copy
    assert all(np.array_equal(source, _stored(dtype)[0][i])
               for i, source in enumerate(sources))


def test_one_source_and_a_var_column(take_rows):
    column = VarColumn.from_values([b'ab', b'', b'cde', b'f'], 'bytes')
    taken = column.take([2, 0, 1, 2])
    assert taken.tolist() == [b'cde', b'ab', b'', b'cde']
    assert list(taken.offsets) == [0, 3, 5, 5, 8]
    tokens = VarColumn.from_values([[1, 2], [3], []], 'list', dtype=np.int16)
    assert [list(value) for value in tokens.take([1, 0, 2])] == [[3], [1, 2], []]


def test_references_are_taken_too():  # (object arrays never reach TAKE_ROWS)
    source = np.array([{'a': 1}, 'x', None, 2.5], dtype=object)
    offsets, values = StoredRows([source], [0, 1, 3], [1, 3, 4]).take([2, 1, 0])
    assert list(offsets) == [0, 1, 3, 4]
    assert list(values) == [2.5, 'x', None, {'a': 1}]


@pytest.mark.parametrize('row', [-1, 30, 2**40])
def test_a_row_out_of_range_is_named(take_rows, row):
    sources, starts, ends, which, _ = _stored(np.uint8)
    with pytest.raises(IndexError, match=r'row {} out of range for {} rows'.format(
            row, len(starts))):
        StoredRows(sources, starts, ends, which).take([0, row, 1])


@pytest.mark.parametrize('change, named', [
    (lambda s, e, w: s.__setitem__(4, -1), 'stored row 4: values -1 to'),
    (lambda s, e, w: e.__setitem__(2, s[2] - 1), 'stored row 2: values'),
    (lambda s, e, w: e.__setitem__(6, 10**6), 'stored row 6: values .* to 1000000 '),
    (lambda s, e, w: w.__setitem__(3, 3), 'stored row 3: .* of source 3 of 3'),
    (lambda s, e, w: w.__setitem__(0, -1), 'stored row 0: .* of source -1 of 3'),
])
def test_a_stored_row_outside_its_source_is_refused_when_made(change, named):
    sources, starts, ends, which, _ = _stored(np.uint8)
    change(starts, ends, which)
    with pytest.raises(ValueError, match=named):
        StoredRows(sources, starts, ends, which)


def test_what_was_checked_cannot_change_afterwards(take_rows):
    sources, starts, ends, which, expected = _stored(np.uint8)
    stored = StoredRows(sources, starts, ends, which)
    ends[0] = 10**6  # the caller's arrays, not the stored rows' copies
    offsets, values = stored.take([0])
    np.testing.assert_array_equal(values, expected[0])
    with pytest.raises(ValueError, match='read-only'):
        stored._ends[0] = 10**6


def test_rows_must_be_one_dimensional(take_rows):
    stored = StoredRows(*_stored(np.uint8)[:4])
    with pytest.raises(ValueError, match=r'one-dimensional, not of shape \(2, 1\)'):
        stored.take([[0], [1]])


def test_arrays_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match='differ in length: 3, 2, None'):
        StoredRows([np.zeros(4, np.uint8)], [0, 1, 2], [1, 2])
    with pytest.raises(ValueError, match='differ in length: 2, 2, 1'):
        StoredRows([np.zeros(4, np.uint8)], [0, 1], [1, 2], [0])


def _arguments(**changes):
    """Arguments of take_rows for one source of 10 bytes and two stored rows."""
    arguments = dict(sources=[memoryview(bytes(range(10)))], source_of_row=None,
                     starts=np.array([0, 4]), ends=np.array([4, 10]),
                     rows=np.array([1, 0]), width=1)
    arguments.update(changes)
    return list(arguments.values())


@compiled_only
def test_the_compiled_form_checks_every_position_itself():
    offsets, values = _take_rows.take_rows(*_arguments())
    assert np.frombuffer(offsets, np.int64).tolist() == [0, 6, 10]
    assert bytes(values) == bytes([4, 5, 6, 7, 8, 9, 0, 1, 2, 3])
    refused = [
        (_arguments(ends=np.array([4, 11])), ValueError, 'row 1: values 4 to 11 of source 0'),
        (_arguments(starts=np.array([5, 4])), ValueError, 'row 0: values 5 to 4'),
        (_arguments(starts=np.array([-1, 4])), ValueError, 'row 0: values -1 to 4'),
        (_arguments(rows=np.array([1], np.uint64)), TypeError, 'native int64'),
        (_arguments(rows=np.array([1.0])), TypeError, 'native int64'),
        (_arguments(rows=np.array([1], '>i8')), TypeError, 'native int64'),
        (_arguments(rows=np.array([[1]])), TypeError, 'one-dimensional'),
        (_arguments(rows=np.array(1)), TypeError, 'one-dimensional'),
        (_arguments(source_of_row=np.array([0, 1])), ValueError, 'of source 1 are out'),
        (_arguments(width=4), ValueError, 'row 1: values 4 to 10 of source 0'),
        (_arguments(rows=np.array([2])), IndexError, 'row 2 out of range for 2 rows'),
        (_arguments(rows=np.array([-1])), IndexError, 'row -1 out of range'),
        (_arguments(rows=np.array([0], np.int32)), TypeError,
         'rows must be a one-dimensional array of native int64'),
        (_arguments(starts=np.array([0, 2, 4])[::2]), ValueError, 'not C-contiguous'),
        (_arguments(ends=np.array([4])), ValueError, '2 starts but 1 ends'),
        (_arguments(source_of_row=np.array([0])), ValueError, '1 sources of rows but 2 starts'),
        (_arguments(sources=[]), ValueError, 'at least one source and a positive width'),
        (_arguments(width=0), ValueError, 'at least one source and a positive width'),
        (_arguments(sources=(b'0123456789',)), TypeError, 'must be list'),
        (_arguments(sources=[object()]), TypeError, 'bytes-like object'),
    ]
    for arguments, error, message in refused:
        with pytest.raises(error, match=message):
            _take_rows.take_rows(*arguments)


class _ShrinkingSource:
    """A source whose buffer, once taken, empties the list of sources."""

    def __init__(self, sources):
        self.sources = sources

    def __buffer__(self, flags):
        self.sources.clear()
        return memoryview(bytes(range(10)))


@compiled_only
@pytest.mark.skipif(sys.version_info < (3, 12), reason='__buffer__ is Python 3.12+')
def test_sources_changed_while_their_buffers_are_taken():
    sources = [None]
    sources[0] = _ShrinkingSource(sources)
    sources.append(memoryview(bytes(10)))
    offsets, values = _take_rows.take_rows(*_arguments(
        sources=sources, source_of_row=np.array([1, 0])))
    assert bytes(values) == bytes([4, 5, 6, 7, 8, 9]) + bytes(4)


@compiled_only
def test_rows_too_large_together_are_refused(tmp_path):
    # Each row lies within its source (a sparse file of 2**40 bytes, mapped
    # read-only); together they would wrap the total size around.
    path = tmp_path / 'sparse'
    with open(path, 'wb') as file:
        file.truncate(2**40)
    with open(path, 'rb') as file, mmap.mmap(file.fileno(), 0,
                                              access=mmap.ACCESS_READ) as mapped:
        arguments = _arguments(sources=[mapped], starts=np.array([0]),
                               ends=np.array([2**40]), rows=np.zeros(2**23, np.int64))
        with pytest.raises(OverflowError, match='too large together'):
            _take_rows.take_rows(*arguments)
