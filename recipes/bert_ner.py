"""Fine-tune a BERT-family encoder for named-entity recognition (CoNLL-2003 or your own tags) with mixed precision.

    accelerate launch recipes/bert_ner.py --mixed_precision fp16
    python recipes/bert_ner.py --train_file train.txt --validation_file valid.txt --model_name_or_path ./my-bert

Token classification: one tag per word (B-PER, I-PER, O, ...), learnt on each word's first
sub-token and scored per entity (seqeval, conlleval's rules). accelerate owns autocast and the fp16
GradScaler; this file asks for them and reports what is really in effect. Every precision-specific
line is marked `# AMP:` (`grep -n "AMP:" <recipe>` lists them). Copy it as the template for your
own job (`amp-recipes cp bert_ner my_tagger.py`).
"""

import argparse
import logging
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, GradScalerKwargs, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    get_scheduler,
)

from amp_recipes.arguments import add_shared_args, add_worker_args, check_ranges, check_shared_args
from amp_recipes.batches import first_rows, loader_settings, pad_multiple, train_sampler
from amp_recipes.checkpoint import PreemptionHandler, resume, save_checkpoint
from amp_recipes.compile import CompileMonitor, dynamo_plugin
from amp_recipes.errors import TrainingDiverged, model_load_errors, one_sentence_errors
from amp_recipes.meters import ThroughputMeter, peak_memory_bytes
from amp_recipes.metrics import load_metric
from amp_recipes.ner import HUB_DATASET, HUB_REVISION, load_files, load_hub, tokenize_and_align, word_tags
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
    data.add_argument("--dataset_name", default=HUB_DATASET, help="Hub dataset with tokens + ner_tags.")
    data.add_argument(
        "--dataset_revision",
        default=HUB_REVISION,
        help="Hub revision (default: the parquet export, which datasets >= 4 can load).",
    )
    data.add_argument(
        "--train_file",
        help="Your own training data: CoNLL text (.txt, .conll: token ... tag) or .json/.jsonl.",
    )
    data.add_argument("--validation_file", help="Your own validation data, same format as --train_file.")
    data.add_argument("--tokens_column", default="tokens", help="Words column of a .json/.jsonl file.")
    data.add_argument(
        "--tags_column", help="Tags column of a .json/.jsonl file (default: ner_tags, tags or labels)."
    )
    data.add_argument(
        "--label_all_tokens",
        action="store_true",
        help="Train on every sub-token of a word (B-X becomes I-X after the first), not only the first.",
    )
    data.add_argument("--max_seq_length", type=int, default=128)
    data.add_argument("--max_train_samples", type=int, help="Use only the first N training sentences.")
    data.add_argument("--max_eval_samples", type=int, help="Use only the first N validation sentences.")
    data.add_argument(
        "--group_by_length", action="store_true", help="Batch similar lengths together (less padding)."
    )
    add_worker_args(data)
    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", default="bert-base-uncased", help="Hub id or local directory.")
    model.add_argument(
        "--ignore_mismatched_sizes", action="store_true", help="Start a new tagging head if sizes differ."
    )
    add_shared_args(parser, output_default="outputs/ner")  # training, precision, output flags
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.train_file) != bool(args.validation_file):
        parser.error("give both --train_file and --validation_file (or neither: the Hub's CoNLL-2003).")
    check_shared_args(parser, args)  # every shared numeric flag in range, no conflicting flags
    at_least_1 = (lambda v: v >= 1, "at least 1")
    check_ranges(
        parser, args, dict.fromkeys(["max_seq_length", "max_train_samples", "max_eval_samples"], at_least_1)
    )
    args.output_dir = args.output_dir or os.path.join("outputs", "ner")
    return args


# ----------------------------------------------------------------------------- data
def load_data(args, tokenizer, accelerator):
    """The tagged sentences (Hub or your files) and their DataLoaders. Edit this function for other data."""
    with accelerator.main_process_first():  # the main process loads and tokenises, the others read its cache
        if args.train_file:
            task = load_files(args.train_file, args.validation_file, args.tokens_column, args.tags_column)
        else:
            task = load_hub(args.dataset_name, args.dataset_revision)
        task.splits["train"] = first_rows(task.splits["train"], args.max_train_samples)
        task.splits["validation"] = first_rows(task.splits["validation"], args.max_eval_samples)
        tokenized = tokenize_and_align(
            task.splits,
            tokenizer,
            task.label_names,
            args.max_seq_length,
            args.label_all_tokens,
            args.preprocessing_num_workers,
        )
    # Evaluation scores words, not tokens: each word's gold tag, and where its first sub-token is.
    gold = {
        "tags": list(task.splits["validation"]["tags"]),
        "word_index": list(tokenized["validation"]["word_index"]),
    }
    train = tokenized["train"]
    cut = sum(
        len(t) - sum(w >= 0 for w in i) for t, i in zip(train["tags"], train["word_index"], strict=True)
    )
    tokenized = tokenized.remove_columns(["tags", "word_index"])
    # AMP: fp16/bf16 batches are padded to a multiple of 8, the shapes Tensor Cores run fastest.
    collator = DataCollatorForTokenClassification(
        tokenizer, pad_to_multiple_of=pad_multiple(accelerator.mixed_precision)
    )
    loader_kwargs = loader_settings(accelerator, collator, args.dataloader_num_workers)
    batch_size = args.per_device_train_batch_size
    sampler = train_sampler(tokenized["train"], batch_size, args.group_by_length, args.seed)
    train_dataloader = DataLoader(
        tokenized["train"],
        batch_size=batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        # Its own generator: starting an epoch's iterator then draws nothing from the global RNG
        # (dropout), so a run resumed mid-epoch continues the same random stream.
        generator=torch.Generator().manual_seed(args.seed),
        **loader_kwargs,
    )
    eval_dataloader = DataLoader(
        tokenized["validation"], batch_size=args.per_device_eval_batch_size, **loader_kwargs
    )
    logger.info(
        f"{task.name}: {len(tokenized['train'])} training sentences, {len(gold['tags'])} validation "
        f"sentences, tags {list(task.label_names)} ({task.scheme}); {cut} training words cut off by "
        f"--max_seq_length {args.max_seq_length} (no label for them)"
    )
    return task, train_dataloader, eval_dataloader, gold


def tokenizer_kwargs(config) -> dict:
    """Byte-level BPE tokenizers (RoBERTa, ...) glue a word of a pre-split sentence to the one
    before unless told that each word starts after a space."""
    byte_level_bpe = {"roberta", "deberta", "longformer", "bart", "gpt2", "modernbert"}
    return {"add_prefix_space": True} if config.model_type in byte_level_bpe else {}


def load_model(args, config, task):
    """The pretrained encoder with a new token-classification head for the task's tags."""
    config.num_labels, config.finetuning_task = len(task.label_names), "ner"
    config.id2label = dict(enumerate(task.label_names))
    config.label2id = {name: i for i, name in enumerate(task.label_names)}
    with model_load_errors(args.model_name_or_path, len(task.label_names)):
        return AutoModelForTokenClassification.from_pretrained(
            args.model_name_or_path,
            config=config,
            ignore_mismatched_sizes=args.ignore_mismatched_sizes,
            dtype=torch.float32,  # AMP: fp32 master weights whatever the checkpoint's dtype; autocast casts
        )


# ----------------------------------------------------------------------------- evaluate
def evaluate(model, eval_dataloader, metric, accelerator, gold, label_names):
    """Entity precision / recall / F1 (overall and per type) and word accuracy over every
    validation word; words cut off by --max_seq_length count as predicted O."""
    model.eval()
    sentence, truncated_words = 0, 0
    # fork_rng: iterating a DataLoader draws from the global RNG, and evaluating must not change
    # the dropout and shuffling that training sees next (same run, whatever --eval_steps is).
    cuda_devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    # AMP: no_grad, not inference_mode: torchao's fp8 Linear layers fail under it (pytorch/ao#643).
    with torch.random.fork_rng(devices=cuda_devices), torch.no_grad():
        for batch in eval_dataloader:
            logits = model(**batch).logits  # AMP: fp16/bf16 under autocast; argmax reads them as they are
            predictions = accelerator.pad_across_processes(logits.argmax(dim=-1), dim=1)  # lengths differ
            # gather_for_metrics drops the sentences the last batch repeats to fill every process, and
            # keeps the validation order, so the i-th gathered row is the i-th validation sentence.
            predictions = accelerator.gather_for_metrics(predictions).cpu().tolist()
            references = gold["tags"][sentence : sentence + len(predictions)]
            word_index = gold["word_index"][sentence : sentence + len(predictions)]
            predicted = [
                word_tags(row, words, len(tags), label_names)
                for row, words, tags in zip(predictions, word_index, references, strict=True)
            ]
            truncated_words += sum(
                len(tags) - sum(w >= 0 for w in words)
                for tags, words in zip(references, word_index, strict=True)
            )
            metric.add_batch(predictions=predicted, references=references)
            sentence += len(predictions)
    model.train()
    if truncated_words:
        logger.warning(
            f"{truncated_words} validation words were cut off by --max_seq_length and count as predicted O; "
            "raise --max_seq_length to tag them.",
            main_process_only=True,
        )
    scores = {**metric.compute(), "samples": sentence, "truncated_words": truncated_words}
    return {f"eval_{name}": value for name, value in scores.items()}


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
        config = AutoConfig.from_pretrained(args.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, **tokenizer_kwargs(config))
    task, train_dataloader, eval_dataloader, gold = load_data(args, tokenizer, accelerator)

    # ------------------------------------------------------------------------- model
    model = load_model(args, config, task)
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
    metric = load_metric("seqeval")  # shipped with amp_recipes: works offline

    # ------------------------------------------------------------------------- resume
    checkpoints_dir = Path(args.output_dir) / "checkpoints"
    run_kind = {
        "task_name": task.name,
        "label_names": list(task.label_names),
        "model": f"{config.model_type}/{config.num_hidden_layers}x{config.hidden_size}",
        "seed": args.seed,
    }
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
        "task_name": task.name,
        "tag_scheme": task.scheme,
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

    def run_evaluation(step, epoch):  # entity F1 over the words, logged; its time stays out of the throughput
        with meter.paused():
            scores = evaluate(model, eval_dataloader, metric, accelerator, gold, task.label_names)
        results = {"epoch": epoch, **scores}
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
