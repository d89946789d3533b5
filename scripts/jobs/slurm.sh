#!/bin/bash
# Data-parallel ImageNet training, N nodes x 4 processes (one per GPU),
# the paper's layout (sec. 4.2), under SLURM.
#
# Submit:   sbatch scripts/jobs/slurm.sh    (N = --nodes below)
# Adapt by editing the #SBATCH lines (nodes, GPUs, time, partition and
# account of your site) and the variables below; nothing else.
#
#SBATCH --job-name=chainer_prefetch
#SBATCH --nodes=2 --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=6
#SBATCH --time=12:00:00
# #SBATCH --partition=<partition>
# #SBATCH --account=<account>
set -euo pipefail

# ---- edit these --------------------------------------------------------
PROCS_PER_NODE=${PROCS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-4}}   # = GPUs per node
DATA_ROOT=${DATA_ROOT:-/lustre/${USER:-$(id -un)}/imagenet}   # dataset on shared storage
TRAIN_LIST=${TRAIN_LIST:-$DATA_ROOT/train.txt}
VAL_LIST=${VAL_LIST:-$DATA_ROOT/val.txt}
MEAN=${MEAN:-$DATA_ROOT/mean.npy}            # '' = subtract 128
LOCAL_DIR=${LOCAL_DIR:-${TMPDIR:-/tmp}/chainer_prefetch_${USER:-$(id -un)}}   # node-local SSD
ITERATOR=${ITERATOR:-prefetch}               # prefetch | multiprocess
ARCH=${ARCH:-resnet50}
CROP_SIZE=${CROP_SIZE:-224}
BATCHSIZE=${BATCHSIZE:-32}                   # per process
EPOCHS=${EPOCHS:-10}
LOADERJOB=${LOADERJOB:-2}                    # loader processes per rank (paper: 2)
COPY_THREADS=${COPY_THREADS:-8}              # copy threads per rank
GPU_ARGS=${GPU_ARGS:---gpu}                  # '' for a CPU-only run (naive communicator)
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}      # repository root (sbatch from there)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
MPIRUN=${MPIRUN:-mpirun}
OUT=${OUT:-$REPO/result/slurm_${SLURM_JOB_ID:-manual}}
# ------------------------------------------------------------------------

cd "$REPO"
NODES=${SLURM_JOB_NUM_NODES:-1}
NPROCS=$((NODES * PROCS_PER_NODE))
mkdir -p "$OUT"
mean_args=()
if [ -n "$MEAN" ]; then mean_args=(--mean "$MEAN"); fi

# Open MPI built with SLURM support reads the allocation itself.
set -x
"$MPIRUN" -n "$NPROCS" --map-by "ppr:$PROCS_PER_NODE:node" \
    -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH \
    "$PYTHON" "$REPO/examples/imagenet/train_imagenet.py" \
    "$TRAIN_LIST" "$VAL_LIST" --root "$DATA_ROOT" ${mean_args[@]+"${mean_args[@]}"} \
    --arch "$ARCH" --crop-size "$CROP_SIZE" --batchsize "$BATCHSIZE" \
    --epoch "$EPOCHS" --loaderjob "$LOADERJOB" \
    --iterator "$ITERATOR" --local-dir "$LOCAL_DIR" \
    --copy-threads "$COPY_THREADS" $GPU_ARGS --out "$OUT" "$@"
