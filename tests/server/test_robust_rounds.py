"""Robust aggregators in the round loop: the strategy's rule decides the new global model, refusals come first."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pytest

from fedcore.errors import ConfigError
from fedcore.messages import FitIns, FitRes, Reply, ServerMessage
from fedcore.strategy import SamplingConfig, StrategyConfig, build_strategy
from fedcore.task import FitConfig
from server.round_loop import RoundConfig, run_rounds


class ShiftingClients:
    """A client pool whose client ``i`` answers every fit instruction with the global model plus ``shifts[i]``."""

    def __init__(self, shifts: Sequence[Sequence[float]]) -> None:
        self.shifts = [np.array(s, np.float32) for s in shifts]
        self.ids = [f"c{i}" for i in range(len(shifts))]
        self.runs = 0

    def available(self) -> list[str]:
        return list(self.ids)

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        return self.available()

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[Reply]:
        self.runs += 1
        for cid, instruction in instructions.items():
            assert isinstance(instruction, FitIns)
            update = {"w": instruction.parameters["w"] + self.shifts[self.ids.index(cid)]}
            yield FitRes(client_id=cid, round=instruction.round, parameters=update, num_examples=10)


def _run(config: StrategyConfig, shifts: Sequence[Sequence[float]]) -> np.ndarray:
    pool = ShiftingClients(shifts)
    sampling = SamplingConfig(fraction_fit=1.0, min_fit_clients=len(shifts))
    strategy = build_strategy(config, FitConfig(), sampling)
    start = {"w": np.array([1.0, 1.0], np.float32)}
    state, _ = run_rounds(pool, strategy, start, RoundConfig(num_rounds=1))
    return state.parameters["w"]


def test_median_strategy_moves_the_model_by_the_median_update() -> None:
    shifts = [[1, 0], [2, 0], [3, 1], [4, 0], [1000, -1000]]  # one wild client
    np.testing.assert_array_equal(_run(StrategyConfig(aggregator="median", byzantine=2), shifts), [4.0, 1.0])
    # the mean follows the wild client: 1 + (1 + 2 + 3 + 4 + 1000) / 5 = 203; 1 + (1 - 1000) / 5 = -198.8
    np.testing.assert_allclose(_run(StrategyConfig(), shifts), [203.0, -198.8], rtol=1e-6)


def test_norm_bound_clips_against_the_global_model_the_round_loop_passes() -> None:
    # shifts of norm 5 and 0.5 around the global model, bound 1: (0.6, 0.8) and (0.3, 0.4), mean (0.45, 0.6)
    out = _run(StrategyConfig(aggregator="norm_bound", norm_bound=1.0), [[3, 4], [0.3, 0.4]])
    np.testing.assert_allclose(out, [1.45, 1.6], rtol=1e-6)


def test_krum_refuses_a_round_too_small_before_contacting_clients() -> None:
    pool = ShiftingClients([[0, 0]] * 6)
    strategy = build_strategy(
        StrategyConfig(aggregator="krum", byzantine=2), FitConfig(), SamplingConfig(fraction_fit=1.0, min_fit_clients=6)
    )
    with pytest.raises(ConfigError, match="at least 7 clients"):
        run_rounds(pool, strategy, {"w": np.zeros(2, np.float32)}, RoundConfig(num_rounds=1))
    assert pool.runs == 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"aggregator": "medain"}, "unknown aggregator 'medain'"),
        ({"byzantine": -1}, "must be an integer >= 0"),
        ({"aggregator": "norm_bound"}, "needs strategy.norm_bound"),
        ({"aggregator": "trimmed_mean", "trim_beta": 0.5}, r"must be in \[0, 0.5\)"),
        ({"aggregator": "multi_krum", "multi_krum_m": 0}, "must be >= 1"),
    ],
)
def test_strategy_config_refuses_bad_aggregator_settings(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StrategyConfig(**settings)  # type: ignore[arg-type]
