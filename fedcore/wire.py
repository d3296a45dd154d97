"""Wire conversion, in one place: typed messages <-> protobuf (``fedcore.v1``) and chunked payload streams.

A payload (the global model, a client's update) travels as safetensors bytes split into chunks of
``chunk_bytes`` (default 4 MiB) followed by a trailer with the SHA-256 of the whole payload; the header message
announces its size first. A receiver (:class:`PayloadReceiver`) refuses an announced size above its limit before
reading a byte, stops as soon as more bytes arrive than announced, and checks size and digest at the trailer, so
truncated, corrupted and oversized payloads are all rejected with a reason that names the client and round.

Files and framing that do not need gRPC (safetensors on disk, spill files, data chunks) live in
:mod:`fedcore.payload`; this module is the gRPC edge.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import BinaryIO

import grpc

from fedcore.config import scalar_fields
from fedcore.errors import ConfigError, PayloadError
from fedcore.messages import (
    EvaluateIns,
    EvaluateRes,
    Failure,
    FitIns,
    FitRes,
    ModParam,
    ModSpec,
    Reply,
    ServerMessage,
    Stage,
    StageIns,
    StageRes,
    StageValue,
    bound_text,
)
from fedcore.mods import check_mods
from fedcore.payload import DATA_TAG, DEFAULT_CHUNK_BYTES, DataChunk, SpillFile, unpack_groups
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.proto.v1 import fedcore_pb2_grpc as pb_grpc
from fedcore.task import FitConfig
from fedcore.tensors import (
    NamedArrays,
)

_STAGE_TO_PB = {Stage.FIT: pb.STAGE_FIT, Stage.EVALUATE: pb.STAGE_EVALUATE, Stage.PROTOCOL: pb.STAGE_PROTOCOL}
_STAGE_FROM_PB = {v: k for k, v in _STAGE_TO_PB.items()}

# ---------------------------------------------------------------------------------------------------------------
# chunking


def message_kind(kind: str | None) -> str:
    """``"a data message"``, ``"an idle message"``, ``"an empty message"`` for a chunk's oneof name."""
    word = kind or "empty"
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word} message"


def iter_bytes_chunks(data: bytes | bytearray | memoryview, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Yield ``data`` in pieces of at most ``chunk_bytes`` (one copy per piece, none of the whole)."""
    view = memoryview(data).cast("B")
    for i in range(0, len(view), chunk_bytes):
        yield bytes(view[i : i + chunk_bytes])


class PayloadReceiver:
    """Receives one chunked payload into ``sink`` while checking its announced size, a limit and its digest.

    Size checks run in :meth:`write`, on the caller's thread, before a chunk is accepted. Writing to the sink and
    the SHA-256 run on a helper thread (both release the GIL), overlapped with receiving the next chunks; at most
    ``_QUEUE_DEPTH`` chunks wait for it, which bounds what one transfer holds in memory besides its sink (2 chunks
    were as fast as 8 in bench/transfer.py, and kept bench/server_memory.py at 2.72x the model against 3.20x with
    8, with 4 pushes at a time). Use it as a context manager (or call :meth:`close`) so the helper thread
    stops when a transfer is abandoned.

    Args:
        sink: where the bytes go (a spill file, or a :class:`BufferSink` on a client).
        announced: the size the header announced.
        limit: the largest payload accepted, in bytes.
        round, client_id: context for error messages.

    Raises:
        PayloadError: at construction when ``announced`` is negative or over ``limit`` (nothing read yet); in
            :meth:`write` when more bytes arrive than announced; in :meth:`finish` when the payload is truncated
            or its SHA-256 differs from the trailer's.
    """

    _QUEUE_DEPTH = 2

    def __init__(
        self,
        sink: BinaryIO | BufferSink | SpillFile,
        *,
        announced: int,
        limit: int,
        round: int | None = None,
        client_id: str | None = None,
    ) -> None:
        self._round, self._client_id = round, client_id
        if announced < 0:
            raise self._fail(f"announced payload size {announced} is negative")
        if announced > limit:
            raise self._fail(
                f"announced payload of {announced} bytes exceeds the limit of {limit} bytes; refused before reading "
                "it (raise max_payload_bytes if the model really is that large)"
            )
        self._sink = sink
        self._announced = announced
        self._received = 0
        self._digest = hashlib.sha256()
        self._queue: queue.Queue[bytes | memoryview | None] = queue.Queue(self._QUEUE_DEPTH)
        self._error: BaseException | None = None
        self._worker: threading.Thread | None = None

    @property
    def received(self) -> int:
        """Bytes received so far."""
        return self._received

    def _fail(self, message: str) -> PayloadError:
        return PayloadError(message, round=self._round, client_id=self._client_id, stage="transfer")

    def _drain(self) -> None:
        while True:
            data = self._queue.get()
            if data is None:
                return
            if self._error is not None:
                continue  # keep draining so the receiving thread never blocks
            try:
                self._sink.write(data)
                self._digest.update(data)
            except BaseException as exc:  # re-raised on the receiving thread
                self._error = exc

    def write(self, data: bytes | memoryview) -> None:
        """Take one chunk (kept by reference until it is written: do not reuse its buffer)."""
        if self._received + len(data) > self._announced:
            self.close()
            raise self._fail(
                f"received more than the announced {self._announced} bytes; the payload is rejected (corrupted "
                "stream or a misbehaving client)"
            )
        if self._error is not None:
            self.close()
            raise self._error
        if self._worker is None:
            self._worker = threading.Thread(target=self._drain, name="fedcore-payload-sink", daemon=True)
            self._worker.start()
        self._queue.put(data)
        self._received += len(data)

    def read_until_trailer(self, chunks: Iterator[memoryview | pb.TaskChunk | pb.ResultChunk]) -> bytes | None:
        """:meth:`write` each data chunk of ``chunks`` until the trailer; return the trailer's SHA-256, or None
        when the stream ended without one. Call :meth:`finish` with it to check the payload.

        Raises:
            PayloadError: a message other than data or the trailer arrived inside the payload, anything followed
                the trailer, or (from :meth:`write`) more bytes than announced.
        """
        for chunk in chunks:
            kind, data = chunk_body(chunk)
            if kind == "data":
                self.write(data)
            elif kind == "trailer" and not isinstance(chunk, memoryview):
                extra = next(chunks, None)
                if extra is not None:
                    self.close()
                    raise self._fail(f"{message_kind(chunk_body(extra)[0])} followed the trailer")
                return chunk.trailer.sha256
            else:
                self.close()
                raise self._fail(f"unexpected {kind or 'empty'} message inside a payload")
        return None

    def close(self) -> None:
        """Stop the helper thread once the queued chunks are written (idempotent)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            self._queue.put(None)
            worker.join()

    def __enter__(self) -> PayloadReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def finish(self, sha256: bytes | None) -> None:
        """Check the trailer: all announced bytes arrived and their digest matches ``sha256``.

        ``sha256`` is None when the stream ended without a trailer.
        """
        self.close()
        if self._error is not None:
            raise self._error
        if self._received != self._announced:
            raise self._fail(
                f"payload truncated: {self._received} of {self._announced} bytes arrived"
                + ("" if sha256 is not None else " and no trailer")
            )
        if sha256 is None:
            raise self._fail(f"the stream ended without its trailer (all {self._announced} bytes arrived)")
        if len(sha256) != self._digest.digest_size:
            raise self._fail(f"malformed trailer: its SHA-256 has {len(sha256)} bytes, not {self._digest.digest_size}")
        if self._digest.digest() != sha256:
            raise self._fail("payload corrupted: SHA-256 of the received bytes differs from the trailer")


class BufferSink:
    """An in-memory sink of exactly ``size`` bytes, allocated at the first write (so a receiver can refuse an
    oversized announcement before any memory is taken); one copy per chunk, no regrowth."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._buffer: bytearray | None = None
        self._pos = 0

    @property
    def buffer(self) -> bytearray:
        """The whole buffer (``size`` bytes)."""
        if self._buffer is None:
            self._buffer = bytearray(self._size)
        return self._buffer

    def write(self, data: bytes | memoryview) -> int:
        """Append ``data``; raises PayloadError past the end."""
        n = len(data)
        if self._pos + n > self._size:
            raise PayloadError(f"payload overflows its announced {self._size} bytes")
        memoryview(self.buffer)[self._pos : self._pos + n] = data
        self._pos += n
        return n


class BackgroundDigest:
    """SHA-256 of ``data`` (one buffer, or a sequence of buffers hashed in order, such as
    :func:`payload_segments`) computed on a helper thread (hashlib releases the GIL), so it overlaps sending.
    The buffers must not change until :meth:`digest` returns."""

    def __init__(self, data: bytes | bytearray | memoryview | Sequence[memoryview]) -> None:
        self._value = b""
        parts = [data] if isinstance(data, bytes | bytearray | memoryview) else list(data)
        self._thread = threading.Thread(target=self._run, args=(parts,), name="fedcore-digest", daemon=True)
        self._thread.start()

    def _run(self, parts: list[bytes | bytearray | memoryview]) -> None:
        hasher = hashlib.sha256()
        for part in parts:
            hasher.update(part)
        self._value = hasher.digest()

    def digest(self) -> bytes:
        """Wait for and return the digest."""
        self._thread.join()
        return self._value


TRANSFER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 1 << 20),
    ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20),
)
"""gRPC options for bulk payloads, for servers and client channels: read the socket in large pieces."""


# ---------------------------------------------------------------------------------------------------------------
# credentials in call metadata (checked by the server before it reads a request)

SESSION_KEY = "fedcore-session"
"""Call metadata key of the session: every call after Join carries it."""
CLIENT_ID_KEY = "fedcore-client-id"
TOKEN_KEY = "fedcore-token"
"""Call metadata keys of a Join's client id and token."""


def session_metadata(session: str) -> tuple[tuple[str, str], ...]:
    """The metadata of a call made under ``session``."""
    return ((SESSION_KEY, session),)


def join_metadata(client_id: str, token: str, previous_session: str = "") -> tuple[tuple[str, str], ...]:
    """The metadata of a Join: client id and token (checked before the request is read; metadata holds printable
    ASCII only, so other ids and tokens travel in the request alone) and, when the daemon reconnects, the session
    it held, which lets it take its id over from that session at once."""
    items: list[tuple[str, str]] = []
    if all(value.isascii() and value.isprintable() for value in (client_id, token)):  # else: in the request only
        items += [(CLIENT_ID_KEY, client_id), (TOKEN_KEY, token)]
    if previous_session:
        items.append((SESSION_KEY, previous_session))
    return tuple(items)


def serialize_chunk(message: DataChunk | pb.TaskChunk | pb.ResultChunk) -> bytes:
    """gRPC serializer for TaskChunk / ResultChunk streams: a :class:`DataChunk` as it is, else protobuf."""
    if isinstance(message, DataChunk):
        return message.framed
    return message.SerializeToString()


def _chunk_parser(
    message_type: type[pb.TaskChunk] | type[pb.ResultChunk],
) -> Callable[[bytes], memoryview | pb.TaskChunk | pb.ResultChunk]:
    def parse(raw: bytes) -> memoryview | pb.TaskChunk | pb.ResultChunk:
        if raw[:1] == bytes((DATA_TAG,)):
            length = shift = 0
            for pos in range(1, min(len(raw), 11)):
                byte = raw[pos]
                length |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    if pos + 1 + length == len(raw):  # exactly one data field: the common case
                        return memoryview(raw)[pos + 1 :]
                    break
        return message_type.FromString(raw)

    return parse


parse_task_chunk = _chunk_parser(pb.TaskChunk)
"""gRPC deserializer for TaskChunk: a data chunk as a read-only memoryview, anything else as a TaskChunk."""
parse_result_chunk = _chunk_parser(pb.ResultChunk)
"""gRPC deserializer for ResultChunk: a data chunk as a read-only memoryview, anything else as a ResultChunk."""


def coordinator_stub(channel: grpc.Channel) -> pb_grpc.CoordinatorStub:
    """A ``fedcore.v1.Coordinator`` stub whose payload streams use the chunk codec (pushes take
    :class:`DataChunk` items; pulled data chunks arrive as memoryviews)."""
    stub = pb_grpc.CoordinatorStub(channel)
    stub.PullTask = channel.unary_stream(  # type: ignore[method-assign]
        "/fedcore.v1.Coordinator/PullTask",
        request_serializer=pb.PullTaskRequest.SerializeToString,
        response_deserializer=parse_task_chunk,
        _registered_method=True,
    )
    stub.PushResult = channel.stream_unary(  # type: ignore[method-assign]
        "/fedcore.v1.Coordinator/PushResult",
        request_serializer=serialize_chunk,
        response_deserializer=pb.PushReply.FromString,
        _registered_method=True,
    )
    return stub


def chunk_body(chunk: memoryview | pb.TaskChunk | pb.ResultChunk) -> tuple[str | None, memoryview | bytes]:
    """``(kind, data)`` of a received chunk: kind is the oneof name (``"data"``, ``"header"``, ...)."""
    if isinstance(chunk, memoryview):
        return "data", chunk
    kind = chunk.WhichOneof("body")
    return kind, chunk.data if kind == "data" else b""


# ---------------------------------------------------------------------------------------------------------------
# typed messages <-> protobuf


_INT32_MAX = (1 << 31) - 1
_INT64 = (-(1 << 63), (1 << 63) - 1)


def fit_config_to_pb(config: FitConfig) -> pb.FitConfig:
    """FitConfig (or a subclass) -> protobuf, derived from the dataclass's fields.

    Every field goes into ``values`` by name (an unset optional field is left out). The frozen typed fields 1-7
    of the message are filled too, by name, for daemons older than ``values`` (``None`` travels there as 0, and a
    value beyond their int32 range leaves them 0, which such a daemon refuses).

    Raises:
        ConfigError: an int field beyond the 64-bit range.
    """
    message = pb.FitConfig()
    legacy = message.DESCRIPTOR.fields_by_name
    for f in scalar_fields(type(config)):
        value = getattr(config, f.name)
        if value is None:
            continue
        if f.kind is int and not _INT64[0] <= value <= _INT64[1]:
            raise ConfigError(f"FitConfig.{f.name}={value} does not fit in 64 bits; give a smaller value")
        if f.kind is float:
            value = float(value)  # an int given for a float field travels as the float it stands for
        slot = message.values[f.name]
        setattr(slot, _VALUE_SLOTS[f.kind], value)
        if f.name in legacy and f.name != "values" and not (f.kind is int and abs(value) > _INT32_MAX):
            setattr(message, f.name, value)
    return message


#: the ``ConfigValue`` oneof member each scalar kind travels in.
_VALUE_SLOTS: dict[type, str] = {int: "int_value", float: "float_value", bool: "bool_value", str: "string_value"}


def fit_config_from_pb(message: pb.FitConfig, cls: type[FitConfig] = FitConfig) -> FitConfig:
    """Protobuf -> FitConfig (or the subclass ``cls``), derived from the dataclass's fields and validated by its
    constructor.

    Reads ``values``; a message without it (from a server older than the map) is read from the typed fields that
    carry the same names (0 in an optional int field meaning unset), the other fields keeping their defaults.

    Raises:
        ConfigError: a key this client's FitConfig does not have (the server runs a newer fedcore: upgrade this
            client), a value of the wrong type, or a value the FitConfig refuses.
    """
    fields = {f.name: f for f in scalar_fields(cls)}
    kwargs: dict[str, object] = {}
    if not message.values:
        for name in message.DESCRIPTOR.fields_by_name:
            if name in fields:
                value = getattr(message, name)
                kwargs[name] = None if fields[name].optional and value == 0 else value
        return cls(**kwargs)  # type: ignore[arg-type]
    unknown = sorted(set(message.values) - set(fields))
    if unknown:
        raise ConfigError(
            f"the server sent FitConfig setting(s) {', '.join(repr(bound_text(k, 40)) for k in unknown[:5])} that this "
            "client does not know: the server runs a newer fedcore; upgrade fedcore on this client"
        )
    for name, slot in message.values.items():
        f = fields[name]
        kind = slot.WhichOneof("kind")
        value = getattr(slot, kind) if kind is not None else None
        if kind == "int_value" and f.kind is float:
            value = float(value)  # type: ignore[arg-type]
        elif kind != _VALUE_SLOTS[f.kind]:
            raise ConfigError(
                f"the server sent FitConfig.{name} as {kind or 'nothing'}, expected {f.kind.__name__}; the server "
                "and this client run incompatible fedcore versions"
            )
        kwargs[name] = value
    return cls(**kwargs)  # type: ignore[arg-type]


def mod_to_pb(spec: ModSpec) -> pb.ModSpec:
    """A client mod declaration -> protobuf (each parameter in the oneof field of its type)."""
    message = pb.ModSpec(name=spec.name)
    for key, value in spec.params.items():
        param = message.params[key]
        if isinstance(value, bool):
            param.flag = value
        elif isinstance(value, int):
            param.integer = value
        elif isinstance(value, float):
            param.number = value
        else:
            param.text = value
    return message


def mod_from_pb(message: pb.ModSpec) -> ModSpec:
    """Protobuf -> a client mod declaration (not yet checked against the registry: see :func:`check_mods`).

    Raises:
        ConfigError: a parameter without a value.
    """
    params: dict[str, ModParam] = {}
    for key, param in message.params.items():
        kind = param.WhichOneof("value")
        if kind is None:
            raise ConfigError(
                f"parameter {bound_text(key, 40)!r} of client mod {bound_text(message.name, 40)!r} has no value"
            )
        params[key] = getattr(param, kind)
    return ModSpec(message.name, params)


def stage_message_to_pb(message: StageIns | StageRes) -> pb.StageMessage:
    """The protocol, stage name and fields of a stage message (its tensors travel as the payload)."""
    out = pb.StageMessage(protocol=message.protocol, name=message.name, attempt=message.attempt)
    for key, value in message.fields.items():
        if isinstance(value, bytes):
            out.fields[key].bytes_value = value
        elif isinstance(value, int):
            out.fields[key].int_value = value
        else:
            out.fields[key].str_value = value
    return out


def stage_fields_from_pb(message: pb.StageMessage) -> dict[str, StageValue]:
    """The fields of a received stage message (checked against their bounds when the message is built)."""
    fields: dict[str, StageValue] = {}
    for key, value in message.fields.items():
        kind = value.WhichOneof("value")
        fields[key] = (
            value.int_value if kind == "int_value" else value.str_value if kind == "str_value" else value.bytes_value
        )
    return fields


def task_header(
    instruction: ServerMessage, *, task_id: str, payload_bytes: int, deadline_s: float = 0.0
) -> pb.TaskHeader:
    """The header announcing ``instruction``; its tensors (the global model, a stage's tensors) follow as a
    chunked payload of ``payload_bytes``, with a fit instruction's tensor groups (see :func:`payload_arrays`).
    ``deadline_s``: seconds left until the exchange's deadline (0: none)."""
    header = pb.TaskHeader(
        task_id=task_id,
        round=instruction.round,
        stage=_STAGE_TO_PB[instruction.stage],
        payload_bytes=payload_bytes,
        deadline_s=deadline_s,
    )
    if isinstance(instruction, FitIns):
        header.seed = instruction.seed
        header.fit.CopyFrom(fit_config_to_pb(instruction.config))
        header.mods.extend(mod_to_pb(spec) for spec in instruction.mods)
    elif isinstance(instruction, EvaluateIns):
        header.evaluate_batch_size = instruction.batch_size
    else:
        header.protocol_stage.CopyFrom(stage_message_to_pb(instruction))
    return header


def instruction_from_header(
    header: pb.TaskHeader, parameters: NamedArrays, metadata: Mapping[str, str] | None = None
) -> ServerMessage:
    """Rebuild the instruction a client received from its header and payload (``parameters``: the payload's
    arrays, ``metadata``: its header metadata, which lists a fit instruction's tensor groups, split off here).

    Raises:
        PayloadError: unknown stage, tensor groups that do not unpack (see :func:`unpack_groups`), or a stage
            message out of bounds.
        ConfigError: invalid fit settings, or client mods that are unknown or have bad parameters.
    """
    stage = _STAGE_FROM_PB.get(header.stage)
    if stage is Stage.FIT:
        model, groups = unpack_groups(parameters, metadata or {}, round=header.round)
        mods = tuple(mod_from_pb(m) for m in header.mods)
        check_mods(mods)  # refused on arrival: an unknown mod never runs half a round
        return FitIns(
            round=header.round,
            parameters=model,
            config=fit_config_from_pb(header.fit),
            seed=header.seed,
            groups=groups,
            mods=mods,
        )
    if stage is Stage.EVALUATE:
        return EvaluateIns(round=header.round, parameters=parameters, batch_size=header.evaluate_batch_size)
    if stage is Stage.PROTOCOL:
        message = header.protocol_stage
        return StageIns(
            round=header.round,
            attempt=message.attempt,
            protocol=message.protocol,
            name=message.name,
            fields=stage_fields_from_pb(message),
            tensors=parameters,
        )
    raise PayloadError(f"task {header.task_id!r} has an unknown stage {header.stage}", round=header.round)


def result_header(reply: Reply, *, session: str, task_id: str, payload_bytes: int = 0) -> pb.ResultHeader:
    """The header of a pushed reply (a FitRes's parameters, a StageRes's tensors follow as a payload of
    ``payload_bytes``)."""
    header = pb.ResultHeader(session=session, task_id=task_id, round=reply.round, payload_bytes=payload_bytes)
    if isinstance(reply, Failure):
        header.stage = _STAGE_TO_PB[reply.stage]
        header.failure = reply.reason or "unknown failure"
        return header
    if isinstance(reply, StageRes):
        header.stage = pb.STAGE_PROTOCOL
        header.protocol_stage.CopyFrom(stage_message_to_pb(reply))
        return header
    header.num_examples = reply.num_examples
    header.metrics.update({k: float(v) for k, v in reply.metrics.items()})
    if isinstance(reply, FitRes):
        header.stage = pb.STAGE_FIT
    else:
        header.stage = pb.STAGE_EVALUATE
        header.loss = reply.loss
    return header


def reply_from_header(
    header: pb.ResultHeader,
    *,
    client_id: str,
    parameters: NamedArrays | None,
    metadata: Mapping[str, str] | None = None,
) -> Reply:
    """Rebuild a client's reply on the server. ``client_id`` comes from the session, never from the message;
    ``parameters`` and ``metadata`` are the payload's arrays and header metadata (tensor groups are split off here).

    ``parameters`` is the payload that followed the header (None: none came; a stage reply then has no tensors).

    Raises:
        PayloadError: unknown stage, a fit result without parameters, tensor groups that do not unpack, or a stage
            message out of bounds.
    """
    stage = _STAGE_FROM_PB.get(header.stage)
    if stage is None:
        raise PayloadError(f"result has an unknown stage {header.stage}", round=header.round, client_id=client_id)
    if header.failure:
        return Failure(
            client_id=client_id,
            round=header.round,
            stage=stage,
            reason=f"client reported: {bound_text(header.failure)}",
        )
    if stage is Stage.PROTOCOL:
        message = header.protocol_stage
        return StageRes(
            client_id=client_id,
            round=header.round,
            attempt=message.attempt,
            protocol=message.protocol,
            name=message.name,
            fields=stage_fields_from_pb(message),
            tensors=parameters if parameters is not None else {},
        )
    metrics = dict(header.metrics)
    if stage is Stage.FIT:
        if parameters is None:
            raise PayloadError("fit result without parameters", round=header.round, client_id=client_id)
        model, groups = unpack_groups(parameters, metadata or {}, round=header.round, client_id=client_id)
        return FitRes(
            client_id=client_id,
            round=header.round,
            parameters=model,
            num_examples=header.num_examples,
            metrics=metrics,
            groups=groups,
        )
    return EvaluateRes(
        client_id=client_id, round=header.round, loss=header.loss, num_examples=header.num_examples, metrics=metrics
    )
