"""scripts/launch_slurm.sh with faked Slurm variables and stub srun / scontrol / accelerate."""

import os
import stat
import subprocess

from conftest import REPO

SCRIPT = REPO / "scripts" / "launch_slurm.sh"


def stub(folder, name, body):
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_bash_syntax():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0


def test_one_launch_per_node_with_its_rank(tmp_path):
    stub(tmp_path, "scontrol", 'printf "gpu-node-07\\ngpu-node-08\\n"\n')
    # srun: run the command once per node, as Slurm would, with that node's SLURM_NODEID.
    stub(tmp_path, "srun", 'shift 2\nfor id in 0 1; do SLURM_NODEID=$id "$@"; done\n')
    stub(tmp_path, "accelerate", 'echo "node $SLURM_NODEID: accelerate $*" >> "$LAUNCH_LOG"\n')
    log = tmp_path / "launches.txt"
    env = {
        **os.environ,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "LAUNCH_LOG": str(log),
        "SLURM_JOB_NODELIST": "gpu-node-[07-08]",
        "SLURM_NNODES": "2",
        "SLURM_GPUS_ON_NODE": "4",
        "MAIN_PROCESS_PORT": "29611",
    }
    result = subprocess.run(
        ["bash", SCRIPT, "recipes/bert_glue.py", "--task_name", "mnli", "--run_name", "a b"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "launching on 2 node(s) x 4 GPU(s); main process gpu-node-07:29611" in result.stdout
    common = (
        "--num_machines 2 --num_processes 8 --machine_rank {rank} --main_process_ip gpu-node-07 "
        "--main_process_port 29611 --rdzv_backend static recipes/bert_glue.py --task_name mnli --run_name a b"
    )
    assert log.read_text().splitlines() == [
        f"node {rank}: accelerate launch --config_file accelerate_configs/multi_node.yaml "
        + common.format(rank=rank)
        for rank in (0, 1)
    ]


def test_refuses_to_run_outside_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        ["bash", SCRIPT, "recipes/bert_glue.py"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode != 0 and "run this through sbatch" in result.stderr
