"""Extractive question-answering data for recipes/bert_qa.py: SQuAD v1.1 / v2.0 from the Hub,
SQuAD-format JSON files, or JSON / JSON Lines rows of question + context + answers; checked,
cut into overlapping windows, and the windows' logits turned back into answer texts.

Every source is normalised to the Hub's `squad` columns: `id`, `question`, `context` and
`answers` = {"text": [...], "answer_start": [...]} (character offsets into the context; empty
lists for an unanswerable SQuAD 2.0 question).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from amp_recipes.errors import InputError
from amp_recipes.tasks.batches import check_max_length
from amp_recipes.tasks.files import check_file, load_hub_dataset, load_user_file
from amp_recipes.training.outputs import write_json_atomic

HUB_DATASETS = {False: "rajpurkar/squad", True: "rajpurkar/squad_v2"}  # by --version_2_with_negative
JSON_BUILDERS = {".json": "json", ".jsonl": "json"}


@dataclass
class QAData:
    name: str  # "squad", "squad_v2" or "custom"
    splits: datasets.DatasetDict  # "train", "validation": id, question, context, answers


# ----------------------------------------------------------------------------- reading
def read_squad_json(path: str) -> datasets.Dataset:
    """A file in SQuAD's own layout ({"data": [{"title", "paragraphs": [{"context", "qas"}]}]}),
    flattened to one row per question as the Hub's `squad` is. The nesting defeats datasets'
    json builder (an article's paragraphs would be one row), so it is read here into an
    in-memory table: no cache files, so each process of a launch reads and tokenises it."""
    try:
        with open(path, encoding="utf-8-sig") as handle:
            squad = json.load(handle)
    except ValueError as error:
        raise InputError(f"{path} is not valid JSON ({error}).") from None
    if isinstance(squad.get("data"), list) and squad["data"] and "question" in squad["data"][0]:
        return flat_rows(squad["data"], path)
    rows = {"id": [], "title": [], "question": [], "context": [], "answers": []}
    where = "its 'data'"
    try:
        for a, article in enumerate(squad["data"], start=1):
            where = f"article {a}"
            for p, paragraph in enumerate(article["paragraphs"], start=1):
                where = f"article {a} paragraph {p}"
                for q, qa in enumerate(paragraph["qas"], start=1):
                    where = f"article {a} paragraph {p} question {q}"
                    answers = [] if qa.get("is_impossible") else qa.get("answers", [])
                    rows["id"].append(str(qa["id"]))
                    rows["title"].append(article.get("title", ""))
                    rows["question"].append(qa["question"])
                    rows["context"].append(paragraph["context"])
                    texts = [answer["text"] for answer in answers]
                    rows["answers"].append(
                        {"text": texts, "answer_start": [answer["answer_start"] for answer in answers]}
                    )
    except (KeyError, TypeError, AttributeError) as error:
        raise InputError(
            f"{path}: {where} does not follow SQuAD's layout ({type(error).__name__}: {error}); expected "
            '{"data": [{"title", "paragraphs": [{"context", "qas": [{"id", "question", "answers": '
            '[{"text", "answer_start"}]}]}]}]}.'
        ) from None
    if not rows["id"]:
        raise InputError(f"{path} holds no questions.")
    return datasets.Dataset.from_dict(rows)


def flat_rows(rows: list[dict], path: str) -> datasets.Dataset:
    """{"version": ..., "data": [rows]}: the layout transformers' QA examples read
    (`load_dataset("json", field="data")`), one row per question with the Hub squad's columns;
    an unanswerable question's answers are empty lists."""
    try:
        table = {
            "id": [str(row.get("id", i)) for i, row in enumerate(rows)],
            "question": [row["question"] for row in rows],
            "context": [row["context"] for row in rows],
            "answers": [
                {"text": list(row["answers"]["text"]), "answer_start": list(row["answers"]["answer_start"])}
                for row in rows
            ],
        }
    except (KeyError, TypeError) as error:
        raise InputError(
            f"{path}: a row of its 'data' has no {error} (rows need id, question, context and answers = "
            '{"text": [...], "answer_start": [...]}).'
        ) from None
    return datasets.Dataset.from_dict(table)


def read_file(path: str, columns: dict[str, str], unanswered=False) -> datasets.Dataset:
    """SQuAD-format JSON, or flat .json/.jsonl rows whose columns `columns` names
    ({"question": ..., "context": ..., "answers": ...}; `id` optional; `unanswered`: the answers
    column too, for --test_file's questions, whose answers are not read)."""
    check_file(path)
    suffix = Path(path).suffix.lower()
    if suffix not in JSON_BUILDERS:
        raise InputError(
            f"{path}: unsupported file type {suffix or '(none)'!r}; use SQuAD-format .json or "
            ".json/.jsonl rows with question, context and answers."
        )
    if suffix == ".json" and _is_squad_layout(path):
        return read_squad_json(path)
    table = load_user_file(path, None, JSON_BUILDERS)
    missing = [name for name in columns.values() if name not in table.column_names]
    if missing == [columns.get("answers")] and unanswered:  # --test_file: the answers are not read
        table = table.add_column(columns["answers"], [{"text": [], "answer_start": []}] * table.num_rows)
        missing = []
    if missing:
        raise InputError(
            f"{path} has no column(s) {missing}; found {table.column_names}. Name them with "
            "--question_column / --context_column / --answer_column, or give a SQuAD-format file."
        )
    table = table.rename_columns({name: key for key, name in columns.items() if name != key})
    if "id" not in table.column_names:
        table = table.add_column("id", [str(i) for i in range(table.num_rows)])
    return table.select_columns(["id", "question", "context", "answers"])


def _is_squad_layout(path: str) -> bool:
    with open(path, encoding="utf-8-sig") as handle:
        start = handle.read(4096).lstrip()
    return start.startswith("{") and '"data"' in start[:200]


def check_rows(table: datasets.Dataset, path: str, version_2: bool, check_answers=True) -> None:
    """Every question and context non-empty, ids unique, and (`check_answers`) every answer found in its
    context at its offset, unanswerable questions only in SQuAD 2.0 mode. Several answers (SQuAD's
    dev files): all are references for the metric, the first is the training target."""
    seen = set()
    for number, row in enumerate(table, start=1):
        where = f"{path} question {number} (id {row['id']!r})"
        if row["id"] in seen:
            raise InputError(f"{where}: the id occurs twice; each question needs its own id.")
        seen.add(row["id"])
        for key in ("question", "context"):
            if not isinstance(row[key], str) or not row[key].strip():
                raise InputError(f"{where}: {key!r} is empty or not text.")
        if not check_answers:  # --test_file: its answers, if any, are not read
            continue
        answers = row["answers"]
        if not isinstance(answers, dict) or set(answers) != {"text", "answer_start"}:
            raise InputError(
                f'{where}: answers must be {{"text": [...], "answer_start": [...]}} (the Hub\'s squad '
                f"layout), got {answers!r}."
            )
        if len(answers["text"]) != len(answers["answer_start"]):
            raise InputError(
                f"{where}: {len(answers['text'])} answer texts but {len(answers['answer_start'])} starts."
            )
        if not answers["text"] and not version_2:
            raise InputError(
                f"{where} has no answer. SQuAD 2.0 data, with unanswerable questions, needs "
                "--version_2_with_negative."
            )
        for text, start in zip(answers["text"], answers["answer_start"], strict=True):
            found = row["context"][start : start + len(text)] if isinstance(start, int) else None
            if not text or found != text:
                raise InputError(
                    f"{where}: answer {text!r} is not at character {start} of the context (found "
                    f"{found!r}); answer_start counts characters from 0."
                )


# ----------------------------------------------------------------------------- sources
def load_hub(version_2: bool, name: str | None = None, cache_dir=None, config: str | None = None) -> QAData:
    name = name or HUB_DATASETS[version_2]
    raw = load_hub_dataset(
        name,
        *([config] if config else []),
        offline="Give --train_file and --validation_file (SQuAD-format JSON; the repository ships a "
        "SQuAD v1.1 sample in data/squad).",
        cache_dir=cache_dir,
    )
    splits = datasets.DatasetDict(
        {
            split: raw[split].select_columns(["id", "question", "context", "answers"])
            for split in ("train", "validation")
        }
    )
    return QAData(name.split("/")[-1], splits)


def load_files(train_file: str, validation_file: str, columns: dict[str, str], version_2: bool) -> QAData:
    splits = datasets.DatasetDict(
        train=read_file(train_file, columns), validation=read_file(validation_file, columns)
    )
    check_rows(splits["train"], train_file, version_2)
    check_rows(splits["validation"], validation_file, version_2)
    return QAData("custom", splits)


def load_test(test_file: str, columns: dict[str, str]) -> datasets.Dataset:
    """--do_predict: the questions of --test_file (SQuAD-format JSON or .json/.jsonl rows), with
    or without answers; SQuAD has no test split on the Hub."""
    table = read_file(test_file, columns, unanswered=True)
    check_rows(table, test_file, version_2=True, check_answers=False)
    return table


# ----------------------------------------------------------------------------- tokenisation
def tokenize_windows(
    splits,
    tokenizer,
    max_seq_length: int,
    doc_stride: int,
    max_query_length: int,
    num_proc=None,
    load_from_cache_file: bool = True,
) -> datasets.DatasetDict:
    """Each question with its context, question first, cut into windows of max_seq_length tokens
    that overlap by doc_stride (`truncation="only_second"`: only the context is cut). Questions
    longer than max_query_length tokens are shortened first, so every window has room for context.

    Training windows get `start_positions` / `end_positions`: the answer's first and last token,
    or the [CLS] token where the window does not hold the whole answer (and for unanswerable
    questions). The windows of the other splits (validation, --do_predict's test) keep
    `example_index` (their question's row) and `offset_mapping` (character spans of the context
    tokens; None for the others) to map logits back to text."""
    check_max_length(tokenizer, max_seq_length)
    special = tokenizer.num_special_tokens_to_add(pair=True)
    room = max_seq_length - max_query_length - special
    if doc_stride >= room:
        raise InputError(
            f"--doc_stride {doc_stride} must be smaller than the context part of a window: "
            f"--max_seq_length {max_seq_length} - --max_query_length {max_query_length} - {special} "
            f"special tokens = {room}."
        )
    if tokenizer.padding_side != "right":
        raise InputError(
            f"{type(tokenizer).__name__} pads on the left; the QA recipe expects the question first."
        )

    def encode(batch):
        questions = [question.lstrip() for question in batch["question"]]  # some start with spaces
        alone = tokenizer(questions, add_special_tokens=False, return_offsets_mapping=True)
        questions = [
            question[: offsets[max_query_length - 1][1]] if len(offsets) > max_query_length else question
            for question, offsets in zip(questions, alone["offset_mapping"], strict=True)
        ]
        return tokenizer(
            questions,
            batch["context"],
            truncation="only_second",
            max_length=max_seq_length,
            stride=doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
        )

    def train_windows(batch):
        encoded = encode(batch)
        starts, ends = [], []
        for i, offsets in enumerate(encoded["offset_mapping"]):
            answers = batch["answers"][encoded["overflow_to_sample_mapping"][i]]
            cls = cls_position(encoded["input_ids"][i], tokenizer)
            start = end = cls
            if answers["text"]:
                first_char = answers["answer_start"][0]
                last_char = first_char + len(answers["text"][0])
                context = [t for t, s in enumerate(encoded.sequence_ids(i)) if s == 1]
                if offsets[context[0]][0] <= first_char and offsets[context[-1]][1] >= last_char:
                    start = next(t for t in context if offsets[t][1] > first_char)
                    end = next(t for t in reversed(context) if offsets[t][0] < last_char)
            starts.append(start)
            ends.append(end)
        encoded["start_positions"], encoded["end_positions"] = starts, ends
        encoded.pop("offset_mapping")
        encoded.pop("overflow_to_sample_mapping")
        return encoded

    def eval_windows(batch, indices):
        encoded = encode(batch)
        encoded["example_index"] = [indices[i] for i in encoded.pop("overflow_to_sample_mapping")]
        encoded["cls_index"] = [cls_position(ids, tokenizer) for ids in encoded["input_ids"]]
        encoded["offset_mapping"] = [
            [span if s == 1 else None for span, s in zip(offsets, encoded.sequence_ids(i), strict=True)]
            for i, offsets in enumerate(encoded["offset_mapping"])
        ]
        return encoded

    windows = datasets.DatasetDict()
    for name, split in splits.items():
        training = name == "train"
        windows[name] = split.map(
            train_windows if training else eval_windows,
            batched=True,
            with_indices=not training,
            remove_columns=split.column_names,
            num_proc=num_proc,
            load_from_cache_file=load_from_cache_file,  # --overwrite_cache: tokenise again
            desc=f"Tokenizing {name}",
        )
    return windows


def set_aside(windows: datasets.Dataset) -> tuple[datasets.Dataset, dict]:
    """Evaluation or test windows without what post-processing reads (their question's row, [CLS]
    position and context offsets), and those, as lists: the model gets only its inputs."""
    aside = ["example_index", "cls_index", "offset_mapping"]
    return windows.remove_columns(aside), windows.select_columns(aside).to_dict()


def cls_position(input_ids, tokenizer) -> int:
    """Where a window's [CLS] (the "no answer here" position) is: first for BERT-like models."""
    cls = tokenizer.cls_token_id
    return input_ids.index(cls) if cls is not None and cls in input_ids else 0


# ----------------------------------------------------------------------------- answers
def add_answer_args(group) -> None:
    """The flags of `postprocess`: how the windows' logits become answer texts."""
    group.add_argument("--n_best_size", type=int, default=20, help="Start and end candidates per window.")
    group.add_argument("--max_answer_length", type=int, default=30, help="Longest answer, in tokens.")
    group.add_argument(
        "--null_score_diff_threshold",
        type=float,
        default=0.0,
        help="SQuAD 2.0: answer nothing when null score - best span score exceeds this.",
    )


def answer_settings(args) -> dict:
    """`postprocess`'s settings, from the recipe's flags."""
    return {
        "n_best_size": args.n_best_size,
        "max_answer_length": args.max_answer_length,
        "version_2": args.version_2_with_negative,
        "null_score_diff_threshold": args.null_score_diff_threshold,
    }


def postprocess(
    examples: datasets.Dataset,
    windows: dict,
    start_logits: list,
    end_logits: list,
    n_best_size: int,
    max_answer_length: int,
    version_2: bool,
    null_score_diff_threshold: float,
) -> tuple[dict[str, str], dict[str, float]]:
    """Answer texts from the windows' start/end logits (one float32 row per window, in window
    order; rows may run on past the window with padding).

    For each question: the n_best_size highest start and end logits of every window give the
    candidate spans that lie in the context, end not before start, at most max_answer_length
    tokens; the best by start + end logit wins. SQuAD 2.0: the null score is the lowest
    [CLS] start + end logit over the question's windows, and the answer is "" when null score -
    best span score > null_score_diff_threshold. Returns ({id: answer}, {id: null score diff}),
    the files SQuAD's official evaluation scripts read (predictions.json, null_odds.json)."""
    by_example = defaultdict(list)
    for window, example in enumerate(windows["example_index"]):
        by_example[example].append(window)
    predictions, null_odds = {}, {}
    for example, (qid, context) in enumerate(zip(examples["id"], examples["context"], strict=True)):
        best_score, best_span, null_score = -np.inf, None, np.inf
        for window in by_example[example]:
            offsets = windows["offset_mapping"][window]
            starts = np.asarray(start_logits[window][: len(offsets)], dtype=np.float32)
            ends = np.asarray(end_logits[window][: len(offsets)], dtype=np.float32)
            cls = windows["cls_index"][window]
            null_score = min(null_score, float(starts[cls] + ends[cls]))
            top_starts = np.argsort(-starts, kind="stable")[:n_best_size]
            top_ends = np.argsort(-ends, kind="stable")[:n_best_size]
            for start in top_starts:
                if offsets[start] is None:
                    continue
                for end in top_ends:
                    if offsets[end] is None or end < start or end - start + 1 > max_answer_length:
                        continue
                    score = float(starts[start] + ends[end])
                    if score > best_score:
                        best_score, best_span = score, (offsets[start][0], offsets[end][1])
        answer = context[best_span[0] : best_span[1]] if best_span else ""
        if version_2:
            null_odds[qid] = null_score - best_score if best_span else float("inf")
            if null_odds[qid] > null_score_diff_threshold:
                answer = ""
        predictions[qid] = answer
    return predictions, null_odds


def write_answers(output_dir: str, predictions: dict, null_odds: dict, prefix="") -> None:
    """The files SQuAD's official evaluation scripts read: <prefix>predictions.json ({id: answer})
    and, for SQuAD 2.0, <prefix>null_odds.json ({id: null score diff})."""
    write_json_atomic(Path(output_dir) / f"{prefix}predictions.json", predictions)
    if null_odds:
        write_json_atomic(Path(output_dir) / f"{prefix}null_odds.json", null_odds)


def metric_inputs(predictions: dict, null_odds: dict, examples) -> tuple[list, list]:
    """The answers and the gold answers as the squad / squad_v2 metrics take them."""
    formatted = [
        {
            "id": qid,
            "prediction_text": text,
            **({"no_answer_probability": null_odds[qid]} if null_odds else {}),
        }
        for qid, text in predictions.items()
    ]
    references = [
        {"id": qid, "answers": answers}
        for qid, answers in zip(examples["id"], examples["answers"], strict=True)
    ]
    return formatted, references
