"""Token-classification (NER) data for recipes/bert_ner.py: CoNLL-2003 from the Hub, CoNLL-format
text files, or JSON / JSON Lines rows of tokens + tags; the tag scheme detected and checked; words
aligned to sub-word tokens.

Every source is normalised to the columns `tokens` (list of words) and `tags` (list of tag names,
e.g. `B-PER`), plus `where` (the line or row of the file, for error messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import datasets

from amp_recipes.errors import InputError
from amp_recipes.tasks.batches import check_max_length
from amp_recipes.tasks.files import check_file, load_hub_dataset, load_user_file

HUB_DATASET = "eriktks/conll2003"  # the Hub's CoNLL-2003 (English), integer tags + their names
# datasets >= 4 runs no loading scripts; the Hub's parquet export of a script dataset loads anyway.
HUB_REVISION = "refs/convert/parquet"
CONLL_SUFFIXES = (".txt", ".conll", ".bio", ".iob")
JSON_BUILDERS = {".json": "json", ".jsonl": "json"}
TAG_COLUMNS = ("ner_tags", "tags", "labels")  # looked for, in this order, when --tags_column is unset
PREFIXES = "BIES"  # begin, inside, end, single (IOB1, IOB2, IOBES)


@dataclass
class TaggingData:
    name: str  # "conll2003" or "custom"
    splits: datasets.DatasetDict  # "train", "validation": tokens, tags, where
    label_names: tuple[str, ...]  # id -> tag name
    scheme: str  # IOB1, IOB2 or IOBES, detected on the training data


# ----------------------------------------------------------------------------- reading
def read_conll(path: str, words_only=False) -> datasets.Dataset:
    """A CoNLL-format file: one token per line, its tag in the last column (the columns between,
    such as POS and chunk tags, are ignored), a blank line after each sentence, `-DOCSTART-` lines
    skipped. datasets has no builder for this layout (the Hub's CoNLL-2003 used a loading script),
    so it is read here into an in-memory table: no cache files, so every process of a launch
    reads and tokenises it (a few seconds for CoNLL-2003's 14,041 training sentences).
    `words_only` (--test_file): one column, the words, is enough; tags are not read."""
    check_file(path)
    rows = {"tokens": [], "tags": [], "where": []}
    tokens, tags, start, columns = [], [], 0, None

    def end_sentence():
        if tokens:
            rows["tokens"].append(list(tokens))
            rows["tags"].append(list(tags))
            rows["where"].append(f"line {start}")
            tokens.clear()
            tags.clear()

    with open(path, encoding="utf-8-sig") as handle:
        for number, line in enumerate(handle, start=1):
            fields = line.split()
            if not fields or fields[0] == "-DOCSTART-":
                end_sentence()
                continue
            if columns is None:
                columns, first = len(fields), number
                if columns < 2 and not words_only:
                    raise InputError(
                        f"{path} line {number} has one column ({line.strip()!r}); a CoNLL line is "
                        "`token tag` or `token POS chunk tag`, whitespace-separated."
                    )
            if len(fields) != columns:
                raise InputError(
                    f"{path} line {number} has {len(fields)} columns, line {first} has {columns}: every "
                    "token line needs the same columns (token ... tag), a blank line between sentences."
                )
            if not tokens:
                start = number
            tokens.append(fields[0])
            tags.append("O" if words_only else fields[-1])
    end_sentence()
    if not rows["tokens"]:
        raise InputError(f"{path} holds no sentences (only -DOCSTART- or blank lines).")
    return datasets.Dataset.from_dict(rows)


def read_json(
    path: str, tokens_column: str | None, tags_column: str | None, words_only=False, task: str = "ner"
) -> datasets.Dataset:
    """Rows with a list of words and a list of tag names of the same length (`words_only`: the
    words are enough, the tags are not read). Columns not named: `tokens`, else the first column
    not named as tags; `<task>_tags`, tags or labels, else the first other column (for a file of
    two columns, the first and the second, as transformers' run_ner_no_trainer.py reads it)."""
    table = load_user_file(path, None, JSON_BUILDERS)
    columns = table.column_names
    candidates = (f"{task}_tags", *TAG_COLUMNS)
    if tokens_column is None:  # `tokens`, else the first column that is not named as tags
        others = [c for c in columns if c not in candidates]
        tokens_column = "tokens" if "tokens" in columns or not columns else (others or columns)[0]
    if words_only:  # --test_file: every tag O, never read (word_tags predicts them)
        if tokens_column not in table.column_names:
            raise InputError(
                f"{path} has no column {tokens_column!r}; found {table.column_names}. Name it with --tokens_column."
            )
        tags_column = "__tags__"
        table = table.add_column(tags_column, [["O"] * len(words or []) for words in table[tokens_column]])
    fallback = next((c for c in columns if c != tokens_column), TAG_COLUMNS[0])
    tags_column = tags_column or next((c for c in candidates if c in table.column_names), fallback)
    if tokens_column == tags_column:
        raise InputError(
            f"{path} has no words column besides its tags column {tags_column!r}; found {columns}. "
            "Name it with --tokens_column."
        )
    missing = [c for c in (tokens_column, tags_column) if c not in table.column_names]
    if missing:
        raise InputError(
            f"{path} has no column(s) {missing}; found {table.column_names}. "
            "Name them with --tokens_column / --tags_column."
        )
    line_or_row = "line" if path.lower().endswith(".jsonl") else "row"
    for number, (words, tags) in enumerate(
        zip(table[tokens_column], table[tags_column], strict=True), start=1
    ):
        where = f"{path} {line_or_row} {number}"
        if (
            not isinstance(words, list)
            or not words
            or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise InputError(f"{where}: {tokens_column!r} must be a non-empty list of words, got {words!r}.")
        if not isinstance(tags, list) or len(tags) != len(words):
            count = len(tags) if isinstance(tags, list) else "no list of"
            raise InputError(f"{where}: {len(words)} words but {count} tags.")
        if not all(isinstance(tag, str) for tag in tags):
            raise InputError(
                f"{where}: tags must be names such as 'B-PER' or 'O' (got {tags[:3]!r}); integer ids "
                "carry no entity type to score."
            )
    table = table.select_columns([tokens_column, tags_column])
    table = table.rename_columns({tokens_column: "tokens", tags_column: "tags"})
    return table.add_column("where", [f"{line_or_row} {i}" for i in range(1, table.num_rows + 1)])


def read_file(
    path: str, tokens_column: str | None = None, tags_column: str | None = None, words_only=False, task="ner"
) -> datasets.Dataset:
    suffix = Path(path).suffix.lower()
    if suffix in JSON_BUILDERS:
        return read_json(path, tokens_column, tags_column, words_only, task)
    if suffix in CONLL_SUFFIXES:
        return read_conll(path, words_only)
    raise InputError(
        f"{path}: unsupported file type {suffix or '(none)'!r}; use CoNLL text "
        f"({', '.join(CONLL_SUFFIXES)}) or {', '.join(JSON_BUILDERS)}."
    )


# ----------------------------------------------------------------------------- tags
def tag_scheme(table: datasets.Dataset, path: str) -> str:
    """IOB2 (every entity starts with B-), IOB1 (entities start with I-; B- only between two
    adjacent entities of one type) or IOBES (E-/S- tags). A tag other than O or a B/I/E/S-prefixed
    type is an error."""
    prefixes, starts_with_inside = set(), False
    for where, tags in zip(table["where"], table["tags"], strict=True):
        previous = "O"
        for tag in tags:
            if tag != "O":
                prefix, dash, kind = tag.partition("-")
                if not dash or prefix not in PREFIXES or len(prefix) != 1 or not kind:
                    raise InputError(
                        f"{path} {where}: tag {tag!r} is neither O nor a B-/I-/E-/S- prefixed entity "
                        "type (IOB1, IOB2 or IOBES, e.g. B-PER)."
                    )
                prefixes.add(prefix)
                if prefix == "I" and previous[2:] != kind:
                    starts_with_inside = True
            previous = tag
    if prefixes & {"E", "S"}:
        return "IOBES"
    return "IOB1" if starts_with_inside else "IOB2"


def label_order(tags) -> tuple[str, ...]:
    """O first, then by entity type, B before I before E before S: stable across runs and files."""
    return tuple(sorted(set(tags), key=lambda t: ("",) if t == "O" else (t[2:], PREFIXES.index(t[0]))))


def check_known_tags(table: datasets.Dataset, label_names, path: str, train_source: str) -> None:
    known = set(label_names)
    for where, tags in zip(table["where"], table["tags"], strict=True):
        unknown = [tag for tag in tags if tag not in known]
        if unknown:
            raise InputError(
                f"{path} {where}: tag {unknown[0]!r} does not occur in the training data ({train_source}), "
                f"whose tags are {', '.join(label_names)}; a model cannot predict a tag it never saw."
            )


# ----------------------------------------------------------------------------- sources
def load_hub(
    name: str = HUB_DATASET, revision: str | None = HUB_REVISION, cache_dir=None, config=None, task="ner"
) -> TaggingData:
    """A Hub dataset of `tokens` and `<task>_tags` (ClassLabel ids: their names are the tags)."""
    raw = load_hub_dataset(
        name,
        *([config] if config else []),
        offline="Give --train_file and --validation_file (CoNLL text or JSON; the repository ships a "
        "CoNLL-2003 excerpt in data/conll2003).",
        revision=revision,
        cache_dir=cache_dir,
    )
    column = f"{task}_tags"
    if column not in raw["train"].column_names or "tokens" not in raw["train"].column_names:
        raise InputError(
            f"{name} has no tokens and {column} columns (it has {raw['train'].column_names}); give "
            "--train_file and --validation_file with --text_column_name / --label_column_name."
        )
    names = raw["train"].features[column].feature.names
    splits = datasets.DatasetDict()
    for split in ("train", "validation"):
        table = raw[split].select_columns(["tokens", column])
        table = table.map(lambda row: {"tags": [names[i] for i in row[column]]}, remove_columns=[column])
        splits[split] = table.add_column("where", [f"row {i}" for i in range(1, table.num_rows + 1)])
    return TaggingData("conll2003", splits, tuple(names), tag_scheme(splits["train"], name))


def load_files(
    train_file: str, validation_file: str, tokens_column=None, tags_column=None, task="ner"
) -> TaggingData:
    splits = datasets.DatasetDict(
        train=read_file(train_file, tokens_column, tags_column, task=task),
        validation=read_file(validation_file, tokens_column, tags_column, task=task),
    )
    scheme = tag_scheme(splits["train"], train_file)
    validation_scheme = tag_scheme(splits["validation"], validation_file)  # well-formed tags there too
    has_entities = any(tag != "O" for tags in splits["validation"]["tags"] for tag in tags)
    if has_entities and validation_scheme != scheme:
        raise InputError(
            f"{train_file} is tagged {scheme} but {validation_file} {validation_scheme}: tag both files "
            "with one scheme (data/conll2003/README.md shows how to convert IOB1 and IOB2)."
        )
    label_names = label_order(["O", *(tag for tags in splits["train"]["tags"] for tag in tags)])
    if label_names == ("O",):
        raise InputError(f"{train_file}: every tag is O; there is no entity to learn.")
    check_known_tags(splits["validation"], label_names, validation_file, train_file)
    return TaggingData("custom", splits, label_names, scheme)


def load_test(
    test_file=None, tokens_column="tokens", name=HUB_DATASET, revision=HUB_REVISION
) -> datasets.Dataset:
    """--do_predict: the sentences to tag, their words only (every tag set to O, never read):
    --test_file (CoNLL text, one column enough, or .json/.jsonl rows of words), else the Hub
    dataset's test split."""
    if test_file:
        return read_file(test_file, tokens_column, words_only=True)
    raw = load_hub_dataset(
        name, offline="Give --test_file (CoNLL text or JSON).", revision=revision, split="test"
    )
    table = raw.select_columns(["tokens"])
    table = table.map(lambda row: {"tags": ["O"] * len(row["tokens"])})
    return table.add_column("where", [f"row {i}" for i in range(1, table.num_rows + 1)])


def conll_lines(sentences, tags) -> str:
    """Tagged sentences in CoNLL format: `word tag` per line, a blank line after each sentence."""
    return "".join(
        "".join(f"{word} {tag}\n" for word, tag in zip(words, sentence_tags, strict=True)) + "\n"
        for words, sentence_tags in zip(sentences, tags, strict=True)
    )


# ----------------------------------------------------------------------------- tokenisation
def tokenizer_kwargs(config) -> dict:
    """Byte-level BPE tokenizers (RoBERTa, ...) glue a word of a pre-split sentence to the one
    before unless told that each word starts after a space."""
    byte_level_bpe = {"roberta", "deberta", "longformer", "bart", "gpt2", "modernbert"}
    return {"add_prefix_space": True} if config.model_type in byte_level_bpe else {}


def tokenize_and_align(
    splits, tokenizer, label_names, max_seq_length: int, label_all_tokens: bool, num_proc=None
) -> datasets.DatasetDict:
    """Sub-word tokens with their labels: the first sub-token of each word carries the word's tag,
    the others -100 (ignored by the loss) or, with `label_all_tokens`, the tag too (B-X becoming
    I-X). `word_index` gives, per token, the index of the word it starts (-1 for the other
    tokens), so that evaluation scores every word, also those cut off by max_seq_length."""
    check_max_length(tokenizer, max_seq_length)
    label2id = {name: i for i, name in enumerate(label_names)}
    inside = [
        label2id.get("I-" + name[2:], i) if name[:2] == "B-" else i for i, name in enumerate(label_names)
    ]

    def tokenize(batch):
        encoded = tokenizer(
            batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_seq_length
        )
        encoded["labels"], encoded["word_index"] = [], []
        for i, tags in enumerate(batch["tags"]):
            labels, starts, previous = [], [], None
            for word in encoded.word_ids(i):
                first = word is not None and word != previous
                if word is None:
                    labels.append(-100)
                elif first:
                    labels.append(label2id[tags[word]])
                else:
                    labels.append(inside[label2id[tags[word]]] if label_all_tokens else -100)
                starts.append(word if first else -1)
                previous = word
            encoded["labels"].append(labels)
            encoded["word_index"].append(starts)
        return encoded

    return splits.map(
        tokenize, batched=True, remove_columns=["tokens", "where"], num_proc=num_proc, desc="Tokenizing"
    )


def words_cut(sentences, word_index) -> int:
    """How many words of these sentences (lists of words or of tags) no token starts: cut off by
    max_seq_length."""
    return sum(
        len(words) - sum(w >= 0 for w in index) for words, index in zip(sentences, word_index, strict=True)
    )


def word_tags(token_predictions, word_index, num_words: int, label_names) -> list[str]:
    """One example's predicted tag per word, read at each word's first sub-token; a word without
    one (cut off by max_seq_length) is predicted O, so it still counts in the metric."""
    tags = ["O"] * num_words
    # The predictions run on over the padding (batch, processes); word_index ends with the example.
    for prediction, word in zip(token_predictions, word_index, strict=False):
        if word >= 0:
            tags[word] = label_names[prediction]
    return tags
