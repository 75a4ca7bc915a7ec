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


def slurm(tmp_path, *recipe_args, srun_exit=0, **variables):
    """The script as an sbatch job would run it: stub scontrol (node names; `requeue` logged),
    srun (the command once per node, with that node's SLURM_NODEID, then `srun_exit`) and
    accelerate (its arguments logged)."""
    stub(
        tmp_path,
        "scontrol",
        'if [ "$1" = requeue ]; then echo "requeue $2" >> "$LAUNCH_LOG"; else printf "gpu-node-07\\ngpu-node-08\\n"; fi\n',
    )
    stub(tmp_path, "srun", f'shift 2\nfor id in 0 1; do SLURM_NODEID=$id "$@"; done\nexit {srun_exit}\n')
    stub(tmp_path, "accelerate", 'echo "node $SLURM_NODEID: accelerate $*" >> "$LAUNCH_LOG"\n')
    log = tmp_path / "launches.txt"
    log.unlink(missing_ok=True)  # this job's launches only
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "LAUNCH_LOG": str(log),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-node-[07-08]",
        "SLURM_NNODES": "2",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_SUBMIT_DIR": str(REPO),
        "MAIN_PROCESS_PORT": "29611",
        **variables,
    }
    result = subprocess.run(
        ["bash", SCRIPT, *recipe_args], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    return result, log.read_text().splitlines() if log.exists() else []


COMMON = (
    "--num_machines 2 --num_processes 8 --machine_rank {rank} --main_process_ip gpu-node-07 "
    "--main_process_port 29611 --rdzv_backend static recipes/bert_glue.py --task_name mnli --run_name a b "
    "--output_dir {out}"
)


def test_one_launch_per_node_with_its_rank(tmp_path):
    out = tmp_path / "mnli"
    args = ["recipes/bert_glue.py", "--task_name", "mnli", "--run_name", "a b", "--output_dir", str(out)]
    result, launches = slurm(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert "launching on 2 node(s) x 4 GPU(s); main process gpu-node-07:29611" in result.stdout
    assert launches == [
        f"node {rank}: accelerate launch -q --config_file accelerate_configs/multi_node.yaml "
        + COMMON.format(rank=rank, out=out)
        for rank in (0, 1)
    ]


def test_sigterm_requeues_and_the_requeued_job_resumes_from_its_checkpoint(tmp_path):
    """--signal=TERM@120: the recipes checkpoint and exit 143, and the job requeues itself; a
    requeued job (SLURM_RESTART_COUNT) resumes from `latest`, or starts again if the first
    allocation ended before any checkpoint (its output folder holds only logs)."""
    script = SCRIPT.read_text()
    assert "#SBATCH --signal=TERM@120\n" in script and "#SBATCH --requeue\n" in script
    out = tmp_path / "mnli"
    args = ["recipes/bert_glue.py", "--task_name", "mnli", "--run_name", "a b", "--output_dir", str(out)]
    result, launches = slurm(tmp_path, *args, srun_exit=143)
    assert result.returncode == 143 and launches[-1] == "requeue 4242"
    assert "requeueing job 4242" in result.stdout

    out.mkdir()
    (out / "log_history.jsonl").write_text("{}\n")  # stopped before its first checkpoint
    result, launches = slurm(tmp_path, *args, SLURM_RESTART_COUNT="1")
    assert result.returncode == 0, result.stderr
    assert all(line.endswith(f"--output_dir {out} --overwrite_output_dir") for line in launches), launches

    (out / "checkpoints" / "checkpoint-500").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("checkpoint-500\n")
    result, launches = slurm(tmp_path, *args, SLURM_RESTART_COUNT="2")
    assert "requeued (restart 2): --resume_from_checkpoint latest" in result.stdout
    assert launches == [
        f"node {rank}: accelerate launch -q --config_file accelerate_configs/multi_node.yaml "
        + COMMON.format(rank=rank, out=out)
        + " --resume_from_checkpoint latest"
        for rank in (0, 1)
    ]


def test_refuses_without_an_output_dir_or_a_gpu_count(tmp_path):
    result, launches = slurm(tmp_path, "recipes/bert_glue.py", "--task_name", "mnli")
    assert result.returncode == 2 and not launches
    assert "error: pass the recipe's --output_dir" in result.stderr
    result, launches = slurm(tmp_path, "recipes/bert_glue.py", "--output_dir=x", SLURM_GPUS_ON_NODE="")
    assert result.returncode == 2 and "submit with --gres=gpu:N" in result.stderr and not launches


def test_refuses_to_run_outside_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        ["bash", SCRIPT, "recipes/bert_glue.py"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode != 0 and "run this through sbatch" in result.stderr
