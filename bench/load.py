"""Benchmark: how many connected daemons one coordinator holds, with and without one hostile client.

    python bench/load.py                                   # N = 50, 200, 1000; each without and with a hostile client
    python bench/load.py --sizes 200 --hostile none stall  # one size, two scenarios
    python bench/load.py --code /path/to/other/checkout    # the same load against another tree's server code

Each scenario starts a real coordinator in its own process (this module's ``--serve`` mode: the gRPC pool and
service of ``--code``, plaintext on 127.0.0.1, port 0, the tree's default worker count and limits, a tokens
table for every client) and N raw gRPC clients in this process (``grpc.aio``, one connection each, as N daemons
have): each joins with its token, then long-polls ``PullTask`` (20 s, the daemon's default) and sends a
``Heartbeat`` every interval the server asked for (5 s by default), as the daemon does, without training. The
joins start spread over the first two seconds. After ``--seconds`` of steady load (default 35 s: more than two
liveness timeouts) the clients stop, the server is stopped, and one row is printed:

- conn p99: time to open the client's connection (TCP and HTTP/2 set-up, before any call);
- join p50/p99: from a client's first Join attempt on its open connection until it holds a session (retries
  included);
- heartbeat p50/p99: latency of each Heartbeat call;
- drops: sessions the server ended although the client was alive (a heartbeat answered "join again", a pull
  answered UNAUTHENTICATED) plus clients that never joined;
- RSS/client: the server's resident memory at the end minus before the clients came, over N; threads: the
  server's thread count at the end (both from /proc);
- log: bytes the server logged.

Hostile clients (``--hostile``), one process next to the honest ones:
``stall``: 200 ``PushResult`` streams without credentials that never send a message (held open);
``pullflood``: joins with a valid token, then keeps 200 ``PullTask`` long-polls open on its one session;
``badjoin``: four threads joining with a wrong token as fast as the server answers.
The honest clients start once the hostile one has started its attack.

Everything is bounded: clients and the hostile process stop after the scenario's time, the server is killed if it
does not stop within 10 s, and every call has a deadline. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOSTILE_KINDS = ("none", "stall", "pullflood", "badjoin")
HOSTILE_STREAMS = 200


# --------------------------------------------------------------------------------------------- the server
def serve(port_file: Path, log_file: Path, clients: int, stop_after_s: float) -> None:
    """Run the coordinator of the tree on ``sys.path`` until stdin closes (or ``stop_after_s``)."""
    import logging

    from server.config import PoolSettings
    from server.grpc_pool import GrpcClientPool, PoolConfig
    from server.metrics import ServerMetrics
    from server.service import AuthPolicy, CoordinatorService, build_server, hash_token

    logging.basicConfig(filename=log_file, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    tokens = {f"c{i:04d}": hash_token(f"token-{i}") for i in range(clients)}
    tokens["hostile"] = hash_token("token-hostile")
    metrics = ServerMetrics()
    spill = Path(tempfile.mkdtemp(prefix="fedcore-load-"))
    pool = GrpcClientPool(PoolConfig(spill_dir=spill), metrics)
    service = CoordinatorService(pool, AuthPolicy(tokens=tokens), metrics)
    workers = PoolSettings().max_workers
    server, port = build_server(
        service, "127.0.0.1:0", credentials=None, max_workers=workers, chunk_bytes=pool.config.chunk_bytes
    )
    server.start()
    port_file.write_text(f"{port} {workers}")
    closed = threading.Event()

    def wait_for_stdin_to_close() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=wait_for_stdin_to_close, daemon=True).start()
    closed.wait(stop_after_s)
    dropped = metrics.dropped._value.get()
    print(json.dumps({"dropped": dropped}), flush=True)
    server.stop(0)
    pool.close()


# --------------------------------------------------------------------------------------------- honest clients
@dataclass
class Stats:
    connects: list[float] = field(default_factory=list)
    joins: list[float] = field(default_factory=list)
    heartbeats: list[float] = field(default_factory=list)
    lost_sessions: int = 0
    never_joined: int = 0
    refused_pulls: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def honest_client(index: int, port: int, stats: Stats, start_in: float, until: float) -> None:
    import grpc

    from fedcore.proto.v1 import fedcore_pb2 as pb
    from fedcore.wire import coordinator_stub

    await asyncio.sleep(start_in)
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        started = time.monotonic()
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=max(1.0, until - started))
        except TimeoutError:
            stats.never_joined += 1
            return
        stats.connects.append(time.monotonic() - started)
        # over an aio channel the stub's calls are awaitable and its streams async (the stub is typed sync)
        stub: Any = coordinator_stub(channel)
        client_id, token = f"c{index:04d}", f"token-{index}"

        async def join() -> tuple[str, float] | None:
            started = time.monotonic()
            while time.monotonic() < until:
                try:
                    reply = await stub.Join(
                        pb.JoinRequest(client_id=client_id, token=token),
                        metadata=(("fedcore-token", token),),
                        timeout=10,
                    )
                    stats.joins.append(time.monotonic() - started)
                    return reply.session, max(0.1, reply.heartbeat_interval_s)
                except grpc.aio.AioRpcError as exc:
                    stats.error(f"join {exc.code().name}")
                    await asyncio.sleep(random.uniform(0.2, 1.0))
            return None

        joined = await join()
        if joined is None:
            stats.never_joined += 1
            return
        session, interval = joined
        lost = asyncio.Event()

        async def heartbeats() -> None:
            nonlocal session
            while time.monotonic() + interval < until:
                await asyncio.sleep(interval)
                started = time.monotonic()
                try:
                    reply = await stub.Heartbeat(
                        pb.HeartbeatRequest(session=session), metadata=(("fedcore-session", session),), timeout=30
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:  # the session is gone
                        stats.lost_sessions += 1
                        lost.set()
                        return
                    stats.error(f"heartbeat {exc.code().name}")
                    continue
                stats.heartbeats.append(time.monotonic() - started)
                if not reply.ok:
                    stats.lost_sessions += 1
                    lost.set()
                    return

        async def pulls() -> None:
            while time.monotonic() + 1 < until and not lost.is_set():
                wait = min(20.0, until - time.monotonic() - 1)
                try:
                    call = stub.PullTask(
                        pb.PullTaskRequest(session=session, wait_s=wait),
                        metadata=(("fedcore-session", session),),
                        timeout=wait + 30,
                    )
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                        if not lost.is_set():
                            stats.lost_sessions += 1
                            lost.set()
                        return
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        stats.refused_pulls += 1
                    else:
                        stats.error(f"pull {exc.code().name}")
                    await asyncio.sleep(random.uniform(0.5, 1.5))

        await asyncio.gather(heartbeats(), pulls())
        if not lost.is_set():  # a daemon leaves when it stops; the server's drop count is then wrongful drops only
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Leave(pb.LeaveRequest(session=session), metadata=(("fedcore-session", session),), timeout=10)


async def run_clients(n: int, port: int, seconds: float) -> Stats:
    import fedcore.wire  # noqa: F401 - imported (torch with it) before the clock starts

    stats = Stats()
    until = time.monotonic() + 2 + seconds
    await asyncio.gather(*(honest_client(i, port, stats, random.uniform(0, 2), until) for i in range(n)))
    return stats


# --------------------------------------------------------------------------------------------- the hostile client
def hostile(kind: str, port: int, seconds: float) -> None:
    """Run one hostile client of ``kind`` against ``127.0.0.1:port`` for ``seconds``."""
    import grpc

    from fedcore.proto.v1 import fedcore_pb2 as pb
    from fedcore.wire import coordinator_stub

    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_retries", 0)])
    stub = coordinator_stub(channel)
    calls: list[object] = []

    def silent_stream():  # type: ignore[no-untyped-def]
        stop.wait()
        yield from ()

    if kind == "stall":
        push: grpc.StreamUnaryMultiCallable = stub.PushResult  # (typed as a plain call in the generated stub)
        for _ in range(HOSTILE_STREAMS):
            calls.append(push.future(silent_stream(), timeout=seconds + 5))
    elif kind == "pullflood":
        session = ""
        while not session and not stop.is_set():
            try:
                session = stub.Join(
                    pb.JoinRequest(client_id="hostile", token="token-hostile"),
                    metadata=(("fedcore-token", "token-hostile"),),
                    timeout=10,
                ).session
            except grpc.RpcError:
                time.sleep(0.5)

        def flood() -> None:
            while not stop.is_set():
                try:
                    for _ in stub.PullTask(
                        pb.PullTaskRequest(session=session, wait_s=30),
                        metadata=(("fedcore-session", session),),
                        timeout=35,
                    ):
                        pass
                except grpc.RpcError:
                    time.sleep(0.05)

        for _ in range(HOSTILE_STREAMS):
            threading.Thread(target=flood, daemon=True).start()
    elif kind == "badjoin":

        def joins() -> None:
            while not stop.is_set():
                with contextlib.suppress(grpc.RpcError):
                    stub.Join(
                        pb.JoinRequest(client_id="c0000", token="wrong"),
                        metadata=(("fedcore-client-id", "c0000"), ("fedcore-token", "wrong")),
                        timeout=5,
                    )

        for _ in range(4):
            threading.Thread(target=joins, daemon=True).start()
    print("attacking", flush=True)  # imports done, attack under way: the honest clients may start
    stop.wait()
    time.sleep(0.5)
    channel.close()


# --------------------------------------------------------------------------------------------- one scenario
def _proc_status(pid: int) -> tuple[float, int]:
    """(RSS in MiB, thread count) of process ``pid``."""
    rss, threads = 0.0, 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, threads


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def scenario(n: int, kind: str, seconds: float, code: Path) -> dict[str, object]:
    """Run one scenario and return its row."""
    with tempfile.TemporaryDirectory(prefix="fedcore-load-") as tmp:
        port_file, log_file = Path(tmp) / "port", Path(tmp) / "server.log"
        env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{ROOT}"}
        limit = seconds + 40
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(port_file), str(log_file), str(n), str(limit)],
            cwd=code,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists() or not port_file.read_text():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the bench server did not start (exit code {server.poll()})")
                time.sleep(0.1)
            port_text, workers = port_file.read_text().split()
            port = int(port_text)
            time.sleep(1.0)
            base_rss, _ = _proc_status(server.pid)
            attacker = None
            if kind != "none":
                attacker = subprocess.Popen(
                    [sys.executable, __file__, "--hostile-run", kind, str(port), str(seconds + 10)],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert attacker.stdout is not None
                attacker.stdout.readline()  # "attacking": its imports (torch) no longer compete with the joins
            stats = asyncio.run(run_clients(n, port, seconds))
            rss, threads = _proc_status(server.pid)
            if attacker is not None:
                try:
                    attacker.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    attacker.kill()
            try:
                out, _ = server.communicate(input="", timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                out, _ = server.communicate()
            dropped = json.loads(out.strip().splitlines()[-1])["dropped"] if out.strip() else float("nan")
            log_bytes = log_file.stat().st_size if log_file.exists() else 0
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    return {
        "clients": n,
        "hostile": kind,
        "workers": int(workers),
        "connect_p99_ms": 1000 * _pct(stats.connects, 0.99),
        "join_p50_ms": 1000 * _pct(stats.joins, 0.5),
        "join_p99_ms": 1000 * _pct(stats.joins, 0.99),
        "hb_p50_ms": 1000 * _pct(stats.heartbeats, 0.5),
        "hb_p99_ms": 1000 * _pct(stats.heartbeats, 0.99),
        "heartbeats": len(stats.heartbeats),
        "drops": stats.lost_sessions + stats.never_joined,
        "server_dropped": dropped,
        "refused_pulls": stats.refused_pulls,
        "rss_per_client_kib": 1024 * (rss - base_rss) / n,
        "rss_mib": rss,
        "threads": threads,
        "log_kib": log_bytes / 1024,
        "errors": dict(sorted(stats.errors.items())),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--hostile-run":
        hostile(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 1000], choices=range(1, 2001), metavar="N")
    parser.add_argument("--hostile", nargs="+", default=["none", "stall"], choices=HOSTILE_KINDS)
    parser.add_argument("--seconds", type=float, default=35.0, help="steady load per scenario (5..300)")
    parser.add_argument("--code", type=Path, default=ROOT, help="checkout whose server code is measured")
    args = parser.parse_args()
    if not 5 <= args.seconds <= 300:
        parser.error("--seconds must be in 5..300")
    header = (
        f"{'N':>5} {'hostile':>9} {'workers':>7} {'conn p99':>9} {'join p50':>9} {'join p99':>9} {'hb p50':>8} "
        f"{'hb p99':>8} {'drops':>5} {'srv drop':>8} {'RSS/cl KiB':>10} {'threads':>7} {'log KiB':>8}"
    )
    print(header, flush=True)
    for n in args.sizes:
        for kind in args.hostile:
            row = scenario(n, kind, args.seconds, args.code.resolve())
            print(
                f"{row['clients']:>5} {row['hostile']:>9} {row['workers']:>7} {row['connect_p99_ms']:>7.1f}ms "
                f"{row['join_p50_ms']:>7.1f}ms "
                f"{row['join_p99_ms']:>7.1f}ms {row['hb_p50_ms']:>6.1f}ms {row['hb_p99_ms']:>6.1f}ms "
                f"{row['drops']:>5} {row['server_dropped']:>8} {row['rss_per_client_kib']:>10.1f} "
                f"{row['threads']:>7} {row['log_kib']:>8.1f}   {row['errors'] or ''}",
                flush=True,
            )


if __name__ == "__main__":
    main()
