"""Payloads as files and bytes: safetensors written and mapped without extra copies, and the data-chunk framing.

This module knows nothing of gRPC or protobuf classes, so checkpoints, simulations and spill files depend on it
alone; :mod:`fedcore.wire` builds the gRPC codec on top of it.

Payloads are written and read as files without holding a second copy of the model: :func:`save_payload`
streams tensors to a file (computing the digest on the way) and :func:`open_safetensors` maps a received file as
read-only ``np.memmap`` views, so the server folds an update from disk (DESIGN.md, "spill to disk"). A written file
depends only on its tensors and metadata (the same run writes the same bytes), replaces its path atomically, and can
carry the SHA-256 of its own bytes (checkpoints: :func:`check_digest`).

A payload travels as a stream of data chunks (:class:`DataChunk`): each is the protobuf encoding of a
``TaskChunk``/``ResultChunk`` whose ``data`` field (field 2, length-delimited) holds the bytes, encoded here by hand
(tag, varint length, bytes: one copy), so stock generated stubs on the other side interoperate, and a payload file
can be written already framed for the wire (``save_payload(frame_bytes=...)``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from fedcore.errors import PayloadError, TransportError
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
# tensor groups in one payload

GROUPS_KEY = "fedcore.groups"
"""Header metadata key listing the tensor groups a payload carries besides the model (a JSON list of names)."""

GROUP_PREFIX = "@"
"""Tensors of group ``g`` are stored as ``@g/<name>``; a model tensor name may not start with it."""

_GROUP_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")

MAX_GROUPS = 16
"""The most tensor groups one payload carries besides the model."""


def check_group_name(name: object) -> str:
    """``name`` if it can name a tensor group: a letter, then letters, digits, ``_`` or ``-``; 64 characters at
    most.

    Raises:
        PayloadError: any other name (bounded in the message).
    """
    if not isinstance(name, str) or _GROUP_NAME.fullmatch(name) is None:
        shown = repr(name)[:70]
        raise PayloadError(
            f"{shown} cannot name a tensor group: use a letter, then letters, digits, '_' or '-' (64 at most)"
        )
    return name


def pack_groups(
    parameters: Mapping[str, np.ndarray], groups: Mapping[str, Mapping[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The model and its tensor groups as one flat set of named arrays plus header metadata, for one payload.

    The model's tensors keep their names; those of group ``g`` become ``@g/<name>``, and the metadata entry
    :data:`GROUPS_KEY` lists the groups (JSON, in order). No array is copied. Without groups the result is the model
    alone with empty metadata: the payload of a plain FedAvg round is unchanged.

    Raises:
        PayloadError: a group name that :func:`check_group_name` refuses, more than :data:`MAX_GROUPS` groups, an
            empty group, or a model tensor whose name starts with :data:`GROUP_PREFIX`.
    """
    if not groups:
        return dict(parameters), {}
    if len(groups) > MAX_GROUPS:
        raise PayloadError(f"{len(groups)} tensor groups; a payload carries at most {MAX_GROUPS}")
    arrays: dict[str, np.ndarray] = {}
    for name, array in parameters.items():
        if name.startswith(GROUP_PREFIX):
            raise PayloadError(
                f"model tensor {name[:80]!r} starts with {GROUP_PREFIX!r}, which is reserved for tensor groups"
            )
        arrays[name] = array
    for group, tensors in groups.items():
        check_group_name(group)
        if not tensors:
            raise PayloadError(f"tensor group {group!r} is empty; leave it out instead")
        for name, array in tensors.items():
            arrays[f"{GROUP_PREFIX}{group}/{name}"] = array
    return arrays, {GROUPS_KEY: json.dumps(list(groups))}


def unpack_groups(
    arrays: Mapping[str, np.ndarray],
    metadata: Mapping[str, str],
    *,
    round: int | None = None,
    client_id: str | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """Split a payload's arrays back into ``(model, groups)``: the inverse of :func:`pack_groups`.

    Raises:
        PayloadError: the group list is not a JSON list of valid, distinct names; a tensor names a group the
            list does not hold; or a listed group carries no tensor.
    """

    def fail(message: str) -> PayloadError:
        return PayloadError(message, round=round, client_id=client_id, stage="decode")

    listed = metadata.get(GROUPS_KEY)
    names: list[str] = []
    if listed is not None:
        try:
            names = json.loads(listed)
        except ValueError:
            raise fail(f"the {GROUPS_KEY!r} metadata entry is not JSON") from None
        if not isinstance(names, list) or len(names) > MAX_GROUPS:
            raise fail(f"the {GROUPS_KEY!r} metadata entry is not a list of at most {MAX_GROUPS} group names")
        try:
            for name in names:
                check_group_name(name)
        except PayloadError as exc:
            raise fail(exc.message) from None
        if len(set(names)) != len(names):
            raise fail(f"the payload lists a tensor group twice: {sorted({n for n in names if names.count(n) > 1})}")
    groups: dict[str, dict[str, np.ndarray]] = {name: {} for name in names}
    model: dict[str, np.ndarray] = {}
    for key, array in arrays.items():
        if not key.startswith(GROUP_PREFIX):
            model[key] = array
            continue
        group, sep, name = key[len(GROUP_PREFIX) :].partition("/")
        if not sep or group not in groups:
            raise fail(f"tensor {key[:80]!r} belongs to no tensor group the payload lists ({', '.join(names)})")
        groups[group][name] = array
    empty = [name for name, tensors in groups.items() if not tensors]
    if empty:
        raise fail(f"tensor group(s) {', '.join(empty)} listed but carrying no tensor")
    return model, groups


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


def _write_segments(fh: BinaryIO, segments: Sequence[memoryview], *, digest: bool = True) -> tuple[int, bytes]:
    """Write ``segments`` to ``fh``; their total size and SHA-256 (empty bytes without ``digest``)."""
    hasher = hashlib.sha256() if digest else None
    for segment in segments:
        for i in range(0, len(segment), _READ_BLOCK * 16):
            piece = segment[i : i + _READ_BLOCK * 16]
            fh.write(piece)
            if hasher is not None:
                hasher.update(piece)
    return sum(len(s) for s in segments), hasher.digest() if hasher is not None else b""


def save_payload(
    path: str | os.PathLike[str],
    arrays: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    *,
    frame_bytes: int | None = None,
    durable: bool = True,
    self_digest: bool = False,
    digest: bool = True,
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
        digest: False: no SHA-256 is computed (``sha256`` is empty bytes), for a file whose reader never checks
            one (the process pool's shared memory, a local spill): 0.44 ms of the 0.9 a 0.8 MB update takes to
            write to /dev/shm on this project's VM. Not with ``self_digest`` or ``frame_bytes``.

    Raises:
        PayloadError: a dtype safetensors cannot hold, a reserved metadata key, or ``self_digest`` with framing,
            or ``digest`` False with either.
        OSError: the file cannot be written (disk full, permissions, file size limit).
    """
    path = Path(path)
    if self_digest and frame_bytes is not None:
        raise PayloadError("a framed payload file cannot carry its own digest (self_digest with frame_bytes)")
    if not digest and (self_digest or frame_bytes is not None):
        raise PayloadError("digest=False leaves the file without a SHA-256, which self_digest and framing record")
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
                _, sha256 = _write_segments(fh, segments, digest=digest)
                if self_digest:
                    fh.seek(_digest_offset(bytes(segments[0])))
                    fh.write(sha256.hex().encode())
            else:
                preallocate(fh, sum(framed for _, framed in framed_sizes(size, frame_bytes)))
                hasher = hashlib.sha256()
                for chunk in iter_data_chunks(segments, frame_bytes):
                    fh.write(chunk.framed)
                    hasher.update(chunk.payload)
                sha256 = hasher.digest()
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a torn temporary behind; ``path`` keeps its old content
        raise
    if durable:
        _fsync_dir(path.parent)
    return PayloadFile(path=path, size=size, sha256=sha256, frame_bytes=frame_bytes)


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
# data-chunk framing (see the module docstring)


DATA_TAG = 0x12


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _frame_prefix(length: int) -> bytes:
    return bytes((DATA_TAG,)) + _varint(length)


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
