"""What precision a run really uses, and who chose it.

accelerate takes `mixed_precision` from the script's argument, else from
`ACCELERATE_MIXED_PRECISION` (set by `accelerate launch --mixed_precision` or
its config file), else "no". It then silently runs fp32 when fp16 is asked on
a CPU. This module resolves `--mixed_precision auto`, runs the preflight (launch, device and
precision checks) and reports what actually happens, so logs never claim fp16 for an fp32 run.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from .errors import InputError
from .hardware import device_facts, tf32_matmul_enabled

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
    """The compute precision really in effect: 'fp16', 'bf16', 'tf32' or 'fp32'."""
    requested = accelerator.mixed_precision
    if requested == "no":
        # TF32 matmuls on an Ampere+ GPU are not fp32 (accelerate itself turns TF32 on for a
        # compiled fp32 run on CUDA, in AcceleratorState).
        device = accelerator.device
        if (
            device.type == "cuda"
            and tf32_matmul_enabled()
            and torch.cuda.get_device_capability(device)[0] >= 8
        ):
            return "tf32"
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


# ----------------------------------------------------------------------------- preflight
def choose_auto_precision(facts: dict) -> tuple[str, str]:
    """`--mixed_precision auto`: bf16 where the device supports it natively, else fp16 on a GPU
    with Tensor Cores, else fp32. Returns (accelerate's mixed_precision value, why)."""
    name = facts["device_name"]
    if facts["device_type"] == "cuda":
        capability = f"{name}, compute capability {facts['compute_capability']}"
        if facts["bf16_supported"]:
            return "bf16", f"{capability} supports bf16 (fp32's range: no loss scaling needed)"
        if facts["tensor_cores"]:
            return "fp16", f"{capability} has Tensor Cores but no native bf16"
        return "no", f"{capability} predates Tensor Cores: fp16 would not be faster than fp32"
    if facts["device_type"] == "cpu":
        if facts["bf16_supported"]:
            return "bf16", f"this CPU ({name}) has native bf16 (AVX512-BF16/AMX)"
        return "no", f"this CPU ({name}) has no native bf16 (emulated bf16 is slower than fp32)"
    return "no", f"no mixed-precision rule for a {facts['device_type']} device"


def resolve_mixed_precision(flag: str | None) -> tuple[str | None, str | None]:
    """`--mixed_precision` as accelerate takes it: `auto` becomes this device's choice (with the
    reason, for the preflight block); anything else, None included, passes through."""
    if flag != "auto":
        return flag, None
    return choose_auto_precision(device_facts())


def check_launch(accelerator) -> None:
    """Refuse launches that accelerate would quietly run another way.

    - On a machine without GPUs, `accelerate launch --multi_gpu --num_processes N` starts N
      independent single-process runs (each training on all the data, all writing the same
      files) unless ACCELERATE_USE_CPU=1 asks for a gloo process group.
    - accelerate turns on FSDP / DeepSpeed only over GPU (or other accelerator) process groups:
      asked on a CPU, it trains with plain DDP instead.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes != launched:
        raise InputError(
            f"{launched} processes were launched but accelerate sees {accelerator.num_processes}: on a machine "
            "without GPUs set ACCELERATE_USE_CPU=1 for multi-process CPU training (gloo)."
        )
    for engine in ("FSDP", "DEEPSPEED"):
        asked = os.environ.get(f"ACCELERATE_USE_{engine}", "false").lower() == "true"
        if asked and accelerator.distributed_type.value != engine:
            raise InputError(
                f"{engine} was requested but accelerate set up {accelerator.distributed_type.value} on "
                f"{accelerator.device.type}: accelerate enables {engine} only on GPUs; use a GPU machine or drop it."
            )


def preflight_checks(
    facts: dict,
    requested: str,
    flag: str | None,
    launcher: str | None,
    in_effect: str | None = None,
    num_processes: int = 1,
) -> tuple[list, list]:
    """Warnings and refusals (each one sentence with the fix) for a precision on a device.

    `requested` is accelerate's mixed_precision, `flag` the script's --mixed_precision, `launcher`
    ACCELERATE_MIXED_PRECISION (set by `accelerate launch` or its config file), `in_effect` what
    accelerate really enabled (default: the fp32 it falls back to for fp16 on a CPU),
    `num_processes` how many processes share the machine."""
    warnings, refusals = [], []
    where = facts["device_name"]
    if facts.get("compute_capability"):
        where += f" (compute capability {facts['compute_capability']})"
    if flag and launcher and flag != launcher:
        warnings.append(
            f"--mixed_precision {flag} and the accelerate launch/config setting {launcher} disagree: "
            f"the script's flag wins, this run uses {flag}."
        )
    if requested == "fp16" and facts["device_type"] == "cpu" and in_effect != "fp16":
        warnings.append(
            "fp16 was asked on a CPU, where accelerate silently runs fp32 (no autocast, no GradScaler); "
            + (
                "use --mixed_precision bf16 (this CPU has native bf16) or a CUDA GPU for fp16."
                if facts["bf16_supported"]
                else "use a CUDA GPU for fp16, or --mixed_precision no."
            )
        )
    cores, threads = facts.get("cpu_cores", 1), facts.get("torch_threads")
    if facts["device_type"] == "cpu" and threads == 1 and num_processes < cores:
        warnings.append(
            f"this run computes with 1 thread on a CPU with {cores} cores (OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; a bare `accelerate launch` sets it to 1): "
            "use every core with `accelerate launch --config_file accelerate_configs/cpu.yaml ...` "
            "or plain `python recipes/...`."
        )
    if requested == "bf16" and facts["device_type"] == "cpu" and not facts["bf16_supported"]:
        warnings.append(
            f"bf16 on {where}, which has no native bf16 (AVX512-BF16/AMX): autocast emulates it and runs "
            "much slower than fp32 (about 15x for a small BERT); use --mixed_precision no (or auto)."
        )
    if requested == "bf16" and facts["device_type"] == "cuda" and not facts["bf16_supported"]:
        refusals.append(
            f"bf16 on {where}: bf16 needs an Ampere (8.0) or newer GPU; use --mixed_precision fp16 (or auto)."
        )
    if requested == "fp16" and facts["device_type"] == "cuda" and not facts["tensor_cores"]:
        warnings.append(
            f"fp16 on {where}, which predates Tensor Cores (7.0): fp16 may be slower than fp32; "
            "it still saves memory. Use --mixed_precision no (or auto) for speed."
        )
    return warnings, refusals


def check_model_dtype(
    model: torch.nn.Module, precision_in_effect: str, distributed_type: DistributedType | None = None
) -> None:
    """AMP keeps fp32 master weights and casts per operation; half-precision weights break the
    GradScaler ("Attempting to unscale FP16 gradients") and lose small updates under bf16.
    DeepSpeed is exempt: its optimizer holds the fp32 master weights, and under ZeRO-3's
    `zero.Init` transformers creates the module's own parameters in half precision."""
    if distributed_type in _ENGINE_OWNED:
        return
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    half = sorted(str(d).replace("torch.", "") for d in dtypes & {torch.float16, torch.bfloat16})
    if half and precision_in_effect in ("fp16", "bf16"):
        raise InputError(
            f"The model's weights are {'/'.join(half)} while {precision_in_effect} mixed precision is on: "
            "load the model in float32 (from_pretrained(..., dtype=torch.float32), not .half() or "
            "dtype='auto'); accelerate's autocast casts per operation and needs fp32 master weights."
        )


def preflight(accelerator: Accelerator, flag: str | None, auto_reason: str | None = None, facts=None) -> dict:
    """Check the launch, and the precision against the device; return the report for the log,
    the trackers and eval_results.json (device facts, precision in effect and who chose it).

    Raises InputError for a refusal; warnings are returned under "preflight_warnings"."""
    check_launch(accelerator)
    facts = facts or device_facts(accelerator.device)
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    in_effect = effective_precision(accelerator)
    warnings, refusals = preflight_checks(
        facts, accelerator.mixed_precision, flag, launcher, in_effect, accelerator.num_processes
    )
    if refusals:
        raise InputError(" ".join(refusals))
    scaler_settings = accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler else {}
    if scaler_settings and in_effect != "fp16":
        warnings.append(
            f"The --fp16_* GradScaler flags ({', '.join(scaler_settings)}) have no effect: this run is not fp16."
        )
    report = {**describe_precision(accelerator, flag), **facts, "num_processes": accelerator.num_processes}
    report.pop("precision_note", None)  # the preflight warning says it, with the fix
    if auto_reason:
        report["mixed_precision_auto_reason"] = auto_reason
    report["preflight_warnings"] = warnings
    return report


def log_preflight(report: dict, logger) -> None:
    """The preflight block, then each of its warnings as a warning (main process only)."""
    logger.info(format_preflight(report), main_process_only=True)
    for warning in report["preflight_warnings"]:
        logger.warning(warning, main_process_only=True)


def format_preflight(report: dict) -> str:
    """The preflight block of the log (its warnings are logged one by one, as warnings)."""
    device = report["device_name"]
    if report.get("compute_capability"):
        device += f", compute capability {report['compute_capability']}"
    lines = [
        "Preflight",
        f"  device:     {report['device_type']} ({device}) x {report['num_processes']} process(es)",
        f"  hardware:   Tensor Cores {'yes' if report['tensor_cores'] else 'no'}, "
        f"native bf16 {'yes' if report['bf16_supported'] else 'no'}",
        f"  precision:  {report['precision_in_effect']} in effect (requested "
        f"{report['mixed_precision_requested']}, chosen by {report['mixed_precision_source']})",
    ]
    if report.get("mixed_precision_auto_reason"):
        lines.append(f"  auto:       {report['mixed_precision_auto_reason']}")
    return "\n".join(lines)
