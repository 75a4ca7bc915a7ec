"""Crash-safe checkpoints around accelerate's `save_state` / `load_state`, and preemption.

`save_state` writes model, optimizer, scheduler, GradScaler and RNG states, but into the final
folder directly: a crash mid-write leaves a folder that looks like a checkpoint. Here each
checkpoint is written to a temporary folder, flushed, given a completeness marker (with our
record of the run position and every file's size), renamed into place, and only then does the
`latest` pointer move. Older checkpoints are rotated only after a newer one is complete.

Layout: <output_dir>/checkpoints/{checkpoint-<step>/, latest}, and with --checkpointing_steps the
same complete checkpoint under the name transformers' no_trainer examples give it:
<output_dir>/epoch_<i>/ or <output_dir>/step_<n>/ (its files hard-linked: no second copy on disk).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.utils import SCALER_NAME

from amp_recipes.errors import WRITE_ERRORS, CheckpointError, write_failure
from amp_recipes.training.outputs import fsync_dir, fsync_tree, is_example_name, write_json_atomic

MARKER = "amp_checkpoint.json"  # written last: a folder without it is not a checkpoint
LATEST = "latest"
PREFIX = "checkpoint-"
logger = get_logger(__name__)


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.glob(f"{PREFIX}*") if (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def save_checkpoint(
    accelerator,
    checkpoints_dir: Path,
    step: int,
    record: dict,
    save_total_limit: int | None,
    keep: str | None = None,
) -> Path:
    """Write checkpoint-<step> atomically (all processes call this; the main one renames).

    accelerate's `save_state` writes the states (model, optimizer, scheduler, GradScaler, RNGs,
    sampler); `record` (the recipe's position in the run) goes into the completeness marker with
    the W&B run id, the precision and the GradScaler's state. `keep`: a checkpoint's folder name
    that rotation leaves (the best one, --load_best_model_at_end)."""
    checkpoints_dir = Path(checkpoints_dir)
    scaler = getattr(accelerator, "scaler", None)
    record = {
        **record,
        "global_step": step,
        "tracker_run_id": tracker_run_id(accelerator),
        "mixed_precision": getattr(accelerator, "mixed_precision", None),
        "grad_scaler": scaler.state_dict() if scaler is not None else None,
    }
    final = checkpoints_dir / f"{PREFIX}{step}"
    staging = checkpoints_dir / f".tmp-{PREFIX}{step}"
    if accelerator.is_main_process:
        checkpoints_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(staging))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            files = {str(p.relative_to(staging)): p.stat().st_size for p in staging.rglob("*") if p.is_file()}
            write_json_atomic(staging / MARKER, {**record, "files": files})
            fsync_tree(staging)
            if final.exists():  # the same step saved again (e.g. a resumed run): replace it whole
                shutil.rmtree(final)
            os.replace(staging, final)
            fsync_dir(checkpoints_dir)
            (checkpoints_dir / f".{LATEST}.tmp").write_text(final.name)
            os.replace(checkpoints_dir / f".{LATEST}.tmp", checkpoints_dir / LATEST)
            fsync_dir(checkpoints_dir)
            rotate(checkpoints_dir, save_total_limit, keep)
    except WRITE_ERRORS as error:  # a full disk, a file-size limit, a lost mount
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        previous = complete_checkpoints(checkpoints_dir)
        kept = f"{previous[-1]} is intact" if previous else "there is no earlier checkpoint"
        raise CheckpointError(
            f"Could not write the checkpoint of step {step} ({write_failure(error)}); {kept}."
        ) from error
    accelerator.wait_for_everyone()
    logger.info(f"Saved checkpoint {final}", main_process_only=True)
    return final


def save_example_folder(accelerator, checkpoint: Path, name: str) -> Path:
    """The complete `checkpoint` also as <output_dir>/<name>, the folder a transformers no_trainer
    example's --checkpointing_steps writes (epoch_<i>, step_<n>): scripts that look for it, and
    `--resume_from_checkpoint <output_dir>/epoch_1`, find it. Its files are hard links to the
    checkpoint's (copies where the file system has none), gathered in a staging folder that is
    renamed when complete, so the example's name never holds a half-written folder. It holds the
    marker, so the recipe resumes it exactly; the example's own load_state reads it as its own."""
    checkpoint = Path(checkpoint)
    folder = checkpoint.parent.parent / name
    staging = folder.with_name(f".tmp-{name}")
    if accelerator.is_main_process:
        try:
            shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
            shutil.copytree(checkpoint, staging, copy_function=link_or_copy)
            fsync_tree(staging)
            if folder.exists():  # the same name saved again (a resumed run): replaced whole
                shutil.rmtree(folder)
            os.replace(staging, folder)
            fsync_dir(folder.parent)
        except WRITE_ERRORS as error:
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(
                f"Could not write {folder} ({write_failure(error)}); the checkpoint {checkpoint} is intact."
            ) from error
    accelerator.wait_for_everyone()
    return folder


def link_or_copy(source: str, destination: str) -> None:
    """A hard link (the checkpoint's bytes once on disk), else a copy (a file system without links)."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def example_folders(output_dir: Path) -> dict[int, list[Path]]:
    """The recipe's epoch_<i>/step_<n> folders in an output folder (complete: they hold the
    marker), by the optimizer step they were saved at."""
    found: dict[int, list[Path]] = {}
    for path in Path(output_dir).iterdir():
        if is_example_name(path.name) and (path / MARKER).is_file():
            found.setdefault(json.loads((path / MARKER).read_text())["global_step"], []).append(path)
    return found


def rotate(checkpoints_dir: Path, save_total_limit: int | None, keep: str | None = None) -> None:
    """Keep the newest `save_total_limit` complete checkpoints, and the one named `keep` (the best,
    as the Trainer keeps it); never the only complete one. The epoch_<i>/step_<n> folders of a
    removed checkpoint go with it (they hold its files)."""
    if not save_total_limit:
        return
    complete = complete_checkpoints(checkpoints_dir)
    removed = [
        old for old in complete[: max(0, len(complete) - max(1, save_total_limit))] if old.name != keep
    ]
    examples = example_folders(Path(checkpoints_dir).parent) if removed else {}
    for old in removed:
        for folder in examples.get(int(old.name[len(PREFIX) :]), []):
            shutil.rmtree(folder)
        shutil.rmtree(old)


def resolve_checkpoint(value: str, checkpoints_dir: Path) -> Path:
    """`latest` (the newest complete checkpoint of this output_dir) or a checkpoint folder."""
    checkpoints_dir = Path(checkpoints_dir)
    if value != "latest":
        path = Path(value)
        if not path.is_dir():
            raise CheckpointError(f"Checkpoint {path} does not exist.")
        # A checkpoints folder: its latest. Not a checkpoint that holds a `latest` of its own
        # (DeepSpeed writes one beside its shards): our marker says which folder is a checkpoint.
        if path.name == "checkpoints" or ((path / LATEST).exists() and not (path / MARKER).exists()):
            return resolve_checkpoint("latest", path)
        return path
    pointer = checkpoints_dir / LATEST
    if pointer.is_file() and (checkpoints_dir / pointer.read_text().strip() / MARKER).is_file():
        return checkpoints_dir / pointer.read_text().strip()
    complete = complete_checkpoints(checkpoints_dir)  # pointer lost: the newest complete one
    if not complete:
        raise CheckpointError(
            f"--resume_from_checkpoint latest: no complete checkpoint in {checkpoints_dir}; "
            "drop the flag to start a fresh run."
        )
    return complete[-1]


def read_checkpoint(path: Path, expected: dict) -> dict:
    """The checkpoint's record, after checking it is complete, intact and of this run's kind."""
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"Checkpoint {path} is incomplete (no {MARKER}): its save was interrupted.")
    try:
        record = json.loads(marker.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"Checkpoint {path} is corrupted: {MARKER} is not valid JSON.") from error
    for name, size in record.get("files", {}).items():
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != size:
            state = "missing" if actual is None else f"{actual} bytes instead of {size}"
            raise CheckpointError(f"Checkpoint {path} is corrupted: {name} is {state}.")
    for key, value in expected.items():
        if record.get(key) != value:
            raise CheckpointError(
                f"Checkpoint {path} was written for {key} {record.get(key)!r}, but this run has {value!r}; "
                "resume it with the same setting, or start a fresh run with another --output_dir."
            )
    return record


def check_precision_switch(checkpoint: Path, accelerator) -> str | None:
    """Resuming under another precision: allowed when no GradScaler state is lost silently.

    accelerate's load_state restores `scaler.pt` only when the run has a scaler: an fp16
    checkpoint resumed as bf16/fp32 drops the scaler state (said in a warning); a checkpoint
    without one cannot be resumed under fp16 with a GradScaler (refused).
    """
    has_scaler_state = (checkpoint / "scaler.pt").is_file()
    if accelerator.scaler is not None and not has_scaler_state:
        raise CheckpointError(
            f"Checkpoint {checkpoint} has no GradScaler state (it was not written under fp16 with loss scaling), "
            "so it cannot be resumed under fp16; resume it with the precision it was written with."
        )
    if has_scaler_state and accelerator.scaler is None:
        return (
            f"Resuming the fp16 checkpoint {checkpoint} under {accelerator.mixed_precision}: "
            "its GradScaler state (loss scale, growth tracker) is dropped."
        )
    return None


def load_checkpoint(accelerator, checkpoint: Path) -> None:
    try:
        accelerator.load_state(str(checkpoint))
        restore_grad_scaler(accelerator, checkpoint)
    except Exception as error:  # torch/safetensors raise many types for damaged or foreign files
        raise CheckpointError(
            f"Could not load checkpoint {checkpoint}: {str(error).splitlines()[0]}"
        ) from error


def restore_grad_scaler(accelerator, checkpoint: Path) -> None:
    """The GradScaler exactly as the checkpoint saved it (accelerate's scaler.pt), after load_state.

    accelerate 1.15 loads FSDP2's optimizer state through torch's set_optimizer_state_dict with the
    optimizer prepare() wrapped; torch first gives an empty optimizer its states by stepping it on
    zero gradients, and the wrapped step goes through the GradScaler, loaded just before: update()
    counts a step without overflow, so the resumed scale grows one step early and the run no longer
    matches the uninterrupted one (1.16 steps the unwrapped optimizer). Loading the saved state
    again puts it back, whatever the version; where nothing moved it, it changes nothing."""
    path = checkpoint / SCALER_NAME
    if accelerator.scaler is not None and path.is_file():
        accelerator.scaler.load_state_dict(torch.load(path, weights_only=True))


FRESH_RUN = {"global_step": 0, "epoch": 0, "batches_in_epoch": 0, "tracker_run_id": None, "log_epoch": 0}


def example_checkpoint(path: Path) -> tuple[str, int] | None:
    """("epoch", i) or ("step", n) for a folder the examples' --checkpointing_steps wrote with
    accelerator.save_state (`epoch_<i>`, `step_<n>`, holding the model and the optimizer's state);
    None for a folder not so named. One so named in a layout the recipe cannot load (FSDP's or
    DeepSpeed's shards) is refused in one sentence."""
    if not is_example_name(Path(path).name):
        return None
    kind, _, number = Path(path).name.partition("_")
    files = {p.name for p in Path(path).iterdir()} if Path(path).is_dir() else set()
    if not (files & {"model.safetensors", "pytorch_model.bin"} and "optimizer.bin" in files):
        raise CheckpointError(
            f"{path} is named as a transformers example's checkpoint but holds no model.safetensors (or "
            "pytorch_model.bin) with optimizer.bin: the recipes resume the examples' one-process and DDP "
            "saves, not FSDP's or DeepSpeed's sharded ones; start a fresh run, or resume it with the example."
        )
    return kind, int(number)


def resume(accelerator, value: str | None, checkpoints_dir: Path, identity: dict, layout=None) -> dict:
    """Find, check and load a checkpoint (model, optimizer, scheduler, GradScaler, RNG); return its
    record. Without one (`value` None: no --resume_from_checkpoint), the position of a fresh run.
    A folder transformers' no_trainer examples wrote (epoch_<i>, step_<n>) is resumed too: see
    resume_example (`layout`: the run's optimizer steps per epoch, batches per epoch per process,
    gradient accumulation steps)."""
    if not value:
        return dict(FRESH_RUN)
    path = resolve_checkpoint(value, checkpoints_dir)
    written_by_example = not (path / MARKER).exists() and example_checkpoint(path)
    if written_by_example:
        return resume_example(accelerator, path, *written_by_example, *layout)
    record = read_checkpoint(path, identity)
    warning = check_precision_switch(path, accelerator)
    if warning:
        logger.warning(warning, main_process_only=True)
    load_checkpoint(accelerator, path)
    logger.info(f"Resumed from {path} at step {record['global_step']}", main_process_only=True)
    # The epoch an evaluation at this position is logged with: the loop counts an epoch from its
    # first batch (`epoch + 1`), so a checkpoint saved mid-epoch belongs to the epoch it is in.
    return {**record, "log_epoch": record["epoch"] + (record["batches_in_epoch"] > 0), "path": str(path)}


def resume_example(
    accelerator,
    path: Path,
    kind: str,
    number: int,
    steps_per_epoch: int,
    batches_per_epoch: int,
    accumulation: int,
) -> dict:
    """A folder written by a transformers no_trainer example's --checkpointing_steps
    (accelerator.save_state into epoch_<i> or step_<n>): its model, optimizer, scheduler, RNG
    states and GradScaler loaded as the example loads them. It records no position of its own, so
    the position is read from its name, as the example reads it: after epoch_<i>, the start of
    epoch i+1; at step_<n>, optimizer step n, n x accumulation micro-batches into the data. The
    batches that follow are the recipe's shuffle (seeded by --seed), not the run's that wrote it."""
    if kind == "epoch":
        epoch, in_epoch, step = number + 1, 0, (number + 1) * steps_per_epoch
    else:
        epoch, in_epoch = divmod(number * accumulation, batches_per_epoch)
        step = number
    warning = check_precision_switch(path, accelerator)
    if warning:
        logger.warning(warning, main_process_only=True)
    load_checkpoint(accelerator, path)
    logger.warning(
        f"Resumed from {path}, which a transformers no_trainer example wrote (accelerator.save_state, no "
        f"record of its own): its weights, optimizer, learning-rate scheduler and random states are "
        f"loaded; its position is read from its name, as the example reads it: step {step}, epoch "
        f"{epoch + 1}, {in_epoch} batches into it. The batches that follow are this recipe's shuffle of the "
        "data (--seed), not the one of the run that wrote it.",
        main_process_only=True,
    )
    position = {"global_step": step, "epoch": epoch, "batches_in_epoch": in_epoch}
    return {**FRESH_RUN, **position, "log_epoch": epoch + (in_epoch > 0), "path": str(path)}


def tracker_run_id(accelerator) -> str | None:
    """The W&B run id, saved so that a resumed run continues the same W&B run."""
    try:
        return accelerator.get_tracker("wandb", unwrap=True).id
    except (ValueError, AttributeError):
        return None


class PreemptionHandler:
    """SIGTERM / SIGINT ask the loop to stop after the current optimizer step (and checkpoint).

    A second signal, RELAY_WINDOW_S or more after the first, gets the default action, so a stuck
    run can still be stopped. One sooner is the same stop passed on: a signal to the whole process
    group (Slurm, `kill -- -PGID`, Ctrl-C in a terminal) reaches the launcher too, and both
    `accelerate launch`'s one-process launcher (accelerate >= 1.16) and torchrun's agent pass it on
    to the run at once; taken for a second signal it would kill the run before its checkpoint.
    """

    CHECK_INTERVAL = 10  # optimizer steps between the processes' agreement checks
    RELAY_WINDOW_S = 2.0  # a launcher relays within milliseconds; a person presses again later

    def __init__(self):
        self.signal_name, self.first_signal_at = None, None
        self.previous = {
            signum: signal.signal(signum, self._handle) for signum in (signal.SIGTERM, signal.SIGINT)
        }

    def restore(self) -> None:
        """Give the signals back to whoever had them before training."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.first_signal_at is None:  # the stop: noted, acted on after the step
            self.signal_name, self.first_signal_at = signal.Signals(signum).name, now
        elif now - self.first_signal_at >= self.RELAY_WINDOW_S:  # a second stop: at once
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    @property
    def exit_code(self) -> int:
        """The shell's code for a run ended by the signal: 130 for SIGINT (Ctrl-C), else 143 (SIGTERM)."""
        return 130 if self.signal_name == "SIGINT" else 143

    def stop_message(self, step: int, checkpoint: Path) -> str:
        return (
            f"Stopped by {self.signal_name or 'a signal on another process'} after step {step}; "
            f"checkpoint {checkpoint}. Continue with --resume_from_checkpoint latest."
        )

    def should_stop(self, accelerator, step: int) -> bool:
        """Whether to stop after optimizer step `step`. With several processes every one must
        agree, which costs an all-reduce and a host read: done every CHECK_INTERVAL steps only
        (all processes reach the same steps), so a stop comes at most that many steps late."""
        if accelerator.num_processes == 1:
            return self.signal_name is not None  # a Python flag: no device synchronisation
        if step % self.CHECK_INTERVAL:
            return False
        if self.signal_name is not None:
            accelerator.set_trigger()
        return accelerator.check_trigger()  # one process signalled: every process stops together
