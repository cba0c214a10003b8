#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --job-name=omni-clevr
#SBATCH --mem=1000GB
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output={RUN_DIR}/submitit/%j_0_log.out
#SBATCH --requeue
#SBATCH --signal=USR2@600
#SBATCH --time=480
#SBATCH --wckey=submitit

# setup
module load cuda/12.4
module load nccl
export NCCL_DEBUG=WARN
export HF_HUB_OFFLINE=1

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output {RUN_DIR}/submitit/%j_%t_log.out --open-mode=append --kill-on-bad-exit=1 {PYTHON} -u -m submitit.core._submit {RUN_DIR}/submitit
