#!/usr/bin/env bash
# One entry point for a fresh machine: installs what is missing, then runs.
#
#   bash scripts/run.sh demo    the benchmark demo on a generated dataset:
#                               prints the comparison, writes figures
#   bash scripts/run.sh test    the test suite
#   bash scripts/run.sh lint    the linter (ruff, configured in pyproject.toml)
#   bash scripts/run.sh setup   only the installation
#
# Installs Debian packages (FUSE) with apt-get when missing (needs root) and a
# virtual environment in .venv with the package and every extra but elastic
# (requirements.txt), editable; Chainer 7.8.1 builds under constraints.txt.
# Reinstalls when requirements.txt, constraints.txt or setup.py change.
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
    wanted=$(cat requirements.txt constraints.txt setup.py | sha1sum)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ] \
            || ! python -c 'import chainer_prefetch, chainer_prefetch_bench' 2>/dev/null; then
        echo "installing Python packages into .venv"
        PIP_CONSTRAINT=constraints.txt pip install -q -r requirements.txt -e '.[test]'
        echo "$wanted" > "$stamp"
    fi
    if ! python -c 'import torch.distributed, etcd3gw' 2>/dev/null; then
        echo "installing the [elastic] extra into .venv"
        grep -v '^torch' scripts/requirements-elastic.txt | pip install -q -r /dev/stdin
        pip install -q --no-deps "$(grep '^torch' scripts/requirements-elastic.txt | cut -d' ' -f1)"
    fi
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
    setup) ;;
    *)
        echo "usage: bash scripts/run.sh demo|test|lint|setup" >&2
        exit 2
        ;;
esac
