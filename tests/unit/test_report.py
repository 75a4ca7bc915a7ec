"""amp_recipes.measure.report, the one writer of every measuring tool's report, read back as a user reads
it: the JSON and markdown files, the offline W&B run, the TensorBoard events."""

import json
import math
from pathlib import Path

from wandb_offline import offline_run, offline_summary

from amp_recipes.measure import report


def test_a_report_is_its_json_and_its_markdown(tmp_path):
    """NaN (an sd of one seed) is null and a Path is its text, so other tools read standard JSON;
    a "|" in a cell does not split the markdown table's row."""
    lines = report.table(["arm", "note"], [["fp16", "crashed: a | b"], ["bf16", 1.5]])
    assert lines == ["| arm | note |", "|---|---|", "| fp16 | crashed: a \\| b |", "| bf16 | 1.5 |"]
    payload = {"sd": math.nan, "values": [0.3, math.nan], "where": Path("/x/y")}
    report.write(tmp_path / "out", "results", payload, "\n".join(lines) + "\n")
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == {
        "sd": None,
        "values": [0.3, None],
        "where": "/x/y",
    }
    assert (tmp_path / "out" / "results.md").read_text().splitlines() == lines
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["results.json", "results.md"]


def test_a_report_as_a_wandb_run_and_tensorboard_events(tmp_path, wandb_dir, monkeypatch):
    """One call, both trackers: W&B gets the config, the history row by row, the table and the
    summary; TensorBoard the same history and summary numbers, and the text. (A continued run's
    summary losing the figures the new report no longer has: test_paired_runs' comparison run.)"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    history = [{"loss": 0.5, "step_seconds": 0.1}, {"loss": 0.25, "step_seconds": 0.2}]
    where = report.log_run(
        ["wandb", "tensorboard"],
        "amp-recipes-test",
        "bench-fp16",
        {"arm": "fp16", "hardware": {"device_type": "cpu"}},
        {"speedup": 1.5, "note": "fp16"},
        wandb_kwargs={"group": "bench", "job_type": "fp16", "id": "reportrun1"},
        tensorboard_dir=tmp_path / "logs" / "bench-fp16",
        history=history,
        tables={"comparison": (["arm", "speedup"], [["fp16", 1.5]])},
        text="| arm | speedup |",
    )
    assert where["wandb"].id == "reportrun1" and where["tensorboard"] == tmp_path / "logs" / "bench-fp16"
    run, config, rows = offline_run(wandb_dir)
    assert (run.run_group, run.job_type, run.display_name) == ("bench", "fp16", "bench-fp16")
    assert config["arm"] == "fp16" and config["hardware"] == {"device_type": "cpu"}
    assert [row["loss"] for row in rows if "loss" in row] == [0.5, 0.25]
    # The table's history entry: one dict (wandb 0.17) or its keys nested under "comparison/" (0.2x+).
    entries = [
        row.get("comparison") or {k[11:]: v for k, v in row.items() if k.startswith("comparison/")}
        for row in rows
    ]
    (table,) = [entry["path"] for entry in entries if entry.get("_type") == "table-file"]
    (run_dir,) = (wandb_dir / "wandb").glob("offline-run-*")
    logged = json.loads((run_dir / "files" / table).read_text())
    assert (logged["columns"], logged["data"]) == (["arm", "speedup"], [["fp16", 1.5]])
    summary = offline_summary(wandb_dir)
    assert (summary["speedup"], summary["note"]) == (1.5, "fp16")

    (events,) = (tmp_path / "logs" / "bench-fp16").glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events.parent), size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    assert [(p.step, p.value) for p in accumulator.Scalars("loss")] == [(0, 0.5), (1, 0.25)]
    assert [(p.step, p.value) for p in accumulator.Scalars("speedup")] == [(0, 1.5)]
    (text,) = accumulator.Tensors("bench-fp16/text_summary")
    assert text.tensor_proto.string_val[0].decode() == "| arm | speedup |"


def test_all_is_every_installed_tracker():
    assert report.trackers("none") == [] and report.trackers("wandb") == ["wandb"]
    assert report.trackers("all") == ["wandb", "tensorboard"]  # both are in requirements.txt
