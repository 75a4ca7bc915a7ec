"""SQuAD exact match and F1 as an `evaluate` module shipped with the repository.

The Hub's `squad` and `squad_v2` metrics cannot be downloaded offline, so this file is loaded with
`evaluate.load(<this folder>, config_name)`: config `v1` (SQuAD v1.1, the default) or `v2`
(SQuAD 2.0). It follows the official evaluation scripts (`evaluate-v1.1.py`, `evaluate-v2.0.py`):
answers lower-cased, punctuation and the articles a/an/the removed, whitespace collapsed; exact
match and token-overlap F1 taken as the best over a question's reference answers and averaged
over the questions, in percent. v2: an unanswerable question's reference is "", and an empty
answer scores 1 against it and 0 against any real answer; the scores are also split into
questions with an answer (HasAns) and without (NoAns). Inputs and output keys are those of the
Hub's `squad` / `squad_v2` modules.
"""

import collections
import re
import string

import datasets
import evaluate

_DESCRIPTION = (
    "SQuAD v1.1 / v2.0 exact match and F1 with the official answer normalisation; v2 also per HasAns / NoAns."
)
_CITATION = """@inproceedings{rajpurkar-etal-2016-squad,
  title={{SQ}u{AD}: 100,000+ Questions for Machine Comprehension of Text},
  author={Rajpurkar, Pranav and Zhang, Jian and Lopyrev, Konstantin and Liang, Percy}, booktitle={EMNLP}, year={2016}}
@inproceedings{rajpurkar-etal-2018-know,
  title={Know What You Don{'}t Know: Unanswerable Questions for {SQ}u{AD}},
  author={Rajpurkar, Pranav and Jia, Robin and Liang, Percy}, booktitle={ACL}, year={2018}}"""
_KWARGS_DESCRIPTION = """
Args:
    predictions: [{"id": str, "prediction_text": str}] (v2 adds "no_answer_probability": float,
        any score that is higher the likelier the question has no answer; it is not used for the
        scores below, only carried for the official script's threshold search).
    references: [{"id": str, "answers": {"text": [str, ...], "answer_start": [int, ...]}}]; v2: empty
        lists for an unanswerable question.
Returns: v1 {"exact_match", "f1"}; v2 {"exact", "f1", "total", "HasAns_exact", "HasAns_f1",
    "HasAns_total", "NoAns_exact", "NoAns_f1", "NoAns_total"} (the splits only where such
    questions exist). Scores in percent.
"""
CONFIGS = ("v1", "v2")
ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, punctuation removed, articles removed, whitespace collapsed (the official order)."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def exact(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def f1(prediction: str, reference: str, empty_matches_empty: bool) -> float:
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if empty_matches_empty and (not predicted or not gold):  # v2: "no answer" is an answer
        return float(predicted == gold)
    same = sum((collections.Counter(predicted) & collections.Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold)
    return 2 * precision * recall / (precision + recall)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Squad(evaluate.Metric):
    def _info(self):
        name = "v1" if self.config_name == "default" else self.config_name
        if name not in CONFIGS:
            raise KeyError(f"Unknown SQuAD metric config {self.config_name!r}; expected one of {CONFIGS}.")
        prediction = {"id": datasets.Value("string"), "prediction_text": datasets.Value("string")}
        if name == "v2":
            prediction["no_answer_probability"] = datasets.Value("float32")
        answers = {"text": datasets.Value("string"), "answer_start": datasets.Value("int32")}
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": prediction,
                    "references": {"id": datasets.Value("string"), "answers": datasets.Sequence(answers)},
                }
            ),
        )

    def _compute(self, predictions, references):
        version_2 = self.config_name == "v2"
        predicted = {row["id"]: row["prediction_text"] for row in predictions}
        scores = {"HasAns": [], "NoAns": []}  # (exact, f1) per question
        for reference in references:
            if reference["id"] not in predicted:
                raise ValueError(f"no prediction for question {reference['id']!r}")
            prediction = predicted[reference["id"]]
            texts = list(reference["answers"]["text"])
            if version_2:  # the official v2 script drops answers that normalise to nothing
                texts = [text for text in texts if normalize_answer(text)]
            if not texts and not version_2:
                raise ValueError(
                    f"question {reference['id']!r} has no reference answer (SQuAD 2.0: config v2)"
                )
            split = "HasAns" if texts else "NoAns"
            texts = texts or [""]
            scores[split].append(
                (
                    max(exact(prediction, text) for text in texts),
                    max(f1(prediction, text, version_2) for text in texts),
                )
            )
        every = scores["HasAns"] + scores["NoAns"]
        if not every:
            raise ValueError("no questions to score")

        def percent(rows, column):
            return 100.0 * sum(row[column] for row in rows) / len(rows)

        if not version_2:
            return {"exact_match": percent(every, 0), "f1": percent(every, 1)}
        result = {"exact": percent(every, 0), "f1": percent(every, 1), "total": len(every)}
        for split, rows in scores.items():
            if rows:
                result.update(
                    {
                        f"{split}_exact": percent(rows, 0),
                        f"{split}_f1": percent(rows, 1),
                        f"{split}_total": len(rows),
                    }
                )
        return result
