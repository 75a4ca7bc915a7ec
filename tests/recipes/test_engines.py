"""FSDP2 and DeepSpeed on CPU processes (gloo): the test seam that lets accelerate run them there,
and what a run does when one rank's loss goes non-finite. The round trip of every recipe under
each engine is in test_round_trip.py.

accelerate switches to FSDP only from GPU/accelerator process groups, and to DeepSpeed only when
not asked for the CPU; the engines themselves run on CPU processes: torch's fully_shard over gloo,
DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu), which falls back to gloo without oneCCL.
tests/cpu_engines/sitecustomize.py lifts those two gates, and the first test here holds it to that."""

import json
import os
import sys
import time

import pytest
from conftest import (
    REPO,
    accelerate_launch,
    engine_env,
    engine_launch,
    free_port,
    glue_flags,
    run,
    run_processes,
)

from amp_recipes.training.checkpoint import complete_checkpoints, read_checkpoint, resolve_checkpoint

STATE_PROBE = """
import json, os
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
Accelerator()
state = {key: repr(value) for key, value in AcceleratorState._shared_state.items()}
partial = {key: repr(value) for key, value in PartialState._shared_state.items()}
print(json.dumps({"state": state, "partial": partial, "use_cpu": os.environ.get("ACCELERATE_USE_CPU")}))
"""


def accelerator_state(tmp_path, seam: bool, **engine) -> dict:
    """accelerate's whole state in a one-process gloo group, as the Accelerator() of a recipe sets it."""
    env = {
        **engine_env(),
        "LOCAL_RANK": "0",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        **engine,
    }
    if not seam:  # the same environment, without the seam on the path
        env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    result = run([sys.executable, "-c", STATE_PROBE], tmp_path, timeout=120, **env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
DEEPSPEED = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}


def differences(a: dict, b: dict) -> dict:
    return {
        (which, key): (a[which].get(key), b[which].get(key))
        for which in ("state", "partial")
        for key in a[which].keys() | b[which].keys()
        if a[which].get(key) != b[which].get(key)
    }


def engine_type(name: str) -> str:
    return f"<DistributedType.{name}: '{name}'>"


@pytest.mark.parametrize(
    "engine, name, plugin",
    [({}, None, None), (FSDP2, "FSDP", "fsdp_plugin"), (DEEPSPEED, "DEEPSPEED", "deepspeed_plugins")],
    ids=["no-engine", "fsdp2", "deepspeed"],
)
def test_the_seam_lifts_the_gpu_gate_and_changes_nothing_else(tmp_path, engine, name, plugin, request):
    """accelerate's whole state (AcceleratorState and PartialState, every key) with and without
    the seam: only the engine switch and its plugin differ. A seam that also changed the device,
    the backend, the process count or the precision, or left ACCELERATE_USE_CPU unset, fails here."""
    if name == "DEEPSPEED":
        request.getfixturevalue("deepspeed_built")
    plain = accelerator_state(tmp_path, seam=False, **engine)
    lifted = accelerator_state(tmp_path, seam=True, **engine)
    assert plain["use_cpu"] == lifted["use_cpu"] == "1"
    changed = differences(plain, lifted)
    if name is None:
        assert changed == {}
        return
    assert set(changed) == {("state", "distributed_type"), ("partial", "distributed_type"), ("state", plugin)}
    assert changed["state", "distributed_type"] == (engine_type("MULTI_CPU"), engine_type(name))
    assert changed["partial", "distributed_type"] == (engine_type("MULTI_CPU"), engine_type(name))
    assert changed["state", plugin][0] in (None, "None") and "Plugin(" in changed["state", plugin][1]


# ----------------------------------------------------------------------------- a NaN on one rank
SPOILER = REPO / "tests" / "recipes" / "nonfinite_on_one_rank.py"
DDP_TIMEOUT_S = 300
TWO_DDP_PROCESSES = ["--multi_gpu", "--num_processes", 2, "--num_cpu_threads_per_process", 1]
ENGINES = {"ddp": None, "fsdp2": "fsdp.yaml", "zero2": "deepspeed_zero2.yaml"}  # engine -> its config


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_nan_on_one_rank_stops_every_rank_with_one_sentence(tmp_path, engine, request):
    """Rank 1's loss turns NaN at step 3 (rank 0's stays finite; the all-reduced gradients spoil
    both models). The check before step 3's checkpoint counts non-finite losses over both ranks, so
    both stop there with the same sentence, long before --ddp_timeout: none waits in a collective
    for a peer that has left, none saves the spoiled weights, no process is left, and checkpoint-2
    is the newest complete checkpoint."""
    output_dir = tmp_path / "out"
    argv = glue_flags(
        mixed_precision="no",
        max_train_samples=64,
        per_device_train_batch_size=4,
        max_train_steps=6,
        checkpointing_steps=1,
        logging_steps=100,  # the check runs before each checkpoint, not only at log lines
        ddp_timeout=DDP_TIMEOUT_S,
        output_dir=output_dir,
    )
    recipe = [SPOILER, REPO / "recipes" / "bert_glue.py", *argv]
    if engine == "ddp":
        cmd, env = accelerate_launch(*TWO_DDP_PROCESSES, *recipe), {"ACCELERATE_USE_CPU": "1"}
    else:
        cmd, env = engine_launch(ENGINES[engine], *recipe), engine_env()
    if engine == "zero2":
        request.getfixturevalue("deepspeed_built")  # DeepSpeed's one-time compile, off the clock
    started = time.monotonic()
    result = run(
        cmd,
        tmp_path,
        timeout=DDP_TIMEOUT_S * 2,
        NONFINITE_RANK="1",
        NONFINITE_STEP="3",
        NONFINITE_REPORT_DIR=tmp_path,
        AMP_SCALE_OUT_TEST=tmp_path,
        **env,
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    sentence = (
        "error: The loss became non-finite under fp32 between steps 2 and 3; the weights are spoiled, "
        "so nothing after step 2 is saved."
    )
    assert result.stderr.count(sentence) == 1, result.stderr[-4000:]  # printed once for the launch
    # Each rank ended on that sentence, not on the launcher's SIGTERM after its peer left.
    ends = {path.name: path.read_text() for path in sorted(tmp_path.glob("rank-*.txt"))}
    assert set(ends) == {"rank-0.txt", "rank-1.txt"}, result.stderr[-4000:]
    assert all(end.startswith(sentence) for end in ends.values()), ends
    assert elapsed < DDP_TIMEOUT_S / 2, f"{elapsed:.0f} s: a rank waited for its peer"
    assert not run_processes(tmp_path)

    checkpoints = output_dir / "checkpoints"
    assert [path.name for path in complete_checkpoints(checkpoints)] == ["checkpoint-1", "checkpoint-2"]
    assert resolve_checkpoint("latest", checkpoints).name == "checkpoint-2"
    assert read_checkpoint(checkpoints / "checkpoint-2", {})["global_step"] == 2
    assert not list(checkpoints.glob("*checkpoint-3*"))  # not even a partial one
    assert not (output_dir / "model.safetensors").exists() and not (output_dir / "eval_results.json").exists()
