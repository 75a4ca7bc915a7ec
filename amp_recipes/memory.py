"""Gradient checkpointing, the memory lever beside mixed precision.

Mixed precision shrinks what each activation costs; gradient (activation) checkpointing keeps
fewer of them: each encoder layer's activations are dropped after the forward and recomputed
from the layer's input during the backward. The step costs about one more forward pass (a third
more compute for an encoder); the activation memory falls roughly by the number of layers.
`scripts/benchmark_precision.py --arms fp16,fp16+gradient_checkpointing` measures both on your
device.

And what the batch-size searches (the doctor's, the benchmark's) share: what counts as "does not
fit", the bisection, and the budget of a smaller card emulated on a CUDA GPU."""


def enable_gradient_checkpointing(model) -> None:
    """Checkpoint every layer, with torch's non-reentrant checkpoint (it works with autocast,
    torch.compile, FSDP2 and frozen inputs, and keeps dropout's random state for the recompute).

    transformers renamed the call (`activation_checkpointing_enable`, 5.2x; the old
    `gradient_checkpointing_enable` warns there and goes in v6): the new name where it exists."""
    kwargs = {"use_reentrant": False}
    # An encoder keeps no cache; said here, transformers does not warn that it turns use_cache off.
    model.config.use_cache = False
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def gradient_checkpointing_on(model) -> bool:
    """Whether the model checkpoints its layers (read from the model, under either name)."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


# What CUDA and cuBLAS say when the driver, not PyTorch's allocator, runs out of memory (a kernel
# loaded on first use, a library handle): torch raises them as RuntimeErrors whose message
# accelerate's should_reduce_batch_size does not read ("CUDA error: out of memory" has no period).
DRIVER_OUT_OF_MEMORY = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def is_out_of_memory(error: BaseException) -> bool:
    """A trial that does not fit: torch's OutOfMemoryError, what accelerate's
    find_executable_batch_size also reads as one (a raw CUDA allocation failure in a library's
    kernel is a RuntimeError whose message says " out of memory."), or the driver's own."""
    import torch
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


# Kept free on the card under a CUDA budget: what CUDA allocates outside PyTorch's allocator as a
# trial runs (kernels loaded on first use, cuBLAS workspaces, library handles). With it, a trial too
# large fails in the allocator (OutOfMemoryError: "does not fit"), not in the driver. A choice, not
# a measure.
CUDA_RESERVE = 2**30


def cuda_index(device) -> int:
    """The CUDA device's index: accelerate's single-process device is an index-less
    torch.device("cuda"), which torch.cuda.set_per_process_memory_fraction refuses ("Expected a
    torch.device with a specified index")."""
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_budget(device, budget_bytes: int | None) -> dict:
    """A card of `budget_bytes` (None: this card) emulated on this CUDA GPU. The caching allocator,
    which torch.cuda.set_per_process_memory_fraction caps, may hold the budget less what lives
    outside it now (the card's memory in use that the allocator does not hold: the CUDA context,
    libraries' handles, other processes) less CUDA_RESERVE: capped at the whole budget, a trial
    could use more of the card than the budget. Returns the figures the reports state."""
    import torch

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
