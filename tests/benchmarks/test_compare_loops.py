"""benchmarks/compare_loops.py: every arm runs in its own process on the same work and the report
holds their figures and ratios (tiny model; the real comparison is a benchmark, see docs/results.md)."""

import json
import sys

import pytest
from conftest import GLUE_DIR, REPO, TINY_BERT, load_module, run

pytestmark = pytest.mark.heavy  # many processes: CI runs this file in a lane of its own (.ci/run)


def test_arms_run_and_report(tmp_path):
    output_dir = tmp_path / "report"
    command = [
        sys.executable,
        REPO / "benchmarks" / "compare_loops.py",
        "--arms",
        "recipe,minimal,trainer,trainer_padded",  # recipe_monitor: the recipe arm with one flag less
    ]
    command += ["--model_name_or_path", TINY_BERT, "--data_dir", GLUE_DIR, "--max_train_steps", 4]
    command += ["--per_device_train_batch_size", 8, "--max_seq_length", 384, "--output_dir", output_dir]
    command += ["--repeats", 1]  # the order of repeats and the paired ratios: the test below
    done = run(command, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((output_dir / "results.json").read_text())
    arms = ["recipe", "minimal", "trainer", "trainer_padded"]
    assert list(report["summary"]) == arms
    for arm, figures in report["summary"].items():
        assert figures["train_steps"] == 4, arm
        assert figures["train_seconds"] > 0 and figures["wall_seconds"] > figures["train_seconds"], arm
        assert figures["peak_rss_bytes"] > 0, arm
    # The same dynamic padding in the recipe, the minimal loop and Trainer; run_glue.py's pads every
    # sequence to max_seq_length: 4 batches of 8 sequences of 384 positions.
    padding = {arm: figures["padding_fraction"] for arm, figures in report["summary"].items()}
    assert padding["recipe"] == padding["minimal"] == padding["trainer"] < 0.5
    tokens = report["summary"]["trainer_padded"]["train_tokens"]
    assert padding["trainer_padded"] == 1 - tokens / (4 * 8 * 384) > padding["trainer"] + 0.1
    summary = report["summary"]
    assert summary["trainer"]["train_tokens"] == tokens  # the same sequences, padded differently
    assert summary["recipe"]["train_tokens"] == summary["minimal"]["train_tokens"]
    assert report["hardware"]["device_type"] == "cpu"
    table = (output_dir / "results.md").read_text()
    assert "Ratios vs recipe" in table and "| minimal |" in table and "| trainer_padded |" in table
    assert "| recipe | " in table


def test_repeats_alternate_the_arm_order_and_ratios_pair_runs_side_by_side(tmp_path, monkeypatch):
    """Three repeats of two arms with made-up step times (no processes): the order alternates
    (a, b / b, a / a, b), and the ratios are the hand-computed ones."""
    compare_loops = load_module(REPO / "benchmarks" / "compare_loops.py")
    step_seconds = {"recipe": [1.0, 2.0, 1.2], "minimal": [1.5, 2.0, 1.2]}
    order = []

    def fake_run(args, arm, work_dir):
        order.append(arm)
        seconds = step_seconds[arm][sum(1 for a in order if a == arm) - 1]
        figures = {"train_steps": 4, "train_seconds": 4 * seconds, "wall_seconds": 4 * seconds + 5}
        return {**figures, "step_seconds": seconds, "padding_fraction": 0.25, "peak_rss_bytes": 2**30}

    monkeypatch.setattr(compare_loops, "run_arm", fake_run)
    argv = ["--arms", "recipe,minimal", "--repeats", 3, "--max_train_steps", 4, "--output_dir", tmp_path]
    summary = compare_loops.main([str(a) for a in argv])
    assert order == ["recipe", "minimal", "minimal", "recipe", "recipe", "minimal"]
    # side by side: 1.5 / 1.0, 2.0 / 2.0, 1.2 / 1.2 -> median 1.0; fastest over fastest: 1.2 / 1.0
    assert summary["minimal"]["paired_step_ratio"] == 1.0
    assert summary["minimal"]["best_step_ratio"] == 1.2
    assert summary["minimal"]["step_seconds"] == 1.5  # the median of 1.5, 2.0, 1.2
    assert (
        "| minimal | 11.0 (1.122x)" in (tmp_path / "results.md").read_text()
    )  # medians 4 x 1.5 + 5 over 4 x 1.2 + 5
