"""The step's figures: loss scale, skipped steps, gradient norm, non-finite losses, activations, throughput.

accelerate owns the GradScaler; this module only watches it. Three things it adds:

- `StepTelemetry.after_optimizer_step()` tells whether the last optimizer step was skipped for *any*
  optimizer. accelerate's `optimizer.step_was_skipped` infers a skip from "the scaler did not call
  optimizer.step", but GradScaler always calls a fused optimizer (which skips internally on
  found_inf), so with fused AdamW accelerate misses the skip and its scheduler steps anyway.
  The scale itself cannot lie: `GradScaler.update()` multiplies it by `backoff_factor` (< 1)
  exactly when it found inf/NaN gradients.
- `NonFiniteLocator` names the first module whose forward output or gradient was not finite.
- `ActivationMonitor` samples, per module, the largest absolute activation relative to the
  fp16 maximum (65504): which layer is close to overflowing, even in an fp32 run.

And the step's throughput: `ThroughputMeter` counts samples, tokens and padding.

Everything lives on the device between logging steps; the host reads it once per log line.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from amp_recipes.errors import TrainingDiverged

FP16_MAX = torch.finfo(torch.float16).max  # 65504
# 16 halvings take GradScaler's default initial scale (2**16) to 1, i.e. no scaling at all; four
# more leave a margin for a noisy start. Gradients that still overflow after that are not a
# loss-scale problem: something in the forward or backward is non-finite at any scale.
DEFAULT_MAX_CONSECUTIVE_SKIPPED = 20


def _tensors(value):
    """Floating-point tensors in a module's output (tensor, tuple/list, dict or ModelOutput)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class NonFiniteLocator:
    """Context manager that records, for one forward + backward, which module first produced a
    non-finite output (forward, in completion order: the innermost module where it appeared) or
    a non-finite gradient at its output (backward, in backward order: the one nearest the loss).

    Checks are device tensors read once in `first()`, not a sync per module.
    """

    def __init__(self, model: torch.nn.Module):
        self.modules = [(name, module) for name, module in model.named_modules() if name]
        self.forward: list[tuple[str, torch.Tensor]] = []
        self.backward: list[tuple[str, torch.Tensor]] = []
        self._handles = []

    def _forward_hook(self, name):
        def hook(module, inputs, output):
            for tensor in _tensors(output):
                self.forward.append((name, ~torch.isfinite(tensor.detach()).all()))
                if tensor.requires_grad:
                    tensor.register_hook(
                        lambda grad: self.backward.append((name, ~torch.isfinite(grad).all()))
                    )

        return hook

    def __enter__(self):
        self.forward, self.backward = [], []
        self._handles = [
            module.register_forward_hook(self._forward_hook(name)) for name, module in self.modules
        ]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @staticmethod
    def _first(flags):
        if not flags:
            return None
        bad = torch.stack([flag for _, flag in flags]).tolist()  # one host copy for all
        return next((flags[i][0] for i, is_bad in enumerate(bad) if is_bad), None)

    def first(self) -> str | None:
        """'forward output of <module>' or 'gradient at the output of <module>', else None."""
        name = self._first(self.forward)
        if name is not None:
            return f"forward output of {name}"
        name = self._first(self.backward)
        return None if name is None else f"gradient at the output of {name}"


def locate_nonfinite(accelerator, model, batch, loss_scale: float | None) -> str:
    """Replay one batch with every module watched and say where it first became non-finite.

    Used after a skipped fp16 step: costs one extra forward/backward, only on skipped steps. It
    only looks: its gradients are discarded and its dropout draws from a copy of the random state,
    so the run trains on exactly as it would have without the replay.

    Under torch.compile the batch is replayed on the eager model (accelerate keeps it beside the
    compiled regions, with the same parameters and autocast): module hooks do not fire inside a
    compiled region (dynamo skips hook guards), so the compiled model would name no module.

    The replay leaves no gradient behind on any engine. Under DDP its backward runs in `no_sync`
    (no all-reduce) and zero_grad clears what it left. Not under FSDP2: there `no_sync` keeps the
    unsharded gradients on FSDP's own parameters, out of zero_grad's reach, and the next step's
    reduce-scatter would add them in; so the replay reduces as a training step does (every rank
    replays: the skip was decided on gradients every rank shares) and zero_grad clears the shards."""
    eager = accelerator.unwrap_model(model, keep_torch_compile=False)
    replayed = eager if eager is not accelerator.unwrap_model(model) else model
    unsynced = contextlib.nullcontext() if accelerator.is_fsdp2 else accelerator.no_sync(model)
    # fork_rng: the replay's dropout draws from a copy of the random state, so training goes on
    # with the same random stream as a run that did not replay.
    cuda_devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices), NonFiniteLocator(eager) as locator, unsynced:
        with accelerator.autocast():  # as the training step's forward (FSDP2 included)
            loss = replayed(**batch).loss
        (loss * (loss_scale or 1.0)).backward()
    model.zero_grad(set_to_none=True)
    where = locator.first()
    return where or "no module (the overflow did not reproduce on the replayed batch)"


class StepTelemetry:
    """Per-run counters for the loss, the fp16 loss scale, skipped steps and the gradient norm,
    and the guard that stops a run whose loss or gradients are no longer finite.

    In the loop: `with watch():` around the step, `after_optimizer_step()` after
    `optimizer.step()`, `observe(loss, grad_norm)` every micro-batch (device only), `read()` at
    logging steps (one host sync), `check_finite(step)` before anything is saved, `summary()` at
    the end. It computes and counts; the recipe decides what to log, save and stop.
    """

    def __init__(self, accelerator, model, max_consecutive_skipped: int, diagnose_every_step=False):
        self.accelerator, self.model = accelerator, model
        self.scaler = accelerator.scaler  # None unless accelerate runs fp16 with torch AMP
        self.max_consecutive_skipped = max_consecutive_skipped
        # Over the whole run, a resume included (saved in the checkpoint via state_dict).
        self.skipped_steps = 0
        self.optimizer_steps = 0  # attempted, skipped ones included
        self.consecutive_skipped = 0
        self.scale_used = None
        # One sync at start-up; afterwards the scale is read on the host once per optimizer step
        # (fp16 only): the one host sync per step the recipes make. A foreach optimizer already
        # forces it (the GradScaler reads found_inf to decide whether to step); a fused one does not
        # (it skips inside the kernel), so with fused AdamW this read is an extra sync per step.
        self.loss_scale = self.scaler.get_scale() if self.scaler is not None else None
        self.locator = (
            NonFiniteLocator(accelerator.unwrap_model(model, keep_torch_compile=False))
            if diagnose_every_step
            else None
        )
        device = accelerator.device
        self._loss_sum = torch.zeros((), device=device)
        self._finite_batches = torch.zeros((), device=device, dtype=torch.long)
        self._nonfinite_batches = torch.zeros((), device=device, dtype=torch.long)
        self._grad_norm = None
        self.nonfinite_losses = 0
        self._checked_step = 0

    @property
    def fp16(self) -> bool:
        return self.scaler is not None

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = state.get("skipped_steps", 0)
        self.optimizer_steps = state.get("optimizer_steps", 0)

    def watch(self):
        """Context for one training step: every module watched with --diagnose_overflow, else nothing."""
        return self.locator if self.locator is not None else contextlib.nullcontext()

    def observe(self, loss: torch.Tensor, grad_norm=None) -> None:
        loss = loss.detach().float()
        finite = torch.isfinite(loss)
        self._loss_sum += torch.where(finite, loss, torch.zeros_like(loss))
        self._finite_batches += finite
        self._nonfinite_batches += ~finite
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.detach()
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2: the global norm, as a plain tensor
                grad_norm = grad_norm.full_tensor()
        if grad_norm is not None:
            self._grad_norm = grad_norm

    def after_optimizer_step(self) -> bool:
        """Count the optimizer step that just ran (on a gradient-synchronising micro-batch) and
        return whether the GradScaler skipped it. Always False without fp16: bf16/fp32 never skip."""
        if not self.accelerator.sync_gradients:
            return False
        self.optimizer_steps += 1
        if self.scaler is None:
            return False
        self.scale_used, self.loss_scale = self.loss_scale, self.scaler.get_scale()
        skipped = self.loss_scale < self.scale_used or self.loss_scale == 0
        if skipped:
            self.skipped_steps += 1
            self.consecutive_skipped += 1
        else:
            self.consecutive_skipped = 0
        return skipped

    def first_nonfinite(self, batch) -> str | None:
        """The first non-finite module output or gradient of the last step: from the watched step
        with --diagnose_overflow, else by replaying the batch (after a skipped fp16 step)."""
        if self.locator is not None:
            return self.locator.first()
        return locate_nonfinite(self.accelerator, self.model, batch, self.scale_used)

    def nonfinite_message(self, step: int, skipped: bool, nonfinite_at: str | None) -> str:
        """The warning for a skipped fp16 step, or (--diagnose_overflow) a step that went non-finite."""
        if not skipped:
            return f"step {step}: first non-finite value: {nonfinite_at}"
        return (
            f"step {step}: fp16 overflow, optimizer step skipped, loss scale {self.scale_used:g} -> "
            f"{self.loss_scale:g}; first non-finite value: {nonfinite_at}"
        )

    def too_many_skips(self) -> bool:
        """--max_consecutive_skipped_steps fp16 steps in a row were skipped: no loss scale helps."""
        return self.fp16 and self.consecutive_skipped >= self.max_consecutive_skipped

    def stop_message(self, step: int, nonfinite_at: str | None) -> str:
        return (
            f"Stopped at step {step}: {self.consecutive_skipped} consecutive fp16 steps were skipped "
            f"(gradients not finite even at loss scale {self.loss_scale:g})"
            + (f"; first non-finite value: {nonfinite_at}" if nonfinite_at else "")
            + ". Try a lower --fp16_init_scale, gradient clipping (--max_grad_norm 1.0), a lower "
            "--learning_rate, or --mixed_precision bf16 (the range of fp32)."
        )

    def check_finite(self, step: int, precision: str) -> None:
        """Under bf16/fp32 a non-finite loss is not skipped: the update has already spoiled the
        weights. Checked at logging steps and before every save (not every step: that would be a
        host sync per step), so a spoiled state is never saved; the run stops with what to try."""
        if self.fp16 or precision == "fp16":
            # fp16 skips such steps (torch's GradScaler, or DeepSpeed's own loss scaler, which the
            # telemetry does not see); consecutive GradScaler skips are guarded by too_many_skips().
            return
        unread = self._nonfinite_batches
        if self.accelerator.num_processes > 1:
            # Summed over the processes (every one calls this at the same steps), so that all of them
            # stop together: one that stopped alone would leave the others waiting in their next
            # collective until --ddp_timeout, and they would save the spoiled weights it saw first.
            unread = self.accelerator.reduce(unread.clone(), reduction="sum")
        if self.nonfinite_losses or unread.item():
            raise TrainingDiverged(
                f"The loss became non-finite under {precision} between steps {self._checked_step} and "
                f"{step}; the weights are spoiled, so nothing after step {self._checked_step} is saved. "
                "Resume from the newest checkpoint with a lower --learning_rate or --max_grad_norm 1.0; "
                "--diagnose_overflow names the module where it starts."
            )
        self._checked_step = step

    def read(self) -> dict:
        """Window values for a log line, then start a new window. One host sync."""
        values = [self._loss_sum, self._finite_batches.float(), self._nonfinite_batches.float()]
        if isinstance(self._grad_norm, torch.Tensor):
            values.append(self._grad_norm.float().reshape(()))
        stacked = torch.stack([value.to(values[0].device) for value in values])
        if (
            self.accelerator.num_processes > 1
        ):  # loss and counts over all processes (the norm is global already)
            stacked[:3] = self.accelerator.reduce(stacked[:3].contiguous(), reduction="sum")
        read = stacked.tolist()
        loss_sum, finite, nonfinite = read[:3]
        logs = {"loss": loss_sum / finite if finite else math.nan}
        if len(read) > 3:
            logs["grad_norm"] = read[3]
        elif self._grad_norm is not None:
            logs["grad_norm"] = float(self._grad_norm)
        self.nonfinite_losses += int(nonfinite)
        logs.update(self.scale_record())
        self._loss_sum.zero_()
        self._finite_batches.zero_()
        self._nonfinite_batches.zero_()
        return logs

    def scale_record(self) -> dict:
        if not self.fp16:
            return {}
        return {
            "loss_scale": self.loss_scale,
            "skipped_steps": self.skipped_steps,
            "skipped_step_rate": self.skipped_steps / max(self.optimizer_steps, 1),
            "effective_optimizer_steps": self.optimizer_steps - self.skipped_steps,
        }

    def summary(self) -> dict:
        return {**self.scale_record(), "nonfinite_losses": self.nonfinite_losses}


class ActivationMonitor:
    """Samples one training forward in `every` and records, per leaf module, the largest absolute
    output relative to the fp16 maximum. Hooks exist only during sampled forwards (a root
    pre-hook attaches them, a root post-hook removes them), so other steps pay one Python call."""

    def __init__(self, model: torch.nn.Module, every: int):
        self.model, self.every = model, every
        self.forwards = 0
        self.maxima: dict[str, torch.Tensor] = {}
        self._leaf_handles = []
        self._root_handles = []
        if every > 0:
            self._root_handles = [
                model.register_forward_pre_hook(self._start),
                model.register_forward_hook(self._stop),
            ]

    def _record(self, name):
        def hook(module, inputs, output):
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                # max |x| = max(|min|, |max|): two scalars, not abs()'s full-size copy of every
                # module's output, which raised the peak memory of each sampled step.
                low, high = torch.aminmax(output.detach())
                peak = torch.maximum(low.abs(), high.abs()).float()
                previous = self.maxima.get(name)
                self.maxima[name] = peak if previous is None else torch.maximum(previous, peak)

        return hook

    def _start(self, module, inputs):
        if not module.training:
            return
        self.forwards += 1
        if (self.forwards - 1) % self.every:
            return
        for name, leaf in module.named_modules():
            if name and not any(True for _ in leaf.children()) and not isinstance(leaf, torch.nn.Dropout):
                self._leaf_handles.append(leaf.register_forward_hook(self._record(name)))

    def _stop(self, module, inputs, output):
        for handle in self._leaf_handles:
            handle.remove()
        self._leaf_handles = []

    def remove(self) -> None:
        self._stop(None, None, None)
        for handle in self._root_handles:
            handle.remove()

    def read(self, top: int = 5) -> dict:
        """{module: max |activation| / 65504} for the `top` modules closest to fp16 overflow."""
        if not self.maxima:
            return {}
        names = list(self.maxima)
        # Stacked on the device, then one host copy (not one per module: ~200 for BERT-base).
        ratios = (torch.stack([self.maxima[n] for n in names]) / FP16_MAX).tolist()
        ranked = sorted(zip(names, ratios, strict=True), key=lambda item: -item[1])
        return dict(ranked[:top])


class ThroughputMeter:
    """Samples, tokens and padding over a window of training steps (`read` at each log line), and
    over the whole run (`run_rates`, the sum of the windows). The non-padding tokens are counted on
    the device and read only at a log line: an `.item()` every step would make the host wait for
    the device, and stall the asynchronous pipeline mixed precision relies on."""

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
