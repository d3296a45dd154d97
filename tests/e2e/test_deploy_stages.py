"""Multi-stage rounds over gRPC: the three-stage test protocol (tests/stage_protocol.py) between an in-process
server (pool, service, round loop on 127.0.0.1) and real `fedcore client start` daemons, with a dropout at every
stage (a client failing ``hello``, one missing the ``sum`` deadline, one failing fit, one failing ``confirm``).
The dropouts, the rounds' records and the final model equal those of the same rounds in memory."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from client.stages import ClientStages
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.task import FitConfig, TaskContext, initial_parameters
from server.grpc_pool import GrpcClientPool, PoolConfig
from server.round_loop import RoundConfig, RoundRecord, run_rounds
from server.service import AuthPolicy, CoordinatorService, build_server
from simulations.inmemory import InMemoryPool
from tests.e2e.deploy_helpers import Proc
from tests.stage_protocol import CLIENT_PROTOCOL, TranscriptProtocol, model, stage_task

pytestmark = pytest.mark.slow

SEED = 11
ROUNDS = 2
IDS = ["c0", "c1-fail-hello", "c2-slow-sum", "c3-fail-fit", "c4-fail-confirm"]
FIT = FitConfig(local_epochs=1, batch_size=8, lr=0.1)


def _strategy(protocol: TranscriptProtocol) -> Strategy:
    return Strategy(fit=FIT, sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=len(IDS)), protocol=protocol)


def _client_args(port: int, client_id: str) -> list[str]:
    return [
        "-v", "client", "start", "--insecure", "--server", f"127.0.0.1:{port}", "--client-id", client_id,
        "--task", "tests.stage_protocol:stage_task", "--poll-s", "1", "--backoff-max-s", "1", "--give-up-after-s", "60",
    ]  # fmt: skip


def _outcome(records: list[RoundRecord]) -> list[tuple[list[str], list[tuple[str, str]]]]:
    # sorted: over gRPC updates arrive in any order
    return [(sorted(r.accepted), sorted((f.client_id, f.stage.value) for f in r.failures)) for r in records]


def test_a_three_stage_protocol_with_dropouts_over_grpc_equals_the_same_rounds_in_memory(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the daemons (OMP_NUM_THREADS=1)
    try:
        memory_protocol = TranscriptProtocol(min_clients=1, deadline_s=0.5)
        pool = InMemoryPool(
            IDS, lambda cid: stage_task(TaskContext(client_id=cid, seed=SEED)), stages=ClientStages([CLIENT_PROTOCOL])
        )
        config = RoundConfig(num_rounds=ROUNDS, seed=SEED)
        want, want_records = run_rounds(pool, _strategy(memory_protocol), initial_parameters(model, SEED), config)
    finally:
        torch.set_num_threads(threads)

    grpc_pool = GrpcClientPool(
        PoolConfig(spill_dir=tmp_path / "spill", seed=SEED, heartbeat_interval_s=0.5, liveness_timeout_s=10.0)
    )
    server, port = build_server(
        CoordinatorService(grpc_pool, AuthPolicy()),
        "127.0.0.1:0",
        credentials=None,
        max_workers=32,
        chunk_bytes=1 << 20,
    )
    server.start()
    daemons = [Proc(cid, _client_args(port, cid), tmp_path) for cid in IDS]
    try:
        protocol = TranscriptProtocol(min_clients=1, deadline_s=3.0)
        config = RoundConfig(num_rounds=ROUNDS, seed=SEED, round_timeout_s=60, wait_for_clients_s=300)
        started = time.monotonic()
        got, records = run_rounds(grpc_pool, _strategy(protocol), initial_parameters(model, SEED), config)
        took = time.monotonic() - started
        grpc_pool.finish()
        for daemon in daemons:
            assert daemon.wait(120) == 0, daemon.text()[-3000:]  # a loaded machine may take its time to exit
    finally:
        for daemon in daemons:
            daemon.close()
        server.stop(0)
        grpc_pool.close()

    assert _outcome(records) == _outcome(want_records)
    assert sorted(records[-1].accepted) == ["c0", "c4-fail-confirm"]
    for rnd in range(1, ROUNDS + 1):
        machine, reference = protocol.rounds[(rnd, 1)], memory_protocol.rounds[(rnd, 1)]
        assert [(s, a, sorted(d)) for s, a, d in machine.stages] == [(s, a, sorted(d)) for s, a, d in reference.stages]
        sum_stage = machine.stages[1]
        assert list(sum_stage[2]) == ["c2-slow-sum"] and "deadline of 3.0 s" in sum_stage[2]["c2-slow-sum"]
    assert took < ROUNDS * (3.0 + 40)  # each sum stage waited for its deadline (3 s), no stage for the round's (60 s)
    for name in want.parameters:
        np.testing.assert_array_equal(got.parameters[name], want.parameters[name], err_msg=name)
    slow = next(d for d in daemons if d.name == "c2-slow-sum").text()
    assert "result not taken: no open task" in slow  # its sum reply came after the deadline and was discarded
