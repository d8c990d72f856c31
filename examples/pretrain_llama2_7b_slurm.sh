#!/bin/bash
# Slurm: one task per node, each running torchrun over 8 GPUs, joined by the c10d rendezvous on
# the first node. Submit from the repository root (change --nodes to scale data parallelism):
#   DATA_PATH=... sbatch examples/pretrain_llama2_7b_slurm.sh
#SBATCH --job-name=llama2_7b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
export LAUNCHER=slurm
source "${SLURM_SUBMIT_DIR:-$(dirname "${BASH_SOURCE[0]}")/..}/examples/pretrain_llama2_7b.sh" "$@"
