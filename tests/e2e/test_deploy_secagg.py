"""Secure aggregation with real `fedcore client start` daemons: fresh processes load the SecAgg+ client side on
the first stage message, mask their updates, and the rounds give the in-memory simulation's model bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig, build_strategy
from server.grpc_pool import GrpcClientPool, PoolConfig
from server.round_loop import RoundConfig, run_rounds
from server.service import AuthPolicy, CoordinatorService, build_server
from simulations.inmemory import InMemoryPool
from tests.e2e.deploy_helpers import Proc
from tests.privacy.secagg.test_rounds import FIT, IDS, SECAGG, SEED, make_task, start_state

pytestmark = pytest.mark.slow

ROUNDS = 2


def secure() -> Strategy:  # every round waits for all four daemons
    config = StrategyConfig(secure_aggregation=True, secagg=SECAGG)
    return build_strategy(config, FIT, SamplingConfig(fraction_fit=1.0, min_fit_clients=len(IDS)))


def _client_args(port: int, client_id: str) -> list[str]:
    return [
        "-v", "client", "start", "--insecure", "--server", f"127.0.0.1:{port}", "--client-id", client_id,
        "--task", "tests.privacy.secagg.test_rounds:task_factory", "--poll-s", "1", "--backoff-max-s", "1",
        "--give-up-after-s", "60",
    ]  # fmt: skip


def test_secure_rounds_with_daemon_processes_equal_the_simulation_bit_for_bit(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the daemons (OMP_NUM_THREADS=1)
    try:
        want, _ = run_rounds(
            InMemoryPool(IDS, make_task), secure(), start_state(secure()), RoundConfig(num_rounds=ROUNDS, seed=SEED)
        )
    finally:
        torch.set_num_threads(threads)
    pool = GrpcClientPool(
        PoolConfig(spill_dir=tmp_path / "spill", seed=SEED, heartbeat_interval_s=0.5, liveness_timeout_s=10.0)
    )
    server, port = build_server(
        CoordinatorService(pool, AuthPolicy()), "127.0.0.1:0", credentials=None, max_workers=32, chunk_bytes=1 << 20
    )
    server.start()
    daemons = [Proc(cid, _client_args(port, cid), tmp_path) for cid in IDS]
    try:
        strategy = secure()
        config = RoundConfig(num_rounds=ROUNDS, seed=SEED, round_timeout_s=60, wait_for_clients_s=300)
        got, records = run_rounds(pool, strategy, start_state(strategy), config)
        pool.finish()
        for daemon in daemons:
            assert daemon.wait(120) == 0, daemon.text()[-3000:]
    finally:
        for daemon in daemons:
            daemon.close()
        server.stop(0)
        pool.close()
    assert [sorted(r.accepted) for r in records] == [IDS] * ROUNDS
    for name in want.parameters:
        np.testing.assert_array_equal(got.parameters[name], want.parameters[name], err_msg=name)
