"""What keeps recipes/bert_glue.py fast: no host synchronisation between logging steps, cached
tokenisation, SDPA attention, torch.compile through accelerate."""

import json
import sys

import torch
from conftest import RECIPES, REPO, glue_flags, log_history, run, train

TINY = glue_flags(seed=3)
# Tensor methods that make the host wait for the device (on a GPU); counted when our code calls them.
SYNCING = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__")
OURS = (str(RECIPES), str(REPO / "amp_recipes"))


def test_no_host_sync_between_logging_steps(recipe, tmp_path, monkeypatch):
    calls, marks = [], []

    def counting(name, method):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(OURS):
                calls.append((name, caller, sys._getframe(1).f_lineno))
            return method(self, *args, **kwargs)

        return wrapper

    for name in SYNCING:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    observe = recipe.StepTelemetry.observe

    def observe_and_mark(self, *args, **kwargs):
        observe(self, *args, **kwargs)
        marks.append(len(calls))  # syncs so far, at the end of each micro-batch

    monkeypatch.setattr(recipe.StepTelemetry, "observe", observe_and_mark)
    train(recipe, [*TINY, "--max_train_steps", 12, "--logging_steps", 4, "--output_dir", tmp_path])
    assert len(marks) == 12
    # syncs between the end of step k and the end of step k+1: only the log line of step k (4, 8)
    per_step = [after - before for before, after in zip(marks, marks[1:], strict=False)]
    syncing_steps = [step for step, count in enumerate(per_step, start=1) if count]
    assert syncing_steps == [4, 8], [calls[marks[s - 1] : marks[s]] for s in syncing_steps]


def test_a_second_run_reads_datasets_cache_and_a_changed_flag_tokenises_again(tmp_path):
    cache = tmp_path / "datasets-cache"
    command = [sys.executable, RECIPES / "bert_glue.py", *TINY, "--max_train_steps", 1]
    logs, files = [], []
    for name, length in (("first", 128), ("second", 128), ("shorter", 32)):
        argv = [*command, "--max_seq_length", length, "--output_dir", tmp_path / name]
        done = run(argv, tmp_path, HF_DATASETS_CACHE=cache)
        assert done.returncode == 0, done.stderr[-2000:]
        logs.append(done.stderr)
        files.append(sorted(p.name for p in cache.rglob("cache-*.arrow")))
    assert "Tokenizing" in logs[0] and "Tokenizing" not in logs[1]  # datasets' cache, no map pass
    assert files[1] == files[0]  # nothing re-tokenised into new cache files
    assert "Tokenizing" in logs[2] and len(files[2]) > len(files[1])  # never stale: tokenised again
    results = json.loads((tmp_path / "second" / "eval_results.json").read_text())
    assert results["attn_implementation"] == "sdpa"  # transformers' fused attention, recorded
    assert results["optimizer"] == "fused AdamW"


def test_torch_compile_goes_through_accelerate(recipe, tmp_path, monkeypatch):
    compiled = []
    real_compile = torch.compile

    def recording_compile(model, *args, **kwargs):
        compiled.append(kwargs.get("backend"))
        return real_compile(model, *args, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    argv = [*TINY, "--max_train_steps", 2, "--torch_compile", "--torch_compile_backend", "eager"]
    results = train(recipe, [*argv, "--output_dir", tmp_path])
    assert compiled == ["eager"]  # accelerate's TorchDynamoPlugin compiled the prepared model once
    assert results["fp16_range"] == {}  # the monitor's hooks would force recompiles: off
    assert results["train_steps"] == 2


def test_dataloader_workers(recipe, tmp_path):
    results = train(
        recipe, [*TINY, "--max_train_steps", 2, "--dataloader_num_workers", 1, "--output_dir", tmp_path]
    )
    assert results["train_steps"] == 2 and results["eval_samples"] == 16


def test_padding_per_epoch_is_logged_and_grouping_lowers_it(recipe, tmp_path, caplog):
    caplog.set_level("INFO")
    fractions = {}
    for grouped in (False, True):
        output_dir = tmp_path / f"grouped-{grouped}"
        argv = [*TINY, "--max_train_samples", 64, "--num_train_epochs", 1, "--max_seq_length", 512]
        argv += ["--output_dir", output_dir]  # 512: the tiny vocabulary makes long sequences
        train(recipe, [*argv, "--group_by_length"] if grouped else argv)
        rows = [row for row in log_history(output_dir) if "epoch_padding_fraction" in row]
        assert len(rows) == 1 and rows[0]["step"] == 8
        fractions[grouped] = rows[0]["epoch_padding_fraction"]
    assert 0 < fractions[True] < fractions[False] < 1
    assert f"epoch 1: {fractions[False]:.1%} of the batches' tokens were padding" in caplog.text
