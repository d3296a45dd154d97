"""Worker processes: every wait is bounded, workers die with their caller, and plan errors come before start.

Real worker processes on loopback gloo; a caller is a real Python process that is sent real signals.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from client.daemon import ClientDaemon, DaemonConfig
from fedcore.engine import ParallelPlan
from fedcore.engine.launch import GRACE_S, PARENT_ENV, remove_stale_workdirs
from fedcore.errors import ConfigError, EngineError
from fedcore.messages import Failure, FitIns
from fedcore.task import FitConfig, TaskContext
from server.grpc_pool import GrpcClientPool, PoolConfig
from tests.e2e.deploy_helpers import Proc, client_args, server_args
from tests.engine import engine_tasks
from tests.engine.engine_tasks import (
    WithUnusedModule,
    assert_same_state,
    initial_parameters,
    mlp,
    reference,
    run_plan,
    tied_mlp,
    unused_module_task,
)

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
    with pytest.raises(ConfigError, match=r"cannot train tied weights: 0\.weight = 2\.weight"):
        ParallelPlan(data_parallel=2, sharded=True).check_model(model)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="tied weights"):
        run_plan("tied_task", tied_mlp, ParallelPlan(data_parallel=2, sharded=True), ctx=CTX, config=CONFIG)
    assert time.monotonic() - started < 2.0  # no worker was started
    assert _workers_of(os.getpid()) == set()


def test_a_pipeline_split_between_tied_weights_names_them() -> None:
    plan = ParallelPlan(pipeline=2, split_points=("2",))
    with pytest.raises(ConfigError, match=r"parameter '0\.weight' of stage 0 is also '2\.weight' of stage 1"):
        plan.check_model(tied_mlp())


@pytest.mark.parametrize("timeout_s", [0, -1, float("inf"), float("nan")])
def test_timeout_must_be_a_positive_bound(timeout_s: float) -> None:
    with pytest.raises(ConfigError, match="timeout_s"):
        run_plan("mlp_task", mlp, ParallelPlan(data_parallel=2), ctx=CTX, config=CONFIG, timeout_s=timeout_s)


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
    with pytest.raises(
        EngineError, match=r"\['unused.weight', 'unused.bias'\] got no gradient.*find_unused_parameters"
    ):
        run_plan("unused_module_task", WithUnusedModule, ParallelPlan(data_parallel=2), ctx=CTX, config=CONFIG)


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan",
    [ParallelPlan(data_parallel=2, find_unused_parameters=True), ParallelPlan(data_parallel=2, sharded=True)],
    ids=["ddp-find-unused", "fsdp2"],
)
def test_an_unused_module_trains_as_on_one_device(plan: ParallelPlan) -> None:
    # no FedProx term, weight decay on: an unused parameter must keep no gradient (left alone), as on one device
    config = FitConfig(local_epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=0.05)
    global_parameters = initial_parameters(WithUnusedModule)
    expected, _ = reference(unused_module_task, CTX, global_parameters, config, seed=1, round=1, client_id="c1")
    updated, _ = run_plan("unused_module_task", WithUnusedModule, plan, ctx=CTX, config=config)
    assert_same_state(updated, expected)


@pytest.mark.slow
def test_a_hanging_worker_fails_within_the_bound_and_leaves_nothing() -> None:
    timeout_s = 8.0
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"did not finish within 8 s \(ranks \[.*1.*\] still running") as info:
        plan = ParallelPlan(data_parallel=2)
        run_plan("hanging_task", mlp, plan, ctx=CTX, config=CONFIG, round=4, timeout_s=timeout_s)
    elapsed = time.monotonic() - started
    assert timeout_s <= elapsed < timeout_s + GRACE_S + 5.0
    assert info.value.round == 4 and info.value.client_id == "c1"
    assert not re.search(r"log tail ---\n(---|\n|$)", str(info.value))  # an empty rank log gives no empty section
    assert _workers_of(os.getpid()) == set()
    assert _workdirs_of(os.getpid()) == []


_CALLER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import engine_tasks
    from fedcore.engine import ParallelPlan
    from fedcore.task import FitConfig, TaskContext
    ctx = TaskContext(client_id="c1", seed=3, options={{"n": "24"}})
    engine_tasks.run_plan("hanging_task", engine_tasks.mlp, ParallelPlan(data_parallel=2), ctx=ctx,
                          config=FitConfig(local_epochs=1, batch_size=8, lr=0.1), timeout_s=300)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])  # SIGTERM: the client daemon test below
def test_workers_die_with_their_caller(sig: signal.Signals) -> None:
    caller = subprocess.Popen([sys.executable, "-c", _CALLER.format(tests=str(TESTS_DIR))], stderr=subprocess.PIPE)
    try:
        assert _wait_until(lambda: len(_workers_of(caller.pid)) == 2, 60.0), "the workers did not start"
        workers = _workers_of(caller.pid)
        assert len(_workdirs_of(caller.pid)) == 1
        time.sleep(1.0)  # let the workers reach the hang
        caller.send_signal(sig)
        caller.wait(timeout=GRACE_S + 10.0)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
    assert _wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 5.0)
    if sig is signal.SIGKILL:  # nothing runs in a killed process: the next caller removes its directory
        remove_stale_workdirs()
    assert _workdirs_of(caller.pid) == []


def test_the_server_hands_out_the_time_left_until_the_round_deadline(tmp_path: Path) -> None:
    pool = GrpcClientPool(PoolConfig(spill_dir=tmp_path / "spill"))
    try:
        session = pool.join("c1")
        instruction = FitIns(round=1, parameters=initial_parameters(mlp), config=CONFIG, seed=1)
        replies = pool.run({"c1": instruction}, timeout_s=30.0)
        runner = threading.Thread(target=lambda: list(replies))
        runner.start()
        time.sleep(1.0)
        pulled = pool.pull(session, 5.0)
        assert not isinstance(pulled, bool)
        task, payload = pulled
        payload.close()
        assert 25.0 < task.seconds_left() <= 29.0  # 30 s less the second before the pull
        pool.finish()
        runner.join(40)
    finally:
        pool.close()


@pytest.mark.slow
def test_the_daemon_bounds_parallel_training_by_the_round_deadline() -> None:
    config = DaemonConfig(
        server="127.0.0.1:1",
        client_id="c1",
        task=f"{engine_tasks.__name__}:hanging_task",
        insecure=True,
        parallel=ParallelPlan(data_parallel=2),
    )
    daemon = ClientDaemon(config)
    daemon._prepare_task(seed=3)
    daemon._deadline_s = 6.0  # as _pull sets it from the task header
    instruction = FitIns(round=2, parameters=initial_parameters(mlp), config=CONFIG, seed=1)
    started = time.monotonic()
    reply = daemon._execute(instruction)
    assert 6.0 <= time.monotonic() - started < 6.0 + GRACE_S + 5.0
    assert isinstance(reply, Failure) and "did not finish within 6 s" in reply.reason
    assert _workers_of(os.getpid()) == set()


@pytest.mark.slow
def test_sigterm_to_a_client_daemon_ends_its_workers(tmp_path: Path) -> None:
    # the real CLI daemon of a deployment, training under --parallel dp=2 when the signal arrives
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS_DIR), *sys.path])}
    flags = ["--rounds", "1", "--min-fit-clients", "1", "--fraction-fit", "1.0", "--round-timeout-s", "300",
             "--no-evaluate", "--epochs", "1", "--batch-size", "8", "--lr", "0.1"]  # fmt: skip
    server_cmd = server_args(0, tmp_path / "state", {}, *flags)  # the OS picks the port; the server reports it
    server_cmd[server_cmd.index("--task") + 1] = "engine_tasks:mlp_task"
    server = Proc("server", server_cmd, tmp_path, env=env)
    daemon: Proc | None = None
    try:
        port = server.listening_port(60)
        daemon = Proc(
            "daemon",
            client_args(port, "c1", 0, 1, {}, "--task", "engine_tasks:hanging_task", "--parallel", "dp=2"),
            tmp_path,
            env=env,
        )
        assert _wait_until(lambda: len(_workers_of(daemon.popen.pid)) == 2, 90.0), daemon.text()[-3000:]
        workers = _workers_of(daemon.popen.pid)
        daemon.popen.send_signal(signal.SIGTERM)
        # the daemon handles SIGTERM itself: the workers are stopped as its stack unwinds, and it exits 0
        assert daemon.wait(GRACE_S + 15.0) == 0, daemon.text()[-3000:]
        assert "stopped (SIGTERM)" in daemon.text(), daemon.text()[-3000:]
    finally:
        for proc in (daemon, server):
            if proc is not None:
                proc.close()
    assert _wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 5.0)
    assert _workdirs_of(daemon.popen.pid) == []
