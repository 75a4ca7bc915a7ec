"""What keeps recipes/bert_glue.py fast: no host synchronisation between logging steps, cached
tokenisation, SDPA attention, torch.compile through accelerate."""

import json
import sys

import torch
from conftest import RECIPES, REPO, glue_flags, log_history, run, train
from transformers import AutoModelForSequenceClassification

from amp_recipes.amp import compiling
from amp_recipes.training import telemetry

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
    observe = telemetry.StepTelemetry.observe

    def observe_and_mark(self, *args, **kwargs):
        observe(self, *args, **kwargs)
        marks.append(len(calls))  # syncs so far, at the end of each micro-batch

    monkeypatch.setattr(telemetry.StepTelemetry, "observe", observe_and_mark)
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


def compile_run(recipe, tmp_path, monkeypatch, *extra):
    """The tiny model compiled (dynamo's `eager` backend: the graphs without inductor's codegen) on
    MRPC batches of many padded lengths, launched as accelerate 1.15's `accelerate launch` would:
    it exports ACCELERATE_DYNAMO_USE_DYNAMIC=False, which made every new length recompile."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "False")
    torch._dynamo.reset()
    counters.clear()
    compiled = []
    real_compile = torch.compile

    def recording_compile(model, *args, **kwargs):
        if isinstance(model, torch.nn.Module):  # accelerate 1.16 also compiles a method (no graph of its own)
            compiled.append((type(model).__name__, kwargs.get("backend"), kwargs.get("dynamic")))
        return real_compile(model, *args, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    argv = [*TINY, "--max_train_samples", 96, "--max_train_steps", 12, "--eval_steps", 6, *extra]
    results = train(
        recipe, [*argv, "--torch_compile", "--torch_compile_backend", "eager", "--output_dir", tmp_path]
    )
    return results, compiled, counters["stats"]["unique_graphs"]


def test_torch_compile_compiles_a_bounded_number_of_graphs(recipe, tmp_path, monkeypatch):
    results, compiled, graphs = compile_run(recipe, tmp_path, monkeypatch)
    # accelerate's TorchDynamoPlugin, regional: each encoder layer compiled (the same code, so one
    # set of graphs serves all five), dynamic shapes, the eager backend asked for.
    assert [name for name, _, _ in compiled].count("BertLayer") == 5
    assert {(backend, dynamic) for _, backend, dynamic in compiled} == {("eager", True)}
    # Whatever the lengths (MRPC's padded lengths change from batch to batch: with static shapes
    # the same run hits dynamo's recompile limit, next test): per compiled
    # module class one graph for training and one for evaluation (dropout on and off).
    kinds = {name for name, _, _ in compiled}  # BertEmbeddings, BertLayer, BertPooler, Dropout, Linear
    assert results["compiled_graphs"] == graphs == 2 * len(kinds), (graphs, kinds)
    assert results["recompile_limit_hit"] is False
    assert results["fp16_range"] == {}  # the monitor's hooks would force recompiles: off
    assert results["train_steps"] == 12
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)  # plain keys, no _orig_mod
    assert reloaded.config.model_type == "bert"


def test_a_hit_recompile_limit_is_reported_in_our_log(recipe, tmp_path, monkeypatch, caplog):
    """Shapes marked static (what accelerate 1.15's `accelerate launch` asks by default) recompile per length until
    dynamo gives up; the run says so, and eval_results.json records it."""
    caplog.set_level("WARNING")
    static = compiling.dynamo_plugin

    def static_shapes(args):
        plugin = static(args)
        plugin.dynamic = False
        return plugin

    monkeypatch.setattr(compiling, "dynamo_plugin", static_shapes)
    # dynamo's own patch: monkeypatch's undo of this option left it unreadable ("recompile_limit
    # does not exist") for every later torch.compile in the same pytest process.
    with torch._dynamo.config.patch(recompile_limit=2):
        results, _, _ = compile_run(recipe, tmp_path, monkeypatch)
    assert results["recompile_limit_hit"] is True
    assert "torch.compile hit dynamo's recompile limit: parts of the model now run uncompiled" in caplog.text


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
        train(recipe, [*argv, "--group_by_length" if grouped else "--no_group_by_length"])
        rows = [row for row in log_history(output_dir) if "epoch_padding_fraction" in row]
        assert len(rows) == 1 and rows[0]["step"] == 8
        fractions[grouped] = rows[0]["epoch_padding_fraction"]
    assert 0 < fractions[True] < fractions[False] < 1
    assert f"epoch 1: {fractions[False]:.1%} of the batches' tokens were padding" in caplog.text
