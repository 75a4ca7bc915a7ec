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
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, GradScalerKwargs, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer, get_scheduler

from amp_recipes import arguments, errors, no_trainer
from amp_recipes.amp import compiling, memory, precision
from amp_recipes.tasks import batches, mlm
from amp_recipes.training import optim
from amp_recipes.training.run import TrainingRun

logger = get_logger(__name__)


# ----------------------------------------------------------------------------- args
def build_parser() -> argparse.ArgumentParser:
    # argparse's parser; under a multi-process launch its error is printed once, not once per rank.
    parser = arguments.ArgumentParser(description=__doc__.splitlines()[0])
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", help="A Hub dataset of text (instead of --train_file).")
    data.add_argument("--train_file", help="Your text: .txt (one per line), .csv, .tsv, .json, .jsonl.")
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
    data.add_argument(
        "--line_by_line",
        nargs="?",
        const=True,
        default=False,
        type=arguments.truthy,
        help="One sequence per non-empty line, not the text concatenated and cut (--line_by_line, or "
        "--line_by_line true; false is false here, where the example reads any value as true).",
    )
    data.add_argument(
        "--overwrite_cache", action="store_true", help="Tokenise again instead of reading datasets' cache."
    )
    arguments.add_worker_args(data)
    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", default="bert-base-uncased", help="Hub id or local directory.")
    # training, precision and output flags, and those of the no_trainer example this recipe stands in for
    arguments.add_shared_args(parser, output_default="outputs/mlm", example="mlm")
    parser.set_defaults(learning_rate=5e-5, per_device_train_batch_size=32, num_train_epochs=1)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    # run_mlm_no_trainer.py's numbers for every flag not given: 3 epochs, the model's own length (None)
    if args.hf_example_defaults:
        example = {**arguments.EXAMPLE_DEFAULTS, "max_seq_length": None, "num_train_epochs": 3}
        arguments.set_unless_given(parser, args, example)
    if args.with_tracking:  # the example's trackers: every one installed, under its project name
        arguments.set_unless_given(parser, args, {"report_to": "all", "project_name": "mlm_no_trainer"})
    if bool(args.train_file) == bool(args.dataset_name):
        parser.error("give --train_file (your text) or --dataset_name (a Hub dataset of text), one of them.")
    arguments.check_shared_args(parser, args)  # every shared numeric flag in range, no conflicting flags
    ranges = {
        "max_seq_length": (lambda v: v >= 8, "at least 8"),
        "mlm_probability": (lambda v: 0 < v < 1, "in (0, 1)"),
        "validation_split_percentage": (
            lambda v: 0 < v < 100,
            "between 0 and 100 (or give --validation_file)",
        ),
    }
    arguments.check_ranges(parser, args, ranges)
    args.output_dir = args.output_dir or "outputs/mlm"
    return args


# ----------------------------------------------------------------------------- data
def load_data(args, tokenizer, accelerator):
    """Blocks of --max_seq_length tokens from your texts, and their DataLoaders."""
    with accelerator.main_process_first():  # the main process loads and tokenises, the others read its cache
        if args.dataset_name:  # a Hub dataset of text
            splits = mlm.load_named_dataset(
                args.dataset_name,
                args.dataset_config_name,
                args.text_column,
                args.validation_split_percentage,
                args.seed,
            )
        else:
            splits = mlm.load_text_files(
                args.train_file,
                args.validation_file,
                args.text_column,
                args.validation_split_percentage,
                args.seed,
            )
        args.max_seq_length = no_trainer.max_seq_length(args, tokenizer)  # unset: the model's, at most 1024
        workers, from_cache = args.preprocessing_num_workers, not args.overwrite_cache
        if args.line_by_line:  # one sequence per line (padded to --max_seq_length with --pad_to_max_length)
            blocks = mlm.tokenize_lines(
                splits, tokenizer, args.max_seq_length, workers, args.pad_to_max_length, from_cache
            )
        else:  # the texts concatenated and cut into blocks: no padding at all
            blocks = mlm.tokenize_and_group(splits, tokenizer, args.max_seq_length, workers, from_cache)
    # Masks BERT-style (80% [MASK], 10% random, 10% kept) as batches are built, drawn from the seed
    # and each batch's tokens: a resumed run masks every batch as an uninterrupted one does.
    # AMP: fp16/bf16 batches (a last, shorter block) are padded to a multiple of 8, for Tensor Cores.
    collator = mlm.SeededMaskCollator(
        tokenizer,
        mlm_probability=args.mlm_probability,
        pad_to_multiple_of=batches.pad_multiple(accelerator.mixed_precision),
        seed=args.seed,
    )
    loader_kwargs = batches.loader_settings(accelerator, collator, args.dataloader_num_workers)
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


def load_model(args):
    """The pretrained encoder with its masked-LM head (the pretraining objective's, weights and all)."""
    with errors.model_load_errors(args.model_name_or_path):
        config = AutoConfig.from_pretrained(
            args.config_name or args.model_name_or_path, trust_remote_code=args.trust_remote_code
        )
        return AutoModelForMaskedLM.from_pretrained(
            args.model_name_or_path,
            config=config,
            trust_remote_code=args.trust_remote_code,  # a model's own code runs only when you ask
            dtype=torch.float32,  # AMP: fp32 master weights whatever the checkpoint's dtype; autocast casts
        )


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
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50)), "eval_masked_tokens": masked}


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
            tokenizer = AutoTokenizer.from_pretrained(
                args.tokenizer_name or args.model_name_or_path, **no_trainer.tokenizer_kwargs(args)
            )
        train_dataloader, eval_dataloader = load_data(args, tokenizer, accelerator)

        # --------------------------------------------------------------------- model
        with precision.zero3_init(accelerator):  # AMP: ZeRO-3: 16-bit zero.Init only if the config asks
            model = load_model(args)
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
        run.start(  # --resume_from_checkpoint (model, optimizer, scheduler, GradScaler, RNG), trackers
            model,
            optimizer,
            train_dataloader,
            schedule,
            identity={"objective": "mlm"},
            evaluate=lambda: evaluate(model, eval_dataloader, accelerator),
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
