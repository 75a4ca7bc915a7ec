"""Domain-adaptive masked-language-model training of a BERT-family encoder on your own text.

    accelerate launch recipes/bert_mlm.py --train_file notes.txt --mixed_precision bf16
    python recipes/bert_mlm.py --train_file tickets.csv --text_column body --model_name_or_path ./my-bert

Texts come one per line (.txt) or from a column of a .csv/.tsv/.json/.jsonl file; they are
tokenised, concatenated and cut into blocks of --max_seq_length tokens; 15% of the tokens are
masked (BERT's 80/10/10 rule). The run reports the masked-LM loss and perplexity on a held-out
split and saves a model that `recipes/bert_glue.py --model_name_or_path <output_dir>` fine-tunes.
Precision, tracking, checkpointing and fp16 telemetry work exactly as in bert_glue.py; every
precision-specific line is marked `# AMP:` (`grep -n "AMP:" recipes/bert_mlm.py` lists them).
"""

import argparse
import logging
import math
import sys
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, GradScalerKwargs, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForMaskedLM, AutoTokenizer, get_scheduler

from amp_recipes.arguments import add_shared_args, add_worker_args, check_ranges, check_shared_args
from amp_recipes.batches import loader_settings, pad_multiple
from amp_recipes.checkpoint import PreemptionHandler, resume, save_checkpoint
from amp_recipes.compile import CompileMonitor, dynamo_plugin
from amp_recipes.errors import TrainingDiverged, model_load_errors, one_sentence_errors
from amp_recipes.meters import ThroughputMeter, peak_memory_bytes
from amp_recipes.mlm import SeededMaskCollator, load_text_files, tokenize_and_group
from amp_recipes.optim import check_every_parameter_trains, make_optimizer, training_schedule
from amp_recipes.outputs import claim_output_dir, plain_state_dict
from amp_recipes.precision import (
    check_model_dtype,
    fp8_layer_report,
    fp8_recipe_kwargs,
    log_fp8_report,
    log_preflight,
    preflight,
    resolve_mixed_precision,
)
from amp_recipes.records import RunRecord, init_trackers, weights_fingerprint, write_final_figures
from amp_recipes.telemetry import ActivationMonitor, StepTelemetry

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
    check_shared_args(parser, args)  # every shared numeric flag in range, no conflicting flags
    ranges = {
        "max_seq_length": (lambda v: v >= 8, "at least 8"),
        "mlm_probability": (lambda v: 0 < v < 1, "in (0, 1)"),
        "validation_split_percentage": (
            lambda v: 0 < v < 100,
            "between 0 and 100 (or give --validation_file)",
        ),
    }
    check_ranges(parser, args, ranges)
    args.output_dir = args.output_dir or "outputs/mlm"
    return args


# ----------------------------------------------------------------------------- data
def load_data(args, tokenizer, accelerator):
    """Blocks of --max_seq_length tokens from your texts, and their DataLoaders."""
    with accelerator.main_process_first():  # the main process loads and tokenises, the others read its cache
        splits = load_text_files(
            args.train_file,
            args.validation_file,
            args.text_column,
            args.validation_split_percentage,
            args.seed,
        )
        blocks = tokenize_and_group(splits, tokenizer, args.max_seq_length, args.preprocessing_num_workers)
    # Masks BERT-style (80% [MASK], 10% random, 10% kept) as batches are built, drawn from the seed
    # and each batch's tokens: a resumed run masks every batch as an uninterrupted one does.
    # AMP: fp16/bf16 batches (a last, shorter block) are padded to a multiple of 8, for Tensor Cores.
    collator = SeededMaskCollator(
        tokenizer,
        mlm_probability=args.mlm_probability,
        pad_to_multiple_of=pad_multiple(accelerator.mixed_precision),
        seed=args.seed,
    )
    loader_kwargs = loader_settings(accelerator, collator, args.dataloader_num_workers)
    train_dataloader = DataLoader(
        blocks["train"],
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        # Its own generator: starting an epoch's iterator then draws nothing from the global RNG
        # (dropout), so a run resumed mid-epoch continues the same random stream.
        generator=torch.Generator().manual_seed(args.seed),
        **loader_kwargs,
    )
    # The same collator: every evaluation masks the held-out blocks the same way.
    eval_dataloader = DataLoader(
        blocks["validation"], batch_size=args.per_device_eval_batch_size, **loader_kwargs
    )
    logger.info(
        f"mlm: {blocks['train'].num_rows} training and {blocks['validation'].num_rows} held-out blocks "
        f"of {args.max_seq_length} tokens"
    )
    return train_dataloader, eval_dataloader


# ----------------------------------------------------------------------------- evaluate
def evaluate(model, dataloader, accelerator):
    """Masked-LM loss (mean over masked tokens) and perplexity on the held-out blocks. Their masks
    come from the seed and the blocks' tokens, so every evaluation scores the same masked tokens."""
    model.eval()
    loss_sum, masked = 0.0, 0
    # fork_rng: iterating a DataLoader draws from the global RNG, and evaluating must not change
    # the dropout and shuffling that training sees next (same run, whatever --eval_steps is).
    cuda_devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    # AMP: no_grad, not inference_mode: torchao's fp8 Linear layers fail under it (pytorch/ao#643).
    with torch.random.fork_rng(devices=cuda_devices), torch.no_grad():
        for batch in dataloader:
            logits = model(**batch).logits.float()  # AMP: the loss in fp32, whatever autocast returned
            labels = batch["labels"]
            token_losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
            # Per block, so that gather_for_metrics can drop the blocks the last batch repeats to
            # give every process a full batch (a plain sum over processes would count them twice).
            block_sums, block_counts = accelerator.gather_for_metrics(
                (token_losses.sum(dim=1), (labels != -100).sum(dim=1))
            )
            loss_sum += block_sums.sum().item()
            masked += int(block_counts.sum())
    model.train()
    loss = loss_sum / max(masked, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50)), "masked_tokens": masked}


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)

    # ------------------------------------------------------------------------- accelerator
    # AMP: `auto` becomes bf16 where the device has it natively, else fp16 on a Tensor-Core GPU, else fp32.
    mixed_precision, auto_reason = resolve_mixed_precision(args.mixed_precision)
    accelerator = Accelerator(
        mixed_precision=mixed_precision,  # AMP: fp16/bf16/fp8/no; None: `accelerate launch` or its config decides
        kwargs_handlers=[  # AMP: fp16's loss scaling: accelerate creates the GradScaler with these settings
            GradScalerKwargs(
                init_scale=args.fp16_init_scale,
                growth_factor=args.fp16_growth_factor,
                backoff_factor=args.fp16_backoff_factor,
                growth_interval=args.fp16_growth_interval,
            ),
            # AMP: fp8 only: prepare() swaps Linear layers for torchao's/TE's fp8 ones, the rest runs in bf16.
            *fp8_recipe_kwargs(mixed_precision, args.fp8_backend),  # refused where fp8 cannot run
            InitProcessGroupKwargs(timeout=timedelta(seconds=args.ddp_timeout)),  # a hung rank ends the run
        ],
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # --torch_compile: one graph for every padded length, the repeated layer compiled once.
        dynamo_plugin=dynamo_plugin(args),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True,  # shuffling seeded by (seed, epoch): a resume sees the same batches
            non_blocking=torch.cuda.is_available(),  # copies to the GPU from pinned memory, without a stall
        ),
        log_with=None if args.report_to == "none" else args.report_to,  # W&B / TensorBoard
        project_dir=args.output_dir,
    )
    # AMP: the precision really in effect and who chose it; refuses what cannot work (bf16 on a
    # pre-Ampere GPU, an unconnected multi-process launch), warns about what silently misbehaves.
    precision = preflight(accelerator, mixed_precision, auto_reason)
    log_preflight(precision, logger)
    precision_in_effect = precision["precision_in_effect"]
    output = claim_output_dir(accelerator, args)  # refuses a folder that holds a run; locks it (PID)
    set_seed(args.seed)

    # ------------------------------------------------------------------------- data
    with model_load_errors(args.model_name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    train_dataloader, eval_dataloader = load_data(args, tokenizer, accelerator)

    # ------------------------------------------------------------------------- model
    with model_load_errors(args.model_name_or_path):
        # AMP: fp32 master weights whatever the checkpoint's dtype; autocast casts per operation.
        model = AutoModelForMaskedLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    config = model.config
    check_model_dtype(model, precision_in_effect, accelerator.distributed_type)  # AMP: no .half() weights
    initial_weights = weights_fingerprint(model)  # sha256; the arms of a paired run start equal

    # ------------------------------------------------------------------------- optimizer
    optimizer = make_optimizer(model, args, accelerator.device)  # AdamW, fused where torch has it
    schedule = training_schedule(len(train_dataloader), accelerator, args)  # optimizer steps per process
    lr_scheduler = get_scheduler(
        "linear", optimizer, int(args.warmup_ratio * schedule.scheduler_steps), schedule.scheduler_steps
    )

    # ------------------------------------------------------------------------- prepare
    # AMP: prepare() wraps the model's forward in autocast (fp16/bf16), so no line below calls it,
    # and the optimizer, so that under fp16 its step goes through the GradScaler.
    model, optimizer, train_dataloader, lr_scheduler, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler, eval_dataloader
    )
    precision.update(fp8_layer_report(accelerator, model, args.max_seq_length))  # AMP: fp8 layers, FLOP share
    check_every_parameter_trains(accelerator, model, optimizer)  # AMP: fp8 swapped layers: none untrained
    plain_model = accelerator.unwrap_model(model, keep_torch_compile=False)  # no DDP/compile wrapper
    log_fp8_report(precision, logger)

    # ------------------------------------------------------------------------- resume
    checkpoints_dir = Path(args.output_dir) / "checkpoints"
    model_shape = f"{config.model_type}/{config.num_hidden_layers}x{config.hidden_size}"
    run_kind = {"objective": "mlm", "model": model_shape, "seed": args.seed}
    # --resume_from_checkpoint: model, optimizer, scheduler, GradScaler and RNG states; else step 0.
    resumed = resume(accelerator, args.resume_from_checkpoint, checkpoints_dir, run_kind)
    # AMP: loss scale, skipped steps, grad norm, non-finite checks; created after a resume has
    # restored the GradScaler, so it starts from the checkpoint's loss scale.
    telemetry = StepTelemetry(accelerator, model, args.max_consecutive_skipped_steps, args.diagnose_overflow)
    telemetry.load_state_dict(resumed.get("telemetry", {}))
    # AMP: each module's max |activation| / 65504; off under --torch_compile (its hooks would recompile).
    monitor_interval = 0 if args.torch_compile else args.activation_monitor_interval
    activations = ActivationMonitor(plain_model, monitor_interval)
    compiled = CompileMonitor(args.torch_compile)  # graphs compiled; whether dynamo gave up recompiling
    run_facts = {  # for the trackers' config and eval_results.json
        **precision,
        "model_type": config.model_type,
        "distributed_type": accelerator.distributed_type.value,
        "total_train_batch_size": train_dataloader.total_batch_size * args.gradient_accumulation_steps,
        "attn_implementation": plain_model.config._attn_implementation,  # SDPA: fused
        "optimizer": f"{'fused' if optimizer.defaults['fused'] else 'foreach'} AdamW",
        "initial_weights_sha256": initial_weights,
    }
    run_config = {**vars(args), **run_facts, **schedule._asdict()}
    output.clear_previous_run(accelerator)  # --overwrite_output_dir: the old run's checkpoints go
    init_trackers(accelerator, args, run_config, resumed["tracker_run_id"])  # W&B / TensorBoard
    record = RunRecord(args.output_dir, accelerator.is_main_process, resumed["global_step"] or None)
    logger.info(f"Run config: {run_config}")

    # ------------------------------------------------------------------------- train
    meter = ThroughputMeter(accelerator.device)

    def run_evaluation(step, epoch):  # every eval split, logged; its time stays out of the throughput
        with meter.paused():
            scores = evaluate(model, eval_dataloader, accelerator)
        results = {"epoch": epoch, **{f"eval_{name}": value for name, value in scores.items()}}
        logger.info(f"step {step}: {results}")
        accelerator.log(results, step=step)
        record.log(results, step)
        return results

    def save(step, epoch, batches_in_epoch):  # crash-safe: written aside, renamed when complete
        telemetry.check_finite(step, precision_in_effect)  # AMP: never saves weights spoiled by inf/NaN
        position = {**run_kind, "epoch": epoch, "batches_in_epoch": batches_in_epoch}
        position["telemetry"] = telemetry.state_dict()  # AMP: skipped-step counts (the GradScaler's own)
        return save_checkpoint(accelerator, checkpoints_dir, step, position, args.save_total_limit)

    completed_steps, results = resumed["global_step"], {}
    checkpoint_every = int(args.checkpointing_steps) if str(args.checkpointing_steps).isdigit() else None
    max_grad_norm = args.max_grad_norm or math.inf  # 0: no clipping, the norm is still measured
    if args.eval_only:  # evaluate the model (or the resumed checkpoint) and stop
        results = {**run_evaluation(completed_steps, resumed["log_epoch"]), **run_facts, **compiled.report()}
        record.write_results({**results, "model_name_or_path": args.model_name_or_path})
        write_final_figures(accelerator, results, completed_steps)  # W&B run summary, TensorBoard
        accelerator.end_training()
        output.release()
        return results
    preemption = PreemptionHandler()  # SIGTERM/SIGINT: stop after the current step, with a checkpoint
    progress = tqdm(
        total=schedule.max_train_steps, initial=completed_steps, disable=not accelerator.is_local_main_process
    )
    model.train()
    for epoch in range(resumed["epoch"], schedule.num_epochs):
        train_dataloader.set_epoch(epoch)  # the epoch's shuffle depends on (seed, epoch) only
        resume_batches = resumed["batches_in_epoch"] if epoch == resumed["epoch"] else 0
        batches = train_dataloader  # a resumed run skips the batches its checkpoint had seen:
        if resume_batches:
            batches = accelerator.skip_first_batches(train_dataloader, resume_batches)
        for batches_in_epoch, batch in enumerate(batches, start=resume_batches + 1):
            grad_norm = None
            with accelerator.accumulate(model), telemetry.watch():
                loss = model(**batch).loss  # AMP: the forward runs under autocast (prepare); the loss is fp32
                accelerator.backward(loss)  # AMP: fp16: scales the loss by the GradScaler's scale first
                if accelerator.sync_gradients:  # AMP: unscales fp16 gradients, then clips (0: measures only)
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()  # AMP: fp16: the GradScaler skips the step when a gradient is inf/NaN
                # AMP: a skipped step must not advance the schedule. accelerate holds the scheduler back then,
                # but misses a fused optimizer's skips; the telemetry reads the GradScaler's scale instead.
                overflow = telemetry.after_optimizer_step()
                if not overflow:
                    lr_scheduler.step()
                optimizer.zero_grad()
            telemetry.observe(loss, grad_norm)  # stays on the device: no per-step synchronisation
            meter.update(batch)
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            progress.update(1)
            # AMP: name the first non-finite module of a skipped fp16 step (--diagnose_overflow: of any step).
            nonfinite_at = telemetry.first_nonfinite(batch) if overflow or args.diagnose_overflow else None
            if overflow or nonfinite_at:
                logger.warning(telemetry.nonfinite_message(completed_steps, overflow, nonfinite_at))
            if telemetry.too_many_skips():  # AMP: no loss scale helps any more; the weights are unchanged
                if args.checkpointing_steps:
                    save(completed_steps, epoch, batches_in_epoch)
                raise TrainingDiverged(telemetry.stop_message(completed_steps, nonfinite_at))
            if completed_steps % args.logging_steps == 0 or completed_steps == schedule.max_train_steps:
                logs = {
                    **telemetry.read(),  # AMP: loss, grad_norm; fp16: loss_scale, skipped_steps (one host sync)
                    "learning_rate": lr_scheduler.get_last_lr()[0],
                    "epoch": completed_steps / schedule.steps_per_epoch,
                    **meter.read(accelerator),  # samples/s, tokens/s, padding since the last log line
                    **{f"fp16_range/{name}": ratio for name, ratio in activations.read().items()},  # AMP
                }
                telemetry.check_finite(completed_steps, precision_in_effect)  # AMP: bf16/fp32 stop on inf/NaN
                progress.set_postfix(
                    {k: logs[k] for k in ("loss", "loss_scale", "skipped_steps") if k in logs}
                )
                accelerator.log(logs, step=completed_steps)
                record.log(logs, completed_steps)
            if args.eval_steps and completed_steps % args.eval_steps == 0:
                results = run_evaluation(completed_steps, epoch + 1)
            if checkpoint_every and completed_steps % checkpoint_every == 0:
                save(completed_steps, epoch, batches_in_epoch)
            if preemption.should_stop(accelerator, completed_steps):  # a SIGTERM/SIGINT arrived
                path = save(completed_steps, epoch, batches_in_epoch)
                logger.warning(preemption.stop_message(completed_steps, path))
                preemption.restore()
                accelerator.end_training()
                output.release()
                sys.exit(preemption.exit_code)
            if completed_steps >= schedule.max_train_steps:
                break
        padding = meter.epoch_padding_fraction(accelerator)  # --group_by_length lowers it
        logger.info(f"epoch {epoch + 1}: {padding:.1%} of the batches' tokens were padding")
        accelerator.log({"epoch_padding_fraction": padding}, step=completed_steps)
        record.log({"epoch_padding_fraction": padding}, completed_steps)
        if not (args.eval_steps and completed_steps % args.eval_steps == 0):  # unless just evaluated
            results = run_evaluation(completed_steps, epoch + 1)
        if args.checkpointing_steps == "epoch":
            save(completed_steps, epoch + 1, 0)
    progress.close()
    preemption.restore()
    activations.remove()
    telemetry.check_finite(completed_steps, precision_in_effect)  # AMP: never saves spoiled weights

    # ------------------------------------------------------------------------- save
    summary = {
        **results,
        **run_facts,
        "model_name_or_path": args.model_name_or_path,
        "train_steps": completed_steps,
        **meter.run_rates(),  # training runtime, samples/s and tokens/s (evaluation left out)
        "peak_memory_bytes": peak_memory_bytes(accelerator.device),
        **telemetry.summary(),  # AMP: fp16 skipped steps and final loss scale; non-finite losses
        "fp16_range": activations.read(),  # AMP: max |activation| / 65504 of the modules closest to it
        **compiled.report(),  # --torch_compile: compiled_graphs, recompile_limit_hit
    }
    with output.final_model(accelerator) as folder:  # .final.tmp, renamed into place when complete
        plain_model.save_pretrained(  # AMP: the fp32 master weights, gathered under FSDP / ZeRO-3
            folder,
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict=plain_state_dict(accelerator, model),  # plain names, even after torch.compile
        )
        if accelerator.is_main_process:
            tokenizer.save_pretrained(folder)
    record.write_results(summary)  # written last: its presence means the run finished
    write_final_figures(accelerator, summary, completed_steps)  # W&B run summary, TensorBoard
    logger.info(f"Saved model and eval_results.json to {args.output_dir}: {summary}")
    accelerator.end_training()
    output.release()
    return summary


if __name__ == "__main__":
    with one_sentence_errors():  # bad input, a diverged run, a rank that hung or died: `error: ...`, exit 1
        main()
