"""amp_recipes.tasks.ner: CoNLL and JSON reading, the tag scheme, label order, sub-word alignment, and
the shipped seqeval metric, on the repository's CoNLL-2003 excerpt."""

import json

import pytest
from conftest import BERT_BASE_CONFIG, REPO

from amp_recipes.errors import InputError
from amp_recipes.tasks.metrics import load_metric
from amp_recipes.tasks.ner import (
    label_order,
    load_files,
    load_hub,
    read_conll,
    read_file,
    tag_scheme,
    tokenize_and_align,
    word_tags,
)

CONLL = REPO / "data" / "conll2003"
CONLL_ORDER = ("O", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "B-ORG", "I-ORG", "B-PER", "I-PER")


def to_iob1(tags):
    """data/conll2003/README.md's rule: B-X becomes I-X unless the previous tag is B-X or I-X."""
    out = []
    for i, tag in enumerate(tags):
        previous = tags[i - 1] if i else "O"
        keep = tag.startswith("B-") and previous[2:] == tag[2:] and previous != "O"
        out.append(tag if keep or not tag.startswith("B-") else "I-" + tag[2:])
    return out


def write_conll(path, sentences):
    lines = ["-DOCSTART- -X- -X- O", ""]
    for tokens, tags in sentences:
        lines += [f"{token} NNP B-NP {tag}" for token, tag in zip(tokens, tags, strict=True)] + [""]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_conll_excerpt_is_read_as_published():
    """Counts of data/conll2003/README.md; -DOCSTART- lines are no sentences."""
    train, valid = read_conll(str(CONLL / "train.txt")), read_conll(str(CONLL / "valid.txt"))
    assert (train.num_rows, sum(map(len, train["tokens"]))) == (507, 7253)
    assert (valid.num_rows, sum(map(len, valid["tokens"]))) == (262, 2910)
    assert train[0]["tokens"][:3] == ["EU", "rejects", "German"]
    assert train[0]["tags"][:3] == ["B-ORG", "O", "B-MISC"] and train[0]["where"] == "line 3"
    assert train[1] == {"tokens": ["Peter", "Blackburn"], "tags": ["B-PER", "I-PER"], "where": "line 13"}
    entities = sum(tag.startswith("B-") for tags in train["tags"] for tag in tags)
    assert entities == 962
    assert tag_scheme(train, "train.txt") == "IOB2"
    assert label_order(t for tags in train["tags"] for t in tags) == CONLL_ORDER


def test_iob1_and_iobes_are_detected(tmp_path):
    train = read_conll(str(CONLL / "train.txt"))
    iob1 = [(tokens, to_iob1(tags)) for tokens, tags in zip(train["tokens"], train["tags"], strict=True)]
    assert any(tags[0] == "I-ORG" for _, tags in iob1)  # the conversion did something
    iob1_train = str(write_conll(tmp_path / "iob1.txt", iob1))
    with pytest.raises(InputError, match=r"iob1\.txt is tagged IOB1 but .*valid\.txt IOB2: tag both files"):
        load_files(iob1_train, str(CONLL / "valid.txt"))
    valid = read_conll(str(CONLL / "valid.txt"))
    iob1_valid = [
        (tokens, to_iob1(tags)) for tokens, tags in zip(valid["tokens"], valid["tags"], strict=True)
    ]
    data = load_files(iob1_train, str(write_conll(tmp_path / "iob1-valid.txt", iob1_valid)))
    # B-X only between two adjacent X entities: the excerpt has such LOC and MISC pairs, no ORG or PER.
    assert data.scheme == "IOB1"
    assert data.label_names == ("O", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "I-ORG", "I-PER")
    iobes = [(["Peter", "Blackburn", "in", "Paris"], ["B-PER", "E-PER", "O", "S-LOC"])]
    assert tag_scheme(read_conll(str(write_conll(tmp_path / "iobes.txt", iobes))), "x") == "IOBES"


def test_conll_and_json_files_give_the_same_data(tmp_path):
    sentences = [(["Peter", "Blackburn", "visited", "Paris"], ["B-PER", "I-PER", "O", "B-LOC"])] * 3
    conll = write_conll(tmp_path / "train.conll", sentences)
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps({"words": w, "tags": t}) + "\n" for w, t in sentences))
    from_conll, from_json = read_file(str(conll)), read_file(str(jsonl), "words")
    assert from_conll["tokens"] == from_json["tokens"] and from_conll["tags"] == from_json["tags"]
    assert from_json["where"] == ["line 1", "line 2", "line 3"]


@pytest.mark.parametrize(
    "content, message",
    [
        ("EU NNP B-NP B-ORG\nrejects VBZ O\n", r"x\.txt line 2 has 3 columns, line 1 has 4"),
        ("EU\n", r"line 1 has one column \('EU'\)"),
        ("-DOCSTART- -X- -X- O\n\n", "holds no sentences"),
        ("", r"x\.txt is empty"),
        ("EU NNP B-NP ORG\n", r"x\.txt line 1: tag 'ORG' is neither O nor a B-/I-/E-/S- prefixed"),
        ("EU NNP B-NP O\n", "every tag is O; there is no entity to learn"),
    ],
)
def test_bad_conll_files_are_one_sentence_errors(tmp_path, content, message):
    path = tmp_path / "x.txt"
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        load_files(str(path), str(CONLL / "valid.txt"))


def test_columns_not_named_are_read_as_the_ner_example_reads_them(tmp_path):
    """No `tokens` column: the first is the words, and the second the tags where no tags column
    has a known name (transformers' run_ner_no_trainer.py)."""
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"words": ["Paris", "is"], "marks": ["B-LOC", "O"]}) + "\n")
    table = read_file(str(path), None, None)
    assert table["tokens"] == [["Paris", "is"]] and table["tags"] == [["B-LOC", "O"]]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"tokens": ["a", "b"], "ner_tags": ["O"]}, "line 1: 2 words but 1 tags"),
        ({"tokens": ["a"], "ner_tags": [3]}, r"tags must be names such as 'B-PER'"),
        ({"tokens": [], "ner_tags": []}, "must be a non-empty list of words"),
        ({"words": ["a"]}, r"has no column\(s\) \['ner_tags'\]"),  # words alone: no tags to learn
    ],
)
def test_bad_json_rows_are_one_sentence_errors(tmp_path, row, message):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(InputError, match=message):
        load_files(str(path), str(CONLL / "valid.txt"))


def test_a_validation_tag_the_training_data_lacks_is_refused(tmp_path):
    train = write_conll(tmp_path / "train.txt", [(["Peter", "Paris"], ["B-PER", "B-LOC"])])
    valid = write_conll(tmp_path / "valid.txt", [(["EU"], ["O"]), (["Acme", "Corp"], ["B-ORG", "I-ORG"])])
    with pytest.raises(InputError, match=r"valid\.txt line 5: tag 'B-ORG' does not occur in the training"):
        load_files(str(train), str(valid))


def test_the_hub_unreachable_says_how_to_work_offline():
    with pytest.raises(InputError, match="Offline.*--train_file and --validation_file"):
        load_hub()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BERT_BASE_CONFIG)


def aligned(tokenizer, max_seq_length=32, label_all_tokens=False):
    import datasets

    sentence = {"tokens": [["Jean-Claude", "Juncker", "visited", "Luxembourg"]], "where": ["line 1"]}
    sentence["tags"] = [["B-PER", "I-PER", "O", "B-LOC"]]
    splits = datasets.DatasetDict(validation=datasets.Dataset.from_dict(sentence))
    return tokenize_and_align(splits, tokenizer, CONLL_ORDER, max_seq_length, label_all_tokens)["validation"][
        0
    ]


def test_the_first_sub_token_of_each_word_carries_its_tag(tokenizer):
    row = aligned(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(row["input_ids"])
    assert tokens == ["[CLS]", "jean", "-", "claude", "jun", "##cker", "visited", "luxembourg", "[SEP]"]
    B_PER, I_PER, B_LOC = 7, 8, 1  # noqa: N806 (ids in CONLL_ORDER)
    assert row["labels"] == [-100, B_PER, -100, -100, I_PER, -100, 0, B_LOC, -100]
    assert row["word_index"] == [-1, 0, -1, -1, 1, -1, 2, 3, -1]
    all_tokens = aligned(tokenizer, label_all_tokens=True)  # the rest of a B- word is I-
    assert all_tokens["labels"] == [-100, B_PER, I_PER, I_PER, I_PER, I_PER, 0, B_LOC, -100]


def test_words_cut_off_by_max_seq_length_still_count_as_predicted_o(tokenizer):
    row = aligned(tokenizer, max_seq_length=6)  # [CLS] jean - claude jun [SEP]: 2 of 4 words left
    assert row["word_index"] == [-1, 0, -1, -1, 1, -1]
    predictions = [0, 7, 0, 0, 8, 0, 0, 0]  # padded beyond the example, as in a batch
    assert word_tags(predictions, row["word_index"], 4, CONLL_ORDER) == ["B-PER", "I-PER", "O", "O"]


def test_the_shipped_seqeval_scores_entities_like_conlleval():
    """Hand-counted: gold PER, LOC, LOC, ORG; predicted PER (right), LOC (right, started with I- as
    IOB1 writes it), MISC (wrong type), one LOC missed: precision 2/3, recall 2/4."""
    metric = load_metric("seqeval")
    scores = metric.compute(
        references=[["B-PER", "I-PER", "O", "B-LOC"], ["B-LOC", "O", "B-ORG"]],
        predictions=[["B-PER", "I-PER", "O", "O"], ["I-LOC", "O", "B-MISC"]],
    )
    assert scores["precision"] == pytest.approx(2 / 3) and scores["recall"] == pytest.approx(2 / 4)
    assert scores["f1"] == pytest.approx(2 * (2 / 3) * (1 / 2) / (2 / 3 + 1 / 2))
    assert scores["accuracy"] == pytest.approx(4 / 7)  # words whose tag is exactly right (I-LOC is not B-LOC)
    assert (scores["LOC_recall"], scores["LOC_number"], scores["PER_f1"]) == (0.5, 2, 1.0)
    assert (scores["ORG_f1"], scores["MISC_precision"], scores["MISC_number"]) == (0.0, 0.0, 0)
