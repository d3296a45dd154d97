"""One hostile client against a real coordinator process on loopback, for each attack of issue 9.

Each test runs `fedcore server start` (plaintext, a tokens file, 24 worker threads, streams cut off after 2 s
without progress, rounds closing 8 s after they start when a client does not answer, daemons dropped after 10 s
without a heartbeat: a margin for a shared test machine, against 15-25 s without heartbeats under these attacks
before) with two honest
`fedcore client start` daemons (tokens from the environment) and one hostile raw gRPC client in this process,
which attacks for the whole run. Every test asserts that the run completes (all rounds, exit code 0, both
honest daemons in every round and never dropped), that the hostile client is refused or cut off with a clear
reason logged once per cause (not once per attempt), and that the server's log and state stay small.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from client.daemon import DamagedTask, receive_task
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.proto.v1 import fedcore_pb2_grpc as pb_grpc
from fedcore.tensors import MAX_HEADER_BYTES, NamedArrays, encode
from fedcore.wire import coordinator_stub, iter_bytes_chunks, join_metadata, session_metadata
from tests.e2e.deploy_helpers import Proc, client_args, server_args

pytestmark = pytest.mark.slow

OPTIONS = {"dataset": "digits", "num_clients": "2", "partition": "iid", "model": "logreg"}
ROUNDS = 3
SLOW = ["--task", "tests.e2e.slow_task:slow_demo_task", "--task-option"]
TOKENS = {"client-000": "token-000", "client-001": "token-001", "hostile": "token-hostile"}

Attack = Callable[[str, threading.Event], None]


def _stub(target: str) -> pb_grpc.CoordinatorStub:
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    return coordinator_stub(channel)


def _join(stub: pb_grpc.CoordinatorStub) -> str:
    """Join as the hostile client (it holds a valid token) until the server lets it in."""
    while True:
        try:
            return stub.Join(
                pb.JoinRequest(client_id="hostile"), metadata=join_metadata("hostile", TOKENS["hostile"]), timeout=10
            ).session
        except grpc.RpcError:
            time.sleep(0.2)


def _silent_streams(target: str, stop: threading.Event) -> None:
    """64 PushResult and 64 Join streams that never send a message, over 8 connections, opened again as they end."""

    def never() -> Iterator[pb.ResultChunk]:
        stop.wait()
        yield from ()

    def hold(stub: pb_grpc.CoordinatorStub, join: grpc.StreamUnaryMultiCallable) -> None:
        while not stop.is_set():
            calls = [stub.PushResult.future(never(), timeout=60) for _ in range(8)]
            calls += [join.future(never(), timeout=60) for _ in range(8)]
            for call in calls:
                with contextlib.suppress(grpc.RpcError):
                    call.result()

    for _ in range(8):
        channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        join = channel.stream_unary("/fedcore.v1.Coordinator/Join", pb.JoinRequest.SerializeToString, None)
        threading.Thread(target=hold, args=(coordinator_stub(channel), join), daemon=True).start()
    stop.wait()


def _pull_flood(target: str, stop: threading.Event) -> None:
    """An authenticated client with 64 long-polls open on its one session."""
    stub = _stub(target)
    session = _join(stub)

    def poll() -> None:
        while not stop.is_set():
            try:
                call = stub.PullTask(
                    pb.PullTaskRequest(session=session, wait_s=30), metadata=session_metadata(session), timeout=35
                )
                for _ in call:
                    pass
            except grpc.RpcError:
                time.sleep(0.01)

    for _ in range(64):
        threading.Thread(target=poll, daemon=True).start()
    stop.wait()


def _tasks(
    stub: pb_grpc.CoordinatorStub, session: str, stop: threading.Event
) -> Iterator[tuple[pb.TaskHeader, NamedArrays]]:
    """The hostile client's fit tasks, heartbeating meanwhile so that it stays selected."""

    def beat() -> None:
        while not stop.wait(0.3):
            with contextlib.suppress(grpc.RpcError):
                stub.Heartbeat(pb.HeartbeatRequest(session=session), metadata=session_metadata(session), timeout=5)

    threading.Thread(target=beat, daemon=True).start()
    while not stop.is_set():
        try:
            call = stub.PullTask(
                pb.PullTaskRequest(session=session, wait_s=2), metadata=session_metadata(session), timeout=20
            )
            got = receive_task(call, max_payload_bytes=1 << 30, client_id="hostile")
        except (grpc.RpcError, DamagedTask):
            time.sleep(0.2)
            continue
        if not isinstance(got, bool) and got[0].stage == pb.STAGE_FIT:
            header, arrays, _ = got  # the payload's header metadata (tensor groups) is not needed here
            yield header, arrays


def _header(session: str, task: pb.TaskHeader, size: int) -> pb.ResultChunk:
    return pb.ResultChunk(
        header=pb.ResultHeader(
            session=session, task_id=task.task_id, round=task.round, stage=pb.STAGE_FIT, num_examples=50,
            payload_bytes=size,
        )
    )  # fmt: skip


def _slow_push(target: str, stop: threading.Event) -> None:
    """For each task: announce an 8 GiB update, then send one byte every 3 s."""
    stub = _stub(target)
    session = _join(stub)
    for task, _ in _tasks(stub, session, stop):

        def trickle(task: pb.TaskHeader = task) -> Iterator[pb.ResultChunk]:
            yield _header(session, task, 8 << 30)
            while not stop.wait(3):
                yield pb.ResultChunk(data=b"x")

        with contextlib.suppress(grpc.RpcError):
            stub.PushResult(trickle(), metadata=session_metadata(session), timeout=120)


def _huge_header(target: str, stop: threading.Event) -> None:
    """For each task: an update whose safetensors header is padded past the cap (correct size and digest)."""
    stub = _stub(target)
    session = _join(stub)
    for task, params in _tasks(stub, session, stop):
        good = encode(params)
        length = int(np.frombuffer(good[:8], dtype="<u8")[0])
        header = json.loads(good[8 : 8 + length])
        header["__metadata__"]["pad"] = "{}" * (MAX_HEADER_BYTES // 2 + 1024)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        payload = len(text).to_bytes(8, "little") + text + good[8 + length :]

        def stream(task: pb.TaskHeader = task, payload: bytes = payload) -> Iterator[pb.ResultChunk]:
            yield _header(session, task, len(payload))
            for piece in iter_bytes_chunks(payload, 1 << 20):
                yield pb.ResultChunk(data=piece)
            yield pb.ResultChunk(trailer=pb.Trailer(sha256=hashlib.sha256(payload).digest()))

        with contextlib.suppress(grpc.RpcError):
            stub.PushResult(stream(), metadata=session_metadata(session), timeout=60)


def _bad_tokens(target: str, stop: threading.Event) -> None:
    """Joins with a wrong token, as fast as the server answers, from four threads."""
    stub = _stub(target)

    def joins() -> None:
        while not stop.is_set():
            with contextlib.suppress(grpc.RpcError):
                stub.Join(pb.JoinRequest(client_id="client-000", token="wrong"), timeout=5)

    for _ in range(4):
        threading.Thread(target=joins, daemon=True).start()
    stop.wait()


ATTACKS: dict[str, tuple[Attack, str, bool]] = {
    # attack -> (hostile client, the reason the server logs once, whether the hostile client joins the run)
    "silent-streams": (_silent_streams, "refused a call (no session)", False),
    "pull-flood": (_pull_flood, "refused a call (calls per client)", True),
    "slow-push": (_slow_push, "cut off an update upload", True),
    "huge-header": (_huge_header, "rejected the update of client hostile: ", True),
    "bad-tokens": (_bad_tokens, "refused a call (wrong token)", False),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_hostile_client_cannot_stop_the_run(tmp_path: Path, attack: str) -> None:
    hostile, reason, joins = ATTACKS[attack]
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("".join(f"{cid} {token}\n" for cid, token in TOKENS.items()))
    state = tmp_path / "state"
    flags = ["--rounds", str(ROUNDS), "--tokens-file", str(tokens), "--max-workers", "24", "--stream-idle-s", "2",
             "--round-timeout-s", "8", "--min-fit-results", "2", "--no-evaluate",
             "--liveness-timeout-s", "10"]  # fmt: skip
    # a hostile client that joins is one of three: rounds start once all three are connected and select them all,
    # so a round never begins with the hostile client and one honest daemon alone (every attempt would miss the
    # quorum of two before the other daemon joined)
    flags += ["--min-fit-clients", "3" if joins else "2"]
    server = Proc("server", server_args(0, state, OPTIONS, *flags), tmp_path)  # the OS picks the port
    honest: list[Proc] = []
    stop = threading.Event()
    try:
        port = server.listening_port(60)
        honest = [
            Proc(cid, client_args(port, cid, i, 2, OPTIONS), tmp_path, env={"FEDCORE_TOKEN": TOKENS[cid]})
            for i, cid in enumerate(["client-000", "client-001"])
        ]
        attacker = threading.Thread(target=hostile, args=(f"127.0.0.1:{port}", stop), daemon=True)
        attacker.start()
        assert server.wait(150) == 0, server.text()[-4000:]
        for daemon in honest:
            assert daemon.wait(30) == 0, daemon.text()[-4000:]
    finally:
        stop.set()
        for proc in [server, *honest]:
            proc.close()
    text = server.text()
    for r in range(1, ROUNDS + 1):
        line = next(line for line in text.splitlines() if line.startswith(f"round {r}:"))
        assert int(line.split()[2]) >= 2, line  # both honest daemons' updates in every round
    assert "client client-000 is gone" not in text and "client client-001 is gone" not in text
    # once per cause per minute (the run takes about one)
    assert 1 <= text.count(reason) <= 2, f"{reason!r} logged {text.count(reason)} times:\n{text[-4000:]}"
    assert len(text) < 200_000  # a bounded log (a line per wrong token wrote 4 MiB in 15 s)
    with sqlite3.connect(state / "state.db") as db:
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        longest = max(
            (len(value) for table in tables for row in db.execute(f"SELECT * FROM {table}") for value in row
             if isinstance(value, str)),
            default=0,
        )  # fmt: skip
    assert longest < 4000  # a rejection reason stored from a 8 MiB header is cut to a few hundred characters
    spill = sum(f.stat().st_blocks * 512 for f in (state / "spill").glob("*") if f.is_file())
    assert spill < 64 << 20


def test_a_second_daemon_with_the_same_client_id_is_refused(tmp_path: Path) -> None:
    # issue 8: two daemons with one --client-id took each other's session (18 joins in 4 rounds) and both trained.
    # Now the live one keeps the id for the whole run; the second is refused, and both sides say why.
    state = tmp_path / "state"
    rounds = 10  # each fit sleeps 1 s: the run outlasts the second daemon's start
    flags = ["--rounds", str(rounds), "--no-evaluate"]
    server = Proc("server", ["-v", *server_args(0, state, OPTIONS, *flags)], tmp_path)  # the OS picks the port
    first: list[Proc] = []
    second: Proc | None = None
    try:
        port = server.listening_port(60)

        def daemon(cid: str, index: int, name: str) -> Proc:
            return Proc(name, client_args(port, cid, index, 2, OPTIONS, *SLOW, "sleep_s=1"), tmp_path)

        first = [daemon(cid, i, cid) for i, cid in enumerate(["client-000", "client-001"])]
        first[1].wait_for_line("joined 127.0.0.1", 60)
        second = daemon("client-001", 1, "client-001-again")
        second.wait_for_line("the server refused client id 'client-001'", 60)
        assert server.wait(120) == 0, server.text()[-4000:]
        for daemon in first:
            assert daemon.wait(30) == 0, daemon.text()[-4000:]
    finally:
        for proc in [server, *first, *([second] if second else [])]:
            proc.close()
    text = server.text()
    assert "refused a call (client id in use)" in text and "client id 'client-001' is in use by a live session" in text
    # never taken over during the run (once the first daemon has left at its end, the second may join)
    assert text.split(f"finished {rounds} rounds")[0].count("client client-001 joined") == 1
    assert "fit started" not in second.text()
    assert "session lost" not in first[1].text()
    for r in range(1, rounds + 1):
        line = next(line for line in text.splitlines() if line.startswith(f"round {r}:"))
        assert line.startswith(f"round {r}: 2 update(s), 0 failure(s)"), line
