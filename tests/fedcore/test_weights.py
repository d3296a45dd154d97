"""Aggregation weights by hand: examples, uniform, a client-reported metric (softmax over -loss/T, accuracy
proportional), the server's evaluation of each update, and the fallback for missing or non-finite values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedcore.aggregation import MeanAggregator
from fedcore.aggregation.weights import QualityWeights, softmax_weight, update_weight
from fedcore.errors import ConfigError, UpdateRejected
from fedcore.messages import FitRes
from fedcore.strategy import Strategy, StrategyConfig
from fedcore.task import EvalResult
from fedcore.tensors import spec_of


def reply(num_examples: int, **metrics: float) -> FitRes:
    return FitRes(client_id="c", round=1, parameters={}, num_examples=num_examples, metrics=metrics)


def test_examples_and_uniform_are_todays_rules() -> None:
    assert Strategy().weight(reply(7)) == 7.0
    assert Strategy(weighting="uniform").weight(reply(7)) == 1.0
    with pytest.raises(UpdateRejected, match="beyond the float range"):
        Strategy().weight(reply(1 << 1100))


def test_softmax_over_minus_loss_over_t_by_hand_and_its_denominator_cancels() -> None:
    strategy = Strategy(weighting="metric", quality=QualityWeights(metric="train_loss", temperature=0.5))
    weights = [strategy.weight(reply(100, train_loss=loss)) for loss in (0.5, 1.0, 2.0)]
    assert weights == [math.exp(-1.0), math.exp(-2.0), math.exp(-4.0)]
    # the streaming weighted mean with these weights is the softmax-weighted mean
    updates = [np.array([1.0], np.float32), np.array([4.0], np.float32), np.array([10.0], np.float32)]
    acc = MeanAggregator().start(spec_of({"x": updates[0]}), round=1)
    for u, w in zip(updates, weights, strict=True):
        acc.add({"x": u}, w, client_id="c", round=1)
    softmax = np.exp(-np.array([0.5, 1.0, 2.0]) / 0.5)
    softmax /= softmax.sum()
    by_hand = float(softmax @ np.array([1.0, 4.0, 10.0]))
    weighted = (math.e**-1 * 1 + math.e**-2 * 4 + math.e**-4 * 10) / (math.e**-1 + math.e**-2 + math.e**-4)
    assert by_hand == pytest.approx(weighted, rel=1e-15)
    np.testing.assert_allclose(acc.result()["x"], [by_hand], rtol=1e-6)


def test_accuracy_proportional_and_times_examples() -> None:
    quality = QualityWeights(metric="val_accuracy", transform="proportional")
    assert update_weight("metric", quality, 10, {"val_accuracy": 0.8}) == 0.8
    assert update_weight("metric", quality, 10, {"val_accuracy": 0.0}) == 0.0  # no say, still accepted
    both = QualityWeights(metric="val_accuracy", transform="proportional", times_examples=True)
    assert update_weight("metric", both, 20, {"val_accuracy": 0.5}) == 10.0


def test_missing_or_unusable_values_are_rejected_or_take_the_fallback() -> None:
    strict = QualityWeights(metric="train_loss")
    for metrics in (
        {},
        {"train_loss": float("nan")},
        {"train_loss": float("inf")},
        {"train_loss": True},
        {"train_loss": "0.1"},
    ):
        with pytest.raises(UpdateRejected, match="no usable 'train_loss'"):
            update_weight("metric", strict, 10, metrics)
    lenient = QualityWeights(metric="train_loss", fallback=10.0)
    assert update_weight("metric", lenient, 10, {}) == math.exp(-10.0)
    assert update_weight("metric", lenient, 10, {"train_loss": float("nan")}) == math.exp(-10.0)
    accuracy = QualityWeights(metric="accuracy", transform="proportional", fallback=0.0)
    assert update_weight("metric", accuracy, 10, {"accuracy": -0.5}) == 0.0  # negative: not an accuracy


def test_the_exponent_is_clamped_so_a_weight_stays_positive_and_finite() -> None:
    assert softmax_weight(1e6, 1.0) == math.exp(-300.0) > 0
    assert softmax_weight(-1e6, 1.0) == math.exp(300.0) < math.inf
    assert softmax_weight(-3.0, 0.5) == math.exp(6.0)


def test_the_servers_evaluation_of_the_update() -> None:
    result = EvalResult(loss=0.3, num_examples=100, metrics={"accuracy": 0.9})
    accuracy = QualityWeights(metric="accuracy", transform="proportional")
    assert update_weight("server", accuracy, 5, {}, lambda: result) == 0.9
    loss = QualityWeights(metric="loss", temperature=0.1)
    assert update_weight("server", loss, 5, {"loss": 99.0}, lambda: result) == math.exp(-0.3 / 0.1)  # not the client's

    def broken() -> EvalResult:
        raise RuntimeError("shape mismatch")

    with pytest.raises(UpdateRejected, match="RuntimeError: shape mismatch"):
        update_weight("server", loss, 5, {}, broken)
    lenient = QualityWeights(metric="loss", temperature=0.1, fallback=1.0)
    assert update_weight("server", lenient, 5, {}, broken) == math.exp(-10.0)
    empty = EvalResult(loss=0.3, num_examples=0, metrics={})
    assert update_weight("server", lenient, 5, {}, lambda: empty) == math.exp(-10.0)  # 0 examples: no value
    with pytest.raises(ConfigError, match="needs the server's evaluation"):
        update_weight("server", loss, 5, {}, None)


def test_bad_settings_are_refused() -> None:
    for bad in ({"metric": ""}, {"temperature": 0.0}, {"temperature": math.inf}, {"transform": "log"},
                {"fallback": math.nan}, {"transform": "proportional", "fallback": -1.0}):  # fmt: skip
        with pytest.raises(ConfigError):
            QualityWeights(**bad)
    with pytest.raises(ConfigError, match="weighting must be one of"):
        StrategyConfig(weighting="loss")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="secure_aggregation"):
        StrategyConfig(weighting="metric", secure_aggregation=True)
    with pytest.raises(ConfigError, match="temperature"):
        StrategyConfig(weighting="metric", weight_temperature=-1.0)


def test_dp_fedavg_refuses_a_quality_weighting_instead_of_replacing_it() -> None:
    from privacy.dp.config import PrivacyConfig, apply_dp

    private = PrivacyConfig(dp="central", population=10)
    assert apply_dp(Strategy(), private).weighting == "uniform"  # examples: replaced, as documented
    with pytest.raises(ConfigError, match="weighting 'metric' cannot be combined"):
        apply_dp(Strategy(weighting="metric"), private)
