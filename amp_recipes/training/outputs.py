"""The output folder a run owns, and everything the run writes into it.

- A folder that holds something (a finished run, checkpoints, anything) is only written into with
  `--overwrite_output_dir`, or by a run that resumes from a checkpoint of that folder; as in
  transformers' `run_glue.py`, nothing is replaced silently.
- A lock file (`.amp-recipes.lock`: PID, host, start time) stops a second run on the same folder
  while the first one lives. A lock left by a killed run (its PID no longer running on this host)
  is reported and taken over; one from another host cannot be checked and is reported.
- The run record: `run_config.json`, `log_history.jsonl` and `eval_results.json`, written
  atomically, and the W&B / TensorBoard runs of accelerate's trackers.
- The final model is written to `.final.tmp/` inside it, then renamed into place file by file,
  and `eval_results.json` (which says "this run finished") is written last: a kill or a full
  disk while the model is written leaves the previous run complete; during the renames
  (microseconds), the folder has no `eval_results.json`, so it never looks finished with half of a
  model in it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from amp_recipes.errors import WRITE_ERRORS, CheckpointError, InputError, write_failure

LOCK = ".amp-recipes.lock"
FINAL_STAGING = ".final.tmp"
RESULTS = "eval_results.json"
# transformers' weight files: a new final model replaces all of the old one's (sharded or not).
WEIGHT_PATTERNS = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin*")
# --do_predict's files: GLUE's predict_results_<task>.txt, NER's predictions.txt, QA's predict_*.json.
PREDICTION_PATTERNS = ("predict_results_*.txt", "predictions.txt", "predict_*.json")
logger = get_logger(__name__)


# ----------------------------------------------------------------------------- the run record
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


# ----------------------------------------------------------------------------- the folder


def is_example_name(name: str) -> bool:
    """epoch_<i> or step_<n>: the folder names of transformers' no_trainer examples' checkpoints."""
    kind, _, number = name.partition("_")
    return kind in ("epoch", "step") and number.isdigit()


_held: dict[Path, OutputDir] = {}  # this process's locks, released at exit if the run did not


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class OutputDir:
    """The run's claim on `--output_dir` (every process holds one; only the main one writes)."""

    def __init__(self, path: Path, is_main_process: bool, overwrite: bool):
        self.path, self.is_main_process, self.overwrite = path, is_main_process, overwrite
        self.lock = path / LOCK
        self.created = False
        self.held = False

    # ------------------------------------------------------------------ claim
    def claim(self, resume_from_checkpoint: str | None) -> OutputDir:
        if not self.is_main_process:
            return self
        if self.path.exists() and not self.path.is_dir():
            raise InputError(f"--output_dir {self.path} is a file; give a directory.")
        try:
            self.created = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise InputError(
                f"Cannot create --output_dir {self.path} ({error.strerror}); give a directory you can write to."
            ) from None
        self._take_lock()
        try:
            self._check_reuse(resume_from_checkpoint)
        except InputError:
            self.release()
            raise
        return self

    def _take_lock(self) -> None:
        mine = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        # Written whole to a file of our own, then hard-linked as the lock: creating the link is
        # atomic and fails when a lock exists, so no run ever reads a half-written lock.
        mine_file = self.path / f"{LOCK}.{os.getpid()}"
        try:
            mine_file.write_text(json.dumps(mine))
            for _ in range(2):
                try:
                    os.link(mine_file, self.lock)
                except FileExistsError:
                    self._handle_existing_lock(mine)
                    continue
                self.held = True
                _held[self.path] = self
                return
        except OSError as error:
            raise InputError(
                f"Cannot write to --output_dir {self.path} ({error.strerror}); give a directory you can write to."
            ) from None
        finally:
            mine_file.unlink(missing_ok=True)
        raise InputError(f"Could not take the lock {self.lock}: another run took it at the same moment.")

    def _handle_existing_lock(self, mine: dict) -> None:
        try:
            owner = json.loads(self.lock.read_text())
            pid, host = int(owner["pid"]), str(owner["host"])
        except (OSError, ValueError, KeyError, TypeError):
            owner, pid, host = {}, None, None
        if pid is None:
            logger.warning(f"Removing the unreadable lock {self.lock}.", main_process_only=False)
        elif host != mine["host"]:
            raise InputError(
                f"{self.path} is locked by PID {pid} on host {host} (since {owner.get('started')}), which "
                f"cannot be checked from here; if that run is over, delete {self.lock}."
            )
        elif pid == mine["pid"]:
            pass  # an earlier main() of this process stopped with an error (a notebook, a test)
        elif _pid_running(pid):
            raise InputError(
                f"Another run (PID {pid}, started {owner.get('started')}) is using {self.path}; wait for "
                "it to finish or give another --output_dir."
            )
        else:
            logger.warning(
                f"Removing the stale lock {self.lock}: PID {pid} (started {owner.get('started')}) is no "
                "longer running.",
                main_process_only=False,
            )
        self.lock.unlink(missing_ok=True)

    def _check_reuse(self, resume_from_checkpoint: str | None) -> None:
        contents = sorted(p.name for p in self.path.iterdir() if p.name not in (LOCK, FINAL_STAGING))
        if not contents or self.overwrite:
            return
        if resume_from_checkpoint == "latest" or (
            resume_from_checkpoint and self.path.resolve() in Path(resume_from_checkpoint).resolve().parents
        ):
            return  # a resumed run continues what is there
        if RESULTS in contents:
            raise InputError(
                f"{self.path} holds a finished run ({RESULTS}); pass --overwrite_output_dir to replace it, "
                "or give another --output_dir."
            )
        if "checkpoints" in contents:
            raise InputError(
                f"{self.path} holds an unfinished run with checkpoints; pass --resume_from_checkpoint latest "
                "to continue it, --overwrite_output_dir to start again, or give another --output_dir."
            )
        raise InputError(
            f"{self.path} is not empty (it holds {', '.join(contents[:3])}{', ...' if len(contents) > 3 else ''}); "
            "pass --overwrite_output_dir to write into it anyway, or give another --output_dir."
        )

    # ------------------------------------------------------------------ the run
    def clear_previous_run(self, accelerator) -> None:
        """--overwrite_output_dir, once every input has been checked: the old run's checkpoints go
        (a later `--resume_from_checkpoint latest` must not find them), with its epoch_<i>/step_<n>
        folders (the no_trainer examples' names: `--resume_from_checkpoint <output_dir>/epoch_0`
        must not find them either), and its prediction files (they would pass for this run's); its
        final model stays until the new one replaces it."""
        if self.overwrite and self.is_main_process:
            examples = [p for p in self.path.iterdir() if p.is_dir() and is_example_name(p.name)]
            if (self.path / "checkpoints").exists() or examples:
                shutil.rmtree(self.path / "checkpoints", ignore_errors=True)
                for folder in examples:
                    shutil.rmtree(folder)
                logger.info(
                    f"--overwrite_output_dir: removed the previous run's checkpoints from {self.path}"
                )
        if self.overwrite and self.is_main_process:  # --do_predict's files: this run writes its own, or none
            for pattern in PREDICTION_PATTERNS:
                for old in self.path.glob(pattern):
                    old.unlink()
        accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def final_model(self, accelerator):
        """`with output.final_model(accelerator) as folder:` save the model and tokenizer into
        `folder` (<output_dir>/.final.tmp); when the block ends they are renamed into place. A
        failure (full disk) leaves the previous run's files as they were. All processes enter it
        (FSDP / ZeRO-3 gather the weights)."""
        staging = self.path / FINAL_STAGING
        if self.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving
            staging.mkdir(parents=True)
        accelerator.wait_for_everyone()
        try:
            yield staging
            accelerator.wait_for_everyone()
            if self.is_main_process:
                fsync_tree(staging)
        except WRITE_ERRORS as error:  # a full disk, a file-size limit, a lost mount
            if self.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(
                f"Could not write the final model to {self.path} ({write_failure(error)}); the final model "
                "that was there before, if any, is unchanged."
            ) from error
        if self.is_main_process:
            (self.path / RESULTS).unlink(missing_ok=True)  # from here on the folder is not "finished"
            for pattern in WEIGHT_PATTERNS:
                for old in self.path.glob(pattern):
                    if not (staging / old.name).exists():
                        old.unlink()  # the previous model's other shards
            for path in staging.iterdir():
                os.replace(path, self.path / path.name)
            staging.rmdir()
            fsync_dir(self.path)
        accelerator.wait_for_everyone()

    def release(self) -> None:
        """Remove the lock (and the folder, if this run created it and left it empty)."""
        if not self.held:
            return
        self.lock.unlink(missing_ok=True)
        self.held = False
        _held.pop(self.path, None)
        if self.created:
            try:
                self.path.rmdir()  # only when empty
            except OSError:
                pass


def plain_state_dict(accelerator, model) -> dict:
    """The trained weights for `save_pretrained(state_dict=...)`, under the plain model's names, in
    fp32. Every process calls it (FSDP and ZeRO gather from all of them).

    accelerate's get_state_dict unwraps with keep_torch_compile=True: after --torch_compile
    (regional compilation, which builds a compiled copy of the model) the names hold `_orig_mod.`,
    and under DDP + compile also `module.`. from_pretrained does not recognise such names: it would
    load freshly initialised weights, with a warning, not an error. So: the plain model's own state
    dict where every process holds the whole model; under FSDP accelerate's gathered one (FSDP2
    compiles in place; FSDP1 compiles a copy, whose `_orig_mod.` is dropped); under DeepSpeed the
    fp32 master weights (`deepspeed_fp32_state_dict`)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return deepspeed_fp32_state_dict(model, keep=accelerator.is_main_process)
    if accelerator.distributed_type == DistributedType.FSDP:
        state_dict = accelerator.get_state_dict(model)  # gathered from every process
        return {name.replace("_orig_mod.", ""): tensor for name, tensor in state_dict.items()}
    return accelerator.unwrap_model(model, keep_torch_compile=False).state_dict()


def deepspeed_fp32_state_dict(engine, keep: bool = True) -> dict:
    """The fp32 master weights of a DeepSpeed engine's model, whole, on the CPU; an empty dict
    where `keep` is false (the processes that do not write the model take part in the gathering
    without holding a copy).

    Under ZeRO with bf16/fp16 the module's own weights are 16-bit copies and the fp32 masters live
    in the optimizer, partitioned across processes; accelerate's get_state_dict returns the 16-bit
    copies (ZeRO-3: only with stage3_gather_16bit_weights_on_model_save). DeepSpeed's
    safe_get_full_fp32_param gathers each master (a collective: every process calls it, in the same
    order); a parameter the optimizer does not hold (none in these recipes) is gathered as it is."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    state_dict = {}
    for name, parameter in module.named_parameters():
        master = safe_get_full_fp32_param(parameter)
        if master is None:
            with deepspeed.zero.GatheredParameters([parameter]):
                master = parameter.detach().clone()
        if keep:
            state_dict[name.replace("_orig_mod.", "")] = master.float().cpu()
    if not keep:
        return state_dict
    skipped = set()
    for prefix, submodule in module.named_modules():
        skipped |= {f"{prefix}.{name}".lstrip(".") for name in submodule._non_persistent_buffers_set}
    for name, buffer in module.named_buffers():
        if name not in skipped:
            state_dict[name.replace("_orig_mod.", "")] = buffer.detach().cpu()
    return state_dict


def save_weights(folder: Path, state_dict: dict, model) -> None:
    """A model of your own (an nn.Module, not a transformers model): its trained weights as
    `model.safetensors`, which `safetensors.torch.load_model(model, path)` loads into a new one.
    Tied weights (one parameter under two names) are saved once, under the name load_model keeps,
    as safetensors' save_model does; that function saves the module's own tensors, and these are
    the fp32 weights `plain_state_dict` gathered (FSDP, ZeRO), not accelerator.save_model's
    (compiled names, ZeRO's 16-bit copies)."""
    from safetensors.torch import save_file

    first_name = {}
    tied = {}  # a second name of a parameter -> the name kept
    for name, parameter in model.named_parameters(remove_duplicate=False):
        kept = first_name.setdefault(id(parameter), name)
        if kept != name:
            tied[name] = kept
    weights = {name: tensor.contiguous() for name, tensor in state_dict.items() if name not in tied}
    save_file(weights, str(Path(folder) / "model.safetensors"), metadata={"format": "pt", **tied})


def write_saved_dtype(folder: Path, state_dict: dict) -> None:
    """config.json's `dtype` as the saved weights are: save_pretrained writes the module's dtype,
    which under DeepSpeed bf16/fp16 is that of its 16-bit copies, not of the fp32 masters saved."""
    path = Path(folder) / "config.json"
    dtypes = {
        str(tensor.dtype).replace("torch.", "")
        for tensor in state_dict.values()
        if tensor.is_floating_point()
    }
    config = json.loads(path.read_text())
    if len(dtypes) == 1 and config.get("dtype") not in dtypes:  # else transformers' file stays as written
        config["dtype"] = dtypes.pop()
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def claim_output_dir(accelerator, args) -> OutputDir:
    """Check that this run may write into --output_dir and lock it for the run (main process)."""
    output = OutputDir(Path(args.output_dir), accelerator.is_main_process, args.overwrite_output_dir)
    return output.claim(args.resume_from_checkpoint)


@atexit.register
def release_held() -> None:
    """At exit (an error, a signal's SystemExit): the locks this process still holds."""
    for output in list(_held.values()):
        output.release()
