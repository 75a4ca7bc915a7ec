"""The command-line flags every recipe shares, with Hugging Face names and one meaning each:
training, mixed precision and telemetry, evaluation / logging / output. A recipe adds its own
data and model flags, then calls `check_shared_args`."""

from __future__ import annotations

import argparse

from .telemetry import DEFAULT_MAX_CONSECUTIVE_SKIPPED


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


def add_shared_args(parser: argparse.ArgumentParser, output_default: str) -> None:
    train = parser.add_argument_group("training")
    train.add_argument("--per_device_train_batch_size", type=int, default=32)
    train.add_argument("--per_device_eval_batch_size", type=int, default=128)
    train.add_argument("--learning_rate", type=float, default=2e-5)
    train.add_argument("--weight_decay", type=float, default=0.01)
    train.add_argument("--num_train_epochs", type=int, default=3)
    train.add_argument("--max_train_steps", type=int, help="Stop after N optimizer steps (overrides epochs).")
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument(
        "--warmup_ratio", type=float, default=0.1, help="Fraction of steps with linear LR warm-up."
    )
    train.add_argument("--max_grad_norm", type=float, default=1.0, help="Gradient clipping; 0 turns it off.")
    train.add_argument("--seed", type=int, default=42)
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
        "--optim",
        choices=["auto", "adamw_torch", "adamw_torch_fused"],
        default="auto",
        help="AdamW kernel: auto = fused where torch has it (CUDA, CPU), else foreach (multi-tensor).",
    )

    amp = parser.add_argument_group("mixed precision")
    amp.add_argument(
        "--mixed_precision",
        choices=["no", "fp16", "bf16", "auto"],
        default=None,
        help="Default: whatever `accelerate launch` / its config file says (else fp32). auto: bf16 "
        "where the device has it natively, else fp16 on a Tensor-Core GPU, else fp32.",
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
    output.add_argument("--logging_steps", type=int, default=10)
    output.add_argument("--report_to", choices=["none", "wandb", "tensorboard", "all"], default="none")
    output.add_argument("--project_name", default="amp-recipes", help="W&B project / TensorBoard folder.")
    output.add_argument("--run_name", help="W&B run name.")
    output.add_argument("--wandb_group", help="W&B group, e.g. one per fp32/fp16 pair.")
    output.add_argument("--wandb_job_type", help="W&B job type, e.g. the precision arm.")
    output.add_argument(
        "--output_dir", help=f"Where the model, eval_results.json and logs go (default: {output_default})."
    )
    output.add_argument(
        "--checkpointing_steps", help="Save a checkpoint every N optimizer steps, or each 'epoch'."
    )
    output.add_argument(
        "--resume_from_checkpoint", help="'latest' (in <output_dir>/checkpoints) or a checkpoint path."
    )
    output.add_argument("--save_total_limit", type=int, help="Keep only the newest K complete checkpoints.")


def check_shared_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One sentence per bad flag, before anything starts."""
    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "logging_steps",
        "num_train_epochs",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1.")
    if args.checkpointing_steps not in (None, "epoch") and not (
        args.checkpointing_steps.isdigit() and int(args.checkpointing_steps) > 0
    ):
        parser.error(
            f"--checkpointing_steps must be a positive number of steps or 'epoch', not {args.checkpointing_steps!r}."
        )
    if args.save_total_limit is not None and args.save_total_limit < 1:
        parser.error("--save_total_limit must be at least 1.")
    if not 0 <= args.warmup_ratio < 1:
        parser.error("--warmup_ratio must be in [0, 1).")
    for name, valid, rule in (
        ("fp16_init_scale", lambda v: v > 0, "positive"),
        ("fp16_growth_interval", lambda v: v >= 1, "at least 1"),
        ("fp16_growth_factor", lambda v: v > 1, "greater than 1"),
        ("fp16_backoff_factor", lambda v: 0 < v < 1, "between 0 and 1"),
    ):
        if not valid(getattr(args, name)):
            parser.error(f"--{name} must be {rule}.")
    if args.torch_compile and args.diagnose_overflow:
        parser.error(
            "--diagnose_overflow adds hooks every step, which makes torch.compile recompile: use one."
        )
    if args.max_consecutive_skipped_steps < 1 or args.activation_monitor_interval < 0:
        parser.error(
            "--max_consecutive_skipped_steps must be at least 1, --activation_monitor_interval at least 0."
        )
