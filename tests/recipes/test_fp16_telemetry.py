"""fp16 telemetry of recipes/bert_glue.py on accelerate's real fp16 path (the CPU fixture):
skipped steps and loss scales exactly as the GradScaler had them, a schedule that does not move
on skipped steps (fused AdamW too), the module named where an overflow starts, and the guard."""

import math

import pytest
import torch
from conftest import Fp16OnCpu, glue_flags, log_history, on_model_load, train
from safetensors.torch import load_file

from amp_recipes.errors import TrainingDiverged
from amp_recipes.training.checkpoint import complete_checkpoints

INJECTED = "bert.encoder.layer.1.output.dense"
LEARNING_RATE = 1e-3
TINY = glue_flags(
    logging_steps=1, seed=7, warmup_ratio=0, activation_monitor_interval=0, learning_rate=LEARNING_RATE
)


class OverflowInjector:
    """Makes one module's forward output (or the gradient at it) infinite on chosen optimizer
    steps. A replay of the same batch (the recipe's diagnosis) counts as the same step."""

    def __init__(self, model, module_name, steps, kind="forward"):
        self.steps, self.kind = set(steps), kind
        self.step, self.previous = 0, None
        model.register_forward_pre_hook(self._count, with_kwargs=True)
        model.get_submodule(module_name).register_forward_hook(self._inject)

    def _count(self, module, args, kwargs):
        if module.training:
            input_ids = kwargs["input_ids"]
            if self.previous is None or not torch.equal(input_ids, self.previous):
                self.step += 1
            self.previous = input_ids.clone()

    def _inject(self, module, inputs, output):
        if not (module.training and self.step in self.steps):
            return None
        if self.kind == "forward":
            return output * math.inf
        output.register_hook(lambda grad: grad * math.inf)
        return None


def inject(monkeypatch, recipe, steps, kind="forward"):
    on_model_load(
        monkeypatch,
        recipe,
        "AutoModelForSequenceClassification",
        lambda model: OverflowInjector(model, INJECTED, steps, kind),
    )


def expected_scales(steps, skipped, init_scale, growth_interval, growth=2.0, backoff=0.5):
    """GradScaler's rule: times `backoff` on a skipped step, times `growth` after `growth_interval`
    good ones."""
    scale, good, scales = init_scale, 0, []
    for step in range(1, steps + 1):
        if step in skipped:
            scale, good = scale * backoff, 0
        else:
            good += 1
            if good == growth_interval:
                scale, good = scale * growth, 0
        scales.append(scale)
    return scales


@pytest.mark.parametrize(
    "optim, growth, backoff", [("adamw_torch", 4.0, 0.25), ("adamw_torch_fused", 2.0, 0.5)]
)
def test_skipped_steps_loss_scale_and_schedule_are_exact(
    recipe, tmp_path, monkeypatch, caplog, optim, growth, backoff
):
    """Every --fp16_* flag reaches the GradScaler (torch's default factors with one optimizer,
    others with the second)."""
    skipped, steps = {2, 3, 7}, 10
    caplog.set_level("INFO")
    monkeypatch.setattr(recipe, "Accelerator", Fp16OnCpu)
    inject(monkeypatch, recipe, skipped)
    argv = [*TINY, "--mixed_precision", "fp16", "--optim", optim, "--max_train_steps", steps]
    argv += ["--fp16_init_scale", 1024, "--fp16_growth_interval", 2, "--output_dir", tmp_path]
    argv += ["--fp16_growth_factor", growth, "--fp16_backoff_factor", backoff]
    results = train(recipe, argv)

    rows = [row for row in log_history(tmp_path) if "loss_scale" in row]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    # the scaler's own values: --fp16_* reached accelerate's GradScalerKwargs
    assert [row["loss_scale"] for row in rows] == expected_scales(steps, skipped, 1024.0, 2, growth, backoff)
    assert [row["skipped_steps"] for row in rows] == [
        sum(s <= step for s in skipped) for step in range(1, steps + 1)
    ]
    # linear decay over 10 scheduler steps that advances only on applied steps
    applied = [sum(s not in skipped for s in range(1, step + 1)) for step in range(1, steps + 1)]
    assert [row["learning_rate"] for row in rows] == pytest.approx(
        [LEARNING_RATE * (1 - n / steps) for n in applied], rel=1e-12
    )
    # the mean over the finite losses of the window: none on a skipped step (its loss was inf)
    assert [math.isnan(row["loss"]) for row in rows] == [step in skipped for step in range(1, steps + 1)]
    assert results["skipped_steps"] == 3 and results["effective_optimizer_steps"] == 7
    assert results["skipped_step_rate"] == pytest.approx(0.3)
    assert results["loss_scale"] == rows[-1]["loss_scale"]
    assert results["nonfinite_losses"] == 3  # an infinite forward makes the loss infinite too
    assert "grad_norm" in rows[0] and math.isfinite(rows[0]["grad_norm"])
    assert (
        f"step 2: fp16 overflow, optimizer step skipped, loss scale 1024 -> {1024 * backoff:g}; first non-finite value: forward output of {INJECTED}"
        in caplog.text
    )


def test_fp16_telemetry_reaches_the_wandb_record(recipe, tmp_path, monkeypatch, wandb_dir):
    """The W&B run (read back from its offline record) has the loss scale and skipped steps of every
    logged step, as the GradScaler had them, and the run's totals in its summary."""
    from wandb_offline import offline_run, offline_summary

    monkeypatch.setattr(recipe, "Accelerator", Fp16OnCpu)
    inject(monkeypatch, recipe, {2, 3})
    argv = [*TINY, "--mixed_precision", "fp16", "--max_train_steps", 5, "--fp16_init_scale", 1024]
    results = train(
        recipe, [*argv, "--fp16_growth_interval", 2, "--report_to", "wandb", "--output_dir", tmp_path / "run"]
    )
    _, _, history = offline_run(tmp_path)
    rows = [row for row in history if "loss_scale" in row]
    assert [row["_step"] for row in rows] == [1, 2, 3, 4, 5]
    assert [row["loss_scale"] for row in rows] == expected_scales(5, {2, 3}, 1024.0, 2)
    assert [row["skipped_steps"] for row in rows] == [0, 1, 2, 2, 2]
    summary = offline_summary(tmp_path)
    assert summary["skipped_steps"] == results["skipped_steps"] == 2
    assert summary["loss_scale"] == results["loss_scale"] == rows[-1]["loss_scale"]
    assert summary["precision_in_effect"] == "fp16"


def test_the_diagnosis_names_the_module_of_a_gradient_overflow(recipe, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(recipe, "Accelerator", Fp16OnCpu)
    inject(monkeypatch, recipe, {2}, kind="backward")
    results = train(
        recipe, [*TINY, "--mixed_precision", "fp16", "--max_train_steps", 3, "--output_dir", tmp_path]
    )
    assert results["skipped_steps"] == 1 and results["nonfinite_losses"] == 0  # the loss was fine
    assert (
        f"step 2: fp16 overflow, optimizer step skipped, loss scale 16384 -> 8192; first non-finite value: gradient at the output of {INJECTED}"
        in caplog.text
    )


def test_diagnose_overflow_watches_every_step_in_any_precision(recipe, tmp_path, monkeypatch, caplog):
    inject(monkeypatch, recipe, {2}, kind="backward")
    argv = [
        *TINY,
        "--max_train_steps",
        3,
        "--diagnose_overflow",
        "--logging_steps",
        5,
        "--output_dir",
        tmp_path,
    ]
    with pytest.raises(TrainingDiverged):  # fp32 has no scaler: the inf reaches the weights
        train(recipe, argv)
    assert f"step 2: first non-finite value: gradient at the output of {INJECTED}" in caplog.text
    assert "step 1: first non-finite" not in caplog.text


def test_guard_stops_after_consecutive_skips_with_the_last_good_checkpoint(recipe, tmp_path, monkeypatch):
    monkeypatch.setattr(recipe, "Accelerator", Fp16OnCpu)
    inject(monkeypatch, recipe, range(3, 100))
    argv = [*TINY, "--mixed_precision", "fp16", "--max_train_steps", 20, "--checkpointing_steps", 2]
    argv += ["--max_consecutive_skipped_steps", 4, "--output_dir", tmp_path]
    with pytest.raises(TrainingDiverged) as stopped:
        train(recipe, argv)
    message = str(stopped.value)
    assert message.startswith("Stopped at step 6: 4 consecutive fp16 steps were skipped")
    assert f"first non-finite value: forward output of {INJECTED}" in message
    assert "--fp16_init_scale" in message and "--mixed_precision bf16" in message
    checkpoints = complete_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in checkpoints] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    last_good, at_stop = (load_file(str(p / "model.safetensors")) for p in (checkpoints[0], checkpoints[-1]))
    assert all(torch.equal(last_good[k], at_stop[k]) for k in last_good)  # skipped steps changed nothing
    assert not (tmp_path / "eval_results.json").exists()


def test_nonfinite_loss_under_fp32_stops_without_saving_spoiled_weights(recipe, tmp_path, monkeypatch):
    inject(monkeypatch, recipe, {5})
    argv = [*TINY, "--max_train_steps", 10, "--logging_steps", 2, "--checkpointing_steps", 4]
    with pytest.raises(TrainingDiverged, match="non-finite under fp32 between steps 4 and 6"):
        train(recipe, [*argv, "--output_dir", tmp_path])
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["checkpoint-4"]
    assert not (tmp_path / "model.safetensors").exists()


def test_activation_monitor_reports_the_modules_closest_to_fp16_overflow(recipe, tmp_path, monkeypatch):
    """The monitor's top 5 against the test's own hooks: every training forward's per-module
    max |output| kept, the sampled forwards (1 and 3 of 3, one in --activation_monitor_interval 2)
    reduced, divided by fp16's largest value and ranked."""
    seen = []  # per training forward: {module: max |output|}

    def watch(model):
        model.register_forward_pre_hook(lambda module, _: seen.append({}) if module.training else None)
        for name, module in model.named_modules():
            if name and not list(module.children()) and not isinstance(module, torch.nn.Dropout):

                def hook(module, _, output, name=name):
                    if module.training and output.is_floating_point():
                        seen[-1][name] = output.detach().abs().max().item()

                module.register_forward_hook(hook)

    on_model_load(monkeypatch, recipe, "AutoModelForSequenceClassification", watch)
    argv = [*TINY, "--max_train_steps", 3, "--activation_monitor_interval", 2, "--output_dir", tmp_path]
    results = train(recipe, argv)
    assert len(seen) == 3
    sampled = {name: max(seen[0][name], seen[2][name]) / torch.finfo(torch.float16).max for name in seen[0]}
    expected = dict(sorted(sampled.items(), key=lambda item: -item[1])[:5])
    assert list(results["fp16_range"]) == list(expected)
    assert results["fp16_range"] == pytest.approx(expected, rel=1e-6)
    assert any(key.startswith("fp16_range/") for key in log_history(tmp_path)[0])


def test_auto_precision_and_the_preflight_block(recipe, tmp_path, caplog, monkeypatch):
    import copy

    from amp_recipes.amp.hardware import device_facts
    from amp_recipes.amp.precision import choose_auto_precision

    caplog.set_level("INFO")
    _, reason = choose_auto_precision(device_facts())  # the wording of the reason
    # The choice, from torch's own feature probes (not the code under test): bf16 where the hardware
    # runs it natively (Ampere+, or a CPU with AVX512-BF16 / AMX), fp16 on a Tensor-Core GPU, else fp32.
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability()[0]
        choice = "bf16" if major >= 8 else "fp16" if major >= 7 else "no"
    else:
        choice = (
            "bf16" if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported() else "no"
        )
    argv = [*TINY, "--max_train_steps", 1, "--mixed_precision", "auto", "--output_dir", tmp_path]
    parsed = []
    parse_args = recipe.parse_args
    monkeypatch.setattr(recipe, "parse_args", lambda argv: parsed.append(parse_args(argv)) or parsed[-1])
    results = train(recipe, argv)
    as_parsed = copy.deepcopy(vars(recipe.parse_args([str(a) for a in argv])))
    assert vars(parsed[0]) == as_parsed and parsed[0].mixed_precision == "auto"  # nothing rewrote the flags
    assert results["mixed_precision_requested"] == choice
    assert results["precision_in_effect"] == {"no": "fp32"}.get(choice, choice)
    assert results["mixed_precision_auto_reason"] == reason
    block = next(r.getMessage() for r in caplog.records if "Preflight" in r.getMessage())
    assert f"auto:       {reason}" in block and "x 1 process(es)" in block
    assert "native bf16" in block and "Tensor Cores no" in block


class WeightFault:
    """An overflow that also happens inside a torch.compile'd region, where module hooks are not
    run: one weight of `module_name` is infinite during the chosen optimizer steps (set by a
    pre-hook on the top-level model, which is never compiled; the replay of a step's batch counts as
    the same step), and restored afterwards (the skipped step left it untouched)."""

    def __init__(self, model, module_name, steps):
        self.weight = model.get_submodule(module_name).weight
        self.steps, self.step, self.previous, self.saved = set(steps), 0, None, None
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    @torch.no_grad()
    def _count(self, module, args, kwargs):
        if not module.training:
            return
        input_ids = kwargs["input_ids"]
        if self.previous is None or not torch.equal(input_ids, self.previous):
            self.step += 1
            if self.saved is not None:
                self.weight[0, 0], self.saved = self.saved, None
            if self.step in self.steps:
                self.saved = self.weight[0, 0].clone()
                self.weight[0, 0] = math.inf
        self.previous = input_ids.clone()


def test_an_overflow_under_torch_compile_is_located_on_the_eager_model(recipe, tmp_path, monkeypatch, caplog):
    """Module hooks do not fire inside compiled regions (dynamo skips hook guards), so watching
    the compiled model would name no module: the skipped step's batch is replayed on the eager
    model accelerate keeps beside the compiled regions (same weights, same autocast)."""
    caplog.set_level("INFO")
    torch._dynamo.reset()
    monkeypatch.setattr(recipe, "Accelerator", Fp16OnCpu)
    on_model_load(
        monkeypatch, recipe, "AutoModelForSequenceClassification", lambda m: WeightFault(m, INJECTED, {2})
    )
    argv = [*TINY, "--mixed_precision", "fp16", "--max_train_steps", 3, "--fp16_init_scale", 1024]
    argv += ["--torch_compile", "--torch_compile_backend", "eager", "--output_dir", tmp_path]
    results = train(recipe, argv)
    assert results["skipped_steps"] == 1 and results["compiled_graphs"] > 0
    message = "step 2: fp16 overflow, optimizer step skipped, loss scale 1024 -> 512; first non-finite value"
    assert f"{message}: forward output of {INJECTED}" in caplog.text
    assert all(torch.isfinite(t).all() for t in load_file(str(tmp_path / "model.safetensors")).values())
