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
from typing import TYPE_CHECKING

import numpy as np

from fedcore.errors import ModelMismatch, NonFiniteError, PayloadError

if TYPE_CHECKING:  # for the annotations only: importing this module does not import torch (to_state_dict does)
    import torch

NamedArrays = dict[str, np.ndarray]
"""Ordered ``name -> array`` mapping; insertion order is the parameter order."""

ORDER_KEY = "fedcore.order"
"""Header metadata key holding the tensor order (safetensors itself does not keep it)."""


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


def state_spec(state: Mapping[str, object]) -> tuple[TensorSpec, ...]:
    """The ordered specs of a ``torch`` state dict, read from the tensors' metadata (no copy of the data).

    Equals ``spec_of(from_state_dict(state))`` for the dtypes numpy can hold.
    """
    import torch

    specs = []
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise PayloadError(f"state entry {name!r} is a {type(value).__name__}, not a tensor")
        specs.append(TensorSpec(name, tuple(int(d) for d in value.shape), str(value.dtype).removeprefix("torch.")))
    return tuple(specs)


def num_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Total payload size of ``arrays`` in bytes."""
    return sum(int(a.nbytes) for a in arrays.values())


_FINITE_BLOCK = 1 << 20


def _all_finite(array: np.ndarray) -> bool:
    flat = np.ravel(array)  # a view for contiguous arrays
    return all(bool(np.isfinite(flat[i : i + _FINITE_BLOCK]).all()) for i in range(0, flat.size, _FINITE_BLOCK))


NON_FINITE_WORDS = "NaN/Inf value(s)"
"""The words every :func:`check_finite` message holds (and so a client's :class:`~fedcore.messages.Failure` reason
for such an update: :func:`fedcore.messages.non_finite_update`)."""

UPDATE_ADVICE = "the update is rejected. Check the client's learning rate and input data."
""":func:`check_finite`'s advice by default: for a client's update."""


def check_finite(
    arrays: Mapping[str, np.ndarray],
    *,
    round: int | None = None,
    client_id: str | None = None,
    advice: str = UPDATE_ADVICE,
) -> None:
    """Raise :class:`NonFiniteError` naming the first tensor that holds NaN or Inf, followed by ``advice`` (what
    happens and what to do; by default, for a client's update).

    Integer and boolean tensors are always finite and are skipped. Large tensors are checked in blocks of
    ``_FINITE_BLOCK`` elements, so the check needs no temporary the size of the model.
    """
    for name, array in arrays.items():
        if array.dtype.kind in "fc" and not _all_finite(array):
            bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
            raise NonFiniteError(
                f"tensor {name!r} holds {bad} {NON_FINITE_WORDS}; {advice}",
                round=round,
                client_id=client_id,
            )


SAME_MODEL = (
    "The client must train the same model architecture as the server (client daemons: start them with the server's "
    "--task and --task-option values)."
)
"""The advice of :func:`check_spec`'s name and shape mismatches."""


LOCAL_MODEL = (
    "This client's task builds another model than the server's: start the daemon with the server's --task and "
    "--task-option values."
)
"""The advice of :func:`check_spec`'s mismatches for a global model a client received."""


def check_spec(
    arrays: Mapping[str, np.ndarray],
    expected: Sequence[TensorSpec],
    *,
    round: int | None = None,
    client_id: str | None = None,
    received_global: bool = False,
) -> None:
    """Raise :class:`PayloadError` unless ``arrays`` has exactly the names, shapes and dtypes of ``expected``.

    The message lists missing and unexpected names, or the first shape/dtype mismatch. By default ``arrays`` is a
    client's update, checked against the global model (``expected``). With ``received_global``, ``arrays`` is the
    global model a client received, checked against the client's own model, and the error is a
    :class:`ModelMismatch` that names each side.
    """
    want = {s.name: s for s in expected}
    error = ModelMismatch if received_global else PayloadError
    missing, extra = _name_differences(arrays, want)
    if missing or extra:  # missing: only ``expected`` has them (the client's model, for a received global model)
        raise error(
            f"the global model from the server does not fit this client's model: only the global model has "
            f"{_names(extra)}, only this client's model has {_names(missing)}. {LOCAL_MODEL}"
            if received_global
            else f"tensor names do not match the global model: missing {_names(missing)}, unexpected "
            f"{_names(extra)}. {SAME_MODEL}",
            round=round,
            client_id=client_id,
        )
    for name, spec in want.items():
        array = arrays[name]
        for what, got, wanted in (("shape", tuple(array.shape), spec.shape), ("dtype", array.dtype.name, spec.dtype)):
            if got == wanted:
                continue
            if received_global:
                message = (
                    f"tensor {_name(name)} has {what} {got} in the global model from the server, {wanted} in this "
                    f"client's model. {LOCAL_MODEL}"
                )
            else:  # an update of another dtype is the client's cast, not another model
                advice = f" {SAME_MODEL}" if what == "shape" else ""
                message = f"tensor {_name(name)} has {what} {got}, expected {wanted}.{advice}"
            raise error(message, round=round, client_id=client_id)


#: safetensors dtype codes (the format's specification) and the little-endian numpy dtypes fedcore maps them to.
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lies in a safetensors body: dtype, shape and byte offsets ``[start, end)``."""

    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


_MAX_DIMS = 64  # numpy's limit on array dimensions (numpy >= 2)

MAX_HEADER_BYTES = 8 << 20
"""Largest safetensors JSON header read (8 MiB: about 40,000 tensors). A header is parsed into Python objects
many times its size, so a payload cannot make a reader take unbounded memory with a huge, repetitive header."""


def _header_size_problem(header_len: int) -> str:
    """Why a header of ``header_len`` bytes is not read ("" when it is read)."""
    if header_len <= MAX_HEADER_BYTES:
        return ""
    return (
        f"safetensors header of {header_len} bytes exceeds the {MAX_HEADER_BYTES} bytes fedcore reads (about 40,000 "
        "tensors); the payload is refused unread"
    )


def name_mismatch(arrays: Mapping[str, object], expected: Mapping[str, object] | Sequence[str]) -> str | None:
    """``"missing [...], unexpected [...]"`` (at most 5 names each, each bounded for an error message) when the
    names of ``arrays`` differ from ``expected``'s (a mapping's keys, or a sequence of names), else None."""
    missing, extra = _name_differences(arrays, expected)
    if not missing and not extra:
        return None
    return f"missing {_names(missing)}, unexpected {_names(extra)}"


def _name_differences(
    arrays: Mapping[str, object], expected: Mapping[str, object] | Sequence[str]
) -> tuple[list[str], list[str]]:
    """The names ``expected`` has and ``arrays`` lacks, and those ``arrays`` has and ``expected`` lacks."""
    return [n for n in expected if n not in arrays], [n for n in arrays if n not in expected]


def _names(names: Sequence[str]) -> str:
    return "[" + ", ".join(_name(n) for n in names[:5]) + "]" + (" ..." if len(names) > 5 else "")


def _name(name: str) -> str:
    """A tensor name from a payload, bounded for an error message."""
    return repr(name) if len(name) <= 120 else f"{name[:120]!r}... ({len(name)} characters)"


def _fits_in_memory(shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether numpy can build an array of ``shape``: the byte size, with zero-length dimensions counted as 1
    (numpy refuses ``(0, 2**64)`` as well), stays below ``2**63``."""
    size = itemsize
    for dim in shape:
        size *= max(dim, 1)
        if size >= 1 << 63:
            return False
    return True


def _short(shape: tuple[int, ...]) -> str:
    return str(list(shape)) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ...] ({len(shape)} dims)"


def parse_header(
    header_json: bytes,
    body_len: int,
    *,
    round: int | None = None,
    client_id: str | None = None,
    require_order: bool = True,
) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Validate a safetensors header strictly and return its tensors (in recorded order) and user metadata.

    The one header check shared by every reader (:func:`decode`, the streaming aggregator, the wire's file
    reader), so that they all accept exactly the same payloads: a JSON object; string metadata; for each tensor a
    known dtype, a shape of non-negative integers and integer data offsets whose length matches the shape; and,
    as the format requires, tensors that tile the body exactly (no overlap, no hole, no trailing bytes).

    Args:
        header_json: the header bytes (after the 8-byte length prefix).
        body_len: the number of bytes after the header.
        round, client_id: context for error messages.
        require_order: the recorded tensor order must name exactly the tensors present; when false (the caller
            orders by an expected spec and reports name mismatches itself) a stale order is ignored.

    Raises:
        PayloadError: anything malformed, naming the tensor.
    """

    def fail(message: str) -> PayloadError:
        return PayloadError(message, round=round, client_id=client_id, stage="decode")

    if _header_size_problem(len(header_json)):
        raise fail(_header_size_problem(len(header_json)))
    try:
        header = json.loads(bytes(header_json))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise fail(f"safetensors header is not valid JSON (corrupted payload): {exc}") from exc
    if not isinstance(header, dict):
        raise fail("safetensors header is not a JSON object (corrupted payload)")
    raw_meta = header.pop("__metadata__", None) or {}
    if not isinstance(raw_meta, dict) or not all(isinstance(v, str) for v in raw_meta.values()):
        raise fail("safetensors metadata is not an object of strings (corrupted payload)")
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
            shape_raw, offsets = info["shape"], info["data_offsets"]
            if not isinstance(shape_raw, list) or not isinstance(offsets, list) or len(offsets) != 2:
                raise TypeError("shape and data_offsets must be lists")
            if not all(type(v) is int for v in [*shape_raw, *offsets]):
                raise TypeError("shape and data_offsets must hold integers")
        except (KeyError, TypeError) as exc:
            shown = repr(info)
            shown = shown if len(shown) <= 200 else f"{shown[:200]}... ({len(shown)} characters)"
            raise fail(f"tensor {_name(name)} has an invalid or unsupported header entry {shown}") from exc
        shape, (start, end) = tuple(shape_raw), offsets
        if min(shape, default=0) < 0 or not 0 <= start <= end <= body_len:
            raise fail(
                f"tensor {_name(name)} has data offsets {start}..{end} outside the {body_len}-byte body (truncated)"
            )
        if len(shape) > _MAX_DIMS or not _fits_in_memory(shape, dtype.itemsize):
            raise fail(
                f"tensor {_name(name)} has shape {_short(shape)}, which no array can have (at most {_MAX_DIMS} "
                "dimensions and fewer than 2**63 bytes, counting zero-length dimensions as 1)"
            )
        if end - start != int(np.prod(shape, dtype=object)) * dtype.itemsize:
            raise fail(f"tensor {_name(name)}: {end - start} bytes do not hold shape {shape} of {dtype.name}")
        entries[name] = TensorEntry(dtype, shape, start, end)
    position = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].end)):
        if entry.start != position:
            what = "overlaps the previous tensor" if entry.start < position else "leaves a gap before it"
            raise fail(f"tensor {_name(name)} at byte {entry.start} {what} (corrupted payload)")
        position = entry.end
    if position != body_len:
        raise fail(f"{body_len - position} bytes after the last tensor (corrupted payload)")
    order_raw = raw_meta.get(ORDER_KEY)
    try:
        order = json.loads(order_raw) if isinstance(order_raw, str) else sorted(entries)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise fail(f"payload's recorded tensor order is not valid JSON (corrupted payload): {exc}") from exc
    if not isinstance(order, list) or not all(isinstance(n, str) for n in order) or sorted(order) != sorted(entries):
        if require_order:
            raise fail("payload's recorded tensor order does not match its tensors (corrupted payload)")
        order = sorted(entries)
    metadata = {str(k): v for k, v in raw_meta.items() if k != ORDER_KEY}
    return {n: entries[n] for n in order}, metadata


# numpy dtype name -> safetensors dtype code (the inverse of SAFETENSORS_DTYPES)
_TO_ST = {name: code for code, name in SAFETENSORS_DTYPES.items()}
_HEADER_ALIGN = 8


def safetensors_header(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length prefix plus the (space-padded) JSON header for ``arrays`` laid out in their order.

    The same arrays and metadata always give the same bytes: the metadata keys are written sorted (safetensors'
    own writer orders them by a hash map, which differs from run to run), the tensors in the order given.

    Raises:
        PayloadError: a dtype safetensors cannot hold, or ``metadata`` sets fedcore's reserved order key.
    """
    if metadata is not None and ORDER_KEY in metadata:
        raise PayloadError(f"metadata key {ORDER_KEY!r} is reserved")
    meta = dict(metadata or {})
    meta[ORDER_KEY] = json.dumps(list(arrays))
    header: dict[str, object] = {"__metadata__": {key: meta[key] for key in sorted(meta)}}
    offset = 0
    for name, array in arrays.items():
        code = _TO_ST.get(array.dtype.name)
        if code is None:
            raise PayloadError(f"tensor {name!r} has dtype {array.dtype.name}, which safetensors cannot hold")
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += int(array.nbytes)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % _HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


def raw_bytes(array: np.ndarray) -> memoryview:
    """The little-endian C-order bytes of ``array`` as a flat byte view (a copy only when the layout needs one)."""
    flat = np.require(array, requirements="C").reshape(-1)
    if flat.dtype.byteorder == ">":
        flat = flat.astype(flat.dtype.newbyteorder("<"))
    return flat.view(np.uint8).data if flat.size else memoryview(b"")


def encode(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize ``arrays`` to safetensors bytes, keeping their order in the header metadata.

    Args:
        arrays: ordered ``name -> array``; any numpy dtype safetensors supports.
        metadata: extra string key/values stored in the header.

    Returns:
        The safetensors payload (8-byte header length, JSON header, raw little-endian data), laid out by
        :func:`safetensors_header`: the same arrays and metadata always give the same bytes.

    Raises:
        PayloadError: a name is reserved or a dtype is unsupported.
    """
    return b"".join([safetensors_header(arrays, metadata), *(raw_bytes(a) for a in arrays.values())])


def read_metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """Return the user metadata of a safetensors payload (without fedcore's own keys).

    Raises:
        PayloadError: the payload is truncated or its header is malformed.
    """
    header_json, body_len, _ = split_payload(data)
    return parse_header(header_json, body_len)[1]


def split_payload(
    data: bytes | bytearray | memoryview, *, round: int | None = None, client_id: str | None = None
) -> tuple[bytes, int, int]:
    """``(header bytes, body length, body offset)`` of a safetensors payload, checking the length prefix.

    Raises:
        PayloadError: not bytes-like, or shorter than its length prefix says.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PayloadError(f"a payload must be bytes, got {type(data).__name__}", round=round, client_id=client_id)
    if len(data) < 8:
        message = f"payload of {len(data)} bytes is too short to be safetensors (truncated?)"
        raise PayloadError(message, round=round, client_id=client_id)
    (header_len,) = struct.unpack("<Q", bytes(data[:8]))
    if _header_size_problem(header_len):
        raise PayloadError(_header_size_problem(header_len), round=round, client_id=client_id)
    if header_len > len(data) - 8:
        raise PayloadError(
            f"safetensors header claims {header_len} bytes but only {len(data) - 8} follow (truncated payload)",
            round=round,
            client_id=client_id,
        )
    return bytes(data[8 : 8 + header_len]), len(data) - 8 - header_len, 8 + header_len


def decode(
    data: bytes | bytearray | memoryview,
    expected: Sequence[TensorSpec] | None = None,
    *,
    allow_nonfinite: bool = False,
    copy: bool = True,
    round: int | None = None,
    client_id: str | None = None,
) -> NamedArrays:
    """Parse safetensors bytes into ordered named arrays and validate them.

    Args:
        data: a payload produced by :func:`encode` (or any safetensors file), as any bytes-like object.
        expected: if given, the names, shapes and dtypes the payload must have; the result follows its order.
        allow_nonfinite: accept NaN/Inf values (off by default: updates with them are rejected).
        copy: False to return arrays that share memory with ``data`` where they can (``data`` writable, e.g. a
            ``bytearray``; the tensor aligned for its dtype; native byte order), which saves copying the whole
            payload once more; ``data`` must then stay unchanged for as long as the arrays are used. Arrays that
            cannot be views are copied.
        round, client_id: context for error messages.

    Returns:
        ``name -> array``, writable, in the order of ``expected`` (or the encoder's order); copies unless
        ``copy`` is False.

    Raises:
        PayloadError: truncated or corrupted bytes (see :func:`parse_header`); names, shapes or dtypes differ
            from ``expected``.
        NonFiniteError: a floating tensor holds NaN or Inf and ``allow_nonfinite`` is false.
    """
    header_json, body_len, body = split_payload(data, round=round, client_id=client_id)
    entries, _ = parse_header(header_json, body_len, round=round, client_id=client_id, require_order=expected is None)
    view = memoryview(data).cast("B")
    share = not copy and not view.readonly
    loaded: NamedArrays = {}
    for name, e in entries.items():
        array = np.frombuffer(view[body + e.start : body + e.end], dtype=e.dtype.newbyteorder("<")).reshape(e.shape)
        keep = share and array.flags.aligned and array.dtype.isnative
        loaded[name] = array if keep else array.astype(e.dtype, copy=True)
    order = [s.name for s in expected] if expected is not None else list(entries)
    arrays: NamedArrays = {name: loaded[name] for name in order if name in loaded}
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
        array = value.detach().cpu().numpy()
        # a tensor on another device was copied by .cpu() already; a CPU tensor's array still shares its memory
        arrays[name] = array.copy() if value.device.type == "cpu" else np.require(array, requirements="C")
    return arrays


def to_state_dict(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Convert named numpy arrays to a ``torch`` state dict (tensors share memory with the arrays)."""
    import torch

    # np.require keeps 0-d tensors 0-d (np.ascontiguousarray would make them 1-d)
    return {name: torch.from_numpy(np.require(a, requirements="C")) for name, a in arrays.items()}
