"""`amp-recipes doctor` on the recipes' own data and model, its predictions checked against real
runs of the recipe: accelerate's real fp16 path through conftest's Fp16OnCpu (CPU fp16 autocast,
whose list of fp16 operations is not CUDA's)."""

import json
import sys

import pytest
import torch
from conftest import Fp16OnCpu, glue_flags, load_recipe, on_model_load, reset_accelerate, run, train

from amp_recipes import doctor

SCALED = "bert.encoder.layer.1.output.dense"


def blow_up(model):
    """An activation made to exceed fp16's 65504: one Linear's weights times 1e7."""
    with torch.no_grad():
        model.get_submodule(SCALED).weight.mul_(1e7)


@pytest.fixture
def glue():
    yield load_recipe("bert_glue")
    reset_accelerate()


def test_a_module_beyond_fp16s_range_is_named_and_fp16_skips_its_steps_as_predicted(
    glue, tmp_path, monkeypatch
):
    on_model_load(monkeypatch, glue, "AutoModelForSequenceClassification", blow_up)
    flags = glue_flags(max_train_samples=32, max_train_steps=4, output_dir=tmp_path / "run")
    report = doctor.diagnose(glue, "bert_glue", flags, probe_steps=4, timed_steps=1)
    overflow = report["fp16_risk"]["overflowing_modules"]
    assert overflow[0]["module"] == SCALED and overflow[0]["max_abs_activation"] > 65520  # where it starts
    assert "bert.encoder.layer.1.output.dropout" in [entry["module"] for entry in overflow[1:]]  # carried on
    fp16 = next(advice for advice in report["recommendation"] if advice["precision"] == "fp16")
    assert not fp16["advised"] and f"fp16 not advised: {SCALED} reaches" in fp16["reason"]
    # As predicted: the recipe under accelerate's real fp16 path skips every step.
    monkeypatch.setattr(glue, "Accelerator", Fp16OnCpu)
    results = train(glue, [*flags, "--mixed_precision", "fp16"])
    assert results["precision_in_effect"] == "fp16"
    assert results["skipped_steps"] == results["train_steps"] == 4


def test_the_predicted_loss_scale_is_within_a_factor_2_of_a_real_fp16_runs(glue, tmp_path, monkeypatch):
    """An initial scale of 2**30, far above what the tiny model's gradients allow: the doctor's
    settled scale from 8 fp32 steps, and the scale a real fp16 run backs off to in 16 steps."""
    flags = glue_flags(
        max_train_samples=128,
        max_train_steps=16,
        learning_rate=1e-3,
        fp16_init_scale=2**30,
        fp16_growth_interval=1000,
        output_dir=tmp_path / "run",
    )
    report = doctor.diagnose(glue, "bert_glue", flags, probe_steps=8, timed_steps=1)
    risk = report["fp16_risk"]
    monkeypatch.setattr(glue, "Accelerator", Fp16OnCpu)
    results = train(glue, [*flags, "--mixed_precision", "fp16"])
    assert results["skipped_steps"] >= 3  # the real run did back off
    assert risk["settled_loss_scale"] / 2 <= results["loss_scale"] <= risk["settled_loss_scale"] * 2
    assert abs(results["skipped_steps"] - risk["initial_skipped_steps"]) <= 1


def test_the_command_writes_its_report(tmp_path):
    """`amp-recipes doctor` as a user runs it: doctor.json and doctor.md, fp32 and bf16 timed on
    this CPU, a recommendation line per precision."""
    flags = [str(f) for f in glue_flags(max_train_samples=32, output_dir=tmp_path / "unused")]
    done = run(
        [
            sys.executable,
            "-m",
            "amp_recipes.cli",
            "doctor",
            "--recipe",
            "bert_glue",
            "--report_dir",
            tmp_path / "report",
            "--probe_steps",
            3,
            "--timed_steps",
            2,
            "--",
            *flags,
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "doctor.json").read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert set(report["speed"]) == set(doctor.precisions_to_time(device)) and report["probe_steps"] == 3
    assert all(
        figures["step_time_s"] > 0 and figures["peak_memory_bytes"] > 0
        for figures in report["speed"].values()
    )
    assert {advice["precision"] for advice in report["recommendation"]} == {"fp16", "bf16"}
    page = (tmp_path / "report" / "doctor.md").read_text()
    assert page.startswith("# Precision doctor: bert_glue") and "## Recommendation" in page
    assert not (tmp_path / "unused").exists()  # the doctor trains nothing the recipe would save
