"""scripts/gpu_check.sh --dry_run: the whole GPU plan rehearsed on CPU with the tiny model."""

import json
import os
import sys

from conftest import REPO, load_module, run


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
    assert summary["checks"] == {
        "every_step_finished_in_time": True,
        "gpu_tests_passed": True,  # on a CPU: every gpu test skipped, none failed
        "overflow_step_skipped": None,  # needs CUDA
        "every_arm_ran_its_precision": True,
        "fp16_fine_tune_ran_fp16": True,  # on a CPU: the fp32 accelerate really runs
        "fp16_loss_agrees_with_fp32": True,
    }
    assert not any(step["timed_out"] for step in summary["steps"].values())
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
    assert "**ok**: every_step_finished_in_time yes" in text


def load_gpu_check():
    return load_module(REPO / "scripts" / "gpu_check.py")


def test_a_step_past_its_limit_is_killed_with_its_children_and_reported(tmp_path):
    gpu_check = load_gpu_check()
    marker = tmp_path / "child-survived"
    # A parent that waits on a child, as the benchmark waits on its trial processes.
    command = ["bash", "-c", f"(sleep 3; touch {marker}) & wait"]
    step = gpu_check.run_step("slow", command, tmp_path / "slow.log", dict(os.environ), timeout=1)
    assert step["timed_out"] and step["seconds"] < 3
    import time

    time.sleep(3)
    assert not marker.exists()  # the whole process group was killed


def test_checks_fail_on_figures_even_when_every_exit_code_is_zero():
    gpu_check = load_gpu_check()
    step = {"exit_code": 0, "timed_out": False}
    summary = {
        "dry_run": False,
        "steps": {name: step for name in ("gpu_tests", "benchmark", "finetune_fp32", "finetune_fp16")},
        "overflow_test": "passed",
        "benchmark": {
            "arms": {a: {"precision_in_effect": a, "fits": True} for a in ("fp32", "tf32", "fp16", "bf16")}
        },
        "finetune_fp16": {"precision_in_effect": "fp16"},
        "loss_agreement": {"max_relative_difference": 0.01},
    }
    summary["steps"]["gpu_tests"] = {**step, "tests": 7, "failures": 0, "errors": 0, "skipped": 0}
    assert all(gpu_check.checks(summary).values())
    summary["benchmark"]["arms"]["fp16"]["precision_in_effect"] = "fp32"  # accelerate fell back
    summary["loss_agreement"]["max_relative_difference"] = 0.2
    summary["overflow_test"] = "skipped"
    failed = {name for name, value in gpu_check.checks(summary).items() if value is False}
    assert failed == {"every_arm_ran_its_precision", "fp16_loss_agrees_with_fp32", "overflow_step_skipped"}


def test_the_check_fine_tunes_with_the_real_uncased_tokenizer(tmp_path):
    """The model the check builds from data/models/bert-base-uncased: the real 30,522-token
    vocabulary (transformers 5's BertTokenizerFast(vocab_file=...) silently gave 5 tokens)."""

    from transformers import AutoConfig, AutoTokenizer

    gpu_check = load_gpu_check()
    folder = gpu_check.random_bert(tmp_path / "model", **gpu_check.TINY)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 30522
    assert tokenizer("Hello world")["input_ids"] == [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    config = AutoConfig.from_pretrained(folder)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (30522, 32, 2)
