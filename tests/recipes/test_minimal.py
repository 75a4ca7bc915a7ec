"""recipes/minimal/bert_glue.py, the textbook loop: it trains as recipes/bert_glue.py does (fp32
step for step, bf16 within rounding), and its own fp16 path (torch's CPU autocast, GradScaler("cpu"))
skips an overflowing step, halves the scale and holds the schedule."""

import json
import math
import re

import pytest
import torch
from conftest import (
    GLUE_DIR,
    REPO,
    TINY_BERT,
    load_module,
    load_recipe,
    minilm_path,
    on_model_load,
    train,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.heavy  # real-weights runs in two processes: CI's heavy lane (.ci/run)

MINIMAL = REPO / "recipes" / "minimal" / "bert_glue.py"


def minimal():
    return load_module(MINIMAL, "minimal_bert_glue")


def flags(**work) -> list[str]:
    return [arg for name, value in work.items() for arg in (f"--{name}", str(value))]


def losses(output_dir) -> list[float]:
    rows = [json.loads(line) for line in (output_dir / "log_history.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def test_fp32_trains_step_for_step_as_the_full_recipe_on_a_model_that_learns(tmp_path):
    """The full recipe against an independent reference: the minimal tier's plain PyTorch loop on
    the same work, pretrained MiniLM on MRPC crossing two epoch boundaries, gradients accumulated
    over 2 batches. Every step's loss and the final weights are the same, and the loss falls (the
    weights really move, so a wrong schedule, clipping, decay, batch order or accumulation shows)."""
    work = dict(
        task_name="mrpc",  # sentence pairs: token_type_ids matter
        data_dir=GLUE_DIR,
        model_name_or_path=minilm_path(),
        max_seq_length=128,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,  # optimizer steps of 16 sequences
        learning_rate=3e-4,
        weight_decay=0.01,
        warmup_ratio=0.1,
        max_grad_norm=1.0,
        seed=7,
        max_train_steps=12,
        max_train_samples=64,  # 4 optimizer steps an epoch: 3 epochs, each reshuffled
        max_eval_samples=8,
        logging_steps=1,
    )
    runs = {"minimal": tmp_path / "minimal", "recipe": tmp_path / "recipe"}  # both in this process
    minimal().main(flags(**work, output_dir=runs["minimal"]))
    train(load_recipe("bert_glue"), flags(**work, output_dir=runs["recipe"]))
    recipe_losses, minimal_losses = losses(runs["recipe"]), losses(runs["minimal"])
    assert len(minimal_losses) == len(recipe_losses) == 12
    torch.testing.assert_close(
        torch.tensor(recipe_losses), torch.tensor(minimal_losses), rtol=1e-6, atol=1e-6
    )
    assert sum(recipe_losses[-4:]) < sum(recipe_losses[:4]) - 0.4  # it learns (measured: 2.81 -> 2.12)
    recipe_weights = load_file(runs["recipe"] / "model.safetensors")
    minimal_weights = load_file(runs["minimal"] / "model.safetensors")
    assert recipe_weights.keys() == minimal_weights.keys()
    initial = load_file(minilm_path() / "model.safetensors")
    moved = 0
    for name, tensor in minimal_weights.items():
        torch.testing.assert_close(recipe_weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        pretrained = initial.get(name.removeprefix("bert."))
        moved += pretrained is not None and not torch.equal(pretrained, tensor)
    assert moved > 50  # the encoder (104 pretrained tensors) was trained, not only the new head
    results = json.loads((runs["minimal"] / "eval_results.json").read_text())
    assert results["train_steps"] == 12 and results["skipped_steps"] == 0 and "eval_f1" in results


# bf16 on this CPU: both loops run the very same torch.autocast("cpu", torch.bfloat16) regions over
# fp32 weights, on the same batches; measured on the 2-core AMD EPYC (2026-12-02), losses and final
# weights equal to the last bit. The tolerance allows for kernels that order their sums differently
# between the two call paths on another CPU.
BF16_TOLERANCE = 1e-4


# A few steps of the tiny BERT on real MRPC pairs, every step logged.
TINY_WORK = dict(task_name="mrpc", data_dir=GLUE_DIR, model_name_or_path=TINY_BERT, max_eval_samples=16)
TINY_WORK.update(per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=1)


def test_bf16_trains_as_the_full_recipe_in_bf16(tmp_path):
    work = dict(TINY_WORK, mixed_precision="bf16", max_train_samples=32, max_train_steps=6, seed=3)
    shuffled = ["--no_group_by_length"]  # the plain shuffle here; the fp32 test above runs grouped batches
    results = minimal().main([*flags(**work, output_dir=tmp_path / "minimal"), *shuffled])
    recipe_results = train(
        load_recipe("bert_glue"), [*flags(**work, output_dir=tmp_path / "recipe"), *shuffled]
    )
    assert recipe_results["precision_in_effect"] == "bf16" and results["mixed_precision"] == "bf16"
    recipe_losses, minimal_losses = losses(tmp_path / "recipe"), losses(tmp_path / "minimal")
    assert len(recipe_losses) == len(minimal_losses) == 6
    torch.testing.assert_close(
        torch.tensor(minimal_losses), torch.tensor(recipe_losses), rtol=BF16_TOLERANCE, atol=BF16_TOLERANCE
    )
    # bf16 really ran: the same loop in fp32 computes other losses.
    minimal().main(flags(**{**work, "mixed_precision": "no"}, output_dir=tmp_path / "fp32"))
    assert losses(tmp_path / "fp32") != minimal_losses
    recipe_weights = load_file(tmp_path / "recipe" / "model.safetensors")
    for name, tensor in load_file(tmp_path / "minimal" / "model.safetensors").items():
        assert tensor.dtype == torch.float32, name  # fp32 master weights, saved as such
        torch.testing.assert_close(tensor, recipe_weights[name], rtol=BF16_TOLERANCE, atol=BF16_TOLERANCE)


def test_fp16_skips_an_overflowing_step_halves_the_scale_and_holds_the_schedule(tmp_path, monkeypatch):
    """torch's own CPU autocast in fp16 and GradScaler("cpu"): an inf injected into one gradient of
    the third optimizer step makes the scaler skip that step (the weights stay), halve its scale,
    and the loop hold the learning-rate schedule."""
    module = minimal()
    backward_passes, snapshots = [], []

    def inject_overflow(model):
        weight = model.classifier.weight

        def hook(grad):
            backward_passes.append(1)
            return grad * math.inf if len(backward_passes) == 3 else grad

        weight.register_hook(hook)
        snapshots.append(lambda: weight.detach().clone())

    on_model_load(monkeypatch, module, "AutoModelForSequenceClassification", inject_overflow)
    weights_by_step = {}
    real_step = torch.amp.GradScaler.step

    def recording_step(scaler, optimizer, *args, **kwargs):  # the classifier weight before each step
        weights_by_step[len(weights_by_step) + 1] = snapshots[0]()
        return real_step(scaler, optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.amp.GradScaler, "step", recording_step)
    work = dict(TINY_WORK, mixed_precision="fp16", warmup_ratio=0.0, max_train_samples=48, max_train_steps=5)
    results = module.main(flags(**work, output_dir=tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "log_history.jsonl").read_text().splitlines()]
    assert [row["skipped_steps"] for row in rows] == [0, 0, 1, 1, 1]
    assert [row["loss_scale"] for row in rows] == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0]
    rates = [row["learning_rate"] for row in rows]
    assert rates[2] == rates[1] and rates[1] > rates[3] > rates[4]  # held at the skipped step only
    assert torch.equal(weights_by_step[3], weights_by_step[4])  # step 3 changed no weight
    assert not torch.equal(weights_by_step[2], weights_by_step[3])  # the steps around it did
    assert all(math.isfinite(row["loss"]) for row in rows)
    assert results["skipped_steps"] == 1 and results["mixed_precision"] == "fp16"
    reloaded = load_file(tmp_path / "model.safetensors")
    assert all(tensor.dtype == torch.float32 for tensor in reloaded.values())  # fp32 master weights


def test_the_logged_loss_is_the_mean_over_the_logging_window_in_both_tiers(tmp_path):
    """A log line's `loss` is the mean of every batch's loss since the previous log line, in the
    minimal tier as in the full one (telemetry's window): not the last optimizer step's alone."""
    work = dict(TINY_WORK, max_train_samples=48, max_train_steps=6, gradient_accumulation_steps=2, seed=5)
    minimal().main(flags(**work, output_dir=tmp_path / "every-step"))  # logging_steps=1
    per_step = losses(tmp_path / "every-step")
    work["logging_steps"] = 3
    minimal().main(flags(**work, output_dir=tmp_path / "minimal"))
    train(load_recipe("bert_glue"), flags(**work, output_dir=tmp_path / "recipe"))
    # Every step has 2 batches, so the window's batch mean is the mean of its steps' means.
    windows = [sum(per_step[:3]) / 3, sum(per_step[3:]) / 3]
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "minimal")), torch.tensor(windows))
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "recipe")), torch.tensor(windows))
    assert per_step[2] != windows[0]  # the last step's loss alone would fail the check above


def test_max_grad_norm_0_means_no_clipping_in_the_minimal_tier(tmp_path):
    """--max_grad_norm 0 trains exactly as a bound no gradient reaches (1e9): no clipping, while
    the norm is still measured and logged. (Clipping to a norm of 0 would leave only the weight
    decay to move the weights.) The full recipe's: test_readme_claims, which reads what its
    optimizer sees."""
    work = dict(TINY_WORK, max_train_samples=32, max_train_steps=4, seed=11)
    for name, bound in (("off", 0), ("unreached", 1e9)):
        minimal().main(flags(**work, max_grad_norm=bound, output_dir=tmp_path / name))
    off, unreached = (load_file(tmp_path / name / "model.safetensors") for name in ("off", "unreached"))
    for name, tensor in off.items():
        assert torch.equal(tensor, unreached[name]), name
    rows = [json.loads(line) for line in (tmp_path / "off" / "log_history.jsonl").read_text().splitlines()]
    norms = [row["grad_norm"] for row in rows if "grad_norm" in row]
    assert len(norms) == 4 and all(math.isfinite(norm) and norm > 0 for norm in norms)


@pytest.mark.parametrize("platform, unit", [("linux", 1024), ("darwin", 1)])
def test_the_peak_memory_is_in_bytes_on_linux_and_macos(platform, unit, tmp_path, monkeypatch):
    """ru_maxrss is in KiB on Linux and in bytes on macOS. The module sees the platform and
    getrusage of a Mac (this machine cannot be one); nothing else in the process does."""
    from types import SimpleNamespace

    module = minimal()
    maxrss = 3_000_000  # what getrusage says, in the platform's unit
    monkeypatch.setattr(module, "sys", SimpleNamespace(platform=platform))
    fake_resource = SimpleNamespace(RUSAGE_SELF=0, getrusage=lambda who: SimpleNamespace(ru_maxrss=maxrss))
    monkeypatch.setattr(module, "resource", fake_resource)
    work = dict(TINY_WORK, max_train_samples=16, max_train_steps=1)
    results = module.main(flags(**work, output_dir=tmp_path))
    assert results["peak_memory_bytes"] == maxrss * unit


def test_every_flag_of_the_minimal_tier_is_a_plain_add_argument_with_help():
    """One `parser.add_argument("--name", ..., help=...)` per flag, so each can be read and grepped
    (no table of defaults turned into flags by a loop)."""
    written = re.findall(r'parser\.add_argument\(\s*"(--\w+)"', MINIMAL.read_text())
    actions = [
        action for action in minimal().build_parser()._actions if action.option_strings != ["-h", "--help"]
    ]
    assert len(written) == len(set(written)) == len(actions) >= 19
    assert {action.option_strings[0] for action in actions} == set(written)
    assert not [action.dest for action in actions if not action.help]


def test_the_minimal_tier_stays_minimal():
    """At most 200 lines (issue #52: for reading, not a target), one device, and nothing from
    amp_recipes but the task's data and metric: every AMP call is a line of the file."""
    source = MINIMAL.read_text()
    assert len(source.splitlines()) <= 200
    imports = [
        line for line in source.splitlines() if line.startswith(("from amp_recipes", "import amp_recipes"))
    ]
    assert imports == [
        "from amp_recipes.tasks import batches, classification  # the task's data: loaded, tokenised",
        "from amp_recipes.tasks.metrics import load_metric  # the task's GLUE metric, shipped so it works offline",
    ]
    assert not any(line.startswith(("from accelerate", "import accelerate")) for line in source.splitlines())
    for call in (
        "torch.autocast(device.type, dtype=dtype, enabled=amp)",
        "torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)",
        "scaler.scale(loss / args.gradient_accumulation_steps).backward()",
        "scaler.unscale_(optimizer)",
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)",
        "scaler.step(optimizer)",
        "scaler.update()",
        "if scaler.get_scale() < scale:",
        "dtype=torch.float32",
        ".logits.float()",
    ):
        assert call in source, call
