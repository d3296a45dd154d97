"""Multi-stage rounds in memory: a three-stage protocol (tests/stage_protocol.py) driven by the round loop through
the in-memory pool, with dropouts at each stage, a stage deadline, a stopped round, and rounds without a protocol
left as they were."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from client.stages import ClientStages
from fedcore.errors import ClientTaskError, PayloadError, RoundFailed
from fedcore.messages import MAX_STAGE_FIELD_BYTES, Failure, Stage, StageIns, StageRes
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.task import FitConfig, TaskContext, initial_parameters
from fedcore.tensors import NamedArrays
from server.round_loop import RoundConfig, RoundRecord, run_rounds
from simulations.inmemory import InMemoryPool
from tests.stage_protocol import (
    TranscriptClientProtocol,
    TranscriptProtocol,
    TranscriptServer,
    model,
    stage_task,
)

SEED = 5
FIT = FitConfig(local_epochs=1, batch_size=8, lr=0.1)


def _pool(ids: list[str], client: TranscriptClientProtocol | None = None) -> tuple[InMemoryPool, ClientStages]:
    stages = ClientStages([client or TranscriptClientProtocol()])
    pool = InMemoryPool(ids, lambda cid: stage_task(TaskContext(client_id=cid, seed=SEED)), stages=stages)
    return pool, stages


def _strategy(num: int, protocol: TranscriptProtocol | None) -> Strategy:
    return Strategy(fit=FIT, sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=num), protocol=protocol)


def _run(
    ids: list[str], protocol: TranscriptProtocol | None, rounds: int = 2, **round_kw: object
) -> tuple[NamedArrays, list[RoundRecord], ClientStages]:
    pool, stages = _pool(ids)
    config = RoundConfig(num_rounds=rounds, seed=SEED, **round_kw)  # type: ignore[arg-type]
    state, records = run_rounds(pool, _strategy(len(ids), protocol), initial_parameters(model, SEED), config)
    return state.parameters, records, stages


def _same(got: NamedArrays, want: NamedArrays) -> None:
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_protocol_without_dropouts_runs_every_stage_and_leaves_the_model_as_a_plain_round() -> None:
    ids = ["a", "b", "c"]
    protocol = TranscriptProtocol(min_clients=3)
    with_protocol, records, stages = _run(ids, protocol)
    plain, plain_records, _ = _run(ids, None)
    _same(with_protocol, plain)
    assert [r.accepted for r in records] == [r.accepted for r in plain_records] == [tuple(ids)] * 2
    assert all(not r.failures for r in records)
    for rnd in (1, 2):
        machine = protocol.rounds[(rnd, 1)]
        assert machine.stages == [(name, ids, {}) for name in ("hello", "sum", "confirm")]
        assert machine.fit == (ids, {})
    assert len(stages) == 3  # the last round's machines, one per client; round 1's went when round 2 began


def test_dropouts_at_each_stage_leave_the_round_to_the_rest() -> None:
    ids = ["c0", "c1-fail-hello", "c2-slow-sum", "c3-lie-sum", "c4-fail-fit", "c5-fail-confirm", "c6"]
    protocol = TranscriptProtocol(min_clients=2, deadline_s=0.3)
    final, records, _ = _run(ids, protocol, rounds=1)
    (record,) = records
    machine = protocol.rounds[(1, 1)]
    hello, total, confirm = machine.stages
    assert hello[0] == "hello" and hello[1] == [c for c in ids if c != "c1-fail-hello"]
    assert list(hello[2]) == ["c1-fail-hello"] and "fails at stage hello" in hello[2]["c1-fail-hello"]
    # the slow client missed the deadline; the lying one answered in time and was refused by the protocol
    assert total[0] == "sum" and total[1] == ["c0", "c3-lie-sum", "c4-fail-fit", "c5-fail-confirm", "c6"]
    assert list(total[2]) == ["c2-slow-sum"] and "deadline of 0.3 s" in total[2]["c2-slow-sum"]
    assert machine.fit is not None
    assert machine.fit[0] == ["c0", "c5-fail-confirm", "c6"]
    assert list(machine.fit[1]) == ["c4-fail-fit"] and "fails at fit" in machine.fit[1]["c4-fail-fit"]
    assert confirm[0] == "confirm" and confirm[1] == ["c0", "c6"] and list(confirm[2]) == ["c5-fail-confirm"]
    assert record.selected == tuple(ids)
    assert record.accepted == ("c0", "c5-fail-confirm", "c6")
    stages = {f.client_id: (f.stage, f.reason) for f in record.failures}
    assert stages["c1-fail-hello"][0] is Stage.PROTOCOL and "stage 'hello'" in stages["c1-fail-hello"][1]
    assert "stage 'sum'" in stages["c2-slow-sum"][1]
    assert "wrong proof of the total" in stages["c3-lie-sum"][1]
    assert stages["c4-fail-fit"][0] is Stage.FIT
    assert "stage 'confirm'" in stages["c5-fail-confirm"][1]
    assert set(stages) == {c for c in ids if c not in ("c0", "c6")}
    # the dropped clients trained nothing: the model is a plain round's over the clients whose updates counted
    plain, _, _ = _run(["c0", "c5-fail-confirm", "c6"], None, rounds=1)
    _same(final, plain)


def test_a_protocol_that_stops_the_round_fails_each_attempt_and_the_run_with_a_clear_error() -> None:
    ids = ["c0", "c1-fail-hello", "c2-fail-sum", "c3"]
    protocol = TranscriptProtocol(min_clients=3)
    client = TranscriptClientProtocol()
    pool, stages = _pool(ids, client)
    config = RoundConfig(num_rounds=1, seed=SEED, max_round_attempts=2)
    with pytest.raises(RoundFailed, match=r"stopped the round: 2 client\(s\) left after stage 'sum'"):
        run_rounds(pool, _strategy(len(ids), protocol), initial_parameters(model, SEED), config)
    assert sorted(protocol.rounds) == [(1, 1), (1, 2)]
    assert all(m.fit is None for m in protocol.rounds.values())  # nobody was asked to train
    # each attempt ran the protocol afresh on every client: a machine per (round, attempt, client), the older
    # attempt's dropped when the newer began
    assert sorted(client.started) == sorted((1, a, c) for a in (1, 2) for c in ids)
    assert len(stages) == len(ids)


def test_a_client_without_the_protocol_is_dropped_with_the_reason() -> None:
    pool = InMemoryPool(["a", "b"], lambda cid: stage_task(TaskContext(client_id=cid)), stages=ClientStages([]))
    ins = StageIns(round=1, attempt=1, protocol="transcript", name="hello")
    (reply,) = pool.run({"a": ins}, timeout_s=None)
    assert isinstance(reply, Failure) and reply.stage is Stage.PROTOCOL
    assert "no client side of the round protocol 'transcript'" in reply.reason


def test_a_client_machine_that_answers_another_stage_is_refused() -> None:
    class Wrong:
        name = "wrong"

        def start(self, *, round: int, attempt: int, client_id: str) -> Wrong:
            return self

        def handle(self, instruction: StageIns) -> StageRes:
            return StageRes(client_id="a", round=instruction.round, attempt=1, protocol="wrong", name="other")

    with pytest.raises(ClientTaskError, match="answered stage 'hello' with something else"):
        ClientStages([Wrong()]).handle(StageIns(round=1, attempt=1, protocol="wrong", name="hello"), "a")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"k": True}, "holds a bool"),
        ({"k": 1.5}, "holds a float"),
        ({"k": 1 << 63}, "int of 64 bits"),
        ({"": b""}, "field name"),
        ({"k\n": b""}, "field name"),
        ({"k": b"x" * MAX_STAGE_FIELD_BYTES}, "more than 524288 bytes"),
        ({f"k{i}": 0 for i in range(4097)}, "4097 fields"),
    ],
)
def test_stage_fields_out_of_bounds_are_refused(fields: dict[str, object], match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        StageIns(round=1, attempt=1, protocol="p", name="s", fields=fields)  # type: ignore[arg-type]


def test_stage_names_and_attempts_out_of_bounds_are_refused() -> None:
    with pytest.raises(PayloadError, match="stage name"):
        StageRes(client_id="a", round=1, attempt=1, protocol="p", name="x" * 65)
    with pytest.raises(PayloadError, match="protocol name"):
        StageIns(round=1, attempt=1, protocol="", name="s")
    with pytest.raises(PayloadError, match="attempt must be an int >= 1"):
        StageIns(round=1, attempt=0, protocol="p", name="s")
    StageIns(round=1, attempt=1, protocol="p", name="s", fields={"k": -(1 << 63), "t": "é" * 10, "b": b"\0"})


def test_a_protocol_that_addresses_a_client_outside_the_round_fails_the_attempt() -> None:
    class Stray(TranscriptProtocol):
        def start(self, *, round: int, attempt: int, clients: Sequence[str], seed: int) -> TranscriptServer:
            machine = super().start(round=round, attempt=attempt, clients=[*clients, "stranger"], seed=seed)
            machine.alive = list(clients)
            return machine

    pool, _ = _pool(["a", "b"])
    config = RoundConfig(num_rounds=1, seed=SEED, max_round_attempts=1)
    with pytest.raises(RoundFailed, match=r"addressed 1 client\(s\) not selected for this round at stage 'hello'"):
        run_rounds(pool, _strategy(2, Stray()), initial_parameters(model, SEED), config)
