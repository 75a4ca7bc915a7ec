"""One-shot GPU validation of the repository's fp16 claims (about 8 minutes on one H200).

    bash scripts/gpu_check.sh --output_dir gpu_check_results
    bash scripts/gpu_check.sh --dry_run --output_dir /tmp/gpu_check   # same plan, CPU, tiny model, < 2 min

Run it through scripts/gpu_check.sh, which first installs carried wheels of packages a GPU
image may lack. Three steps, everything written into --output_dir:

1. `pytest -m gpu tests/gpu`: accelerate's real CUDA fp16 path (GradScaler, a skipped step on an
   injected overflow with the scheduler held, scaler state through save/load), bf16, hardware
   facts, and the recipe logging its loss scale  -> pytest.xml, pytest.log
2. the paired benchmark on BERT-base (random weights from config), seq 128, arms
   fp32/tf32/fp16/bf16, with a capped max-batch search  -> benchmark/results.{json,md,png}
3. a short fine-tune of recipes/bert_glue.py on MRPC in fp32 and in fp16, for loss agreement
   -> finetune_fp32/, finetune_fp16/

and summary.json + summary.md, printed at the end. Data and models come from --shared_dir
(the layout of ../shared: data/glue/MRPC, models/tiny-random-bert, models/bert-base-uncased).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry_run", action="store_true", help="The same plan on CPU with the tiny model.")
    parser.add_argument("--output_dir", type=Path, default=Path("gpu_check_results"))
    parser.add_argument(
        "--shared_dir", type=Path, default=Path(os.environ.get("AMP_SHARED_DIR", REPO.parent / "shared"))
    )
    return parser.parse_args(argv)


def plan(args) -> dict:
    """Sizes of each step: the real ones fit about 8 minutes on an H200."""
    if args.dry_run:
        return {
            "benchmark": [
                "--config_name",
                args.shared_dir / "models" / "tiny-random-bert",
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
                256,
                "--search_granularity",
                256,
                "--search_max",
                1024,
            ],
            "model": args.shared_dir / "models" / "tiny-random-bert",
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
        "model": None,  # BERT-base with random weights, built below from the real config and vocab
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
    }


def run_step(name: str, command: list, log_path: Path, env: dict) -> dict:
    print(f"== {name}: {' '.join(map(str, command))}", flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        completed = subprocess.run(
            [str(c) for c in command], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    seconds = time.perf_counter() - started
    print(f"   exit {completed.returncode} after {seconds:.0f} s (log: {log_path})", flush=True)
    return {"exit_code": completed.returncode, "seconds": round(seconds, 1), "log": str(log_path)}


def random_bert_base(shared_dir: Path, target: Path) -> Path:
    """bert-base-uncased's exact architecture and tokenizer with random weights (no download)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, BertTokenizerFast

    source = shared_dir / "models" / "bert-base-uncased"
    config = AutoConfig.from_pretrained(source, num_labels=2)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(target)
    BertTokenizerFast(vocab_file=str(source / "vocab.txt"), do_lower_case=True).save_pretrained(target)
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
    glue_dir = args.shared_dir / "data" / "glue"
    env = dict(
        os.environ,
        AMP_SHARED_DIR=str(args.shared_dir.resolve()),
        GLUE_DIR=str(glue_dir.resolve()),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
        WANDB_MODE="offline",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    import torch

    summary = {
        "dry_run": args.dry_run,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "steps": {},
    }
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; use --dry_run to rehearse the plan on a CPU.")

    # 1. the GPU-marked tests
    step = run_step(
        "gpu tests",
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "tests/gpu",
            "-q",
            "-rs",
            f"--junitxml={out / 'pytest.xml'}",
        ],
        out / "pytest.log",
        env,
    )
    summary["steps"]["gpu_tests"] = {**step, **pytest_counts(out / "pytest.xml")}

    # 2. the paired precision benchmark
    step = run_step(
        "benchmark",
        [
            sys.executable,
            "scripts/benchmark_precision.py",
            *sizes["benchmark"],
            "--bench_id",
            "gpu-check",
            "--output_dir",
            out / "benchmark",
        ],
        out / "benchmark.log",
        env,
    )
    results_file = out / "benchmark" / "results.json"
    summary["steps"]["benchmark"] = step
    if results_file.exists():
        summary["benchmark"] = json.loads(results_file.read_text())

    # 3. the recipe, fp32 and fp16, on the same data and seed
    model = sizes["model"] or random_bert_base(args.shared_dir, out / "bert-base-random")
    for arm, precision in (("fp32", "no"), ("fp16", "fp16")):
        command = [
            sys.executable,
            "recipes/bert_glue.py",
            "--task_name",
            "mrpc",
            "--data_dir",
            glue_dir,
            "--model_name_or_path",
            model,
            *sizes["finetune"],
            "--logging_steps",
            1,
            "--mixed_precision",
            precision,
            "--output_dir",
            out / f"finetune_{arm}",
        ]
        summary["steps"][f"finetune_{arm}"] = run_step(
            f"fine-tune {arm}", command, out / f"finetune_{arm}.log", env
        )
        results = out / f"finetune_{arm}" / "eval_results.json"
        if results.exists():
            summary[f"finetune_{arm}"] = json.loads(results.read_text())
    summary["loss_agreement"] = loss_agreement(out / "finetune_fp32", out / "finetune_fp16")
    summary["ok"] = all(s["exit_code"] == 0 for s in summary["steps"].values())

    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    text = summary_markdown(summary, out)
    (out / "summary.md").write_text(text)
    print(text)
    return summary


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
        lines.append(f"| {name} | {step['exit_code']} | {step['seconds']} | {detail} |")
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
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(0 if main().get("ok") else 1)
