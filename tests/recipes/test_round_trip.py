"""Round trip, read back as a user does: every recipe under every precision and engine it supports
on this CPU finishes, its final model reloads with the recipe's Auto class holding exactly the
saved tensors, a fresh `--eval_only` of that model reproduces eval_results.json's scores, and every
trainable weight moved.

Modes: fp32; bf16; fp8 (torchao emulated, the product's own Float8LinearConfig with emulate=True);
fp16 (accelerate's real fp16 path through conftest's Fp16OnCpu); --torch_compile;
--gradient_checkpointing; --load_best_model_at_end (every step evaluated: the final model and its
scores are the first best evaluation's); two DDP processes over gloo; and both. torch.compile uses dynamo's `eager` backend: accelerate's regional compilation,
its wrappers and the save path are the same as with inductor, whose C++ code generation would cost
about 30 s a run on two cores.

The engines users scale to run here on two CPU processes over gloo, through `accelerate launch`
with the repository's own configs (accelerate_configs/fsdp.yaml, deepspeed_zero2.yaml,
deepspeed_zero3.yaml): FSDP2 in fp32, bf16, fp8 and with --torch_compile, DeepSpeed ZeRO-2 and
ZeRO-3. What a CPU cannot do is overridden, and only that (conftest.engine_launch, engine_env);
accelerate's GPU-only gate is lifted by tests/cpu_engines (test_engines.py holds it to that gate).
The engine rows of RESUMED also resume their mid-run checkpoint to the uninterrupted run's final
weights, bit for bit. The masked LM does not run under FSDP2 (FSDP2_MLM_REFUSAL): its rows check the
refusal. FSDP1 does not run on a CPU: torch's FullyShardedDataParallel refuses
`sync_module_states=True` there (docs/scaling-out.md).

Each defect this matrix was written against fails it: fp8 weights left out of the optimizer
(frozen), `_orig_mod.` names in the saved model (from_pretrained starts from random weights), a
crash at start-up under DDP + torch.compile, `optimizer.defaults` read from DeepSpeed's optimizer
(which has none), 16-bit weights saved from ZeRO's module copies instead of the fp32 masters, and a
DeepSpeed checkpoint (which holds a `latest` file of its own) taken for a checkpoints folder."""

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from conftest import (
    FP8_EMULATION,
    REPO,
    TINY_BERT,
    Fp16OnCpu,
    accelerate_launch,
    assert_same_training,
    engine_env,
    engine_launch,
    glue_flags,
    history,
    load_recipe,
    log_history,
    on_model_load,
    reset_accelerate,
    run,
    train,
)
from families import glue_sentences
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from amp_recipes.training.checkpoint import MARKER
from amp_recipes.training.outputs import is_example_name

CONLL, SQUAD = REPO / "data" / "conll2003", REPO / "data" / "squad"
STEPS = ["--max_train_steps", 4, "--learning_rate", 1e-3, "--seed", 3, "--per_device_eval_batch_size", 8]
COMMON = ["--model_name_or_path", TINY_BERT, "--per_device_train_batch_size", 8, *STEPS]


RECIPES = {  # recipe -> (its Auto class, the flags of a tiny run)
    "bert_glue": (
        "AutoModelForSequenceClassification",
        [*glue_flags(model_name_or_path=None, per_device_train_batch_size=None), "--max_train_samples", 32],
    ),
    "bert_ner": (
        "AutoModelForTokenClassification",
        ["--train_file", CONLL / "train.txt", "--validation_file", CONLL / "valid.txt"]
        + ["--max_train_samples", 32, "--max_eval_samples", 20, "--max_seq_length", 24]
        + ["--ignore_mismatched_sizes"],
    ),
    "bert_qa": (
        "AutoModelForQuestionAnswering",
        ["--train_file", SQUAD / "train.json", "--validation_file", SQUAD / "dev.json"]
        + ["--max_train_samples", 32, "--max_eval_samples", 12, "--max_seq_length", 64, "--doc_stride", 16]
        + ["--max_query_length", 24],
    ),
    "bert_mlm": ("AutoModelForMaskedLM", ["--max_seq_length", 32]),  # + --train_file, the corpus fixture
}
PIPELINE_TAGS = {
    "bert_glue": "text-classification",
    "bert_ner": "token-classification",
    "bert_qa": "question-answering",
    "bert_mlm": "fill-mask",
}
BEST_METRIC = {"bert_glue": "accuracy", "bert_ner": "f1", "bert_qa": "f1", "bert_mlm": "loss"}  # MLM: lower


def best_flags(name: str) -> list:
    """A best_model row's training flags: every step evaluated, the best evaluation's weights kept."""
    return ["--eval_steps", 1, "--load_best_model_at_end", "--metric_for_best_model", BEST_METRIC[name]]


COMPILE = ["--torch_compile", "--torch_compile_backend", "eager"]
MODES = {  # mode -> (recipe flags, how it is launched: in this process, two DDP processes, or a config)
    "fp32": ([], None),
    "bf16": (["--mixed_precision", "bf16"], None),
    "fp8": (["--mixed_precision", "fp8"], None),
    "fp16": (["--mixed_precision", "fp16"], None),
    "compile": (COMPILE, None),
    "gradient_checkpointing": (["--gradient_checkpointing"], None),
    "best_model": ([], None),  # every step evaluated, the best one's weights saved (flags_of, BEST)
    "ddp": ([], "ddp"),
    "ddp+compile": (COMPILE, "ddp"),
    # The configs ask for fp16: each row names its precision (the recipe's flag wins over the config).
    "fsdp2": (["--mixed_precision", "no"], "fsdp.yaml"),
    "fsdp2+bf16": (["--mixed_precision", "bf16"], "fsdp.yaml"),
    "fsdp2+fp8": (["--mixed_precision", "fp8"], "fsdp.yaml"),  # the product's config: fp8 all-gathers on
    "fsdp2+compile": (["--mixed_precision", "no", *COMPILE], "fsdp.yaml"),
    # DeepSpeed's CPU accelerator has no fp16 ("Type fp16 is not supported on your device"): bf16.
    "zero2": (["--mixed_precision", "bf16"], "deepspeed_zero2.yaml"),
    "zero3": (["--mixed_precision", "bf16"], "deepspeed_zero3.yaml"),
    # The best evaluation's weights loaded back at the end through the engine's own load_state.
    "fsdp2+best_model": (["--mixed_precision", "no"], "fsdp.yaml"),
    "zero3+best_model": (["--mixed_precision", "bf16"], "deepspeed_zero3.yaml"),
}
ENGINE_TYPE = {"fsdp.yaml": "FSDP", "deepspeed_zero2.yaml": "DEEPSPEED", "deepspeed_zero3.yaml": "DEEPSPEED"}
TWO_PROCESSES = ["--multi_gpu", "--num_processes", 2, "--num_cpu_threads_per_process", 1]
# Scores of the reloaded model against the run's own: bit for bit where both evaluations run the
# same fp32 arithmetic on the same batches. Elsewhere the evaluation differs in ways that are not the
# saved model's: the multi-process runs evaluated in two processes (other batches, so other padded
# lengths), and bf16/fp16/fp8 round inside autocast, where a different batch layout changes the last
# bits. (The bf16 and fp8 engine rows are ENGINE_EVAL's.)
EXACT = {"fp32", "compile", "bf16", "fp8", "fp16", "gradient_checkpointing", "best_model"}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "sst2.txt"
    path.write_text("\n".join(glue_sentences(400)) + "\n")
    return path


def flags_of(name: str, mode: str, output_dir: Path, corpus: Path, training=True) -> list:
    _, flags = RECIPES[name]
    data = ["--train_file", corpus] if name == "bert_mlm" else []
    best = best_flags(name) if training and "best_model" in mode else []
    # GLUE's best_model rows also predict MRPC's test split, in the run and in the --eval_only run.
    predict = ["--do_predict"] if name == "bert_glue" and "best_model" in mode else []
    return [*flags, *data, *COMMON, *MODES[mode][0], *best, *predict, "--output_dir", output_dir]


def in_process(name, mode, argv, monkeypatch, request, initial=None):
    """One run of the recipe in this process, as `mode` runs it on this CPU."""
    module = load_recipe(name)
    if mode == "fp16":
        monkeypatch.setattr(module, "Accelerator", Fp16OnCpu)
    if mode == "fp8":
        request.getfixturevalue("fp8_on_cpu")
    if mode.endswith("compile"):
        torch._dynamo.reset()
    if initial is not None:  # the weights the recipe starts from (its new head's included)
        auto_class = RECIPES[name][0]
        on_model_load(monkeypatch, module, auto_class, lambda m: initial.update(clone(m.state_dict())))
    try:
        return train(module, argv)
    finally:
        reset_accelerate()


def clone(state_dict):
    return {key: tensor.detach().clone() for key, tensor in state_dict.items()}


_baselines: dict = {}


def fp32_start(name, corpus, tmp_path_factory, monkeypatch, request):
    """The initial weights of a recipe's fp32 run (same seed): what the two-process runs, whose
    weights this process cannot see, start from; their initial_weights_sha256 must agree."""
    if name not in _baselines:
        initial = {}
        output_dir = tmp_path_factory.mktemp(f"{name}-start")
        results = in_process(
            name, "fp32", flags_of(name, "fp32", output_dir, corpus), monkeypatch, request, initial
        )
        _baselines[name] = (initial, results["initial_weights_sha256"])
    return _baselines[name]


def scores(results: dict) -> dict:
    return {k: v for k, v in results.items() if k.startswith("eval_") and isinstance(v, int | float)}


def launch(name, mode, argv, tmp_path, expect_success=True):
    """A two-process run of the recipe: plain DDP, or the engine of one of the repository's configs."""
    how = MODES[mode][1]
    if how == "ddp":
        cmd, env = accelerate_launch(*TWO_PROCESSES, REPO / "recipes" / f"{name}.py", *argv), {}
    else:  # the repository's config, on 2 CPU processes (conftest.engine_launch / engine_env)
        cmd = engine_launch(how, REPO / "recipes" / f"{name}.py", *argv)
        env = engine_env(*([FP8_EMULATION] if "fp8" in mode else []))
    launched = run(cmd, tmp_path, **{"ACCELERATE_USE_CPU": "1", **env})
    assert (launched.returncode == 0) is expect_success, launched.stderr[-3000:]
    return launched


# Every two-process launch costs about 25 CPU-seconds before its first step (three Python
# processes importing torch, transformers and evaluate), and an engine row makes two or three of
# them: the rows CI leaves out took 26 CPU-minutes (docs/scaling-out.md), more than CI's 20-minute
# budget on two cores. CI runs every in-process row, DDP with the masked LM's tied weights, DDP +
# torch.compile on GLUE, one row per engine (with its engine --eval_only; ZeRO-3's with its resume)
# and the masked LM's FSDP2 refusal; the others are `full_matrix` rows, run with --full-matrix
# (docs/scaling-out.md says when). NER's and QA's two-process scoring is their own tests'
# (test_bert_ner.py, test_bert_qa.py); plain DDP on GLUE runs in test_multiprocess.py and
# test_scale_out.py, and is ddp+compile's launch less the compile. In CI:
IN_CI = {
    ("bert_mlm", "ddp"),  # the tied decoder weight saved once, gathered from two processes
    ("bert_glue", "ddp+compile"),  # the DDP + torch.compile start-up is the recipes' shared code
    ("bert_glue", "fsdp2+fp8"),  # FSDP2, its mixed precision and torchao's fp8 all-gathers at once
    # ZeRO-3: partitioned parameters, the gathered fp32 save, DeepSpeed's resume and --eval_only, and
    # the best checkpoint loaded back into partitioned parameters (the plain zero3 row runs the same
    # steps less the last: a full_matrix row since 2026-12-06, 66 CPU-seconds of CI's budget)
    ("bert_glue", "zero3+best_model"),
    ("bert_mlm", "fsdp2"),  # the refusal
}  # ZeRO-2 trains in CI in test_engines.py's NaN test; FSDP2 in fp32 there too


def row(name: str, mode: str):
    """One (recipe, mode) row: two-process rows in CI's `slow` lane (see .ci/run), and those CI
    leaves out also `full_matrix`."""
    marks = []
    if MODES[mode][1]:
        marks.append(pytest.mark.slow)
        if (name, mode) not in IN_CI:
            marks.append(pytest.mark.full_matrix)
    return pytest.param(name, mode, marks=marks, id=f"{name}-{mode}")


ROWS = [row(name, mode) for name in RECIPES for mode in MODES]
# The engine rows resume their checkpoint for one recipe with a plain head (GLUE) and the one with
# tied weights (MLM): NER and QA run the same loop, engine and checkpoint code as GLUE, with a
# Linear head of another size, and each resume costs a launch (about 30 CPU-seconds) in CI's budget.
RESUMED = {"bert_glue", "bert_mlm"}
# In CI, FSDP2's resume is test_engine_fp16.py's (its loss scale, exact weights) and fp8's
# test_fp8.py's: the fsdp2+fp8 row saves and reloads, and resumes under --full-matrix.
NOT_RESUMED_IN_CI = {"fsdp2+fp8"}
# A bf16 or fp8 engine row evaluated in arithmetic this process does not repeat (FSDP2 casts the
# weights to bf16, DeepSpeed runs a bf16 copy of the module, where autocast casts per operation; a
# tiny model's NER scores then move by a whole entity): its --eval_only runs through the same
# launch, and must give the run's scores exactly. The fp32 engine rows evaluate here (TOLERANCE).
ENGINE_EVAL = {"fsdp2+bf16", "fsdp2+fp8", "zero2", "zero3", "zero3+best_model"}
# accelerate's FSDP2 wrapping (1.15, 1.16) puts BERT's masked-LM decoder in a unit of its own and
# the prediction head that owns the decoder's tied bias in another: the tie breaks, the decoder's
# copy of the bias is not the optimizer's, and the recipe refuses before training.
FSDP2_MLM_REFUSAL = (
    "1 trainable parameters are not in the optimizer after prepare() (e.g. cls.predictions.decoder.bias"
)


@pytest.mark.parametrize("name, mode", ROWS)
def test_trains_saves_reloads_and_scores_the_same(
    name, mode, corpus, tmp_path, tmp_path_factory, monkeypatch, request
):
    output_dir = tmp_path / "run"
    argv = flags_of(name, mode, output_dir, corpus)
    how = MODES[mode][1]
    engine = how not in (None, "ddp")
    if engine:
        argv += ["--checkpointing_steps", 2]  # the checkpoint the resumed run starts from
    if ENGINE_TYPE.get(how) == "DEEPSPEED":
        request.getfixturevalue("deepspeed_built")
    if name == "bert_mlm" and how == "fsdp.yaml":
        refused = launch(name, mode, argv, tmp_path, expect_success=False)
        assert f"error: {FSDP2_MLM_REFUSAL}" in refused.stderr
        assert not (output_dir / "checkpoints").exists()  # refused before the first step
        return
    if how:
        launch(name, mode, argv, tmp_path)
        initial, fingerprint = fp32_start(name, corpus, tmp_path_factory, monkeypatch, request)
    else:
        initial = {}
        in_process(name, mode, argv, monkeypatch, request, initial)
    results = json.loads((output_dir / "eval_results.json").read_text())
    if how:
        distributed_type = ENGINE_TYPE[how] if engine else "MULTI_CPU"
        assert (results["num_processes"], results["distributed_type"]) == (2, distributed_type)
        assert results["initial_weights_sha256"] == fingerprint  # it started where `initial` says
        assert results["optimizer"] == "fused AdamW"
    if "fp8" in mode:
        assert results["precision_in_effect"] == "fp8" and results["fp8_linear_layers"] > 0
    if "bf16" in mode or ENGINE_TYPE.get(how) == "DEEPSPEED":
        assert results["precision_in_effect"] == "bf16"
    if mode.endswith("compile"):
        assert results["compiled_graphs"] > 0
    assert results["gradient_checkpointing"] is (mode == "gradient_checkpointing")
    if "best_model" in mode:  # the scores, and below the weights, of the first best evaluation
        key = results["metric_for_best_model"]
        logged = {row["step"]: row for row in log_history(output_dir) if key in row}
        assert sorted(logged) == [1, 2, 3, 4]
        pick = min if name == "bert_mlm" else max
        best_step = min(s for s in logged if logged[s][key] == pick(row[key] for row in logged.values()))
        assert results["best_step"] == best_step and results["best_metric"] == logged[best_step][key]
        assert scores(results) == scores(logged[best_step])
        if name == "bert_glue":  # its accuracy is best first: the best checkpoint is loaded back
            assert best_step < results["train_steps"]

    # The final model, as a user reloads it: the recipe's Auto class, every key found, the saved tensors.
    saved = load_file(str(output_dir / "model.safetensors"))
    auto_class = getattr(transformers, RECIPES[name][0])
    reloaded, info = auto_class.from_pretrained(output_dir, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    state = reloaded.state_dict()
    assert set(saved) <= set(state) and set(state) - set(saved) <= tied_keys(reloaded)
    assert all(torch.equal(state[key], tensor) for key, tensor in saved.items())
    # fp32 master weights, under every engine (ZeRO's module copies are 16-bit), and config.json says so.
    assert all(tensor.dtype == torch.float32 for tensor in saved.values())
    assert json.loads((output_dir / "config.json").read_text())["dtype"] == "float32"

    # The model card: the Hub's task for the recipe's head, and the dev scores: as model-index
    # metadata for GLUE (a Hub dataset), in the card's table for the files of the other rows.
    card = ModelCard.load(output_dir / "README.md")
    assert card.data.pipeline_tag == PIPELINE_TAGS[name] and results["precision_in_effect"] in card.data.tags
    counts = ("_samples", "_windows", "_tokens")  # how much was evaluated, not how well
    expected = {key: value for key, value in scores(results).items() if not key.endswith(counts)}
    assert expected
    if name == "bert_glue":
        scored = {f"eval_{result.metric_type}": result.metric_value for result in card.data.eval_results}
        assert scored == expected
    else:
        assert card.data.eval_results is None
        for key, value in expected.items():
            assert f"| {key.removeprefix('eval_')} | {value:.4g} |" in card.text, key

    # Every trainable weight moved (the tied decoder weight is the word embeddings, saved once).
    assert set(saved) <= set(initial)
    frozen = [key for key, tensor in saved.items() if torch.equal(tensor, initial[key])]
    assert not frozen, f"{len(frozen)} of {len(saved)} weights never changed, e.g. {frozen[:3]}"

    # The mid-run checkpoint, resumed by the same launch, reaches the same final weights, bit for bit.
    full_matrix = request.config.getoption("--full-matrix")
    if engine and name in RESUMED and (mode not in NOT_RESUMED_IN_CI or full_matrix):
        resumed_dir = tmp_path / "resumed"
        checkpoint = output_dir / "checkpoints" / "checkpoint-2"
        resumed_argv = flags_of(name, mode, resumed_dir, corpus) + ["--resume_from_checkpoint", checkpoint]
        if "--do_predict" in resumed_argv:  # the weights are compared, not the predictions
            resumed_argv.remove("--do_predict")
        launched = launch(name, mode, resumed_argv, tmp_path)
        assert "checkpoint-2 at step 2" in launched.stderr
        again = load_file(str(resumed_dir / "model.safetensors"))
        assert again.keys() == saved.keys()
        assert all(torch.equal(again[key], saved[key]) for key in saved)

    # A fresh --eval_only of the saved folder gives the run's scores.
    expected = scores(results)
    eval_flags = ["--model_name_or_path", output_dir, "--eval_only"]
    if mode in ENGINE_EVAL:  # the same engine and precision, two processes: the same arithmetic
        eval_argv = [*flags_of(name, mode, tmp_path / "eval", corpus, training=False), *eval_flags]
        launch(name, mode, eval_argv, tmp_path)
        again = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
        assert expected and scores(again) == expected
        assert_same_predictions(output_dir, tmp_path / "eval", "--do_predict" in argv)
        return
    eval_mode = "fp32" if how else mode
    again = in_process(
        name,
        eval_mode,
        [*flags_of(name, eval_mode, tmp_path / "eval", corpus, training=False), *eval_flags],
        monkeypatch,
        request,
    )
    assert expected and scores(again).keys() == expected.keys()
    if mode in EXACT:
        assert scores(again) == expected
        assert_same_predictions(output_dir, tmp_path / "eval", "--do_predict" in argv)
    else:
        for key, value in expected.items():
            assert math.isclose(scores(again)[key], value, rel_tol=TOLERANCE, abs_tol=TOLERANCE), key


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_examples_checkpoint_folders_resume_exactly(name, corpus, tmp_path, monkeypatch, request):
    """--checkpointing_steps epoch and N leave the folders transformers' no_trainer examples leave,
    <output_dir>/epoch_<i> and step_<n> (0-based epochs, optimizer steps), each a complete
    checkpoint sharing its files with checkpoints/checkpoint-<step>; a run resumed from epoch_0 or
    from step_3, as a user of the example types it, ends where the uninterrupted run ended: the
    same logged losses and rates, the same final weights, bit for bit. The reading by the example's
    own load_state: test_migration.test_the_example_loads_the_recipes_epoch_folder."""
    # Two epochs of 4 steps for GLUE and NER (32 examples in batches of 8); QA's windows and MLM's
    # blocks make longer epochs, whose first ends at the run's last step.
    two_epochs = ["--num_train_epochs", 2, "--max_train_steps", 8, "--logging_steps", 1]
    runs = {}
    for every in ("epoch", 3):
        output_dir = tmp_path / f"every-{every}"
        argv = [*flags_of(name, "fp32", output_dir, corpus), *two_epochs, "--checkpointing_steps", every]
        in_process(name, "fp32", argv, monkeypatch, request)
        runs[every] = (output_dir, argv)
    assert_same_training(runs["epoch"][0], runs[3][0])  # checkpointing changes nothing of the training
    folders = [p for p in tmp_path.glob("every-*/*") if is_example_name(p.name)]
    steps = {p.name: json.loads((p / MARKER).read_text())["global_step"] for p in folders}
    epoch_steps = [steps[f"epoch_{i}"] for i in range(sum(k.startswith("epoch_") for k in steps))]
    assert epoch_steps and epoch_steps == sorted(epoch_steps) and epoch_steps[-1] == 8
    assert [k for k in sorted(steps) if k.startswith("step_")] == ["step_3", "step_6"]
    assert not list(tmp_path.glob("every-*/.tmp-*"))  # no staging folder left behind
    for folder in folders:  # the checkpoint's files, once on disk
        twin = folder.parent / "checkpoints" / f"checkpoint-{steps[folder.name]}"
        files = sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(twin) for p in twin.rglob("*") if p.is_file())
        assert all((folder / f).samefile(twin / f) for f in files)
    for every, resume_from in (("epoch", "epoch_0"), (3, "step_3")):
        reference, argv = runs[every]
        resumed = tmp_path / f"resumed-{resume_from}"
        argv = [resumed if flag == reference else flag for flag in argv]
        argv += ["--resume_from_checkpoint", reference / resume_from]
        in_process(name, "fp32", argv, monkeypatch, request)
        logged = [(row["step"], row["loss"], row["learning_rate"]) for row in history(resumed)]
        expected = [(row["step"], row["loss"], row["learning_rate"]) for row in history(reference)]
        assert logged == [row for row in expected if row[0] > steps[resume_from]]
        again, final = (
            load_file(str(resumed / "model.safetensors")),
            load_file(str(reference / "model.safetensors")),
        )
        assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final)


def assert_same_predictions(run_dir: Path, eval_dir: Path, predicted: bool) -> None:
    """--do_predict's file of the run (the final model) and of --eval_only on its folder: the same."""
    written = sorted(path.name for path in run_dir.glob("predict_results_*.txt"))
    assert bool(written) is predicted
    assert written == sorted(path.name for path in eval_dir.glob("predict_results_*.txt"))
    for name in written:
        assert (run_dir / name).read_text() == (eval_dir / name).read_text(), name


def tied_keys(model) -> set[str]:
    """Keys of tensors that share storage with an earlier key (save_pretrained writes them once)."""
    seen, tied = {}, set()
    for key, tensor in model.state_dict().items():
        pointer = tensor.data_ptr()
        if pointer in seen:
            tied.add(key)
        seen.setdefault(pointer, key)
    return tied
