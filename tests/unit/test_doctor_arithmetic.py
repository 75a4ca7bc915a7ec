"""amp_recipes.doctor's arithmetic: the share of gradients fp16 rounds to zero, read from the
exponent histogram, against a second method (casting the scaled gradient to fp16), and the loss
scale the GradScaler settles at."""

import math

import pytest
import torch

from amp_recipes.doctor import FP16_MAX, GradientProbe, settled_scale, zero_share


@pytest.mark.parametrize("log2_scale", [0, 10, 16, 24])
def test_the_zero_share_is_what_casting_to_fp16_rounds_to_zero(log2_scale):
    """A fixed gradient spanning 2**-50 .. 2**10 (with exact zeros, which do not count) reaches a
    module's output; the probe's histogram gives the same share as `(g * scale).half() == 0`."""
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    probe = GradientProbe(model)
    exponents = torch.randint(-50, 10, (32, 64), generator=generator).float()
    gradient = torch.randn(32, 64, generator=generator) * 2.0**exponents
    gradient[0, :5] = 0
    model(torch.randn(32, 64, requires_grad=True)).backward(gradient)
    scale = 2.0**log2_scale
    nonzero = gradient != 0
    independent = ((gradient * scale).half() == 0)[nonzero].double().mean().item()
    assert 0 < independent < 1
    assert zero_share(probe.exponents["0"], scale) == pytest.approx(independent, abs=1e-12)


@pytest.mark.parametrize("largest", [3.0, 1e-3, FP16_MAX / 1024, 7e4])
def test_the_settled_scale_is_the_largest_power_of_two_under_fp16s_maximum(largest):
    scale = settled_scale(largest)
    assert math.log2(scale).is_integer()
    assert largest * scale < FP16_MAX <= largest * scale * 2


def test_no_gradient_no_scale():
    assert math.isnan(settled_scale(0.0)) and math.isnan(settled_scale(math.inf))
