"""Convergence tracking in the round loop: bytes up and down, the update norm, and the stop rules (a target
accuracy, a plateau), with a resumed run that does not go past a stop it made."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fedcore.convergence import Stop, StopRules
from fedcore.messages import FitIns, FitRes, packed_nbytes
from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig
from fedcore.task import EvalResult, FitConfig, TaskContext, initial_parameters, load_task_factory
from fedcore.tensors import NamedArrays
from server.app import run_server
from server.round_loop import EvaluateFn, RoundConfig, RoundRecord, ServerState, run_rounds
from server.state import StateStore
from tests.deploy.test_service import _demo_server_config
from tests.server.test_round_loop import all_clients, make_pool, model_fn, shards  # noqa: F401 - fixture

Shards = list[tuple[torch.Tensor, torch.Tensor]]
DEMO_OPTIONS = {"dataset": "digits", "num_clients": "2", "partition": "iid", "model": "2nn"}


def two_clients() -> Strategy:
    """FedAvg over two clients, both every round (the stop rules' tests need rounds, not many clients)."""
    return Strategy(fit=FitConfig(local_epochs=1, batch_size=32, lr=0.1),
                    sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=2))  # fmt: skip


def scripted(accuracies: dict[int, float]) -> EvaluateFn:
    """A server evaluation that reports the given accuracy for each round."""

    def evaluate(parameters: NamedArrays, rnd: int) -> EvalResult:
        return EvalResult(loss=1.0, num_examples=10, metrics={"accuracy": accuracies[rnd]})

    return evaluate


def test_bytes_and_update_norm_of_a_round(shards: Shards) -> None:  # noqa: F811 - the fixture
    initial = initial_parameters(model_fn, seed=1)
    state, records = run_rounds(make_pool(shards), all_clients(), initial, RoundConfig(num_rounds=1, seed=3))
    record = records[-1]
    model_bytes = sum(a.nbytes for a in initial.values())
    assert model_bytes == (64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10) * 4  # 2NN: 64-32-32-10, float32
    assert record.bytes_down == 4 * model_bytes  # the model to each of the 4 clients
    assert record.bytes_up == 4 * model_bytes  # float32 updates of the model's size
    by_hand = math.sqrt(
        sum(
            float(((state.parameters[n].astype(np.float64) - a.astype(np.float64)) ** 2).sum())
            for n, a in initial.items()
        )
    )
    assert record.update_norm is not None and math.isclose(record.update_norm, by_hand, rel_tol=1e-12)
    row = record.as_row()
    assert (row["bytes_up"], row["bytes_down"], row["update_norm"]) == (
        4 * model_bytes,
        4 * model_bytes,
        record.update_norm,
    )


def test_a_measured_payload_is_counted_as_the_pool_gives_it(shards: Shards) -> None:  # noqa: F811
    """bytes_up takes FitRes.payload_bytes as the pool set it (e.g. a compressed update), not the tensors' size."""
    inner = make_pool(shards)

    class HalfPool:
        def available(self) -> list[str]:
            return inner.available()

        def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
            return inner.wait_for(num_clients, timeout_s)

        def run(self, instructions, *, timeout_s):  # type: ignore[no-untyped-def]
            for reply in inner.run(instructions, timeout_s=timeout_s):
                assert isinstance(reply, FitRes) and reply.payload_bytes == packed_nbytes(reply)  # the in-memory pool
                yield FitRes(
                    client_id=reply.client_id,
                    round=reply.round,
                    parameters=reply.parameters,
                    num_examples=reply.num_examples,
                    metrics=reply.metrics,
                    payload_bytes=1000,
                )

        def payload_bytes(self, message: FitIns) -> int:  # a pool that measures what it sends
            return 77

    _, records = run_rounds(HalfPool(), all_clients(), initial_parameters(model_fn, 1), RoundConfig(num_rounds=1))
    assert (records[-1].bytes_up, records[-1].bytes_down) == (4000, 4 * 77)


def test_target_accuracy_stops_the_run_and_records_which_rule_and_round(shards: Shards) -> None:  # noqa: F811
    config = RoundConfig(num_rounds=6, seed=3, stop=StopRules(target_accuracy=0.7))
    evaluate = scripted({0: 0.1, 1: 0.5, 2: 0.75, 3: 0.8})
    state, records = run_rounds(
        make_pool(shards[:2]), two_clients(), initial_parameters(model_fn, 1), config, evaluate_fn=evaluate
    )
    assert state.round == 2 and [r.round for r in records] == [0, 1, 2]
    assert records[-1].stop == Stop("target_accuracy", 2, "accuracy 0.7500 reached the target 0.7")
    assert records[-1].as_row()["stopped_target_accuracy"] == 1
    assert all(r.stop is None for r in records[:-1])


def test_plateau_stops_after_patience_evaluated_rounds_and_counts_on_after_a_resume(shards: Shards) -> None:  # noqa: F811
    accuracies = {0: 0.1, 1: 0.5, 2: 0.6, 3: 0.6, 4: 0.55, 5: 0.9, 6: 0.9}
    config = RoundConfig(num_rounds=6, seed=3, stop=StopRules(patience=2))
    strategy = two_clients()
    initial = initial_parameters(model_fn, 1)
    full_state, full = run_rounds(make_pool(shards[:2]), strategy, initial, config, evaluate_fn=scripted(accuracies))
    assert full_state.round == 4 and full[-1].stop is not None and full[-1].stop.rule == "plateau"
    # the same run stopped after round 3 and resumed with its history: the count goes on, the stop is at round 4
    first_state, first = run_rounds(
        make_pool(shards[:2]),
        strategy,
        initial,
        RoundConfig(num_rounds=3, seed=3, stop=config.stop),
        evaluate_fn=scripted(accuracies),
    )
    assert first_state.round == 3 and first[-1].stop is None
    resumed_state, resumed = run_rounds(
        make_pool(shards[:2]),
        strategy,
        first_state,
        config,
        evaluate_fn=scripted(accuracies),
        history=[r.as_row() for r in first],
    )
    assert [r.round for r in resumed] == [4] and resumed[-1].stop == full[-1].stop
    for name, value in full_state.parameters.items():
        np.testing.assert_array_equal(resumed_state.parameters[name], value, err_msg=name)
    # and resumed once more after its stop: no round is run, the state comes back as it is
    history = [r.as_row() for r in [*first, *resumed]]
    again_state, again = run_rounds(
        make_pool(shards[:2]), strategy, resumed_state, config, evaluate_fn=scripted(accuracies), history=history
    )
    assert again == [] and again_state is resumed_state


def test_round_zero_record_has_no_traffic(shards: Shards) -> None:  # noqa: F811
    _, records = run_rounds(
        make_pool(shards[:2]),
        two_clients(),
        initial_parameters(model_fn, 1),
        RoundConfig(num_rounds=1),
        evaluate_fn=scripted({0: 0.1, 1: 0.2}),
    )
    zero: RoundRecord = records[0]
    assert (zero.bytes_up, zero.bytes_down, zero.update_norm, zero.stop) == (0, 0, None, None)


def test_a_server_resumed_after_a_stop_runs_no_further_round(tmp_path: Path) -> None:
    """``fedcore server start`` on a state directory whose history records a stop: no round, no client awaited
    (a round would fail: none connects), and it says why."""
    store = StateStore(tmp_path / "state")
    task = load_task_factory("simulations.tasks:demo_task")(TaskContext(role="server", options=DEMO_OPTIONS))
    store.check_strategy(StrategyConfig())
    store.save_checkpoint(ServerState(round=1, parameters=initial_parameters(task.build_model, 0), optimizer_state={}))
    store.record_round(RoundRecord(round=1, eval_metrics={"accuracy": 0.5}, stop=Stop("plateau", 1, "2 rounds")))
    store.close()
    lines: list[str] = []
    config = _demo_server_config(tmp_path / "state", wait_for_clients_s=0.5)
    final = run_server(replace(config, linger_s=0.0), echo=lines.append)
    assert final is not None and final.round == 1
    assert "stopped early after round 1 (plateau: recorded in the history)" in lines
    history = pd.read_csv(tmp_path / "state" / "history.csv")
    assert list(history["round"]) == [1] and list(history["stopped_plateau"]) == [1]
