"""Fine-tune a BERT-family encoder on a GLUE task (or your own data) with mixed precision.

    accelerate launch recipes/bert_glue.py --task_name mrpc --mixed_precision fp16
    python recipes/bert_glue.py --task_name mrpc --data_dir $GLUE_DIR --model_name_or_path ./my-bert

accelerate owns autocast and the fp16 GradScaler (`--mixed_precision`, or the accelerate
config); this file only asks for them and reports what is really in effect. Copy it as the
template for your own job: everything about the loop and precision is in this one file.
"""

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, GradScalerKwargs, TorchDynamoPlugin, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, get_scheduler

from amp_recipes.checkpoint import PreemptionHandler, resume, save_checkpoint, tracker_run_id
from amp_recipes.data import GLUE_TASKS, InputError, load_glue, load_user_files
from amp_recipes.hardware import device_facts
from amp_recipes.meters import ThroughputMeter, peak_memory_bytes
from amp_recipes.precision import check_model_dtype, choose_auto_precision, format_preflight, preflight
from amp_recipes.telemetry import (
    DEFAULT_MAX_CONSECUTIVE_SKIPPED,
    ActivationMonitor,
    StepTelemetry,
    TrainingDiverged,
)
from amp_recipes.training import (
    RunRecord,
    check_launch,
    load_metric,
    make_collator,
    optimizer_grouped_parameters,
    tokenize_splits,
    train_sampler,
)

logger = get_logger(__name__)


# ----------------------------------------------------------------------------- args
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    data = parser.add_argument_group("data")
    data.add_argument("--task_name", choices=sorted(GLUE_TASKS), help="GLUE task (else use --train_file).")
    data.add_argument(
        "--data_dir",
        default=os.environ.get("GLUE_DIR"),
        help="Classic GLUE TSV folder (default: $GLUE_DIR); without it GLUE comes from the Hub.",
    )
    data.add_argument("--train_file", help="Your own training data: .csv, .tsv, .json or .jsonl.")
    data.add_argument("--validation_file", help="Your own validation data, same format as --train_file.")
    data.add_argument(
        "--text_columns",
        help="Comma-separated text column(s) of your files "
        "(default: sentence1,sentence2 or sentence or text).",
    )
    data.add_argument(
        "--label_column", default="label", help="Label column of your files; float labels mean regression."
    )
    data.add_argument("--max_seq_length", type=int, default=128)
    data.add_argument(
        "--max_train_samples", type=int, help="Use only the first N training examples (quick runs)."
    )
    data.add_argument(
        "--max_eval_samples", type=int, help="Use only the first N examples of each eval split."
    )
    data.add_argument(
        "--group_by_length", action="store_true", help="Batch sequences of similar length (less padding)."
    )
    data.add_argument(
        "--preprocessing_num_workers", type=int, help="Processes for tokenisation (large datasets)."
    )
    data.add_argument(
        "--dataloader_num_workers",
        type=int,
        help="DataLoader worker processes (default: 2 on CUDA, where batches are built while the GPU "
        "computes; 0 elsewhere).",
    )

    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", default="bert-base-uncased", help="Hub id or local directory.")
    model.add_argument(
        "--ignore_mismatched_sizes",
        action="store_true",
        help="Re-initialise a classifier head whose number of labels differs from the task's.",
    )

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
        "--optim",
        choices=["auto", "adamw_torch", "adamw_torch_fused"],
        default="auto",
        help="AdamW kernel: auto = fused on CUDA, foreach (multi-tensor) elsewhere.",
    )

    amp = parser.add_argument_group("mixed precision")
    amp.add_argument(
        "--mixed_precision",
        choices=["no", "fp16", "bf16", "auto"],
        default=None,
        help="Default: whatever `accelerate launch` / its config file says (else fp32). auto: bf16 "
        "where the device has it natively, else fp16 on a Tensor-Core GPU, else fp32.",
    )
    # GradScaler settings (fp16 only), passed to accelerate as GradScalerKwargs; None = torch's default.
    amp.add_argument("--fp16_init_scale", type=float, help="Initial loss scale (torch default 65536).")
    amp.add_argument(
        "--fp16_growth_interval", type=int, help="Steps without overflow before the scale grows (2000)."
    )
    amp.add_argument("--fp16_growth_factor", type=float, help="Scale multiplier on growth (2.0).")
    amp.add_argument("--fp16_backoff_factor", type=float, help="Scale multiplier on overflow (0.5).")
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
        "--output_dir", help="Where the model, eval_results.json and logs go (default: outputs/<task>)."
    )
    output.add_argument(
        "--checkpointing_steps", help="Save a checkpoint every N optimizer steps, or each 'epoch'."
    )
    output.add_argument(
        "--resume_from_checkpoint", help="'latest' (in <output_dir>/checkpoints) or a checkpoint path."
    )
    output.add_argument("--save_total_limit", type=int, help="Keep only the newest K complete checkpoints.")
    args = parser.parse_args(argv)

    if args.task_name and args.train_file:
        parser.error("use either --task_name (GLUE) or --train_file/--validation_file (your data), not both.")
    if not args.task_name and not (args.train_file and args.validation_file):
        parser.error("give --task_name, or both --train_file and --validation_file.")
    for name in (
        "max_seq_length",
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
        if getattr(args, name) is not None and not valid(getattr(args, name)):
            parser.error(f"--{name} must be {rule}.")
    if args.torch_compile and args.diagnose_overflow:
        parser.error(
            "--diagnose_overflow adds hooks every step, which makes torch.compile recompile: use one."
        )
    if args.max_consecutive_skipped_steps < 1 or args.activation_monitor_interval < 0:
        parser.error(
            "--max_consecutive_skipped_steps must be at least 1, --activation_monitor_interval at least 0."
        )
    args.output_dir = args.output_dir or os.path.join("outputs", args.task_name or "custom")
    return args


def evaluate(model, dataloader, metric, accelerator, is_regression):
    model.eval()
    # fork_rng: iterating a DataLoader draws from the global RNG, and evaluating must not change
    # the dropout and shuffling that training sees next (same run, whatever --eval_steps is).
    cuda_devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    samples = 0
    with torch.random.fork_rng(devices=cuda_devices), torch.inference_mode():
        for batch in dataloader:
            logits = model(**batch).logits
            predictions = logits.squeeze(-1).float() if is_regression else logits.argmax(dim=-1)
            # gather_for_metrics drops the samples the last batch repeats to fill every process.
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions.cpu(), references=references.cpu())
            samples += len(references)
    model.train()
    return {**metric.compute(), "samples": samples}


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)

    # ------------------------------------------------------------------------- accelerator
    auto_reason = None
    if args.mixed_precision == "auto":
        args.mixed_precision, auto_reason = choose_auto_precision(device_facts())
    scaler_kwargs = {
        name: getattr(args, f"fp16_{name}")
        for name in ("init_scale", "growth_interval", "growth_factor", "backoff_factor")
        if getattr(args, f"fp16_{name}") is not None
    }
    # mixed_precision=None lets `accelerate launch --mixed_precision` or the config file decide.
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        kwargs_handlers=[GradScalerKwargs(**scaler_kwargs)] if scaler_kwargs else None,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        # Shuffling seeded by (seed, epoch): a resumed run sees the same batches.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        # torch.compile of the prepared model, by accelerate (also settable in its config file).
        dynamo_plugin=TorchDynamoPlugin(backend=args.torch_compile_backend) if args.torch_compile else None,
    )
    check_launch(accelerator)
    # Device, Tensor Cores, bf16, the precision really in effect and who chose it; refuses what
    # cannot work (bf16 on a pre-Ampere GPU), warns about what silently misbehaves.
    precision = preflight(accelerator, args.mixed_precision, auto_reason)
    logger.info(format_preflight(precision), main_process_only=True)
    for warning in precision["preflight_warnings"]:
        logger.warning(warning, main_process_only=True)
    if scaler_kwargs and precision["precision_in_effect"] != "fp16":
        logger.warning(
            "The --fp16_* GradScaler flags have no effect: this run is not fp16.", main_process_only=True
        )
    set_seed(args.seed)

    # ------------------------------------------------------------------------- data
    data_started = time.perf_counter()
    if args.task_name:
        task = load_glue(args.task_name, args.data_dir)
    else:
        text_columns = tuple(args.text_columns.split(",")) if args.text_columns else None
        task = load_user_files(args.train_file, args.validation_file, text_columns, args.label_column)
    if args.max_train_samples:
        task.splits["train"] = task.splits["train"].select(
            range(min(args.max_train_samples, task.splits["train"].num_rows))
        )
    if args.max_eval_samples:
        for split in task.eval_splits:
            task.splits[split] = task.splits[split].select(
                range(min(args.max_eval_samples, task.splits[split].num_rows))
            )

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        config = AutoConfig.from_pretrained(
            args.model_name_or_path, num_labels=task.num_labels, finetuning_task=task.name
        )
    except OSError as error:
        raise InputError(
            f"Could not load model {args.model_name_or_path!r} ({str(error).splitlines()[0]}). Offline? Pass a local "
            "directory holding config.json, the weights and the tokenizer as --model_name_or_path, and set HF_HUB_OFFLINE=1."
        ) from error
    # The main process tokenises and caches; the others reuse the cache.
    with accelerator.main_process_first():
        tokenized = tokenize_splits(task, tokenizer, args.max_seq_length, args.preprocessing_num_workers)
    data_seconds = time.perf_counter() - data_started  # a second run reads the tokenised cache
    logger.info(f"Data ready in {data_seconds:.1f} s", main_process_only=True)

    collator = make_collator(tokenizer, accelerator.mixed_precision)
    on_cuda = accelerator.device.type == "cuda"
    num_workers = args.dataloader_num_workers if args.dataloader_num_workers is not None else 2 * on_cuda
    loader_kwargs = {"collate_fn": collator, "pin_memory": on_cuda, "num_workers": num_workers}
    loader_kwargs["persistent_workers"] = num_workers > 0  # no worker restart each epoch
    sampler = train_sampler(
        tokenized["train"], args.per_device_train_batch_size, args.group_by_length, args.seed
    )
    train_dataloader = DataLoader(
        tokenized["train"],
        batch_size=args.per_device_train_batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        **loader_kwargs,
        # Its own generator: starting an epoch's iterator then draws nothing from the global RNG
        # (dropout), so a run resumed mid-epoch continues the same random stream.
        generator=torch.Generator().manual_seed(args.seed),
    )
    eval_dataloaders = {
        split: DataLoader(
            tokenized[split],
            batch_size=args.per_device_eval_batch_size,
            **loader_kwargs,
        )
        for split in task.eval_splits
    }

    # ------------------------------------------------------------------------- model
    if not task.is_regression:
        config.id2label = dict(enumerate(task.label_names))
        config.label2id = {name: i for i, name in enumerate(task.label_names)}
    try:
        # float32 whatever dtype the checkpoint was saved in: AMP needs fp32 master weights.
        model = AutoModelForSequenceClassification.from_pretrained(
            args.model_name_or_path,
            config=config,
            ignore_mismatched_sizes=args.ignore_mismatched_sizes,
            dtype=torch.float32,
        )
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        raise InputError(
            f"The classifier head of {args.model_name_or_path!r} does not have the {task.num_labels} output(s) "
            "this task needs; pass --ignore_mismatched_sizes to start a new head."
        ) from error
    check_model_dtype(model, precision["precision_in_effect"])

    # ------------------------------------------------------------------------- optimizer
    # Fused AdamW (one kernel for all parameters) is fastest on CUDA; foreach elsewhere. With fp16
    # a fused optimizer skips overflowing steps itself; StepTelemetry detects those for the scheduler.
    fused = args.optim == "adamw_torch_fused" or (args.optim == "auto" and accelerator.device.type == "cuda")
    optimizer = torch.optim.AdamW(
        optimizer_grouped_parameters(model, args.weight_decay),
        lr=args.learning_rate,
        fused=fused or None,
        foreach=None if fused else True,
    )

    # ------------------------------------------------------------------------- prepare
    model, optimizer, train_dataloader, *eval_loaders = accelerator.prepare(
        model, optimizer, train_dataloader, *eval_dataloaders.values()
    )
    eval_dataloaders = dict(zip(eval_dataloaders, eval_loaders, strict=True))
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or steps_per_epoch * args.num_train_epochs
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    # The prepared scheduler steps once per process per optimizer step, hence the factor.
    scheduler_steps = max_train_steps * accelerator.num_processes
    lr_scheduler = accelerator.prepare(
        get_scheduler(
            "linear",
            optimizer,
            num_warmup_steps=int(args.warmup_ratio * scheduler_steps),
            num_training_steps=scheduler_steps,
        )
    )
    metric = load_metric(task.metric_config)

    # ------------------------------------------------------------------------- resume
    checkpoints_dir = Path(args.output_dir) / "checkpoints"
    identity = {  # a checkpoint resumes only into a run of the same kind
        "task_name": task.name,
        "label_names": list(task.label_names or []),
        "model": f"{config.model_type}/{config.num_hidden_layers}x{config.hidden_size}",
        "seed": args.seed,
    }
    position = {
        "global_step": 0,
        "epoch": 0,
        "batches_in_epoch": 0,
        "samples_seen": 0,
        "tracker_run_id": None,
    }
    if args.resume_from_checkpoint:
        position = resume(accelerator, args.resume_from_checkpoint, checkpoints_dir, identity, logger)
    # Loss scale, skipped steps, grad norm, non-finite guard; created after a resume has restored
    # the GradScaler, so it starts from the checkpoint's loss scale.
    telemetry = StepTelemetry(
        accelerator, model, args.max_consecutive_skipped_steps, diagnose_every_step=args.diagnose_overflow
    )
    telemetry.load_state_dict(position.get("telemetry", {}))
    # Its hooks come and go on sampled steps, which would make a compiled model recompile.
    monitor_interval = 0 if args.torch_compile else args.activation_monitor_interval
    activations = ActivationMonitor(accelerator.unwrap_model(model), monitor_interval)

    # SDPA (fused attention kernels) is transformers' default where the model supports it.
    attn_implementation = accelerator.unwrap_model(model).config._attn_implementation
    logger.info(
        f"Attention: {attn_implementation}; optimizer: {'fused' if fused else 'foreach'} AdamW",
        main_process_only=True,
    )
    total_batch_size = (
        args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    )
    run_config = {
        **vars(args),
        **precision,
        "total_train_batch_size": total_batch_size,
        "max_train_steps": max_train_steps,
        "num_processes": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "attn_implementation": attn_implementation,
    }
    if args.report_to != "none":
        wandb_kwargs = {"name": args.run_name, "group": args.wandb_group, "job_type": args.wandb_job_type}
        if position["tracker_run_id"]:  # continue the same W&B run after a resume
            wandb_kwargs.update(id=position["tracker_run_id"], resume="allow")
        accelerator.init_trackers(
            args.project_name,
            config={
                k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in run_config.items()
            },
            init_kwargs={"wandb": {k: v for k, v in wandb_kwargs.items() if v}},
        )
    record = RunRecord(
        args.output_dir,
        enabled=accelerator.is_main_process,
        resume_step=position["global_step"] if args.resume_from_checkpoint else None,
    )
    logger.info(
        f"{task.name}: {tokenized['train'].num_rows} training examples, {num_epochs} epoch(s), "
        f"{max_train_steps} optimizer steps, total batch size {total_batch_size}",
        main_process_only=True,
    )

    # ------------------------------------------------------------------------- train
    def run_evaluation(step, epoch):
        nonlocal eval_seconds
        started = time.perf_counter()
        results = {"epoch": epoch}
        for split, dataloader in eval_dataloaders.items():
            suffix = "_mm" if split == "validation_mismatched" else ""
            scores = evaluate(model, dataloader, metric, accelerator, task.is_regression)
            results.update({f"eval_{name}{suffix}": value for name, value in scores.items()})
        logger.info(f"step {step}: {results}", main_process_only=True)
        accelerator.log(results, step=step)
        record.log(results, step)
        duration = time.perf_counter() - started
        eval_seconds += duration
        meter.exclude(duration)  # throughput counts training time only
        return results

    def checkpoint(epoch, batches_in_epoch):
        telemetry.check_finite(
            completed_steps, precision["precision_in_effect"]
        )  # never save spoiled weights
        run_position = {
            "global_step": completed_steps,
            "epoch": epoch,
            "batches_in_epoch": batches_in_epoch,
            "samples_seen": samples_seen,
            "tracker_run_id": tracker_run_id(accelerator),
            "mixed_precision": accelerator.mixed_precision,
            "grad_scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
            "telemetry": telemetry.state_dict(),
            **identity,
        }
        path = save_checkpoint(
            accelerator, checkpoints_dir, completed_steps, run_position, args.save_total_limit
        )
        logger.info(f"Saved checkpoint {path}", main_process_only=True)
        return path

    preemption = PreemptionHandler()
    meter = ThroughputMeter(accelerator.device)
    completed_steps, samples_seen = position["global_step"], position["samples_seen"]
    progress = tqdm(
        range(max_train_steps),
        initial=completed_steps,
        disable=not accelerator.is_local_main_process,
        desc="Training",
    )
    train_started = time.perf_counter()
    train_samples, train_tokens, eval_seconds, results = 0, 0, 0.0, {}
    if args.eval_only:  # evaluate the model (or the resumed checkpoint) and stop
        results = run_evaluation(completed_steps, position["epoch"])
        summary = {**results, **precision, "task_name": task.name, "num_processes": accelerator.num_processes}
        record.write_results({**summary, "model_name_or_path": args.model_name_or_path})
        preemption.restore()
        accelerator.end_training()
        return summary
    model.train()
    for epoch in range(position["epoch"], num_epochs):
        train_dataloader.set_epoch(epoch)  # the epoch's shuffle depends on (seed, epoch) only
        skipped = position["batches_in_epoch"] if epoch == position["epoch"] else 0
        batches = accelerator.skip_first_batches(train_dataloader, skipped) if skipped else train_dataloader
        batches_in_epoch = skipped
        for batch in batches:
            grad_norm = None
            with accelerator.accumulate(model), telemetry.watch():
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # the norm of the unscaled gradients, clipped if asked
                    grad_norm = accelerator.clip_grad_norm_(
                        model.parameters(), args.max_grad_norm or math.inf
                    )
                optimizer.step()
                # accelerate holds the scheduler back on accumulation steps and on skipped fp16 steps,
                # but misses the skips of a fused optimizer: ask the GradScaler's scale instead.
                step_skipped = telemetry.step_skipped()
                if not step_skipped:
                    lr_scheduler.step()
                optimizer.zero_grad()
            telemetry.observe(loss, grad_norm)  # stays on the device: no per-step synchronisation
            batches_in_epoch += 1
            samples_seen += batch["input_ids"].shape[0] * accelerator.num_processes
            meter.update(batch)
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            progress.update(1)
            if step_skipped or args.diagnose_overflow:
                where = telemetry.where_nonfinite(batch)
                if step_skipped:
                    logger.warning(
                        f"step {completed_steps}: fp16 overflow, optimizer step skipped, loss scale "
                        f"{telemetry.scale_used:g} -> {telemetry.loss_scale:g}; first non-finite value: {where}",
                        main_process_only=True,
                    )
                elif where:
                    logger.warning(
                        f"step {completed_steps}: first non-finite value: {where}", main_process_only=True
                    )
                if telemetry.should_stop():
                    if args.checkpointing_steps:  # skipped steps left the weights as they were: still good
                        checkpoint(epoch, batches_in_epoch)
                    raise TrainingDiverged(telemetry.stop_message(completed_steps, where))
            if completed_steps % args.logging_steps == 0 or completed_steps == max_train_steps:
                throughput = meter.read(accelerator)
                train_samples += throughput["samples"]
                train_tokens += throughput["tokens"]
                logs = {
                    **telemetry.read(),  # loss, grad_norm; fp16: loss_scale, skipped steps and rate
                    "learning_rate": lr_scheduler.get_last_lr()[0],
                    "epoch": completed_steps / steps_per_epoch,
                    **{
                        k: throughput[k]
                        for k in ("samples_per_second", "tokens_per_second", "padding_fraction")
                    },
                }
                logs.update({f"fp16_range/{name}": ratio for name, ratio in activations.read().items()})
                telemetry.check_finite(completed_steps, precision["precision_in_effect"])
                postfix = {"loss": f"{logs['loss']:.4f}", "lr": f"{logs['learning_rate']:.2e}"}
                if telemetry.fp16:
                    postfix.update(scale=f"{logs['loss_scale']:g}", skipped=logs["skipped_steps"])
                progress.set_postfix(postfix)
                accelerator.log(logs, step=completed_steps)
                record.log(logs, completed_steps)
            if args.eval_steps and completed_steps % args.eval_steps == 0:
                results = run_evaluation(completed_steps, epoch + 1)
            if (
                args.checkpointing_steps not in (None, "epoch")
                and completed_steps % int(args.checkpointing_steps) == 0
            ):
                checkpoint(epoch, batches_in_epoch)
            if preemption.should_stop(accelerator):
                path = checkpoint(epoch, batches_in_epoch)
                logger.warning(
                    f"Stopped by {preemption.signal_name or 'a signal on another process'} after step "
                    f"{completed_steps}; checkpoint {path}. Continue with --resume_from_checkpoint latest.",
                    main_process_only=True,
                )
                preemption.restore()
                accelerator.end_training()
                raise SystemExit(143 if preemption.signal_name != "SIGINT" else 130)
            if completed_steps >= max_train_steps:
                break
        if not (args.eval_steps and completed_steps % args.eval_steps == 0):
            results = run_evaluation(completed_steps, epoch + 1)
        if args.checkpointing_steps == "epoch":
            checkpoint(epoch + 1, 0)
    train_seconds = time.perf_counter() - train_started - eval_seconds
    progress.close()
    preemption.restore()
    activations.remove()
    telemetry.check_finite(completed_steps, precision["precision_in_effect"])

    # ------------------------------------------------------------------------- save
    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(
        args.output_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    summary = {
        **results,
        **precision,
        "task_name": task.name,
        "model_name_or_path": args.model_name_or_path,
        "train_steps": completed_steps,
        "train_runtime_seconds": train_seconds,
        "train_samples_per_second": train_samples / train_seconds,
        "train_tokens_per_second": train_tokens / train_seconds,
        "peak_memory_bytes": peak_memory_bytes(accelerator.device),
        "num_processes": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "total_train_batch_size": total_batch_size,
        "attn_implementation": attn_implementation,
        "data_preparation_seconds": data_seconds,
        **telemetry.summary(),
        "fp16_range": activations.read(),  # max |activation| / 65504 of the modules closest to it
    }
    if telemetry.fp16:
        logger.info(
            f"fp16: {telemetry.skipped_steps} of {telemetry.optimizer_steps} optimizer steps skipped, "
            f"final loss scale {telemetry.loss_scale:g}",
            main_process_only=True,
        )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        record.write_results(summary)  # written last: its presence means the run finished
    logger.info(f"Saved model and eval_results.json to {args.output_dir}: {results}", main_process_only=True)
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    try:
        main()
    except (InputError, TrainingDiverged) as error:
        sys.exit(f"error: {error}")
