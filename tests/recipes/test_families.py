"""Every recipe end to end on a tiny random model of each BERT-like family: a few fp32 steps,
finite losses, and a saved model that loads again."""

import math

import pytest
import torch
from conftest import GLUE_DIR, REPO, load_recipe, log_history, reset_accelerate, train
from families import FAMILIES, build_family
from transformers import (
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

RECIPES = {
    "bert_glue": AutoModelForSequenceClassification,
    "bert_mlm": AutoModelForMaskedLM,
    "bert_ner": AutoModelForTokenClassification,
    "bert_qa": AutoModelForQuestionAnswering,
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: build_family(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from families import glue_sentences

    path = tmp_path_factory.mktemp("corpus") / "sst2.txt"
    path.write_text("\n".join(glue_sentences(400)) + "\n")
    return path


@pytest.fixture(scope="module")
def recipes():
    yield {name: load_recipe(name) for name in RECIPES}
    reset_accelerate()


def arguments(recipe, model_dir, corpus, output_dir):
    common = [
        "--model_name_or_path",
        model_dir,
        "--output_dir",
        output_dir,
        "--logging_steps",
        1,
        "--seed",
        1,
    ]
    common += ["--max_train_steps", 3, "--per_device_train_batch_size", 8, "--learning_rate", 1e-3]
    if recipe == "bert_glue":
        return [
            *common,
            "--task_name",
            "mrpc",
            "--data_dir",
            GLUE_DIR,
            "--max_train_samples",
            32,
            "--max_eval_samples",
            16,
        ]
    if recipe == "bert_ner":
        conll = REPO / "data" / "conll2003"
        return [
            *common,
            *("--train_file", conll / "train.txt", "--validation_file", conll / "valid.txt"),
            *("--max_train_samples", 32, "--max_eval_samples", 16, "--max_seq_length", 32),
        ]
    if recipe == "bert_qa":
        squad = REPO / "data" / "squad"
        return [
            *common,
            *("--train_file", squad / "train.json", "--validation_file", squad / "dev.json"),
            *("--max_train_samples", 16, "--max_eval_samples", 8, "--max_seq_length", 64),
            *("--doc_stride", 16, "--max_query_length", 24),
        ]
    return [*common, "--train_file", corpus, "--max_seq_length", 32]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_recipe_runs_on_family(recipes, family_dirs, corpus, tmp_path, family, recipe):
    results = train(recipes[recipe], arguments(recipe, family_dirs[family], corpus, tmp_path))
    losses = [row["loss"] for row in log_history(tmp_path) if "loss" in row]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert results["train_steps"] == 3
    model = RECIPES[recipe].from_pretrained(tmp_path)  # saved and reloadable
    assert model.config.model_type == family
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    with torch.inference_mode():
        output = model(**tokenizer(["a fine film", "dull"], padding=True, return_tensors="pt"))
    logits = output.start_logits if recipe == "bert_qa" else output.logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bert_glue_runs_on_family_under_bf16(recipes, family_dirs, corpus, tmp_path, family):
    """bf16 autocast (real on a CPU too): every family's forward and backward stay finite, and
    the saved weights are float32 (the master copy, not the autocast casts)."""
    argv = [*arguments("bert_glue", family_dirs[family], corpus, tmp_path), "--mixed_precision", "bf16"]
    results = train(recipes["bert_glue"], argv)
    assert results["precision_in_effect"] == "bf16" and results["train_steps"] == 3
    losses = [row["loss"] for row in log_history(tmp_path) if "loss" in row]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    model = RECIPES["bert_glue"].from_pretrained(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
