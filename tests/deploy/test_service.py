"""The gRPC pool and service in one process on 127.0.0.1: bad updates, limits, liveness, authentication, state."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple, cast

import grpc
import numpy as np
import pytest

from fedcore.cli import build_parser, client_options
from fedcore.errors import RoundFailed
from fedcore.messages import Failure, FitIns, FitRes
from fedcore.options import given_values
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.proto.v1 import fedcore_pb2_grpc as pb_grpc
from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig
from fedcore.task import FitConfig
from fedcore.tensors import NamedArrays, decode, encode
from fedcore.wire import iter_bytes_chunks, session_metadata
from privacy.tls import init_certs
from server.config import RoundSettings, ServerConfig, TlsSettings
from server.grpc_pool import GrpcClientPool, PoolConfig
from server.limits import ServiceLimits
from server.metrics import ServerMetrics
from server.round_loop import RoundConfig, RoundRecord, ServerState, run_rounds
from server.service import AuthPolicy, CoordinatorService, build_server, hash_token, load_tokens
from server.state import StateStore, load_checkpoint

pytestmark = pytest.mark.timeout(60)

GLOBAL: NamedArrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, dtype=np.float32)}


class Harness:
    def __init__(
        self,
        tmp: Path,
        *,
        auth: AuthPolicy | None = None,
        credentials: object = None,
        limits: ServiceLimits | None = None,
        **pool_kw: object,
    ) -> None:
        self.metrics = ServerMetrics()
        self.pool = GrpcClientPool(PoolConfig(spill_dir=tmp / "spill", **pool_kw), self.metrics)  # type: ignore[arg-type]
        service = CoordinatorService(self.pool, auth or AuthPolicy(), self.metrics, limits)
        self.server, self.port = build_server(
            service, "127.0.0.1:0", credentials=credentials, max_workers=16, chunk_bytes=self.pool.config.chunk_bytes
        )
        self.server.start()

    def stub(self, channel_credentials: grpc.ChannelCredentials | None = None) -> pb_grpc.CoordinatorStub:
        target = f"127.0.0.1:{self.port}"
        if channel_credentials is None:
            channel = grpc.insecure_channel(target)
        else:
            channel = grpc.secure_channel(
                target, channel_credentials, options=[("grpc.ssl_target_name_override", "localhost")]
            )
        return pb_grpc.CoordinatorStub(channel)

    def close(self) -> None:
        self.server.stop(0)
        self.pool.close()


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    # liveness 5 s: these clients send no heartbeats, and a stall of a loaded CI machine must not drop them
    h = Harness(tmp_path, max_payload_bytes=4096, chunk_bytes=1024, heartbeat_interval_s=0.2, liveness_timeout_s=5.0)
    yield h
    h.close()


def _pull(stub: pb_grpc.CoordinatorStub, session: str) -> tuple[pb.TaskHeader, NamedArrays]:
    for _ in range(50):
        chunks = list(
            stub.PullTask(pb.PullTaskRequest(session=session, wait_s=0.5), metadata=session_metadata(session))
        )
        if chunks[0].WhichOneof("body") == "header":
            data = b"".join(c.data for c in chunks[1:-1])
            assert hashlib.sha256(data).digest() == chunks[-1].trailer.sha256
            return chunks[0].header, decode(data)
    raise AssertionError("no task")


def result_header_chunk(
    session: str,
    header: pb.TaskHeader,
    announce: int,
    *,
    num_examples: int = 10,
    metrics: dict[str, float] | None = None,
) -> pb.ResultChunk:
    """The first message of a push of a fit result for the task ``header``, announcing ``announce`` bytes."""
    return pb.ResultChunk(
        header=pb.ResultHeader(
            session=session,
            task_id=header.task_id,
            round=header.round,
            stage=pb.STAGE_FIT,
            num_examples=num_examples,
            payload_bytes=announce,
            metrics=metrics or {},
        )
    )


def _push(
    stub: pb_grpc.CoordinatorStub,
    session: str,
    header: pb.TaskHeader,
    payload: bytes,
    *,
    announce: int | None = None,
    send: bytes | None = None,
    digest: bytes | None = None,
    num_examples: int = 10,
    extra: list[pb.ResultChunk] | None = None,
    metrics: dict[str, float] | None = None,
) -> pb.PushReply:
    body = payload if send is None else send

    def stream() -> Iterator[pb.ResultChunk]:
        announced = len(payload) if announce is None else announce
        yield result_header_chunk(session, header, announced, num_examples=num_examples, metrics=metrics)
        for piece in iter_bytes_chunks(body, 1024):
            yield pb.ResultChunk(data=piece)
        yield pb.ResultChunk(trailer=pb.Trailer(sha256=digest or hashlib.sha256(payload).digest()))
        yield from extra or []

    return stub.PushResult(stream(), metadata=session_metadata(session))


Behaviour = Callable[[pb_grpc.CoordinatorStub, str, pb.TaskHeader, NamedArrays], pb.PushReply]


def _client(h: Harness, client_id: str, behaviour: Behaviour, out: dict[str, pb.PushReply]) -> threading.Thread:
    stub = h.stub()
    session = stub.Join(pb.JoinRequest(client_id=client_id)).session

    def run() -> None:
        header, params = _pull(stub, session)
        out[client_id] = behaviour(stub, session, header, params)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _good(stub: pb_grpc.CoordinatorStub, session: str, header: pb.TaskHeader, params: NamedArrays) -> pb.PushReply:
    return _push(stub, session, header, encode({k: v + 1 for k, v in params.items()}))


BAD: dict[str, Behaviour] = {
    "wrong-shape": lambda s, ss, h, p: _push(s, ss, h, encode({"w": np.zeros((3, 2), np.float32), "b": p["b"]})),
    "nan": lambda s, ss, h, p: _push(s, ss, h, encode({"w": p["w"] * np.nan, "b": p["b"]})),
    "truncated": lambda s, ss, h, p: _push(s, ss, h, (e := encode(p)), send=e[:-16]),
    "corrupted": lambda s, ss, h, p: _push(s, ss, h, (e := encode(p)), send=e[:-1] + b"\x07"),
    "oversized": lambda s, ss, h, p: _push(s, ss, h, encode(p), announce=10**9),
    "impossible-shape": lambda s, ss, h, p: _push(s, ss, h, _deep_payload()),
    "after-trailer": lambda s, ss, h, p: _push(s, ss, h, encode(p), extra=[pb.ResultChunk(data=b"more")]),
    "empty": lambda s, ss, h, p: _push(s, ss, h, b""),
    "negative-examples": lambda s, ss, h, p: _push(s, ss, h, encode(p), num_examples=-5),
    "short-trailer": lambda s, ss, h, p: _push(s, ss, h, encode(p), digest=b"12345"),
    "metric-flood": lambda s, ss, h, p: _push(s, ss, h, encode(p), metrics={f"m{i}": 1.0 for i in range(300)}),
}


def _deep_payload() -> bytes:
    """A safetensors payload whose one tensor has 65 dimensions of 1: 4 bytes that no array can hold."""
    header = json.dumps({"t": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + bytes(4)


def _round_with_a_good_client(
    harness: Harness, other: str, behaviour: Behaviour
) -> tuple[dict[str, pb.PushReply], RoundRecord]:
    """One round with client "good" (adds 1) and ``other``; checks the global model is the good update alone."""
    replies: dict[str, pb.PushReply] = {}
    threads = [_client(harness, "good", _good, replies), _client(harness, other, behaviour, replies)]
    strategy = Strategy(sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=2), fit=FitConfig())
    final, records = run_rounds(
        harness.pool, strategy, dict(GLOBAL), RoundConfig(num_rounds=1, round_timeout_s=20, wait_for_clients_s=5)
    )
    for t in threads:
        t.join(10)
    for name, value in GLOBAL.items():
        np.testing.assert_array_equal(final.parameters[name], value + 1)
    (record,) = records
    return replies, record


def test_a_round_whose_client_misses_the_deadline_says_to_raise_it(harness: Harness) -> None:
    """Client "mute" takes its task and never replies; under a quorum of 2 the round fails, naming the missed
    deadline, and its advice names the deadline and the quorum (either would let such a round through)."""
    replies: dict[str, pb.PushReply] = {}
    threads = [_client(harness, "good", _good, replies), _client(harness, "mute", lambda *_: pb.PushReply(), replies)]
    strategy = Strategy(sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=2), fit=FitConfig())
    config = RoundConfig(
        num_rounds=1, round_timeout_s=1.5, wait_for_clients_s=5, max_round_attempts=1, min_fit_results=2
    )
    with pytest.raises(RoundFailed) as caught:
        run_rounds(harness.pool, strategy, dict(GLOBAL), config)
    for t in threads:
        t.join(10)
    message = str(caught.value)
    assert "only 1 of 2 selected clients returned a valid update; the quorum is 2" in message, message
    assert "mute: no reply within the round deadline of 1.5 s" in message, message
    assert message.endswith("check the failing clients' logs, lower the quorum, or raise the deadline."), message


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_update_is_rejected_and_the_global_model_is_unchanged_by_it(harness: Harness, kind: str) -> None:
    replies, record = _round_with_a_good_client(harness, "bad", BAD[kind])
    assert record.accepted == ("good",)
    (failure,) = record.failures
    assert failure.client_id == "bad" and failure.round == 1
    reason = {
        "wrong-shape": "shape",
        "nan": "NaN",
        "truncated": "truncated",
        "corrupted": "SHA-256",
        "oversized": "exceeds the limit",
        "impossible-shape": "65 dims",
        "after-trailer": "followed the trailer",
        "empty": "payload is empty",
        "negative-examples": "num_examples is -5",
        "short-trailer": "malformed trailer",
        "metric-flood": "reports 300 metrics; at most 256",
    }[kind]
    assert reason in failure.reason
    if kind not in ("wrong-shape", "nan"):  # checked at push time: the client hears why
        assert not replies["bad"].accepted and reason in replies["bad"].reason
    assert not list((harness.pool.config.spill_dir).glob("*.part"))


def test_an_update_that_does_not_fit_on_disk_is_refused_at_its_first_chunk(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.posix_fallocate

    def disk_full_for_large_updates(fd: int, offset: int, length: int) -> None:
        if "/update-" in os.readlink(f"/proc/self/fd/{fd}") and length > 2000:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    def big(stub: pb_grpc.CoordinatorStub, session: str, header: pb.TaskHeader, params: NamedArrays) -> pb.PushReply:
        return _push(stub, session, header, encode({**params, "extra": np.zeros(300)}))  # 2400 more bytes

    monkeypatch.setattr(os, "posix_fallocate", disk_full_for_large_updates)
    replies, record = _round_with_a_good_client(harness, "big", big)
    assert record.accepted == ("good",)
    assert not replies["big"].accepted and "no room in the spill directory" in replies["big"].reason
    assert not list(harness.pool.config.spill_dir.glob("*.part"))


@pytest.mark.parametrize("client_id", ["a/b", "x/../../y", "é" * 250])
def test_any_client_id_that_may_join_can_push(harness: Harness, client_id: str) -> None:
    replies, record = _round_with_a_good_client(harness, client_id, _good)
    assert replies[client_id].accepted and sorted(record.accepted) == sorted(["good", client_id])


def test_silent_client_fails_fast_and_late_push_is_discarded(tmp_path: Path) -> None:
    harness = Harness(tmp_path, heartbeat_interval_s=0.2, liveness_timeout_s=1.0)
    try:
        _silent_client_fails_fast(harness)
    finally:
        harness.close()


def _silent_client_fails_fast(harness: Harness) -> None:
    stub = harness.stub()
    session = stub.Join(pb.JoinRequest(client_id="quiet")).session
    ins = FitIns(round=1, parameters=dict(GLOBAL), config=FitConfig(), seed=0)
    started = time.monotonic()
    replies = list(harness.pool.run({"quiet": ins}, timeout_s=30))
    assert time.monotonic() - started < 5
    (reply,) = replies
    assert isinstance(reply, Failure) and "no heartbeat" in reply.reason
    assert harness.pool.available() == []
    assert harness.metrics.dropped._value.get() == 1
    with pytest.raises(grpc.RpcError) as info:
        stub.Heartbeat(pb.HeartbeatRequest(session=session), metadata=session_metadata(session))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        list(stub.PullTask(pb.PullTaskRequest(session=session, wait_s=0.1), metadata=session_metadata(session)))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_result_pushed_after_its_client_was_dropped_is_not_reported_taken(harness: Harness) -> None:
    # the daemon's session ends mid-round (here it leaves; a network cut past the liveness timeout does the same):
    # the round fails its task at once; the daemon, back under a new session, then pushes its finished result
    stub, session, header, params, got, runner = open_task(harness)
    stub.Leave(pb.LeaveRequest(session=session), metadata=session_metadata(session))
    runner.join(10)
    assert isinstance(got[0], Failure) and got[0].reason == "client left"
    session = stub.Join(pb.JoinRequest(client_id="c")).session
    reply = _push(stub, session, header, encode(params))
    # not "accepted, duplicate": the round took a failure for this task, not the update
    assert not reply.accepted and not reply.duplicate, reply
    assert reply.reason == "already refused: the session of client c ended before its result came (client left)"
    assert not list(harness.pool.config.spill_dir.glob("update-*"))


def test_a_push_that_does_not_start_with_its_header_is_logged_with_its_client(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    stub, session, header, params, got, runner = open_task(harness)
    with caplog.at_level(logging.WARNING, logger="fedcore.server"), pytest.raises(grpc.RpcError) as info:
        stub.PushResult(iter([pb.ResultChunk(data=encode(params))]), metadata=session_metadata(session))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "a push must start with a ResultHeader"
    lines = [r.getMessage() for r in caplog.records if "malformed push" in r.getMessage()]
    assert len(lines) == 1 and "(client c): a push must start with a ResultHeader" in lines[0], lines
    assert _push(stub, session, header, encode(params)).accepted  # the task itself is still open
    runner.join(10)
    assert isinstance(got[0], FitRes)


def test_deadline_and_duplicate_push(harness: Harness) -> None:
    stub = harness.stub()
    session = stub.Join(pb.JoinRequest(client_id="c")).session
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            stub.Heartbeat(pb.HeartbeatRequest(session=session), metadata=session_metadata(session))

    threading.Thread(target=beat, daemon=True).start()
    ins = FitIns(round=1, parameters=dict(GLOBAL), config=FitConfig(), seed=0)
    got: list[object] = []
    runner = threading.Thread(target=lambda: got.extend(harness.pool.run({"c": ins}, timeout_s=30)))
    runner.start()
    header, params = _pull(stub, session)
    first = _push(stub, session, header, encode(params))
    again = _push(stub, session, header, encode(params))
    runner.join(10)
    assert first.accepted and again.accepted and again.duplicate
    assert len(got) == 1 and isinstance(got[0], FitRes)
    # a task that misses its deadline yields a Failure, and its late push is discarded
    late: list[object] = []
    runner = threading.Thread(target=lambda: late.extend(harness.pool.run({"c": ins}, timeout_s=2.0)))
    runner.start()
    header, params = _pull(stub, session)
    runner.join(10)
    assert isinstance(late[0], Failure) and "deadline" in late[0].reason
    reply = _push(stub, session, header, encode(params))
    assert not reply.accepted and ("closed" in reply.reason or "no open task" in reply.reason)
    stop.set()


class OpenTask(NamedTuple):
    """One client "c" joined, a round of one fit task running on a thread, the task pulled."""

    stub: pb_grpc.CoordinatorStub
    session: str
    header: pb.TaskHeader
    params: NamedArrays
    replies: list[object]
    runner: threading.Thread


def open_task(harness: Harness) -> OpenTask:
    stub = harness.stub()
    session = stub.Join(pb.JoinRequest(client_id="c")).session
    ins = FitIns(round=1, parameters=dict(GLOBAL), config=FitConfig(), seed=0)
    replies: list[object] = []
    runner = threading.Thread(target=lambda: replies.extend(harness.pool.run({"c": ins}, timeout_s=30)))
    runner.start()
    header, params = _pull(stub, session)
    return OpenTask(stub, session, header, params, replies, runner)


def test_a_refused_push_stays_refused_and_one_push_per_task_is_read_at_a_time(harness: Harness) -> None:
    stub, session, header, params, got, runner = open_task(harness)
    payload = encode(params)
    # a push that stalls after its first chunk holds the task; a second push of it is turned away meanwhile
    release = threading.Event()

    def stalled() -> Iterator[pb.ResultChunk]:
        yield pb.ResultChunk(
            header=pb.ResultHeader(
                session=session,
                task_id=header.task_id,
                round=1,
                stage=pb.STAGE_FIT,
                num_examples=1,
                payload_bytes=len(payload),
            )
        )
        yield pb.ResultChunk(data=payload[:10])
        release.wait(10)

    first = cast(grpc.StreamUnaryMultiCallable, stub.PushResult).future(stalled(), metadata=session_metadata(session))
    spill = harness.pool.config.spill_dir
    deadline = time.monotonic() + 10
    while not list(spill.glob(f"update-{header.task_id}-*.part")) and time.monotonic() < deadline:
        time.sleep(0.02)  # until the server has claimed the task for the stalled push (its spill file exists)
    with pytest.raises(grpc.RpcError) as info:
        _push(stub, session, header, payload)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "already in progress" in str(
        info.value.details()
    )
    release.set()
    refused = first.result(10)  # it ended without its bytes: truncated
    assert not refused.accepted and "truncated" in refused.reason
    again = _push(stub, session, header, payload)  # the same task, now complete and correct: still refused
    assert not again.accepted and not again.duplicate and again.reason.startswith("already refused: ")
    runner.join(10)
    assert isinstance(got[0], Failure) and "truncated" in got[0].reason


def test_a_push_naming_another_clients_task_is_not_told_that_tasks_outcome(harness: Harness) -> None:
    # client "c" answers its task twice; client "d" then pushes under c's task id (one it was never given)
    stub, session, header, params, got, runner = open_task(harness)
    payload = encode(params)
    assert not _push(stub, session, header, payload, send=payload[:-16]).accepted  # truncated: refused, answered
    runner.join(10)
    assert isinstance(got[0], Failure) and got[0].client_id == "c" and "truncated" in got[0].reason
    again = _push(stub, session, header, payload)  # c itself is told its own refusal again
    assert not again.accepted and again.reason.startswith("already refused: ")
    other = harness.stub()
    d = other.Join(pb.JoinRequest(client_id="d")).session
    for task in (header, pb.TaskHeader(task_id=header.task_id, round=1)):
        reply = _push(other, d, task, payload)
        # d had no task: it hears that, neither "duplicate" nor c's refusal (which it must not learn, and which
        # the server's log would otherwise pin on d)
        assert not reply.accepted and not reply.duplicate, reply
        assert reply.reason == "no open task with this id (the round closed or the task was cancelled)", reply


@pytest.mark.parametrize("wait_s", [math.nan, -1.0])
def test_a_pull_with_a_nonsense_wait_returns_at_once(harness: Harness, wait_s: float) -> None:
    session = harness.pool.join("c")
    started = time.monotonic()
    assert harness.pool.pull(session, wait_s) is False
    assert time.monotonic() - started < 2.0  # at once, not after waiting forever (NaN) or erroring


def test_wait_for_says_how_many_are_connected(harness: Harness) -> None:
    harness.stub().Join(pb.JoinRequest(client_id="one"))
    with pytest.raises(RoundFailed, match=r"1 client\(s\) connected .* 3 needed"):
        harness.pool.wait_for(3, 0.3)


def test_tokens_and_revocation(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("# comment\nalice s3cret\nbob other\n")
    policy = AuthPolicy(tokens=load_tokens(tokens), revoked=frozenset({"bob"}))
    assert policy.tokens["alice"] == hash_token("s3cret")
    h = Harness(tmp_path, auth=policy)
    try:
        stub = h.stub()
        assert stub.Join(pb.JoinRequest(client_id="alice", token="s3cret")).session
        for client_id, token, code in [
            ("alice", "wrong", grpc.StatusCode.UNAUTHENTICATED),
            ("mallory", "s3cret", grpc.StatusCode.UNAUTHENTICATED),
            ("bob", "other", grpc.StatusCode.PERMISSION_DENIED),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                stub.Join(pb.JoinRequest(client_id=client_id, token=token))
            assert info.value.code() == code
        with pytest.raises(grpc.RpcError) as info:
            list(stub.PullTask(pb.PullTaskRequest(session="forged", wait_s=0.1), metadata=session_metadata("forged")))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        h.close()


def test_issued_tokens_are_hex_so_the_client_flag_always_parses(tmp_path: Path) -> None:
    # A token beginning with '-' made `fedcore client start --token VALUE` exit 2 ("expected one argument"): with
    # url-safe base64 that was 1 token in 64. Issued tokens are 256-bit hex; a user's own token still parses as
    # --token=VALUE.
    init_certs(tmp_path, clients=[f"client-{i:03d}" for i in range(8)])
    lines = (tmp_path / "tokens.txt").read_text().splitlines()
    tokens = dict(line.split() for line in lines if not line.startswith("#"))
    assert len(tokens) == 8 and len(set(tokens.values())) == 8
    assert all(re.fullmatch(r"[0-9a-f]{64}", token) for token in tokens.values()), tokens
    parser = build_parser()

    def token_given(*argv: str) -> object:
        args = parser.parse_args(["client", "start", "--server", "h:1", "--client-id", "a", *argv])
        return given_values(args, client_options())["token"]

    for token in tokens.values():
        assert token_given("--token", token) == token
    assert token_given("--token=-own-token") == "-own-token"


def test_mutual_tls_checks_the_certificate_name(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_certs(certs, clients=["client-000", "client-001"])
    server_creds = grpc.ssl_server_credentials(
        [((certs / "server.key").read_bytes(), (certs / "server.pem").read_bytes())],
        root_certificates=(certs / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    h = Harness(tmp_path, auth=AuthPolicy(require_client_cert=True), credentials=server_creds)

    def creds(name: str | None) -> grpc.ChannelCredentials:
        if name is None:
            return grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
        return grpc.ssl_channel_credentials(
            root_certificates=(certs / "ca.pem").read_bytes(),
            private_key=(certs / "clients" / f"{name}.key").read_bytes(),
            certificate_chain=(certs / "clients" / f"{name}.pem").read_bytes(),
        )

    try:
        assert h.stub(creds("client-000")).Join(pb.JoinRequest(client_id="client-000"), timeout=10).session
        with pytest.raises(grpc.RpcError) as info:
            h.stub(creds("client-001")).Join(pb.JoinRequest(client_id="client-000"), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            h.stub(creds(None)).Join(pb.JoinRequest(client_id="client-000"), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # handshake refused without a client certificate
    finally:
        h.close()


def test_state_checkpoints_are_atomic_and_resume(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    assert store.latest_checkpoint() is None
    for rnd in (1, 2, 3):
        state = ServerState(
            round=rnd, parameters={k: v + rnd for k, v in GLOBAL.items()}, optimizer_state={"m/w": GLOBAL["w"] * rnd}
        )
        store.save_checkpoint(state)
    names = sorted(p.name for p in store.checkpoints.iterdir())
    assert names == ["round-000002.safetensors", "round-000003.safetensors"]  # newest two, no temporaries
    latest = store.latest_checkpoint()
    assert latest is not None and latest.round == 3
    np.testing.assert_array_equal(latest.parameters["w"], GLOBAL["w"] + 3)
    np.testing.assert_array_equal(latest.optimizer_state["m/w"], GLOBAL["w"] * 3)
    (store.checkpoints / "round-000004.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(Exception, match="round-000004"):
        load_checkpoint(store.checkpoints / "round-000004.safetensors")
    store.record_join("a")
    store.record_join("a")
    assert store.clients() == [("a", 2)]
    store.close()


def _demo_server_config(state_dir: Path, *, wait_for_clients_s: float) -> ServerConfig:
    """A plaintext server on an ephemeral port running the demo task on ``digits`` for 3 rounds."""
    return ServerConfig(
        tls=TlsSettings(insecure=True),
        address="127.0.0.1:0",
        state_dir=state_dir,
        task="simulations.tasks:demo_task",
        task_options={"dataset": "digits", "num_clients": "2", "partition": "iid", "model": "2nn"},
        round=RoundSettings(rounds=3, wait_for_clients_s=wait_for_clients_s),
    )


def test_a_resumed_server_reports_its_last_round_and_says_initial_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart, fedcore_current_round ("Last completed round") read 0 until the next round ended, and
    --initial was silently ignored by a run that resumed from its checkpoint."""
    import dataclasses
    import re
    import urllib.request
    from typing import Any

    import server.app
    from fedcore.task import TaskContext, initial_parameters, load_task_factory

    options = {"dataset": "digits", "num_clients": "2", "partition": "iid", "model": "2nn"}
    task = load_task_factory("simulations.tasks:demo_task")(TaskContext(role="server", options=options))
    params = initial_parameters(task.build_model, 0)
    store = StateStore(tmp_path / "state")
    store.check_strategy(StrategyConfig())
    for rnd in (1, 2):
        store.save_checkpoint(ServerState(round=rnd, parameters=params, optimizer_state={}))
        store.record_round(RoundRecord(round=rnd))
    store.close()
    initial = tmp_path / "state" / "checkpoints" / "round-000001.safetensors"  # a model file, as any would be
    lines: list[str] = []
    scraped: list[str] = []

    def scrape_then_stop(*args: Any, **kwargs: Any) -> Any:
        port = next(m.group(1) for line in lines if (m := re.search(r"metrics on http://127.0.0.1:(\d+)/", line)))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            scraped.append(response.read().decode())
        raise RoundFailed("stop here: the test only looks at the server before its first round")

    monkeypatch.setattr(server.app, "run_rounds", scrape_then_stop)
    monkeypatch.setattr(server.app, "warm_up_kernels", lambda: None)
    config = dataclasses.replace(
        _demo_server_config(tmp_path / "state", wait_for_clients_s=1.0), metrics_port=0, initial=initial
    )
    with pytest.raises(RoundFailed, match="stop here"):
        server.app.run_server(config, echo=lines.append)
    assert "fedcore_current_round 2.0" in scraped[0].splitlines()
    assert f"WARNING: --initial {initial} is not used" in "\n".join(lines)


def test_server_refuses_to_resume_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    """A state directory from another run (another model) is refused at start, not after clients trained."""
    from fedcore.errors import ConfigError
    from server.app import run_server

    store = StateStore(tmp_path / "state")
    store.check_strategy(StrategyConfig())  # the demo config's strategy: only the model differs
    for rnd in (1, 2):
        store.save_checkpoint(ServerState(round=rnd, parameters=dict(GLOBAL), optimizer_state={}))
        store.record_round(RoundRecord(round=rnd))
    store.close()
    config = _demo_server_config(tmp_path / "state", wait_for_clients_s=1.0)
    with pytest.raises(ConfigError, match=r"round 2\) is of another model.*new --state-dir"):
        run_server(config, echo=lambda _: None)


def test_sigterm_while_a_round_is_saved_stops_after_it_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM that lands inside the round's commit (here: round 0's database row) waits until the commit is done."""
    import signal

    from server.app import run_server

    record_round = StateStore.record_round

    def signalled_mid_commit(self: StateStore, record: RoundRecord) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this (main) thread before the row is written
        record_round(self, record)

    monkeypatch.setattr(StateStore, "record_round", signalled_mid_commit)
    lines: list[str] = []
    config = _demo_server_config(tmp_path / "state", wait_for_clients_s=30.0)
    started = time.monotonic()
    assert run_server(config, echo=lines.append) is None
    assert time.monotonic() - started < 25  # stopped after round 0, not after waiting for clients
    assert any(line.startswith("round 0: 0 update(s), 0 failure(s), test accuracy") for line in lines), lines
    assert lines[-1].startswith("stopping (signal); restart with the same state directory to resume")
    store = StateStore(tmp_path / "state")
    try:
        assert [row["round"] for row in store.history()] == [0]
    finally:
        store.close()
