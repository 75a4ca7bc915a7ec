"""Gradient checkpointing, the memory lever beside mixed precision.

Mixed precision shrinks what each activation costs; gradient (activation) checkpointing keeps
fewer of them: each encoder layer's activations are dropped after the forward and recomputed
from the layer's input during the backward. The step costs about one more forward pass (a third
more compute for an encoder); the activation memory falls roughly by the number of layers.
`scripts/benchmark_precision.py --arms fp16,fp16+gradient_checkpointing` measures both on your
device."""

from transformers import PreTrainedModel

from amp_recipes.errors import InputError


def enable_gradient_checkpointing(model) -> None:
    """Checkpoint every layer, with torch's non-reentrant checkpoint (it works with autocast,
    torch.compile, FSDP2 and frozen inputs, and keeps dropout's random state for the recompute).

    transformers renamed the call (`activation_checkpointing_enable`, 5.2x; the old
    `gradient_checkpointing_enable` warns there and goes in v6): the new name where it exists."""
    if not isinstance(model, PreTrainedModel):
        raise InputError(
            f"--gradient_checkpointing checkpoints a transformers model's layers; {type(model).__name__} "
            "is a model of your own: wrap its layers in torch.utils.checkpoint.checkpoint instead."
        )
    kwargs = {"use_reentrant": False}
    # An encoder keeps no cache; said here, transformers does not warn that it turns use_cache off.
    model.config.use_cache = False
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def gradient_checkpointing_on(model) -> bool:
    """Whether the model checkpoints its layers (read from the model, under either name)."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return getattr(model, "is_gradient_checkpointing", False)  # a model of your own: off unless it says
