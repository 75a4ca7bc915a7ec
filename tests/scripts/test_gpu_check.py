"""scripts/gpu_check.sh --dry_run: the whole GPU plan rehearsed on CPU with the tiny model, with its
process count, its deadlines, its verdict, its agreement criterion and its cleanup. The dry run runs
as docs/gpu-check.md writes it, in the environment a user has: no test seam on PYTHONPATH."""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    Fp16OnCpu,
    load_module,
    load_recipe,
    offline_env,
    reset_accelerate,
    run,
    run_processes,
    train,
)

pytestmark = pytest.mark.heavy  # many processes: CI runs this file in a lane of its own (.ci/run)


def check_command(out, *flags):
    """The dry run as docs/gpu-check.md writes it."""
    return ["bash", REPO / "scripts" / "gpu_check.sh", "--dry_run", "--output_dir", out, *flags]


def plain_env(tmp_path, **extra) -> dict:
    """A user's environment on a CPU machine (offline: no Hub here): no test seam on PYTHONPATH,
    nothing of accelerate's or DeepSpeed's set. PYTHON is this test's interpreter (its packages)."""
    env = offline_env(tmp_path, PYTHON=sys.executable, **extra)
    for name in [k for k in env if k.startswith("ACCELERATE_") or k in ("PYTHONPATH", "DS_ACCELERATOR")]:
        env.pop(name)
    return env


class ProcessCensus(threading.Thread):
    """Every Python process of a run, seen in /proc every 50 ms while it runs (each lives seconds):
    the processes whose environment carries AMP_SCALE_OUT_TEST=<tag>, with their command line.

    A command line is read again at every look, the last one kept: between fork and exec a child
    still shows its parent's (a CI run once counted the reload step as a second check), and after
    exec it shows its own. An empty one (a process exiting) leaves the last one read. A child last
    seen with its parent's command line was never seen after its exec: it exec'd without the tag
    (the check's cleanup watcher, counted once as a second check), or exec'd and exited between two
    looks, or never exec'd. It is not one of the run's programs, so stop() leaves it out."""

    def __init__(self, tag: str):
        super().__init__(daemon=True)
        self.tag, self.seen, self.parents, self.running = tag, {}, {}, True

    def run(self):
        while self.running:
            for pid in run_processes(self.tag):
                with contextlib.suppress(OSError):
                    argv = [
                        part.decode()
                        for part in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                        if part
                    ]
                    if not argv:
                        continue
                    if pid not in self.parents:  # the process that forked it
                        stat = Path(f"/proc/{pid}/stat").read_text()
                        self.parents[pid] = int(stat.rsplit(") ", 1)[1].split()[1])
                    if Path(argv[0]).name.startswith("python"):
                        self.seen[pid] = " ".join(argv)
                    else:  # it exec'd something other than Python after the look that counted it
                        self.seen.pop(pid, None)
            time.sleep(0.05)

    def stop(self) -> dict:
        self.running = False
        self.join()
        return {
            pid: command
            for pid, command in self.seen.items()
            if self.seen.get(self.parents.get(pid)) != command
        }


def load_gpu_check():
    return load_module(REPO / "scripts" / "gpu_check.py")


def assert_output_fits_what_comes_back(out):
    """At most 8 files, none in a folder, each under 16 MiB."""
    entries = list(out.iterdir())
    assert all(entry.is_file() for entry in entries), entries
    assert len(entries) <= 8 and all(entry.stat().st_size < 16 * 2**20 for entry in entries)


def roles(commands) -> list[str]:
    """What each Python process of the check was, from its command line."""
    found = []
    for command in commands:
        if "--measure" in command:
            found.append("benchmark")
        elif "scripts/gpu_check.py" in command:
            found.append("check")
        elif "pytest" in command:
            found.append("pytest")
        elif "accelerate.commands.launch" in command:
            found.append("launcher")
        elif "amp_recipes.cli doctor" in command:
            found.append("doctor")
        elif "bert_glue.py" in command:
            found.append("reload" if "--eval_only" in command else "recipe")
        else:
            found.append(command)
    return found


def test_gpu_check_dry_run(tmp_path):
    """`bash scripts/gpu_check.sh --dry_run --output_dir ...` on this CPU, as a user runs it before
    renting a GPU: the same plan on what a CPU runs (the bf16 fine-tune as DDP over gloo: accelerate
    sets FSDP up only over GPU process groups; no fp8), and the verdict ok."""
    out, tag = tmp_path / "check", f"{tmp_path}-census"
    census = ProcessCensus(tag)
    census.start()
    try:
        result = run(check_command(out), tmp_path, timeout=900, **plain_env(tmp_path, AMP_SCALE_OUT_TEST=tag))
    finally:
        commands = census.stop()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] and summary["verdict"] == "ok" and summary["ok"]
    assert summary["checks"] == {
        "gpu_tests_passed": True,  # on a CPU: every gpu test skipped, none failed
        "overflow_step_skipped": None,  # needs CUDA
        "fp16_fine_tune_ran_fp16_with_a_loss_scale": True,  # on a CPU: accelerate's fp16 says fp32
        "bf16_fine_tune_ran_bf16": True,  # DDP over gloo on a CPU
        "bf16_fine_tune_ran_under_fsdp2": None,  # needs GPUs (accelerate)
        "fp16_loss_agrees_with_fp32": True,
        "bf16_loss_agrees_with_fp32": True,
        "fp16_model_reloads_to_its_scores": True,
        "doctor_measured_every_precision": True,  # on a CPU: fp32 and bf16, the largest batch predicted
        "every_arm_ran_its_precision": True,
        "fp8_arms_ran_fp8": None,  # needs an fp8 GPU
    }
    assert summary["not_measured"] == dict.fromkeys(
        ("overflow_step_skipped", "bf16_fine_tune_ran_under_fsdp2", "fp8_arms_ran_fp8"), "n/a"
    )
    # The Python processes: on one GPU the FSDP2 fine-tune has one worker, here two (a CPU
    # process group needs two), so the plan on a GPU starts one fewer.
    started = roles(commands.values())
    assert sorted(started) == sorted(
        [
            "check",
            "pytest",
            "recipe",
            "recipe",
            "launcher",
            "recipe",
            "recipe",
            "reload",
            "doctor",
            "benchmark",
        ]
    ), started
    assert len(started) - (2 - 1) == 9
    assert list(summary["steps"]) == [
        *(
            "gpu_tests",
            "finetune_fp32",
            "finetune_fp16",
            "finetune_bf16",
            "reload_fp16",
            "doctor",
            "benchmark",
        ),
    ]
    assert all(step["status"] == "done" for step in summary["steps"].values())
    assert summary["seconds"] <= summary["budget_s"]
    shares = [step["share_s"] for step in summary["steps"].values()]
    assert sum(step["seconds"] for step in summary["steps"].values()) <= summary["budget_s"]
    assert shares[-1] > max(shares[:-1])  # the benchmark, last, takes what the others left
    tests = summary["steps"]["gpu_tests"]
    assert tests["tests"] >= 6 and tests["skipped"] == tests["tests"]  # no CUDA here
    for arm in ("fp32", "fp16", "bf16"):
        assert summary[f"finetune_{arm}"]["train_steps"] == 32
    assert (summary["bf16_engine"], summary["finetune_bf16"]["distributed_type"]) == (
        "MULTI_CPU",
        "MULTI_CPU",
    )
    assert summary["finetune_bf16"]["checkpoints"] == ["checkpoint-32"]
    fp16_scores = {k: v for k, v in summary["finetune_fp16"].items() if k.startswith("eval_")}
    assert summary["reload_fp16"] == fp16_scores and fp16_scores["eval_samples"] == 32
    agreement = summary["loss_agreement_fp16"]
    assert agreement["steps"] == 32 and agreement["fp32_learned"] > 0.2  # the memorized examples
    # A CPU's fp16 is fp32: the same losses but for rounding (fp16's batches are padded to a
    # multiple of 8, so the kernels see other shapes).
    assert agreement["difference"] < 1e-6
    assert summary["loss_agreement_bf16"]["difference_of_learned"] < 0.25
    assert summary["fp8_not_run"].startswith("fp8 was asked on a cpu")
    benchmark = summary["benchmark"]
    assert list(benchmark) == ["precisions", "compiled"]
    assert list(benchmark["precisions"]["arms"]) == ["fp32", "bf16"]
    assert benchmark["precisions"]["config"]["in_process"] and benchmark["precisions"]["complete"]
    assert {arm["pid"] for series in benchmark.values() for arm in series["arms"].values()} == {
        pid for pid, command in commands.items() if "--measure" in command
    }  # every arm of every series in the one benchmark process
    assert benchmark["compiled"]["arms"]["fp32+compile"]["compiled_graphs"] >= 1
    assert sorted(p.name for p in out.iterdir()) == [
        *("benchmark.png", "check.log", "doctor.md", "pytest.xml", "summary.json", "summary.md"),
    ]
    assert_output_fits_what_comes_back(out)
    text = (out / "summary.md").read_text()
    assert result.stdout.rstrip().endswith(text.rstrip())
    assert "| gpu_tests | done |" in text and "## Paired benchmark" in text and "| bf16 | bf16 |" in text
    assert "**ok**: gpu_tests_passed yes, overflow_step_skipped n/a" in text
    assert "bf16_fine_tune_ran_under_fsdp2 n/a" in text and "## Compiled arms" in text
    assert "## fp8\n\nNot run: fp8 was asked on a cpu" in text
    doctor = summary["doctor"]
    assert set(doctor["speed"]) == set(doctor["largest_batch"]) == {"fp32", "bf16"}
    assert "| doctor | done |" in text and "fp16: no activation overflow" in text
    assert (out / "doctor.md").read_text().startswith("# Precision doctor: bert_glue")


def test_correctness_steps_may_use_all_but_the_later_steps_needs():
    """A step that decides correctness may run until only the later steps' needs are left, so that a
    first run on a GPU at the default budget reaches every correctness verdict (its CUDA tests
    compile cold); the doctor gets its need and its weight's part of the rest against the
    benchmark, which takes what is left. Short of time, the needs in order."""
    gpu_check = load_gpu_check()
    needs, weights = gpu_check.STEP_NEEDS_S, gpu_check.STEP_WEIGHTS
    steps = gpu_check.planned_steps(gpu_check.STEPS)
    total = sum(needs[step] for step in steps)
    assert gpu_check.BUDGET_S >= total  # the default holds every need

    def at(left):
        return gpu_check.Budget(left, started=0.0, clock=lambda: 0.0)

    later = sum(needs[step] for step in steps[1:])
    assert at(gpu_check.BUDGET_S).share("gpu_tests", steps) == gpu_check.BUDGET_S - later
    assert at(gpu_check.BUDGET_S).share("gpu_tests", steps) >= needs["gpu_tests"] + 90  # room beyond its need
    tail = ["doctor", "benchmark"]
    spare = 100
    doctor = at(needs["doctor"] + needs["benchmark"] + spare).share("doctor", tail)
    assert doctor == needs["doctor"] + spare * weights["doctor"] / (weights["doctor"] + weights["benchmark"])
    assert at(500).share("benchmark", ["benchmark"]) == 500  # the last step takes all that is left
    short = at(needs["gpu_tests"] + 10)
    assert short.share("gpu_tests", steps) == needs["gpu_tests"]  # short: its need first
    assert at(30).share("gpu_tests", steps) == 30
    assert at(10).share("doctor", tail) == 10
    assert gpu_check.Budget(10, started=0.0, clock=lambda: 20.0).share("benchmark", ["benchmark"]) == 0.0


def test_a_check_out_of_time_reads_partial_not_failed(tmp_path):
    """A budget the fine-tunes cannot fit (less than one fine-tune's start-up, STARTUP_S): each is
    stopped at its deadline or not started, and the check says "partial: time" (exit 3), never
    NOT OK, and no check reads NO."""
    out = tmp_path / "check"
    startup = load_gpu_check().STARTUP_S
    budget = min(startup["finetune_fp32"], startup["reload_fp16"]) - 2
    result = run(
        check_command(out, "--steps", "finetune", "--budget_s", budget), tmp_path, **plain_env(tmp_path)
    )
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "partial: time" and not summary["ok"]
    assert list(summary["steps"]) == ["finetune_fp32", "finetune_fp16", "finetune_bf16", "reload_fp16"]
    assert {step["status"] for step in summary["steps"].values()} == {"partial: time"}
    assert False not in summary["checks"].values()
    assert summary["not_measured"]["fp16_loss_agrees_with_fp32"] == "partial: time"
    assert summary["not_measured"]["gpu_tests_passed"] == "not asked"
    text = (out / "summary.md").read_text()
    # stopped at its deadline, or not started where the check's own start-up took the budget
    fp32_row = next(line for line in text.splitlines() if line.startswith("| finetune_fp32 |"))
    assert fp32_row.startswith(
        ("| finetune_fp32 | partial: time |", "| finetune_fp32 | not run: no time left |")
    )
    assert "**partial: time**" in text


def summary_of(gpu_check, **figures):
    """A GPU check's summary as main() builds it, every step done, with `figures` over the good ones."""
    done = {"status": "done", "exit_code": 0, "seconds": 1, "share_s": 10}
    arm = {"fits": True, "precision_in_effect": "fp16"}
    fp8 = {"fits": True, "precision_in_effect": "fp8", "fp8_linear_layers": 72, "fp8_emulated": False}
    summary = {
        "dry_run": False,
        "planned_steps": list(gpu_check.STEPS),
        "steps": {name: dict(done) for name in gpu_check.planned_steps(gpu_check.STEPS)},
        "overflow_test": "passed",
        "finetune_fp16": {"precision_in_effect": "fp16", "loss_scales": [65536.0], "eval_accuracy": 0.7},
        "finetune_bf16": {"precision_in_effect": "bf16", "distributed_type": "FSDP", "checkpoints": ["c"]},
        "loss_agreement_fp16": {"agrees": True},
        "loss_agreement_bf16": {"agrees": True},
        "reload_fp16": {"eval_accuracy": 0.7},
        "doctor": {
            "speed": dict.fromkeys(("fp32", "bf16", "fp16"), {"step_time_s": 0.1}),
            "not_timed_for_budget": [],
            "largest_batch": dict.fromkeys(
                ("fp32", "bf16", "fp16"), {"method": "searched", "largest_batch": 96}
            ),
            "recommendation": [
                {"precision": "bf16", "reason": "bf16: native here, 1.9x fp32's speed"},
                {"precision": "fp16", "reason": "fp16: no activation overflow in 8 fp32 steps"},
            ],
        },
        "fp8_not_run": None,
        "benchmark": {"precisions": {"arms": {"fp16": arm, "fp8": fp8}, "complete": True}},
    }
    summary["steps"]["gpu_tests"].update(tests=7, failures=0, errors=0, skipped=0)
    summary.update(figures)
    return summary


def test_only_figures_that_are_wrong_make_the_check_not_ok():
    gpu_check = load_gpu_check()
    values, why = gpu_check.checks(summary_of(gpu_check))
    assert all(values.values()) and not why
    broken = summary_of(
        gpu_check,
        finetune_fp16={"precision_in_effect": "fp32", "loss_scales": [], "eval_accuracy": 0.7},  # a fallback
        loss_agreement_bf16={"agrees": False},
        reload_fp16={"eval_accuracy": 0.5},  # the saved model is not the one that was evaluated
        overflow_test="skipped",
    )
    values, _ = gpu_check.checks(broken)
    assert {name for name, value in values.items() if value is False} == {
        *("fp16_fine_tune_ran_fp16_with_a_loss_scale", "bf16_loss_agrees_with_fp32"),
        *("fp16_model_reloads_to_its_scores", "overflow_step_skipped"),
    }
    assert gpu_check.verdict(values, {}, broken["steps"]) == "NOT OK"
    crashed = summary_of(gpu_check)
    crashed["benchmark"]["precisions"]["arms"]["fp16"] = {"fits": False, "crashed": "the fp16 arm crashed"}
    assert gpu_check.checks(crashed)[0]["every_arm_ran_its_precision"] is False
    emulated = summary_of(gpu_check)
    emulated["benchmark"]["precisions"]["arms"]["fp8"]["fp8_emulated"] = True  # no fp8 on a GPU
    assert gpu_check.checks(emulated)[0]["fp8_arms_ran_fp8"] is False
    cpu_figures = summary_of(gpu_check)  # the doctor fell back to a CPU's figures on the GPU machine
    cpu_figures["doctor"]["speed"].pop("fp16")
    assert gpu_check.checks(cpu_figures)[0]["doctor_measured_every_precision"] is False
    nothing_fit = summary_of(gpu_check)
    nothing_fit["doctor"]["largest_batch"]["fp16"] = {"method": "searched", "largest_batch": 0}
    assert gpu_check.checks(nothing_fit)[0]["doctor_measured_every_precision"] is False


def test_a_benchmark_cut_short_or_a_step_that_failed():
    """Arms the deadline left out are no failure (partial: time); a fine-tune that crashed is."""
    gpu_check = load_gpu_check()
    cut = summary_of(gpu_check)
    cut["benchmark"]["precisions"]["arms"]["bf16"] = {"fits": False, "not_run": "time limit"}
    cut["steps"]["benchmark"]["status"] = "partial: time"
    values, why = gpu_check.checks(cut)
    assert all(values.values()) and gpu_check.verdict(values, why, cut["steps"]) == "partial: time"
    nothing_ran = summary_of(gpu_check, benchmark={"precisions": {"not_run": "no time left"}})
    nothing_ran["steps"]["benchmark"] = {"status": "partial: time", "not_run": "no time left"}
    values, why = gpu_check.checks(nothing_ran)
    assert (
        values["every_arm_ran_its_precision"] is None
        and why["every_arm_ran_its_precision"] == "partial: time"
    )
    crashed = summary_of(gpu_check, loss_agreement_fp16=None)
    del crashed["finetune_fp16"], crashed["reload_fp16"]
    crashed["steps"]["finetune_fp16"].update(status="failed", exit_code=1)
    crashed["steps"]["reload_fp16"] = {"status": "failed", "not_run": "the fp16 fine-tune did not finish"}
    values, why = gpu_check.checks(crashed)
    assert (
        values["fp16_loss_agrees_with_fp32"] is False and values["fp16_model_reloads_to_its_scores"] is False
    )
    assert gpu_check.verdict(values, why, crashed["steps"]) == "NOT OK"
    elsewhere = summary_of(
        gpu_check, fp8_not_run="fp8 was asked on NVIDIA A100 (compute capability 8.0), ..."
    )
    del elsewhere["benchmark"]["precisions"]["arms"]["fp8"]
    values, why = gpu_check.checks(elsewhere)
    assert values["fp8_arms_ran_fp8"] is None and why["fp8_arms_ran_fp8"] == "n/a"
    doctor_cut = summary_of(gpu_check)  # its --budget_s left fp16 out: partial, not a failure
    del doctor_cut["doctor"]["speed"]["fp16"], doctor_cut["doctor"]["largest_batch"]["fp16"]
    doctor_cut["steps"]["doctor"].update(status="partial: time", cut=["fp16"])
    values, why = gpu_check.checks(doctor_cut)
    assert values["doctor_measured_every_precision"] is None
    assert why["doctor_measured_every_precision"] == "partial: time"
    elsewhere.update(date="now", device="A100", budget_s=420, tables={}, checks=values, not_measured=why)
    elsewhere["verdict"] = gpu_check.verdict(values, why, elsewhere["steps"])
    elsewhere["loss_agreement_fp16"] = elsewhere["loss_agreement_bf16"] = None  # no figures to print
    text = gpu_check.summary_markdown(elsewhere)
    assert "## fp8\n\nNot run: fp8 was asked on NVIDIA A100 (compute capability 8.0)" in text


class SkipsEveryStep(torch.amp.GradScaler):
    """A broken scaler: its scale never backs off, so with a large one every step overflows and is
    skipped, and the model never trains."""

    def update(self, new_scale=None):
        super().update(self.get_scale())  # the same scale again, whatever the step found


class AppliesOverflowedSteps(torch.amp.GradScaler):
    """A broken scaler: its overflow check finds none, so a step whose gradients overflowed (inf) is
    applied (with torch's fused AdamW too, which takes the check's verdict into its own kernel)."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        found_per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        for found in found_per_device.values():
            found.zero_()
        return found_per_device


def with_scaler(scaler_class, **settings):
    """accelerate's real fp16 path on this CPU (conftest's Fp16OnCpu) with this GradScaler."""

    class Fp16WithThisScaler(Fp16OnCpu):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scaler = scaler_class("cpu", **settings)

    return Fp16WithThisScaler


def test_the_agreement_holds_for_fp16_and_bf16_and_fails_for_a_broken_scaler(tmp_path, monkeypatch):
    """The check's own fine-tune (the dry run's flags and model, in this process): accelerate's real
    fp16 path (tests' Fp16OnCpu fixture) and bf16 agree with fp32 within the tolerance; a scaler that
    skips every step, and one that applies an overflowed step, do not. fp16 runs torch's default
    GradScaler (the fixture's own grows its scale every 3 steps); the recipe's guard against
    skipped steps is lifted so that the criterion alone decides."""
    gpu_check, recipe = load_gpu_check(), load_recipe("bert_glue")
    model = gpu_check.random_bert(
        tmp_path / "model", **gpu_check.TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    flags = [*gpu_check.plan(dry_run=True)["finetune"], "--logging_steps", 1, "--model_name_or_path", model]
    flags += [
        "--task_name",
        "mrpc",
        "--data_dir",
        gpu_check.GLUE_DIR,
        "--max_consecutive_skipped_steps",
        1000,
    ]
    runs = {"fp32": (None, "no"), "bf16": (None, "bf16"), "fp16": (with_scaler(torch.amp.GradScaler), "fp16")}
    runs |= {
        "skips": (with_scaler(SkipsEveryStep, init_scale=2.0**40), "fp16"),
        "nan": (with_scaler(AppliesOverflowedSteps, init_scale=2.0**40), "fp16"),
    }
    agreement = {}
    for name, (accelerator, precision) in runs.items():
        if accelerator:
            monkeypatch.setattr(recipe, "Accelerator", accelerator)
        scaler = (
            ["--fp16_init_scale", 2**16, "--fp16_growth_interval", 2000] if name == "fp16" else []
        )  # torch's
        train(recipe, [*flags, "--mixed_precision", precision, *scaler, "--output_dir", tmp_path / name])
        monkeypatch.undo()
        agreement[name] = gpu_check.loss_agreement(tmp_path / "fp32", tmp_path / name)
    reset_accelerate()
    print({name: a.get("difference_of_learned") for name, a in agreement.items()})
    assert agreement["fp32"]["difference"] == 0 and agreement["fp32"]["fp32_learned"] > 0.2
    assert agreement["fp16"]["agrees"] and agreement["bf16"]["agrees"]
    assert (
        agreement["fp16"]["difference_of_learned"] < 0.1 and agreement["bf16"]["difference_of_learned"] < 0.1
    )
    assert not agreement["skips"]["agrees"] and agreement["skips"]["difference_of_learned"] > 0.9
    assert (
        not agreement["nan"]["agrees"]
        and agreement["nan"]["last_window_loss"] != agreement["nan"]["last_window_loss"]
    )


def test_unknown_steps_are_refused(capsys):
    with pytest.raises(SystemExit):
        load_gpu_check().parse_args(["--steps", "fp8,fp4"])
    assert (
        "--steps: unknown ['fp4']; choose from gpu_tests, finetune, doctor, benchmark, fp8, compiled."
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


def test_the_preflight_imports_and_names_the_conflicting_dependency(monkeypatch):
    """Every package is imported, not only found; a failure names the package, its error and the
    installed dependencies at versions it does not accept (here: an old pyarrow under datasets)."""
    import importlib.metadata

    gpu_check = load_gpu_check()
    assert {"datasets", "evaluate", "transformers", "accelerate", "torch"} <= set(gpu_check.NEEDED)
    gpu_check.preflight()  # this machine has them all, and datasets reads MRPC
    real_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "1.0.0" if name == "pyarrow" else real_version(name)
    )
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    with pytest.raises(SystemExit) as stop:
        gpu_check.preflight()
    message = str(stop.value)
    assert message.startswith("error: datasets does not import (ModuleNotFoundError: ")
    assert "; it needs pyarrow>=" in message and "(found 1.0.0)" in message
    assert message.endswith("Install: pip install datasets, or wheels from scripts/fetch_gpu_wheels.sh.")


def torchrun_worker_of(tag: str) -> int | None:
    """A worker that torchrun started (a RANK of its own, in a session of its own) for this check,
    once one runs."""
    for pid, rank in run_processes(tag).items():
        with contextlib.suppress(OSError):
            if rank >= 0 and os.getsid(pid) == pid:
                return pid
    return None


def assert_nothing_outlives(tag: str, what: str) -> None:
    deadline = time.monotonic() + 15
    while run_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftovers = list(run_processes(tag))
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"processes outlived the check ({what})"


def test_a_check_killed_during_its_multi_process_step_leaves_no_process(tmp_path):
    """SIGKILL, which no handler sees, while torchrun's worker of the bf16 fine-tune (FSDP2 on a GPU,
    DDP on this CPU) runs in a session of its own (out of reach of a process-group kill): the check's
    watcher kills it before
    it finishes (two fine-tunes saved their model, not three), and removes the scratch folder."""
    out, tag = tmp_path / "check", f"{tmp_path}-sigkill"
    env = plain_env(tmp_path, AMP_SCALE_OUT_TEST=tag)
    check = subprocess.Popen([str(c) for c in check_command(out, "--steps", "finetune")], cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 300
        while torchrun_worker_of(tag) is None:
            assert check.poll() is None and time.monotonic() < deadline, "no torchrun worker ever ran"
            time.sleep(0.2)
        time.sleep(1)
        check.send_signal(signal.SIGKILL)
        check.wait()
        assert_nothing_outlives(tag, "SIGKILL during the multi-process fine-tune")
    finally:
        check.kill()
    summary = json.loads((out / "summary.json").read_text())  # whole, never half-written
    assert summary["steps"]["finetune_fp32"]["status"] == "done"
    assert "finetune_bf16" not in summary["steps"]  # killed while it ran
    log = (out / "check.log").read_text()
    assert log.count("Saved model and eval_results.json") == 2  # fp32 and fp16; bf16 was killed
    scratch = Path(re.search(r"--output_dir (\S+)/finetune_fp32", log).group(1))
    assert scratch.name.startswith("gpu-check-") and not scratch.exists()


def test_a_check_terminated_at_any_moment_leaves_a_readable_summary_and_no_process(tmp_path):
    """SIGTERM at a random moment (printed, to replay a failure): the check stops every process it
    started, and its summary is whole."""
    out, tag = tmp_path / "check", f"{tmp_path}-sigterm"
    moment = random.uniform(4, 45)  # set-up, the tests, the fine-tunes
    print(f"SIGTERM after {moment:.1f} s")
    env = plain_env(tmp_path, AMP_SCALE_OUT_TEST=tag)
    check = subprocess.Popen(
        [str(c) for c in check_command(out)], cwd=REPO, env=env, stdout=subprocess.DEVNULL
    )
    try:
        check.wait(timeout=moment)
    except subprocess.TimeoutExpired:
        check.send_signal(signal.SIGTERM)  # the check's own process (gpu_check.sh execs it)
        check.wait(timeout=60)
    assert_nothing_outlives(tag, f"SIGTERM at {moment:.1f} s")
    if not (out / "summary.json").exists():
        assert not (out / "check.log").exists()  # stopped before any step started
        return
    assert_output_fits_what_comes_back(out)
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "summary.md").read_text().startswith("# GPU check (dry run, CPU)")
    for name, step in summary["steps"].items():
        if step.get("status") == "done" and name.startswith("finetune_"):
            assert summary[name]["train_steps"] == 32, (name, moment)


def test_a_step_past_its_deadline_is_stopped_with_every_process_it_started(tmp_path):
    """Its child in a session of its own too, as torchrun's workers are."""
    gpu_check = load_gpu_check()
    marker = tmp_path / "child-survived"
    command = ["bash", "-c", f"setsid bash -c 'sleep 3; touch {marker}' & wait"]
    env = {**os.environ, gpu_check.TAG: "test-deadline"}
    step = gpu_check.run_step("slow", command, tmp_path / "slow.log", env, seconds=1)
    assert step["status"] == "partial: time" and step["seconds"] < 3
    time.sleep(3)
    assert not marker.exists()


def test_a_check_killed_outright_takes_its_steps_processes_along(tmp_path):
    """SIGKILL to the check (no handler runs): its watcher kills the step and every process it
    started, a process in another session included, and removes the scratch folder."""
    marker = tmp_path / "grandchild-survived"
    code = (
        "import importlib.util, os;"
        "spec = importlib.util.spec_from_file_location('gpu_check', 'scripts/gpu_check.py');"
        "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g);"
        f"g.start_watcher('outright', g.Path('{tmp_path / 'scratch'}'));"
        f"g.run_step('s', ['bash', '-c', 'echo started; setsid bash -c \"sleep 4; touch {marker}\" & wait'], "
        f"'{tmp_path / 's.log'}', dict(os.environ, **{{g.TAG: 'outright'}}), seconds=60)"
    )
    (tmp_path / "scratch").mkdir()  # the check's models and checkpoints
    check = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    deadline = time.monotonic() + 30
    while "\nstarted" not in ((tmp_path / "s.log").read_text() if (tmp_path / "s.log").exists() else ""):
        assert time.monotonic() < deadline and check.poll() is None
        time.sleep(0.1)
    time.sleep(1)
    assert check.poll() is None, "the check ended before it was killed"
    check.send_signal(signal.SIGKILL)
    check.wait()
    time.sleep(5)
    assert not marker.exists() and not (tmp_path / "scratch").exists()


def test_the_census_counts_the_programs_a_run_starts_not_its_forks(tmp_path):
    """The census behind the process count: a child seen only between its fork and its exec (as
    the check's cleanup watcher, which execs without the tag) or a fork that never execs is not a
    program of the run; a tagged Python child after its exec is, by its own command line."""
    tag = f"{tmp_path}-census"
    parent = (
        "import os, subprocess, sys, time\n"
        "env = {k: v for k, v in os.environ.items() if k != 'AMP_SCALE_OUT_TEST'}\n"
        "if os.fork() == 0:\n"  # seen with the parent's command line, then gone from the tagged
        "    time.sleep(0.5)\n"
        "    os.execve('/bin/sleep', ['sleep', '1.5'], env)\n"
        "if os.fork() == 0:\n"  # never execs
        "    time.sleep(0.5)\n"
        "    os._exit(0)\n"
        "subprocess.run([sys.executable, '-c', 'import time; time.sleep(1)', 'child'], check=True)\n"
        "time.sleep(1.5)\n"
        "os.wait(); os.wait()\n"
    )
    census = ProcessCensus(tag)
    census.start()
    subprocess.run(
        [sys.executable, "-c", parent, "parent"], check=True, env={**os.environ, "AMP_SCALE_OUT_TEST": tag}
    )
    commands = sorted(command.rsplit(" ", 1)[-1] for command in census.stop().values())
    assert commands == ["child", "parent"], commands
