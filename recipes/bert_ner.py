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
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, GradScalerKwargs, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from transformers import (
    AutoConfig,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    get_scheduler,
)

from amp_recipes import arguments, errors, no_trainer
from amp_recipes.amp import compiling, memory, precision
from amp_recipes.tasks import batches, metrics, ner
from amp_recipes.training import optim, outputs
from amp_recipes.training.run import TrainingRun

logger = get_logger(__name__)


# ----------------------------------------------------------------------------- args
def build_parser() -> argparse.ArgumentParser:
    # argparse's parser; under a multi-process launch its error is printed once, not once per rank.
    parser = arguments.ArgumentParser(description=__doc__.splitlines()[0])
    data = parser.add_argument_group("data")
    data.add_argument(
        "--task_name",
        choices=["ner", "pos", "chunk"],
        default="ner",
        help="Which tags to learn: the tags column <task>_tags when --tags_column is not given (pos is refused).",
    )
    data.add_argument("--dataset_name", default=ner.HUB_DATASET, help="Hub dataset with tokens + ner_tags.")
    data.add_argument(
        "--dataset_revision",
        default=ner.HUB_REVISION,
        help="Hub revision (default: the parquet export, which datasets >= 4 can load).",
    )
    data.add_argument(
        "--train_file",
        help="Your own training data: CoNLL text (.txt, .conll: token ... tag) or .json/.jsonl.",
    )
    data.add_argument("--validation_file", help="Your own validation data, same format as --train_file.")
    data.add_argument(
        "--do_predict",
        action="store_true",
        help="Tag the test sentences with the final model (or, with --eval_only, the given one): "
        "predictions.txt in CoNLL format (word tag).",
    )
    data.add_argument(
        "--test_file",
        help="Sentences to tag (--do_predict): CoNLL text (the words column is enough) or .json/.jsonl "
        "(default: the Hub dataset's test split).",
    )
    data.add_argument(
        "--tokens_column",
        "--text_column_name",
        help="Words column of a .json/.jsonl file (default: tokens, else the first).",
    )
    data.add_argument(
        "--tags_column",
        "--label_column_name",
        help="Tags column of a .json/.jsonl file (default: <task>_tags, tags or labels, else another).",
    )
    data.add_argument(
        "--label_all_tokens",
        action="store_true",
        help="Train on every sub-token of a word (B-X becomes I-X after the first), not only the first.",
    )
    data.add_argument(
        "--max_seq_length", "--max_length", type=int, default=128, help="Longer sentences are cut."
    )
    data.add_argument("--max_train_samples", type=int, help="Use only the first N training sentences.")
    data.add_argument("--max_eval_samples", type=int, help="Use only the first N validation sentences.")
    data.add_argument("--debug", action="store_true", help="The first 100 sentences of each split.")
    # off: grouped batches trained to lower CoNLL F1 (docs/performance.md)
    arguments.add_group_by_length_arg(data, default=False)
    arguments.add_worker_args(data)
    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", default="bert-base-uncased", help="Hub id or local directory.")
    model.add_argument(
        "--ignore_mismatched_sizes", action="store_true", help="Start a new tagging head if sizes differ."
    )
    # training, precision and output flags, and those of the no_trainer example this recipe stands in for
    arguments.add_shared_args(parser, output_default="outputs/ner", example="ner")
    parser.add_argument_group("entity scores").add_argument(
        "--return_entity_level_metrics",
        action="store_true",
        help="all_results.json gets each entity type's scores, and the overall ones as eval_overall_* "
        "(eval_results.json always has them).",
    )
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.hf_example_defaults:  # run_ner_no_trainer.py's numbers for every flag not given
        arguments.set_unless_given(parser, args, arguments.EXAMPLE_DEFAULTS)
    if args.with_tracking:  # the example's trackers: every one installed, under its project name
        arguments.set_unless_given(parser, args, {"report_to": "all", "project_name": "ner_no_trainer"})
    if args.debug:  # the example's --debug: the first 100 sentences of each split
        args.max_train_samples = min(args.max_train_samples or 100, 100)
        args.max_eval_samples = min(args.max_eval_samples or 100, 100)
    if bool(args.train_file) != bool(args.validation_file):
        parser.error("give both --train_file and --validation_file (or neither: the Hub's CoNLL-2003).")
    if args.test_file and not args.do_predict:
        parser.error("--test_file holds the sentences --do_predict tags: add --do_predict.")
    if args.do_predict and args.train_file and not args.test_file:
        parser.error("--do_predict with your own files needs --test_file, the sentences to tag.")
    if args.task_name == "pos":
        parser.error(
            "--task_name pos: part-of-speech tags (NN, VB, ...) are not entity spans, which this recipe "
            "learns and scores (seqeval); use ner or chunk (B-NP, I-NP, ...)."
        )
    arguments.check_shared_args(parser, args)  # every shared numeric flag in range, no conflicting flags
    at_least_1 = (lambda v: v >= 1, "at least 1")
    arguments.check_ranges(
        parser, args, dict.fromkeys(["max_seq_length", "max_train_samples", "max_eval_samples"], at_least_1)
    )
    args.output_dir = args.output_dir or os.path.join("outputs", "ner")
    return args


# ----------------------------------------------------------------------------- data
def load_data(args, tokenizer, accelerator):
    """The tagged sentences (Hub or your files) and their DataLoaders. Edit this function for other data."""
    with accelerator.main_process_first():  # the main process loads and tokenises, the others read its cache
        if args.train_file:
            task = ner.load_files(
                args.train_file, args.validation_file, args.tokens_column, args.tags_column, args.task_name
            )
        else:
            task = ner.load_hub(
                args.dataset_name, args.dataset_revision, config=args.dataset_config_name, task=args.task_name
            )
        task.splits["train"] = batches.first_rows(task.splits["train"], args.max_train_samples)
        task.splits["validation"] = batches.first_rows(task.splits["validation"], args.max_eval_samples)
        if args.do_predict:  # the words to tag: --test_file, else the Hub dataset's test split
            task.splits["test"] = ner.load_test(
                args.test_file, args.tokens_column, args.dataset_name, args.dataset_revision
            )
        tokenized = ner.tokenize_and_align(
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
    test = None  # --do_predict: each test sentence's words, where their first sub-tokens are, its batches
    if args.do_predict:
        test = {
            "tokens": list(task.splits["test"]["tokens"]),
            "word_index": list(tokenized["test"]["word_index"]),
        }
    cut = ner.words_cut(tokenized["train"]["tags"], tokenized["train"]["word_index"])
    tokenized = tokenized.remove_columns(["tags", "word_index"])
    # AMP: fp16/bf16 batches are padded to a multiple of 8, the shapes Tensor Cores run fastest.
    collator = DataCollatorForTokenClassification(
        tokenizer,
        pad_to_multiple_of=batches.pad_multiple(accelerator.mixed_precision),
        # --pad_to_max_length: every batch --max_seq_length long
        **({"padding": "max_length", "max_length": args.max_seq_length} if args.pad_to_max_length else {}),
    )
    loader_kwargs = batches.loader_settings(accelerator, collator, args.dataloader_num_workers)
    batch_size = args.per_device_train_batch_size
    sampler = batches.train_sampler(tokenized["train"], batch_size, args.group_by_length, args.seed)
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
    if test:  # --do_predict
        test["dataloader"] = DataLoader(
            tokenized["test"], batch_size=args.per_device_eval_batch_size, **loader_kwargs
        )
    logger.info(
        f"{task.name}: {len(tokenized['train'])} training sentences, {len(gold['tags'])} validation "
        f"sentences, tags {list(task.label_names)} ({task.scheme}); {cut} training words cut off by "
        f"--max_seq_length {args.max_seq_length} (no label for them)"
    )
    return task, train_dataloader, eval_dataloader, gold, test


def load_model(args, config, task):
    """The pretrained encoder with a new token-classification head for the task's tags."""
    config.num_labels, config.finetuning_task = len(task.label_names), args.task_name
    config.id2label = dict(enumerate(task.label_names))
    config.label2id = {name: i for i, name in enumerate(task.label_names)}
    with errors.model_load_errors(args.model_name_or_path, len(task.label_names)):
        return AutoModelForTokenClassification.from_pretrained(
            args.model_name_or_path,
            config=config,
            ignore_mismatched_sizes=args.ignore_mismatched_sizes,
            trust_remote_code=args.trust_remote_code,  # a model's own code runs only when you ask
            dtype=torch.float32,  # AMP: fp32 master weights whatever the checkpoint's dtype; autocast casts
        )


# ----------------------------------------------------------------------------- evaluate
def tag_words(model, dataloader, accelerator, sentences, word_index, label_names) -> list[list[str]]:
    """Every sentence's predicted tag per word (`sentences`: its words or gold tags, in the data's
    order), read at the word's first sub-token (`word_index`); a word cut off by --max_seq_length
    is predicted O."""
    model.eval()
    tagged = []
    # fork_rng: iterating a DataLoader draws from the global RNG, and evaluating must not change
    # the dropout and shuffling that training sees next (same run, whatever --eval_steps is).
    cuda_devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    # AMP: no_grad, not inference_mode: torchao's fp8 Linear layers fail under it (pytorch/ao#643).
    with torch.random.fork_rng(devices=cuda_devices), torch.no_grad():
        for batch in dataloader:
            logits = model(**batch).logits  # AMP: fp16/bf16 under autocast; argmax reads them as they are
            predictions = accelerator.pad_across_processes(logits.argmax(dim=-1), dim=1)  # lengths differ
            # gather_for_metrics drops the sentences the last batch repeats to fill every process, and
            # keeps the data's order, so the i-th gathered row is the i-th sentence.
            for row in accelerator.gather_for_metrics(predictions).cpu().tolist():
                i = len(tagged)
                tagged.append(ner.word_tags(row, word_index[i], len(sentences[i]), label_names))
    model.train()
    return tagged


def evaluate(model, eval_dataloader, metric, accelerator, gold, label_names):
    """Entity precision / recall / F1 (overall and per type) and word accuracy over every
    validation word; words cut off by --max_seq_length count as predicted O."""
    predicted = tag_words(model, eval_dataloader, accelerator, gold["tags"], gold["word_index"], label_names)
    truncated_words = ner.words_cut(gold["tags"], gold["word_index"])
    if truncated_words:
        logger.warning(
            f"{truncated_words} validation words were cut off by --max_seq_length and count as predicted O; "
            "raise --max_seq_length to tag them.",
            main_process_only=True,
        )
    scores = metric.compute(predictions=predicted, references=gold["tags"])
    # Entity F1 first: word accuracy stays high (0.83 on CoNLL-2003) for a model that tags every word O.
    scores = {"f1": scores["f1"], **scores, "samples": len(predicted), "truncated_words": truncated_words}
    return {f"eval_{name}": value for name, value in scores.items()}


# ----------------------------------------------------------------------------- predict
def predict(model, test, accelerator, label_names, output_dir) -> dict:
    """--do_predict: a tag for every word of every test sentence, in CoNLL format (`word tag`, a
    blank line after each sentence): predictions.txt. Words cut off by --max_seq_length: O."""
    dataloader = accelerator.prepare_data_loader(test["dataloader"])  # sharded only when predicting
    tagged = tag_words(model, dataloader, accelerator, test["tokens"], test["word_index"], label_names)
    if accelerator.is_main_process:
        lines = ner.conll_lines(test["tokens"], tagged)
        outputs.write_text_atomic(os.path.join(output_dir, "predictions.txt"), lines)
    truncated_words = ner.words_cut(test["tokens"], test["word_index"])
    return {"predict_samples": len(tagged), "predict_truncated_words": truncated_words}


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)

    # ------------------------------------------------------------------------- accelerator
    # AMP: `auto` becomes bf16 where the device has it natively, else fp16 on a Tensor-Core GPU, else fp32.
    mixed_precision, auto_reason = precision.resolve_mixed_precision(args.mixed_precision)
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
            *precision.fp8_recipe_kwargs(mixed_precision, args.fp8_backend),  # refused where fp8 cannot run
            InitProcessGroupKwargs(timeout=timedelta(seconds=args.ddp_timeout)),  # a hung rank ends the run
        ],
        fsdp_plugin=precision.fsdp_plugin(mixed_precision),  # AMP: FSDP2: outputs not cast back to 16 bits
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # --torch_compile: one graph for every padded length, the repeated layer compiled once.
        dynamo_plugin=compiling.dynamo_plugin(args),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True,  # shuffling seeded by (seed, epoch): a resume sees the same batches
            non_blocking=torch.cuda.is_available(),  # copies to the GPU from pinned memory, without a stall
        ),
        log_with=None if args.report_to == "none" else args.report_to,  # W&B / TensorBoard
        project_dir=args.output_dir,
    )
    # AMP: the precision really in effect and who chose it; refuses what cannot work (bf16 on a
    # pre-Ampere GPU, an unconnected multi-process launch), warns about what silently misbehaves.
    in_effect = precision.preflight(accelerator, mixed_precision, auto_reason)  # logged by TrainingRun
    # Output folder and lock, resume, trackers, checkpoints, preemption, final save: released on every exit.
    with TrainingRun(accelerator, args, in_effect) as run:
        set_seed(args.seed)  # the new head's weights, dropout; --seed unset: the one TrainingRun settled
        # --------------------------------------------------------------------- data
        with errors.model_load_errors(args.model_name_or_path):
            config = AutoConfig.from_pretrained(
                args.config_name or args.model_name_or_path, trust_remote_code=args.trust_remote_code
            )
            tokenizer = AutoTokenizer.from_pretrained(
                args.tokenizer_name or args.model_name_or_path,
                **ner.tokenizer_kwargs(config),
                **no_trainer.tokenizer_kwargs(args),
            )
        task, train_dataloader, eval_dataloader, gold, test = load_data(args, tokenizer, accelerator)

        # --------------------------------------------------------------------- model
        with precision.zero3_init(accelerator):  # AMP: ZeRO-3: 16-bit zero.Init only if the config asks
            model = load_model(args, config, task)
        # AMP: fp32 weights (no .half()): autocast needs fp32 master weights.
        precision.check_model_dtype(model, in_effect["precision_in_effect"], accelerator.distributed_type)
        if args.gradient_checkpointing:  # less activation memory for a third more compute
            memory.enable_gradient_checkpointing(model)  # each layer recomputed in the backward
        run.fingerprint(model)  # sha256 of the weights as loaded; the arms of a paired run start equal

        # --------------------------------------------------------------------- optimizer
        optimizer = optim.make_optimizer(model, args, accelerator.device)  # AdamW, fused where torch has it
        schedule = optim.training_schedule(len(train_dataloader), accelerator, args)  # steps per process
        lr_scheduler = get_scheduler(  # --lr_scheduler_type (linear, cosine, ...) after a linear warm-up
            args.lr_scheduler_type, optimizer, schedule.warmup_steps, schedule.scheduler_steps
        )

        # --------------------------------------------------------------------- prepare
        # AMP: prepare() wraps the model's forward in autocast (fp16/bf16), so no line below calls it,
        # and the optimizer, so that under fp16 its step goes through the GradScaler.
        model, optimizer, train_dataloader, lr_scheduler, eval_dataloader = accelerator.prepare(
            model, optimizer, train_dataloader, lr_scheduler, eval_dataloader
        )
        # AMP: under FSDP2 prepare() casts the weights instead; this puts its forward under autocast too.
        precision.autocast_fsdp2_forward(accelerator, model)
        # AMP: prepare() may swap Linear layers for fp8 ones: which ones, and their FLOP share.
        in_effect.update(precision.fp8_layer_report(accelerator, model, args.max_seq_length))
        optim.check_every_parameter_trains(accelerator, model, optimizer)  # AMP: none of them left untrained
        metric = metrics.load_metric("seqeval")  # shipped with amp_recipes: works offline
        run.start(  # --resume_from_checkpoint (model, optimizer, scheduler, GradScaler, RNG), trackers
            model,
            optimizer,
            train_dataloader,
            schedule,
            identity={"task_name": task.name, "label_names": list(task.label_names)},
            evaluate=lambda: evaluate(model, eval_dataloader, metric, accelerator, gold, task.label_names),
            predict=lambda: predict(model, test, accelerator, task.label_names, args.output_dir),
            facts={"tag_scheme": task.scheme},
        )

        # --------------------------------------------------------------------- train
        if args.eval_only:  # evaluate the model (or the resumed checkpoint) and stop
            return run.evaluate_only()
        max_grad_norm = args.max_grad_norm or math.inf  # 0: no clipping, the norm is still measured
        model.train()  # dropout on (evaluate() turns it off and back on)
        for epoch in run.epochs():  # a resumed run starts in its checkpoint's epoch
            # Shuffled by (seed, epoch); a resumed run's first epoch skips what its checkpoint saw.
            for batch in run.epoch_batches(train_dataloader, epoch):
                grad_norm = None
                # accumulate(): gradients add up over a window, synced on its last micro-batch; prepare()'s
                # optimizer and scheduler act only then. watch(): --diagnose_overflow's inf/NaN hooks.
                with accelerator.accumulate(model), run.telemetry.watch():
                    loss = model(**batch).loss  # AMP: the forward runs under autocast (prepare); fp32 loss
                    accelerator.backward(loss)  # AMP: fp16: scales the loss by the GradScaler's scale first
                    if accelerator.sync_gradients:  # AMP: unscales fp16 gradients, then clips
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                    optimizer.step()  # AMP: fp16: the GradScaler skips the step when a gradient is inf/NaN
                    # AMP: a skipped step must not advance the schedule; accelerate holds it back, but misses
                    # a fused optimizer's skips: the telemetry reads the GradScaler's scale instead.
                    overflow = run.telemetry.after_optimizer_step()
                    if not overflow:
                        lr_scheduler.step()  # the next step's learning rate (--lr_scheduler_type)
                    optimizer.zero_grad()  # the gradients back to zero for the next window
                run.count_batch(batch, loss, grad_norm)  # its loss, norm and tokens go into the next log line
                if not accelerator.sync_gradients:
                    continue  # inside a gradient-accumulation window: no optimizer step yet
                run.count_optimizer_step()  # run.step += 1; the progress bar moves
                if overflow or args.diagnose_overflow:  # AMP: fp16 skipped this step (inf/NaN gradients)
                    run.warn_nonfinite(batch, overflow)  # names the first module whose output was inf/NaN
                if run.telemetry.too_many_skips():  # AMP: fp16: no loss scale helps any more
                    run.stop_diverged()  # a checkpoint (with --checkpointing_steps), then the error
                if run.step % args.logging_steps == 0 or run.step == schedule.max_train_steps:
                    logs = {
                        **run.telemetry.read(),  # AMP: loss, grad_norm; fp16: loss_scale, skipped_steps
                        "learning_rate": lr_scheduler.get_last_lr()[0],  # the rate the next step will use
                        "epoch": run.step / schedule.steps_per_epoch,
                        **run.meter.read(accelerator),  # samples/s, tokens/s, padding since the last log line
                        **run.activation_ranges(),  # AMP: fp16_range/<module>: max |activation| / 65504
                    }
                    run.stop_if_loss_diverged()  # AMP: bf16/fp32: an inf/NaN loss ends the run (fp16 skips)
                    run.log(logs)  # trackers, log_history.jsonl, progress bar
                if args.eval_steps and run.step % args.eval_steps == 0:
                    run.evaluate(epoch + 1)  # every eval split: logged, and kept for eval_results.json
                if isinstance(args.checkpointing_steps, int) and run.step % args.checkpointing_steps == 0:
                    run.save_checkpoint(example_name=f"step_{run.step}")  # crash-safe; also as step_<n>
                if run.preemption_requested():  # SIGTERM/SIGINT: a scheduler's notice, Ctrl-C
                    run.checkpoint_and_exit()  # a checkpoint of this step, then exit 143 / 130
                if run.step >= schedule.max_train_steps or run.early_stopped:  # --early_stopping_patience
                    break  # the run's last optimizer step (--max_train_steps, the epochs' or an early stop)
            run.end_epoch()  # the epoch's padding share (logged) and mean loss; the next epoch's start
            if run.evaluated_step != run.step:  # an evaluation ends each epoch, unless this step had one
                run.evaluate(epoch + 1)
            if args.checkpointing_steps == "epoch":  # the epoch just ended, also as epoch_<i> (from 0)
                run.save_checkpoint(example_name=f"epoch_{epoch}")

        # --------------------------------------------------------------------- save
        return run.save_final_model(tokenizer)  # AMP: fp32 master weights; eval_results.json last


if __name__ == "__main__":
    # Bad input, a diverged run, a rank that hung or died: `error: <one sentence>`, exit 1.
    with errors.one_sentence_errors():
        main()
