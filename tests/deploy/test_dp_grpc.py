"""Differential privacy over gRPC in process: client daemons (threads) receive the dp-clip and dp-sgd mods with the
fit instruction and run them, the server releases DP-FedAvg's aggregate and reports epsilon per round."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from client.state import ClientStateStore
from fedcore.strategy import Strategy
from fedcore.task import initial_parameters, trainable_names
from privacy.dp.accounting import epsilon
from privacy.dp.config import PrivacyConfig, apply_dp
from privacy.dp.mechanism import l2_norm
from server.round_loop import RoundConfig, initial_state, run_rounds
from tests.deploy.daemon_threads import daemon_threads
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
    try:
        with daemon_threads(h, IDS, make_task, state_root=tmp_path):
            after_one, records = run_rounds(
                h.pool, strategy, start, RoundConfig(num_rounds=1, seed=SEED, round_timeout_s=60)
            )
            _, more = run_rounds(h.pool, strategy, after_one, RoundConfig(num_rounds=2, seed=SEED, round_timeout_s=60))
    finally:
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
