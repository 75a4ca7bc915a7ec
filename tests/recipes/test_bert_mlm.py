"""recipes/bert_mlm.py: masked-LM training on real sentences, its held-out loss and perplexity,
checkpoints, bad input, and a saved model that bert_glue.py fine-tunes."""

import json
import math
import sys

import pytest
from conftest import GLUE_DIR, RECIPES, TINY_BERT, log_history, run, train
from families import glue_sentences


@pytest.fixture
def mlm(recipe):  # a fresh module per test, like `recipe`
    from conftest import load_recipe

    return load_recipe("bert_mlm")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    # 6000 sentences: about 75 steps an epoch at batch 16, seq 64 (the tests stay in epoch 1)
    (folder / "sst2.txt").write_text("\n".join(glue_sentences(6000)) + "\n\n")
    (folder / "sst2.csv").write_text(
        "id,body\n" + "".join(f'{i},"{s}"\n' for i, s in enumerate(glue_sentences(300)))
    )
    return folder


def test_masked_lm_loss_decreases_and_the_model_fine_tunes(mlm, recipe, corpus, tmp_path):
    argv = ["--train_file", corpus / "sst2.txt", "--model_name_or_path", TINY_BERT, "--max_seq_length", 64]
    argv += ["--per_device_train_batch_size", 16, "--learning_rate", 2e-3, "--max_train_steps", 60]
    argv += ["--eval_steps", 20, "--logging_steps", 10, "--output_dir", tmp_path / "mlm"]
    results = train(mlm, argv)
    evals = [row for row in log_history(tmp_path / "mlm") if "eval_loss" in row]
    assert [row["step"] for row in evals] == [20, 40, 60]  # every 20 steps; the epoch's end is one of them
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.5  # it learns the corpus
    assert results["eval_perplexity"] == pytest.approx(math.exp(results["eval_loss"]))
    assert results["eval_masked_tokens"] > 100 and results["precision_in_effect"] == "fp32"

    glue = [*("--task_name mrpc --max_train_samples 32 --max_eval_samples 16 --max_train_steps 2".split())]
    glue += [
        "--data_dir",
        GLUE_DIR,
        "--model_name_or_path",
        tmp_path / "mlm",
        "--output_dir",
        tmp_path / "glue",
    ]
    fine_tuned = train(recipe, glue)  # the adapted encoder, with a new classifier head
    assert fine_tuned["train_steps"] == 2 and "eval_accuracy" in fine_tuned


def test_evaluation_masks_are_fixed_with_dataloader_workers(mlm, corpus, tmp_path):
    """With DataLoader workers (the CUDA default is 2), masks drawn in the workers differed between
    two evaluations of the same weights; evaluation now masks in the main process, seeded."""
    argv = ["--train_file", corpus / "sst2.txt", "--model_name_or_path", TINY_BERT, "--max_seq_length", 32]
    argv += ["--per_device_train_batch_size", 16, "--max_train_steps", 4, "--eval_steps", 2]
    argv += ["--learning_rate", 0, "--dataloader_num_workers", 2, "--output_dir", tmp_path / "mlm"]
    train(mlm, argv)  # learning rate 0: the weights evaluated at steps 2 and 4 are the same
    evals = [row["eval_loss"] for row in log_history(tmp_path / "mlm") if "eval_loss" in row]
    assert len(evals) == 2 and evals[0] == evals[1]


def mlm_command(corpus):
    return [
        sys.executable,
        RECIPES / "bert_mlm.py",
        "--train_file",
        corpus / "sst2.csv",
        "--text_column",
        "body",
    ]


def test_csv_text_column_and_resume(corpus, tmp_path):
    base = mlm_command(corpus)
    base += ["--model_name_or_path", TINY_BERT, "--max_seq_length", 32, "--per_device_train_batch_size", 8]
    base += [
        "--max_train_steps",
        8,
        "--checkpointing_steps",
        4,
        "--logging_steps",
        1,
        "--output_dir",
        tmp_path,
    ]
    first = run(base, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run([*base, "--resume_from_checkpoint", str(tmp_path / "checkpoints" / "checkpoint-4")], tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Resumed from" in again.stderr and "at step 4" in again.stderr
    results = json.loads((tmp_path / "eval_results.json").read_text())
    assert results["train_steps"] == 8 and results["eval_masked_tokens"] > 0
