"""recipes/bert_qa.py on the repository's SQuAD v1.1 sample: answers and scores that an
independent evaluation reproduces (questions spread over several windows), --eval_only and exact
resume, two processes on CPU, fp16 logits leaving autocast as float32, SQuAD 2.0's null answer."""

import collections
import json
import re
import string

import pytest
import torch
from conftest import (
    RECIPES,
    REPO,
    TINY_BERT,
    accelerate_launch,
    load_recipe,
    log_history,
    reset_accelerate,
    run,
    train,
)

SQUAD = REPO / "data" / "squad"
FILES = ["--train_file", SQUAD / "train.json", "--validation_file", SQUAD / "dev.json"]
WINDOW = {"max_seq_length": 64, "doc_stride": 16, "max_query_length": 24}


@pytest.fixture
def qa():
    yield load_recipe("bert_qa")
    reset_accelerate()


def tiny_run(output_dir, *extra):
    return [
        *FILES,
        *("--model_name_or_path", TINY_BERT, "--max_train_samples", 48, "--max_eval_samples", 30),
        *[value for name, size in WINDOW.items() for value in (f"--{name}", size)],
        *("--per_device_train_batch_size", 8, "--per_device_eval_batch_size", 8),
        *("--learning_rate", 1e-3, "--max_train_steps", 6, "--logging_steps", 1, "--seed", 3),
        *("--output_dir", output_dir, *extra),
    ]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("qa")
    results = train(load_recipe("bert_qa"), tiny_run(output_dir))
    reset_accelerate()
    return output_dir, results


# ----------------------------------------------------------------------------- an independent evaluation
def normalize(text):  # SQuAD's evaluate-v1.1.py, written out again
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def token_f1(prediction, truth):
    common = collections.Counter(normalize(prediction).split()) & collections.Counter(
        normalize(truth).split()
    )
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(normalize(prediction).split()), same / len(normalize(truth).split())
    return 2 * precision * recall / (precision + recall)


def independent_answers(
    model_dir, questions, max_seq_length, doc_stride, max_query_length, n_best=20, longest=30
):
    """Each question's windows through the saved model one at a time (no batching, no padding, no
    accelerate, no amp_recipes), the best start + end logit over the valid spans of all windows."""
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForQuestionAnswering.from_pretrained(model_dir).eval()
    answers = {}
    for row in questions:
        question = row["question"].lstrip()
        alone = tokenizer(question, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(alone) > max_query_length:
            question = question[: alone[max_query_length - 1][1]]
        encoded = tokenizer(
            question,
            row["context"],
            truncation="only_second",
            max_length=max_seq_length,
            stride=doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
        )
        best = (-float("inf"), "")
        for w in range(len(encoded["input_ids"])):
            inputs = {
                k: torch.tensor([encoded[k][w]]) for k in ("input_ids", "token_type_ids", "attention_mask")
            }
            with torch.inference_mode():
                out = model(**inputs)
            starts, ends = out.start_logits[0].tolist(), out.end_logits[0].tolist()
            context = [seq == 1 for seq in encoded.sequence_ids(w)]
            top_starts = sorted(range(len(starts)), key=lambda i: -starts[i])[:n_best]
            top_ends = sorted(range(len(ends)), key=lambda i: -ends[i])[:n_best]
            for i in top_starts:
                for j in top_ends:
                    if context[i] and context[j] and i <= j < i + longest and starts[i] + ends[j] > best[0]:
                        offsets = encoded["offset_mapping"][w]
                        best = (starts[i] + ends[j], row["context"][offsets[i][0] : offsets[j][1]])
        answers[row["id"]] = best[1]
    return answers


def squad_rows(path, limit):
    data = json.loads(path.read_text())["data"]
    rows = [
        {
            "id": qa["id"],
            "question": qa["question"],
            "context": p["context"],
            "answers": [a["text"] for a in qa["answers"]],
        }
        for article in data
        for p in article["paragraphs"]
        for qa in p["qas"]
    ]
    return rows[:limit]


def test_answers_and_scores_match_an_independent_evaluation(tiny_model):
    output_dir, results = tiny_model
    assert results["train_steps"] == 6 and results["eval_samples"] == 30
    assert results["eval_windows"] > 60  # at 64 tokens most questions span several windows
    questions = squad_rows(SQUAD / "dev.json", 30)
    expected = independent_answers(output_dir, questions, **WINDOW)
    predictions = json.loads((output_dir / "predictions.json").read_text())
    assert predictions == expected
    exact = (
        100
        * sum(max(normalize(expected[q["id"]]) == normalize(a) for a in q["answers"]) for q in questions)
        / 30
    )
    f1 = 100 * sum(max(token_f1(expected[q["id"]], a) for a in q["answers"]) for q in questions) / 30
    assert results["eval_exact_match"] == pytest.approx(exact) and results["eval_f1"] == pytest.approx(f1)
    assert f1 > 0  # the tiny model's answers overlap some references: the F1 compares something
    saved = json.loads((output_dir / "eval_results.json").read_text())
    assert saved["eval_f1"] == results["eval_f1"] and not saved["version_2_with_negative"]


def test_two_processes_gather_every_window_once(tiny_model, tmp_path):
    """The 30 questions' windows in batches of 8 on 2 processes: the last batch repeats windows to
    fill both, gather_for_metrics drops them, and the gathered rows stay in window order, so
    every question gets its own windows' logits: the same answers as one process. So does
    --do_predict's gathering of the test questions' windows."""
    model_dir, results = tiny_model
    assert results["eval_windows"] % 16 != 0  # the last batch is uneven
    questions = squad_rows(SQUAD / "dev.json", 40)[30:]
    rows = [{"id": q["id"], "question": q["question"], "context": q["context"]} for q in questions]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = [*tiny_run(tmp_path / "two"), "--model_name_or_path", model_dir, "--eval_only"]
    flags += ["--do_predict", "--test_file", tmp_path / "test.jsonl"]
    two = ["--multi_gpu", "--num_processes", 2, "--num_cpu_threads_per_process", 1]
    launched = run(accelerate_launch(*two, RECIPES / "bert_qa.py", *flags), tmp_path, ACCELERATE_USE_CPU="1")
    assert launched.returncode == 0, launched.stderr[-3000:]
    scores = json.loads((tmp_path / "two" / "eval_results.json").read_text())
    assert scores["num_processes"] == 2
    assert {k: v for k, v in scores.items() if k.startswith("eval_")} == {
        k: v for k, v in results.items() if k.startswith("eval_")
    }
    one = json.loads((model_dir / "predictions.json").read_text())
    assert json.loads((tmp_path / "two" / "predictions.json").read_text()) == one
    predicted = json.loads((tmp_path / "two" / "predict_predictions.json").read_text())
    assert predicted == independent_answers(model_dir, questions, **WINDOW)


def test_fp16_logits_leave_autocast_as_float32(qa, tmp_path, monkeypatch, caplog):
    """accelerate's real fp16 path (the CPU fixture): an overflow injected at step 2 skips that step
    and halves the loss scale; evaluation runs under fp16 autocast, and post-processing receives
    float32 logits."""
    from conftest import Fp16OnCpu, on_model_load
    from test_fp16_telemetry import OverflowInjector

    real_postprocess, seen = qa.qa.postprocess, []

    def inject(model):
        OverflowInjector(model, "bert.encoder.layer.1.output.dense", {2})
        model.qa_outputs.register_forward_hook(lambda module, args, output: seen.append(output.dtype))

    def recording(examples, windows, start_logits, end_logits, **settings):
        seen.append({row.dtype for row in start_logits + end_logits})
        return real_postprocess(examples, windows, start_logits, end_logits, **settings)

    on_model_load(monkeypatch, qa, "AutoModelForQuestionAnswering", inject)
    monkeypatch.setattr(qa.qa, "postprocess", recording)
    monkeypatch.setattr(qa, "Accelerator", Fp16OnCpu)
    caplog.set_level("INFO")
    argv = [
        *tiny_run(tmp_path),
        "--mixed_precision",
        "fp16",
        "--max_train_steps",
        4,
        "--fp16_init_scale",
        1024,
    ]
    results = train(qa, argv)
    assert results["precision_in_effect"] == "fp16" and results["skipped_steps"] == 1
    scales = [row["loss_scale"] for row in log_history(tmp_path) if "loss_scale" in row]
    assert scales == [1024.0, 512.0, 512.0, 512.0]
    assert "step 2: fp16 overflow, optimizer step skipped, loss scale 1024 -> 512" in caplog.text
    assert torch.float16 in seen  # the span head computed in fp16 under autocast
    import numpy as np

    assert seen[-1] == {np.dtype("float32")}  # and its logits reached post-processing as float32
    assert 0 <= results["eval_f1"] <= 100 and results["eval_samples"] == 30


def squad_2_file(tmp_path):
    """The dev sample as SQuAD 2.0: every third question asked of another article's paragraph,
    where it has no answer (is_impossible), the others as they are."""
    data = json.loads((SQUAD / "dev.json").read_text())["data"]
    paragraphs = [p for article in data for p in article["paragraphs"]]
    for n, paragraph in enumerate(paragraphs):
        foreign = paragraphs[(n + 7) % len(paragraphs)]
        for k, qa in enumerate(foreign["qas"][:2]):
            paragraph["qas"].append(
                {
                    "id": f"{qa['id']}-x{n}{k}",
                    "question": qa["question"],
                    "answers": [],
                    "is_impossible": True,
                }
            )
    path = tmp_path / "dev-v2.json"
    path.write_text(json.dumps({"version": "v2.0", "data": data}))
    return path


def test_squad_2_null_answers_and_threshold(qa, tiny_model, tmp_path):
    """--version_2_with_negative on a SQuAD 2.0 file: HasAns and NoAns counted apart, null_odds.json
    written, and the threshold decides: a huge one answers every question, a very low one none."""
    model_dir, _ = tiny_model
    dev = squad_2_file(tmp_path)
    base = [
        *tiny_run(tmp_path / "v2"),
        "--model_name_or_path",
        model_dir,
        "--eval_only",
        "--version_2_with_negative",
    ]
    base[base.index("--validation_file") + 1] = dev
    base[base.index("--max_eval_samples") + 1] = 40
    scores = {}
    for threshold in (1e6, 0.0, -1e6):
        results = train(qa, [*base, "--null_score_diff_threshold", threshold, "--overwrite_output_dir"])
        predictions = json.loads((tmp_path / "v2" / "predictions.json").read_text())
        null_odds = json.loads((tmp_path / "v2" / "null_odds.json").read_text())
        assert set(predictions) == set(null_odds) and len(predictions) == 40
        empty = {qid for qid, text in predictions.items() if text == ""}
        assert empty == {qid for qid, odds in null_odds.items() if odds > threshold}
        scores[threshold] = results
    has, no = scores[0.0]["eval_HasAns_total"], scores[0.0]["eval_NoAns_total"]
    assert has + no == 40 and has > 0 and no > 0
    assert scores[1e6]["eval_NoAns_exact"] == 0.0  # a span for every question
    assert scores[-1e6]["eval_NoAns_exact"] == 100.0 and scores[-1e6]["eval_HasAns_exact"] == 0.0
    assert scores[-1e6]["eval_exact"] == pytest.approx(100 * no / 40)


def test_do_predict_answers_the_test_files_questions_as_an_independent_evaluation_does(
    qa, tiny_model, tmp_path
):
    """--eval_only --do_predict on the saved model, the test questions as .jsonl rows without
    answers: predict_predictions.json holds, per id, the answer a plain loop over the saved model's
    windows finds; the validation's predictions.json is the evaluation's, apart."""
    model_dir, _ = tiny_model
    questions = squad_rows(SQUAD / "dev.json", 40)[30:]  # questions the evaluation did not see
    rows = [{"id": q["id"], "question": q["question"], "context": q["context"]} for q in questions]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = [*tiny_run(tmp_path / "p"), "--model_name_or_path", model_dir, "--eval_only"]
    results = train(qa, [*flags, "--do_predict", "--test_file", tmp_path / "test.jsonl"])
    assert results["predict_samples"] == 10 and results["predict_windows"] >= 10
    predicted = json.loads((tmp_path / "p" / "predict_predictions.json").read_text())
    assert predicted == independent_answers(model_dir, questions, **WINDOW)
    assert any(predicted.values())  # answers, not empty strings
    assert set(json.loads((tmp_path / "p" / "predictions.json").read_text())) == {
        q["id"] for q in squad_rows(SQUAD / "dev.json", 30)
    }
