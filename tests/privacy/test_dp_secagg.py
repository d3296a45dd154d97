"""Distributed DP under SecAgg+ (``--dp distributed --secure-aggregation``): discrete Gaussian shares added inside
the field, only the masked noisy sum unmasked, accounting of the combined noise, dropouts, and the field checks."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import dp_accounting
import dp_accounting.rdp
import numpy as np
import pytest
import torch
from torch import nn

from fedcore.cli import simulate_options
from fedcore.config import from_mapping
from fedcore.errors import ClientTaskError, ConfigError, RoundFailed
from fedcore.messages import FitIns, FitRes
from fedcore.mods import ModContext
from fedcore.options import add_options, given_values
from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig, build_strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, initial_parameters, trainable_names
from fedcore.tensors import NamedArrays, TensorSpec
from privacy.dp.accounting import epsilon
from privacy.dp.config import PrivacyConfig, apply_dp
from privacy.dp.ddgauss import (
    COUNT_TENSOR,
    MAX_WRAP_PROBABILITY,
    check_count_field,
    check_field,
    count_scale,
    count_share,
    discrete_gaussian,
    integer_noise_stddev,
    max_clipping_norm,
    min_clipping_norm,
    minimum_clip,
    read_count,
    signed,
    tau,
    wrap_probability,
)
from privacy.dp.mechanism import clip_update
from privacy.dp.secure import SecureDPAggregator
from privacy.secagg.client import rounding_key
from privacy.secagg.codec import MASKED
from privacy.secagg.config import SecAggConfig
from privacy.secagg.inmemory import run_round
from privacy.secagg.messages import Stage
from privacy.secagg.quantize import quantize
from privacy.secagg.rounds import SecAggClientMachine, SecAggMod
from privacy.secagg.server import SecAggResult
from server.round_loop import RoundConfig, RoundRecord, ServerState, initial_state, run_rounds
from simulations.inmemory import InMemoryPool
from tests.privacy.secagg.test_rounds import Recording

IDS = ["a", "b", "c", "d"]
SEED = 3


# -- the discrete Gaussian -------------------------------------------------------------------------------------------


def test_discrete_gaussian_has_its_probability_ratios_and_standard_deviation() -> None:
    rng = np.random.default_rng(0)
    draws = discrete_gaussian(400_000, 1.0, rng)
    counts = {v: int(np.sum(draws == v)) for v in (-1, 0, 1, 2)}
    # P(x) ∝ exp(-x^2 / 2): P(0)/P(1) = e^0.5 = 1.6487, P(1)/P(2) = e^1.5 = 4.4817 (counts ~ 160k, 97k, 22k)
    assert counts[0] / counts[1] == pytest.approx(math.exp(0.5), rel=0.02)
    assert counts[1] / counts[2] == pytest.approx(math.exp(1.5), rel=0.04)
    assert counts[1] == pytest.approx(counts[-1], rel=0.02)
    for sigma in (3.7, 1234.5):
        sample = discrete_gaussian(200_000, sigma, rng)
        assert sample.dtype == np.int64
        assert abs(sample.mean()) < 4 * sigma / math.sqrt(sample.size)
        assert sample.std() == pytest.approx(sigma, rel=0.01)  # Var N_Z(0, s^2) = s^2 within 1e-8 for s >= 1
    with pytest.raises(ConfigError, match="sigma"):
        discrete_gaussian(3, 0.0, rng)


def field(**changes: float) -> float:
    """check_field with C = 1, z / sqrt(n_min) = 0.5, c = 8, L = 2^20, D = 1000, n_min = n = 4, as changed."""
    values = dict(share_multiplier=0.5, clipping_norm=1.0, clip=8.0, levels=1 << 20, dimension=1000)
    values.update(changes)
    return check_field(**values, minimum_clients=4, num_clients=4)  # type: ignore[arg-type]


def test_field_checks_name_the_clip_that_fits() -> None:
    # C = 1, z / sqrt(n_min) = 0.5, L = 2^20, c = 2, D = 1000: Delta = 1 * 2^20 / 4 + sqrt(1000) = 262175.6 units,
    # sigma = 131087.8 units = 0.50003 in update units
    sigma = integer_noise_stddev(0.5, 1.0, 2.0, 1 << 20, 1000)
    assert sigma == pytest.approx(0.5 * (2**18 + math.sqrt(1000)))
    assert field() == pytest.approx(0.5 * (1.0 + math.sqrt(1000) * 16.0 / 2**20))
    # the wrap-around bound at the clip the check names is the limit, by hand: c - C = s sqrt(2 ln(2D / p) / n_min)
    needed = minimum_clip(clipping_norm=1.0, noise_stddev=0.5, minimum_clients=4, dimension=1000)
    assert needed == pytest.approx(1.0 + 0.5 * math.sqrt(2 * math.log(2000 / MAX_WRAP_PROBABILITY) / 4))
    bound = wrap_probability(clipping_norm=1.0, clip=needed, noise_stddev=0.5, minimum_clients=4, dimension=1000)
    assert bound == pytest.approx(MAX_WRAP_PROBABILITY)
    with pytest.raises(ConfigError, match=r"clip \(--clip\) to at least 2\.88"):
        field(clip=2.0)
    with pytest.raises(ConfigError, match="clip"):  # c <= C: the field would clip the clipped update
        field(share_multiplier=50.0, clip=1.0, dimension=10)
    # a field too coarse for the noise: sigma of ~0.03 units leaves the sum far from one discrete Gaussian
    assert tau(0.3, 4) > 1.0
    with pytest.raises(ConfigError, match="field_bits"):
        field(share_multiplier=0.01, clip=4.0, levels=2, dimension=10)


# -- the secure sum of noisy updates ---------------------------------------------------------------------------------


def test_the_unmasked_sum_is_the_plain_sum_of_the_clipped_and_noised_updates() -> None:
    spec = (TensorSpec("w", (3, 2), "float32"), TensorSpec("b", (2,), "float32"))
    config = SecAggConfig(field_bits=32, clip=4.0, max_weight=1)
    params = config.resolve(len(IDS))
    rng = np.random.default_rng(7)
    updates, noises, seeds = {}, {}, {}
    for i, cid in enumerate(IDS):
        raw = {"w": rng.normal(0, 1.5, (3, 2)), "b": rng.normal(0, 1.5, 2)}
        clipped, norm = clip_update(raw, 1.0)
        assert norm > 1.0 or i  # at least the first is clipped
        updates[cid] = ({n: a.astype(np.float32) for n, a in clipped.items()}, 1)
        sigma = integer_noise_stddev(0.5, 1.0, params.clip, params.levels, 8)
        noises[cid] = discrete_gaussian(8, sigma, rng)
        seeds[cid] = bytes([i + 1]) * 32
    result = run_round(config, updates, spec, noise=noises, rounding_seeds=seeds, dropouts={Stage.UNMASK: {"d"}})
    # the field sum is exactly the sum of the quantized updates plus the noise, modulo 2^32
    expected = np.zeros(9, dtype=np.int64)
    for cid in IDS:
        q = quantize(updates[cid][0], 1, params, spec, rounding_key(seeds[cid], 1, cid)).astype(np.int64)
        q[:-1] += noises[cid]
        expected += q
    assert np.array_equal(result.field_sum, (expected % 2**32).astype(np.uint32))
    assert result.total_weight == 4
    # dequantized: the plain sum of clipped + noised updates, within one quantization step per client
    flat = {cid: np.concatenate([updates[cid][0]["w"].ravel(), updates[cid][0]["b"]]) for cid in IDS}
    plain = sum(flat[cid].astype(np.float64) + noises[cid] * params.step for cid in IDS)
    got = np.concatenate([result.weighted_sum["w"].ravel(), result.weighted_sum["b"]])
    assert np.max(np.abs(got - plain)) <= 4 * params.step
    assert np.max(np.abs(got - sum(flat[cid].astype(np.float64) for cid in IDS))) > 100 * params.step  # noise shows


# -- in federated rounds ---------------------------------------------------------------------------------------------


def model_fn() -> nn.Module:
    return nn.Linear(50, 20)  # D = 1020


def make_task(cid: str) -> SupervisedTask:
    g = torch.Generator().manual_seed(ord(cid))
    x = torch.randn(16, 50, generator=g)
    y = torch.randint(0, 20, (16,), generator=g)
    return SupervisedTask(model_fn=model_fn, train_data=(x, y))


FIT = FitConfig(local_epochs=1, batch_size=8, lr=1e-9)  # the update is ~1e-9: what the model moves by is the noise
SAMPLING = SamplingConfig(fraction_fit=1.0, min_fit_clients=4)
SECAGG = SecAggConfig(field_bits=32, clip=2.0, max_weight=1)
PRIVACY = PrivacyConfig(dp="distributed", clipping_norm=0.5, noise_multiplier=1.0, population=4)


def secure_dp(privacy: PrivacyConfig = PRIVACY) -> Strategy:
    strategy = build_strategy(StrategyConfig(secure_aggregation=True, secagg=SECAGG), FIT, SAMPLING)
    return apply_dp(strategy, privacy)


def test_noise_shares_sum_to_the_accounted_noise_and_only_masked_uploads_leave_the_clients() -> None:
    strategy = secure_dp()
    assert isinstance(strategy.aggregator, SecureDPAggregator)
    assert strategy.weighting == "uniform"
    assert [m.name for m in strategy.mods] == ["secagg"]  # no plain dp-clip mod: the noise goes into the field
    assert strategy.mods[0].params == {"weighting": "uniform", "clipping_norm": 0.5, "noise_multiplier": 0.5}
    state = initial_state(initial_parameters(model_fn, SEED), strategy, trainable=trainable_names(model_fn))
    pool = Recording(InMemoryPool(IDS, make_task))
    final, records = run_rounds(pool, strategy, state, RoundConfig(num_rounds=2, seed=SEED))
    assert pool.stages == ["advertise_keys", "share_keys", "collect_masked_input", "fit", "unmask"] * 2
    for reply in pool.fit_replies:
        assert list(reply.parameters) == [MASKED] and reply.parameters[MASKED].dtype == np.uint32
    # by hand: m = n_min = 4, z = 1, C = 0.5, c = 2, L = floor((2^32 - 1) / 4) = 1073741823, D = 1020. Each share
    # has s = (z / sqrt(4)) (C + sqrt(D) 2c / L) = 0.5 * (0.5 + 1.19e-7) in update units; the four sum to 2 s, and
    # the average (over m = 4) carries 2 s / 4 = 0.1250000297
    levels = (2**32 - 1) // 4
    s = 0.5 * (0.5 + math.sqrt(1020) * 4.0 / levels)
    on_average = 2 * s / 4
    assert on_average == pytest.approx(0.1250000297, rel=1e-9)
    for record in records:
        assert record.aggregation["dp_noise_std"] == pytest.approx(on_average, rel=1e-12)
        assert record.aggregation["dp_clipping_norm"] == 0.5
    assert [r.aggregation["epsilon"] for r in records] == [
        epsilon(noise_multiplier=1.0, sampling_rate=1.0, rounds=r, delta=1e-5) for r in (1, 2)
    ]
    start = initial_parameters(model_fn, SEED)
    moved = np.concatenate([(final.parameters[n].astype(np.float64) - start[n]).ravel() for n in start])
    # two rounds of independent noise: std sqrt(2) * 0.125. The noise comes from OS entropy, so the bounds are 5.5 and
    # 5 sigma of the estimates (1020 values give the std within 2.2%, one sigma): a false failure in ~1e-6 runs. A 4
    # sigma bound on the mean failed once in CI (z = 4.1); 200 runs gave mean(z) = -0.03, std(z) = 1.04, no bias.
    assert moved.std() == pytest.approx(math.sqrt(2) * on_average, rel=0.12)
    assert abs(moved.mean()) < 5 * math.sqrt(2) * on_average / math.sqrt(moved.size)


class RootLinear(nn.Module):
    """x -> x sqrt(W)^T with W = 0.05 everywhere at the start (D = 1000): it trains from the initial model, but a
    model that carries noise of std 0.125 has negative weights, whose square root is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((20, 50), 0.05))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.sqrt().T


def test_a_nan_update_under_distributed_dp_names_the_noise_the_global_model_carries() -> None:
    """Round 1 trains from the initial model; the global model after it carries the noise of four shares, so in
    round 2 every client's update is NaN. Each client refuses to send it with advice that gives the noise: by hand
    s = (z / sqrt(4)) (C + sqrt(D) 2c / L) = 0.5 (0.5 + sqrt(1000) 4 / 1073741823) = 0.25 per share, 0.25 / sqrt(4)
    = 0.125 on a round of four, the round's dp_noise_std."""

    def root_task(cid: str) -> SupervisedTask:
        return dataclasses.replace(make_task(cid), model_fn=RootLinear)

    strategy = secure_dp()
    state = initial_state(initial_parameters(RootLinear, SEED), strategy, trainable=trainable_names(RootLinear))
    pool = Recording(InMemoryPool(IDS, root_task))
    records: list[RoundRecord] = []

    def keep(record: RoundRecord, state: ServerState) -> None:
        records.append(record)

    with pytest.raises(RoundFailed) as caught:
        run_rounds(pool, strategy, state, RoundConfig(num_rounds=2, seed=SEED, max_round_attempts=1), on_round_end=keep)
    assert [r.round for r in records] == [1] and records[0].aggregation["dp_noise_std"] == pytest.approx(0.125)
    message = str(caught.value)
    assert "tensor 'weight' holds" in message and "NaN/Inf value(s); the update is not sent" in message
    assert (
        "each client's share has standard deviation 0.25 per coordinate (noise multiplier share 0.5 times clipping "
        "norm 0.5, plus the field's rounding), so a round of n clients adds 0.25 / sqrt(n)"
    ) in message
    assert "lower --clipping-norm or --noise-multiplier" in message


def test_fewer_survivors_than_n_min_are_never_unmasked_and_a_tolerated_dropout_is() -> None:
    strategy = secure_dp()
    state = initial_state(initial_parameters(model_fn, SEED), strategy, trainable=trainable_names(model_fn))
    pool = Recording(InMemoryPool(IDS, make_task), drop={("c", "fit")})
    with pytest.raises(RoundFailed, match=r"only 3 masked inputs arrived but the round needs 4.*nothing is unmasked"):
        run_rounds(pool, strategy, state, RoundConfig(num_rounds=1, seed=SEED, max_round_attempts=1))
    assert "unmask" not in pool.stages
    # tolerating a quarter: n_min = 3, each share raised to z C' / sqrt(3); the 3 survivors carry exactly z C'
    tolerant = secure_dp(dataclasses.replace(PRIVACY, tolerated_dropout=0.25))
    assert tolerant.mods[0].params["noise_multiplier"] == pytest.approx(1 / math.sqrt(3))
    pool = Recording(InMemoryPool(IDS, make_task), drop={("c", "fit")})
    _, records = run_rounds(pool, tolerant, state, RoundConfig(num_rounds=1, seed=SEED))
    assert sorted(records[-1].accepted) == ["a", "b", "d"] and "unmask" in pool.stages
    s = (0.5 + math.sqrt(1020) * 4.0 / ((2**32 - 1) // 4)) / math.sqrt(3)
    assert records[-1].aggregation["dp_noise_std"] == pytest.approx(s * math.sqrt(3) / 4, rel=1e-12)


def test_settings_that_cannot_be_honoured_are_refused_before_any_client_is_contacted() -> None:
    secured = build_strategy(StrategyConfig(secure_aggregation=True, secagg=SECAGG), FIT, SAMPLING)
    with pytest.raises(ConfigError, match="--dp distributed"):
        apply_dp(secured, PrivacyConfig(dp="central", population=4))
    narrow = build_strategy(
        StrategyConfig(secure_aggregation=True, secagg=SecAggConfig(clip=0.8, max_weight=1)), FIT, SAMPLING
    )
    strategy = apply_dp(narrow, PRIVACY)
    state = initial_state(initial_parameters(model_fn, SEED), strategy, trainable=trainable_names(model_fn))
    pool = Recording(InMemoryPool(IDS, make_task))
    # by hand: C + s sqrt(2 ln(2 D / 1e-9) / n_min) = 0.5 + 0.25 * sqrt(2 * 28.344 / 4) = 1.441
    with pytest.raises(ConfigError, match=r"Set \[strategy.secagg\] clip \(--clip\) to at least 1\.44"):
        run_rounds(pool, strategy, state, RoundConfig(num_rounds=1, seed=SEED))
    assert pool.stages == []


def test_dp_distributed_with_secure_aggregation_is_two_flags_of_simulate() -> None:
    options = simulate_options()
    parser = argparse.ArgumentParser()
    add_options(parser, options)
    flags = [
        "--dp",
        "distributed",
        "--secure-aggregation",
        "--clip",
        "2.0",
        "--max-weight",
        "1",
        "--clipping-norm",
        "0.5",
    ]
    values = given_values(parser.parse_args(flags), options)
    assert values["strategy"] == {"secure_aggregation": True, "secagg": {"clip": 2.0, "max_weight": 1}}
    assert values["privacy"] == {"dp": "distributed", "clipping_norm": 0.5}
    strategy = apply_dp(
        build_strategy(from_mapping(StrategyConfig, values["strategy"]), FIT, SAMPLING),
        from_mapping(PrivacyConfig, values["privacy"]),
        population=4,
    )
    assert isinstance(strategy.aggregator, SecureDPAggregator) and strategy.protocol is not None


@pytest.mark.timeout(120)
def test_the_same_option_runs_over_grpc_with_client_daemons(tmp_path: Path) -> None:
    """Daemons (threads, in-process gRPC) get the secagg mod with the DP parameters in the fit instruction, add
    their noise shares in the field and mask; the server releases the noisy average with its epsilon."""
    from tests.deploy.daemon_threads import daemon_threads
    from tests.deploy.test_service import Harness

    strategy = secure_dp()
    state = initial_state(initial_parameters(model_fn, SEED), strategy, trainable=trainable_names(model_fn))
    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=5.0)
    try:
        with daemon_threads(h, IDS, make_task):
            final, records = run_rounds(
                h.pool, strategy, state, RoundConfig(num_rounds=1, seed=SEED, round_timeout_s=60)
            )
    finally:
        h.pool.finish()
        h.close()
    assert sorted(records[-1].accepted) == IDS
    assert records[-1].aggregation["dp_noise_std"] == pytest.approx(0.1250000297, rel=1e-9)
    assert records[-1].aggregation["epsilon"] == epsilon(noise_multiplier=1.0, sampling_rate=1.0, rounds=1, delta=1e-5)
    start = initial_parameters(model_fn, SEED)
    moved = np.concatenate([(final.parameters[n].astype(np.float64) - start[n]).ravel() for n in start])
    assert moved.std() == pytest.approx(0.125, rel=0.12)  # OS-entropy noise: 5.5 sigma of the 2.2% estimate


# -- adaptive clipping under secure aggregation ----------------------------------------------------------------------

ADAPTIVE = dataclasses.replace(
    PRIVACY, adaptive_clipping=True, clipped_count_stddev=1.0, clipping_lr=1.0, target_quantile=0.5
)


COUNT_SPEC = (TensorSpec("w", (3,), "float32"), TensorSpec(COUNT_TENSOR, (1,), "float64"))


def count_round(
    config: SecAggConfig, bits: dict[str, bool], scale: int, sigma: float, rng: np.random.Generator
) -> tuple[SecAggResult, dict[str, int]]:
    """One secure sum of 4 clients whose updates are 0 and whose count coordinates carry ``count_share``; returns
    the result and the count noise each client drew."""
    params = config.resolve(len(bits))
    updates: dict[str, tuple[NamedArrays, int]]
    noises: dict[str, np.ndarray]
    drawn: dict[str, int]
    updates, noises, drawn = {}, {}, {}
    for cid, bit in bits.items():
        share = count_share(bit, scale, sigma, rng)
        drawn[cid] = int(share[0]) - scale * int(bit)
        updates[cid] = ({"w": np.zeros(3, np.float32), COUNT_TENSOR: np.full(1, -params.clip)}, 1)
        noises[cid] = np.concatenate([np.zeros(3, np.int64), share])
    return run_round(config, updates, COUNT_SPEC, noise=noises), drawn


def test_the_noisy_count_out_of_the_secure_sum_and_the_norm_step_by_hand() -> None:
    """sigma_b = 1.5, n_min = 4: S = 2^ceil(log2(64 * 2 / 1.5)) = 128, each client's sigma 128 * 1.5 / 2 = 96 field
    units. Three of four clients unclipped: the unmasked coordinate is 3 * 128 + the four draws, exactly."""
    assert count_scale(1.5, 4) == 128
    config = SecAggConfig(field_bits=32, clip=2.0, max_weight=1)
    bits = {"a": True, "b": True, "c": False, "d": True}
    result, drawn = count_round(config, bits, 128, 96.0, np.random.default_rng(1))
    coordinate = 3 * 128 + sum(drawn.values())
    assert int(result.field_sum[3]) == coordinate % 2**32  # a negative sum wraps to the top of the field
    count = read_count(result.field_sum, 32, 128)
    assert count == coordinate / 128
    assert signed(2**32 - 5, 32) == -5 and signed(5, 32) == 5
    # C <- C exp(-eta (count / m - gamma)), by hand for a known count: C = 0.5, count 2.75 of m = 4, gamma 0.5,
    # eta 0.2: 0.5 * exp(-0.2 * 0.1875) = 0.5 * exp(-0.0375) = 0.4815972089
    rule = secure_dp(dataclasses.replace(ADAPTIVE, clipping_lr=0.2)).aggregator
    assert isinstance(rule, SecureDPAggregator)
    dp = rule.dp
    assert dp.adapt(1, 0.5, 2.75) == pytest.approx(0.5 * math.exp(-0.0375), rel=1e-15)
    assert dp.clipping_norm_for(2) == pytest.approx(0.4815972089, rel=1e-9)
    assert dp.state_dict(1)["dp_clipping_norm"] == dp.clipping_norm_for(2)


def test_the_count_out_of_the_secure_sum_is_the_plain_count_plus_noise_of_the_stated_std() -> None:
    """Over 200 secure sums the count minus the plain count (3) has mean 0 and standard deviation sigma_b sqrt(k /
    n_min) = 1.5 (k = n_min = 4); 200 draws estimate a std within 5% (one sigma), a mean within 0.11."""
    config = SecAggConfig(field_bits=32, clip=2.0, max_weight=1, neighbours=3)
    rng = np.random.default_rng(2)
    bits = {"a": True, "b": False, "c": True, "d": True}
    errors = np.array(
        [read_count(count_round(config, bits, 128, 96.0, rng)[0].field_sum, 32, 128) - 3 for _ in range(200)]
    )
    assert abs(errors.mean()) < 4 * 1.5 / math.sqrt(errors.size)
    assert errors.std() == pytest.approx(1.5, rel=0.15)
    assert np.allclose(errors * 128, np.round(errors * 128))  # whole field units: nothing lost on the way


def test_adaptive_clipping_under_secure_aggregation_announces_steps_and_accounts_the_norm() -> None:
    """z = 1, sigma_b = 1: z_delta = (1 - 1/4)^(-1/2) = 2 / sqrt(3) on the update, 2 sigma_b = 2 on the count. The
    updates are ~1e-9 (lr 1e-9), so all four are unclipped: the count is 4 + noise of std 1, and C moves by
    exp(-1 * (count / 4 - 0.5)) ~ exp(-0.5) a round, which the clients must use: each round's model moves by the
    noise of its own C."""
    strategy = secure_dp(ADAPTIVE)
    assert isinstance(strategy.aggregator, SecureDPAggregator)
    params = strategy.mods[0].params
    z_delta = 2 / math.sqrt(3)
    assert params["noise_multiplier"] == pytest.approx(z_delta / 2, rel=1e-15)  # n_min = 4
    assert params["count_scale"] == 128 and params["count_noise"] == 64.0  # S = 2^ceil(log2(64 * 2 / 1)); S / 2
    models = [initial_parameters(model_fn, SEED)]

    def keep(record: RoundRecord, state: ServerState) -> None:
        models.append(state.parameters)

    state = initial_state(models[0], strategy, trainable=trainable_names(model_fn))
    pool = Recording(InMemoryPool(IDS, make_task))
    _, records = run_rounds(pool, strategy, state, RoundConfig(num_rounds=3, seed=SEED), on_round_end=keep)
    for reply in pool.fit_replies:
        assert reply.parameters[MASKED].shape == (1020 + 2,)  # the values, the count coordinate, the weight
    norms = [r.aggregation["dp_clipping_norm"] for r in records]
    assert norms[0] == 0.5
    levels = (2**32 - 1) // 4
    for r, record in enumerate(records):
        count = record.aggregation["dp_unclipped"]
        assert abs(count - 4) < 6.0  # 6 sigma of the count's noise (sigma_b = 1)
        if r + 1 < len(records):
            assert norms[r + 1] == pytest.approx(norms[r] * math.exp(-(count / 4 - 0.5)), rel=1e-12)
        # the noise of the round's own C: 2 shares' worth of z_delta / 2 (C + sqrt(D) 2c / L), over m = 4
        s = z_delta / 2 * (norms[r] + math.sqrt(1020) * 4.0 / levels)
        assert record.aggregation["dp_noise_std"] == pytest.approx(2 * s / 4, rel=1e-12)
        moved = np.concatenate([(models[r + 1][n].astype(np.float64) - models[r][n]).ravel() for n in models[0]])
        assert moved.std() == pytest.approx(2 * s / 4, rel=0.12), r  # OS-entropy noise: 5.5 sigma of 2.2%
    # both releases together are the Gaussian mechanism of z = 1: dp-accounting's epsilon of the composition
    for r, record in enumerate(records, start=1):
        library = dp_accounting.rdp.RdpAccountant()
        pair = dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(z_delta), dp_accounting.GaussianDpEvent(2.0)]
        )
        library.compose(dp_accounting.PoissonSampledDpEvent(1.0, pair), r)
        assert record.aggregation["epsilon"] == pytest.approx(library.get_epsilon(1e-5), rel=1e-9)
        assert record.aggregation["epsilon"] == epsilon(noise_multiplier=1.0, sampling_rate=1.0, rounds=r, delta=1e-5)


def test_adaptive_settings_the_field_or_the_paper_cannot_honour_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"> z / 2"):  # sigma_b = m / 20 = 0.2 against z = 1
        secure_dp(dataclasses.replace(ADAPTIVE, clipped_count_stddev=0.0))
    with pytest.raises(ConfigError, match="target_quantile"):
        dataclasses.replace(ADAPTIVE, target_quantile=0.0)
    with pytest.raises(ConfigError, match="clipping_lr"):
        dataclasses.replace(ADAPTIVE, clipping_lr=0.0)
    with pytest.raises(ConfigError, match="clipped_count_stddev"):
        dataclasses.replace(ADAPTIVE, clipped_count_stddev=-1.0)
    # the count coordinate: S n + its noise margin must stay below 2^(b-1); by hand for S = 128, sigma 64, n = 4:
    # 512 + 64 sqrt(8 ln(2e9)) = 512 + 838.4 = 1350.4 < 2^11 but not < 2^10
    check_count_field(scale=128, sigma=64.0, num_clients=4, field_bits=12)
    with pytest.raises(ConfigError, match="field_bits >= 13"):
        check_count_field(scale=128, sigma=64.0, num_clients=4, field_bits=11)
    # the largest C the field's clip carries: check_field accepts it and refuses a little more
    limit = max_clipping_norm(share_multiplier=0.5, clip=2.0, levels=1 << 20, dimension=1000, minimum_clients=4)
    field(clipping_norm=limit, clip=2.0)
    with pytest.raises(ConfigError, match="clip"):
        field(clipping_norm=limit * 1.0001, clip=2.0)
    # the smallest C whose noise is fine enough (sigma = 0.01 (128 C + sqrt(10)) field units): accepted, a little
    # less refused
    low = min_clipping_norm(share_multiplier=0.01, clip=4.0, levels=1024, dimension=10, num_clients=4)
    assert 0.5 < low < 2.0
    field(share_multiplier=0.01, clipping_norm=low, clip=4.0, levels=1024, dimension=10)
    with pytest.raises(ConfigError, match="field_bits"):
        field(share_multiplier=0.01, clipping_norm=low * 0.999, clip=4.0, levels=1024, dimension=10)
    assert min_clipping_norm(share_multiplier=0.5, clip=2.0, levels=1 << 20, dimension=1000, num_clients=4) == 0
    # an adapted norm above it is held at it (the initial norm is refused instead, as with a fixed one)
    strategy = secure_dp(ADAPTIVE)
    rule = strategy.aggregator
    assert isinstance(rule, SecureDPAggregator)
    rule.load_state(1, {"dp_clipping_norm": np.array(50.0)})
    rule.check(4)
    spec = (TensorSpec("weight", (20, 50), "float32"), TensorSpec("bias", (20,), "float32"))
    reference = initial_parameters(model_fn, SEED)
    accumulator = rule.start(spec, round=2, reference=reference)
    held = accumulator.report()["dp_clipping_norm"]
    params = SECAGG.resolve(4)
    assert held == max_clipping_norm(
        share_multiplier=rule.share_multiplier(), clip=2.0, levels=params.levels, dimension=1020, minimum_clients=4
    )
    assert 0.5 < held < 2.0


class _Stages:
    """The one SecAgg+ machine a client holds for the round."""

    def __init__(self, machine: SecAggClientMachine) -> None:
        self._machine = machine

    def machine(self, round: int, client_id: str, protocol: str) -> SecAggClientMachine:
        return self._machine


def test_an_adaptive_client_refuses_a_round_that_announced_no_clipping_norm_before_training() -> None:
    mod = SecAggMod(weighting="uniform", clipping_norm=0.5, noise_multiplier=0.5, count_scale=128, count_noise=64.0)
    machine = SecAggClientMachine("a")
    machine.ready = True
    machine.spec = (TensorSpec("w", (3,), "float32"), TensorSpec(COUNT_TENSOR, (1,), "float64"))
    context = ModContext(client_id="a", model=None, state=None, stages=_Stages(machine))
    instruction = FitIns(round=1, parameters={"w": np.zeros(3, np.float32)}, config=FIT, seed=0)
    trained: list[int] = []

    def train(ins: FitIns) -> FitRes:
        trained.append(ins.round)
        raise AssertionError("a client must not train for a round it cannot privatize")

    for settings in ({}, {"dp_clipping_norm": 0.0}, {"dp_clipping_norm": -1.0}):
        machine.settings = settings
        with pytest.raises(ClientTaskError, match="did not announce a clipping norm"):
            mod(instruction, context, train)
    machine.settings = {"dp_clipping_norm": 0.5}
    machine.spec = machine.spec[:1]  # a server that left out the count coordinate
    with pytest.raises(ClientTaskError, match="coordinate"):
        mod(instruction, context, train)
    assert trained == []
    with pytest.raises(ConfigError, match="count_noise"):
        SecAggMod(weighting="uniform", clipping_norm=0.5, noise_multiplier=0.5, count_scale=128)
    with pytest.raises(ConfigError, match="count_scale"):
        SecAggMod(weighting="uniform", clipping_norm=0.5, noise_multiplier=0.5, count_scale=-1, count_noise=1.0)
