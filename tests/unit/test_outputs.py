"""amp_recipes.training.outputs.save_weights: a model of your own saved for safetensors' load_model."""

import torch
from safetensors.torch import load_model

from amp_recipes.training.outputs import save_weights


class TiedHead(torch.nn.Module):
    """An embedding and an output layer that share one weight, as a masked LM's decoder does."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 4)
        self.out = torch.nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight


def test_tied_weights_are_saved_once_and_load_back_tied(tmp_path):
    trained = TiedHead()
    with torch.no_grad():
        trained.embed.weight.mul_(3)
    state_dict = {name: tensor.clone() for name, tensor in trained.state_dict().items()}  # as gathered
    save_weights(tmp_path, state_dict, trained)

    fresh = TiedHead()
    load_model(fresh, tmp_path / "model.safetensors")  # strict: refuses a missing or extra name
    assert fresh.embed.weight.equal(trained.embed.weight) and fresh.out.weight is fresh.embed.weight
