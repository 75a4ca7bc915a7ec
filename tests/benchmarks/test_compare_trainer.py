"""benchmarks/compare_trainer.py: the Trainer side prepares the same inputs as the recipes (checked
against the recipes' own tokenisation and post-processing on real data), both sides run per seed in
alternating order, and the report holds time, memory and metric intervals (tiny model here; the
real comparison is a benchmark, see docs/results.md)."""

import json
import math
import os
import re
import sys

import numpy as np
import pytest
from conftest import BERT_BASE_CONFIG, GLUE_DIR, REPO, TINY_BERT, load_module, run
from transformers import AutoTokenizer

from amp_recipes.amp import hardware
from amp_recipes.tasks import ner, qa

pytestmark = pytest.mark.heavy  # many processes: CI runs this file in a lane of its own (.ci/run)

SQUAD = REPO / "data" / "squad"
CONLL = REPO / "data" / "conll2003"
COLUMNS = {"question": "question", "context": "context", "answers": "answers"}


@pytest.fixture(scope="module")
def script():
    return load_module(REPO / "benchmarks" / "compare_trainer.py")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BERT_BASE_CONFIG)


def test_qa_windows_and_answers_equal_the_recipes(script, tokenizer):
    """run_qa.py's windows and answer positions, and utils_qa.py's n-best answers, against the QA
    recipe's (amp_recipes.tasks.qa) on the repository's SQuAD questions, in windows short enough that
    most contexts span several."""
    data = qa.load_files(str(SQUAD / "train.json"), str(SQUAD / "dev.json"), COLUMNS, False)
    spec = {"max_seq_length": 128, "doc_stride": 32}
    kwargs = {"fn_kwargs": {"tokenizer": tokenizer, "spec": spec}, "batched": True}
    recipe = qa.tokenize_windows(data.splits, tokenizer, 128, 32, max_query_length=64)
    train = data.splits["train"].map(
        script.qa_train_features, remove_columns=data.splits["train"].column_names, **kwargs
    )
    assert len(train) == len(recipe["train"]) > len(data.splits["train"])  # several windows per context
    assert train["input_ids"] == recipe["train"]["input_ids"]
    ours = list(zip(train["start_positions"], train["end_positions"], strict=True))
    theirs = list(zip(recipe["train"]["start_positions"], recipe["train"]["end_positions"], strict=True))
    differing = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    # run_qa.py's rule steps past an answer that ends on a window's last token (start > end): the
    # one kind of window where the two differ.
    assert len(differing) <= len(ours) // 100 and all(a[0] > a[1] for a, _ in differing), differing
    assert sum(start > 0 for start, _ in ours) > len(data.splits["train"]) // 2  # answers inside windows

    validation = data.splits["validation"]
    windows = validation.map(script.qa_validation_features, remove_columns=validation.column_names, **kwargs)
    assert windows["input_ids"] == recipe["validation"]["input_ids"]
    rng = np.random.default_rng(0)
    starts = [rng.normal(size=len(ids)).astype(np.float32) for ids in windows["input_ids"]]
    ends = [rng.normal(size=len(ids)).astype(np.float32) for ids in windows["input_ids"]]
    answers = script.qa_answers(validation, windows, starts, ends)
    expected, _ = qa.postprocess(validation, recipe["validation"].to_dict(), starts, ends, 20, 30, False, 0.0)
    assert answers == expected and len(answers) == len(validation)


def test_ner_labels_equal_the_recipes(script, tokenizer):
    """run_ner.py's labels (each word's first sub-token, -100 elsewhere) against bert_ner.py's."""
    spec = {"train_file": str(CONLL / "train.txt"), "validation_file": str(CONLL / "valid.txt")}
    spec.update(max_seq_length=32, max_train_samples=None, max_eval_samples=None)  # some sentences cut
    task, features = script.ner_features(spec, tokenizer)
    recipe = ner.tokenize_and_align(task.splits, tokenizer, task.label_names, 32, label_all_tokens=False)
    for split in ("train", "validation"):
        assert features[split]["input_ids"] == recipe[split]["input_ids"]
        assert features[split]["labels"] == recipe[split]["labels"]
    assert any(len(ids) == 32 for ids in features["train"]["input_ids"])


def test_both_sides_run_per_seed_and_the_report_has_intervals(tmp_path):
    output_dir = tmp_path / "report"
    command = [sys.executable, REPO / "benchmarks" / "compare_trainer.py", "--task", "qa", "--seeds", "1,2"]
    command += ["--model_name_or_path", TINY_BERT, "--output_dir", output_dir]
    command += ["--train_file", SQUAD / "train.json", "--validation_file", SQUAD / "dev.json"]
    command += ["--max_train_samples", 24, "--max_eval_samples", 12, "--max_seq_length", 128]
    command += ["--doc_stride", 32, "--per_device_train_batch_size", 8, "--malloc_mmap_threshold", 2**20]
    command += ["--malloc_env", "MALLOC_TOP_PAD_=65536"]
    huge_pages = hardware.huge_pages_on()  # else --huge_pages is refused
    command += ["--huge_pages"] * huge_pages
    done = run(command, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    order = [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("seed ")]
    assert order == ["seed 1 recipe", "seed 1 trainer", "seed 2 trainer", "seed 2 recipe"]  # alternating
    report = json.loads((output_dir / "results.json").read_text())
    for side in ("recipe", "trainer"):
        runs = report["runs"][side]
        assert [r["seed"] for r in runs] == [1, 2]
        for result in runs:
            assert result["train_steps"] > 0
            assert 0 < result["train_seconds"] < result["wall_seconds"]
            assert result["peak_rss_bytes"] > 2**27  # torch alone takes more than 128 MiB
            assert result["cpu_user_seconds"] > 0 and result["cpu_system_seconds"] > 0
            assert 0 <= result["eval_exact_match"] <= result["eval_f1"] <= 100
            assert result["involuntary_context_switches"] >= 0
            assert result["machine_steal_seconds"] >= 0  # a Linux machine: /proc/stat is there
    settings = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TOP_PAD_": "65536"}
    settings.update({"THP_MEM_ALLOC_ENABLE": "1"} if huge_pages else {})
    assert all(run["allocator_env"] == settings for run in report["runs"]["trainer"])  # what the child saw
    assert report["allocator_env"] == settings
    assert report["hardware"]["transparent_huge_pages"] in ("always", "madvise", "never", None)
    assert [r["train_steps"] for r in report["runs"]["recipe"]] == [
        r["train_steps"] for r in report["runs"]["trainer"]
    ]
    summary = report["summary"]
    for name in ("wall_seconds", "train_seconds", "peak_rss_bytes", "cpu_user_seconds", "cpu_system_seconds"):
        assert summary["ratios"][name] > 0
        per_seed = summary["ratio_per_seed"][name]
        pairs = zip(report["runs"]["recipe"], report["runs"]["trainer"], strict=True)
        expected = [a[name] / b[name] for a, b in pairs]
        assert per_seed["values"] == pytest.approx(expected)
        low, high = per_seed["ci"]
        assert per_seed["geometric_mean"] == pytest.approx(math.sqrt(expected[0] * expected[1]))
        assert 0 < low <= per_seed["geometric_mean"] <= high
    for name in ("eval_exact_match", "eval_f1"):
        interval = summary["metrics"][name]
        assert interval["n"] == 2 and math.isfinite(interval["half_width"]), interval
        differences = [
            a[name] - b[name]
            for a, b in zip(report["runs"]["recipe"], report["runs"]["trainer"], strict=True)
        ]
        assert interval["mean"] == pytest.approx(sum(differences) / 2)
    table = (output_dir / "results.md").read_text()
    assert re.search(
        r"\| training, s \|.*\(per seed [\d.]+ / [\d.]+, geometric mean [\d.]+x \[[\d.]+, [\d.]+\]\) \|",
        table,
    )
    assert "| training, s |" in table and "| eval_f1 |" in table and "Still different:" in table
    assert "Both under MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_TOP_PAD_=65536 (glibc)." in table
    if huge_pages:
        mode = report["hardware"]["transparent_huge_pages"]
        assert "Both under THP_MEM_ALLOC_ENABLE=1 (torch: with 1, CPU tensors of 2 MB or more on " in table
        assert f"the kernel's mode: {mode})." in table
    steal = [f"{r['machine_steal_seconds']:.1f}" for r in report["runs"]["recipe"]]
    assert "| CPU time the hypervisor took from this machine during the run, s |" in table
    assert f"per seed: recipe {' / '.join(steal)}, Trainer " in table


def test_stolen_cpu_time_is_read_from_proc_stat(script, tmp_path):
    """The `steal` column (the 8th figure of the first line) in seconds; None where a kernel has
    no such column or there is no /proc/stat."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  5548142 627299 1250668 4005015 19125 0 6487 27640 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert script.stolen_cpu_seconds(str(stat)) == pytest.approx(27640 / os.sysconf("SC_CLK_TCK"))
    stat.write_text("cpu  5548142 627299 1250668 4005015\n")  # Linux before 2.6.11
    assert script.stolen_cpu_seconds(str(stat)) is None
    assert script.stolen_cpu_seconds(str(tmp_path / "missing")) is None


def test_malloc_settings_are_checked_before_any_run(script, capsys, monkeypatch):
    """glibc ignores a misspelt MALLOC_ name silently: the script takes only the names glibc reads
    (some end in an underscore, some do not) and refuses a setting given twice, before an hour of
    runs under the wrong allocator."""
    base = ["--task", "glue", "--model_name_or_path", str(TINY_BERT)]
    args = script.parse_args(
        [*base, "--malloc_mmap_threshold", "131072", "--malloc_env", "MALLOC_TOP_PAD_=1024"]
    )
    assert args.allocator_env == {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TOP_PAD_": "1024"}
    assert script.parse_args(base).allocator_env == {}
    args = script.parse_args([*base, "--malloc_env", "MALLOC_ARENA_MAX=2 MALLOC_TRIM_THRESHOLD_=0"])
    assert args.allocator_env == {"MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "0"}
    with monkeypatch.context() as patch:  # what this machine's kernel says is not under test here
        patch.setattr(hardware, "transparent_huge_pages", lambda: "madvise")
        assert script.parse_args([*base, "--huge_pages"]).allocator_env == {"THP_MEM_ALLOC_ENABLE": "1"}
        patch.setattr(hardware, "transparent_huge_pages", lambda: "never")
        with pytest.raises(SystemExit):
            script.parse_args([*base, "--huge_pages"])  # an hour of runs that would change nothing
        assert "this one's are never" in capsys.readouterr().err
    # The report names what both sides inherit from the shell too; a flag overrides the shell.
    shell = {"MALLOC_ARENA_MAX": "4", "MALLOC_TOP_PAD_": "0", "THP_MEM_ALLOC_ENABLE": "0", "HOME": "/root"}
    assert script.allocator_settings({"MALLOC_TOP_PAD_": "1024"}, shell) == {
        "MALLOC_ARENA_MAX": "4",
        "MALLOC_TOP_PAD_": "1024",
        "THP_MEM_ALLOC_ENABLE": "0",
    }
    for settings, message in [
        ("MALLOC_TOP_PAD=1024", "with a NAME of MALLOC_ARENA_MAX, "),  # this one ends in an underscore
        ("MALLOC_TOP_PADD_=1024", "got 'MALLOC_TOP_PADD_=1024'"),
        ("MALLOC_TOP_PAD_=1G", "NAME=NUMBER"),
        ("TOP_PAD_=1024", "NAME=NUMBER"),
        ("MALLOC_MMAP_THRESHOLD_=1024", "given twice"),
    ]:
        with pytest.raises(SystemExit):
            script.parse_args([*base, "--malloc_mmap_threshold", "131072", "--malloc_env", settings])
        assert message in capsys.readouterr().err


@pytest.mark.skipif(not hardware.huge_pages_on(), reason="no transparent huge pages here")
def test_huge_pages_reach_torchs_cpu_allocator(script, tmp_path):
    """--huge_pages works through torch's THP_MEM_ALLOC_ENABLE: a process given the flag's
    environment madvises a 4 MiB tensor's memory for huge pages (the mapping's `hg` flag), one
    without does not. A torch that dropped the variable would fail here, not in an hour's run."""
    probe = (
        "import torch\n"
        "x = torch.ones(2**20)\n"  # 4 MiB: over torch's 2 MB threshold
        "start = x.data_ptr()\n"
        "lines = open('/proc/self/smaps').read().splitlines()\n"
        "inside = False\n"
        "for line in lines:\n"
        "    first = line.split()[0]\n"
        "    if '-' in first and not first.endswith(':'):\n"
        "        low, high = (int(part, 16) for part in first.split('-'))\n"
        "        inside = low <= start < high\n"
        "    elif inside and first == 'VmFlags:':\n"
        "        print(' '.join(line.split()[1:]))\n"
    )
    flags = {}
    for given in ([], ["--huge_pages"]):
        args = script.parse_args(["--task", "qa", "--model_name_or_path", str(TINY_BERT), *given])
        env = {"THP_MEM_ALLOC_ENABLE": "0", **args.allocator_env}  # "0": whatever the shell has
        done = run([sys.executable, "-c", probe], tmp_path, **env)
        assert done.returncode == 0, done.stderr[-2000:]
        flags[bool(given)] = done.stdout.split()
    assert "hg" in flags[True], flags
    assert "hg" not in flags[False], flags


def test_the_glue_and_ner_trainer_sides_train_and_score(script, tmp_path):
    """The two other Trainer sides, in this process: they train the given steps and score the
    validation split with the task's metric."""
    base = {
        "model_name_or_path": str(TINY_BERT),
        "max_seq_length": 64,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 16,
        "learning_rate": 1e-3,
        "weight_decay": 0.01,
        "warmup_ratio": 0.1,
        "max_grad_norm": 1.0,
        "num_train_epochs": 1,
        "seed": 3,
        "task_name": "mrpc",
        "data_dir": str(GLUE_DIR),
        "doc_stride": 16,
        "max_train_samples": 32,
        "max_eval_samples": 16,
    }
    glue = script.trainer_worker(
        {
            **base,
            "task": "glue",
            "train_file": None,
            "validation_file": None,
            "work_dir": str(tmp_path / "glue"),
        }
    )
    assert glue["train_steps"] == 4 and 0 <= glue["eval_accuracy"] <= 1 and "eval_f1" in glue
    files = {"train_file": str(CONLL / "train.txt"), "validation_file": str(CONLL / "valid.txt")}
    ner_spec = {
        **base,
        **files,
        "task": "ner",
        "ignore_mismatched_sizes": True,
    }  # the tiny model's head: 2 labels
    tagged = script.trainer_worker({**ner_spec, "work_dir": str(tmp_path / "ner")})
    assert tagged["train_steps"] == 4
    assert {"eval_f1", "eval_precision", "eval_recall", "eval_accuracy"} <= set(tagged)
    assert tagged["reported_peak_memory_bytes"] > 2**27


def test_the_glue_recipe_side_shuffles_as_the_trainer_does(script, tmp_path):
    """GLUE's recipe groups batches by length by default; the Trainer samples at random, so the
    recipe side is run with the plain shuffle: both sides do the same batches' work."""
    args = script.parse_args(["--task", "glue", "--model_name_or_path", str(TINY_BERT)])
    command = script.recipe_command(args, 1, tmp_path)
    recipe = load_module(REPO / "recipes" / "bert_glue.py", "bert_glue_for_compare_trainer")
    assert recipe.parse_args(command[2:]).group_by_length is False
