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

# ---- edit these (any setting of cluster_train.sh can be set here) ------
DATA_ROOT=${DATA_ROOT:-/lustre/${USER:-$(id -un)}/imagenet}   # dataset on shared storage
LOCAL_DIR=${LOCAL_DIR:-${TMPDIR:-/tmp}/chainer_prefetch_${USER:-$(id -un)}}   # node-local SSD
PROCS_PER_NODE=${PROCS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-4}}   # = GPUs per node
EPOCHS=${EPOCHS:-10}
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}      # repository root (sbatch from there)
# --------------------------------------------------------------------------

# Open MPI built with SLURM support reads the allocation itself.
NODES=${SLURM_JOB_NUM_NODES:-1}
HOST_ARGS=()
OUT=${OUT:-$REPO/result/slurm_${SLURM_JOB_ID:-manual}}
source "$REPO/scripts/jobs/cluster_train.sh" "$@"
