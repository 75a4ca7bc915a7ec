"""What a run leaves behind: `log_history.jsonl` and `eval_results.json` in its output folder
(written atomically), and the W&B / TensorBoard runs of accelerate's trackers."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename into it) to disk."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(folder: Path) -> None:
    """Flush every file under a folder, then the folder itself, to disk (before a rename)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(folder)


def write_json_atomic(path: str | os.PathLike, payload: dict) -> None:
    """`payload` as indented JSON, through `write_text_atomic`."""
    write_text_atomic(path, json.dumps(payload, indent=2))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write to a temporary file in the same folder, flush to disk, then rename into place:
    a crash leaves either the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    # tempfile creates it private (0600); give it the mode any new file gets (0644 under umask 022),
    # so that colleagues on a shared machine can read the results.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(handle.name, 0o666 & ~umask)
    os.replace(handle.name, path)


def weights_fingerprint(model: torch.nn.Module) -> str | None:
    """sha256 of the model's parameters and buffers (names, dtypes, shapes, bytes) as loaded: the
    arms of one seed in `scripts/paired_runs.py` must start from the same weights, and this is how
    it checks. None where the weights are not all on this process (ZeRO-3's zero.Init partitions,
    meta tensors of FSDP's low-memory loading on other ranks than the first)."""
    if any(p.is_meta or hasattr(p, "ds_id") for p in [*model.parameters(), *model.buffers()]):
        return None
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        # The tensor's own buffer (numpy's buffer protocol), not a bytes copy of it.
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


class RunRecord:
    """The run's local record in `output_dir`: `run_config.json` (every setting), `log_history.jsonl`
    (one line per log or eval) and `eval_results.json` (final metrics and run summary). Writes only
    on the main process."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool, resume_step: int | None = None):
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        if enabled:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            history = self.output_dir / "log_history.jsonl"
            kept = []
            if resume_step is not None and history.exists():  # keep what happened up to the checkpoint
                kept = [
                    line
                    for line in history.read_text().splitlines()
                    if json.loads(line)["step"] <= resume_step
                ]
            history.write_text("".join(line + "\n" for line in kept))

    def log(self, values: dict, step: int) -> None:
        if self.enabled:
            with open(self.output_dir / "log_history.jsonl", "a") as handle:
                handle.write(json.dumps({"step": step, **values}) + "\n")

    def write_results(self, results: dict) -> None:
        if self.enabled:
            write_json_atomic(self.output_dir / "eval_results.json", results)

    def write_config(self, run_config: dict) -> None:
        """run_config.json: every flag and run fact the trackers get (the Hub token left out)."""
        if self.enabled:
            # default=str: a value JSON has no type for (a Path, a dtype) is written as it prints
            write_text_atomic(
                self.output_dir / "run_config.json", json.dumps(run_config, indent=2, default=str)
            )


def init_trackers(accelerator, args, run_config: dict, tracker_run_id: str | None) -> None:
    """accelerate's trackers (W&B, TensorBoard) with the run config (as plain values); a resumed
    run continues its W&B run."""
    if args.report_to == "none":
        return
    wandb_kwargs = {"name": args.run_name, "group": args.wandb_group, "job_type": args.wandb_job_type}
    wandb_kwargs["tags"] = [tag.strip() for tag in (args.wandb_tags or "").split(",") if tag.strip()]
    if tracker_run_id:
        wandb_kwargs.update(id=tracker_run_id, resume="allow")
    accelerator.init_trackers(
        args.project_name,
        config={k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in run_config.items()},
        init_kwargs={"wandb": {k: v for k, v in wandb_kwargs.items() if v}},
    )


def write_final_figures(accelerator, summary: dict, step: int) -> None:
    """The run's final figures (dev metrics, peak memory, runtime, samples/s and tokens/s,
    precision in effect, fp16 skipped steps and loss scale) into accelerate's trackers: W&B's run
    summary, which its run tables and comparisons show (otherwise only the last history row), and
    TensorBoard scalars under `final/`. accelerate's tracker API has no summary call: this writes
    through each tracker's own object (`tracker.tracker`: the wandb run, the SummaryWriter)."""
    numbers = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    texts = {k: v for k, v in summary.items() if isinstance(v, str)}
    for tracker in accelerator.trackers:  # empty on other processes than the main one
        if tracker.name == "wandb":
            tracker.tracker.summary.update({**numbers, **texts})
        elif tracker.name == "tensorboard":
            for name, value in numbers.items():
                tracker.tracker.add_scalar(f"final/{name}", value, global_step=step)
            tracker.tracker.flush()
