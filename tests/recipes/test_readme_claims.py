"""Claims of the docs (docs/recipes/glue.md) about bert_glue.py's flags, each run through the recipe (in process, tiny BERT,
real MRPC rows): clipping and `--max_grad_norm 0`, `--eval_only` of a checkpoint, an fp16
checkpoint trained as float32, and `--preprocessing_num_workers` > 1."""

import json

import pytest
import torch
from conftest import TINY_BERT, glue_flags, log_history, train
from safetensors.torch import load_file

from amp_recipes.training import optim

TINY = dict(max_train_samples=48, logging_steps=1, seed=5, learning_rate=1e-3, activation_monitor_interval=0)


def test_max_grad_norm_clips_what_the_optimizer_sees_and_0_only_measures(recipe, tmp_path, monkeypatch):
    """The optimizer's step sees gradients of total norm --max_grad_norm when they were larger;
    with 0 it sees them as computed, and the logged grad_norm is the norm before clipping."""
    seen, make_optimizer = [], optim.make_optimizer

    def recording(model, args, device):
        optimizer = make_optimizer(model, args, device)

        def norm_at_step(optimizer, args, kwargs):
            grads = [
                p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None
            ]
            seen.append(
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
            )

        optimizer.register_step_pre_hook(norm_at_step)
        return optimizer

    monkeypatch.setattr(optim, "make_optimizer", recording)
    logged = {}
    for max_grad_norm in (0.05, 0):
        seen.clear()
        flags = glue_flags(
            **TINY, max_train_steps=3, max_grad_norm=max_grad_norm, output_dir=tmp_path / str(max_grad_norm)
        )
        train(recipe, flags)
        logged[max_grad_norm] = [
            row["grad_norm"] for row in log_history(tmp_path / str(max_grad_norm)) if "grad_norm" in row
        ]
        assert len(seen) == len(logged[max_grad_norm]) == 3
        if max_grad_norm:
            assert all(norm > 0.05 * 2 for norm in logged[max_grad_norm])  # so clipping had work to do
            assert seen == pytest.approx([0.05] * 3, rel=1e-4)
        else:
            assert seen == pytest.approx(logged[0], rel=1e-5)  # measured, not clipped
    assert logged[0.05][0] == pytest.approx(logged[0][0], rel=1e-5)  # the same first step, before clipping


def test_eval_only_of_a_checkpoint_scores_its_weights(recipe, tmp_path, monkeypatch):
    """--eval_only --resume_from_checkpoint <checkpoint-3> evaluates checkpoint-3's weights (not the
    pretrained ones, not the final ones), in another output folder, without training, and
    scores what the training run logged at step 3."""
    trained = tmp_path / "trained"
    train(
        recipe, glue_flags(**TINY, max_train_steps=6, eval_steps=3, checkpointing_steps=3, output_dir=trained)
    )
    at_3 = next(row for row in log_history(trained) if row["step"] == 3 and "eval_accuracy" in row)
    evaluated, real_evaluate = [], recipe.evaluate

    def recording(model, *args):
        evaluated.append({k: v.clone() for k, v in model.state_dict().items()})
        return real_evaluate(model, *args)

    monkeypatch.setattr(recipe, "evaluate", recording)
    checkpoint = trained / "checkpoints" / "checkpoint-3"
    flags = glue_flags(
        **TINY, eval_only=True, resume_from_checkpoint=checkpoint, output_dir=tmp_path / "evaluated"
    )
    results = train(recipe, flags)
    (weights,) = evaluated
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert all(torch.equal(weights[name], saved[name]) for name in saved)
    final = load_file(str(trained / "model.safetensors"))
    assert not torch.equal(weights["classifier.weight"], final["classifier.weight"])  # the test can tell
    pretrained = load_file(str(TINY_BERT / "model.safetensors"))
    assert not torch.equal(weights["classifier.weight"], pretrained["classifier.weight"])
    assert {k: v for k, v in results.items() if k in at_3 and k != "step"} == {
        k: v for k, v in at_3.items() if k != "step"
    }
    assert "train_steps" not in results and not (tmp_path / "evaluated" / "model.safetensors").exists()


def test_a_checkpoint_saved_in_fp16_is_trained_and_saved_as_float32(recipe, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    half = tmp_path / "half"
    AutoModelForSequenceClassification.from_pretrained(TINY_BERT).half().save_pretrained(half)
    AutoTokenizer.from_pretrained(TINY_BERT).save_pretrained(half)
    assert {t.dtype for t in load_file(str(half / "model.safetensors")).values()} == {torch.float16}
    results = train(
        recipe, glue_flags(**TINY, max_train_steps=2, model_name_or_path=half, output_dir=tmp_path / "out")
    )
    assert results["train_steps"] == 2
    assert {t.dtype for t in load_file(str(tmp_path / "out" / "model.safetensors")).values()} == {
        torch.float32
    }


def test_preprocessing_workers_tokenise_the_same_batches(recipe, tmp_path):
    """--preprocessing_num_workers 2 (datasets' num_proc): the same rows in the same order, so
    the same losses bit for bit as one process."""
    runs = {}
    for workers in (None, 2):
        out = tmp_path / f"workers-{workers}"
        flags = glue_flags(**TINY, max_train_steps=3, preprocessing_num_workers=workers, output_dir=out)
        train(recipe, flags)
        runs[workers] = [row["loss"] for row in log_history(out) if "loss" in row]
    assert len(runs[None]) == 3 and runs[2] == runs[None]
    config = json.loads((tmp_path / "workers-2" / "eval_results.json").read_text())
    assert config["train_steps"] == 3


def test_unset_flag_lets_accelerate_launch_decide_and_report_to_all_feeds_both_trackers(tmp_path):
    """`accelerate launch --mixed_precision bf16` with no --mixed_precision for the recipe: bf16
    autocast runs (the launcher decided, and the run says so); --report_to all writes the W&B
    offline run and the TensorBoard events. The recipe's own flag overrides the launcher's."""
    from conftest import RECIPES, accelerate_launch, load_recipe, run, train
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_offline import offline_run

    flags = glue_flags(**TINY, max_train_steps=2, report_to="all", output_dir=tmp_path / "launcher")
    launch = ["--num_processes", 1, "--cpu", "--mixed_precision", "bf16"]
    result = run(accelerate_launch(*launch, RECIPES / "bert_glue.py", *flags), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "launcher" / "eval_results.json").read_text())
    assert results["mixed_precision_requested"] == "bf16" and results["precision_in_effect"] == "bf16"
    assert results["mixed_precision_source"] == "accelerate launch / config file (ACCELERATE_MIXED_PRECISION)"
    _, config, history = offline_run(tmp_path)
    assert config["precision_in_effect"] == "bf16"
    losses = [(row["_step"], row["loss"]) for row in history if "loss" in row]
    events = EventAccumulator(str(tmp_path / "launcher" / "amp-recipes"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (s, pytest.approx(v, rel=1e-6)) for s, v in losses
    ]
    assert len(losses) == 2

    # The recipe's own flag against the launcher's choice, in this process: the environment
    # variable `accelerate launch --mixed_precision bf16` hands its processes.
    flags = glue_flags(**TINY, max_train_steps=1, mixed_precision="no", output_dir=tmp_path / "flag")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
        train(load_recipe("bert_glue"), flags)
    results = json.loads((tmp_path / "flag" / "eval_results.json").read_text())
    assert results["precision_in_effect"] == "fp32"
    assert (
        results["mixed_precision_source"]
        == "--mixed_precision flag (no; overrides accelerate launch/config's bf16)"
    )


def test_mnli_reports_matched_and_mismatched_accuracy(recipe, tmp_path):
    """docs/recipes/glue.md: MNLI's mismatched dev accuracy is `eval_accuracy_mm`. Both are checked against the
    saved model's own predictions on each dev file, computed here with plain transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    header = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse"]
    header += ["sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]
    labels = ["entailment", "neutral", "contradiction"]
    words = "the a cat dog sat ran on under mat hill red blue".split()

    def write(name, count, offset, golds):
        rows = []
        for n in range(count):
            premise = " ".join(words[(n * 5 + k + offset) % len(words)] for k in range(6))
            hypothesis = " ".join(words[(n * 3 + k + offset) % len(words)] for k in range(4))
            gold = labels[golds(n)]
            extra = [gold] * (2 if name == "train.tsv" else 6)  # label1 (.. label5), gold_label
            rows.append([n, n, f"{n}e", "fiction", "(", "(", "(S", "(S", premise, hypothesis, *extra])
        head = header + (
            ["label1", "gold_label"]
            if name == "train.tsv"
            else [f"label{i}" for i in range(1, 6)] + ["gold_label"]
        )
        path = tmp_path / "MNLI" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join("\t".join(map(str, r)) for r in [head, *rows]) + "\n")
        return rows

    write("train.tsv", 48, 0, lambda n: n % 3)
    dev = {
        "validation_matched": write("dev_matched.tsv", 10, 1, lambda n: n % 3),
        "validation_mismatched": write("dev_mismatched.tsv", 7, 2, lambda n: (n * n) % 3),
    }
    output_dir = tmp_path / "out"
    flags = glue_flags(**TINY, task_name="mnli", data_dir=tmp_path, max_eval_samples=None, max_train_steps=4)
    flags += ["--ignore_mismatched_sizes"]  # the tiny BERT has a 2-label head; MNLI has 3 labels
    results = train(recipe, [*flags, "--output_dir", output_dir, "--mixed_precision", "no"])

    model = AutoModelForSequenceClassification.from_pretrained(output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    accuracy = {}
    for split, rows in dev.items():
        correct = 0
        for row in rows:
            with torch.no_grad():
                logits = model(**tokenizer(row[8], row[9], return_tensors="pt")).logits
            correct += model.config.id2label[int(logits.argmax())] == row[-1]
        accuracy[split] = correct / len(rows)
    assert results["eval_accuracy"] == pytest.approx(accuracy["validation_matched"])
    assert results["eval_accuracy_mm"] == pytest.approx(accuracy["validation_mismatched"])
    assert results["eval_samples"] == 10 and results["eval_samples_mm"] == 7
