"""The Ray backend: the in-process history bit for bit, a killed actor fails only its client (a real local Ray)."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from fedcore.errors import ConfigError
from fedcore.messages import Failure, FitIns, FitRes
from fedcore.task import FitConfig, initial_parameters
from simulations.procpool import ClientTasks
from tests.simulations.procpool_tasks import linear, linear64
from tests.simulations.test_procpool import (
    CTRL_C_BURST,
    DIGITS,
    SECAGG,
    assert_same_history_as_in_process,
    simulate_stopped_by_ctrl_c,
)

TINY = "tests.simulations.procpool_tasks:tiny_task"
IDS = [f"client-{i}" for i in range(8)]


def test_without_ray_the_backend_is_refused_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from simulations.config import load_recipe

    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray gives: ImportError
    with pytest.raises(ConfigError) as refused:
        load_recipe(None, ["simulation.backend='ray'"])
    python = shlex.quote(sys.executable)  # this environment's pip, not whichever `pip` the shell finds first
    assert (
        f"; {python} -m pip install 'fedcore[ray]' (from a checkout: {python} -m pip install -e '.[ray]'), or choose "
        "backend = 'process'"
    ) in str(refused.value)


def test_a_cluster_address_where_nothing_listens_is_refused_in_seconds() -> None:
    """ray.init retries an address where nothing listens without end; the pool checks it first (no Ray needed)."""
    import socket
    import time

    from simulations.raypool import check_reachable

    with socket.socket() as closed:  # a port that was just free: nothing listens there
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"no Ray cluster answers at ray_address '127\.0\.0\.1:{port}' \(.*refused"):
        check_reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - started < 5
    for bad in ("head", "ray://:10001", "head:port"):
        with pytest.raises(ConfigError, match="is not host:port"):
            check_reachable(bad)
    with socket.socket() as listening:  # a head that accepts connections passes, ray:// or not
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        check_reachable(f"127.0.0.1:{port}")
        check_reachable(f"ray://127.0.0.1:{port}")
    check_reachable("auto")


def test_an_address_that_names_no_ray_client_plugin_is_refused_in_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray hands scheme://... to the module named by the scheme; one that is no plug-in failed inside ray.init with
    a traceback (AssertionError for http://, the dashboard's address, a RuntimeError for a missing module)."""
    from simulations.raypool import check_reachable

    with pytest.raises(ConfigError, match=r"'http' is no Ray Client plug-in .*\(http:// is the Ray dashboard's"):
        check_reachable("http://127.0.0.1:8265")
    for bad, scheme in (("nosuchmodule://x", "nosuchmodule"), ("://x", "")):
        with pytest.raises(ConfigError, match=rf"ray_address '{bad}': '{scheme}' is no Ray Client plug-in module"):
            check_reachable(bad)
    (tmp_path / "fedcore_test_plugin.py").write_text("class ClientBuilder:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_reachable("fedcore_test_plugin://head:1234")  # a plug-in: Ray's to resolve


@pytest.mark.slow
def test_auto_with_no_ray_running_is_a_one_line_error_in_fedcores_words(tmp_path: Path) -> None:
    """ray.init(address='auto') with no Ray on this machine raises ConnectionError, whose advice names Ray's own
    --address flag; simulate says what to do with its own keys."""
    services = pytest.importorskip("ray._private.services", reason="the ray extra is not installed")
    if services.find_gcs_addresses():
        pytest.skip("a Ray instance runs on this machine: 'auto' would join it")
    args = ["-m", "fedcore.cli", "simulate", *(word for item in DIGITS for word in ("--set", item)), "--rounds", "1"]
    args += ["--no-progress", "--out", str(tmp_path / "out"), "--backend", "ray", "--ray-address", "auto"]
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr  # a configuration error
    assert done.stderr.splitlines()[-1] == (
        "fedcore: error: ray_address 'auto': Could not find any running Ray instance; start a cluster (ray start "
        "--head) or give its address (host:port, ray://host:10001), or leave ray_address unset to start Ray on this "
        "machine"
    ), done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["simulation.num_gpus=0.5"], "add backend = 'ray'"),
        (["simulation.ray_address='auto'"], "add backend = 'ray'"),
        (["simulation.backend='ray'", "simulation.num_cpus=0"], "not both 0"),
        (["simulation.backend='ray'", "simulation.num_cpus=-1"], "num_cpus must be in 0..1024"),
    ],
)
def test_ray_options_are_checked_before_the_run(overrides: list[str], message: str) -> None:
    from simulations.config import load_recipe

    pytest.importorskip("ray", reason="the ray extra is not installed: pip install -e '.[ray]'")
    with pytest.raises(ConfigError, match=message):
        load_recipe(None, overrides)


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """One local Ray for the module: 2 CPUs, a small object store, no dashboard."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install -e '.[ray]'")
    with warnings.catch_warnings():  # Ray's notice about a future default of accelerator variables
        warnings.simplefilter("ignore", FutureWarning)
        ray.init(num_cpus=2, object_store_memory=80 << 20, include_dashboard=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def _fit(clients: list[str], round: int = 1, model_fn: Callable[[], torch.nn.Module] = linear) -> dict[str, FitIns]:
    parameters = initial_parameters(model_fn, 0)
    ins = FitIns(round=round, parameters=parameters, config=FitConfig(local_epochs=1, batch_size=5, lr=0.1), seed=0)
    return {cid: ins for cid in clients}


@pytest.mark.slow
def test_a_killed_actor_fails_only_its_client_and_is_replaced(ray_instance: None) -> None:
    from simulations.raypool import RayPool

    tasks = ClientTasks(factory=TINY, options={"crash": "client-2"}, num_partitions=len(IDS), seed=0)
    with RayPool(IDS, tasks, workers=2) as pool:
        before = set(pool.worker_pids())
        replies = {r.client_id: r for r in pool.run(_fit(["client-1", "client-2", "client-3", "client-4", "client-5"]))}
        assert sorted(replies) == ["client-1", "client-2", "client-3", "client-4", "client-5"]
        failure = replies["client-2"]
        assert isinstance(failure, Failure) and "actor running this client died" in failure.reason, failure
        others = {c: replies[c] for c in ("client-1", "client-3", "client-4", "client-5")}
        assert all(isinstance(r, FitRes) for r in others.values()), others
        after = set(pool.worker_pids())
        assert len(after) == 2 and len(before - after) == 1, (before, after)  # the dead actor was replaced
        again = {r.client_id: r for r in pool.run(_fit(IDS[3:], round=2))}  # both actors train, the new one too
        assert all(isinstance(r, FitRes) for r in again.values()) and len(again) == 5, again
        pids = {r.metrics["pid"] for r in again.values() if isinstance(r, FitRes)}
        assert pids == after, (pids, after)  # the first client of the round goes to each actor


@pytest.mark.slow
def test_more_actors_than_this_machines_ray_holds_are_refused_at_once(
    ray_instance: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """workers = 3 actors of 1 CPU on a local Ray of 2 CPUs: the third would never start. (Before, the pool waited
    START_TIMEOUT_S, 300 s, then gave up with a TransportError.) Fractions that fit start: 4 actors of 0.5 CPU."""
    import simulations.raypool as raypool
    from simulations.raypool import RayPool

    monkeypatch.setattr(raypool, "START_TIMEOUT_S", 20.0)
    tasks = ClientTasks(factory=TINY, num_partitions=len(IDS), seed=0)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"workers = 3 Ray actors of num_cpus=1.0 need 3 CPUs, and Ray on this "):
        RayPool(IDS, tasks, workers=3)
    with pytest.raises(ConfigError, match=r"need 1 GPUs, and Ray on this machine has 0: the actors beyond 0 "):
        RayPool(IDS, tasks, workers=1, num_gpus=1.0)
    assert time.monotonic() - started < 5
    import ray

    deadline = time.monotonic() + 30  # the actors of the module's earlier tests free their CPUs after ray.kill
    while ray.available_resources().get("CPU", 0.0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    with RayPool(IDS, tasks, workers=4, num_cpus=0.5) as pool:
        assert pool.num_workers == 4 and len(set(pool.worker_pids())) == 4


@pytest.mark.slow
def test_float64_replies_come_in_order_and_a_run_stopped_early_waits_for_nothing(
    ray_instance: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the Ray pool shares with the process pool's run: a float64 model's replies in the clients' order even
    when the first client finishes last; a run stopped after its first reply returns at once, its client still
    training is waited for by the next run, which yields only its own replies. Under an order window of 3 places,
    only the two clients after the slow one run while it sleeps."""
    import simulations.procpool as procpool
    from simulations.raypool import RayPool

    options = {"dtype": "float64", "slow": "client-0", "slow_s": "3"}
    tasks = ClientTasks(factory=TINY, options=options, num_partitions=len(IDS), seed=0)
    with RayPool(IDS, tasks, workers=2) as pool:
        pool.wait_until_ready()
        clients = ["client-0", "client-3", "client-4", "client-5"]
        assert [r.client_id for r in pool.run(_fit(clients, model_fn=linear64))] == clients
        replies = pool.run(_fit(["client-3", "client-0"], round=2, model_fn=linear64))
        assert next(replies).client_id == "client-3"
        started = time.monotonic()
        replies.close()  # client-0 sleeps 3 s in the other actor
        assert time.monotonic() - started < 1.0
        again = list(pool.run(_fit(["client-4"], round=3, model_fn=linear64)))
        assert [(type(r), r.client_id, r.round) for r in again] == [(FitRes, "client-4", 3)]
        monkeypatch.setattr(procpool, "order_window", lambda instructions, workers: 3)
        clients = IDS[:7]
        windowed = [r for r in pool.run(_fit(clients, round=4, model_fn=linear64)) if isinstance(r, FitRes)]
        assert [r.client_id for r in windowed] == clients
        slow_end = float(windowed[0].metrics["ended"])
        assert [r.client_id for r in windowed[1:] if float(r.metrics["started"]) < slow_end] == clients[1:3]


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "overrides"), [(None, DIGITS), (SECAGG, [])], ids=["fedavgm", "secagg"])
def test_simulate_with_the_ray_backend_gives_the_in_process_history_bit_for_bit(
    ray_instance: None, tmp_path: Path, recipe: Path | None, overrides: list[str]
) -> None:
    """FedAvgM on digits, and SecAgg+ (its stages keep each client on one actor for the round)."""
    assert_same_history_as_in_process(tmp_path, recipe, overrides, "ray")


@pytest.mark.slow
def test_simulate_on_ray_stopped_by_a_burst_of_ctrl_c_cleans_up_as_after_one(tmp_path: Path) -> None:
    """Ctrl-C pressed two or three times: the later ones come as ray.shutdown starts (in the pool's close, and in
    Ray's own atexit hook) and half-way through its ending of Ray's processes (sent from there, so that they always
    land inside them). The run still ends as after one Ctrl-C: "fedcore: interrupted", exit status 130, no
    traceback, no Ray process left. (Before, the run exited 1 and left ray::DashboardAgent and
    ray::RuntimeEnvAgent running, or printed the KeyboardInterrupt of Ray's atexit shutdown.)"""
    pytest.importorskip("ray", reason="the ray extra is not installed: pip install -e '.[ray]'")
    patches = CTRL_C_BURST + (
        "import ray.dag.compiled_dag_node as dags\n"
        "from ray._private.node import Node\n"
        "first, kill = dags._shutdown_all_compiled_dags, Node._kill_process_impl\n"
        "def first_again():\n"
        "    burst()  # ray.shutdown's first step (imported at each call)\n"
        "    first()\n"
        "def kill_again(self, *args, **kwargs):\n"
        "    burst()  # before each of Ray's processes is ended\n"
        "    return kill(self, *args, **kwargs)\n"
        "dags._shutdown_all_compiled_dags, Node._kill_process_impl = first_again, kill_again\n"
    )
    code, out, err, left = simulate_stopped_by_ctrl_c(tmp_path, "ray", patches)
    assert (code, err, left) == (130, "fedcore: interrupted\n", []), out


@pytest.mark.slow
def test_simulate_on_ray_stopped_by_sigterm_exits_143_through_its_cleanup(tmp_path: Path) -> None:
    """``kill PID`` on a run on Ray: ray.init had replaced Python's default with its own handler, whose exit inside
    ray.wait printed a native stack dump ("*** SIGTERM received ...") and exited 1. The run now leaves through its
    cleanup (Ray stopped, nothing left running) with 143, the status of a process the signal ended, and prints
    nothing; the finished rounds are kept for --resume."""
    pytest.importorskip("ray", reason="the ray extra is not installed: pip install -e '.[ray]'")
    code, out, err, left = simulate_stopped_by_ctrl_c(tmp_path, "ray", "", sigterm=True)
    assert (code, err, left) == (143, "", []), out
    history = (tmp_path / "run" / "history.csv").read_text().splitlines()
    assert len(history) >= 3  # the header, round 0 and round 1 at least


def test_a_new_pool_forgets_the_sigterm_an_earlier_one_exited_through() -> None:
    """A process that survived one run's SIGTERM exit (an application embedding fedcore catches SystemExit) would
    otherwise report a later run's SystemExit(1) from ray.wait as 143."""
    import signal

    from simulations import raypool

    before = signal.getsignal(signal.SIGTERM)
    raypool._TERMINATED.set()
    try:
        raypool._sigterm_after_init(signal.SIG_DFL)
        assert signal.getsignal(signal.SIGTERM) is raypool._exit_on_sigterm
        assert not raypool._TERMINATED.is_set()
    finally:
        signal.signal(signal.SIGTERM, before)
        raypool._TERMINATED.clear()
