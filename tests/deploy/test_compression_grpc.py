"""Compressed updates over gRPC in process: client daemons (threads) push their compressed updates through real
gRPC uploads; the bytes the server received shrink by the method's factor (counted by the service as the payload
arrived, ``fedcore_bytes_in_total``), and the model equals the in-memory simulation's bit for bit (top-k's
residuals in the daemons' state directories)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client.state import ClientStateStore
from fedcore.messages import ModParam, ModSpec
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, initial_parameters
from server.round_loop import RoundConfig, ServerState, run_rounds
from simulations.inmemory import InMemoryPool
from tests.deploy.daemon_threads import daemon_threads
from tests.deploy.test_service import Harness

pytestmark = pytest.mark.timeout(120)

IDS = ["a", "b", "c"]
SEED = 4
ROUNDS = 2
FIT = FitConfig(local_epochs=1, batch_size=32, lr=0.05)
SAMPLING = SamplingConfig(fraction_fit=1.0, min_fit_clients=3)
PARAMS = 256 * 64 + 64  # float32: 65,792 bytes of update per client and round uncompressed


def model_fn() -> nn.Module:
    return nn.Linear(256, 64)


def make_task(cid: str) -> SupervisedTask:
    g = torch.Generator().manual_seed(IDS.index(cid) + 7)
    return SupervisedTask(
        model_fn=model_fn, train_data=(torch.randn(64, 256, generator=g), torch.randint(0, 64, (64,), generator=g))
    )


# entire-model top-k with one warm-up round: 10% of the 16,448 entries in round 1, 1% (165) in round 2, split over
# the weight and the bias as their magnitudes fall (a tensor may send none: an empty tensor on the wire)
MODEL_WIDE: dict[str, ModParam] = {"method": "topk", "fraction": 0.01, "scope": "model", "warmup_rounds": 1}


def strategy(method: str | None) -> Strategy:
    if method is None:
        return Strategy(fit=FIT, sampling=SAMPLING, mods=())
    params: dict[str, ModParam] = MODEL_WIDE if method == "topk-model" else {"method": method, "fraction": 0.01}
    return Strategy(fit=FIT, sampling=SAMPLING, mods=(ModSpec("compress", params),))


def simulated(tmp: Path, method: str | None) -> ServerState:
    """The in-memory run; its client state (one store for every method, as the daemons keep one state directory:
    top-k model-wide starts from the residuals plain top-k left) in ``tmp``."""
    pool = InMemoryPool(IDS, make_task, state=ClientStateStore(tmp / "clients"))
    final, _ = run_rounds(
        pool, strategy(method), initial_parameters(model_fn, SEED), RoundConfig(num_rounds=ROUNDS, seed=SEED)
    )
    return final


def test_compressed_updates_shrink_on_the_wire_and_equal_the_simulation(tmp_path: Path) -> None:
    received: dict[str | None, float] = {}
    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=5.0)
    try:
        with daemon_threads(h, IDS, make_task, state_root=tmp_path):  # the daemons run the mods each round declares
            for method in (None, "int8", "topk", "topk-model"):
                before = h.metrics.registry.get_sample_value("fedcore_bytes_in_total") or 0.0
                config = RoundConfig(num_rounds=ROUNDS, seed=SEED, round_timeout_s=60)
                final, records = run_rounds(h.pool, strategy(method), initial_parameters(model_fn, SEED), config)
                assert all(not r.failures and len(r.accepted) == len(IDS) for r in records[1:])
                after = h.metrics.registry.get_sample_value("fedcore_bytes_in_total")
                assert after is not None
                received[method] = after - before
                reference = simulated(tmp_path / "sim", method)
                for name, value in reference.parameters.items():
                    np.testing.assert_array_equal(final.parameters[name], value, err_msg=f"{method}: {name}")
    finally:
        h.pool.finish()
        h.close()
    updates = ROUNDS * len(IDS)
    assert received[None] / updates >= PARAMS * 4  # the uncompressed float32 update, plus its header
    # int8: 1 byte per element + a float32 scale per 512 + the header, against 4 bytes per element
    assert received[None] / received["int8"] >= 3.8
    # top-k 1%: 165 float32 values + 165 int32 indices per update (1,320 bytes) + the header
    assert received[None] / received["topk"] >= 25
    assert received["topk"] / updates < 3000
    # model-wide with warm-up: (1,645 + 165) values and indices per client over the two rounds (14,480 bytes)
    assert 14_480 * len(IDS) < received["topk-model"] < (14_480 + 2 * 1000) * len(IDS)
