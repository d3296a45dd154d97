"""``fedcore server start`` (``run_server``) hands the round loop the model's trainable names, fresh and resumed,
and a stop signal during the server's own evaluation still stops it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import server.app
from fedcore.errors import RoundFailed
from fedcore.strategy import StrategyConfig
from fedcore.task import EvalResult, TaskContext, initial_parameters, load_task_factory
from fedcore.tensors import NamedArrays
from server.round_loop import RoundRecord, ServerState, run_rounds
from server.state import StateStore
from tests.deploy.test_service import _demo_server_config


def demo_model_names() -> frozenset[str]:
    task = load_task_factory("simulations.tasks:demo_task")(
        TaskContext(
            role="server", options={"dataset": "digits", "num_clients": "2", "partition": "iid", "model": "2nn"}
        )
    )
    return frozenset(initial_parameters(task.build_model, 0))


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resumed"])
def test_the_round_loop_gets_the_trainable_names_of_the_tasks_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resume: bool
) -> None:
    names = demo_model_names()  # the 2nn has no buffers: every tensor is a trainable parameter
    if resume:
        store = StateStore(tmp_path / "state")
        task = load_task_factory("simulations.tasks:demo_task")(
            TaskContext(
                role="server", options={"dataset": "digits", "num_clients": "2", "partition": "iid", "model": "2nn"}
            )
        )
        store.check_strategy(StrategyConfig())  # the demo config's strategy
        store.save_checkpoint(
            ServerState(round=1, parameters=initial_parameters(task.build_model, 0), optimizer_state={})
        )
        store.record_round(RoundRecord(round=1))
        store.close()
    seen: list[ServerState] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(args[2])
        return run_rounds(*args, **kwargs)

    monkeypatch.setattr(server.app, "run_rounds", spy)
    with pytest.raises(RoundFailed):  # no client connects within the second
        server.app.run_server(_demo_server_config(tmp_path / "state", wait_for_clients_s=1.0), echo=lambda _: None)
    assert len(seen) == 1 and seen[0].round == (1 if resume else 0)
    assert seen[0].trainable == names


def test_sigterm_during_the_servers_evaluation_stops_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = server.app.central_evaluation

    def signalled(task: Any, batch_size: int) -> Any:
        evaluate = real(task, batch_size)

        def evaluate_and_stop(parameters: NamedArrays, rnd: int) -> EvalResult:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises in this (main) thread, inside the evaluation
            return evaluate(parameters, rnd)

        return evaluate_and_stop

    monkeypatch.setattr(server.app, "central_evaluation", signalled)
    lines: list[str] = []
    started = time.monotonic()
    assert (
        server.app.run_server(_demo_server_config(tmp_path / "state", wait_for_clients_s=30.0), echo=lines.append)
        is None
    )
    assert time.monotonic() - started < 25  # not swallowed as a failed evaluation, then waiting for clients
    assert lines[-1].startswith("stopping (signal)")
