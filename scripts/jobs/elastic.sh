#!/bin/bash
# Elastic data-parallel ImageNet training: start a job, or add members to a
# running one.  Every process started with the same ELASTIC address is a
# member of the same job; there is no single mpirun that owns them all.
#
#   # 1. an etcd the nodes can reach (the site's, or a private one:
#   #    python -m chainer_prefetch.elastic.local_etcd  prints etcd://127.0.0.1:PORT/job)
#   # 2. the first allocation starts the job:
#   ELASTIC=etcd://etcd-host:2379/resnet50-run1 sbatch scripts/jobs/elastic.sh
#   ELASTIC=etcd://etcd-host:2379/resnet50-run1 qsub -v ELASTIC scripts/jobs/elastic.sh
#   # 3. a node allocated later joins the running job: the same command
#   #    with the same ELASTIC value (a second sbatch/srun or qsub).
#   # On one machine, K members in the background (and later more):
#   ELASTIC=etcd://127.0.0.1:PORT/try K=2 bash scripts/jobs/elastic.sh
#   ELASTIC=etcd://127.0.0.1:PORT/try K=2 bash scripts/jobs/elastic.sh   # +2 members
#
# Inside SLURM each task of `srun` is a member; inside PBS `mpirun` is used
# only to start PROCS_PER_NODE members per node (they do not use MPI).
#SBATCH --job-name=chainer_prefetch_elastic
#SBATCH --nodes=2 --ntasks-per-node=4
#SBATCH --time=12:00:00
#PBS -N chainer_prefetch_elastic
#PBS -l select=2:ncpus=24:mpiprocs=4
#PBS -l walltime=12:00:00
set -euo pipefail

# ---- edit these (each VAR=${VAR:-default}) ---------------------------------
: "${ELASTIC:?set ELASTIC=etcd://HOST:PORT/JOB (the same for every member)}"
SCALE_POLICY=${SCALE_POLICY:-minmax:1}       # minmax:MIN[:MAX] | failstop:N | module:Policy
REPO=${REPO:-${SLURM_SUBMIT_DIR:-${PBS_O_WORKDIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}}}
DATA_ROOT=${DATA_ROOT:-/lustre/${USER:-$(id -un)}/imagenet}
TRAIN_LIST=${TRAIN_LIST:-$DATA_ROOT/train.txt}
VAL_LIST=${VAL_LIST:-$DATA_ROOT/val.txt}
LOCAL_DIR=${LOCAL_DIR:-${TMPDIR:-/tmp}/chainer_prefetch_${USER:-$(id -un)}}
ARCH=${ARCH:-resnet50}
CROP_SIZE=${CROP_SIZE:-224}
BATCHSIZE=${BATCHSIZE:-32}
EPOCHS=${EPOCHS:-90}
LOADERJOB=${LOADERJOB:-2}
PROCS_PER_NODE=${PROCS_PER_NODE:-4}
K=${K:-2}                                    # members started here outside a scheduler
OUT=${OUT:-$REPO/result/elastic}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
# ------------------------------------------------------------------------------

cd "$REPO"
mkdir -p "$OUT"
member=("$PYTHON" "$REPO/examples/imagenet/train_imagenet.py"
        "$TRAIN_LIST" "$VAL_LIST" --root "$DATA_ROOT" --arch "$ARCH"
        --crop-size "$CROP_SIZE" --batchsize "$BATCHSIZE" --epoch "$EPOCHS"
        --loaderjob "$LOADERJOB" --local-dir "$LOCAL_DIR" --out "$OUT"
        --elastic "$ELASTIC" --scale-policy "$SCALE_POLICY" "$@")
set -x
if [ -n "${SLURM_JOB_ID:-}" ]; then
    srun "${member[@]}"
elif [ -n "${PBS_NODEFILE:-}" ]; then
    NODES=$(sort -u "$PBS_NODEFILE" | wc -l)
    mpirun -n $((NODES * PROCS_PER_NODE)) --hostfile "$PBS_NODEFILE" \
        --map-by "ppr:$PROCS_PER_NODE:node" -x PATH "${member[@]}"
else
    for _ in $(seq "$K"); do "${member[@]}" & done
    wait
fi
