"""SecAgg+ over gRPC in process: client daemons (threads) answering the four stages and masking their updates
give the in-memory simulation's model bit for bit (the stochastic rounding is keyed by the run's seed, round and
client id; the masks differ between the runs but cancel exactly in the field)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from client.daemon import ClientDaemon, DaemonConfig
from fedcore.task import Task, TaskContext
from server.round_loop import RoundConfig, run_rounds
from simulations.inmemory import InMemoryPool
from tests.deploy.test_service import Harness
from tests.privacy.secagg.test_rounds import IDS, SEED, make_task, secure, start_state

pytestmark = pytest.mark.timeout(120)

ROUNDS = 2


def test_secure_rounds_over_grpc_equal_the_simulation_bit_for_bit(tmp_path: Path) -> None:
    simulated, _ = run_rounds(
        InMemoryPool(IDS, make_task), secure(), start_state(secure()), RoundConfig(num_rounds=ROUNDS, seed=SEED)
    )
    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=5.0)
    daemons, threads = [], []
    try:
        for cid in IDS:
            config = DaemonConfig(
                server=f"127.0.0.1:{h.port}",
                client_id=cid,
                task="unused:factory",
                insecure=True,
                poll_s=0.5,
                backoff_initial_s=0.05,
                backoff_max_s=0.2,
                exit_when_finished=False,
            )

            def factory(context: TaskContext, cid: str = cid) -> Task:
                return make_task(cid)

            daemon = ClientDaemon(config, factory=factory)
            daemons.append(daemon)
            threads.append(threading.Thread(target=daemon.run, daemon=True))
        for thread in threads:
            thread.start()
        h.pool.wait_for(len(IDS), timeout_s=30)
        strategy = secure()
        final, records = run_rounds(
            h.pool, strategy, start_state(strategy), RoundConfig(num_rounds=ROUNDS, seed=SEED, round_timeout_s=60)
        )
    finally:
        for daemon in daemons:
            daemon.stop()
        for thread in threads:
            thread.join(10)
        h.pool.finish()
        h.close()
    assert [sorted(r.accepted) for r in records] == [IDS] * ROUNDS
    for name, value in simulated.parameters.items():
        np.testing.assert_array_equal(final.parameters[name], value, err_msg=name)
