"""Deployment end to end: a real `fedcore server start` and real `fedcore client start` daemons on 127.0.0.1.

- 4 daemons finish 3 rounds on mnist-5k and the final global model equals the in-process simulation's with the
  same seed and partition (the same round loop and client runner on both sides);
- kill -9 the server after round 2 and restart it on the same state directory: it resumes at round 3, the daemons
  reconnect by themselves, and the final model equals the uninterrupted run's;
- kill -9 a daemon mid-round: the server notices within seconds (heartbeats) and closes the round with the
  remaining quorum, long before the round deadline.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.strategy import StrategyConfig
from fedcore.tensors import NamedArrays
from server.state import load_checkpoint
from simulations.config import DataConfig, ModelConfig, OutputConfig, SimulationConfig
from simulations.harness import client_ids, run_simulation, task_options
from tests.e2e.deploy_helpers import Proc, client_args, server_args

pytestmark = pytest.mark.slow

NUM_CLIENTS = 4
ROUNDS = 3
SEED = 7


def _config(out: Path) -> SimulationConfig:
    from fedcore.strategy import SamplingConfig
    from fedcore.task import FitConfig

    return SimulationConfig(
        seed=SEED,
        rounds=ROUNDS,
        data=DataConfig(dataset="mnist-5k", num_clients=NUM_CLIENTS, partition="dirichlet", alpha=0.5),
        model=ModelConfig(name="2nn"),
        strategy=StrategyConfig(name="fedavg"),  # the server's default; the simulation's is FedAvgM
        sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=NUM_CLIENTS),
        train=FitConfig(local_epochs=1, batch_size=32, lr=0.05),
        output=OutputConfig(dir=out, progress=False, plot=False),
    )


def _round_flags() -> list[str]:
    return [
        "--seed", str(SEED), "--rounds", str(ROUNDS), "--fraction-fit", "1.0",
        "--min-fit-clients", str(NUM_CLIENTS), "--epochs", "1", "--batch-size", "32", "--lr", "0.05",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> NamedArrays:
    """The in-process simulation's final global model, with one torch thread as the daemons (OMP_NUM_THREADS=1):
    float sums inside torch's kernels depend on the thread count, so equal models need equal counts."""
    out = tmp_path_factory.mktemp("simulation")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_simulation(_config(out), echo=lambda _: None).final.parameters
    finally:
        torch.set_num_threads(threads)


def _assert_same_model(got: NamedArrays, want: NamedArrays) -> None:
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _start_clients(port: int, options: dict[str, str], log_dir: Path, *extra: str) -> list[Proc]:
    return [
        Proc(cid, client_args(port, cid, i, NUM_CLIENTS, options, *extra), log_dir)
        for i, cid in enumerate(client_ids(NUM_CLIENTS))
    ]


def test_four_daemons_match_the_simulation(tmp_path: Path, reference: NamedArrays) -> None:
    options = task_options(_config(tmp_path))
    state = tmp_path / "state"
    server = Proc("server", server_args(0, state, options, *_round_flags()), tmp_path)
    clients: list[Proc] = []
    try:
        clients = _start_clients(server.listening_port(), options, tmp_path)
        assert server.wait(150) == 0, server.text()
        for client in clients:
            assert client.wait(30) == 0, client.text()
    finally:
        for proc in [server, *clients]:
            proc.close()
    final = load_checkpoint(state / "checkpoints" / f"round-{ROUNDS:06d}.safetensors")
    assert final.round == ROUNDS
    _assert_same_model(final.parameters, reference)
    history = (state / "history.csv").read_text().splitlines()
    assert len(history) == 1 + ROUNDS + 1  # header, round 0 (initial evaluation), rounds 1..3


def test_server_killed_after_round_2_resumes_and_matches(tmp_path: Path, reference: NamedArrays) -> None:
    options = task_options(_config(tmp_path))
    state = tmp_path / "state"
    server = Proc("server", server_args(0, state, options, *_round_flags()), tmp_path)
    clients: list[Proc] = []
    restarted: Proc | None = None
    try:
        port = server.listening_port()
        # the restarted server takes the same port, which the daemons keep reconnecting to
        args = server_args(port, state, options, *_round_flags())
        clients = _start_clients(port, options, tmp_path)
        server.wait_for_line(f"round 2: {NUM_CLIENTS} update(s)", 120)  # the round line, not a warning about round 2
        server.kill9()
        assert not (state / "checkpoints" / f"round-{ROUNDS:06d}.safetensors").exists()
        restarted = Proc("server-restarted", args, tmp_path)
        restarted.wait_for_line("resuming after round 2", 60)
        assert restarted.wait(120) == 0, restarted.text()
        assert "round 1:" not in restarted.text() and "round 3:" in restarted.text()
        for client in clients:
            assert client.wait(30) == 0, client.text()
            # the outage is retried many times (debug lines) and its reasons (the cut call, then connection
            # refused until the restarted server listens) are each printed once
            reasons = [line for line in client.text().splitlines() if "cannot reach the server" in line]
            retries = client.text().count("retrying in")
            assert 1 <= len(reasons) <= 2 < retries, client.text()
            assert len(set(line.split(": ", 1)[1] for line in reasons)) == len(reasons), reasons
    finally:
        for proc in [server, *clients, *([restarted] if restarted else [])]:
            proc.close()
    final = load_checkpoint(state / "checkpoints" / f"round-{ROUNDS:06d}.safetensors")
    _assert_same_model(final.parameters, reference)


def _slow_round(
    tmp_path: Path, *, results: int, sleep_s: float, deadline_s: float, extra: Sequence[str] = ()
) -> tuple[Proc, list[Proc]]:
    """A server for one round that starts once all 4 daemons are connected (so each is selected) and closes with
    ``results`` updates, and the 4 daemons, whose training sleeps ``sleep_s`` first: a test acts mid-round."""
    options = task_options(_config(tmp_path))
    flags = [
        "--seed", str(SEED), "--rounds", "1", "--fraction-fit", "1.0", "--min-fit-clients", "4",
        "--min-fit-results", str(results), "--round-timeout-s", str(deadline_s), "--no-evaluate", *extra,
    ]  # fmt: skip
    server = Proc("server", server_args(0, tmp_path / "state", options, *flags), tmp_path)
    slow = ["--task", "tests.e2e.slow_task:slow_demo_task", "--task-option", f"sleep_s={sleep_s}"]
    try:
        return server, _start_clients(server.listening_port(), options, tmp_path, *slow)
    except BaseException:
        server.close()
        raise


def test_a_daemon_stopped_mid_round_leaves_its_session_and_exits_as_documented(tmp_path: Path) -> None:
    """SIGTERM (``systemctl stop``) in the middle of training: the daemon left no line and exited 143, and the
    server waited for its liveness timeout. It now leaves its session at once, says it stopped and exits 0, as the
    README says; Ctrl-C leaves too and exits 130 with ``fedcore: interrupted``. The round closes with the two others'
    updates and two failures, well before the slow clients' liveness timeout of 30 s, and the run finishes."""
    server, clients = _slow_round(tmp_path, results=2, sleep_s=6, deadline_s=120, extra=["--liveness-timeout-s", "30"])
    try:
        stopped, interrupted = clients[-2:]
        for victim in (stopped, interrupted):
            victim.wait_for_line("round 1 fit started", 120)
        stopped.popen.send_signal(signal.SIGTERM)
        interrupted.popen.send_signal(signal.SIGINT)
        sent_at = time.monotonic()
        assert stopped.wait(10) == 0, stopped.text()
        assert "stopped (SIGTERM); the session is left" in stopped.text()
        assert interrupted.wait(10) == 130, interrupted.text()
        assert interrupted.text().rstrip().endswith("fedcore: interrupted"), interrupted.text()
        closed_at = server.wait_for_line("round 1: 2 update(s), 2 failure(s)", 60)
        assert closed_at - sent_at < 20  # the survivors' 6 s of training, not a 30 s liveness timeout
        assert "no heartbeat" not in server.text()
        assert server.wait(120) == 0, server.text()
        for survivor in clients[:-2]:
            assert survivor.wait(30) == 0, survivor.text()
    finally:
        for proc in [server, *clients]:
            proc.close()


def test_client_killed_mid_round_closes_round_with_quorum(tmp_path: Path) -> None:
    deadline_s = 120
    # All 4 must be connected for round 1 (so the victim is certainly selected); 3 results make the quorum.
    server, clients = _slow_round(tmp_path, results=3, sleep_s=4, deadline_s=deadline_s)
    try:
        victim = clients[-1]
        victim.wait_for_line("round 1 fit started", 120)
        victim.kill9()
        killed_at = time.monotonic()
        closed_at = server.wait_for_line("round 1: 3 update(s), 1 failure(s)", 60)
        # liveness timeout 2.5 s + the survivors' 4 s of training, far below the 120 s deadline
        assert closed_at - killed_at < 20
        assert "no heartbeat" in server.text()
        assert server.wait(120) == 0, server.text()  # the run finishes normally without the dead client
        for survivor in clients[:-1]:
            assert survivor.wait(30) == 0, survivor.text()
    finally:
        for proc in [server, *clients]:
            proc.close()


@pytest.mark.parametrize(("option", "message"), [
    ("model=logreg", "the global model from the server does not fit this client's model: only the global model "
     "has ['net.1.weight', 'net.1.bias', 'net.3.weight', 'net.3.bias', 'net.5.weight'] ..., only this client's "
     "model has ['linear.weight', 'linear.bias']"),
    ("dataset=digits", "tensor 'net.1.weight' has shape (200, 784) in the global model from the server, (200, 64) "
     "in this client's model"),
])  # fmt: skip
def test_a_daemon_whose_task_builds_another_model_exits_2_after_telling_the_server(
    option: str, message: str, tmp_path: Path
) -> None:
    """A daemon started with another --task or --task-option than the server's stayed in the run forever, failing
    every round and looking healthy to systemd, with a message that named its own tensors 'missing'. It now tells
    the server why its round failed, leaves, and exits 2 (an error no retry fixes) with a message that names each
    side; the server closes the round at once, without waiting for the deadline."""
    options = task_options(_config(tmp_path))
    flags = ["--seed", str(SEED), "--rounds", "1", "--min-fit-clients", "1", "--round-timeout-s", "120",
             "--max-round-attempts", "1", "--no-evaluate"]  # fmt: skip
    server = Proc("server", server_args(0, tmp_path / "state", options, *flags), tmp_path)
    client: Proc | None = None
    try:
        port = server.listening_port()
        key, value = option.split("=")
        client = Proc("client", client_args(port, "client-000", 0, NUM_CLIENTS, {**options, key: value}), tmp_path)
        assert client.wait(60) == 2, client.text()
        assert f"fedcore: error: [round 1, client 'client-000'] {message}" in client.text(), client.text()
        assert "start the daemon with the server's --task and --task-option values" in client.text()
        assert server.wait(60) == 2, server.text()
        assert message in server.text() and "no heartbeat" not in server.text()
    finally:
        for proc in [server, *([client] if client else [])]:
            proc.close()
