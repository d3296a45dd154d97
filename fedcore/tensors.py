"""Named tensors: a model's state as an ordered mapping ``name -> numpy array``, and its safetensors codec.

A :data:`NamedArrays` value is a plain ``dict[str, np.ndarray]`` whose insertion order is the model's
parameter order (as in ``torch.nn.Module.state_dict()``). On the wire and on disk it travels as
safetensors bytes (no pickle), with the order kept in the header metadata.

Decoding validates: a payload that is truncated, corrupt, or whose names, shapes or dtypes differ from the
expected :class:`TensorSpec` list, or that holds NaN/Inf, raises :class:`~fedcore.errors.PayloadError`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as _st_load
from safetensors.numpy import save as _st_save

from fedcore.errors import NonFiniteError, PayloadError

NamedArrays = dict[str, np.ndarray]
"""Ordered ``name -> array`` mapping; insertion order is the parameter order."""

_ORDER_KEY = "fedcore.order"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, shape and dtype of one tensor of a model.

    Attributes:
        name: the parameter name (``state_dict`` key).
        shape: the tensor shape.
        dtype: numpy dtype string, e.g. ``"float32"``, ``"int64"``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str


def spec_of(arrays: Mapping[str, np.ndarray]) -> tuple[TensorSpec, ...]:
    """Return the ordered specs (name, shape, dtype) of ``arrays``."""
    return tuple(TensorSpec(n, tuple(int(d) for d in a.shape), a.dtype.name) for n, a in arrays.items())


def num_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Total payload size of ``arrays`` in bytes."""
    return sum(int(a.nbytes) for a in arrays.values())


def check_finite(
    arrays: Mapping[str, np.ndarray],
    *,
    round: int | None = None,
    client_id: str | None = None,
) -> None:
    """Raise :class:`NonFiniteError` naming the first tensor that holds NaN or Inf.

    Integer and boolean tensors are always finite and are skipped.
    """
    for name, array in arrays.items():
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
            raise NonFiniteError(
                f"tensor {name!r} holds {bad} NaN/Inf value(s); the update is rejected. "
                "Check the client's learning rate and input data.",
                round=round,
                client_id=client_id,
            )


def check_spec(
    arrays: Mapping[str, np.ndarray],
    expected: Sequence[TensorSpec],
    *,
    round: int | None = None,
    client_id: str | None = None,
) -> None:
    """Raise :class:`PayloadError` unless ``arrays`` has exactly the names, shapes and dtypes of ``expected``.

    The message lists missing and unexpected names, or the first shape/dtype mismatch.
    """
    want = {s.name: s for s in expected}
    missing = [n for n in want if n not in arrays]
    extra = [n for n in arrays if n not in want]
    if missing or extra:
        raise PayloadError(
            f"tensor names do not match the global model: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}. "
            "The client must train the same model architecture as the server.",
            round=round,
            client_id=client_id,
        )
    for name, spec in want.items():
        array = arrays[name]
        if tuple(array.shape) != spec.shape:
            raise PayloadError(
                f"tensor {name!r} has shape {tuple(array.shape)}, expected {spec.shape}.",
                round=round,
                client_id=client_id,
            )
        if array.dtype.name != spec.dtype:
            raise PayloadError(
                f"tensor {name!r} has dtype {array.dtype.name}, expected {spec.dtype}.",
                round=round,
                client_id=client_id,
            )


def encode(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize ``arrays`` to safetensors bytes, keeping their order in the header metadata.

    Args:
        arrays: ordered ``name -> array``; any numpy dtype safetensors supports.
        metadata: extra string key/values stored in the header.

    Returns:
        The safetensors payload (8-byte header length, JSON header, raw little-endian data).

    Raises:
        PayloadError: a name is reserved or a dtype is unsupported.
    """
    meta = dict(metadata or {})
    if _ORDER_KEY in meta:
        raise PayloadError(f"metadata key {_ORDER_KEY!r} is reserved")
    meta[_ORDER_KEY] = json.dumps(list(arrays))
    try:
        return bytes(_st_save({n: np.require(a, requirements="C") for n, a in arrays.items()}, metadata=meta))
    except (SafetensorError, ValueError, TypeError) as exc:
        raise PayloadError(f"cannot encode tensors as safetensors: {exc}") from exc


def read_metadata(data: bytes) -> dict[str, str]:
    """Return the user metadata of a safetensors payload (without fedcore's own keys).

    Raises:
        PayloadError: the header is truncated or not valid JSON.
    """
    header = _read_header(data)
    raw = header.get("__metadata__") or {}
    if not isinstance(raw, dict):
        raise PayloadError("safetensors metadata is not a JSON object (corrupted payload)")
    return {str(k): str(v) for k, v in raw.items() if k != _ORDER_KEY}


def _read_header(data: bytes) -> dict[str, object]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PayloadError(f"a payload must be bytes, got {type(data).__name__}")
    if len(data) < 8:
        raise PayloadError(f"payload of {len(data)} bytes is too short to be safetensors (truncated?)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise PayloadError(
            f"safetensors header claims {header_len} bytes but only {len(data) - 8} follow (truncated payload)"
        )
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PayloadError(f"safetensors header is not valid JSON (corrupted payload): {exc}") from exc
    if not isinstance(header, dict):
        raise PayloadError("safetensors header is not a JSON object (corrupted payload)")
    return header


def decode(
    data: bytes,
    expected: Sequence[TensorSpec] | None = None,
    *,
    allow_nonfinite: bool = False,
    round: int | None = None,
    client_id: str | None = None,
) -> NamedArrays:
    """Parse safetensors bytes into ordered named arrays and validate them.

    Args:
        data: a payload produced by :func:`encode` (or any safetensors file).
        expected: if given, the names, shapes and dtypes the payload must have; the result follows its order.
        allow_nonfinite: accept NaN/Inf values (off by default: updates with them are rejected).
        round, client_id: context for error messages.

    Returns:
        ``name -> array``, writable arrays in the order of ``expected`` (or the encoder's order).

    Raises:
        PayloadError: truncated or corrupted bytes; names, shapes or dtypes differ from ``expected``.
        NonFiniteError: a floating tensor holds NaN or Inf and ``allow_nonfinite`` is false.
    """
    header = _read_header(data)
    try:
        loaded = _st_load(bytes(data))
    except (SafetensorError, ValueError, TypeError, OverflowError, KeyError, RecursionError) as exc:
        raise PayloadError(
            f"payload is not valid safetensors (truncated or corrupted): {exc}", round=round, client_id=client_id
        ) from exc
    if expected is not None:
        order = [s.name for s in expected]
    else:
        meta = header.get("__metadata__") or {}
        raw = meta.get(_ORDER_KEY) if isinstance(meta, dict) else None
        try:
            order = json.loads(raw) if isinstance(raw, str) else sorted(loaded)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise PayloadError(f"payload's recorded tensor order is not valid JSON (corrupted payload): {exc}") from exc
        if not isinstance(order, list) or not all(isinstance(n, str) for n in order) or sorted(order) != sorted(loaded):
            raise PayloadError("payload's recorded tensor order does not match its tensors (corrupted payload)")
    arrays: NamedArrays = {}
    for name in order:
        if name in loaded:
            arrays[name] = loaded[name]
    for name in loaded:
        arrays.setdefault(name, loaded[name])
    if expected is not None:
        check_spec(arrays, expected, round=round, client_id=client_id)
    if not allow_nonfinite:
        check_finite(arrays, round=round, client_id=client_id)
    return arrays


def from_state_dict(state: Mapping[str, object]) -> NamedArrays:
    """Convert a ``torch`` state dict to named numpy arrays (detached copies on the CPU).

    bfloat16 tensors, which numpy cannot hold, are rejected with a clear error.
    """
    import torch

    arrays: NamedArrays = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise PayloadError(f"state entry {name!r} is a {type(value).__name__}, not a tensor")
        if value.dtype == torch.bfloat16:
            raise PayloadError(
                f"tensor {name!r} is bfloat16, which numpy cannot represent; keep master weights in float32"
            )
        arrays[name] = value.detach().cpu().numpy().copy()
    return arrays


def to_state_dict(arrays: Mapping[str, np.ndarray]) -> dict[str, object]:
    """Convert named numpy arrays to a ``torch`` state dict (tensors share memory with the arrays)."""
    import torch

    # np.require keeps 0-d tensors 0-d (np.ascontiguousarray would make them 1-d)
    return {name: torch.from_numpy(np.require(a, requirements="C")) for name, a in arrays.items()}
