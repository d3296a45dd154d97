"""A standard Flower client app (tests/deploy/flower_app.py: ``client_fn`` reads ``node_config["partition-id"]``)
deployed unchanged: a real ``fedcore server start`` and two ``fedcore client start`` daemons on 127.0.0.1, all
with ``--task tests.deploy.flower_app:factory``. The server's call of ``client_fn`` gets partition 0 of 1 (it
used to crash with a raw KeyError); the final model equals FedAvg computed by hand with the client code, and
the server's evaluation equals that client's ``evaluate`` on it."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from server.state import load_checkpoint
from tests.deploy import flower_app
from tests.e2e.deploy_helpers import Proc

pytestmark = pytest.mark.slow

ROUNDS, EPOCHS, LR = 2, 3, 0.1
TASK = ["--task", "tests.deploy.flower_app:factory", "--task-option", f"lr={LR}"]


def test_a_flower_app_runs_unchanged_on_server_and_daemons(tmp_path: Path) -> None:
    state = tmp_path / "state"
    server = Proc("server", ["server", "start", "--insecure", "--address", "127.0.0.1:0", "--state-dir", str(state),
                             *TASK, "--rounds", str(ROUNDS), "--epochs", str(EPOCHS), "--fraction-fit", "1.0",
                             "--min-fit-clients", "2", "--linger-s", "3"], tmp_path)  # fmt: skip
    clients: list[Proc] = []
    try:
        port = server.listening_port()
        clients = [Proc(f"client-{i}", ["client", "start", "--insecure", "--server", f"127.0.0.1:{port}",
                                        "--client-id", f"client-{i}", "--partition-id", str(i), "--num-partitions",
                                        "2", *TASK, "--give-up-after-s", "60"], tmp_path)
                   for i in range(2)]  # fmt: skip
        assert server.wait(180) == 0, server.text()
        for client in clients:
            assert client.wait(30) == 0, client.text()
    finally:
        for proc in [server, *clients]:
            proc.close()
    final = load_checkpoint(state / "checkpoints" / f"round-{ROUNDS:06d}.safetensors").parameters
    w, b = flower_app.fedavg_by_hand(ROUNDS, EPOCHS, LR)
    np.testing.assert_allclose(final["param_0000"], w, rtol=1e-6)
    np.testing.assert_allclose(final["param_0001"], b, rtol=1e-6)
    assert final["param_0001"].shape == ()  # the 0-d bias came back as numpy scalars and stays 0-d
    with (state / "history.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    loss, _, _ = flower_app.LinearClient(flower_app.load_data(0, 1), LR).evaluate([w, b], {})
    assert float(rows[-1]["test_loss"]) == pytest.approx(loss, rel=1e-5)
