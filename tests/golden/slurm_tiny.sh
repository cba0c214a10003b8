#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=2
#SBATCH --job-name=tiny-clevr-cpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output={RUN_DIR}/submitit/%j_0_log.out
#SBATCH --requeue
#SBATCH --signal=USR2@60
#SBATCH --time=30
#SBATCH --wckey=submitit

# setup

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output {RUN_DIR}/submitit/%j_%t_log.out --open-mode=append --kill-on-bad-exit=1 {PYTHON} -u -m submitit.core._submit {RUN_DIR}/submitit
