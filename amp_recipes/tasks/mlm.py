"""Masked-language-model data: unlabelled text (txt / csv / tsv / json / jsonl) loaded and held
out, tokenised into blocks (datasets' cache), and BERT-style masks drawn reproducibly per block."""

from __future__ import annotations

import hashlib
from pathlib import Path

import datasets
import torch
from transformers import DataCollatorForLanguageModeling

from amp_recipes.errors import InputError
from amp_recipes.tasks.batches import check_max_length
from amp_recipes.tasks.files import FILE_BUILDERS, load_user_file


def load_text_files(
    train_file: str,
    validation_file: str | None = None,
    text_column: str = "text",
    validation_percentage: float = 5.0,
    seed: int = 42,
    cache_dir: str | None = None,
) -> datasets.DatasetDict:
    """Unlabelled text for language-model training: `.txt` (one text per line, empty lines
    dropped) or a text column of `.csv`/`.tsv`/`.json`/`.jsonl`. Without a validation file,
    `validation_percentage` of the texts are held out (seeded split)."""

    def read(path: str) -> datasets.Dataset:
        table = load_user_file(path, cache_dir, {".txt": "text", **FILE_BUILDERS})
        if Path(path).suffix.lower() != ".txt":
            if text_column not in table.column_names:
                raise InputError(
                    f"{path} has no column {text_column!r}; found {table.column_names}. Use --text_column."
                )
            table = (
                table.select_columns([text_column]).rename_column(text_column, "text")
                if text_column != "text"
                else table.select_columns(["text"])
            )
        table = table.filter(
            lambda row: isinstance(row["text"], str) and bool(row["text"].strip()),
            desc="Dropping empty texts",
        )
        if table.num_rows == 0:
            raise InputError(f"{path} holds no text.")
        return table

    train = read(train_file)
    if validation_file:
        return datasets.DatasetDict({"train": train, "validation": read(validation_file)})
    if not 0 < validation_percentage < 100:
        raise InputError(
            "--validation_split_percentage must be between 0 and 100 (or give --validation_file)."
        )
    held_out = max(1, round(train.num_rows * validation_percentage / 100))
    if held_out >= train.num_rows:
        raise InputError(f"{train_file} has too few texts ({train.num_rows}) to hold out a validation split.")
    split = train.train_test_split(test_size=held_out, seed=seed)
    return datasets.DatasetDict({"train": split["train"], "validation": split["test"]})


def load_named_dataset(
    name: str,
    config: str | None,
    text_column: str | None = None,
    validation_percentage: float = 5.0,
    seed: int = 42,
) -> datasets.DatasetDict:
    """A Hub dataset of text (--dataset_name, --dataset_config_name): its `text` column, else its
    first (or --text_column); without a validation split, `validation_percentage` of the training
    texts held out (seeded split), as with your own files."""
    from amp_recipes.tasks.files import load_hub_dataset

    raw = load_hub_dataset(
        name, *([config] if config else []), offline="Give --train_file (and --validation_file) instead."
    )
    columns = raw["train"].column_names
    column = text_column if text_column in columns else "text" if "text" in columns else columns[0]

    def texts(table: datasets.Dataset) -> datasets.Dataset:
        table = table.select_columns([column]).rename_columns({column: "text"} if column != "text" else {})
        return table.filter(lambda row: isinstance(row["text"], str) and bool(row["text"].strip()))

    if "validation" in raw:
        return datasets.DatasetDict({"train": texts(raw["train"]), "validation": texts(raw["validation"])})
    train = texts(raw["train"])
    split = train.train_test_split(
        test_size=max(1, round(train.num_rows * validation_percentage / 100)), seed=seed
    )
    return datasets.DatasetDict({"train": split["train"], "validation": split["test"]})


def tokenize_lines(
    splits, tokenizer, max_seq_length: int, num_proc=None, pad_to_max_length=False, load_from_cache_file=True
):
    """--line_by_line: each text (line) its own sequence, cut at max_seq_length tokens (and, with
    --pad_to_max_length, padded to it), as transformers' run_mlm_no_trainer.py does."""
    check_max_length(tokenizer, max_seq_length)

    def tokenize(batch):
        return tokenizer(
            batch["text"],
            truncation=True,
            max_length=max_seq_length,
            padding="max_length" if pad_to_max_length else False,
            return_special_tokens_mask=True,
        )

    return splits.map(
        tokenize,
        batched=True,
        remove_columns=splits["train"].column_names,
        num_proc=num_proc,
        load_from_cache_file=load_from_cache_file,
        desc="Tokenizing lines",
    )


def tokenize_and_group(
    splits, tokenizer, max_seq_length: int, num_proc: int | None = None, load_from_cache_file: bool = True
):
    """Language-model inputs: tokenise each text (with its special tokens), concatenate them and
    cut blocks of max_seq_length tokens, so no compute goes to padding. A split too short for one
    block keeps what it has as a single shorter block."""
    check_max_length(tokenizer, max_seq_length)

    def tokenize(batch):
        return tokenizer(batch["text"], return_special_tokens_mask=True)

    def group(batch):
        columns = {key: sum(batch[key], []) for key in batch}
        total = len(columns["input_ids"])
        usable = (total // max_seq_length) * max_seq_length or total
        return {
            key: [values[i : i + max_seq_length] for i in range(0, usable, max_seq_length)]
            for key, values in columns.items()
        }

    tokenized = splits.map(
        tokenize,
        batched=True,
        remove_columns=splits["train"].column_names,
        num_proc=num_proc,
        load_from_cache_file=load_from_cache_file,  # --overwrite_cache: tokenise again
        desc="Tokenizing",
    )
    return tokenized.map(
        group,
        batched=True,
        batch_size=1000,
        num_proc=num_proc,
        load_from_cache_file=load_from_cache_file,
        desc=f"Grouping into blocks of {max_seq_length}",
    )


class SeededMaskCollator(DataCollatorForLanguageModeling):
    """transformers' masked-LM collator (BERT-style masks) whose masks are drawn, block by block,
    from a generator seeded by the run's seed and the block's own tokens.

    The stock collator draws from the global RNG (or one generator stream), and accelerate's
    DataLoader builds each batch one step ahead, so a checkpoint's RNG state already holds the next
    batch's masks: a resumed run would mask differently, and its dropout would shift too. Keyed on
    each block's tokens (padding left out), a block gets the same masks wherever and whenever it is
    built (one batch ahead, in a worker, after a resume, in each evaluation) and whatever batch it
    is in: with two processes the last evaluation batch is filled up with repeated blocks, and the
    held-out loss must still score the same masked tokens as one process does. The global RNG
    stays the training's alone."""

    def __init__(self, tokenizer, mlm_probability: float, pad_to_multiple_of: int | None, seed: int):
        super().__init__(tokenizer, mlm_probability=mlm_probability, pad_to_multiple_of=pad_to_multiple_of)
        self.mask_seed = seed

    def torch_mask_tokens(self, inputs, special_tokens_mask=None, offset_mapping=None):
        labels = torch.full_like(inputs, -100)
        for row, tokens in enumerate(inputs):
            length = len(tokens)  # without the padding at the end
            while length and tokens[length - 1] == self.tokenizer.pad_token_id:
                length -= 1
            digest = hashlib.blake2b(str(self.mask_seed).encode(), digest_size=8)
            digest.update(tokens[:length].to(torch.int64).numpy().tobytes())
            self.generator = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
            special = None if special_tokens_mask is None else special_tokens_mask[row : row + 1, :length]
            masked, row_labels = super().torch_mask_tokens(tokens[None, :length].clone(), special)
            inputs[row, :length], labels[row, :length] = masked[0], row_labels[0]
        return inputs, labels
