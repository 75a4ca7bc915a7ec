"""`amp-recipes ls/cp`, a copied recipe running outside the repository, and the docs'
"Make it your own" adaptations applied to copies and run."""

import importlib.util
import json
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from conftest import REPO, TINY_BERT, run, train
from families import build_family

pytestmark = pytest.mark.heavy  # copies of recipes run in processes of their own: CI's heavy lane (.ci/run)

CLI = [sys.executable, "-m", "amp_recipes.cli"]


def sh(command, cwd, **env):
    return run(command, cwd, cwd=cwd, **env)  # in the temporary folder, outside the repository


def test_ls_lists_every_recipe_with_what_it_does_and_its_command(tmp_path):
    listing = sh([*CLI, "ls"], tmp_path)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0].startswith("# full recipes: accelerate runs AMP")
    assert lines[1].startswith("bert_glue") and "GLUE task" in lines[1]
    assert lines[2].strip().startswith("accelerate launch recipes/bert_glue.py")
    assert lines[3].startswith("bert_mlm") and "masked-language-model" in lines[3]
    assert lines[4].strip().startswith("accelerate launch recipes/bert_mlm.py")
    assert lines[5].startswith("bert_ner") and "named-entity recognition" in lines[5]
    assert lines[6].strip().startswith("accelerate launch recipes/bert_ner.py")
    assert lines[7].startswith("bert_qa") and "extractive question answering" in lines[7]
    assert lines[8].strip().startswith("accelerate launch recipes/bert_qa.py")
    assert lines[9].startswith("# minimal tier: one device, plain PyTorch")
    assert lines[10].startswith("minimal/bert_glue") and "textbook mixed-precision loop" in lines[10]
    assert lines[11].strip().startswith("python recipes/minimal/bert_glue.py")
    assert len(lines) == 12
    # The installed console script (requirements.txt installs the package) gives the same listing.
    (entry,) = [e for e in entry_points(group="console_scripts") if e.name == "amp-recipes"]
    assert entry.value == "amp_recipes.cli:command"
    console = Path(sys.executable).parent / "amp-recipes"
    assert sh([console, "ls"], tmp_path).stdout == listing.stdout


def test_cp_copies_refuses_to_overwrite_and_says_what_to_run(tmp_path):
    target = tmp_path / "jobs" / "my_task.py"
    copied = sh([*CLI, "cp", "bert_glue", target], tmp_path)
    assert copied.returncode == 0, copied.stderr
    assert target.read_text() == (REPO / "recipes" / "bert_glue.py").read_text()
    assert f"accelerate launch {target} --task_name mrpc --mixed_precision fp16" in copied.stdout
    target.write_text("# my edits\n")
    refused = sh([*CLI, "cp", "bert_glue", target], tmp_path)
    assert refused.returncode == 1 and "exists; pass --force to overwrite it" in refused.stderr
    assert target.read_text() == "# my edits\n"
    assert sh([*CLI, "cp", "bert_glue", target, "--force"], tmp_path).returncode == 0
    assert target.read_text().startswith('"""Fine-tune')
    into_folder = sh([*CLI, "cp", "bert_mlm.py", tmp_path], tmp_path)
    assert into_folder.returncode == 0 and (tmp_path / "bert_mlm.py").is_file()
    minimal = sh([*CLI, "cp", "minimal/bert_glue", tmp_path], tmp_path)  # the minimal tier, into a folder
    assert minimal.returncode == 0, minimal.stderr
    assert (tmp_path / "bert_glue.py").read_text() == (
        REPO / "recipes" / "minimal" / "bert_glue.py"
    ).read_text()
    assert f"python {tmp_path / 'bert_glue.py'} --task_name mrpc --mixed_precision fp16" in minimal.stdout
    unknown = sh([*CLI, "cp", "gpt_pretrain", target], tmp_path)
    assert unknown.returncode == 2 and (
        "no recipe 'gpt_pretrain'; choose from bert_glue, bert_mlm, bert_ner, bert_qa, minimal/bert_glue"
        in unknown.stderr
    )


def small_csvs(folder):
    rows = ["great film, loved it", "terrible and dull", "a joy to watch", "boring plot", "wonderful acting"]
    for name in ("reviews_train.csv", "reviews_dev.csv"):
        lines = ["review,stars"] + [
            f'"{text}",{"good" if i % 2 == 0 else "bad"}' for i, text in enumerate(rows * 4)
        ]
        (folder / name).write_text("\n".join(lines) + "\n")


def test_a_copied_recipe_runs_outside_the_repository_under_its_own_name(tmp_path):
    """`amp-recipes cp`, then the copy renamed throughout (`sed s/bert_glue/my_task/g`): it runs from
    another folder with nothing of the checkout on the path, with every flag, the no_trainer
    example's --with_tracking included (its trackers under the example's project name)."""
    assert sh([*CLI, "cp", "bert_glue", tmp_path / "my_task.py"], tmp_path).returncode == 0
    copy = tmp_path / "my_task.py"
    copy.write_text(copy.read_text().replace("bert_glue", "my_task"))
    small_csvs(tmp_path)
    argv = [
        sys.executable,
        "my_task.py",
        "--train_file",
        "reviews_train.csv",
        "--validation_file",
        "reviews_dev.csv",
    ]
    argv += ["--text_columns", "review", "--label_column", "stars", "--model_name_or_path", TINY_BERT]
    argv += ["--max_train_steps", 2, "--per_device_train_batch_size", 4, "--output_dir", "out"]
    argv += ["--with_tracking", "--report_to", "tensorboard"]
    done = sh(argv, tmp_path, PYTHONPATH="")  # nothing from the checkout on the path
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert results["train_steps"] == 2 and results["eval_samples"] == 20
    all_results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert all_results["eval_accuracy"] == results["eval_accuracy"]
    assert any((tmp_path / "out" / "glue_no_trainer").rglob("events.out.tfevents*"))


# ----------------------------------------------------------------------------- "Make it your own"
def documented_adaptations() -> dict[str, str]:
    """{title: unified diff} of the worked adaptations in docs/customize.md ("Make it your own")."""
    page = (REPO / "docs" / "customize.md").read_text()
    found = re.findall(r"^## (.+?)\n.*?```diff\n(.*?)```", page, re.S | re.M)
    return {title.strip(): diff for title, diff in found}


def test_the_docs_have_four_adaptations():
    assert list(documented_adaptations()) == [
        "Your own CSV data",
        "Another model family",
        "Another metric",
        "A head of your own",
    ]


def patched_copy(folder: Path, title: str) -> Path:
    """`amp-recipes cp bert_glue my_task.py` in `folder`, with the docs' adaptation `title` applied
    exactly (`patch --fuzz=0`: every line of context as it is in the recipe)."""
    assert sh([*CLI, "cp", "bert_glue", folder / "my_task.py"], folder).returncode == 0
    patched = subprocess.run(
        ["patch", "--fuzz=0", "--no-backup-if-mismatch", "my_task.py"],
        input=documented_adaptations()[title],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert patched.returncode == 0, patched.stdout + patched.stderr
    return folder / "my_task.py"


@pytest.mark.parametrize("title", ["Your own CSV data", "Another model family", "Another metric"])
def test_adaptation_applies_to_a_copy_and_runs(tmp_path, title):
    patched_copy(tmp_path, title)
    small_csvs(tmp_path)
    argv = [sys.executable, "my_task.py", "--max_train_steps", 2, "--per_device_train_batch_size", 4]
    argv += ["--output_dir", "out"]
    if title == "Another model family":  # the diff's Hub checkpoint cannot be fetched here: a tiny one
        argv += ["--model_name_or_path", build_family("roberta", tmp_path / "tiny-roberta")]
    else:
        argv += ["--model_name_or_path", TINY_BERT]
    if title != "Your own CSV data":
        argv += ["--train_file", "reviews_train.csv", "--validation_file", "reviews_dev.csv"]
        argv += ["--text_columns", "review", "--label_column", "stars"]
    done = sh(argv, tmp_path, PYTHONPATH="")
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    if title == "Another metric":
        assert 0 <= results["eval_macro_f1"] <= 1 and "eval_accuracy" not in results
    if title == "Another model family":
        assert results["model_type"] == "roberta"
    assert results["train_steps"] == 2


def test_a_copy_with_a_head_of_its_own_trains_checkpoints_resumes_and_its_weights_load_back(tmp_path):
    """The docs' "A head of your own" on a copy outside the repository: a plain nn.Module (no
    config, no save_pretrained) trains, checkpoints, resumes to the same weights as the run it
    resumes, and saves model.safetensors, which safetensors' load_model puts into a new model that
    scores on the dev set what the run reported."""
    from accelerate import Accelerator
    from safetensors.torch import load_file, load_model
    from transformers import AutoConfig, AutoTokenizer

    from amp_recipes.tasks import metrics

    copy = patched_copy(tmp_path, "A head of your own")
    small_csvs(tmp_path)
    data = ["--train_file", "reviews_train.csv", "--validation_file", "reviews_dev.csv"]
    data += ["--text_columns", "review", "--label_column", "stars", "--model_name_or_path", str(TINY_BERT)]
    argv = [sys.executable, "my_task.py", *data, "--max_train_steps", 4, "--checkpointing_steps", 2]
    argv += ["--per_device_train_batch_size", 4, "--learning_rate", "1e-3", "--seed", 3]
    done = sh([*argv, "--output_dir", "whole"], tmp_path, PYTHONPATH="")
    assert done.returncode == 0, done.stderr[-2000:]
    whole = tmp_path / "whole"
    results = json.loads((whole / "eval_results.json").read_text())
    assert results["model_type"] == "MeanPoolingClassifier" and results["train_steps"] == 4
    assert sorted(p.name for p in (whole / "checkpoints").iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-4",
    ]
    assert not (whole / "config.json").exists()  # weights only: the class is the copy's own
    assert 'load_model(model, "whole/model.safetensors")' in (whole / "README.md").read_text()

    resumed = [*argv, "--output_dir", "resumed", "--resume_from_checkpoint", "whole/checkpoints/checkpoint-2"]
    done = sh(resumed, tmp_path, PYTHONPATH="")
    assert done.returncode == 0, done.stderr[-2000:]
    weights, again = (
        load_file(whole / "model.safetensors"),
        load_file(tmp_path / "resumed" / "model.safetensors"),
    )
    assert weights.keys() == again.keys() and all(weights[k].equal(again[k]) for k in weights)
    pretrained = load_file(TINY_BERT / "model.safetensors")["bert.embeddings.word_embeddings.weight"]
    assert not weights["encoder.embeddings.word_embeddings.weight"].equal(pretrained)  # the encoder trained

    # The user's way back: the copy builds its model, load_model puts the weights in, its evaluate() scores.
    spec = importlib.util.spec_from_file_location("my_task", copy)
    my_task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(my_task)
    args = my_task.parse_args([*data, "--output_dir", str(tmp_path / "unused")])
    accelerator = Accelerator(cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(TINY_BERT)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        task, _, eval_loaders, _ = my_task.load_data(args, tokenizer, accelerator)
    model = my_task.load_model(args, AutoConfig.from_pretrained(TINY_BERT), task)
    load_model(model, whole / "model.safetensors")
    metric = metrics.load_metric("glue", task.metric_config)
    scores = my_task.evaluate(model, eval_loaders, metric, accelerator, task.is_regression)
    assert scores["eval_samples"] == 20 and "eval_accuracy" in scores
    assert scores == {key: results[key] for key in scores}

    # The docs' way to evaluate it with the recipe: the base model and the last checkpoint.
    last = whole / "checkpoints" / "checkpoint-4"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        again = train(
            my_task,
            [*data, "--seed", 3, "--eval_only", "--resume_from_checkpoint", last, "--output_dir", "eval"],
        )
    assert {key: again[key] for key in scores} == scores
