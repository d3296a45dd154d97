"""Differential privacy over gRPC in process: client daemons (threads) receive the dp-clip and dp-sgd mods with the
fit instruction and run them, the server releases DP-FedAvg's aggregate and reports epsilon per round."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest

from client.daemon import ClientDaemon, DaemonConfig
from client.state import ClientStateStore
from fedcore.strategy import Strategy
from fedcore.task import Task, TaskContext, initial_parameters, trainable_names
from privacy.dp.accounting import epsilon
from privacy.dp.config import PrivacyConfig, apply_dp
from privacy.dp.mechanism import l2_norm
from server.round_loop import RoundConfig, initial_state, run_rounds
from tests.deploy.test_service import Harness
from tests.server.test_scaffold import FIT, IDS, SAMPLING, SEED, make_task, model_fn

pytestmark = pytest.mark.timeout(120)


def test_distributed_dp_and_dp_sgd_over_grpc(tmp_path: Path) -> None:
    """2 of 3 clients a round, C = 0.05, z tiny (1e-6): one round moves the model by at most k C / m = C, so
    the daemons clipped before replying; each daemon that trained keeps its DP-SGD step history in its state."""
    privacy = PrivacyConfig(
        dp="distributed", clipping_norm=0.05, noise_multiplier=1e-6, dp_sgd=True, dp_sgd_noise_multiplier=0.5
    )
    strategy = apply_dp(Strategy(name="fedavg", fit=FIT, sampling=SAMPLING), privacy, population=len(IDS))
    start = initial_state(initial_parameters(model_fn, SEED), strategy, trainable=trainable_names(model_fn))
    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=5.0)
    daemons, threads = [], []
    for cid in IDS:
        config = DaemonConfig(server=f"127.0.0.1:{h.port}", client_id=cid, task="unused:factory", insecure=True,
                              poll_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.2, exit_when_finished=False,
                              state_dir=tmp_path / f"state-{cid}")  # fmt: skip

        def factory(context: TaskContext, cid: str = cid) -> Task:
            return make_task(cid)

        daemons.append(ClientDaemon(config, factory=factory))
        threads.append(threading.Thread(target=daemons[-1].run, daemon=True))
    try:
        for thread in threads:
            thread.start()
        h.pool.wait_for(len(IDS), timeout_s=30)
        after_one, records = run_rounds(
            h.pool, strategy, start, RoundConfig(num_rounds=1, seed=SEED, round_timeout_s=60)
        )
        _, more = run_rounds(h.pool, strategy, after_one, RoundConfig(num_rounds=2, seed=SEED, round_timeout_s=60))
    finally:
        for daemon in daemons:
            daemon.stop()
        for thread in threads:
            thread.join(10)
        h.pool.finish()
        h.close()
    moved = l2_norm({n: after_one.parameters[n].astype(np.float64) - start.parameters[n] for n in start.parameters})
    assert 0 < moved <= 0.05 * (1 + 1e-3)
    assert [r.aggregation["epsilon"] for r in (*records, *more)] == [
        epsilon(noise_multiplier=1e-6, sampling_rate=2 / 3, rounds=r, delta=1e-5) for r in (1, 2)
    ]
    assert all(math.isfinite(r.train_metrics["sgd_epsilon"]) for r in (*records, *more))
    trained = [cid for r in (*records, *more) for cid in r.accepted]
    for cid in set(trained):
        history = ClientStateStore(tmp_path / f"state-{cid}").entry(cid).get("dp-sgd")
        assert history is not None and len(history["steps"]) == trained.count(cid)
