"""fedcore.wire: safetensors files without copies, chunked payloads with a SHA-256 trailer, message conversion."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedcore.errors import PayloadError
from fedcore.messages import EvaluateIns, EvaluateRes, Failure, FitIns, FitRes, Stage
from fedcore.payload import framed_sizes, iter_data_chunks, open_safetensors, payload_segments, save_payload
from fedcore.task import FitConfig
from fedcore.tensors import decode
from fedcore.wire import (
    PayloadReceiver,
    instruction_from_header,
    iter_bytes_chunks,
    reply_from_header,
    result_header,
    task_header,
)


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "conv.weight": rng.standard_normal((4, 3, 2), dtype=np.float32),
        "conv.bias": rng.standard_normal(4).astype(np.float64),
        "bn.num_batches_tracked": np.array(7, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "a_first_by_name": np.arange(5, dtype=np.int32),
    }


def test_written_file_is_standard_safetensors_in_model_order(tmp_path: Path) -> None:
    arrays = _arrays()
    written = save_payload(tmp_path / "m.safetensors", arrays, {"round": "3"})
    data = written.path.read_bytes()
    assert written.size == len(data)
    assert written.sha256 == hashlib.sha256(data).digest()
    decoded = decode(data)
    assert list(decoded) == list(arrays)
    for name, array in arrays.items():
        np.testing.assert_array_equal(decoded[name], array)
        assert decoded[name].shape == array.shape
    reference = load_file(str(written.path))
    assert sorted(reference) == sorted(arrays)
    mapped, meta = open_safetensors(written.path)
    assert list(mapped) == list(arrays) and meta == {"round": "3"}
    for name, array in arrays.items():
        np.testing.assert_array_equal(mapped[name], array)
        assert mapped[name].dtype == array.dtype


def test_open_rejects_truncated_file(tmp_path: Path) -> None:
    written = save_payload(tmp_path / "m.safetensors", _arrays())
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(written.path.read_bytes()[:-10])
    with pytest.raises(PayloadError, match="outside"):
        open_safetensors(cut, round=2, client_id="c1")
    cut.write_bytes(b"\xff" * 4)
    with pytest.raises(PayloadError, match="too short"):
        open_safetensors(cut)


def _receive(chunks: list[bytes], announced: int, trailer: bytes | None, limit: int = 1 << 20) -> bytes:
    sink = io.BytesIO()
    receiver = PayloadReceiver(sink, announced=announced, limit=limit, round=4, client_id="client-007")
    for chunk in chunks:
        receiver.write(chunk)
    receiver.finish(trailer)
    return sink.getvalue()


def test_chunks_round_trip_with_digest() -> None:
    payload = bytes(range(256)) * 41
    chunks = list(iter_bytes_chunks(payload, 1000))
    assert max(len(c) for c in chunks) == 1000 and len(chunks) == 11
    assert _receive(chunks, len(payload), hashlib.sha256(payload).digest()) == payload


@pytest.mark.parametrize("chunk_bytes", [1, 7, 100, 1 << 20])
def test_data_chunks_cut_the_payload_exactly_and_frame_it_as_protobuf(chunk_bytes: int) -> None:
    from fedcore.proto.v1 import fedcore_pb2 as pb

    arrays = _arrays()
    arrays["transposed"] = np.arange(12, dtype=np.float32).reshape(3, 4).T  # not C-contiguous
    arrays["big_endian"] = np.arange(3, dtype=">i4")
    segments = payload_segments(arrays)
    chunks = list(iter_data_chunks(segments, chunk_bytes))
    payload = b"".join(bytes(c.payload) for c in chunks)
    assert len(payload) == sum(len(s) for s in segments)
    assert all(len(c.payload) == chunk_bytes for c in chunks[:-1]) and 0 < len(chunks[-1].payload) <= chunk_bytes
    for chunk in chunks[:3]:
        assert chunk.framed == pb.TaskChunk(data=bytes(chunk.payload)).SerializeToString()
    decoded = decode(payload)
    assert list(decoded) == list(arrays)
    for name, array in arrays.items():
        np.testing.assert_array_equal(decoded[name], array)
        assert decoded[name].dtype == array.dtype.newbyteorder("=")


def test_framed_payload_file_holds_the_wire_chunks(tmp_path: Path) -> None:
    arrays = _arrays()
    plain = save_payload(tmp_path / "plain.safetensors", arrays)
    framed = save_payload(tmp_path / "framed.bin", arrays, frame_bytes=100, durable=False)
    body = plain.path.read_bytes()
    assert (framed.size, framed.sha256, framed.frame_bytes) == (len(body), hashlib.sha256(body).digest(), 100)
    expected = b"".join(c.framed for c in iter_data_chunks([memoryview(body)], 100))
    assert framed.path.read_bytes() == expected
    assert [n for n, _ in framed_sizes(framed.size, 100)] == [100] * (len(body) // 100) + [len(body) % 100]
    assert sum(f for _, f in framed_sizes(framed.size, 100)) == len(expected)


def test_truncated_corrupted_and_oversized_payloads_are_rejected_with_context() -> None:
    payload = b"y" * 3000
    digest = hashlib.sha256(payload).digest()
    chunks = list(iter_bytes_chunks(payload, 1000))
    with pytest.raises(PayloadError, match="truncated: 2000 of 3000") as info:
        _receive(chunks[:2], 3000, digest)
    assert info.value.round == 4 and info.value.client_id == "client-007"
    with pytest.raises(PayloadError, match="ended without its trailer"):
        _receive(chunks, 3000, None)
    bad = [chunks[0], b"z" + chunks[1][1:], chunks[2]]
    with pytest.raises(PayloadError, match="SHA-256"):
        _receive(bad, 3000, digest)
    with pytest.raises(PayloadError, match="more than the announced"):
        _receive([*chunks, b"extra"], 3000, digest)
    with pytest.raises(PayloadError, match="exceeds the limit"):
        _receive([], 3000, digest, limit=2999)


def test_instruction_and_reply_conversion() -> None:
    params = _arrays()
    fit = FitIns(round=3, parameters=params, config=FitConfig(local_epochs=2, lr=0.1, mu=0.01), seed=42)
    back = instruction_from_header(task_header(fit, task_id="t1", payload_bytes=10), params)
    assert isinstance(back, FitIns)
    assert (back.round, back.seed, back.config) == (3, 42, fit.config)
    ev = EvaluateIns(round=5, parameters=params, batch_size=77)
    back_ev = instruction_from_header(task_header(ev, task_id="t2", payload_bytes=10), params)
    assert isinstance(back_ev, EvaluateIns) and back_ev.batch_size == 77
    res = FitRes(client_id="ignored", round=3, parameters=params, num_examples=12, metrics={"train_loss": 0.5})
    got = reply_from_header(result_header(res, session="s", task_id="t1"), client_id="client-001", parameters=params)
    assert isinstance(got, FitRes)
    assert (got.client_id, got.round, got.num_examples, dict(got.metrics)) == ("client-001", 3, 12, {"train_loss": 0.5})
    er = EvaluateRes(client_id="x", round=5, loss=0.25, num_examples=9, metrics={"accuracy": 0.75})
    got_ev = reply_from_header(result_header(er, session="s", task_id="t2"), client_id="c", parameters=None)
    assert isinstance(got_ev, EvaluateRes) and got_ev.loss == 0.25 and got_ev.metrics["accuracy"] == 0.75
    fail = Failure(client_id="x", round=5, stage=Stage.EVALUATE, reason="boom")
    got_fail = reply_from_header(result_header(fail, session="s", task_id="t2"), client_id="c", parameters=None)
    assert isinstance(got_fail, Failure) and "boom" in got_fail.reason and got_fail.stage is Stage.EVALUATE


def test_chunk_codec_is_protobuf_compatible_and_copy_free() -> None:
    from fedcore.payload import DataChunk
    from fedcore.proto.v1 import fedcore_pb2 as pb
    from fedcore.wire import BufferSink, chunk_body, parse_result_chunk, parse_task_chunk, serialize_chunk

    for size in (0, 1, 127, 128, 300_000):
        data = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
        chunk = DataChunk.of(memoryview(data))
        raw = serialize_chunk(chunk)
        assert raw is chunk.framed and bytes(chunk.payload) == data
        assert raw == pb.TaskChunk(data=data).SerializeToString() == pb.ResultChunk(data=data).SerializeToString()
        for parse in (parse_task_chunk, parse_result_chunk):
            kind, body = chunk_body(parse(raw))
            assert kind == "data" and bytes(body) == data
    header = pb.TaskChunk(trailer=pb.Trailer(sha256=b"d" * 32))
    parsed = parse_task_chunk(serialize_chunk(header))
    assert chunk_body(parsed)[0] == "trailer" and not isinstance(parsed, memoryview)
    # a data field followed by another field is not taken as a bare data chunk
    twice = pb.TaskChunk(data=b"ab").SerializeToString() + pb.TaskChunk(trailer=pb.Trailer()).SerializeToString()
    assert chunk_body(parse_task_chunk(twice))[0] == "trailer"
    # the receiving buffer is allocated only after the announced size passed the limit
    sink = BufferSink(1 << 40)
    with pytest.raises(PayloadError, match="exceeds the limit"):
        PayloadReceiver(sink, announced=1 << 40, limit=1 << 20)
    payload = b"q" * 5000
    sink = BufferSink(len(payload))
    with PayloadReceiver(sink, announced=len(payload), limit=len(payload)) as receiver:
        for i in range(0, len(payload), 999):
            receiver.write(memoryview(payload)[i : i + 999])
        receiver.finish(hashlib.sha256(payload).digest())
    assert bytes(sink.buffer) == payload


def test_a_stray_message_inside_a_payload_is_rejected() -> None:
    from fedcore.proto.v1 import fedcore_pb2 as pb

    payload = b"q" * 300
    stream = [
        pb.ResultChunk(data=payload[:100]),
        pb.ResultChunk(header=pb.ResultHeader(task_id="again")),
        pb.ResultChunk(data=payload[100:]),
        pb.ResultChunk(trailer=pb.Trailer(sha256=hashlib.sha256(payload).digest())),
    ]
    with (
        PayloadReceiver(io.BytesIO(), announced=300, limit=1000, round=2, client_id="c") as receiver,
        pytest.raises(PayloadError, match="unexpected header message inside a payload"),
    ):
        receiver.read_until_trailer(iter(stream))
    receiver = PayloadReceiver(io.BytesIO(), announced=300, limit=1000)
    assert receiver.read_until_trailer(iter([stream[0], stream[2], stream[3]])) == stream[3].trailer.sha256
    receiver.finish(stream[3].trailer.sha256)
