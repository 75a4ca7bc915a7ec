"""Training FLOPs of an encoder and model FLOPs utilisation (MFU).

FLOPs of one training step (forward + backward) on `tokens = batch * seq_len` tokens:

    6 * N * tokens                  every weight matrix: 2 FLOPs per multiply-add forward,
                                    twice that backward (input and weight gradients)
  + 12 * L * d_model * seq_len * tokens
                                    attention scores QK^T and the weighted sum AV: each
                                    2 * seq_len^2 * d_model FLOPs per layer and sequence forward,
                                    x3 with the backward pass

N counts the parameters used in matrix multiplies: all of them except the embedding tables
(a lookup, not a matmul). This is the accounting of Kaplan et al. (2020) and the PaLM paper's
MFU, without the recomputation of activation checkpointing.
"""

from __future__ import annotations

import re

import torch

# Dense peak TFLOP/s (no structured sparsity) from the vendors' datasheets, per arm precision:
# fp32 = CUDA-core FP32, tf32/fp16/bf16 = Tensor Cores. None: the chip has no such unit.
PEAK_TFLOPS: dict[str, dict[str, float | None]] = {
    "V100": {"fp32": 15.7, "tf32": None, "fp16": 125.0, "bf16": None},  # SXM2
    "T4": {"fp32": 8.1, "tf32": None, "fp16": 65.0, "bf16": None},
    "A10": {"fp32": 31.2, "tf32": 62.5, "fp16": 125.0, "bf16": 125.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    "L4": {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
    "H100": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},  # SXM
    "H200": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},  # SXM
    # The NVL (PCIe) cards run slower clocks: their datasheets give 835 / 1,671 TFLOP/s for
    # TF32 / FP16-BF16 with sparsity, i.e. half that dense, and 60 for FP32.
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5},
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5},
}


def matmul_parameters(model: torch.nn.Module) -> int:
    """Parameters that take part in matrix multiplies: all but the embedding tables."""
    embedding = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in embedding)


def training_flops_per_step(
    matmul_params: int, num_layers: int, hidden_size: int, batch_size: int, seq_len: int
) -> float:
    tokens = batch_size * seq_len
    return 6.0 * matmul_params * tokens + 12.0 * num_layers * hidden_size * seq_len * tokens


def device_peak_tflops(device_name: str, precision: str) -> float | None:
    """Peak dense TFLOP/s of a known GPU at a precision, or None when unknown."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIe"/"H100 NVL" before "H100"
        # Whole words only: "L4" must not match an "L40S", nor "A10" an "A100".
        if all(re.search(rf"\b{re.escape(part)}\b", device_name, re.IGNORECASE) for part in key.split()):
            return PEAK_TFLOPS[key].get(precision)  # none for fp8: its FLOPs run at two peaks
    return None


def mfu(flops_per_step: float, step_seconds: float, peak_tflops: float | None) -> float | None:
    if not peak_tflops or step_seconds <= 0:
        return None
    return flops_per_step / step_seconds / (peak_tflops * 1e12)


def forward_flops_by_module(model_class, config, seq_len: int) -> dict[str, int]:
    """FLOPs of one forward pass on one sequence of `seq_len` tokens, per module name ("" for the
    whole model), counted by torch's FlopCounterMode on a copy of the model built on the meta device
    (shapes only: no memory, no computation). Exact where the formula above approximates: BERT's
    pooler and classifier see one token per sequence, not seq_len."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        shadow = model_class(config)
        input_ids = torch.zeros(1, seq_len, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        shadow(input_ids=input_ids)
    root = type(shadow).__name__
    counts = {
        "" if name == root else name.removeprefix(root + "."): sum(ops.values())
        for name, ops in counter.get_flop_counts().items()
        if name != "Global"
    }
    return counts
