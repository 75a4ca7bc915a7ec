"""amp_recipes.tasks.qa and the shipped SQuAD metric: reading SQuAD files, windows whose answer
positions point at the answer text, post-processing of logits into answers, and the official
exact-match / F1 rules."""

import json

import numpy as np
import pytest
from conftest import BERT_BASE_CONFIG, REPO

from amp_recipes.errors import InputError
from amp_recipes.tasks.metrics import load_metric
from amp_recipes.tasks.qa import check_rows, load_files, postprocess, read_file, tokenize_windows

SQUAD = REPO / "data" / "squad"
COLUMNS = {"question": "question", "context": "context", "answers": "answers"}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BERT_BASE_CONFIG)


# ----------------------------------------------------------------------------- the metric
def squad_v1(pairs):
    metric = load_metric("squad")
    predictions = [{"id": str(i), "prediction_text": p} for i, (p, _) in enumerate(pairs)]
    references = [
        {"id": str(i), "answers": {"text": refs, "answer_start": [0] * len(refs)}}
        for i, (_, refs) in enumerate(pairs)
    ]
    return metric.compute(predictions=predictions, references=references)


@pytest.mark.parametrize(
    "prediction, references, exact, f1",
    [
        ("The Denver Broncos!", ["Denver Broncos"], 100.0, 100.0),  # case, article, punctuation
        ("denver  broncos", ["Denver Broncos"], 100.0, 100.0),  # whitespace
        ("Broncos", ["Denver Broncos"], 0.0, 100 * 2 / 3),  # P 1, R 1/2
        ("blue car", ["a red car"], 0.0, 50.0),  # P 1/2, R 1/2
        ("blue car", ["a red car", "the blue car"], 100.0, 100.0),  # the best reference counts
        ("", ["Denver Broncos"], 0.0, 0.0),  # v1: an empty answer scores nothing
        ("theory", ["the"], 0.0, 0.0),  # 'the' removed only as a whole word
        ("Saint-Denis", ["Saint Denis"], 0.0, 0.0),  # punctuation deleted, not replaced by a space
    ],
)
def test_v1_exact_match_and_f1_follow_the_official_rules(prediction, references, exact, f1):
    scores = squad_v1([(prediction, references)])
    assert scores == {"exact_match": pytest.approx(exact), "f1": pytest.approx(f1)}


def test_v1_averages_over_questions_in_percent():
    scores = squad_v1([("Denver Broncos", ["Denver Broncos"]), ("blue car", ["a red car"])])
    assert scores == {"exact_match": 50.0, "f1": 75.0}


def test_v2_scores_no_answer_and_splits_has_ans_from_no_ans():
    metric = load_metric("squad", "v2")
    predictions = [
        {"id": "a", "prediction_text": "", "no_answer_probability": 3.0},  # has an answer: missed
        {"id": "b", "prediction_text": "blue car", "no_answer_probability": -1.0},  # F1 0.5
        {"id": "c", "prediction_text": "", "no_answer_probability": 2.0},  # rightly nothing
        {"id": "d", "prediction_text": "Paris", "no_answer_probability": -2.0},  # answered the unanswerable
    ]
    empty = {"text": [], "answer_start": []}
    references = [
        {"id": "a", "answers": {"text": ["Denver Broncos"], "answer_start": [0]}},
        {"id": "b", "answers": {"text": ["a red car"], "answer_start": [0]}},
        {"id": "c", "answers": empty},
        {"id": "d", "answers": empty},
    ]
    scores = metric.compute(predictions=predictions, references=references)
    assert scores == {
        "exact": 25.0,
        "f1": pytest.approx(37.5),
        "total": 4,
        "HasAns_exact": 0.0,
        "HasAns_f1": 25.0,
        "HasAns_total": 2,
        "NoAns_exact": 50.0,
        "NoAns_f1": 50.0,
        "NoAns_total": 2,
    }


def test_a_question_without_a_prediction_is_an_error():
    metric = load_metric("squad")
    with pytest.raises(ValueError, match="no prediction for question 'b'"):
        metric.compute(
            predictions=[{"id": "a", "prediction_text": "x"}, {"id": "c", "prediction_text": "y"}],
            references=[
                {"id": "a", "answers": {"text": ["x"], "answer_start": [0]}},
                {"id": "b", "answers": {"text": ["y"], "answer_start": [0]}},
            ],
        )


# ----------------------------------------------------------------------------- reading
def test_the_repository_sample_reads_as_squad_rows():
    train, dev = read_file(str(SQUAD / "train.json"), COLUMNS), read_file(str(SQUAD / "dev.json"), COLUMNS)
    assert (train.num_rows, dev.num_rows) == (667, 131)
    assert set(train["title"]).isdisjoint(dev["title"])  # split by article
    row = dev[0]
    assert row["context"][row["answers"]["answer_start"][0] :].startswith(row["answers"]["text"][0])
    assert len(row["answers"]["text"]) >= 1


def test_flat_json_lines_with_named_columns(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [
        {"q": "Who?", "passage": "Ada wrote it.", "gold": {"text": ["Ada"], "answer_start": [0]}},
        {"q": "What?", "passage": "Ada wrote it.", "gold": {"text": ["it"], "answer_start": [10]}},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    columns = {"question": "q", "context": "passage", "answers": "gold"}
    table = load_files(str(path), str(path), columns, version_2=False).splits["train"]
    assert table.column_names == ["id", "question", "context", "answers"]
    assert table["id"] == ["0", "1"] and table[1]["answers"]["text"] == ["it"]


def squad_file(tmp_path, qas, context="Ada wrote it."):
    path = tmp_path / "squad.json"
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}))
    return str(path)


@pytest.mark.parametrize(
    "qas, version_2, message",
    [
        (
            [{"id": "1", "question": "Who?", "answers": [{"text": "Bob", "answer_start": 0}]}],
            False,
            "'Bob' is not at character 0",
        ),
        ([{"id": "1", "question": "Who?", "answers": []}], False, "has no answer.*--version_2_with_negative"),
        (
            [
                {"id": "1", "question": "Who?", "answers": [{"text": "Ada", "answer_start": 0}]},
                {"id": "1", "question": "What?", "answers": [{"text": "it", "answer_start": 10}]},
            ],
            False,
            "question 2 \\(id '1'\\): the id occurs twice",
        ),
        (
            [{"id": "1", "question": " ", "answers": [{"text": "Ada", "answer_start": 0}]}],
            False,
            "'question' is empty",
        ),
    ],
)
def test_bad_rows_are_named(tmp_path, qas, version_2, message):
    path = squad_file(tmp_path, qas)
    with pytest.raises(InputError, match=message):
        check_rows(read_file(path, COLUMNS), path, version_2)


def test_squad_2_unanswerable_questions(tmp_path):
    qas = [
        {"id": "1", "question": "Who?", "answers": [{"text": "Ada", "answer_start": 0}]},
        {"id": "2", "question": "When?", "answers": [], "is_impossible": True, "plausible_answers": []},
    ]
    path = squad_file(tmp_path, qas)
    table = read_file(path, COLUMNS)
    check_rows(table, path, version_2=True)
    assert table[1]["answers"] == {"text": [], "answer_start": []}


# ----------------------------------------------------------------------------- windows
def test_every_training_window_points_at_its_answer_or_at_cls(tokenizer):
    """Windows of 96 tokens, stride 32: where a window holds the whole answer, its start and end
    tokens are the shortest token span that covers the answer text; elsewhere both are [CLS]."""
    import datasets

    def flat(ids):  # as text, lower-cased and without spaces (what an uncased WordPiece keeps)
        return tokenizer.decode(ids).replace(" ", "")

    several_windows = 0
    for row in read_file(str(SQUAD / "train.json"), COLUMNS).select(range(0, 667, 16)):
        table = datasets.Dataset.from_list([row])
        windows = tokenize_windows(datasets.DatasetDict(train=table, validation=table), tokenizer, 96, 32, 24)
        answer = flat(tokenizer(row["answers"]["text"][0], add_special_tokens=False)["input_ids"])
        with_answer = 0
        for window in windows["train"]:
            ids, start, end = window["input_ids"], window["start_positions"], window["end_positions"]
            assert len(ids) <= 96
            if start == end == 0:  # this window cuts the answer or lacks it
                continue
            assert 0 < start <= end and answer in flat(ids[start : end + 1])
            if end > start:  # the shortest such span: dropping either end token loses the answer
                assert answer not in flat(ids[start + 1 : end + 1]) and answer not in flat(ids[start:end])
            with_answer += 1
        assert with_answer >= 1, row["id"]
        several_windows += windows["train"].num_rows > 1
    assert several_windows >= 10  # long contexts made several windows


def test_a_stride_as_long_as_the_context_room_is_refused(tokenizer):
    import datasets

    rows = read_file(str(SQUAD / "dev.json"), COLUMNS).select(range(2))
    splits = datasets.DatasetDict(train=rows, validation=rows)
    with pytest.raises(InputError, match="--doc_stride 40 must be smaller than .* = 37"):
        tokenize_windows(splits, tokenizer, 64, 40, 24)


def test_long_questions_are_cut_to_max_query_length(tokenizer):
    import datasets

    row = read_file(str(SQUAD / "dev.json"), COLUMNS)[0]
    long = {**row, "question": " ".join(["why"] * 50) + "?", "id": "long"}
    table = datasets.Dataset.from_list([long])
    windows = tokenize_windows(datasets.DatasetDict(train=table, validation=table), tokenizer, 64, 16, 10)
    first = windows["validation"][0]
    question = first["input_ids"][1 : first["input_ids"].index(tokenizer.sep_token_id)]
    assert len(question) == 10  # cut at 10 tokens; the rest of the window is context


# ----------------------------------------------------------------------------- answers from logits
def test_postprocess_picks_the_best_valid_span_across_windows():
    import datasets

    context = "Ada Lovelace wrote the first program in 1843."
    examples = datasets.Dataset.from_dict({"id": ["q"], "context": [context]})
    # Two windows of one question. Tokens: [CLS] q [SEP] then context words with their offsets.
    spans = [(0, 3), (4, 12), (13, 18), (19, 22), (23, 28), (29, 36), (37, 39), (40, 44)]
    windows = {
        "example_index": [0, 0],
        "cls_index": [0, 0],
        "offset_mapping": [[None, None, None, *spans[:5]], [None, None, None, *spans[3:]]],
    }
    low = -5.0
    first = (np.full(8, low), np.full(8, low))
    second = (np.full(8, low), np.full(8, low))
    first[0][3], first[1][4] = 2.0, 2.0  # "Ada Lovelace": 4.0
    second[0][7], second[1][7] = 3.0, 2.5  # "1843": 5.5, the best
    second[0][1] = 9.0  # a question token: never a start
    second[1][5] = 6.0  # an end before the best start: never paired with it
    predictions, null_odds = postprocess(
        examples, windows, [first[0], second[0]], [first[1], second[1]], 20, 30, False, 0.0
    )
    assert predictions == {"q": "1843"} and null_odds == {}
    # max_answer_length 1: "Ada Lovelace" (2 tokens) is out, single-token spans only
    first[1][3] = 1.9  # "Ada" alone: 3.9
    second[0][7] = -5.0
    predictions, _ = postprocess(
        examples, windows, [first[0], second[0]], [first[1], second[1]], 20, 1, False, 0.0
    )
    assert predictions == {"q": "Ada"}


def test_postprocess_answers_nothing_when_the_null_score_wins_by_the_threshold():
    import datasets

    examples = datasets.Dataset.from_dict({"id": ["q"], "context": ["Ada wrote it."]})
    windows = {
        "example_index": [0],
        "cls_index": [0],
        "offset_mapping": [[None, None, None, (0, 3), (4, 9), (10, 13)]],
    }
    starts = np.array([4.0, 0, 0, 2.0, 0, 0])  # null: 4 + 3 = 7, best span "Ada": 2 + 1 = 3
    ends = np.array([3.0, 0, 0, 1.0, 0, 0])
    for threshold, answer in ((0.0, ""), (3.9, ""), (4.1, "Ada")):
        predictions, odds = postprocess(examples, windows, [starts], [ends], 20, 30, True, threshold)
        assert predictions == {"q": answer} and odds == {"q": pytest.approx(4.0)}


# ----------------------------------------------------------------------------- the Hub
def test_the_hub_unreachable_says_how_to_work_offline():
    from amp_recipes.tasks.qa import load_hub

    with pytest.raises(
        InputError, match=r"rajpurkar/squad_v2 .*Offline\?.*--train_file and --validation_file"
    ):
        load_hub(version_2=True)


def test_the_hubs_squad_layout_is_read_as_is(monkeypatch):
    """The Hub's squad / squad_v2 rows (id, title, context, question, answers as a dict of lists)
    are already the recipe's layout: loaded by name, the title dropped."""
    import datasets

    from amp_recipes.tasks import qa

    rows = read_file(str(SQUAD / "dev.json"), COLUMNS).select(range(3))
    asked = []

    def load_dataset(name, cache_dir=None):
        asked.append(name)
        return datasets.DatasetDict(train=rows, validation=rows)

    monkeypatch.setattr(qa.datasets, "load_dataset", load_dataset)
    for version_2, name in ((False, "rajpurkar/squad"), (True, "rajpurkar/squad_v2")):
        task = qa.load_hub(version_2)
        assert asked[-1] == name and task.name == name.split("/")[1]
        assert task.splits["validation"].column_names == ["id", "question", "context", "answers"]


def test_split_squad_splits_by_article(tmp_path, capsys):
    from conftest import load_module

    split = load_module(REPO / "scripts" / "split_squad.py")
    first, rest = tmp_path / "a.json", tmp_path / "b.json"
    split.main([str(SQUAD / "train.json"), "--first", "30", str(first), str(rest)])
    a, b = read_file(str(first), COLUMNS), read_file(str(rest), COLUMNS)
    assert a.num_rows + b.num_rows == 667 and set(a["title"]).isdisjoint(b["title"])
    assert len(set(b["title"])) == 2 and json.loads(first.read_text())["version"] == "1.1"
    assert f"{rest}: 2 articles, {b.num_rows} questions" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        split.main([str(SQUAD / "dev.json"), "--first", "8", str(first), str(rest)])
