#!/usr/bin/env bash
# The GPU path in one command, on a node with a GPU (NVIDIA, CUDA 12):
#
#   bash scripts/gpu_check.sh                  # ResNet-50, --gpu, 1 rank
#   bash scripts/gpu_check.sh --ranks 2        # with 2 GPUs: pure_nccl
#   bash scripts/gpu_check.sh --cpu --arch tiny --crop-size 32 --images 96 \
#       --batchsize 16 --out results/gpu/cpu_check   # end to end, no GPU
#
# Installs the environment (scripts/run.sh setup) and CuPy when missing
# (CUPY_PACKAGE, default cupy-cuda12x), then runs the ImageNet example for
# our iterator and Chainer's MultiprocessIterator, --start-method fork and
# forkserver, with and without maxtasksperchild, pinned copy off and on;
# prints images/s and the time breakdown, watches /dev/shm, and writes
# results/gpu/runs.json and table.txt (with the command).  Arguments go to
# python -m chainer_prefetch_bench.gpu.run (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/run.sh setup
# shellcheck disable=SC1091
. .venv/bin/activate
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [[ " $* " != *" --cpu "* ]] && ! python -c 'import cupy' 2>/dev/null; then
    echo "installing ${CUPY_PACKAGE:-cupy-cuda12x}"
    pip install -q "${CUPY_PACKAGE:-cupy-cuda12x}"
fi
exec python -m chainer_prefetch_bench.gpu.run --out results/gpu "$@"
