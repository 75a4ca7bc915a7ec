"""Entity-level NER scores (seqeval) as an `evaluate` module shipped with the repository.

The Hub's `seqeval` metric cannot be downloaded offline, so this file is loaded with
`evaluate.load(<this folder>)`. It scores in seqeval's default mode, which follows CoNLL's
`conlleval` script: an entity starts at a B- tag or at an I- tag that does not continue an entity
of the same type, so IOB1 and IOB2 tags are read alike (strict mode would discard the
I-started entities of IOB1).
"""

import datasets
import evaluate
from seqeval.metrics import accuracy_score, classification_report

_DESCRIPTION = "Entity-level precision, recall and F1 (seqeval default mode = conlleval), overall and per entity type, plus token accuracy."
_CITATION = """@inproceedings{tjong-kim-sang-de-meulder-2003-introduction,
  title={Introduction to the {CoNLL}-2003 Shared Task: Language-Independent Named Entity Recognition},
  author={Tjong Kim Sang, Erik F. and De Meulder, Fien}, booktitle={CoNLL}, year={2003}}
@misc{seqeval, title={seqeval: A Python framework for sequence labeling evaluation},
  author={Hiroki Nakayama}, year={2018}, url={https://github.com/chakki-works/seqeval}}"""
_KWARGS_DESCRIPTION = """
Args:
    predictions: one list of tag names per sentence, e.g. [["B-PER", "I-PER", "O"]].
    references: the gold tags, same shapes.
Returns: {"precision", "recall", "f1", "accuracy"} (micro-averaged over entities; accuracy over
    words) and, per entity type X, "X_precision", "X_recall", "X_f1", "X_number" (gold entities).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Seqeval(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("string")),
                    "references": datasets.Sequence(datasets.Value("string")),
                }
            ),
        )

    def _compute(self, predictions, references):
        predictions, references = list(map(list, predictions)), list(map(list, references))
        for number, (predicted, gold) in enumerate(zip(predictions, references, strict=True), start=1):
            if len(predicted) != len(gold):
                raise ValueError(f"sentence {number}: {len(predicted)} predicted tags, {len(gold)} gold tags")
        report = classification_report(references, predictions, output_dict=True, zero_division=0)
        micro = report.pop("micro avg")
        scores = {
            "precision": float(micro["precision"]),
            "recall": float(micro["recall"]),
            "f1": float(micro["f1-score"]),
            "accuracy": float(accuracy_score(references, predictions)),
        }
        for kind, row in report.items():
            if not kind.endswith(" avg"):
                scores.update(
                    {
                        f"{kind}_precision": float(row["precision"]),
                        f"{kind}_recall": float(row["recall"]),
                        f"{kind}_f1": float(row["f1-score"]),
                        f"{kind}_number": int(row["support"]),
                    }
                )
        return scores
