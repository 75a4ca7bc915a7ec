"""The optimizer every recipe uses: AdamW, no decay on biases and norms, fused where torch has it."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from accelerate.utils import DistributedType

from amp_recipes.errors import InputError

FUSED_ADAMW_DEVICES = ("cuda", "cpu", "mps", "xpu")  # torch has a fused AdamW kernel for these


def optimizer_grouped_parameters(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on biases and normalisation weights (the BERT convention)."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        lowered = name.lower()
        (no_decay if lowered.endswith("bias") or "norm" in lowered else decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model, args, device: torch.device) -> torch.optim.AdamW:
    """AdamW (--learning_rate, --weight_decay); fused (one kernel for all parameters) by default.

    Fused is the fastest on CUDA, and on a CPU too: 14-17 ms against foreach's 61-75 ms per step
    for MiniLM-L6 on our 2-core development CPU (torch 2.13), about 7% of a training step. With
    fp16 a fused optimizer skips overflowing steps itself; StepTelemetry detects those for the
    scheduler (accelerate's own check cannot)."""
    fused = args.optim in ("auto", "adamw_torch_fused") and device.type in FUSED_ADAMW_DEVICES
    return torch.optim.AdamW(
        optimizer_grouped_parameters(model, args.weight_decay),
        lr=args.learning_rate,
        fused=fused or None,
        foreach=None if fused else True,
    )


def describe_optimizer(optimizer) -> str:
    """'fused AdamW' or 'foreach AdamW': read from the torch optimizer the recipe built, inside the
    wrappers prepare() puts around it. accelerate's AcceleratedOptimizer forwards `defaults`, but
    DeepSpeed's ZeRO / fp16 / bf16 optimizers have none: each keeps the one it wraps as `.optimizer`."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return f"{'fused' if optimizer.defaults.get('fused') else 'foreach'} {type(optimizer).__name__}"


class Schedule(NamedTuple):
    steps_per_epoch: int
    max_train_steps: int
    num_epochs: int
    # What the LR scheduler is created with: max_train_steps x processes, since accelerate's prepared
    # scheduler steps once per process for each optimizer step (DeepSpeed's engine: once).
    scheduler_steps: int
    warmup_steps: int  # its warm-up, in the same unit


def training_schedule(train_batches: int, accelerator, args) -> Schedule:
    """Optimizer steps per epoch and in all, from the DataLoader's length before `prepare()`.

    Sized before prepare(), so the scheduler can be prepared with the model and optimizer (under
    DeepSpeed the engine then owns it, and save_state keeps it): each process will see
    ceil(batches / processes) batches. accelerate's prepared scheduler steps once per process for
    every optimizer step; DeepSpeed's engine steps its own once per optimizer step."""
    per_process_batches = math.ceil(train_batches / accelerator.num_processes)
    steps_per_epoch = math.ceil(per_process_batches / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or steps_per_epoch * args.num_train_epochs
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    scheduler_steps = max_train_steps * (1 if deepspeed else accelerator.num_processes)
    if args.num_warmup_steps is not None:  # optimizer steps, counted as the scheduler counts them
        warmup_steps = args.num_warmup_steps * (scheduler_steps // max_train_steps)
    else:
        warmup_steps = int(args.warmup_ratio * scheduler_steps)
    return Schedule(
        steps_per_epoch,
        max_train_steps,
        math.ceil(max_train_steps / steps_per_epoch),
        scheduler_steps,
        warmup_steps,
    )


def check_every_parameter_trains(accelerator, model: torch.nn.Module, optimizer) -> None:
    """After prepare(): refuse to train when a parameter that requires grad is not in the optimizer.

    prepare() may replace parameters (an fp8 conversion, a sharding engine) and must hand the
    optimizer the new ones; if it ever does not, those weights would silently never train while
    their gradients still count in the clipping norm. Checked by identity against the prepared
    model's own parameters. Not under DeepSpeed: its engine builds the optimizer's (flattened,
    partitioned) parameter groups from the model itself, so they are never the model's tensors."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return
    in_optimizer = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
    untrained = [
        name
        for name, parameter in model.named_parameters()
        if parameter.requires_grad and id(parameter) not in in_optimizer
    ]
    if untrained:
        raise InputError(
            f"{len(untrained)} trainable parameters are not in the optimizer after prepare() (e.g. "
            f"{untrained[0]}; mixed precision {accelerator.mixed_precision}, distributed type "
            f"{accelerator.distributed_type.value}): they would never train. Build the optimizer after "
            "any change to the model's parameters."
        )
