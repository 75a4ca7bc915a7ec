"""Paired precision benchmark: what fp16 / bf16 / tf32 / fp8 buy over fp32 for one model and sequence length.

    python scripts/benchmark_precision.py --arms fp32,fp16
    accelerate launch scripts/benchmark_precision.py --arms fp32,tf32,fp16,bf16 --report_to wandb
    python scripts/benchmark_precision.py --arms fp32,bf16 --memory_budget_gb 6   # a CPU: searched under 6 GiB
    python scripts/benchmark_precision.py --arms fp32,fp16,fp32+compile,fp16+compile --no_search
    python scripts/benchmark_precision.py --arms fp32,fp16,fp16+gradient_checkpointing   # the other memory lever
    python scripts/benchmark_precision.py --head qa --seq_len 384 --arms fp32,fp16,bf16   # SQuAD's shape
    python scripts/benchmark_precision.py --arms fp32,bf16,fp8,bf16+compile,fp8+compile   # Ada/Hopper, torchao

Each arm, and each trial of the batch-size search, runs in this process with the same seed, the
same initial weights and the same batches, measured by the engine the precision doctor uses
(amp_recipes.measure.engine): accelerate's state is reset before each trial, and the peak memory
restarted (on a GPU the allocator's, after `empty_cache`; on a CPU Linux's peak resident set).
An out-of-memory error anywhere in a trial (the model's build, `prepare()`, a step: torch's,
what accelerate's `find_executable_batch_size` reads as one, or the driver's) means "does not
fit"; any other error is a crash, reported as one. Default workload: the exact BERT-base architecture
(`BertConfig()` defaults are bert-base-uncased's) with random weights, on synthetic token
batches, so nothing is downloaded; `--head` picks what the recipes train on top of it: a
sentence classifier (bert_glue.py), a tagger with a label per token (bert_ner.py), or the
start/end span head of extractive QA. Reports go to --output_dir: results.json (every figure and
the hardware/software record), results.md and results.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from amp_recipes.amp.precision import MIXED_PRECISION, precision_of

# An arm is a precision of amp_recipes.amp.precision.MIXED_PRECISION (fp32; tf32, fp32 with TF32 matmuls
# allowed; fp16; bf16; fp8, Linear layers in fp8 (--fp8_backend) and the rest bf16, Ada/Hopper GPUs
# only), then modifiers.
COMPILED = "+compile"
CHECKPOINTED = "+gradient_checkpointing"
MODIFIERS = (CHECKPOINTED, COMPILED)  # in this order after the precision: fp16+gradient_checkpointing+compile
HEADS = {  # --head -> (transformers auto class, labels of the synthetic batches)
    "sequence": ("AutoModelForSequenceClassification", 2),
    "token": ("AutoModelForTokenClassification", 9),  # CoNLL-2003's 9 tags
    "qa": ("AutoModelForQuestionAnswering", 2),  # start and end logits
}  # "fp16+compile": the same arm under torch.compile, with the recipes' settings


def without_checkpointing(arm: str) -> str:
    """The arm that differs from `arm` only by keeping its activations."""
    return arm.replace(CHECKPOINTED, "")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arms",
        default="fp32,tf32,fp16,bf16",
        help="Comma-separated subset of fp32,tf32,fp16,bf16,fp8; add +compile to one (fp16+compile) for "
        "the same arm under torch.compile (compile time reported apart from step time), and/or "
        "+gradient_checkpointing (fp16+gradient_checkpointing) for it with gradient checkpointing, "
        "compared with the arm without it when that one runs too.",
    )
    parser.add_argument(
        "--fp8_backend",
        choices=["ao", "te"],
        default="ao",
        help="fp8 arm: torchao (ao) or Transformer Engine.",
    )
    parser.add_argument("--torch_compile_backend", default="inductor", help="Backend of the +compile arms.")
    parser.add_argument(
        "--model_name_or_path", help="Pretrained sequence-classification model (Hub id or directory)."
    )
    parser.add_argument(
        "--config_name", help="Config (id or directory) for random weights; default BertConfig()."
    )
    parser.add_argument(
        "--task_name", help="Time real GLUE batches of this task instead of synthetic tokens."
    )
    parser.add_argument("--data_dir", default=os.environ.get("GLUE_DIR"), help="GLUE folder for --task_name.")
    parser.add_argument("--tokenizer_name", help="Tokenizer for --task_name (default: the model's).")
    parser.add_argument(
        "--head",
        choices=list(HEADS),
        default="sequence",
        help="sequence: a label per sequence (GLUE); token: a label per token (NER); qa: answer start/end.",
    )
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=32, help="Batch size of the timed run.")
    parser.add_argument(
        "--warmup_steps", type=int, default=5, help="Untimed steps first (allocator, kernels)."
    )
    parser.add_argument("--timed_steps", type=int, default=20)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--memory_budget_gb",
        type=float,
        help="Budget of the batch-size search: on CUDA a smaller GPU (default the card, less what lives "
        "outside PyTorch's allocator); on a CPU the search measures under it (default: the largest batch "
        "is predicted from two peaks, within what is free).",
    )
    parser.add_argument("--no_search", action="store_true", help="Skip the max-batch-size search.")
    parser.add_argument("--search_start", type=int, default=8, help="A search's first batch size.")
    parser.add_argument("--search_max", type=int, default=8192, help="A search's largest batch size.")
    parser.add_argument(
        "--search_granularity", type=int, default=8, help="A search's bisection stops at this step."
    )
    parser.add_argument(
        "--time_limit_s",
        type=float,
        help="Start no trial that would end past this many seconds (judged by the longest trial so far): "
        "the arms not timed yet are recorded as not run; each arm's search gets an equal share of the "
        "time left and, cut, keeps its largest fit as a lower bound (≥). results.json is rewritten "
        "after every arm in any case.",
    )
    # Every trial runs in this process since 2026-12-07; the flag that asked for it still parses.
    parser.add_argument("--in_process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output_dir", help="Default: bench_results/<bench_id>.")
    parser.add_argument("--bench_id", default=time.strftime("bench-%Y%m%d-%H%M%S"))
    parser.add_argument(
        "--report_to",
        choices=["none", "wandb", "tensorboard", "all"],
        default="none",
        help="W&B: a run per arm in one group; TensorBoard: <output_dir>/logs/<arm>; all: both where installed.",
    )
    parser.add_argument("--project_name", default="amp-recipes-benchmark")
    args = parser.parse_args(argv)
    args.arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    suffixes = ("", CHECKPOINTED, COMPILED, CHECKPOINTED + COMPILED)
    unknown = [
        arm
        for arm in args.arms
        if precision_of(arm) not in MIXED_PRECISION or arm.removeprefix(precision_of(arm)) not in suffixes
    ]
    if unknown or not args.arms:
        parser.error(
            f"unknown arm(s) {unknown}; choose from {', '.join(MIXED_PRECISION)} (each may end in "
            f"{' and/or '.join(MODIFIERS)}, in that order)."
        )
    if args.model_name_or_path and args.config_name:
        parser.error(
            "use --model_name_or_path (pretrained weights) or --config_name (random weights), not both."
        )
    if args.task_name and args.head != "sequence":
        parser.error("--task_name times GLUE batches, which train the sequence head; drop --head.")
    if args.task_name and not (args.tokenizer_name or args.model_name_or_path or args.config_name):
        parser.error(
            "--task_name needs a tokenizer: pass --model_name_or_path, --config_name or --tokenizer_name."
        )
    for name in ("seq_len", "batch_size", "timed_steps", "search_start", "search_granularity"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1.")
    args.output_dir = args.output_dir or os.path.join("bench_results", args.bench_id)
    args.started, args.longest_trial_s = time.monotonic(), 0.0  # --time_limit_s's clock
    args.search_ends = None  # the arm's search: its share of the time left (run_arms)
    return args


# =============================================================================== one trial
def build_model(config: dict):
    import torch
    import transformers
    from transformers import AutoConfig, BertConfig

    class_name, num_labels = HEADS[config["head"]]
    auto_class = getattr(transformers, class_name)
    if config["model_name_or_path"]:
        # The head is new in every trial, by design: transformers' load report (a warning listing
        # its missing weights) would repeat at every trial of every search.
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            return auto_class.from_pretrained(
                config["model_name_or_path"],
                num_labels=num_labels,
                ignore_mismatched_sizes=True,
                dtype=torch.float32,
            )
        finally:
            transformers.logging.set_verbosity(verbosity)
    model_config = (
        AutoConfig.from_pretrained(config["config_name"]) if config["config_name"] else BertConfig()
    )
    model_config.num_labels = num_labels
    return auto_class.from_config(model_config)


def synthetic_labels(head: str, batch_size: int, seq_len: int, generator) -> dict:
    """Random targets of the head's shape: a class per sequence, a tag per token, or an answer span."""
    import torch

    if head == "token":
        return {"labels": torch.randint(0, HEADS["token"][1], (batch_size, seq_len), generator=generator)}
    if head == "qa":
        start = torch.randint(1, seq_len - 1, (batch_size,), generator=generator)
        length = torch.randint(0, 30, (batch_size,), generator=generator)  # run_qa's max_answer_length
        return {"start_positions": start, "end_positions": torch.clamp(start + length, max=seq_len - 1)}
    return {"labels": torch.randint(0, 2, (batch_size,), generator=generator)}


def make_batches(config: dict, model_config, batch_size: int, count: int):
    """`count` batches of exactly batch_size x seq_len, identical for every arm (seeded)."""
    import torch

    seq_len = config["seq_len"]
    if config["task_name"]:
        from transformers import AutoTokenizer

        from amp_recipes.tasks.classification import load_glue

        task = load_glue(config["task_name"], config["data_dir"])
        tokenizer = AutoTokenizer.from_pretrained(
            config["tokenizer_name"] or config["model_name_or_path"] or config["config_name"]
        )
        rows = task.splits["train"].select(range(min(task.splits["train"].num_rows, batch_size * count)))
        texts = [list(rows[column]) for column in task.text_columns]
        encoded = tokenizer(
            *texts, truncation=True, max_length=seq_len, padding="max_length", return_tensors="pt"
        )
        labels = torch.tensor(list(rows["label"])).long() % 2  # the benchmark head has 2 outputs
        repeats = -(-batch_size * count // len(labels))  # small tasks are cycled to fill every batch
        columns = {k: v.repeat(repeats, 1) for k, v in encoded.items()} | {"labels": labels.repeat(repeats)}
        return [
            {k: v[i * batch_size : (i + 1) * batch_size] for k, v in columns.items()} for i in range(count)
        ]
    generator = torch.Generator().manual_seed(1234)
    low = min(
        1000, model_config.vocab_size // 2
    )  # skip special tokens at the start of BERT-style vocabularies
    return [
        {
            "input_ids": torch.randint(
                low, model_config.vocab_size, (batch_size, seq_len), generator=generator
            ),
            "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
            **synthetic_labels(config["head"], batch_size, seq_len, generator),
        }
        for _ in range(count)
    ]


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(config: dict, arm: str, batch_size: int, warmup_steps: int, timed_steps: int) -> dict:
    """One arm at one batch size: `warmup_steps` untimed steps, then `timed_steps` timed ones."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from amp_recipes.amp.compiling import CompileMonitor, dynamo_plugin
    from amp_recipes.amp.hardware import hardware_record, tf32_matmul_enabled
    from amp_recipes.amp.memory import enable_gradient_checkpointing, gradient_checkpointing_on
    from amp_recipes.amp.precision import describe_precision, fp8_layer_report, fp8_recipe_kwargs
    from amp_recipes.measure.engine import peak_memory_since_window, start_memory_window, time_steps
    from amp_recipes.measure.flops import matmul_parameters, training_flops_per_step
    from amp_recipes.training.optim import make_optimizer

    mixed_precision, tf32 = MIXED_PRECISION[precision_of(arm)], precision_of(arm) == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    compile_flags = argparse.Namespace(
        torch_compile=arm.endswith(COMPILED),
        torch_compile_backend=config["torch_compile_backend"],
        torch_compile_mode="default",
    )
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        kwargs_handlers=fp8_recipe_kwargs(mixed_precision, config["fp8_backend"]),  # the recipes' fp8 recipe
        dynamo_plugin=dynamo_plugin(compile_flags),
    )
    device = accelerator.device
    baseline = start_memory_window(device)
    set_seed(config["seed"])  # same initial weights in every arm
    model = build_model(config)
    if CHECKPOINTED in arm:  # the recipes' --gradient_checkpointing
        enable_gradient_checkpointing(model)
    steps = warmup_steps + timed_steps
    batches = make_batches(config, model.config, batch_size, steps)
    # The recipes' own optimizer (fused AdamW where torch has it, no decay on biases and norms).
    recipe_flags = argparse.Namespace(optim="auto", weight_decay=0.01, learning_rate=config["learning_rate"])
    optimizer = make_optimizer(model, recipe_flags, accelerator.device)
    model, optimizer = accelerator.prepare(model, optimizer)
    result = {
        "arm": arm,
        "batch_size": batch_size,
        "pid": os.getpid(),
        "seq_len": config["seq_len"],
        "head": config["head"],
        **describe_precision(accelerator, mixed_precision),
        # fp8: backend, its version, the Linear layers converted and their share of the FLOPs.
        **fp8_layer_report(accelerator, model, config["seq_len"]),
        "tf32_matmul": tf32_matmul_enabled(),  # this arm's own setting, not the parent's
        "gradient_checkpointing": gradient_checkpointing_on(accelerator.unwrap_model(model)),
    }
    if precision_of(arm) == "tf32":
        hardware = hardware_record(device)
        if not hardware["tf32_supported"]:
            result["precision_in_effect"] = "fp32"
            result["precision_note"] = (
                "TF32 needs a CUDA GPU of compute capability 8.0+; this arm ran plain fp32."
            )
        else:
            result["precision_in_effect"] = "tf32"

    gradient_bytes = []

    def step(batch):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        loss = model(**batch).loss
        accelerator.backward(loss)
        if not gradient_bytes:
            gradient_bytes.append(tensor_bytes(p.grad for p in model.parameters() if p.grad is not None))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    # An out-of-memory error goes up to the caller: at the timed batch the arm does not fit; in a
    # search (amp_recipes.measure.engine.largest_batch) the trial does not.
    compiled = CompileMonitor(compile_flags.torch_compile)  # the compilation is at the first step
    try:
        timed = time_steps(step, batches, device, warmup_steps)
    finally:
        compile_report = compiled.report()  # stops listening to dynamo's log, whether the trial fit or not
    result["peak_memory_bytes"] = peak_memory_since_window(device)  # on a CPU: the process's peak RSS
    if device.type == "cuda":
        result["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    step_seconds, first_step_seconds = timed["step_seconds"], timed["first_step_seconds"]
    if step_seconds:
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        weights = tensor_bytes(unwrapped.parameters())
        optimizer_state = tensor_bytes(
            v
            for state in optimizer.state_dict()["state"].values()
            for v in state.values()
            if torch.is_tensor(v)
        )
        activations = result["peak_memory_bytes"] - baseline - weights - gradient_bytes[0] - optimizer_state
        median = sorted(step_seconds)[len(step_seconds) // 2]
        matmul_params = matmul_parameters(unwrapped)
        result.update(
            memory_split_bytes={
                "weights": weights,
                "gradients": gradient_bytes[0],
                "optimizer_state": optimizer_state,
                # On a CPU this also holds allocator overhead: peak RSS minus the start-up RSS.
                "activations_and_other": activations,
            },
            step_seconds=step_seconds,
            median_step_seconds=median,
            min_step_seconds=min(step_seconds),
            max_step_seconds=max(step_seconds),
            samples_per_second=batch_size / median,
            first_step_seconds=first_step_seconds,
            # The first step's time beyond a steady step: compilation (+compile arms), else warm-up.
            compile_seconds=first_step_seconds - median if compile_flags.torch_compile else None,
            **compile_report,
            tokens_per_second=batch_size * config["seq_len"] / median,
            losses=timed["losses"],
            parameters=sum(p.numel() for p in unwrapped.parameters()),
            matmul_parameters=matmul_params,
            flops_per_step=training_flops_per_step(
                matmul_params,
                unwrapped.config.num_hidden_layers,
                unwrapped.config.hidden_size,
                batch_size,
                config["seq_len"],
            ),
        )
    return result


# =============================================================================== parent
def out_of_time(args) -> bool:
    """A trial as long as the longest so far would end past --time_limit_s."""
    if args.time_limit_s is None:
        return False
    return time.monotonic() - args.started + args.longest_trial_s > args.time_limit_s


class BenchmarkCrash(RuntimeError):
    """A trial that failed for another reason than running out of memory: the message is one line
    (its error), `tail` the last lines of its traceback; `fatal` when the error was CUDA's own (an
    illegal memory access, a device-side assert), after which the process's CUDA context is
    unusable: the arms after it cannot run in this process."""

    def __init__(self, message: str, tail: str = "", fatal: bool = False):
        super().__init__(message)
        self.tail, self.fatal = tail, fatal


def trial(args, arm: str, batch_size: int, warmup_steps: int, timed_steps: int) -> dict:
    """One arm at one batch size, in this process. accelerate keeps one state per process
    (precision, device, plugins) and refuses an Accelerator with other settings once it exists: it
    is reset before each trial, as accelerate's own test suite does between tests; dynamo's graphs
    of the last compiled trial (which hold its model) are dropped, and `measure` starts with a
    released allocator and a restarted peak (amp_recipes.measure.engine.start_memory_window; on a CPU
    Linux's peak resident set, restarted through /proc/self/clear_refs). An out-of-memory error
    anywhere in the trial (the model's build, prepare(), a step) goes up as it is: the caller reads
    it as "does not fit"; any other error is a BenchmarkCrash, never "does not fit"."""
    import traceback

    import torch
    from accelerate.state import AcceleratorState, GradientState

    from amp_recipes.measure.engine import is_out_of_memory

    started = time.monotonic()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch._dynamo.reset()
    config = {k: v for k, v in vars(args).items() if k != "arms"}
    # The arm decides precision and compilation: `accelerate launch` exports
    # ACCELERATE_MIXED_PRECISION and ACCELERATE_DYNAMO_*, which every Accelerator would read.
    launched = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("ACCELERATE_")}
    try:
        return measure(config, arm, batch_size, warmup_steps, timed_steps)
    except Exception as error:
        if is_out_of_memory(error):
            raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        tail = "\n".join(traceback.format_exc().strip().splitlines()[-5:])
        message = f"the {arm} arm crashed at batch {batch_size}: {type(error).__name__}: {first_line}"
        fatal = isinstance(error, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(error)
        raise BenchmarkCrash(message, tail, fatal) from None
    finally:
        os.environ.update(launched)
        args.longest_trial_s = max(args.longest_trial_s, time.monotonic() - started)


def search_max_batch(args, arm: str, device, budget: int) -> dict:
    """The arm's largest batch, by the measurement engine (amp_recipes.measure.engine.largest_batch), each
    trial one warm-up step and one measured: on a GPU doubled from --search_start then bisected to
    --search_granularity under the budget's allocator cap; on a CPU the same against the peak
    resident set with --memory_budget_gb, else predicted from the peaks at --batch_size and twice it
    (a trial past the machine's memory would be killed, not fail). Within the arm's share of
    --time_limit_s."""
    import math

    from amp_recipes.measure.engine import largest_batch

    search_started = time.monotonic()
    ends = math.inf if args.search_ends is None else args.started + args.search_ends

    def peak_at(batch_size: int) -> int:
        return trial(args, arm, batch_size, 1, 1)["peak_memory_bytes"]

    def say(trial: dict) -> None:
        print(search_progress(args, arm, trial, search_started), flush=True)

    return largest_batch(
        peak_at,
        device,
        budget,
        args.batch_size,
        ends,
        start=args.search_start,
        maximum=args.search_max,
        granularity=args.search_granularity,
        search_on_cpu=bool(args.memory_budget_gb),
        on_trial=say,
    )


def search_progress(args, arm: str, trial: dict, search_started: float) -> str:
    """One line per trial of a search: the batch, whether it fit (and its peak), the time so far
    and the search's bound, e.g. `[bf16] batch 64: fits, peak 2.31 GiB (9.8 s; search 41 s of 150 s)`."""
    outcome = (
        f"fits, peak {trial['peak_memory_bytes'] / 2**30:.2f} GiB"
        if trial["fits"]
        else f"does not fit ({trial['failure']})"
    )
    bound = (
        f" of {args.search_ends - (search_started - args.started):.0f} s"
        if args.search_ends is not None
        else ""
    )
    return (
        f"[{arm}] batch {trial['batch_size']}: {outcome} "
        f"({trial['seconds']:.1f} s; search {time.monotonic() - search_started:.0f} s{bound})"
    )


def relative_difference(losses, reference):
    pairs = [(a, b) for a, b in zip(losses, reference, strict=False) if b]
    diffs = [abs(a - b) / abs(b) for a, b in pairs]
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs)} if diffs else None


def ratios_between(result: dict, base: dict) -> dict:
    """`result` against `base`: peak-memory drop, speedup, and headroom (max batch ratio) unless
    either search only found a lower bound."""
    ratios = {
        "memory_drop_percent": 100.0 * (1 - result["peak_memory_bytes"] / base["peak_memory_bytes"]),
        "speedup": result["samples_per_second"] / base["samples_per_second"],
    }
    capped = result.get("capped_at_search_max") or base.get("capped_at_search_max")
    if result.get("max_batch_size") and base.get("max_batch_size") and not capped:
        ratios["headroom"] = result["max_batch_size"] / base["max_batch_size"]
    return ratios


def compare(results: dict) -> None:
    """Ratios against fp32, only for arms of this invocation that really ran reduced precision."""
    base = results.get("fp32")
    for arm, result in results.items():
        result["ratios_vs_fp32"] = None
        if not result.get("fits") or arm == "fp32" or not base or not base.get("fits"):
            continue
        if result["precision_in_effect"] != precision_of(arm):
            result["no_ratio_reason"] = f"requested {arm} but ran {result['precision_in_effect']}"
            continue
        if result.get("fp8_emulated"):
            result["no_ratio_reason"] = "fp8 was emulated (torchao emulate=True): no fp8 Tensor Core ran"
            continue
        ratios = ratios_between(result, base)
        if result.get("capped_at_search_max") or base.get("capped_at_search_max"):
            # a lower bound over a lower bound is no ratio
            stopped = result.get("search_stopped") or base.get("search_stopped")
            result["headroom_note"] = (
                "no headroom ratio: the search stopped at --time_limit_s; give it more time"
                if stopped
                else "no headroom ratio: the search reached --search_max; raise it"
            )
        result["ratios_vs_fp32"] = ratios
        result["loss_vs_fp32"] = relative_difference(result["losses"], base["losses"])
    for arm, result in results.items():  # gradient checkpointing against the same arm without it
        kept = results.get(without_checkpointing(arm))
        if CHECKPOINTED not in arm or not result.get("fits") or not kept or not kept.get("fits"):
            continue
        result["ratios_vs_without_checkpointing"] = ratios_between(result, kept)


def markdown_table(results: dict) -> str:
    from amp_recipes.amp.precision import describe_fp8_layers
    from amp_recipes.measure import report

    def gib(value):
        return f"{value / 2**30:.2f}" if value else "—"

    def ratio(result, key, fmt):
        value = (result.get("ratios_vs_fp32") or {}).get(key)
        return fmt.format(value) if value is not None else "—"

    header = ["arm", "ran as", "peak mem (GiB)", "mem drop", "max batch", "headroom", "median step (ms)"]
    header += ["samples/s", "speedup", "MFU", "loss rel. diff (max)", "compile (s)"]
    rows = []
    for arm, r in results.items():
        if not r.get("fits"):
            reason = (
                f"crashed: {r['crashed']}"
                if r.get("crashed")
                else f"not run: {r['not_run']}"
                if r.get("not_run")
                else f"does not fit ({r.get('failure')})"
            )
            rows.append([arm, r.get("precision_in_effect", "—"), reason, *["—"] * 9])
            continue
        max_batch = r.get("max_batch_size")
        max_batch_text = (
            ("crashed" if r.get("crashed") else "not measured")
            if max_batch is None
            else (
                f"≥{max_batch}"
                if r.get("capped_at_search_max")
                else (str(max_batch) if max_batch else "none fits")
            )
        )
        loss = r.get("loss_vs_fp32")
        rows.append(
            [
                arm,
                r["precision_in_effect"],
                gib(r["peak_memory_bytes"]),
                ratio(r, "memory_drop_percent", "{:.1f}%"),
                max_batch_text,
                ratio(r, "headroom", "{:.2f}x"),
                f"{r['median_step_seconds'] * 1e3:.1f}",
                f"{r['samples_per_second']:.1f}",
                ratio(r, "speedup", "{:.2f}x"),
                "—" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
                "—" if not loss else f"{loss['max']:.2e}",
                "—" if r.get("compile_seconds") is None else f"{r['compile_seconds']:.1f}",
            ]
        )
    lines = report.table(header, rows)
    notes = [f"- {arm}: {r['precision_note']}" for arm, r in results.items() if r.get("precision_note")]
    notes += [f"- {arm}: {describe_fp8_layers(r)}" for arm, r in results.items() if "fp8_linear_layers" in r]
    notes += [
        f"- {arm}: no ratio, {r['no_ratio_reason']}" for arm, r in results.items() if r.get("no_ratio_reason")
    ]
    notes += [f"- {arm}, max batch: {r['why']}" for arm, r in results.items() if r.get("why")]
    notes += [  # a GPU's budget: the card (or --memory_budget_gb) less what the allocator cannot hold
        f"- {arm}, max batch within {gib(r['budget_bytes'])} GiB: PyTorch's allocator capped at "
        f"{gib(r['allocator_cap_bytes'])} GiB ({gib(r['outside_allocator_bytes'])} GiB outside it: the CUDA "
        f"context, other processes; {gib(r['reserve_bytes'])} GiB kept free for what CUDA adds there)"
        for arm, r in results.items()
        if "allocator_cap_bytes" in r
    ]
    for arm, r in results.items():
        ratios = r.get("ratios_vs_without_checkpointing")
        if ratios:
            headroom = f", headroom {ratios['headroom']:.2f}x" if "headroom" in ratios else ""
            notes.append(
                f"- {arm} against {without_checkpointing(arm)} (gradient checkpointing alone): peak memory "
                f"{-ratios['memory_drop_percent']:+.1f}%{headroom}, speed {ratios['speedup']:.2f}x"
            )
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [arm for arm, r in results.items() if r.get("fits")]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("peak memory (GiB)", [results[a]["peak_memory_bytes"] / 2**30 for a in arms]),
        ("max batch size", [results[a].get("max_batch_size") or 0 for a in arms]),
        ("samples / s", [results[a]["samples_per_second"] for a in arms]),
    ]
    for axis, (title, values) in zip(axes, panels, strict=True):
        bars = axis.bar(
            arms,
            values,
            color=[
                "#777777" if results[a]["precision_in_effect"] != precision_of(a) else "#ff9d00" for a in arms
            ],
        )
        axis.bar_label(bars, fmt="%.3g")
        axis.set_title(title)
    figure.suptitle("grey: did not run in the requested precision", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report_to_trackers(args, results: dict, hardware: dict) -> None:
    """One tracker run per arm: in W&B in one group (group = benchmark id, job type = arm), in
    TensorBoard in <output_dir>/logs/<arm>: its losses and step times step by step, its figures in
    the summary, the comparison table of every arm (W&B)."""
    from amp_recipes.measure import report

    columns = ["arm", "ran_as", "peak_memory_gib", "max_batch_size", "samples_per_second"]
    columns += ["speedup", "memory_drop_percent", "headroom"]
    rows = []
    for arm, r in results.items():
        ratios = r.get("ratios_vs_fp32") or {}
        rows.append(
            [
                arm,
                r.get("precision_in_effect"),
                (r.get("peak_memory_bytes") or 0) / 2**30,
                r.get("max_batch_size"),
                r.get("samples_per_second"),
                ratios.get("speedup"),
                ratios.get("memory_drop_percent"),
                ratios.get("headroom"),
            ]
        )
    for arm, r in results.items():
        summary = {k: v for k, v in r.items() if not isinstance(v, (list, dict))}
        summary.update({f"ratio/{k}": v for k, v in (r.get("ratios_vs_fp32") or {}).items()})
        history = [
            {"loss": loss, "step_seconds": seconds}
            for loss, seconds in zip(r.get("losses") or [], r.get("step_seconds") or [], strict=True)
        ]
        report.log_run(
            report.trackers(args.report_to),
            args.project_name,
            f"{args.bench_id}-{arm}",
            {**vars(args), **hardware},
            summary,
            wandb_kwargs={"group": args.bench_id, "job_type": arm, "dir": args.output_dir},
            tensorboard_dir=Path(args.output_dir) / "logs" / arm,
            history=history,
            tables={"comparison": (columns, rows)},
        )


def run_arms(args, hardware: dict, device, budget: int, after_arm=None) -> dict:
    """Time each arm, then search its largest batch. An arm whose trial crashed is recorded with
    its error (`crashed`), never as "does not fit", and the others' figures are kept.
    `after_arm(results)` is called after each arm (the report, rewritten)."""
    results = {}
    for index, arm in enumerate(args.arms):
        if results and after_arm:
            after_arm(results)
        if args.time_limit_s is not None:  # this arm's search: an equal share of the time left
            elapsed = time.monotonic() - args.started
            args.search_ends = elapsed + (args.time_limit_s - elapsed) / (len(args.arms) - index)
        why = (
            f"the CUDA context is unusable after the {lost} arm's crash; run this arm on its own"
            if (lost := next((a for a, r in results.items() if r.get("cuda_context_lost")), None))
            else "time limit"
            if out_of_time(args)
            else None
        )
        if why:
            print(f"[{arm}] not run: {why}", flush=True)
            results[arm] = {"arm": arm, "batch_size": args.batch_size, "fits": False, "not_run": why}
            continue
        try:
            results[arm] = run_arm(args, arm, hardware, device, budget)
        except BenchmarkCrash as crash:  # recorded; the other arms still run and keep their figures
            print(f"[{arm}] error: {crash}; its last lines:\n{crash.tail}", flush=True)
            results[arm] = {"arm": arm, "batch_size": args.batch_size, "fits": False, "crashed": str(crash)}
            results[arm]["cuda_context_lost"] = crash.fatal
    return results


def run_arm(args, arm: str, hardware: dict, device, budget: int) -> dict:
    """One arm: its timed run (on a GPU under --memory_budget_gb's allocator cap), then (unless
    skipped) its largest batch."""
    from amp_recipes.measure.engine import allocator_cap, is_out_of_memory
    from amp_recipes.measure.flops import device_peak_tflops, mfu

    print(f"[{arm}] timing {args.timed_steps} steps at batch {args.batch_size} ...", flush=True)
    with allocator_cap(device, args.memory_budget_gb and budget) as card:
        try:
            result = {**trial(args, arm, args.batch_size, args.warmup_steps, args.timed_steps), "fits": True}
        except Exception as error:  # noqa: BLE001 - BenchmarkCrash is not one: it goes up
            if not is_out_of_memory(error):
                raise
            result = {"arm": arm, "batch_size": args.batch_size, "fits": False, "failure": "out of memory"}
    if card:  # the card the budget emulates: its allocator's share, stated in the result
        result["cuda_budget"] = card
    elif args.memory_budget_gb and result.get("peak_memory_bytes", 0) > budget:  # a CPU's
        result["fits"], result["failure"] = False, "over the memory budget"
    if result["fits"]:
        peak = (
            device_peak_tflops(hardware["device_name"], result["precision_in_effect"])
            if hardware["device_type"] == "cuda"
            else None
        )
        result["peak_tflops"] = peak
        result["mfu"] = mfu(result["flops_per_step"], result["median_step_seconds"], peak)
    if not args.no_search:
        print(f"[{arm}] searching the largest batch that fits ...", flush=True)
        try:
            result.update(search_max_batch(args, arm, device, budget))
        except BenchmarkCrash as crash:  # the timed figures stand; the headroom is not measured
            print(f"[{arm}] error: {crash}; its last lines:\n{crash.tail}", flush=True)
            result["crashed"], result["cuda_context_lost"] = f"max-batch search: {crash}", crash.fatal
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    from accelerate import PartialState

    state = PartialState()
    if state.num_processes > 1:
        sys.exit(
            "error: run the benchmark as one process (it runs each arm in turn); drop --num_processes/--multi_gpu."
        )
    from amp_recipes.amp.hardware import hardware_record
    from amp_recipes.measure import report
    from amp_recipes.measure.engine import cpu_peak_restarts, memory_budget

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    device = state.device
    hardware = hardware_record(device)
    if any(precision_of(arm) == "fp8" for arm in args.arms):  # refused before any arm runs
        from amp_recipes.amp.hardware import device_facts
        from amp_recipes.amp.precision import fp8_refusal

        refusal = fp8_refusal(device_facts(), args.fp8_backend)
        if refusal:
            sys.exit(f"error: the fp8 arm: {refusal}")
    budget = memory_budget(device, args.memory_budget_gb)
    search_note = None
    if not args.no_search and device.type == "cpu" and not args.memory_budget_gb:
        search_note = (
            f"max batch predicted on this CPU, from the peaks at batch {args.batch_size} and "
            f"{2 * args.batch_size}, within the {budget / 2**30:.1f} GiB free to a run (a trial past it "
            "would be killed, not fail); --memory_budget_gb searches under that budget instead"
        )
    if device.type == "cpu" and not cpu_peak_restarts():
        search_note = (search_note + "\n\n" if search_note else "") + (
            "This system cannot restart a process's peak resident set (Linux's /proc/self/clear_refs): "
            "every arm runs in this process, so each arm's peak memory holds the arms' before it. Run "
            "one arm per invocation for its own peak."
        )
        print(f"warning: {search_note.splitlines()[-1]}", flush=True)

    def write_report(results: dict, complete: bool = False) -> tuple[dict, str]:
        """results.json and results.md, rewritten after every arm: a benchmark stopped half-way
        (killed, or past a deadline) keeps the arms it finished."""
        compare(results)
        table = markdown_table(results) + (f"\n{search_note}\n" if search_note else "")
        payload = {
            "bench_id": args.bench_id,
            "config": vars(args),
            "hardware": hardware,
            "arms": results,
            "search_note": search_note,
            "complete": complete,
        }
        report.write(
            output_dir,
            "results",
            payload,
            f"# {args.bench_id}\n\n{hardware['device_name']}, torch {hardware['torch']}, {args.head} head, "
            f"seq_len {args.seq_len}, batch {args.batch_size}\n\n{table}",
        )
        return payload, table

    results = run_arms(args, hardware, device, budget, after_arm=write_report)
    payload, table = write_report(results, complete=True)
    plot(results, output_dir / "results.png")
    if args.report_to != "none":
        report_to_trackers(args, results, hardware)
    print(table)
    print(f"Wrote {output_dir}/results.json, results.md and results.png")
    crashed = [r["crashed"] for r in results.values() if r.get("crashed")]
    if crashed:  # the figures of the other arms are written; the run still fails
        sys.exit("\n".join(f"error: {reason}" for reason in crashed))
    return payload


if __name__ == "__main__":
    main()
