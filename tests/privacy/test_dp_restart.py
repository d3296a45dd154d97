"""Privacy state across a server restart, with the real state directory (server/state.py): adaptive clipping's norm
comes back from the checkpoint, and a DP-SGD round trained again after the restart is accounted once."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client.state import ClientStateStore
from fedcore.errors import StateError
from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig, build_strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, initial_parameters, trainable_names
from privacy.dp.accounting import epsilon
from privacy.dp.aggregator import DPFedAvgAggregator
from privacy.dp.config import PrivacyConfig, apply_dp
from privacy.dp.secure import SecureDPAggregator
from privacy.secagg.config import SecAggConfig
from server.round_loop import RoundConfig, RoundRecord, ServerState, initial_state, run_rounds
from server.state import StateStore, load_checkpoint
from simulations.inmemory import InMemoryPool

IDS = ["a", "b", "c", "d"]
SIZES = {"a": 12, "b": 16, "c": 20, "d": 24}
SEED = 11
FIT = FitConfig(local_epochs=1, batch_size=8, lr=0.2)


def model_fn() -> nn.Module:
    return nn.Linear(5, 3)


def make_task(cid: str) -> SupervisedTask:
    g = torch.Generator().manual_seed(ord(cid))
    x = torch.randn(SIZES.get(cid, 12), 5, generator=g)
    y = torch.randint(0, 3, (SIZES.get(cid, 12),), generator=g)
    return SupervisedTask(model_fn=model_fn, train_data=(x, y))


def strategy_for(privacy: PrivacyConfig, fit: FitConfig = FIT) -> Strategy:
    """A fresh strategy, as a restarted server builds it from its config."""
    return apply_dp(Strategy(fit=fit, sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=4)), privacy)


class Crash(Exception):
    """The server process dying after a round's clients trained, before its checkpoint was written."""


def run_until_crash(
    store: StateStore, strategy: Strategy, pool: InMemoryPool, *, crash_at: int, rounds: int
) -> list[RoundRecord]:
    records: list[RoundRecord] = []

    def on_round_end(record: RoundRecord, state: ServerState) -> ServerState:
        if record.round == crash_at:
            raise Crash
        store.save_checkpoint(state)
        store.record_round(record)
        records.append(record)
        return state

    start = initial_state(initial_parameters(model_fn, SEED), strategy, trainable=trainable_names(model_fn))
    with pytest.raises(Crash):
        run_rounds(pool, strategy, start, RoundConfig(num_rounds=rounds, seed=SEED), on_round_end=on_round_end)
    return records


def resume(directory: Path, strategy: Strategy, pool: InMemoryPool, rounds: int) -> list[RoundRecord]:
    store = StateStore(directory)  # a new process: a new store, a new strategy, the state from the checkpoint
    try:
        state = store.resume()
        assert state is not None

        def on_round_end(record: RoundRecord, state: ServerState) -> None:
            store.save_checkpoint(state)
            store.record_round(record)

        _, records = run_rounds(
            pool, strategy, state, RoundConfig(num_rounds=rounds, seed=SEED), on_round_end=on_round_end
        )
        return records
    finally:
        store.close()


ADAPTIVE = PrivacyConfig(
    dp="central",
    adaptive_clipping=True,
    clipping_norm=0.05,
    noise_multiplier=1.0,
    clipping_lr=0.5,
    clipped_count_stddev=1.0,
    population=4,
)


def test_adaptive_clipping_norm_survives_a_server_restart(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "server")
    first = strategy_for(ADAPTIVE)
    records = run_until_crash(store, first, InMemoryPool(IDS, make_task), crash_at=3, rounds=4)
    store.close()
    assert [r.round for r in records] == [1, 2]
    rule = first.aggregator
    assert isinstance(rule, DPFedAvgAggregator)
    reached = rule.clipping_norm_for(3)  # what round 3 would have clipped with in the process that died
    assert reached != pytest.approx(0.05)  # the norm moved (noisy unclipped counts, eta 0.5), so the test can fail
    stored = load_checkpoint(tmp_path / "server" / "checkpoints" / "round-000002.safetensors")
    assert stored.aggregator_state["dp_clipping_norm"] == np.float64(reached)
    # restarted: a new strategy (its aggregator starts at the initial norm) resumes from round 2's checkpoint
    second = strategy_for(ADAPTIVE)
    resumed = resume(tmp_path / "server", second, InMemoryPool(IDS, make_task), rounds=4)
    assert [r.round for r in resumed] == [3, 4]
    assert resumed[0].aggregation["dp_clipping_norm"] == reached
    # the epsilon counts released rounds: round 3 after the restart spends what round 3 of one run spends
    assert [r.aggregation["epsilon"] for r in resumed] == [
        epsilon(noise_multiplier=1.0, sampling_rate=1.0, rounds=r, delta=1e-5) for r in (3, 4)
    ]
    history = StateStore(tmp_path / "server")
    try:
        assert [row["round"] for row in history.history()] == [1, 2, 3, 4]
    finally:
        history.close()


def test_rounds_sampling_from_fewer_clients_than_the_population_are_accounted_at_their_rate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--population 8, 2 clients a round (q = 2/8), but only 4 clients connected: every round selects 2 of 4, so
    each client's chance is 1/2, and epsilon was reported at 1/4 (0.74 where 4.73 was spent, in a user's run with
    q = 3/1000 declared and 3 of 3 connected). Epsilon is composed at the rate the rounds really had, kept in the
    checkpoint: a restart where all 8 are connected goes on at 1/2, not back to 1/4."""
    privacy = PrivacyConfig(dp="central", noise_multiplier=1.0, population=8)

    def strategy() -> Strategy:
        return apply_dp(Strategy(fit=FIT, sampling=SamplingConfig(fraction_fit=0.25, min_fit_clients=2)), privacy)

    store = StateStore(tmp_path / "server")
    first = strategy()
    with caplog.at_level("WARNING", logger="fedcore.privacy"):
        records = run_until_crash(store, first, InMemoryPool(IDS, make_task), crash_at=3, rounds=4)
    store.close()
    half = [epsilon(noise_multiplier=1.0, sampling_rate=0.5, rounds=r, delta=1e-5) for r in (1, 2, 3, 4)]
    assert [r.aggregation["epsilon"] for r in records] == half[:2]
    assert half[1] > 1.3 * epsilon(noise_multiplier=1.0, sampling_rate=0.25, rounds=2, delta=1e-5)  # what was said
    warnings = [r.getMessage() for r in caplog.records if r.name == "fedcore.privacy"]
    assert len(warnings) == 1 and warnings[0].startswith(
        "round 1 selects 2 of the 4 clients connected, not of the population N=8 (--population): epsilon is now "
        "composed at sampling rate 2/4 = 0.5 for every round (was 0.25)"
    )
    stored = load_checkpoint(tmp_path / "server" / "checkpoints" / "round-000002.safetensors")
    assert stored.aggregator_state["dp_sampling_rate"] == np.float64(0.5)
    everyone = InMemoryPool([*IDS, "e", "f", "g", "h"], make_task)
    resumed = resume(tmp_path / "server", strategy(), everyone, rounds=4)
    assert [r.aggregation["epsilon"] for r in resumed] == half[2:]


def test_a_damaged_stored_norm_is_refused_and_a_missing_one_falls_back_to_the_initial_norm() -> None:
    rule = strategy_for(ADAPTIVE).aggregator
    assert isinstance(rule, DPFedAvgAggregator)
    rule.load_state(4, {"dp_clipping_norm": np.array(0.7)})
    assert rule.clipping_norm_for(5) == 0.7 and rule.state_dict(4)["dp_clipping_norm"] == 0.7
    with pytest.raises(StateError, match="adaptive clipping norm"):
        rule.load_state(4, {"dp_clipping_norm": np.array(-1.0)})
    fresh = strategy_for(ADAPTIVE).aggregator
    assert isinstance(fresh, DPFedAvgAggregator)
    fresh.load_state(4, {})  # a checkpoint written before the norm was kept
    assert fresh.clipping_norm_for(5) == 0.05
    fixed = strategy_for(PrivacyConfig(dp="central", population=4)).aggregator
    assert isinstance(fixed, DPFedAvgAggregator) and fixed.state_dict(3) == {}


DP_SGD = PrivacyConfig(dp_sgd=True, dp_sgd_noise_multiplier=1.1, dp_sgd_max_grad_norm=1.0)
FULL_BATCH = FitConfig(local_epochs=2, batch_size=32, lr=0.2)  # q = 1: Opacus' RDP in closed form, fast


def dp_sgd() -> Strategy:
    return strategy_for(DP_SGD, FULL_BATCH)


def test_a_dp_sgd_round_trained_again_after_a_restart_is_accounted_once(tmp_path: Path) -> None:
    # uninterrupted: three rounds
    pool = InMemoryPool(IDS, make_task, state=ClientStateStore(tmp_path / "clients-once"))
    strategy = dp_sgd()
    start = initial_state(initial_parameters(model_fn, SEED), strategy, trainable=trainable_names(model_fn))
    _, once = run_rounds(pool, strategy, start, RoundConfig(num_rounds=3, seed=SEED))
    # interrupted: the clients train round 2, the server dies before its checkpoint, resumes after round 1 and sends
    # round 2 again; the clients keep their state directory throughout
    clients = ClientStateStore(tmp_path / "clients-restarted")
    store = StateStore(tmp_path / "server")
    run_until_crash(store, dp_sgd(), InMemoryPool(IDS, make_task, state=clients), crash_at=2, rounds=3)
    store.close()
    trained_twice = clients.entry("a").get("dp-sgd")
    assert trained_twice is not None and list(trained_twice["round"]) == [1, 2]  # round 2 ran once so far
    again = resume(tmp_path / "server", dp_sgd(), InMemoryPool(IDS, make_task, state=clients), rounds=3)
    assert [r.round for r in again] == [2, 3]
    for record, reference in zip(again, once[1:], strict=True):
        assert record.train_metrics["sgd_epsilon"] == reference.train_metrics["sgd_epsilon"], record.round
    assert again[0].train_metrics["sgd_epsilon"] < once[2].train_metrics["sgd_epsilon"]  # 2 rounds < 3 rounds
    for cid in IDS:  # one full batch per epoch, two epochs: 2 steps per round, each round once
        entry = clients.entry(cid).get("dp-sgd")
        assert entry is not None
        assert list(entry["round"]) == [1, 2, 3]
        assert list(entry["steps"]) == [2, 2, 2]


SECURE_ADAPTIVE = dataclasses.replace(ADAPTIVE, dp="distributed", clipping_norm=0.5, clipping_lr=1.0)


def secure_strategy() -> Strategy:
    """Distributed DP with adaptive clipping under SecAgg+, built afresh as a restarted server does."""
    secagg = SecAggConfig(field_bits=32, clip=4.0, max_weight=1)
    sampling = SamplingConfig(fraction_fit=1.0, min_fit_clients=4)
    return apply_dp(
        build_strategy(StrategyConfig(secure_aggregation=True, secagg=secagg), FIT, sampling), SECURE_ADAPTIVE
    )


def test_distributed_adaptive_clipping_norm_survives_a_server_restart(tmp_path: Path) -> None:
    """The norm the secure sum's noisy count moved to is in round 2's checkpoint, and the restarted server announces
    it to the clients in round 3 (and steps on from it)."""
    store = StateStore(tmp_path / "server")
    first = secure_strategy()
    records = run_until_crash(store, first, InMemoryPool(IDS, make_task), crash_at=3, rounds=4)
    store.close()
    assert [r.round for r in records] == [1, 2]
    rule = first.aggregator
    assert isinstance(rule, SecureDPAggregator)
    reached = rule.dp.clipping_norm_for(3)
    assert reached == pytest.approx(
        records[1].aggregation["dp_clipping_norm"] * math.exp(-(records[1].aggregation["dp_unclipped"] / 4 - 0.5)),
        rel=1e-12,
    )
    assert reached != pytest.approx(0.5)
    stored = load_checkpoint(tmp_path / "server" / "checkpoints" / "round-000002.safetensors")
    assert stored.aggregator_state["dp_clipping_norm"] == np.float64(reached)
    resumed = resume(tmp_path / "server", secure_strategy(), InMemoryPool(IDS, make_task), rounds=4)
    assert [r.round for r in resumed] == [3, 4]
    assert resumed[0].aggregation["dp_clipping_norm"] == reached
    assert resumed[1].aggregation["dp_clipping_norm"] == pytest.approx(
        reached * math.exp(-(resumed[0].aggregation["dp_unclipped"] / 4 - 0.5)), rel=1e-12
    )
    assert [r.aggregation["epsilon"] for r in resumed] == [
        epsilon(noise_multiplier=1.0, sampling_rate=1.0, rounds=r, delta=1e-5) for r in (3, 4)
    ]


def test_a_released_round_run_again_after_its_checkpoint_was_damaged_is_accounted_twice(tmp_path: Path) -> None:
    """Round 3 was released (recorded, evaluated, its model written), then its checkpoint was damaged: --resume
    went back to round 2 and released round 3 again with fresh noise, but epsilon still counted 3 releases
    (4.42 where 4 releases spend 4.87). The superseded release counts."""
    import pandas as pd

    from fedcore.cli import main

    out = tmp_path / "run"
    argv = ["simulate", "--dataset", "digits", "--clients", "20", "--min-fit-clients", "5", "--fraction-fit", "0.25",
            "--model", "logreg", "--partition", "iid", "--strategy", "fedavg", "--lr", "0.1", "--dp", "central",
            "--clipping-norm", "0.5", "--rounds", "3", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    checkpoint = out / "state" / "checkpoints" / "round-000003.safetensors"
    data = bytearray(checkpoint.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor: the digest no longer matches
    checkpoint.write_bytes(bytes(data))
    assert main([*argv, "--resume"]) == 0
    history = pd.read_csv(out / "history.csv")
    releases = {1: 1, 2: 2, 3: 4}  # round 3's first release, superseded, and its rerun
    expected = [epsilon(noise_multiplier=1.0, sampling_rate=0.25, rounds=releases[r], delta=1e-5) for r in (1, 2, 3)]
    assert history.loc[history["round"] > 0, "epsilon"].tolist() == pytest.approx(expected, rel=1e-12)
