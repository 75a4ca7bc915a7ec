"""The library pieces behind the recipes' fp16 telemetry, on small hand-built models."""

import math

import pytest
import torch
from conftest import Fp16OnCpu, reset_accelerate

from amp_recipes.telemetry import FP16_MAX, ActivationMonitor, NonFiniteLocator, StepTelemetry


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
        assert telemetry.step_skipped() is expect_skip
        optimizer.zero_grad()
        if factor == math.inf and telemetry.skipped_steps == 1:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert telemetry.should_stop() and telemetry.consecutive_skipped == 2
    assert telemetry.scale_record() == {
        "loss_scale": 2.0**14 / 8,
        "skipped_steps": 3,
        "skipped_step_rate": 0.75,
        "effective_optimizer_steps": 1,
    }
