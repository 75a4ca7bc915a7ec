"""The measurement engine: timed training steps, the peak memory as the device reports it, the
largest batch that fits a memory budget, and fp8's share of the FLOPs. The precision doctor (`amp-recipes doctor`) and the
precision benchmark (`scripts/benchmark_precision.py`, which `scripts/paired_runs.py --headroom`
runs) both measure with it; each brings its own training step (the doctor's on its copy of the
recipe's model, the benchmark's under a fresh Accelerator per trial)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import os
import re
import resource
import sys
import time
from pathlib import Path

import torch

SEARCH_MAX = 8192  # the largest batch a search tries unless told otherwise

# Kept free on the card under a CUDA budget: what CUDA allocates outside PyTorch's allocator as a
# trial runs (kernels loaded on first use, cuBLAS workspaces, library handles). With it, a trial too
# large fails in the allocator (OutOfMemoryError: "does not fit"), not in the driver. A choice, not
# a measure.
CUDA_RESERVE = 2**30

# What CUDA and cuBLAS say when the driver, not PyTorch's allocator, runs out of memory (a kernel
# loaded on first use, a library handle): torch raises them as RuntimeErrors whose message
# accelerate's should_reduce_batch_size does not read ("CUDA error: out of memory" has no period).
DRIVER_OUT_OF_MEMORY = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


class OutOfTime(Exception):
    """The search's deadline: the next trial would end past it."""


# ----------------------------------------------------------------------------- peak memory
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


# ----------------------------------------------------------------------------- timed steps
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_peak_restarts() -> bool:
    """Whether this process's peak resident set can be restarted before a measurement (Linux's
    /proc/self/clear_refs, which amp_recipes.measure.engine.start_memory_window writes): elsewhere a CPU's
    peak only grows, and a measurement in a process that measured before holds the earlier peaks."""
    return os.access("/proc/self/clear_refs", os.W_OK)


def time_steps(step, batches: list, device: torch.device, warmup: int) -> dict:
    """`step(batch)` (one training step, returning its loss) on each batch, the device synchronized
    before and after each one (a GPU runs asynchronously: without it a step's time would be its
    launch). The first `warmup` steps are not timed (the allocator's first blocks, kernels
    loaded, a compilation); the first step's time is kept apart (under torch.compile: the
    compilation)."""
    seconds, losses, first = [], [], None
    for index, batch in enumerate(batches):
        synchronize(device)
        started = time.perf_counter()
        loss = step(batch)
        synchronize(device)
        elapsed = time.perf_counter() - started
        first = elapsed if index == 0 else first
        if index >= warmup:
            seconds.append(elapsed)
            losses.append(float(loss))  # after the clock: reading the loss waits for the device
    return {"step_seconds": seconds, "losses": losses, "first_step_seconds": first}


# ----------------------------------------------------------------------------- fp8's share
def fp8_flop_share(unwrapped: torch.nn.Module, fp8_names: list[str], seq_len: int) -> float | None:
    """The named fp8 layers' share of one forward pass's matmul FLOPs at `seq_len` tokens (attention's
    score and weighted-sum matmuls included, which run in bf16): the doctor's, for the layers
    accelerate would convert, and the recipes' layer report's, for those it did. None for a model the
    meta-device copy cannot be built for (not a transformers model: no `config` to build it from)."""
    from amp_recipes.measure.flops import forward_flops_by_module

    try:
        flops = forward_flops_by_module(type(unwrapped), unwrapped.config, seq_len)
    except (AttributeError, TypeError, NotImplementedError, RuntimeError):
        return None
    total = flops.pop("")
    return sum(flops.get(name, 0) for name in fp8_names) / total if total else None


# ----------------------------------------------------------------------------- what fits
def is_out_of_memory(error: BaseException) -> bool:
    """A trial that does not fit: torch's OutOfMemoryError, what accelerate's
    find_executable_batch_size also reads as one (a raw CUDA allocation failure in a library's
    kernel is a RuntimeError whose message says " out of memory."), or the driver's own."""
    from accelerate.utils.memory import should_reduce_batch_size

    if isinstance(error, torch.OutOfMemoryError) or should_reduce_batch_size(error):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in DRIVER_OUT_OF_MEMORY)


def largest_fitting(fits, start: int, maximum: int, granularity: int = 1) -> tuple[int, int | None]:
    """The largest batch size for which `fits(size)` holds: double from `start` until a size does
    not fit, then bisect down to `granularity`. Upward, unlike accelerate's
    find_executable_batch_size (which halves a batch until it stops raising OOM): the headroom is
    the largest batch that fits. Returns (the largest fit, 0 when `start` does not; the smallest
    size that did not fit, None when `maximum` was reached first)."""
    largest_fit, smallest_fail, size = 0, None, start
    while size <= maximum:
        if not fits(size):
            smallest_fail = size
            break
        largest_fit, size = size, size * 2
    while smallest_fail is not None and largest_fit and smallest_fail - largest_fit > granularity:
        middle = largest_fit + max(
            granularity, (smallest_fail - largest_fit) // 2 // granularity * granularity
        )
        if fits(middle):
            largest_fit = middle
        else:
            smallest_fail = middle
    return largest_fit, smallest_fail


def cuda_index(device) -> int:
    """The CUDA device's index: accelerate's single-process device is an index-less
    torch.device("cuda"), which torch.cuda.set_per_process_memory_fraction refuses ("Expected a
    torch.device with a specified index")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_budget(device, budget_bytes: int | None) -> dict:
    """A card of `budget_bytes` (None: this card) emulated on this CUDA GPU. The caching allocator,
    which torch.cuda.set_per_process_memory_fraction caps, may hold the budget less what lives
    outside it now (the card's memory in use that the allocator does not hold: the CUDA context,
    libraries' handles, other processes) less CUDA_RESERVE: capped at the whole budget, a trial
    could use more of the card than the budget. Returns the figures the reports state."""
    index = cuda_index(device)
    free, total = torch.cuda.mem_get_info(index)
    outside = max(0, total - free - torch.cuda.memory_reserved(index))
    budget = min(budget_bytes or total, total)
    return {
        "budget_bytes": budget,
        "outside_allocator_bytes": outside,
        "reserve_bytes": CUDA_RESERVE,
        "allocator_cap_bytes": max(0, budget - outside - CUDA_RESERVE),
    }


@contextlib.contextmanager
def allocator_cap(device: torch.device, budget_bytes: int | None):
    """On a CUDA GPU, a card of `budget_bytes` (None: this card): PyTorch's allocator capped with
    torch.cuda.set_per_process_memory_fraction at the budget less what lives outside it
    (cuda_budget), so that an allocation past it raises OutOfMemoryError as that card would.
    A cap set before (a call, or PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction) is never
    raised, and is restored after. Yields the budget's figures (None on a CPU, where nothing is
    capped)."""
    if device.type != "cuda":
        yield None
        return
    index = cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    card = cuda_budget(device, budget_bytes)
    fraction_before = torch.cuda.get_per_process_memory_fraction(index)
    fraction = min(fraction_before, card["allocator_cap_bytes"] / total)
    card["allocator_cap_bytes"] = int(fraction * total)  # a lower cap set before is the limit
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    try:
        yield card
    finally:
        torch.cuda.set_per_process_memory_fraction(fraction_before, index)


def memory_budget(device: torch.device, memory_budget_gb: float | None) -> int:
    """--memory_budget_gb, else what a run could hold: on a GPU the card (a search caps the
    allocator at it less what lives outside the allocator: cuda_budget); on a CPU the memory free
    now and what this process holds (a recipe run would hold about as much)."""
    if memory_budget_gb:
        return int(memory_budget_gb * 2**30)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(cuda_index(device))[1]
    import psutil

    return psutil.virtual_memory().available + psutil.Process().memory_info().rss


def largest_batch(
    peak_at,
    device: torch.device,
    budget: int,
    batch_size: int,
    deadline: float = math.inf,
    *,
    start: int = 1,
    maximum: int = SEARCH_MAX,
    granularity: int = 8,
    search_on_cpu: bool = False,
    on_trial=None,
) -> dict:
    """The largest batch that fits `budget` bytes, `peak_at(size)` running a batch of that size (its
    model built and prepared in the trial, or not) and returning its peak memory.

    Searched on a GPU: sizes doubled from `start`, then bisected to `granularity`, under
    allocator_cap; an out-of-memory error anywhere in a trial (is_out_of_memory) means "does not
    fit", and the next trial starts from a released cache. On a CPU an allocation past the memory
    does not fail, the kernel kills the process: searched only with `search_on_cpu` (a budget
    given well below the machine's memory), a peak over the budget meaning "does not fit";
    otherwise predicted, from a line through the peaks at `batch_size` and twice it (the weights,
    gradients and optimizer states are the same at any batch size; the activations grow with it,
    by the same bytes per row of the same length).

    `deadline` (time.monotonic()): no trial starts that would end past it, judged by the longest
    trial so far; a search cut there keeps its largest fit as a lower bound (`search_stopped`).
    `on_trial(trial)` is called after each trial (a progress line)."""
    from accelerate.utils.memory import clear_device_cache

    trials = []

    def fits(size: int) -> bool:
        if time.monotonic() + max((t["seconds"] for t in trials), default=0.0) > deadline:
            raise OutOfTime
        started, failure, peak = time.monotonic(), None, None
        try:
            peak = peak_at(size)
        except Exception as error:  # noqa: BLE001 - only an out-of-memory error means "does not fit"
            if not is_out_of_memory(error):
                raise
            failure = "out of memory"
        if failure:  # the failed trial's tensors, freed before the next one
            clear_device_cache(garbage_collection=True)
        elif device.type == "cpu" and peak > budget:
            failure = "over the memory budget"
        trial = {"batch_size": size, "fits": failure is None, "peak_memory_bytes": peak, "failure": failure}
        trials.append({**trial, "seconds": time.monotonic() - started})
        if on_trial:
            on_trial(trials[-1])
        return failure is None

    if device.type == "cuda" or search_on_cpu:
        with allocator_cap(device, budget) as card:
            if card and not card["allocator_cap_bytes"]:
                why = "the budget is no larger than what lives outside PyTorch's allocator and the reserve"
                return {"method": "searched", "max_batch_size": None, "why": why, **card, "trials": trials}
            try:
                largest, failed = largest_fitting(fits, start, maximum, granularity)
                found = {"max_batch_size": largest, "first_batch_not_fitting": failed}
                found["capped_at_search_max"] = failed is None
            except OutOfTime:  # what fit so far: a lower bound (None: nothing fit yet)
                largest = max((t["batch_size"] for t in trials if t["fits"]), default=None)
                found = {
                    "max_batch_size": largest,
                    "capped_at_search_max": True,
                    "search_stopped": "out of time",
                }
        return {"method": "searched", **found, **(card or {"budget_bytes": budget}), "trials": trials}
    found = {"method": "predicted", "budget_bytes": budget, "trials": trials}
    try:
        if not fits(batch_size) and trials[0]["peak_memory_bytes"] is None:  # out of memory already
            return {**found, "max_batch_size": 0, "why": "your batch ran out of memory"}
        if trials[0]["peak_memory_bytes"] > budget / 2:  # twice the batch might not fit: killed, not failed
            return {**found, "max_batch_size": None, "why": "the peak at your batch is over half the budget"}
        if not fits(2 * batch_size) and trials[1]["peak_memory_bytes"] is None:
            return {**found, "max_batch_size": batch_size, "why": "twice your batch ran out of memory"}
    except OutOfTime:
        return {**found, "max_batch_size": None, "search_stopped": "out of time"}
    small, large = (trial["peak_memory_bytes"] for trial in trials)
    per_row = (large - small) / batch_size
    fixed = small - per_row * batch_size
    found.update(fixed_bytes=fixed, bytes_per_row=per_row)
    if per_row <= 0:  # the resident set did not grow: nothing to extrapolate from
        return {**found, "max_batch_size": None, "why": "the peak did not grow with the batch size"}
    return {**found, "max_batch_size": max(0, math.floor((budget - fixed) / per_row))}
