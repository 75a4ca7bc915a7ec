"""`amp-recipes ls/cp`, a copied recipe running outside the repository, and the docs'
"Make it your own" adaptations applied to copies and run."""

import json
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from conftest import REPO, TINY_BERT, run
from families import build_family

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


def test_the_docs_have_three_adaptations():
    assert list(documented_adaptations()) == ["Your own CSV data", "Another model family", "Another metric"]


@pytest.mark.parametrize("title", ["Your own CSV data", "Another model family", "Another metric"])
def test_adaptation_applies_to_a_copy_and_runs(tmp_path, title):
    assert sh([*CLI, "cp", "bert_glue", tmp_path / "my_task.py"], tmp_path).returncode == 0
    patched = subprocess.run(
        ["patch", "--fuzz=0", "--no-backup-if-mismatch", "my_task.py"],
        input=documented_adaptations()[title],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert patched.returncode == 0, patched.stdout + patched.stderr
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
