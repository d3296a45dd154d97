"""SecAgg+ over gRPC in process: client daemons (threads) answering the four stages and masking their updates
give the in-memory simulation's model bit for bit (the stochastic rounding is keyed by the run's seed, round and
client id; the masks differ between the runs but cancel exactly in the field), and the rounds' bytes count the
stage traffic, matching what the service streamed."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest

from fedcore.messages import FitIns, FitRes, PoolReply, ServerMessage, StageIns, StageRes
from fedcore.tensors import encode, safetensors_header
from fedcore.wire import stage_message_to_pb
from privacy.secagg.codec import MASKED
from server.pool import PoolWrapper
from server.round_loop import RoundConfig, run_rounds
from simulations.inmemory import InMemoryPool
from tests.deploy.daemon_threads import daemon_threads
from tests.deploy.test_service import Harness
from tests.privacy.secagg.test_rounds import IDS, SEED, make_task, secure, start_state

pytestmark = pytest.mark.timeout(120)

ROUNDS = 2


class Tally(PoolWrapper):
    """The wrapped pool, recording every message sent and every reply received."""

    def __init__(self, pool: object) -> None:
        super().__init__(pool)  # type: ignore[arg-type]
        self.sent: list[ServerMessage] = []
        self.received: list[PoolReply] = []

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[PoolReply]:
        self.sent += instructions.values()
        for reply in self._pool.run(instructions, timeout_s=timeout_s):
            self.received.append(reply)
            yield reply


def field_bytes(message: StageIns | StageRes) -> int:
    """By hand: a bytes field its length, an int 8 bytes, a text its UTF-8 length."""
    return sum(
        len(v) if isinstance(v, bytes) else 8 if isinstance(v, int) else len(v.encode())
        for v in message.fields.values()
    )


def test_secure_rounds_over_grpc_equal_the_simulation_bit_for_bit(tmp_path: Path) -> None:
    memory = Tally(InMemoryPool(IDS, make_task))
    simulated, sim_records = run_rounds(
        memory, secure(), start_state(secure()), RoundConfig(num_rounds=ROUNDS, seed=SEED)
    )
    h = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=5.0)
    wire = Tally(h.pool)
    try:
        with daemon_threads(h, IDS, make_task):
            strategy = secure()
            final, records = run_rounds(
                wire, strategy, start_state(strategy), RoundConfig(num_rounds=ROUNDS, seed=SEED, round_timeout_s=60)
            )
        streamed_out = h.metrics.registry.get_sample_value("fedcore_bytes_out_total")
        streamed_in = h.metrics.registry.get_sample_value("fedcore_bytes_in_total")
    finally:
        h.pool.finish()
        h.close()
    assert [sorted(r.accepted) for r in records] == [IDS] * ROUNDS
    for name, value in simulated.parameters.items():
        np.testing.assert_array_equal(final.parameters[name], value, err_msg=name)
    # bytes: the four SecAgg+ stages' traffic is counted besides the fit exchange's
    for tally in (memory, wire):
        assert {m.name for m in tally.sent if isinstance(m, StageIns)} >= {"advertise_keys", "share_keys", "unmask"}
        assert all(isinstance(r, FitRes | StageRes) for r in tally.received)
    stage_in = [m for m in memory.sent if isinstance(m, StageIns)]
    stage_out = [r for r in memory.received if isinstance(r, StageRes)]
    fit_in = [m for m in memory.sent if isinstance(m, FitIns)]
    model_bytes = sum(a.nbytes for a in fit_in[0].parameters.values())
    # in memory: the tensors' bytes and the stage fields' values (keys, encrypted shares, seeds)
    assert sum(r.bytes_down for r in sim_records) == len(fit_in) * model_bytes + sum(map(field_bytes, stage_in))
    masked = sum(a.nbytes for r in memory.received if isinstance(r, FitRes) for a in r.parameters.values())
    assert sum(r.bytes_up for r in sim_records) == masked + sum(map(field_bytes, stage_out)) > masked
    assert sum(map(field_bytes, stage_in)) > 0 and sum(map(field_bytes, stage_out)) > 0
    # over gRPC: the payloads the service streamed (its own counters, chunk by chunk) plus each stage message's
    # protobuf header (protocol, name, fields)
    stage_headers_down = sum(stage_message_to_pb(m).ByteSize() for m in wire.sent if isinstance(m, StageIns))
    stage_headers_up = sum(stage_message_to_pb(r).ByteSize() for r in wire.received if isinstance(r, StageRes))
    assert sum(r.bytes_down for r in records) == streamed_out + stage_headers_down
    assert sum(r.bytes_up for r in records) == streamed_in + stage_headers_up
    fit_wire = [m for m in wire.sent if isinstance(m, FitIns)]
    empty = len(safetensors_header({}))  # a stage instruction without tensors still streams an empty payload
    stages_wire = sum(1 for m in wire.sent if isinstance(m, StageIns))
    model_payload = len(safetensors_header(fit_wire[0].parameters)) + model_bytes
    assert streamed_out == len(fit_wire) * model_payload + stages_wire * empty
    # each fit result is a masked upload of D + 1 uint32 elements (24-bit field), no larger than the plain float32
    # update of the same model as it travels (safetensors)
    size = sum(int(np.prod(v.shape)) for v in final.parameters.values())
    assert masked == ROUNDS * len(IDS) * (size + 1) * 4
    assert len(encode({MASKED: np.zeros(size + 1, np.uint32)})) <= len(encode(dict(final.parameters)))
