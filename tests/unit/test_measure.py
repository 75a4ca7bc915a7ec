"""The measurement engine (amp_recipes.measure.engine) that the doctor and the benchmark measure with:
its batch-size search on a GPU (the device's memory calls faked: this machine has none), its CPU
search and prediction, its timed steps and what it counts as "does not fit"."""

import math

import pytest
import torch

from amp_recipes.measure import engine
from amp_recipes.measure.engine import CUDA_RESERVE


class Clock:
    """time.monotonic as the engine reads it, moved by the trials."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(engine.time, "monotonic", lambda: self.now)


def test_a_predicted_largest_batch_is_the_line_through_two_measured_peaks():
    """On a CPU: the peaks at the user's batch and at twice it fix the line; the largest batch is
    the last that stays within the budget. A peak that did not grow predicts nothing."""
    peaks = {16: 1_000 + 16 * 40, 32: 1_000 + 32 * 40}
    found = engine.largest_batch(peaks.__getitem__, torch.device("cpu"), 5_000, 16, math.inf)
    assert (found["fixed_bytes"], found["bytes_per_row"]) == (1_000, 40)
    assert found["max_batch_size"] == 100  # 1000 + 100 * 40 = 5000
    flat = engine.largest_batch(lambda size: 1_000, torch.device("cpu"), 5_000, 16, math.inf)
    assert flat["max_batch_size"] is None and "did not grow" in flat["why"]
    measured = []

    def near_the_budget(size):
        measured.append(size)
        return 3_000

    near = engine.largest_batch(near_the_budget, torch.device("cpu"), 5_000, 16, math.inf)
    assert near["max_batch_size"] is None and measured == [16]  # twice the batch is not tried


class FakeGpu:
    """torch.cuda's memory calls as a GPU of `total` bytes answers them: the seam is the device
    (this machine has none); the search, its budget and its errors are the doctor's own."""

    def __init__(self, monkeypatch, total=80 * 2**30, fraction=0.9):
        self.total, self.fractions = total, [fraction]
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: self)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: self.fractions[-1])
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set_fraction)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * 2**30, total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 * 2**30)

    @property
    def total_memory(self):
        return self.total

    def set_fraction(self, fraction, index):
        assert index == 0
        self.fractions.append(fraction)


def test_a_gpu_search_tries_batches_under_the_budgets_memory_fraction(monkeypatch):
    """On a GPU: batches doubled, then bisected to a multiple of 8, under
    set_per_process_memory_fraction: the allocator may hold the budget (by default the card) less
    what lives outside it (the card's memory in use that the allocator does not hold: 80 GiB less
    30 free, less this process's 2) less the reserve; an out-of-memory error (the allocator's, or
    the driver's) means "does not fit"; the fraction set before is restored, after an error too."""
    gpu = FakeGpu(monkeypatch)
    cuda = torch.device("cuda")
    budget = engine.memory_budget(cuda, None)
    assert budget == gpu.total  # the card
    assert engine.memory_budget(cuda, 16) == 16 * 2**30  # --memory_budget_gb
    outside = (80 - 30 - 2) * 2**30
    allocator = budget - outside - CUDA_RESERVE  # = free + this process's, less the reserve
    assert allocator == 30 * 2**30 + 2 * 2**30 - CUDA_RESERVE
    tried, fractions_seen = [], []

    def peak_at(size):
        tried.append(size)
        fractions_seen.append(gpu.fractions[-1])
        if size > 300:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if size == 296:
            raise RuntimeError(
                "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"
            )
        return size

    found = engine.largest_batch(peak_at, cuda, budget, 16, math.inf)
    assert (
        found["method"] == "searched"
        and found["max_batch_size"] == 288
        and [t["batch_size"] for t in found["trials"]] == tried
    )
    assert tried[:10] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] and tried[10:] == [384, 320, 288, 304, 296]
    assert set(fractions_seen) == {allocator / gpu.total} and gpu.fractions[-1] == 0.9
    assert (found["budget_bytes"], found["outside_allocator_bytes"]) == (budget, outside)
    assert (found["allocator_cap_bytes"], found["reserve_bytes"]) == (allocator, CUDA_RESERVE)
    # A smaller card: the allocator's cap is that budget less the same outside and reserve.
    fractions_seen.clear()
    smaller = engine.largest_batch(peak_at, cuda, 64 * 2**30, 16, math.inf)
    assert set(fractions_seen) == {(64 * 2**30 - outside - CUDA_RESERVE) / gpu.total}
    assert smaller["budget_bytes"] == 64 * 2**30
    # The deadline ends the search: no trial starts that would end past it (judged by the longest
    # so far); what fit is a lower bound (the doctor's "N+", the benchmark's "≥N").
    clock = Clock(monkeypatch)

    def ten_seconds(size):
        clock.now += 10
        return size

    cut = engine.largest_batch(ten_seconds, cuda, budget, 16, deadline=35)
    assert [t["batch_size"] for t in cut["trials"]] == [1, 2, 4]  # a fourth would end at 40
    assert (cut["max_batch_size"], cut["capped_at_search_max"], cut["search_stopped"]) == (
        4,
        True,
        "out of time",
    )
    assert gpu.fractions[-1] == 0.9

    # Any other error is the user's to see, and the fraction is restored before it propagates.
    def broken(size):
        raise RuntimeError("expected scalar type Half but found Float")

    with pytest.raises(RuntimeError, match="expected scalar type"):
        engine.largest_batch(broken, cuda, budget, 16, 10**9)
    assert gpu.fractions[-1] == 0.9

    # A lower cap set before (a call, PYTORCH_CUDA_ALLOC_CONF) is never raised: it is the limit.
    gpu.fractions.append(0.2)
    fractions_seen.clear()
    capped = engine.largest_batch(peak_at, cuda, budget, 16, 10**9)
    assert set(fractions_seen) == {0.2} and gpu.fractions[-1] == 0.2
    assert capped["allocator_cap_bytes"] == int(0.2 * gpu.total)


def test_the_search_doubles_then_bisects_to_the_granularity():
    """Trials that fit up to 700 rows: doubling from 64 to the first failure (1024), then halving
    the gap down to the granularity (32); a maximum reached first is a lower bound."""
    tried = []

    def fits(size):
        tried.append(size)
        return size <= 700

    assert engine.largest_fitting(fits, 64, 4096, 32) == (672, 704)
    assert tried == [64, 128, 256, 512, 1024, 768, 640, 704, 672]
    assert engine.largest_fitting(lambda size: True, 64, 256) == (256, None)
    assert engine.largest_fitting(lambda size: False, 64, 256) == (0, 64)


def test_a_cpu_search_measures_under_a_given_budget():
    """On a CPU with a budget given (the benchmark's --memory_budget_gb): searched, a peak over the
    budget is "does not fit", every trial recorded and reported as it ends."""
    seen = []
    found = engine.largest_batch(
        lambda size: 1_000 + 10 * size,
        torch.device("cpu"),
        5_000,
        8,
        start=64,
        granularity=32,
        search_on_cpu=True,
        on_trial=seen.append,
    )
    assert found["method"] == "searched" and found["budget_bytes"] == 5_000
    assert (found["max_batch_size"], found["first_batch_not_fitting"]) == (384, 416)  # 1000 + 3840 <= 5000
    assert seen == found["trials"] and [t["batch_size"] for t in seen] == [64, 128, 256, 512, 384, 448, 416]
    assert [t["failure"] for t in seen if not t["fits"]] == ["over the memory budget"] * 3


def test_what_reads_as_out_of_memory():
    """torch's error, what accelerate's find_executable_batch_size reads as one, and the driver's own
    (a kernel loaded, a cuBLAS handle made), which accelerate does not read; nothing else."""
    assert engine.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert engine.is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert engine.is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    assert engine.is_out_of_memory(
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    )
    assert not engine.is_out_of_memory(RuntimeError("expected scalar type Half but found Float"))


def test_the_cap_gets_a_cuda_index_torch_accepts(monkeypatch):
    """accelerate's single-process device is torch.device("cuda") without an index, which
    torch.cuda.set_per_process_memory_fraction refuses; the engine passes the index."""
    from torch.cuda._utils import _get_device_index

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        _get_device_index(torch.device("cuda"), optional=False)  # what torch does with the bare device
    assert _get_device_index(engine.cuda_index(torch.device("cuda")), optional=False) == 0
    assert engine.cuda_index(torch.device("cuda", 3)) == 3


def test_timed_steps_leave_out_the_warmup_and_keep_the_first_apart(monkeypatch):
    """Each step between two synchronizations; the warm-up's steps untimed; the first step's time
    (a compilation) kept apart; the losses read after the clock."""
    clock = iter(range(0, 100))
    monkeypatch.setattr(engine.time, "perf_counter", lambda: next(clock) ** 2)  # steps of growing length
    synchronized = []
    monkeypatch.setattr(engine, "synchronize", synchronized.append)
    timed = engine.time_steps(lambda batch: torch.tensor(float(batch)), [5, 6, 7], torch.device("cpu"), 1)
    assert timed["first_step_seconds"] == 1  # 1**2 - 0**2
    assert timed["step_seconds"] == [9 - 4, 25 - 16] and timed["losses"] == [6.0, 7.0]
    assert len(synchronized) == 6


def test_a_prediction_whose_batch_runs_out_of_memory_says_so():
    """On a CPU, an out-of-memory error at the user's batch (or at twice it) ends the prediction
    with what fit, not a line through a missing peak."""

    def out_of_memory_from(limit):
        def peak_at(size):
            if size >= limit:
                raise RuntimeError(
                    "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes."
                )
            return 1_000 + size

        return peak_at

    cpu = torch.device("cpu")
    at_your_batch = engine.largest_batch(out_of_memory_from(16), cpu, 10**9, 16)
    assert (at_your_batch["max_batch_size"], at_your_batch["why"]) == (0, "your batch ran out of memory")
    at_twice = engine.largest_batch(out_of_memory_from(32), cpu, 10**9, 16)
    assert (at_twice["max_batch_size"], at_twice["why"]) == (16, "twice your batch ran out of memory")


def test_a_budget_below_what_lives_outside_the_allocator_says_so(monkeypatch):
    """A card whose budget the CUDA context and the reserve already take: no trial, a reason."""
    FakeGpu(monkeypatch)
    tried = []
    found = engine.largest_batch(tried.append, torch.device("cuda"), 2**30, 16)
    assert found["max_batch_size"] is None and "no larger than what lives outside" in found["why"]
    assert tried == [] and found["allocator_cap_bytes"] == 0
