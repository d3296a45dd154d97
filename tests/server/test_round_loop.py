"""The round loop with real tasks on small real data (scikit-learn digits), through the in-memory pool."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from client.runner import run_instruction
from fedcore.errors import RoundFailed
from fedcore.messages import Failure, FitIns, FitRes, Stage
from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig, build_strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import EvalResult, FitConfig, Task, TrainContext, TrainResult, initial_parameters
from fedcore.tensors import NamedArrays
from server.round_loop import RoundConfig, failure_summary, run_rounds
from simulations.datasets import load_digits_dataset
from simulations.inmemory import InMemoryPool
from simulations.models import MLP2NN
from simulations.partition import iid

NUM_CLIENTS = 4


@pytest.fixture(scope="module")
def shards() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = load_digits_dataset(seed=0)
    parts = iid(data.y_train, NUM_CLIENTS, seed=0)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    return [(x[torch.from_numpy(p)], y[torch.from_numpy(p)]) for p in parts]


def model_fn() -> torch.nn.Module:
    return MLP2NN(num_inputs=64, num_classes=10, hidden=32)


def make_pool(
    shards: list[tuple[torch.Tensor, torch.Tensor]], override: Mapping[int, Callable[[], Task]] | None = None
) -> InMemoryPool:
    ids = [f"c{i}" for i in range(len(shards))]

    def make(cid: str) -> Task:
        i = int(cid[1:])
        if override and i in override:
            return override[i]()
        return SupervisedTask(model_fn=model_fn, train_data=shards[i])

    return InMemoryPool(ids, make)


def all_clients(mu: float = 0.0, lr: float = 0.1) -> Strategy:
    fit = FitConfig(local_epochs=1, batch_size=16, lr=lr, mu=mu)
    return Strategy(fit=fit, sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=NUM_CLIENTS))


class NaNTask:
    """A client whose training blows up: every floating parameter becomes NaN."""

    def __init__(self, shard: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.inner = SupervisedTask(model_fn=model_fn, train_data=shard)

    def build_model(self) -> torch.nn.Module:
        return model_fn()

    def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        return TrainResult(num_examples=100, metrics={"train_loss": 1.0})

    def evaluate(self, model: torch.nn.Module, batch_size: int) -> EvalResult:
        return self.inner.evaluate(model, batch_size)


class WrongModelTask(NaNTask):
    """A client that trains another architecture than the server's."""

    def build_model(self) -> torch.nn.Module:
        return MLP2NN(num_inputs=64, num_classes=10, hidden=16)


def test_one_round_equals_weighted_mean_of_local_models(shards: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    initial = initial_parameters(model_fn, seed=1)
    strategy = all_clients()
    state, records = run_rounds(make_pool(shards), strategy, initial, RoundConfig(num_rounds=1, seed=3))
    # Reference: train each client by hand from the same start and average with numpy in float64.
    total = sum(len(s[1]) for s in shards)
    expected = {n: np.zeros(a.shape, np.float64) for n, a in initial.items()}
    for i, shard in enumerate(shards):
        task = SupervisedTask(model_fn=model_fn, train_data=shard)
        ins = FitIns(round=1, parameters=initial, config=strategy.fit, seed=3)
        res = run_instruction(task, ins, f"c{i}")
        assert isinstance(res, FitRes)
        for n in expected:
            expected[n] += res.parameters[n].astype(np.float64) * len(shard[1]) / total
    for n, a in state.parameters.items():
        np.testing.assert_allclose(a, expected[n], rtol=1e-6, atol=1e-7)
    assert records[-1].accepted == ("c0", "c1", "c2", "c3")
    assert records[-1].failures == ()


def test_bad_updates_are_rejected_and_never_reach_the_global_model(
    shards: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    initial = initial_parameters(model_fn, seed=1)
    strategy = all_clients()
    config = RoundConfig(num_rounds=1, seed=3)
    bad = make_pool(shards, {1: lambda: NaNTask(shards[1]), 2: lambda: WrongModelTask(shards[2])})
    state, records = run_rounds(bad, strategy, initial, config)
    record = records[-1]
    assert record.accepted == ("c0", "c3")
    reasons = {f.client_id: f.reason for f in record.failures}
    assert set(reasons) == {"c1", "c2"}
    assert "NaN" in reasons["c1"]
    assert "c2" in reasons["c2"] and "shape" in reasons["c2"]
    # The global model equals the run in which only the two good clients took part.
    good_strategy = Strategy(fit=strategy.fit, sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=2))
    # The good clients keep their ids, so their random streams (keyed by id) are the same.
    good_only = InMemoryPool(
        ["c0", "c3"], lambda cid: SupervisedTask(model_fn=model_fn, train_data=shards[int(cid[1:])])
    )
    reference, _ = run_rounds(good_only, good_strategy, initial, config)
    for n in initial:
        assert np.array_equal(state.parameters[n], reference.parameters[n]), n
        assert np.isfinite(state.parameters[n]).all()


def test_round_without_quorum_fails_and_keeps_the_model(shards: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    initial = initial_parameters(model_fn, seed=1)
    every = {i: (lambda i=i: NaNTask(shards[i])) for i in range(NUM_CLIENTS)}
    pool = make_pool(shards, every)
    with pytest.raises(RoundFailed, match=r"round 1.*0 of 4 selected clients returned a valid update"):
        run_rounds(pool, all_clients(), initial, RoundConfig(num_rounds=2, seed=0, max_round_attempts=2))
    assert all(np.isfinite(a).all() for a in initial.values())


def test_clients_of_another_model_fail_the_round_with_one_readable_message(
    shards: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Every client trains another architecture (a daemon started without the server's --task): the round's error
    names the mismatch once, says to give the daemons the server's --task, and reads as sentences (no '..')."""
    initial = initial_parameters(model_fn, seed=1)

    def other_model() -> torch.nn.Module:
        return MLP2NN(num_inputs=64, num_classes=10, hidden=16)

    every = {i: (lambda i=i: SupervisedTask(model_fn=other_model, train_data=shards[i])) for i in range(NUM_CLIENTS)}
    with pytest.raises(RoundFailed) as caught:
        run_rounds(make_pool(shards, every), all_clients(), initial, RoundConfig(num_rounds=1, max_round_attempts=1))
    message = str(caught.value)
    assert "round failed after 1 attempt(s)" in message
    assert "start the daemon with the server's --task and --task-option values" in message
    assert ".." not in message
    # every client replied: a later deadline would not help, and no update was valid, so neither would a lower quorum
    assert "no client missed the deadline, so a later one would not help" in message
    assert "raise the deadline" not in message and "quorum," not in message and "lower the quorum" not in message


class HugeUpdateTask(NaNTask):
    """A client that trains, then multiplies its model by 1e30: a finite update no check refuses."""

    def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        result = self.inner.train(model, config, context)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1e30)
        return result


def test_one_clients_extreme_update_is_named_as_the_cause_when_every_client_fails_the_next_round(
    shards: list[tuple[torch.Tensor, torch.Tensor]], caplog: pytest.LogCaptureFixture
) -> None:
    """One client's update of norm ~1e30 is averaged in (finite: no check refuses it) and the next round every
    client's update is NaN/Inf. Before, round 1 passed without a word and round 2's error told each client to
    check its learning rate and data; now round 1 warns of the non-finite test loss, and round 2's error says the
    global model is the likely cause, with its norm and what keeps such an update out."""
    from fedcore.task import central_evaluation

    initial = initial_parameters(model_fn, seed=1)
    pool = make_pool(shards, {0: lambda: HugeUpdateTask(shards[0])})
    evaluate = central_evaluation(SupervisedTask(model_fn=model_fn, train_data=shards[1], test_data=shards[1]), 64)
    with caplog.at_level(logging.WARNING, logger="fedcore.server"), pytest.raises(RoundFailed) as caught:
        run_rounds(pool, all_clients(), initial, RoundConfig(num_rounds=2, max_round_attempts=1), evaluate_fn=evaluate)
    warnings = [r.getMessage() for r in caplog.records if "test loss" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(
        "round 1: the new global model's test loss is nan (its parameters are finite, its update norm"
    )
    assert "or the evaluation itself returns a non-finite loss" in warnings[0]  # a Flower evaluate returning NaN
    assert "a norm bound (--norm-bound) or a robust aggregator (--aggregator)" in warnings[0]
    message = str(caught.value)
    assert message.startswith("[round 2] round failed after 1 attempt(s): only 0 of 4 selected clients returned")
    assert (
        "Every selected client's update from the global model of round 1 holds NaN/Inf: that model is the " in message
    )
    assert re.search(r"its L2 norm is [0-9.]+e\+(29|30|31);", message), message
    assert ".." not in message


class ZeroExamplesTask(NaNTask):
    def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        return TrainResult(num_examples=0, metrics={})


def test_zero_total_examples_fails_the_round_with_a_clear_error(
    shards: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    initial = initial_parameters(model_fn, seed=1)
    every = {i: (lambda i=i: ZeroExamplesTask(shards[i])) for i in range(NUM_CLIENTS)}
    with pytest.raises(RoundFailed, match="weight"):
        run_rounds(make_pool(shards, every), all_clients(), initial, RoundConfig(num_rounds=1, max_round_attempts=1))


def test_same_seed_same_model_to_the_last_bit(shards: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    def run(seed: int) -> NamedArrays:
        initial = initial_parameters(model_fn, seed=seed)
        strategy = build_strategy(
            StrategyConfig(name="fedavgm", server_momentum=0.9),
            FitConfig(batch_size=16, lr=0.05),
            SamplingConfig(fraction_fit=0.5, min_fit_clients=2),
        )
        state, _ = run_rounds(make_pool(shards), strategy, initial, RoundConfig(num_rounds=3, seed=seed))
        return state.parameters

    a, b, c = run(7), run(7), run(8)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not all(np.array_equal(a[n], c[n]) for n in a)


def test_fedprox_mu_zero_equals_fedavg_and_mu_positive_changes_updates(
    shards: list[tuple[torch.Tensor, torch.Tensor]], caplog: pytest.LogCaptureFixture
) -> None:
    initial = initial_parameters(model_fn, seed=1)
    config = RoundConfig(num_rounds=2, seed=5)

    def run(strategy: Strategy) -> NamedArrays:
        return run_rounds(make_pool(shards), strategy, initial, config)[0].parameters

    fedavg = run(all_clients(mu=0.0))
    with caplog.at_level(logging.WARNING, logger="fedcore.strategy"):
        prox0_strategy = build_strategy(
            StrategyConfig(name="fedprox"),
            FitConfig(batch_size=16, lr=0.1, mu=0.0),
            SamplingConfig(fraction_fit=1.0, min_fit_clients=NUM_CLIENTS),
        )
    assert "fedprox with train.mu = 0 trains exactly as fedavg" in caplog.text  # taken, but said
    prox0 = run(prox0_strategy)
    prox = run(all_clients(mu=1.0))
    assert all(np.array_equal(fedavg[n], prox0[n]) for n in fedavg)
    drift_avg = sum(float(np.sum((fedavg[n] - initial[n]) ** 2)) for n in initial)
    drift_prox = sum(float(np.sum((prox[n] - initial[n]) ** 2)) for n in initial)
    # The proximal term pulls local models toward the global one: the global model moves less.
    assert drift_prox < drift_avg
    assert not all(np.array_equal(fedavg[n], prox[n]) for n in fedavg)


def test_on_round_end_may_hand_back_the_state_and_records_need_not_be_kept(
    shards: list[tuple[torch.Tensor, torch.Tensor]], tmp_path: Path
) -> None:
    from server.round_loop import RoundRecord, ServerState
    from server.state import StateStore, load_checkpoint

    initial = initial_parameters(model_fn, seed=1)
    config = RoundConfig(num_rounds=3, seed=5)
    reference, _ = run_rounds(make_pool(shards), all_clients(), initial, config)
    store = StateStore(tmp_path / "state")
    seen: list[int] = []

    def mapped_from_checkpoint(record: RoundRecord, state: ServerState) -> ServerState:
        seen.append(record.round)
        return load_checkpoint(store.save_checkpoint(state), mapped=True)

    start = store.map_initial(ServerState(round=0, parameters=initial, optimizer_state={}))
    assert list(store.spill.iterdir()) == []  # mapped, and its file already unlinked: nothing left behind
    final, records = run_rounds(
        make_pool(shards), all_clients(), start, config, on_round_end=mapped_from_checkpoint, keep_records=False
    )
    assert records == [] and seen == [1, 2, 3]
    assert all(isinstance(a, np.memmap) for a in final.parameters.values())  # the loop continued from the files
    for name, array in reference.parameters.items():
        assert np.array_equal(final.parameters[name], array), name  # bit for bit


def test_a_rounds_failures_read_each_reason_once() -> None:
    same = [Failure(client_id=f"c{i}", round=1, stage=Stage.FIT, reason="no 'bogus'") for i in range(5)]
    other = Failure(client_id="c9", round=1, stage=Stage.FIT, reason="timed out")
    assert failure_summary([*same[:2], other, *same[2:]]) == "c0, c1, c2 and 2 more: no 'bogus'; c9: timed out"
    assert failure_summary(same[:1]) == "c0: no 'bogus'"
    many = [Failure(client_id=f"c{i}", round=1, stage=Stage.FIT, reason=f"r{i}") for i in range(7)]
    assert failure_summary(many, reasons=2) == "c0: r0; c1: r1; 5 other reason(s)"


def test_many_failures_log_a_few_lines_not_one_per_client(
    shards: list[tuple[torch.Tensor, torch.Tensor]], caplog: pytest.LogCaptureFixture
) -> None:
    """Clients failing for one reason (a bug in a batched model fails all its clients): the first five are logged
    as they come, the rest in one line that gives the reason once; the record keeps every failure."""
    many = [shards[i % NUM_CLIENTS] for i in range(12)]

    class Broken(NaNTask):
        def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
            raise ValueError("the model's forward is broken")

    broken = {i: (lambda i=i: Broken(many[i])) for i in range(2, 12)}
    pool = make_pool(many, broken)
    strategy = Strategy(fit=FitConfig(local_epochs=1, batch_size=16, lr=0.1), sampling=SamplingConfig(fraction_fit=1.0))
    with caplog.at_level(logging.WARNING, logger="server.round_loop"):
        _, records = run_rounds(pool, strategy, initial_parameters(model_fn, seed=1), RoundConfig(num_rounds=1))
    assert len(records[-1].failures) == 10 and records[-1].accepted == ("c0", "c1")
    lines = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(lines) == 6, lines
    assert all("ValueError: the model's forward is broken" in line for line in lines)
    summary = "round 1: 5 more client(s) failed or had their update rejected: c5, c6, c7 and 2 more: [round 1, stage"
    assert lines[-1].startswith(summary)


def test_a_batchs_simulated_seconds_give_the_rounds_duration_as_each_clients_would() -> None:
    from fedcore.aggregation import MetricColumns
    from server.round_loop import _simulated_duration

    seconds = np.array([0.0, -0.0, np.nan, -1.0, np.inf])  # only the zeros are usable: the first one counts
    batch = MetricColumns(np.ones(5, dtype=np.int64), {"simulated_seconds": seconds})
    rows = [(1, {"simulated_seconds": float(s)}) for s in seconds]
    for got, want in ((_simulated_duration([batch]), _simulated_duration(rows)), (_simulated_duration([]), None)):
        assert got == want and (
            got is None or (want is not None and math.copysign(1.0, got) == math.copysign(1.0, want))
        )
    late = MetricColumns(np.ones(2, dtype=np.int64), {"simulated_seconds": np.array([2.5, 7.0])})
    assert _simulated_duration([(1, {"simulated_seconds": 3.0}), late, (1, {})]) == 7.0
