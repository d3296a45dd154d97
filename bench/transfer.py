"""Benchmark: send a model to a client and an update back over loopback gRPC with TLS; compare to raw TCP.

    python bench/transfer.py                    # 1 GiB model (the issue's figure)
    python bench/transfer.py --mib 3072         # above protobuf's 2 GiB cap: one full round trip (~7 GiB RSS)
    python bench/transfer.py --mib 256          # quick run
    python bench/transfer.py --chunk-mib 16     # another chunk size (default: fedcore.wire.DEFAULT_CHUNK_BYTES)

The server side is the real one (GrpcClientPool + CoordinatorService, TLS from privacy.tls): the global model is
streamed from its payload file in chunks with a SHA-256 trailer, and the update is spilled to disk and
digest-checked. The client side does what the daemon does: the chunk-codec stub (no protobuf copies), a
PayloadReceiver into a preallocated buffer with the SHA-256 on a helper thread, and one in-memory payload pushed
as views with its digest computed alongside. The raw baseline sends the same number of bytes over a plain
loopback TCP socket in the same process (both ends in one process, as the gRPC ends are).
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np

from fedcore.messages import FitIns, FitRes
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.task import FitConfig
from fedcore.wire import (
    DEFAULT_CHUNK_BYTES,
    TRANSFER_OPTIONS,
    BackgroundDigest,
    BufferSink,
    DataChunk,
    PayloadReceiver,
    chunk_body,
    coordinator_stub,
    iter_views,
    safetensors_header,
)
from privacy.tls import init_certs
from server.grpc_pool import GrpcClientPool, PoolConfig
from server.service import AuthPolicy, CoordinatorService, build_server


def raw_tcp(num_bytes: int) -> float:
    """Seconds to push ``num_bytes`` through a loopback TCP socket (4 MiB sends)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    block = bytes(DEFAULT_CHUNK_BYTES)

    def sink() -> None:
        conn, _ = listener.accept()
        buf = bytearray(DEFAULT_CHUNK_BYTES)
        got = 0
        while got < num_bytes:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
        conn.close()

    thread = threading.Thread(target=sink)
    thread.start()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        sent = 0
        while sent < num_bytes:
            s.sendall(block[: min(len(block), num_bytes - sent)])
            sent += min(len(block), num_bytes - sent)
    thread.join()
    listener.close()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024, help="model size in MiB (float32)")
    parser.add_argument(
        "--chunk-mib", type=float, default=DEFAULT_CHUNK_BYTES / (1 << 20), help="payload chunk size in MiB"
    )
    args = parser.parse_args()
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    tmp = Path(tempfile.mkdtemp(prefix="fedcore-bench-"))
    certs = tmp / "certs"
    init_certs(certs, clients=["bench"])
    n = args.mib * (1 << 20) // 4
    model = {"w": np.ones(n, dtype=np.float32)}
    pool = GrpcClientPool(PoolConfig(spill_dir=tmp / "spill", max_payload_bytes=1 << 40, chunk_bytes=chunk_bytes))
    creds = grpc.ssl_server_credentials([((certs / "server.key").read_bytes(), (certs / "server.pem").read_bytes())])
    server, port = build_server(
        CoordinatorService(pool, AuthPolicy()), "127.0.0.1:0", credentials=creds, max_workers=8, chunk_bytes=chunk_bytes
    )
    server.start()
    cap = chunk_bytes + (1 << 20)
    channel = grpc.secure_channel(
        f"127.0.0.1:{port}",
        grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes()),
        options=[
            ("grpc.ssl_target_name_override", "localhost"),
            ("grpc.max_receive_message_length", cap),
            ("grpc.max_send_message_length", cap),
            *TRANSFER_OPTIONS,
        ],
    )
    stub = coordinator_stub(channel)  # the daemon's stub: payload chunks without protobuf copies
    session = stub.Join(pb.JoinRequest(client_id="bench")).session
    done = threading.Event()

    def heartbeat() -> None:  # as the daemon does: a long transfer must not look like a dead client
        while not done.wait(2.0):
            stub.Heartbeat(pb.HeartbeatRequest(session=session), timeout=10)

    threading.Thread(target=heartbeat, daemon=True).start()
    got: list[object] = []
    ins = FitIns(round=1, parameters=model, config=FitConfig(), seed=0)
    runner = threading.Thread(target=lambda: got.extend(pool.run({"bench": ins}, timeout_s=3600)))
    runner.start()

    # down: the global model, received as the daemon receives it (size limit, preallocated buffer, SHA-256
    # overlapped on a helper thread, trailer checked)
    started = time.perf_counter()
    header: pb.TaskHeader | None = None
    size = 0
    while header is None:
        for chunk in stub.PullTask(pb.PullTaskRequest(session=session, wait_s=5)):
            kind, data = chunk_body(chunk)
            if kind == "header" and not isinstance(chunk, memoryview):
                header = chunk.header
                sink = BufferSink(header.payload_bytes)
                receiver = PayloadReceiver(sink, announced=header.payload_bytes, limit=1 << 40)
                started = time.perf_counter()
            elif kind == "data":
                receiver.write(data)
                size += len(data)
            elif kind == "trailer" and not isinstance(chunk, memoryview):
                receiver.finish(chunk.trailer.sha256)
    down_s = time.perf_counter() - started
    del sink, receiver

    # up: the update (one in-memory payload, as the daemon sends it: views, digest on a helper thread)
    payload = bytearray(safetensors_header(model))
    payload += model["w"].data.cast("B")
    model.clear()  # the pool wrote its payload file at the start of the round; keep one copy of the model

    def stream() -> Iterator[pb.ResultChunk | DataChunk]:
        assert header is not None
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
        for piece in iter_views(payload, chunk_bytes):
            yield DataChunk(piece)
        yield pb.ResultChunk(trailer=pb.Trailer(sha256=digest.digest()))

    started = time.perf_counter()
    digest = BackgroundDigest(payload)
    reply = stub.PushResult(stream())  # type: ignore[arg-type]  # the stub's serializer takes DataChunk
    up_s = time.perf_counter() - started
    runner.join(600)
    done.set()
    assert reply.accepted and isinstance(got[0], FitRes), (reply, got)
    del got[:]
    server.stop(0)
    pool.close()
    raw_s = raw_tcp(size)
    gib = size / (1 << 30)
    raw = gib / raw_s
    print(
        f"payload {size / (1 << 20):.0f} MiB ({'above' if size > (2 << 30) else 'below'} the 2 GiB protobuf cap), "
        f"chunks of {chunk_bytes / (1 << 20):g} MiB"
    )
    print(f"raw loopback TCP        : {raw:6.2f} GiB/s")
    print(f"gRPC+TLS model download : {gib / down_s:6.2f} GiB/s  ({gib / down_s / raw:5.1%} of raw; target >= 50%)")
    print(
        f"gRPC+TLS update upload  : {gib / up_s:6.2f} GiB/s  ({gib / up_s / raw:5.1%} of raw; spill to disk + SHA-256)"
    )


if __name__ == "__main__":
    main()
