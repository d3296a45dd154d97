"""Client state stores (a file per client, read only when used) and the client mod chain around training."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from client.mods import chain
from client.runner import ParallelTraining, run_instruction
from client.state import ClientStateStore, state_file_name
from fedcore.algorithms.scaffold import CONTROL
from fedcore.engine.plan import ParallelPlan
from fedcore.errors import ClientTaskError, ConfigError, PayloadError
from fedcore.messages import FitIns, FitRes, ModSpec
from fedcore.mods import CallNext, ModContext, register
from fedcore.task import FitConfig, TaskContext
from tests.engine import engine_tasks


def test_a_client_state_round_trips_through_its_file(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path / "state")
    assert not (tmp_path / "state").exists()  # nothing written until a client keeps state
    entry = store.entry("client-007")
    assert entry.get("control") is None
    entry.put({"control": {"w": np.arange(3, dtype=np.float32)}, "other": {"k": np.array(2, np.int64)}})
    entry.put({"control": {"w": np.ones(3, np.float32)}})  # replaces one group, keeps the other
    again = ClientStateStore(tmp_path / "state").entry("client-007")  # a restarted daemon
    np.testing.assert_array_equal(again.get("control")["w"], np.ones(3, np.float32))  # type: ignore[index]
    assert int(again.get("other")["k"]) == 2  # type: ignore[index]
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["client-007.safetensors"]  # no temporaries


def test_any_client_id_gets_a_safe_file_name_of_its_own() -> None:
    assert state_file_name("client-001") == "client-001.safetensors"
    odd = [state_file_name(cid) for cid in ("../etc/passwd", ".hidden", "a/b", "x" * 300, "é")]
    assert all(name.startswith("id-") and "/" not in name and len(name) < 100 for name in odd)
    assert len(set(odd)) == len(odd)


def test_a_damaged_state_file_names_itself(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path)
    (tmp_path / "c.safetensors").write_bytes(b"garbage!")
    entry = store.entry("c")  # nothing is read yet: a client that is not run costs no memory and no read
    with pytest.raises(PayloadError, match=r"c\.safetensors.*remove it") as raised:
        entry.get("control")
    # removing it is not free: a DP-SGD client's accounting restarts with it, and the message says so
    assert "backup" in str(raised.value) and "epsilon would restart at 0" in str(raised.value)


class Recorder:
    """A test mod: records the order of calls and tags the reply's metrics."""

    calls: ClassVar[list[str]] = []

    def __init__(self, tag: str = "x") -> None:
        self.tag = tag

    def __call__(self, instruction: FitIns, context: ModContext, call_next: CallNext) -> FitRes:
        Recorder.calls.append(f"in:{self.tag}")
        reply = call_next(instruction)
        Recorder.calls.append(f"out:{self.tag}")
        return replace(reply, metrics={**reply.metrics, self.tag: 1.0})


register("recorder-test", Recorder)


def test_mods_run_in_order_around_training() -> None:
    Recorder.calls = []
    trained: list[int] = []

    def train(ins: FitIns) -> FitRes:
        trained.append(ins.round)
        Recorder.calls.append("train")
        return FitRes(client_id="c", round=ins.round, parameters={}, num_examples=1)

    context = ModContext(client_id="c", model=None, state=None)
    ins = FitIns(round=2, parameters={}, config=FitConfig(), seed=0)
    reply = chain([Recorder("a"), Recorder("b")], context, train)(ins)
    assert Recorder.calls == ["in:a", "in:b", "train", "out:b", "out:a"] and trained == [2]
    assert dict(reply.metrics) == {"a": 1.0, "b": 1.0}


def _fit(mods: tuple[ModSpec, ...], groups: dict[str, dict[str, np.ndarray]] | None = None) -> FitIns:
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    return FitIns(
        round=1, parameters=initial, config=FitConfig(batch_size=8, lr=0.05), seed=1, groups=groups or {}, mods=mods
    )


def test_run_instruction_runs_the_declared_mods_and_refuses_unknown_ones(tmp_path: Path) -> None:
    task = engine_tasks.mlp_task(TaskContext(client_id="a", seed=5, options={"n": "40"}))
    Recorder.calls = []
    reply = run_instruction(task, _fit((ModSpec("recorder-test", {"tag": "t"}),)), "a")
    assert isinstance(reply, FitRes) and reply.metrics["t"] == 1.0 and Recorder.calls == ["in:t", "out:t"]
    with pytest.raises(ConfigError, match=r"\[round 1, client 'a', stage fit\] unknown client mod 'gone'"):
        run_instruction(task, _fit((ModSpec("gone"),)), "a")
    with pytest.raises(ConfigError, match="refuses its parameters"):
        run_instruction(task, _fit((ModSpec("recorder-test", {"nope": 1}),)), "a")


def test_scaffold_mod_needs_state_in_process_training_and_its_group(tmp_path: Path) -> None:
    task = engine_tasks.mlp_task(TaskContext(client_id="a", seed=5, options={"n": "40"}))
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    control = {n: np.zeros_like(a) for n, a in initial.items() if a.dtype.kind == "f"}
    scaffold = (ModSpec("scaffold"),)
    with pytest.raises(ClientTaskError, match="keeps no state"):
        run_instruction(task, _fit(scaffold, {CONTROL: control}), "a")
    store = ClientStateStore(tmp_path)
    with pytest.raises(PayloadError, match="no 'control' group"):
        run_instruction(task, _fit(scaffold), "a", state=store)
    plan = ParallelTraining(task_factory="x:y", task_context=TaskContext(), plan=ParallelPlan(data_parallel=2))
    with pytest.raises(ClientTaskError, match="parallel plan"):
        run_instruction(task, _fit(scaffold, {CONTROL: control}), "a", state=store, parallel=plan)
    reply = run_instruction(task, _fit(scaffold, {CONTROL: control}), "a", state=store)
    assert isinstance(reply, FitRes) and set(reply.groups) == {CONTROL}
    stored = store.entry("a").get(CONTROL)
    assert stored is not None
    for n in control:  # c_i was 0: delta c_i is c_i+ itself
        np.testing.assert_array_equal(reply.groups[CONTROL][n], stored[n])
        assert float(np.abs(stored[n]).max()) > 0
