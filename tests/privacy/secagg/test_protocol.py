"""SecAgg+ rounds driven in memory: exact sums, dropouts at every stage, aborts, privacy checks, refusals, sizes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import pytest
from scipy import stats

from fedcore.errors import ConfigError, ProtocolError, RoundFailed, UpdateRejected
from fedcore.tensors import TensorSpec, spec_of
from privacy.secagg import (
    AdvertiseKeysIns,
    AdvertiseKeysRes,
    ClientMessage,
    MaskedInputIns,
    MaskedInputRes,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    ServerMessage,
    ShareKeysIns,
    Stage,
    UnmaskIns,
    UnmaskRes,
)
from privacy.secagg.client import rounding_key
from privacy.secagg.inmemory import run_round
from privacy.secagg.messages import max_payload_bytes
from privacy.secagg.quantize import quantize, vector_length

GRAPH_SEED = bytes(range(32))
Updates = dict[str, tuple[dict[str, np.ndarray], int]]


def _updates(n: int, *, seed: int = 0, scale: float = 0.5) -> Updates:
    rng = np.random.default_rng(seed)
    return {
        f"client-{i}": (
            {
                "layer.weight": (rng.standard_normal((4, 3)) * scale).astype(np.float32),
                "layer.bias": (rng.standard_normal(5) * scale).astype(np.float32),
            },
            int(rng.integers(1, 200)),
        )
        for i in range(n)
    }


def _seeds(updates: Mapping[str, object]) -> dict[str, bytes]:
    return {cid: bytes([i % 256]) * 32 for i, cid in enumerate(updates)}


def _spec(updates: Updates) -> tuple[TensorSpec, ...]:
    return spec_of(next(iter(updates.values()))[0])


def _check_exact(
    result_sum: np.ndarray, config: SecAggConfig, updates: Updates, survivors: set[str], *, round: int = 1
) -> None:
    """The unmasked sum equals the field sum of the survivors' quantized uploads, element for element."""
    params = config.resolve(len(updates))
    spec = _spec(updates)
    seeds = _seeds(updates)
    expected = np.zeros(vector_length(spec), dtype=np.uint64)
    for cid in survivors:
        update, weight = updates[cid]
        expected += quantize(update, weight, params, spec, rounding_key(seeds[cid], round, cid))
    expected &= np.uint64(params.modulus_mask)
    assert np.array_equal(result_sum.astype(np.uint64), expected)


def _float_mean(updates: Updates, survivors: set[str], clip: float) -> dict[str, np.ndarray]:
    total = sum(updates[c][1] for c in survivors)
    return {
        name: np.asarray(
            sum(np.clip(updates[c][0][name].astype(np.float64), -clip, clip) * updates[c][1] for c in survivors)
        )
        / total
        for name in (s.name for s in _spec(updates))
    }


@pytest.mark.parametrize("n", [2, 3, 10, 50])
def test_secure_sum_is_exact_and_the_mean_is_fedavg_within_the_bound(n: int) -> None:
    updates = _updates(n)
    config = SecAggConfig()
    result = run_round(config, updates, _spec(updates), rounding_seeds=_seeds(updates), graph_seed=GRAPH_SEED)
    assert set(result.survivors) == set(updates) and result.dropped == ()
    _check_exact(result.field_sum, config, updates, set(updates))
    assert result.total_weight == sum(w for _, w in updates.values())
    mean = result.mean(_spec(updates))
    reference = _float_mean(updates, set(updates), config.clip)
    bound = config.resolve(n).error_bound
    for name, value in mean.items():
        assert value.dtype == np.float32
        assert np.abs(value - reference[name]).max() <= bound + 1e-6


@pytest.mark.parametrize("bits", [16, 20, 64])
def test_other_field_widths_and_a_full_bit_budget(bits: int) -> None:
    """Every client at the maximum weight with every coordinate at +clip fills the budget without overflowing."""
    n = 10
    config = SecAggConfig(field_bits=bits, max_weight=100, quantization_levels=65 if bits == 16 else None)
    updates = {f"c{i}": ({"w": np.full(7, 3.0, np.float32)}, 100) for i in range(n)}
    result = run_round(config, updates, _spec(updates), rounding_seeds=_seeds(updates))
    params = config.resolve(n)
    assert result.field_sum.dtype == params.dtype
    assert result.field_sum[:-1].tolist() == [n * 100 * params.levels] * 7
    assert result.mean(_spec(updates))["w"].tolist() == [1.0] * 7  # clipped to +1


def _neighbours(n: int, config: SecAggConfig) -> dict[str, frozenset[str]]:
    ids = [f"client-{i}" for i in range(n)]
    spec = (TensorSpec("w", (1,), "float32"),)
    return SecAggServer(config, round=1, clients=ids, spec=spec, graph_seed=GRAPH_SEED).neighbours


@pytest.mark.parametrize("stage", [Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_INPUT, Stage.UNMASK])
def test_dropouts_at_each_stage_up_to_the_limit(stage: Stage) -> None:
    """k = 7, t = 4: three of one client's neighbours may vanish at any stage. Before sharing they are left out;
    after sharing (no masked input) their masks are recovered; silent at unmask, their inputs are in the sum."""
    updates = _updates(10)
    config = SecAggConfig()
    gone = set(sorted(_neighbours(10, config)["client-0"])[:3])
    result = run_round(
        config,
        updates,
        _spec(updates),
        dropouts={stage: gone},
        rounding_seeds=_seeds(updates),
        graph_seed=GRAPH_SEED,
    )
    in_sum = set(updates) if stage is Stage.UNMASK else set(updates) - gone
    assert set(result.survivors) == in_sum
    assert set(result.dropped) == (gone if stage is Stage.COLLECT_MASKED_INPUT else set())
    _check_exact(result.field_sum, config, updates, in_sum)
    reference = _float_mean(updates, in_sum, config.clip)
    for name, value in result.mean(_spec(updates)).items():
        assert np.abs(value - reference[name]).max() <= config.resolve(10).error_bound + 1e-6


@pytest.mark.parametrize("stage", [Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_INPUT, Stage.UNMASK])
def test_one_dropout_too_many_aborts_and_reveals_nothing(stage: Stage) -> None:
    updates = _updates(10)
    config = SecAggConfig()
    gone = set(sorted(_neighbours(10, config)["client-0"])[:4])  # 4 > k - t = 3
    replies: list[ClientMessage] = []
    with pytest.raises(RoundFailed, match=r"aborted, nothing is revealed.*fewer than the threshold 4") as caught:
        run_round(
            config,
            updates,
            _spec(updates),
            dropouts={stage: gone},
            graph_seed=GRAPH_SEED,
            on_reply=replies.append,
        )
    assert caught.value.stage == stage.value
    if stage is not Stage.UNMASK:  # the server saw it coming: nobody was asked to reveal a share
        assert not any(isinstance(r, UnmaskRes) for r in replies)


@pytest.mark.parametrize("stage", [Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_INPUT])
def test_a_round_never_unmasks_a_single_update(stage: Stage) -> None:
    updates = _updates(2)  # k = 1, t = 1: one client alone would make the "sum" its own update
    with pytest.raises(RoundFailed, match=r"fewer than max\(2, threshold 1\); a sum of fewer than 2 updates"):
        run_round(SecAggConfig(), updates, _spec(updates), dropouts={stage: {"client-1"}})


def _start_round(
    n: int, config: SecAggConfig, *, round: int = 1
) -> tuple[SecAggServer, dict[str, SecAggClient], Updates]:
    updates = _updates(n)
    server = SecAggServer(config, round=round, clients=list(updates), spec=_spec(updates), graph_seed=GRAPH_SEED)
    seeds = _seeds(updates)
    return server, {cid: SecAggClient(cid, rounding_seed=seeds[cid]) for cid in updates}, updates


def _exchange(
    server: SecAggServer, clients: dict[str, SecAggClient], updates: Updates, outbox: Mapping[str, ServerMessage]
) -> dict[str, ServerMessage]:
    for cid, message in outbox.items():
        update, weight = updates[cid]
        server.receive(clients[cid].handle(message, update=update, weight=weight))
    return server.advance()


def test_shares_can_travel_ahead_of_the_masking() -> None:
    """Stage 3 in two halves (shares with the fit instruction, masking on the fit result) gives the same sum."""
    config = SecAggConfig()
    server, clients, updates = _start_round(10, config)
    outbox = server.start()
    for _ in range(2):
        outbox = _exchange(server, clients, updates, outbox)
    for cid, message in outbox.items():
        assert isinstance(message, MaskedInputIns)
        with pytest.raises(ProtocolError, match="after the neighbours' shares arrived"):
            clients[cid].mask(*updates[cid])
        clients[cid].receive_shares(message)
    for cid in outbox:
        with pytest.raises(ProtocolError, match="arrived twice"):
            clients[cid].receive_shares(outbox[cid])  # type: ignore[arg-type]
        server.receive(clients[cid].mask(*updates[cid]))
        with pytest.raises(ProtocolError, match="masked only once"):
            clients[cid].mask(*updates[cid])
    outbox = server.advance()
    _exchange(server, clients, updates, outbox)
    _check_exact(server.result.field_sum, config, updates, set(updates))


def test_a_masked_upload_looks_uniform_and_uncorrelated() -> None:
    """What the server holds of one client is uniform over the field and independent of the update."""
    n, size = 10, 40_000
    rng = np.random.default_rng(1)
    updates = {f"c{i}": ({"w": rng.uniform(-1, 1, size).astype(np.float32)}, 50) for i in range(n)}
    updates["c0"] = ({"w": np.zeros(size, np.float32)}, 50)  # a constant input: all structure must come from masks
    uploads: dict[str, np.ndarray] = {}

    def keep(reply: ClientMessage) -> None:
        if isinstance(reply, MaskedInputRes):
            uploads[reply.client_id] = reply.masked.copy()

    config = SecAggConfig()
    run_round(config, updates, _spec(updates), on_reply=keep)
    params = config.resolve(n)
    for cid in ("c0", "c1"):
        masked = uploads[cid][:-1]
        assert masked.dtype == np.dtype("<u4")
        plain = quantize(updates[cid][0], 50, params, _spec(updates), bytes(32))
        assert np.count_nonzero(masked == plain[:-1]) < 5  # about size / 2^32 coincidences expected
        counts = np.bincount(masked >> 24, minlength=256)  # top byte: 256 equally likely bins
        assert stats.chisquare(counts).pvalue > 1e-4
        low = np.bincount(masked & 0xFF, minlength=256)  # low byte
        assert stats.chisquare(low).pvalue > 1e-4
        if cid == "c1":
            corr = np.corrcoef(masked.astype(np.float64), updates[cid][0]["w"].astype(np.float64))[0, 1]
            assert abs(corr) < 5 / np.sqrt(size)
    # the same test rejects the unmasked quantized input: it has power
    plain = quantize(updates["c1"][0], 50, params, _spec(updates), bytes(32))[:-1]
    assert stats.chisquare(np.bincount(plain >> 24, minlength=256)).pvalue < 1e-10


def test_tampered_share_ciphertext_is_refused_and_its_receiver_recovered() -> None:
    updates = _updates(10)
    config = SecAggConfig()
    victim = "client-3"

    def flip(cid: str, message: ServerMessage) -> ServerMessage:
        if cid == victim and isinstance(message, MaskedInputIns):
            sender, ciphertext = next(iter(message.ciphertexts.items()))
            bad = bytearray(ciphertext)
            bad[40] ^= 0x01
            return dataclasses.replace(message, ciphertexts={**message.ciphertexts, sender: bytes(bad)})
        return message

    result = run_round(
        config, updates, _spec(updates), tamper=flip, rounding_seeds=_seeds(updates), graph_seed=GRAPH_SEED
    )
    assert result.dropped == (victim,)  # it refused, sent nothing, and its masks were removed
    _check_exact(result.field_sum, config, updates, set(updates) - {victim})


def test_client_refuses_replays_outsiders_and_out_of_order_messages() -> None:
    config = SecAggConfig()
    server, clients, updates = _start_round(10, config, round=1)
    outbox = _exchange(server, clients, updates, server.start())
    share_ins = outbox["client-0"]
    assert isinstance(share_ins, ShareKeysIns)
    outsider = next(c for c in updates if c != "client-0" and c not in server.neighbours["client-0"])
    with pytest.raises(ProtocolError, match="outside this client's neighbourhood"):
        clients["client-0"].handle(
            dataclasses.replace(share_ins, public_keys={**share_ins.public_keys, outsider: (b"a" * 32, b"b" * 32)})
        )
    with pytest.raises(ProtocolError, match="round 2 arrived in round 1"):
        clients["client-0"].handle(dataclasses.replace(share_ins, round=2))
    with pytest.raises(ProtocolError, match="not all distinct"):
        twin = next(iter(share_ins.public_keys))
        clients["client-0"].handle(
            dataclasses.replace(share_ins, public_keys={p: share_ins.public_keys[twin] for p in share_ins.public_keys})
        )
    outbox = _exchange(server, clients, updates, outbox)
    masked_ins = outbox["client-0"]
    assert isinstance(masked_ins, MaskedInputIns)
    with pytest.raises(ProtocolError, match="advertise_keys message arrived while the client is at stage"):
        clients["client-0"].handle(AdvertiseKeysIns(1, server.params, server.clients, GRAPH_SEED, server.spec))
    with pytest.raises(ProtocolError, match="outside this client's neighbourhood"):
        clients["client-0"].handle(
            dataclasses.replace(masked_ins, ciphertexts={**masked_ins.ciphertexts, outsider: bytes(160)}),
            update=updates["client-0"][0],
            weight=updates["client-0"][1],
        )
    # a ciphertext from a neighbour's round-1 message replayed into a fresh round 2 between the same ids
    server2, clients2, _ = _start_round(10, config, round=2)
    outbox2 = _exchange(server2, clients2, updates, server2.start())
    outbox2 = _exchange(server2, clients2, updates, outbox2)
    masked2 = outbox2["client-0"]
    assert isinstance(masked2, MaskedInputIns)
    replayed = {p: masked_ins.ciphertexts.get(p, c) for p, c in masked2.ciphertexts.items()}
    with pytest.raises(ProtocolError, match="failed authentication"):
        clients2["client-0"].handle(
            dataclasses.replace(masked2, ciphertexts=replayed),
            update=updates["client-0"][0],
            weight=updates["client-0"][1],
        )


def test_a_client_never_reveals_both_shares_of_a_peer() -> None:
    config = SecAggConfig()
    server, clients, updates = _start_round(10, config)
    outbox = server.start()
    for _ in range(3):
        outbox = _exchange(server, clients, updates, outbox)
    request = outbox["client-0"]
    assert isinstance(request, UnmaskIns)
    peer = request.survivors[0]
    with pytest.raises(ProtocolError, match="both survived and dropped"):
        clients["client-0"].handle(dataclasses.replace(request, dropped=(*request.dropped, peer)))
    with pytest.raises(ProtocolError, match="fewer than the threshold"):
        clients["client-0"].handle(dataclasses.replace(request, survivors=request.survivors[:1]))
    reply = clients["client-0"].handle(request)
    assert isinstance(reply, UnmaskRes) and set(reply.seed_shares) == set(request.survivors) and not reply.key_shares
    flipped = UnmaskIns(round=1, survivors=(), dropped=request.survivors)
    with pytest.raises(ProtocolError, match="unmask message arrived while the client is at stage done"):
        clients["client-0"].handle(flipped)


def test_server_rejects_bad_replies_and_keeps_nothing_of_them() -> None:
    config = SecAggConfig()
    server, clients, updates = _start_round(10, config)
    outbox = server.start()
    keys = clients["client-0"].handle(outbox["client-0"])
    assert isinstance(keys, AdvertiseKeysRes)
    server.receive(keys)
    with pytest.raises(UpdateRejected, match="already advertised by another client"):
        server.receive(dataclasses.replace(keys, client_id="client-1"))
    with pytest.raises(UpdateRejected, match="two distinct 32-byte"):
        server.receive(dataclasses.replace(keys, client_id="client-2", mask_key=b"short"))
    with pytest.raises(ProtocolError, match="not a server message"):
        clients["client-0"].handle(keys)  # type: ignore[arg-type]
    server, clients, updates = _start_round(10, config)
    outbox = server.start()
    for _ in range(2):
        outbox = _exchange(server, clients, updates, outbox)
    update, weight = updates["client-0"]
    good = clients["client-0"].handle(outbox["client-0"], update=update, weight=weight)
    assert isinstance(good, MaskedInputRes)
    for bad in (
        dataclasses.replace(good, masked=good.masked.astype(np.uint64)),  # widened to 64 bits
        dataclasses.replace(good, masked=good.masked[:-1]),
        dataclasses.replace(good, round=2),
        dataclasses.replace(good, client_id="stranger"),
    ):
        with pytest.raises(UpdateRejected):
            server.receive(bad)
    server.receive(good)
    with pytest.raises(UpdateRejected, match="second reply"):
        server.receive(good)


def test_server_refuses_bad_rounds_before_any_message() -> None:
    spec = (TensorSpec("w", (3,), "float32"),)
    with pytest.raises(ConfigError, match="n·k must be even"):
        SecAggServer(SecAggConfig(neighbours=3), round=1, clients=[f"c{i}" for i in range(11)], spec=spec)
    with pytest.raises(ConfigError, match="repeat"):
        SecAggServer(SecAggConfig(), round=1, clients=["a", "b", "a"], spec=spec)
    with pytest.raises(ConfigError, match="UTF-8 bytes"):
        SecAggServer(SecAggConfig(), round=1, clients=["a", "x" * 200], spec=spec)
    with pytest.raises(ConfigError, match="float tensors"):
        SecAggServer(SecAggConfig(), round=1, clients=["a", "b"], spec=(TensorSpec("n", (), "int64"),))
    with pytest.raises(ConfigError, match="overflow"):
        SecAggServer(SecAggConfig(field_bits=12), round=1, clients=[f"c{i}" for i in range(10)], spec=spec)


def test_every_message_is_within_its_size_bound() -> None:
    n = 10
    updates = _updates(n)
    config = SecAggConfig()
    params = config.resolve(n)
    length = vector_length(_spec(updates))
    seen: list[tuple[Stage, int, bool]] = []

    def record_in(cid: str, message: ServerMessage) -> ServerMessage:
        seen.append((message.stage, message.payload_bytes(), True))
        return message

    def record_out(reply: ClientMessage) -> None:
        seen.append((reply.stage, reply.payload_bytes(), False))

    gone = {Stage.COLLECT_MASKED_INPUT: {"client-4"}}
    run_round(config, updates, _spec(updates), tamper=record_in, on_reply=record_out, dropouts=gone)
    assert {stage for stage, _, _ in seen} == {
        Stage.ADVERTISE_KEYS,
        Stage.SHARE_KEYS,
        Stage.COLLECT_MASKED_INPUT,
        Stage.UNMASK,
    }
    for stage, size, from_server in seen:
        assert 0 < size <= max_payload_bytes(stage, params, length, from_server=from_server)
    float_bytes = sum(a.nbytes for a in updates["client-0"][0].values())
    uploads = [size for stage, size, from_server in seen if stage is Stage.COLLECT_MASKED_INPUT and not from_server]
    assert uploads and all(size == float_bytes + 4 for size in uploads)  # uint32 per float32, plus the weight
