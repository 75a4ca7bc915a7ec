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
        "recipe,bare,recipe_monitor,trainer",
    ]
    command += ["--model_name_or_path", TINY_BERT, "--data_dir", GLUE_DIR, "--max_train_steps", 4]
    command += ["--per_device_train_batch_size", 8, "--output_dir", output_dir]
    done = run(command, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((output_dir / "results.json").read_text())
    assert list(report["summary"]) == ["recipe", "bare", "recipe_monitor", "trainer"]
    for arm, figures in report["summary"].items():
        assert figures["train_steps"] == 4, arm
        assert figures["train_seconds"] > 0 and figures["wall_seconds"] > figures["train_seconds"], arm
        assert figures["peak_rss_bytes"] > 0, arm
    assert report["hardware"]["device_type"] == "cpu"
    table = (output_dir / "results.md").read_text()
    assert "Ratios vs recipe." in table and "| bare |" in table and "| trainer |" in table
    assert "| recipe | " in table and "(1.000x)" in table
