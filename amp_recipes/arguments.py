"""The command-line flags every recipe shares, with Hugging Face names and one meaning each:
training, mixed precision and telemetry, evaluation / logging / output, and the flags of
transformers' `run_*_no_trainer.py` examples that every recipe takes. A recipe adds its own data
and model flags (an example's other name for one of them is another option string of the same
flag: `"--max_seq_length", "--max_length"`), then calls `check_shared_args`. docs/migrating.md's
table of the examples' flags is generated from the recipes' parsers."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

from amp_recipes.amp.precision import fp8_backend_choice
from amp_recipes.errors import first_to_say
from amp_recipes.training.telemetry import DEFAULT_MAX_CONSECUTIVE_SKIPPED


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, except that under a multi-process launch its error (the usage, then
    `<recipe>: error: ...`, exit 2) is printed once for the launch, not once per rank, and that a
    flag must be spelled out (no abbreviations: `--hub_tok` is not quietly --hub_token).

    After parsing, `written` holds {dest: the option string the command line used} of every flag
    given. argparse keeps neither which flags were given nor under which of a flag's names, and
    both are needed: an error names the flag as it was typed (`--max_length`, not
    --max_seq_length), and --hf_example_defaults changes only the flags not given. Two names of one
    flag on one command line are refused (argparse would keep the last, silently)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.written = {}

    def parse_known_args(self, args=None, namespace=None):
        self.written = {}
        args = sys.argv[1:] if args is None else list(args)  # read twice: here, then by argparse
        for token in args:
            if token == "--":
                break
            option = str(token).split("=", 1)[0]
            action = self._option_string_actions.get(option)
            if action is None:
                continue
            earlier = self.written.get(action.dest)
            if earlier in action.option_strings and earlier != option:
                self.error(f"{earlier} and {option} are the same setting: give one of them.")
            self.written[action.dest] = option
        return super().parse_known_args(args, namespace)

    def error(self, message):
        sentence = f"{self.prog}: error: {message}\n"
        if first_to_say(sentence):
            self.print_usage(sys.stderr)
            self.exit(2, sentence)
        self.exit(2)


def add_worker_args(group) -> None:
    """Worker processes for tokenisation and for the DataLoader (a recipe's data group)."""
    group.add_argument(
        "--preprocessing_num_workers", type=int, help="Processes for tokenisation (large datasets)."
    )
    group.add_argument(
        "--dataloader_num_workers",
        type=int,
        help="DataLoader worker processes (default: 2 on CUDA, where batches are built while the GPU "
        "computes; 0 elsewhere).",
    )


def add_group_by_length_arg(group, default: bool) -> None:
    """--group_by_length / --no_group_by_length (a recipe's data group); the recipe says why its default.
    Two flags, not argparse's BooleanOptionalAction, whose negative is spelt --no-group_by_length."""
    group.add_argument(
        "--group_by_length",
        action="store_true",
        default=default,
        help=f"Batch similar lengths together: less padding, less compute (default: {'on' if default else 'off'}).",
    )
    group.add_argument(
        "--no_group_by_length", dest="group_by_length", action="store_false", help="The plain shuffle."
    )


# transformers' schedules that take the warm-up and the number of steps and nothing else, and
# `constant`, which ignores the warm-up (as transformers' does; the no_trainer examples offer it).
# Left out: `inverse_sqrt` (its decay timescale counts scheduler steps, which grow with the process
# count), and those that need settings of their own (cosine_with_min_lr, warmup_stable_decay) or a
# metric at every step (reduce_lr_on_plateau).
SCHEDULERS = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant_with_warmup", "constant"]


# accelerate's trackers (LoggerType), and the package each needs.
TRACKERS = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "comet_ml": "comet_ml",
    "clearml": "clearml",
    "mlflow": "mlflow",
    "aim": "aim",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "trackio": "trackio",
}

# The no_trainer examples' defaults where they differ from the recipes' (--hf_example_defaults;
# a recipe adds its own). `max_grad_norm` 0: the examples do not clip; `seed` None: the examples
# seed nothing (here a seed is drawn, and recorded, since the recipes' resume and paired runs need one).
EXAMPLE_DEFAULTS = {
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 8,
    "learning_rate": 5e-5,
    "weight_decay": 0.0,
    "num_warmup_steps": 0,
    "max_grad_norm": 0.0,
    "seed": None,
}


def set_unless_given(parser: ArgumentParser, args: argparse.Namespace, values: dict) -> None:
    """Each value into `args`, except for the flags the command line gave (--hf_example_defaults,
    --with_tracking). A warm-up given as --warmup_ratio keeps it (no --num_warmup_steps 0 over it)."""
    for name, value in values.items():
        if name not in parser.written and not (
            name == "num_warmup_steps" and "warmup_ratio" in parser.written
        ):
            setattr(args, name, value)


def truthy(value: str) -> bool:
    """A flag's written value: true/false, yes/no, 1/0."""
    lowered = str(value).strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {value!r}")


def checkpoint_or_none(value: str) -> str | None:
    """--resume_from_checkpoint: an empty value resumes nothing, as in the no_trainer examples."""
    return value or None


def steps_or_epoch(value: str) -> int | str:
    """--checkpointing_steps: a positive number of optimizer steps (an int), or 'epoch'."""
    if value == "epoch":
        return value
    if not (value.isdigit() and int(value) > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of steps or 'epoch', not {value!r}")
    return int(value)


def add_shared_args(parser: argparse.ArgumentParser, output_default: str, example: str) -> None:
    """`example`: the transformers no_trainer example the recipe stands in for (glue, ner, qa, mlm):
    the run leaves that example's all_results.json beside its own results (`args.example`)."""
    parser.set_defaults(example=example)
    train = parser.add_argument_group("training")
    train.add_argument(
        "--per_device_train_batch_size", type=int, default=32, help="Training examples per device per step."
    )
    train.add_argument(
        "--per_device_eval_batch_size",
        type=int,
        default=128,
        help="Evaluation examples per device per batch.",
    )
    train.add_argument("--learning_rate", type=float, default=2e-5, help="AdamW's peak learning rate.")
    train.add_argument(
        "--weight_decay", type=float, default=0.01, help="AdamW's weight decay, never on biases and norms."
    )
    train.add_argument("--num_train_epochs", type=int, default=3, help="Passes over the training data.")
    train.add_argument("--max_train_steps", type=int, help="Stop after N optimizer steps (overrides epochs).")
    train.add_argument(
        "--gradient_accumulation_steps",
        type=int,
        help="Micro-batches per optimizer step (default: what a DeepSpeed launch of accelerate launch "
        "says, from its --gradient_accumulation_steps or the config's deepspeed_config; else 1).",
    )
    train.add_argument(
        "--lr_scheduler_type",
        choices=SCHEDULERS,
        default="linear",
        help="The learning-rate schedule after the warm-up (transformers' get_scheduler).",
    )
    train.add_argument(
        "--warmup_ratio", type=float, default=0.1, help="Fraction of steps with linear LR warm-up."
    )
    train.add_argument(
        "--num_warmup_steps",
        type=int,
        help="Optimizer steps of linear LR warm-up (overrides --warmup_ratio; default: --warmup_ratio's share).",
    )
    train.add_argument("--max_grad_norm", type=float, default=1.0, help="Gradient clipping; 0 turns it off.")
    train.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute each layer's activations in the backward instead of keeping them: less "
        "activation memory (a larger batch fits), about a third more compute.",
    )
    train.add_argument(
        "--seed",
        type=int,
        default=42,
        help="Seeds the new head, dropout and shuffling: a run repeats, resumes exactly and pairs with another.",
    )
    train.add_argument(
        "--torch_compile",
        action="store_true",
        help="torch.compile the model through accelerate's dynamo settings (first steps compile).",
    )
    train.add_argument("--torch_compile_backend", default="inductor", help="torch.compile backend.")
    train.add_argument(
        "--torch_compile_mode",
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        default="default",
        help="torch.compile mode (reduce-overhead: CUDA graphs, for small batches on a GPU).",
    )
    train.add_argument(
        "--ddp_timeout",
        type=int,
        default=600,
        help="Seconds a process waits for the others in a collective operation (gradient all-reduce, "
        "barrier) before the run stops with an error naming the rank: a rank that hangs ends the run. "
        "Raise it if one rank works alone longer (e.g. the main process tokenising a large dataset).",
    )
    train.add_argument(
        "--optim",
        choices=["auto", "adamw_torch", "adamw_torch_fused"],
        default="auto",
        help="AdamW kernel: auto = fused where torch has it (CUDA, CPU, MPS, XPU), else foreach (multi-tensor).",
    )

    amp = parser.add_argument_group("mixed precision")
    amp.add_argument(
        "--mixed_precision",
        choices=["no", "fp16", "bf16", "fp8", "auto"],
        default=None,
        help="Default: whatever `accelerate launch` / its config file says (else fp32). auto: bf16 "
        "where the device has it natively, else fp16 on a Tensor-Core GPU, else fp32 (never fp8). "
        "fp8: Ada/Hopper GPUs (compute capability 8.9+), Linear layers in fp8, the rest bf16.",
    )
    amp.add_argument(
        "--fp8_backend",
        choices=["ao", "te"],
        default=None,
        help="fp8 engine: ao = torchao's Float8Linear (`pip install -e '.[fp8]'`), te = NVIDIA Transformer "
        "Engine. Default: accelerate launch's --fp8_backend, else ao.",
    )
    # The GradScaler's settings (fp16 only), passed to accelerate as GradScalerKwargs; the defaults are torch's.
    amp.add_argument("--fp16_init_scale", type=float, default=65536.0, help="Initial loss scale.")
    amp.add_argument(
        "--fp16_growth_interval",
        type=int,
        default=2000,
        help="Steps without overflow before the scale grows.",
    )
    amp.add_argument("--fp16_growth_factor", type=float, default=2.0, help="Scale multiplier on growth.")
    amp.add_argument("--fp16_backoff_factor", type=float, default=0.5, help="Scale multiplier on overflow.")
    amp.add_argument(
        "--max_consecutive_skipped_steps",
        type=int,
        default=DEFAULT_MAX_CONSECUTIVE_SKIPPED,
        help="Stop after this many fp16 steps in a row were skipped for overflow (20: the default "
        "scale 2**16 reaches 1 after 16 halvings; beyond that no loss scale helps).",
    )
    amp.add_argument(
        "--diagnose_overflow",
        action="store_true",
        help="Check every module's outputs and gradients on every step and name the first non-finite "
        "one (slow; for debugging, any precision). Without it, only skipped fp16 steps are diagnosed.",
    )
    amp.add_argument(
        "--activation_monitor_interval",
        type=int,
        default=100,
        help="Every N training forwards, record each module's largest |activation| relative to the fp16 "
        "maximum 65504 (0 turns it off).",
    )

    output = parser.add_argument_group("evaluation, logging and output")
    output.add_argument(
        "--eval_only", action="store_true", help="Only evaluate the model (or the checkpoint)."
    )
    output.add_argument(
        "--eval_steps", type=int, help="Also evaluate every N optimizer steps (always each epoch)."
    )
    output.add_argument(
        "--metric_for_best_model",
        help="The eval score that decides the best evaluation (accuracy, f1, eval_f1 ...); "
        "eval_results.json then reports its best value and step.",
    )
    output.add_argument(
        "--greater_is_better",
        choices=["true", "false"],
        help="Whether a higher --metric_for_best_model is better (default: false for a loss or "
        "perplexity, else true).",
    )
    output.add_argument(
        "--load_best_model_at_end",
        action="store_true",
        help="Save a checkpoint at each new best evaluation (kept through --save_total_limit) and save "
        "its weights as the final model.",
    )
    output.add_argument(
        "--early_stopping_patience",
        type=int,
        help="Stop after N evaluations in a row without a better --metric_for_best_model.",
    )
    output.add_argument("--logging_steps", type=int, default=10)
    output.add_argument(
        "--report_to",
        choices=["none", "all", *TRACKERS],
        default="none",
        help="Trackers: all (every one installed) or one of accelerate's (wandb, tensorboard, comet_ml, "
        "clearml, mlflow, aim, dvclive, ...); none by default. One not installed is refused.",
    )
    output.add_argument("--project_name", default="amp-recipes", help="W&B project / TensorBoard folder.")
    output.add_argument("--run_name", help="W&B run name.")
    output.add_argument("--wandb_group", help="W&B group, e.g. one per fp32/fp16 pair.")
    output.add_argument("--wandb_job_type", help="W&B job type, e.g. the precision arm.")
    output.add_argument("--wandb_tags", help="Comma-separated W&B tags, e.g. fp16,seed1.")
    output.add_argument(
        "--output_dir", help=f"Where the model, eval_results.json and logs go (default: {output_default})."
    )
    output.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="Replace the run already in --output_dir (its final model stays until the new one is saved).",
    )
    output.add_argument(
        "--checkpointing_steps",
        type=steps_or_epoch,
        help="Save a checkpoint every N optimizer steps, or each 'epoch': checkpoints/checkpoint-<step>, also "
        "as <output_dir>/step_<n> or epoch_<i> (the no_trainer examples' folders).",
    )
    output.add_argument(
        "--resume_from_checkpoint",
        type=checkpoint_or_none,
        help="'latest' (in <output_dir>/checkpoints), a checkpoint path, or a folder a no_trainer example "
        "saved (epoch_<i>, step_<n>); an empty value resumes nothing.",
    )
    output.add_argument("--save_total_limit", type=int, help="Keep only the newest K complete checkpoints.")
    output.add_argument(
        "--push_to_hub",
        action="store_true",
        help="Upload the output folder (model, tokenizer, model card, results; no checkpoints) to the Hub "
        "once the run has finished; refused before training when it cannot work (offline, no token).",
    )
    output.add_argument("--hub_model_id", help="The Hub repo to push to (default: the output folder's name).")
    output.add_argument(
        "--hub_token", help="A Hub token with write access (default: HF_TOKEN or `hf auth login`)."
    )

    examples = parser.add_argument_group("transformers no_trainer examples (docs/migrating.md)")
    examples.add_argument(
        "--hf_example_defaults",
        action="store_true",
        help="The transformers example's defaults for every flag not given (batch 8, learning rate 5e-5, "
        "no weight decay, no warm-up, no clipping, unseeded, the plain shuffle): its numbers, not the recipe's.",
    )
    examples.add_argument(
        "--with_tracking",
        action="store_true",
        help="Trackers on: --report_to's, else every installed one (all), under the example's project "
        "<example>_no_trainer (not --project_name's default).",
    )
    examples.add_argument(
        "--pad_to_max_length",
        action="store_true",
        help="Pad every batch to --max_seq_length (default: each batch to its longest row).",
    )
    examples.add_argument(
        "--dataset_config_name", help="The Hub dataset's configuration (with --dataset_name)."
    )
    examples.add_argument("--config_name", help="The config to load, if not --model_name_or_path's.")
    examples.add_argument("--tokenizer_name", help="The tokenizer to load, if not --model_name_or_path's.")
    examples.add_argument(
        "--use_slow_tokenizer",
        action="store_true",
        help="Passed as use_fast=False; transformers 5 loads the fast tokenizer anyway (a warning says so).",
    )
    examples.add_argument(
        "--trust_remote_code",
        nargs="?",
        const=True,
        default=False,
        type=truthy,
        help="Run a model's own code from the Hub (--trust_remote_code, or --trust_remote_code true); off "
        "unless given. datasets 4 and newer run no loading scripts at all.",
    )
    examples.add_argument(
        "--model_type",
        help="Refused: it trains a model from random weights; the recipes fine-tune a pretrained one.",
    )


# Every numeric flag the recipes share, with the values it accepts (a recipe adds its own):
# checked before anything is loaded, so a typo costs a second, not a model download.
SHARED_RANGES = {
    "per_device_train_batch_size": (lambda v: v >= 1, "at least 1"),
    "per_device_eval_batch_size": (lambda v: v >= 1, "at least 1"),
    "learning_rate": (lambda v: v >= 0, "at least 0"),
    "weight_decay": (lambda v: v >= 0, "at least 0"),
    "num_train_epochs": (lambda v: v >= 1, "at least 1"),
    "max_train_steps": (lambda v: v >= 1, "at least 1"),
    "gradient_accumulation_steps": (lambda v: v >= 1, "at least 1"),
    "warmup_ratio": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "num_warmup_steps": (lambda v: v >= 0, "at least 0"),
    "max_grad_norm": (lambda v: v >= 0, "at least 0 (0 turns clipping off)"),
    "ddp_timeout": (lambda v: v >= 1, "at least 1 (seconds)"),
    "seed": (lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    "fp16_init_scale": (lambda v: v > 0, "positive"),
    "fp16_growth_interval": (lambda v: v >= 1, "at least 1"),
    "fp16_growth_factor": (lambda v: v > 1, "greater than 1"),
    "fp16_backoff_factor": (lambda v: 0 < v < 1, "between 0 and 1"),
    "max_consecutive_skipped_steps": (lambda v: v >= 1, "at least 1"),
    "activation_monitor_interval": (lambda v: v >= 0, "at least 0 (0 turns it off)"),
    "eval_steps": (lambda v: v >= 1, "at least 1"),
    "early_stopping_patience": (lambda v: v >= 1, "at least 1"),
    "logging_steps": (lambda v: v >= 1, "at least 1"),
    "save_total_limit": (lambda v: v >= 1, "at least 1"),
    "preprocessing_num_workers": (lambda v: v >= 1, "at least 1"),
    "dataloader_num_workers": (lambda v: v >= 0, "at least 0"),
}


def check_ranges(parser: argparse.ArgumentParser, args: argparse.Namespace, ranges: dict) -> None:
    """`parser.error` (usage, then one sentence) for the first numeric flag out of its range; a
    flag left unset (None) is not checked. NaN and infinity are out of every range."""
    for name, (valid, rule) in ranges.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and valid(value)):
            written = getattr(parser, "written", {}).get(name, f"--{name}")  # as the user wrote it
            parser.error(f"{written} must be {rule}, not {value}.")


def resolve_gradient_accumulation(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--gradient_accumulation_steps as accelerate will run it. A DeepSpeed launch of `accelerate
    launch` exports its --gradient_accumulation_steps, or `gradient_accumulation_steps` from the
    config's deepspeed_config, as ACCELERATE_GRADIENT_ACCUMULATION_STEPS (other launches export
    nothing, but a user may set it), and accelerate takes that over the script's value silently: a
    run would step every micro-batch while the recipe sized its schedule for another count. Unset, the flag takes the launcher's value; set to another, the run is refused."""
    launcher = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    flag = args.gradient_accumulation_steps
    if launcher is None:
        args.gradient_accumulation_steps = flag or 1
    elif not launcher.isdigit() or int(launcher) < 1:
        parser.error(
            f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS (from accelerate launch, or set by hand) is {launcher!r}, "
            "not a whole number of steps of at least 1: unset it, or correct it."
        )
    elif flag is None:
        args.gradient_accumulation_steps = int(launcher)
    elif flag != int(launcher):
        parser.error(
            f"--gradient_accumulation_steps {flag} disagrees with accelerate launch's {launcher} (its "
            "--gradient_accumulation_steps, or gradient_accumulation_steps in the config's deepspeed_config), "
            "which accelerate would use instead: drop one of them, or make them equal."
        )


def check_shared_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One sentence per bad flag, before anything starts."""
    if args.model_type:
        parser.error(
            f"--model_type {args.model_type} builds a model from random weights; these recipes fine-tune a "
            "pretrained one: give --model_name_or_path (and --config_name for another configuration)."
        )
    missing = TRACKERS.get(args.report_to)
    if missing and importlib.util.find_spec(missing) is None:
        parser.error(f"--report_to {args.report_to} needs the {missing} package: pip install {missing}.")
    check_ranges(parser, args, SHARED_RANGES)
    resolve_gradient_accumulation(parser, args)  # the launcher's value, or the flag's, never both
    if (
        args.gradient_checkpointing
        and args.mixed_precision == "fp8"
        and fp8_backend_choice(args.fp8_backend) == "te"
    ):
        parser.error(
            "--gradient_checkpointing with Transformer Engine's fp8 is not supported: the recompute in the "
            "backward would run outside TE's fp8 autocast. Use --fp8_backend ao (torchao), or drop one."
        )
    if args.torch_compile and args.diagnose_overflow:
        parser.error(
            "--diagnose_overflow adds hooks every step, which makes torch.compile recompile: use one."
        )
    for flag in ("load_best_model_at_end", "early_stopping_patience", "greater_is_better"):
        if getattr(args, flag) and not args.metric_for_best_model:
            parser.error(
                f"--{flag} needs --metric_for_best_model (e.g. accuracy, f1) to compare evaluations."
            )
        if getattr(args, flag) and args.eval_only:
            parser.error(f"--{flag} acts on the evaluations of a training run; --eval_only trains nothing.")
    if args.overwrite_output_dir and args.resume_from_checkpoint:
        parser.error(
            "--overwrite_output_dir starts the run again, --resume_from_checkpoint continues it: use one."
        )
