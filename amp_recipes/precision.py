"""What precision a run really uses, and who chose it.

accelerate takes `mixed_precision` from the script's argument, else from
`ACCELERATE_MIXED_PRECISION` (set by `accelerate launch --mixed_precision` or
its config file), else "no". It then silently runs fp32 when fp16 is asked on
a CPU. This module reports what actually happens, so logs never claim fp16
for an fp32 run.
"""

from __future__ import annotations

import os

from accelerate import Accelerator
from accelerate.utils import DistributedType

# Engines that own precision themselves (their own loss scaler / casting) rather than torch autocast.
_ENGINE_OWNED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def precision_source(flag: str | None) -> str:
    """Who chose the precision: the script's flag, accelerate's launcher/config, or nobody."""
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if flag is not None:
        if launcher and launcher != flag:
            return f"--mixed_precision flag ({flag}; overrides accelerate launch/config's {launcher})"
        return "--mixed_precision flag"
    if launcher:
        return "accelerate launch / config file (ACCELERATE_MIXED_PRECISION)"
    return "default (no mixed precision)"


def effective_precision(accelerator: Accelerator) -> str:
    """The compute precision really in effect: 'fp16', 'bf16' or 'fp32'."""
    requested = accelerator.mixed_precision
    if requested == "no":
        return "fp32"
    if accelerator.distributed_type in _ENGINE_OWNED:
        return requested
    if requested == "fp16":
        # Without a GradScaler accelerate did not enable fp16 autocast (e.g. on a CPU).
        return "fp16" if accelerator.native_amp and accelerator.scaler is not None else "fp32"
    return requested if accelerator.native_amp else "fp32"


def describe_precision(accelerator: Accelerator, flag: str | None) -> dict:
    """A record of the precision for logs, tracker config and eval_results.json."""
    requested = accelerator.mixed_precision
    active = effective_precision(accelerator)
    record = {
        "mixed_precision_requested": requested,
        "mixed_precision_source": precision_source(flag),
        "precision_in_effect": active,
        "device_type": accelerator.device.type,
    }
    if requested == "fp16" and active == "fp32":
        record["precision_note"] = (
            f"fp16 was requested but accelerate runs fp32 on a {accelerator.device.type} device "
            "(no autocast, no GradScaler); use a CUDA GPU for fp16, or bf16 on a CPU."
        )
    return record
