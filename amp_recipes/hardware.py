"""Facts about the machine a run or benchmark used: device, precision support, software."""

from __future__ import annotations

import platform
import shutil
import subprocess

import torch


def _cpu_info() -> tuple[str, set[str]]:
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
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_info()[1])


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


def hardware_record(device: torch.device | None = None) -> dict:
    import accelerate
    import transformers

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu_model, _ = _cpu_info()
    record = {
        "device_type": device.type,
        "cpu_model": cpu_model,
        "cpu_count": torch.get_num_threads(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "tf32_matmul_allowed": torch.backends.cuda.matmul.allow_tf32,
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        major, minor = properties.major, properties.minor
        record.update(
            device_name=properties.name,
            compute_capability=f"{major}.{minor}",
            tensor_cores=major >= 7,  # Volta (7.0) and newer
            bf16_supported=torch.cuda.is_bf16_supported(),
            tf32_supported=major >= 8,  # Ampere (8.0) and newer
            gpu_memory_bytes=properties.total_memory,
            cuda=torch.version.cuda,
            driver=_nvidia_driver(),
        )
    else:
        record.update(device_name=cpu_model, bf16_supported=True, tensor_cores=False, tf32_supported=False)
    return record
