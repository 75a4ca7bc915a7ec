"""GLUE and your own classification data, end to end: the task table, loading (the classic GLUE
TSV folder, the Hub, or your csv / tsv / json / jsonl files) with their column and label checks,
tokenisation (datasets' cache) and the collator. The metric is the shipped `glue` module
(`amp_recipes.tasks.metrics`).

Every source is normalised to the Hub's column names (`sentence1`, `question`, ...) plus `label`:
an int class id in the Hub's label order, or a float for regression. That way a model fine-tuned
from local TSV files has the same `id2label` as one fine-tuned from the Hub.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import datasets
from transformers import DataCollatorWithPadding

from amp_recipes.errors import InputError
from amp_recipes.tasks.batches import check_max_length, pad_multiple
from amp_recipes.tasks.files import load_hub_dataset, load_user_file, read_file


class LabelCount:
    """`is_regression` and `num_labels`, read from a `label_names` field (None means regression)."""

    label_names: tuple[str, ...] | None

    @property
    def is_regression(self) -> bool:
        return self.label_names is None

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.label_names)


@dataclass(frozen=True)
class GlueTask(LabelCount):
    name: str
    text_columns: tuple[str, ...]  # Hub column names fed to the tokenizer (one sentence or a pair)
    label_names: tuple[str, ...] | None  # Hub label order; None means regression
    glue_dir: str  # folder name in the classic $GLUE_DIR layout
    tsv_header: tuple[str, ...] | None  # column names for header-less files (CoLA)
    tsv_columns: dict[str, str]  # Hub name -> TSV column name, "label" included
    # Hub split -> TSV file; the first is the main validation split.
    eval_splits: dict[str, str] = field(default_factory=lambda: {"validation": "dev.tsv"})
    # Hub split -> TSV file of the unlabelled test examples (--do_predict).
    test_splits: dict[str, str] = field(default_factory=lambda: {"test": "test.tsv"})


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
            test_splits={"test_matched": "test_matched.tsv", "test_mismatched": "test_mismatched.tsv"},
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
class TaskData(LabelCount):
    """What a recipe needs to know about its data, whatever the source."""

    name: str  # GLUE task name, or "custom"
    splits: datasets.DatasetDict  # "train" plus one or more eval splits, normalised columns
    text_columns: tuple[str, ...]
    label_names: tuple[str, ...] | None  # None means regression
    metric_config: str  # config name of amp_recipes/tasks/metrics/glue
    eval_splits: tuple[str, ...] = ("validation",)


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


def _read_glue_tsv(path: Path, task: GlueTask, cache_dir: str | None, test=False) -> datasets.Dataset:
    """A train or dev TSV with its labels checked, or (`test`) a test TSV: its texts only."""
    if not path.is_file():
        raise InputError(f"Missing GLUE file {path} for task {task.name}.")
    # GLUE TSVs are not CSV: no quote processing (several rows hold unbalanced quotes that a
    # quoting reader would merge), MRPC starts with a UTF-8 BOM, and text such as "null" or
    # "NA" must stay text (na_filter=False).
    kwargs = dict(delimiter="\t", quoting=csv.QUOTE_NONE, na_filter=False, encoding="utf-8-sig")
    if task.tsv_header is not None and not test:  # CoLA's train and dev files; its test file has a header
        kwargs.update(header=None, column_names=list(task.tsv_header))
    table = read_file("csv", str(path), ".tsv", cache_dir, **kwargs)
    columns = {hub: tsv for hub, tsv in task.tsv_columns.items() if not (test and hub == "label")}
    missing = [column for column in columns.values() if column not in table.column_names]
    if missing:
        raise InputError(
            f"{path} has no column(s) {missing} needed for {task.name}; found {table.column_names}."
        )
    table = table.select_columns(list(columns.values()))
    table = table.rename_columns({tsv: hub for hub, tsv in columns.items() if tsv != hub})
    return table if test else _encode_labels(table, task.label_names, str(path))


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


OFFLINE_HINT = (
    "Point --data_dir (or $GLUE_DIR) at the classic GLUE folder of TSV files "
    "(the repository ships CoLA, MRPC, RTE and SST-2 in data/glue)."
)


def load_glue_from_hub(task: GlueTask, cache_dir: str | None = None) -> datasets.DatasetDict:
    raw = load_hub_dataset(
        "nyu-mll/glue", task.name, what=f"GLUE {task.name}", offline=OFFLINE_HINT, cache_dir=cache_dir
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


def load_test_splits(task: TaskData, data_dir=None, test_file=None, cache_dir=None) -> datasets.DatasetDict:
    """--do_predict: the examples to predict, texts only. --test_file (your data, with the training
    file's text columns; a label column is ignored), else the GLUE task's test split: the test TSV
    (MNLI: test_matched.tsv and test_mismatched.tsv) of `data_dir` (or $GLUE_DIR), else the Hub's."""
    if test_file:
        table = load_user_file(test_file, cache_dir)
        missing = [column for column in task.text_columns if column not in table.column_names]
        if missing:
            raise InputError(f"{test_file} has no column(s) {missing}; found {table.column_names}.")
        _check_texts(table, task.text_columns, test_file)
        return datasets.DatasetDict(test=table.select_columns(list(task.text_columns)))
    glue_task = get_task(task.name)
    data_dir = data_dir or os.environ.get("GLUE_DIR")
    if data_dir:
        task_dir = resolve_task_dir(glue_task, data_dir)
        return datasets.DatasetDict(
            {
                split: _read_glue_tsv(task_dir / name, glue_task, cache_dir, test=True)
                for split, name in glue_task.test_splits.items()
            }
        )
    raw = load_hub_dataset(
        "nyu-mll/glue", task.name, what=f"GLUE {task.name}", offline=OFFLINE_HINT, cache_dir=cache_dir
    )
    return datasets.DatasetDict(
        {split: raw[split].select_columns(list(task.text_columns)) for split in glue_task.test_splits}
    )


def prediction_lines(predictions: list, label_names) -> str:
    """GLUE's submission format, as transformers' run_glue.py writes it: a header, then per test
    example its index and the predicted label's name (or, for regression, the score)."""
    rows = [
        f"{index}\t{value:3.3f}" if label_names is None else f"{index}\t{label_names[value]}"
        for index, value in enumerate(predictions)
    ]
    return "\n".join(["index\tprediction", *rows]) + "\n"


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


def default_text_columns(columns: list[str], label_column: str) -> tuple[str, ...] | None:
    """sentence1 + sentence2, sentence or text; else, as transformers' run_glue_no_trainer.py
    reads a file, the first two columns other than the label as a pair, or the one there is."""
    named = next((c for c in _DEFAULT_TEXT_COLUMNS if set(c) <= set(columns)), None)
    others = [c for c in columns if c != label_column]
    return named or (tuple(others[:2]) if others else None)


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
    return user_task(
        tables, {"train": train_file, "validation": validation_file}, text_columns, label_column, label_type
    )


def load_named_dataset(
    name: str,
    config: str | None,
    text_columns: tuple[str, ...] | None = None,
    label_column: str = "label",
    label_type: str = "auto",
) -> TaskData:
    """A Hub dataset by name (--dataset_name, --dataset_config_name) with train and validation
    splits, read as your own files are (its text and label columns)."""
    raw = load_hub_dataset(
        name,
        *([config] if config else []),
        offline="Give --train_file and --validation_file (or --task_name with --data_dir).",
    )
    missing = [split for split in ("train", "validation") if split not in raw]
    if missing:
        raise InputError(f"{name} has no {' or '.join(missing)} split (it has {list(raw)}).")
    tables = {split: raw[split] for split in ("train", "validation")}
    return user_task(tables, dict.fromkeys(tables, name), text_columns, label_column, label_type)


def user_task(tables: dict, sources: dict, text_columns, label_column: str, label_type: str) -> TaskData:
    """Your own classification or regression rows (train and validation tables, `sources` naming
    where each came from): text and label columns checked, labels encoded."""
    train_file, validation_file = sources["train"], sources["validation"]
    columns = tables["train"].column_names
    if text_columns is None:
        text_columns = default_text_columns(columns, label_column)
        if text_columns is None:
            raise InputError(
                f"{train_file}: no text columns found (looked for sentence1+sentence2, sentence or text, "
                f"then any column but {label_column!r}); found {columns}. Name them with --text_columns."
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


# ----------------------------------------------------------------------------- tokenisation and batches
# `datasets.map` caches each result on disk under a fingerprint of its input and of the function
# with everything it refers to (dill-pickled), so a second identical run reads the cache and any
# change (another max_seq_length, tokenizer or column) tokenises again. Pickling the tokenizer
# for that fingerprint costs ~0.2 s per map for MiniLM's: slow, but never stale.
def tokenize_splits(task: TaskData, tokenizer, max_seq_length: int, num_proc: int | None = None, splits=None):
    """Tokenise every split (one sentence or a pair) with labels, where it has them (test splits
    have none). `splits`: others than the task's own (its test splits). No padding here: the
    collator pads each batch to its own longest sequence."""
    check_max_length(tokenizer, max_seq_length)
    text_columns = tuple(task.text_columns)  # not `task`: datasets would hash its splits too

    def tokenize(batch):
        encoded = tokenizer(
            *[batch[column] for column in text_columns], truncation=True, max_length=max_seq_length
        )
        if "label" in batch:
            encoded["labels"] = batch["label"]
        return encoded

    splits = task.splits if splits is None else splits
    return datasets.DatasetDict(
        {
            name: split.map(
                tokenize,
                batched=True,
                remove_columns=split.column_names,
                num_proc=num_proc,
                desc="Tokenizing",
            )
            for name, split in splits.items()
        }
    )


def make_collator(tokenizer, mixed_precision: str, max_length: int | None = None):
    """Each batch padded to its longest row (a multiple of 8 under fp16/bf16); `max_length`
    (--pad_to_max_length): every batch to that length."""
    if max_length:
        return DataCollatorWithPadding(tokenizer, padding="max_length", max_length=max_length)
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_multiple(mixed_precision))
