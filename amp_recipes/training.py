"""Pieces every fine-tuning recipe would otherwise copy: tokenisation, collation,
length-grouped sampling, optimizer parameter groups, metrics and the run record."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import evaluate
import torch
from transformers import DataCollatorWithPadding
from transformers.trainer_pt_utils import LengthGroupedSampler

from .data import InputError, TaskData

METRICS_DIR = Path(__file__).parent / "metrics"


def tokenize_splits(task: TaskData, tokenizer, max_seq_length: int, num_proc: int | None = None):
    """Tokenise every split with `datasets.map` (cached on disk, so a second run skips it).

    No padding here: the collator pads each batch to its own longest sequence.
    """
    if max_seq_length > tokenizer.model_max_length:
        raise InputError(
            f"--max_seq_length {max_seq_length} is longer than the model's limit of {tokenizer.model_max_length}."
        )

    def tokenize(batch):
        texts = [batch[column] for column in task.text_columns]
        encoded = tokenizer(*texts, truncation=True, max_length=max_seq_length)
        encoded["labels"] = batch["label"]
        return encoded

    return task.splits.map(
        tokenize,
        batched=True,
        num_proc=num_proc,
        remove_columns=task.splits["train"].column_names,
        desc="Tokenizing",
    )


def make_collator(tokenizer, mixed_precision: str):
    # Tensor Cores run fp16/bf16 matmuls fastest on dimensions that are multiples of 8,
    # so reduced-precision batches are padded up to one; fp32 pads to the longest sequence.
    pad_to_multiple_of = 8 if mixed_precision in ("fp16", "bf16", "fp8") else None
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)


def train_sampler(dataset, batch_size: int, group_by_length: bool, seed: int):
    """None (the DataLoader shuffles) or a sampler that batches sequences of similar length.

    Grouping cuts padding, hence wasted compute, at the price of less random batches.
    """
    if not group_by_length:
        return None
    generator = torch.Generator().manual_seed(seed)
    lengths = [len(ids) for ids in dataset["input_ids"]]
    return LengthGroupedSampler(batch_size, lengths=lengths, generator=generator)


def optimizer_grouped_parameters(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on biases and normalisation weights (the BERT convention)."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        lowered = name.lower()
        (no_decay if lowered.endswith("bias") or "norm" in lowered else decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def load_metric(config_name: str):
    """The GLUE metric module shipped in this package, so evaluation works offline."""
    return evaluate.load(str(METRICS_DIR / "glue"), config_name, keep_in_memory=True)


def write_json_atomic(path: str | os.PathLike, payload: dict) -> None:
    """Write to a temporary file in the same folder, flush to disk, then rename into place:
    a crash leaves either the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        json.dump(payload, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(handle.name, path)


class RunRecord:
    """The run's local record in `output_dir`: `log_history.jsonl` (one line per log or eval)
    and `eval_results.json` (final metrics and run summary). Writes only on the main process."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool):
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        if enabled:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "log_history.jsonl").write_text("")

    def log(self, values: dict, step: int) -> None:
        if self.enabled:
            with open(self.output_dir / "log_history.jsonl", "a") as handle:
                handle.write(json.dumps({"step": step, **values}) + "\n")

    def write_results(self, results: dict) -> None:
        if self.enabled:
            write_json_atomic(self.output_dir / "eval_results.json", results)
