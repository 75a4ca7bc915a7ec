"""One writer for the reports of every measuring tool (the precision doctor, the precision
benchmark, the paired runs, the GPU check, compare_runs): `<name>.json` and `<name>.md` written
atomically, markdown tables, and the report as a tracker run (W&B and/or TensorBoard) through
accelerate's tracker classes. The tools train nothing, so no Accelerator holds these trackers; a
recipe's own run logs through its Accelerator (amp_recipes.training.outputs)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

from amp_recipes.training.outputs import write_text_atomic


def json_safe(value):
    """NaN (an sd of one seed) and infinities as null: the JSON stays standard JSON for other tools."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def table(header: list, rows: list[list]) -> list[str]:
    """A markdown table's lines (a "|" inside a cell escaped)."""

    def line(cells):
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


def write(folder: str | Path, name: str, payload: dict, text: str) -> None:
    """`<folder>/<name>.json` (NaN as null) and `<name>.md`, each written aside and renamed into
    place: a report stopped half-way is the old one or the new one, never a torn one."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # default=str: a value JSON has no type for (a Path, a dtype) is written as it prints
    write_text_atomic(folder / f"{name}.json", json.dumps(json_safe(payload), indent=2, default=str))
    write_text_atomic(folder / f"{name}.md", text)


def trackers(report_to: str) -> list[str]:
    """The trackers a recipe's --report_to turns on: `all` is accelerate's, every one installed."""
    if report_to != "all":
        return [] if report_to == "none" else [report_to]
    return [name for name in ("wandb", "tensorboard") if importlib.util.find_spec(name) is not None]


def log_run(
    report_to: list[str],
    project: str,
    name: str,
    config: dict,
    summary: dict,
    *,
    wandb_kwargs: dict | None = None,
    tensorboard_dir: str | Path | None = None,
    history: list[dict] = (),
    tables: dict | None = None,
    images: dict | None = None,
    text: str | None = None,
) -> dict:
    """The report as a run of each tracker in `report_to` ("wandb", "tensorboard"); returns where
    each went ({"wandb": the run, finished; "tensorboard": its folder}).

    W&B (accelerate's WandBTracker; `wandb_kwargs` go to wandb.init: group, job_type, tags, entity,
    dir, and id with resume="allow" to continue a run): the config, the `history` rows (row i at
    step i), `tables` ({key: (columns, rows)}), `images` ({key: png path}), then the summary. The
    summary replaces what a continued run had: a figure the report no longer has must not stand
    beside the new ones.

    TensorBoard (accelerate's TensorBoardTracker in `tensorboard_dir`, written anew): the history
    rows' numbers at their steps, the summary's numbers as scalars at step 0, the config and `text`
    (under the folder's name) as text."""
    from accelerate import PartialState
    from accelerate.tracking import TensorBoardTracker, WandBTracker

    PartialState()  # the trackers log through accelerate's logger, which needs the process's state
    where = {}
    if "wandb" in report_to:
        import wandb

        tracker = WandBTracker(project, name=name, **(wandb_kwargs or {}))
        tracker.start()
        run = tracker.tracker
        try:
            tracker.store_init_configuration(config)
            for step, row in enumerate(history):
                tracker.log(row, step=step)
            for key, (columns, rows) in (tables or {}).items():
                tracker.log_table(key, columns=columns, data=rows)
            if images:
                tracker.log({key: wandb.Image(str(path)) for key, path in images.items()})
            logged = {*summary, *(tables or {}), *(images or {}), *(key for row in history for key in row)}
            for key in [key for key in run.summary.keys() if key not in logged and not key.startswith("_")]:
                del run.summary[key]
            run.summary.update(summary)
        finally:
            tracker.finish()
        where["wandb"] = run
    if "tensorboard" in report_to and tensorboard_dir is not None:
        folder = Path(tensorboard_dir)
        shutil.rmtree(folder, ignore_errors=True)  # an earlier report's, for the same name
        tracker = TensorBoardTracker(folder.name, folder.parent)
        tracker.start()
        writer = tracker.tracker
        try:
            for step, row in enumerate(history):
                for key, value in row.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        writer.add_scalar(key, value, global_step=step)
            for key, value in summary.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    writer.add_scalar(key, value, global_step=0)
            writer.add_text("config", json.dumps(json_safe(config), indent=2, default=str), global_step=0)
            if text:
                writer.add_text(folder.name, text, global_step=0)
        finally:
            tracker.finish()
        where["tensorboard"] = folder
    return where
