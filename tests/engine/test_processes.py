"""Worker processes: every wait is bounded, workers die with their caller, and plan errors come before start.

Real worker processes on loopback gloo; a caller is a real Python process that is sent real signals.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import engine_tasks
import pytest
from engine_tasks import assert_same_state, initial_parameters, mlp, reference, tied_mlp, unused_module_task

from fedcore.engine import ParallelPlan, train_with_plan
from fedcore.engine.launch import GRACE_S, PARENT_ENV
from fedcore.engine.train import remove_stale_workdirs
from fedcore.errors import ConfigError, EngineError
from fedcore.task import FitConfig, TaskContext

CTX = TaskContext(client_id="c1", seed=3, options={"n": "24"})
CONFIG = FitConfig(local_epochs=1, batch_size=8, lr=0.1)
TESTS_DIR = Path(__file__).parent


def _workers_of(parent: int) -> set[int]:
    """Pids of engine workers started by ``parent`` (from their environment)."""
    found = set()
    marker = f"{PARENT_ENV}={parent}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"fedcore.engine.worker" in (entry / "cmdline").read_bytes() and marker in (
                entry / "environ"
            ).read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def _workdirs_of(pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"fedcore-engine-{pid}-*"))


def _wait_until(condition: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return bool(condition())  # type: ignore[operator]


def test_tied_weights_under_fsdp2_are_refused_before_start() -> None:
    model = tied_mlp()
    ParallelPlan(data_parallel=2).check_model(model)  # DDP trains tied weights
    with pytest.raises(ConfigError, match="cannot train tied weights: 0.weight = 2.weight"):
        ParallelPlan(data_parallel=2, sharded=True).check_model(model)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="tied weights"):
        train_with_plan(
            f"{engine_tasks.__name__}:tied_task",
            CTX,
            initial_parameters(tied_mlp),
            CONFIG,
            ParallelPlan(data_parallel=2, sharded=True),
            seed=1,
            round=1,
            client_id="c1",
        )
    assert time.monotonic() - started < 2.0  # no worker was started
    assert _workers_of(os.getpid()) == set()


def test_a_pipeline_split_between_tied_weights_names_them() -> None:
    plan = ParallelPlan(pipeline=2, split_points=("2",))
    with pytest.raises(ConfigError, match="parameter '0.weight' of stage 0 is also '2.weight' of stage 1"):
        plan.check_model(tied_mlp())


@pytest.mark.parametrize("timeout_s", [0, -1, float("inf"), float("nan")])
def test_timeout_must_be_a_positive_bound(timeout_s: float) -> None:
    with pytest.raises(ConfigError, match="timeout_s"):
        train_with_plan(
            f"{engine_tasks.__name__}:mlp_task",
            CTX,
            initial_parameters(mlp),
            CONFIG,
            ParallelPlan(data_parallel=2),
            seed=1,
            round=1,
            client_id="c1",
            timeout_s=timeout_s,
        )


def test_find_unused_parameters_is_a_ddp_option() -> None:
    assert ParallelPlan.from_cli(["dp=2", "find_unused_parameters=true"]).find_unused_parameters
    with pytest.raises(ConfigError, match="DDP only"):
        ParallelPlan(data_parallel=2, sharded=True, find_unused_parameters=True)


def test_stale_workdirs_of_dead_callers_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"fedcore-engine-{int(dead.stdout)}-abc"
    live = tmp_path / f"fedcore-engine-{os.getpid()}-def"
    stale.mkdir()
    live.mkdir()
    (stale / "spec.json").write_text("{}")
    assert remove_stale_workdirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists()


@pytest.mark.slow
def test_ddp_with_an_unused_module_names_it_and_the_option() -> None:
    with pytest.raises(EngineError, match=r"\['unused.weight', 'unused.bias'\] got no gradient.*find_unused_parameters"):
        train_with_plan(
            f"{engine_tasks.__name__}:unused_module_task",
            CTX,
            initial_parameters(engine_tasks.WithUnusedModule),
            CONFIG,
            ParallelPlan(data_parallel=2),
            seed=1,
            round=1,
            client_id="c1",
        )


@pytest.mark.slow
def test_ddp_with_find_unused_parameters_equals_the_reference() -> None:
    # no FedProx term, weight decay on: an unused parameter must keep no gradient (left alone), as on one device
    config = FitConfig(local_epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=0.05)
    global_parameters = initial_parameters(engine_tasks.WithUnusedModule)
    expected, _ = reference(unused_module_task, CTX, global_parameters, config, seed=1, round=1, client_id="c1")
    updated, _ = train_with_plan(
        f"{engine_tasks.__name__}:unused_module_task",
        CTX,
        global_parameters,
        config,
        ParallelPlan(data_parallel=2, find_unused_parameters=True),
        seed=1,
        round=1,
        client_id="c1",
    )
    assert_same_state(updated, expected)


@pytest.mark.slow
def test_a_hanging_worker_fails_within_the_bound_and_leaves_nothing() -> None:
    timeout_s = 8.0
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"did not finish within 8 s \(ranks \[.*1.*\] still running") as info:
        train_with_plan(
            f"{engine_tasks.__name__}:hanging_task",
            CTX,
            initial_parameters(mlp),
            CONFIG,
            ParallelPlan(data_parallel=2),
            seed=1,
            round=4,
            client_id="c1",
            timeout_s=timeout_s,
        )
    elapsed = time.monotonic() - started
    assert timeout_s <= elapsed < timeout_s + GRACE_S + 5.0
    assert info.value.round == 4 and info.value.client_id == "c1"
    assert _workers_of(os.getpid()) == set()
    assert _workdirs_of(os.getpid()) == []


_CALLER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import engine_tasks
    from fedcore.engine import ParallelPlan, train_with_plan
    from fedcore.task import FitConfig, TaskContext
    ctx = TaskContext(client_id="c1", seed=3, options={{"n": "24"}})
    train_with_plan("engine_tasks:hanging_task", ctx, engine_tasks.initial_parameters(engine_tasks.mlp),
                    FitConfig(local_epochs=1, batch_size=8, lr=0.1), ParallelPlan(data_parallel=2),
                    seed=1, round=1, client_id="c1", timeout_s=300)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_workers_die_with_their_caller(sig: signal.Signals) -> None:
    caller = subprocess.Popen([sys.executable, "-c", _CALLER.format(tests=str(TESTS_DIR))], stderr=subprocess.PIPE)
    try:
        assert _wait_until(lambda: len(_workers_of(caller.pid)) == 2, 60.0), "the workers did not start"
        workers = _workers_of(caller.pid)
        assert len(_workdirs_of(caller.pid)) == 1
        time.sleep(1.0)  # let the workers reach the hang
        caller.send_signal(sig)
        code = caller.wait(timeout=GRACE_S + 10.0)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
    if sig is signal.SIGTERM:
        assert code == 128 + signal.SIGTERM
    assert _wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 5.0)
    if sig is signal.SIGKILL:  # nothing runs in a killed process: the next caller removes its directory
        remove_stale_workdirs()
    assert _workdirs_of(caller.pid) == []
