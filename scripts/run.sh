#!/usr/bin/env bash
# One entry point for a fresh machine: installs what is missing, then runs.
#
#   bash scripts/run.sh demo    the benchmark demo on a generated dataset:
#                               prints the comparison, writes figures
#   bash scripts/run.sh test    the test suite
#   bash scripts/run.sh lint    the linter (ruff, configured in pyproject.toml)
#   bash scripts/run.sh docs    the Sphinx documentation (docs/) into
#                               docs/_build/html, every warning an error
#   bash scripts/run.sh setup   only the installation
#
# Installs Debian packages (FUSE) with apt-get when missing (needs root) and a
# virtual environment in .venv with the package and every extra
# (requirements.txt), editable, PyTorch apart (scripts/requirements-elastic.txt),
# and the checkout on its path for the benchmark tree; Chainer 7.8.1 builds
# under constraints.txt.  Reinstalls when one of these files or setup.py
# changes.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-}

setup() {
    local missing=()
    for package in $(grep -v '^#' scripts/apt-packages.txt); do
        dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing Debian packages: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    if [ ! -x .venv/bin/python ]; then
        python3 -m venv .venv
    fi
    # shellcheck disable=SC1091
    . .venv/bin/activate
    local stamp=.venv/.installed wanted
    wanted=$(cat requirements.txt constraints.txt setup.py scripts/requirements-elastic.txt \
        | sha1sum)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ] \
            || ! python -c 'import chainer_prefetch, torch.distributed, etcd3gw' 2>/dev/null; then
        echo "installing Python packages into .venv"
        PIP_CONSTRAINT=constraints.txt pip install -q -r requirements.txt -e '.[test,elastic]'
        # PyTorch apart, without its declared setuptools>=77 (Chainer's import
        # needs setuptools<74): the elastic extra brought its other dependencies.
        pip install -q --no-deps -r scripts/requirements-elastic.txt
        echo "$wanted" > "$stamp"
    fi
    # The benchmark tree is not installed with the package: the checkout goes
    # on the environment's path, so that `python -m chainer_prefetch_bench...`
    # also runs where the tests start it from another directory.
    pwd > "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/chainer_prefetch_checkout.pth"
}

setup
. .venv/bin/activate
# Open MPI refuses to run as root unless told; CI and containers run as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
case "$what" in
    demo)
        python -m chainer_prefetch_bench.minibatch.bench --quick --out results/demo/bench_minibatch.json
        python -m chainer_prefetch_bench.minibatch.plot results/demo/bench_minibatch.json --out results/demo
        ;;
    test)
        shift
        python -m pytest -q "$@"
        ;;
    lint)
        ruff check .
        ;;
    docs)
        # -W: a warning (a broken reference, a name autodoc cannot import)
        # fails the build; -n would also check every cross-reference in the
        # docstrings, which name internal classes autodoc does not document.
        python -m sphinx -W --keep-going -q -b html docs docs/_build/html
        echo "docs: docs/_build/html/index.html"
        ;;
    setup) ;;
    *)
        echo "usage: bash scripts/run.sh demo|test|lint|docs|setup" >&2
        exit 2
        ;;
esac
