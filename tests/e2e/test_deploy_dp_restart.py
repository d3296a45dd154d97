"""DP-FedAvg's accounting across a server killed while a round's model is out for federated evaluation: that model
was released to the clients, and the restarted server trains the round again with fresh noise, so the round counts
twice in epsilon (a real `fedcore server start` and real client daemons on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from privacy.dp.accounting import epsilon
from tests.e2e.deploy_helpers import Proc, client_args, server_args

pytestmark = pytest.mark.slow

OPTIONS = {"dataset": "digits", "num_clients": "2", "partition": "iid", "model": "logreg"}
SLOW = ["--task", "tests.e2e.slow_task:slow_demo_task"]
Z, DELTA = 2.0, 1e-3


def test_a_round_released_to_federated_evaluation_then_trained_again_counts_twice(tmp_path: Path) -> None:
    state = tmp_path / "state"
    flags = [*SLOW, "--rounds", "3", "--min-fit-clients", "2", "--dp", "central", "--population", "2",
             "--noise-multiplier", str(Z), "--clipping-norm", "0.5", "--delta", str(DELTA), "--seed", "5",
             "--epochs", "1", "--fraction-evaluate", "1", "--min-evaluate-clients", "2",
             "--evaluate-every", "1"]  # fmt: skip
    procs: list[Proc] = []
    try:
        server = Proc("server", server_args(0, state, OPTIONS, *flags), tmp_path)
        procs.append(server)
        port = server.listening_port(120)
        for i in range(2):  # each client's evaluation sleeps 2 s: time to kill the server while it waits for them
            options = {**OPTIONS, "eval_sleep_s": "2"}
            procs.append(Proc(f"client-{i}", client_args(port, f"client-{i}", i, 2, options, *SLOW), tmp_path))
        procs[1].wait_for_line("round 2 evaluate started", 120)  # round 2's noisy model is at the client
        server.kill9()
        assert sorted(p.name for p in (state / "checkpoints").glob("*")) == ["round-000001.safetensors"]
        restarted = Proc("restarted", server_args(port, state, OPTIONS, *flags), tmp_path)
        procs.append(restarted)
        assert restarted.wait(180) == 0, restarted.text()
        log = restarted.text()
    finally:
        for proc in procs:
            proc.close()
    history = pd.read_csv(state / "history.csv")
    releases = {1: 1, 2: 3, 3: 4}  # round 2 was released twice: before the kill and after the restart
    for rnd, count in releases.items():
        spent = history.loc[history["round"] == rnd, "epsilon"].item()
        assert spent == epsilon(noise_multiplier=Z, sampling_rate=1.0, rounds=count, delta=DELTA), rnd
    assert "1 global model(s) of rounds after round 1 were sent to clients" in log
