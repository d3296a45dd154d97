"""Sample-level DP-SGD through Opacus (the dp-sgd client mod): per-example clipping against a plain torch
reference, the steps that really ran in the accountant, client state across rounds, BatchNorm refused/converted."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from torch import nn

from client.state import ClientStateStore
from fedcore.errors import ClientTaskError, ConfigError
from fedcore.messages import FitIns, FitRes
from fedcore.mods import ModContext, check_mods
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.task import FitConfig
from fedcore.training import train_supervised
from privacy.dp.config import PrivacyConfig, apply_dp
from privacy.dp.sgd import DPSGDMod, make_private_model
from simulations.config import load_recipe
from simulations.harness import run_simulation
from tests.privacy.test_dp import SMALL_DP


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.squeeze(1) - y) ** 2).mean()


def fit(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, mod: DPSGDMod, ctx: ModContext, config: FitConfig, rnd: int
) -> FitRes:
    params = {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}
    ins = FitIns(round=rnd, parameters=params, config=config, seed=0)

    def train(ins: FitIns) -> FitRes:
        result = train_supervised(model, x, y, ins.config, generator=torch.Generator().manual_seed(rnd), loss_fn=mse)
        trained = {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}
        return FitRes(
            client_id="a", round=rnd, parameters=trained, num_examples=result.num_examples, metrics=result.metrics
        )

    return mod(ins, ctx, train)


def test_one_step_clips_every_example_gradient(tmp_path: Path) -> None:
    """w = [1, 1], examples x1 = [3, 0] (y 0) and x2 = [0, 0.1] (y 0), loss mean (w.x - y)^2. Per-example gradients
    2 (w.x) x: g1 = [18, 0] (norm 18, clipped to C = 1: [1, 0]), g2 = [0, 0.02] (kept). The step with lr 1 and
    noise ~ 0 is w - ([1, 0] + [0, 0.02]) / 2 = [0.5, 0.99]."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1.0]]))
    x, y = torch.tensor([[3.0, 0.0], [0.0, 0.1]]), torch.zeros(2)
    mod = DPSGDMod(noise_multiplier=1e-9, max_grad_norm=1.0)
    ctx = ModContext(client_id="a", model=model, state=ClientStateStore(tmp_path).entry("a"))
    reply = fit(model, x, y, mod, ctx, FitConfig(lr=1.0, batch_size=2, local_epochs=1), 1)
    np.testing.assert_allclose(reply.parameters["weight"], [[0.5, 0.99]], atol=1e-6)
    assert not hasattr(model.weight, "grad_sample") or model.weight.grad_sample is None  # hooks are gone


def test_the_accountant_counts_the_steps_that_ran_across_rounds(tmp_path: Path) -> None:
    """20 examples, batch 8: 3 steps an epoch; 2 epochs in round 1, then max_steps = 4 in round 2."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(20, 3), torch.randn(20)
    mod = DPSGDMod(noise_multiplier=1.2, max_grad_norm=0.5, delta=1e-5)
    ctx = ModContext(client_id="a", model=model, state=ClientStateStore(tmp_path).entry("a"))
    first = fit(model, x, y, mod, ctx, FitConfig(lr=0.1, batch_size=8, local_epochs=2), 1)
    reference = RDPAccountant()
    reference.history = [(1.2, 8 / 20, 6)]
    assert first.metrics["sgd_epsilon"] == reference.get_epsilon(1e-5)
    second = fit(
        model,
        x,
        y,
        mod,
        ModContext(client_id="a", model=model, state=ClientStateStore(tmp_path).entry("a")),
        FitConfig(lr=0.1, batch_size=8, local_epochs=5, max_steps=4),
        2,
    )
    reference.history = [(1.2, 8 / 20, 6), (1.2, 8 / 20, 4)]
    assert second.metrics["sgd_epsilon"] == reference.get_epsilon(1e-5)
    stored = ClientStateStore(tmp_path).entry("a").get("dp-sgd")
    assert stored is not None and list(stored["steps"]) == [6, 4]


def test_batchnorm_is_refused_and_converted(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    mod = DPSGDMod(noise_multiplier=1.0, max_grad_norm=1.0)
    ctx = ModContext(client_id="a", model=model, state=ClientStateStore(tmp_path).entry("a"))
    ins = FitIns(round=1, parameters={}, config=FitConfig(), seed=0)
    with pytest.raises(ClientTaskError, match=r"BatchNorm.*make_private_model"):
        mod(ins, ctx, lambda i: pytest.fail("trained a model Opacus cannot handle"))
    fixed, changes = make_private_model(model)
    assert changes == ["1: BatchNorm1d -> GroupNorm"]
    assert isinstance(fixed, nn.Sequential)
    assert isinstance(fixed[1], nn.GroupNorm)


def test_dp_sgd_is_a_client_option() -> None:
    strategy = apply_dp(
        Strategy(sampling=SamplingConfig(min_fit_clients=2)),
        PrivacyConfig(dp_sgd=True, dp_sgd_noise_multiplier=0.8, dp_sgd_max_grad_norm=2.0),
    )
    assert strategy.mods[0].name == "dp-sgd" and strategy.mods[0].params["noise_multiplier"] == 0.8
    assert strategy.aggregator.name == "mean"  # client-level DP stays off
    check_mods(strategy.mods)
    with pytest.raises(ConfigError, match="max_grad_norm"):
        DPSGDMod(noise_multiplier=1.0, max_grad_norm=math.inf)


def test_simulation_with_dp_sgd_and_central_dp(tmp_path: Path) -> None:
    """Both levels at once through the simulation's real clients: every client reports its sample-level epsilon
    (history column train_sgd_epsilon), the server its client-level epsilon."""
    config = load_recipe(
        None,
        [*SMALL_DP, "rounds=2", "privacy.dp='central'", "privacy.dp_sgd=true", f"output.dir={str(tmp_path)!r}"],
    )
    history = run_simulation(config, echo=lambda _: None).history
    assert list(history["round"]) == [0, 1, 2]
    sgd = history["train_sgd_epsilon"].iloc[1:]
    assert (sgd > 0).all() and np.isfinite(sgd).all()
    assert (history["epsilon"].iloc[1:] > 0).all()


def test_the_noise_does_not_follow_from_the_seed_and_has_the_configured_scale(tmp_path: Path) -> None:
    """A zero-loss model (every per-example gradient is 0) moves by the noise alone: one step with lr 1 and batch B
    moves each weight by -N(0, (sigma C)^2) / B. Two runs with the same seed, round and client draw different noise
    (it is seeded from the OS, not from what the server sends), and over 20,000 weights its std is sigma C / B."""
    sigma, clip, batch = 2.0, 0.5, 4
    moves = []
    for run in range(2):
        model = nn.Linear(20_000, 1, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        x, y = torch.zeros(batch, 20_000), torch.zeros(batch)
        torch.manual_seed(0)  # what the client runner does with the round's seed, which the server sends
        mod = DPSGDMod(noise_multiplier=sigma, max_grad_norm=clip)
        ctx = ModContext(client_id="a", model=model, state=ClientStateStore(tmp_path / str(run)).entry("a"))
        reply = fit(model, x, y, mod, ctx, FitConfig(lr=1.0, batch_size=batch, local_epochs=1), 1)
        moves.append(np.asarray(reply.parameters["weight"], np.float64).ravel())
    assert not np.array_equal(moves[0], moves[1])
    for move in moves:
        assert abs(move.std() / (sigma * clip / batch) - 1) < 0.05  # 20,000 draws: std's relative error ~0.5%
        assert abs(move.mean()) < 5 * sigma * clip / batch / math.sqrt(move.size)
