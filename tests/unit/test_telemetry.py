"""The library pieces behind the recipes' fp16 telemetry, on small hand-built models."""

import math

import pytest
import torch
from conftest import Fp16OnCpu, reset_accelerate

from amp_recipes.training.telemetry import (
    FP16_MAX,
    ActivationMonitor,
    NonFiniteLocator,
    StepTelemetry,
    _tensors,
)


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_locator_names_the_innermost_module_of_a_forward_overflow():
    model = net()
    model[1].register_forward_hook(lambda module, inputs, output: output * math.inf)
    with NonFiniteLocator(model) as locator:
        model(torch.ones(2, 4)).sum().backward()
    assert locator.first() == "forward output of 1"  # not 2, which only inherited it


def test_locator_names_the_module_whose_output_gradient_overflowed():
    model = net()

    def infinite_gradient(module, inputs, output):
        output.register_hook(lambda grad: grad * math.inf)

    injection = model[0].register_forward_hook(infinite_gradient)
    with NonFiniteLocator(model) as locator:
        model(torch.ones(2, 4)).sum().backward()
    assert locator.first() == "gradient at the output of 0"
    injection.remove()
    with locator:  # reusable: a clean step finds nothing
        model(torch.ones(2, 4)).sum().backward()
    assert locator.first() is None


def test_activation_monitor_samples_one_forward_in_n_and_removes_its_hooks():
    model = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False), torch.nn.Dropout(0.0))
    torch.nn.init.constant_(model[0].weight, FP16_MAX / 10)
    monitor = ActivationMonitor(model, every=2)
    for value in (1.0, 3.0, 2.0, 4.0):  # forwards 1 and 3 are sampled
        model(torch.full((1, 1), value))
        assert not model[0]._forward_hooks  # hooks live only during a sampled forward
    assert monitor.read() == {"0": pytest.approx(0.2)}  # max(1, 2) / 10; Dropout not watched
    model.eval()
    model(torch.full((1, 1), 100.0))  # evaluation is not sampled
    assert monitor.read() == {"0": pytest.approx(0.2)}
    monitor.remove()
    model.train()
    model(torch.full((1, 1), 100.0))
    assert monitor.forwards == 4  # not counted any more after remove()


def test_activation_monitor_reads_negative_peaks_without_copying_the_activations():
    """max |activation| of a negative output too, from reductions only: a sampled forward
    allocates a few scalars more than an unsampled one, not a copy of every module's output."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllocatedBytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in _tensors([args, kwargs or {}])}
            for tensor in _tensors(out):  # new storage only: a view (detach) allocates nothing
                if tensor.untyped_storage().data_ptr() not in inputs:
                    self.total += tensor.untyped_storage().nbytes()
            return out

    model = torch.nn.Sequential(torch.nn.Linear(64, 256, bias=False), torch.nn.Linear(256, 64, bias=False))
    torch.nn.init.constant_(model[0].weight, -1.0)
    torch.nn.init.constant_(model[1].weight, 0.5)
    monitor = ActivationMonitor(model, every=2)
    allocated = []
    for _ in range(2):  # forward 1 is sampled, forward 2 is not
        with torch.no_grad(), AllocatedBytes() as mode:
            model(torch.ones(32, 64))
        allocated.append(mode.total)
    assert monitor.read() == {
        "1": pytest.approx(64 * 256 * 0.5 / FP16_MAX),
        "0": pytest.approx(64 / FP16_MAX),
    }
    outputs = 32 * 256 * 4 + 32 * 64 * 4  # what abs() would copy
    assert allocated[0] - allocated[1] < 64 * 4 < outputs  # a few scalars per module


@pytest.fixture
def fp16_accelerator():
    reset_accelerate()
    yield Fp16OnCpu(mixed_precision="fp16", cpu=True)
    reset_accelerate()


def test_step_telemetry_sees_a_fused_optimizers_skipped_step(fp16_accelerator):
    """GradScaler calls a fused optimizer even on overflow (it skips inside), so accelerate's
    step_was_skipped cannot see it; the loss scale can."""
    accelerator = fp16_accelerator
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    telemetry = StepTelemetry(accelerator, model, max_consecutive_skipped=2)
    before = [p.detach().clone() for p in model.parameters()]
    for factor, expect_skip in ((math.inf, True), (1.0, False), (math.inf, True), (math.inf, True)):
        loss = model(torch.ones(2, 4)).sum() * factor
        accelerator.backward(loss)
        optimizer.step()
        assert telemetry.after_optimizer_step() is expect_skip
        optimizer.zero_grad()
        if factor == math.inf and telemetry.skipped_steps == 1:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert telemetry.too_many_skips() and telemetry.consecutive_skipped == 2
    assert telemetry.scale_record() == {
        "loss_scale": 2.0**14 / 8,
        "skipped_steps": 3,
        "skipped_step_rate": 0.75,
        "effective_optimizer_steps": 1,
    }


DTENSOR_GRAD_NORM = """
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from accelerate import Accelerator
from amp_recipes.training.telemetry import StepTelemetry

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
# What FSDP2 hands to clip_grad_norm_: parameters and gradients sharded as DTensors.
weight = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)]))
weight.grad = distribute_tensor(torch.full((4, 4), 1.0), mesh, [Shard(0)])
norm = torch.nn.utils.clip_grad_norm_([weight], 10.0)
assert type(norm).__name__ == "DTensor", type(norm)
telemetry = StepTelemetry(Accelerator(cpu=True), torch.nn.Linear(1, 1), 20)
telemetry.observe(torch.tensor(0.25), norm)
logs = telemetry.read()
print("grad_norm", logs["grad_norm"], "loss", logs["loss"])
dist.destroy_process_group()
"""


def test_an_fsdp2_dtensor_grad_norm_is_read_as_a_number(tmp_path):
    """Under FSDP2 accelerator.clip_grad_norm_ returns a DTensor (accelerate 1.15; 1.16 a plain
    tensor, which the same code reads); stacking it with plain tensors
    and calling .tolist() raised "not supported for tensor subclasses" at the first log line."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "dtensor_norm.py"
    script.write_text(DTENSOR_GRAD_NORM.format(port=port))
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "grad_norm 4.0 loss 0.25" in result.stdout  # sqrt(16 * 1.0**2)


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts what can copy a tensor to the host: .tolist(), .item(), .cpu() and .to(...)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.to):
            self.count += 1
        return func(*args, **kwargs)


def test_reading_many_modules_costs_one_host_copy():
    """ActivationMonitor.read and NonFiniteLocator.first copied each module's value to the host
    on its own (~200 synchronisations for BERT-base on a GPU); now one copy for all."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(12)])
    monitor = ActivationMonitor(model, every=1)
    model(torch.ones(2, 8))
    with HostReads() as reads:
        ranked = monitor.read(top=3)
    assert len(ranked) == 3 and reads.count == 1
    with NonFiniteLocator(model) as locator:
        model(torch.ones(2, 8)).sum().backward()
    with HostReads() as reads:
        assert locator.first() is None  # nothing overflowed: every flag read, forward and backward
    assert reads.count == 2  # one copy for the 12 forward flags, one for the 12 gradient flags


def test_several_processes_agree_on_a_stop_every_interval_steps_only():
    """The all-reduce + host read that makes every process stop together runs every
    CHECK_INTERVAL optimizer steps, not every step."""
    from amp_recipes.training.checkpoint import PreemptionHandler

    class TwoProcesses:
        num_processes, checks, triggered = 2, 0, False

        def set_trigger(self):
            self.triggered = True

        def check_trigger(self):
            self.checks += 1
            return self.triggered

    handler, accelerator = PreemptionHandler(), TwoProcesses()
    try:
        interval = PreemptionHandler.CHECK_INTERVAL
        stops = [handler.should_stop(accelerator, step) for step in range(1, 2 * interval + 1)]
        assert accelerator.checks == 2 and not any(stops)
        handler.signal_name = "SIGTERM"  # a signal arrives after step 2 * interval
        stops = [handler.should_stop(accelerator, step) for step in range(2 * interval + 1, 3 * interval + 1)]
        assert stops == [False] * (interval - 1) + [True]
    finally:
        handler.restore()


def test_a_nonfinite_loss_stops_bf16_and_fp32_but_is_left_to_the_loss_scaler_under_fp16():
    """Without a torch GradScaler (fp32, bf16, and DeepSpeed's fp16, whose own loss scaler skips the
    step), the check before a save stops a run whose loss went non-finite, except under fp16."""
    from accelerate import Accelerator

    from amp_recipes.errors import TrainingDiverged

    accelerator = Accelerator(cpu=True)
    try:
        telemetry = StepTelemetry(accelerator, torch.nn.Linear(2, 2), max_consecutive_skipped=3)
        telemetry.observe(torch.tensor(float("nan")))
        telemetry.check_finite(1, "fp16")  # DeepSpeed fp16: its scaler's to handle
        for precision in ("bf16", "fp32"):
            with pytest.raises(TrainingDiverged, match=f"non-finite under {precision} between steps 0 and 1"):
                telemetry.check_finite(1, precision)
    finally:
        reset_accelerate()
