#!/bin/bash
# Data-parallel ImageNet training, N nodes x 4 processes (one per GPU),
# the paper's layout (sec. 4.2), under PBS Pro / OpenPBS.
#
# Submit:   qsub scripts/jobs/pbs.sh        (N = the select= count below)
# Adapt by editing the #PBS lines (nodes, cores, GPUs, walltime, queue and
# project of your site) and the variables below; nothing else.
#
#PBS -N chainer_prefetch
#PBS -l select=2:ncpus=24:ngpus=4:mpiprocs=4
#PBS -l walltime=12:00:00
#PBS -j oe
# #PBS -q <queue>
# #PBS -A <project>
set -euo pipefail

# ---- edit these --------------------------------------------------------
PROCS_PER_NODE=${PROCS_PER_NODE:-4}          # = GPUs per node = mpiprocs above
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
REPO=${REPO:-${PBS_O_WORKDIR:-$PWD}}         # repository root (qsub from there)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
MPIRUN=${MPIRUN:-mpirun}
HOSTFILE=${HOSTFILE:-${PBS_NODEFILE:-}}
OUT=${OUT:-$REPO/result/pbs_${PBS_JOBID:-manual}}
# ------------------------------------------------------------------------

cd "$REPO"
if [ -n "$HOSTFILE" ]; then
    NODES=$(sort -u "$HOSTFILE" | wc -l)
    host_args=(--hostfile "$HOSTFILE")
else
    NODES=1
    host_args=()
fi
NPROCS=$((NODES * PROCS_PER_NODE))
mkdir -p "$OUT"
mean_args=()
if [ -n "$MEAN" ]; then mean_args=(--mean "$MEAN"); fi

# Open MPI: PROCS_PER_NODE ranks per node; environment passed to all ranks.
# The local directory is created by each rank on its own node.
set -x
"$MPIRUN" -n "$NPROCS" ${host_args[@]+"${host_args[@]}"} --map-by "ppr:$PROCS_PER_NODE:node" \
    -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH \
    "$PYTHON" "$REPO/examples/imagenet/train_imagenet.py" \
    "$TRAIN_LIST" "$VAL_LIST" --root "$DATA_ROOT" ${mean_args[@]+"${mean_args[@]}"} \
    --arch "$ARCH" --crop-size "$CROP_SIZE" --batchsize "$BATCHSIZE" \
    --epoch "$EPOCHS" --loaderjob "$LOADERJOB" \
    --iterator "$ITERATOR" --local-dir "$LOCAL_DIR" \
    --copy-threads "$COPY_THREADS" $GPU_ARGS --out "$OUT" "$@"
