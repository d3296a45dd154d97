"""Client-level DP-FedAvg: clipping, noise, adaptive clipping, noise shares, accounting, and the round loop's stop
at a target epsilon. Numbers are computed by hand or by dp-accounting called directly."""

from __future__ import annotations

import math
from pathlib import Path

import dp_accounting
import numpy as np
import pandas as pd
import pytest
from dp_accounting import pld, rdp
from scipy import stats

from fedcore.errors import AggregationError, BudgetExhausted, ConfigError, NonFiniteError, UpdateRejected
from fedcore.messages import FitIns, FitRes
from fedcore.mods import ModContext, check_mods
from fedcore.strategy import SamplingConfig, StrategyConfig, build_strategy
from fedcore.task import FitConfig
from fedcore.tensors import NamedArrays, spec_of
from privacy.dp.accounting import epsilon
from privacy.dp.aggregator import DPFedAvgAggregator
from privacy.dp.config import PrivacyConfig, apply_dp
from privacy.dp.distributed import ClipAndNoiseMod
from privacy.dp.mechanism import (
    AdaptiveClipping,
    clip_update,
    l2_norm,
    minimum_contributors,
    noise_share_stddev,
    update_noise_multiplier,
)
from simulations.config import load_recipe
from simulations.harness import run_simulation

FALSE_FAILURE = 1e-6
"""Each statistical test below fails a correct implementation with probability 1e-6 (its noise is drawn from the
OS's entropy, as in a real run, so it is not seeded)."""


def assert_std(samples: np.ndarray, std: float) -> None:
    """Two-sided chi-square test that zero-mean ``samples`` have standard deviation ``std``: with n samples,
    ``sum(x^2) / std^2 ~ chi2(n)``; refused outside the central 1 - FALSE_FAILURE of that law."""
    x = samples.reshape(-1).astype(np.float64)
    statistic = float(np.dot(x, x)) / std**2
    low, high = stats.chi2.ppf([FALSE_FAILURE / 2, 1 - FALSE_FAILURE / 2], df=x.size)
    assert low <= statistic <= high, f"sample std {math.sqrt(statistic / x.size) * std:.5g} vs configured {std}"


# --- clipping -----------------------------------------------------------------------------------------------------


def test_clipping_by_hand() -> None:
    clipped, norm = clip_update({"w": np.array([3.0, 0.0], np.float32), "b": np.array([4.0], np.float32)}, 1.0)
    assert norm == 5.0
    np.testing.assert_allclose(clipped["w"], [0.6, 0.0])
    np.testing.assert_allclose(clipped["b"], [0.8])
    same, norm = clip_update({"w": np.array([0.3, 0.4])}, 1.0)
    assert norm == pytest.approx(0.5)
    np.testing.assert_array_equal(same["w"], [0.3, 0.4])
    counter = {"steps": np.array([7], np.int64), "w": np.array([6.0, 8.0])}  # integer tensors are not clipped
    clipped, norm = clip_update(counter, 2.0)
    assert norm == 10.0 and clipped["steps"][0] == 7
    np.testing.assert_allclose(clipped["w"], [1.2, 1.6])


def test_every_clipped_update_is_within_the_norm() -> None:
    rng = np.random.default_rng(0)
    for trial in range(200):
        scale = 10.0 ** rng.uniform(-4, 6)
        update = {f"t{i}": (rng.standard_normal(rng.integers(1, 50)) * scale).astype(np.float32) for i in range(3)}
        c = 10.0 ** rng.uniform(-2, 2)
        clipped, norm = clip_update(update, c)
        assert l2_norm(clipped) <= c * (1 + 1e-12), trial
        if norm <= c:
            for name in update:
                np.testing.assert_array_equal(clipped[name], update[name].astype(np.float64))


def test_an_infinite_norm_clips_to_zero() -> None:
    clipped, norm = clip_update({"w": np.array([1e200, 1e200])}, 1.0)
    assert norm == math.inf
    np.testing.assert_array_equal(clipped["w"], [0.0, 0.0])


# --- central mode -------------------------------------------------------------------------------------------------


def central(**kw: object) -> DPFedAvgAggregator:
    settings: dict[str, object] = {
        "mode": "central",
        "clipping_norm": 1.0,
        "noise_multiplier": 1.0,
        "expected_clients": 2,
        "population": 10,
    }
    settings.update(kw)
    return DPFedAvgAggregator(**settings)  # type: ignore[arg-type]


def test_central_aggregate_by_hand() -> None:
    """w + (clip([3, 4]) + [0.3, 0.4]) / m with m = 2, noise negligible (z = 1e-9): [0.45, 0.6] added to w."""
    reference = {"w": np.array([1.0, -1.0]), "n": np.array([5], np.int64)}
    acc = central(noise_multiplier=1e-9).start(spec_of(reference), round=1, reference=reference)
    acc.add({"w": np.array([4.0, 3.0]), "n": np.array([9], np.int64)}, 1.0, client_id="a")
    acc.add({"w": np.array([1.3, -0.6]), "n": np.array([1], np.int64)}, 1.0, client_id="b")
    out = acc.result()
    np.testing.assert_allclose(out["w"], [1.45, -0.4], atol=1e-7)
    assert out["n"][0] == 5  # the global model's integer tensor, nothing from the clients
    assert acc.report()["dp_clipping_norm"] == 1.0


def test_central_noise_has_the_configured_std() -> None:
    """Every client returns the global model (update 0): what the aggregate holds is the noise, N(0, (z C / m)^2)."""
    z, c, m = 1.3, 0.7, 4
    reference = {"w": np.zeros((300, 300), np.float64)}
    acc = central(noise_multiplier=z, clipping_norm=c, expected_clients=m).start(
        spec_of(reference), round=1, reference=reference
    )
    for cid in "abc":
        acc.add({"w": np.zeros((300, 300))}, 1.0, client_id=cid)
    noise = acc.result()["w"]
    assert_std(noise, z * c / m)
    assert acc.report()["dp_noise_std"] == pytest.approx(z * c / m)


def test_central_refusals() -> None:
    reference = {"w": np.zeros(2)}
    rule = central()
    with pytest.raises(ConfigError, match="reference"):
        rule.start(spec_of(reference), round=1)
    with pytest.raises(ConfigError, match="selects 3 clients"):
        rule.check(3)
    acc = rule.start(spec_of(reference), round=1, reference=reference)
    with pytest.raises(UpdateRejected, match="uniform"):
        acc.add({"w": np.zeros(2)}, 12.0)
    with pytest.raises(AggregationError):
        acc.result()
    with pytest.raises(ConfigError, match="population"):
        central(population=1)
    with pytest.raises(ConfigError, match="distributed mode"):
        central(tolerated_dropout=0.1)


def test_a_non_finite_update_after_a_noisy_round_names_the_noise() -> None:
    """From round 2 on the global model carries the released rounds' noise, z * C / m per coordinate (here
    1.5 * 0.4 / 4 = 0.15): a NaN update then points at the DP settings as well as the client's learning rate."""
    reference = {"w": np.zeros(3)}
    rule = central(noise_multiplier=1.5, clipping_norm=0.4, expected_clients=4, population=40)
    first = rule.start(spec_of(reference), round=1, reference=reference)
    with pytest.raises(NonFiniteError) as caught:
        first.add({"w": np.array([0.0, np.nan, 1.0])}, 1.0, client_id="c1", round=1)
    assert "learning rate" in str(caught.value) and "noise" not in str(caught.value)
    second = rule.start(spec_of(reference), round=2, reference=reference)
    with pytest.raises(NonFiniteError) as caught:
        second.add({"w": np.array([np.inf, 0.0, 1.0])}, 1.0, client_id="c1", round=2)
    message = str(caught.value)
    assert "standard deviation 0.15 per coordinate" in message, message
    assert "--noise-multiplier" in message and "--min-fit-clients" in message and "learning rate" in message
    assert second.count == 0  # nothing of it was folded


# --- adaptive clipping --------------------------------------------------------------------------------------------


def test_adaptive_clipping_follows_the_hand_computed_sequence() -> None:
    """C0 = 1, gamma = 0.5, eta = 0.2, m = 4. Round 1: 3 unclipped, count noise 0: b = 0.75, C1 = exp(-0.2 * 0.25)
    = exp(-0.05). Round 2: 1 unclipped, noise 0.4: b = 0.35, C2 = C1 exp(0.03) = exp(-0.02). Round 3: 4
    unclipped, noise -1: b = 0.75, C3 = exp(-0.07)."""
    rule = AdaptiveClipping(target_quantile=0.5, learning_rate=0.2, clipped_count_stddev=1.0)
    c1 = rule.next_norm(1.0, 3, 4, 0.0)
    c2 = rule.next_norm(c1, 1, 4, 0.4)
    c3 = rule.next_norm(c2, 4, 4, -1.0)
    assert (c1, c2, c3) == pytest.approx((0.951229424500714, 0.980198673306755, 0.932393819905948), rel=1e-14)


def test_adaptive_noise_split() -> None:
    """z = 1, sigma_b = 1: z_delta = (1 - 1/4)^(-1/2) = 2 / sqrt(3)."""
    assert update_noise_multiplier(1.0, 1.0) == pytest.approx(2 / math.sqrt(3), rel=1e-15)
    with pytest.raises(ConfigError, match=r"> z / 2.*raise privacy\.clipped_count_stddev \(--clipped-count-stddev\)"):
        update_noise_multiplier(2.0, 1.0)  # the message names the option to change


def test_adaptive_aggregator_moves_the_norm_for_the_next_round() -> None:
    """Four updates of norm 5 with C0 = 1: b~ = (0 + noise) / 4 with noise N(0, 0.01^2), so the norm grows by
    exp(0.2 * (0.5 - b~)) ~ exp(0.1) for round 2."""
    rule = central(expected_clients=4, adaptive=AdaptiveClipping(clipped_count_stddev=0.01), noise_multiplier=0.001)
    reference = {"w": np.zeros(2)}
    acc = rule.start(spec_of(reference), round=1, reference=reference)
    for cid in "abcd":
        acc.add({"w": np.array([3.0, 4.0])}, 1.0, client_id=cid)
    acc.result()
    # |noise| < 0.06 (6 sigma): C2 within exp(0.1 +- 0.003)
    assert math.exp(0.097) < rule.clipping_norm_for(2) < math.exp(0.103)
    assert rule.clipping_norm_for(1) == 1.0
    # distributed mode learns the noisy count only from the secure sum (privacy.dp.secure): alone, it refuses
    distributed = central(mode="distributed", adaptive=AdaptiveClipping())
    with pytest.raises(ConfigError, match="enable secure aggregation"):
        distributed.start(spec_of(reference), round=1, reference=reference)


# --- distributed mode ---------------------------------------------------------------------------------------------


def test_noise_shares_sum_to_the_central_std() -> None:
    """n_min clients each add N(0, s^2) with s = z C / sqrt(n_min): the sum of their shares is N(0, (z C)^2)."""
    z, c, m, dropout = 1.1, 0.5, 10, 0.2
    n_min = minimum_contributors(m, dropout)
    assert n_min == 8
    s = noise_share_stddev(z, c, m, dropout)
    assert s == pytest.approx(z * c / math.sqrt(8))
    mod = ClipAndNoiseMod(clipping_norm=c, noise_stddev=s)
    reference = {"w": np.zeros(40_000)}
    shares = [mod.privatize(reference, reference)["w"] for _ in range(n_min)]
    assert_std(shares[0], s)
    assert_std(np.sum(shares, axis=0), z * c)


def test_distributed_mod_clips_before_adding_its_share() -> None:
    mod = ClipAndNoiseMod(clipping_norm=1.0, noise_stddev=0.0)
    reference: NamedArrays = {"w": np.array([1.0, 1.0], np.float32), "n": np.array([3], np.int64)}
    out = mod.privatize(reference, {"w": np.array([4.0, 5.0], np.float32), "n": np.array([8], np.int64)})
    np.testing.assert_allclose(out["w"], [1.6, 1.8], rtol=1e-6)
    assert out["w"].dtype == np.float32 and out["n"][0] == 3

    instruction = FitIns(round=1, parameters=reference, config=FitConfig(), seed=0)

    def train(ins: FitIns) -> FitRes:
        return FitRes(
            client_id="a",
            round=1,
            parameters={"w": np.array([1.0, 9.0], np.float32), "n": ins.parameters["n"]},
            num_examples=3,
        )

    reply = mod(instruction, ModContext(client_id="a", model=None, state=None), train)
    np.testing.assert_allclose(reply.parameters["w"], [1.0, 2.0])


def test_distributed_server_releases_no_sum_of_too_few_shares() -> None:
    rule = DPFedAvgAggregator(
        mode="distributed",
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=4,
        population=8,
        tolerated_dropout=0.25,
    )
    assert rule.minimum_clients == 3
    with pytest.raises(ConfigError, match="n_min=3"):
        rule.check(2)
    reference = {"w": np.zeros(2)}
    acc = rule.start(spec_of(reference), round=1, reference=reference)
    acc.add({"w": np.array([0.5, 0.0])}, 1.0)
    acc.add({"w": np.array([0.0, 0.5])}, 1.0)
    with pytest.raises(AggregationError, match="n_min=3"):
        acc.result()
    acc.add({"w": np.array([0.5, 0.5])}, 1.0)
    np.testing.assert_allclose(acc.result()["w"], [0.25, 0.25])  # the shares' sum over m = 4, as sent


# --- accounting ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_equals_the_library_value(accountant: str) -> None:
    q, z, rounds, delta = 0.05, 1.1, 30, 1e-5  # PLD: about 10 s
    library = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    library.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    expected = library.get_epsilon(delta)
    got = epsilon(noise_multiplier=z, sampling_rate=q, rounds=rounds, delta=delta, accountant=accountant)  # type: ignore[arg-type]
    assert got == expected
    rule = central(noise_multiplier=z, expected_clients=5, population=100, delta=delta, accountant=accountant)
    assert rule.epsilon_after(rounds) == expected
    assert epsilon(noise_multiplier=z, sampling_rate=q, rounds=0, delta=delta) == 0.0


def test_a_round_beyond_the_target_epsilon_is_refused_before_it_starts() -> None:
    """q = 1 (every client every round): the target lies between the epsilons of rounds 3 and 4."""
    three, four = (epsilon(noise_multiplier=2.0, sampling_rate=1.0, rounds=r, delta=1e-5) for r in (3, 4))
    rule = central(noise_multiplier=2.0, population=2, target_epsilon=(three + four) / 2)
    reference = {"w": np.zeros(2)}
    rule.start(spec_of(reference), round=3, reference=reference)
    with pytest.raises(BudgetExhausted, match="round 4 would spend"):
        rule.start(spec_of(reference), round=4, reference=reference)


def test_a_target_epsilon_below_one_rounds_cost_is_refused_at_configuration() -> None:
    """A budget that cannot pay for round 1 is a configuration error, known from z, q and delta alone: an adversarial
    user's run with target 0.5 (one round: 3.894) loaded the data, replaced its output with the untrained model and
    exited 0 after 0 rounds. The edge (the target equal to one round's epsilon) is taken."""
    one = epsilon(noise_multiplier=1.0, sampling_rate=0.5, rounds=1, delta=1e-5)
    assert one == pytest.approx(3.894, abs=1e-3)
    with pytest.raises(
        ConfigError, match=r"target_epsilon 0\.5 cannot pay for one round: a round spends epsilon 3\.894"
    ):
        central(noise_multiplier=1.0, expected_clients=5, population=10, target_epsilon=0.5)
    central(noise_multiplier=1.0, expected_clients=5, population=10, target_epsilon=one)


def test_more_clients_a_round_than_the_population_is_refused_at_configuration() -> None:
    """min_fit_clients 3 with privacy.population 2 was taken (m quietly lowered to 2) and the server stopped at
    round 1, after the daemons had joined."""
    sampling = SamplingConfig(fraction_fit=1.0, min_fit_clients=3)
    base = build_strategy(StrategyConfig(name="fedavg"), FitConfig(), sampling)
    with pytest.raises(ConfigError, match=r"the rounds select 3 clients .* privacy\.population is 2"):
        apply_dp(base, PrivacyConfig(dp="central", population=2))
    apply_dp(base, PrivacyConfig(dp="central", population=3))


# --- configuration ------------------------------------------------------------------------------------------------


def test_apply_dp_composes_the_strategy() -> None:
    sampling = SamplingConfig(fraction_fit=0.1, min_fit_clients=2)
    base = build_strategy(StrategyConfig(name="fedavgm", server_momentum=0.9), FitConfig(), sampling)
    assert apply_dp(base, PrivacyConfig()) is base
    dp = apply_dp(base, PrivacyConfig(dp="central"), population=100)
    assert isinstance(dp.aggregator, DPFedAvgAggregator)
    assert dp.weighting == "uniform" and dp.server_optimizer == base.server_optimizer
    assert dp.aggregator.sampling_rate == 10 / 100
    distributed = apply_dp(
        base, PrivacyConfig(dp="distributed", noise_multiplier=2.0, tolerated_dropout=0.2), population=100
    )
    assert distributed.mods[0].name == "dp-clip"
    assert distributed.mods[0].params["noise_stddev"] == pytest.approx(2.0 / math.sqrt(8))
    check_mods(distributed.mods)  # what a client does when the instruction arrives
    with pytest.raises(ConfigError, match="population"):
        apply_dp(base, PrivacyConfig(dp="central"))
    # a simulation knows N: another privacy.population would give the accountant a wrong sampling rate
    with pytest.raises(ConfigError, match=r"privacy.population = 1000, but the rounds sample from 100 clients"):
        apply_dp(base, PrivacyConfig(dp="central", population=1000), population=100)
    agreeing = apply_dp(base, PrivacyConfig(dp="central", population=100), population=100)
    assert isinstance(agreeing.aggregator, DPFedAvgAggregator) and agreeing.aggregator.sampling_rate == 10 / 100
    scaffold = build_strategy(StrategyConfig(name="scaffold"), FitConfig(), sampling)
    with pytest.raises(ConfigError, match="tensor groups"):
        apply_dp(scaffold, PrivacyConfig(dp="central"), population=100)
    with pytest.raises(ConfigError, match="clipping_norm"):
        check_mods((distributed.mods[0].__class__("dp-clip", {"clipping_norm": -1.0, "noise_stddev": 0.1}),))
    with pytest.raises(ConfigError, match="target_quantile"):
        PrivacyConfig(dp="central", target_quantile=1.0)
    with pytest.raises(ConfigError, match="enable secure aggregation"):
        apply_dp(base, PrivacyConfig(dp="distributed", adaptive_clipping=True), population=100)


# --- simulation ---------------------------------------------------------------------------------------------------

SMALL_DP = [
    "data.dataset=digits",
    "data.num_clients=8",
    "data.partition=iid",
    "model.name=logreg",
    "sampling.min_fit_clients=4",
    "sampling.fraction_fit=0.5",
    "train.batch_size=32",
    "train.lr=0.1",
    "train.local_epochs=1",
    "evaluate_every=1",
    "output.progress=false",
    "output.plot=false",
    "strategy.name='fedavg'",
    "privacy.noise_multiplier=1.0",
    "privacy.clipping_norm=0.5",
]


def test_simulation_reports_epsilon_per_round_and_stops_at_the_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Central DP, q = 4 / 8: the history's epsilon after round r is dp-accounting's for (q, z, r, delta); with the
    target between the epsilons of rounds 2 and 3, a 5-round run stops after round 2, evaluates and keeps its model."""
    eps = [epsilon(noise_multiplier=1.0, sampling_rate=0.5, rounds=r, delta=1e-5) for r in (1, 2, 3)]
    config = load_recipe(
        None,
        [
            *SMALL_DP,
            "rounds=5",
            "evaluate_every=5",
            "privacy.dp='central'",
            f"privacy.target_epsilon={(eps[1] + eps[2]) / 2}",
            f"output.dir={str(tmp_path)!r}",
            "output.progress=true",
        ],
    )
    result = run_simulation(config, echo=lambda _: None)
    history = result.history
    assert list(history["round"]) == [0, 1, 2]
    assert result.final.round == 2
    assert history["test_accuracy"].iloc[2] > 0  # the last round within budget is evaluated like a final round
    assert math.isnan(history["test_accuracy"].iloc[1])
    assert list(history["epsilon"].iloc[1:]) == eps[:2]
    assert math.isnan(history["epsilon"].iloc[0])
    assert (history["dp_clipping_norm"].iloc[1:] == 0.5).all()
    on_disk = pd.read_csv(tmp_path / "history.csv")
    np.testing.assert_array_equal(on_disk["epsilon"].iloc[1:], eps[:2])
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["round", "clients", "train_loss", "test_loss", "test_accuracy", "epsilon", "seconds"]
    assert float(table[2].split()[5]) == pytest.approx(eps[0], abs=1e-4)


def test_simulation_in_distributed_mode_sends_the_mod_and_reports_epsilon(tmp_path: Path) -> None:
    config = load_recipe(
        None,
        [
            *SMALL_DP,
            "rounds=2",
            "privacy.dp='distributed'",
            "privacy.tolerated_dropout=0.25",
            f"output.dir={str(tmp_path)!r}",
        ],
    )
    history = run_simulation(config, echo=lambda _: None).history
    assert list(history["round"]) == [0, 1, 2]
    assert (history["clients"].iloc[1:] == 4).all()
    expected = epsilon(noise_multiplier=1.0, sampling_rate=0.5, rounds=2, delta=1e-5)
    assert history["epsilon"].iloc[2] == expected
    # the noise on the average: 4 shares of z C / sqrt(3) over m = 4
    assert history["dp_noise_std"].iloc[2] == pytest.approx(0.5 * math.sqrt(4 / 3) / 4)


@pytest.mark.parametrize("flag", ["--noise-multiplier", "--dp-sgd-noise-multiplier"])
def test_an_overflowing_noise_multiplier_is_refused_before_the_first_round(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--noise-multiplier 1e300 printed round 0, then dp-accounting's OverflowError traceback (exit 1)."""
    from fedcore.cli import main

    out = tmp_path / "run"
    argv = [
        "simulate",
        "--dataset",
        "digits",
        "--model",
        "logreg",
        "--clients",
        "4",
        "--rounds",
        "1",
        "--dp",
        "central",
    ]
    assert main([*argv, flag, "1e300", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    name = flag[2:].replace("-", "_")
    assert f"privacy.{name} must be at most 1e+06, got 1e+300" in err and "Traceback" not in err
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"noise multiplier must be a number in \(0, 1e\+06\], got 1e\+300"):
        central(noise_multiplier=1e300)


def test_a_delta_not_below_one_over_the_clients_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--delta 0.5 with 20 clients ran and reported epsilon 0.0000 without a word."""
    from fedcore.cli import main
    from privacy.dp.config import weak_delta

    assert weak_delta(PrivacyConfig(dp="central", delta=1 / 20), 20) is not None  # 1 / N itself is too large
    assert weak_delta(PrivacyConfig(dp="central", delta=0.049), 20) is None
    assert weak_delta(PrivacyConfig(delta=0.5), 20) is None  # DP off: no guarantee claimed
    argv = ["simulate", "--dataset", "digits", "--model", "logreg", "--clients", "20", "--rounds", "1", "--dp",
            "central", "--delta", "0.5", "--out", str(tmp_path / "run")]  # fmt: skip
    with caplog.at_level("WARNING", logger="fedcore.simulation"):
        assert main(argv) == 0
    assert [r.getMessage() for r in caplog.records if "privacy.delta" in r.getMessage()] == [
        "privacy.delta = 0.5 is not below 1 / N = 1/20 = 0.05: the guarantee then allows publishing a few clients' "
        "data whole, whatever epsilon is reported; choose delta below 1 / N (--delta), e.g. 0.037"
    ]


def test_a_secagg_field_too_small_for_the_noise_is_refused_before_a_simulation_writes_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a server refuses it at start: simulate evaluated round 0 and wrote its output directory first."""
    from fedcore.cli import main

    out = tmp_path / "run"
    argv = ["simulate", "--dataset", "digits", "--model", "2nn", "--clients", "3", "--min-fit-clients", "3",
            "--fraction-fit", "1.0", "--secure-aggregation", "--clip", "1", "--dp", "distributed", "--clipping-norm",
            "1", "--noise-multiplier", "0.5", "--rounds", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 2
    assert "Set [strategy.secagg] clip (--clip) to at least 2.3" in capsys.readouterr().err
    assert not out.exists()
