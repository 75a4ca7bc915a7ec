"""The textbook mixed-precision loop: fine-tune a BERT-family encoder on a GLUE task, AMP by hand.

    python recipes/minimal/bert_glue.py --task_name mrpc --mixed_precision fp16

One device, plain PyTorch: torch.autocast runs the forward in fp16/bf16 over fp32 weights; for fp16
a torch.amp.GradScaler scales the loss so small gradients survive and skips steps that overflowed.
recipes/bert_glue.py leaves these calls to accelerate and adds what a long job needs (many GPUs,
checkpoints and resume, telemetry): start here to learn AMP or port it to your loop, there to scale.
"""

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, RandomSampler
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_scheduler,
)

from amp_recipes.tasks import batches, classification  # the task's data: loaded, tokenised
from amp_recipes.tasks.metrics import load_metric  # the task's GLUE metric, shipped so it works offline

DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task_name", default="mrpc", help="The GLUE task: cola, mnli, mrpc, qnli, ...")
    parser.add_argument("--data_dir", default=os.environ.get("GLUE_DIR"), help="GLUE TSVs (else the Hub).")
    parser.add_argument("--model_name_or_path", default="bert-base-uncased", help="A Hub id or a folder.")
    parser.add_argument("--output_dir", default="outputs/minimal", help="Where the model and results go.")
    parser.add_argument("--mixed_precision", choices=list(DTYPES), default="no", help="fp16, bf16 or no.")
    parser.add_argument("--max_seq_length", type=int, default=128, help="Longer inputs are truncated.")
    parser.add_argument("--per_device_train_batch_size", type=int, default=32, help="Sequences per batch.")
    parser.add_argument(
        "--per_device_eval_batch_size", type=int, default=64, help="Sequences per eval batch."
    )
    parser.add_argument("--learning_rate", type=float, default=2e-5, help="AdamW's peak learning rate.")
    parser.add_argument("--weight_decay", type=float, default=0.01, help="AdamW's (not on biases, norms).")
    parser.add_argument("--warmup_ratio", type=float, default=0.1, help="Share of steps warming up.")
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help="Clip to this norm; 0: no clipping.")
    parser.add_argument("--seed", type=int, default=42, help="Weights of the new head, shuffling.")
    parser.add_argument("--num_train_epochs", type=int, default=3, help="Passes over the training set.")
    parser.add_argument("--max_train_steps", type=int, help="Stop after N optimizer steps.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1, help="Batches per step.")
    parser.add_argument("--logging_steps", type=int, default=10, help="Log the mean loss every N steps.")
    parser.add_argument("--max_train_samples", type=int, help="Use only the first N training examples.")
    parser.add_argument("--max_eval_samples", type=int, help="Use only the first N dev examples.")
    parser.add_argument(
        "--group_by_length", action="store_true", default=True, help="Batch similar lengths (default)."
    )
    parser.add_argument(
        "--no_group_by_length", dest="group_by_length", action="store_false", help="The plain shuffle."
    )
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.mixed_precision]
    amp = dtype != torch.float32  # AMP: autocast and padding to multiples of 8 for fp16/bf16 only
    torch.manual_seed(args.seed)

    # ------------------------------------------------------------------------- data
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    task = classification.load_glue(args.task_name, args.data_dir)
    task.splits["train"] = batches.first_rows(task.splits["train"], args.max_train_samples)
    task.splits["validation"] = batches.first_rows(task.splits["validation"], args.max_eval_samples)
    tokenized = classification.tokenize_splits(task, tokenizer, args.max_seq_length)
    # AMP: fp16/bf16 batches padded to a multiple of 8, the shapes Tensor Cores run fastest.
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if amp else None)
    if args.group_by_length:  # less padding: 0.6x the time on MRPC, scores within seed noise
        sampler = batches.train_sampler(tokenized["train"], args.per_device_train_batch_size, True, args.seed)
    else:
        sampler = RandomSampler(tokenized["train"], generator=torch.Generator())
    train_loader = DataLoader(
        tokenized["train"],
        args.per_device_train_batch_size,
        sampler=sampler,
        collate_fn=collator,
        generator=torch.Generator(),  # the loader's own RNG, off the global one
    )
    eval_loader = DataLoader(  # shortest to longest: little padding, and accuracy has no order
        tokenized["validation"],
        args.per_device_eval_batch_size,
        sampler=batches.by_length(tokenized["validation"]),
        collate_fn=collator,
    )

    # ------------------------------------------------------------------------- model and optimizer
    # AMP: fp32 master weights, whatever the checkpoint's dtype; autocast casts each op's inputs instead.
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, num_labels=task.num_labels, dtype=torch.float32
    ).to(device)
    decay, no_decay = [], []  # no weight decay on biases and LayerNorm weights (the BERT convention)
    for name, parameter in model.named_parameters():
        (no_decay if name.endswith("bias") or "norm" in name.lower() else decay).append(parameter)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, fused=True)  # one kernel for all weights
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    max_steps = args.max_train_steps or steps_per_epoch * args.num_train_epochs
    scheduler = get_scheduler("linear", optimizer, int(args.warmup_ratio * max_steps), max_steps)
    # AMP: fp16 only: scale the loss so small gradients do not flush to zero; bf16 has fp32's range.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    # ------------------------------------------------------------------------- train
    max_grad_norm = args.max_grad_norm or math.inf  # 0: no clipping (the norm is still measured)
    step, skipped = 0, 0  # optimizer steps taken; of them, skipped by the GradScaler (fp16)
    history, window_losses = [], []  # the log lines; the batch losses since the last one
    tokens, positions = 0, 0  # real tokens and padded positions of the training batches
    started = time.perf_counter()
    model.train()
    for epoch in range(math.ceil(max_steps / steps_per_epoch)):
        if args.group_by_length:  # the batches depend on (seed, epoch) only
            sampler.set_epoch(epoch)
        else:
            sampler.generator.manual_seed(args.seed + epoch)
        for i, batch in enumerate(train_loader, start=1):
            batch = batch.to(device)
            # AMP: the forward in fp16/bf16 where it is safe (matmuls), fp32 where it is not (softmax, loss).
            with torch.autocast(device.type, dtype=dtype, enabled=amp):
                loss = model(**batch).loss
            scaler.scale(loss / args.gradient_accumulation_steps).backward()  # AMP: fp16: loss x scale
            window_losses.append(loss.detach())  # every batch's loss since the last log line
            tokens += batch["attention_mask"].sum()  # stays on the device: no sync per batch
            positions += batch["attention_mask"].numel()
            if i % args.gradient_accumulation_steps and i != len(train_loader):
                continue  # accumulate the next batch's gradients
            scaler.unscale_(optimizer)  # AMP: gradients / scale, so clipping sees their true norm
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            scale = scaler.get_scale()  # (a host sync on a GPU, the price of reading it every step)
            scaler.step(optimizer)  # AMP: skips optimizer.step() if any gradient is inf/NaN
            scaler.update()  # AMP: halves the scale after an overflow, doubles it after 2000 good steps
            if scaler.get_scale() < scale:  # AMP: the step was skipped: the schedule must not move
                skipped += 1
            else:
                scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % args.logging_steps == 0 or step == max_steps:
                window = torch.stack(window_losses)
                loss_value = window[window.isfinite()].mean().item()  # the window's mean, inf/NaN left out
                lr = scheduler.get_last_lr()[0]
                row = dict(step=step, loss=loss_value, grad_norm=grad_norm.item(), learning_rate=lr)
                history.append({**row, "loss_scale": scaler.get_scale(), "skipped_steps": skipped})  # AMP
                print(json.dumps(history[-1]), flush=True)
                window_losses = []
            if step == max_steps:
                break
    train_seconds = time.perf_counter() - started

    # ------------------------------------------------------------------------- evaluate and save
    metric = load_metric("glue", task.metric_config)
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=amp):
        for batch in eval_loader:
            logits = model(**batch.to(device)).logits.float()  # AMP: fp32 logits for the metric
            predictions = logits.squeeze(-1) if task.is_regression else logits.argmax(dim=-1)
            metric.add_batch(predictions=predictions.cpu(), references=batch["labels"].cpu())
    results = {f"eval_{name}": value for name, value in metric.compute().items()}
    # Peak memory on a CPU: the peak RSS, which Linux gives in KiB and macOS in bytes.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else rss
    results.update(mixed_precision=args.mixed_precision, train_steps=step, skipped_steps=skipped)
    results.update(train_runtime_seconds=train_seconds, train_tokens=int(tokens), peak_memory_bytes=peak)
    results["padding_fraction"] = 1 - int(tokens) / positions  # of the training batches' positions
    output_dir = Path(args.output_dir)
    model.save_pretrained(output_dir)  # AMP: the fp32 master weights
    tokenizer.save_pretrained(output_dir)
    (output_dir / "log_history.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history))
    (output_dir / "eval_results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
