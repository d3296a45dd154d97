"""Settings that every round would refuse are refused when the server starts, before it listens and before its
state directory exists: not at round 1, once its clients joined (the server then exited 2 and left its daemons
retrying)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedcore.errors import ConfigError
from fedcore.strategy import SamplingConfig, StrategyConfig
from privacy.dp.config import PrivacyConfig, apply_dp
from privacy.secagg.config import SecAggConfig
from tests.server.starting import refused_before_listening


def _refused(tmp_path: Path, match: str, **settings: Any) -> None:
    refused_before_listening(tmp_path / "state", ConfigError, match, **settings)
    assert not (tmp_path / "state").exists()


def test_more_secagg_neighbours_than_the_smallest_round_has_is_refused_at_start(tmp_path: Path) -> None:
    """--neighbours 3 with --min-fit-clients 3: round 1 started as soon as 3 of 4 daemons had joined."""
    _refused(
        tmp_path,
        r"3 neighbours per client need at least 4 clients, got 3 \(a round may select as few as min_fit_clients = 3\); "
        r"raise --min-fit-clients",
        strategy=StrategyConfig(secure_aggregation=True, secagg=SecAggConfig(neighbours=3, threshold=2)),
        sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=3),
    )


def test_a_secagg_field_too_small_for_the_dp_noise_is_refused_at_start(tmp_path: Path) -> None:
    """--dp distributed --clip 1 --clipping-norm 1 --noise-multiplier 0.5: refused at round 1 before."""
    _refused(
        tmp_path,
        r"clip=1\.0 cannot hold the noisy sum .* Set \[strategy.secagg\] clip \(--clip\) to at least 2\.3\d+",
        strategy=StrategyConfig(secure_aggregation=True, secagg=SecAggConfig(clip=1.0)),
        sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=3),
        privacy=PrivacyConfig(dp="distributed", clipping_norm=1.0, noise_multiplier=0.5, population=3),
    )


def test_settings_that_run_but_protect_or_survive_less_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """--neighbours 1 ran with threshold 1 silently; --tolerated-dropout 0.34 with 3 clients and SecAgg+ k = 2,
    t = 2 was accepted, and the round a daemon dropped from was aborted."""
    from fedcore.strategy import build_strategy
    from fedcore.task import FitConfig
    from privacy.secagg.config import weak_points

    single = weak_points(SecAggConfig(neighbours=1).resolve(4))
    assert len(single) == 1 and single[0].startswith("secure aggregation with 1 neighbour(s) and threshold 1: one")
    assert weak_points(SecAggConfig(neighbours=4, threshold=3).resolve(8), dropouts=1) == []
    [short] = weak_points(SecAggConfig(neighbours=4, threshold=3).resolve(8), dropouts=2)
    expected = (
        "the rounds are set to tolerate 2 dropped client(s) (privacy.tolerated_dropout), but SecAgg+ with 4 "
        "neighbours and threshold 3 cannot unmask a client that loses more than 1"
    )
    assert short.startswith(expected)
    strategy = apply_dp(
        build_strategy(
            StrategyConfig(secure_aggregation=True, secagg=SecAggConfig(clip=10.0)),
            FitConfig(),
            SamplingConfig(fraction_fit=1.0, min_fit_clients=3),
        ),
        PrivacyConfig(dp="distributed", tolerated_dropout=0.34, population=3),
    )
    with caplog.at_level("WARNING", logger="fedcore.privacy"):
        strategy.aggregator.preflight(3, None)  # type: ignore[attr-defined]
    assert [r.getMessage()[:44] for r in caplog.records] == ["the rounds are set to tolerate 1 dropped cli"]
