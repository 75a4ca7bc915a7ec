"""Facts about the machine a run or benchmark used: device, precision support, software."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

import torch


def cpu_info() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                if flags and model:
                    break
    except OSError:
        pass
    return model, flags


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them CPU bf16 autocast is emulated and much slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_info()[1])


def tf32_matmul_enabled() -> bool:
    """Whether fp32 CUDA matmuls may run on TF32 Tensor Cores. Read through torch's
    `fp32_precision` API where it exists: the legacy `allow_tf32` getter raises once anything
    (a user, accelerate, torch.compile) set TF32 through the new API."""
    matmul = torch.backends.cuda.matmul
    try:
        precision = matmul.fp32_precision
    except AttributeError:  # a torch without the fp32_precision API
        return bool(matmul.allow_tf32)
    if precision == "none":  # inherits the global setting
        precision = getattr(torch.backends, "fp32_precision", "ieee")
    return precision == "tf32"


def _nvidia_driver() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (subprocess.SubprocessError, OSError, IndexError):
        return None


def device_facts(device: torch.device | None = None) -> dict:
    """What the preflight needs to know about this process's device. Works before the
    Accelerator exists (for `--mixed_precision auto`): CUDA unless ACCELERATE_USE_CPU is set."""
    if device is None:
        use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
        if torch.cuda.is_available() and not use_cpu:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        else:
            device = torch.device("cpu")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        return {
            "device_type": "cuda",
            "device_name": properties.name,
            "compute_capability": f"{properties.major}.{properties.minor}",
            "tensor_cores": properties.major >= 7,  # Volta (7.0) and newer
            # Native bf16 from Ampere (8.0); torch can emulate it on older GPUs, slowly.
            "bf16_supported": properties.major >= 8,
        }
    facts = {
        "device_type": device.type,
        "device_name": cpu_info()[0] if device.type == "cpu" else device.type,
        "compute_capability": None,
        "tensor_cores": False,
        "bf16_supported": device.type == "cpu" and cpu_has_native_bf16(),  # AVX512-BF16 / AMX
    }
    if device.type == "cpu":
        # A bare `accelerate launch` sets OMP_NUM_THREADS=1: the preflight compares the two.
        facts.update(cpu_cores=len(os.sched_getaffinity(0)), torch_threads=torch.get_num_threads())
    return facts


def transparent_huge_pages(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`; None off Linux):
    under `madvise`, only memory a program asks for gets them (torch: THP_MEM_ALLOC_ENABLE=1)."""
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_pages_on() -> bool:
    """Whether a process can get transparent huge pages here by asking (`madvise`) or at all (`always`)."""
    return transparent_huge_pages() in ("always", "madvise")


def library_versions() -> dict:
    """Python's and each library's version (None where not installed): every report's record of
    what ran (hardware_record, the paired runs' W&B config)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("amp-recipes", "torch", "transformers", "accelerate", "datasets", "evaluate", "wandb"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return {"python": platform.python_version(), **found}


def hardware_record(device: torch.device | None = None) -> dict:
    versions = library_versions()
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu_model, _ = cpu_info()
    record = {
        "device_type": device.type,
        "cpu_model": cpu_model,
        "cpu_count": torch.get_num_threads(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        **{name: versions[name] for name in ("python", "torch", "transformers", "accelerate")},
        "tf32_matmul_allowed": tf32_matmul_enabled(),
        "transparent_huge_pages": transparent_huge_pages(),
    }
    record.update(device_facts(device))
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        record.update(
            tf32_supported=properties.major >= 8,  # Ampere (8.0) and newer
            gpu_memory_bytes=properties.total_memory,
            cuda=torch.version.cuda,
            driver=_nvidia_driver(),
        )
    else:
        record.update(tf32_supported=False)
    return record
