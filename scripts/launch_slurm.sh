#!/usr/bin/env bash
# sbatch --nodes=2 scripts/launch_slurm.sh recipes/bert_glue.py --task_name mnli --mixed_precision fp16
#
# Multi-node launcher for Slurm: one `accelerate launch` per node (srun, one task a node), each
# starting one process per GPU, with the node's machine rank, the first node as the main process
# and a static rendezvous (accelerate_configs/multi_node.yaml, whose EDIT fields are set here).
# Environment knobs: GPUS_PER_NODE (default: Slurm's count, else 8), MAIN_PROCESS_PORT (29500),
# ACCELERATE_CONFIG (accelerate_configs/multi_node.yaml).
#SBATCH --job-name=amp-recipes
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --output=slurm-%j.out
set -euo pipefail

if [ $# -eq 0 ]; then
    echo "usage: sbatch scripts/launch_slurm.sh RECIPE [RECIPE ARGS...]" >&2
    exit 2
fi
: "${SLURM_JOB_NODELIST:?run this through sbatch (or salloc) so that Slurm sets the node list}"

nodes=${SLURM_NNODES:-1}
gpus_per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
main_ip=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE
port=${MAIN_PROCESS_PORT:-29500}
config=${ACCELERATE_CONFIG:-accelerate_configs/multi_node.yaml}

echo "launching on $nodes node(s) x $gpus_per_node GPU(s); main process $main_ip:$port"
# SLURM_NODEID is read on each node (single quotes): it is that node's machine rank.
srun --nodes="$nodes" --ntasks-per-node=1 bash -c '
    exec accelerate launch --config_file "$0" \
        --num_machines "$1" --num_processes "$(($1 * $2))" --machine_rank "$SLURM_NODEID" \
        --main_process_ip "$3" --main_process_port "$4" --rdzv_backend static "${@:5}"
' "$config" "$nodes" "$gpus_per_node" "$main_ip" "$port" "$@"
