"""What the run reports as its precision, and who chose it."""

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from amp_recipes.precision import describe_precision, precision_source


@pytest.fixture
def fresh_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_fp16_on_cpu_is_reported_as_fp32(fresh_state, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    record = describe_precision(Accelerator(mixed_precision="fp16", cpu=True), "fp16")
    assert record["mixed_precision_requested"] == "fp16"
    assert record["precision_in_effect"] == "fp32"
    assert "accelerate runs fp32 on a cpu device" in record["precision_note"]


def test_bf16_on_cpu_uses_autocast(fresh_state, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    record = describe_precision(accelerator, "bf16")
    assert record["precision_in_effect"] == "bf16" and "precision_note" not in record
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    seen = []
    model[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    accelerator.prepare(model)(torch.ones(2, 8))
    assert seen == [torch.bfloat16]  # autocast really is on (accelerate casts the output back to fp32)


def test_fp16_path_with_a_grad_scaler_is_fp16(fresh_state):
    # The CPU fp16 test fixture of ../shared/GUIDE.md: accelerate's real fp16 path.
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu")
    assert describe_precision(accelerator, None)["precision_in_effect"] == "fp16"


def test_precision_source(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert precision_source(None) == "default (no mixed precision)"
    assert precision_source("bf16") == "--mixed_precision flag"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert precision_source(None) == "accelerate launch / config file (ACCELERATE_MIXED_PRECISION)"
    assert (
        precision_source("bf16") == "--mixed_precision flag (bf16; overrides accelerate launch/config's fp16)"
    )
