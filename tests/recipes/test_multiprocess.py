"""recipes/bert_glue.py under `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo)."""

import json

import pytest
import torch
from conftest import RECIPES, TINY_BERT, accelerate_launch, glue_flags, load_recipe, run, train
from safetensors.torch import load_file
from wandb_offline import offline_run

TINY = glue_flags(
    model_name_or_path=None,
    max_eval_samples=None,
    per_device_train_batch_size=None,
    per_device_eval_batch_size=8,
    seed=3,
)
TWO_PROCESSES = ["--multi_gpu", "--num_processes", 2, "--num_cpu_threads_per_process", 1]
pytestmark = pytest.mark.heavy  # two-process launches in every test: CI's heavy lane (.ci/run)

CPU_GROUP = {"ACCELERATE_USE_CPU": "1"}  # without a GPU: one gloo process group, not 2 lone runs


def results(output_dir):
    return json.loads((output_dir / "eval_results.json").read_text())


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("model")
    flags = [*TINY, "--model_name_or_path", TINY_BERT, "--max_train_samples", 64, "--max_train_steps", 6]
    train(load_recipe("bert_glue"), [*flags, "--output_dir", tmp_path])  # in this process
    return tmp_path


def test_two_process_metrics_equal_single_process_metrics(trained_model, tmp_path):
    # 37 samples in batches of 8 over 2 processes: the last batch is padded with repeats,
    # which gather_for_metrics must drop.
    common = [
        RECIPES / "bert_glue.py",
        *TINY,
        "--model_name_or_path",
        trained_model,
        "--eval_only",
        "--max_eval_samples",
        37,
    ]
    train(load_recipe("bert_glue"), [*common[1:], "--output_dir", tmp_path / "one"])  # one process: this one
    double = run(
        accelerate_launch(*TWO_PROCESSES, *common, "--output_dir", tmp_path / "two"), tmp_path, **CPU_GROUP
    )
    assert double.returncode == 0, double.stderr[-2000:]
    one, two = results(tmp_path / "one"), results(tmp_path / "two")
    assert (one["num_processes"], two["num_processes"]) == (1, 2)
    assert one["eval_samples"] == two["eval_samples"] == 37
    assert {k: v for k, v in one.items() if k.startswith("eval_")} == {
        k: v for k, v in two.items() if k.startswith("eval_")
    }


def test_two_process_training_logs_checkpoints_and_resumes(tmp_path):
    common = [
        RECIPES / "bert_glue.py",
        *TINY,
        "--model_name_or_path",
        TINY_BERT,
        "--max_train_samples",
        64,
        "--per_device_train_batch_size",
        8,
        "--num_train_epochs",
        2,
        "--logging_steps",
        1,
        "--max_eval_samples",
        16,
    ]
    output_dir = tmp_path / "ddp"
    full = run(
        accelerate_launch(
            *TWO_PROCESSES,
            *common,
            "--checkpointing_steps",
            3,
            "--report_to",
            "wandb",
            "--output_dir",
            output_dir,
        ),
        tmp_path,
        **CPU_GROUP,
    )
    assert full.returncode == 0, full.stderr[-3000:]
    summary = results(output_dir)
    # 64 samples / (8 per process x 2 processes) = 4 steps an epoch, 8 in all; total batch 16.
    assert (summary["num_processes"], summary["total_train_batch_size"], summary["train_steps"]) == (2, 16, 8)
    history = [json.loads(line) for line in (output_dir / "log_history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history if "loss" in row] == list(range(1, 9))  # written once, by rank 0
    # The scheduler is prepared with the model: it steps twice per optimizer step (once per
    # process) over 16 scheduler steps, so the linear decay reaches 0 exactly at the last step.
    rates = [row["learning_rate"] for row in history if "loss" in row]
    assert rates[-1] == 0.0 and rates[3] == pytest.approx(2e-5 * 8 / 15)  # warm-up int(0.1 * 16) = 1
    assert (output_dir / "checkpoints" / "checkpoint-3" / "scheduler.bin").is_file()
    _, config, _ = offline_run(tmp_path)  # exactly one W&B run
    assert config["num_processes"] == 2 and config["total_train_batch_size"] == 16
    assert sorted(p.name for p in (output_dir / "checkpoints").iterdir()) == [
        "checkpoint-3",
        "checkpoint-6",
        "latest",
    ]

    resumed_dir = tmp_path / "resumed"
    resumed = run(
        accelerate_launch(
            *TWO_PROCESSES,
            *common,
            "--output_dir",
            resumed_dir,
            "--resume_from_checkpoint",
            output_dir / "checkpoints" / "checkpoint-3",
        ),
        tmp_path,
        **CPU_GROUP,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint-3 at step 3" in resumed.stderr
    a, b = load_file(str(output_dir / "model.safetensors")), load_file(str(resumed_dir / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same final weights as the uninterrupted run


def test_unconnected_processes_are_refused(trained_model, tmp_path):
    args = [
        RECIPES / "bert_glue.py",
        *TINY,
        "--model_name_or_path",
        trained_model,
        "--eval_only",
        "--max_eval_samples",
        8,
        "--output_dir",
        tmp_path / "out",
    ]
    result = run(accelerate_launch(*TWO_PROCESSES, *args), tmp_path)  # no ACCELERATE_USE_CPU
    assert result.returncode != 0
    assert (
        "2 processes were launched but accelerate sees 1: on a machine without GPUs set ACCELERATE_USE_CPU=1"
        in result.stderr
    )


def test_fsdp_on_cpu_runs_fsdp_or_is_refused(trained_model, tmp_path):
    """FSDP with 2 CPU processes (gloo), if accelerate can; else the recipe must refuse, not run DDP.
    accelerate switches to FSDP only from GPU/accelerator process groups (state.py lists MULTI_GPU,
    MULTI_NPU, MULTI_XPU, ... but not MULTI_CPU): the refusal is what this accelerate gives, and
    tests/gpu trains with FSDP2 on two GPUs."""
    args = [
        RECIPES / "bert_glue.py",
        *TINY,
        "--model_name_or_path",
        trained_model,
        "--max_train_samples",
        16,
        "--max_train_steps",
        2,
        "--max_eval_samples",
        8,
        "--output_dir",
        tmp_path / "out",
    ]
    result = run(
        accelerate_launch("--use_fsdp", "--fsdp_version", 2, "--num_processes", 2, *args),
        tmp_path,
        **CPU_GROUP,
    )
    if result.returncode == 0:  # a future accelerate that shards over a CPU process group
        assert results(tmp_path / "out")["distributed_type"] == "FSDP"
    else:
        assert (
            "FSDP was requested but accelerate set up MULTI_CPU on cpu: accelerate enables FSDP only on GPUs"
            in result.stderr
        )
