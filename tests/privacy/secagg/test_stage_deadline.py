"""The per-stage deadline of SecAgg+ (``[strategy.secagg] stage_deadline_s`` / ``--stage-deadline-s``): every
protocol stage waits that long, the fit exchange keeps the round's deadline, a client that misses a stage's
deadline drops out, and a deadline that cannot be honoured is refused when the config is read."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping

import pytest

from fedcore.cli import server_options, simulate_options
from fedcore.config import from_mapping
from fedcore.errors import ConfigError, RoundFailed
from fedcore.messages import FitIns, Reply, ServerMessage, StageIns
from fedcore.options import add_options, given_values
from fedcore.strategy import StrategyConfig, build_strategy
from privacy.secagg.config import SecAggConfig
from privacy.secagg.rounds import secure_aggregation
from server.round_loop import RoundConfig, run_rounds
from simulations.inmemory import InMemoryPool
from tests.privacy.secagg.test_rounds import FIT, IDS, SAMPLING, SEED, make_task, plain, start_state


class Deadlines:
    """The in-memory pool, recording the deadline each exchange was given."""

    def __init__(self, pool: InMemoryPool) -> None:
        self.pool = pool
        self.deadlines: list[tuple[str, float | None]] = []

    def available(self) -> list[str]:
        return self.pool.available()

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        return self.pool.wait_for(num_clients, timeout_s)

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[Reply]:
        if not instructions:
            return
        first = next(iter(instructions.values()))
        stage = first.name if isinstance(first, StageIns) else "fit" if isinstance(first, FitIns) else "evaluate"
        self.deadlines.append((stage, timeout_s))
        yield from self.pool.run(instructions, timeout_s=timeout_s)


def test_each_protocol_stage_waits_the_configured_deadline_and_fit_the_rounds() -> None:
    config = StrategyConfig(secure_aggregation=True, secagg=SecAggConfig(field_bits=24, stage_deadline_s=30.0))
    strategy = build_strategy(config, FIT, SAMPLING)
    pool = Deadlines(InMemoryPool(IDS, make_task))
    _, records = run_rounds(
        pool, strategy, start_state(strategy), RoundConfig(num_rounds=1, seed=SEED, round_timeout_s=90)
    )
    assert sorted(records[-1].accepted) == IDS
    assert pool.deadlines == [
        ("advertise_keys", 30.0),
        ("share_keys", 30.0),
        ("collect_masked_input", 30.0),
        ("fit", 90),
        ("unmask", 30.0),
    ]
    # unset: every stage waits the round's deadline; the function's argument overrides the config
    unset = build_strategy(StrategyConfig(secure_aggregation=True, secagg=SecAggConfig(field_bits=24)), FIT, SAMPLING)
    pool = Deadlines(InMemoryPool(IDS, make_task))
    run_rounds(pool, unset, start_state(unset), RoundConfig(num_rounds=1, seed=SEED, round_timeout_s=90))
    assert {d for _, d in pool.deadlines} == {90}
    override = secure_aggregation(plain(), SecAggConfig(field_bits=24, stage_deadline_s=30.0), deadline_s=12.0)
    pool = Deadlines(InMemoryPool(IDS, make_task))
    run_rounds(pool, override, start_state(override), RoundConfig(num_rounds=1, seed=SEED, round_timeout_s=90))
    assert [d for s, d in pool.deadlines if s != "fit"] == [12.0] * 4


def test_clients_that_miss_the_stage_deadline_drop_out(caplog: pytest.LogCaptureFixture) -> None:
    # no client can answer within a microsecond: all drop out at advertise_keys, and every attempt fails
    config = StrategyConfig(secure_aggregation=True, secagg=SecAggConfig(field_bits=24, stage_deadline_s=1e-6))
    strategy = build_strategy(config, FIT, SAMPLING)
    pool = Deadlines(InMemoryPool(IDS, make_task))
    with pytest.raises(RoundFailed, match=r"after 2 attempt.*only 0 of 4 selected clients"):
        run_rounds(pool, strategy, start_state(strategy), RoundConfig(num_rounds=1, seed=SEED, max_round_attempts=2))
    assert [s for s, _ in pool.deadlines] == ["advertise_keys", "advertise_keys"]  # no fit, no unmask
    stopped = [r.getMessage() for r in caplog.records if "stopped the round" in r.getMessage()]
    assert len(stopped) == 2 and all("only 0 of 4 clients answered" in m for m in stopped)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "30"])
def test_a_deadline_that_cannot_be_honoured_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="stage_deadline_s must be a finite number of seconds > 0"):
        SecAggConfig(stage_deadline_s=bad)  # type: ignore[arg-type]


def test_the_stage_deadline_is_a_toml_key_and_a_flag_of_simulate_and_server_start() -> None:
    for options in (simulate_options(), server_options()):
        by_flag = {o.flag: o for o in options}
        assert by_flag["--stage-deadline-s"].key == "strategy.secagg.stage_deadline_s"
        parser = argparse.ArgumentParser()
        add_options(parser, options)
        values = given_values(parser.parse_args(["--secure-aggregation", "--stage-deadline-s", "20"]), options)
        assert values == {"strategy": {"secure_aggregation": True, "secagg": {"stage_deadline_s": 20.0}}}
    config = from_mapping(StrategyConfig, {"secure_aggregation": True, "secagg": {"stage_deadline_s": 20}})
    assert config.secagg.stage_deadline_s == 20
    with pytest.raises(ConfigError, match="stage_deadline_s"):
        from_mapping(StrategyConfig, {"secagg": {"stage_deadline_s": -5}})
