"""amp_recipes.training.optim.training_schedule: the steps the learning-rate scheduler is created with."""

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from amp_recipes.training.optim import training_schedule


def flags(**overrides):
    values = dict(gradient_accumulation_steps=1, max_train_steps=None, num_train_epochs=2)
    values.update(warmup_ratio=0.1, num_warmup_steps=None)
    return SimpleNamespace(**{**values, **overrides})


@pytest.mark.parametrize(
    "processes, distributed_type, per_optimizer_step",
    [
        (1, DistributedType.NO, 1),
        (2, DistributedType.MULTI_GPU, 2),  # accelerate's prepared scheduler steps once per process
        (2, DistributedType.DEEPSPEED, 1),  # DeepSpeed's engine steps its own once
    ],
)
def test_warmup_is_counted_as_the_scheduler_counts_steps(processes, distributed_type, per_optimizer_step):
    """100 batches, 2 epochs: each process takes 100 / processes steps an epoch. --num_warmup_steps
    is in optimizer steps and --warmup_ratio a share of them, whoever steps the scheduler."""
    accelerator = SimpleNamespace(num_processes=processes, distributed_type=distributed_type)
    schedule = training_schedule(100, accelerator, flags())
    optimizer_steps = 2 * 100 // processes
    assert schedule.max_train_steps == optimizer_steps
    assert schedule.scheduler_steps == optimizer_steps * per_optimizer_step
    assert schedule.warmup_steps == int(0.1 * optimizer_steps * per_optimizer_step)
    explicit = training_schedule(100, accelerator, flags(num_warmup_steps=7, warmup_ratio=0.5))
    assert explicit.warmup_steps == 7 * per_optimizer_step  # overrides --warmup_ratio
    assert training_schedule(100, accelerator, flags(num_warmup_steps=0)).warmup_steps == 0
