"""SecAgg+ over gRPC in process: client daemons (threads) answering the four stages and masking their updates
give the in-memory simulation's model bit for bit (the stochastic rounding is keyed by the run's seed, round and
client id; the masks differ between the runs but cancel exactly in the field)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedcore.tensors import encode
from privacy.secagg.codec import MASKED
from server.round_loop import RoundConfig, run_rounds
from simulations.inmemory import InMemoryPool
from tests.deploy.daemon_threads import daemon_threads
from tests.deploy.test_service import Harness
from tests.privacy.secagg.test_rounds import IDS, SEED, make_task, secure, start_state

pytestmark = pytest.mark.timeout(120)

ROUNDS = 2


def test_secure_rounds_over_grpc_equal_the_simulation_bit_for_bit(tmp_path: Path) -> None:
    simulated, _ = run_rounds(
        InMemoryPool(IDS, make_task), secure(), start_state(secure()), RoundConfig(num_rounds=ROUNDS, seed=SEED)
    )
    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=5.0)
    try:
        with daemon_threads(h, IDS, make_task):
            strategy = secure()
            final, records = run_rounds(
                h.pool, strategy, start_state(strategy), RoundConfig(num_rounds=ROUNDS, seed=SEED, round_timeout_s=60)
            )
    finally:
        h.pool.finish()
        h.close()
    assert [sorted(r.accepted) for r in records] == [IDS] * ROUNDS
    for name, value in simulated.parameters.items():
        np.testing.assert_array_equal(final.parameters[name], value, err_msg=name)
    # the bytes the server received for the fit results: each a masked upload of D + 1 uint32 elements (24-bit
    # field), no larger than the plain float32 update of the same model as it travels (safetensors)
    size = sum(int(np.prod(v.shape)) for v in final.parameters.values())
    masked = len(encode({MASKED: np.zeros(size + 1, np.uint32)}))
    plain = len(encode(dict(final.parameters)))
    assert [r.bytes_up for r in records] == [len(IDS) * masked] * ROUNDS
    assert masked <= plain
