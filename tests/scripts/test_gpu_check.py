"""scripts/gpu_check.sh --dry_run: the whole GPU plan rehearsed on CPU with the tiny model."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, fp8_env, load_module, offline_env, run

pytestmark = pytest.mark.heavy  # many processes: CI runs this file in a lane of its own (.ci/run)


def check_command(out, *flags):
    return ["bash", REPO / "scripts" / "gpu_check.sh", "--dry_run", "--output_dir", out, *flags]


def assert_output_fits_what_comes_back(out):
    """At most 8 files, none in a folder, each under 16 MiB: what the GPU machine returns."""
    entries = list(out.iterdir())
    assert all(entry.is_file() for entry in entries), entries
    assert len(entries) <= 8 and all(entry.stat().st_size < 16 * 2**20 for entry in entries)


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "check"
    result = run(
        check_command(out),
        tmp_path,
        timeout=900,
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
        "bf16_fine_tune_ran_bf16": True,
        "fp16_loss_agrees_with_fp32": True,
        "fp16_model_reloads_to_its_scores": True,
        "fp8_arms_ran_fp8": True,  # emulated: accepted in the dry run only
    }
    # In order of value, all inside the budget.
    assert list(summary["steps"]) == [
        *("gpu_tests", "finetune_fp32", "finetune_fp16", "finetune_bf16", "reload_fp16"),
        *("benchmark", "fp8_seq32", "compiled"),
    ]
    assert not any(step["timed_out"] for step in summary["steps"].values())
    assert summary["seconds"] <= summary["budget_s"]
    tests = summary["steps"]["gpu_tests"]
    assert (
        tests["tests"] >= 6 and tests["skipped"] == tests["tests"]
    )  # no CUDA here: all skipped, none failed
    assert list(summary["benchmark"]["arms"]) == ["fp32", "bf16"]
    for arm in ("fp32", "fp16", "bf16"):
        assert summary[f"finetune_{arm}"]["train_steps"] == 4
    assert summary["finetune_fp16"]["precision_in_effect"] == "fp32"  # a CPU: accelerate's fp16 is a no-op
    fp16_scores = {k: v for k, v in summary["finetune_fp16"].items() if k.startswith("eval_")}
    assert summary["reload_fp16"] == fp16_scores and fp16_scores["eval_samples"] == 32
    agreement = summary["loss_agreement"]
    assert agreement["steps"] == 4 and agreement["max_relative_difference"] < 1e-3
    assert summary["loss_agreement_bf16"]["steps"] == 4
    assert summary["compiled"]["arms"]["fp32+compile"]["fits"]
    # Everything directly in --output_dir: the summary, the log of every step, pytest's report, the chart.
    assert sorted(p.name for p in out.iterdir()) == [
        "benchmark.png",
        "check.log",
        "pytest.xml",
        "summary.json",
        "summary.md",
    ]
    assert_output_fits_what_comes_back(out)
    assert "== reload_fp16 (limit" in (out / "check.log").read_text()
    text = (out / "summary.md").read_text()
    assert result.stdout.rstrip().endswith(text.rstrip())
    assert "| gpu_tests | 0 |" in text and "## Paired benchmark" in text and "| bf16 | bf16 |" in text
    assert "**ok**: every_step_finished_in_time yes" in text and "## Compiled arms" in text
    for seq_len in ("32",):  # the GPU plan's two lengths (128, 384): one in the dry run
        arms = summary["fp8"]["by_seq_len"][seq_len]["arms"]
        assert list(arms) == ["fp32", "bf16", "fp8"] and arms["fp8"]["fp8_linear_layers"] == 12
        assert f"## fp8 benchmark, seq {seq_len}" in text
    # 2 layers x 6 Linear layers of width 32/64, the pooler and the classifier: all but the first
    # (layer 0's query) and the last (the classifier, 32 -> 2) run in fp8.
    assert arms["fp8"]["linear_layers"] == 14 and arms["fp8"]["no_ratio_reason"].startswith(
        "fp8 was emulated"
    )


def test_the_h200_plan_fits_its_420_seconds():
    gpu_check = load_gpu_check()
    assert gpu_check.BUDGET_S[False] == 420
    assert sum(gpu_check.LIMITS[False].values()) + gpu_check.STARTUP_S <= 420
    # every step of the plan has a limit, on the GPU and in the dry run
    for dry_run in (False, True):
        names = {"gpu_tests", "benchmark", "compiled", "reload_fp16"}
        names |= {f"finetune_{arm}" for arm in ("fp32", "fp16", "bf16")}
        names |= {f"fp8_seq{n}" for n in gpu_check.FP8_SEQ_LENS[dry_run]}
        assert set(gpu_check.LIMITS[dry_run]) == names


def test_a_step_that_does_not_fit_the_budget_is_not_started():
    budget = load_gpu_check().Budget(100, started=0.0, clock=lambda: 70.0)
    assert budget.refusal(30) is None
    assert budget.refusal(40) == "budget: needs 40 s, 30 s left"


def test_a_check_out_of_budget_records_its_steps_as_not_run(tmp_path):
    out = tmp_path / "check"
    result = run(check_command(out, "--steps", "finetune", "--budget_s", 30), tmp_path, PYTHON=sys.executable)
    assert result.returncode == 1  # nothing measured: not ok
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["steps"]) == ["finetune_fp32", "finetune_fp16", "finetune_bf16"]
    assert all(step["not_run"].startswith("budget: needs 60 s, ") for step in summary["steps"].values())
    assert summary["checks"]["fp16_fine_tune_ran_fp16"] is False and not summary["ok"]
    assert "| finetune_fp32 | not run: budget: needs 60 s," in (out / "summary.md").read_text()


def tagged_processes(tag: str) -> list[int]:
    """PIDs whose environment carries GPU_CHECK_TEST=<tag> (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"GPU_CHECK_TEST={tag}".encode() in (entry / "environ").read_bytes():
                if not (entry / "stat").read_text().split(") ")[1].startswith("Z"):
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_check_killed_at_any_moment_leaves_a_readable_summary_and_no_process(tmp_path):
    """Killed at random moments, as a machine's time limit would (SIGKILL, which no handler sees,
    and SIGTERM); the moments are printed so that a failure can be replayed."""
    rng = random.Random()
    for attempt, signum in enumerate((signal.SIGKILL, signal.SIGTERM)):
        out, tag = tmp_path / f"check{attempt}", f"{tmp_path}-{attempt}"
        moment = rng.uniform(4, 45)  # set-up, the tests, the fine-tunes, the benchmark starting
        print(f"attempt {attempt}: {signum.name} after {moment:.1f} s")
        env = offline_env(tmp_path, PYTHON=sys.executable, GPU_CHECK_TEST=tag, **fp8_env())
        process = subprocess.Popen(
            [str(c) for c in check_command(out)], cwd=REPO, env=env, stdout=subprocess.DEVNULL
        )
        try:
            process.wait(timeout=moment)
        except subprocess.TimeoutExpired:
            process.send_signal(signum)  # the check's own process (gpu_check.sh execs it)
            process.wait(timeout=60)
        deadline = time.monotonic() + 15
        while tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = tagged_processes(tag)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, (
            f"attempt {attempt}: processes outlived the check ({signum.name} at {moment:.1f} s)"
        )
        if not (out / "summary.json").exists():
            assert not (out / "check.log").exists()  # killed before any step started
            continue
        assert_output_fits_what_comes_back(out)
        summary = json.loads((out / "summary.json").read_text())  # whole, never half-written
        assert (out / "summary.md").read_text().startswith("# GPU check (dry run, CPU)")
        for name, step in summary["steps"].items():
            if step.get("exit_code") == 0 and name.startswith("finetune_"):
                assert summary[name]["train_steps"] == 4, (name, moment)
            if step.get("exit_code") == 0 and name == "gpu_tests":
                assert step["tests"] >= 6


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
        "finetune_fp16": {"precision_in_effect": "fp16", "eval_accuracy": 0.8, "eval_samples": 256},
        "finetune_bf16": {"precision_in_effect": "bf16"},
        "reload_fp16": {"eval_accuracy": 0.8, "eval_samples": 256},
        "loss_agreement": {"max_relative_difference": 0.01},
    }
    summary["steps"]["gpu_tests"] = {**step, "tests": 7, "failures": 0, "errors": 0, "skipped": 0}
    checks = gpu_check.checks(summary)
    assert checks.pop("fp8_arms_ran_fp8") is None and all(checks.values())  # fp8 not asked for
    summary["benchmark"]["arms"]["fp16"]["precision_in_effect"] = "fp32"  # accelerate fell back
    summary["loss_agreement"]["max_relative_difference"] = 0.2
    summary["overflow_test"] = "skipped"
    summary["reload_fp16"]["eval_accuracy"] = 0.5  # the saved model is not the one that was evaluated
    failed = {name for name, value in gpu_check.checks(summary).items() if value is False}
    assert failed == {
        *("every_arm_ran_its_precision", "fp16_loss_agrees_with_fp32", "overflow_step_skipped"),
        "fp16_model_reloads_to_its_scores",
    }
    summary["benchmark"]["arms"]["fp16"] = {
        "fits": False,
        "crashed": "the fp16 arm crashed at batch 32 (exit 1): ...",
    }
    assert gpu_check.checks(summary)["every_arm_ran_its_precision"] is False


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
        "steps": {"fp8_seq128": step, "fp8_seq384": step},
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
    summary.update(budget_s=420, tables={})
    text = gpu_check.summary_markdown(summary)
    assert "## fp8\n\nNot run: fp8 was asked on NVIDIA A100 (compute capability 8.0)" in text


def test_unknown_steps_are_refused(capsys):
    with pytest.raises(SystemExit):
        load_gpu_check().parse_args(["--steps", "fp8,fp4"])
    assert (
        "--steps: unknown ['fp4']; choose from gpu_tests, finetune, benchmark, fp8, compiled."
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


def test_a_missing_import_stops_the_check_before_any_step(monkeypatch):
    gpu_check = load_gpu_check()
    assert {"datasets", "evaluate", "transformers", "accelerate"} <= set(gpu_check.NEEDED)
    gpu_check.preflight()  # this machine has them all
    monkeypatch.setitem(gpu_check.NEEDED, "no_such_package", "carried wheels (no_such_package)")
    with pytest.raises(SystemExit) as stop:
        gpu_check.preflight()
    assert str(stop.value).startswith(
        "error: missing no_such_package (carried wheels (no_such_package)): run `bash scripts/fetch_gpu_wheels.sh`"
    )


def test_a_check_killed_outright_takes_its_steps_grandchildren_along(tmp_path):
    """SIGKILL to the check (no handler runs): the reaper leading the step's group kills the step
    and the processes it started, not only its first process."""
    marker = tmp_path / "grandchild-survived"
    check = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import importlib.util, os;"
            "spec = importlib.util.spec_from_file_location('gpu_check', 'scripts/gpu_check.py');"
            "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g);"
            f"g.run_step('s', ['bash', '-c', 'echo started; (sleep 4; touch {marker}) & wait'], '{tmp_path / 's.log'}', "
            "dict(os.environ), timeout=60)",
        ],
        cwd=REPO,
    )
    deadline = time.monotonic() + 30
    while "\nstarted" not in ((tmp_path / "s.log").read_text() if (tmp_path / "s.log").exists() else ""):
        assert time.monotonic() < deadline and check.poll() is None
        time.sleep(0.1)
    time.sleep(1)  # the reaper, bash and its sleeping child are running
    assert check.poll() is None, "the check ended before it was killed"
    check.send_signal(signal.SIGKILL)
    check.wait()
    time.sleep(5)
    assert not marker.exists()
