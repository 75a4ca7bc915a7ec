"""The precision doctor: which precision to train in, and which batch fits, read from a few
minutes on your own model and data, before the fine-tune.

    amp-recipes doctor --recipe bert_glue -- --task_name mrpc --model_name_or_path bert-base-uncased

The recipe's own code loads your data and model (its flags go after `--`, as you would pass them
to the recipe: bert_glue, bert_ner, bert_qa or bert_mlm); the doctor then

- trains `--probe_steps` fp32 steps with a forward hook on every leaf module and a gradient hook
  on its output: each module's largest |activation| against fp16's largest value (65504), and
  each module's activation gradients as a histogram of their binary exponents, from which follows
  the share fp16 would round to zero at any loss scale (below 2**-25, half of fp16's smallest
  subnormal 2**-24), and the loss scale the GradScaler would settle at: the largest power of two
  that keeps the largest scaled gradient (activations' and parameters') under 65504;
- times a few training steps and reads the peak memory in fp32 and in each reduced precision the
  device runs (bf16 where it has it, native or emulated; fp16 on a CUDA GPU), with torch's
  autocast as accelerate's prepare() applies it, on the recipe's batches padded as a run in that
  precision pads them (multiples of 8 for fp16/bf16);
- finds the largest batch that fits what a run could hold (or `--memory_budget_gb`) with every row
  at --max_seq_length tokens, the longest a batch of the run can be: on a GPU by trying batches
  under torch.cuda.set_per_process_memory_fraction, on a CPU by a line through two measured
  batches (the peak grows by the same activations per row);
- where the device has fp8, the share of the forward matmul FLOPs in the Linear layers accelerate
  would run in fp8;
- writes doctor.json and doctor.md (`--report_dir`): the figures and a recommendation per
  precision, each with its reason; with the recipe's `--report_to wandb` (or tensorboard), the same
  figures as a tracker run.

Peak memory is read as the recipe reports it: on a GPU the allocator's peak, on a CPU the
process's peak resident set (less the doctor's own copy of the weights, which a run does not hold).

The probe runs in fp32 and watches modules: an estimate of what fp16 meets on the same batches,
not a bound. fp16's rounding moves the values a little; operations that are not modules
(attention's matmuls inside scaled_dot_product_attention, functional calls) are not watched; the
gradients of the modules autocast keeps in fp32 (layer norm, embeddings) count towards the
largest gradient though they cannot overflow, which makes the settled scale a conservative one.
A value overflows fp16 from 65520 on (65504 is its largest, and what lies between rounds to it).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import itertools
import math
import time
from pathlib import Path

import torch

from amp_recipes.amp.precision import MIXED_PRECISION
from amp_recipes.errors import InputError
from amp_recipes.measure import report as reports
from amp_recipes.tasks.batches import pad_multiple

FP16_MAX = 65504.0  # fp16's largest value
OVERFLOW = 65520.0  # from here a value rounds to inf in fp16
ZERO_EXPONENT = -25  # |x| < 2**-25 rounds to 0 in fp16 (2**-24 is its smallest subnormal)
OFFSET, BINS = 160, 320  # frexp exponents of float32 values lie in [-148, 129]


# ----------------------------------------------------------------------------- the fp32 probe
class GradientProbe:
    """Forward hooks on every leaf module (dropout aside) record the largest |output| and the step
    it came at; a hook on that output records its gradient's largest magnitude and the histogram
    of its nonzero elements' binary exponents. After each backward, `end_step` adds the largest
    parameter gradient (the weights' fp16 copies get gradients of that size under autocast)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.step = model, 0
        # module -> (max |activation|, its step), in the order the modules first ran
        self.activation_max: dict[str, tuple[float, int]] = {}
        self.gradient_max: dict[str, float] = {}
        self.exponents: dict[str, torch.Tensor] = {}  # module -> counts of frexp exponents + OFFSET
        self.step_gradient_max: list[float] = []  # per step: the largest gradient anywhere
        self._this_step = 0.0
        self._handles = [
            module.register_forward_hook(self._forward(name))
            for name, module in model.named_modules()
            if name and not any(True for _ in module.children())  # dropout too: it scales by 1 / (1 - p)
        ]

    def _forward(self, name):
        def hook(module, inputs, output):
            if not (isinstance(output, torch.Tensor) and output.is_floating_point()):
                return
            peak = output.detach().abs().max().item()
            if peak > self.activation_max.get(name, (-1.0, 0))[0]:
                self.activation_max[name] = (peak, self.step + 1)
            if output.requires_grad:
                output.register_hook(self._backward(name))

        return hook

    def _backward(self, name):
        def hook(grad):
            grad = grad.detach().float()
            peak = grad.abs().max().item()
            self.gradient_max[name] = max(self.gradient_max.get(name, 0.0), peak)
            self._this_step = max(self._this_step, peak)
            exponents = torch.frexp(grad[grad != 0]).exponent.long() + OFFSET
            counts = torch.bincount(exponents, minlength=BINS).cpu()
            self.exponents[name] = self.exponents.get(name, 0) + counts

        return hook

    def end_step(self) -> None:
        """After the backward: the largest parameter gradient joins the step's largest gradient."""
        grads = [p.grad.detach().abs().max() for p in self.model.parameters() if p.grad is not None]
        if grads:
            self._this_step = max(self._this_step, torch.stack(grads).max().item())
        self.step_gradient_max.append(self._this_step)
        self._this_step, self.step = 0.0, self.step + 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def zero_share(counts: torch.Tensor, scale: float) -> float:
    """The share of nonzero gradients that fp16 rounds to zero once multiplied by `scale` (a power
    of two, as the GradScaler's are with its default initial scale; another is rounded down to
    one, which counts more). With |g| = m * 2**e, m in [0.5, 1): |g| * 2**s < 2**-25 exactly when
    e <= -25 - s (a value of exactly 2**-25, which rounds to zero too, is not counted)."""
    total = int(counts.sum())
    if not total:
        return 0.0
    last = ZERO_EXPONENT - math.floor(math.log2(scale)) + OFFSET  # the largest exponent that underflows
    return int(counts[: max(0, min(BINS, last + 1))].sum()) / total


def settled_scale(largest_gradient: float, init_scale: float, growth_factor: float = 2.0) -> float:
    """The largest scale the GradScaler can hold (its initial scale times a power of its growth
    factor, the back-off being its inverse by default) that keeps `largest_gradient` times it
    below fp16's overflow."""
    if largest_gradient <= 0 or not math.isfinite(largest_gradient):
        return math.nan
    room = OVERFLOW / (largest_gradient * init_scale)  # how far the initial scale may grow (or must shrink)
    return init_scale * growth_factor ** (math.ceil(math.log(room, growth_factor)) - 1)


def initial_skips(largest_gradient: float, init_scale: float, backoff_factor: float = 0.5) -> int | None:
    """Steps skipped at the start: each overflow multiplies the scale by the back-off factor until
    the largest gradient times it stays below fp16's overflow."""
    if largest_gradient <= 0 or not math.isfinite(largest_gradient):
        return None
    room = OVERFLOW / (largest_gradient * init_scale)
    return 0 if room > 1 else math.floor(math.log(room) / math.log(backoff_factor)) + 1


def fp16_risk(probe: GradientProbe, scaler: dict, top: int = 5) -> dict:
    """What fp16 would meet, from the fp32 probe: the modules whose activations overflow, the
    largest gradient and the loss scale it settles at, the skipped steps that costs, and the share
    of each module's activation gradients rounded to zero at the initial and the settled scale.
    `scaler`: the GradScaler's init_scale, growth_factor, backoff_factor and growth_interval."""
    init_scale = scaler["init_scale"]
    # In forward order (the order the modules first ran): the first is where the overflow starts,
    # the others (the dropout after it, ...) carry it on.
    overflow = [(name, peak, step) for name, (peak, step) in probe.activation_max.items() if peak >= OVERFLOW]
    largest = max(probe.step_gradient_max, default=0.0)
    settled = settled_scale(largest, init_scale, scaler["growth_factor"])
    # After the initial back-off, at most one step in growth_interval + 1 is skipped: the scaler's
    # try of a grown scale.

    def shares(scale):
        ranked = sorted(((n, zero_share(c, scale)) for n, c in probe.exponents.items()), key=lambda x: -x[1])
        return dict(ranked[:top])

    nearest = sorted(probe.activation_max.items(), key=lambda item: -item[1][0])[:top]
    return {
        "overflowing_modules": [{"module": n, "max_abs_activation": p, "step": s} for n, p, s in overflow],
        "largest_activation_ratio": {name: peak / FP16_MAX for name, (peak, _) in nearest},
        "largest_gradient": largest,
        "initial_loss_scale": init_scale,
        "settled_loss_scale": settled,
        "initial_skipped_steps": initial_skips(largest, init_scale, scaler["backoff_factor"]),
        "skipped_step_rate_after": 1 / (scaler["growth_interval"] + 1),
        "zero_share_at_initial_scale": shares(init_scale),
        "zero_share_at_settled_scale": shares(settled) if math.isfinite(settled) else {},
    }


# ----------------------------------------------------------------------------- the batches
class RecipeRows:
    """The recipe's first training batches, as rows: its own DataLoader picks them (its sampler,
    seeded as the recipe seeds it, in its order), and a copy of its own collator pads them as a run
    in each precision pads (amp_recipes.tasks.batches.pad_multiple: multiples of 8 for fp16 and bf16)."""

    def __init__(self, dataloader, steps: int, max_length: int):
        self.collator, self.max_length = dataloader.collate_fn, max_length
        dataloader.collate_fn = list  # the loader's batches as they come, before the collator pads them
        self.rows = list(itertools.islice(dataloader, steps))

    def _collate(self, rows: list[dict], multiple: int | None) -> dict:
        collator = copy.copy(self.collator)
        collator.pad_to_multiple_of = multiple
        return dict(collator(rows))

    def batches(self, precision: str) -> list[dict]:
        """The first batches as a run in `precision` collates them."""
        return [self._collate(rows, pad_multiple(MIXED_PRECISION[precision])) for rows in self.rows]

    def longest(self, size: int, precision: str) -> dict:
        """A batch of `size` rows (the first batches' rows, repeated as needed), every one padded to
        --max_seq_length (up to the precision's multiple): the longest a batch of the run can be,
        since the recipes cut rows there. What a batch size must fit."""
        rows = list(itertools.islice(itertools.cycle(itertools.chain(*self.rows)), size))
        multiple = pad_multiple(MIXED_PRECISION[precision]) or 1
        return self._collate(rows, -(-self.max_length // multiple) * multiple)


# ----------------------------------------------------------------------------- speed and memory
def precisions_to_time(device: torch.device) -> dict[str, torch.dtype | None]:
    """fp32, and the reduced precisions autocast runs on this device: bf16 (native or emulated),
    fp16 on a CUDA GPU (accelerate runs fp16 as fp32 on a CPU)."""
    candidates = {"fp32": None, "bf16": torch.bfloat16}
    if device.type == "cuda":
        candidates["fp16"] = torch.float16
    return candidates


def allocate_optimizer_states(optimizer: torch.optim.Optimizer) -> None:
    """Have the optimizer allocate its states (AdamW's two moments) now, as a run's first step
    does: one step on zero gradients at a learning rate of 0, which moves no weight. Without it, a
    timed fp16 step the GradScaler skips (an overflow) never steps a foreach AdamW
    (--optim adamw_torch), and the peak memory would leave its states out; the fused AdamW steps
    anyway (the GradScaler hands it the overflow flag). Every trainable parameter gets states,
    also one the loss never reaches (an unused pooler), which a run would not hold."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for parameter in group["params"]:
            if parameter.requires_grad:
                parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate


def time_steps(
    model,
    batches,
    device,
    dtype,
    optimizer_factory,
    steps: int,
    warmup: int = 2,
    checkpointing=False,
    scaler_settings: dict | None = None,
) -> dict:
    """Seconds per training step and the peak memory as a recipe run reports it (the weights,
    their gradients, the optimizer's states and the activations: on a GPU the allocator's peak; on
    a CPU the process's peak resident set, less the weights of the doctor's own model, which a
    run does not hold), autocast to `dtype` (None: fp32), fp16 through a GradScaler built with
    `scaler_settings` (torch.amp.GradScaler's keywords), on a copy of the model (the doctor's own
    model stays as it was). Timed by the measurement engine (amp_recipes.measure.engine)."""
    from amp_recipes.amp.memory import enable_gradient_checkpointing
    from amp_recipes.measure.engine import peak_memory_since_window, start_memory_window
    from amp_recipes.measure.engine import time_steps as timed_steps

    start_memory_window(device)
    own_weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model = copy.deepcopy(model).to(device).train()
    if checkpointing:  # --gradient_checkpointing, as the recipe would run it
        enable_gradient_checkpointing(model)
    optimizer = optimizer_factory(model)
    allocate_optimizer_states(optimizer)
    scaler = None
    if dtype == torch.float16:
        scaler = torch.amp.GradScaler(device.type, **(scaler_settings or {}))

    def step(batch):
        batch = {k: v.to(device) for k, v in batch.items()}
        autocast = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with autocast:
            loss = model(**batch).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    cycled = [batches[i % len(batches)] for i in range(warmup + steps)]
    seconds = timed_steps(step, cycled, device, warmup)["step_seconds"]
    peak = peak_memory_since_window(device) - (own_weights if device.type == "cpu" else 0)
    return {"step_time_s": sum(seconds) / steps, "peak_memory_bytes": peak}


# ----------------------------------------------------------------------------- fp8
def fp8_report(model, facts: dict, seq_len: int) -> dict:
    """Where the device runs fp8 (an NVIDIA GPU of compute capability 8.9 or newer, with torchao):
    the Linear layers accelerate would convert (its default filter: all but the first and the
    last, sizes multiples of 16) and their share of a forward pass's matmul FLOPs at `seq_len`
    tokens, as the recipes' fp8 layer report reads them after prepare()."""
    from accelerate.utils.ao import filter_linear_layers, find_first_last_linear_layers

    from amp_recipes.amp.precision import FP8_BACKENDS, FP8_CAPABILITY
    from amp_recipes.measure.engine import fp8_flop_share

    capability = facts.get("compute_capability")
    if facts["device_type"] != "cuda" or tuple(map(int, capability.split("."))) < FP8_CAPABILITY:
        return {"fp8_available": False, "why": "fp8 needs an NVIDIA GPU of compute capability 8.9 or newer"}
    if importlib.util.find_spec("torchao") is None:
        return {"fp8_available": False, "why": f"torchao is not installed: `{FP8_BACKENDS['ao'][1]}`"}
    first, last = find_first_last_linear_layers(model)
    linear = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    fp8 = [name for name, module in linear if filter_linear_layers(module, name, [first, last])]
    return {
        "fp8_available": True,
        "fp8_linear_layers": len(fp8),
        "linear_layers": len(linear),
        "fp8_flop_share": fp8_flop_share(model, fp8, seq_len),
        "fp8_flop_share_seq_len": seq_len,
    }


# ----------------------------------------------------------------------------- the verdict
def recommend(risk: dict, speed: dict, bf16_native: bool, device: torch.device, steps: int) -> list[dict]:
    """One line per precision: advised or not, and why, in one sentence."""
    advice = []
    fp32 = speed.get("fp32")
    bf16 = speed.get("bf16")
    if bf16 and fp32:
        ratio = fp32["step_time_s"] / bf16["step_time_s"]
        memory = bf16["peak_memory_bytes"] / fp32["peak_memory_bytes"]
        native = "native" if bf16_native else "emulated"
        advised = ratio >= 1.0
        reason = (
            f"{native} here, {ratio:.2f}x fp32's speed and {memory:.2f}x its peak memory, no overflow risk "
            "(fp32's exponent range)"
        )
        advice.append({"precision": "bf16", "advised": advised, "reason": f"bf16: {reason}."})
    overflow = risk["overflowing_modules"]
    if overflow:
        worst = overflow[0]
        reason = (
            f"fp16 not advised: {worst['module']} reaches {worst['max_abs_activation']:.3g} at step "
            f"{worst['step']}, beyond fp16's 65504"
        )
        advice.append({"precision": "fp16", "advised": False, "reason": reason + "."})
    else:
        settled = risk["settled_loss_scale"]
        # The run starts at the initial scale and grows once per growth_interval steps: the worse of both.
        shares = [
            *risk["zero_share_at_initial_scale"].values(),
            *risk["zero_share_at_settled_scale"].values(),
        ]
        lost = max(shares, default=0.0)
        where = "on your GPU" if device.type != "cuda" else "here"
        reason = (
            f"fp16: no activation overflow in {steps} fp32 steps; the loss scale settles near "
            f"2**{int(math.log2(settled))} after {risk['initial_skipped_steps']} skipped steps"
            if math.isfinite(settled)
            else f"fp16: no activation overflow in {steps} fp32 steps"
        )
        if lost > 0.01:
            reason += f", though {lost:.1%} of one module's gradients round to zero"
        advice.append({"precision": "fp16", "advised": lost <= 0.01, "reason": f"{reason} ({where})."})
    return advice


def markdown(report: dict) -> str:
    """doctor.md: the recommendation first, then the figures behind it."""
    risk = report["fp16_risk"]
    lines = [f"# Precision doctor: {report['recipe']} on {report['device']}", "", "## Recommendation", ""]
    lines += [f"- {'yes' if a['advised'] else 'no'}: {a['reason']}" for a in report["recommendation"]]
    lines += ["", f"## Speed and memory at your batch ({report['per_device_train_batch_size']})", ""]
    rows = []
    for name, figures in report["speed"].items():
        largest = report["largest_batch"].get(name, {})
        fit = largest.get("max_batch_size")
        how = largest.get("method", "not measured yet (--budget_s ran out)")
        if fit is not None and (largest.get("capped_at_search_max") or largest.get("search_stopped")):
            fit = f"{fit}+"  # a lower bound: the search's cap fit too, or --budget_s stopped it
        elif largest.get("search_stopped"):
            how += ", cut by --budget_s"
        if largest.get("why"):
            how += f": {largest['why']}"
        time_s, peak = f"{figures['step_time_s']:.4f}", f"{figures['peak_memory_bytes'] / 2**20:.0f}"
        rows.append([name, time_s, peak, "—" if fit is None else fit, how])
    lines += reports.table(["precision", "s/step", "peak memory (MiB)", "largest batch", "how"], rows)
    if report["not_timed_for_budget"]:
        lines.append(f"\nNot timed (--budget_s ran out): {', '.join(report['not_timed_for_budget'])}.")
    card = next(iter(report["largest_batch"].values()), {})
    if card.get("budget_bytes"):
        lines.append(
            f"\nLargest batch: every row at --max_seq_length ({report['max_seq_length']} tokens), within "
            f"{card['budget_bytes'] / 2**30:.1f} GiB."
        )
        if "allocator_cap_bytes" in card:  # a GPU's: the card less what PyTorch's allocator does not hold
            lines[-1] += (
                f" PyTorch's allocator held at most {card['allocator_cap_bytes'] / 2**30:.1f} GiB of it: "
                f"{card['outside_allocator_bytes'] / 2**30:.1f} GiB lives outside it (the CUDA context, "
                f"other processes) and {card['reserve_bytes'] / 2**30:.0f} GiB is kept free for what "
                "CUDA adds there as a trial runs."
            )
    lines += ["", f"## fp16 risk, from {report['probe_steps']} fp32 steps", ""]
    nearest = next(iter(risk["largest_activation_ratio"].items()), None)
    if nearest:
        lines.append(f"- largest activation: {nearest[0]}, {nearest[1]:.3g} of fp16's 65504")
    lines.append(
        f"- largest gradient: {risk['largest_gradient']:.3g}; settled loss scale: {risk['settled_loss_scale']:g}"
    )
    for entry in risk["overflowing_modules"]:
        lines.append(
            f"- overflows: {entry['module']} ({entry['max_abs_activation']:.3g} at step {entry['step']})"
        )
    for title, key in (
        ("initial", "zero_share_at_initial_scale"),
        ("settled", "zero_share_at_settled_scale"),
    ):
        shares = ", ".join(f"{name} {share:.2%}" for name, share in risk[key].items())
        lines.append(f"- gradients rounded to zero at the {title} scale: {shares or 'none'}")
    fp8 = report["fp8"]
    lines += ["", "## fp8", ""]
    if fp8["fp8_available"]:
        share = fp8["fp8_flop_share"]
        flops = "FLOP share not computed" if share is None else f"{share:.1%} of the forward matmul FLOPs"
        lines.append(
            f"- {fp8['fp8_linear_layers']} of {fp8['linear_layers']} Linear layers would run in fp8 (torchao), "
            f"{flops} at {fp8['fp8_flop_share_seq_len']} tokens"
        )
    else:
        lines.append(f"- not on this device: {fp8['why']}")
    hardware = report["hardware"]
    versions = ", ".join(f"{name} {hardware[name]}" for name in ("torch", "transformers", "accelerate"))
    lines += ["", f"Device: {report['device']} ({hardware['device_type']}); {versions}"]
    return "\n".join(lines) + "\n"


def tracker_figures(report: dict) -> dict:
    """The report's figures, flat, for a tracker run's summary (W&B) or scalars (TensorBoard)."""
    risk = report["fp16_risk"]
    figures = {
        "recipe": report["recipe"],
        "per_device_train_batch_size": report["per_device_train_batch_size"],
        "fp16_largest_gradient": risk["largest_gradient"],
        "fp16_settled_loss_scale": risk["settled_loss_scale"],
        "fp16_initial_skipped_steps": risk["initial_skipped_steps"],
        "fp16_overflowing_modules": len(risk["overflowing_modules"]),
    }
    for name, speed in report["speed"].items():
        figures[f"{name}_step_time_s"] = speed["step_time_s"]
        figures[f"{name}_peak_memory_bytes"] = speed["peak_memory_bytes"]
    for name, found in report["largest_batch"].items():
        figures[f"{name}_largest_batch"] = found.get("max_batch_size")
    for advice in report["recommendation"]:
        figures[f"{advice['precision']}_advised"] = int(advice["advised"])
        figures[f"{advice['precision']}_advice"] = advice["reason"]
    if report["fp8"]["fp8_available"]:
        figures["fp8_flop_share"] = report["fp8"]["fp8_flop_share"]
    return {key: value for key, value in figures.items() if value is not None}


def log_to_trackers(args, report: dict, report_dir: str | Path) -> None:
    """With the recipe's --report_to (wandb, tensorboard), --project_name, --run_name, ...: the
    report as a tracker run of its own (W&B job type "doctor" unless --wandb_job_type says
    otherwise; TensorBoard in <report_dir>/<project_name>): its figures in the run's summary, the
    recommendation as a table."""
    tags = [tag.strip() for tag in (args.wandb_tags or "").split(",") if tag.strip()]
    wandb_kwargs = {"group": args.wandb_group, "job_type": args.wandb_job_type or "doctor", "tags": tags}
    rows = [[a["precision"], a["advised"], a["reason"]] for a in report["recommendation"]]
    reports.log_run(
        reports.trackers(args.report_to),
        args.project_name,
        args.run_name,
        {
            "doctor": True,
            **{k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in vars(args).items()},
        },
        tracker_figures(report),
        wandb_kwargs={k: v for k, v in wandb_kwargs.items() if v},
        tensorboard_dir=Path(report_dir) / args.project_name,
        tables={"recommendation": (["precision", "advised", "reason"], rows)},
    )


# ----------------------------------------------------------------------------- the command
def load_recipe(recipe: str):
    """A full recipe (shipped, by name, or your copy, by path) as a module: the doctor calls its
    parse_args, load_data and load_model."""
    from amp_recipes.shipped import load

    module = load(recipe)
    if not all(hasattr(module, name) for name in ("parse_args", "load_data", "load_model")):
        raise InputError(
            f"--recipe {recipe}: the doctor reads a full recipe or a copy of one (its parse_args, load_data "
            "and load_model); the minimal tier has none of them."
        )
    return module


def model_and_rows(recipe, args, accelerator, steps: int):
    """The recipe's own model and its first `steps` training batches' rows, as its code loads them.
    What its load_data returns and its load_model takes are those of the example it stands in for
    (`args.example`, which a copy keeps): glue, ner, qa or mlm."""
    from transformers import AutoConfig, AutoTokenizer

    from amp_recipes.tasks import ner

    config = AutoConfig.from_pretrained(args.model_name_or_path)
    extra = ner.tokenizer_kwargs(config) if args.example == "ner" else {}
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, **extra)
    loaded = recipe.load_data(args, tokenizer, accelerator)
    if args.example == "mlm":  # (train, eval) loaders: a masked LM has no task
        train_dataloader, model = loaded[0], recipe.load_model(args)
    else:  # (task, train loader, ...)
        task, train_dataloader = loaded[0], loaded[1]
        model = (
            recipe.load_model(args, config) if args.example == "qa" else recipe.load_model(args, config, task)
        )
    return model, RecipeRows(train_dataloader, steps, args.max_seq_length)


def diagnose(
    recipe,
    name: str,
    recipe_argv: list,
    probe_steps: int = 8,
    timed_steps: int = 5,
    budget_s: float = 300,
    memory_budget_gb: float | None = None,
    report_dir: str | Path = "doctor",
) -> dict:
    """The report: the fp32 probe's fp16 risk, the timed precisions (those the budget leaves time
    for, fp32 first), the largest batch of each (while time is left), fp8's share, the
    recommendation."""
    deadline = time.monotonic() + budget_s
    from accelerate import Accelerator

    from amp_recipes.amp.hardware import cpu_has_native_bf16, hardware_record
    from amp_recipes.measure.engine import largest_batch, memory_budget
    from amp_recipes.training.optim import make_optimizer

    args = recipe.parse_args(recipe_argv)
    torch.manual_seed(args.seed)
    accelerator = Accelerator(mixed_precision="no", cpu=not torch.cuda.is_available())
    device = accelerator.device
    model, rows = model_and_rows(recipe, args, accelerator, probe_steps)
    model = model.to(device).train()
    probe = GradientProbe(model)
    optimizer = make_optimizer(model, args, device)
    for batch in rows.batches("fp32"):
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        # As accelerate's backward() under --gradient_accumulation_steps: the loss over the window's
        # micro-batches, so each one's gradients are that much smaller.
        (loss / args.gradient_accumulation_steps).backward()
        probe.end_step()
        optimizer.step()
        optimizer.zero_grad()
    probe.remove()
    del optimizer  # its states must not count in the timed precisions' peak memory
    model.cpu()  # each timed precision trains its own copy on the device
    scaler = {
        "init_scale": args.fp16_init_scale,
        "growth_factor": args.fp16_growth_factor,
        "backoff_factor": args.fp16_backoff_factor,
        "growth_interval": args.fp16_growth_interval,
    }
    risk = fp16_risk(probe, scaler)

    # fp16 is timed as a run after its first steps: the GradScaler with the recipe's --fp16_* flags,
    # from the scale the probe predicts it settles at (the initial back-off's skipped steps are
    # the run's first few, not its speed).
    settled = risk["settled_loss_scale"]
    timed_scaler = {**scaler, "init_scale": settled if math.isfinite(settled) else scaler["init_scale"]}

    def timed(precision, dtype, batches, steps, warmup=2):
        optimizer_factory = lambda m: make_optimizer(m, args, device)  # noqa: E731
        checkpointing = args.gradient_checkpointing  # as the recipe would run
        return time_steps(
            model, batches, device, dtype, optimizer_factory, steps, warmup, checkpointing, timed_scaler
        )

    speed, not_timed = {}, []
    for precision, dtype in precisions_to_time(device).items():
        if time.monotonic() > deadline:
            not_timed.append(precision)  # said in the report: not measured, --budget_s ran out
            continue
        speed[precision] = timed(precision, dtype, rows.batches(precision), timed_steps)
    budget, largest = memory_budget(device, memory_budget_gb), {}
    for precision, dtype in precisions_to_time(device).items():
        if precision not in speed or time.monotonic() > deadline:
            continue  # the table says "not measured yet"

        def peak_at(size, precision=precision, dtype=dtype):  # one warm-up step and one measured
            return timed(precision, dtype, [rows.longest(size, precision)], 1, 1)["peak_memory_bytes"]

        largest[precision] = largest_batch(
            peak_at, device, budget, args.per_device_train_batch_size, deadline
        )
    # The device's facts and the libraries' versions, as every report has them.
    facts = hardware_record(device)
    bf16_native = facts["bf16_supported"] if device.type == "cuda" else cpu_has_native_bf16()
    report = {
        "recipe": name,
        "device": facts.get("device_name", device.type),
        "model_name_or_path": args.model_name_or_path,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "max_seq_length": args.max_seq_length,
        "probe_steps": len(rows.rows),
        "fp16_risk": risk,
        "speed": speed,
        "not_timed_for_budget": not_timed,
        "largest_batch": largest,
        "bf16_native": bf16_native,
        "fp8": fp8_report(model, facts, args.max_seq_length),
        "recommendation": recommend(risk, speed, bf16_native, device, len(rows.rows)),
        "hardware": facts,
    }
    log_to_trackers(args, report, report_dir)
    return report


def main(argv=None, started: float | None = None) -> dict:
    """`amp-recipes doctor`. `started`: the time.monotonic() its --budget_s counts from (the
    command passes its start, the CLI module's import, so the imports count too); by default, now."""
    started = time.monotonic() if started is None else started
    description = " ".join(__doc__.split("\n\n")[0].split())  # the docstring's first sentence
    parser = argparse.ArgumentParser(prog="amp-recipes doctor", description=description)
    parser.add_argument(
        "--recipe",
        required=True,
        help="The recipe whose data and model to read: bert_glue, bert_ner, bert_qa, bert_mlm, or your "
        "copy's path (my_task.py).",
    )
    parser.add_argument("--probe_steps", type=int, default=8, help="fp32 steps watched for fp16's risks.")
    parser.add_argument("--timed_steps", type=int, default=5, help="Training steps timed per precision.")
    parser.add_argument("--report_dir", default="doctor", help="Where doctor.json and doctor.md go.")
    parser.add_argument(
        "--budget_s",
        type=float,
        default=300,
        help="Seconds for the whole diagnosis, from the command's start; what is left unmeasured says so.",
    )
    parser.add_argument(
        "--memory_budget_gb",
        type=float,
        help="The memory the largest batch must fit (default: on a GPU the card, less what lives outside "
        "PyTorch's allocator and 1 GiB; on a CPU what is free and what this process holds).",
    )
    parser.add_argument("recipe_args", nargs=argparse.REMAINDER, help="-- then the recipe's own flags.")
    args = parser.parse_args(argv)
    recipe_argv = args.recipe_args[1:] if args.recipe_args[:1] == ["--"] else args.recipe_args
    report = diagnose(
        load_recipe(args.recipe),
        args.recipe,
        recipe_argv,
        args.probe_steps,
        args.timed_steps,
        args.budget_s - (time.monotonic() - started),  # what is left of it
        args.memory_budget_gb,
        args.report_dir,
    )
    reports.write(args.report_dir, "doctor", report, markdown(report))
    print(markdown(report))
    return report
