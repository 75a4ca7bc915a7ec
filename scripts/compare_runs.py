"""Compare finished fine-tuning runs of recipes/bert_glue.py, e.g. an fp32/fp16 pair, without W&B.

    python scripts/compare_runs.py outputs/mrpc-fp32 outputs/mrpc-fp16 --output comparison

Reads each run's eval_results.json and log_history.jsonl and writes <output>.md (final metrics,
precision, throughput, peak memory, with ratios against the first run), <output>.json (each run's
results and history) and <output>.png (loss curves). Prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_run(path: Path) -> dict:
    results_file = path / "eval_results.json"
    if not results_file.is_file():
        raise SystemExit(f"error: {path} has no eval_results.json (not a finished bert_glue.py run).")
    history_file = path / "log_history.jsonl"
    history = (
        [json.loads(line) for line in history_file.read_text().splitlines()] if history_file.is_file() else []
    )
    return {"name": path.name, "results": json.loads(results_file.read_text()), "history": history}


def markdown(runs: list[dict]) -> str:
    from amp_recipes.measure.report import table

    metric_names = sorted({k for run in runs for k in run["results"] if k.startswith("eval_")})
    header = ["run", "precision", *metric_names, "train time (s)", "samples/s", "tokens/s"]
    header += ["peak memory (GiB)", "speedup", "memory drop"]
    rows = []
    base = runs[0]["results"]
    for run in runs:
        r = run["results"]
        speedup = r["train_samples_per_second"] / base["train_samples_per_second"]
        drop = 100 * (1 - r["peak_memory_bytes"] / base["peak_memory_bytes"])
        cells = [run["name"], r.get("precision_in_effect", "?")]
        cells += [
            ("—" if m not in r else f"{r[m]:.4f}" if isinstance(r[m], float) else str(r[m]))
            for m in metric_names
        ]
        cells += [
            f"{r['train_runtime_seconds']:.1f}",
            f"{r['train_samples_per_second']:.1f}",
            f"{r['train_tokens_per_second']:.0f}",
            f"{r['peak_memory_bytes'] / 2**30:.2f}",
            f"{speedup:.2f}x",
            f"{drop:.1f}%",
        ]
        rows.append(cells)
    return "\n".join(table(header, rows)) + f"\n\nRatios are against the first run ({runs[0]['name']}).\n"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for run in runs:
        points = [(row["step"], row["loss"]) for row in run["history"] if "loss" in row]
        if points:
            steps, losses = zip(*points, strict=True)
            axis.plot(
                steps, losses, label=f"{run['name']} ({run['results'].get('precision_in_effect', '?')})"
            )
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("training loss")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> str:
    from amp_recipes.measure import report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="Output directories of bert_glue.py runs.")
    parser.add_argument(
        "--output", type=Path, default=Path("comparison"), help="Writes <output>.md, .json and .png."
    )
    args = parser.parse_args(argv)
    if len(args.run_dirs) < 2:
        parser.error("give at least two run directories to compare.")
    runs = [load_run(path) for path in args.run_dirs]
    table = markdown(runs)
    payload = {"runs": [{"path": str(path), **run} for path, run in zip(args.run_dirs, runs, strict=True)]}
    report.write(args.output.parent, args.output.with_suffix("").name, payload, table)
    plot(runs, args.output.with_suffix(".png"))
    print(table)
    return table


if __name__ == "__main__":
    main(sys.argv[1:])
