#!/usr/bin/env bash
# Launch tinytron.train on N nodes x G GPUs under Slurm: one torchrun per node (srun starts
# them), the c10d rendezvous on the first node of the allocation, then G ranks per node.
#
#   sbatch scripts/slurm_train.sh                                        # the 7B example, 32 x 8 GPUs
#   sbatch --nodes 2 scripts/slurm_train.sh configs/gpt_1b.toml --training.train_iters 100
#   GPUS_PER_NODE=4 sbatch --nodes 1 --gpus-per-node 4 scripts/slurm_train.sh configs/gpt_125m.toml
#
# Arguments: the config file, then any --section.key value overrides. The world size is
# nodes x GPUS_PER_NODE and dp = world / (tp · pp · cp); the trainer checks the layout before
# any process group is built and exits with code 2 naming the numbers.
# torchrun's --max-restarts relaunches every worker of the job after any failure, whatever its
# exit code (chapter 08's: 16 = relaunch to disambiguate a rerun, 17 = a result failed
# validation, 18 = a hang); each relaunch resumes from the latest checkpoint. A config error
# would fail the same way on every attempt, so the config is checked once before srun
# (`tinytron.train --check`, exit 2 and one line): it is never restarted.
# A relative config path is read from the directory sbatch was run in, else from the repository
# (`sbatch` runs a copy of this script, so the repository is found through the installed
# package); runs/ is written under the directory sbatch was run in. SIGTERM 5 minutes before the time
# limit reaches the trainer through srun and torchrun: with exit_signal_handler it finishes
# the iteration, saves and exits 0 (the next sbatch resumes). torchrun kills workers that are
# still running TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds after it passed the signal on (30 by
# default): it is raised below so that the last save fits.
#
#SBATCH --job-name=tinytron
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=TERM@300
#SBATCH --output=%x-%j.out

set -euo pipefail

CONFIG=${1:-configs/llama7b_tp2_pp2_dp64.toml}
if [ "$#" -gt 0 ]; then shift; fi
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
NNODES=${SLURM_NNODES:-1}
MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-3}

PYTHON=${PYTHON:-python3}
REPO=$("$PYTHON" -c 'import pathlib, tinytron; print(pathlib.Path(tinytron.__file__).resolve().parents[1])')
cd "${SLURM_SUBMIT_DIR:-$PWD}"
if [ ! -f "$CONFIG" ] && [ -f "$REPO/$CONFIG" ]; then CONFIG="$REPO/$CONFIG"; fi
# the trainer prints the sbatch line that resumes the run
export TINYTRON_SLURM_SCRIPT="$REPO/scripts/slurm_train.sh"
echo "tinytron: $NNODES node(s) x $GPUS_PER_NODE GPU(s), rendezvous $MASTER_ADDR:$MASTER_PORT, config $CONFIG"
WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) "$PYTHON" -m tinytron.train --check --config "$CONFIG" "$@"

# A failed NCCL collective raises instead of hanging; values the site already set win.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONUNBUFFERED=1
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}

# --kill-on-bad-exit: a node whose torchrun fails (a config error exits 2, restarts used up)
# ends the step instead of leaving the other nodes waiting in the rendezvous.
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
    torchrun \
        --nnodes "$NNODES" \
        --nproc-per-node "$GPUS_PER_NODE" \
        --rdzv-id "${SLURM_JOB_ID:-tinytron}" \
        --rdzv-backend c10d \
        --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
        --max-restarts "$MAX_RESTARTS" \
        -m tinytron.train --config "$CONFIG" "$@"
