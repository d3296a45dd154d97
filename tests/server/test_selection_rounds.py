"""Client selection inside the round loop: feedback reaches the selector, simulated device time, availability,
and the selector's state rebuilt from the state database after a restart."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.errors import RoundFailed
from fedcore.selection import SelectionConfig, Selector
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.task import EvalResult, FitConfig, TrainContext, TrainResult, initial_parameters
from server.round_loop import RoundConfig, RoundRecord, run_rounds
from server.state import StateStore
from simulations.devices import DevicesConfig, SimulatedDevices
from simulations.inmemory import InMemoryPool


@pytest.fixture(autouse=True, scope="module")
def frozen_heap() -> Iterator[None]:
    """Keep the round loop's per-round garbage collection from walking the modules loaded so far (about 1 s a
    round otherwise), as the simulation harness does."""
    gc.freeze()
    yield
    gc.unfreeze()


LOSSES = {"c0": 0.1, "c1": 0.6, "c2": 0.3, "c3": 0.9, "c4": 0.2, "c5": 0.5}


def model_fn() -> torch.nn.Module:
    return torch.nn.Linear(2, 1)


class ReportingTask:
    """A client that leaves the model as it is and reports a fixed training loss on 10 examples."""

    def __init__(self, loss: float) -> None:
        self.loss = loss

    def build_model(self) -> torch.nn.Module:
        return model_fn()

    def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        return TrainResult(num_examples=10, metrics={"train_loss": self.loss})

    def evaluate(self, model: torch.nn.Module, batch_size: int) -> EvalResult:
        return EvalResult(loss=0.0, num_examples=1)


def pool() -> InMemoryPool:
    return InMemoryPool(sorted(LOSSES), lambda cid: ReportingTask(LOSSES[cid]))


def strategy(selection: Selector, per_round: int = 2) -> Strategy:
    fit = FitConfig(local_epochs=1, batch_size=5, lr=0.1)
    return Strategy(fit=fit, sampling=SamplingConfig(fraction_fit=0.01, min_fit_clients=per_round), selection=selection)


def run(selection: Selector, rounds: int, clients: object = None) -> list[RoundRecord]:
    _, records = run_rounds(
        clients if clients is not None else pool(),  # type: ignore[arg-type]
        strategy(selection),
        initial_parameters(model_fn, 0),
        RoundConfig(num_rounds=rounds, seed=3),
    )
    return records


def test_power_of_choice_tries_every_client_then_keeps_the_highest_losses() -> None:
    records = run(Selector("power-of-choice", SelectionConfig(candidates=6)), 5)
    # rounds 1-3: unseen clients count as the highest loss, so each round takes two not seen yet
    firsts = [set(r.selected) for r in records[:3]]
    assert set().union(*firsts) == set(LOSSES) and sum(map(len, firsts)) == 6
    # rounds 4, 5: the two highest reported losses, c3 (0.9) and c1 (0.6)
    assert [r.selected for r in records[3:]] == [("c1", "c3"), ("c1", "c3")]
    assert records[0].observations[0].loss == LOSSES[records[0].selected[0]]


def test_oort_leaves_out_slow_clients_and_rounds_take_the_slowest_clients_time() -> None:
    devices = DevicesConfig(slow_fraction=1 / 3, slowdown=4.0, step_seconds=0.5)
    slow = frozenset({"c3", "c5"})  # the two highest losses are slow
    config = SelectionConfig(exploration=1.0, exploration_min=1.0, exploration_decay=1.0)
    records = run(Selector("oort", config), 8, SimulatedDevices(pool(), slow, devices))
    # 10 examples, batch 5: 2 steps of 0.5 s; slow clients 4x -> a round is 1.0 s, or 4.0 s with a slow client
    for r in records:
        assert r.simulated_seconds == (4.0 if slow & set(r.selected) else 1.0)
        assert r.as_row()["simulated_seconds"] == r.simulated_seconds
    # rounds 1-3 explore all six; then the slow ones score (1 / 4)^2 of a fast one and are left out
    assert set().union(*(set(r.selected) for r in records[:3])) == set(LOSSES)
    assert all(not slow & set(r.selected) for r in records[3:])
    # uniform selection in the same population keeps paying for the slow clients
    uniform = run(Selector(), 8, SimulatedDevices(pool(), slow, devices))
    assert sum(r.simulated_seconds or 0 for r in uniform) > sum(r.simulated_seconds or 0 for r in records)


def test_offline_clients_are_never_selected_and_too_few_online_fails_the_round() -> None:
    online = {1: {"c0", "c1", "c2"}, 2: {"c3", "c4"}, 3: {"c5"}}
    selection = Selector("oort", availability=lambda cid, rnd: cid in online[rnd])
    with pytest.raises(RoundFailed, match="only 1 of 6 clients are online"):
        run(selection, 3)
    records = run(Selector("oort", availability=lambda cid, rnd: cid in online[rnd]), 2)
    assert [set(r.selected) <= online[r.round] for r in records] == [True, True]
    assert records[1].selected == ("c3", "c4")


def test_a_restarted_server_rebuilds_the_selection_from_the_state_database(tmp_path: Path) -> None:
    live = Selector("power-of-choice", SelectionConfig(candidates=6))
    records = run(live, 4)
    store = StateStore(tmp_path / "state")
    for record in records:
        store.record_round(record)
    store.close()
    store = StateStore(tmp_path / "state")
    history = store.selection_history()
    assert [rnd for rnd, _ in history] == [1, 2, 3, 4]
    assert [(o.client_id, o.num_examples, o.loss) for o in history[3][1]] == [("c1", 10, 0.6), ("c3", 10, 0.9)]
    assert history[3][1] == list(records[3].observations)  # the measured fit_seconds too, to the bit
    rebuilt = Selector("power-of-choice", SelectionConfig(candidates=6))
    rebuilt.restore(history)
    assert rebuilt.stats() == live.stats()
    ids = sorted(LOSSES)
    assert rebuilt.select(ids, 3, seed=3, round=5) == live.select(ids, 3, seed=3, round=5) == ["c1", "c3", "c5"]
    # rounds after an older checkpoint are superseded: their feedback leaves the rebuilt state too
    store._supersede_after(2)
    assert [rnd for rnd, _ in store.selection_history()] == [1, 2]
    store.close()


def test_simulated_durations_are_the_devices_model() -> None:
    from simulations.devices import fit_seconds, slow_clients

    # 3 epochs over 25 examples in batches of 10: 3 steps an epoch, 9 steps of 0.02 s, 5 times slower
    assert fit_seconds(5.0, 0.02, 3, 10, 25) == pytest.approx(0.9)
    assert fit_seconds(1.0, 0.02, 3, 10, 0) == 0.0
    ids = [f"client-{i:03d}" for i in range(50)]
    slow = slow_clients(ids, 0.2, seed=1)
    assert len(slow) == 10 and slow == slow_clients(list(reversed(ids)), 0.2, seed=1)
    assert slow != slow_clients(ids, 0.2, seed=2)
    assert np.isclose(len(slow_clients(ids, 0.5, seed=1)), 25)


def test_run_server_resumes_with_the_selection_learned_before_the_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fedcore server start`` on a state directory replays the stored feedback of the rounds up to its checkpoint
    into the strategy's selector before the first round; rounds after the checkpoint (superseded) do not count."""
    import dataclasses
    from typing import Any

    import server.app
    from fedcore.selection import ClientObservation, ClientStats
    from fedcore.strategy import StrategyConfig
    from fedcore.task import TaskContext, load_task_factory
    from server.round_loop import ServerState
    from tests.deploy.test_service import _demo_server_config

    options = {"dataset": "digits", "num_clients": "2", "partition": "iid", "model": "2nn"}
    task = load_task_factory("simulations.tasks:demo_task")(TaskContext(role="server", options=options))
    store = StateStore(tmp_path / "state")
    store.check_strategy(StrategyConfig())
    store.save_checkpoint(ServerState(round=1, parameters=initial_parameters(task.build_model, 0), optimizer_state={}))
    for rnd, loss in ((1, 0.7), (2, 0.1)):  # round 2 is recorded but has no checkpoint: it runs again
        seen = (ClientObservation(client_id="daemon-a", num_examples=30, loss=loss, seconds=2.5),)
        store.record_round(RoundRecord(round=rnd, observations=seen))
    store.close()
    strategies: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        strategies.append(args[1])
        raise RoundFailed("stop here: the test only looks at the strategy handed to the round loop")

    monkeypatch.setattr(server.app, "run_rounds", spy)
    monkeypatch.setattr(server.app, "warm_up_kernels", lambda: None)  # compiling the kernels is not looked at here
    config = _demo_server_config(tmp_path / "state", wait_for_clients_s=1.0)
    config = dataclasses.replace(config, strategy=dataclasses.replace(config.strategy, selection="power-of-choice"))
    with pytest.raises(RoundFailed, match="stop here"):
        server.app.run_server(config, echo=lambda _: None)
    selection = strategies[0].selection
    assert selection.policy == "power-of-choice"
    assert selection.stats() == {"daemon-a": ClientStats(num_examples=30, loss=0.7, seconds=2.5, round=1)}
