"""One-shot GPU validation of the repository's fp16 and fp8 claims (limits: 18 minutes in all on one H200).

    bash scripts/gpu_check.sh --output_dir gpu_check_results
    bash scripts/gpu_check.sh --steps fp8 --output_dir gpu_check_fp8   # only step 4 (10 minutes of limits)
    bash scripts/gpu_check.sh --dry_run --output_dir /tmp/gpu_check   # same plan, CPU, tiny model

Run it through scripts/gpu_check.sh, which first installs carried wheels of packages a GPU
image may lack (scripts/fetch_gpu_wheels.sh fetches them). Four steps (--steps picks some), each
with its own time limit, everything written into --output_dir:

1. `pytest -m gpu tests/gpu`: accelerate's real CUDA fp16 path (GradScaler, a skipped step on an
   injected overflow with the scheduler held, scaler state through save/load), bf16, hardware
   facts, and the recipe logging its loss scale  -> pytest.xml, gpu_tests.log
2. the paired benchmark on BERT-base (random weights from config), seq 128, arms
   fp32/tf32/fp16/bf16, with a capped max-batch search  -> benchmark/results.{json,md,png}
3. a short fine-tune of recipes/bert_glue.py on MRPC in fp32 and in fp16, for loss agreement
   -> finetune_fp32/, finetune_fp16/
4. fp8 (GPUs of compute capability 8.9+, torchao installed; otherwise recorded as not run, with
   the reason): the benchmark's fp32/bf16/fp8 arms, eager and compiled, on BERT-base at seq 128
   and 384, no batch search  -> benchmark_fp8_seq128/, benchmark_fp8_seq384/

summary.json + summary.md are rewritten after every step and printed at the end. "ok" means the
figures hold (every arm ran its precision, no timed run crashed, the fp16 loss agrees with fp32
within LOSS_TOLERANCE, the GradScaler skipped the injected overflow), not only exit codes 0.
Everything comes from the checkout: MRPC from data/glue, BERT-base's config and vocabulary from
data/models/bert-base-uncased (random weights; the dry run shrinks it to 2 layers of width 32).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GLUE_DIR = REPO / "data" / "glue"
BERT_BASE = REPO / "data" / "models" / "bert-base-uncased"
# The dry run's model: BERT-base's vocabulary and layout, shrunk so a CPU trains it in seconds.
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry_run", action="store_true", help="The same plan on CPU with the tiny model.")
    parser.add_argument("--output_dir", type=Path, default=Path("gpu_check_results"))
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"Comma-separated subset of {','.join(STEPS)} (default: all).",
    )
    args = parser.parse_args(argv)
    args.steps = [step.strip() for step in args.steps.split(",") if step.strip()]
    unknown = sorted(set(args.steps) - set(STEPS))
    if unknown or not args.steps:
        parser.error(f"--steps: unknown {unknown or args.steps}; choose from {', '.join(STEPS)}.")
    return args


STEPS = ("gpu_tests", "benchmark", "finetune", "fp8")


# Per-step limits (seconds). On the H200: imports and CUDA start-up ~20 s a process; the
# benchmark starts ~30 fresh processes (4 arms x (1 timed run + a capped search)).
# fp8: 5 arms a length, 2 of them compiled (not yet run on a GPU: estimates, 20 s a process and
# about a minute a compilation).
TIMEOUTS = {"gpu_tests": 150, "benchmark": 210, "finetune_fp32": 60, "finetune_fp16": 60, "fp8": 300}
DRY_RUN_TIMEOUTS = {
    "gpu_tests": 120,
    "benchmark": 420,
    "finetune_fp32": 180,
    "finetune_fp16": 180,
    "fp8": 240,
}
# Sequence lengths of the fp8 step: GLUE's usual 128 and SQuAD's 384 (larger matmuls, where fp8
# has more to gain).
FP8_SEQ_LENS = {False: (128, 384), True: (32, 64)}
# The fp16 fine-tune's per-step loss against fp32's, same seed and batches: rounding alone moves
# it by far less; a broken scaler, autocast or loss reduction moves it by far more.
LOSS_TOLERANCE = 0.05
# What each benchmark arm must have run as, on the GPU and on a CPU (the dry run).
EXPECTED_PRECISION = {
    False: {"fp32": "fp32", "tf32": "tf32", "fp16": "fp16", "bf16": "bf16"},
    True: {"fp32": "fp32", "bf16": "bf16"},
}


def plan(args) -> dict:
    """Sizes of each step: the real ones fit about 8 minutes on an H200."""
    if args.dry_run:
        return {
            "benchmark": [
                "--arms",
                "fp32,bf16",
                "--seq_len",
                64,
                "--batch_size",
                4,
                "--warmup_steps",
                1,
                "--timed_steps",
                2,
                "--memory_budget_gb",
                1.0,
                "--search_start",
                64,
                "--search_granularity",
                64,
                "--search_max",
                64,  # one small trial per arm (bf16 is emulated on most CPUs): the search is tested in tests/scripts
            ],
            "model": TINY,
            "finetune": [
                "--max_train_samples",
                64,
                "--max_eval_samples",
                32,
                "--max_train_steps",
                4,
                "--per_device_train_batch_size",
                8,
            ],
            # Emulated on a CPU (the test suite puts tests/fp8_emulation on PYTHONPATH); otherwise refused.
            "fp8": ["--arms", "fp32,bf16,fp8", "--batch_size", 4, "--warmup_steps", 1, "--timed_steps", 2],
        }
    return {
        # BERT-base at seq 128 needs roughly 0.1 GiB per sample in fp32: a 16 GiB budget keeps
        # every trial of the search short while still showing the headroom fp16/bf16 give.
        "benchmark": [
            "--arms",
            "fp32,tf32,fp16,bf16",
            "--seq_len",
            128,
            "--batch_size",
            32,
            "--warmup_steps",
            5,
            "--timed_steps",
            20,
            "--memory_budget_gb",
            16,
            "--search_start",
            32,
            "--search_granularity",
            32,
            "--search_max",
            1024,
        ],
        "model": {},  # BERT-base as it is, with random weights
        "finetune": [
            "--max_train_samples",
            1920,
            "--max_train_steps",
            60,
            "--per_device_train_batch_size",
            32,
            "--learning_rate",
            5e-5,
        ],
        # torchao's fp8 needs torch.compile to fuse its scaling and casts: compiled arms side by side.
        "fp8": [
            *("--arms", "fp32,bf16,fp8,bf16+compile,fp8+compile", "--batch_size", 32),
            *("--warmup_steps", 5, "--timed_steps", 20),
        ],
    }


def run_step(name: str, command: list, log_path: Path, env: dict, timeout: float) -> dict:
    """Run one step with its own time limit; a step past it is killed (its whole process group)
    and reported as timed out, so the steps after it still run."""
    print(f"== {name} (limit {timeout:.0f} s): {' '.join(map(str, command))}", flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [str(c) for c in command],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the benchmark's trials die with it
        )
        try:
            exit_code, timed_out = process.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            exit_code, timed_out = process.wait(), True
    seconds = time.perf_counter() - started
    verdict = f"TIMED OUT after {timeout:.0f} s" if timed_out else f"exit {exit_code} after {seconds:.0f} s"
    print(f"   {verdict} (log: {log_path})", flush=True)
    return {
        "exit_code": exit_code,
        "timed_out": timed_out,
        "seconds": round(seconds, 1),
        "log": str(log_path),
    }


def random_bert(target: Path, **config_overrides) -> Path:
    """bert-base-uncased's architecture (with `config_overrides`) and real uncased tokenizer,
    random weights, saved to `target` (no download). The tokenizer is loaded by AutoTokenizer from
    the folder: transformers 5's BertTokenizerFast ignores a `vocab_file=` argument and would give
    a 5-token vocabulary."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(BERT_BASE, num_labels=2, **config_overrides)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(target)
    AutoTokenizer.from_pretrained(BERT_BASE, model_max_length=config.max_position_embeddings).save_pretrained(
        target
    )
    return target


def pytest_counts(junit_path: Path) -> dict:
    if not junit_path.exists():
        return {}
    suite = ElementTree.parse(junit_path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}


def loss_agreement(fp32_dir: Path, fp16_dir: Path) -> dict | None:
    def losses(directory):
        history = directory / "log_history.jsonl"
        if not history.exists():
            return []
        return [json.loads(line)["loss"] for line in history.read_text().splitlines() if '"loss"' in line]

    reference, other = losses(fp32_dir), losses(fp16_dir)
    diffs = [abs(a - b) / abs(b) for a, b in zip(other, reference, strict=False) if b]
    if not diffs:
        return None
    return {
        "steps": len(diffs),
        "max_relative_difference": max(diffs),
        "mean_relative_difference": sum(diffs) / len(diffs),
        "final_loss_fp32": reference[-1],
        "final_loss_fp16": other[-1],
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sizes = plan(args)
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
        WANDB_MODE="offline",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    env.pop("GLUE_DIR", None)  # the fine-tunes read the repository's data/glue, named below
    import torch

    summary = {
        "dry_run": args.dry_run,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {"torch": torch.__version__, **library_versions()},
        "planned_steps": args.steps,
        "steps": {},
    }
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; use --dry_run to rehearse the plan on a CPU.")
    timeouts = DRY_RUN_TIMEOUTS if args.dry_run else TIMEOUTS

    def step(name: str, command: list) -> dict:
        limit = timeouts["fp8" if name.startswith("benchmark_fp8") else name]
        summary["steps"][name] = run_step(name, command, out / f"{name}.log", env, limit)
        return summary["steps"][name]

    # 1. the GPU-marked tests
    if "gpu_tests" in args.steps:
        pytest_command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs"]
        step("gpu_tests", [*pytest_command, f"--junitxml={out / 'pytest.xml'}"])
        summary["steps"]["gpu_tests"].update(pytest_counts(out / "pytest.xml"))
        summary["overflow_test"] = test_outcome(out / "pytest.xml", "test_injected_overflow")
        write_summary(summary, out)

    # 2. the paired precision benchmark
    # Without dropout: fp16 pads batches to a multiple of 8 and fp32 does not, so dropout would
    # draw different masks for the same tokens and blur the fp16-vs-fp32 loss comparison.
    model = random_bert(
        out / "model", **sizes["model"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    benchmark = [sys.executable, "scripts/benchmark_precision.py", "--config_name", model]
    if "benchmark" in args.steps:
        benchmark_dir = out / "benchmark"
        step(
            "benchmark",
            [*benchmark, *sizes["benchmark"], "--bench_id", "gpu-check", "--output_dir", benchmark_dir],
        )
        if (benchmark_dir / "results.json").exists():
            summary["benchmark"] = json.loads((benchmark_dir / "results.json").read_text())
        write_summary(summary, out)

    # 3. the recipe, fp32 and fp16, on the same data and seed
    for arm, precision in (("fp32", "no"), ("fp16", "fp16")) if "finetune" in args.steps else ():
        command = [
            *(sys.executable, "recipes/bert_glue.py", "--task_name", "mrpc", "--data_dir", GLUE_DIR),
            *("--model_name_or_path", model, *sizes["finetune"], "--logging_steps", 1),
            *("--mixed_precision", precision),
            *("--output_dir", out / f"finetune_{arm}", "--overwrite_output_dir"),  # a rerun replaces it
        ]
        step(f"finetune_{arm}", command)
        results = out / f"finetune_{arm}" / "eval_results.json"
        if results.exists():
            summary[f"finetune_{arm}"] = json.loads(results.read_text())
        summary["loss_agreement"] = loss_agreement(out / "finetune_fp32", out / "finetune_fp16")
        write_summary(summary, out)

    # 4. fp8 at two lengths, where the GPU and torchao allow it
    if "fp8" in args.steps:
        run_fp8(summary, step, [*benchmark, *sizes["fp8"]], out, args.dry_run)
    text = write_summary(summary, out)
    print(text)
    return summary


def run_fp8(summary: dict, step, benchmark: list, out: Path, dry_run: bool) -> None:
    """The fp8 benchmarks, or the one-sentence reason why this machine cannot run them (the
    recipes' own refusal: compute capability below 8.9, or torchao not installed)."""
    from amp_recipes.hardware import device_facts
    from amp_recipes.precision import fp8_refusal

    summary["fp8"] = {"not_run": fp8_refusal(device_facts(), "ao"), "by_seq_len": {}}
    if summary["fp8"]["not_run"]:
        print(f"== fp8: not run: {summary['fp8']['not_run']}", flush=True)
        return
    for seq_len in FP8_SEQ_LENS[dry_run]:
        name = f"benchmark_fp8_seq{seq_len}"
        step(
            name,
            [*benchmark, "--seq_len", seq_len, "--no_search", "--bench_id", name, "--output_dir", out / name],
        )
        results = out / name / "results.json"
        if results.exists():
            summary["fp8"]["by_seq_len"][str(seq_len)] = json.loads(results.read_text())
        write_summary(summary, out)


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("transformers", "accelerate", "datasets", "evaluate"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def test_outcome(junit_path: Path, name: str) -> str | None:
    """'passed', 'failed' or 'skipped' for the first test whose name starts with `name`."""
    if not junit_path.exists():
        return None
    for case in ElementTree.parse(junit_path).getroot().iter("testcase"):
        if case.get("name", "").startswith(name):
            for outcome in ("failure", "error", "skipped"):
                if case.find(outcome) is not None:
                    return {"failure": "failed", "error": "failed"}.get(outcome, outcome)
            return "passed"
    return None


def checks(summary: dict) -> dict:
    """ "ok" means the figures hold, not only that every exit code was 0. None: not applicable
    (a step not asked for with --steps, or one this machine cannot run)."""
    dry_run, steps = summary["dry_run"], summary["steps"]
    planned = summary.get("planned_steps", STEPS)
    tests = steps.get("gpu_tests", {})
    arms = (summary.get("benchmark") or {}).get("arms", {})
    expected = EXPECTED_PRECISION[dry_run]
    agreement = summary.get("loss_agreement")
    fp16 = summary.get("finetune_fp16", {})
    found = {
        "every_step_finished_in_time": bool(steps)
        and all(s["exit_code"] == 0 and not s["timed_out"] for s in steps.values()),
        # On the GPU every gpu test must run (none skipped); on a CPU they all skip.
        "gpu_tests_passed": tests.get("tests", 0) >= 6
        and tests.get("failures", 1) == 0
        and tests.get("errors", 1) == 0
        and (tests.get("skipped") == tests.get("tests") if dry_run else tests.get("skipped") == 0),
        "overflow_step_skipped": None if dry_run else summary.get("overflow_test") == "passed",
        "every_arm_ran_its_precision": set(arms) == set(expected)
        and all(r.get("precision_in_effect") == expected[a] and r.get("fits") for a, r in arms.items()),
        "fp16_fine_tune_ran_fp16": fp16.get("precision_in_effect") == ("fp32" if dry_run else "fp16"),
        "fp16_loss_agrees_with_fp32": bool(agreement)
        and agreement["max_relative_difference"] <= LOSS_TOLERANCE,
        "fp8_arms_ran_fp8": fp8_ran(summary.get("fp8"), dry_run),
    }
    step_of = {
        "gpu_tests_passed": "gpu_tests",
        "overflow_step_skipped": "gpu_tests",
        "fp8_arms_ran_fp8": "fp8",
    }
    step_of.update(every_arm_ran_its_precision="benchmark", fp16_fine_tune_ran_fp16="finetune")
    step_of.update(fp16_loss_agrees_with_fp32="finetune")
    return {name: value if step_of.get(name, "") in ("", *planned) else None for name, value in found.items()}


def fp8_ran(fp8: dict | None, dry_run: bool) -> bool | None:
    """Every fp8 arm at every length really ran fp8: Linear layers converted, on fp8 Tensor Cores
    (emulated only in the dry run). None where this machine cannot run fp8 (the reason is kept)."""
    if fp8 is None:
        return False  # asked for and never reached
    if fp8["not_run"]:
        return None
    runs = fp8["by_seq_len"].values()
    arms = [r for run in runs for name, r in run["arms"].items() if name.startswith("fp8")]
    return (
        len(runs) == len(FP8_SEQ_LENS[dry_run])
        and bool(arms)
        and all(
            r.get("fits")
            and r.get("precision_in_effect") == "fp8"
            and r.get("fp8_linear_layers", 0) > 0
            and r.get("fp8_emulated") == dry_run
            for r in arms
        )
    )


def write_summary(summary: dict, out: Path) -> str:
    """summary.json and summary.md, rewritten after every step: a check killed half-way still
    reports what it did."""
    summary["checks"] = checks(summary)
    summary["ok"] = all(value is not False for value in summary["checks"].values())
    text = summary_markdown(summary, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text(text)
    return text


def summary_markdown(summary: dict, out: Path) -> str:
    lines = [
        f"# GPU check ({'dry run, CPU' if summary['dry_run'] else summary['device']}), {summary['date']}",
        "",
        "| step | exit | seconds | detail |",
        "|---|---|---|---|",
    ]
    for name, step in summary["steps"].items():
        detail = ""
        if name == "gpu_tests" and "tests" in step:
            detail = f"{step['tests']} tests, {step['failures']} failed, {step['errors']} errors, {step['skipped']} skipped"
        elif name.startswith("finetune_") and name in summary:
            r = summary[name]
            detail = (
                f"ran as {r['precision_in_effect']}, {r['train_samples_per_second']:.1f} samples/s, "
                f"peak {r['peak_memory_bytes'] / 2**30:.2f} GiB, eval acc {r.get('eval_accuracy', float('nan')):.3f}"
            )
        exit_code = "timed out" if step.get("timed_out") else step["exit_code"]
        lines.append(f"| {name} | {exit_code} | {step['seconds']} | {detail} |")
    lines += [
        "",
        f"**{'ok' if summary['ok'] else 'NOT OK'}**: "
        + ", ".join(
            f"{name} {'n/a' if value is None else 'yes' if value else 'NO'}"
            for name, value in summary["checks"].items()
        )
        + f" (loss tolerance {LOSS_TOLERANCE:.0%} per step).",
    ]
    agreement = summary.get("loss_agreement")
    if agreement:
        lines += [
            "",
            f"Fine-tune loss agreement fp16 vs fp32 over {agreement['steps']} steps: max relative "
            f"difference {agreement['max_relative_difference']:.2e}, mean {agreement['mean_relative_difference']:.2e}; "
            f"final loss {agreement['final_loss_fp32']:.4f} (fp32) vs {agreement['final_loss_fp16']:.4f} (fp16).",
        ]
    benchmark_table = out / "benchmark" / "results.md"
    if benchmark_table.exists():
        lines += ["", "## Paired benchmark", "", benchmark_table.read_text().split("\n", 2)[2].strip()]
    fp8 = summary.get("fp8")
    if fp8 and fp8["not_run"]:
        lines += ["", "## fp8", "", f"Not run: {fp8['not_run']}"]
    for seq_len in (fp8 or {}).get("by_seq_len", {}):
        table = out / f"benchmark_fp8_seq{seq_len}" / "results.md"
        lines += ["", f"## fp8 benchmark, seq {seq_len}", "", table.read_text().split("\n", 2)[2].strip()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(0 if main().get("ok") else 1)
