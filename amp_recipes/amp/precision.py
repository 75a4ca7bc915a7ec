"""What precision a run really uses, and who chose it.

accelerate takes `mixed_precision` from the script's argument, else from
`ACCELERATE_MIXED_PRECISION` (set by `accelerate launch --mixed_precision` or
its config file), else "no". It then silently runs fp32 when fp16 is asked on
a CPU, and fp16 when fp8 is asked on a GPU older than Ada/Hopper. This module resolves
`--mixed_precision auto`, refuses fp8 where it cannot run, runs the preflight (launch, device and
precision checks) and reports what actually happens, so logs never claim fp16 for an fp32 run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from importlib.metadata import PackageNotFoundError, version

import torch
from accelerate import Accelerator
from accelerate.utils import (
    AORecipeKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradScalerKwargs,
    TERecipeKwargs,
    is_torchao_available,
    is_transformer_engine_available,
    parse_flag_from_env,
)

from amp_recipes.amp.hardware import device_facts, tf32_matmul_enabled
from amp_recipes.errors import InputError
from amp_recipes.measure.engine import fp8_flop_share

# A precision as the reports name it (the doctor's rows, the benchmark's and the paired runs' arms)
# -> accelerate's mixed_precision. tf32 is fp32 with TF32 matmuls allowed.
MIXED_PRECISION = {"fp32": "no", "tf32": "no", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}


def precision_of(arm: str) -> str:
    """The precision part of an arm's name: "fp16" for "fp16", "fp16+compile" and
    "fp16+gradient_checkpointing" (an arm is a precision, then "+modifier"s)."""
    return arm.split("+", 1)[0]


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


# ----------------------------------------------------------------------------- fp8
# --fp8_backend -> (package, how to install it). torchao is the default: a plain wheel from the
# package index (our `[fp8]` extra); Transformer Engine builds against the local CUDA toolkit.
FP8_BACKENDS = {
    "ao": ("torchao", "pip install -e '.[fp8]'"),
    "te": ("transformer_engine", "pip install 'transformer-engine[pytorch]'"),
}
FP8_CAPABILITY = (8, 9)  # fp8 Tensor Cores: Ada (8.9: L4, L40S), Hopper (9.0: H100, H200), Blackwell


def fp8_backend_choice(flag: str | None) -> str:
    """--fp8_backend, else `accelerate launch --fp8_backend` (ACCELERATE_FP8_BACKEND), else torchao."""
    backend = (flag or os.environ.get("ACCELERATE_FP8_BACKEND") or "ao").lower()
    if backend not in FP8_BACKENDS:
        raise InputError(
            f"fp8 backend {backend!r} (from accelerate launch/config) is not one these recipes wire; "
            "use --fp8_backend ao (torchao) or te (Transformer Engine)."
        )
    return backend


def fp8_refusal(facts: dict, backend: str) -> str | None:
    """Why fp8 cannot run on this device with this backend (one sentence with what to use instead), or None."""
    capability = facts.get("compute_capability")
    if facts["device_type"] != "cuda" or tuple(map(int, capability.split("."))) < FP8_CAPABILITY:
        where = (
            f"{facts['device_name']} (compute capability {capability})"
            if facts["device_type"] == "cuda"
            else f"a {facts['device_type']} ({facts['device_name']})"
        )
        instead = choose_auto_precision(facts)[0]  # bf16 on Ampere, fp16 on Volta/Turing, ...
        return (
            f"fp8 was asked on {where}, but fp8 training needs an NVIDIA GPU of compute capability 8.9 "
            f"or newer (Ada L4/L40S, Hopper H100/H200, Blackwell); use --mixed_precision {instead} instead."
        )
    available = is_torchao_available() if backend == "ao" else is_transformer_engine_available()
    if not available:
        package, install = FP8_BACKENDS[backend]
        return (
            f"fp8 with --fp8_backend {backend} needs {package}, which is not installed: `{install}` "
            f"(or use --mixed_precision bf16 on this {facts['device_name']})."
        )
    return None


def fsdp2_launch() -> bool:
    """Whether this process was launched for FSDP2 (`accelerate launch` with fsdp_version 2), read
    before any Accelerator exists from the variables accelerate launch sets, as accelerate does."""
    return parse_flag_from_env("ACCELERATE_USE_FSDP") and os.environ.get("FSDP_VERSION", "1") == "2"


def fsdp_plugin(mixed_precision: str | None) -> FullyShardedDataParallelPlugin | None:
    """Under an FSDP2 launch, the FSDP plugin accelerate would build from the launch's settings,
    with one change to its MixedPrecisionPolicy: FSDP2 does not cast the model's outputs
    (`output_dtype` None), so the loss reaches backward in fp32, as autocast computed it.

    accelerate 1.15 sets `output_dtype` to the compute dtype. Under fp16 the loss then leaves the
    model in fp16, and backward starts from the GradScaler's scale rounded to fp16: 65536 (the
    default initial scale) is inf there, so the first step always overflows and the scale can never
    grow past 32768. accelerate 1.16 leaves `output_dtype` unset, as this does. None elsewhere:
    accelerate builds its own plugin (FSDP1 does not cast outputs)."""
    if not fsdp2_launch():
        return None
    plugin = FullyShardedDataParallelPlugin()  # the launch's FSDP_* settings, as accelerate reads them
    mixed_precision = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)  # accelerate's own policy for this precision
        plugin.mixed_precision_policy = dataclasses.replace(plugin.mixed_precision_policy, output_dtype=None)
    return plugin


def autocast_fsdp2_forward(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """After prepare(), under FSDP2 with mixed precision: the model's forward under autocast, with
    its outputs converted to fp32, as prepare() does for every other engine (accelerate's own
    `get_mixed_precision_context_manager` and `convert_outputs_to_fp32`, as in its prepare_model).

    accelerate's FSDP2 path (1.15, 1.16) leaves them out: FSDP2 casts the weights to fp16/bf16
    (MixedPrecisionPolicy) and the whole forward runs in that dtype, the loss included. Under fp16
    backward then starts from the GradScaler's scale rounded to fp16, where the default 65536 is
    inf: every step at that scale overflows, and the scale never stays above 32768. Under
    autocast softmax, the norms and the loss run in fp32, in training and in evaluation alike.
    Elsewhere this does nothing."""
    if not (accelerator.is_fsdp2 and accelerator.native_amp):
        return
    from types import MethodType

    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    model._original_forward = model.forward
    if hasattr(model.forward, "__func__"):  # a method: wrapped, and bound again (accelerate's way)
        model.forward = MethodType(convert_outputs_to_fp32(autocast(model.forward.__func__)), model)
    else:
        model.forward = convert_outputs_to_fp32(autocast(model.forward))


def fp8_linear_config(fsdp2: bool = False):
    """torchao's Float8Linear settings: dynamic tensorwise scaling (torchao's default recipe);
    inner dimensions padded to multiples of 16 (torch._scaled_mm needs them; the weight-gradient
    matmul's inner dimension is batch x sequence).

    fp8 all-gathers (`enable_fsdp_float8_all_gather`) only under FSDP2, the one engine they serve:
    with them, torchao replaces every converted weight by a new Parameter (a float8-aware wrapper,
    Float8Linear.from_float), and accelerate converts the model in prepare() without telling the
    optimizer, which the recipes build before prepare() (accelerate's nlp example does too). Only
    FSDP2's prepare() remaps the optimizer to the new parameters (by data pointer); anywhere else
    those weights would never train, and save_pretrained/save_state fail on the wrapper.
    Without the flag, Float8Linear keeps the nn.Linear's own Parameter objects."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(pad_inner_dim=True, enable_fsdp_float8_all_gather=fsdp2)


def fp8_recipe_kwargs(mixed_precision: str | None, fp8_backend: str | None) -> list:
    """accelerate's fp8 recipe handler, to unpack into `kwargs_handlers`: none unless fp8 is asked
    (by --mixed_precision or by accelerate launch/config). Raises InputError, before any
    Accelerator exists, where fp8 cannot run: accelerate itself would fall back to fp16 with a
    warning on an older GPU, or fail later with an ImportError."""
    if (mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION")) != "fp8":
        return []
    backend = fp8_backend_choice(fp8_backend)
    refusal = fp8_refusal(device_facts(), backend)
    if refusal:
        raise InputError(refusal)
    if backend == "te":
        # Transformer Engine: delayed scaling from an amax history, HYBRID format (E4M3 forward, E5M2
        # gradients) unless accelerate launch's --fp8_format / --fp8_* flags say otherwise.
        return [TERecipeKwargs()]
    # torchao: accelerate swaps nn.Linear for Float8Linear in prepare(), except the first and last
    # Linear layers and any whose sizes are not multiples of 16 (accelerate's default filter).
    return [AORecipeKwargs(config=fp8_linear_config(fsdp2_launch()))]


def is_fp8_linear(module: torch.nn.Module) -> bool:
    """torchao's Float8Linear or a Transformer Engine layer (what accelerate swaps nn.Linear for)."""
    return type(module).__module__.startswith(("torchao.float8", "transformer_engine"))


# What FSDP (1), activation checkpointing and torch.compile insert into module names; accelerate's
# unwrap_model removes DDP's and DeepSpeed's wrappers, not these.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _package_version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def fp8_layer_report(accelerator: Accelerator, model: torch.nn.Module, seq_len: int) -> dict:
    """After prepare(): how many Linear layers run in fp8, which stay in high precision, and the
    fp8 layers' share of the model's matmul FLOPs on a sequence of `seq_len` tokens (attention's
    score and weighted-sum matmuls included, which run in bf16). Empty unless fp8 is on."""
    if not getattr(accelerator, "fp8_enabled", False):
        return {}
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    fp8, high = [], []
    for name, module in unwrapped.named_modules():
        for part in _WRAPPER_PARTS:
            name = name.replace(part, "")
        if is_fp8_linear(module):
            fp8.append(name)
        elif isinstance(module, torch.nn.Linear):
            high.append(name)
    backend = accelerator.fp8_backend.value.lower()
    package = FP8_BACKENDS[backend][0] if backend in FP8_BACKENDS else backend
    handler = accelerator.ao_recipe_handler if backend == "ao" else None
    report = {
        "fp8_backend": backend,
        "fp8_backend_version": _package_version(package),
        # torchao's emulation (a test setting): fp8 rounding in fp32 matmuls, no fp8 Tensor Cores.
        "fp8_emulated": bool(handler and handler.config and handler.config.emulate),
        "fp8_linear_layers": len(fp8),
        "linear_layers": len(fp8) + len(high),
        "high_precision_linear_layers": high,
        "fp8_flop_share": fp8_flop_share(unwrapped, fp8, seq_len),
        "fp8_flop_share_seq_len": seq_len,
    }
    if not fp8:  # nothing passed the backend's filter: accelerate's bf16 autocast is all that runs
        report["precision_in_effect"] = "bf16"
    return report


def describe_fp8_layers(report: dict) -> str:
    """The layer report in words, for the log and the benchmark's table: "ao 0.18.0: 72 of 74
    Linear layers in fp8, 96.6% of the forward matmul FLOPs at 128 tokens"."""
    share = report["fp8_flop_share"]
    flops = "FLOP share not computed" if share is None else f"{share:.1%} of the forward matmul FLOPs"
    return (
        f"{report['fp8_backend']} {report['fp8_backend_version']}{' (emulated)' if report['fp8_emulated'] else ''}: "
        f"{report['fp8_linear_layers']} of {report['linear_layers']} Linear layers in fp8, {flops} at "
        f"{report['fp8_flop_share_seq_len']} tokens"
    )


def log_fp8_report(report: dict, logger) -> None:
    """One line: the fp8 layers and their FLOP share; a warning when prepare() converted none."""
    if "fp8_linear_layers" not in report:
        return
    if not report["fp8_linear_layers"]:
        logger.warning(
            "fp8 was asked but no Linear layer runs in fp8 (none passed the backend's filter): this run "
            "is bf16 throughout; use --mixed_precision bf16 to say so.",
            main_process_only=True,
        )
        return
    kept = ", ".join(report["high_precision_linear_layers"]) or "none"
    logger.info(f"fp8 with {describe_fp8_layers(report)}; kept in bf16: {kept}", main_process_only=True)


def check_launch(accelerator) -> None:
    """Refuse launches that accelerate would quietly run another way.

    - On a machine without GPUs, `accelerate launch --multi_gpu --num_processes N` starts N
      independent single-process runs (each training on all the data, all writing the same
      files) unless ACCELERATE_USE_CPU=1 asks for a gloo process group.
    - accelerate turns on FSDP / DeepSpeed only over GPU (or other accelerator) process groups:
      asked on a CPU, it trains with plain DDP instead.
    - A DeepSpeed config file whose gradient_accumulation_steps is not the run's: prepare() would
      switch to the file's, with a warning, after the recipe sized its schedule for the run's.
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
    plugin = accelerator.state.deepspeed_plugin
    configured = plugin.deepspeed_config.get("gradient_accumulation_steps") if plugin else None
    if isinstance(configured, int) and configured != accelerator.gradient_accumulation_steps:
        raise InputError(
            f"The DeepSpeed config holds gradient_accumulation_steps {configured} (the file's value, or 1 where the "
            f"file has none) and the run asks for {accelerator.gradient_accumulation_steps}: prepare() would switch to "
            f'{configured} after the schedule was sized; set it to "auto" in the file (the flag then decides) or '
            f"to {accelerator.gradient_accumulation_steps}."
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
    # `accelerate launch` without a config exports "no" whether or not anyone chose it, so a flag
    # that asks for a reduced precision over a launcher's "no" is the usual way to ask, not a
    # disagreement (the preflight's source line still says the flag overrode it).
    if flag and launcher and launcher != "no" and flag != launcher:
        warnings.append(
            f"--mixed_precision {flag} and the accelerate launch/config setting {launcher} disagree: "
            f"the script's flag wins, this run asks for {flag}."
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
            "much slower than fp32 (19x for MiniLM-L6 on SST-2, docs/paired-runs.md); use --mixed_precision no (or auto)."
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


# What the recipes' --fp16_* flags (torch's GradScaler settings) are in DeepSpeed's fp16 config.
# DeepSpeed's dynamic loss scaler multiplies by a fixed factor 2 (growth) and 1/2 (back-off): its
# config has no key for either. `hysteresis` 1 halves the scale on every overflowing step, as torch
# does (DeepSpeed's default 2 lets the first overflow after each growth pass without a back-off).
DEEPSPEED_FIXED_FACTORS = {"growth_factor": 2.0, "backoff_factor": 0.5}


def deepspeed_loss_scaling(plugin, handler: GradScalerKwargs | None) -> dict:
    """DeepSpeed fp16: the recipe's GradScaler settings (`handler`, its GradScalerKwargs:
    --fp16_init_scale, --fp16_growth_interval, --fp16_growth_factor, --fp16_backoff_factor) written
    into the fp16 section of the DeepSpeed plugin's config, before prepare() hands that very dict to
    deepspeed.initialize. accelerate
    creates no GradScaler under DeepSpeed and drops GradScalerKwargs without a word; DeepSpeed's own
    scaler would start at 2**16, grow after 1000 clean steps and halve only on a second overflow.

    Written: `initial_scale_power` (log2 of --fp16_init_scale), `loss_scale_window`
    (--fp16_growth_interval), `hysteresis` 1 and dynamic scaling (`loss_scale` 0). A DeepSpeed config
    file's own value stays unless a flag set on the command line says otherwise (then the run is
    refused); keys the file leaves out or sets to "auto" are filled. Raises InputError for what
    DeepSpeed cannot do: growth/back-off factors other than 2 and 0.5, an initial scale that is not a
    power of two, loss-scale flags with a static loss scale. Returns DeepSpeed's loss-scale settings."""
    handler = handler or GradScalerKwargs()
    given = handler.to_kwargs()  # the flags set to something other than torch's defaults
    for name, fixed in DEEPSPEED_FIXED_FACTORS.items():
        if getattr(handler, name) != fixed:
            raise InputError(
                f"--fp16_{name} {getattr(handler, name):g}: DeepSpeed's fp16 loss scaler grows by 2 and backs off "
                "by 0.5, fixed; drop the flag, or use DDP/FSDP (multi_gpu.yaml, fsdp.yaml) for another factor."
            )
    power = math.log2(handler.init_scale) if handler.init_scale >= 1 else math.nan
    if not power.is_integer():
        raise InputError(
            f"--fp16_init_scale {handler.init_scale:g}: DeepSpeed's initial loss scale is a power of two, at "
            "least 1 (its initial_scale_power); use one, e.g. 65536 (2**16)."
        )
    fp16 = plugin.deepspeed_config.setdefault("fp16", {"enabled": True})
    if fp16.get("loss_scale") not in (None, "auto", 0):  # a static loss scale, from the config file
        if given:
            raise InputError(
                f"The DeepSpeed config's fp16.loss_scale {fp16['loss_scale']} is a static loss scale: the "
                f"--fp16_* flags ({', '.join(given)}) have nothing to set; drop them, or set loss_scale to 0."
            )
        return {key: fp16[key] for key in ("loss_scale",)}
    wanted = {  # DeepSpeed key -> (value, the flag it comes from)
        "loss_scale": (0, None),
        "initial_scale_power": (int(power), "init_scale"),
        "loss_scale_window": (handler.growth_interval, "growth_interval"),
        "hysteresis": (1, None),
    }
    for key, (value, flag) in wanted.items():
        if fp16.get(key) in (None, "auto"):
            fp16[key] = value
        elif fp16[key] != value and flag in given:
            raise InputError(
                f"--fp16_{flag} disagrees with the DeepSpeed config file's fp16.{key} {fp16[key]}: drop the "
                'flag, or the key (or set it to "auto") to let the flag decide.'
            )
    return {key: fp16[key] for key in wanted}


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def describe_deepspeed_loss_scaling(settings: dict) -> str:
    """DeepSpeed's loss-scale settings in words, for the preflight block."""
    if settings.get("loss_scale"):
        return f"DeepSpeed's static loss scale {settings['loss_scale']:g}"
    hysteresis = settings["hysteresis"]
    overflow = (
        "halves on each overflowing step"
        if hysteresis == 1
        else f"halves from the {_ordinal(hysteresis)} overflow on (hysteresis {hysteresis})"
    )
    window = settings["loss_scale_window"]
    return (
        f"DeepSpeed's dynamic loss scaler: starts at 2**{settings['initial_scale_power']}, doubles on the "
        f"{_ordinal(window + 1)} step without overflow, then every {window}, {overflow} (every overflowing step "
        "is skipped)"
    )


@contextlib.contextmanager
def zero3_init(accelerator: Accelerator):
    """Around `from_pretrained`: DeepSpeed ZeRO-3's zero.Init only where the config's zero3_init_flag
    asks for it. transformers builds the model inside zero.Init (weights partitioned, in the
    config's 16 bits, as they load) whenever a stage-3 DeepSpeed config is registered with it, and
    accelerate (1.15, 1.16) registers one whatever the flag says. With the flag off the model loads
    whole, in fp32, and DeepSpeed partitions it at prepare(): training starts from the checkpoint's
    own weights and --ignore_mismatched_sizes can start a new head. Elsewhere it does nothing."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.is_zero3_init_enabled():
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # registered again, for prepare() and the checkpoints


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
    if half and precision_in_effect in ("fp16", "bf16", "fp8"):
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
    deepspeed_fp16 = accelerator.distributed_type == DistributedType.DEEPSPEED and in_effect == "fp16"
    # DeepSpeed fp16: its own loss scaler, set from the --fp16_* flags (accelerate would drop them).
    plugin, handler = accelerator.state.deepspeed_plugin, accelerator.scaler_handler
    loss_scaling = deepspeed_loss_scaling(plugin, handler) if deepspeed_fp16 else None
    if scaler_settings and in_effect != "fp16":
        warnings.append(
            f"The --fp16_* GradScaler flags ({', '.join(scaler_settings)}) have no effect: this run is not fp16."
        )
    report = {**describe_precision(accelerator, flag), **facts, "num_processes": accelerator.num_processes}
    report.pop("precision_note", None)  # the preflight warning says it, with the fix
    if auto_reason:
        report["mixed_precision_auto_reason"] = auto_reason
    if loss_scaling:
        report["deepspeed_loss_scaling"] = loss_scaling
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
    if report.get("deepspeed_loss_scaling"):
        lines.append(f"  loss scale: {describe_deepspeed_loss_scaling(report['deepspeed_loss_scaling'])}")
    return "\n".join(lines)
