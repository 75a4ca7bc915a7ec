"""The shipped GLUE metric module against values computed independently (numpy formulas, scipy ranks)."""

import numpy as np
import pytest
from scipy.stats import rankdata

from amp_recipes.tasks.metrics import load_metric

rng = np.random.default_rng(0)
REFS = rng.integers(0, 2, size=200)
PREDS = np.where(rng.random(200) < 0.8, REFS, 1 - REFS)


def confusion(preds, refs):
    tp = int(((preds == 1) & (refs == 1)).sum())
    tn = int(((preds == 0) & (refs == 0)).sum())
    fp = int(((preds == 1) & (refs == 0)).sum())
    fn = int(((preds == 0) & (refs == 1)).sum())
    return tp, tn, fp, fn


def test_mrpc_and_qqp_f1_and_accuracy():
    tp, tn, fp, fn = confusion(PREDS, REFS)
    expected = {"accuracy": (tp + tn) / len(REFS), "f1": 2 * tp / (2 * tp + fp + fn)}
    for task in ("mrpc", "qqp"):
        assert load_metric("glue", task).compute(predictions=PREDS, references=REFS) == pytest.approx(
            expected
        )


def test_cola_matthews():
    tp, tn, fp, fn = confusion(PREDS, REFS)
    mcc = (tp * tn - fp * fn) / np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert load_metric("glue", "cola").compute(predictions=PREDS, references=REFS) == pytest.approx(
        {"matthews_correlation": mcc}
    )


@pytest.mark.parametrize("task", ["sst2", "mnli", "qnli", "rte", "wnli"])
def test_accuracy_tasks(task):
    preds, refs = np.array([0, 1, 2, 2, 1]), np.array([0, 1, 1, 2, 0])
    assert load_metric("glue", task).compute(predictions=preds, references=refs) == {"accuracy": 0.6}


def test_stsb_pearson_and_spearman():
    refs = rng.random(50) * 5
    preds = refs + rng.normal(0, 1, 50)
    pearson = np.corrcoef(preds, refs)[0, 1]
    spearman = np.corrcoef(rankdata(preds), rankdata(refs))[0, 1]
    scores = load_metric("glue", "stsb").compute(predictions=preds, references=refs)
    assert scores == pytest.approx({"pearson": pearson, "spearmanr": spearman}, rel=1e-5)


def test_custom_classification_macro_f1():
    preds, refs = np.array([0, 0, 1, 2, 2, 2]), np.array([0, 1, 1, 2, 2, 0])
    # per class F1: class0 p=1/2 r=1/2 -> .5; class1 p=1 r=1/2 -> 2/3; class2 p=2/3 r=1 -> .8
    expected = {"accuracy": 4 / 6, "f1_macro": (0.5 + 2 / 3 + 0.8) / 3}
    assert load_metric("glue", "classification").compute(predictions=preds, references=refs) == pytest.approx(
        expected
    )


def test_batches_accumulate_like_one_call():
    metric = load_metric("glue", "mrpc")
    for start in range(0, 200, 64):
        metric.add_batch(predictions=PREDS[start : start + 64], references=REFS[start : start + 64])
    assert metric.compute() == pytest.approx(
        load_metric("glue", "mrpc").compute(predictions=PREDS, references=REFS)
    )
