"""Scale-out for real, on CPU (gloo): two machines through scripts/launch_slurm.sh's own launch
line, a rank killed mid-epoch (SIGKILL), a rank that hangs (SIGSTOP) against --ddp_timeout.

Every process of a run carries AMP_SCALE_OUT_TEST=<the test's folder> in its environment, so the
test finds its ranks (RANK=...) and checks that none is left when the launch has ended."""

import contextlib
import json
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import accelerate
import pytest
import torch
from conftest import (
    RECIPES,
    REPO,
    accelerate_launch,
    assert_checkpoints_intact,
    free_port,
    glue_flags,
    run_processes,
    start_launch,
    wait_for_checkpoint,
    wait_gone,
)
from packaging.version import Version
from safetensors.torch import load_file

from amp_recipes.training.outputs import LOCK

# Many processes: CI runs this file in a lane of its own (.ci/run).
pytestmark = [pytest.mark.heavy, pytest.mark.usefixtures("no_process_left_behind")]

CPU_GROUP = {"ACCELERATE_USE_CPU": "1"}  # one gloo process group on a machine without GPUs
# 240 MRPC pairs in batches of 4 per process: 30 optimizer steps, a checkpoint every 5; all of
# MRPC's 408 dev pairs scored.
TRAINING = [
    RECIPES / "bert_glue.py",
    *glue_flags(
        mixed_precision="no",
        max_train_samples=240,
        max_eval_samples=408,
        per_device_train_batch_size=4,
        num_train_epochs=1,
        checkpointing_steps=5,
        seed=3,
    ),
]
# The launcher's grace between its SIGTERM and its SIGKILL to the ranks still running
# (torch.distributed.elastic's agent: 30 s; from torch 2.13 LaunchConfig.shutdown_timeout).
LAUNCHER_GRACE_S = 30


def two_processes(port):
    return [
        "--multi_gpu",
        "--num_processes",
        2,
        "--num_cpu_threads_per_process",
        1,
        "--main_process_port",
        port,
    ]


def start(cmd, tmp_path, **env):
    return start_launch(cmd, tmp_path, **CPU_GROUP, **env)


def final_weights(output_dir: Path) -> dict:
    return load_file(str(output_dir / "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 2-process run that no one interrupts: the final weights the others must reach."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    cmd = accelerate_launch(*two_processes(free_port()), *TRAINING, "--output_dir", tmp_path / "out")
    process = start(cmd, tmp_path)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-3000:]
    return tmp_path / "out"


# ----------------------------------------------------------------------------- two machines
def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


class LockWatcher(threading.Thread):
    """Reads the output folder's lock every few milliseconds: which processes ever held it, and
    their global rank (read from the holder's environment while it runs)."""

    def __init__(self, output_dir: Path):
        super().__init__(daemon=True)
        self.lock, self.holders, self.running = output_dir / LOCK, {}, True

    def run(self):
        while self.running:
            try:
                pid = json.loads(self.lock.read_text())["pid"]
            except (OSError, ValueError, KeyError):
                pid = None
            if pid is not None and pid not in self.holders:
                try:
                    environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
                    self.holders[pid] = next(int(v[5:]) for v in environ if v.startswith(b"RANK="))
                except (OSError, StopIteration):
                    self.holders[pid] = None
            time.sleep(0.005)


def test_two_machines_from_the_slurm_launcher_equal_one_machine_with_two_processes(uninterrupted, tmp_path):
    """Two "nodes" on 127.0.0.1, one process each: scripts/launch_slurm.sh's own srun line, run by
    a stub srun that starts the task once per node, concurrently, as Slurm does; against the same
    run on one machine with two processes (`uninterrupted`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir, "scontrol", 'printf "127.0.0.1\\n127.0.0.1\\n"\n')  # the job's two hosts
    stub(
        bin_dir,
        "srun",
        "shift 2  # --nodes=2 --ntasks-per-node=1\npids=()\n"
        'for id in 0 1; do SLURM_NODEID=$id "$@" & pids+=($!); done\n'
        'status=0\nfor pid in "${pids[@]}"; do wait "$pid" || status=$?; done\nexit $status\n',
    )
    port = free_port()
    shared = tmp_path / "shared-fs" / "out"  # both machines write to the same folder
    recipe_args = [*TRAINING, "--output_dir", shared]
    slurm = {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",  # accelerate: this Python's
        "SLURM_JOB_NODELIST": "node-[1-2]",
        "SLURM_NNODES": "2",
        "GPUS_PER_NODE": "1",
        "MAIN_PROCESS_PORT": str(port),
    }
    watcher = LockWatcher(shared)
    watcher.start()
    try:
        process = start(["bash", REPO / "scripts" / "launch_slurm.sh", *recipe_args], tmp_path, **slurm)
        output, _ = process.communicate(timeout=600)
    finally:
        watcher.running = False
        watcher.join()
    assert process.returncode == 0, output[-4000:]
    assert f"launching on 2 node(s) x 1 GPU(s); main process 127.0.0.1:{port}" in output

    one_machine = uninterrupted
    two = json.loads((shared / "eval_results.json").read_text())
    one = json.loads((one_machine / "eval_results.json").read_text())
    assert (two["distributed_type"], two["num_processes"], two["total_train_batch_size"]) == (
        "MULTI_CPU",
        2,
        8,
    )
    assert two["eval_samples"] == 408  # every dev pair scored once
    assert {k: v for k, v in two.items() if k.startswith("eval_")} == {
        k: v for k, v in one.items() if k.startswith("eval_")
    }
    assert_same_weights(final_weights(shared), final_weights(one_machine))
    # One writer: global rank 0 (machine 1's process is rank 1 and logs nothing of its own).
    assert output.count("Saved model and eval_results.json") == 1
    assert "[RANK 1]" not in output
    assert list(watcher.holders.values()) == [0], watcher.holders  # one lock holder ever: global rank 0
    assert not (shared / LOCK).exists()
    assert not any(shared.glob(f"{LOCK}.*")) and not (shared / ".final.tmp").exists()


# ----------------------------------------------------------------------------- a dying rank
@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0-lock-holder"])
def test_a_rank_killed_mid_epoch_ends_the_launch_and_the_run_resumes(victim, uninterrupted, tmp_path):
    """SIGKILL to one rank mid-epoch: the launch ends within a minute, every checkpoint intact.
    Rank 1 killed: rank 0 says so in one sentence and releases the lock. Rank 0 (the lock's holder)
    killed: its lock stays, naming a dead PID, and the resumed run removes it, continues from the
    last checkpoint and ends with the uninterrupted run's weights."""
    output_dir = tmp_path / "out"
    launch = accelerate_launch(*two_processes(free_port()), *TRAINING, "--output_dir", output_dir)
    process = start(launch, tmp_path)
    wait_for_checkpoint(process, output_dir / "checkpoints", "checkpoint-10")  # step 10 of 30
    pid = next(pid for pid, rank in run_processes(tmp_path).items() if rank == victim)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    output, _ = process.communicate(timeout=120)
    ended_after = time.monotonic() - killed_at
    print(f"the launch ended {ended_after:.1f} s after SIGKILL to rank {victim}")
    assert process.returncode != 0 and ended_after < 60, output[-3000:]
    wait_gone(tmp_path, timeout=10)
    assert not (output_dir / "eval_results.json").exists()  # killed mid-run, not after it
    latest = assert_checkpoints_intact(output_dir / "checkpoints", at_least=10)
    # The lock stays only where its holder (rank 0) was killed; then it names a PID no longer running.
    # Rank 1 killed: rank 0 sees its peer die in the next collective, says so in one sentence and
    # releases the lock, whenever the launcher's SIGTERM reaches it (its handler only notes that).
    stale_pid = json.loads((output_dir / LOCK).read_text())["pid"] if (output_dir / LOCK).exists() else None
    if victim == 0:
        assert stale_pid == pid
    else:
        assert stale_pid is None
        assert "error: rank 0 of 2 lost its connection to rank 1: that process died" in output, output[-3000:]
        return  # resuming a checkpoint left by a killed launch: rank 0's case, with its stale lock

    resumed = start([*launch, "--resume_from_checkpoint", "latest"], tmp_path)
    resumed_output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, resumed_output[-3000:]
    assert f"{latest} at step {latest.split('-')[1]}" in resumed_output
    stale = f"Removing the stale lock {output_dir / LOCK}: PID {stale_pid}"
    assert (stale in resumed_output) == (stale_pid is not None)
    assert_same_weights(final_weights(output_dir), final_weights(uninterrupted))
    assert not (output_dir / LOCK).exists()


@pytest.mark.parametrize("processes", [1, 2], ids=["one-process", "two-processes"])
def test_a_signal_to_the_whole_launch_checkpoints_and_the_run_resumes(processes, uninterrupted, tmp_path):
    """SIGTERM to the launch's process group, as `kill -- -PGID` (and Ctrl-C, as SIGINT) send it.
    One process: the signal reaches the run, its DataLoader workers and the launcher, which passes
    it on to all of them at once (accelerate >= 1.16) and kills them 5 s later; the run must not
    take that relay for a second signal, nor lose a worker to it. Two processes: torchrun's workers
    have sessions of their own, which its agent signals. Either way the run stops after a step
    with one checkpoint of it, 143, leaves no process behind, and resumes."""
    output_dir = tmp_path / "out"
    workers = ["--dataloader_num_workers", 2]  # the default on CUDA
    if processes == 2:
        launch = accelerate_launch(*two_processes(free_port()), *TRAINING, *workers)
    else:  # the same 8 samples per optimizer step, in one process
        layout = ["--num_processes", 1, "--num_cpu_threads_per_process", 1]
        launch = accelerate_launch(*layout, *TRAINING, *workers, "--per_device_train_batch_size", 8)
    launch += ["--output_dir", output_dir]
    process = start(launch, tmp_path, own_session=True)  # the test signals its process group
    wait_for_checkpoint(process, output_dir / "checkpoints", "checkpoint-5")  # step 5 of 30
    os.killpg(process.pid, signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    # accelerate 1.15's launchers do not pass the signal's code on: its one-process launcher dies
    # of the signal itself, its torchrun launcher raises.
    relaying = Version(accelerate.__version__) >= Version("1.16")
    assert process.returncode == (143 if relaying else -signal.SIGTERM if processes == 1 else 1), output[
        -3000:
    ]
    wait_gone(tmp_path, timeout=10)
    latest = assert_checkpoints_intact(output_dir / "checkpoints", at_least=5)
    stopped_at = output_dir / "checkpoints" / latest
    # Through accelerate >= 1.16's one-process launcher a line of the run can go missing: seen about
    # 1 run in 10 here (an earlier "Saved checkpoint" line) and in CI's run of stop 72 (the "Stopped
    # by" sentence), the checkpoint whole, 143. The likely cause, read in its source (not
    # reproduced): it copies the run's stderr chunk by chunk (commands/launch.py, _run_subprocess:
    # `while chunk := read1(...)`, then write), and its SIGTERM handler raises SystemExit wherever
    # that copy is, so a chunk read but not yet written is dropped. A line may be missing there,
    # never wrong; torchrun's ranks write to the terminal themselves.
    lossy = processes == 1 and relaying
    stop = f"Stopped by SIGTERM after step {latest.split('-')[1]}; checkpoint {stopped_at}. Continue with"
    # The sentence names the checkpoint it stopped with, and that checkpoint was written once (step
    # 10 of 2 processes is a --checkpointing_steps one): accelerate's line at the start of each save.
    assert stop in output or (lossy and "Stopped by" not in output), output[-3000:]
    saves = output.count(f"Saving current state to {stopped_at.parent / ('.tmp-' + latest)}\n")
    assert saves == 1 or (lossy and saves == 0), output[-3000:]
    assert not (output_dir / "eval_results.json").exists()

    resumed = start([*launch, "--resume_from_checkpoint", "latest"], tmp_path)
    resumed_output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, resumed_output[-3000:]
    assert f"{latest} at step {latest.split('-')[1]}" in resumed_output
    assert json.loads((output_dir / "eval_results.json").read_text())["train_steps"] == 30
    if processes == 2:
        assert_same_weights(final_weights(output_dir), final_weights(uninterrupted))


def test_a_hung_rank_ends_the_run_after_the_ddp_timeout(tmp_path):
    timeout_s = 10
    output_dir = tmp_path / "out"
    launch = accelerate_launch(
        *two_processes(free_port()), *TRAINING, "--ddp_timeout", timeout_s, "--output_dir", output_dir
    )
    process = start(launch, tmp_path)
    wait_for_checkpoint(process, output_dir / "checkpoints", "checkpoint-10")
    pid = next(pid for pid, rank in run_processes(tmp_path).items() if rank == 1)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        for leftover in run_processes(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(leftover, signal.SIGCONT)
    ended_after = time.monotonic() - stopped_at
    print(f"the launch ended {ended_after:.1f} s after SIGSTOP to rank 1 (--ddp_timeout {timeout_s})")
    # Rank 0 gives up after the timeout; the launcher's SIGTERM cannot reach a stopped process,
    # its SIGKILL does, LAUNCHER_GRACE_S later.
    assert process.returncode != 0, output[-3000:]
    assert timeout_s <= ended_after < timeout_s + LAUNCHER_GRACE_S + 20, output[-3000:]
    assert (
        f"error: rank 0 of 2 waited {timeout_s} s (--ddp_timeout) for rank 1 in a collective operation"
        in output
    )
    wait_gone(tmp_path, timeout=10)
    assert_checkpoints_intact(output_dir / "checkpoints", at_least=10)
    assert not (output_dir / LOCK).exists()  # rank 0 ended in order and released it


# ----------------------------------------------------------------------------- a collective that never ends
BLOCKED = REPO / "tests" / "recipes" / "blocked_in_a_collective.py"


@pytest.mark.parametrize("peer_end", ["sigkill", "error"])
def test_a_rank_waiting_for_a_dead_peer_ends_within_seconds_with_one_sentence(peer_end, tmp_path):
    """Rank 0 waits at step 7 in a call that never returns, as NCCL's collectives wait for a peer
    that is gone (gloo's fail at once instead), and rank 1 ends there: killed (SIGKILL), or with an
    error of its own. The launcher's SIGTERM reaches rank 0, whose handler can only note it; its peer
    watch (amp_recipes.training.peers) ends it within seconds, with one sentence, and writes no checkpoint
    of the step it was blocked in. Without the watch the launcher's SIGKILL ends rank 0
    LAUNCHER_GRACE_S later, silently, its lock left behind."""
    output_dir = tmp_path / "out"
    launch = accelerate_launch(*two_processes(free_port()), BLOCKED, *TRAINING, "--output_dir", output_dir)
    report = tmp_path / "peer-ended-at"
    blocked = {
        "BLOCK_RANK": "0",
        "PEER_RANK": "1",
        "BLOCK_STEP": "7",
        "PEER_END": peer_end,
        "BLOCK_REPORT": report,
    }
    process = start(launch, tmp_path, **blocked)
    output, _ = process.communicate(timeout=300)
    ended_after = time.time() - float(report.read_text())
    print(f"the launch ended {ended_after:.1f} s after rank 1 ended ({peer_end})")
    wait_gone(tmp_path, timeout=10)
    assert process.returncode != 0, output[-3000:]
    assert ended_after < LAUNCHER_GRACE_S / 2, output[-3000:]
    died = "error: rank 1 of 2 (pid "
    failed = "error: another of the 2 ranks failed with an error of its own"
    assert output.count(died if peer_end == "sigkill" else failed) == 1, output[-3000:]
    assert (failed if peer_end == "sigkill" else died) not in output
    assert assert_checkpoints_intact(output_dir / "checkpoints", at_least=5) == "checkpoint-5"
    assert not (output_dir / LOCK).exists()  # released by the watch before it ended rank 0
    if peer_end == "sigkill":
        assert "ended without an error of its own" in output, output[-3000:]


LINGERS = REPO / "tests" / "recipes" / "rank0_lingers.py"


def test_a_rank_still_working_after_its_peer_finished_is_not_told_the_peer_died(tmp_path):
    """Rank 1 finishes and its process ends while rank 0, past the last collective, still works
    with its peer watch running: rank 1 said it finished, so the watch lets rank 0 end its run."""
    output_dir = tmp_path / "out"
    report = tmp_path / "lingered"
    launch = accelerate_launch(*two_processes(free_port()), LINGERS, *TRAINING, "--output_dir", output_dir)
    process = start(launch, tmp_path, LINGER_REPORT=report)
    output, _ = process.communicate(timeout=300)
    wait_gone(tmp_path, timeout=10)
    assert process.returncode == 0, output[-3000:]
    assert report.read_text() == "rank 1 gone: True; watch running: True"
    assert "error:" not in output, output[-3000:]
    assert (output_dir / "eval_results.json").is_file()
