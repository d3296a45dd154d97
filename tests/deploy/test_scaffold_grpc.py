"""SCAFFOLD over gRPC in process: client daemons (threads) with their own state directories against the gRPC pool
give the in-memory simulation's model and control variates bit for bit, and a daemon started again on its state
directory continues from its stored control variate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedcore.algorithms.scaffold import CONTROL, scaffold
from fedcore.task import initial_parameters, trainable_names
from server.round_loop import RoundConfig, ServerState, initial_state, run_rounds
from tests.deploy.daemon_threads import daemon_threads
from tests.deploy.test_service import Harness
from tests.server.test_scaffold import ETA_G, FIT, IDS, SAMPLING, SEED, make_task, model_fn, run

pytestmark = pytest.mark.timeout(120)


def _grpc_rounds(tmp: Path, h: Harness, start: ServerState, rounds: int) -> ServerState:
    with daemon_threads(h, IDS, make_task, state_root=tmp):
        strategy = scaffold(fit=FIT, sampling=SAMPLING, server_lr=ETA_G)
        final, _ = run_rounds(h.pool, strategy, start, RoundConfig(num_rounds=rounds, seed=SEED, round_timeout_s=60))
        return final


def test_scaffold_over_grpc_equals_the_simulation_and_daemons_keep_their_control_variates(tmp_path: Path) -> None:
    simulated, _ = run(tmp_path / "simulation", rounds=3)
    strategy = scaffold(fit=FIT, sampling=SAMPLING, server_lr=ETA_G)
    start = initial_state(initial_parameters(model_fn, SEED), strategy, trainable=trainable_names(model_fn))
    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=5.0)
    try:
        after_two = _grpc_rounds(tmp_path, h, start, rounds=2)
        # the daemons stop and start again (new processes would do the same): c_i comes back from their files
        final = _grpc_rounds(tmp_path, h, after_two, rounds=3)
    finally:
        h.pool.finish()
        h.close()
    for name, value in simulated.parameters.items():
        np.testing.assert_array_equal(final.parameters[name], value, err_msg=name)
        np.testing.assert_array_equal(final.groups[CONTROL][name], simulated.groups[CONTROL][name], err_msg=name)
    assert sorted(p.name for p in (tmp_path / "state-a").iterdir()) == ["a.safetensors"]
