"""fedcore.tensors: the safetensors codec round-trips and rejects malformed or mismatched payloads."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fedcore.errors import NonFiniteError, PayloadError
from fedcore.tensors import NamedArrays, TensorSpec, check_finite, check_spec, decode, encode, read_metadata, spec_of


def _model() -> dict[str, np.ndarray]:
    # deliberately not in alphabetical order: the codec must keep the insertion order
    return {
        "z.weight": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
        "a.bias": np.array([1.0 / 3, -2.5], np.float64),
        "m.num_batches_tracked": np.array(12345678901, np.int64),
        "b.half": np.array([0.5, -1.25, 65504.0], np.float16),
    }


def _rewrite_header(payload: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    (n,) = struct.unpack("<Q", payload[:8])
    header = json.loads(payload[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw + payload[8 + n :]


def test_round_trip_keeps_order_dtypes_and_values() -> None:
    model = _model()
    out = decode(encode(model, metadata={"round": "3"}))
    assert list(out) == list(model)
    for name, array in model.items():
        assert out[name].dtype == array.dtype and out[name].shape == array.shape
        assert np.array_equal(out[name], array)
    assert out["m.num_batches_tracked"] == 12345678901
    assert read_metadata(encode(model, metadata={"round": "3"})) == {"round": "3"}
    # with an expected spec the result follows the spec's order
    spec = tuple(reversed(spec_of(model)))
    assert list(decode(encode(model), spec)) == [s.name for s in spec]


def test_decoded_arrays_are_writable() -> None:
    out = decode(encode(_model()))
    out["z.weight"] += 1


def test_decode_without_copy_shares_a_writable_buffer_and_copies_what_it_must() -> None:
    from fedcore.payload import payload_segments

    model = _model()
    buffer = bytearray(encode(model))
    raw = np.frombuffer(buffer, np.uint8)
    shared = decode(buffer, copy=False)
    for name, array in model.items():
        assert np.array_equal(shared[name], array) and shared[name].flags.writeable
        assert np.shares_memory(shared[name], raw)
    # read-only bytes cannot be shared: writable copies
    copied = decode(bytes(buffer), copy=False)
    assert all(a.flags.writeable and not np.shares_memory(a, raw) for a in copied.values())
    # a float32 tensor right after 3 bytes of int8 is misaligned in the buffer: copied, values intact
    odd: NamedArrays = {"i8": np.array([1, 2, 3], np.int8), "f32": np.array([0.5, -2.0], np.float32)}
    misaligned = bytearray(b"".join(bytes(s) for s in payload_segments(odd)))
    out = decode(misaligned, copy=False)
    assert np.shares_memory(out["i8"], np.frombuffer(misaligned, np.uint8))
    assert (
        not np.shares_memory(out["f32"], np.frombuffer(misaligned, np.uint8))
        and out["f32"].flags.aligned
        and np.array_equal(out["f32"], odd["f32"])
    )


def test_truncated_and_garbage_bytes() -> None:
    payload = encode(_model())
    for data in (payload[:-1], payload[: len(payload) // 2], payload[:5], b""):
        with pytest.raises(PayloadError):
            decode(data)
    with pytest.raises(PayloadError, match="JSON"):
        decode(struct.pack("<Q", 4) + b"\xff\xfe{]" + b"\x00" * 16)
    with pytest.raises(PayloadError):
        decode(b"\x00" * 3 + b"garbage garbage garbage")


def test_spec_mismatches_name_the_tensor() -> None:
    model = _model()
    spec = spec_of(model)
    renamed = dict(model)
    renamed["z.weights"] = renamed.pop("z.weight")
    with pytest.raises(PayloadError, match=r"missing \['z.weight'\].*unexpected \['z.weights'\]"):
        decode(encode(renamed), spec, client_id="c1")
    reshaped = dict(model, **{"z.weight": model["z.weight"].reshape(3, 2)})
    with pytest.raises(PayloadError, match=r"'z.weight' has shape \(3, 2\), expected \(2, 3\)"):
        decode(encode(reshaped), spec)
    retyped = dict(model, **{"a.bias": model["a.bias"].astype(np.float32)})
    with pytest.raises(PayloadError, match=r"'a\.bias' has dtype float32, expected float64"):
        decode(encode(retyped), spec)
    with pytest.raises(PayloadError) as info:
        decode(encode(renamed), spec, client_id="c1", round=2)
    assert info.value.client_id == "c1" and "client 'c1'" in str(info.value)


def test_header_rename_is_caught_against_spec() -> None:
    payload = _rewrite_header(encode(_model()), lambda h: h.__setitem__("evil", h.pop("a.bias")))
    with pytest.raises(PayloadError, match=r"a\.bias"):
        decode(payload, spec_of(_model()))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nonfinite_values_rejected_naming_tensor(bad: float, dtype: type[np.floating]) -> None:
    model = _model()
    w = np.ones(4, dtype)
    w[2] = bad
    model["layer.w"] = w
    with pytest.raises(NonFiniteError, match=r"'layer\.w' holds 1 NaN/Inf"):
        decode(encode(model))
    assert np.isnan(decode(encode(model), allow_nonfinite=True)["layer.w"][2]) == np.isnan(bad)


def test_check_helpers() -> None:
    spec = (TensorSpec("w", (2,), "float32"),)
    check_spec({"w": np.zeros(2, np.float32)}, spec)
    with pytest.raises(PayloadError, match="'w' has shape"):
        check_spec({"w": np.zeros(3, np.float32)}, spec)
    check_finite({"i": np.array([1, 2]), "f": np.zeros(2)})
    with pytest.raises(NonFiniteError, match="'f'"):
        check_finite({"f": np.array([np.nan])})
