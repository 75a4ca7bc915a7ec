"""The GPU check: the CUDA test suite, then the precision figures, in one command, on your GPU machine.

    bash scripts/gpu_check.sh --output_dir gpu_check_results
    bash scripts/gpu_check.sh --dry_run --output_dir /tmp/gpu_check    # the same parts on a CPU

Three parts, one after the other; a part that fails (or crashes) does not stop the next:

1. suite: `pytest tests/gpu`, each test stopped by pytest-timeout after --test_timeout_s: accelerate's
   fp16/bf16/fp8 paths, TF32 and torch.compile, the recipe's fine-tunes per precision and the saved
   model's reload on one GPU; DDP, FSDP2 and ZeRO-2 fp16 and a killed rank on two or more (skipped,
   and said so, on one).
2. doctor: `amp-recipes doctor` on MRPC with BERT-base's architecture (random weights): each
   precision's step time, peak memory and largest batch, the fp16 risk, its advice.
3. paired: `scripts/paired_runs.py --arms fp32,fp16` (the dry run: fp32,bf16, which a CPU runs),
   two seeds of a short MRPC fine-tune (the dry run: one): the speedup and the peak-memory drop
   against fp32.

summary.json and summary.md in --output_dir hold each part's verdict, its figures and its log's
name; the check reads "ok" (exit 0) when every part is ok, "NOT OK" (exit 1) otherwise. Data and
models come from the checkout (data/glue, data/models/bert-base-uncased), nothing from the network.
The dry run shrinks BERT to 2 layers of width 32 and runs every part on a CPU, where the suite's
tests skip (no CUDA): a rehearsal of the set-up before you rent a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GLUE_DIR = REPO / "data" / "glue"
BERT_BASE = REPO / "data" / "models" / "bert-base-uncased"
# The dry run's model: BERT-base's vocabulary and layout, shrunk so a CPU trains it in seconds.
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
PARTS = ("suite", "doctor", "paired")
# Not measured on a GPU yet: the longest tests launch two 60-step BERT-base fine-tunes, or a
# 250-step run and its resume; a first torch.compile without a cache takes 40-90 s (issue #63).
TEST_TIMEOUT_S = 600
# Every part reads the checkout's files only: the Hub and the libraries' lookups stay offline.
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_EVALUATE_OFFLINE": "1",
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", type=Path, default=Path("gpu_check_results"))
    parser.add_argument("--dry_run", action="store_true", help="Every part on a CPU with a tiny BERT.")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"Comma-separated subset of {','.join(PARTS)} (default: all).",
    )
    parser.add_argument(
        "--test_timeout_s",
        type=int,
        default=TEST_TIMEOUT_S,
        help=f"pytest-timeout's limit for each test of the suite (default {TEST_TIMEOUT_S}).",
    )
    args = parser.parse_args(argv)
    asked = {part.strip() for part in args.parts.split(",") if part.strip()}
    if not asked or asked - set(PARTS):
        parser.error(f"--parts {args.parts!r}: choose one or more of {', '.join(PARTS)}.")
    args.parts = [part for part in PARTS if part in asked]  # always in the check's order
    return args


def random_bert(target: Path, **config_overrides) -> Path:
    """bert-base-uncased's architecture (with `config_overrides`) and tokenizer from the checkout,
    random weights, saved to `target`."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(BERT_BASE, num_labels=2, **config_overrides)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(target)
    AutoTokenizer.from_pretrained(BERT_BASE).save_pretrained(target)
    return target


def run_part(name: str, command: list, out: Path) -> tuple[int, float]:
    """The part's command, its output in <out>/<name>.log; (exit code, seconds)."""
    print(f"[{name}] {' '.join(map(str, command))}", flush=True)
    started = time.monotonic()
    # Offline; and a test-CPU log of an enclosing pytest (AMP_TEST_CPU_LOG) is not the suite's to write.
    env = {**{k: v for k, v in os.environ.items() if k != "AMP_TEST_CPU_LOG"}, **OFFLINE}
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.run(
            [str(c) for c in command], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode
    return code, round(time.monotonic() - started, 1)


def suite(args, out: Path, work: Path) -> dict:
    import importlib.util

    missing = [name for name in ("pytest", "pytest_timeout") if importlib.util.find_spec(name) is None]
    if missing:
        why = f'{" and ".join(missing)} not installed: pip install -e ".[gpu-check]"'
        return {"ok": False, "why": why, "seconds": 0.0}
    junit = out / "pytest.xml"
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-rs", "-p", "no:cacheprovider"]
    command += [f"--timeout={args.test_timeout_s}", f"--junitxml={junit}"]
    code, seconds = run_part("suite", command, out)
    counts, failed = {}, []
    if junit.exists():
        root = ElementTree.parse(junit).getroot()
        tests = root if root.tag == "testsuite" else root.find("testsuite")
        counts = {key: int(tests.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        failed = [
            f"{case.get('classname')}::{case.get('name')}"
            for case in tests.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None
        ]
    passed = counts.get("tests", 0) - sum(counts.get(key, 0) for key in ("failures", "errors", "skipped"))
    # On a GPU the one-GPU tests must run; on a CPU (the dry run) every test skips itself.
    ok = code == 0 and bool(counts) and (args.dry_run or passed > 0)
    why = "" if ok else ("no test ran: no CUDA GPU" if code == 0 and counts else f"pytest exited {code}")
    return {"ok": ok, "why": why, "seconds": seconds, "passed": passed, **counts, "failed": failed}


def doctor(args, out: Path, work: Path) -> dict:
    model = random_bert(work / "doctor-model", **(TINY if args.dry_run else {}))
    # On a GPU the doctor's own defaults (the card itself as the budget), within its --budget_s.
    sizes = (
        ["--probe_steps", 2, "--timed_steps", 2, "--memory_budget_gb", 4]
        if args.dry_run
        else ["--budget_s", 300]
    )
    command = [sys.executable, "-m", "amp_recipes.cli", "doctor", "--recipe", "bert_glue", *sizes]
    command += ["--report_dir", out / "doctor", "--"]
    command += ["--task_name", "mrpc", "--data_dir", GLUE_DIR, "--model_name_or_path", model]
    command += ["--max_train_samples", 64 if args.dry_run else 512, "--output_dir", work / "doctor-run"]
    code, seconds = run_part("doctor", command, out)
    report_path = out / "doctor" / "doctor.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    # Every precision the device runs: fp16 needs a GPU (accelerate ignores it on a CPU).
    wanted = {"fp32", "bf16"} if args.dry_run else {"fp32", "fp16", "bf16"}
    timed = set(report.get("speed", {}))
    ok = code == 0 and wanted <= timed
    why = "" if ok else (f"doctor exited {code}" if code else f"not timed: {sorted(wanted - timed)}")
    figures = {key: report[key] for key in ("speed", "largest_batch", "recommendation") if key in report}
    return {"ok": ok, "why": why, "seconds": seconds, **figures}


def paired(args, out: Path, work: Path) -> dict:
    model = random_bert(work / "paired-model", **(TINY if args.dry_run else {}))
    arms = "fp32,bf16" if args.dry_run else "fp32,fp16"
    seeds = 1 if args.dry_run else 2  # the dry run rehearses the command, it measures nothing
    pair = out / "paired"
    command = [
        sys.executable,
        "scripts/paired_runs.py",
        "--arms",
        arms,
        "--seeds",
        seeds,
        "--output_dir",
        pair,
    ]
    command += ["--task_name", "mrpc", "--data_dir", GLUE_DIR, "--model_name_or_path", model]
    command += ["--max_train_samples", 64 if args.dry_run else 1024, "--num_train_epochs", 1]
    code, seconds = run_part("paired", command, out)
    comparison = pair / "comparison.json"
    figures = json.loads(comparison.read_text()) if comparison.exists() else {}
    reduced = arms.split(",")[1]
    in_effect = figures.get("per_arm", {}).get(reduced, {}).get("precision_in_effect")
    ok = code == 0 and in_effect == [reduced]
    why = "" if ok else (f"paired_runs exited {code}" if code else f"the {reduced} arm ran {in_effect}")
    against = figures.get("vs_fp32", {}).get(reduced, {})
    return {
        "ok": ok,
        "why": why,
        "seconds": seconds,
        "arm": reduced,
        "seeds": seeds,
        "speedup": against.get("speedup", {}).get("mean"),
        "memory_drop_percent": against.get("memory_drop_percent", {}).get("mean"),
        "metrics": {name: metric["verdict"] for name, metric in against.get("metrics", {}).items()},
    }


def figures_lines(summary: dict) -> list[str]:
    """The headline figures: the doctor's per precision, the paired runs' against fp32."""
    from amp_recipes.measure import report

    lines = []
    doctor_part = summary["parts"].get("doctor", {})
    if doctor_part.get("speed"):
        rows = []
        for precision, speed in doctor_part["speed"].items():
            largest = doctor_part.get("largest_batch", {}).get(precision, {})
            batch = largest.get("max_batch_size")
            if batch is None:
                batch = largest.get("why", "not measured")
            elif largest.get("search_stopped") or largest.get("capped_at_search_max"):
                batch = f"{batch}+"  # a lower bound, as doctor.md writes it
            step_ms, peak = f"{speed['step_time_s'] * 1000:.1f}", f"{speed['peak_memory_bytes'] / 2**30:.2f}"
            rows.append([precision, step_ms, peak, batch])
        header = ["precision (doctor)", "step time (ms)", "peak memory (GiB)", "largest batch"]
        lines += ["", *report.table(header, rows)]
    paired_part = summary["parts"].get("paired", {})
    if paired_part.get("speedup") is not None:
        verdicts = ", ".join(f"{name} {verdict}" for name, verdict in paired_part["metrics"].items())
        seeds = "one seed" if paired_part["seeds"] == 1 else f"the mean over {paired_part['seeds']} seeds"
        lines += [
            "",
            f"Paired runs, {paired_part['arm']} against fp32 ({seeds}): speedup "
            f"{paired_part['speedup']:.2f}x, peak-memory drop {paired_part['memory_drop_percent']:.1f}%; {verdicts}.",
        ]
    return lines


def write_summary(summary: dict, out: Path) -> None:
    """summary.json and summary.md, each written aside and renamed: a check stopped at any moment
    leaves a whole summary of the parts it finished."""
    from amp_recipes.measure import report

    rows = [
        [name, "ok" if part["ok"] else f"NOT OK: {part['why']}", part["seconds"], f"{name}.log"]
        for name, part in summary["parts"].items()
    ]
    lines = [
        f"# GPU check: {summary['verdict']}",
        "",
        *report.table(["part", "verdict", "seconds", "log"], rows),
    ]
    suite_part = summary["parts"].get("suite")
    if suite_part:
        lines += ["", f"Suite: {suite_part.get('passed', 0)} passed, {suite_part.get('skipped', 0)} skipped "]
        lines[-1] += "(pytest.xml and suite.log say which and why)."
        lines += [f"- failed: {name}" for name in suite_part.get("failed", [])]
    lines += figures_lines(summary)
    reports = {"doctor": "doctor/doctor.md (the doctor)", "paired": "paired/comparison.md (the paired runs)"}
    if set(reports) & set(summary["parts"]):
        lines += [
            "",
            f"Reports: {', '.join(text for name, text in reports.items() if name in summary['parts'])}.",
        ]
    hardware = summary["hardware"]
    versions = ", ".join(f"{name} {hardware[name]}" for name in ("torch", "transformers", "accelerate"))
    lines += ["", f"Device: {summary['device']} ({hardware['device_type']}); {versions}"]
    report.write(out, "summary", summary, "\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from amp_recipes.amp.hardware import hardware_record

    hardware = hardware_record()  # the device, its facts, the library versions: as every report has them
    summary = {
        "verdict": "running",
        "dry_run": args.dry_run,
        "device": hardware.get("device_name") or hardware["cpu_model"],
        "hardware": hardware,
        "parts": {},
    }
    work = Path(tempfile.mkdtemp(prefix="amp-gpu-check-"))
    parts = {"suite": suite, "doctor": doctor, "paired": paired}
    try:
        for name in args.parts:
            started = time.monotonic()
            try:
                summary["parts"][name] = parts[name](args, out, work)
            except Exception as error:  # noqa: BLE001 - a crashed part is its verdict, not the check's end
                why = f"crashed: {type(error).__name__}: {error}"
                summary["parts"][name] = {
                    "ok": False,
                    "why": why,
                    "seconds": round(time.monotonic() - started, 1),
                }
            write_summary(summary, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(part["ok"] for part in summary["parts"].values())
    summary["verdict"] = "ok" if ok else "NOT OK"
    write_summary(summary, out)
    print((out / "summary.md").read_text())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
