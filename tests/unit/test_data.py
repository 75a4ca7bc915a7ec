"""GLUE loading from the real files in the repository's data/glue, from files in every other task's
classic layout, and from a user's own csv/tsv/json/jsonl files."""

import json

import pytest
from conftest import GLUE_DIR

from amp_recipes.errors import InputError
from amp_recipes.tasks.classification import (
    GLUE_TASKS,
    get_task,
    load_glue,
    load_test_splits,
    load_user_files,
    prediction_lines,
)

# Row counts from data/README.md; first/last rows copied from the files by hand.
REAL_TASKS = {
    "cola": dict(
        rows={"train": 8551, "validation": 1043},
        first={
            "train": ("Our friends won't buy this analysis, let alone the next one we propose.", 1),
            "validation": ("The sailors rode the breeze clear of the rocks.", 1),
        },
        last={
            "train": ("What all did you get for Christmas?", 1),
            "validation": ("John talked to Bill about himself.", 1),
        },
        labels=("unacceptable", "acceptable"),
    ),
    "mrpc": dict(
        rows={"train": 3668, "validation": 408},
        first={
            "train": (
                'Amrozi accused his brother, whom he called "the witness", of deliberately distorting his evidence.',
                1,
            ),
            "validation": (
                "He said the foodservice pie business doesn't fit the company's long-term growth strategy.",
                1,
            ),
        },
        last={
            "train": (
                "The 30-year bond US30YT=RR rose 22/32 for a yield of 4.31 percent, versus 4.35 percent at Wednesday's close.",
                0,
            ),
            "validation": (
                "Ex-KGB agent Putin added that the Beatles were considered 'propaganda of an alien ideology'.",
                1,
            ),
        },
        labels=("not_equivalent", "equivalent"),
    ),
    "rte": dict(
        rows={"train": 2490, "validation": 277},
        first={
            "train": ("No Weapons of Mass Destruction Found in Iraq Yet.", 1),
            "validation": (
                "Dana Reeve, the widow of the actor Christopher Reeve, has died of lung cancer at age 44, according to the Christopher Reeve Foundation.",
                1,
            ),
        },
        last={
            "train": (
                "Turkey is unlikely to become involved in, or allow U.S. forces to use Turkish territory in a Middle East war that does not threaten her territory directly.",
                1,
            ),
            "validation": (
                'Danny Kennedy, Greenpeace campaigns director, said: "The burden of proof in the Scott Parkin expulsion case',
                1,
            ),
        },
        labels=("entailment", "not_entailment"),
    ),
    "sst2": dict(
        rows={"train": 67349, "validation": 872},
        first={
            "train": ("hide new secretions from the parental units ", 0),
            "validation": ("it 's a charming and often affecting journey . ", 1),
        },
        last={
            "train": (
                "this new jangle of noise , mayhem and stupidity must be a serious contender for the title . ",
                0,
            ),
            "validation": (
                "looking aristocratic , luminous yet careworn in jane hamilton 's exemplary costumes , rampling gives a performance that could not be improved upon . ' ",
                1,
            ),
        },
        labels=("negative", "positive"),
    ),
}


@pytest.mark.parametrize("task_name", sorted(REAL_TASKS))
def test_real_glue_files(task_name):
    expected = REAL_TASKS[task_name]
    data = load_glue(task_name, GLUE_DIR)
    assert data.label_names == expected["labels"]
    for split, rows in expected["rows"].items():
        table = data.splits[split]
        assert table.num_rows == rows
        assert table.column_names == [*GLUE_TASKS[task_name].text_columns, "label"]
        assert set(table["label"]) == {0, 1}
        first_text, first_label = expected["first"][split]
        last_text, last_label = expected["last"][split]
        text_column = data.text_columns[0]
        assert (table[0][text_column], table[0]["label"]) == (first_text, first_label)
        assert table[-1][text_column].startswith(last_text)
        assert table[-1]["label"] == last_label


def test_glue_dir_may_be_the_task_folder_itself():
    assert load_glue("rte", GLUE_DIR / "RTE").splits["validation"].num_rows == 277


def test_glue_dir_from_environment(monkeypatch):
    monkeypatch.setenv("GLUE_DIR", str(GLUE_DIR))
    assert load_glue("mrpc").splits["validation"].num_rows == 408


def write_tsv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ([("\t".join(header))] if header else []) + ["\t".join(map(str, row)) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


# Each remaining task's classic GLUE layout (download_glue_data.py), two rows per file. The
# texts include an unbalanced quote and "NA", which a quoting / NA-parsing reader would mangle.
OTHER_LAYOUTS = {
    "qqp": (
        ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
        [[1, 11, 12, 'How do I learn "Python?', "NA", 1], [2, 13, 14, "What is AI?", "Who am I?", 0]],
        {"question1": 'How do I learn "Python?', "question2": "NA", "label": 1},
    ),
    "stsb": (
        [
            "index",
            "genre",
            "filename",
            "year",
            "old_index",
            "source1",
            "source2",
            "sentence1",
            "sentence2",
            "score",
        ],
        [
            [
                0,
                "main-captions",
                "MSRvid",
                "2012test",
                1,
                "none",
                "none",
                'A "plane is taking off.',
                "An air plane is taking off.",
                5.0,
            ],
            [
                1,
                "main-captions",
                "MSRvid",
                "2012test",
                4,
                "none",
                "none",
                "A man plays a flute.",
                "A man plays a big flute.",
                3.8,
            ],
        ],
        {"sentence1": 'A "plane is taking off.', "sentence2": "An air plane is taking off.", "label": 5.0},
    ),
    "qnli": (
        ["index", "question", "sentence", "label"],
        [
            [0, "When did it open?", "It opened in 1990.", "entailment"],
            [1, "Who?", "Nobody knows.", "not_entailment"],
        ],
        {"question": "When did it open?", "sentence": "It opened in 1990.", "label": 0},
    ),
    "wnli": (
        ["index", "sentence1", "sentence2", "label"],
        [
            [0, "I stuck a pin through a carrot.", "The carrot has a hole.", 1],
            [1, "John couldn't see.", "John was tall.", 0],
        ],
        {"sentence1": "I stuck a pin through a carrot.", "sentence2": "The carrot has a hole.", "label": 1},
    ),
}
MNLI_TRAIN = [
    "index",
    "promptID",
    "pairID",
    "genre",
    "sentence1_binary_parse",
    "sentence2_binary_parse",
    "sentence1_parse",
    "sentence2_parse",
    "sentence1",
    "sentence2",
    "label1",
    "gold_label",
]
MNLI_DEV = MNLI_TRAIN[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]


@pytest.mark.parametrize("task_name", sorted(OTHER_LAYOUTS))
def test_other_task_layouts(tmp_path, task_name):
    task = GLUE_TASKS[task_name]
    header, rows, first = OTHER_LAYOUTS[task_name]
    for name in ("train.tsv", "dev.tsv"):
        write_tsv(tmp_path / task.glue_dir / name, header, rows)
    data = load_glue(task_name, tmp_path)
    assert data.splits["train"].num_rows == 2
    row = data.splits["validation"][0]
    assert {k: row[k] for k in first} == pytest.approx(first)
    assert data.num_labels == (1 if task_name == "stsb" else len(task.label_names))


def test_mnli_layout_with_matched_and_mismatched(tmp_path):
    def row(n, extra, label):
        return [
            n,
            1,
            f"{n}e",
            "fiction",
            "(",
            "(",
            "(S",
            "(S",
            f"premise {n}",
            f"hypothesis {n}",
            *extra,
            label,
        ]

    write_tsv(
        tmp_path / "MNLI" / "train.tsv",
        MNLI_TRAIN,
        [
            row(0, ["neutral"], "neutral"),
            row(1, ["contradiction"], "contradiction"),
            row(2, ["entailment"], "entailment"),
        ],
    )
    for name in ("dev_matched.tsv", "dev_mismatched.tsv"):
        write_tsv(
            tmp_path / "MNLI" / name,
            MNLI_DEV,
            [row(7, ["neutral"] * 5, "neutral"), row(8, ["entailment"] * 5, "contradiction")],
        )
    data = load_glue("mnli", tmp_path)
    assert data.eval_splits == ("validation_matched", "validation_mismatched")
    assert data.splits["train"]["label"] == [1, 2, 0]
    assert data.splits["validation_mismatched"][1] == {
        "premise": "premise 8",
        "hypothesis": "hypothesis 8",
        "label": 2,
    }


def test_unknown_task():
    with pytest.raises(InputError, match="Unknown task 'mrcp'"):
        get_task("mrcp")


def test_missing_task_folder(tmp_path):
    with pytest.raises(InputError, match=r"No GLUE files for rte under .*RTE/train.tsv"):
        load_glue("rte", tmp_path)


def test_missing_dev_file(tmp_path):
    write_tsv(
        tmp_path / "RTE" / "train.tsv",
        ["index", "sentence1", "sentence2", "label"],
        [[0, "a", "b", "entailment"]],
    )
    with pytest.raises(InputError, match=r"Missing GLUE file .*RTE/dev.tsv for task rte"):
        load_glue("rte", tmp_path)


def test_label_not_of_the_task(tmp_path):
    header = ["index", "sentence1", "sentence2", "label"]
    write_tsv(tmp_path / "RTE" / "train.tsv", header, [[0, "a", "b", "entailment"], [1, "c", "d", "neutral"]])
    write_tsv(tmp_path / "RTE" / "dev.tsv", header, [[0, "a", "b", "entailment"]])
    with pytest.raises(InputError, match=r"label 'neutral' is not one of \['entailment', 'not_entailment'\]"):
        load_glue("rte", tmp_path)


def test_missing_column(tmp_path):
    write_tsv(tmp_path / "SST-2" / "train.tsv", ["text", "label"], [["good", 1]])
    write_tsv(tmp_path / "SST-2" / "dev.tsv", ["text", "label"], [["bad", 0]])
    with pytest.raises(InputError, match=r"has no column\(s\) \['sentence'\] needed for sst2"):
        load_glue("sst2", tmp_path)


# ----------------------------------------------------------------------------- user files
def write_user_file(path, rows):
    if path.suffix in (".json", ".jsonl"):
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    else:
        sep = "\t" if path.suffix == ".tsv" else ","
        header = list(rows[0])
        path.write_text(
            "\n".join([sep.join(header)] + [sep.join(str(r[k]) for k in header) for r in rows]) + "\n"
        )


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".json", ".jsonl"])
def test_user_files_pair_classification(tmp_path, suffix):
    rows = [
        {"sentence1": f"a{i}", "sentence2": f"b{i}", "label": ["spam", "ham", "eggs"][i % 3]}
        for i in range(6)
    ]
    train, dev = tmp_path / f"train{suffix}", tmp_path / f"dev{suffix}"
    write_user_file(train, rows)
    write_user_file(dev, rows[:2])
    data = load_user_files(str(train), str(dev))
    assert data.text_columns == ("sentence1", "sentence2")
    assert data.label_names == ("eggs", "ham", "spam")  # sorted: stable ids between runs
    assert data.metric_config == "classification"
    assert data.splits["validation"][0] == {"sentence1": "a0", "sentence2": "b0", "label": 2}


def test_user_files_regression_with_named_columns(tmp_path):
    rows = [{"review": f"text {i}", "stars": i / 2} for i in range(5)]
    write_user_file(tmp_path / "train.jsonl", rows)
    write_user_file(tmp_path / "dev.jsonl", rows)
    data = load_user_files(str(tmp_path / "train.jsonl"), str(tmp_path / "dev.jsonl"), ("review",), "stars")
    assert data.is_regression and data.num_labels == 1 and data.metric_config == "regression"
    assert data.splits["train"][3] == {"review": "text 3", "label": 1.5}


def test_user_integer_labels_keep_their_values_as_names(tmp_path):
    write_user_file(tmp_path / "train.csv", [{"text": "x", "label": v} for v in (10, 2, 2, 10)])
    write_user_file(tmp_path / "dev.csv", [{"text": "y", "label": 10}])
    data = load_user_files(str(tmp_path / "train.csv"), str(tmp_path / "dev.csv"))
    assert data.label_names == ("2", "10")  # numeric order, not string order
    assert data.splits["validation"]["label"] == [1]


def test_user_validation_label_unseen_in_training(tmp_path):
    write_user_file(tmp_path / "train.csv", [{"text": "x", "label": "pos"}, {"text": "y", "label": "neg"}])
    write_user_file(tmp_path / "dev.csv", [{"text": "z", "label": "neutral"}])
    with pytest.raises(InputError, match=r"dev.csv: label 'neutral' is not one of \['neg', 'pos'\]"):
        load_user_files(str(tmp_path / "train.csv"), str(tmp_path / "dev.csv"))


def test_user_file_columns_other_than_the_known_names(tmp_path):
    """As transformers' run_glue_no_trainer.py reads a file: the first two columns other than the
    label are a pair, one column is a single text; only the label alone has no text."""
    write_user_file(tmp_path / "one.csv", [{"body": "x", "label": 1}, {"body": "y", "label": 0}])
    assert load_user_files(str(tmp_path / "one.csv"), str(tmp_path / "one.csv")).text_columns == ("body",)
    rows = [{"a": "x", "b": "y", "c": "z", "label": 1}, {"a": "y", "b": "x", "c": "z", "label": 0}]
    write_user_file(tmp_path / "three.csv", rows)
    three = load_user_files(str(tmp_path / "three.csv"), str(tmp_path / "three.csv"))
    assert three.text_columns == ("a", "b")
    write_user_file(tmp_path / "none.csv", [{"label": 1}, {"label": 0}])
    with pytest.raises(
        InputError, match=r"no text columns found .* found \['label'\]. Name them with --text_columns"
    ):
        load_user_files(str(tmp_path / "none.csv"), str(tmp_path / "none.csv"))


def test_user_file_errors(tmp_path):
    write_user_file(tmp_path / "train.csv", [{"body": "x", "label": 1}, {"body": "y", "label": 0}])
    with pytest.raises(InputError, match=r"has no column\(s\) \['title'\]"):
        load_user_files(str(tmp_path / "train.csv"), str(tmp_path / "train.csv"), ("title",))
    with pytest.raises(InputError, match="does not exist"):
        load_user_files(str(tmp_path / "nope.csv"), str(tmp_path / "train.csv"))
    with pytest.raises(InputError, match=r"unsupported file type '.parquet'"):
        load_user_files(str(tmp_path / "train.parquet"), str(tmp_path / "train.csv"))


def test_hub_unreachable_says_how_to_work_offline(monkeypatch):
    monkeypatch.delenv("GLUE_DIR", raising=False)  # no local files: the Hub is the source
    with pytest.raises(InputError, match=r"Could not load GLUE mrpc from the Hugging Face Hub .* --data_dir"):
        load_glue("mrpc")


# ----------------------------------------------------------------------------- --do_predict's test splits
def test_real_mrpc_test_split_has_every_pair_and_no_label():
    task = load_glue("mrpc", GLUE_DIR)
    tests = load_test_splits(task, GLUE_DIR)
    assert list(tests) == ["test"] and tests["test"].num_rows == 1725
    assert tests["test"].column_names == ["sentence1", "sentence2"]
    assert tests["test"][1724]["sentence2"].endswith('"Re: Details".')  # the file's last pair, unmangled


def test_mnli_predicts_matched_and_mismatched_and_cola_reads_its_test_header(tmp_path):
    """MNLI's two test files (Hub names test_matched / test_mismatched); CoLA's test file has a
    header (index, sentence) where its train and dev files have none."""
    for name in ("test_matched.tsv", "test_mismatched.tsv"):
        write_tsv(
            tmp_path / "MNLI" / name, ["index", "sentence1", "sentence2"], [[0, "a", "NA"], [1, 'b"', "c"]]
        )
    write_tsv(tmp_path / "MNLI" / "train.tsv", MNLI_TRAIN, [])
    tests = load_test_splits(get_task_data("mnli"), tmp_path)
    assert list(tests) == ["test_matched", "test_mismatched"]
    assert tests["test_mismatched"][:] == {"premise": ["a", 'b"'], "hypothesis": ["NA", "c"]}
    write_tsv(tmp_path / "CoLA" / "train.tsv", None, [])
    write_tsv(tmp_path / "CoLA" / "test.tsv", ["index", "sentence"], [[0, "Bill whistled past the house."]])
    assert load_test_splits(get_task_data("cola"), tmp_path)["test"]["sentence"] == [
        "Bill whistled past the house."
    ]
    (tmp_path / "CoLA" / "test.tsv").write_text("index\tfirst\n0\tx\n")
    with pytest.raises(InputError, match=r"test\.tsv has no column\(s\) \['sentence'\] needed for cola"):
        load_test_splits(get_task_data("cola"), tmp_path)


def test_your_test_file_needs_the_training_files_text_columns(tmp_path):
    write_user_file(
        tmp_path / "train.csv", [{"text": "good", "label": "pos"}, {"text": "bad", "label": "neg"}]
    )
    task = load_user_files(str(tmp_path / "train.csv"), str(tmp_path / "train.csv"))
    (tmp_path / "test.csv").write_text("text,label\nokay,pos\nmeh,\n")  # a label column is ignored
    assert load_test_splits(task, test_file=str(tmp_path / "test.csv"))["test"][:] == {
        "text": ["okay", "meh"]
    }
    (tmp_path / "test.csv").write_text("review\nokay\n")
    with pytest.raises(InputError, match=r"test\.csv has no column\(s\) \['text'\]; found \['review'\]"):
        load_test_splits(task, test_file=str(tmp_path / "test.csv"))


def test_prediction_lines_are_glues_submission_format():
    assert prediction_lines([1, 0], ("not_equivalent", "equivalent")) == (
        "index\tprediction\n0\tequivalent\n1\tnot_equivalent\n"
    )
    assert prediction_lines([4.56789, -0.1], None) == "index\tprediction\n0\t4.568\n1\t-0.100\n"


def get_task_data(name):
    """A TaskData of a GLUE task without reading its training files (the test splits need only its texts)."""
    from amp_recipes.tasks.classification import TaskData

    task = get_task(name)
    return TaskData(name, None, task.text_columns, task.label_names, name)
