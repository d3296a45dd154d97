"""A client daemon training under a parallel plan (`--parallel dp=2`: two DDP worker processes) takes part in
a real gRPC round, and the global model equals the in-process simulation's (up to float rounding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedcore.strategy import SamplingConfig, StrategyConfig
from fedcore.task import FitConfig
from server.state import load_checkpoint
from simulations.config import DataConfig, ModelConfig, OutputConfig, SimulationConfig
from simulations.harness import client_ids, run_simulation, task_options
from tests.e2e.deploy_helpers import Proc, client_args, server_args

pytestmark = pytest.mark.slow

SEED = 11


def test_daemon_with_data_parallel_plan_matches_the_simulation(tmp_path: Path) -> None:
    config = SimulationConfig(
        seed=SEED,
        rounds=1,
        data=DataConfig(dataset="mnist-5k", num_clients=2, partition="iid"),
        model=ModelConfig(name="2nn"),
        strategy=StrategyConfig(name="fedavg"),  # the server's default; the simulation's is FedAvgM
        sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=2),
        train=FitConfig(local_epochs=1, batch_size=32, lr=0.05),
        output=OutputConfig(dir=tmp_path / "simulation", progress=False, plot=False),
    )
    reference = run_simulation(config, echo=lambda _: None).final.parameters
    options = task_options(config)
    state = tmp_path / "state"
    flags = ["--seed", str(SEED), "--rounds", "1", "--fraction-fit", "1.0", "--min-fit-clients", "2",
             "--epochs", "1", "--batch-size", "32", "--lr", "0.05", "--no-evaluate"]  # fmt: skip
    server = Proc("server", server_args(0, state, options, *flags), tmp_path)
    ids = client_ids(2)
    clients: list[Proc] = []
    try:
        port = server.listening_port()
        clients = [
            Proc(ids[0], client_args(port, ids[0], 0, 2, options, "--parallel", "dp=2"), tmp_path),
            Proc(ids[1], client_args(port, ids[1], 1, 2, options), tmp_path),
        ]
        assert server.wait(150) == 0, server.text()
        for client in clients:
            assert client.wait(30) == 0, client.text()
    finally:
        for proc in [server, *clients]:
            proc.close()
    final = load_checkpoint(state / "checkpoints" / "round-000001.safetensors")
    assert list(final.parameters) == list(reference)
    for name, want in reference.items():
        torch.testing.assert_close(
            torch.from_numpy(final.parameters[name]), torch.from_numpy(want), atol=1e-5, rtol=1e-5
        )
