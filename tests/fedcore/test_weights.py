"""Aggregation weights by hand: examples, uniform, a client-reported metric (softmax over -loss/T, accuracy
proportional), the server's evaluation of each update, and the fallback for missing or non-finite values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedcore.aggregation import MeanAggregator
from fedcore.aggregation.weights import QualityWeights, WeightRule, softmax_weight, update_weight
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


def test_a_value_beyond_300_temperatures_is_not_clamped_but_unusable() -> None:
    """Clamping the exponent gave every value beyond 300 T one weight: with a round's losses 2.1727 .. 2.2439 at
    T = 0.005 (an adversarial user's run) all clients counted alike, a uniform mean where the two best should carry
    99 %. Such a value is unusable now (the fallback, or a rejection that names the temperature needed)."""
    assert softmax_weight(-3.0, 0.5) == math.exp(6.0)
    assert softmax_weight(300.0, 1.0) == math.exp(-300.0) > 0  # the edge is taken
    assert softmax_weight(-300.0, 1.0) == math.exp(300.0) < math.inf
    with pytest.raises(UpdateRejected, match=r"2\.1727 is beyond .* temperature 0\.005 .* at least 0\.00724"):
        softmax_weight(2.1727, 0.005)
    with pytest.raises(UpdateRejected):
        softmax_weight(-1e6, 1.0)
    strict = QualityWeights(metric="train_loss", temperature=0.005)
    with pytest.raises(
        UpdateRejected,
        match=r"client's 'train_loss' 2\.1727 is beyond .* 0\.005 .* at least 0\.00724.*--weight-fallback",
    ):
        update_weight("metric", strict, 10, {"train_loss": 2.1727})
    assert update_weight("metric", strict, 10, {"train_loss": 1.5}) == math.exp(-300.0)  # 1.5 = 300 T: taken
    # the round's five losses at T = 0.01 (all within 300 T): the softmax's own weights, the best first
    sharp = QualityWeights(metric="train_loss", temperature=0.01)
    losses = [2.1727, 2.1763, 2.1901, 2.2093, 2.2439]
    weights = [update_weight("metric", sharp, 10, {"train_loss": v}) for v in losses]
    share = [w / sum(weights) for w in weights]
    expected = [math.exp(-(v - losses[0]) / 0.01) for v in losses]
    assert share == pytest.approx([e / sum(expected) for e in expected], rel=1e-12)
    assert share[0] > 0.5 > share[4] * 100
    # a diverged client's loss takes the fallback; a fallback itself beyond 300 T is refused at configuration
    lenient = QualityWeights(metric="train_loss", temperature=0.01, fallback=3.0)
    assert update_weight("metric", lenient, 10, {"train_loss": 1e9}) == math.exp(-300.0)
    with pytest.raises(ConfigError, match=r"at most 300 x the temperature 0\.01.*got 10"):
        QualityWeights(metric="train_loss", temperature=0.01, fallback=10.0)


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


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean", "krum"])
def test_a_quality_weighting_is_refused_by_a_rule_that_ignores_weights(aggregator: str) -> None:
    """Median, trimmed mean and Krum ignore the clients' weights: an adversarial user found --weighting metric and
    server accepted with them and every run's model the same bits as with examples. Now refused at configuration;
    the weighting rules that change nothing (examples, uniform) and the rules that weight (Multi-Krum's average, norm
    bounding) are taken."""
    quality: tuple[WeightRule, ...] = ("metric", "server")
    for weighting in quality:
        refusal = rf"aggregator '{aggregator}' ignores the clients' weights.*'{weighting}'"
        with pytest.raises(ConfigError, match=refusal):
            StrategyConfig(name="fedavg", aggregator=aggregator, weighting=weighting)
    with pytest.raises(ConfigError, match="ignores the clients' weights"):
        StrategyConfig(name="fedavg", aggregator="multi_krum", multi_krum_m=1, weighting="metric")
    plain: tuple[WeightRule, ...] = ("examples", "uniform")
    for weighting in plain:
        StrategyConfig(name="fedavg", aggregator=aggregator, weighting=weighting)
    StrategyConfig(name="fedavg", aggregator="multi_krum", weighting="metric")
    StrategyConfig(name="fedavg", aggregator="norm_bound", norm_bound=1.0, weighting="server")
