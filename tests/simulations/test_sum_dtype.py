"""``strategy.sum_dtype`` (``--sum-dtype``): the streaming mean's float32 running sum of differences
(``MeanAggregator(delta=True)``) as a recipe and server option; what it refuses; a real simulation with it."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from fedcore.aggregation import MeanAggregator
from fedcore.cli import build_parser, main, server_options, simulate_options
from fedcore.errors import ConfigError
from fedcore.options import given_values, to_overrides
from fedcore.strategy import SamplingConfig, StrategyConfig, build_aggregator, build_strategy
from fedcore.task import FitConfig
from fedcore.tensors import decode
from privacy.dp.config import PrivacyConfig, apply_dp
from server.config import load_server_config
from simulations.config import load_recipe
from simulations.harness import FLOAT32_ORDER_NOTICE, run_simulation
from tests.simulations.test_harness import SMALL

SERVER = ['task="simulations.tasks:demo_task"', "insecure=true"]


def test_sum_dtype_is_a_flag_of_both_commands_and_float64_by_default() -> None:
    for options in (simulate_options(), server_options()):  # `fedcore simulate` and `fedcore server start`
        (option,) = [o for o in options if o.flag == "--sum-dtype"]
        assert (option.key, option.default, option.choices) == ("strategy.sum_dtype", "float64", ("float64", "float32"))
    assert load_recipe().strategy.sum_dtype == "float64"
    assert build_aggregator(StrategyConfig()) == MeanAggregator(delta=False)
    args = build_parser().parse_args(["simulate", "--sum-dtype", "float32"])
    recipe = load_recipe(None, to_overrides(given_values(args, simulate_options())))
    assert recipe.strategy.sum_dtype == "float32"
    assert build_strategy(recipe.strategy, recipe.train, recipe.sampling).aggregator == MeanAggregator(delta=True)
    args = build_parser().parse_args(["server", "start", "--sum-dtype", "float32", "--insecure"])
    server = load_server_config(None, [*SERVER], given_values(args, server_options()))
    assert build_aggregator(server.strategy) == MeanAggregator(delta=True)
    assert load_recipe(None, ["strategy.sum_dtype='float32'"]).strategy.sum_dtype == "float32"  # the TOML key


def test_a_sum_dtype_that_cannot_apply_is_refused_saying_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"'bfloat16' is not one of 'float64', 'float32'"):
        load_recipe(None, ["strategy.sum_dtype='bfloat16'"])
    with pytest.raises(ConfigError, match=r"sum_dtype must be 'float64' or 'float32', got 'float16'"):
        StrategyConfig(sum_dtype="float16")  # type: ignore[arg-type]
    for aggregator in ("median", "trimmed_mean", "krum", "multi_krum"):
        with pytest.raises(ConfigError, match=rf"{aggregator!r} keeps none: use sum_dtype = 'float64'"):
            StrategyConfig(aggregator=aggregator, sum_dtype="float32")
    with pytest.raises(ConfigError, match="'norm_bound' keeps none"):
        StrategyConfig(aggregator="norm_bound", norm_bound=1.0, sum_dtype="float32")
    with pytest.raises(ConfigError, match="secure_aggregation sums quantized updates in a finite field"):
        StrategyConfig(secure_aggregation=True, sum_dtype="float32")
    strategy = build_strategy(StrategyConfig(sum_dtype="float32"), FitConfig(), SamplingConfig())
    for dp in ("central", "distributed"):
        with pytest.raises(ConfigError, match="DP-FedAvg's clipped mean, which sums in float64"):
            apply_dp(strategy, PrivacyConfig(dp=dp), population=10)
    # the server refuses it when its config is built, before the state directory is touched
    with pytest.raises(ConfigError, match=r"strategy.sum_dtype = 'float32' cannot apply"):
        load_server_config(None, [*SERVER, "strategy.sum_dtype='float32'", "privacy.dp='central'",
                                  "privacy.population=10"])  # fmt: skip
    with pytest.raises(ConfigError, match="'median' keeps none"):
        load_server_config(None, [*SERVER, "strategy.sum_dtype='float32'", "strategy.aggregator='median'"])
    # scaffold's model goes through the same mean; its control group keeps the float64 sum
    scaffold = build_strategy(StrategyConfig(name="scaffold", sum_dtype="float32"), FitConfig(), SamplingConfig())
    assert scaffold.aggregator == MeanAggregator(delta=True)


def test_cli_refusal_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--sum-dtype", "float32", "--aggregator", "krum"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "fedcore: error: [strategy] sum_dtype = 'float32' sets the running sum of aggregator 'mean'; 'krum' keeps "
        "none: use sum_dtype = 'float64' (--sum-dtype float64) or aggregator = 'mean'"
    )


def _run(tmp_path: Path, *extra: str) -> tuple[dict[str, np.ndarray], float]:
    config = load_recipe(None, [*SMALL, "rounds=1", f"output.dir={str(tmp_path)!r}", *extra])
    history = run_simulation(config, echo=lambda _: None).history
    return decode((tmp_path / "model.safetensors").read_bytes()), float(history["test_loss"].iloc[-1])


@pytest.mark.slow
def test_float32_sum_gives_the_float64_model_within_one_float32_unit_but_not_bit_for_bit(tmp_path: Path) -> None:
    """One FedAvg round (server_lr 1: the new model is the mean), digits, 5 clients of 10, the 2NN."""
    fedavg = ["strategy.name='fedavg'", "strategy.server_momentum=0.0"]
    float64, loss64 = _run(tmp_path / "64", *fedavg)
    float32, loss32 = _run(tmp_path / "32", *fedavg, "strategy.sum_dtype='float32'")
    assert set(float32) == set(float64)
    equal = total = 0
    for name, a in float64.items():
        b = float32[name]
        assert a.dtype == b.dtype == np.float32
        # the documented tolerance (README "Memory per model", MeanAggregator.delta): about one float32 unit of
        # the tensor's parameters; measured: at most exactly one unit of its largest |parameter| in every tensor
        assert np.max(np.abs(a.astype(np.float64) - b)) <= np.spacing(np.max(np.abs(a))), name
        equal += int(np.sum(a == b))
        total += a.size
    assert equal < total  # not the same bits: measured 93.5% of the 2NN's elements equal
    assert equal > 0.9 * total
    assert loss32 == pytest.approx(loss64, rel=1e-6)  # measured 1.97301337 against 1.97301341


@pytest.mark.slow
def test_the_process_backend_with_a_float32_sum_says_its_history_is_not_bit_identical(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="fedcore.simulation"):
        _run(tmp_path, "strategy.sum_dtype='float32'", "simulation.backend='process'", "simulation.workers=2")
    notices = [r.getMessage() for r in caplog.records if r.msg == FLOAT32_ORDER_NOTICE]
    assert notices == [FLOAT32_ORDER_NOTICE % "process"]
    assert "not bit-identical to the in-process backend's" in notices[0]
