"""scripts/compare_loops.py: every arm runs in its own process on the same work and the report
holds their figures and ratios (tiny model; the real comparison is a benchmark, see README)."""

import json
import sys

from conftest import GLUE_DIR, REPO, TINY_BERT, run


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
    command += ["--repeats", 2]
    done = run(command, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((output_dir / "results.json").read_text())
    arms = ["recipe", "bare", "trainer", "trainer_padded"]
    assert list(report["summary"]) == arms
    order = [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("repeat ")]
    assert order == [f"repeat 1/2 {arm}" for arm in arms] + [f"repeat 2/2 {arm}" for arm in arms[::-1]]
    for arm, figures in report["summary"].items():
        assert figures["train_steps"] == 4, arm
        assert figures["train_seconds"] > 0 and figures["wall_seconds"] > figures["train_seconds"], arm
        assert figures["peak_rss_bytes"] > 0, arm
        runs = report["runs"][arm]
        ratios = sorted(
            a["step_seconds"] / b["step_seconds"] for a, b in zip(runs, report["runs"]["recipe"], strict=True)
        )
        assert figures["paired_step_ratio"] == sum(ratios) / 2  # the median of two
    assert report["summary"]["recipe"]["paired_step_ratio"] == 1.0
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
    assert "| recipe | " in table and "(1.000x)" in table
