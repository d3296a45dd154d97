"""Distributed DP under SecAgg+ (``--dp distributed --secure-aggregation``): discrete Gaussian shares added inside
the field, only the masked noisy sum unmasked, accounting of the combined noise, dropouts, and the field checks."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedcore.cli import simulate_options
from fedcore.config import from_mapping
from fedcore.errors import ConfigError, RoundFailed
from fedcore.options import add_options, given_values
from fedcore.strategy import SamplingConfig, StrategyConfig, build_strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, initial_parameters, trainable_names
from fedcore.tensors import TensorSpec
from privacy.dp.accounting import epsilon
from privacy.dp.config import PrivacyConfig, apply_dp
from privacy.dp.ddgauss import (
    MAX_WRAP_PROBABILITY,
    check_field,
    discrete_gaussian,
    integer_noise_stddev,
    minimum_clip,
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
from server.round_loop import RoundConfig, initial_state, run_rounds
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


def secure_dp(privacy: PrivacyConfig = PRIVACY):
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
    # two rounds of independent noise: std sqrt(2) * 0.125; 1020 values estimate it within ~2.2% (one sigma)
    assert moved.std() == pytest.approx(math.sqrt(2) * on_average, rel=0.08)
    assert abs(moved.mean()) < 4 * math.sqrt(2) * on_average / math.sqrt(moved.size)


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
    assert moved.std() == pytest.approx(0.125, rel=0.08)
