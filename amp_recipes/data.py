"""The recipes' data: GLUE (Hub, `$GLUE_DIR` folder) or the user's own files, loaded and checked,
then tokenised, collated and batched.

Every source is normalised to the Hub's column names (`sentence1`, `question`, ...) plus `label`:
an int class id in the Hub's label order, or a float for regression. That way a model fine-tuned
from local TSV files has the same `id2label` as one fine-tuned from the Hub.
"""

from __future__ import annotations

import csv
import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding
from transformers.trainer_pt_utils import LengthGroupedSampler

from .errors import InputError
from .files import FILE_BUILDERS, load_user_file, read_file


@dataclass(frozen=True)
class GlueTask:
    name: str
    text_columns: tuple[str, ...]  # Hub column names fed to the tokenizer (one sentence or a pair)
    label_names: tuple[str, ...] | None  # Hub label order; None means regression
    glue_dir: str  # folder name in the classic $GLUE_DIR layout
    tsv_header: tuple[str, ...] | None  # column names for header-less files (CoLA)
    tsv_columns: dict[str, str]  # Hub name -> TSV column name, "label" included
    # Hub split -> TSV file; the first is the main validation split.
    eval_splits: dict[str, str] = field(default_factory=lambda: {"validation": "dev.tsv"})

    @property
    def is_regression(self) -> bool:
        return self.label_names is None

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.label_names)


GLUE_TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in [
        GlueTask(
            "cola",
            ("sentence",),
            ("unacceptable", "acceptable"),
            "CoLA",
            tsv_header=("source", "label", "original_mark", "sentence"),
            tsv_columns={"sentence": "sentence", "label": "label"},
        ),
        GlueTask(
            "sst2",
            ("sentence",),
            ("negative", "positive"),
            "SST-2",
            None,
            {"sentence": "sentence", "label": "label"},
        ),
        GlueTask(
            "mrpc",
            ("sentence1", "sentence2"),
            ("not_equivalent", "equivalent"),
            "MRPC",
            None,
            {"sentence1": "#1 String", "sentence2": "#2 String", "label": "Quality"},
        ),
        GlueTask(
            "qqp",
            ("question1", "question2"),
            ("not_duplicate", "duplicate"),
            "QQP",
            None,
            {"question1": "question1", "question2": "question2", "label": "is_duplicate"},
        ),
        GlueTask(
            "stsb",
            ("sentence1", "sentence2"),
            None,
            "STS-B",
            None,
            {"sentence1": "sentence1", "sentence2": "sentence2", "label": "score"},
        ),
        GlueTask(
            "mnli",
            ("premise", "hypothesis"),
            ("entailment", "neutral", "contradiction"),
            "MNLI",
            None,
            {"premise": "sentence1", "hypothesis": "sentence2", "label": "gold_label"},
            eval_splits={
                "validation_matched": "dev_matched.tsv",
                "validation_mismatched": "dev_mismatched.tsv",
            },
        ),
        GlueTask(
            "qnli",
            ("question", "sentence"),
            ("entailment", "not_entailment"),
            "QNLI",
            None,
            {"question": "question", "sentence": "sentence", "label": "label"},
        ),
        GlueTask(
            "rte",
            ("sentence1", "sentence2"),
            ("entailment", "not_entailment"),
            "RTE",
            None,
            {"sentence1": "sentence1", "sentence2": "sentence2", "label": "label"},
        ),
        GlueTask(
            "wnli",
            ("sentence1", "sentence2"),
            ("not_entailment", "entailment"),
            "WNLI",
            None,
            {"sentence1": "sentence1", "sentence2": "sentence2", "label": "label"},
        ),
    ]
}


@dataclass
class TaskData:
    """What a recipe needs to know about its data, whatever the source."""

    name: str  # GLUE task name, or "custom"
    splits: datasets.DatasetDict  # "train" plus one or more eval splits, normalised columns
    text_columns: tuple[str, ...]
    label_names: tuple[str, ...] | None  # None means regression
    metric_config: str  # config name of amp_recipes/metrics/glue
    eval_splits: tuple[str, ...] = ("validation",)

    @property
    def is_regression(self) -> bool:
        return self.label_names is None

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.label_names)


def get_task(name: str) -> GlueTask:
    try:
        return GLUE_TASKS[name.lower()]
    except KeyError:
        raise InputError(f"Unknown task {name!r}: choose one of {', '.join(GLUE_TASKS)}.") from None


def resolve_task_dir(task: GlueTask, data_dir: str | os.PathLike) -> Path:
    """Accept either the $GLUE_DIR root (holding MRPC/, CoLA/, ...) or the task's own folder."""
    root = Path(data_dir)
    for candidate in (root / task.glue_dir, root):
        if (candidate / "train.tsv").is_file():
            return candidate
    raise InputError(
        f"No GLUE files for {task.name} under {root}: expected {root / task.glue_dir / 'train.tsv'} "
        f"(the classic $GLUE_DIR layout) or {root / 'train.tsv'}."
    )


def _read_glue_tsv(path: Path, task: GlueTask, cache_dir: str | None) -> datasets.Dataset:
    if not path.is_file():
        raise InputError(f"Missing GLUE file {path} for task {task.name}.")
    # GLUE TSVs are not CSV: no quote processing (several rows hold unbalanced quotes that a
    # quoting reader would merge), MRPC starts with a UTF-8 BOM, and text such as "null" or
    # "NA" must stay text (na_filter=False).
    kwargs = dict(delimiter="\t", quoting=csv.QUOTE_NONE, na_filter=False, encoding="utf-8-sig")
    if task.tsv_header is not None:
        kwargs.update(header=None, column_names=list(task.tsv_header))
    table = read_file("csv", str(path), ".tsv", cache_dir, **kwargs)
    missing = [column for column in task.tsv_columns.values() if column not in table.column_names]
    if missing:
        raise InputError(
            f"{path} has no column(s) {missing} needed for {task.name}; found {table.column_names}."
        )
    table = table.select_columns(list(task.tsv_columns.values()))
    table = table.rename_columns({tsv: hub for hub, tsv in task.tsv_columns.items() if tsv != hub})
    return _encode_labels(table, task.label_names, str(path))


def _encode_labels(table: datasets.Dataset, label_names, source: str) -> datasets.Dataset:
    """Turn string or numeric labels into Hub-style class ids (or floats), checking every row."""
    if label_names is None:
        try:
            return table.cast_column("label", datasets.Value("float32"))
        except (ValueError, TypeError) as error:
            raise InputError(f"{source}: regression labels must be numbers ({error}).") from error
    index = {name: i for i, name in enumerate(label_names)}
    if not any(name.lstrip("-").isdigit() for name in label_names):
        # Named classes (GLUE) may also be written as their ids, as in most GLUE TSVs.
        index.update({str(i): i for i in range(len(label_names))})

    def encode(batch):
        ids = []
        for value in batch["label"]:
            key = _label_name(value)
            if key not in index:
                raise InputError(
                    f"{source}: label {value!r} is not one of {list(label_names)} "
                    f"(or 0..{len(label_names) - 1})."
                )
            ids.append(index[key])
        return {"label": ids}

    features = table.features.copy()
    features["label"] = datasets.ClassLabel(names=list(label_names))
    return table.map(encode, batched=True, features=features, desc="Checking labels")


def glue_files(task: GlueTask, data_dir) -> dict[str, Path]:
    """Split -> the TSV file it is read from."""
    task_dir = resolve_task_dir(task, data_dir)
    return {split: task_dir / name for split, name in {"train": "train.tsv", **task.eval_splits}.items()}


def load_glue_from_dir(task: GlueTask, data_dir, cache_dir: str | None = None) -> datasets.DatasetDict:
    return datasets.DatasetDict(
        {split: _read_glue_tsv(path, task, cache_dir) for split, path in glue_files(task, data_dir).items()}
    )


def load_hub_dataset(name: str, *config: str, what: str | None = None, offline: str, **kwargs):
    """`datasets.load_dataset(name, *config, **kwargs)` from the Hub; any failure is one InputError
    that names the dataset (`what`, default `name`) and says, in `offline`, how to work from local
    files instead."""
    try:
        return datasets.load_dataset(name, *config, **kwargs)
    except Exception as error:  # connection, offline-mode and missing-cache errors differ by version
        raise InputError(
            f"Could not load {what or name} from the Hugging Face Hub ({type(error).__name__}). Offline? {offline}"
        ) from error


def load_glue_from_hub(task: GlueTask, cache_dir: str | None = None) -> datasets.DatasetDict:
    raw = load_hub_dataset(
        "nyu-mll/glue",
        task.name,
        what=f"GLUE {task.name}",
        offline="Point --data_dir (or $GLUE_DIR) at the classic GLUE folder of TSV files "
        "(the repository ships CoLA, MRPC, RTE and SST-2 in data/glue).",
        cache_dir=cache_dir,
    )
    keep = ["train", *task.eval_splits]
    return datasets.DatasetDict(
        {split: raw[split].select_columns([*task.text_columns, "label"]) for split in keep}
    )


def load_glue(task_name: str, data_dir=None, cache_dir: str | None = None) -> TaskData:
    """GLUE task data from `data_dir` when given (or `$GLUE_DIR` when set), else from the Hub."""
    task = get_task(task_name)
    data_dir = data_dir or os.environ.get("GLUE_DIR")
    if data_dir:
        splits = load_glue_from_dir(task, data_dir, cache_dir)
    else:
        splits = load_glue_from_hub(task, cache_dir)
    return TaskData(
        name=task.name,
        splits=splits,
        text_columns=task.text_columns,
        label_names=task.label_names,
        metric_config=task.name,
        eval_splits=tuple(task.eval_splits),
    )


_DEFAULT_TEXT_COLUMNS = (("sentence1", "sentence2"), ("sentence",), ("text",))


def _check_texts(table: datasets.Dataset, text_columns, path: str) -> None:
    for column in text_columns:
        for row, text in enumerate(table[column], start=1):
            if not isinstance(text, str) or not text.strip():
                raise InputError(f"{path} row {row}: the {column!r} text is empty ({text!r}).")


def _label_kind(value) -> str:
    """'empty', 'int' (12, '12', 12.0), 'float' (0.5) or 'name' ('pos')."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "empty"
    if isinstance(value, bool):
        return "name"
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return "name"
    if isinstance(value, (int, float)) and math.isfinite(value):
        return "int" if float(value).is_integer() else "float"
    return "name"


def _label_name(value) -> str:
    """A class label as its name: 2, "2" and 2.0 are all "2"."""
    return str(int(float(value))) if _label_kind(value) == "int" else str(value).strip()


def _label_type(values: list, path: str, label_type: str) -> str:
    """classification or regression, from the label values and --label_type; explained, never
    guessed, when the values leave it open."""
    kinds: dict[str, int] = {}
    for row, value in enumerate(values, start=1):
        kind = _label_kind(value)
        if kind == "empty":
            raise InputError(f"{path} row {row} has no label; fill it in or drop the row.")
        kinds.setdefault(kind, row)
    if "name" in kinds and len(kinds) > 1:
        number = min(row for kind, row in kinds.items() if kind != "name")
        raise InputError(
            f"{path} mixes class names (row {kinds['name']}: {values[kinds['name'] - 1]!r}) with numbers "
            f"(row {number}: {values[number - 1]!r}); write every label the same way."
        )
    if label_type == "regression":
        if "name" in kinds:
            raise InputError(
                f"{path} row {kinds['name']}: regression labels must be numbers, not {values[kinds['name'] - 1]!r}."
            )
        return "regression"
    if label_type == "classification":
        if "float" in kinds:
            raise InputError(
                f"{path} row {kinds['float']}: label {values[kinds['float'] - 1]!r} is not a whole number; "
                "classification labels are class names or integer ids."
            )
        return "classification"
    if "float" in kinds:
        return "regression"
    if "int" in kinds and any(isinstance(v, float) or (isinstance(v, str) and "." in v) for v in values):
        raise InputError(
            f"{path}: the labels are written as decimals but are all whole numbers (row 1: {values[0]!r}); "
            "pass --label_type classification (classes) or --label_type regression (scores)."
        )
    return "classification"


def load_user_files(
    train_file: str,
    validation_file: str,
    text_columns: tuple[str, ...] | None = None,
    label_column: str = "label",
    cache_dir: str | None = None,
    label_type: str = "auto",
) -> TaskData:
    """The user's own sentence (or sentence-pair) classification or regression data.

    `label_type` auto: decimal labels (0.5, 3.8) mean regression; integers and names mean
    classification, with the class list taken from the training file (sorted) so that ids are
    stable between runs. Whole numbers written as decimals (1.0) are ambiguous: an error asks for
    `label_type`.
    """
    tables = {
        "train": load_user_file(train_file, cache_dir),
        "validation": load_user_file(validation_file, cache_dir),
    }
    columns = tables["train"].column_names
    if text_columns is None:
        text_columns = next((c for c in _DEFAULT_TEXT_COLUMNS if set(c) <= set(columns)), None)
        if text_columns is None:
            raise InputError(
                f"{train_file}: no text columns found (looked for sentence1+sentence2, sentence or text); "
                f"found {columns}. Name them with --text_columns."
            )
    for split, table in tables.items():
        path = train_file if split == "train" else validation_file
        missing = [c for c in (*text_columns, label_column) if c not in table.column_names]
        if missing:
            raise InputError(f"{path} has no column(s) {missing}; found {table.column_names}.")
        _check_texts(table, text_columns, path)
        table = table.select_columns([*text_columns, label_column])
        if label_column != "label":
            table = table.rename_column(label_column, "label")
        tables[split] = table

    kind = _label_type(tables["train"]["label"], train_file, label_type)
    _label_type(tables["validation"]["label"], validation_file, kind)  # empty or mixed labels
    regression = kind == "regression"
    label_names = None
    if not regression:
        values = {_label_name(v) for v in tables["train"]["label"]}
        label_names = tuple(
            sorted(values, key=lambda v: (0, int(v), "") if v.lstrip("-").isdigit() else (1, 0, v))
        )
        if len(label_names) < 2:
            raise InputError(
                f"{train_file}: classification needs at least two label values, found {list(label_names)}."
            )
    splits = datasets.DatasetDict(
        {
            split: _encode_labels(table, label_names, train_file if split == "train" else validation_file)
            for split, table in tables.items()
        }
    )
    return TaskData(
        name="custom",
        splits=splits,
        text_columns=tuple(text_columns),
        label_names=label_names,
        metric_config="regression" if regression else "classification",
    )


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


def first_rows(table: datasets.Dataset, limit: int | None) -> datasets.Dataset:
    """The first `limit` rows (all of them when `limit` is None): --max_train/eval_samples."""
    return table.select(range(min(limit, table.num_rows))) if limit else table


# ----------------------------------------------------------------------------- tokenisation
# `datasets.map` caches each result on disk under a fingerprint of its input and of the function
# with everything it refers to (dill-pickled), so a second identical run reads the cache and any
# change (another max_seq_length, tokenizer or column) tokenises again. Pickling the tokenizer
# for that fingerprint costs ~0.2 s per map for MiniLM's: slow, but never stale.
def check_max_length(tokenizer, max_seq_length: int) -> None:
    if max_seq_length > tokenizer.model_max_length:
        raise InputError(
            f"--max_seq_length {max_seq_length} is longer than the model's limit of {tokenizer.model_max_length}."
        )


def tokenize_splits(task: TaskData, tokenizer, max_seq_length: int, num_proc: int | None = None):
    """Tokenise every split (one sentence or a pair) with labels. No padding here: the collator
    pads each batch to its own longest sequence."""
    check_max_length(tokenizer, max_seq_length)
    text_columns = tuple(task.text_columns)  # not `task`: datasets would hash its splits too

    def tokenize(batch):
        encoded = tokenizer(
            *[batch[column] for column in text_columns], truncation=True, max_length=max_seq_length
        )
        encoded["labels"] = batch["label"]
        return encoded

    return task.splits.map(
        tokenize,
        batched=True,
        remove_columns=task.splits["train"].column_names,
        num_proc=num_proc,
        desc="Tokenizing",
    )


def tokenize_and_group(splits, tokenizer, max_seq_length: int, num_proc: int | None = None):
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
        desc="Tokenizing",
    )
    return tokenized.map(
        group,
        batched=True,
        batch_size=1000,
        num_proc=num_proc,
        desc=f"Grouping into blocks of {max_seq_length}",
    )


# ----------------------------------------------------------------------------- batches
def pad_multiple(mixed_precision: str) -> int | None:
    """Tensor Cores run fp16/bf16 matmuls fastest on dimensions that are multiples of 8, so
    reduced-precision batches are padded up to one; fp32 pads to the longest sequence. fp8 matmuls
    (torch._scaled_mm) need multiples of 16, and batch x sequence is the inner dimension of the
    weight gradient's: padded here, torchao need not pad every one of those matmuls itself."""
    if mixed_precision == "fp8":
        return 16
    return 8 if mixed_precision in ("fp16", "bf16") else None


def make_collator(tokenizer, mixed_precision: str):
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_multiple(mixed_precision))


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


def loader_settings(accelerator, collator, num_workers: int | None) -> dict:
    """DataLoader keyword arguments shared by a recipe's loaders: on CUDA, pinned memory and (by
    default) 2 worker processes that build batches while the GPU computes; none elsewhere."""
    on_cuda = accelerator.device.type == "cuda"
    num_workers = num_workers if num_workers is not None else 2 * on_cuda
    return {
        "collate_fn": collator,
        "pin_memory": on_cuda,
        "num_workers": num_workers,
        "persistent_workers": num_workers > 0,  # no worker restart each epoch
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
