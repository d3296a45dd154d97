"""A researcher's own server optimizer and tensor-group rule (README "Writing a strategy":
``Strategy(server_optimizer=..., groups=...)``) through the round loop with real tasks and the in-memory pool: a
step or group update whose tensors are not those it was given is refused in the round that made it, naming the
part, instead of becoming the server's state (which the clients then refused next round as "another task's
model", which a one-round run kept as its final model, or which raised a KeyError or AttributeError)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client.state import ClientStateStore
from fedcore.algorithms.scaffold import ControlRule, scaffold
from fedcore.errors import ConfigError, RoundFailed
from fedcore.server_opt import ServerSGD
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, initial_parameters, trainable_names
from fedcore.tensors import NamedArrays
from server.round_loop import RoundConfig, initial_state, run_rounds
from simulations.inmemory import InMemoryPool


def model() -> nn.Module:
    return nn.Linear(4, 3)


def data(cid: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(int(cid[1:]))
    x = torch.randn(20, 4, generator=g)
    return x, (x[:, 0] > 0).long()


class FaultyStep:
    """The plain average (FedAvg's step), then one fault of ``mode``."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def init(self, params: NamedArrays, **_: object) -> NamedArrays:
        return {}

    def step(self, params: NamedArrays, average: NamedArrays, state: NamedArrays, **_: object) -> tuple[object, ...]:
        out: dict[str, object] = {n: np.array(a, copy=True) for n, a in average.items()}
        weight = out["weight"]
        assert isinstance(weight, np.ndarray)
        if self.mode == "transposed":
            out["weight"] = weight.T.copy()
        elif self.mode == "float64":
            out["weight"] = weight.astype(np.float64)
        elif self.mode == "missing":
            del out["bias"]
        elif self.mode == "list":
            out["weight"] = weight.tolist()
        elif self.mode == "nan":
            weight[0, 0] = np.nan
        return out, {}


def run(optimizer: object, rounds: int) -> None:
    strategy = Strategy(
        fit=FitConfig(lr=0.1),
        sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=2),
        server_optimizer=optimizer,  # type: ignore[arg-type]
    )
    pool = InMemoryPool(["c0", "c1"], lambda cid: SupervisedTask(model_fn=model, train_data=data(cid)))
    init = initial_state(initial_parameters(model, 0), strategy, trainable=trainable_names(model))
    run_rounds(pool, strategy, init, RoundConfig(num_rounds=rounds, max_round_attempts=1))


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("transposed", "tensor 'weight' with shape (4, 3) and dtype float32, where it was given (3, 4) float32"),
        ("float64", "tensor 'weight' with shape (3, 4) and dtype float64, where it was given (3, 4) float32"),
        ("missing", "returned other tensors than it was given: missing ['bias']"),
        ("list", "returned 'weight' as a list, not a numpy array"),
    ],
)
def test_a_step_that_is_not_the_model_fails_its_own_round_naming_the_optimizer(mode: str, says: str) -> None:
    for rounds in (1, 2):  # one round: it would have been the final model; two: the clients would have been blamed
        with pytest.raises(RoundFailed) as caught:
            run(FaultyStep(mode), rounds)
        assert caught.value.round == 1
        assert "FaultyStep.step" in caught.value.message
        assert says in caught.value.message
        assert "another model" not in caught.value.message  # not the clients' task


def test_a_non_finite_step_of_an_optimizer_without_lr_gives_no_server_lr_advice() -> None:
    with pytest.raises(RoundFailed) as caught:
        run(FaultyStep("nan"), 1)
    assert "server step made the new global model non-finite" in caught.value.message
    assert "now None" not in caught.value.message
    with pytest.raises(RoundFailed, match=r"Lower the server learning rate \(--server-lr, now 1e\+300\)"):
        run(ServerSGD(lr=1e300), 1)  # a built-in optimizer's step that overflows float32: its lr is named


class NoParameters(nn.Module):
    """A model without tensors (a fixed function): nothing to federate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :3]


def test_a_model_without_tensors_is_refused_before_any_round_with_what_to_do() -> None:
    strategy = Strategy(sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=2))
    pool = InMemoryPool(["c0", "c1"], lambda cid: SupervisedTask(model_fn=NoParameters, train_data=data(cid)))
    with pytest.raises(ConfigError, match=r"the initial model has no tensors .*build_model must return a model with"):
        run_rounds(pool, strategy, initial_parameters(NoParameters, 0), RoundConfig(num_rounds=1))


@dataclass(frozen=True, kw_only=True)
class FaultyControl(ControlRule):
    """SCAFFOLD's control-variate rule, then one fault of ``mode`` in the new server state."""

    mode: str = ""

    def update(self, state: NamedArrays, combined: NamedArrays, *, accepted: int, available: int) -> NamedArrays:
        out: dict[str, object] = dict(super().update(state, combined, accepted=accepted, available=available))
        weight = out["weight"]
        assert isinstance(weight, np.ndarray)
        if self.mode == "transposed":
            out["weight"] = weight.T.copy()
        elif self.mode == "missing":
            del out["bias"]
        elif self.mode == "list":
            out["weight"] = weight.tolist()
        return out  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("transposed", "tensor 'weight' with shape (4, 3) and dtype float32, where it was given (3, 4) float32"),
        ("missing", "returned other tensors than it was given: missing ['bias']"),
        ("list", "returned 'weight' as a list, not a numpy array"),
    ],
)
def test_a_group_update_that_is_not_its_state_fails_its_own_round_naming_the_rule(
    mode: str, says: str, tmp_path: Path
) -> None:
    fit, sampling = FitConfig(lr=0.1), SamplingConfig(fraction_fit=1.0, min_fit_clients=2)
    strategy = replace(
        scaffold(fit=fit, sampling=sampling, server_lr=1.0), groups={"control": FaultyControl(mode=mode)}
    )
    pool = InMemoryPool(
        ["c0", "c1"],
        lambda cid: SupervisedTask(model_fn=model, train_data=data(cid)),
        state=ClientStateStore(tmp_path),
    )
    init = initial_state(initial_parameters(model, 0), strategy, trainable=trainable_names(model))
    with pytest.raises(RoundFailed) as caught:
        run_rounds(pool, strategy, init, RoundConfig(num_rounds=2, max_round_attempts=1))
    assert caught.value.round == 1
    assert "the FaultyControl.update of tensor group 'control' returned" in caught.value.message
    assert says in caught.value.message
