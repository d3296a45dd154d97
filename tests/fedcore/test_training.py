"""Local SGD with the step taken inside backward (large models) equals one optimizer over all parameters."""

from __future__ import annotations

import re
from typing import cast

import pytest
import torch
from torch import nn

import fedcore.training as training
from fedcore.task import FitConfig
from fedcore.training import train_supervised

#: momentum (optimizer state), weight decay, FedProx, uneven batches, two epochs
CONFIG = FitConfig(local_epochs=2, batch_size=7, lr=0.05, momentum=0.9, weight_decay=1e-3, mu=0.1)


def net() -> nn.Sequential:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model[2].bias.requires_grad_(False)  # a frozen parameter is left alone either way
    return model


def train(threshold: int, monkeypatch: pytest.MonkeyPatch) -> tuple[nn.Sequential, float, list[int]]:
    """Train ``net()`` with the in-backward step from ``threshold`` elements on; also returns, for each parameter's
    completed gradient, how many parameters held a gradient at that moment (a hook registered before fedcore's)."""
    monkeypatch.setattr(training, "STEP_IN_BACKWARD_MIN_ELEMENTS", threshold)
    model = net()
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(40, 12, generator=gen), torch.randint(0, 4, (40,), generator=gen)
    params = [p for p in model.parameters() if p.requires_grad]
    global_parameters = {name: p.detach().clone() for name, p in model.named_parameters()}
    holding: list[int] = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: holding.append(sum(q.grad is not None for q in params)))
    result = train_supervised(
        model, x, y, CONFIG, generator=torch.Generator().manual_seed(9), global_parameters=global_parameters
    )
    return model, float(result.metrics["train_loss"]), holding


def test_the_step_inside_backward_trains_the_same_model_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    whole, whole_loss, whole_holding = train(1 << 40, monkeypatch)
    fused, fused_loss, fused_holding = train(0, monkeypatch)
    for (name, a), b in zip(whole.state_dict().items(), fused.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert fused_loss == whole_loss
    assert not torch.equal(cast(nn.Linear, whole[0]).weight, cast(nn.Linear, net()[0]).weight)  # it did train
    assert torch.equal(cast(nn.Linear, whole[2]).bias, cast(nn.Linear, net()[2]).bias)
    # one optimizer: every gradient exists by the last one's completion; in backward: at most the current one
    trainable = 5
    assert max(whole_holding) == trainable and max(fused_holding) == 1
    assert all(p.grad is None for p in fused.parameters())
    assert len(fused_holding) == len(whole_holding) == trainable * 2 * 6  # per parameter and step (2 x 6 batches)
    # fedcore's hooks are gone afterwards: a backward of the user's own leaves its gradients and steps nothing
    before = [p.detach().clone() for p in fused.parameters()]
    fused(torch.ones(3, 12)).sum().backward()
    assert all(p.grad is not None for p in fused.parameters() if p.requires_grad)
    assert all(torch.equal(p, b) for p, b in zip(fused.parameters(), before, strict=True))


def test_labels_beyond_the_models_classes_are_refused_by_name_before_the_loss_reads_them() -> None:
    """Training and evaluation with torch's cross-entropy refuse labels outside the model's 3 classes with a
    ClientTaskError naming them (on a GPU the loss's index would be a device-side assert, which no client can fail
    alone with); the ignored -100 trains as torch's loss takes it (the loss of a batch is over its other samples),
    and a loss of the user's own is left to itself."""
    from fedcore.errors import ClientTaskError
    from fedcore.training import evaluate_supervised

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=generator)
    config = FitConfig(local_epochs=1, batch_size=4, lr=0.1)
    bad = torch.tensor([0, 1, 2, 7, 1, -3, 0, 2])
    want = r"labels -3, 7 lie outside the model's 3 classes; give labels in 0\.\.2 \(or -100 to skip a sample\)"
    with pytest.raises(ClientTaskError, match=want):
        train_supervised(nn.Linear(4, 3), x, bad, config, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ClientTaskError, match=want):
        evaluate_supervised(nn.Linear(4, 3), x, bad)
    for dtype in (torch.int32, torch.uint8):  # other integer labels are checked too
        with pytest.raises(ClientTaskError, match=r"labels 7 lie outside"):
            train_supervised(
                nn.Linear(4, 3), x, bad.clamp(0).to(dtype), config, generator=torch.Generator().manual_seed(1)
            )
    with pytest.raises(NotImplementedError, match="index_select"):  # unsigned wider: left to torch, which says so
        train_supervised(nn.Linear(4, 3), x, bad.clamp(0).to(torch.uint16), config, generator=torch.Generator())
    ignored = torch.tensor([0, 1, -100, 2, 1, -100, 0, 2])
    torch.manual_seed(3)
    model, reference = nn.Linear(4, 3), nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    train_supervised(model, x, ignored, config, generator=torch.Generator().manual_seed(1))
    order = torch.randperm(8, generator=torch.Generator().manual_seed(1))  # the loop's shuffle, by hand
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for rows in order.split(4):
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference(x[rows]), ignored[rows]).backward()
        optimizer.step()
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value)

    def own_loss(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return nn.functional.cross_entropy(output, target.clamp(0, 2), reduction=reduction)

    train_supervised(nn.Linear(4, 3), x, bad, config, generator=torch.Generator().manual_seed(1), loss_fn=own_loss)


def test_evaluation_averages_over_the_labels_torch_counts() -> None:
    """Test loss and accuracy are means over the labels not ignored, as torch's mean cross-entropy counts them: a
    label per position for outputs (N, C, T), and none for -100; labels (N,) give the mean per example (batches of
    3 over 7 examples). Computed by hand with torch."""
    from fedcore.training import evaluate_supervised

    generator = torch.Generator().manual_seed(5)

    class PerPosition(nn.Module):  # (N, T, 4) -> (N, 3, T): three classes at each of T positions
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).transpose(1, 2)

    torch.manual_seed(0)
    x = torch.randn(7, 5, 4, generator=generator)
    y = torch.randint(0, 3, (7, 5), generator=generator)
    y[0, :2] = -100
    y[4, 3] = -100
    model = PerPosition()
    result = evaluate_supervised(model, x, y, batch_size=3)
    with torch.no_grad():
        out = model(x)
    kept = y != -100
    assert result.num_examples == 7
    assert result.loss == pytest.approx(float(nn.functional.cross_entropy(out, y)), rel=1e-6)
    assert result.metrics["accuracy"] == pytest.approx(float((out.argmax(1) == y)[kept].float().mean()), rel=1e-12)
    flat_x, flat_y = torch.randn(7, 4, generator=generator), torch.randint(0, 3, (7,), generator=generator)
    linear = nn.Linear(4, 3)
    per_example = evaluate_supervised(linear, flat_x, flat_y, batch_size=3)
    with torch.no_grad():
        logits = linear(flat_x)
    assert per_example.loss == pytest.approx(float(nn.functional.cross_entropy(logits, flat_y)), rel=1e-6)
    assert per_example.metrics["accuracy"] == float((logits.argmax(1) == flat_y).sum()) / 7
    none = evaluate_supervised(linear, flat_x, torch.full((7,), -100), batch_size=3)
    assert none.num_examples == 7 and none.metrics == {} and none.loss != none.loss  # NaN: nothing to measure


def test_a_supervised_task_refuses_data_that_are_not_a_pair_of_tensors() -> None:
    """numpy arrays (or one tensor, or a triple) given as a SupervisedTask's data are refused where the task is made,
    saying how to convert them, rather than failing inside training as an AttributeError."""
    import numpy as np

    from fedcore.errors import ConfigError
    from fedcore.supervised import SupervisedTask

    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    SupervisedTask(model_fn=lambda: nn.Linear(3, 2), train_data=(x, y), test_data=(x, y))
    for data, got in [
        ((x.numpy(), y.numpy()), "(ndarray, ndarray)"),
        ((x, np.asarray([0, 1, 0, 1])), "(Tensor, ndarray)"),
        (x, "Tensor"),
        ((x, y, y), "(Tensor, Tensor, Tensor)"),
    ]:
        for name in ("train_data", "test_data"):
            with pytest.raises(
                ConfigError, match=rf"^SupervisedTask's {name} must be a pair \(x, y\) of torch tensors, "
            ):
                SupervisedTask(model_fn=lambda: nn.Linear(3, 2), **{name: data})  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match=rf"got {re.escape(got)}; convert numpy arrays with torch.from_numpy"):
                SupervisedTask(model_fn=lambda: nn.Linear(3, 2), **{name: data})  # type: ignore[arg-type]
