"""scripts/gpu_check.sh --dry_run: the whole GPU plan rehearsed on CPU with the tiny model."""

import json
import os
import sys

from conftest import REPO, fp8_env, load_module, run


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "check"
    result = run(
        ["bash", REPO / "scripts" / "gpu_check.sh", "--dry_run", "--output_dir", out],
        tmp_path,
        timeout=600,
        PYTHON=sys.executable,
        **fp8_env(),  # the fp8 step emulated on this CPU (tests/fp8_emulation); refused without it
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
        "fp8_arms_ran_fp8": True,  # emulated: accepted in the dry run only
    }
    assert not any(step["timed_out"] for step in summary["steps"].values())
    assert set(summary["steps"]) == {
        *("gpu_tests", "benchmark", "finetune_fp32", "finetune_fp16"),
        *("benchmark_fp8_seq32", "benchmark_fp8_seq64"),
    }
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
    for seq_len in ("32", "64"):
        arms = summary["fp8"]["by_seq_len"][seq_len]["arms"]
        assert list(arms) == ["fp32", "bf16", "fp8"] and arms["fp8"]["fp8_linear_layers"] == 12
        assert f"## fp8 benchmark, seq {seq_len}" in text
    # 2 layers x 6 Linear layers of width 32/64, the pooler and the classifier: all but the first
    # (layer 0's query) and the last (the classifier, 32 -> 2) run in fp8.
    assert arms["fp8"]["linear_layers"] == 14 and arms["fp8"]["no_ratio_reason"].startswith(
        "fp8 was emulated"
    )


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
        "planned_steps": ["gpu_tests", "benchmark", "finetune"],  # fp8: the test below
        "steps": {name: step for name in ("gpu_tests", "benchmark", "finetune_fp32", "finetune_fp16")},
        "overflow_test": "passed",
        "benchmark": {
            "arms": {a: {"precision_in_effect": a, "fits": True} for a in ("fp32", "tf32", "fp16", "bf16")}
        },
        "finetune_fp16": {"precision_in_effect": "fp16"},
        "loss_agreement": {"max_relative_difference": 0.01},
    }
    summary["steps"]["gpu_tests"] = {**step, "tests": 7, "failures": 0, "errors": 0, "skipped": 0}
    checks = gpu_check.checks(summary)
    assert checks.pop("fp8_arms_ran_fp8") is None and all(checks.values())  # fp8 not asked for
    summary["benchmark"]["arms"]["fp16"]["precision_in_effect"] = "fp32"  # accelerate fell back
    summary["loss_agreement"]["max_relative_difference"] = 0.2
    summary["overflow_test"] = "skipped"
    failed = {name for name, value in gpu_check.checks(summary).items() if value is False}
    assert failed == {"every_arm_ran_its_precision", "fp16_loss_agrees_with_fp32", "overflow_step_skipped"}


def test_fp8_alone_and_fp8_where_it_cannot_run():
    gpu_check = load_gpu_check()
    step = {"exit_code": 0, "timed_out": False, "seconds": 60}
    fp8_arm = {"fits": True, "precision_in_effect": "fp8", "fp8_linear_layers": 72, "fp8_emulated": False}
    by_seq_len = {
        str(n): {"arms": {"fp32": {}, "fp8": dict(fp8_arm), "fp8+compile": dict(fp8_arm)}} for n in (128, 384)
    }
    summary = {
        "dry_run": False,
        "planned_steps": ["fp8"],
        "steps": {"benchmark_fp8_seq128": step, "benchmark_fp8_seq384": step},
        "fp8": {"not_run": None, "by_seq_len": by_seq_len},
    }
    checks = gpu_check.checks(summary)
    assert checks.pop("every_step_finished_in_time") and checks.pop("fp8_arms_ran_fp8")
    assert set(checks.values()) == {None}  # the steps not asked for are not failures
    by_seq_len["384"]["arms"]["fp8+compile"]["fp8_emulated"] = True  # emulated is no fp8 on a GPU
    assert gpu_check.checks(summary)["fp8_arms_ran_fp8"] is False
    del by_seq_len["384"]  # a length that never finished
    by_seq_len["128"]["arms"]["fp8"]["fp8_emulated"] = by_seq_len["128"]["arms"]["fp8+compile"][
        "fp8_emulated"
    ] = False
    assert gpu_check.checks(summary)["fp8_arms_ran_fp8"] is False
    summary["fp8"] = {
        "not_run": "fp8 was asked on NVIDIA A100 (compute capability 8.0), ...",
        "by_seq_len": {},
    }
    assert gpu_check.checks(summary)["fp8_arms_ran_fp8"] is None
    summary.update(date="now", device="A100", ok=True, checks=gpu_check.checks(summary))
    text = gpu_check.summary_markdown(summary, REPO / "no-such-dir")
    assert "## fp8\n\nNot run: fp8 was asked on NVIDIA A100 (compute capability 8.0)" in text


def test_unknown_steps_are_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        load_gpu_check().parse_args(["--steps", "fp8,fp4"])
    assert (
        "--steps: unknown ['fp4']; choose from gpu_tests, benchmark, finetune, fp8."
        in capsys.readouterr().err
    )


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
