"""SCAFFOLD deployed: a real `fedcore server start --strategy scaffold` and real daemons with their own
`--state-dir` on 127.0.0.1.

The server is killed (kill -9) after round 2 and restarted on its state directory (the server control variate
comes back from the checkpoint), and one daemon is killed at the same moment and restarted on its state directory
(its control variate comes back from its state file). The final model and control variate equal the in-process
simulation's with the same seed, bit for bit: the simulation and gRPC paths give the same SCAFFOLD.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.algorithms.scaffold import CONTROL
from fedcore.strategy import SamplingConfig, StrategyConfig
from fedcore.task import FitConfig
from server.round_loop import ServerState
from server.state import load_checkpoint
from simulations.config import DataConfig, ModelConfig, OutputConfig, SimulationConfig
from simulations.harness import client_ids, run_simulation, task_options
from tests.e2e.deploy_helpers import Proc, client_args, server_args

pytestmark = pytest.mark.slow

NUM_CLIENTS = 3
ROUNDS = 4
SEED = 11


def _config(out: Path) -> SimulationConfig:
    return SimulationConfig(
        seed=SEED,
        rounds=ROUNDS,
        data=DataConfig(dataset="mnist-5k", num_clients=NUM_CLIENTS, partition="dirichlet", alpha=0.5),
        model=ModelConfig(name="2nn"),
        strategy=StrategyConfig(name="scaffold", server_lr=0.8),
        sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=NUM_CLIENTS),
        train=FitConfig(local_epochs=1, batch_size=32, lr=0.05),
        output=OutputConfig(dir=out, progress=False, plot=False),
    )


def _round_flags() -> list[str]:
    return [
        "--seed", str(SEED), "--rounds", str(ROUNDS), "--strategy", "scaffold", "--server-lr", "0.8",
        "--fraction-fit", "1.0", "--min-fit-clients", str(NUM_CLIENTS), "--epochs", "1", "--batch-size", "32",
        "--lr", "0.05",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> ServerState:
    """The simulation's final state, with one torch thread as the daemons (equal float sums need equal counts)."""
    out = tmp_path_factory.mktemp("simulation")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_simulation(_config(out), echo=lambda _: None).final
    finally:
        torch.set_num_threads(threads)


def test_scaffold_deployed_survives_server_and_daemon_restarts_and_matches_the_simulation(
    tmp_path: Path, reference: ServerState
) -> None:
    options = task_options(_config(tmp_path))
    state = tmp_path / "state"
    ids = client_ids(NUM_CLIENTS)

    def daemon(index: int, name: str) -> Proc:
        extra = ("--state-dir", str(tmp_path / f"client-state-{index}"))
        return Proc(name, client_args(port, ids[index], index, NUM_CLIENTS, options, *extra), tmp_path)

    server = Proc("server", server_args(0, state, options, *_round_flags()), tmp_path)
    procs = [server]
    try:
        port = server.listening_port()
        clients = [daemon(i, ids[i]) for i in range(NUM_CLIENTS)]
        procs += clients
        server.wait_for_line(f"round 2: {NUM_CLIENTS} update(s)", 150)
        server.kill9()
        clients[0].kill9()
        assert (tmp_path / "client-state-0").is_dir()  # (its state file is read back by the restarted daemon)
        restarted = Proc("server-restarted", server_args(port, state, options, *_round_flags()), tmp_path)
        procs.append(restarted)
        again = daemon(0, f"{ids[0]}-restarted")
        procs.append(again)
        restarted.wait_for_line("resuming after round 2", 60)
        assert restarted.wait(150) == 0, restarted.text()
        for client in [*clients[1:], again]:
            assert client.wait(30) == 0, client.text()
    finally:
        for proc in procs:
            proc.close()
    final = load_checkpoint(state / "checkpoints" / f"round-{ROUNDS:06d}.safetensors")
    assert final.round == ROUNDS and set(final.groups) == {CONTROL}
    for name, value in reference.parameters.items():
        np.testing.assert_array_equal(final.parameters[name], value, err_msg=name)
    for name, value in reference.groups[CONTROL].items():
        np.testing.assert_array_equal(final.groups[CONTROL][name], value, err_msg=name)
    assert any(float(np.abs(v).max()) > 0 for v in final.groups[CONTROL].values())
