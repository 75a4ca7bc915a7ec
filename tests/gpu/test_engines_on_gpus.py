"""recipes/bert_glue.py on two CUDA GPUs under accelerate's engines, over NCCL (skipped with fewer).

The same behaviours tests/recipes proves on CPU processes over gloo (through its seams), here on
the path they were written for: DDP's fp16 skips an overflowed step on every rank alike; FSDP2's
fp16 starts without an overflow, grows its scale and resumes to the same steps; ZeRO-2's loss
scaler takes the recipe's --fp16_* flags; a rank killed mid-run ends every rank, in one sentence,
with the checkpoints intact, and the run resumes. Each launch uses the repository's engine configs
as they are, on two of this machine's GPUs.
"""

import json
import math
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from accelerate.test_utils import require_multi_gpu
from accelerate.test_utils.testing import require_deepspeed
from conftest import (
    RECIPES,
    REPO,
    accelerate_launch,
    assert_checkpoints_intact,
    glue_flags,
    log_history,
    run,
    run_processes,
    start_launch,
    torch_like,
    wait_for_checkpoint,
    wait_gone,
)

GLUE = RECIPES / "bert_glue.py"
CONFIGS = REPO / "accelerate_configs"
TWO_GPUS = ["--num_processes", 2]
pytestmark = pytest.mark.usefixtures("no_process_left_behind")
SMALL = glue_flags(max_train_samples=64, per_device_train_batch_size=4, logging_steps=1, learning_rate=1e-3)


def launch(tmp_path, *args, **env):
    """A launch to its end, its processes tagged for no_process_left_behind; the suite's
    pytest-timeout bounds it. HF_HOME of its own: the machine's default accelerate config (under
    HF_HOME) stays out, the launch takes only the config file it names."""
    env = {"AMP_SCALE_OUT_TEST": tmp_path, "HF_HOME": tmp_path / "hf-home", **env}
    result = run(accelerate_launch(*args), tmp_path, timeout=None, **env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def rank_process(tag, rank: int) -> int:
    """The pid of the launch's rank `rank` itself (its parent is the launcher), not one of its
    DataLoader workers, which inherit its environment."""
    ranks = run_processes(tag)
    launchers = {pid for pid, found in ranks.items() if found == -1}
    parent = {pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1]) for pid in ranks}
    return next(pid for pid, found in ranks.items() if found == rank and parent[pid] in launchers)


def steps(output_dir) -> list[tuple]:
    return [
        (row["step"], row["loss_scale"], row["skipped_steps"])
        for row in log_history(output_dir)
        if "loss" in row
    ]


def losses(output_dir) -> list[float]:
    return [row["loss"] for row in log_history(output_dir) if "loss" in row]


@require_multi_gpu
def test_ddp_fp16_skips_an_overflowed_step_on_every_rank(tmp_path):
    """A scale of 10**8 that backs off 100-fold: steps 1 and 2 overflow on both ranks (NCCL's
    all-reduced gradients), each is skipped with the schedule held and replayed to name where it
    overflowed; the rest train."""
    output_dir = tmp_path / "out"
    result = launch(
        tmp_path, "--config_file", CONFIGS / "multi_gpu.yaml", *TWO_GPUS, GLUE, *SMALL, "--max_train_steps", 6,
        "--fp16_init_scale", 1e8, "--fp16_backoff_factor", 0.01, "--output_dir", output_dir,
    )  # fmt: skip
    saved = json.loads((output_dir / "eval_results.json").read_text())
    assert (saved["distributed_type"], saved["num_processes"], saved["precision_in_effect"]) == (
        "MULTI_GPU", 2, "fp16"
    )  # fmt: skip
    assert result.stderr.count("fp16 overflow, optimizer step skipped") == 2, result.stderr[-3000:]
    assert "first non-finite value: gradient at the output of" in result.stderr
    assert [skipped for _, _, skipped in steps(output_dir)] == [1, 2, 2, 2, 2, 2]
    rates = [row["learning_rate"] for row in log_history(output_dir) if "loss" in row]
    assert rates[0] == rates[1] != rates[2]  # the schedule held on both skipped steps, then moved
    assert all(math.isfinite(loss) for loss in losses(output_dir))


@require_multi_gpu
def test_fsdp2_fp16_grows_its_scale_and_resumes_to_the_same_steps(tmp_path):
    """fsdp.yaml's own fp16 from a scale of 32768 that doubles after 4 steps without overflow: no
    first-step overflow (the loss reaches backward in fp32), 65536 after step 4 and 131072 after
    step 8, logged but never used (at 131072 a gradient of 0.5 would overflow fp16 and make the
    sequence depend on the batch). Resumed from checkpoint-4, whose scaler has just grown: steps
    5-8 log the same scales and skips, and the same losses to
    within GPU kernels' run-to-run rounding (non-deterministic atomics; on CPU,
    tests/recipes/test_engine_fp16.py asserts losses and weights bit for bit)."""
    fp16 = ["--fp16_init_scale", 32768, "--fp16_growth_interval", 4, "--max_train_steps", 8]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    fsdp = ["--config_file", CONFIGS / "fsdp.yaml", *TWO_GPUS, GLUE, *SMALL, *fp16]
    launch(tmp_path, *fsdp, "--checkpointing_steps", 4, "--output_dir", full)
    saved = json.loads((full / "eval_results.json").read_text())
    assert (saved["distributed_type"], saved["precision_in_effect"]) == ("FSDP", "fp16")
    assert steps(full) == [
        (1, 32768, 0), (2, 32768, 0), (3, 32768, 0), (4, 65536, 0), (5, 65536, 0), (6, 65536, 0), (7, 65536, 0), (8, 131072, 0)
    ]  # fmt: skip
    checkpoint = full / "checkpoints" / "checkpoint-4"
    launch(tmp_path, *fsdp, "--resume_from_checkpoint", checkpoint, "--output_dir", resumed)
    assert steps(resumed) == steps(full)[4:]
    torch.testing.assert_close(losses(resumed), losses(full)[4:], rtol=1e-2, atol=1e-3)


@require_multi_gpu
@require_deepspeed
def test_zero2_fp16_loss_scaler_follows_the_recipes_flags(tmp_path):
    """--fp16_init_scale 1024 --fp16_growth_interval 3 in DeepSpeed's own scaler
    (tests/gpu/deepspeed_loss_scale.py reads engine.optimizer.loss_scale after every step), with
    an overflow injected at step 2: halved there, doubled on the 4th clean step after it, then
    every 3 — DeepSpeed's DynamicLossScaler (one clean step later than torch's GradScaler), the
    rule the ZeRO configs state and tests/recipes checks through DeepSpeed's own scaler on a CPU."""
    report = tmp_path / "scales.json"
    launch(
        tmp_path, "--config_file", CONFIGS / "deepspeed_zero2.yaml", *TWO_GPUS, REPO / "tests" / "gpu" / "deepspeed_loss_scale.py",
        GLUE, *SMALL, "--max_train_steps", 9, "--fp16_init_scale", 1024, "--fp16_growth_interval", 3,
        "--output_dir", tmp_path / "out",
        LOSS_SCALE_REPORT=report, OVERFLOW_STEPS="2",
    )  # fmt: skip
    assert json.loads(report.read_text()) == torch_like(1024, 3, ".O.......")
    saved = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert (saved["distributed_type"], saved["precision_in_effect"]) == ("DEEPSPEED", "fp16")


@require_multi_gpu
def test_a_rank_killed_mid_run_ends_every_rank_in_one_sentence_and_the_run_resumes(tmp_path):
    """SIGKILL to rank 1 after checkpoint-10: rank 0, in or about to enter an NCCL collective
    with it, ends within seconds (the peer watch, or NCCL's own error) with one sentence for the
    launch; no process is left, every checkpoint is complete, and the run resumes to the end."""
    output_dir = tmp_path / "out"
    training = glue_flags(
        max_train_samples=2000, per_device_train_batch_size=4, num_train_epochs=1, checkpointing_steps=5
    )
    cmd = accelerate_launch("--multi_gpu", *TWO_GPUS, GLUE, *training, "--output_dir", output_dir)
    process = start_launch(cmd, tmp_path, HF_HOME=tmp_path / "hf-home")
    wait_for_checkpoint(process, output_dir / "checkpoints", "checkpoint-10", or_later=True)
    os.kill(rank_process(tmp_path, 1), signal.SIGKILL)
    killed_at = time.monotonic()
    output, _ = process.communicate(timeout=120)
    ended_after = time.monotonic() - killed_at
    assert process.returncode != 0 and ended_after < 60, output[-3000:]
    wait_gone(tmp_path, timeout=10)
    # Found anywhere in a line: rank 0's progress bar, never closed, may hold the sentence's line.
    sentences = re.findall(r"error: [^\r\n]*", output)
    assert len(sentences) == 1 and "--resume_from_checkpoint latest" in sentences[0], output[-3000:]
    latest = assert_checkpoints_intact(output_dir / "checkpoints", at_least=10)

    resumed = start_launch(
        [*cmd, "--resume_from_checkpoint", "latest"], tmp_path, HF_HOME=tmp_path / "hf-home"
    )
    resumed_output, _ = resumed.communicate()  # bounded by the suite's pytest-timeout
    assert resumed.returncode == 0, resumed_output[-3000:]
    assert f"{latest} at step {latest.split('-')[1]}" in resumed_output
    assert (output_dir / "eval_results.json").is_file()
