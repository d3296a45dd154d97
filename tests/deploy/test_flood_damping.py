"""Damping of callers in a tight loop, over real gRPC on 127.0.0.1: a connection whose calls keep being refused
(wrong tokens) is answered at a pace, while another connection's honest join stays fast; a session's pulls and a
client id's joins are limited by token buckets, refused with the seconds to wait."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.wire import coordinator_stub, join_metadata, session_metadata
from server.limits import ServiceLimits, TokenBuckets
from server.service import RETRY_AFTER_KEY, AuthPolicy, hash_token
from tests.deploy.test_service import Harness

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_token_bucket_allows_its_burst_then_its_rate() -> None:
    clock = Clock()
    buckets = TokenBuckets(3, 2.0, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == 0.5  # empty: one token in 1 / 2 s
    assert buckets.take("b") == 0.0  # another key has its own bucket
    clock.now += 0.25
    assert buckets.take("a") == 0.25  # half a token refilled
    clock.now += 0.25
    assert buckets.take("a") == 0.0
    clock.now += 60
    assert [buckets.take("a") for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]  # refilled to the burst, no more


def test_a_paced_key_waits_its_turn_up_to_the_cap_and_keys_are_bounded() -> None:
    clock = Clock()
    buckets = TokenBuckets(2, 10.0, max_keys=2, clock=clock)
    waits = [buckets.debit("peer", 0.3) for _ in range(6)]
    assert waits == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.3, 0.3])  # 10 a second, never more than 0.3 s
    clock.now += 0.3  # 3 tokens back: the debt of 3 is paid
    assert buckets.debit("peer", 0.3) == pytest.approx(0.1)
    buckets.debit("x", 0.3)
    buckets.debit("y", 0.3)  # "peer" is the least recently used of three: forgotten, full again
    assert buckets.debit("peer", 0.3) == 0.0


def test_a_wrong_token_loop_is_paced_and_an_honest_join_stays_fast(tmp_path: Path) -> None:
    tokens = {"alice": hash_token("s3cret"), "bob": hash_token("b0b")}
    limits = ServiceLimits(stream_idle_s=5.0, refusal_burst=10, refusal_rate=20.0, refusal_max_wait_s=1.0)
    harness = Harness(tmp_path, auth=AuthPolicy(tokens=tokens), limits=limits)
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    attacker = coordinator_stub(grpc.insecure_channel(f"127.0.0.1:{harness.port}", options=own_connection))
    honest = coordinator_stub(grpc.insecure_channel(f"127.0.0.1:{harness.port}", options=own_connection))
    stop, answered = threading.Event(), []

    def flood() -> None:
        while not stop.is_set():
            with pytest.raises(grpc.RpcError) as info:
                attacker.Join(pb.JoinRequest(client_id="alice"), metadata=join_metadata("alice", "wrong"), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            answered.append(time.monotonic())

    try:
        threads = [threading.Thread(target=flood) for _ in range(4)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(2.0)
        before = time.monotonic()
        assert honest.Join(pb.JoinRequest(client_id="bob"), metadata=join_metadata("bob", "b0b"), timeout=5).session
        join_s = time.monotonic() - before
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(5)
        elapsed = time.monotonic() - started
    finally:
        harness.close()
    # the burst of 10 at once, then 20 a second (the 4 threads' waits overlap by up to 1 s): without pacing the
    # loop is answered thousands of times in these 3 s
    assert len(answered) <= 10 + 20 * elapsed + 4
    assert len(answered) >= 10 + 20 * (elapsed - 1.5)
    assert join_s < 0.5
    paced = harness.metrics.registry.get_sample_value("fedcore_calls_refused_total", {"cause": "paced"})
    assert paced is not None and paced >= len(answered) - 10 - 4


def test_a_sessions_pulls_past_its_bucket_are_refused_with_the_wait(tmp_path: Path) -> None:
    limits = ServiceLimits(stream_idle_s=5.0, pull_burst=5, pull_rate=4.0, refusal_burst=100)
    harness = Harness(tmp_path, limits=limits)
    try:
        stub = harness.stub()
        session = stub.Join(pb.JoinRequest(client_id="c")).session
        meta = session_metadata(session)

        def pull() -> list[pb.TaskChunk]:
            return list(stub.PullTask(pb.PullTaskRequest(session=session, wait_s=0.0), metadata=meta, timeout=5))

        for _ in range(5):  # the burst: each answered (idle, nothing to do)
            assert pull()[0].WhichOneof("body") == "idle"
        with pytest.raises(grpc.RpcError) as info:
            pull()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "more than 5 pulls of this session at once and 4 a second after" in str(info.value.details())
        retry_after = float(dict(info.value.trailing_metadata())[RETRY_AFTER_KEY])
        assert 0 < retry_after <= 0.25
        time.sleep(retry_after + 0.05)
        assert pull()[0].WhichOneof("body") == "idle"  # a token back: allowed again
    finally:
        harness.close()


def test_a_client_ids_joins_past_its_bucket_are_refused(tmp_path: Path) -> None:
    harness = Harness(tmp_path, limits=ServiceLimits(join_burst=3, join_rate=0.5, refusal_burst=100))
    try:
        stub = harness.stub()
        session = ""
        for _ in range(3):  # rejoining with the previous session, as a daemon does after a lost connection
            reply = stub.Join(pb.JoinRequest(client_id="c"), metadata=join_metadata("c", "", session), timeout=5)
            session = reply.session
        with pytest.raises(grpc.RpcError) as info:
            stub.Join(pb.JoinRequest(client_id="c"), metadata=join_metadata("c", "", session), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "joins of client 'c'" in str(info.value.details())
        assert stub.Join(pb.JoinRequest(client_id="d"), timeout=5).session  # another id is not affected
    finally:
        harness.close()
