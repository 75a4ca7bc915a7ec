"""scripts/gpu_check.sh --dry_run: the whole GPU plan rehearsed on CPU with the tiny model."""

import json
import sys

from conftest import REPO, run


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "check"
    result = run(
        ["bash", REPO / "scripts" / "gpu_check.sh", "--dry_run", "--output_dir", out],
        tmp_path,
        timeout=600,
        PYTHON=sys.executable,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] and summary["ok"]
    assert set(summary["steps"]) == {"gpu_tests", "benchmark", "finetune_fp32", "finetune_fp16"}
    tests = summary["steps"]["gpu_tests"]
    assert (
        tests["tests"] >= 6 and tests["skipped"] == tests["tests"]
    )  # no CUDA here: all skipped, none failed
    assert list(summary["benchmark"]["arms"]) == ["fp32", "bf16"]
    assert (out / "benchmark" / "results.png").exists()
    for arm in ("fp32", "fp16"):
        assert summary[f"finetune_{arm}"]["train_steps"] == 4
    assert summary["finetune_fp16"]["precision_in_effect"] == "fp32"  # a CPU: accelerate's fp16 is a no-op
    agreement = summary["loss_agreement"]
    assert agreement["steps"] == 4 and agreement["max_relative_difference"] < 1e-3
    text = (out / "summary.md").read_text()
    assert text == result.stdout[-len(text) :] or "## Paired benchmark" in result.stdout
    assert "| gpu_tests | 0 |" in text and "## Paired benchmark" in text and "| bf16 | bf16 |" in text
