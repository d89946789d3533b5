#!/bin/bash
# The launch shared by pbs.sh and slurm.sh: N nodes x PROCS_PER_NODE ranks.
# Sourced by them after they set REPO, NODES, HOST_ARGS and OUT from the
# scheduler's variables; do not submit this file itself.
set -euo pipefail
: "${REPO:?set REPO to the repository root}"
HOST_ARGS=(${HOST_ARGS[@]+"${HOST_ARGS[@]}"})

# ---- settings: each VAR=${VAR:-default}; set them in pbs.sh/slurm.sh or the environment
PROCS_PER_NODE=${PROCS_PER_NODE:-4}          # = GPUs per node
DATA_ROOT=${DATA_ROOT:-/lustre/${USER:-$(id -un)}/imagenet}   # dataset on shared storage
TRAIN_LIST=${TRAIN_LIST:-$DATA_ROOT/train.txt}
VAL_LIST=${VAL_LIST:-$DATA_ROOT/val.txt}
MEAN=${MEAN-$DATA_ROOT/mean.npy}             # MEAN='' subtracts 128 instead
LOCAL_DIR=${LOCAL_DIR:-${TMPDIR:-/tmp}/chainer_prefetch_${USER:-$(id -un)}}   # node-local SSD
ITERATOR=${ITERATOR:-prefetch}               # prefetch | multiprocess
ARCH=${ARCH:-resnet50}
CROP_SIZE=${CROP_SIZE:-224}
BATCHSIZE=${BATCHSIZE:-32}                   # per process
EPOCHS=${EPOCHS:-10}
LOADERJOB=${LOADERJOB:-2}                    # loader processes per rank (paper: 2)
COPY_THREADS=${COPY_THREADS:-16}             # copy threads per rank
GPU_ARGS=${GPU_ARGS---gpu}                   # GPU_ARGS='' for a CPU-only run (naive communicator)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
MPIRUN=${MPIRUN:-mpirun}
NODES=${NODES:-1}
OUT=${OUT:-$REPO/result/manual}
# --------------------------------------------------------------------------

cd "$REPO"
NPROCS=$((NODES * PROCS_PER_NODE))
mkdir -p "$OUT"
mean_args=()
if [ -n "$MEAN" ]; then mean_args=(--mean "$MEAN"); fi

# Open MPI: PROCS_PER_NODE ranks per node; environment passed to all ranks.
# The local directory is created by each rank on its own node.
set -x
"$MPIRUN" -n "$NPROCS" ${HOST_ARGS[@]+"${HOST_ARGS[@]}"} \
    --map-by "ppr:$PROCS_PER_NODE:node" \
    -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH \
    "$PYTHON" "$REPO/examples/imagenet/train_imagenet.py" \
    "$TRAIN_LIST" "$VAL_LIST" --root "$DATA_ROOT" ${mean_args[@]+"${mean_args[@]}"} \
    --arch "$ARCH" --crop-size "$CROP_SIZE" --batchsize "$BATCHSIZE" \
    --epoch "$EPOCHS" --loaderjob "$LOADERJOB" --time-breakdown \
    --iterator "$ITERATOR" --local-dir "$LOCAL_DIR" \
    --copy-threads "$COPY_THREADS" $GPU_ARGS --out "$OUT" "$@"
