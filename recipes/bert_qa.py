"""Fine-tune a BERT-family encoder for extractive question answering (SQuAD v1.1 / 2.0 or your own) with mixed precision.

    accelerate launch recipes/bert_qa.py --mixed_precision fp16
    python recipes/bert_qa.py --train_file train.json --validation_file dev.json --model_name_or_path ./my-bert

Extractive QA: the answer is a span of the context, a start and an end logit per token. The
context is cut into overlapping windows after the question (--max_seq_length 384, --doc_stride
128); their logits, as float32, become answers (n-best spans, SQuAD 2.0's null score) scored by
SQuAD's exact match and F1. accelerate owns autocast and the fp16 GradScaler; every precision line
is marked `# AMP:` (`grep -n "AMP:" <recipe>`). Copy it: `amp-recipes cp bert_qa my_qa.py`.
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
    AutoModelForQuestionAnswering,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_scheduler,
)

from amp_recipes import arguments, errors, no_trainer
from amp_recipes.amp import compiling, memory, precision
from amp_recipes.tasks import batches, metrics, qa
from amp_recipes.training import optim
from amp_recipes.training.run import TrainingRun

logger = get_logger(__name__)


# ----------------------------------------------------------------------------- args
def build_parser() -> argparse.ArgumentParser:
    # argparse's parser; under a multi-process launch its error is printed once, not once per rank.
    parser = arguments.ArgumentParser(description=__doc__.splitlines()[0])
    data = parser.add_argument_group("data")
    data.add_argument(
        "--dataset_name",
        help="Hub dataset in squad's layout (default: rajpurkar/squad, or squad_v2 with -v2).",
    )
    data.add_argument(
        "--train_file",
        help="Your own training data: SQuAD-format .json, or .json/.jsonl rows (question, context, answers).",
    )
    data.add_argument("--validation_file", help="Your own validation data, same format as --train_file.")
    data.add_argument(
        "--do_predict",
        action="store_true",
        help="Answer --test_file's questions with the final model (or, with --eval_only, the given one): "
        "predict_predictions.json, as SQuAD's evaluation script reads it.",
    )
    data.add_argument(
        "--test_file",
        help="Questions to answer (--do_predict), in --train_file's format; answers not needed.",
    )
    data.add_argument("--question_column", default="question", help="Question column of .json/.jsonl rows.")
    data.add_argument("--context_column", default="context", help="Context column of .json/.jsonl rows.")
    data.add_argument(
        "--answer_column",
        default="answers",
        help='Answers column of .json/.jsonl rows: {"text": [...], "answer_start": [...]}.',
    )
    data.add_argument(
        "--version_2_with_negative",
        action="store_true",
        help="SQuAD 2.0: some questions have no answer; the model may answer nothing.",
    )
    data.add_argument(
        "--max_seq_length", type=int, default=384, help="Tokens per window (with the question)."
    )
    data.add_argument("--doc_stride", type=int, default=128, help="Tokens of context shared by two windows.")
    data.add_argument("--max_query_length", type=int, default=64, help="Longer questions are cut to this.")
    data.add_argument("--max_train_samples", type=int, help="Use only the first N training questions.")
    data.add_argument("--max_eval_samples", type=int, help="Use only the first N validation questions.")
    data.add_argument(
        "--max_predict_samples", type=int, help="Use only the first N questions of --test_file."
    )
    data.add_argument(
        "--overwrite_cache", action="store_true", help="Tokenise again instead of reading datasets' cache."
    )
    # off: not measured on QA yet (docs/performance.md)
    arguments.add_group_by_length_arg(data, default=False)
    arguments.add_worker_args(data)
    qa.add_answer_args(parser.add_argument_group("answers"))  # how logits become answers (qa.postprocess)
    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", default="bert-base-uncased", help="Hub id or local directory.")
    # training, precision and output flags, and those of the no_trainer example this recipe stands in for
    arguments.add_shared_args(parser, output_default="outputs/qa", example="qa")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.hf_example_defaults:  # run_qa_no_trainer.py's numbers for every flag not given
        arguments.set_unless_given(parser, args, arguments.EXAMPLE_DEFAULTS)
    if args.with_tracking:  # the example's trackers: every one installed, under its project name
        arguments.set_unless_given(parser, args, {"report_to": "all", "project_name": "qa_no_trainer"})
    if bool(args.train_file) != bool(args.validation_file):
        parser.error("give both --train_file and --validation_file (or neither: the Hub's SQuAD).")
    if bool(args.test_file) != args.do_predict:  # SQuAD has no test split on the Hub
        parser.error("--do_predict answers the questions of --test_file: give both, or neither.")
    arguments.check_shared_args(parser, args)  # every shared numeric flag in range, no conflicting flags
    at_least_1 = (lambda v: v >= 1, "at least 1")
    limits = ["max_seq_length", "doc_stride", "max_query_length", "max_train_samples", "max_eval_samples"]
    limits.append("max_predict_samples")
    ranges = dict.fromkeys([*limits, "n_best_size", "max_answer_length"], at_least_1)
    ranges["null_score_diff_threshold"] = (math.isfinite, "a finite number")
    arguments.check_ranges(parser, args, ranges)
    args.output_dir = args.output_dir or os.path.join("outputs", "qa")
    return args


# ----------------------------------------------------------------------------- data
def columns_of(args) -> dict:
    """The columns of .json/.jsonl rows, by what they hold."""
    return {"question": args.question_column, "context": args.context_column, "answers": args.answer_column}


def load_data(args, tokenizer, accelerator):
    """The questions (Hub or your files), their windows and DataLoaders. Edit this function for other data."""
    with accelerator.main_process_first():  # the main process loads and tokenises, the others read its cache
        if args.train_file:
            columns = columns_of(args)
            task = qa.load_files(args.train_file, args.validation_file, columns, args.version_2_with_negative)
        else:
            task = qa.load_hub(
                args.version_2_with_negative, args.dataset_name, config=args.dataset_config_name
            )
        task.splits["train"] = batches.first_rows(task.splits["train"], args.max_train_samples)
        task.splits["validation"] = batches.first_rows(task.splits["validation"], args.max_eval_samples)
        if args.do_predict:  # the questions to answer (--max_predict_samples: the first N)
            test = qa.load_test(args.test_file, columns_of(args))
            task.splits["test"] = batches.first_rows(test, args.max_predict_samples)
        windows = qa.tokenize_windows(
            task.splits,
            tokenizer,
            args.max_seq_length,
            args.doc_stride,
            args.max_query_length,
            args.preprocessing_num_workers,
            load_from_cache_file=not args.overwrite_cache,
        )
    # Evaluation maps each window's logits back to its question's context: kept aside, not batched.
    examples = task.splits["validation"]
    windows["validation"], eval_windows = qa.set_aside(windows["validation"])
    # AMP: fp16/bf16 batches are padded to a multiple of 8, the shapes Tensor Cores run fastest.
    collator = DataCollatorWithPadding(
        tokenizer,
        pad_to_multiple_of=batches.pad_multiple(accelerator.mixed_precision),
        # --pad_to_max_length: every batch --max_seq_length long
        **({"padding": "max_length", "max_length": args.max_seq_length} if args.pad_to_max_length else {}),
    )
    loader_kwargs = batches.loader_settings(accelerator, collator, args.dataloader_num_workers)
    batch_size = args.per_device_train_batch_size
    sampler = batches.train_sampler(windows["train"], batch_size, args.group_by_length, args.seed)
    train_dataloader = DataLoader(
        windows["train"],
        batch_size=batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        # Its own generator: starting an epoch's iterator then draws nothing from the global RNG
        # (dropout), so a run resumed mid-epoch continues the same random stream.
        generator=torch.Generator().manual_seed(args.seed),
        **loader_kwargs,
    )
    eval_dataloader = DataLoader(
        windows["validation"], batch_size=args.per_device_eval_batch_size, **loader_kwargs
    )
    test = None  # --do_predict: the questions, their windows' positions (as evaluation's) and batches
    if args.do_predict:
        test_windows, positions = qa.set_aside(windows["test"])
        test_dataloader = DataLoader(
            test_windows, batch_size=args.per_device_eval_batch_size, **loader_kwargs
        )
        test = {"examples": task.splits["test"], "windows": positions, "dataloader": test_dataloader}
    unanswered = sum(not answers["text"] for answers in examples["answers"])
    logger.info(
        f"{task.name}: {len(task.splits['train'])} training questions in {len(windows['train'])} windows, "
        f"{len(examples)} validation questions ({unanswered} without an answer) in "
        f"{len(windows['validation'])} windows of {args.max_seq_length} tokens, stride {args.doc_stride}"
    )
    return task, train_dataloader, eval_dataloader, {"examples": examples, "windows": eval_windows}, test


def load_model(args, config):
    """The pretrained encoder with a new span head: a start and an end logit per token."""
    with errors.model_load_errors(args.model_name_or_path):
        return AutoModelForQuestionAnswering.from_pretrained(
            args.model_name_or_path,
            config=config,
            trust_remote_code=args.trust_remote_code,  # a model's own code runs only when you ask
            dtype=torch.float32,  # AMP: fp32 master weights whatever the checkpoint's dtype; autocast casts
        )


# ----------------------------------------------------------------------------- evaluate
def answer(model, dataloader, accelerator, questions, args) -> tuple[dict, dict, int]:
    """Every question's answer text from its windows' logits: ({id: answer}, SQuAD 2.0's {id:
    null score diff}, the number of windows)."""
    model.eval()
    start_logits, end_logits = [], []
    # fork_rng: iterating a DataLoader draws from the global RNG, and evaluating must not change
    # the dropout and shuffling that training sees next (same run, whatever --eval_steps is).
    cuda_devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    # AMP: no_grad, not inference_mode: torchao's fp8 Linear layers fail under it (pytorch/ao#643).
    with torch.random.fork_rng(devices=cuda_devices), torch.no_grad():
        for batch in dataloader:
            outputs = model(**batch)
            # AMP: the logits leave autocast as float32: span scores add a start and an end logit and
            # SQuAD 2.0 subtracts two such sums, which fp16/bf16's few mantissa bits would round.
            starts, ends = outputs.start_logits.float(), outputs.end_logits.float()
            # Windows are padded per batch: equal lengths across processes before gathering. The
            # padding is never read (post-processing reads a window's own length only).
            starts = accelerator.pad_across_processes(starts, dim=1, pad_index=-10_000)
            ends = accelerator.pad_across_processes(ends, dim=1, pad_index=-10_000)
            # gather_for_metrics drops the windows the last batch repeats to fill every process, and
            # keeps the data's order, so the i-th gathered row is the i-th window.
            starts, ends = accelerator.gather_for_metrics((starts, ends))
            start_logits.extend(starts.cpu().numpy())
            end_logits.extend(ends.cpu().numpy())
    model.train()
    predictions, null_odds = qa.postprocess(
        questions["examples"], questions["windows"], start_logits, end_logits, **qa.answer_settings(args)
    )
    return predictions, null_odds, len(start_logits)


def evaluate(model, eval_dataloader, metric, accelerator, gold, args):
    """Answer every validation question from its windows' logits, write predictions.json (and
    null_odds.json for SQuAD 2.0) to --output_dir, and score exact match and F1."""
    predictions, null_odds, windows = answer(model, eval_dataloader, accelerator, gold, args)
    if accelerator.is_main_process:  # the files SQuAD's official evaluation scripts read
        qa.write_answers(args.output_dir, predictions, null_odds)
    formatted, references = qa.metric_inputs(predictions, null_odds, gold["examples"])
    scores = {**metric.compute(predictions=formatted, references=references), "samples": len(references)}
    return {f"eval_{name}": value for name, value in {**scores, "windows": windows}.items()}


# ----------------------------------------------------------------------------- predict
def predict(model, test, accelerator, args) -> dict:
    """--do_predict: every --test_file question's answer, as SQuAD's evaluation script reads them:
    predict_predictions.json (and predict_null_odds.json for SQuAD 2.0)."""
    dataloader = accelerator.prepare_data_loader(test["dataloader"])  # sharded only when predicting
    predictions, null_odds, windows = answer(model, dataloader, accelerator, test, args)
    if accelerator.is_main_process:
        qa.write_answers(args.output_dir, predictions, null_odds, prefix="predict_")
    return {"predict_samples": len(predictions), "predict_windows": windows}


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
                args.tokenizer_name or args.model_name_or_path, **no_trainer.tokenizer_kwargs(args)
            )
        task, train_dataloader, eval_dataloader, gold, test = load_data(args, tokenizer, accelerator)

        # --------------------------------------------------------------------- model
        with precision.zero3_init(accelerator):  # AMP: ZeRO-3: 16-bit zero.Init only if the config asks
            model = load_model(args, config)
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
        metric = metrics.load_metric("squad", "v2" if args.version_2_with_negative else "v1")  # works offline
        run.start(  # --resume_from_checkpoint (model, optimizer, scheduler, GradScaler, RNG), trackers
            model,
            optimizer,
            train_dataloader,
            schedule,
            identity={"task_name": task.name, "version_2_with_negative": args.version_2_with_negative},
            evaluate=lambda: evaluate(model, eval_dataloader, metric, accelerator, gold, args),
            predict=lambda: predict(model, test, accelerator, args),
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
