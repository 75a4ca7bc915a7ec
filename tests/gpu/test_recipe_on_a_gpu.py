"""recipes/bert_glue.py on one CUDA GPU, as a user launches it (skipped without CUDA).

fp32, fp16 and bf16 fine-tunes of BERT-base's architecture (random weights, dropout off) on the
same MRPC batch and seed: each runs its precision, the fp16 run with a loss scale, and their losses
agree. The saved fp16 model, reloaded with --eval_only, scores what its run wrote. --torch_compile
compiles the model under fp16; --mixed_precision fp8 runs fp8 Linear layers where the GPU and torchao allow.
"""

import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from accelerate.test_utils import require_cuda, require_fp8, require_torchao
from conftest import (
    BERT_BASE_CONFIG,
    GLUE_DIR,
    RECIPES,
    TINY_BERT,
    accelerate_launch,
    kill_runs,
    log_history,
    run,
)

# The agreement: over the last quarter of the logged steps, the fp16 (bf16) run's mean loss may
# differ from fp32's by at most this fraction of what fp32 learned (its mean loss over the first
# quarter minus over the last). The runs see the same batch from the same weights without dropout;
# a GradScaler that skips every step leaves the loss where it started (all of fp32's progress
# apart), one that applies an overflowed step makes it NaN: both fail.
AGREEMENT_TOLERANCE = 0.25
# One batch of 32 MRPC pairs, seen at every step: the loss curve has no batch-to-batch noise and
# the model memorizes the batch, progress the agreement can measure (fp32 on a CPU: 0.69 to under
# 0.003 by step 24).
FINETUNE = [
    *("--task_name", "mrpc", "--data_dir", GLUE_DIR, "--max_train_samples", 32, "--max_eval_samples", 64),
    *("--per_device_train_batch_size", 32, "--max_train_steps", 60, "--learning_rate", 5e-5),
    *("--logging_steps", 1, "--seed", 42),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The module's models and runs (about 2 GB for BERT-base), removed when it ends."""
    folder = tmp_path_factory.mktemp("gpu-runs")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_run_left_behind(work, tmp_path):
    """A test that pytest-timeout stopped leaves no launch of its own holding the GPU for the next."""
    yield
    kill_runs(work)
    kill_runs(tmp_path)


def launch(cmd, tag: Path):
    """`cmd` to its end, its processes tagged with `tag`; the suite's pytest-timeout bounds it.
    HF_HOME of its own: the machine's default accelerate config (under HF_HOME) stays out."""
    result = run(cmd, tag, timeout=None, AMP_SCALE_OUT_TEST=tag, HF_HOME=tag / "hf-home")
    assert result.returncode == 0, result.stderr[-3000:]


@functools.cache
def bert_base(work: Path) -> Path:
    """bert-base-uncased's architecture and tokenizer from the checkout, random weights, no dropout."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(
        BERT_BASE_CONFIG, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    torch.manual_seed(0)
    target = work / "bert-base-random"
    AutoModelForSequenceClassification.from_config(config).save_pretrained(target)
    AutoTokenizer.from_pretrained(BERT_BASE_CONFIG).save_pretrained(target)
    return target


@functools.cache
def finetune(work: Path, mixed_precision: str) -> Path:
    """The recipe's fine-tune under `mixed_precision`, through `accelerate launch` on one GPU."""
    output_dir = work / f"finetune-{mixed_precision}"
    cmd = accelerate_launch(
        "--num_processes", 1, RECIPES / "bert_glue.py", *FINETUNE, "--mixed_precision", mixed_precision,
        "--model_name_or_path", bert_base(work), "--output_dir", output_dir,
    )  # fmt: skip
    launch(cmd, work)
    return output_dir


def results(output_dir: Path) -> dict:
    return json.loads((output_dir / "eval_results.json").read_text())


def losses(output_dir: Path) -> list[float]:
    return [row["loss"] for row in log_history(output_dir) if "loss" in row]


def needs_bf16():
    if not torch.cuda.is_bf16_supported(including_emulation=False):  # native, as the recipes require
        pytest.skip("bf16 needs a GPU of compute capability 8.0 or newer")


@require_cuda
def test_fp32_learns_the_batch(work):
    reference = losses(finetune(work, "no"))
    assert len(reference) == 60 and all(map(math.isfinite, reference))
    assert results(finetune(work, "no"))["precision_in_effect"] in ("fp32", "tf32")
    window = len(reference) // 4
    assert sum(reference[-window:]) < 0.5 * sum(reference[:window])  # progress the agreement measures


@require_cuda
def test_fp16_runs_with_a_loss_scale_and_agrees_with_fp32(work):
    output_dir = finetune(work, "fp16")
    assert results(output_dir)["precision_in_effect"] == "fp16"
    scales = [row["loss_scale"] for row in log_history(output_dir) if "loss" in row]
    assert scales and all(scale >= 1 for scale in scales)
    assert_agrees(losses(finetune(work, "no")), losses(output_dir))


@require_cuda
def test_bf16_runs_without_a_scaler_and_agrees_with_fp32(work):
    needs_bf16()
    output_dir = finetune(work, "bf16")
    assert results(output_dir)["precision_in_effect"] == "bf16"
    assert all(row.get("loss_scale") is None for row in log_history(output_dir))
    assert_agrees(losses(finetune(work, "no")), losses(output_dir))


def assert_agrees(reference: list[float], other: list[float]) -> None:
    assert len(other) == len(reference), "the run stopped early (a guard: non-finite losses, skipped steps)"
    window = len(reference) // 4
    learned = (sum(reference[:window]) - sum(reference[-window:])) / window
    difference = abs(sum(other[-window:]) - sum(reference[-window:])) / window
    assert math.isfinite(difference) and difference <= AGREEMENT_TOLERANCE * learned, (difference, learned)


@require_cuda
def test_the_saved_fp16_model_reloads_to_its_scores(work):
    trained = finetune(work, "fp16")
    reloaded = work / "reload-fp16"
    cmd = accelerate_launch(
        "--num_processes", 1, RECIPES / "bert_glue.py", *FINETUNE, "--mixed_precision", "fp16",
        "--model_name_or_path", trained, "--eval_only", "--output_dir", reloaded,
    )  # fmt: skip
    launch(cmd, work)
    written, scored = results(trained), results(reloaded)
    scores = {key: value for key, value in written.items() if key.startswith("eval_")}
    assert scores and scores == {key: value for key, value in scored.items() if key.startswith("eval_")}


@require_cuda
def test_torch_compile_compiles_the_recipes_model(tmp_path):
    cmd = accelerate_launch(
        "--num_processes", 1, RECIPES / "bert_glue.py", *FINETUNE, "--mixed_precision", "fp16",
        "--model_name_or_path", TINY_BERT, "--max_train_steps", 8, "--torch_compile", "--output_dir", tmp_path,
    )  # fmt: skip
    launch(cmd, tmp_path)
    compiled = results(tmp_path)
    assert compiled["compiled_graphs"] > 0 and compiled["recompile_limit_hit"] is False
    assert all(map(math.isfinite, losses(tmp_path)))


@require_cuda
@require_fp8
@require_torchao
def test_fp8_runs_fp8_linear_layers(work, tmp_path):
    """torchao's Float8Linear on fp8 Tensor Cores (not emulated); BERT-base's shapes, which fp8's
    matmuls accept (multiples of 16)."""
    cmd = accelerate_launch(
        "--num_processes", 1, RECIPES / "bert_glue.py", *FINETUNE, "--mixed_precision", "fp8",
        "--model_name_or_path", bert_base(work), "--max_train_steps", 8, "--output_dir", tmp_path,
    )  # fmt: skip
    launch(cmd, tmp_path)
    fp8 = results(tmp_path)
    assert fp8["precision_in_effect"] == "fp8" and fp8["fp8_emulated"] is False
    assert fp8["fp8_linear_layers"] > 0
    assert all(map(math.isfinite, losses(tmp_path)))
