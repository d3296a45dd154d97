"""Client selection policies (fedcore.selection): which clients each policy picks, by hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedcore.errors import ConfigError
from fedcore.selection import (
    ClientObservation,
    ClientStats,
    SelectionConfig,
    Selector,
    batch_observations,
    check_attributes,
    exploration_share,
    largest_remainder,
    observation,
    oort_scores,
    oort_select,
    power_of_choice,
    sample_clients,
    size_buckets,
    stratified_sample,
)
from fedcore.strategy import SamplingConfig, StrategyConfig, build_strategy
from fedcore.task import FitConfig

IDS = [f"c{i}" for i in range(10)]


def test_uniform_is_todays_sampling_for_every_stage_and_seed() -> None:
    selector = Selector()
    for rnd in range(1, 6):
        for stage in ("fit", "fit-attempt-2", "evaluate"):
            assert selector.select(IDS, 3, seed=4, round=rnd, stage=stage) == sample_clients(
                IDS, 3, seed=4, round=rnd, stage=stage
            )
    # the default strategy of a recipe selects uniformly
    strategy = build_strategy(StrategyConfig(), FitConfig(), SamplingConfig())
    assert strategy.selection.policy == "uniform"
    assert strategy.selection.select(IDS, 4, seed=1, round=2) == sample_clients(IDS, 4, seed=1, round=2)


def test_largest_remainder_by_hand() -> None:
    # 5 of (6, 3, 1): exact 3.0, 1.5, 0.5 -> floors 3, 1, 0; the one left: B and C tie at .5, B is larger
    assert largest_remainder({"A": 6, "B": 3, "C": 1}, 5) == {"A": 3, "B": 2, "C": 0}
    # 4 of (6, 3, 1): exact 2.4, 1.2, 0.4 -> floors 2, 1, 0; the one left: A and C tie at .4, A is larger
    assert largest_remainder({"A": 6, "B": 3, "C": 1}, 4) == {"A": 3, "B": 1, "C": 0}
    # 2 of (1, 1, 1): 2/3 each -> floors 0; two left go by label order
    assert largest_remainder({"z": 1, "y": 1, "x": 1}, 2) == {"x": 1, "y": 1, "z": 0}
    assert largest_remainder({"A": 2}, 0) == {"A": 0}
    with pytest.raises(ConfigError):
        largest_remainder({"A": 2}, 3)


def test_stratified_takes_each_stratum_in_proportion_and_draws_strata_independently() -> None:
    strata = {cid: "A" for cid in IDS[:6]} | {cid: "B" for cid in IDS[6:9]} | {"c9": "C"}
    chosen = stratified_sample(IDS, strata, 5, seed=3, round=1)
    assert len(chosen) == 5 and chosen == sorted(chosen)
    assert [sum(strata[c] == s for c in chosen) for s in "ABC"] == [3, 2, 0]
    # the draw in stratum A does not depend on the other strata's members
    fewer = {cid: s for cid, s in strata.items() if s == "A"} | {"c6": "B", "c7": "B"}
    again = stratified_sample([*IDS[:8]], fewer, 4, seed=3, round=1)  # 6 of A, 2 of B: quotas 3, 1
    assert [c for c in again if fewer[c] == "A"] == [c for c in chosen if strata[c] == "A"]
    # clients without the attribute form the stratum "" of their own
    selector = Selector("stratified", SelectionConfig(stratify_by="region"), attributes={"c0": {"region": "eu"}})
    selector.declare("c1", {"region": "eu"})
    picked = selector.select(["c0", "c1", "c2", "c3"], 2, seed=0, round=1)
    assert sum(c in ("c0", "c1") for c in picked) == 1  # 2 of (eu: 2, "": 2) -> 1 each


def test_power_of_choice_keeps_the_highest_last_losses() -> None:
    ids = ["a", "b", "c", "d", "e", "f"]
    losses = {"a": 0.1, "b": 0.9, "c": 0.5, "d": 0.7, "e": 0.2, "f": 0.3}
    # d = all: the two highest losses, whatever the seed
    for rnd in range(1, 6):
        assert power_of_choice(ids, losses, 2, candidates=6, seed=rnd, round=rnd) == ["b", "d"]
    # a client never seen counts as the highest loss
    unseen = {k: v for k, v in losses.items() if k != "e"}
    assert power_of_choice(ids, unseen, 2, candidates=6, seed=0, round=1) == ["b", "e"]
    # d = 5 of 6: the best of the five drawn, so b unless b was left out (then d, the next)
    picks = [power_of_choice(ids, losses, 1, candidates=5, seed=0, round=r)[0] for r in range(1, 41)]
    assert set(picks) <= {"b", "d"} and picks.count("b") > 25
    # d = m: the losses do not matter, it is a uniform draw of m
    flat = [power_of_choice(ids, losses, 2, candidates=2, seed=0, round=r) for r in range(1, 41)]
    assert {c for pick in flat for c in pick} == set(ids)
    # unset d: 2 * m candidates
    assert power_of_choice(ids, losses, 3, candidates=None, seed=0, round=1) == ["b", "c", "d"]


def _stats() -> dict[str, ClientStats]:
    return {
        "a": ClientStats(num_examples=10, loss=1.0, seconds=1.0, round=1),
        "b": ClientStats(num_examples=20, loss=1.0, seconds=1.0, round=1),
        "c": ClientStats(num_examples=30, loss=1.0, seconds=10.0, round=1),
        "d": ClientStats(num_examples=10, loss=0.5, seconds=2.0, round=1),
    }


def test_oort_scores_by_hand() -> None:
    # utilities n*loss: 10, 20, 30, 5 -> normalized (u - 5) / 25: .2, .6, 1, 0; staleness sqrt(.1 ln 2 / 1);
    # preferred duration T = median(1, 1, 2, 10) = 1.5: c times (1.5/10)^2, d times (1.5/2)^2
    bonus = math.sqrt(0.1 * math.log(2))
    scores = oort_scores(_stats(), round=2, config=SelectionConfig())
    assert scores == pytest.approx(
        {"a": 0.2 + bonus, "b": 0.6 + bonus, "c": (1 + bonus) * 0.0225, "d": bonus * 0.5625}, rel=1e-12
    )
    # a preferred duration that is given; no staleness weight
    scores = oort_scores(_stats(), round=2, config=SelectionConfig(preferred_seconds=5.0, staleness=0.0))
    assert scores == pytest.approx({"a": 0.2, "b": 0.6, "c": 0.25, "d": 0.0})


def test_oort_prefers_useful_fast_clients_and_explores_the_unseen() -> None:
    config = SelectionConfig()
    # all explored: scores a .463, b .863, c .028, d .148 -> 1: b alone above .95 * .863; 2: b, a (.95 * .463 cut)
    assert oort_select(list(_stats()), _stats(), 1, config=config, seed=0, round=2) == ["b"]
    assert oort_select(list(_stats()), _stats(), 2, config=config, seed=0, round=2) == ["a", "b"]
    # four unexplored clients: round 1, epsilon .9 -> floor(1.8) = 1 explored slot, 1 exploited (b)
    pool = [*_stats(), "e", "f", "g", "h"]
    for seed in range(5):
        chosen = oort_select(pool, _stats(), 2, config=config, seed=seed, round=1)
        assert "b" in chosen and len(set(chosen) & {"e", "f", "g", "h"}) == 1
    # round 200: epsilon has decayed to its floor .3 -> floor(.6) = 0 explored slots: a and b again
    assert oort_select(pool, _stats(), 2, config=config, seed=0, round=200) == ["a", "b"]
    # more slots than explored clients: the rest are explored
    assert set(oort_select(pool, _stats(), 8, config=config, seed=0, round=200)) == set(pool)
    assert exploration_share(config, 1) == 0.9
    assert exploration_share(config, 2) == pytest.approx(0.882)
    assert exploration_share(config, 200) == 0.3


def test_oort_draws_the_exploitation_pool_in_proportion_to_scores() -> None:
    # utilities 10, 20, 0 -> scores .5, 1, 0 (no staleness, equal speeds); cutoff .4 of the best: a and b, drawn
    # 1 : 2, so b in about 2/3 of the rounds; e (score 0) never
    config = SelectionConfig(cutoff=0.4, staleness=0.0)
    stats = {
        "a": ClientStats(num_examples=10, loss=1.0, seconds=1.0, round=1),
        "b": ClientStats(num_examples=20, loss=1.0, seconds=1.0, round=1),
        "e": ClientStats(num_examples=10, loss=0.0, seconds=1.0, round=1),
    }
    picks = [oort_select(["a", "b", "e"], stats, 1, config=config, seed=0, round=r)[0] for r in range(2, 302)]
    assert "e" not in picks and 0.58 < picks.count("b") / 300 < 0.75  # 2/3 +- 2.5 standard deviations


def test_oort_fills_slots_that_clients_of_score_0_must_take() -> None:
    """Three clients, all three selected, staleness 0: the least useful scores exactly 0, and numpy's weighted draw
    without replacement raised ValueError ('Fewer non-zero entries in p than size') at round 2, in a simulation
    and on a server (again at every restart). A speed penalty of 1000 underflows a slow client's score to 0 alike."""
    config = SelectionConfig(staleness=0.0)
    stats = {
        "a": ClientStats(num_examples=10, loss=1.0, seconds=1.0, round=1),
        "b": ClientStats(num_examples=20, loss=1.0, seconds=1.0, round=1),
        "e": ClientStats(num_examples=5, loss=1.0, seconds=1.0, round=1),
    }
    assert oort_scores(stats, round=2, config=config)["e"] == 0.0
    for seed in range(3):
        assert oort_select(["a", "b", "e"], stats, 3, config=config, seed=seed, round=2) == ["a", "b", "e"]
        # two slots: a and b, the two above 0, whatever the draw
        assert oort_select(["a", "b", "e"], stats, 2, config=config, seed=seed, round=2) == ["a", "b"]
    slow = {**stats, "e": ClientStats(num_examples=50, loss=1.0, seconds=100.0, round=1)}
    penalised = SelectionConfig(speed_penalty=1000.0, staleness=0.0)
    assert oort_scores(slow, round=2, config=penalised)["e"] == 0.0  # (1 / 100) ** 1000 underflows
    assert oort_select(["a", "b", "e"], slow, 3, config=penalised, seed=0, round=2) == ["a", "b", "e"]
    # a finite loss whose utility n * loss overflows: the min-max scaling made inf - inf = NaN, a score neither
    # above 0 nor at 0, and the fill drew from an empty list (the same crash, again at every restart)
    huge = {**stats, "e": ClientStats(num_examples=100, loss=1e307, seconds=1.0, round=1)}
    assert all(math.isfinite(v) for v in oort_scores(huge, round=2, config=SelectionConfig()).values())
    assert oort_select(["a", "b", "e"], huge, 3, config=SelectionConfig(), seed=0, round=2) == ["a", "b", "e"]
    assert oort_select(["a", "b", "e"], huge, 1, config=SelectionConfig(), seed=0, round=2) == ["e"]


def test_observation_reads_loss_and_duration_and_leaves_out_the_rest() -> None:
    seen = observation("c", 12, {"train_loss": 0.5, "fit_seconds": 3.0, "simulated_seconds": 2.0})
    assert seen == ClientObservation(client_id="c", num_examples=12, loss=0.5, seconds=2.0)
    seen = observation("c", 12, {"train_loss": float("nan"), "fit_seconds": -1.0})
    assert seen == ClientObservation(client_id="c", num_examples=12, loss=None, seconds=None)
    seen = observation("c", 1, {"train_loss": [1.0], "fit_seconds": "3", "simulated_seconds": float("inf")})
    assert seen.loss is None and seen.seconds is None
    assert observation("c", 1, {"fit_seconds": 4}).seconds == 4.0


def test_observe_keeps_last_values_and_restore_rebuilds_the_same_state() -> None:
    history = [
        (1, [ClientObservation(client_id="a", num_examples=5, loss=1.0, seconds=2.0)]),
        (2, [ClientObservation(client_id="a", num_examples=6, loss=None, seconds=3.0),
             ClientObservation(client_id="b", num_examples=7, loss=0.4, seconds=None)]),
    ]  # fmt: skip
    live = Selector("oort")
    for rnd, seen in history:
        live.observe(rnd, seen)
    assert live.stats() == {
        "a": ClientStats(num_examples=6, loss=1.0, seconds=3.0, round=2),  # no loss reported: the last one stays
        "b": ClientStats(num_examples=7, loss=0.4, seconds=None, round=2),
    }
    rebuilt = Selector("oort")
    rebuilt.observe(9, [ClientObservation(client_id="z", num_examples=1)])  # forgotten by restore
    rebuilt.restore(history)
    assert rebuilt.stats() == live.stats()
    pool = ["a", "b", "c", "d"]
    assert [rebuilt.select(pool, 2, seed=1, round=r) for r in range(3, 8)] == [
        live.select(pool, 2, seed=1, round=r) for r in range(3, 8)
    ]


def test_evaluation_is_uniform_for_the_loss_and_speed_policies() -> None:
    for policy in ("power-of-choice", "oort"):
        selector = Selector(policy)
        selector.observe(1, [ClientObservation(client_id="c3", num_examples=1, loss=9.0, seconds=1.0)])
        assert selector.select(IDS, 3, seed=2, round=1, stage="evaluate") == sample_clients(
            IDS, 3, seed=2, round=1, stage="evaluate"
        )


def test_availability_offline_clients_are_never_selected() -> None:
    online = {1: {"c0", "c1", "c2"}, 2: {"c3", "c4", "c5", "c6"}}
    for policy in ("uniform", "stratified", "power-of-choice", "oort"):
        selector = Selector(policy, availability=lambda cid, rnd: cid in online[rnd])
        assert selector.candidates(IDS, round=1) == ["c0", "c1", "c2"]
        assert selector.select(IDS, 3, seed=0, round=1) == ["c0", "c1", "c2"]
        assert set(selector.select(IDS, 2, seed=0, round=2)) <= online[2]
        with pytest.raises(ConfigError, match="cannot select 4 clients from 3"):
            selector.select(IDS, 4, seed=0, round=1)


def test_size_buckets_by_hand() -> None:
    sizes = {"a": 50, "b": 10, "c": 30, "d": 10, "e": 70}
    # ranked b(10) d(10) c(30) a(50) e(70); 5 into 2 buckets: 3 + 2
    assert size_buckets(sizes, 2) == {"b": "0", "d": "0", "c": "0", "a": "1", "e": "1"}
    assert size_buckets(sizes, 9) == {"b": "0", "d": "1", "c": "2", "a": "3", "e": "4"}


def test_config_and_attribute_checks() -> None:
    with pytest.raises(ConfigError, match="unknown selection"):
        StrategyConfig(selection="random")  # type: ignore[arg-type]  # deliberate: an unknown name
    with pytest.raises(ConfigError, match="unknown selection"):
        Selector("best")
    bad_values: list[dict[str, object]] = [
        {"candidates": 0},
        {"exploration": 1.5},
        {"exploration_min": 0.95},
        {"cutoff": 0.0},
        {"speed_penalty": -1.0},
        {"preferred_seconds": 0.0},
        {"size_buckets": 0},
        {"stratify_by": ""},
    ]
    for bad in bad_values:
        with pytest.raises(ConfigError, match="selector"):
            SelectionConfig(**bad)  # type: ignore[arg-type]
    assert check_attributes({"region": "eu"}) == {"region": "eu"}
    with pytest.raises(ConfigError, match=r"1\.\.64 printable"):
        check_attributes({"region": "x" * 65})
    with pytest.raises(ConfigError, match=r"1\.\.64 printable"):
        check_attributes({"re\ngion": "eu"})
    with pytest.raises(ConfigError, match="at most 16"):
        check_attributes({str(i): "v" for i in range(17)})
    strategy = build_strategy(
        StrategyConfig(name="scaffold", weighting="uniform", selection="oort", selector=SelectionConfig(cutoff=0.5)),
        FitConfig(),
        SamplingConfig(),
    )
    assert strategy.selection.policy == "oort" and strategy.selection.config.cutoff == 0.5


def test_a_batchs_observations_equal_each_clients_own() -> None:
    """Columns of a batch (NaN: not reported) give the observations of each client's metrics on its own: the
    simulated time first when usable, else the measured one; losses and durations that are not finite dropped."""
    nan, inf = math.nan, math.inf
    ids = ["a", "b", "c", "d", "e", "f"]
    counts = np.array([5, 0, 7, 1, 2, 3], dtype=np.int64)
    metrics = {
        "train_loss": np.array([0.5, nan, inf, -0.0, 2.0, nan]),
        "simulated_seconds": np.array([3.0, nan, -1.0, inf, 0.0, nan]),
        "fit_seconds": np.array([0.1, 0.2, 0.3, 0.4, nan, -0.5]),
    }
    got = batch_observations(ids, counts, metrics)
    want = [
        observation(cid, int(n), {k: float(v[i]) for k, v in metrics.items() if not math.isnan(v[i])})
        for i, (cid, n) in enumerate(zip(ids, counts.tolist(), strict=True))
    ]
    assert got == want
    assert [(o.loss, o.seconds) for o in got] == [
        (0.5, 3.0),
        (None, 0.2),
        (None, 0.3),
        (-0.0, 0.4),
        (2.0, 0.0),
        (None, None),
    ]
    assert batch_observations(["x"], np.array([4]), {}) == [ClientObservation(client_id="x", num_examples=4)]
