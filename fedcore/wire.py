"""Wire conversion, in one place: typed messages <-> protobuf (``fedcore.v1``) and chunked safetensors payloads.

A payload (the global model, a client's update) travels as safetensors bytes split into chunks of
``chunk_bytes`` (default 4 MiB) followed by a trailer with the SHA-256 of the whole payload; the header message
announces its size first. A receiver (:class:`PayloadReceiver`) refuses an announced size above its limit before
reading a byte, stops as soon as more bytes arrive than announced, and checks size and digest at the trailer, so
truncated, corrupted and oversized payloads are all rejected with a reason that names the client and round.

Payloads are written and read as files without holding a second copy of the model: :func:`save_payload`
streams tensors to a file (computing the digest on the way) and :func:`open_safetensors` maps a received file as
read-only ``np.memmap`` views, so the server folds an update from disk (DESIGN.md, "spill to disk"). A written file
depends only on its tensors and metadata (the same run writes the same bytes), replaces its path atomically, and can
carry the SHA-256 of its own bytes (checkpoints: :func:`check_digest`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import grpc
import numpy as np

from fedcore.errors import PayloadError, TransportError
from fedcore.messages import EvaluateIns, EvaluateRes, Failure, FitIns, FitRes, Instruction, Reply, Stage
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.proto.v1 import fedcore_pb2_grpc as pb_grpc
from fedcore.task import FitConfig
from fedcore.tensors import (
    MAX_HEADER_BYTES,
    NamedArrays,
    TensorEntry,
    parse_header,
    raw_bytes,
    safetensors_header,
)

DEFAULT_CHUNK_BYTES = 4 << 20
"""Payload chunk size on the wire (4 MiB: well under gRPC's default 4 MiB+ message cap once framed)."""


DIGEST_KEY = "fedcore.sha256"
"""Header metadata key of a file's own SHA-256 (see ``save_payload(self_digest=True)`` and :func:`check_digest`)."""

_DIGEST_PLACEHOLDER = "0" * 64


_READ_BLOCK = 1 << 20

_STAGE_TO_PB = {Stage.FIT: pb.STAGE_FIT, Stage.EVALUATE: pb.STAGE_EVALUATE}
_STAGE_FROM_PB = {v: k for k, v in _STAGE_TO_PB.items()}


@dataclass(frozen=True)
class PayloadFile:
    """A payload written to disk: where, how many payload bytes, their SHA-256, and the framing (None: the file
    is the plain safetensors payload; else it holds wire-framed chunks of ``frame_bytes``, see
    :func:`save_payload`)."""

    path: Path
    size: int
    sha256: bytes
    frame_bytes: int | None = None


# ---------------------------------------------------------------------------------------------------------------
# safetensors files without extra copies


def payload_segments(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> list[memoryview]:
    """The safetensors payload of ``arrays`` as views, in order: the header, then each tensor's bytes.

    Nothing is copied (except tensors that are not C-contiguous little-endian); the views share memory with
    ``arrays``, which must not change while the views are in use.

    Raises:
        PayloadError: a dtype safetensors cannot hold.
    """
    return [memoryview(safetensors_header(arrays, metadata)), *(raw_bytes(a) for a in arrays.values())]


def _write_segments(fh: BinaryIO, segments: Sequence[memoryview]) -> tuple[int, bytes]:
    digest = hashlib.sha256()
    for segment in segments:
        for i in range(0, len(segment), _READ_BLOCK * 16):
            piece = segment[i : i + _READ_BLOCK * 16]
            fh.write(piece)
            digest.update(piece)
    return sum(len(s) for s in segments), digest.digest()


def save_payload(
    path: str | os.PathLike[str],
    arrays: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    *,
    frame_bytes: int | None = None,
    durable: bool = True,
    self_digest: bool = False,
) -> PayloadFile:
    """Write ``arrays`` to ``path`` atomically (temporary file, rename) and return its size and digest.

    The bytes depend only on ``arrays`` and ``metadata`` (see :func:`safetensors_header`), so the same run writes
    the same files. If the write fails (disk full, file size limit, an error while writing) the temporary file
    is removed and whatever was at ``path`` before is untouched.

    Args:
        path: the file to write.
        arrays, metadata: the tensors (in order) and extra header metadata.
        frame_bytes: if given, the file holds the payload already framed for the wire: one encoded data chunk
            per ``frame_bytes`` of payload (see :func:`framed_sizes`), so a sender hands each chunk to gRPC as it
            reads it, without another copy. ``size`` and ``sha256`` are those of the payload itself.
        durable: fsync the file and its directory before returning (a checkpoint); False for a file that is
            only sent and is written again after a crash, which saves waiting for the disk.
        self_digest: store in the header, under :data:`DIGEST_KEY`, the SHA-256 (hex) of the whole file as it
            reads with that value set to 64 zeros, so :func:`check_digest` detects any changed byte later
            (header or data). Computed while writing, in one pass. ``sha256`` is then that digest. Not with
            ``frame_bytes``.

    Raises:
        PayloadError: a dtype safetensors cannot hold, a reserved metadata key, or ``self_digest`` with framing.
        OSError: the file cannot be written (disk full, permissions, file size limit).
    """
    path = Path(path)
    if self_digest and frame_bytes is not None:
        raise PayloadError("a framed payload file cannot carry its own digest (self_digest with frame_bytes)")
    meta = dict(metadata or {})
    if DIGEST_KEY in meta:
        raise PayloadError(f"metadata key {DIGEST_KEY!r} is reserved")
    if self_digest:
        meta[DIGEST_KEY] = _DIGEST_PLACEHOLDER
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    segments = payload_segments(arrays, meta)
    size = sum(len(s) for s in segments)
    try:
        with tmp.open("wb") as fh:
            if frame_bytes is None:
                preallocate(fh, size)
                _, digest = _write_segments(fh, segments)
                if self_digest:
                    fh.seek(_digest_offset(bytes(segments[0])))
                    fh.write(digest.hex().encode())
            else:
                preallocate(fh, sum(framed for _, framed in framed_sizes(size, frame_bytes)))
                hasher = hashlib.sha256()
                for chunk in iter_data_chunks(segments, frame_bytes):
                    fh.write(chunk.framed)
                    hasher.update(chunk.payload)
                digest = hasher.digest()
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a torn temporary behind; ``path`` keeps its old content
        raise
    if durable:
        _fsync_dir(path.parent)
    return PayloadFile(path=path, size=size, sha256=digest, frame_bytes=frame_bytes)


def _digest_offset(header: bytes) -> int:
    """Byte offset of the digest value inside ``header`` (the prefix and JSON written by :func:`safetensors_header`).

    The key and its value appear exactly once: JSON escapes every quote inside string values, so the quoted key
    followed by ``:"`` cannot occur anywhere else.
    """
    marker = json.dumps(DIGEST_KEY).encode() + b':"'
    at = header.find(marker)
    if at < 0 or header.find(marker, at + 1) >= 0:
        raise PayloadError(f"header does not hold exactly one {DIGEST_KEY!r} entry (corrupted file)")
    return at + len(marker)


def check_digest(path: str | os.PathLike[str]) -> bool | None:
    """Check the digest a file written with ``save_payload(self_digest=True)`` carries in its header.

    Reads the whole file once (its pages stay in the OS page cache for a later :func:`open_safetensors`).

    Returns:
        True if the file's bytes match the recorded digest, False if any byte differs, None if the file records
        no digest (a plain safetensors file).

    Raises:
        PayloadError: the file is too short or its header is malformed.
        OSError: the file cannot be read.
    """
    path = Path(path)
    _, metadata, body = read_safetensors_header(path)
    recorded = metadata.get(DIGEST_KEY)
    if recorded is None:
        return None
    hasher = hashlib.sha256()
    with path.open("rb") as fh:
        header = bytearray(fh.read(body))
        at = _digest_offset(bytes(header))
        header[at : at + len(_DIGEST_PLACEHOLDER)] = _DIGEST_PLACEHOLDER.encode()
        hasher.update(header)
        while block := fh.read(_READ_BLOCK * 16):
            hasher.update(block)
    return hasher.hexdigest() == recorded


def preallocate(fh: BinaryIO, size: int) -> None:
    """Reserve ``size`` bytes of disk for the open file ``fh`` before it is written.

    Writing into reserved space avoids the file system's block allocation on every write, which made spill writes
    stall on this project's test machines (ext4: 0.3 to 3.5 GiB/s without, 2.6 to 4.5 GiB/s with). Where the file
    system cannot reserve space, nothing happens.

    Raises:
        OSError: ``ENOSPC``, the disk has no room for ``size`` bytes.
    """
    if size <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fh.fileno(), 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise
        # EOPNOTSUPP and friends: the file system cannot reserve; plain writes still work


class SpillFile:
    """A file being received, whose disk space is reserved only as its bytes arrive: at most ``ahead_bytes``
    past what was written (never the whole announced size at once, so an announcement alone reserves nothing
    and a stalled upload holds at most ``ahead_bytes`` it did not send). Reserving ahead keeps the writes fast
    (see :func:`preallocate`).

    Args:
        file: the open file (written from its start).
        announced: the payload size the sender announced (nothing past it is reserved).
        ahead_bytes: how far past the written bytes space is reserved.
        round, client_id: context for the error raised when the disk is full.

    Raises:
        TransportError: from :meth:`write`, when the disk has no room for the next reservation.
    """

    def __init__(
        self,
        file: BinaryIO,
        announced: int,
        *,
        ahead_bytes: int = 64 << 20,
        round: int | None = None,
        client_id: str | None = None,
    ) -> None:
        self._file = file
        self._announced = announced
        self._ahead = ahead_bytes
        self._written = 0
        self._reserved = 0
        self._round, self._client_id = round, client_id

    def write(self, data: bytes | memoryview) -> int:
        """Write ``data`` after reserving room for it (and up to ``ahead_bytes`` more)."""
        end = self._written + len(data)
        if end > self._reserved and hasattr(os, "posix_fallocate"):
            target = min(self._announced, end + self._ahead)
            try:
                if target > self._reserved:
                    os.posix_fallocate(self._file.fileno(), self._reserved, target - self._reserved)
                    self._reserved = target
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise TransportError(
                        f"no room in the spill directory for an update of {self._announced} bytes ({exc}); free "
                        "disk space or point spill_dir elsewhere",
                        round=self._round,
                        client_id=self._client_id,
                    ) from exc
                self._reserved = self._announced  # the file system cannot reserve: plain writes still work
        self._file.write(data)
        self._written = end
        return len(data)


def bound_text(text: str, limit: int = 1000) -> str:
    """``text`` made safe to log or store when it comes from client input: at most ``limit`` characters (a
    longer text is cut and says how long it was), with control characters shown as ``?``."""
    cut = text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"
    return "".join(c if c.isprintable() else "?" for c in cut)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_safetensors_header(
    path: str | os.PathLike[str], *, round: int | None = None, client_id: str | None = None
) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
    """Read and check the header of the safetensors file ``path`` (the tensor data is not read).

    Only the structure is checked (header, dtypes, offsets inside the file, sizes matching shapes); names,
    shapes and values are checked against the model by whoever folds the update.

    Returns:
        ``(name -> TensorEntry in the recorded order, user metadata, byte offset of the data)``.

    Raises:
        PayloadError: truncated or corrupted file.
        OSError: the file cannot be read (FileNotFoundError if it does not exist).
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            message = f"payload of {size} bytes is too short to be safetensors (truncated?)"
            raise PayloadError(message, round=round, client_id=client_id, stage="decode")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:  # refused before the header is read into memory
            message = f"safetensors header of {header_len} bytes exceeds the {MAX_HEADER_BYTES} bytes fedcore reads"
            raise PayloadError(message, round=round, client_id=client_id, stage="decode")
        if header_len > size - 8:
            message = f"safetensors header claims {header_len} bytes but only {size - 8} follow (truncated)"
            raise PayloadError(message, round=round, client_id=client_id, stage="decode")
        header_json = fh.read(header_len)
    body = 8 + header_len
    entries, metadata = parse_header(header_json, size - body, round=round, client_id=client_id)
    return entries, metadata, body


def open_safetensors(
    path: str | os.PathLike[str], *, round: int | None = None, client_id: str | None = None
) -> tuple[NamedArrays, dict[str, str]]:
    """Map a safetensors file as read-only ``np.memmap`` views, in the order recorded in its header.

    The header is checked by :func:`read_safetensors_header`.

    Returns:
        ``(name -> array view, user metadata)``.

    Raises:
        PayloadError: truncated or corrupted file.
        OSError: the file cannot be read (FileNotFoundError if it does not exist).
    """
    path = Path(path)
    entries, metadata, body = read_safetensors_header(path, round=round, client_id=client_id)
    arrays: NamedArrays = {}
    for name, e in entries.items():  # in the recorded order
        if e.end == e.start:
            arrays[name] = np.zeros(e.shape, dtype=e.dtype)
        else:
            arrays[name] = np.memmap(path, dtype=e.dtype, mode="r", offset=body + e.start, shape=e.shape)
    return arrays, metadata


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


# ---------------------------------------------------------------------------------------------------------------
# chunk codec: TaskChunk / ResultChunk data messages without protobuf copies
#
# ``data`` is field 2 (length-delimited) of both TaskChunk and ResultChunk. A data chunk is encoded by hand (tag,
# varint length, bytes: one copy) and decoded to a memoryview into the received message (no copy). The encoding
# is the protobuf encoding, so stock generated stubs on the other side interoperate. Every other message goes
# through protobuf.

_DATA_TAG = 0x12


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _frame_prefix(length: int) -> bytes:
    return bytes((_DATA_TAG,)) + _varint(length)


class DataChunk:
    """An outgoing payload chunk, already encoded as a ``TaskChunk``/``ResultChunk`` data message.

    gRPC sends ``framed`` as it is (:func:`serialize_chunk` returns it), so the chunk's bytes are copied once, when
    it is built, and never again by fedcore. ``payload`` is a view of the chunk's data (without the framing).
    """

    __slots__ = ("framed", "prefix")

    def __init__(self, framed: bytes, prefix: int) -> None:
        self.framed = framed
        self.prefix = prefix

    @classmethod
    def of(cls, *pieces: bytes | bytearray | memoryview) -> DataChunk:
        """Frame the concatenation of ``pieces`` (one copy)."""
        prefix = _frame_prefix(sum(len(p) for p in pieces))
        return cls(b"".join((prefix, *pieces)), len(prefix))

    @property
    def payload(self) -> memoryview:
        """The chunk's data bytes (a view, no copy)."""
        return memoryview(self.framed)[self.prefix :]


def framed_sizes(size: int, frame_bytes: int) -> Iterator[tuple[int, int]]:
    """``(data bytes, framed bytes)`` of each chunk of a ``size``-byte payload cut every ``frame_bytes``."""
    for start in range(0, size, frame_bytes):
        n = min(frame_bytes, size - start)
        yield n, len(_frame_prefix(n)) + n


def iter_data_chunks(segments: Sequence[memoryview], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[DataChunk]:
    """Cut the concatenation of ``segments`` (e.g. :func:`payload_segments`) into framed chunks of ``chunk_bytes``
    (the last one shorter), copying each byte once and never holding the whole payload."""
    pieces: list[memoryview] = []
    filled = 0
    for segment in segments:
        view = memoryview(segment).cast("B")
        while len(view):
            take = min(chunk_bytes - filled, len(view))
            pieces.append(view[:take])
            filled += take
            view = view[take:]
            if filled == chunk_bytes:
                yield DataChunk.of(*pieces)
                pieces, filled = [], 0
    if filled:
        yield DataChunk.of(*pieces)


def serialize_chunk(message: DataChunk | pb.TaskChunk | pb.ResultChunk) -> bytes:
    """gRPC serializer for TaskChunk / ResultChunk streams: a :class:`DataChunk` as it is, else protobuf."""
    if isinstance(message, DataChunk):
        return message.framed
    return message.SerializeToString()


def _chunk_parser(
    message_type: type[pb.TaskChunk] | type[pb.ResultChunk],
) -> Callable[[bytes], memoryview | pb.TaskChunk | pb.ResultChunk]:
    def parse(raw: bytes) -> memoryview | pb.TaskChunk | pb.ResultChunk:
        if raw[:1] == bytes((_DATA_TAG,)):
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


def fit_config_to_pb(config: FitConfig) -> pb.FitConfig:
    """FitConfig -> protobuf (``max_steps=None`` travels as 0)."""
    return pb.FitConfig(
        local_epochs=config.local_epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        mu=config.mu,
        max_steps=config.max_steps or 0,
    )


def fit_config_from_pb(message: pb.FitConfig) -> FitConfig:
    """Protobuf -> FitConfig (validated by its constructor: ConfigError on bad values)."""
    return FitConfig(
        local_epochs=message.local_epochs,
        batch_size=message.batch_size,
        lr=message.lr,
        momentum=message.momentum,
        weight_decay=message.weight_decay,
        mu=message.mu,
        max_steps=message.max_steps or None,
    )


def task_header(instruction: Instruction, *, task_id: str, payload_bytes: int) -> pb.TaskHeader:
    """The header announcing ``instruction``; its parameters follow as a chunked payload of ``payload_bytes``."""
    header = pb.TaskHeader(
        task_id=task_id, round=instruction.round, stage=_STAGE_TO_PB[instruction.stage], payload_bytes=payload_bytes
    )
    if isinstance(instruction, FitIns):
        header.seed = instruction.seed
        header.fit.CopyFrom(fit_config_to_pb(instruction.config))
    else:
        header.evaluate_batch_size = instruction.batch_size
    return header


def instruction_from_header(header: pb.TaskHeader, parameters: NamedArrays) -> Instruction:
    """Rebuild the instruction a client received.

    Raises:
        PayloadError: unknown stage. ConfigError: invalid fit settings.
    """
    stage = _STAGE_FROM_PB.get(header.stage)
    if stage is Stage.FIT:
        return FitIns(
            round=header.round, parameters=parameters, config=fit_config_from_pb(header.fit), seed=header.seed
        )
    if stage is Stage.EVALUATE:
        return EvaluateIns(round=header.round, parameters=parameters, batch_size=header.evaluate_batch_size)
    raise PayloadError(f"task {header.task_id!r} has an unknown stage {header.stage}", round=header.round)


def result_header(reply: Reply, *, session: str, task_id: str, payload_bytes: int = 0) -> pb.ResultHeader:
    """The header of a pushed reply (a FitRes's parameters follow as a payload of ``payload_bytes``)."""
    header = pb.ResultHeader(session=session, task_id=task_id, round=reply.round, payload_bytes=payload_bytes)
    if isinstance(reply, Failure):
        header.stage = _STAGE_TO_PB[reply.stage]
        header.failure = reply.reason or "unknown failure"
        return header
    header.num_examples = reply.num_examples
    header.metrics.update({k: float(v) for k, v in reply.metrics.items()})
    if isinstance(reply, FitRes):
        header.stage = pb.STAGE_FIT
    else:
        header.stage = pb.STAGE_EVALUATE
        header.loss = reply.loss
    return header


def reply_from_header(header: pb.ResultHeader, *, client_id: str, parameters: NamedArrays | None) -> Reply:
    """Rebuild a client's reply on the server. ``client_id`` comes from the session, never from the message.

    Raises:
        PayloadError: unknown stage, or a fit result without parameters.
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
    metrics = dict(header.metrics)
    if stage is Stage.FIT:
        if parameters is None:
            raise PayloadError("fit result without parameters", round=header.round, client_id=client_id)
        return FitRes(
            client_id=client_id,
            round=header.round,
            parameters=parameters,
            num_examples=header.num_examples,
            metrics=metrics,
        )
    return EvaluateRes(
        client_id=client_id, round=header.round, loss=header.loss, num_examples=header.num_examples, metrics=metrics
    )
