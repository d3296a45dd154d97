"""Hostile payloads: whatever a client sends, decoding raises PayloadError, never another exception."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from fedcore.errors import PayloadError
from fedcore.payload import open_safetensors
from fedcore.tensors import decode, encode


def payload(header: object, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw)) + raw + body


HOSTILE = {
    "deeply nested header": payload(b"[" * 100_000 + b"]" * 100_000),
    "order metadata not JSON": payload(
        {"__metadata__": {"fedcore.order": "{not json"}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        b"\0\0\0\0",
    ),
    "order metadata deeply nested": payload(
        {
            "__metadata__": {"fedcore.order": "[" * 100_000 + "]" * 100_000},
            "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        },
        b"\0\0\0\0",
    ),
    "order metadata of numbers": payload(
        {"__metadata__": {"fedcore.order": "[1]"}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        b"\0\0\0\0",
    ),
    "unknown dtype": payload({"w": {"dtype": "BF17", "shape": [1], "data_offsets": [0, 2]}}, b"\0\0"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_decode_turns_hostile_payloads_into_payload_errors(name: str) -> None:
    with pytest.raises(PayloadError):
        decode(HOSTILE[name])


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_wire_reader_turns_hostile_payloads_into_payload_errors(name: str, tmp_path: Path) -> None:
    path = tmp_path / "update.safetensors"
    path.write_bytes(HOSTILE[name])
    with pytest.raises(PayloadError):
        open_safetensors(path)


def test_decode_accepts_any_bytes_like_and_refuses_other_types() -> None:
    data = encode({"w": np.arange(3, dtype=np.float32)})
    np.testing.assert_array_equal(decode(memoryview(data))["w"], np.arange(3, dtype=np.float32))
    with pytest.raises(PayloadError, match="must be bytes"):
        decode(None)  # type: ignore[arg-type]


LAYOUT = {
    "two tensors sharing bytes": payload(
        {
            "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "v": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        },
        bytes(8),
    ),
    "a hole before a tensor": payload({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
    "trailing bytes": payload({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12)),
    "fractional shape": payload({"w": {"dtype": "F32", "shape": [2.7], "data_offsets": [0, 8]}}, bytes(8)),
    "string shape": payload({"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, bytes(8)),
}


@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_every_reader_refuses_the_same_malformed_layouts(name: str, tmp_path: Path) -> None:
    """decode, the streaming aggregator and the wire's file reader share one header check."""
    from fedcore.aggregation import WeightedMean
    from fedcore.tensors import TensorSpec

    spec = [TensorSpec("w", (2,), "float32")] + ([TensorSpec("v", (2,), "float32")] if "sharing" in name else [])
    with pytest.raises(PayloadError):
        decode(LAYOUT[name])
    accumulator = WeightedMean(spec)
    with pytest.raises(PayloadError):
        accumulator.add_bytes(LAYOUT[name], 1.0, client_id="c")
    assert accumulator.count == 0
    path = tmp_path / "update.safetensors"
    path.write_bytes(LAYOUT[name])
    with pytest.raises(PayloadError):
        open_safetensors(path)
