"""SecAgg+ messages as stage messages: packed id maps by hand, round trips, and malformed input refused with
ProtocolError (by the client machine, and by the server side, which then drops the sender)."""

from __future__ import annotations

import numpy as np
import pytest

from fedcore.errors import ProtocolError
from fedcore.messages import StageIns, StageRes
from fedcore.stages import Phase
from fedcore.tensors import TensorSpec
from privacy.secagg.codec import (
    PROTOCOL,
    pack,
    read_client_stage,
    read_server_stage,
    read_settings,
    server_stage,
    unpack,
)
from privacy.secagg.config import SecAggConfig
from privacy.secagg.messages import AdvertiseKeysIns, ShareKeysIns
from privacy.secagg.rounds import SecAggAggregator, SecAggClientMachine, SecureAggregation


def test_pack_lays_out_length_prefixed_records() -> None:
    assert pack({"ab": b"\x01\x02\x03", "c": b""}) == b"\x00\x02ab\x00\x00\x00\x03\x01\x02\x03\x00\x01c\x00\x00\x00\x00"
    assert unpack(pack({"ab": b"\x01\x02\x03", "c": b""}), "x") == {"ab": b"\x01\x02\x03", "c": b""}
    assert unpack(b"", "x") == {}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x00\x02ab\x00\x00\x00\x05\x01", "truncated"),  # value shorter than its length
        (b"\x00\x05ab", "too long or truncated"),  # id shorter than its length
        (b"\x00\x00\x00\x00\x00\x00", "empty"),  # empty id
        (b"\x00\x01a\x00\x00\x00\x00\x00\x01a\x00\x00\x00\x00", "twice"),
        (b"\x00\x01\xff\x00\x00\x00\x00", "malformed"),  # not UTF-8
        (b"\x00\x01a\x00", "malformed"),  # length field cut
        ("text", "not bytes"),
    ],
)
def test_malformed_maps_are_refused(data: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        unpack(data, "ciphertexts")


def test_stage_one_round_trips_with_the_exact_clip_and_spec() -> None:
    params = SecAggConfig(clip=0.1, field_bits=40).resolve(4)
    spec = (TensorSpec("w", (3, 2), "float32"), TensorSpec("b", (3,), "float64"))
    message = AdvertiseKeysIns(
        round=7, params=params, participants=("a", "b", "c", "d"), graph_seed=b"g" * 32, spec=spec, attempt=2
    )
    ins = server_stage(message, attempt=2, rounding_seed=b"r" * 32)
    assert (ins.protocol, ins.name, ins.round, ins.attempt) == (PROTOCOL, "advertise_keys", 7, 2)
    back, seed = read_server_stage(ins)
    assert back == message and seed == b"r" * 32
    keys = ShareKeysIns(round=7, public_keys={"b": (b"e" * 32, b"m" * 32)})
    assert read_server_stage(server_stage(keys, attempt=2, rounding_seed=b""))[0] == keys
    # round settings (adaptive clipping's norm) ride along with stage 1, exactly, and only there
    assert read_settings(ins) == {}
    announced = server_stage(message, attempt=2, rounding_seed=b"", settings={"dp_clipping_norm": 0.1 + 0.2})
    assert announced.fields["setting.dp_clipping_norm"] == (0.1 + 0.2).hex()
    assert read_settings(announced) == {"dp_clipping_norm": 0.30000000000000004}
    assert read_server_stage(announced)[0] == message
    assert "setting.x" not in server_stage(keys, attempt=2, rounding_seed=b"", settings={"x": 1.0}).fields
    for garbled in ("inf", "0x1p+1025", "half", b"1"):
        bad = StageIns(round=7, attempt=2, protocol=PROTOCOL, name="advertise_keys", fields={"setting.c": garbled})
        with pytest.raises(ProtocolError, match="not a finite number"):
            read_settings(bad)


def test_a_client_refuses_a_garbled_stage_and_the_server_drops_a_garbled_reply() -> None:
    machine = SecAggClientMachine("a")
    bad = StageIns(round=1, attempt=1, protocol=PROTOCOL, name="advertise_keys", fields={"clip": "0x1p-1"})
    with pytest.raises(ProtocolError, match="missing"):
        machine.handle(bad)
    with pytest.raises(ProtocolError, match="before the round's keys"):
        machine.handle(StageIns(round=1, attempt=1, protocol=PROTOCOL, name="share_keys", fields={"public_keys": b""}))
    with pytest.raises(ProtocolError, match="no stage"):
        read_client_stage(StageRes(round=1, attempt=1, protocol=PROTOCOL, name="other", client_id="a"))

    protocol = SecureAggregation(SecAggConfig())
    aggregator: SecAggAggregator = protocol.aggregator
    spec = (TensorSpec("w", (2,), "float32"),)
    aggregator.start(spec, round=1, reference={"w": np.zeros(2, np.float32)})
    stages = protocol.start(round=1, attempt=1, clients=list("abcdef"), seed=0)  # k = 5, t = 3
    exchange = stages.next_exchange(Phase.BEFORE_FIT)
    assert (
        exchange is not None and exchange.name == "advertise_keys" and sorted(exchange.instructions) == list("abcdef")
    )
    good = {cid: {"encryption_key": bytes([i]) * 32, "mask_key": bytes([i + 9]) * 32} for i, cid in enumerate("cdef")}
    replies = {
        cid: StageRes(round=1, attempt=1, protocol=PROTOCOL, name="advertise_keys", client_id=cid, fields=fields)
        for cid, fields in {
            "a": {"encryption_key": b"short", "mask_key": b"k" * 32},  # wrong key size
            "b": {"mask_key": b"k" * 32},  # missing key
            **good,
        }.items()
    }
    refused = stages.receive("advertise_keys", replies, {})
    assert sorted(refused) == ["a", "b"]
    assert "32-byte" in refused["a"] and "encryption_key" in refused["b"]
    exchange = stages.next_exchange(Phase.BEFORE_FIT)
    assert exchange is not None and exchange.name == "share_keys" and sorted(exchange.instructions) == list("cdef")
