"""Throughput and memory meters that do not stall the GPU.

Counts that live on the device (non-padding tokens) are accumulated there and
read only when a log line is written: a `.item()` every step forces a host-device
synchronisation and breaks the asynchronous pipeline mixed precision relies on.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import resource
import sys
import time
from pathlib import Path

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on a GPU, peak resident set size on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


def current_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def start_memory_window(device) -> int:
    """Restart the peak-memory reading before a measurement; returns the baseline a CPU's figures
    subtract (what the process held before: interpreter, libraries). On a GPU the allocator's own
    peak restarts, after the cached blocks of an earlier measurement are released."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return 0
    with contextlib.suppress(OSError, AttributeError):  # glibc: freed heap pages back to the system
        ctypes.CDLL(None).malloc_trim(0)
    with contextlib.suppress(OSError):  # Linux: "5" resets the process's peak resident set (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    return current_rss_bytes()


def peak_memory_since_window(device) -> int:
    """The CUDA allocator's peak, or on a CPU the peak resident set (VmHWM where Linux has it)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    with contextlib.suppress(OSError, AttributeError):
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024
    return peak_memory_bytes(device)


class ThroughputMeter:
    """Samples, tokens and padding over a window of training steps (`read` at each log line), and
    over the whole run (`run_rates`, the sum of the windows)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.run_samples, self.run_tokens, self.run_seconds = 0, 0, 0.0
        self.epoch_padded_tokens = 0  # over the epoch, for its padding fraction
        self.epoch_real_tokens = torch.zeros((), dtype=torch.long, device=device)
        self.reset()

    def reset(self) -> None:
        self.samples = 0
        self.padded_tokens = 0  # host-side: shapes are known without a sync
        self.real_tokens = torch.zeros((), dtype=torch.long, device=self.device)
        self.started = time.perf_counter()

    def update(self, batch: dict) -> None:
        input_ids = batch["input_ids"]
        self.samples += input_ids.shape[0]
        self.padded_tokens += input_ids.numel()
        real = batch["attention_mask"].sum() if "attention_mask" in batch else input_ids.numel()
        self.real_tokens += real
        self.epoch_padded_tokens += input_ids.numel()
        self.epoch_real_tokens += real

    def epoch_padding_fraction(self, accelerator=None) -> float:
        """Share of the epoch's batch positions that were padding (over all processes); resets."""
        totals = torch.stack(
            [self.epoch_real_tokens, torch.tensor(self.epoch_padded_tokens, device=self.device)]
        )
        if accelerator is not None and accelerator.num_processes > 1:
            totals = accelerator.reduce(totals, reduction="sum")
        real, padded = totals.tolist()
        self.epoch_padded_tokens = 0
        self.epoch_real_tokens.zero_()
        return 1.0 - real / padded if padded else 0.0

    @contextlib.contextmanager
    def paused(self):
        """Leave the time spent in this block (evaluation) out of the training throughput."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.started += time.perf_counter() - started

    def read(self, accelerator=None) -> dict:
        """Rates over the window since the last read (summed over processes), then start a new window."""
        real_tokens = self.real_tokens
        samples, padded = self.samples, self.padded_tokens
        if accelerator is not None and accelerator.num_processes > 1:
            totals = accelerator.reduce(
                torch.tensor([samples, padded], device=self.device, dtype=torch.long), reduction="sum"
            )
            samples, padded = (int(v) for v in totals.tolist())
            real_tokens = accelerator.reduce(real_tokens.clone(), reduction="sum")
        real = int(real_tokens.item())
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.reset()
        self.run_samples += samples
        self.run_tokens += real
        self.run_seconds += elapsed
        return {
            "samples_per_second": samples / elapsed,
            "tokens_per_second": real / elapsed,
            "padding_fraction": 1.0 - real / padded if padded else 0.0,
        }

    def run_rates(self) -> dict:
        """Training time and throughput over every window read so far (evaluation left out)."""
        seconds = max(self.run_seconds, 1e-9)
        return {
            "train_runtime_seconds": self.run_seconds,
            "train_samples_per_second": self.run_samples / seconds,
            "train_tokens_per_second": self.run_tokens / seconds,
        }
