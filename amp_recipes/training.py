"""Pieces every fine-tuning recipe would otherwise copy: tokenisation, collation,
length-grouped sampling, optimizer parameter groups, metrics and the run record."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import datasets
import evaluate
import torch
from transformers import DataCollatorWithPadding
from transformers.trainer_pt_utils import LengthGroupedSampler

from .data import InputError, TaskData

METRICS_DIR = Path(__file__).parent / "metrics"


def check_launch(accelerator) -> None:
    """Refuse launches that accelerate would quietly run another way.

    - On a machine without GPUs, `accelerate launch --multi_gpu --num_processes N` starts N
      independent single-process runs (each training on all the data, all writing the same
      files) unless ACCELERATE_USE_CPU=1 asks for a gloo process group.
    - accelerate turns on FSDP / DeepSpeed only over GPU (or other accelerator) process groups:
      asked on a CPU, it trains with plain DDP instead.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes != launched:
        raise InputError(
            f"{launched} processes were launched but accelerate sees {accelerator.num_processes}: on a machine "
            "without GPUs set ACCELERATE_USE_CPU=1 for multi-process CPU training (gloo)."
        )
    for engine in ("FSDP", "DEEPSPEED"):
        asked = os.environ.get(f"ACCELERATE_USE_{engine}", "false").lower() == "true"
        if asked and accelerator.distributed_type.value != engine:
            raise InputError(
                f"{engine} was requested but accelerate set up {accelerator.distributed_type.value} on "
                f"{accelerator.device.type}: accelerate enables {engine} only on GPUs; use a GPU machine or drop it."
            )


def check_max_length(tokenizer, max_seq_length: int) -> None:
    if max_seq_length > tokenizer.model_max_length:
        raise InputError(
            f"--max_seq_length {max_seq_length} is longer than the model's limit of {tokenizer.model_max_length}."
        )


def tokenize_splits(task: TaskData, tokenizer, max_seq_length: int, num_proc: int | None = None):
    """Tokenise every split with `datasets.map` (cached on disk, so a second run skips it).

    No padding here: the collator pads each batch to its own longest sequence.
    """
    check_max_length(tokenizer, max_seq_length)

    # datasets fingerprints (dill-hashes) this function and everything it refers to on every run
    # to find its cache: refer to the column names, not to `task`, whose splits it would hash too.
    text_columns = tuple(task.text_columns)

    def tokenize(batch):
        texts = [batch[column] for column in text_columns]
        encoded = tokenizer(*texts, truncation=True, max_length=max_seq_length)
        encoded["labels"] = batch["label"]
        return encoded

    key = ("tokenize_splits/1", text_columns, max_seq_length)
    return cached_map(task.splits, tokenize, tokenizer, key, num_proc=num_proc, desc="Tokenizing")


def tokenizer_fingerprint(tokenizer) -> str | None:
    """A hash of a fast tokenizer's full definition (vocabulary, normaliser, special tokens ...),
    without the truncation/padding state that each call of the tokenizer resets; None for slow
    (Python) tokenizers. ~3 ms for a BERT vocabulary."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    backend = tokenizer.backend_tokenizer
    truncation, padding = backend.truncation, backend.padding
    backend.no_truncation()
    backend.no_padding()
    try:
        definition = backend.to_str()
    finally:
        if truncation:
            backend.enable_truncation(**truncation)
        if padding:
            backend.enable_padding(**padding)
    definition += repr(sorted(tokenizer.init_kwargs.items(), key=str))  # padding side etc.
    return hashlib.sha256(definition.encode()).hexdigest()


def cached_map(splits, function, tokenizer, key, remove_columns=None, **map_kwargs):
    """Batched `map` over each split, cached on disk by `datasets` under a fingerprint of (the
    split, the tokenizer's full definition, `key`).

    Written here because datasets' own fingerprint dill-pickles the function with everything it
    refers to, the tokenizer included, on every run: about 0.2 s for MiniLM's tokenizer, most of
    a second run's data preparation. Slow (Python) tokenizers keep datasets' own fingerprint."""
    tokenizer_hash = tokenizer_fingerprint(tokenizer)
    mapped = {}
    for split, table in splits.items():
        fingerprint = None
        if tokenizer_hash is not None:
            parts = (table._fingerprint, tokenizer_hash, key, map_kwargs.get("batch_size"))
            fingerprint = hashlib.sha256(repr(parts).encode()).hexdigest()[:32]
        mapped[split] = table.map(
            function,
            batched=True,
            remove_columns=table.column_names if remove_columns is None else remove_columns,
            new_fingerprint=fingerprint,
            **map_kwargs,
        )
    return datasets.DatasetDict(mapped)


PREPARED_FORMAT = 1  # bump when what a recipe's prepare step produces changes


def prepare_once(build, sources, tokenizer, key, cache_dir=None):
    """`build()` -> (TaskData, tokenised DatasetDict), or the copy saved by an earlier run that
    prepared the same local files (path, size, modification time) with the same code, tokenizer
    and `key`.

    Written here because datasets' own caches, even when every step hits, cost a fixed ~0.07 s of
    builder and cache look-ups per run: most of a second run's data preparation on a small task
    such as MRPC. This cache is one `load_from_disk` (~5 ms). Used for local files only (sources
    None: data from the Hub, where datasets' cache alone applies). It lives beside datasets' cache
    (`$HF_DATASETS_CACHE/amp_recipes_prepared`); delete that folder to reclaim the space."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    if sources is None or fingerprint is None or not all(os.path.isfile(p) for p in sources):
        return build()  # (a missing file is reported by build())
    stats = {str(Path(p).resolve()): os.stat(p) for p in sources}
    files = [(path, stat.st_size, stat.st_mtime_ns) for path, stat in stats.items()]
    # The code that prepares: the file defining build() (a copied recipe edited by its user, say)
    # and this library's data code. Any edit to them prepares again.
    code = [Path(build.__code__.co_filename), Path(__file__), Path(__file__).with_name("data.py")]
    code = [hashlib.sha256(path.read_bytes()).hexdigest() for path in code if path.is_file()]
    parts = (PREPARED_FORMAT, files, code, fingerprint, key)
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:32]
    root = Path(cache_dir or datasets.config.HF_DATASETS_CACHE) / "amp_recipes_prepared"
    final = root / digest
    if final.is_dir():
        try:
            meta = json.loads((final / "task.json").read_text())
            tokenized = datasets.load_from_disk(str(final / "data"))
            task = TaskData(splits=datasets.DatasetDict(), **{k: _tuple(v) for k, v in meta.items()})
            return task, tokenized
        except (OSError, ValueError, TypeError):
            pass  # unreadable: prepare again, and replace it below
    task, tokenized = build()
    # Saved under a temporary name, then renamed: a crash never leaves a folder that looks complete.
    try:
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=root))
    except OSError:
        return task, tokenized  # nowhere to keep a copy: this run has its data anyway
    try:
        tokenized.save_to_disk(str(scratch / "data"))
        meta = {k: v for k, v in vars(task).items() if k != "splits"}
        (scratch / "task.json").write_text(json.dumps(meta))
        if final.is_dir():
            shutil.rmtree(final, ignore_errors=True)
        os.replace(scratch, final)
    except OSError:
        pass  # another process saved it first, or the disk is full: this run has its data anyway
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return task, tokenized


def _tuple(value):
    return tuple(value) if isinstance(value, list) else value


def pad_multiple(mixed_precision: str) -> int | None:
    """Tensor Cores run fp16/bf16 matmuls fastest on dimensions that are multiples of 8, so
    reduced-precision batches are padded up to one; fp32 pads to the longest sequence."""
    return 8 if mixed_precision in ("fp16", "bf16", "fp8") else None


def make_collator(tokenizer, mixed_precision: str):
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_multiple(mixed_precision))


def loader_settings(accelerator, collator, num_workers: int | None) -> dict:
    """DataLoader keyword arguments shared by a recipe's loaders: on CUDA, pinned memory and (by
    default) 2 worker processes that build batches while the GPU computes; none elsewhere."""
    on_cuda = accelerator.device.type == "cuda"
    num_workers = num_workers if num_workers is not None else 2 * on_cuda
    # persistent: no worker restart each epoch
    return {
        "collate_fn": collator,
        "pin_memory": on_cuda,
        "num_workers": num_workers,
        "persistent_workers": num_workers > 0,
    }


def train_sampler(dataset, batch_size: int, group_by_length: bool, seed: int):
    """None (the DataLoader shuffles) or a sampler that batches sequences of similar length.

    Grouping cuts padding, hence wasted compute, at the price of less random batches.
    """
    if not group_by_length:
        return None
    return EpochLengthGroupedSampler(
        batch_size, lengths=[len(ids) for ids in dataset["input_ids"]], seed=seed
    )


class EpochLengthGroupedSampler(LengthGroupedSampler):
    """transformers' length-grouped sampler, reseeded from (seed, epoch) like accelerate's seedable
    sampler, so a run resumed mid-epoch sees the same batches as an uninterrupted one."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        super().__init__(batch_size, lengths=lengths, generator=torch.Generator().manual_seed(seed))
        self.seed = seed

    def set_epoch(self, epoch: int) -> None:  # accelerate's DataLoaderShard calls it each epoch
        self.generator.manual_seed(self.seed + epoch)


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

    def __init__(self, output_dir: str | os.PathLike, enabled: bool, resume_step: int | None = None):
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        if enabled:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            history = self.output_dir / "log_history.jsonl"
            kept = []
            if resume_step is not None and history.exists():  # keep what happened up to the checkpoint
                kept = [
                    line
                    for line in history.read_text().splitlines()
                    if json.loads(line)["step"] <= resume_step
                ]
            history.write_text("".join(line + "\n" for line in kept))

    def log(self, values: dict, step: int) -> None:
        if self.enabled:
            with open(self.output_dir / "log_history.jsonl", "a") as handle:
                handle.write(json.dumps({"step": step, **values}) + "\n")

    def write_results(self, results: dict) -> None:
        if self.enabled:
            write_json_atomic(self.output_dir / "eval_results.json", results)


def tokenize_and_group(splits, tokenizer, max_seq_length: int, num_proc: int | None = None):
    """Language-model inputs: tokenise each text (with its special tokens), concatenate them and
    cut blocks of max_seq_length tokens, so no compute goes to padding. Cached by `datasets.map`.
    A split too short for one block keeps what it has as a single shorter block."""
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

    tokenized = cached_map(
        splits, tokenize, tokenizer, ("mlm-tokenize/1",), num_proc=num_proc, desc="Tokenizing"
    )
    return cached_map(
        tokenized,
        group,
        tokenizer,
        ("mlm-group/1", max_seq_length),
        remove_columns=[],
        batch_size=1000,
        num_proc=num_proc,
        desc=f"Grouping into blocks of {max_seq_length}",
    )
