"""scripts/compare_loops.py: every arm runs in its own process on the same work and the report
holds their figures and ratios (tiny model; the real comparison is a benchmark, see docs/results.md)."""

import json
import sys

import pytest
import torch
from conftest import GLUE_DIR, REPO, TINY_BERT, load_module, minilm_path, run
from safetensors.torch import load_file

pytestmark = pytest.mark.heavy  # many processes: CI runs this file in a lane of its own (.ci/run)


def test_arms_run_and_report(tmp_path):
    output_dir = tmp_path / "report"
    command = [
        sys.executable,
        REPO / "scripts" / "compare_loops.py",
        "--arms",
        "recipe,bare,trainer,trainer_padded",  # recipe_monitor: the recipe arm with one flag less
    ]
    command += ["--model_name_or_path", TINY_BERT, "--data_dir", GLUE_DIR, "--max_train_steps", 4]
    command += ["--per_device_train_batch_size", 8, "--max_seq_length", 384, "--output_dir", output_dir]
    command += ["--repeats", 1]  # the order of repeats and the paired ratios: the test below
    done = run(command, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((output_dir / "results.json").read_text())
    arms = ["recipe", "bare", "trainer", "trainer_padded"]
    assert list(report["summary"]) == arms
    for arm, figures in report["summary"].items():
        assert figures["train_steps"] == 4, arm
        assert figures["train_seconds"] > 0 and figures["wall_seconds"] > figures["train_seconds"], arm
        assert figures["peak_rss_bytes"] > 0, arm
    # The same dynamic padding in the recipe, the bare loop and Trainer; run_glue.py's pads every
    # sequence to max_seq_length: 4 batches of 8 sequences of 384 positions.
    padding = {arm: figures["padding_fraction"] for arm, figures in report["summary"].items()}
    assert padding["recipe"] == padding["bare"] == padding["trainer"] < 0.5
    tokens = report["summary"]["trainer_padded"]["train_tokens"]
    assert padding["trainer_padded"] == 1 - tokens / (4 * 8 * 384) > padding["trainer"] + 0.1
    summary = report["summary"]
    assert summary["trainer"]["train_tokens"] == tokens  # the same sequences, padded differently
    assert summary["recipe"]["train_tokens"] == summary["bare"]["train_tokens"]
    assert report["hardware"]["device_type"] == "cpu"
    table = (output_dir / "results.md").read_text()
    assert "Ratios vs recipe" in table and "| bare |" in table and "| trainer_padded |" in table
    assert "| recipe | " in table


def test_repeats_alternate_the_arm_order_and_ratios_pair_runs_side_by_side(tmp_path, monkeypatch):
    """Three repeats of two arms with made-up step times (no processes): the order alternates
    (a, b / b, a / a, b), and the ratios are the hand-computed ones."""
    compare_loops = load_module(REPO / "scripts" / "compare_loops.py")
    step_seconds = {"recipe": [1.0, 2.0, 1.2], "bare": [1.5, 2.0, 1.2]}
    order = []

    def fake_run(args, arm, work_dir):
        order.append(arm)
        seconds = step_seconds[arm][sum(1 for a in order if a == arm) - 1]
        figures = {"train_steps": 4, "train_seconds": 4 * seconds, "wall_seconds": 4 * seconds + 5}
        return {**figures, "step_seconds": seconds, "padding_fraction": 0.25, "peak_rss_bytes": 2**30}

    monkeypatch.setattr(compare_loops, "run_arm", fake_run)
    argv = ["--arms", "recipe,bare", "--repeats", 3, "--max_train_steps", 4, "--output_dir", tmp_path]
    summary = compare_loops.main([str(a) for a in argv])
    assert order == ["recipe", "bare", "bare", "recipe", "recipe", "bare"]
    # side by side: 1.5 / 1.0, 2.0 / 2.0, 1.2 / 1.2 -> median 1.0; fastest over fastest: 1.2 / 1.0
    assert summary["bare"]["paired_step_ratio"] == 1.0
    assert summary["bare"]["best_step_ratio"] == 1.2
    assert summary["bare"]["step_seconds"] == 1.5  # the median of 1.5, 2.0, 1.2
    assert (
        "| bare | 11.0 (1.122x)" in (tmp_path / "results.md").read_text()
    )  # medians 4 x 1.5 + 5 over 4 x 1.2 + 5


def test_recipe_trains_exactly_as_the_bare_loop_on_a_model_that_learns(tmp_path):
    """The recipe against an independent reference: compare_loops.py's bare accelerate loop (a
    dozen plain lines) on the same work, pretrained MiniLM on MRPC crossing two epoch boundaries,
    gradients accumulated over 2 batches. Every step's loss and the final weights are the same, and the loss falls (the weights really
    move, so a wrong schedule, clipping, decay or batch order shows). This replaces losses the
    recipe once recorded of itself."""
    work = dict(
        task_name="mrpc",  # sentence pairs: token_type_ids matter
        data_dir=str(GLUE_DIR),
        model_name_or_path=str(minilm_path()),
        max_seq_length=128,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,  # optimizer steps of 16 sequences
        learning_rate=3e-4,
        weight_decay=0.01,
        warmup_ratio=0.1,
        max_grad_norm=1.0,
        num_train_epochs=1,
        seed=7,
        max_train_steps=12,
        max_train_samples=64,  # 4 optimizer steps an epoch: 3 epochs, each reshuffled
    )
    bare_dir = tmp_path / "bare"
    bare_dir.mkdir()
    spec = bare_dir / "spec.json"
    spec.write_text(json.dumps({**work, "work_dir": str(bare_dir), "save_weights": True}))
    script = REPO / "scripts" / "compare_loops.py"
    done = run([sys.executable, script, "--worker", f"bare,{spec},{bare_dir / 'result.json'}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    bare = json.loads((bare_dir / "result.json").read_text())

    flags = [arg for name, value in work.items() for arg in (f"--{name}", value)]
    recipe_dir = tmp_path / "recipe"
    command = [sys.executable, REPO / "recipes" / "bert_glue.py", *flags, "--logging_steps", 1]
    done = run([*command, "--max_eval_samples", 8, "--output_dir", recipe_dir], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    history = [json.loads(line) for line in (recipe_dir / "log_history.jsonl").read_text().splitlines()]
    recipe_losses = [row["loss"] for row in history if "loss" in row]

    assert len(bare["losses"]) == 24 and len(recipe_losses) == 12
    bare_losses = torch.tensor(bare["losses"]).view(12, 2).mean(dim=1)  # per step: its 2 batches' mean
    torch.testing.assert_close(torch.tensor(recipe_losses), bare_losses, rtol=1e-6, atol=1e-6)
    assert sum(recipe_losses[-4:]) < sum(recipe_losses[:4]) - 0.4  # it learns (measured: 2.76 -> 2.16)
    recipe_weights = load_file(recipe_dir / "model.safetensors")
    bare_weights = load_file(bare_dir / "model.safetensors")
    assert recipe_weights.keys() == bare_weights.keys()
    initial = load_file(minilm_path() / "model.safetensors")
    moved = 0
    for name, tensor in bare_weights.items():
        torch.testing.assert_close(recipe_weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        pretrained = initial.get(name.removeprefix("bert."))
        moved += pretrained is not None and not torch.equal(pretrained, tensor)
    assert moved > 50  # the encoder (104 pretrained tensors) was trained, not only the new head
