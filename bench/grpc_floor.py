"""Benchmark: the CPU one call costs gRPC's own Python server, with a handler that does nothing.

    python bench/grpc_floor.py             # 3,000 calls of each kind, 1 and 8 callers, sync and grpc.aio servers

The floor under ``bench/load.py --per-call``: what a fedcore call costs beyond it is fedcore's own work. For each
server (``grpc.server`` with a thread pool, as fedcore runs; ``grpc.aio.server`` on an event loop in a thread) and
each way of registering a call (unary-unary; stream-unary, as fedcore registers every call so that its
credentials are checked before its request is read), a client in another process makes the calls (one caller, or
eight threads sharing them) and the row gives the server process's CPU milliseconds per call (user + system, from
/proc) and the wall time per call. Plaintext on 127.0.0.1; bounded in count; stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

_CLIENT = """
import sys, threading, grpc
port, calls, callers = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
kinds = {"UU": channel.unary_unary("/floor.Floor/UU"), "SU": channel.stream_unary("/floor.Floor/SU")}
def call(kind):
    return kinds[kind](b"x") if kind == "UU" else kinds[kind](iter([b"x"]))
for _ in range(200):  # warm up both
    call("UU"), call("SU")
for line in sys.stdin:  # one line per measurement: the kind
    kind = line.strip()
    def work():
        for _ in range(calls // callers):
            call(kind)
    threads = [threading.Thread(target=work) for _ in range(callers)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print("done", flush=True)
"""


def _cpu_s() -> float:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _identity(data: bytes) -> bytes:
    return data


def _sync_server() -> tuple[grpc.Server, int]:
    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b"ok"

    def stream(requests: object, context: grpc.ServicerContext) -> bytes:
        next(iter(requests))  # type: ignore[call-overload]
        return b"ok"

    handlers = {
        "UU": grpc.unary_unary_rpc_method_handler(unary, _identity, _identity),
        "SU": grpc.stream_unary_rpc_method_handler(stream, _identity, _identity),
    }
    server = grpc.server(futures.ThreadPoolExecutor(64))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _aio_server() -> tuple[asyncio.AbstractEventLoop, int]:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"ok"

    async def stream(requests: object, context: grpc.aio.ServicerContext) -> bytes:
        async for _ in requests:  # type: ignore[attr-defined]
            break
        return b"ok"

    handlers = {
        "UU": grpc.unary_unary_rpc_method_handler(unary, _identity, _identity),
        "SU": grpc.stream_unary_rpc_method_handler(stream, _identity, _identity),
    }
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    ports: list[int] = []

    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", handlers),))
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        await server.wait_for_termination()

    threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True).start()
    if not ready.wait(30):
        raise RuntimeError("the grpc.aio server did not start")
    return loop, ports[0]


def measure(port: int, calls: int, callers: int) -> dict[str, tuple[float, float]]:
    """``kind -> (server CPU ms per call, wall ms per call)`` for calls made by a client process."""
    client = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, str(port), str(calls), str(callers)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdin is not None and client.stdout is not None
    rows: dict[str, tuple[float, float]] = {}
    try:
        for kind in ("UU", "SU"):
            cpu, wall = _cpu_s(), time.monotonic()
            client.stdin.write(kind + "\n")
            client.stdin.flush()
            if client.stdout.readline().strip() != "done":
                raise RuntimeError("the client process failed")
            rows[kind] = (1000 * (_cpu_s() - cpu) / calls, 1000 * (time.monotonic() - wall) / calls)
    finally:
        client.stdin.close()
        client.wait(timeout=30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, choices=range(100, 100_001), metavar="K")
    args = parser.parse_args()
    sync_server, sync_port = _sync_server()
    _, aio_port = _aio_server()
    print(f"{'server':>6} {'call':>13} {'callers':>7} {'CPU ms/call':>11} {'wall ms/call':>12}")
    for name, port in (("sync", sync_port), ("aio", aio_port)):
        for callers in (1, 8):
            for kind, (cpu, wall) in measure(port, args.calls, callers).items():
                call = "unary-unary" if kind == "UU" else "stream-unary"
                print(f"{name:>6} {call:>13} {callers:>7} {cpu:>11.3f} {wall:>12.3f}", flush=True)
    sync_server.stop(0)


if __name__ == "__main__":
    main()
