"""Benchmark: send a model to a client and an update back over loopback gRPC with TLS; compare to raw TCP.

    python bench/transfer.py                 # 1 GiB model (the issue's figure)
    python bench/transfer.py --mib 3200      # above protobuf's 2 GiB cap: one full round trip
    python bench/transfer.py --mib 256       # quick run

The server side is the real one (GrpcClientPool + CoordinatorService, TLS from privacy.tls): the global model is
streamed from its payload file in 4 MiB chunks with a SHA-256 trailer, and the update is spilled to disk and
digest-checked. The client side receives into a SHA-256 (no copy kept) and pushes one in-memory payload. The raw
baseline sends the same number of bytes over a plain loopback TCP socket in the same process.
"""

from __future__ import annotations

import argparse
import hashlib
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
from fedcore.proto.v1 import fedcore_pb2_grpc as pb_grpc
from fedcore.task import FitConfig
from fedcore.wire import DEFAULT_CHUNK_BYTES, iter_bytes_chunks, safetensors_header
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
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fedcore-bench-"))
    certs = tmp / "certs"
    init_certs(certs, clients=["bench"])
    n = args.mib * (1 << 20) // 4
    model = {"w": np.ones(n, dtype=np.float32)}
    pool = GrpcClientPool(PoolConfig(spill_dir=tmp / "spill", max_payload_bytes=1 << 40))
    creds = grpc.ssl_server_credentials([((certs / "server.key").read_bytes(), (certs / "server.pem").read_bytes())])
    server, port = build_server(
        CoordinatorService(pool, AuthPolicy()), "127.0.0.1:0", credentials=creds, max_workers=8, chunk_bytes=4 << 20
    )
    server.start()
    channel = grpc.secure_channel(
        f"127.0.0.1:{port}",
        grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes()),
        options=[
            ("grpc.ssl_target_name_override", "localhost"),
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    )
    stub = pb_grpc.CoordinatorStub(channel)
    session = stub.Join(pb.JoinRequest(client_id="bench")).session
    got: list[object] = []
    ins = FitIns(round=1, parameters=model, config=FitConfig(), seed=0)
    runner = threading.Thread(target=lambda: got.extend(pool.run({"bench": ins}, timeout_s=3600)))
    runner.start()

    # down: the global model
    started = time.perf_counter()
    header: pb.TaskHeader | None = None
    digest = hashlib.sha256()
    size = 0
    while header is None:
        for chunk in stub.PullTask(pb.PullTaskRequest(session=session, wait_s=5)):
            kind = chunk.WhichOneof("body")
            if kind == "header":
                header = chunk.header
                started = time.perf_counter()
            elif kind == "data":
                digest.update(chunk.data)
                size += len(chunk.data)
            elif kind == "trailer":
                assert digest.digest() == chunk.trailer.sha256
    down_s = time.perf_counter() - started

    # up: the update (one in-memory payload, as the daemon sends it)
    payload = bytearray(safetensors_header(model))
    payload += memoryview(model["w"]).cast("B")
    sha = hashlib.sha256(payload).digest()

    def stream() -> Iterator[pb.ResultChunk]:
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
        for piece in iter_bytes_chunks(payload):
            yield pb.ResultChunk(data=piece)
        yield pb.ResultChunk(trailer=pb.Trailer(sha256=sha))

    started = time.perf_counter()
    reply = stub.PushResult(stream())
    up_s = time.perf_counter() - started
    runner.join(600)
    assert reply.accepted and isinstance(got[0], FitRes), (reply, got)
    del got[:]
    server.stop(0)
    pool.close()
    raw_s = raw_tcp(size)
    gib = size / (1 << 30)
    raw = gib / raw_s
    print(f"payload {size / (1 << 20):.0f} MiB ({'above' if size > (2 << 30) else 'below'} the 2 GiB protobuf cap)")
    print(f"raw loopback TCP        : {raw:6.2f} GiB/s")
    print(f"gRPC+TLS model download : {gib / down_s:6.2f} GiB/s  ({gib / down_s / raw:5.1%} of raw; target >= 50%)")
    print(
        f"gRPC+TLS update upload  : {gib / up_s:6.2f} GiB/s  ({gib / up_s / raw:5.1%} of raw; spill to disk + SHA-256)"
    )


if __name__ == "__main__":
    main()
