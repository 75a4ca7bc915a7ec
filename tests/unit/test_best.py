"""amp_recipes.training.run: which evaluation is best, when to stop early, and what a checkpoint keeps of it."""

import argparse
import math

import pytest

from amp_recipes.errors import InputError
from amp_recipes.training.run import BestModel


def settings(metric="accuracy", greater_is_better=None, patience=None):
    return argparse.Namespace(
        metric_for_best_model=metric, greater_is_better=greater_is_better, early_stopping_patience=patience
    )


@pytest.mark.parametrize(
    "metric, flag, greater",
    [
        ("accuracy", None, True),
        ("eval_f1", None, True),
        ("loss", None, False),  # the Trainer's rule
        ("perplexity", None, False),  # the masked LM's
        ("loss", "true", True),  # the flag wins
        ("accuracy", "false", False),
    ],
)
def test_the_direction_comes_from_the_name_unless_the_flag_says(metric, flag, greater):
    best = BestModel(settings(metric, flag))
    assert best.key == metric if metric.startswith("eval_") else best.key == f"eval_{metric}"
    assert best.greater_is_better is greater


def test_the_first_best_wins_ties_and_a_nonfinite_score_never_does():
    best = BestModel(settings(patience=2))
    assert best.update({"eval_accuracy": math.nan}, 1) is False  # not finite: never the best
    assert best.step is None and not best.stop
    assert best.update({"eval_accuracy": 0.5}, 2) is True
    assert best.update({"eval_accuracy": 0.5}, 3) is False  # a tie is no improvement
    assert best.update({"eval_accuracy": 0.75, "epoch": 1}, 4) is True
    assert (best.step, best.value, best.results) == (4, 0.75, {"eval_accuracy": 0.75, "epoch": 1})
    assert best.update({"eval_accuracy": 0.7}, 5) is False and not best.stop
    assert best.update({"eval_accuracy": math.inf}, 6) is False and best.stop  # 2 without improvement


def test_lower_is_better_for_a_loss():
    best = BestModel(settings("loss"))
    for step, loss in enumerate([3.0, 2.0, 2.5, 1.0, 1.5], start=1):
        best.update({"eval_loss": loss}, step)
    assert (best.step, best.value, best.evaluations_without_improvement) == (4, 1.0, 1)
    assert not best.stop  # no patience given: never stops


def test_a_checkpoints_state_continues_the_same_comparison():
    best = BestModel(settings(patience=3))
    best.update({"eval_accuracy": 0.8}, 10)
    best.checkpoint = "checkpoint-10"
    best.update({"eval_accuracy": 0.7}, 20)
    resumed = BestModel(settings(patience=3), best.state_dict())
    assert (
        resumed.summary(stopped_early=False)
        == best.summary(stopped_early=False)
        == {
            "metric_for_best_model": "eval_accuracy",
            "best_metric": 0.8,
            "best_step": 10,
            "best_model_checkpoint": "checkpoint-10",
            "stopped_early": False,
        }
    )
    assert resumed.update({"eval_accuracy": 0.8}, 30) is False
    assert resumed.update({"eval_accuracy": 0.79}, 40) is False and resumed.stop


def test_a_metric_the_evaluation_lacks_names_what_it_has():
    with pytest.raises(
        InputError, match=r"eval_acc is not a score of this evaluation; it has eval_accuracy\.$"
    ):
        BestModel(settings("acc")).update({"epoch": 1, "eval_accuracy": 0.5}, 1)


def test_a_checkpoints_best_by_another_metric_or_direction_is_not_continued():
    best = BestModel(settings("loss"))
    best.update({"eval_loss": 0.35}, 10)
    assert BestModel(settings("loss"), best.state_dict()).value == 0.35
    for other in (settings("accuracy"), settings("loss", greater_is_better="true")):
        fresh = BestModel(other, best.state_dict())
        assert fresh.restarted and fresh.value is None and fresh.step is None
