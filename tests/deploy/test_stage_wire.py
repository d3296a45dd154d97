"""Stage messages at the gRPC edge: protobuf round trips, and a stage exchange through the real service on
127.0.0.1 (tensors both ways, a reply to another stage refused, a reply without tensors taken)."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest

from fedcore.errors import PayloadError
from fedcore.messages import Failure, StageIns, StageRes, StageValue
from fedcore.payload import payload_segments
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.wire import (
    instruction_from_header,
    iter_bytes_chunks,
    reply_from_header,
    result_header,
    session_metadata,
    task_header,
)
from tests.deploy.test_service import Harness, _pull

pytestmark = pytest.mark.timeout(60)

FIELDS: dict[str, StageValue] = {
    "key": b"\x00\xffpk",
    "count": -(1 << 63),
    "big": (1 << 63) - 1,
    "label": "grüße",
    "empty": b"",
}


def test_a_stage_instruction_and_reply_survive_the_protobuf_round_trip() -> None:
    tensors = {"masked": np.arange(5, dtype=np.uint32), "x": np.ones((2, 2), np.float32)}
    ins = StageIns(round=3, attempt=2, protocol="p", name="share_keys", fields=FIELDS, tensors=tensors)
    header = pb.TaskHeader.FromString(task_header(ins, task_id="t", payload_bytes=9).SerializeToString())
    assert header.stage == pb.STAGE_PROTOCOL and header.payload_bytes == 9
    back = instruction_from_header(header, tensors)
    assert isinstance(back, StageIns)
    assert (back.round, back.attempt, back.protocol, back.name) == (3, 2, "p", "share_keys")
    assert dict(back.fields) == FIELDS and all(type(back.fields[k]) is type(v) for k, v in FIELDS.items())
    assert back.tensors is tensors

    res = StageRes(client_id="me", round=3, attempt=2, protocol="p", name="share_keys", fields=FIELDS)
    pushed = pb.ResultHeader.FromString(result_header(res, session="s", task_id="t").SerializeToString())
    reply = reply_from_header(pushed, client_id="from-session", parameters=None)
    assert isinstance(reply, StageRes) and reply.client_id == "from-session" and dict(reply.tensors) == {}
    assert dict(reply.fields) == FIELDS and (reply.round, reply.attempt, reply.name) == (3, 2, "share_keys")


def test_stage_fields_out_of_bounds_from_the_wire_are_refused() -> None:
    header = pb.ResultHeader(round=1, stage=pb.STAGE_PROTOCOL)
    header.protocol_stage.protocol, header.protocol_stage.name, header.protocol_stage.attempt = "p", "s", 1
    header.protocol_stage.fields["bad\nname"].int_value = 1
    with pytest.raises(PayloadError, match="field name"):
        reply_from_header(header, client_id="c", parameters=None)
    header.protocol_stage.attempt = 0
    with pytest.raises(PayloadError):
        reply_from_header(header, client_id="c", parameters=None)


def _push_stage(harness: Harness, session: str, header: pb.TaskHeader, reply: StageRes) -> pb.PushReply:
    segments = payload_segments(reply.tensors) if reply.tensors else []
    payload = b"".join(bytes(s) for s in segments)
    first = result_header(reply, session=session, task_id=header.task_id, payload_bytes=len(payload))

    def stream():  # type: ignore[no-untyped-def]
        yield pb.ResultChunk(header=first)
        if payload:
            for piece in iter_bytes_chunks(payload, 1024):
                yield pb.ResultChunk(data=piece)
            yield pb.ResultChunk(trailer=pb.Trailer(sha256=hashlib.sha256(payload).digest()))

    return harness.stub().PushResult(stream(), metadata=session_metadata(session))


def test_a_stage_exchange_through_the_service_carries_fields_and_tensors_both_ways(tmp_path: Path) -> None:
    harness = Harness(
        tmp_path, max_payload_bytes=1 << 16, chunk_bytes=1024, heartbeat_interval_s=0.2, liveness_timeout_s=5.0
    )
    try:
        stub = harness.stub()
        sessions = {cid: stub.Join(pb.JoinRequest(client_id=cid)).session for cid in ("a", "b", "c")}
        sent = {
            cid: StageIns(
                round=1,
                attempt=1,
                protocol="p",
                name="collect",
                fields={"who": cid},
                tensors={"v": np.full(3, i + 1, np.int64)},
            )
            for i, cid in enumerate(sessions)
        }
        replies: list[object] = []
        runner = threading.Thread(target=lambda: replies.extend(harness.pool.run(sent, timeout_s=20)))
        runner.start()
        answers = {}
        for cid, session in sessions.items():
            header, tensors = _pull(stub, session)
            received = instruction_from_header(header, tensors)
            assert isinstance(received, StageIns) and received.fields == {"who": cid}
            np.testing.assert_array_equal(received.tensors["v"], sent[cid].tensors["v"])
            if cid == "a":  # answers with tensors
                out = StageRes(
                    client_id=cid, round=1, attempt=1, protocol="p", name="collect", tensors={"w": 2 * tensors["v"]}
                )
            elif cid == "b":  # answers another stage: refused at the edge
                out = StageRes(client_id=cid, round=1, attempt=1, protocol="p", name="unmask")
            else:  # fields only, no payload
                out = StageRes(client_id=cid, round=1, attempt=1, protocol="p", name="collect", fields={"n": 7})
            answers[cid] = _push_stage(harness, session, header, out)
        runner.join(20)
        assert answers["a"].accepted and answers["c"].accepted
        assert not answers["b"].accepted and "answers stage 'unmask'" in answers["b"].reason
        got = {r.client_id: r for r in replies}  # type: ignore[attr-defined]
        assert isinstance(got["a"], StageRes) and isinstance(got["c"], StageRes) and isinstance(got["b"], Failure)
        np.testing.assert_array_equal(got["a"].tensors["w"], [2, 2, 2])
        assert dict(got["c"].fields) == {"n": 7} and dict(got["c"].tensors) == {}
        assert list((tmp_path / "spill").iterdir()) == []  # payload files and spilled replies are gone
    finally:
        harness.close()
