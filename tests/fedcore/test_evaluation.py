"""Evaluation and training metrics against a plain torch computation, with an unequal last batch.

10 examples in batches of 4 give batches of 4, 4 and 2: a mean of batch means, or a sum divided by the number of
batches or by 3·4, differs from the true per-example mean, so a loss or accuracy divided by the wrong count fails.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

from client.runner import run_instruction
from fedcore.messages import EvaluateIns, EvaluateRes
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, central_evaluation, initial_parameters
from fedcore.tensors import NamedArrays, to_state_dict
from fedcore.training import evaluate_supervised, train_supervised


def model_fn() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g) * 2.0, torch.randint(0, 3, (n,), generator=g)


def reference(parameters: NamedArrays, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy per example and accuracy, in one plain forward pass in float64."""
    model = model_fn().double()
    model.load_state_dict({k: v.double() for k, v in to_state_dict(parameters).items()})
    with torch.no_grad():
        out = model(x.double())
        loss = float(nn.functional.cross_entropy(out, y))
        accuracy = float((out.argmax(dim=1) == y).double().mean())
    return loss, accuracy


@pytest.fixture(scope="module")
def parameters() -> NamedArrays:
    return initial_parameters(model_fn, seed=3)


def check(loss: float, accuracy: float, num_examples: int, parameters: NamedArrays, x: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
    ref_loss, ref_accuracy = reference(parameters, x, y)
    assert num_examples == len(y)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert accuracy == pytest.approx(ref_accuracy, abs=1e-12)
    # the data are chosen so that the wrong counts give visibly different numbers
    assert 0.0 < ref_accuracy < 1.0 and ref_loss > 0.1


def test_evaluate_supervised_equals_plain_torch(parameters: NamedArrays) -> None:
    x, y = data(10, seed=1)
    model = model_fn()
    model.load_state_dict(to_state_dict(parameters))
    result = evaluate_supervised(model, x, y, batch_size=4)
    check(result.loss, result.metrics["accuracy"], result.num_examples, parameters, x, y)


def test_client_side_evaluation_equals_plain_torch(parameters: NamedArrays) -> None:
    x, y = data(10, seed=2)
    task = SupervisedTask(model_fn=model_fn, train_data=data(6, seed=9), test_data=(x, y))
    res = run_instruction(task, EvaluateIns(round=2, parameters=parameters, batch_size=4), "c0")
    assert isinstance(res, EvaluateRes)
    check(res.loss, res.metrics["accuracy"], res.num_examples, parameters, x, y)


def test_server_side_evaluation_equals_plain_torch(parameters: NamedArrays) -> None:
    x, y = data(10, seed=3)
    evaluate = central_evaluation(SupervisedTask(model_fn=model_fn, test_data=(x, y)), batch_size=4)
    result = evaluate(parameters, 5)
    check(result.loss, result.metrics["accuracy"], result.num_examples, parameters, x, y)


def test_an_empty_split_reports_nan_with_zero_examples(parameters: NamedArrays) -> None:
    x, y = data(10, seed=4)
    task = SupervisedTask(model_fn=model_fn, train_data=(x, y), test_data=(x[:0], y[:0]))
    res = run_instruction(task, EvaluateIns(round=1, parameters=parameters, batch_size=4), "c0")
    assert isinstance(res, EvaluateRes)
    assert res.num_examples == 0 and np.isnan(res.loss) and res.metrics == {}


def test_train_loss_is_the_per_example_mean_of_the_last_epoch(parameters: NamedArrays) -> None:
    # the same SGD by hand: shuffle from the same generator, batches 4, 4, 2, the loss of each batch before its step
    x, y = data(10, seed=5)
    config = FitConfig(local_epochs=2, batch_size=4, lr=0.1)
    model = model_fn()
    model.load_state_dict(to_state_dict(parameters))
    result = train_supervised(model, x, y, config, generator=torch.Generator().manual_seed(42))

    ref = model_fn()
    ref.load_state_dict(to_state_dict(parameters))
    generator = torch.Generator().manual_seed(42)
    for _ in range(2):
        order = torch.randperm(10, generator=generator)
        losses = []
        for idx in (order[:4], order[4:8], order[8:]):
            loss = nn.functional.cross_entropy(ref(x[idx]), y[idx], reduction="sum")
            losses.append(float(loss.detach()))
            ref.zero_grad()
            (loss / len(idx)).backward()
            with torch.no_grad():
                params: Iterator[torch.Tensor] = ref.parameters()  # a Parameter's -= gives a Tensor
                for p in params:
                    assert p.grad is not None
                    p -= 0.1 * p.grad
    assert result.num_examples == 10
    assert result.metrics["train_loss"] == pytest.approx(sum(losses) / 10, rel=1e-5)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, ref.state_dict()[name], rtol=1e-5, atol=1e-6)
