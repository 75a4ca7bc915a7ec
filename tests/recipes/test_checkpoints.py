"""Checkpoints of recipes/bert_glue.py: exact resume, kill -9, SIGTERM, bad checkpoints, rotation."""

import contextlib
import errno
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator, PartialState
from conftest import (
    RECIPES,
    REPO,
    Fp16OnCpu,
    assert_same_training,
    final_weights,
    glue_flags,
    history,
    load_recipe,
    log_history,
    minilm_path,
    offline_env,
    run,
    stop_at,
    train,
)
from safetensors.torch import load_file

from amp_recipes.errors import InputError
from amp_recipes.training import checkpoint
from amp_recipes.training.checkpoint import (
    LATEST,
    MARKER,
    CheckpointError,
    complete_checkpoints,
    rotate,
    save_checkpoint,
)

TINY = glue_flags(learning_rate=1e-3, logging_steps=1, seed=7)


# ----------------------------------------------------------------------------- subprocess: signals
def test_sigterm_checkpoints_mid_epoch_and_exits_143(tmp_path):
    """A real SIGTERM to a running recipe: it finishes its step, checkpoints it (mid-epoch), says how
    to resume and exits 143 without evaluating. That such a checkpoint resumes to the uninterrupted
    run's training, bit for bit, is the in-process tests' (stopped_and_resumed, below: the same
    handler, which they stop at a chosen step)."""
    args = [
        sys.executable,
        RECIPES / "bert_glue.py",
        *TINY,
        "--max_train_samples",
        320,
        "--num_train_epochs",
        2,
    ]
    output_dir = tmp_path / "interrupted"
    process = subprocess.Popen(
        [str(a) for a in [*args, "--output_dir", output_dir]],
        cwd=REPO,
        env=offline_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = output_dir / "log_history.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 5):
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-2000:]
    assert "Stopped by SIGTERM after step" in stderr and "--resume_from_checkpoint latest" in stderr
    latest = (output_dir / "checkpoints" / LATEST).read_text()
    record = json.loads((output_dir / "checkpoints" / latest / MARKER).read_text())
    assert 5 <= record["global_step"] < 40 and record["batches_in_epoch"] > 0  # stopped mid-epoch
    assert not (output_dir / "eval_results.json").exists()


def test_ctrl_c_stops_after_the_step_with_130_and_a_second_one_at_once(tmp_path):
    """SIGINT is recorded (the loop stops after its step and exits 130, as the SIGTERM test shows
    for 143); the SIGTERM a launcher passes on right after it is the same stop (still 130, still
    running); a second SIGINT, RELAY_WINDOW_S later, gets the default action: the process ends at
    once. (The relay through a real launcher: tests/recipes/test_scale_out.py.)"""
    code = (
        "import os, signal, time\n"
        "from amp_recipes.training.checkpoint import PreemptionHandler\n"
        "class OneProcess: num_processes = 1\n"
        "handler = PreemptionHandler()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"  # the launcher passing Ctrl-C on
        "print(handler.should_stop(OneProcess(), 1), handler.exit_code, flush=True)\n"
        "time.sleep(handler.RELAY_WINDOW_S + 0.2)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('still running', flush=True)\n"
    )
    done = run([sys.executable, "-c", code], tmp_path)
    assert done.stdout == "True 130\n", done.stdout + done.stderr
    assert done.returncode == -signal.SIGINT


def test_kill_9_during_a_checkpoint_write_keeps_the_previous_one(tmp_path, caplog):
    output_dir = tmp_path / "out"
    args = [
        *TINY,
        "--max_train_samples",
        64,
        "--num_train_epochs",
        1,
        "--checkpointing_steps",
        2,
        "--output_dir",
        output_dir,
    ]
    crashed = run(
        [sys.executable, Path(__file__).with_name("crash_during_save.py"), RECIPES / "bert_glue.py", *args],
        tmp_path,
    )
    assert crashed.returncode == -signal.SIGKILL
    checkpoints = output_dir / "checkpoints"
    assert (checkpoints / LATEST).read_text() == "checkpoint-2"
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["checkpoint-2"]
    assert (checkpoints / ".tmp-checkpoint-4").is_dir()  # the half-written one, never taken for a checkpoint
    assert not (checkpoints / "checkpoint-4").exists()
    # The examples' name exists for the complete checkpoint only.
    assert (output_dir / "step_2" / MARKER).is_file() and not (output_dir / "step_4").exists()

    with caplog.at_level(logging.INFO):  # the resume, in this process
        train(load_recipe("bert_glue"), [*args, "--resume_from_checkpoint", "latest"])
    assert "Resumed from" in caplog.text and "checkpoint-2 at step 2" in caplog.text
    assert [p.name for p in complete_checkpoints(checkpoints)] == [f"checkpoint-{n}" for n in (2, 4, 6, 8)]
    assert not (checkpoints / ".tmp-checkpoint-4").exists()


# ----------------------------------------------------------------------------- in process


def stopped_and_resumed(recipe, argv, output_dir, monkeypatch, stop_step) -> dict:
    """A SIGTERM during optimizer step `stop_step` (exit 143 after its checkpoint), then the same
    command with --resume_from_checkpoint latest: the resumed run's results."""
    monkeypatch.setattr(checkpoint, "PreemptionHandler", stop_at(stop_step))
    with pytest.raises(SystemExit) as stopped:
        train(recipe, [*argv, "--output_dir", str(output_dir)])
    assert stopped.value.code == 143
    monkeypatch.setattr(checkpoint, "PreemptionHandler", stop_at(-1))
    return train(recipe, [*argv, "--output_dir", str(output_dir), "--resume_from_checkpoint", "latest"])


def test_fp16_resume_keeps_loss_scale_and_growth_tracker(recipe, tmp_path, monkeypatch):
    argv = [
        *TINY,
        "--max_train_samples",
        96,
        "--num_train_epochs",
        2,
        "--mixed_precision",
        "fp16",
        "--checkpointing_steps",
        "epoch",
    ]
    monkeypatch.setattr(recipe, "Accelerator", Fp16OnCpu)
    train(recipe, [*argv, "--output_dir", str(tmp_path / "reference")])
    # mid-epoch: 12 steps an epoch
    results = stopped_and_resumed(recipe, argv, tmp_path / "resumed", monkeypatch, stop_step=7)
    assert results["precision_in_effect"] == "fp16"
    assert_same_training(
        tmp_path / "reference",
        tmp_path / "resumed",
        keys=("loss", "learning_rate", "loss_scale", "skipped_steps", "effective_optimizer_steps"),
    )
    scales = [row["loss_scale"] for row in history(tmp_path / "reference")]
    assert len(set(scales)) > 1  # the scale really moved during the run
    scalers = [
        torch.load(tmp_path / run / "checkpoints" / "checkpoint-24" / "scaler.pt", weights_only=True)
        for run in ("reference", "resumed")
    ]
    assert scalers[0] == scalers[1]
    assert scalers[0]["_growth_tracker"] == scalers[1]["_growth_tracker"]
    record = json.loads((tmp_path / "resumed" / "checkpoints" / "checkpoint-24" / MARKER).read_text())
    assert record["grad_scaler"]["scale"] == scalers[0]["scale"] and record["mixed_precision"] == "fp16"


def test_the_chosen_lr_schedule_is_transformers_schedule(recipe, tmp_path):
    """--lr_scheduler_type cosine with --num_warmup_steps 3: the logged learning rates are
    transformers' cosine schedule with that warm-up, step for step. (Its resume is the scheduler's
    state_dict, whatever the schedule: the linear one's, in every resume test.)"""
    import math

    argv = [*TINY, "--max_train_samples", 64, "--num_train_epochs", 2, "--checkpointing_steps", 3]
    argv += ["--lr_scheduler_type", "cosine", "--num_warmup_steps", 3, "--warmup_ratio", 0.5]
    train(recipe, [*argv, "--output_dir", str(tmp_path / "reference")])

    # The rate after optimizer step k, as transformers' get_cosine_schedule_with_warmup computes it.
    def cosine(step, warmup=3, total=16, peak=1e-3):
        if step < warmup:
            return peak * step / warmup
        return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    rates = [row["learning_rate"] for row in history(tmp_path / "reference") if "learning_rate" in row]
    assert rates == pytest.approx([cosine(step) for step in range(1, 17)], rel=1e-9, abs=1e-12)


def test_gradient_checkpointing_recomputes_trains_the_same_and_resumes_exactly(recipe, tmp_path, monkeypatch):
    """--gradient_checkpointing: every encoder layer's attention runs twice a step (the recompute in
    the backward), the training is the run without it, bit for bit (fp32, dropout's random state
    kept for the recompute), and a run stopped mid-epoch resumes to the same end."""
    from conftest import on_model_load

    argv = [*TINY, "--max_train_samples", 64, "--num_train_epochs", 2, "--checkpointing_steps", 3]
    train(recipe, [*argv, "--output_dir", str(tmp_path / "kept")])  # activations kept
    calls = []
    on_model_load(
        monkeypatch,
        recipe,
        "AutoModelForSequenceClassification",
        # Inside the layer: transformers (5.2x) keeps the layer's own hooks out of the recompute.
        lambda model: model.bert.encoder.layer[0].attention.register_forward_hook(
            lambda *_: calls.append(model.training)
        ),
    )
    argv.append("--gradient_checkpointing")
    results = train(recipe, [*argv, "--output_dir", str(tmp_path / "recomputed")])
    assert results["gradient_checkpointing"] is True
    assert calls.count(True) == 2 * 16  # 16 optimizer steps of one batch: forward + recompute
    assert_same_training(tmp_path / "kept", tmp_path / "recomputed")
    stopped_and_resumed(recipe, argv, tmp_path / "resumed", monkeypatch, stop_step=5)
    assert_same_training(tmp_path / "recomputed", tmp_path / "resumed")


def test_a_run_stopped_at_its_last_step_resumes_to_evaluate_and_save_only(recipe, tmp_path, monkeypatch):
    """A SIGTERM during the last optimizer step (--max_train_steps mid-epoch, 2 batches a step):
    the resumed run takes no further step, evaluates, and saves what the uninterrupted run saves."""
    argv = [*TINY, "--max_train_samples", 64, "--max_train_steps", 3, "--gradient_accumulation_steps", 2]
    reference = train(recipe, [*argv, "--output_dir", str(tmp_path / "reference")])
    resumed = stopped_and_resumed(recipe, argv, tmp_path / "resumed", monkeypatch, stop_step=3)
    assert resumed["train_steps"] == reference["train_steps"] == 3
    assert resumed["eval_accuracy"] == reference["eval_accuracy"]
    assert_same_training(tmp_path / "reference", tmp_path / "resumed")


@contextlib.contextmanager
def file_size_limit(limit_bytes):
    """A real kernel limit on the size of any file this process writes (RLIMIT_FSIZE): a write past
    it fails with EFBIG, whichever library writes (safetensors raises SafetensorError, torch.save
    RuntimeError), the error paths a full disk takes, without filling a disk. SIGXFSZ is ignored
    meanwhile (by default the kernel would kill the process instead)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def limited_from_call(function, call):
    """`function`, writing under a 1 MiB file-size limit from its `call`-th call on."""
    calls = 0

    def wrapper(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls < call:
            return function(*args, **kwargs)
        with file_size_limit(2**20):  # the tiny BERT's weights alone are ~4 MB
            return function(*args, **kwargs)

    return wrapper


def test_a_real_write_failure_during_a_checkpoint_keeps_the_previous_one(recipe, tmp_path, monkeypatch):
    import accelerate

    monkeypatch.setattr(
        accelerate.Accelerator, "save_state", limited_from_call(accelerate.Accelerator.save_state, 2)
    )
    output_dir = tmp_path / "out"
    argv = [*TINY, "--max_train_samples", 32, "--max_train_steps", 4, "--checkpointing_steps", 2]
    checkpoints = output_dir / "checkpoints"
    with pytest.raises(
        CheckpointError,
        match=rf"^Could not write the checkpoint of step 4 \(.*File too large.*\); {checkpoints}/checkpoint-2 is intact\.$",
    ):
        train(recipe, [*argv, "--output_dir", output_dir])
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["checkpoint-2"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-2", LATEST]  # no .tmp-* left


def test_a_real_write_failure_during_the_final_save_keeps_the_previous_model(recipe, tmp_path, monkeypatch):
    import transformers

    real = transformers.PreTrainedModel.save_pretrained
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", limited_from_call(real, 1))
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    previous = {"model.safetensors": b"the previous run's weights", "eval_results.json": b"{}"}
    for name, content in previous.items():
        (output_dir / name).write_bytes(content)
    argv = [*TINY, "--max_train_samples", 32, "--max_train_steps", 2, "--overwrite_output_dir"]
    with pytest.raises(
        CheckpointError,
        match=rf"^Could not write the final model to {output_dir} \(.*File too large.*\); the final model that "
        r"was there before, if any, is unchanged\.$",
    ):
        train(recipe, [*argv, "--output_dir", output_dir])
    assert {name: (output_dir / name).read_bytes() for name in previous} == previous
    assert not (output_dir / ".final.tmp").exists()


@pytest.fixture
def fp32_checkpoint(recipe, tmp_path):
    output_dir = tmp_path / "run"
    train(
        recipe,
        [
            *TINY,
            "--max_train_samples",
            32,
            "--max_train_steps",
            4,
            "--checkpointing_steps",
            2,
            "--output_dir",
            str(output_dir),
        ],
    )
    return output_dir


def test_bad_checkpoints_each_say_what_is_wrong(recipe, fp32_checkpoint, tmp_path):
    base = [*TINY, "--max_train_samples", 32, "--max_train_steps", 6, "--output_dir", str(fp32_checkpoint)]
    checkpoint = fp32_checkpoint / "checkpoints" / "checkpoint-4"
    cases = [
        (
            [*TINY, "--output_dir", str(tmp_path / "empty"), "--resume_from_checkpoint", "latest"],
            r"no complete checkpoint in .*empty/checkpoints; drop the flag to start a fresh run",
        ),
        (
            [*base, "--resume_from_checkpoint", str(fp32_checkpoint / "checkpoints" / "nowhere")],
            r"Checkpoint .*nowhere does not exist",
        ),
        (
            [*base, "--seed", "8", "--resume_from_checkpoint", "latest"],
            r"was written for seed 7, but this run has 8",
        ),
    ]
    minilm = [*base, "--model_name_or_path", str(minilm_path()), "--resume_from_checkpoint", "latest"]
    cases.append((minilm, r"was written for model 'bert/5x32', but this run has 'bert/6x384'"))
    rte = [a if a != "mrpc" else "rte" for a in base]
    cases.append(
        (
            [*rte, "--resume_from_checkpoint", "latest"],
            r"was written for task_name 'mrpc', but this run has 'rte'",
        )
    )
    for argv, message in cases:
        with pytest.raises(CheckpointError, match=message):
            train(recipe, argv)

    incomplete = fp32_checkpoint / "checkpoints" / "checkpoint-9"
    incomplete.mkdir()
    with pytest.raises(CheckpointError, match=r"checkpoint-9 is incomplete \(no amp_checkpoint.json\)"):
        train(recipe, [*base, "--resume_from_checkpoint", str(incomplete)])

    weights = checkpoint / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size // 2)
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint-4 is corrupted: model.safetensors is {size // 2} bytes instead of {size}",
    ):
        train(recipe, [*base, "--resume_from_checkpoint", "latest"])


def test_precision_switch_on_resume(recipe, fp32_checkpoint, tmp_path, monkeypatch, caplog):
    argv = [*TINY, "--max_train_samples", 32, "--max_train_steps", 6, "--mixed_precision", "fp16"]
    monkeypatch.setattr(recipe, "Accelerator", Fp16OnCpu)
    with pytest.raises(CheckpointError, match="has no GradScaler state .* cannot be resumed under fp16"):
        train(recipe, [*argv, "--output_dir", str(fp32_checkpoint), "--resume_from_checkpoint", "latest"])

    fp16_run = tmp_path / "fp16"
    train(recipe, [*argv, "--max_train_steps", 4, "--checkpointing_steps", 2, "--output_dir", str(fp16_run)])
    monkeypatch.setattr(recipe, "Accelerator", Accelerator)
    results = train(
        recipe,
        [
            *TINY,
            "--max_train_samples",
            32,
            "--max_train_steps",
            6,
            "--mixed_precision",
            "no",
            "--output_dir",
            str(fp16_run),
            "--resume_from_checkpoint",
            "latest",
        ],
    )
    assert results["train_steps"] == 6 and results["precision_in_effect"] == "fp32"
    assert "its GradScaler state (loss scale, growth tracker) is dropped" in caplog.text


def test_save_total_limit_keeps_the_newest(recipe, tmp_path):
    output_dir = tmp_path / "run"
    train(
        recipe,
        [
            *TINY,
            "--max_train_samples",
            48,
            "--max_train_steps",
            5,
            "--checkpointing_steps",
            1,
            "--save_total_limit",
            2,
            "--output_dir",
            str(output_dir),
        ],
    )
    checkpoints = output_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-4", "checkpoint-5", LATEST]
    assert (checkpoints / LATEST).read_text() == "checkpoint-5"
    # The examples' step_<n> folders share the checkpoints' files: they go with them.
    assert sorted(p.name for p in output_dir.glob("step_*")) == ["step_4", "step_5"]


def test_rotation_never_deletes_the_only_complete_checkpoint(tmp_path):
    for name, complete in (("checkpoint-3", True), ("checkpoint-5", False)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / MARKER).write_text("{}")
    rotate(tmp_path, 1)
    assert (tmp_path / "checkpoint-3").is_dir()


class FakeAccelerator:
    is_main_process = True

    def __init__(self, error=None):
        PartialState()  # for accelerate's logger
        self.error = error

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"x" * 10)
        if self.error:
            raise self.error


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),  # safetensors / plain writes
        RuntimeError(
            "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/3"
        ),
    ],
    ids=["oserror", "torch-save"],
)
def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, error):
    save_checkpoint(FakeAccelerator(), tmp_path, 2, {"global_step": 2}, None)
    with pytest.raises(CheckpointError, match=r"step 4 \(the disk is full\); .*checkpoint-2 is intact"):
        save_checkpoint(FakeAccelerator(error), tmp_path, 4, {"global_step": 4}, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", LATEST]
    assert json.loads((tmp_path / "checkpoint-2" / MARKER).read_text())["files"] == {"model.safetensors": 10}


def test_disk_full_while_writing_the_examples_folder_leaves_none_under_its_name(tmp_path, monkeypatch):
    """step_<n> is gathered aside and renamed when complete: a write failing half-way leaves no
    folder under the example's name (nothing a resume would take for a checkpoint), no staging
    folder, and the checkpoint itself intact."""
    checkpoints_dir = tmp_path / "checkpoints"
    path = save_checkpoint(FakeAccelerator(), checkpoints_dir, 2, {"global_step": 2}, None)
    written, link_or_copy = [], checkpoint.link_or_copy

    def link_then_fail(source, destination):
        if written:  # the second file: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(link_or_copy(source, destination))

    monkeypatch.setattr(checkpoint, "link_or_copy", link_then_fail)
    with pytest.raises(
        CheckpointError, match=r"step_2 \(the disk is full\); the checkpoint .*checkpoint-2 is intact"
    ):
        checkpoint.save_example_folder(FakeAccelerator(), path, "step_2")
    assert written and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]
    assert checkpoint.read_checkpoint(path, {})["global_step"] == 2


def test_resumed_run_continues_the_same_wandb_run(recipe, tmp_path, monkeypatch, wandb_dir):
    argv = [
        *TINY,
        "--max_train_samples",
        48,
        "--max_train_steps",
        6,
        "--report_to",
        "wandb",
        "--output_dir",
        tmp_path / "run",
    ]
    monkeypatch.setattr(checkpoint, "PreemptionHandler", stop_at(3))
    with pytest.raises(SystemExit):
        train(recipe, argv)
    monkeypatch.setattr(checkpoint, "PreemptionHandler", stop_at(-1))
    train(recipe, [*argv, "--resume_from_checkpoint", "latest"])
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    assert runs[0].name.split("-")[-1] == runs[1].name.split("-")[-1]  # one W&B run id, resumed


# ----------------------------------------------------------------------------- the best evaluation
BEST = ["--eval_steps", 2, "--metric_for_best_model", "accuracy"]


def evaluations(output_dir) -> dict:
    """step -> eval_accuracy, as log_history.jsonl has every evaluation."""
    return {row["step"]: row["eval_accuracy"] for row in log_history(output_dir) if "eval_accuracy" in row}


def first_best(values: dict, greater_is_better=True) -> int:
    """The step of the first evaluation with the best value (a tie is no improvement, as in the Trainer)."""
    best = max(values.values()) if greater_is_better else min(values.values())
    return min(step for step, value in values.items() if value == best)


def test_the_best_evaluation_is_the_final_model_and_survives_a_resume(recipe, tmp_path, monkeypatch):
    """--load_best_model_at_end: the final folder holds the weights of the best evaluation's
    checkpoint (kept through --save_total_limit 1), eval_results.json its scores and step, a fresh
    --eval_only of the folder gives those scores; a run stopped after the best and resumed ends
    the same, weights and best step."""
    argv = [*TINY, "--max_train_samples", 64, "--num_train_epochs", 2, *BEST, "--load_best_model_at_end"]
    argv += ["--checkpointing_steps", 3, "--save_total_limit", 1]
    reference = train(recipe, [*argv, "--output_dir", str(tmp_path / "reference")])
    logged = evaluations(tmp_path / "reference")
    assert sorted(logged) == list(range(2, 17, 2))  # --eval_steps 2 over 16 steps (and each epoch's end)
    best_step = first_best(logged)
    assert best_step < reference["train_steps"] == 16, (
        "the best must be an earlier step for this test to load it"
    )
    assert (
        reference["best_step"] == best_step
        and reference["best_model_checkpoint"] == f"checkpoint-{best_step}"
    )
    assert reference["best_metric"] == reference["eval_accuracy"] == logged[best_step]
    assert reference["metric_for_best_model"] == "eval_accuracy" and reference["stopped_early"] is False
    # Rotation kept the newest checkpoint and the best one.
    checkpoints = tmp_path / "reference" / "checkpoints"
    assert [p.name for p in complete_checkpoints(checkpoints)] == [f"checkpoint-{best_step}", "checkpoint-15"]
    # The final weights are the best checkpoint's model, not the last step's.
    final = final_weights(tmp_path / "reference")
    best = load_file(str(checkpoints / f"checkpoint-{best_step}" / "model.safetensors"))
    last = load_file(str(checkpoints / "checkpoint-15" / "model.safetensors"))
    assert final.keys() <= best.keys()
    assert all(torch.equal(final[key], best[key]) for key in final)
    assert not all(torch.equal(final[key], last[key]) for key in final)
    # As a user reads it back: --eval_only of the final folder.
    again = train(
        recipe,
        glue_flags(model_name_or_path=tmp_path / "reference", eval_only=True, output_dir=tmp_path / "eval"),
    )
    assert again["eval_accuracy"] == reference["eval_accuracy"] and again["eval_f1"] == reference["eval_f1"]

    resumed = stopped_and_resumed(recipe, argv, tmp_path / "resumed", monkeypatch, stop_step=5)
    assert {k: resumed[k] for k in ("best_step", "best_metric", "eval_accuracy")} == {
        k: reference[k] for k in ("best_step", "best_metric", "eval_accuracy")
    }
    assert_same_training(tmp_path / "reference", tmp_path / "resumed")


def test_early_stopping_stops_after_patience_evaluations_and_survives_a_resume(recipe, tmp_path, monkeypatch):
    """--early_stopping_patience 3: the run stops at the third evaluation in a row without a better
    --metric_for_best_model; a run stopped before that and resumed stops at the same step with the
    same weights (the patience count is in the checkpoint), and resuming the stopped run's last
    checkpoint trains no further."""
    argv = [*TINY, "--max_train_samples", 64, "--num_train_epochs", 2, *BEST, "--early_stopping_patience", 3]
    argv += ["--checkpointing_steps", 2]
    reference = train(recipe, [*argv, "--output_dir", str(tmp_path / "reference")])
    logged = evaluations(tmp_path / "reference")
    steps = sorted(logged)
    best_step = first_best(logged)
    stop_step = steps[steps.index(best_step) + 3]  # the third evaluation after the best
    assert steps[-1] == stop_step < 16  # nothing evaluated after the stop, and it came before the end
    assert all(logged[step] <= logged[best_step] for step in steps)
    assert reference["train_steps"] == stop_step and reference["stopped_early"] is True
    assert reference["best_step"] == best_step and reference["eval_accuracy"] == logged[stop_step]
    assert max(row["step"] for row in history(tmp_path / "reference")) == stop_step

    resumed = stopped_and_resumed(recipe, argv, tmp_path / "resumed", monkeypatch, stop_step=stop_step - 1)
    assert resumed["train_steps"] == stop_step and resumed["stopped_early"] is True
    assert_same_training(tmp_path / "reference", tmp_path / "resumed")

    # The stopped run's last checkpoint (taken after the evaluation that stopped it), resumed.
    again = train(
        recipe,
        [
            *argv,
            "--output_dir",
            str(tmp_path / "again"),
            "--resume_from_checkpoint",
            tmp_path / "reference" / "checkpoints" / f"checkpoint-{stop_step}",
        ],
    )
    assert again["train_steps"] == stop_step and again["stopped_early"] is True
    assert not history(tmp_path / "again")  # no step trained
    weights, weights_again = final_weights(tmp_path / "reference"), final_weights(tmp_path / "again")
    assert weights.keys() == weights_again.keys()
    assert all(torch.equal(weights[key], weights_again[key]) for key in weights)


def test_a_metric_the_evaluation_lacks_stops_the_run_at_its_first_evaluation(recipe, tmp_path):
    """As the Trainer does: the scores are known at the first evaluation, which names them."""
    argv = [*TINY, "--max_train_samples", 32, "--eval_steps", 1, "--metric_for_best_model", "acuracy"]
    with pytest.raises(
        InputError,
        match=r"--metric_for_best_model eval_acuracy is not a score of this "
        r"evaluation; it has eval_accuracy, eval_f1, eval_samples\.$",
    ):
        train(recipe, [*argv, "--output_dir", str(tmp_path / "run")])
    assert [row["step"] for row in history(tmp_path / "run")] == [1]


def test_epoch_end_evaluations_resume_without_being_repeated_or_counted_twice(recipe, tmp_path, monkeypatch):
    """Evaluations at epochs' ends only (no --eval_steps), --early_stopping_patience 2 and
    --load_best_model_at_end: the run stops at the second epoch without a better score. Resumed
    from the first epoch's checkpoint (its best), the run evaluates no step twice and stops where
    the uninterrupted run did, with its weights; so does a run stopped mid-epoch. Resumed from the
    checkpoint taken at the stop, it trains nothing and reports the scores it stopped with."""
    argv = [*TINY, "--max_train_samples", 64, "--num_train_epochs", 5, "--metric_for_best_model", "accuracy"]
    argv += ["--early_stopping_patience", 2, "--load_best_model_at_end", "--checkpointing_steps", "epoch"]
    reference = train(recipe, [*argv, "--output_dir", str(tmp_path / "reference")])
    logged = evaluations(tmp_path / "reference")
    best_step = first_best(logged)
    assert sorted(logged) == [8 * epoch for epoch in range(1, len(logged) + 1)]  # one per epoch, 8 steps each
    assert reference["train_steps"] == best_step + 16 < 40 and reference["stopped_early"] is True

    from_best = train(
        recipe,
        [
            *argv,
            "--output_dir",
            str(tmp_path / "from-best"),
            "--resume_from_checkpoint",
            tmp_path / "reference" / "checkpoints" / f"checkpoint-{best_step}",
        ],
    )
    assert sorted(evaluations(tmp_path / "from-best")) == [best_step + 8, best_step + 16]  # none repeated
    assert from_best["train_steps"] == reference["train_steps"] and from_best["best_step"] == best_step
    weights, again = final_weights(tmp_path / "reference"), final_weights(tmp_path / "from-best")
    assert all(torch.equal(weights[key], again[key]) for key in weights)

    stopped_and_resumed(recipe, argv, tmp_path / "resumed", monkeypatch, stop_step=best_step + 4)
    assert_same_training(tmp_path / "reference", tmp_path / "resumed")

    after_stop = train(
        recipe,
        [
            *argv,
            "--output_dir",
            str(tmp_path / "after-stop"),
            "--resume_from_checkpoint",
            tmp_path / "reference" / "checkpoints" / f"checkpoint-{reference['train_steps']}",
        ],
    )
    assert not evaluations(tmp_path / "after-stop") and not history(tmp_path / "after-stop")
    assert (
        after_stop["eval_accuracy"] == reference["eval_accuracy"]
        and after_stop["train_steps"] == reference["train_steps"]
    )
