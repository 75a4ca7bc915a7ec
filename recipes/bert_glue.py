"""Fine-tune a BERT-family encoder on a GLUE task (or your own data) with mixed precision.

    accelerate launch recipes/bert_glue.py --task_name mrpc --mixed_precision fp16
    python recipes/bert_glue.py --task_name mrpc --data_dir $GLUE_DIR --model_name_or_path ./my-bert

accelerate owns autocast and the fp16 GradScaler; this file asks for them and reports what is
really in effect. Every precision-specific line is marked `# AMP:` (`grep -n "AMP:" <recipe>`
lists them). Copy it as the template for your own job (`amp-recipes cp bert_glue my_task.py`).
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
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, get_scheduler

from amp_recipes import arguments, errors, no_trainer
from amp_recipes.amp import compiling, memory, precision
from amp_recipes.tasks import batches, classification, metrics
from amp_recipes.training import optim, outputs
from amp_recipes.training.run import TrainingRun

logger = get_logger(__name__)


# ----------------------------------------------------------------------------- args
def build_parser() -> argparse.ArgumentParser:
    # argparse's parser; under a multi-process launch its error is printed once, not once per rank.
    parser = arguments.ArgumentParser(description=__doc__.splitlines()[0])
    data = parser.add_argument_group("data")
    data.add_argument(
        "--task_name", choices=sorted(classification.GLUE_TASKS), help="GLUE task (else --train_file)."
    )
    data.add_argument(
        "--data_dir",
        default=os.environ.get("GLUE_DIR"),
        help="GLUE TSV folder (default: $GLUE_DIR, else the Hub).",
    )
    data.add_argument(
        "--dataset_name", help="A Hub dataset, read as your own files are (instead of --task_name)."
    )
    data.add_argument("--train_file", help="Your own training data: .csv, .tsv, .json or .jsonl.")
    data.add_argument("--validation_file", help="Your own validation data, same format as --train_file.")
    data.add_argument(
        "--do_predict",
        action="store_true",
        help="Predict the test examples with the final model (or, with --eval_only, the given one): "
        "predict_results_<task>.txt (index, label name), as transformers' run_glue.py writes it.",
    )
    data.add_argument(
        "--test_file", help="Your own examples to predict (--do_predict), with --train_file's text columns."
    )
    data.add_argument(
        "--text_columns", help="Comma-separated text column(s) (default: sentence1,sentence2/sentence/text)."
    )
    data.add_argument("--label_column", default="label", help="Label column of --train_file.")
    data.add_argument(
        "--label_type",
        choices=["auto", "classification", "regression"],
        default="auto",
        help="auto: decimal labels (0.5) mean regression, integers and names classification.",
    )
    data.add_argument("--max_seq_length", "--max_length", type=int, default=128, help="Longer texts are cut.")
    data.add_argument("--max_train_samples", type=int, help="Use only the first N training examples.")
    data.add_argument(
        "--max_eval_samples", type=int, help="Use only the first N examples of each eval split."
    )
    # on: 0.6x the training time on MRPC, dev scores within seed noise (docs/performance.md)
    arguments.add_group_by_length_arg(data, default=True)
    arguments.add_worker_args(data)
    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", default="bert-base-uncased", help="Hub id or local directory.")
    model.add_argument(
        "--ignore_mismatched_sizes", action="store_true", help="Start a new classifier head if sizes differ."
    )
    # training, precision and output flags, and those of the no_trainer example this recipe stands in for
    arguments.add_shared_args(parser, output_default="outputs/<task>", example="glue")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.hf_example_defaults:  # run_glue_no_trainer.py's numbers for every flag not given, its shuffle
        arguments.set_unless_given(parser, args, {**arguments.EXAMPLE_DEFAULTS, "group_by_length": False})
    if args.with_tracking:  # the example's trackers: every one installed, under its project name
        arguments.set_unless_given(parser, args, {"report_to": "all", "project_name": "glue_no_trainer"})
    if sum(map(bool, (args.task_name, args.train_file, args.dataset_name))) > 1:
        parser.error(
            "use one of --task_name (GLUE), --train_file/--validation_file (your data) or --dataset_name."
        )
    if not (args.task_name or args.dataset_name or (args.train_file and args.validation_file)):
        parser.error("give --task_name, both --train_file and --validation_file, or --dataset_name.")
    if args.test_file and not args.do_predict:
        parser.error("--test_file holds the examples --do_predict predicts: add --do_predict.")
    if args.task_name and args.test_file:
        parser.error("--test_file is your own data's; a GLUE task predicts its own test split.")
    if args.do_predict and args.train_file and not args.test_file:
        parser.error("--do_predict with your own files needs --test_file, the examples to predict.")
    if args.task_name and args.text_columns:
        parser.error("--text_columns names the columns of --train_file; a GLUE task has its own.")
    arguments.check_shared_args(parser, args)  # every shared numeric flag in range, no conflicting flags
    at_least_1 = (lambda v: v >= 1, "at least 1")
    arguments.check_ranges(
        parser, args, dict.fromkeys(["max_seq_length", "max_train_samples", "max_eval_samples"], at_least_1)
    )
    args.output_dir = args.output_dir or os.path.join("outputs", args.task_name or "custom")
    return args


# ----------------------------------------------------------------------------- data
def load_data(args, tokenizer, accelerator):
    """The task (GLUE or your files) and its DataLoaders. Edit this function for other data."""
    with accelerator.main_process_first():  # the main process loads and tokenises, the others read its cache
        text_columns = tuple(args.text_columns.split(",")) if args.text_columns else None
        if args.task_name:
            task = classification.load_glue(args.task_name, args.data_dir)
        elif args.dataset_name:  # a Hub dataset, read as your own files are
            task = classification.load_named_dataset(
                args.dataset_name, args.dataset_config_name, text_columns, args.label_column, args.label_type
            )
        else:
            task = classification.load_user_files(
                args.train_file,
                args.validation_file,
                text_columns,
                args.label_column,
                label_type=args.label_type,
            )
        task.splits["train"] = batches.first_rows(task.splits["train"], args.max_train_samples)
        for split in task.eval_splits:
            task.splits[split] = batches.first_rows(task.splits[split], args.max_eval_samples)
        tokenized = classification.tokenize_splits(
            task, tokenizer, args.max_seq_length, args.preprocessing_num_workers
        )
        # --do_predict: the GLUE task's test split(s) or --test_file, texts only.
        tests = (
            classification.load_test_splits(task, args.data_dir, args.test_file) if args.do_predict else {}
        )
        tests = (
            classification.tokenize_splits(task, tokenizer, args.max_seq_length, splits=tests)
            if tests
            else {}
        )
    pad_to = args.max_seq_length if args.pad_to_max_length else None  # --pad_to_max_length: one length
    # AMP: fp16/bf16 batches are padded to a multiple of 8, the shapes Tensor Cores run fastest.
    collator = classification.make_collator(tokenizer, accelerator.mixed_precision, pad_to)
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
    # Evaluated shortest to longest, so that each batch pads little: the scores are over every
    # pair, in any order. --do_predict's test splits keep the file's order.
    eval_dataloaders = {
        split: DataLoader(
            tokenized[split],
            batch_size=args.per_device_eval_batch_size,
            sampler=batches.by_length(tokenized[split]),
            **loader_kwargs,
        )
        for split in task.eval_splits
    }
    test_dataloaders = {
        split: DataLoader(tests[split], batch_size=args.per_device_eval_batch_size, **loader_kwargs)
        for split in tests
    }
    logger.info(
        f"{task.name}: {len(tokenized['train'])} training examples, eval splits {list(eval_dataloaders)}"
    )
    return task, train_dataloader, eval_dataloaders, test_dataloaders


def load_model(args, config, task):
    """The pretrained encoder with a new classification (or regression) head for the task's labels."""
    config.num_labels, config.finetuning_task = task.num_labels, task.name
    if not task.is_regression:
        config.id2label = dict(enumerate(task.label_names))
        config.label2id = {name: i for i, name in enumerate(task.label_names)}
    with errors.model_load_errors(args.model_name_or_path, task.num_labels):
        return AutoModelForSequenceClassification.from_pretrained(
            args.model_name_or_path,
            config=config,
            ignore_mismatched_sizes=args.ignore_mismatched_sizes,
            trust_remote_code=args.trust_remote_code,  # a model's own code runs only when you ask
            dtype=torch.float32,  # AMP: fp32 master weights whatever the checkpoint's dtype; autocast casts
        )


# ----------------------------------------------------------------------------- evaluate
def batch_predictions(model, batch, is_regression: bool) -> torch.Tensor:
    """A batch's predictions: the label's index, or the score for regression (STS-B)."""
    logits = model(**batch).logits  # AMP: fp16/bf16 under autocast; argmax or .float() reads them
    return logits.squeeze(-1).float() if is_regression else logits.argmax(dim=-1)


def evaluate(model, eval_dataloaders, metric, accelerator, is_regression):
    """The task's metric on every eval split (MNLI's mismatched one with the suffix `_mm`)."""
    model.eval()
    results = {}
    # fork_rng: iterating a DataLoader draws from the global RNG, and evaluating must not change
    # the dropout and shuffling that training sees next (same run, whatever --eval_steps is).
    cuda_devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    # AMP: no_grad, not inference_mode: torchao's fp8 Linear layers fail under it (pytorch/ao#643).
    with torch.random.fork_rng(devices=cuda_devices), torch.no_grad():
        for split, dataloader in eval_dataloaders.items():
            samples = 0
            for batch in dataloader:
                predictions = batch_predictions(model, batch, is_regression)
                # gather_for_metrics drops the samples the last batch repeats to fill every process.
                predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
                metric.add_batch(predictions=predictions.cpu(), references=references.cpu())
                samples += len(references)
            suffix = "_mm" if split == "validation_mismatched" else ""
            scores = {**metric.compute(), "samples": samples}
            results.update({f"eval_{name}{suffix}": value for name, value in scores.items()})
    model.train()
    return results


# ----------------------------------------------------------------------------- predict
def predict(model, test_dataloaders, accelerator, task, output_dir) -> dict:
    """--do_predict: each test split's predictions in GLUE's submission format (index, then the
    label's name, or the score for regression), as predict_results_<task>.txt (MNLI's mismatched
    split: predict_results_mnli-mm.txt), written by the main process."""
    model.eval()
    counts = {}
    # AMP: no_grad, not inference_mode: torchao's fp8 Linear layers fail under it (pytorch/ao#643).
    with torch.no_grad():
        for split, dataloader in test_dataloaders.items():
            predicted = []
            for batch in accelerator.prepare_data_loader(dataloader):  # sharded only when predicting
                predictions = batch_predictions(model, batch, task.is_regression)
                predicted += accelerator.gather_for_metrics(predictions).cpu().tolist()  # in file order
            mismatched = split == "test_mismatched"  # MNLI: predict_results_mnli-mm.txt, as run_glue.py
            if accelerator.is_main_process:
                lines = classification.prediction_lines(predicted, task.label_names)
                name = f"predict_results_{task.name}{'-mm' if mismatched else ''}.txt"
                outputs.write_text_atomic(os.path.join(output_dir, name), lines)
            counts[f"predict_samples{'_mm' if mismatched else ''}"] = len(predicted)  # as evaluation's keys
    model.train()
    return counts


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
        task, train_dataloader, eval_dataloaders, test_dataloaders = load_data(args, tokenizer, accelerator)

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
        model, optimizer, train_dataloader, lr_scheduler, *eval_loaders = accelerator.prepare(
            model, optimizer, train_dataloader, lr_scheduler, *eval_dataloaders.values()
        )
        # AMP: under FSDP2 prepare() casts the weights instead; this puts its forward under autocast too.
        precision.autocast_fsdp2_forward(accelerator, model)
        # AMP: prepare() may swap Linear layers for fp8 ones: which ones, and their FLOP share.
        in_effect.update(precision.fp8_layer_report(accelerator, model, args.max_seq_length))
        optim.check_every_parameter_trains(accelerator, model, optimizer)  # AMP: none of them left untrained
        eval_dataloaders = dict(zip(eval_dataloaders, eval_loaders, strict=True))
        metric = metrics.load_metric("glue", task.metric_config)  # shipped with amp_recipes: works offline
        run.start(  # --resume_from_checkpoint (model, optimizer, scheduler, GradScaler, RNG), trackers
            model,
            optimizer,
            train_dataloader,
            schedule,
            identity={"task_name": task.name, "label_names": list(task.label_names or [])},
            evaluate=lambda: evaluate(model, eval_dataloaders, metric, accelerator, task.is_regression),
            predict=lambda: predict(model, test_dataloaders, accelerator, task, args.output_dir),
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
