#!/usr/bin/env bash
# What a user installs: a fresh virtual environment with only `pip install .`
# (plus Chainer's build constraint) imports and runs the iterator, staging
# real files, and passes the pure elastic and resilience tests (no mpi4py,
# torch or etcd3gw there); the parquet and mpi extras install and their parts
# work; without a C compiler the installation still goes on (rows are then
# taken in Python, not by the C extension); the bench and test extras
# resolve; in another fresh virtual environment the elastic extra alone,
# installed as README.rst ("Installation") writes it, keeps `import chainer`
# working and imports elastic training without mpi4py.  Used by .ci/run; a
# few minutes.
#
#   bash scripts/check_install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
scratch=$(mktemp -d /tmp/check_install.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
export PIP_CONSTRAINT="$repo/constraints.txt"  # Chainer 7.8.1 needs setuptools<70 to build
python3 -m venv "$scratch/venv"
python="$scratch/venv/bin/python"
pip_in() {  # pip_in VENV ARGS...: quiet, but the whole log when it fails
    local venv=$1
    shift
    if ! "$venv/bin/pip" install -q "$@" > "$scratch/pip.log" 2>&1; then
        grep -v '^WARNING: Location' "$scratch/pip.log" >&2
        return 1
    fi
}
pip_install() { pip_in "$scratch/venv" "$@"; }
cd "$scratch"  # so that `import chainer_prefetch` finds the installed copy

echo "== pip install ."
pip_install "$repo"
"$python" - <<'PY'
import os, sys, tempfile
import numpy
from PIL import Image
import chainer
import chainer_prefetch
from chainer_prefetch import _take_rows, columnar
assert '/site-packages/' in chainer_prefetch.__file__, chainer_prefetch.__file__
assert columnar.TAKE_ROWS is _take_rows.take_rows  # the C extension was built
with tempfile.TemporaryDirectory() as root:
    pairs = []
    for i in range(12):
        path = os.path.join(root, 'shared', '{}.png'.format(i))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.new('RGB', (8, 8), (i, 0, 0)).save(path)
        pairs.append((path, i % 3))
    dataset = chainer.datasets.LabeledImageDataset(pairs)
    iterator = chainer_prefetch.PrefetchMultiprocessIterator(
        dataset, 4, n_processes=2, repeat=False, shuffle=False,
        local_dir=os.path.join(root, 'local'), n_copy_threads=2)
    try:
        batches = list(iterator)
        stats = iterator.stats
    finally:
        iterator.finalize()
    assert [len(b) for b in batches] == [4, 4, 4], batches
    assert batches[2][3][0][0, 0, 0] == 11 and batches[2][3][1] == 2
    print('iterator: 3 batches, {} files copied'.format(stats['files_copied']))
    assert stats['files_copied'] == 12, stats
for part, extra in (('datasets', 'parquet'), ('resilience.communicator', 'mpi')):
    try:
        __import__('chainer_prefetch.' + part)
    except ImportError as error:
        assert "chainer_prefetch[{}]".format(extra) in str(error), error
        print('without [{}]: {}'.format(extra, error))
    else:
        sys.exit('chainer_prefetch.{} imported without its extra'.format(part))
PY

echo "== the pure elastic and resilience tests, without mpi4py, torch and etcd3gw"
pip_install pytest pytest-timeout
"$python" -c '
import importlib.util
missing = [m for m in ("mpi4py", "torch", "etcd3gw") if importlib.util.find_spec(m) is None]
assert missing == ["mpi4py", "torch", "etcd3gw"], missing'
"$python" -m pytest -q -p no:cacheprovider -p no:warnings \
    "$repo/tests/test_elastic_core.py" "$repo/tests/test_resilience_policy.py"

echo "== pip install .[parquet,mpi]"
pip_install "$repo[parquet,mpi]"
parquet_check() {  # a Parquet dataset through the iterator, columnar batches
    "$python" - <<'PY'
import os, tempfile
import numpy, pyarrow, pyarrow.parquet
from chainer_prefetch import PrefetchMultiprocessIterator
from chainer_prefetch.datasets import ParquetDataset, RowGroupWindowOrderSampler
import chainer_prefetch.resilience
with tempfile.TemporaryDirectory() as root:
    pyarrow.parquet.write_table(
        pyarrow.table({'id': numpy.arange(40), 'name': ['n{}'.format(i) for i in range(40)]}),
        os.path.join(root, 'part.parquet'), row_group_size=10)
    dataset = ParquetDataset(root)
    sampler = RowGroupWindowOrderSampler(dataset.row_group_sizes, window=2, seed=0)
    iterator = PrefetchMultiprocessIterator(
        dataset, 10, n_processes=2, repeat=False, order_sampler=sampler,
        local_dir=os.path.join(root, 'local'))
    try:
        examples = [example for batch in iterator for example in batch]
    finally:
        iterator.finalize()
    assert sorted(example['id'] for example in examples) == list(range(40)), examples
    assert all(example['name'] == 'n{}'.format(example['id']) for example in examples)
from chainer_prefetch import columnar
print('parquet: 40 rows through the iterator (pyarrow {}, {})'.format(
    pyarrow.__version__, columnar.TAKE_ROWS.__name__))
PY
}
parquet_check
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    "$scratch/venv/bin/mpiexec" --oversubscribe -n 2 "$python" -c '
from mpi4py import MPI
import chainermn
import chainer_prefetch.resilience.communicator
comm = chainermn.create_communicator("naive")
assert comm.allreduce_obj(1) == 2
if comm.rank == 0:
    print("mpi: 2 ranks, chainermn naive communicator")'

echo "== pip install . without a C compiler: installs, and takes rows in Python"
# (from a copy of the sources: the repository's build/ holds the compiled one;
# files deleted in the working tree but not yet in git are left out)
mkdir "$scratch/source"
git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | (cd "$repo" && while IFS= read -r -d '' file; do
           if [ -e "$file" ]; then printf '%s\0' "$file"; fi
       done | xargs -0 cp --parents -t "$scratch/source")
CC=false pip_install --no-deps --force-reinstall "$scratch/source"
"$python" -c '
from chainer_prefetch import columnar
assert columnar.TAKE_ROWS is columnar.take_rows_python, columnar.TAKE_ROWS'
parquet_check

echo "== pip install --dry-run .[bench,test]"
pip_install --dry-run "$repo[bench,test]"
"$python" -c '
import importlib.util
assert importlib.util.find_spec("chainer_prefetch_bench") is None  # not installed'

echo "== [elastic] alone, as README.rst writes it, in a fresh virtual environment"
python3 -m venv "$scratch/elastic"
pip_in "$scratch/elastic" "$repo[elastic]"  # under PIP_CONSTRAINT, as documented
env -u PIP_CONSTRAINT "$scratch/elastic/bin/pip" install -q --no-deps torch==2.13.0 \
    --index-url https://download.pytorch.org/whl/cpu > "$scratch/pip.log" 2>&1 \
    || { cat "$scratch/pip.log" >&2; exit 1; }
"$scratch/elastic/bin/python" - <<'PY'
import importlib.util
import chainer
import setuptools
import torch.distributed
from chainer_prefetch.elastic import ElasticTraining, parse_etcd_url
assert importlib.util.find_spec('mpi4py') is None
assert int(setuptools.__version__.split('.')[0]) < 74, setuptools.__version__
assert torch.distributed.is_gloo_available()
parse_etcd_url('etcd://127.0.0.1:2379/job')
print('elastic: chainer {}, torch {}, setuptools {}, {} imported without mpi4py'.format(
    chainer.__version__, torch.__version__, setuptools.__version__,
    ElasticTraining.__name__))
PY
echo "install check: ok"
