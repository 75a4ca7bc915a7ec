"""GLUE metrics as an `evaluate` module shipped with the repository.

The Hub's `glue` metric cannot be downloaded offline, so this file is loaded
with `evaluate.load(<this folder>, config_name)`. Besides the nine GLUE task
names it accepts `classification` (accuracy + macro F1) and `regression`
(Pearson + Spearman) for a user's own data.
"""

import datasets
import evaluate
import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

_DESCRIPTION = "Official GLUE metrics: Matthews correlation (CoLA), F1 + accuracy (MRPC, QQP), Pearson + Spearman (STS-B), accuracy (the rest)."
_CITATION = """@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={ICLR}, year={2019}}"""
_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted labels (ints), or scores (floats) for stsb/regression.
    references: gold labels (ints), or scores (floats) for stsb/regression.
Returns: a dict with the task's metrics, e.g. {"accuracy": 0.84, "f1": 0.88} for mrpc.
"""

ACCURACY_TASKS = {"sst2", "mnli", "qnli", "rte", "wnli"}
REGRESSION_CONFIGS = {"stsb", "regression"}
CONFIGS = ACCURACY_TASKS | REGRESSION_CONFIGS | {"cola", "mrpc", "qqp", "classification"}


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name not in CONFIGS:
            raise KeyError(
                f"Unknown GLUE metric config {self.config_name!r}; expected one of {sorted(CONFIGS)}."
            )
        value_type = "float32" if self.config_name in REGRESSION_CONFIGS else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value(value_type), "references": datasets.Value(value_type)}
            ),
            format="numpy",
        )

    def _compute(self, predictions, references):
        # evaluate < 0.4.6 under datasets 5 hands over datasets' Column objects, not arrays.
        predictions, references = np.asarray(predictions), np.asarray(references)
        name = self.config_name
        if name in REGRESSION_CONFIGS:
            return {
                "pearson": float(pearsonr(predictions, references)[0]),
                "spearmanr": float(spearmanr(predictions, references)[0]),
            }
        accuracy = float((predictions == references).mean())
        if name == "cola":
            return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}
        if name in ("mrpc", "qqp"):
            return {"accuracy": accuracy, "f1": float(f1_score(references, predictions))}
        if name == "classification":
            return {
                "accuracy": accuracy,
                "f1_macro": float(f1_score(references, predictions, average="macro")),
            }
        return {"accuracy": accuracy}
