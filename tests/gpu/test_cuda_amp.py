"""accelerate's mixed precision on one CUDA GPU, in this process (skipped without CUDA).

accelerate's real fp16 path: GradScaler active, a skipped step on an injected overflow with the
scheduler held, scaler state through save_state/load_state; the bf16 path; TF32 and torch.compile
really compiling; our hardware facts. The recipe itself on the GPU: test_recipe_on_a_gpu.py.
"""

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.test_utils import require_cuda

from amp_recipes.amp.hardware import hardware_record
from amp_recipes.amp.precision import describe_precision


@pytest.fixture(autouse=True)
def fresh_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def tiny_setup(mixed_precision, fused=False):
    accelerator = Accelerator(mixed_precision=mixed_precision)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    # fused=True is what the recipes run on CUDA (make_optimizer); its skip path differs.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-3, fused=fused or None, foreach=None if fused else True
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def train_step(accelerator, model, optimizer, scheduler, scale_loss=1.0):
    inputs = torch.randn(8, 16, device=accelerator.device)
    loss = model(inputs).float().pow(2).mean() * scale_loss
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


@require_cuda
def test_fp16_runs_autocast_with_a_grad_scaler():
    accelerator, model, *_ = tiny_setup("fp16")
    assert isinstance(accelerator.scaler, torch.amp.GradScaler) and accelerator.scaler.is_enabled()
    assert describe_precision(accelerator, "fp16")["precision_in_effect"] == "fp16"
    seen = []
    model[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    model(torch.randn(2, 16, device=accelerator.device))
    assert seen == [torch.float16]


@require_cuda
def test_injected_overflow_skips_the_step_and_holds_the_scheduler():
    accelerator, model, optimizer, scheduler = tiny_setup("fp16")
    train_step(accelerator, model, optimizer, scheduler)
    assert not optimizer.step_was_skipped
    scale, lr, epoch = (
        accelerator.scaler.get_scale(),
        scheduler.get_last_lr()[0],
        scheduler.scheduler.last_epoch,
    )
    weights = [p.detach().clone() for p in model.parameters()]
    train_step(accelerator, model, optimizer, scheduler, scale_loss=float("inf"))
    assert optimizer.step_was_skipped
    assert accelerator.scaler.get_scale() == scale / 2  # backoff factor 0.5
    assert scheduler.scheduler.last_epoch == epoch and scheduler.get_last_lr()[0] == lr
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


@require_cuda
def test_injected_overflow_with_the_recipes_fused_adamw_is_seen_by_telemetry():
    """With fused AdamW the GradScaler always calls optimizer.step (the kernel skips inside), so
    accelerate's step_was_skipped misses the skip; StepTelemetry, which the recipes use to hold
    the scheduler, must see it, and the weights must not move."""
    from amp_recipes.training.telemetry import StepTelemetry

    accelerator, model, optimizer, scheduler = tiny_setup("fp16", fused=True)
    telemetry = StepTelemetry(accelerator, model, max_consecutive_skipped=20)

    def step(scale_loss=1.0):
        inputs = torch.randn(8, 16, device=accelerator.device)
        accelerator.backward(model(inputs).float().pow(2).mean() * scale_loss)
        optimizer.step()
        skipped = telemetry.after_optimizer_step()
        if not skipped:
            scheduler.step()
        optimizer.zero_grad()
        return skipped

    assert step() is False
    scale, epoch = accelerator.scaler.get_scale(), scheduler.scheduler.last_epoch
    weights = [p.detach().clone() for p in model.parameters()]
    assert step(scale_loss=float("inf")) is True
    assert accelerator.scaler.get_scale() == scale / 2 and scheduler.scheduler.last_epoch == epoch
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert (telemetry.skipped_steps, telemetry.optimizer_steps) == (1, 2)
    assert step() is False and scheduler.scheduler.last_epoch == epoch + 1


@require_cuda
def test_scaler_state_survives_save_and_load(tmp_path):
    accelerator, model, optimizer, scheduler = tiny_setup("fp16")
    train_step(accelerator, model, optimizer, scheduler, scale_loss=float("inf"))  # scale 65536 -> 32768
    for _ in range(3):
        train_step(accelerator, model, optimizer, scheduler)
    saved = accelerator.scaler.state_dict()
    accelerator.save_state(tmp_path / "ckpt")
    AcceleratorState._reset_state(True)
    accelerator, model, optimizer, scheduler = tiny_setup("fp16")
    assert accelerator.scaler.get_scale() == 65536.0
    accelerator.load_state(tmp_path / "ckpt")
    restored = accelerator.scaler.state_dict()
    assert restored["scale"] == saved["scale"] == 32768.0
    assert restored["_growth_tracker"] == saved["_growth_tracker"] == 3


@require_cuda
def test_bf16_runs_autocast_without_a_scaler():
    if not torch.cuda.is_bf16_supported(including_emulation=False):  # native, as the recipes require
        pytest.skip("bf16 needs a GPU of compute capability 8.0 or newer")
    accelerator, model, *_ = tiny_setup("bf16")
    assert accelerator.scaler is None
    assert describe_precision(accelerator, "bf16")["precision_in_effect"] == "bf16"


@require_cuda
def test_a_compiled_fp32_model_compiles_and_runs_the_tf32_accelerate_turns_on():
    """accelerate's state.py sets allow_tf32 for a dynamo run without mixed precision on CUDA; the
    prepared model is compiled by inductor (dynamo's own counter of the graphs it compiled)."""
    from torch._dynamo.utils import counters

    from amp_recipes.amp.hardware import tf32_matmul_enabled

    # Saved and restored through the legacy flag, the API accelerate sets it with: restoring only
    # the new one (fp32_precision) would leave the two disagreeing, which torch refuses at the next
    # cuBLAS call.
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        accelerator = Accelerator(mixed_precision="no", dynamo_backend="inductor")
        major, _ = torch.cuda.get_device_capability()
        assert tf32_matmul_enabled() is True
        expected = "tf32" if major >= 8 else "fp32"
        assert describe_precision(accelerator, "no")["precision_in_effect"] == expected
        torch._dynamo.reset()  # graphs an earlier test compiled would be reused, not counted
        model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()))
        graphs = counters["stats"]["unique_graphs"]
        inputs = torch.randn(8, 64, device=accelerator.device)
        torch.testing.assert_close(model(inputs), model._orig_mod(inputs))
        assert counters["stats"]["unique_graphs"] > graphs  # inductor compiled it, not eager fallback
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@require_cuda
def test_hardware_facts_match_the_device():
    record = hardware_record(torch.device("cuda"))
    major, minor = torch.cuda.get_device_capability()
    assert record["compute_capability"] == f"{major}.{minor}"
    assert record["tensor_cores"] == (major >= 7)
    assert record["bf16_supported"] == (major >= 8)
    assert record["device_name"] == torch.cuda.get_device_name()
