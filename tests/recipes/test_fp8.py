"""--mixed_precision fp8 on a CPU, as far as the libraries allow: accelerate's real torchao path
(Float8Linear swapped in at prepare(), bf16 autocast around it) with torchao's emulation standing in
for fp8 Tensor Cores (tests/fp8_emulation), and the real refusals of this machine without it.

Not reachable here: fp8 Tensor Cores (speed), Transformer Engine (it builds against CUDA), and
accelerate's fp8 under FSDP/DeepSpeed (GPU process groups only)."""

import json
import logging
import sys
from importlib.metadata import version

import pytest
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import AORecipeKwargs
from conftest import (
    FP8_EMULATION,
    RECIPES,
    REPO,
    TINY_BERT,
    accelerate_launch,
    assert_same_training,
    final_weights,
    fp8_env,
    glue_flags,
    history,
    load_module,
    reset_accelerate,
    run,
    stop_at,
    train,
)
from transformers import AutoModelForSequenceClassification

from amp_recipes.amp.precision import fp8_layer_report, fp8_recipe_kwargs, is_fp8_linear, log_fp8_report
from amp_recipes.training import checkpoint
from amp_recipes.training.checkpoint import MARKER

pytest.importorskip("torchao", reason="the [fp8] extra (requirements-dev.txt installs it)")

SEQ = 128
# The tiny BERT (tests/families.py): hidden 32, 5 layers, intermediate 37. torch._scaled_mm needs
# sizes that are multiples of 16, so accelerate's filter leaves intermediate.dense (32 -> 37) and
# output.dense (37 -> 32) in every layer high precision, and the first Linear (layer 0's query) and
# the last (the classifier, 32 -> 2) as always: 5 x 6 + pooler + classifier = 32 Linear layers, of
# which 5 x 4 - 1 + pooler = 20 run in fp8.
KEPT = ["bert.encoder.layer.0.attention.self.query"]
KEPT += [f"bert.encoder.layer.{i}.{name}.dense" for i in range(5) for name in ("intermediate", "output")]
KEPT = sorted([*KEPT, "classifier"])


def fresh_accelerator(mixed_precision="fp8"):
    """A new Accelerator with the recipes' fp8 recipe handler (none for other precisions)."""
    reset_accelerate()
    return Accelerator(
        mixed_precision=mixed_precision, kwargs_handlers=fp8_recipe_kwargs(mixed_precision, None)
    )


def prepared_tiny_bert(mixed_precision):
    accelerator = fresh_accelerator(mixed_precision)
    model = AutoModelForSequenceClassification.from_pretrained(TINY_BERT, dtype=torch.float32)
    return accelerator, accelerator.prepare(model)


def test_conversion_and_layer_report_against_a_hand_count(fp8_on_cpu):
    accelerator, model = prepared_tiny_bert("fp8")
    report = fp8_layer_report(accelerator, model, SEQ)
    converted = sorted(name for name, module in model.named_modules() if is_fp8_linear(module))
    assert type(model.bert.encoder.layer[1].attention.self.query).__name__ == "Float8Linear"
    assert report["fp8_backend"] == "ao" and report["fp8_backend_version"] == version("torchao")
    assert report["fp8_emulated"] is True
    assert (report["linear_layers"], report["fp8_linear_layers"], len(converted)) == (32, 20, 20)
    assert sorted(report["high_precision_linear_layers"]) == KEPT
    # FLOPs of one sequence of 128 tokens, by hand: a Linear costs 2 * tokens * in * out; the pooler
    # and classifier see one token; attention's QK^T and AV cost 2 * 2 * 128^2 * 32 a layer.
    per_token = {"query": 32 * 32, "key": 32 * 32, "value": 32 * 32, "attention.output": 32 * 32}
    layer = 2 * SEQ * (sum(per_token.values()) + 2 * 32 * 37) + 2 * 2 * SEQ * SEQ * 32
    total = 5 * layer + 2 * 32 * 32 + 2 * 32 * 2
    fp8 = 2 * SEQ * 32 * 32 * (5 * 4 - 1) + 2 * 32 * 32
    assert report["fp8_flop_share"] == pytest.approx(fp8 / total, rel=1e-12)
    assert report["fp8_flop_share_seq_len"] == SEQ and "precision_in_effect" not in report


@pytest.mark.parametrize("fsdp2", [False, True])
def test_the_emulation_seam_changes_emulate_and_nothing_else(fsdp2, monkeypatch):
    """The test seam's Float8LinearConfig is the product's with emulate=True: any other difference
    (such as a seam of its own that hid the product's all-gather setting) fails here."""
    import dataclasses

    from amp_recipes.amp import precision

    product = precision.fp8_linear_config(fsdp2)
    load_module(FP8_EMULATION / "sitecustomize.py", "fp8_emulation").emulate_fp8(monkeypatch.setattr)
    emulated = precision.fp8_linear_config(fsdp2)
    assert (product.emulate, emulated.emulate) == (False, True)
    assert dataclasses.replace(emulated, emulate=False) == product
    assert product.enable_fsdp_float8_all_gather is fsdp2 and product.pad_inner_dim


@pytest.mark.parametrize(
    "env, all_gather",
    [({}, False), ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, False),
     ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, True)],
)  # fmt: skip
def test_fp8_all_gathers_only_under_fsdp2(fp8_on_cpu, monkeypatch, env, all_gather):
    """What accelerate launch --use_fsdp --fsdp_version N exports decides the recipe handler's config."""
    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    [handler] = fp8_recipe_kwargs("fp8", "ao")
    assert handler.config.enable_fsdp_float8_all_gather is all_gather and handler.config.emulate


def test_every_converted_weight_is_in_the_optimizer_and_trains(fp8_on_cpu):
    """The recipes build the optimizer before prepare(), which swaps in Float8Linear: its weights must
    be the optimizer's, and move. With the all-gather wrapper outside FSDP2 (the earlier config) they
    were new Parameters the optimizer never saw: the guard refuses that in one sentence."""
    import dataclasses

    from amp_recipes.amp import precision
    from amp_recipes.errors import InputError
    from amp_recipes.training.optim import check_every_parameter_trains

    def prepared(config):
        reset_accelerate()
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config=config)])
        model = AutoModelForSequenceClassification.from_pretrained(TINY_BERT, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return accelerator, *accelerator.prepare(model, optimizer)

    accelerator, model, optimizer = prepared(precision.fp8_linear_config())
    check_every_parameter_trains(accelerator, model, optimizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch = {"input_ids": torch.randint(1000, 2000, (16, 16)), "labels": torch.randint(0, 2, (16,))}
    for _ in range(3):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    query = "bert.encoder.layer.1.attention.self.query"
    assert type(model.get_submodule(query)).__name__ == "Float8Linear"
    assert not any(torch.equal(p, before[name]) for name, p in model.named_parameters())

    wrapped = dataclasses.replace(precision.fp8_linear_config(), enable_fsdp_float8_all_gather=True)
    accelerator, model, optimizer = prepared(wrapped)
    with pytest.raises(
        InputError, match=r"^20 trainable parameters are not in the optimizer after prepare\(\)"
    ):
        check_every_parameter_trains(accelerator, model, optimizer)


def test_fp8_layers_round_to_fp8_inside_bf16_autocast(fp8_on_cpu):
    """Not a relabelled bf16 run: the converted model computes something close to, not equal to, bf16."""
    batch = {
        "input_ids": torch.randint(1000, 2000, (4, 16)),
        "attention_mask": torch.ones(4, 16, dtype=torch.long),
    }
    logits = {}
    for mixed_precision in ("bf16", "fp8"):
        _, model = prepared_tiny_bert(mixed_precision)
        with torch.no_grad():
            logits[mixed_precision] = model.eval()(**batch).logits
    assert not torch.equal(logits["fp8"], logits["bf16"])
    torch.testing.assert_close(logits["fp8"], logits["bf16"], rtol=0.1, atol=0.05)


def test_a_model_without_a_convertible_layer_is_reported_as_bf16(fp8_on_cpu, caplog):
    accelerator = fresh_accelerator()

    class Odd(torch.nn.Module):  # sizes that are not multiples of 16: nothing can run in fp8
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.first, self.second = torch.nn.Linear(10, 24), torch.nn.Linear(24, 10)

        def forward(self, input_ids):
            return self.second(self.first(torch.ones(*input_ids.shape, 10, device=input_ids.device)))

    from transformers import PretrainedConfig

    model = accelerator.prepare(Odd(PretrainedConfig()))
    report = fp8_layer_report(accelerator, model, 8)
    assert (report["fp8_linear_layers"], report["linear_layers"]) == (0, 2)
    assert report["precision_in_effect"] == "bf16"
    with caplog.at_level(logging.WARNING):
        log_fp8_report(report, get_logger("test"))
    assert "no Linear layer runs in fp8" in caplog.text and "use --mixed_precision bf16" in caplog.text


def test_a_model_of_your_own_gets_the_layer_count_without_a_flop_share(fp8_on_cpu, caplog):
    """No transformers config to build a meta-device copy from: counted, not guessed."""
    accelerator = fresh_accelerator()
    model = accelerator.prepare(torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3))))
    report = fp8_layer_report(accelerator, model, 16)
    assert (report["fp8_linear_layers"], report["high_precision_linear_layers"]) == (1, ["0", "2"])
    assert report["fp8_flop_share"] is None
    with caplog.at_level(logging.INFO):
        log_fp8_report(report, get_logger("test"))
    assert (
        "1 of 3 Linear layers in fp8, FLOP share not computed at 16 tokens; kept in bf16: 0, 2" in caplog.text
    )


def test_the_recipe_trains_evaluates_and_saves_a_plain_model(recipe, fp8_on_cpu, tmp_path, caplog):
    out = tmp_path / "fp8"
    with caplog.at_level(logging.INFO):
        results = train(
            recipe,
            glue_flags(mixed_precision="fp8", max_train_samples=48, output_dir=out, num_train_epochs=1),
        )
    assert results["precision_in_effect"] == "fp8" and results["fp8_linear_layers"] == 20
    assert 0 <= results["eval_accuracy"] <= 1 and results["eval_samples"] == 16  # evaluation ran (no_grad)
    saved = json.loads((out / "eval_results.json").read_text())
    assert {k: saved[k] for k in ("fp8_backend", "fp8_linear_layers", "linear_layers")} == {
        "fp8_backend": "ao",
        "fp8_linear_layers": 20,
        "linear_layers": 32,
    }
    line = f"fp8 with ao {version('torchao')} (emulated): 20 of 32 Linear layers in fp8, "
    assert line in caplog.text and "of the forward matmul FLOPs at 128 tokens" in caplog.text
    # The saved model is a plain BERT: the same tensors as the model it started from, nothing fp8.
    reloaded = AutoModelForSequenceClassification.from_pretrained(out)
    assert not any(is_fp8_linear(m) for m in reloaded.modules())
    start = AutoModelForSequenceClassification.from_pretrained(TINY_BERT).state_dict()
    weights = final_weights(out)
    assert weights.keys() == start.keys() and all(w.dtype == torch.float32 for w in weights.values())
    assert not torch.equal(
        weights["bert.encoder.layer.1.attention.self.key.weight"],
        start["bert.encoder.layer.1.attention.self.key.weight"],
    )


def test_an_fp8_checkpoint_resumes_exactly(recipe, fp8_on_cpu, tmp_path, monkeypatch):
    argv = glue_flags(
        mixed_precision="fp8",
        learning_rate=1e-3,
        logging_steps=1,
        seed=7,
        max_train_samples=64,
        num_train_epochs=2,
        checkpointing_steps="epoch",
    )
    train(recipe, [*argv, "--output_dir", tmp_path / "reference"])
    monkeypatch.setattr(checkpoint, "PreemptionHandler", stop_at(5))  # mid-epoch: 8 steps an epoch
    with pytest.raises(SystemExit) as stopped:
        train(recipe, [*argv, "--output_dir", tmp_path / "resumed"])
    assert stopped.value.code == 143
    saved = tmp_path / "resumed" / "checkpoints" / "checkpoint-5"
    assert json.loads((saved / MARKER).read_text())["mixed_precision"] == "fp8"
    monkeypatch.setattr(checkpoint, "PreemptionHandler", stop_at(-1))
    results = train(
        recipe, [*argv, "--output_dir", tmp_path / "resumed", "--resume_from_checkpoint", "latest"]
    )
    assert results["precision_in_effect"] == "fp8" and results["train_steps"] == 16
    assert_same_training(tmp_path / "reference", tmp_path / "resumed")
    assert len({row["loss"] for row in history(tmp_path / "reference")}) > 10  # it really trained


# ----------------------------------------------------------------------------- subprocesses
def test_accelerate_launch_fp8_over_two_processes(tmp_path):
    """accelerate's own --mixed_precision fp8 --fp8_backend ao (no recipe flag), DDP over gloo."""
    command = accelerate_launch(
        "--multi_gpu", "--num_processes", 2, "--num_cpu_threads_per_process", 1,
        "--mixed_precision", "fp8", "--fp8_backend", "ao",
        RECIPES / "bert_glue.py",
        *glue_flags(max_train_samples=32, max_train_steps=3, output_dir=tmp_path / "out"),
    )  # fmt: skip
    result = run(command, tmp_path, ACCELERATE_USE_CPU="1", **fp8_env())
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert saved["distributed_type"] == "MULTI_CPU" and saved["num_processes"] == 2
    assert saved["mixed_precision_source"].startswith("accelerate launch")
    assert (saved["precision_in_effect"], saved["fp8_backend"], saved["fp8_linear_layers"]) == (
        "fp8",
        "ao",
        20,
    )
    assert sorted(saved["high_precision_linear_layers"]) == KEPT  # DDP's "module." prefix stripped


def test_accelerate_launch_fp8_is_refused_on_this_cpu(tmp_path):
    """The real device facts, no emulation: one sentence, before anything is written."""
    command = accelerate_launch(
        "--mixed_precision", "fp8", RECIPES / "bert_glue.py", *glue_flags(output_dir=tmp_path / "out")
    )
    result = run(command, tmp_path)
    assert result.returncode == 1
    # The recipe's last line (accelerate launch then reports that its child failed).
    # accelerate 1.16's launcher repeats its failed child's last line: one sentence, maybe twice.
    [line] = {line for line in result.stderr.splitlines() if line.startswith("error: ")}
    assert line.startswith("error: fp8 was asked on a cpu (") and "compute capability 8.9 or newer" in line
    assert line.endswith(("use --mixed_precision bf16 instead.", "use --mixed_precision no instead."))
    assert "Traceback" not in result.stderr.split(line)[0]  # the recipe itself refused, no traceback
    assert not (tmp_path / "out").exists()


BENCHMARK = [sys.executable, REPO / "scripts" / "benchmark_precision.py", "--config_name", TINY_BERT]
BENCHMARK += ["--seq_len", 32, "--batch_size", 4, "--warmup_steps", 1, "--timed_steps", 2, "--no_search"]


def test_benchmark_fp8_arm_records_its_backend_and_gives_no_ratio_when_emulated(tmp_path):
    result = run([*BENCHMARK, "--arms", "fp32,fp8", "--output_dir", tmp_path / "out"], tmp_path, **fp8_env())
    assert result.returncode == 0, result.stderr[-3000:]
    arms = json.loads((tmp_path / "out" / "results.json").read_text())["arms"]
    fp8 = arms["fp8"]
    assert fp8["fits"] and fp8["precision_in_effect"] == "fp8"
    assert (fp8["fp8_backend"], fp8["fp8_backend_version"]) == ("ao", version("torchao"))
    assert (fp8["fp8_linear_layers"], fp8["linear_layers"]) == (20, 32)
    assert fp8["ratios_vs_fp32"] is None and "emulated" in fp8["no_ratio_reason"]
    table = (tmp_path / "out" / "results.md").read_text()
    assert f"- fp8: ao {version('torchao')} (emulated): 20 of 32 Linear layers in fp8, " in table
    assert "- fp8: no ratio, fp8 was emulated" in table


def test_benchmark_refuses_the_fp8_arm_on_this_cpu(tmp_path):
    result = run([*BENCHMARK, "--arms", "fp32,fp8", "--output_dir", tmp_path / "out"], tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: the fp8 arm: fp8 was asked on a cpu (")
    assert not (tmp_path / "out" / "results.json").exists()
