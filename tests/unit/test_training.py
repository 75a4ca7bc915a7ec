"""Collation, length grouping, optimizer groups, data caches and the run record."""

import json
import os
import shutil

import datasets
import torch
from conftest import GLUE_DIR, TINY_BERT, minilm_path
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from amp_recipes.data import glue_sources, load_glue
from amp_recipes.training import (
    RunRecord,
    cached_map,
    make_collator,
    optimizer_grouped_parameters,
    prepare_once,
    tokenize_splits,
    train_sampler,
    write_json_atomic,
)


def tokenize_task(task_name="rte", max_train=64):
    tokenizer = AutoTokenizer.from_pretrained(TINY_BERT)
    task = load_glue(task_name, GLUE_DIR)
    task.splits["train"] = task.splits["train"].select(range(max_train))
    return tokenizer, tokenize_splits(task, tokenizer, 128)


def test_tokenized_splits_keep_only_model_inputs_and_labels():
    _, tokenized = tokenize_task()
    assert set(tokenized["train"].column_names) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert max(len(ids) for ids in tokenized["train"]["input_ids"]) <= 128


def test_mixed_precision_pads_to_a_multiple_of_8_and_fp32_to_the_longest():
    tokenizer, tokenized = tokenize_task()
    features = [tokenized["train"][i] for i in range(5)]
    longest = max(len(f["input_ids"]) for f in features)
    assert make_collator(tokenizer, "no")(features)["input_ids"].shape == (5, longest)
    for precision in ("fp16", "bf16"):
        width = make_collator(tokenizer, precision)(features)["input_ids"].shape[1]
        assert width % 8 == 0 and longest <= width < longest + 8


def test_length_grouping_reduces_padding():
    tokenizer, tokenized = tokenize_task("sst2", max_train=256)  # short sentences, varied lengths
    dataset = tokenized["train"]
    lengths = [len(ids) for ids in dataset["input_ids"]]
    assert train_sampler(dataset, 16, False, 0) is None

    def padded_tokens(order):
        batches = [order[i : i + 16] for i in range(0, len(order), 16)]
        return sum(len(b) * max(lengths[j] for j in b) for b in batches)

    grouped = list(train_sampler(dataset, 16, True, 0))
    assert sorted(grouped) == list(range(256))
    shuffled = torch.randperm(256, generator=torch.Generator().manual_seed(0)).tolist()
    assert padded_tokens(grouped) < 0.9 * padded_tokens(shuffled)


def test_no_weight_decay_on_biases_and_norms():
    model = AutoModelForSequenceClassification.from_pretrained(TINY_BERT)
    decay, no_decay = optimizer_grouped_parameters(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("bias") or "LayerNorm" in names[id(p)] for p in no_decay["params"])
    assert all(not names[id(p)].endswith("bias") and "LayerNorm" not in names[id(p)] for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_atomic_json_replaces_whole_files_and_leaves_no_temporaries(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"a": 1})
    write_json_atomic(tmp_path / "r.json", {"a": 2})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_run_record_writes_only_when_enabled(tmp_path):
    RunRecord(tmp_path / "off", enabled=False).log({"loss": 1.0}, 1)
    assert not (tmp_path / "off").exists()
    record = RunRecord(tmp_path / "on", enabled=True)
    record.log({"loss": 1.0}, 1)
    record.log({"loss": 0.5}, 2)
    lines = (tmp_path / "on" / "log_history.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]


def test_cached_map_fingerprint_follows_data_tokenizer_and_key():
    tiny, minilm = AutoTokenizer.from_pretrained(TINY_BERT), AutoTokenizer.from_pretrained(minilm_path())
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a fine film", "dull"]})})

    def fingerprint(tokenizer, key, data=splits):
        mapped = cached_map(
            data, lambda batch: tokenizer(batch["text"], truncation=True, max_length=8), tokenizer, key
        )
        return mapped["train"]._fingerprint

    first = fingerprint(tiny, ("k", 8))
    assert (
        fingerprint(tiny, ("k", 8)) == first
    )  # the same work finds the same cache (truncation state ignored)
    assert fingerprint(tiny, ("k", 16)) != first
    assert fingerprint(minilm, ("k", 8)) != first
    other = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["another film", "dull"]})})
    assert fingerprint(tiny, ("k", 8), other) != first


def test_prepare_once_reuses_the_prepared_copy_until_files_tokenizer_or_key_change(tmp_path, monkeypatch):
    data_dir = tmp_path / "glue"
    shutil.copytree(os.path.join(GLUE_DIR, "RTE"), data_dir / "RTE")
    tiny, minilm = AutoTokenizer.from_pretrained(TINY_BERT), AutoTokenizer.from_pretrained(minilm_path())
    builds = []

    def prepare(tokenizer, key=("k",), cache=tmp_path / "cache"):
        def build():
            builds.append(key)
            task = load_glue("rte", data_dir)
            task.splits["train"] = task.splits["train"].select(range(32))
            return task, tokenize_splits(task, tokenizer, 64)

        return prepare_once(build, glue_sources("rte", data_dir), tokenizer, key, cache_dir=cache)

    task, first = prepare(tiny)
    again, second = prepare(tiny)
    assert len(builds) == 1  # the second call loaded the saved copy
    assert (again.name, again.label_names, again.text_columns, again.eval_splits) == (
        task.name, task.label_names, task.text_columns, task.eval_splits,
    )  # fmt: skip
    for split in first:
        assert second[split][:] == first[split][:]
    prepare(tiny, key=("other",))
    prepare(minilm)
    assert len(builds) == 3  # another key, another tokenizer: prepared again
    dev = data_dir / "RTE" / "dev.tsv"
    dev.write_text(dev.read_text() + "9999\tA new sentence.\tAnother one.\tentailment\n")
    _, edited = prepare(tiny)
    assert len(builds) == 4 and edited["validation"].num_rows == first["validation"].num_rows + 1
    prepare(tiny, cache=None)  # without a cache folder: the datasets cache of this test
    assert len(builds) == 5

    # A save that fails half-way leaves no folder that a later run would take for complete.
    def failing_save(self, path, **kwargs):
        os.makedirs(path)
        raise OSError("disk full")

    monkeypatch.setattr(datasets.DatasetDict, "save_to_disk", failing_save)
    _, data = prepare(tiny, key=("crash",))
    assert data["train"].num_rows == 32  # this run still has its data
    monkeypatch.undo()
    prepare(tiny, key=("crash",))
    assert builds[-2:] == [("crash",), ("crash",)]
    assert not [p for p in (tmp_path / "cache" / "amp_recipes_prepared").iterdir() if p.name.startswith(".")]

    # An unreadable prepared copy is prepared again and replaced.
    for folder in (tmp_path / "cache" / "amp_recipes_prepared").iterdir():
        (folder / "task.json").write_text("{not json")
    prepare(tiny)
    _, reloaded = prepare(tiny)
    assert builds[-1] == ("k",) and len(builds) == 8 and reloaded["train"].num_rows == 32


def test_prepare_once_builds_every_time_without_local_files(tmp_path):
    calls = []
    tokenizer = AutoTokenizer.from_pretrained(TINY_BERT)
    for _ in range(2):
        prepare_once(lambda: calls.append(1) or ("task", "data"), None, tokenizer, "k", cache_dir=tmp_path)
    missing = [tmp_path / "missing.csv"]
    prepare_once(lambda: calls.append(1) or ("task", "data"), missing, tokenizer, "k", cache_dir=tmp_path)
    assert len(calls) == 3 and not (tmp_path / "amp_recipes_prepared").exists()
    blocked = tmp_path / "a-file"  # a cache folder that cannot be created
    blocked.write_text("")
    sources = [os.path.join(GLUE_DIR, "RTE", "train.tsv")]
    assert prepare_once(lambda: ("task", "data"), sources, tokenizer, "k", cache_dir=blocked) == (
        "task",
        "data",
    )


def test_prepare_once_prepares_again_when_the_code_that_prepares_changes(tmp_path, monkeypatch):
    """A user who copies a recipe and edits how it prepares the data must not get the old copy."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_BERT)
    sources = [os.path.join(GLUE_DIR, "RTE", "train.tsv")]
    recipe = tmp_path / "my_task.py"

    def run_copy(marker):
        recipe.write_text(
            "import datasets\n"
            "from amp_recipes.data import TaskData\n"
            "def build():\n"
            f"    data = datasets.DatasetDict({{'train': datasets.Dataset.from_dict({{'x': [{marker}]}})}})\n"
            "    return TaskData('t', data, ('x',), None, 't'), data\n"
        )
        namespace = {}
        exec(compile(recipe.read_text(), str(recipe), "exec"), namespace)
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
        task_and_data = prepare_once(namespace["build"], sources, tokenizer, "k")
        return task_and_data[1]["train"]["x"]

    assert run_copy(1) == [1]
    assert run_copy(2) == [2]  # edited: prepared again, not the saved [1]
