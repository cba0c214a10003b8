#!/bin/bash

# Parameters
#SBATCH --account=proj-42
#SBATCH --cpus-per-task=16
#SBATCH --gpus-per-node=2
#SBATCH --job-name=qwen2.5-vl-3b-clevr
#SBATCH --mem=128GB
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output={RUN_DIR}/submitit/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --qos=high
#SBATCH --requeue
#SBATCH --signal=USR2@300
#SBATCH --time=240
#SBATCH --wckey=submitit

# setup

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output {RUN_DIR}/submitit/%j_%t_log.out --open-mode=append --kill-on-bad-exit=1 {PYTHON} -u -m submitit.core._submit {RUN_DIR}/submitit
