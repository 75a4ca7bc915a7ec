"""One-shot GPU validation of the repository's fp16, bf16 and fp8 claims: one command, 420 s.

    bash scripts/gpu_check.sh --output_dir "$OUT"                   # everything lands in $OUT
    bash scripts/gpu_check.sh --dry_run --output_dir /tmp/gpu_check  # same plan, CPU, tiny model

Run it through scripts/gpu_check.sh, which first installs carried wheels of packages a GPU
image may lack (scripts/fetch_gpu_wheels.sh fetches them). The steps, in order of value, each
with its own time limit inside one budget for the whole check (--budget_s, 420 s on a GPU,
counted from gpu_check.sh's start, the wheels' install included); a step whose limit does not fit
in what is left is recorded as "not run: budget" and not started:

1. `pytest -m gpu tests/gpu`: accelerate's real CUDA fp16 path (GradScaler, a skipped step on an
   injected overflow with the scheduler held, scaler state through save/load), bf16, hardware
   facts, the recipe logging its loss scale
2. short fine-tunes of recipes/bert_glue.py on MRPC in fp32, fp16 and bf16 (loss agreement), and
   the saved fp16 model reloaded (`--eval_only`) to the same scores
3. the paired benchmark on BERT-base (random weights), seq 128, fp32/tf32/fp16/bf16, peak memory,
   step time, MFU, and the largest batch under a 16 GB memory budget (a bounded search)
4. fp8 eager at 128 and 384 tokens (compute capability 8.9+ with torchao; otherwise recorded as
   not run, with the reason)
5. the compiled arms (bf16 and fp8 under torch.compile), only with the time left

Everything the check writes lands directly in --output_dir, at most 8 files, none in folders:
summary.json and summary.md (rewritten after every step: a kill at any moment leaves every
finished step's figures), check.log (every step's output, appended as it runs), pytest.xml and
benchmark.png. Models, checkpoints and trials go to a scratch folder, removed at the end.
"ok" means the figures hold (every arm ran its precision, no arm crashed, the fp16 loss agrees
with fp32 within LOSS_TOLERANCE, the reloaded fp16 model scores what it scored, the GradScaler
skipped the injected overflow), not only exit codes 0. Everything comes from the checkout: MRPC
from data/glue, BERT-base's config and vocabulary from data/models/bert-base-uncased (the dry run
shrinks it to 2 layers of width 32).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # amp_recipes without `pip install -e .`

GLUE_DIR = REPO / "data" / "glue"
BERT_BASE = REPO / "data" / "models" / "bert-base-uncased"
# The dry run's model: BERT-base's vocabulary and layout, shrunk so a CPU trains it in seconds.
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


STEPS = ("gpu_tests", "finetune", "benchmark", "fp8", "compiled")
# The whole check's budget, counted from gpu_check.sh's start (GPU_CHECK_STARTED): a validation
# command on the H200 we validate on runs at most 10 minutes, and 15 minutes of GPU time (machine
# start-up and any rerun included) must leave room for a rerun. The dry run's, on a 2-core CPU.
BUDGET_S = {False: 420, True: 900}
# Step limits (seconds), in plan order. On the GPU these are estimates (not yet run on one): a
# fresh process costs ~10-20 s of imports and CUDA start-up there; STARTUP_S covers the wheels'
# install and this script's imports. The benchmark starts no trial past its limit less one trial.
STARTUP_S = 30
LIMITS = {
    False: {
        "gpu_tests": 60,
        "finetune_fp32": 25,
        "finetune_fp16": 25,
        "finetune_bf16": 25,
        "reload_fp16": 15,
        "benchmark": 120,
        "fp8_seq128": 35,
        "fp8_seq384": 35,
        "compiled": 50,
    },
    # The dry run's: ~3x what each step takes alone on a 2-core CPU, room for CI's parallel test
    # lanes (measured there: the fp8 step 90 s, the benchmark 114 s; alone 46 s and 55 s).
    True: {
        "gpu_tests": 120,
        "finetune_fp32": 60,
        "finetune_fp16": 60,
        "finetune_bf16": 60,
        "reload_fp16": 60,
        "benchmark": 200,
        "fp8_seq32": 180,
        "compiled": 120,
    },
}
TRIAL_S = {False: 20, True: 30}  # one benchmark trial process, start-up included
# Sequence lengths of the fp8 step: GLUE's usual 128 and SQuAD's 384 (larger matmuls, where fp8
# has more to gain). The dry run rehearses the step once: a second length runs the same code.
FP8_SEQ_LENS = {False: (128, 384), True: (32,)}
# The fp16 fine-tune's per-step loss against fp32's, same seed and batches: rounding alone moves
# it by far less; a broken scaler, autocast or loss reduction moves it by far more.
LOSS_TOLERANCE = 0.05
# What each benchmark arm must have run as, on the GPU and on a CPU (the dry run).
EXPECTED_PRECISION = {
    False: {"fp32": "fp32", "tf32": "tf32", "fp16": "fp16", "bf16": "bf16"},
    True: {"fp32": "fp32", "bf16": "bf16"},
}
OUTPUT_FILES = ("summary.json", "summary.md", "check.log", "pytest.xml", "benchmark.png")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry_run", action="store_true", help="The same plan on CPU with the tiny model.")
    parser.add_argument(
        "--output_dir", type=Path, default=Path("gpu_check_results"), help=f"Gets {', '.join(OUTPUT_FILES)}."
    )
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"Comma-separated subset of {','.join(STEPS)} (default: all).",
    )
    parser.add_argument("--budget_s", type=float, help="The whole check's time (default: 420 on a GPU).")
    args = parser.parse_args(argv)
    args.steps = [step.strip() for step in args.steps.split(",") if step.strip()]
    unknown = sorted(set(args.steps) - set(STEPS))
    if unknown or not args.steps:
        parser.error(f"--steps: unknown {unknown or args.steps}; choose from {', '.join(STEPS)}.")
    args.budget_s = args.budget_s or BUDGET_S[args.dry_run]
    return args


def plan(args) -> dict:
    """Sizes of each step."""
    if args.dry_run:
        return {
            "benchmark": [
                *("--arms", "fp32,bf16", "--seq_len", 64, "--batch_size", 4, "--warmup_steps", 1),
                *("--timed_steps", 2, "--memory_budget_gb", 1.0, "--search_start", 64),
                # one small trial per arm (bf16 is emulated on most CPUs): the search is tested in tests/scripts
                *("--search_granularity", 64, "--search_max", 64),
            ],
            "model": TINY,
            "finetune": [
                *("--max_train_samples", 64, "--max_eval_samples", 32, "--max_train_steps", 4),
                *("--per_device_train_batch_size", 8),
            ],
            # Emulated on a CPU (the test suite puts tests/fp8_emulation on PYTHONPATH); otherwise refused.
            "fp8": ["--arms", "fp32,bf16,fp8", "--batch_size", 4, "--warmup_steps", 1, "--timed_steps", 2],
            # The eager backend: torch.compile's whole path without inductor's C compiler.
            "compiled": [
                *("--arms", "fp32+compile", "--seq_len", 32, "--batch_size", 4, "--warmup_steps", 1),
                *("--timed_steps", 2, "--torch_compile_backend", "eager"),
            ],
        }
    return {
        # BERT-base at seq 128 needs roughly 0.1 GiB per sample in fp32: under a 16 GiB budget
        # (the GPUs users fine-tune on) the search brackets the largest batch in a few trials.
        "benchmark": [
            *("--arms", "fp32,tf32,fp16,bf16", "--seq_len", 128, "--batch_size", 32),
            *("--warmup_steps", 5, "--timed_steps", 20, "--memory_budget_gb", 16),
            *("--search_start", 64, "--search_granularity", 64, "--search_max", 1024),
        ],
        "model": {},  # BERT-base as it is, with random weights
        "finetune": [
            *("--max_train_samples", 1920, "--max_train_steps", 60, "--per_device_train_batch_size", 32),
            *("--max_eval_samples", 256, "--learning_rate", 5e-5),
        ],
        "fp8": ["--arms", "fp32,bf16,fp8", "--batch_size", 32, "--warmup_steps", 5, "--timed_steps", 20],
        # torchao's fp8 needs torch.compile to fuse its scaling and casts: with the time left.
        "compiled": [
            *("--arms", "bf16+compile,fp8+compile", "--seq_len", 128, "--batch_size", 32),
            *("--warmup_steps", 5, "--timed_steps", 20),
        ],
    }


class Budget:
    """The check's deadline: a step starts only if its limit fits in what is left."""

    def __init__(self, total_s: float, started: float, clock=time.time):
        self.total_s, self.started, self.clock = total_s, started, clock

    def left(self) -> float:
        return self.total_s - (self.clock() - self.started)

    def refusal(self, limit: float) -> str | None:
        left = self.left()
        return None if limit <= left else f"budget: needs {limit:.0f} s, {max(left, 0):.0f} s left"


_running: subprocess.Popen | None = None  # the step in progress: the signal handler kills its group

# Each step runs under this reaper, the leader of the step's process group. When the check dies,
# even by SIGKILL (no handler of ours runs then), the kernel sends the reaper SIGTERM (Linux's
# parent-death signal), and the reaper kills the whole group: the step and every process it
# started, grandchildren included (pytest's recipe runs, the benchmark's trials), not only the
# step's first process. Elsewhere than Linux prctl is missing and only the handlers below act.
REAPER = """
import contextlib, ctypes, os, signal, subprocess, sys
def reap(*_):
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, reap)
with contextlib.suppress(OSError, AttributeError):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    reap()  # the check died before the line above
sys.exit(subprocess.call(sys.argv[2:]))
"""


def _kill_running_step(signum, frame):
    """SIGTERM/SIGINT/SIGHUP to the check: its step's whole process group dies with it."""
    if _running is not None and _running.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_running.pid, signal.SIGKILL)
    sys.exit(128 + signum)


def run_step(name: str, command: list, log_path: Path, env: dict, timeout: float) -> dict:
    """Run one step with its own time limit, its output appended to `log_path`; a step past it is
    killed (its whole process group) and reported as timed out, so the steps after it still run."""
    global _running
    header = f"== {name} (limit {timeout:.0f} s): {' '.join(map(str, command))}"
    print(header, flush=True)
    started = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(header + "\n")
        log.flush()
        _running = subprocess.Popen(
            [sys.executable, "-c", REAPER, str(os.getpid()), *map(str, command)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, which a timeout, a signal or the reaper kills
        )
        try:
            exit_code, timed_out = _running.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(_running.pid, signal.SIGKILL)
            exit_code, timed_out = _running.wait(), True
        finally:
            _running = None
    seconds = time.perf_counter() - started
    verdict = f"TIMED OUT after {timeout:.0f} s" if timed_out else f"exit {exit_code} after {seconds:.0f} s"
    print(f"   {verdict} (log: {log_path})", flush=True)
    return {"exit_code": exit_code, "timed_out": timed_out, "seconds": round(seconds, 1)}


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


def loss_agreement(fp32_dir: Path, other_dir: Path) -> dict | None:
    """Per-step training losses of a reduced-precision run against fp32's (same data and seed)."""

    def losses(directory):
        history = directory / "log_history.jsonl"
        if not history.exists():
            return []
        return [json.loads(line)["loss"] for line in history.read_text().splitlines() if '"loss"' in line]

    reference, other = losses(fp32_dir), losses(other_dir)
    diffs = [abs(a - b) / abs(b) for a, b in zip(other, reference, strict=False) if b]
    if not diffs:
        return None
    return {
        "steps": len(diffs),
        "max_relative_difference": max(diffs),
        "mean_relative_difference": sum(diffs) / len(diffs),
        "final_loss_fp32": reference[-1],
        "final_loss": other[-1],
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = float(os.environ.get("GPU_CHECK_STARTED") or time.time())  # gpu_check.sh's start
    budget = Budget(args.budget_s, started)
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:  # a rerun into the same folder starts clean
        (out / name).unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))  # models, checkpoints, trials
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _kill_running_step)
    sizes, limits = plan(args), LIMITS[args.dry_run]
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
        "budget_s": args.budget_s,
        "planned_steps": args.steps,
        "steps": {},
        "tables": {},
    }
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; use --dry_run to rehearse the plan on a CPU.")
    preflight()

    def step(name: str, command: list) -> dict | None:
        """Run the step if its limit fits in the budget, else record it as not run."""
        refusal = budget.refusal(limits[name])
        if refusal:
            print(f"== {name}: not run: {refusal}", flush=True)
            summary["steps"][name] = {"not_run": refusal}
            write_summary(summary, out)
            return None
        summary["steps"][name] = run_step(name, command, out / "check.log", env, limits[name])
        return summary["steps"][name]

    try:
        write_summary(summary, out)
        # Without dropout: fp16 pads batches to a multiple of 8 and fp32 does not, so dropout would
        # draw different masks for the same tokens and blur the fp16-vs-fp32 loss comparison.
        model = random_bert(
            work / "model", **sizes["model"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
        if "gpu_tests" in args.steps:
            run_gpu_tests(summary, step, out)
        if "finetune" in args.steps:
            run_finetunes(summary, step, sizes["finetune"], model, work, out)
        benchmark = [sys.executable, "scripts/benchmark_precision.py", "--config_name", model]
        if "benchmark" in args.steps:
            run_benchmark(
                summary, step, [*benchmark, *sizes["benchmark"]], "benchmark", work, out, args.dry_run
            )
        if "fp8" in args.steps:
            run_fp8(summary, step, [*benchmark, *sizes["fp8"]], work, out, args.dry_run)
        if "compiled" in args.steps:
            compiled = [*benchmark, *without_fp8_where_refused(sizes["compiled"]), "--no_search"]
            run_benchmark(summary, step, compiled, "compiled", work, out, args.dry_run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["seconds"] = round(time.time() - started, 1)
    text = write_summary(summary, out)
    print(text)
    return summary


def run_gpu_tests(summary: dict, step, out: Path) -> None:
    pytest_command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "tests/gpu",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
    ]
    if step("gpu_tests", [*pytest_command, f"--junitxml={out / 'pytest.xml'}"]):
        summary["steps"]["gpu_tests"].update(pytest_counts(out / "pytest.xml"))
        summary["overflow_test"] = test_outcome(out / "pytest.xml", "test_injected_overflow")
    write_summary(summary, out)


def run_finetunes(summary: dict, step, sizes: list, model: Path, work: Path, out: Path) -> None:
    """fp32, fp16 and bf16 on the same data and seed; then the saved fp16 model, reloaded and
    evaluated under fp16 the way a user would, must score what its run wrote."""
    recipe = [sys.executable, "recipes/bert_glue.py", "--task_name", "mrpc", "--data_dir", GLUE_DIR]
    for arm, precision in (("fp32", "no"), ("fp16", "fp16"), ("bf16", "bf16")):
        command = [
            *(*recipe, "--model_name_or_path", model, *sizes, "--logging_steps", 1),
            *("--mixed_precision", precision, "--output_dir", work / f"finetune_{arm}"),
        ]
        if step(f"finetune_{arm}", command):
            summary[f"finetune_{arm}"] = read_json(work / f"finetune_{arm}" / "eval_results.json")
        summary["loss_agreement"] = loss_agreement(work / "finetune_fp32", work / "finetune_fp16")
        summary["loss_agreement_bf16"] = loss_agreement(work / "finetune_fp32", work / "finetune_bf16")
        write_summary(summary, out)
    if summary.get("finetune_fp16"):
        saved = work / "finetune_fp16"
        reloaded = work / "reload_fp16"
        command = [*recipe, "--model_name_or_path", saved, "--eval_only", "--mixed_precision", "fp16"]
        command += [*sizes, "--output_dir", reloaded]
        if step("reload_fp16", command):
            scores = read_json(reloaded / "eval_results.json")
            summary["reload_fp16"] = {k: v for k, v in scores.items() if k.startswith("eval_")}
        write_summary(summary, out)


def run_benchmark(
    summary: dict, step, command: list, name: str, work: Path, out: Path, dry_run: bool
) -> None:
    """One benchmark step into the scratch folder; its figures into the summary, its table into
    summary.md, the main benchmark's chart as benchmark.png."""
    limit = LIMITS[dry_run][name]
    folder = work / name
    command = [*command, "--time_limit_s", max(limit - TRIAL_S[dry_run], 1), "--bench_id", name]
    step(name, [*command, "--output_dir", folder])
    if (folder / "results.json").exists():
        summary[name] = read_json(folder / "results.json")
        summary["tables"][name] = (folder / "results.md").read_text().split("\n", 2)[2].strip()
        crashed = {arm: r["crashed"] for arm, r in summary[name]["arms"].items() if r.get("crashed")}
        if crashed:
            summary["steps"][name]["crashed"] = crashed
        if name == "benchmark" and (folder / "results.png").exists():
            shutil.copyfile(folder / "results.png", out / "benchmark.png")
    write_summary(summary, out)


def run_fp8(summary: dict, step, benchmark: list, work: Path, out: Path, dry_run: bool) -> None:
    """The fp8 benchmarks (eager), or the one-sentence reason why this machine cannot run them
    (the recipes' own refusal: compute capability below 8.9, or torchao not installed)."""
    from amp_recipes.hardware import device_facts
    from amp_recipes.precision import fp8_refusal

    summary["fp8"] = {"not_run": fp8_refusal(device_facts(), "ao"), "by_seq_len": {}}
    if summary["fp8"]["not_run"]:
        print(f"== fp8: not run: {summary['fp8']['not_run']}", flush=True)
        write_summary(summary, out)
        return
    for seq_len in FP8_SEQ_LENS[dry_run]:
        name = f"fp8_seq{seq_len}"
        run_benchmark(
            summary, step, [*benchmark, "--seq_len", seq_len, "--no_search"], name, work, out, dry_run
        )
        if name in summary:
            summary["fp8"]["by_seq_len"][str(seq_len)] = summary.pop(name)
    write_summary(summary, out)


# Every import the plan needs, and where it comes from on a GPU image that lacks it. torchao is
# not here: without it the fp8 step records why it did not run (the recipes' own refusal).
NEEDED = {
    "transformers": "the image",
    "accelerate": "the image",
    "safetensors": "the image",
    "pytest": "the image",
    "matplotlib": "the image",
    "datasets": "carried wheels (datasets, dill, multiprocess, xxhash)",
    "evaluate": "carried wheels (evaluate)",
}


def preflight() -> None:
    """Stop before any step when an import the plan needs is missing, with the line that fixes it."""
    import importlib.util

    missing = [
        f"{name} ({source})" for name, source in NEEDED.items() if importlib.util.find_spec(name) is None
    ]
    if missing:
        sys.exit(
            f"error: missing {', '.join(missing)}: run `bash scripts/fetch_gpu_wheels.sh` where pip works, "
            "carry .whl/ with the checkout, and start the check with `bash scripts/gpu_check.sh` (it installs them)."
        )


def without_fp8_where_refused(flags: list) -> list:
    """The compiled arms less the fp8 one where this machine cannot run fp8 (the fp8 step says why)."""
    from amp_recipes.hardware import device_facts
    from amp_recipes.precision import fp8_refusal

    if not fp8_refusal(device_facts(), "ao"):
        return flags
    at = flags.index("--arms") + 1
    arms = ",".join(arm for arm in flags[at].split(",") if not arm.startswith("fp8"))
    return [*flags[:at], arms, *flags[at + 1 :]]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


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
    (a step not asked for with --steps, or one this machine cannot run). A step the budget left
    out has no figures: the checks that need them fail (the compiled arms have none)."""
    dry_run, steps = summary["dry_run"], summary["steps"]
    planned = summary.get("planned_steps", STEPS)
    ran = {name: s for name, s in steps.items() if "not_run" not in s}
    tests = steps.get("gpu_tests", {})
    arms = (summary.get("benchmark") or {}).get("arms", {})
    expected = EXPECTED_PRECISION[dry_run]
    agreement = summary.get("loss_agreement")
    fp16, bf16 = summary.get("finetune_fp16", {}), summary.get("finetune_bf16", {})
    fp16_scores = {k: v for k, v in fp16.items() if k.startswith("eval_")}
    found = {
        "every_step_finished_in_time": bool(ran)
        and all(s["exit_code"] == 0 and not s["timed_out"] for s in ran.values()),
        # On the GPU every gpu test must run (none skipped); on a CPU they all skip.
        "gpu_tests_passed": tests.get("tests", 0) >= 6
        and tests.get("failures", 1) == 0
        and tests.get("errors", 1) == 0
        and (tests.get("skipped") == tests.get("tests") if dry_run else tests.get("skipped") == 0),
        "overflow_step_skipped": None if dry_run else summary.get("overflow_test") == "passed",
        "every_arm_ran_its_precision": set(arms) == set(expected)
        and all(r.get("precision_in_effect") == expected[a] and r.get("fits") for a, r in arms.items())
        and not any(r.get("crashed") for r in arms.values()),
        "fp16_fine_tune_ran_fp16": fp16.get("precision_in_effect") == ("fp32" if dry_run else "fp16"),
        "bf16_fine_tune_ran_bf16": bf16.get("precision_in_effect") == "bf16",
        "fp16_loss_agrees_with_fp32": bool(agreement)
        and agreement["max_relative_difference"] <= LOSS_TOLERANCE,
        "fp16_model_reloads_to_its_scores": bool(fp16_scores) and summary.get("reload_fp16") == fp16_scores,
        "fp8_arms_ran_fp8": fp8_ran(summary.get("fp8"), dry_run),
    }
    step_of = {
        "gpu_tests_passed": "gpu_tests",
        "overflow_step_skipped": "gpu_tests",
        "fp8_arms_ran_fp8": "fp8",
        "every_arm_ran_its_precision": "benchmark",
    }
    for name in ("fp16_fine_tune_ran_fp16", "bf16_fine_tune_ran_bf16", "fp16_loss_agrees_with_fp32"):
        step_of[name] = "finetune"
    step_of["fp16_model_reloads_to_its_scores"] = "finetune"
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
    text = summary_markdown(summary)
    from amp_recipes.records import write_text_atomic  # written aside and renamed: a kill never halves it

    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2, default=str))
    write_text_atomic(out / "summary.md", text)
    return text


def summary_markdown(summary: dict) -> str:
    lines = [
        f"# GPU check ({'dry run, CPU' if summary['dry_run'] else summary['device']}), {summary['date']}",
        "",
        f"Budget {summary['budget_s']:.0f} s"
        + (f", used {summary['seconds']:.0f} s." if "seconds" in summary else "."),
        "",
        "| step | exit | seconds | detail |",
        "|---|---|---|---|",
    ]
    for name, step in summary["steps"].items():
        if "not_run" in step:
            lines.append(f"| {name} | not run: {step['not_run']} | — | |")
            continue
        detail = ""
        if name == "gpu_tests" and "tests" in step:
            detail = f"{step['tests']} tests, {step['failures']} failed, {step['errors']} errors, {step['skipped']} skipped"
        elif name.startswith("finetune_") and summary.get(name):
            r = summary[name]
            detail = (
                f"ran as {r['precision_in_effect']}, {r['train_samples_per_second']:.1f} samples/s, "
                f"peak {r['peak_memory_bytes'] / 2**30:.2f} GiB, eval acc {r.get('eval_accuracy', float('nan')):.3f}"
            )
        elif name == "reload_fp16" and summary.get("reload_fp16"):
            detail = f"reloaded fp16 model: {summary['reload_fp16']}"
        if step.get("crashed"):
            detail = "; ".join(f"{arm} crashed: {reason}" for arm, reason in step["crashed"].items())
            detail = detail.replace("|", "\\|")
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
    for arm in ("fp16", "bf16"):
        agreement = summary.get("loss_agreement" if arm == "fp16" else "loss_agreement_bf16")
        if agreement:
            lines += [
                "",
                f"Fine-tune loss agreement {arm} vs fp32 over {agreement['steps']} steps: max relative "
                f"difference {agreement['max_relative_difference']:.2e}, mean {agreement['mean_relative_difference']:.2e}; "
                f"final loss {agreement['final_loss_fp32']:.4f} (fp32) vs {agreement['final_loss']:.4f} ({arm}).",
            ]
    titles = {"benchmark": "Paired benchmark", "compiled": "Compiled arms"}
    for name, table in summary["tables"].items():
        title = titles.get(name) or f"fp8 benchmark, seq {name.removeprefix('fp8_seq')}"
        lines += ["", f"## {title}", "", table]
    fp8 = summary.get("fp8")
    if fp8 and fp8["not_run"]:
        lines += ["", "## fp8", "", f"Not run: {fp8['not_run']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(0 if main().get("ok") else 1)
