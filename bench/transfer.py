"""Benchmark: send a model to a client and an update back over loopback gRPC with TLS; compare to raw TCP.

    python bench/transfer.py                    # 1 GiB model (the issue's figure)
    python bench/transfer.py --mib 3072         # above protobuf's 2 GiB cap: one full round trip (~7 GiB RSS)
    python bench/transfer.py --mib 256          # quick run
    python bench/transfer.py --chunk-mib 16     # another chunk size (default: fedcore.payload.DEFAULT_CHUNK_BYTES)

The server side is the real one, in this process (GrpcClientPool + CoordinatorService, TLS from privacy.tls): the
global model is streamed from its payload file in chunks with a SHA-256 trailer, and the update is spilled to disk
and digest-checked. The client side runs in its own process, as the daemon does in a deployment, and does what
the daemon does: the chunk-codec stub (no protobuf copies), a PayloadReceiver into a preallocated buffer with the
SHA-256 on a helper thread, and one in-memory payload pushed as views with its digest computed alongside.

Printed in the same run, for comparison:
- raw loopback TCP: the same number of bytes through a plain socket (4 MiB sends into a reused 4 MiB buffer),
  the machine's limit and the issue's reference;
- gRPC with TLS alone: the same bytes streamed by a bare gRPC handler to a client process that drops them (no
  digest, no buffer): the most any gRPC-based path can reach on this machine;
- TLS without gRPC (Python's ``ssl`` on a plain socket, the same certificates): once into a reused buffer, once
  landed as a download must land it (a new payload-sized buffer, SHA-256 alongside on a helper thread), which
  shows what a bulk channel beside gRPC could gain;
- the cryptography bound: AES-GCM encryption and decryption (what TLS does to every byte, through the
  ``cryptography`` package's OpenSSL) plus the SHA-256 check, each measured on one core, spread over all cores.
  Any TLS transfer with a digest check costs at least this much CPU, so it cannot be faster on this machine;
- writing new memory: filling a payload-sized buffer the process did not hold, after a few idle seconds, which is
  what landing a payload costs (see :func:`new_memory_rate`).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from multiprocessing.queues import Queue
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np

from fedcore.messages import FitIns, FitRes
from fedcore.payload import DEFAULT_CHUNK_BYTES
from fedcore.task import FitConfig
from fedcore.wire import TRANSFER_OPTIONS, session_metadata
from privacy.tls import init_certs
from server.grpc_pool import GrpcClientPool, PoolConfig
from server.service import AuthPolicy, CoordinatorService, build_server

GIB = 1 << 30
T = TypeVar("T")


def raw_tcp(num_bytes: int, chunk_bytes: int) -> float:
    """Seconds to push ``num_bytes`` through a loopback TCP socket (``chunk_bytes`` sends)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    block = bytes(chunk_bytes)

    def sink() -> None:
        conn, _ = listener.accept()
        buf = bytearray(chunk_bytes)
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


def new_memory_rate(num_bytes: int, idle_s: float = 5.0) -> float:
    """GiB/s of writing ``num_bytes`` into memory this process did not hold before, after ``idle_s`` of quiet.

    What a receiver pays to land a payload (the daemon's receive buffer, the page cache of a spill file). On a VM
    that hands freed memory back to its host (virtio-balloon free page reporting, as on this project's machines),
    this first touch is several times slower than writing memory the process already holds.
    """
    time.sleep(idle_s)
    started = time.perf_counter()
    buffer = np.empty(num_bytes, dtype=np.uint8)
    buffer.fill(1)
    elapsed = time.perf_counter() - started
    del buffer
    return num_bytes / GIB / elapsed


def crypto_rates(block_bytes: int = 4 << 20, repeat: int = 64) -> tuple[float, float, float]:
    """(AES-256-GCM encrypt, decrypt, SHA-256) throughput of one core in GiB/s, on ``block_bytes`` blocks."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(AESGCM.generate_key(bit_length=256))
    data = os.urandom(block_bytes)
    sealed = bytearray(block_bytes + 16)
    opened = bytearray(block_bytes)
    nonce = bytes(12)
    aead.encrypt_into(nonce, data, None, sealed)  # warm up
    started = time.perf_counter()
    for _ in range(repeat):
        aead.encrypt_into(nonce, data, None, sealed)
    enc = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(repeat):
        aead.decrypt_into(nonce, sealed, None, opened)
    dec = time.perf_counter() - started
    digest = hashlib.sha256()
    started = time.perf_counter()
    for _ in range(repeat):
        digest.update(data)
    sha = time.perf_counter() - started
    total = block_bytes * repeat / GIB
    return total / enc, total / dec, total / sha


# --------------------------------------------------------------------------------------------- client process
def _client_channel(port: int, certs: Path, chunk_bytes: int) -> grpc.Channel:
    cap = chunk_bytes + (1 << 20)
    return grpc.secure_channel(
        f"127.0.0.1:{port}",
        grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes()),
        options=[
            ("grpc.ssl_target_name_override", "localhost"),
            ("grpc.max_receive_message_length", cap),
            ("grpc.max_send_message_length", cap),
            *TRANSFER_OPTIONS,
        ],
    )


def fedcore_client(port: int, certs: Path, chunk_bytes: int, results: Queue[tuple[float, float, int]]) -> None:
    """The daemon's side of one round trip, through the daemon's own receive and send code; puts (download s,
    upload s, payload bytes) on ``results``."""
    from client.daemon import receive_task, result_chunks
    from fedcore.payload import payload_segments
    from fedcore.proto.v1 import fedcore_pb2 as pb
    from fedcore.wire import BackgroundDigest, coordinator_stub

    channel = _client_channel(port, certs, chunk_bytes)
    stub = coordinator_stub(channel)  # the daemon's stub: payload chunks without protobuf copies
    session = stub.Join(pb.JoinRequest(client_id="bench")).session
    done = threading.Event()

    def heartbeat() -> None:  # as the daemon does: a long transfer must not look like a dead client
        while not done.wait(2.0):
            stub.Heartbeat(pb.HeartbeatRequest(session=session), metadata=session_metadata(session), timeout=10)

    threading.Thread(target=heartbeat, daemon=True).start()

    # down: the global model, from its header until the decoded arrays are in hand (size limit, one buffer,
    # SHA-256 overlapped on a helper thread and checked against the trailer, arrays as views of the buffer); the
    # long-poll before the header (the server writing the round's payload file) is not counted
    first_message: list[float] = []

    def timed(stream: Iterator[T]) -> Iterator[T]:
        for message in stream:
            if not first_message:
                first_message.append(time.perf_counter())
            yield message

    got: object = False
    while got is False:
        first_message.clear()
        got = receive_task(
            timed(stub.PullTask(pb.PullTaskRequest(session=session, wait_s=5), metadata=session_metadata(session))),
            max_payload_bytes=1 << 40,
            client_id="bench",
        )
    down_s = time.perf_counter() - first_message[0]
    assert isinstance(got, tuple)
    header, parameters, _ = got  # the payload metadata (tensor groups) is not needed here

    # up: the model sent back as the update, as the daemon sends one: views of the arrays cut into framed chunks
    # (one copy each), the SHA-256 on a helper thread, then the trailer
    started = time.perf_counter()
    segments = payload_segments(parameters)
    size = sum(len(s) for s in segments)
    result = pb.ResultHeader(
        session=session, task_id=header.task_id, round=1, stage=pb.STAGE_FIT, num_examples=1, payload_bytes=size
    )
    chunks = result_chunks(result, segments, BackgroundDigest(segments), chunk_bytes)
    reply = stub.PushResult(chunks, metadata=session_metadata(session))  # type: ignore[arg-type]  # the stub's serializer takes DataChunk
    up_s = time.perf_counter() - started
    done.set()
    assert reply.accepted, reply
    channel.close()
    results.put((down_s, up_s, size))


def bare_grpc_client(port: int, certs: Path, chunk_bytes: int, results: Queue[tuple[float, float, int]]) -> None:
    """Drain the bare stream; puts (seconds, 0, bytes) on ``results``."""
    channel = _client_channel(port, certs, chunk_bytes)
    call = channel.unary_stream("/bench.Bare/Stream", request_serializer=None, response_deserializer=None)
    started = time.perf_counter()
    received = sum(len(message) for message in call(b""))
    results.put((time.perf_counter() - started, 0.0, received))
    channel.close()


def ssl_client(port: int, certs: Path, chunk_bytes: int, land: bool, results: Queue[tuple[float, float, int]]) -> None:
    """Receive a TLS stream on a plain socket; puts (seconds, 0, bytes) on ``results``. ``land``: into a new
    buffer of the whole stream with its SHA-256 computed alongside, else into one reused chunk-sized buffer."""
    import queue
    import ssl

    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    with (
        socket.create_connection(("127.0.0.1", port)) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        prefix = b""
        while len(prefix) < 8:  # the stream's length, sent first
            prefix += tls.recv(8 - len(prefix))
        size = int.from_bytes(prefix, "little")
        started = time.perf_counter()
        buffer = memoryview(bytearray(size if land else chunk_bytes))
        pending: queue.Queue[memoryview | None] = queue.Queue(2)
        digest = hashlib.sha256()

        def hash_pieces() -> None:
            while (piece := pending.get()) is not None:
                digest.update(piece)

        hasher = threading.Thread(target=hash_pieces)
        hasher.start()
        got = hashed = 0
        while got < size:
            n = tls.recv_into(buffer[got : got + chunk_bytes] if land else buffer)
            if not n:
                break
            got += n
            if land and (got - hashed >= chunk_bytes or got == size):  # whole chunks to the hasher, as fedcore does
                pending.put(buffer[hashed:got])
                hashed = got
        pending.put(None)
        hasher.join()
        results.put((time.perf_counter() - started, 0.0, got))


def _spawn(
    target: Callable[..., None], *args: object
) -> tuple[mp.process.BaseProcess, Queue[tuple[float, float, int]]]:
    ctx = mp.get_context("spawn")
    results: Queue[tuple[float, float, int]] = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, results), daemon=True)
    process.start()
    return process, results


# --------------------------------------------------------------------------------------------- server side
def server_credentials(certs: Path) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([((certs / "server.key").read_bytes(), (certs / "server.pem").read_bytes())])


def fedcore_round_trip(tmp: Path, certs: Path, mib: int, chunk_bytes: int) -> tuple[float, float, int]:
    """(download s, upload s, payload bytes) of one model down and one update up through the real server."""
    n = mib * (1 << 20) // 4
    pool = GrpcClientPool(PoolConfig(spill_dir=tmp / "spill", max_payload_bytes=1 << 40, chunk_bytes=chunk_bytes))
    server, port = build_server(
        CoordinatorService(pool, AuthPolicy()),
        "127.0.0.1:0",
        credentials=server_credentials(certs),
        max_workers=8,
        chunk_bytes=chunk_bytes,
    )
    server.start()
    process, results = _spawn(fedcore_client, port, certs, chunk_bytes)
    pool.wait_for(1, timeout_s=120)
    ins = FitIns(round=1, parameters={"w": np.ones(n, dtype=np.float32)}, config=FitConfig(), seed=0)
    got = list(pool.run({"bench": ins}, timeout_s=3600))
    del ins  # the pool wrote its payload file at the start of the round
    down_s, up_s, size = results.get(timeout=3600)
    process.join(60)
    assert isinstance(got[0], FitRes), got
    del got
    server.stop(0)
    pool.close()
    return down_s, up_s, size


def bare_grpc(certs: Path, num_bytes: int, chunk_bytes: int) -> float:
    """Seconds for a bare gRPC+TLS server stream of ``num_bytes`` to a client process that drops them."""
    block = bytes(chunk_bytes)

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        for offset in range(0, num_bytes, chunk_bytes):
            yield block[: min(chunk_bytes, num_bytes - offset)]

    handler = grpc.method_handlers_generic_handler(
        "bench.Bare", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    cap = chunk_bytes + (1 << 20)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[("grpc.max_send_message_length", cap), ("grpc.max_receive_message_length", cap), *TRANSFER_OPTIONS],
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(certs))
    server.start()
    process, results = _spawn(bare_grpc_client, port, certs, chunk_bytes)
    seconds, _, received = results.get(timeout=3600)
    process.join(60)
    server.stop(0)
    assert received == num_bytes, (received, num_bytes)
    return seconds


def python_ssl(certs: Path, num_bytes: int, chunk_bytes: int, *, land: bool) -> float:
    """Seconds to stream ``num_bytes`` over TLS on a plain loopback socket to a client process (see
    :func:`ssl_client`)."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs / "server.pem", certs / "server.key")
    listener = socket.create_server(("127.0.0.1", 0))
    process, results = _spawn(ssl_client, listener.getsockname()[1], certs, chunk_bytes, land)
    conn, _ = listener.accept()
    with context.wrap_socket(conn, server_side=True) as tls:
        tls.sendall(num_bytes.to_bytes(8, "little"))
        block = bytes(chunk_bytes)
        for offset in range(0, num_bytes, chunk_bytes):
            tls.sendall(block[: min(chunk_bytes, num_bytes - offset)])
        seconds, _, received = results.get(timeout=3600)
    process.join(60)
    listener.close()
    assert received == num_bytes, (received, num_bytes)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024, help="model size in MiB (float32)")
    parser.add_argument(
        "--chunk-mib", type=float, default=DEFAULT_CHUNK_BYTES / (1 << 20), help="payload chunk size in MiB"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the best is reported")
    args = parser.parse_args()
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    tmp = Path(tempfile.mkdtemp(prefix="fedcore-bench-"))
    certs = tmp / "certs"
    init_certs(certs, clients=["bench"])

    trips = [fedcore_round_trip(tmp, certs, args.mib, chunk_bytes) for _ in range(args.repeat)]
    size = trips[0][2]
    gib = size / GIB
    down_s, up_s = min(t[0] for t in trips), min(t[1] for t in trips)
    raw = gib / min(raw_tcp(size, chunk_bytes) for _ in range(args.repeat))
    bare = gib / min(bare_grpc(certs, size, chunk_bytes) for _ in range(args.repeat))
    tls = gib / min(python_ssl(certs, size, chunk_bytes, land=False) for _ in range(args.repeat))
    tls_landed = gib / min(python_ssl(certs, size, chunk_bytes, land=True) for _ in range(args.repeat))
    enc, dec, sha = (max(rates) for rates in zip(*(crypto_rates() for _ in range(args.repeat)), strict=True))
    fresh = max(new_memory_rate(size) for _ in range(args.repeat))
    cores = len(os.sched_getaffinity(0))
    bound = cores / (1 / enc + 1 / dec + 1 / sha)
    down, up = gib / down_s, gib / up_s

    print(
        f"payload {size / (1 << 20):.0f} MiB ({'above' if size > (2 << 30) else 'below'} the 2 GiB protobuf cap), "
        f"chunks of {chunk_bytes / (1 << 20):g} MiB, {cores} cores, server and client in separate processes, "
        f"best of {args.repeat}"
    )
    print(f"raw loopback TCP (the reference)   : {raw:6.2f} GiB/s")
    print(f"gRPC+TLS alone, bytes dropped      : {bare:6.2f} GiB/s  ({bare / raw:5.1%} of raw)")
    print(f"TLS without gRPC (Python ssl)      : {tls:6.2f} GiB/s  ({tls / raw:5.1%} of raw; into a reused buffer)")
    print(
        f"  ... landed as a download         : {tls_landed:6.2f} GiB/s  ({tls_landed / raw:5.1%} of raw; new buffer, "
        "SHA-256 alongside)"
    )
    print(
        f"AES-GCM + SHA-256 bound            : {bound:6.2f} GiB/s  ({bound / raw:5.1%} of raw; one core: "
        f"encrypt {enc:.2f}, decrypt {dec:.2f}, SHA-256 {sha:.2f} GiB/s)"
    )
    print(f"writing new memory (first touch)   : {fresh:6.2f} GiB/s  ({fresh / raw:5.1%} of raw; a receiver's floor)")
    for name, rate, what in (
        ("model download", down, "into arrays, SHA-256 checked"),
        ("update upload ", up, "spilled to disk, SHA-256 checked"),
    ):
        print(
            f"fedcore {name}            : {rate:6.2f} GiB/s  ({rate / raw:5.1%} of raw, target >= 50%; "
            f"{rate / bare:5.1%} of bare gRPC; {rate / bound:5.1%} of the bound; {what})"
        )


if __name__ == "__main__":
    main()
