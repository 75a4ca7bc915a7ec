"""The best evaluation of a run: --metric_for_best_model, --load_best_model_at_end and
--early_stopping_patience, as the Trainer has them.

accelerate has no notion of a best checkpoint, and the Trainer's (`TrainerState.best_metric`,
`EarlyStoppingCallback`) lives inside the Trainer's loop, so the recipes keep their own: which
evaluation was best, at which step, in which checkpoint, and how many evaluations since then
brought no improvement. Its state goes into every checkpoint's record, so a resumed run goes on
comparing against the same best and counting the same patience.
"""

from __future__ import annotations

import math

from .errors import InputError

LOWER_IS_BETTER = ("loss", "perplexity")  # the Trainer's rule ("loss") and the masked LM's perplexity


def metric_key(name: str) -> str:
    """The eval_results.json key of --metric_for_best_model: `f1` and `eval_f1` both name `eval_f1`."""
    return name if name.startswith("eval_") else f"eval_{name}"


class BestModel:
    """Which evaluation so far was best by --metric_for_best_model, and whether to stop early."""

    def __init__(self, args, state: dict | None = None):
        self.key = metric_key(args.metric_for_best_model)
        if args.greater_is_better is None:
            self.greater_is_better = not any(word in self.key for word in LOWER_IS_BETTER)
        else:
            self.greater_is_better = args.greater_is_better == "true"
        self.patience = args.early_stopping_patience
        state = state or {}
        # A checkpoint's best ranked by another metric or direction is not this run's best.
        self.restarted = bool(state) and (state.get("key"), state.get("greater_is_better")) != (
            self.key,
            self.greater_is_better,
        )
        state = {} if self.restarted else state
        self.value, self.step = state.get("value"), state.get("step")
        self.results = state.get("results")  # the best evaluation's scores, as eval_results.json has them
        self.checkpoint = state.get("checkpoint")  # its checkpoint's folder name (--load_best_model_at_end)
        self.evaluations_without_improvement = state.get("evaluations_without_improvement", 0)

    def update(self, results: dict, step: int) -> bool:
        """Take an evaluation's scores; True when it is the best so far. A score that is not finite
        never is."""
        if self.key not in results:
            names = ", ".join(k for k in results if k.startswith("eval_"))
            raise InputError(
                f"--metric_for_best_model {self.key} is not a score of this evaluation; it has {names}."
            )
        value = results[self.key]
        if math.isfinite(value) and (self.value is None or self.beats(value)):
            self.value, self.step, self.results = value, step, dict(results)
            self.evaluations_without_improvement = 0
            return True
        self.evaluations_without_improvement += 1
        return False

    def beats(self, value: float) -> bool:
        """Whether `value` is better than the best so far (a tie is not)."""
        return value > self.value if self.greater_is_better else value < self.value

    @property
    def stop(self) -> bool:
        """--early_stopping_patience evaluations in a row without improvement."""
        return bool(self.patience) and self.evaluations_without_improvement >= self.patience

    def state_dict(self) -> dict:
        return {
            "key": self.key,
            "greater_is_better": self.greater_is_better,
            "value": self.value,
            "step": self.step,
            "results": self.results,
            "checkpoint": self.checkpoint,
            "evaluations_without_improvement": self.evaluations_without_improvement,
        }

    def summary(self, stopped_early: bool) -> dict:
        """For eval_results.json and the trackers: the metric, its best value and step, its
        checkpoint, and whether the patience ran out before the last scheduled step."""
        return {
            "metric_for_best_model": self.key,
            "best_metric": self.value,
            "best_step": self.step,
            "best_model_checkpoint": self.checkpoint,
            "stopped_early": stopped_early,
        }
