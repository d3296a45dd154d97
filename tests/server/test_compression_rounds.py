"""Compressed updates in real rounds (in-memory pool): decoded before the aggregator, close to the uncompressed
run, a client's tampered encoding rejected without touching the global model; the recipe option and what it
refuses."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client.state import ClientStateStore
from fedcore.cli import server_options, simulate_options
from fedcore.compression import INDEX_GROUP, SCALE_GROUP
from fedcore.errors import ConfigError
from fedcore.messages import FitIns, FitRes, ModSpec
from fedcore.mods import CallNext, ModContext, register
from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig, build_strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import EvalResult, FitConfig, Task, TrainContext, TrainResult, initial_parameters
from privacy.dp.config import PrivacyConfig, apply_dp
from server.round_loop import RoundConfig, ServerState, run_rounds
from simulations.inmemory import InMemoryPool

IDS = ["a", "b", "c"]
SEED = 2
FIT = FitConfig(local_epochs=2, batch_size=16, lr=0.1)
ALL = SamplingConfig(fraction_fit=1.0, min_fit_clients=3)


def model_fn() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def data(cid: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(IDS.index(cid) + 1)
    return torch.randn(48, 32, generator=g), torch.randint(0, 4, (48,), generator=g)


class Failing:
    """A client whose training raises (it then sends no update)."""

    def __init__(self, cid: str) -> None:
        self.inner = SupervisedTask(model_fn=model_fn, train_data=data(cid))

    def build_model(self) -> nn.Module:
        return model_fn()

    def train(self, model: nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        raise RuntimeError("this client fails")

    def evaluate(self, model: nn.Module, batch_size: int) -> EvalResult:
        return self.inner.evaluate(model, batch_size)


def run(strategy: Strategy, tmp: Path, *, rounds: int = 2, failing: str | None = None) -> ServerState:
    def make(cid: str) -> Task:
        return Failing(cid) if cid == failing else SupervisedTask(model_fn=model_fn, train_data=data(cid))

    pool = InMemoryPool(IDS, make, state=ClientStateStore(tmp / "clients"))
    final, _ = run_rounds(pool, strategy, initial_parameters(model_fn, SEED), RoundConfig(num_rounds=rounds, seed=SEED))
    return final


def compressed(method: str, **params: float | int) -> Strategy:
    return Strategy(fit=FIT, sampling=ALL, mods=(ModSpec("compress", {"method": method, **params}),))


@pytest.mark.parametrize(("method", "atol"), [("float16", 1e-5), ("bfloat16", 1e-3), ("int8", 1e-3)])
def test_compressed_rounds_stay_close_to_the_uncompressed_run(tmp_path: Path, method: str, atol: float) -> None:
    plain = run(Strategy(fit=FIT, sampling=ALL), tmp_path / "plain")
    squeezed = run(compressed(method), tmp_path / method)
    for name, value in plain.parameters.items():
        assert squeezed.parameters[name].dtype == value.dtype
        np.testing.assert_allclose(squeezed.parameters[name], value, rtol=0, atol=atol, err_msg=name)
        assert not np.array_equal(squeezed.parameters[name], value)  # it did go through the codec


def test_topk_of_everything_equals_the_uncompressed_run_within_rounding(tmp_path: Path) -> None:
    plain = run(Strategy(fit=FIT, sampling=ALL), tmp_path / "plain")
    everything = run(compressed("topk", fraction=1.0), tmp_path / "topk")
    for name, value in plain.parameters.items():
        np.testing.assert_allclose(everything.parameters[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


class Tamper:
    """A test mod declared outside ``compress``: client ``target`` spoils its encoded reply in one way."""

    def __init__(self, target: str, how: str) -> None:
        self.target, self.how = target, how

    def __call__(self, instruction: FitIns, context: ModContext, call_next: CallNext) -> FitRes:
        reply = call_next(instruction)
        if context.client_id != self.target:
            return reply
        if self.how == "scale":
            scales = {n: np.full_like(s, np.nan) for n, s in reply.groups[SCALE_GROUP].items()}
            return replace(reply, groups={**reply.groups, SCALE_GROUP: scales})
        if self.how == "index":
            index = {n: i + 10_000 for n, i in reply.groups[INDEX_GROUP].items()}
            return replace(reply, groups={**reply.groups, INDEX_GROUP: index})
        return replace(reply, parameters={n: a.astype(np.float32) for n, a in reply.parameters.items()})


register("test-tamper", Tamper)


@pytest.mark.parametrize(("method", "how", "reason"), [("int8", "scale", "finite"), ("topk", "index", "0..")])
def test_a_tampered_encoding_is_rejected_and_the_model_is_that_of_the_others(
    tmp_path: Path, method: str, how: str, reason: str
) -> None:
    mods = (ModSpec("test-tamper", {"target": "b", "how": how}), ModSpec("compress", {"method": method}))
    strategy = Strategy(fit=FIT, sampling=replace(ALL, min_fit_clients=2), mods=mods)
    pool = InMemoryPool(
        IDS,
        lambda cid: SupervisedTask(model_fn=model_fn, train_data=data(cid)),
        state=ClientStateStore(tmp_path / "clients"),
    )
    final, records = run_rounds(
        pool, strategy, initial_parameters(model_fn, SEED), RoundConfig(num_rounds=1, seed=SEED, min_fit_results=2)
    )
    (failure,) = records[-1].failures
    assert failure.client_id == "b" and reason in failure.reason and "decode" in failure.reason
    without_b = run(
        Strategy(fit=FIT, sampling=replace(ALL, min_fit_clients=2), mods=mods[1:]),
        tmp_path / "without",
        rounds=1,
        failing="b",
    )
    for name, value in without_b.parameters.items():
        np.testing.assert_array_equal(final.parameters[name], value, err_msg=name)


def test_the_recipe_option_declares_the_mod_outermost_and_refuses_what_cannot_work() -> None:
    strategy = build_strategy(StrategyConfig(name="scaffold", compression="topk", topk_fraction=0.05), FIT, ALL)
    assert [m.name for m in strategy.mods] == ["compress", "scaffold"]
    assert strategy.mods[0].params == {
        "method": "topk",
        "fraction": 0.05,
        "block": 512,
        "scope": "tensor",
        "warmup_rounds": 0,
    }
    assert build_strategy(StrategyConfig(), FIT, ALL).mods == ()
    for kwargs, words in (
        ({"compression": "int8", "aggregator": "median"}, "aggregator = 'mean'"),
        ({"compression": "int8", "secure_aggregation": True}, "secure_aggregation"),
        ({"compression": "topk", "topk_fraction": 0.0}, "fraction"),
        ({"compression": "int8", "quantization_block": 8}, "block"),
        ({"compression": "topk", "topk_scope": "layer"}, "scope must be one of tensor, model"),
        ({"compression": "topk", "topk_warmup_rounds": -1}, "warm-up must be an integer"),
        ({"compression": "topk", "topk_warmup_rounds": 2.5}, "warm-up must be an integer"),
    ):
        with pytest.raises(ConfigError, match=words):
            StrategyConfig(**kwargs)
    with pytest.raises(ConfigError, match="streaming mean"):
        replace(strategy, aggregator=build_strategy(StrategyConfig(aggregator="median"), FIT, ALL).aggregator)
    int8 = build_strategy(StrategyConfig(compression="int8"), FIT, ALL)
    # DP-FedAvg clips whole updates: refused in the flags' terms (it named an internal 'dp-fedavg' aggregator)
    with pytest.raises(ConfigError, match=r"strategy.compression cannot be combined with it; use --compression none$"):
        apply_dp(int8, PrivacyConfig(dp="central"), population=10)
    for options in (simulate_options(), server_options()):  # `fedcore simulate` and `fedcore server start`
        keys = {o.flag: o.key for o in options}
        assert keys["--compression"] == "strategy.compression" and keys["--topk-fraction"] == "strategy.topk_fraction"
        assert keys["--quantization-block"] == "strategy.quantization_block"
        assert keys["--topk-scope"] == "strategy.topk_scope"
        assert keys["--topk-warmup-rounds"] == "strategy.topk_warmup_rounds"
