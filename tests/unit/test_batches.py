"""Tokenisation (datasets' cache), collation, length grouping, optimizer groups and the run record."""

import itertools
import json
import os

import datasets
import torch
from conftest import GLUE_DIR, TINY_BERT
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from amp_recipes.tasks.batches import LengthGroupedBatches, by_length, train_sampler
from amp_recipes.tasks.classification import load_glue, make_collator, tokenize_splits
from amp_recipes.training.optim import optimizer_grouped_parameters
from amp_recipes.training.outputs import RunRecord, write_json_atomic


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


def test_length_grouping_reduces_padding_in_full_batches_of_random_order():
    tokenizer, tokenized = tokenize_task("sst2", max_train=1000)  # short sentences, varied lengths
    dataset = tokenized["train"]
    lengths = [len(ids) for ids in dataset["input_ids"]]
    assert train_sampler(dataset, 16, False, 0) is None

    def batches_of(order):
        return [order[i : i + 16] for i in range(0, len(order), 16)]

    def padded_tokens(order):
        return sum(len(b) * max(lengths[j] for j in b) for b in batches_of(order))

    sampler = train_sampler(dataset, 16, True, 0)
    grouped = list(sampler)
    assert sorted(grouped) == list(range(1000)) and len(sampler) == 1000
    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).tolist()
    assert padded_tokens(grouped) < 0.9 * padded_tokens(shuffled)
    # The DataLoader cuts the stream in order: every batch full but the epoch's last.
    longest = [max(lengths[j] for j in batch) for batch in batches_of(grouped)]
    assert [len(b) for b in batches_of(grouped)] == [16] * 62 + [8]
    assert longest[0] == max(lengths)  # the longest batch first: out of memory shows at step 1
    # ... and the batches in random order, not longest to shortest as transformers' sampler runs
    # each megabatch (its last steps, where the learning rate ends, then see only short sequences).
    descending = sum(a >= b for a, b in itertools.pairwise(longest[1:-1]))  # 60 pairs
    assert 0.25 * 60 < descending < 0.75 * 60
    # Reseeded from (seed, epoch): a resumed run sees the same batches; another epoch, others.
    assert list(train_sampler(dataset, 16, True, 0)) == grouped
    sampler.set_epoch(1)
    assert list(sampler) != grouped and sorted(sampler) == list(range(1000))


def test_the_epochs_longest_row_is_always_in_its_first_batch():
    """Even when the shuffle puts it in the epoch's short last batch (10 rows in batches of 4: the
    last holds 2), it trades places with the first batch's shortest row."""
    lengths = list(range(1, 11))  # row 9 is the longest
    in_the_last = 0
    for seed in range(20):
        order = list(LengthGroupedBatches(lengths, 4, seed))
        assert sorted(order) == list(range(10)) and 9 in order[:4]
        in_the_last += 9 in torch.randperm(10, generator=torch.Generator().manual_seed(seed)).tolist()[8:]
    assert in_the_last > 0  # the case arose


def test_evaluation_runs_shortest_to_longest():
    _, tokenized = tokenize_task("sst2", max_train=300)
    dataset = tokenized["train"]
    lengths = [len(ids) for ids in dataset["input_ids"]]
    order = by_length(dataset)
    assert sorted(order) == list(range(300)) and [lengths[i] for i in order] == sorted(lengths)


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
    umask = os.umask(0o027)  # as a group-shared cluster account might have it
    try:
        write_json_atomic(tmp_path / "shared.json", {"a": 3})
    finally:
        os.umask(umask)
    assert (tmp_path / "shared.json").stat().st_mode & 0o777 == 0o640  # not tempfile's private 0600
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o666 & ~umask


def test_run_record_writes_only_when_enabled(tmp_path):
    RunRecord(tmp_path / "off", enabled=False).log({"loss": 1.0}, 1)
    assert not (tmp_path / "off").exists()
    record = RunRecord(tmp_path / "on", enabled=True)
    record.log({"loss": 1.0}, 1)
    record.log({"loss": 0.5}, 2)
    lines = (tmp_path / "on" / "log_history.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]


def test_tokenisation_is_cached_by_datasets_and_never_stale(tmp_path, monkeypatch):
    """A second identical run reads datasets' cache; any change that matters tokenises again."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(TINY_BERT)

    def tokenize(max_seq_length, tokenizer=tokenizer):
        task = load_glue("rte", GLUE_DIR, cache_dir=str(tmp_path))
        task.splits["train"] = task.splits["train"].select(range(32))
        return tokenize_splits(task, tokenizer, max_seq_length)["train"]

    first, again = tokenize(128), tokenize(128)
    assert again.cache_files == first.cache_files and again["input_ids"] == first["input_ids"]
    shorter = tokenize(16)
    assert shorter.cache_files != first.cache_files
    assert max(len(ids) for ids in shorter["input_ids"]) == 16 < max(len(ids) for ids in first["input_ids"])
    other = AutoTokenizer.from_pretrained(TINY_BERT, do_lower_case=False)  # another tokenizer definition
    assert tokenize(128, other).cache_files != first.cache_files


def test_padding_multiple_of_each_precision():
    from amp_recipes.tasks.batches import pad_multiple

    # 8 for fp16/bf16 Tensor Cores; 16 for fp8, torch._scaled_mm's requirement on every matmul
    # dimension, batch x sequence included (the inner dimension of the weight gradient's).
    assert [pad_multiple(p) for p in ("no", "fp16", "bf16", "fp8")] == [None, 8, 8, 16]
