"""amp_recipes.measure.doctor's arithmetic: the share of gradients fp16 rounds to zero, read from the
exponent histogram, against a second method (casting the scaled gradient to fp16), and the loss
scale the GradScaler settles at."""

import math

import pytest
import torch

from amp_recipes.measure.doctor import (
    FP16_MAX,
    OVERFLOW,
    GradientProbe,
    initial_skips,
    settled_scale,
    zero_share,
)


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


@pytest.mark.parametrize("largest", [3.0, 1e-3, OVERFLOW / 2**10, 7e4])
@pytest.mark.parametrize("init_scale", [2.0**16, 1000.0, 2.0**30])
def test_the_settled_scale_is_the_largest_the_scaler_holds_below_fp16s_overflow(largest, init_scale):
    """The scaler's scales are its initial one times powers of two (growth 2, back-off 0.5)."""
    scale = settled_scale(largest, init_scale)
    assert math.log2(scale / init_scale).is_integer()
    assert largest * scale < OVERFLOW <= largest * scale * 2


def test_initial_skips_count_the_halvings_down_to_the_first_scale_below_overflow():
    """The GradScaler's own rule, step by step: skip and halve while the largest gradient times
    the scale overflows fp16 (65504 itself stays finite; from 65520 on it is inf)."""
    for largest, init_scale in [(64.0, 1000.0), (0.01, 2.0**30), (3.0, 2.0**16), (OVERFLOW / 2**20, 2.0**20)]:
        scale, skipped = init_scale, 0
        while torch.tensor(largest * scale, dtype=torch.float32).half().isinf():
            scale, skipped = scale / 2, skipped + 1
        assert initial_skips(largest, init_scale) == skipped, (largest, init_scale)
    assert float(torch.tensor(65519.0).half()) == FP16_MAX and torch.tensor(OVERFLOW).half().isinf()


def test_no_gradient_no_scale():
    assert math.isnan(settled_scale(0.0, 2.0**16)) and math.isnan(settled_scale(math.inf, 2.0**16))
    assert initial_skips(0.0, 2.0**16) is None
