"""amp_recipes.training.hub: the model card's metadata as the Hub reads it, and the Hub token kept out of
sys.argv (the recipes run it through tests/recipes/test_bert_glue.py and every round-trip row)."""

import argparse
import sys

from huggingface_hub import ModelCard

from amp_recipes.training import hub


class BertForSequenceClassification:  # the card reads the head from the class name only
    pass


class BertForQuestionAnswering:
    pass


def flags(**overrides):
    values = dict(model_name_or_path="bert-base-uncased", output_dir="outputs/x", push_to_hub=False)
    values.update(train_file=None, task_name=None, dataset_name=None, hub_model_id=None, hub_token=None)
    return argparse.Namespace(**{**values, **overrides})


def card_of(tmp_path, model, args, summary, identity):
    hub.model_card(model, args, {"precision_in_effect": "bf16", **summary}, identity).save(
        tmp_path / "README.md"
    )
    return ModelCard.load(tmp_path / "README.md")


def test_mnli_scores_name_their_matched_and_mismatched_splits(tmp_path):
    summary = {"eval_accuracy": 0.84, "eval_accuracy_mm": 0.85, "eval_samples": 9815, "eval_samples_mm": 9832}
    card = card_of(
        tmp_path, BertForSequenceClassification(), flags(task_name="mnli"), summary, {"task_name": "mnli"}
    )
    results = {(r.metric_type, r.dataset_split): r.metric_value for r in card.data.eval_results}
    assert results == {("accuracy", "validation_matched"): 0.84, ("accuracy", "validation_mismatched"): 0.85}
    assert card.data.base_model == "bert-base-uncased" and card.data.datasets == ["nyu-mll/glue"]
    assert "bf16" in card.data.tags and card.data.pipeline_tag == "text-classification"


def test_counts_are_not_scores_and_your_own_data_gets_no_model_index(tmp_path):
    summary = {"eval_exact": 70.0, "eval_f1": 73.5, "eval_total": 100, "eval_HasAns_total": 50}
    summary.update(eval_NoAns_total=50, eval_windows=130, eval_masked_tokens=1234)
    squad = card_of(tmp_path, BertForQuestionAnswering(), flags(), summary, {"task_name": "squad_v2"})
    assert {r.metric_type for r in squad.data.eval_results} == {"exact", "f1"}
    assert squad.data.datasets == ["rajpurkar/squad_v2"]
    own = card_of(tmp_path, BertForSequenceClassification(), flags(train_file="data/train.csv"), summary, {})
    assert own.data.eval_results is None and own.data.datasets is None
    assert "| exact | 70 |" in own.text and "your data (train.csv)" in own.text


def test_a_model_of_your_own_is_loaded_back_with_safetensors(tmp_path):
    """A head of your own (an nn.Module): no transformers library tag, and the card loads its
    weights with safetensors, from the Hub repo it was pushed to or from the output folder."""

    class MeanPoolingClassifier:
        pass

    summary = {"eval_accuracy": 0.8}
    pushed = hub.model_card(MeanPoolingClassifier(), flags(), summary, {}, hub_repo="me/my-task")
    assert pushed.data.library_name is None
    assert 'load_model(model, hf_hub_download("me/my-task", "model.safetensors"))' in pushed.text
    local = hub.model_card(MeanPoolingClassifier(), flags(), summary, {})
    assert 'load_model(model, "outputs/x/model.safetensors")' in local.text and "pipeline" not in local.text


def test_the_token_leaves_sys_argv(monkeypatch):
    """W&B records sys.argv with each run and the card quotes it: the value is replaced there."""
    monkeypatch.setattr(sys, "argv", ["recipes/bert_glue.py", "--hub_token", "hf_abc", "--hub_token=hf_abc"])
    hub.hide_token(flags(hub_token="hf_abc"))
    assert sys.argv == ["recipes/bert_glue.py", "--hub_token", "<redacted>", "--hub_token=<redacted>"]
    assert "hf_abc" not in hub.command_line()
