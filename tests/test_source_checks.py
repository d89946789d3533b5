"""``recheck_sources``: what each setting notices, and what it asks of shared storage.

The guarantees (``chainer_prefetch.staging.source_checks``) are tried with
real loader processes on files that are replaced in place, replaced by
rename, and deleted between epochs; the counts of ``stat`` and ``open``
calls that ``iterator.stats`` reports are checked against the files and
directories of the dataset.
"""
import os
import time
import types

import numpy
import pytest

from chainer_prefetch import PrefetchMultiprocessIterator
from chainer_prefetch.staging.source_checks import RECENT_SECONDS, SourceChecks

N_DIRECTORIES = 2
FILES_PER_DIRECTORY = 6
N_FILES = N_DIRECTORIES * FILES_PER_DIRECTORY
BATCH = 4


class BytesFiles:
    """Each example is the bytes of one file (its paths found by discovery)."""

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        with open(self.paths[index], 'rb') as f:
            return numpy.frombuffer(f.read(), dtype=numpy.uint8)


def _content(index, version):
    return bytes([index, version]) * (10 + version)  # versions differ in size too


@pytest.fixture
def files(tmp_path):
    """12 files in 2 directories, whose times have settled (see RECENT_SECONDS)."""
    paths = []
    for index in range(N_FILES):
        directory = tmp_path / 'shared' / 'd{}'.format(index // FILES_PER_DIRECTORY)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / 'f{}.bin'.format(index)
        path.write_bytes(_content(index, 0))
        paths.append(str(path))
    time.sleep(RECENT_SECONDS + 0.2)
    return paths


def _iterator(paths, local, recheck, repeat=True):
    return PrefetchMultiprocessIterator(
        BytesFiles(paths), BATCH, shuffle=False, n_processes=1, n_copy_ahead=1,
        local_dir=local, recheck_sources=recheck, repeat=repeat)


def _epochs(it, n):
    """The examples of the next ``n`` epochs, one list per epoch."""
    epochs = []
    for _ in range(n):
        examples = []
        for _ in range(N_FILES // BATCH):
            examples.extend(bytes(example) for example in it.next())
        epochs.append(examples)
    return epochs


@pytest.mark.parametrize('recheck', ['directories', 'each_epoch', 'never'])
def test_warm_epochs_ask_shared_storage_what_the_setting_says(
        files, tmp_path, recheck):
    it = _iterator(files, str(tmp_path / 'local'), recheck)
    try:
        epochs = _epochs(it, 4)
        stats = it.stats
    finally:
        it.finalize()
    for epoch in epochs:
        assert epoch == [_content(i, 0) for i in range(N_FILES)]
    by_epoch = stats['by_epoch']
    # Epoch 0 copies each file with one open (its size and time taken from
    # the open file); 'directories' also reads each directory's stamp.
    assert by_epoch[0]['source_opens'] == N_FILES
    assert by_epoch[0]['source_stats'] == (
        N_DIRECTORIES if recheck == 'directories' else 0)
    expected_stats = {'directories': N_DIRECTORIES, 'each_epoch': N_FILES,
                      'never': 0}[recheck]
    for epoch in (1, 2, 3):
        assert by_epoch[epoch]['source_stats'] == expected_stats, (epoch, by_epoch)
        assert by_epoch[epoch]['source_opens'] == 0
        assert by_epoch[epoch]['examples_from_local'] == N_FILES
    assert stats['source_stats'] >= sum(
        counts['source_stats'] for counts in by_epoch.values())
    assert stats['source_opens'] == sum(
        counts['source_opens'] for counts in by_epoch.values())


def _replace_by_rename(path, content):
    with open(path + '.new', 'wb') as f:
        f.write(content)
    os.rename(path + '.new', path)


def _rewrite_in_place(path, content):
    with open(path, 'r+b') as f:
        f.write(content)


CHANGED = 3  # the index whose file changes


@pytest.mark.parametrize('recheck, change, noticed', [
    ('directories', _replace_by_rename, True),
    ('each_epoch', _replace_by_rename, True),
    ('never', _replace_by_rename, False),
    ('directories', _rewrite_in_place, False),  # no directory changes
    ('each_epoch', _rewrite_in_place, True),
    ('never', _rewrite_in_place, False),
])
def test_a_changed_source_is_noticed_as_the_setting_says(
        files, tmp_path, recheck, change, noticed):
    it = _iterator(files, str(tmp_path / 'local'), recheck)
    try:
        _epochs(it, 1)
        change(files[CHANGED], _content(CHANGED, 1))
        # Epoch 1 may have been staged before the change (the look-ahead);
        # epoch 2 was staged after it.
        last = _epochs(it, 2)[-1]
    finally:
        it.finalize()
    expected = [_content(i, 0) for i in range(N_FILES)]
    if noticed:
        expected[CHANGED] = _content(CHANGED, 1)
    assert last == expected


@pytest.mark.parametrize('recheck', ['directories', 'each_epoch'])
def test_a_source_replaced_after_a_reset_is_noticed(files, tmp_path, recheck):
    """A reset numbers epochs from 0 again; the checks still see them as new."""
    it = _iterator(files, str(tmp_path / 'local'), recheck)
    try:
        _epochs(it, 3)
        _replace_by_rename(files[CHANGED], _content(CHANGED, 1))
        it.reset()  # (the copies of the new epoch 0 start here)
        last = _epochs(it, 1)[-1]
    finally:
        it.finalize()
    expected = [_content(i, 0) for i in range(N_FILES)]
    expected[CHANGED] = _content(CHANGED, 1)
    assert last == expected


@pytest.mark.parametrize('recheck', ['directories', 'each_epoch'])
def test_an_evaluation_iterator_reset_each_time_sees_a_replaced_source(
        files, tmp_path, recheck):
    """As Chainer's Evaluator uses it: one pass, reset, another pass."""
    it = _iterator(files, str(tmp_path / 'local'), recheck, repeat=False)
    try:
        first = [bytes(example) for batch in it for example in batch]
        _replace_by_rename(files[CHANGED], _content(CHANGED, 1))
        it.reset()  # (as the Evaluator does before each pass)
        second = [bytes(example) for batch in it for example in batch]
    finally:
        it.finalize()
    expected = [_content(i, 0) for i in range(N_FILES)]
    assert first == expected
    expected[CHANGED] = _content(CHANGED, 1)
    assert second == expected


@pytest.mark.parametrize('recheck', ['directories', 'each_epoch'])
def test_a_deleted_source_fails_the_next_epoch_naming_the_file(
        files, tmp_path, recheck):
    it = _iterator(files, str(tmp_path / 'local'), recheck)
    try:
        _epochs(it, 1)
        os.remove(files[CHANGED])
        with pytest.raises(Exception) as raised:
            _epochs(it, 2)
    finally:
        it.finalize()
    assert files[CHANGED] in str(raised.value)


def test_never_keeps_serving_the_copy_of_a_deleted_source(files, tmp_path):
    it = _iterator(files, str(tmp_path / 'local'), 'never')
    try:
        _epochs(it, 1)
        os.remove(files[CHANGED])
        last = _epochs(it, 2)[-1]
    finally:
        it.finalize()
    assert last == [_content(i, 0) for i in range(N_FILES)]


# ---- the decisions alone, with a clock and stamps given ----------------------

class _Directories:
    """Stamps of directories, as a test sets them, and the stats asked."""

    def __init__(self):
        self.stamps = {}
        self.asked = []
        self.now = 1000.0

    def stat(self, path):
        self.asked.append(path)
        if path not in self.stamps:
            raise FileNotFoundError(path)
        ino, changed = self.stamps[path]
        return types.SimpleNamespace(st_dev=1, st_ino=ino,
                                     st_mtime_ns=changed * 10 ** 9,
                                     st_ctime_ns=changed * 10 ** 9)

    def clock(self):
        return self.now


def test_an_item_is_trusted_while_its_directory_stands():
    fs = _Directories()
    fs.stamps['/d'] = (7, 900)
    checks = SourceChecks('directories', 3, fs.stat, fs.clock)
    assert not checks.trusts(0, ['/d/a'], 0)  # never compared in this run
    checks.compared(0, 0)
    assert checks.trusts(0, ['/d/a'], 1)
    assert checks.trusts(0, ['/d/a'], 1)
    assert fs.asked == ['/d', '/d']  # once per epoch
    fs.stamps['/d'] = (7, 950)  # a name in it changed
    assert not checks.trusts(0, ['/d/a'], 2)
    checks.compared(0, 2)
    assert checks.trusts(0, ['/d/a'], 3)


def test_a_recent_or_replaced_or_missing_directory_is_not_trusted():
    fs = _Directories()
    fs.stamps['/d'] = (7, 999)  # changed a second ago
    checks = SourceChecks('directories', 1, fs.stat, fs.clock)
    checks.compared(0, 0)
    assert not checks.trusts(0, ['/d/a'], 0)
    fs.now += RECENT_SECONDS
    assert checks.trusts(0, ['/d/a'], 1) is False  # settled only since epoch 1
    checks.compared(0, 1)
    assert checks.trusts(0, ['/d/a'], 2)
    fs.stamps['/d'] = (8, 999)  # another directory at the same path
    assert not checks.trusts(0, ['/d/a'], 3)
    del fs.stamps['/d']
    checks.compared(0, 3)
    assert not checks.trusts(0, ['/d/a'], 4)


def test_an_item_needs_every_directory_of_its_sources_to_stand():
    fs = _Directories()
    fs.stamps.update({'/d': (1, 900), '/e': (2, 900)})
    checks = SourceChecks('directories', 1, fs.stat, fs.clock)
    checks.compared(0, 0)
    checks.trusts(0, ['/d/a', '/e/b'], 0)
    assert checks.trusts(0, ['/d/a', '/e/b'], 1)
    fs.stamps['/e'] = (2, 950)
    assert not checks.trusts(0, ['/d/a', '/e/b'], 2)
    checks.forget(0)
    fs.now += 100
    assert not checks.trusts(0, ['/d/a', '/e/b'], 3)


@pytest.mark.parametrize('mode', ['each_epoch', 'never'])
def test_other_settings_never_trust_without_comparing(mode):
    fs = _Directories()
    fs.stamps['/d'] = (7, 900)
    checks = SourceChecks(mode, 1, fs.stat, fs.clock)
    checks.compared(0, 0)
    assert not checks.trusts(0, ['/d/a'], 1)
    assert fs.asked == []


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match='recheck_sources must be one of'):
        SourceChecks('sometimes', 1)
