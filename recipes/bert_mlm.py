"""Domain-adaptive masked-language-model training of a BERT-family encoder on your own text.

    accelerate launch recipes/bert_mlm.py --train_file notes.txt --mixed_precision bf16
    python recipes/bert_mlm.py --train_file tickets.csv --text_column body --model_name_or_path ./my-bert

Texts come one per line (.txt) or from a column of a .csv/.tsv/.json/.jsonl file; they are
tokenised, concatenated and cut into blocks of --max_seq_length tokens; 15% of the tokens are
masked (BERT's 80/10/10 rule). The run reports the masked-LM loss and perplexity on a held-out
split and saves a model that `recipes/bert_glue.py --model_name_or_path <output_dir>` fine-tunes.
Precision, tracking, checkpointing and fp16 telemetry work exactly as in bert_glue.py.
"""

import argparse
import logging
import math
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
from transformers import AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling, get_scheduler

from amp_recipes.arguments import add_shared_args, add_worker_args, check_shared_args
from amp_recipes.checkpoint import PreemptionHandler, resume
from amp_recipes.data import InputError, load_text_files
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
from amp_recipes.training import RunRecord, loader_settings, pad_multiple, tokenize_and_group

logger = get_logger(__name__)


# ----------------------------------------------------------------------------- args
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    data = parser.add_argument_group("data")
    data.add_argument(
        "--train_file", required=True, help="Your text: .txt (one per line), .csv, .tsv, .json, .jsonl."
    )
    data.add_argument(
        "--validation_file", help="Held-out text, same format (default: a split of --train_file)."
    )
    data.add_argument("--text_column", default="text", help="Text column of csv/json files.")
    data.add_argument(
        "--validation_split_percentage",
        type=float,
        default=5.0,
        help="Share held out without --validation_file.",
    )
    data.add_argument("--max_seq_length", type=int, default=128, help="Tokens per training block.")
    data.add_argument("--mlm_probability", type=float, default=0.15, help="Share of tokens masked.")
    add_worker_args(data)
    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", default="bert-base-uncased", help="Hub id or local directory.")
    add_shared_args(parser, output_default="outputs/mlm")
    parser.set_defaults(learning_rate=5e-5, per_device_train_batch_size=32, num_train_epochs=1)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_shared_args(parser, args)
    if args.max_seq_length < 8 or not 0 < args.mlm_probability < 1:
        parser.error("--max_seq_length must be at least 8 and --mlm_probability in (0, 1).")
    args.output_dir = args.output_dir or "outputs/mlm"
    return args


# ----------------------------------------------------------------------------- evaluate
def evaluate(model, dataloader, accelerator, seed):
    """Masked-LM loss (mean over masked tokens) and perplexity on the held-out blocks. The masks
    are drawn from a fixed seed, so every evaluation scores the same masked tokens."""
    model.eval()
    cuda_devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    loss_sum = torch.zeros((), device=accelerator.device)
    masked = torch.zeros((), device=accelerator.device)
    with torch.random.fork_rng(devices=cuda_devices), torch.inference_mode():
        torch.manual_seed(seed)
        for batch in dataloader:
            loss = model(**batch).loss.float()
            count = (batch["labels"] != -100).sum()
            loss_sum += loss * count
            masked += count
    loss_sum, masked = accelerator.reduce(torch.stack([loss_sum, masked]), reduction="sum").tolist()
    model.train()
    loss = loss_sum / max(masked, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50)), "masked_tokens": int(masked)}


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
    precision = start_run(accelerator, args, logger)  # preflight block, warnings, seed

    # ------------------------------------------------------------------------- data
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    except OSError as error:
        raise InputError(
            f"Could not load model {args.model_name_or_path!r} ({str(error).splitlines()[0]}). Offline? Pass a local "
            "directory holding config.json, the weights and the tokenizer, and set HF_HUB_OFFLINE=1."
        ) from error
    data_started = time.perf_counter()  # load + tokenise: a second run reads datasets' cache
    splits = load_text_files(
        args.train_file, args.validation_file, args.text_column, args.validation_split_percentage, args.seed
    )
    with accelerator.main_process_first():
        blocks = tokenize_and_group(splits, tokenizer, args.max_seq_length, args.preprocessing_num_workers)
    data_seconds = time.perf_counter() - data_started
    # Masks BERT-style (80% [MASK], 10% random, 10% kept); pads the last short block to a multiple of 8.
    collator = DataCollatorForLanguageModeling(
        tokenizer,
        mlm_probability=args.mlm_probability,
        pad_to_multiple_of=pad_multiple(accelerator.mixed_precision),
    )
    loader_kwargs = loader_settings(accelerator, collator, args.dataloader_num_workers)
    train_dataloader = DataLoader(
        blocks["train"],
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
        **loader_kwargs,
    )
    # Evaluation masks are drawn in this process (no workers), where evaluate() seeds them: worker
    # processes would draw from their own RNGs, and two evaluations of the same weights would differ.
    eval_dataloader = DataLoader(
        blocks["validation"],
        batch_size=args.per_device_eval_batch_size,
        **{**loader_kwargs, "num_workers": 0, "persistent_workers": False},
    )

    # ------------------------------------------------------------------------- model
    try:  # float32 whatever dtype the checkpoint was saved in: AMP needs fp32 master weights
        model = AutoModelForMaskedLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    except OSError as error:
        raise InputError(f"Could not load model {args.model_name_or_path!r}: {error}") from error
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
        "linear", optimizer, int(args.warmup_ratio * scheduler_steps), scheduler_steps
    )

    # ------------------------------------------------------------------------- prepare
    model, optimizer, train_dataloader, lr_scheduler, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler, eval_dataloader
    )

    # ------------------------------------------------------------------------- resume
    checkpoints_dir = Path(args.output_dir) / "checkpoints"
    config = accelerator.unwrap_model(model).config
    identity = {
        "objective": "mlm",
        "model": f"{config.model_type}/{config.num_hidden_layers}x{config.hidden_size}",
        "seed": args.seed,
    }
    position = {"global_step": 0, "epoch": 0, "batches_in_epoch": 0, "tracker_run_id": None}
    if args.resume_from_checkpoint:
        position = resume(accelerator, args.resume_from_checkpoint, checkpoints_dir, identity, logger)
    telemetry = StepTelemetry(accelerator, model, args.max_consecutive_skipped_steps, args.diagnose_overflow)
    telemetry.load_state_dict(position.get("telemetry", {}))
    activations = ActivationMonitor(
        accelerator.unwrap_model(model), 0 if args.torch_compile else args.activation_monitor_interval
    )
    run_config = {
        **vars(args),
        **precision,
        "max_train_steps": max_train_steps,
        "train_blocks": blocks["train"].num_rows,
    }
    init_trackers(accelerator, args, run_config, position["tracker_run_id"])
    record = RunRecord(
        args.output_dir,
        accelerator.is_main_process,
        position["global_step"] if args.resume_from_checkpoint else None,
    )
    logger.info(
        f"mlm: {blocks['train'].num_rows} blocks of {args.max_seq_length} tokens, {num_epochs} epoch(s), "
        f"{max_train_steps} optimizer steps; {blocks['validation'].num_rows} held-out blocks",
        main_process_only=True,
    )

    # ------------------------------------------------------------------------- train
    def run_evaluation(step):
        started = time.perf_counter()
        scores = evaluate(model, eval_dataloader, accelerator, args.seed)
        results = {f"eval_{name}": value for name, value in scores.items()}
        logger.info(f"step {step}: {results}", main_process_only=True)
        accelerator.log(results, step=step)
        record.log(results, step)
        meter.exclude(time.perf_counter() - started)  # throughput counts training time only
        return results

    # checkpoint(step, epoch, batches_in_epoch): crash-safe, with what a resume needs
    checkpoint = partial(
        save_run_checkpoint, accelerator, telemetry, args, identity, precision["precision_in_effect"]
    )

    completed_steps, results, train_seconds, train_tokens = position["global_step"], {}, 0.0, 0
    meter = ThroughputMeter(accelerator.device)
    if args.eval_only:
        results = run_evaluation(completed_steps)
        record.write_results({**results, **precision, "model_name_or_path": args.model_name_or_path})
        accelerator.end_training()
        return results
    preemption = PreemptionHandler()
    progress = tqdm(
        range(max_train_steps),
        initial=completed_steps,
        disable=not accelerator.is_local_main_process,
        desc="MLM",
    )
    model.train()
    for epoch in range(position["epoch"], num_epochs):
        train_dataloader.set_epoch(epoch)
        skipped = position["batches_in_epoch"] if epoch == position["epoch"] else 0
        batches = accelerator.skip_first_batches(train_dataloader, skipped) if skipped else train_dataloader
        for batches_in_epoch, batch in enumerate(batches, start=skipped + 1):
            grad_norm = None
            with accelerator.accumulate(model), telemetry.watch():
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = clip_and_measure(accelerator, model, args.max_grad_norm)
                optimizer.step()
                step_skipped = telemetry.step_skipped()  # fp16 overflow, fused optimizers included
                if not step_skipped:
                    lr_scheduler.step()
                optimizer.zero_grad()
            telemetry.observe(loss, grad_norm)
            meter.update(batch)
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            progress.update(1)
            save = partial(checkpoint, completed_steps, epoch, batches_in_epoch)
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
                train_seconds += throughput["seconds"]
                train_tokens += throughput["tokens"]
            if args.eval_steps and completed_steps % args.eval_steps == 0:
                results = run_evaluation(completed_steps)
            if (
                args.checkpointing_steps not in (None, "epoch")
                and completed_steps % int(args.checkpointing_steps) == 0
            ):
                save()
            stop_if_preempted(preemption, accelerator, completed_steps, save, logger)
            if completed_steps >= max_train_steps:
                break
        results = run_evaluation(completed_steps)
        if args.checkpointing_steps == "epoch":
            checkpoint(completed_steps, epoch + 1, 0)
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
        **telemetry.summary(),
        "model_name_or_path": args.model_name_or_path,
        "train_steps": completed_steps,
        "train_tokens_per_second": train_tokens / max(train_seconds, 1e-9),
        "peak_memory_bytes": peak_memory_bytes(accelerator.device),
        "data_preparation_seconds": data_seconds,
        "fp16_range": activations.read(),
    }
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
