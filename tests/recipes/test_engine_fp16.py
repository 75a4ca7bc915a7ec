"""fp16 and gradient accumulation under each engine, as a GPU run goes through them (issue #63).

DDP and FSDP2 run here on two CPU processes over gloo with accelerate's real fp16 path:
tests/fp16_on_cpu does, after Accelerator.__init__, what accelerate does for fp16 off the CPU
(autocast, its GradScaler with the recipe's --fp16_* settings), and nothing else. DeepSpeed's fp16
does not run on a CPU ("Type fp16 is not supported on your device"): what the recipe hands it is
read back through DeepSpeed's own config parser and loss scaler, in a one-process DeepSpeed launch.
Gradient accumulation under ZeRO-2 runs on two CPU processes in bf16.

Each test fails without its fix:
- FSDP2 + fp16 computed the loss in fp16 (accelerate's FSDP2 path casts the weights and does not
  autocast; 1.15 also cast the outputs back to fp16): the scale 65536 became inf in backward, so
  every step at that scale overflowed and the scale never stayed above 32768;
- resuming FSDP2 + fp16 under accelerate 1.15 stepped the GradScaler once more (its optimizer load
  steps the wrapped optimizer): the resumed scale grew a step early (CI's floor stage runs it);
- the overflow replay under FSDP2 left unsharded gradients behind (no_sync), which the next step
  added in, and on every engine it drew dropout masks from training's random stream;
- deepspeed_zero2/3.yaml's `gradient_accumulation_steps: 1` overrode --gradient_accumulation_steps;
- the --fp16_* flags never reached DeepSpeed's loss scaler (2**16, a window of 1000, hysteresis 2)."""

import json
import math
import os
import sys

import pytest
import torch
from conftest import (
    REPO,
    accelerate_launch,
    engine_env,
    engine_launch,
    free_port,
    glue_flags,
    log_history,
    run,
    torch_like,
)
from safetensors.torch import load_file

from amp_recipes.training.checkpoint import read_checkpoint

FP16_ON_CPU = REPO / "tests" / "fp16_on_cpu"  # on a launch's PYTHONPATH: accelerate's fp16 path on a CPU
WITHOUT_REPLAY = REPO / "tests" / "recipes" / "without_overflow_replay.py"
GLUE = REPO / "recipes" / "bert_glue.py"
TWO_DDP_PROCESSES = ["--multi_gpu", "--num_processes", 2, "--num_cpu_threads_per_process", 1]
SMALL = {"max_train_samples": 64, "per_device_train_batch_size": 4, "logging_steps": 1, "learning_rate": 1e-3}


def fp16_launch(engine: str, tmp_path, argv, wrapper=None):
    """A two-process fp16 run of bert_glue.py: `fsdp2` with accelerate_configs/fsdp.yaml as it is
    (its mixed_precision is fp16), `ddp` with --mixed_precision fp16."""
    recipe = [*([wrapper] if wrapper else []), GLUE, *argv]
    if engine == "fsdp2":
        cmd, env = engine_launch("fsdp.yaml", *recipe), engine_env(FP16_ON_CPU)
    else:
        cmd = accelerate_launch(*TWO_DDP_PROCESSES, *recipe, "--mixed_precision", "fp16")
        env = {
            "ACCELERATE_USE_CPU": "1",
            "PYTHONPATH": os.pathsep.join([str(FP16_ON_CPU), os.environ.get("PYTHONPATH", "")]),
        }
    result = run(cmd, tmp_path, **env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def steps(output_dir) -> list[tuple]:
    return [
        (row["step"], row["loss_scale"], row["skipped_steps"], row["loss"])
        for row in log_history(output_dir)
        if "loss" in row
    ]


def same_weights(a, b) -> bool:
    weights_a, weights_b = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return weights_a.keys() == weights_b.keys() and all(
        torch.equal(weights_a[k], weights_b[k]) for k in weights_a
    )


# ----------------------------------------------------------------------------- FSDP2 + fp16
@pytest.mark.slow
def test_fsdp2_fp16_loss_reaches_backward_in_fp32_and_resumes_exactly(tmp_path):
    """fsdp.yaml's own fp16 from a scale of 32768 that doubles after 3 steps without overflow, as
    torch's GradScaler does: 65536 after step 3, 131072 after step 6, no step skipped. Then the
    run resumed from its checkpoint of step 4 logs the same steps 5-8 (loss and scale) and saves
    the same weights, bit for bit."""
    fp16 = ["--fp16_init_scale", 32768, "--fp16_growth_interval", 3, "--max_train_steps", 8]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    fp16_launch("fsdp2", tmp_path, [*glue_flags(**SMALL, output_dir=full, checkpointing_steps=4), *fp16])
    results = json.loads((full / "eval_results.json").read_text())
    assert (results["distributed_type"], results["precision_in_effect"]) == ("FSDP", "fp16")
    logged = steps(full)
    assert [(step, scale, skipped) for step, scale, skipped, _ in logged] == [
        (1, 32768, 0), (2, 32768, 0), (3, 65536, 0), (4, 65536, 0), (5, 65536, 0), (6, 131072, 0), (7, 131072, 0), (8, 131072, 0)
    ]  # fmt: skip

    checkpoint = full / "checkpoints" / "checkpoint-4"
    assert read_checkpoint(checkpoint, {})["grad_scaler"]["scale"] == 65536
    fp16_launch(
        "fsdp2",
        tmp_path,
        [*glue_flags(**SMALL, output_dir=resumed, resume_from_checkpoint=checkpoint), *fp16],
    )
    assert steps(resumed) == logged[4:]  # the scale, the skips and the loss of steps 5-8, bit for bit
    assert same_weights(full, resumed)


# ----------------------------------------------------------------------------- the overflow replay
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_replayed_overflow_leaves_nothing_behind(engine, tmp_path):
    """A scale of 10**8 that backs off 100-fold: steps 1 and 2 overflow and are skipped, and the
    recipe replays each one's batch to name the module where it overflowed. The same run without
    the replay (tests/recipes/without_overflow_replay.py) must log the same steps and save the
    same weights, bit for bit: the replay only looks."""
    argv = [*glue_flags(**SMALL, max_train_steps=6), "--fp16_init_scale", 1e8, "--fp16_backoff_factor", 0.01]
    replayed = fp16_launch(engine, tmp_path, [*argv, "--output_dir", tmp_path / "replayed"])
    plain = fp16_launch(engine, tmp_path, [*argv, "--output_dir", tmp_path / "plain"], wrapper=WITHOUT_REPLAY)
    assert replayed.stderr.count("fp16 overflow, optimizer step skipped") == 2, replayed.stderr[-3000:]
    assert "first non-finite value: gradient at the output of" in replayed.stderr
    assert "first non-finite value: not replayed" in plain.stderr
    logged = steps(tmp_path / "replayed")
    assert [skipped for _, _, skipped, _ in logged] == [1, 2, 2, 2, 2, 2]
    assert logged == steps(tmp_path / "plain")
    assert same_weights(tmp_path / "replayed", tmp_path / "plain")


# ----------------------------------------------------------------------------- gradient accumulation
@pytest.mark.slow
def test_gradient_accumulation_holds_under_deepspeed(tmp_path, deepspeed_built):
    """deepspeed_zero2.yaml as it is, with --gradient_accumulation_steps 4: 8 batches per process
    in the epoch make 2 optimizer steps of 4 micro-batches each (a checkpoint after each says
    where the run stands), 32 examples per step over both processes."""
    output_dir = tmp_path / "out"
    argv = glue_flags(
        **SMALL, mixed_precision="bf16", num_train_epochs=1, gradient_accumulation_steps=4,
        checkpointing_steps=1, output_dir=output_dir,
    )  # fmt: skip
    result = run(engine_launch("deepspeed_zero2.yaml", GLUE, *argv), tmp_path, **engine_env())
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert (results["distributed_type"], results["train_steps"], results["total_train_batch_size"]) == (
        "DEEPSPEED",
        2,
        32,
    )
    first = read_checkpoint(output_dir / "checkpoints" / "checkpoint-1", {})
    assert (first["global_step"], first["epoch"], first["batches_in_epoch"]) == (1, 0, 4)
    assert "Gradient accumulation steps mismatch" not in result.stderr


@pytest.mark.parametrize(
    "launcher, flag, expected",
    [(None, None, 1), (None, 4, 4), ("4", None, 4), ("4", 4, 4), ("1", 4, None), ("auto", None, None)],
)
def test_gradient_accumulation_from_the_launcher(launcher, flag, expected, monkeypatch, capsys):
    """`accelerate launch` exports its --gradient_accumulation_steps, or a DeepSpeed config's, as
    ACCELERATE_GRADIENT_ACCUMULATION_STEPS, which accelerate takes over the script's value: the flag
    takes it when unset, and a flag that disagrees is refused in one sentence."""
    from conftest import load_recipe

    if launcher is None:
        monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", launcher)
    argv = glue_flags() + (["--gradient_accumulation_steps", str(flag)] if flag else [])
    recipe = load_recipe("bert_glue")
    if expected is not None:
        assert recipe.parse_args(argv).gradient_accumulation_steps == expected
        return
    with pytest.raises(SystemExit):
        recipe.parse_args(argv)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    if launcher == "1":
        assert error.split(": error: ", 1)[1] == (
            "--gradient_accumulation_steps 4 disagrees with accelerate launch's 1 (its "
            "--gradient_accumulation_steps, or gradient_accumulation_steps in the config's deepspeed_config), "
            "which accelerate would use instead: drop one of them, or make them equal."
        )
    else:
        assert (
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS (from accelerate launch, or set by hand) is 'auto'"
            in error
        )


# ----------------------------------------------------------------------------- DeepSpeed's loss scaler
PROBE = """
import json, os, sys
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradScalerKwargs
import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
from amp_recipes.amp import precision
from amp_recipes.errors import InputError

answers = []
for case in json.loads(sys.argv[1]):
    os.environ.pop("ACCELERATE_DEEPSPEED_CONFIG_FILE", None)
    if case.get("config_file"):
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = case["config_file"]
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(
        mixed_precision="fp16",
        kwargs_handlers=[GradScalerKwargs(**case.get("flags", {}))],
        gradient_accumulation_steps=case.get("accumulation", 1),
    )
    try:
        report = precision.preflight(accelerator, "fp16")
    except InputError as error:
        answers.append({"refused": str(error)})
        continue
    config = dict(accelerator.state.deepspeed_plugin.deepspeed_config)
    # What deepspeed.initialize parses (batch sizes filled as prepare() fills them).
    config.update(train_micro_batch_size_per_gpu=1, train_batch_size=1, gradient_accumulation_steps=1)
    parsed = DeepSpeedConfig(config).float16_config
    deepspeed.init_distributed(dist_backend="gloo")  # as deepspeed.initialize does: its scaler logs by rank
    scaler = CreateLossScaler(torch.half, parsed.loss_scale, parsed.loss_scale == 0, parsed.dynamic_loss_scale_args())
    scales = []
    for overflow in case.get("overflows", ""):
        scaler.update_scale(overflow == "O")
        scales.append(scaler.cur_scale)
    answers.append({"report": report["deepspeed_loss_scaling"], "args": parsed.dynamic_loss_scale_args(), "scales": scales})
print(json.dumps(answers))
"""


def deepspeed_fp16(tmp_path, cases: list[dict]) -> list[dict]:
    """Each case's Accelerator(mixed_precision="fp16") in a one-process DeepSpeed ZeRO-2 launch, its
    preflight, and what DeepSpeed parses from the config the recipe leaves (its loss scaler's
    settings, and the scale after each update of the case's overflow pattern, O/.)."""
    env = {
        **engine_env(),
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_MIXED_PRECISION": "fp16",
        **dict(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1"),
        "MASTER_PORT": str(free_port()),
    }
    result = run([sys.executable, "-c", PROBE, json.dumps(cases)], tmp_path, timeout=300, **env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_deepspeed_fp16_takes_the_recipes_loss_scale_flags(tmp_path, deepspeed_built):
    file_fp16 = tmp_path / "ds_file.json"
    file_fp16.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 2},
                "fp16": {"enabled": "auto", "initial_scale_power": 12, "hysteresis": 2},
            }
        )
    )
    file_accumulation = tmp_path / "ds_accumulation.json"
    file_accumulation.write_text(
        json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 8})
    )
    pattern = "O....O......O"
    defaults, custom, from_file, file_and_flag, factor, backoff, not_power, accumulation = deepspeed_fp16(
        tmp_path,
        [
            {},
            {"flags": {"init_scale": 1024, "growth_interval": 3}, "overflows": pattern},
            {"config_file": str(file_fp16)},
            {"config_file": str(file_fp16), "flags": {"init_scale": 1024}},
            {"flags": {"growth_factor": 3.0}},
            {"flags": {"backoff_factor": 0.25}},
            {"flags": {"init_scale": 1000}},
            {"config_file": str(file_accumulation), "accumulation": 4},
        ],
    )
    # Without a flag: torch's GradScaler defaults, every overflow halving (hysteresis 1).
    assert defaults["report"] == {
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 2000,
        "hysteresis": 1,
    }
    assert defaults["args"] == {
        "init_scale": 65536, "scale_window": 2000, "delayed_shift": 1, "consecutive_hysteresis": False, "min_scale": 1
    }  # fmt: skip
    # The flags, in DeepSpeed's own scaler, stepped through overflows: the rule the docs state.
    assert custom["args"]["init_scale"] == 1024 and custom["args"]["scale_window"] == 3
    assert custom["scales"] == torch_like(1024, 3, pattern)
    # A config file's own values stay where no flag is given; what it leaves out is filled.
    assert from_file["report"] == {
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 2000,
        "hysteresis": 2,
    }
    assert file_and_flag["refused"].startswith(
        "--fp16_init_scale disagrees with the DeepSpeed config file's fp16.initial_scale_power 12"
    )
    assert factor["refused"].startswith("--fp16_growth_factor 3: DeepSpeed's fp16 loss scaler grows by 2")
    assert backoff["refused"].startswith(
        "--fp16_backoff_factor 0.25: DeepSpeed's fp16 loss scaler grows by 2"
    )
    assert not_power["refused"].startswith(
        "--fp16_init_scale 1000: DeepSpeed's initial loss scale is a power of two"
    )
    assert accumulation["refused"].startswith(
        "The DeepSpeed config holds gradient_accumulation_steps 8 (the file's value, or 1 where the file has "
        "none) and the run asks for 4"
    )
    assert math.log2(65536) == defaults["report"]["initial_scale_power"]
