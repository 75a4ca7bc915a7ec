#!/usr/bin/env bash
# sbatch --nodes=2 --gres=gpu:$GPUS_PER_NODE scripts/launch_slurm.sh \
#     recipes/bert_glue.py --task_name mnli --mixed_precision fp16 --output_dir outputs/mnli
#
# Multi-node launcher for Slurm: one `accelerate launch` per node (srun, one task a node), each
# starting one process per GPU, with the node's machine rank, the first node as the main process
# and a static rendezvous (accelerate_configs/multi_node.yaml, whose EDIT fields are set here).
# Submit from the root of the checkout, with its virtualenv active: the job runs in the folder it
# was submitted from ($SLURM_SUBMIT_DIR) with the submitting shell's environment (sbatch's default
# --export=ALL), so the recipe and config paths, PATH and HF_HOME are the ones you see.
#
# Preemption and time limits: Slurm sends SIGTERM 120 s before the time limit (--signal below);
# the recipes then finish their step, write a checkpoint and exit 143, and this script requeues
# the job. A requeued job (after that, or after a preemption or a node failure: --requeue)
# resumes from the newest complete checkpoint of --output_dir (`--resume_from_checkpoint latest`),
# or starts again where no checkpoint was written yet (`--overwrite_output_dir`).
#
# Environment knobs: GPUS_PER_NODE (default: Slurm's count from --gres), MAIN_PROCESS_PORT (29500),
# ACCELERATE_CONFIG (accelerate_configs/multi_node.yaml).
#SBATCH --job-name=amp-recipes
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=slurm-%j.out
#SBATCH --signal=TERM@120
#SBATCH --requeue
# Your cluster's settings: remove one '#' to turn a line on, then edit it.
##SBATCH --partition=gpu
##SBATCH --time=24:00:00
##SBATCH --account=my-project
set -euo pipefail

if [ $# -eq 0 ]; then
    echo "usage: sbatch --nodes=N --gres=gpu:G scripts/launch_slurm.sh RECIPE [RECIPE ARGS...] --output_dir DIR" >&2
    exit 2
fi
: "${SLURM_JOB_NODELIST:?run this through sbatch (or salloc) so that Slurm sets the node list}"
cd "${SLURM_SUBMIT_DIR:-.}"

output_dir=""
previous=""
for arg in "$@"; do
    case "$arg" in
        --output_dir=*) output_dir=${arg#--output_dir=} ;;
        *) [ "$previous" = "--output_dir" ] && output_dir=$arg ;;
    esac
    previous=$arg
done
if [ -z "$output_dir" ]; then
    echo "error: pass the recipe's --output_dir: a requeued job resumes from the checkpoints in it" >&2
    exit 2
fi

nodes=${SLURM_NNODES:-1}
gpus_per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
if [ -z "$gpus_per_node" ]; then
    echo "error: no GPU count: submit with --gres=gpu:N (or set GPUS_PER_NODE)" >&2
    exit 2
fi
main_ip=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE
port=${MAIN_PROCESS_PORT:-29500}
config=${ACCELERATE_CONFIG:-accelerate_configs/multi_node.yaml}

resume=()
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
    if [ -e "$output_dir/checkpoints/latest" ]; then
        resume=(--resume_from_checkpoint latest)
    elif [ -d "$output_dir" ] && [ -n "$(ls -A "$output_dir")" ]; then
        resume=(--overwrite_output_dir)  # stopped before its first checkpoint: start again
    fi
    echo "requeued (restart ${SLURM_RESTART_COUNT}): ${resume[*]:-a fresh start}"
fi

echo "launching on $nodes node(s) x $gpus_per_node GPU(s); main process $main_ip:$port"
# SLURM_NODEID is read on each node (single quotes): it is that node's machine rank.
status=0
srun --nodes="$nodes" --ntasks-per-node=1 bash -c '
    exec accelerate launch -q --config_file "$0" \
        --num_machines "$1" --num_processes "$(($1 * $2))" --machine_rank "$SLURM_NODEID" \
        --main_process_ip "$3" --main_process_port "$4" --rdzv_backend static "${@:5}"
' "$config" "$nodes" "$gpus_per_node" "$main_ip" "$port" "$@" "${resume[@]}" || status=$?
if [ "$status" -eq 143 ]; then  # SIGTERM: the run wrote its checkpoint; continue in a new allocation
    echo "stopped by SIGTERM after a checkpoint; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" || echo "could not requeue; resubmit the same command to resume" >&2
fi
exit "$status"
