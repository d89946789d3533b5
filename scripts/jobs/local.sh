#!/bin/bash
# Data-parallel ImageNet training on ONE machine: mpiexec -n K.
#
# Adapt by editing the variables below (or setting them in the environment:
# every one is VAR=${VAR:-default}).  Extra arguments are passed on to
# examples/imagenet/train_imagenet.py, e.g.
#
#     K=2 EPOCHS=1 DATA_ROOT=/data/tiny bash scripts/jobs/local.sh --progress
#
# A tiny dataset for a try (from the repository root):
#
#     python -m chainer_prefetch_bench.testbed.jpeg_dataset /tmp/tiny --n-images 64 --n-classes 4 \
#         --seed 0 --val-images 16
#     DATA_ROOT=/tmp/tiny K=2 EPOCHS=1 bash scripts/jobs/local.sh
#
# Per-rank time breakdowns land in $OUT/time_breakdown_rank*.json and the
# log in $OUT/log.
set -euo pipefail

# ---- edit these --------------------------------------------------------
K=${K:-2}                                   # MPI processes
DATA_ROOT=${DATA_ROOT:-$HOME/imagenet}      # image root (paths in lists are relative to it)
TRAIN_LIST=${TRAIN_LIST:-$DATA_ROOT/train.txt}
VAL_LIST=${VAL_LIST:-$DATA_ROOT/val.txt}
MEAN=${MEAN:-}                              # optional mean.npy ('' = subtract 128)
LOCAL_DIR=${LOCAL_DIR:-${TMPDIR:-/tmp}/chainer_prefetch_${USER:-$(id -un)}}  # staging dir (fast local disk)
ITERATOR=${ITERATOR:-prefetch}              # prefetch | multiprocess
ARCH=${ARCH:-tiny}                          # tiny | resnet50
CROP_SIZE=${CROP_SIZE:-32}                  # 224 for resnet50 on real ImageNet
BATCHSIZE=${BATCHSIZE:-8}                   # per process
VAL_BATCHSIZE=${VAL_BATCHSIZE:-16}
EPOCHS=${EPOCHS:-1}
LOADERJOB=${LOADERJOB:-1}                   # loader processes per iterator
COPY_THREADS=${COPY_THREADS:-2}             # copy threads per iterator
OUT=${OUT:-result/local_${ITERATOR}_k${K}}
REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
PYTHON=${PYTHON:-python}                    # e.g. $REPO/.venv/bin/python
MPIEXEC=${MPIEXEC:-mpiexec}
MPIEXEC_ARGS=${MPIEXEC_ARGS:-}              # more mpiexec options, e.g. '--with-ft ulfm' for
                                            # --fault-tolerance respawn|shrink
# ------------------------------------------------------------------------

if [ ! -f "$TRAIN_LIST" ] || [ ! -f "$VAL_LIST" ]; then
    echo "missing $TRAIN_LIST or $VAL_LIST: set DATA_ROOT (see the header" \
         "of $0 for making a tiny dataset)" >&2
    exit 1
fi
if [ "$(id -u)" = 0 ]; then  # Open MPI refuses root without these
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
mkdir -p "$LOCAL_DIR" "$OUT"

mean_args=()
if [ -n "$MEAN" ]; then mean_args=(--mean "$MEAN"); fi

set -x
# shellcheck disable=SC2086  # MPIEXEC_ARGS is a list of words
"$MPIEXEC" --oversubscribe $MPIEXEC_ARGS -n "$K" \
    "$PYTHON" "$REPO/examples/imagenet/train_imagenet.py" \
    "$TRAIN_LIST" "$VAL_LIST" --root "$DATA_ROOT" ${mean_args[@]+"${mean_args[@]}"} \
    --arch "$ARCH" --crop-size "$CROP_SIZE" \
    --batchsize "$BATCHSIZE" --val_batchsize "$VAL_BATCHSIZE" \
    --epoch "$EPOCHS" --loaderjob "$LOADERJOB" --time-breakdown \
    --iterator "$ITERATOR" --local-dir "$LOCAL_DIR" \
    --copy-threads "$COPY_THREADS" --out "$OUT" "$@"
