"""SecAgg+ messages as fedcore's generic stage messages (:class:`~fedcore.messages.StageIns` /
:class:`~fedcore.messages.StageRes`), and back.

Small values travel as stage fields (ints, bytes, a float as its exact hex text); maps from client ids to bytes
(public keys, share ciphertexts, shares) travel as one bytes field, packed as records of
``u16 id length | id (UTF-8) | u32 value length | value`` (big-endian). The masked upload does not travel here: it
is the fit result's only tensor (:data:`MASKED`), at the field's width. Every decoder checks what it reads and
raises :class:`~fedcore.errors.ProtocolError`; the state machines then check the contents.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping

from fedcore.errors import ProtocolError
from fedcore.messages import StageIns, StageRes, StageValue
from fedcore.tensors import TensorSpec
from privacy.secagg.config import RoundParams
from privacy.secagg.messages import (
    MAX_ID_BYTES,
    AdvertiseKeysIns,
    AdvertiseKeysRes,
    MaskedInputIns,
    ServerMessage,
    ShareKeysIns,
    ShareKeysRes,
    Stage,
    UnmaskIns,
    UnmaskRes,
)

PROTOCOL = "secagg+"
"""The round protocol's name, carried by every stage message."""

MASKED = "secagg.masked"
"""The fit result's only tensor under secure aggregation: the masked upload (``D + 1`` field elements)."""

DELIVER_SHARES = Stage.COLLECT_MASKED_INPUT.value
"""The third exchange: each client receives its neighbours' share ciphertexts (before training) and acknowledges;
its masked input then comes back as its fit result."""

SETTING_PREFIX = "setting."
"""Stage 1's fields that carry round settings from the layer above the protocol (distributed DP's adaptive
clipping norm, :mod:`privacy.dp.secure`), as ``setting.<name>`` = the float's exact hex text."""

_PARAMS = ("num_clients", "neighbours", "threshold", "field_bits", "max_weight", "levels")


def pack(entries: Mapping[str, bytes]) -> bytes:
    """``client id -> bytes`` as one byte string (see the module docstring)."""
    out = []
    for key, value in entries.items():
        data = key.encode()
        out.append(struct.pack(">H", len(data)) + data + struct.pack(">I", len(value)) + value)
    return b"".join(out)


def unpack(data: object, what: str) -> dict[str, bytes]:
    """The map :func:`pack` made.

    Raises:
        ProtocolError: not bytes, truncated, an id that is not UTF-8 or longer than ``MAX_ID_BYTES``, or repeated.
    """
    if not isinstance(data, bytes):
        raise ProtocolError(f"secure aggregation: the {what} field is missing or not bytes")
    out: dict[str, bytes] = {}
    at = 0
    try:
        while at < len(data):
            (size,) = struct.unpack_from(">H", data, at)
            if not 0 < size <= MAX_ID_BYTES or at + 2 + size > len(data):
                raise ProtocolError(f"secure aggregation: a client id in {what} is empty, too long or truncated")
            key = data[at + 2 : at + 2 + size].decode()
            at += 2 + size
            (length,) = struct.unpack_from(">I", data, at)
            if at + 4 + length > len(data):
                raise ProtocolError(f"secure aggregation: a value in {what} is truncated")
            if key in out:
                raise ProtocolError(f"secure aggregation: {what} names a client twice")
            out[key] = data[at + 4 : at + 4 + length]
            at += 4 + length
    except (struct.error, UnicodeDecodeError):
        raise ProtocolError(f"secure aggregation: the {what} field is malformed") from None
    return out


def _int(fields: Mapping[str, StageValue], name: str) -> int:
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"secure aggregation: the field {name!r} is missing or not an int")
    return value


def _bytes(fields: Mapping[str, StageValue], name: str) -> bytes:
    value = fields.get(name)
    if not isinstance(value, bytes):
        raise ProtocolError(f"secure aggregation: the field {name!r} is missing or not bytes")
    return value


def _str(fields: Mapping[str, StageValue], name: str) -> str:
    value = fields.get(name)
    if not isinstance(value, str):
        raise ProtocolError(f"secure aggregation: the field {name!r} is missing or not text")
    return value


def server_stage(
    message: ServerMessage, *, attempt: int, rounding_seed: bytes, settings: Mapping[str, float] | None = None
) -> StageIns:
    """The stage instruction carrying ``message`` (stage 1 also carries the run's ``rounding_seed`` and the round's
    ``settings``, :data:`SETTING_PREFIX`)."""
    fields: dict[str, StageValue]
    if isinstance(message, AdvertiseKeysIns):
        p = message.params
        fields = {name: getattr(p, name) for name in _PARAMS}
        fields |= {
            "clip": float(p.clip).hex(),
            "participants": pack(dict.fromkeys(message.participants, b"")),
            "graph_seed": message.graph_seed,
            "spec": json.dumps([[s.name, list(s.shape), s.dtype] for s in message.spec]),
            "rounding_seed": rounding_seed,
        }
        fields |= {SETTING_PREFIX + name: float(value).hex() for name, value in (settings or {}).items()}
    elif isinstance(message, ShareKeysIns):
        fields = {"public_keys": pack({p: enc + mask for p, (enc, mask) in message.public_keys.items()})}
    elif isinstance(message, MaskedInputIns):
        fields = {"ciphertexts": pack(message.ciphertexts)}
    else:
        fields = {
            "survivors": pack(dict.fromkeys(message.survivors, b"")),
            "dropped": pack(dict.fromkeys(message.dropped, b"")),
        }
    return StageIns(round=message.round, attempt=attempt, protocol=PROTOCOL, name=message.stage.value, fields=fields)


def read_server_stage(ins: StageIns) -> tuple[ServerMessage, bytes]:
    """The SecAgg+ message a stage instruction carries, and the rounding seed (stage 1; else empty).

    Raises:
        ProtocolError: an unknown stage, or fields that are missing or malformed.
    """
    f = ins.fields
    if ins.name == Stage.ADVERTISE_KEYS.value:
        clip_text = _str(f, "clip")
        try:
            clip = float.fromhex(clip_text)
            raw_spec = json.loads(_str(f, "spec"))
            spec = tuple(TensorSpec(str(n), tuple(int(d) for d in shape), str(dtype)) for n, shape, dtype in raw_spec)
        except (ValueError, TypeError, OverflowError) as exc:
            raise ProtocolError(f"secure aggregation: the round's clip or spec is malformed: {exc}") from None
        if not math.isfinite(clip):
            raise ProtocolError("secure aggregation: the round's clip is not finite")
        params = RoundParams(**{name: _int(f, name) for name in _PARAMS}, clip=clip)
        message: ServerMessage = AdvertiseKeysIns(
            round=ins.round,
            params=params,
            participants=tuple(unpack(f.get("participants"), "participants")),
            graph_seed=_bytes(f, "graph_seed"),
            spec=spec,
            attempt=ins.attempt,
        )
        return message, _bytes(f, "rounding_seed")
    if ins.name == Stage.SHARE_KEYS.value:
        keys = unpack(f.get("public_keys"), "public keys")
        return ShareKeysIns(round=ins.round, public_keys={p: (k[:32], k[32:]) for p, k in keys.items()}), b""
    if ins.name == DELIVER_SHARES:
        return MaskedInputIns(round=ins.round, ciphertexts=unpack(f.get("ciphertexts"), "ciphertexts")), b""
    if ins.name == Stage.UNMASK.value:
        survivors = tuple(unpack(f.get("survivors"), "survivors"))
        return UnmaskIns(round=ins.round, survivors=survivors, dropped=tuple(unpack(f.get("dropped"), "dropped"))), b""
    raise ProtocolError(f"secure aggregation has no stage {ins.name[:64]!r}")


def read_settings(ins: StageIns) -> dict[str, float]:
    """The round settings stage 1 announces (``name -> value``; empty when there are none).

    Raises:
        ProtocolError: a setting that is not a finite float's hex text.
    """
    out: dict[str, float] = {}
    for name, value in ins.fields.items():
        if not name.startswith(SETTING_PREFIX):
            continue
        try:
            number = float.fromhex(value) if isinstance(value, str) else math.nan
        except (ValueError, OverflowError):
            number = math.nan
        if not math.isfinite(number):
            raise ProtocolError(f"secure aggregation: the round setting {name[:64]!r} is not a finite number")
        out[name[len(SETTING_PREFIX) :]] = number
    return out


def client_stage(
    message: AdvertiseKeysRes | ShareKeysRes | UnmaskRes | None, ins: StageIns, client_id: str
) -> StageRes:
    """The stage reply carrying ``message`` (None: the acknowledgement of the shares' delivery)."""
    fields: dict[str, StageValue]
    if isinstance(message, AdvertiseKeysRes):
        fields = {"encryption_key": message.encryption_key, "mask_key": message.mask_key}
    elif isinstance(message, ShareKeysRes):
        fields = {"ciphertexts": pack(message.ciphertexts)}
    elif isinstance(message, UnmaskRes):
        fields = {"seed_shares": pack(message.seed_shares), "key_shares": pack(message.key_shares)}
    else:
        fields = {}
    return StageRes(
        round=ins.round, attempt=ins.attempt, protocol=PROTOCOL, name=ins.name, client_id=client_id, fields=fields
    )


def read_client_stage(res: StageRes) -> AdvertiseKeysRes | ShareKeysRes | UnmaskRes | None:
    """The SecAgg+ reply a stage reply carries (None for the acknowledgement of the shares' delivery).

    Raises:
        ProtocolError: an unknown stage, or fields that are missing or malformed.
    """
    f, cid = res.fields, res.client_id
    if res.name == Stage.ADVERTISE_KEYS.value:
        return AdvertiseKeysRes(
            round=res.round, client_id=cid, encryption_key=_bytes(f, "encryption_key"), mask_key=_bytes(f, "mask_key")
        )
    if res.name == Stage.SHARE_KEYS.value:
        return ShareKeysRes(round=res.round, client_id=cid, ciphertexts=unpack(f.get("ciphertexts"), "ciphertexts"))
    if res.name == DELIVER_SHARES:
        if f or res.tensors:
            raise ProtocolError("secure aggregation: the acknowledgement of the shares carries nothing")
        return None
    if res.name == Stage.UNMASK.value:
        return UnmaskRes(
            round=res.round,
            client_id=cid,
            seed_shares=unpack(f.get("seed_shares"), "seed shares"),
            key_shares=unpack(f.get("key_shares"), "key shares"),
        )
    raise ProtocolError(f"secure aggregation has no stage {res.name[:64]!r}")
