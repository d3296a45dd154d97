"""``trainable_names``: which tensors of a model the server optimizer steps."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from client.flower import FlowerParameters
from fedcore.task import trainable_names


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter under two state-dict names
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_parameters_with_requires_grad_under_every_state_dict_name() -> None:
    names = trainable_names(Tied())
    assert names == {"embed.weight", "head.weight", "norm.weight", "norm.bias"}
    assert set(Tied().state_dict()) - names == {
        "norm.running_mean",
        "norm.running_var",
        "norm.num_batches_tracked",
        "frozen.weight",
        "frozen.bias",
    }


def test_a_constructor_is_built_on_the_meta_device_without_touching_the_global_random_state() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert trainable_names(Tied) == trainable_names(Tied())
    torch.manual_seed(0)
    assert trainable_names(Tied) is not None
    assert torch.equal(torch.rand(3), expected)


def test_a_constructor_that_cannot_run_on_meta_is_built_for_real() -> None:
    def needs_values() -> nn.Module:
        model = nn.Linear(3, 2)
        model.bias.requires_grad_(float(model.weight.abs().sum().item()) < 0)  # .item() fails on meta tensors
        return model

    assert trainable_names(needs_values) == {"weight"}


def test_a_model_of_buffers_only_leaves_every_floating_tensor_trainable() -> None:
    # a Flower NumPyClient's arrays: unnamed, held as buffers; the rule is "all trainable" (None), as in flwr
    module = FlowerParameters([np.zeros((2, 2), np.float32), np.array(1.0, np.float32)])
    assert trainable_names(module) is None


def test_state_elements_counts_parameters_and_buffers_once_without_building_for_real() -> None:
    """The 2NN by hand: 784*200 + 200 + 200*200 + 200 + 200*10 + 10; a BatchNorm adds its weight, bias, two running
    statistics and its batch counter; a tied weight counts once. The global random state is untouched."""
    from fedcore.task import state_elements
    from simulations.models import MLP2NN

    assert state_elements(lambda: MLP2NN(num_inputs=784, num_classes=10, hidden=200)) == 199_210
    assert state_elements(lambda: nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))) == 4 * 3 + 3 + 4 * 3 + 1

    def tied() -> nn.Module:
        model = nn.Sequential(nn.Linear(5, 5, bias=False), nn.Linear(5, 5, bias=False))
        model[1].weight = model[0].weight
        return model

    assert state_elements(tied) == 25
    before = torch.random.get_rng_state()
    state_elements(lambda: MLP2NN(num_inputs=784, num_classes=10, hidden=200))
    assert torch.equal(torch.random.get_rng_state(), before)


def test_state_elements_leaves_out_a_modules_extra_state() -> None:
    """A module's extra state (``get_extra_state``: any picklable object) is not a tensor and counts nothing."""
    from fedcore.task import state_elements

    class WithExtra(nn.Linear):
        def get_extra_state(self) -> dict[str, int]:
            return {"version": 2}

        def set_extra_state(self, state: object) -> None:
            pass

    assert state_elements(lambda: WithExtra(3, 2)) == 3 * 2 + 2
