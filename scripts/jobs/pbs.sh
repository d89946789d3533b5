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

# ---- edit these (any setting of cluster_train.sh can be set here) ------
DATA_ROOT=${DATA_ROOT:-/lustre/${USER:-$(id -un)}/imagenet}   # dataset on shared storage
LOCAL_DIR=${LOCAL_DIR:-${TMPDIR:-/tmp}/chainer_prefetch_${USER:-$(id -un)}}   # node-local SSD
PROCS_PER_NODE=${PROCS_PER_NODE:-4}          # = GPUs per node = mpiprocs above
EPOCHS=${EPOCHS:-10}
REPO=${REPO:-${PBS_O_WORKDIR:-$PWD}}         # repository root (qsub from there)
# --------------------------------------------------------------------------

HOSTFILE=${HOSTFILE:-${PBS_NODEFILE:-}}
if [ -n "$HOSTFILE" ]; then
    NODES=$(sort -u "$HOSTFILE" | wc -l)
    HOST_ARGS=(--hostfile "$HOSTFILE")
else
    NODES=1
    HOST_ARGS=()
fi
OUT=${OUT:-$REPO/result/pbs_${PBS_JOBID:-manual}}
source "$REPO/scripts/jobs/cluster_train.sh" "$@"
