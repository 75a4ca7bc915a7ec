"""What every recipe does the same way around its own training loop.

The loop itself (forward, `accelerator.backward`, clipping, `optimizer.step`, the scheduler) stays
in each recipe; these functions are the conventions the recipes share: the Accelerator's
precision settings from the shared flags, the preflight, the AdamW kernel, the trackers, one log
line, the fp16 overflow report and guard, and the stop on a preemption signal.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, GradScalerKwargs, TorchDynamoPlugin, set_seed

from .hardware import device_facts
from .precision import choose_auto_precision, format_preflight, preflight
from .telemetry import TrainingDiverged
from .training import check_launch, optimizer_grouped_parameters

logger = get_logger(__name__)
FUSED_ADAMW_DEVICES = ("cuda", "cpu", "mps", "xpu")  # torch has a fused AdamW kernel for these
SCALER_FLAGS = ("init_scale", "growth_interval", "growth_factor", "backoff_factor")


def accelerator_settings(args) -> dict:
    """`Accelerator(...)` keyword arguments from the shared flags: the precision (`auto` resolved
    here, the reason kept in `args.auto_reason`), the GradScaler settings as accelerate's
    `GradScalerKwargs`, torch.compile as its `TorchDynamoPlugin`, and the DataLoader settings.

    mixed_precision=None lets `accelerate launch --mixed_precision` or the config file decide."""
    args.auto_reason = None
    if args.mixed_precision == "auto":
        args.mixed_precision, args.auto_reason = choose_auto_precision(device_facts())
    scaler = {
        name: getattr(args, f"fp16_{name}")
        for name in SCALER_FLAGS
        if getattr(args, f"fp16_{name}") is not None
    }
    return {
        "mixed_precision": args.mixed_precision,
        "kwargs_handlers": [GradScalerKwargs(**scaler)] if scaler else None,
        "dynamo_plugin": TorchDynamoPlugin(backend=args.torch_compile_backend)
        if args.torch_compile
        else None,
        "dataloader_config": DataLoaderConfiguration(
            use_seedable_sampler=True,  # shuffling seeded by (seed, epoch): a resume sees the same batches
            # Batches copied to the GPU without the host waiting for the copy (accelerate's default
            # waits, a stall per step); they come from pinned memory (`loader_settings`).
            non_blocking=torch.cuda.is_available(),
        ),
    }


def start_run(accelerator, args, logger) -> dict:
    """Check the launch, log the preflight block and its warnings, seed everything.

    Returns the precision record (device facts, precision in effect and who chose it) that goes
    into the tracker config and eval_results.json. Refuses what cannot work (InputError)."""
    check_launch(accelerator)
    precision = preflight(accelerator, args.mixed_precision, args.auto_reason)
    logger.info(format_preflight(precision), main_process_only=True)
    for warning in precision["preflight_warnings"]:
        logger.warning(warning, main_process_only=True)
    if any(getattr(args, f"fp16_{name}") is not None for name in SCALER_FLAGS):
        if precision["precision_in_effect"] != "fp16":
            logger.warning(
                "The --fp16_* GradScaler flags have no effect: this run is not fp16.", main_process_only=True
            )
    set_seed(args.seed)
    return precision


def make_optimizer(model, args, accelerator) -> torch.optim.AdamW:
    """AdamW with no decay on biases and norms; fused (one kernel for all parameters) by default.

    Fused is the fastest on CUDA, and on a CPU too: 14-17 ms against foreach's 61-75 ms per step
    for MiniLM-L6 on our 2-core development CPU (torch 2.13), about 7% of a training step. With
    fp16 a fused optimizer skips overflowing steps itself; StepTelemetry detects those for the
    scheduler (accelerate's own check cannot)."""
    fused = args.optim in ("auto", "adamw_torch_fused") and accelerator.device.type in FUSED_ADAMW_DEVICES
    return torch.optim.AdamW(
        optimizer_grouped_parameters(model, args.weight_decay),
        lr=args.learning_rate,
        fused=fused or None,
        foreach=None if fused else True,
    )


def init_trackers(accelerator, args, run_config: dict, tracker_run_id: str | None) -> None:
    """accelerate's trackers (W&B, TensorBoard) with the run config; a resumed run continues its
    W&B run."""
    if args.report_to == "none":
        return
    wandb_kwargs = {"name": args.run_name, "group": args.wandb_group, "job_type": args.wandb_job_type}
    if tracker_run_id:
        wandb_kwargs.update(id=tracker_run_id, resume="allow")
    accelerator.init_trackers(
        args.project_name,
        config={k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in run_config.items()},
        init_kwargs={"wandb": {k: v for k, v in wandb_kwargs.items() if v}},
    )


def clip_and_measure(accelerator, model, max_grad_norm: float):
    """The norm of the unscaled gradients (a device tensor), clipped to max_grad_norm if > 0."""
    return accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)


def report_step(telemetry, step: int, batch, skipped: bool, diagnose: bool, logger) -> str | None:
    """After an optimizer step: name where a skipped fp16 step (or, with --diagnose_overflow, any
    step) first went non-finite. Returns that place, or None."""
    if not (skipped or diagnose):
        return None
    where = telemetry.where_nonfinite(batch)
    if skipped:
        logger.warning(
            f"step {step}: fp16 overflow, optimizer step skipped, loss scale "
            f"{telemetry.scale_used:g} -> {telemetry.loss_scale:g}; first non-finite value: {where}",
            main_process_only=True,
        )
    elif where:
        logger.warning(f"step {step}: first non-finite value: {where}", main_process_only=True)
    return where


def guard(telemetry, step: int, where: str | None, checkpoint) -> None:
    """Stop after too many consecutive skipped fp16 steps, saving the (unchanged, so still good)
    weights first if `checkpoint` is given."""
    if telemetry.should_stop():
        if checkpoint is not None:
            checkpoint()
        raise TrainingDiverged(telemetry.stop_message(step, where))


def log_training(
    accelerator, telemetry, meter, activations, lr_scheduler, step: int, epoch: float, precision: str,
    progress, record,
) -> dict:  # fmt: skip
    """One log line — loss, grad norm, fp16 loss scale and skips, learning rate, throughput,
    padding, fp16 range — to the trackers, the progress bar and log_history.jsonl. Reads the
    device once; raises TrainingDiverged on a non-finite bf16/fp32 loss. Returns the window's
    throughput (samples, tokens, seconds)."""
    throughput = meter.read(accelerator)
    logs = {
        **telemetry.read(),
        "learning_rate": lr_scheduler.get_last_lr()[0],
        "epoch": epoch,
        **{k: throughput[k] for k in ("samples_per_second", "tokens_per_second", "padding_fraction")},
        **{f"fp16_range/{name}": ratio for name, ratio in activations.read().items()},
    }
    telemetry.check_finite(step, precision)
    postfix = {"loss": f"{logs['loss']:.4f}", "lr": f"{logs['learning_rate']:.2e}"}
    if telemetry.fp16:
        postfix.update(scale=f"{logs['loss_scale']:g}", skipped=logs["skipped_steps"])
    progress.set_postfix(postfix)
    accelerator.log(logs, step=step)
    record.log(logs, step)
    return throughput


def stop_if_preempted(preemption, accelerator, step: int, checkpoint, logger) -> None:
    """On SIGTERM/SIGINT (on any process): checkpoint, say how to continue, exit 143 (130 for SIGINT)."""
    if not preemption.should_stop(accelerator, step):
        return
    path = checkpoint()
    logger.warning(
        f"Stopped by {preemption.signal_name or 'a signal on another process'} after step {step}; "
        f"checkpoint {path}. Continue with --resume_from_checkpoint latest.",
        main_process_only=True,
    )
    preemption.restore()
    accelerator.end_training()
    raise SystemExit(143 if preemption.signal_name != "SIGINT" else 130)


def save_run_checkpoint(
    accelerator,
    telemetry,
    args,
    identity: dict,
    precision: str,
    step: int,
    epoch: int,
    batches_in_epoch: int,
    **extra,
):
    """A crash-safe checkpoint (amp_recipes.checkpoint) of the run at `step`, with the position a
    resume needs. Refuses (TrainingDiverged) to save weights spoiled by a non-finite loss."""
    from .checkpoint import save_checkpoint, tracker_run_id

    telemetry.check_finite(step, precision)
    position = {
        **identity,
        "global_step": step,
        "epoch": epoch,
        "batches_in_epoch": batches_in_epoch,
        "tracker_run_id": tracker_run_id(accelerator),
        "mixed_precision": accelerator.mixed_precision,
        "grad_scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
        "telemetry": telemetry.state_dict(),
        **extra,
    }
    checkpoints_dir = Path(args.output_dir) / "checkpoints"
    path = save_checkpoint(accelerator, checkpoints_dir, step, position, args.save_total_limit)
    logger.info(f"Saved checkpoint {path}", main_process_only=True)
    return path
