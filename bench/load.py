"""Benchmark: how many connected daemons one coordinator holds, with and without one hostile client.

    python bench/load.py                                   # N = 50, 200, 1000; each without and with a hostile client
    python bench/load.py --sizes 200 --hostile none stall  # one size, two scenarios
    python bench/load.py --code /path/to/other/checkout    # the same load against another tree's server code
    python bench/load.py --sizes 1000 --client-procs 2     # the honest clients split over two processes
    python bench/load.py --per-call 1000                   # server CPU per join / heartbeat / pull / refused join

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
- log: bytes the server logged;
- srv CPU, cl CPU: CPU seconds the server and the honest clients' process(es) used from the first join to the
  end; 0-4s: the same over the first 4 s (the joins and first pulls), server/clients; load: the 1-minute load
  average at the end (the machine may be shared: latencies depend on it, CPU seconds per call much less).

The honest clients join as the daemon does (client id and token in the call metadata, so the token is checked
before the request is read). ``--per-call K`` instead measures the server's CPU per call, K calls of each kind
made one after another by one client: a load-independent cost, where the latencies above depend on what else
runs on the machine.

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
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
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
    cpu_s: float = 0.0  # CPU seconds the clients' process(es) took

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def honest_client(index: int, port: int, stats: Stats, start_in: float, until: float) -> None:
    import grpc

    from fedcore.proto.v1 import fedcore_pb2 as pb
    from fedcore.wire import coordinator_stub, join_metadata

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
                        metadata=join_metadata(client_id, token),  # as the daemon: id and token in the metadata
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


async def run_clients(indices: range, port: int, seconds: float) -> Stats:
    """Run the honest clients ``indices`` (joins spread over the first 2 s) for ``seconds`` of steady load."""
    stats = Stats()
    until = time.monotonic() + 2 + seconds
    await asyncio.gather(*(honest_client(i, port, stats, random.uniform(0, 2), until) for i in indices))
    return stats


def clients_process(first: int, count: int, port: int, seconds: float) -> None:
    """``--clients-run``: honest clients ``first .. first + count - 1`` in this process, started when a line
    arrives on stdin (after the imports); prints their Stats as JSON and the CPU seconds they took."""
    import fedcore.wire  # noqa: F401 - imported (torch with it) before the clock starts

    print("ready", flush=True)
    sys.stdin.readline()
    cpu = time.process_time()
    stats = asyncio.run(run_clients(range(first, first + count), port, seconds))
    print(json.dumps({**stats.__dict__, "cpu_s": time.process_time() - cpu}), flush=True)


def clients_in_processes(n: int, procs: int, port: int, seconds: float, on_start: Callable[[list[int]], None]) -> Stats:
    """Run ``n`` honest clients split over ``procs`` processes; ``on_start`` gets their pids as the clock starts."""
    bounds = [n * k // procs for k in range(procs + 1)]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--clients-run", str(lo), str(hi - lo), str(port), str(seconds)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for lo, hi in itertools.pairwise(bounds)
    ]
    try:
        for child in children:
            assert child.stdin is not None and child.stdout is not None
            child.stdout.readline()  # "ready"
        on_start([child.pid for child in children])
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        merged = Stats()
        for child in children:
            out, _ = child.communicate(timeout=seconds + 60)
            got = json.loads(out.strip().splitlines()[-1])
            for key in ("connects", "joins", "heartbeats"):
                getattr(merged, key).extend(got[key])
            merged.lost_sessions += got["lost_sessions"]
            merged.never_joined += got["never_joined"]
            merged.refused_pulls += got["refused_pulls"]
            for what, count in got["errors"].items():
                merged.errors[what] = merged.errors.get(what, 0) + count
            merged.cpu_s += got["cpu_s"]
        return merged
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


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


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _start_server(code: Path, port_file: Path, log_file: Path, n: int, limit: float) -> tuple[Any, int, str]:
    """Start the ``--serve`` process of ``code``'s server for ``n`` clients; returns it, its port and workers."""
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{ROOT}"}
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port_file), str(log_file), str(n), str(limit)],
        cwd=code,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"the bench server did not start (exit code {server.poll()})")
        time.sleep(0.1)
    port_text, workers = port_file.read_text().split()
    time.sleep(1.0)
    return server, int(port_text), workers


def per_call(calls: int, code: Path) -> dict[str, float]:
    """Server CPU milliseconds per call of each kind, ``calls`` of each made one after another by one client
    (so the figure does not depend on the load: a call's CPU, not its wait). Kinds: a join, a heartbeat, a pull
    that answers at once (``wait_s=0``), a join refused for a wrong token."""
    import grpc

    from fedcore.proto.v1 import fedcore_pb2 as pb
    from fedcore.wire import coordinator_stub, join_metadata

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fedcore-load-") as tmp:
        server, port, _ = _start_server(code, Path(tmp) / "port", Path(tmp) / "server.log", calls, 300)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_retries", 0)]) as channel:
                stub = coordinator_stub(channel)
                sessions: list[str] = []

                def join(i: int) -> None:
                    token = f"token-{i}"
                    reply = stub.Join(
                        pb.JoinRequest(client_id=f"c{i:04d}", token=token), metadata=join_metadata(f"c{i:04d}", token)
                    )
                    sessions.append(reply.session)

                def heartbeat(i: int) -> None:
                    meta = (("fedcore-session", sessions[i]),)
                    stub.Heartbeat(pb.HeartbeatRequest(session=sessions[i]), metadata=meta)

                def pull(i: int) -> None:
                    meta = (("fedcore-session", sessions[i]),)
                    list(stub.PullTask(pb.PullTaskRequest(session=sessions[i], wait_s=0), metadata=meta))

                def bad_join(i: int) -> None:
                    with contextlib.suppress(grpc.RpcError):
                        wrong = pb.JoinRequest(client_id="c0000", token="wrong")
                        stub.Join(wrong, metadata=join_metadata("c0000", "wrong"))

                for name, call in (("join", join), ("heartbeat", heartbeat), ("pull", pull), ("bad join", bad_join)):
                    cpu, wall = _cpu_s(server.pid), time.monotonic()
                    for i in range(calls):
                        call(i)
                    out[f"{name} cpu ms"] = 1000 * (_cpu_s(server.pid) - cpu) / calls
                    out[f"{name} wall ms"] = 1000 * (time.monotonic() - wall) / calls
        finally:
            server.kill()
            server.wait()
    return out


def scenario(n: int, kind: str, seconds: float, code: Path, client_procs: int = 1) -> dict[str, object]:
    """Run one scenario and return its row; the honest clients run in this process, or split over
    ``client_procs`` processes."""
    import fedcore.wire  # noqa: F401 - imported (torch with it) before the clock starts

    with tempfile.TemporaryDirectory(prefix="fedcore-load-") as tmp:
        port_file, log_file = Path(tmp) / "port", Path(tmp) / "server.log"
        server, port, workers = _start_server(code, port_file, log_file, n, seconds + 40)
        try:
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
            joining: list[float] = []  # CPU seconds of server and clients over the joins' first 4 s
            probe: list[threading.Timer] = []
            server_cpu = 0.0

            def start_clock(pids: list[int]) -> None:
                nonlocal server_cpu
                server_cpu, base = _cpu_s(server.pid), sum(_cpu_s(pid) for pid in pids)

                def sample() -> None:
                    with contextlib.suppress(OSError):
                        clients = sum(_cpu_s(pid) for pid in pids) - base
                        joining.extend((_cpu_s(server.pid) - server_cpu, clients))

                probe.append(threading.Timer(4.0, sample))
                probe[0].start()

            if client_procs > 1:
                stats = clients_in_processes(n, client_procs, port, seconds, start_clock)
            else:
                start_clock([os.getpid()])
                cpu = time.process_time()
                stats = asyncio.run(run_clients(range(n), port, seconds))
                stats.cpu_s = time.process_time() - cpu
            probe[0].cancel()
            server_cpu = _cpu_s(server.pid) - server_cpu
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
        "server_cpu_s": server_cpu,
        "client_cpu_s": stats.cpu_s,
        "client_procs": client_procs,
        "join_phase_cpu_s": joining[:2],
        "load": os.getloadavg()[0],
        "errors": dict(sorted(stats.errors.items())),
    }


def _pair(values: object) -> str:
    return "/".join(f"{v:.1f}" for v in values) if isinstance(values, list) and values else "-"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--clients-run":
        clients_process(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--hostile-run":
        hostile(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 1000], choices=range(1, 2001), metavar="N")
    parser.add_argument("--hostile", nargs="+", default=["none", "stall"], choices=HOSTILE_KINDS)
    parser.add_argument("--seconds", type=float, default=35.0, help="steady load per scenario (5..300)")
    parser.add_argument("--code", type=Path, default=ROOT, help="checkout whose server code is measured")
    parser.add_argument(
        "--client-procs", type=int, default=1, choices=range(1, 9), metavar="P",
        help="split the honest clients over P processes (1: all in this one)",
    )  # fmt: skip
    parser.add_argument(
        "--per-call", type=int, default=0, metavar="K", help="instead: server CPU per call, K calls of each kind"
    )
    args = parser.parse_args()
    if args.per_call:
        for key, value in per_call(min(args.per_call, 2000), args.code.resolve()).items():
            print(f"{key:>18}: {value:.3f}")
        return
    if not 5 <= args.seconds <= 300:
        parser.error("--seconds must be in 5..300")
    header = (
        f"{'N':>5} {'hostile':>9} {'workers':>7} {'conn p99':>9} {'join p50':>9} {'join p99':>9} {'hb p50':>8} "
        f"{'hb p99':>8} {'drops':>5} {'srv drop':>8} {'RSS/cl KiB':>10} {'threads':>7} {'log KiB':>8} "
        f"{'srv CPU':>7} {'cl CPU':>6} {'0-4s s/c':>9} {'load':>5}"
    )
    print(header, flush=True)
    for n in args.sizes:
        for kind in args.hostile:
            row = scenario(n, kind, args.seconds, args.code.resolve(), args.client_procs)
            print(
                f"{row['clients']:>5} {row['hostile']:>9} {row['workers']:>7} {row['connect_p99_ms']:>7.1f}ms "
                f"{row['join_p50_ms']:>7.1f}ms "
                f"{row['join_p99_ms']:>7.1f}ms {row['hb_p50_ms']:>6.1f}ms {row['hb_p99_ms']:>6.1f}ms "
                f"{row['drops']:>5} {row['server_dropped']:>8} {row['rss_per_client_kib']:>10.1f} "
                f"{row['threads']:>7} {row['log_kib']:>8.1f} {row['server_cpu_s']:>6.1f}s {row['client_cpu_s']:>5.1f}s "
                f"{_pair(row['join_phase_cpu_s']):>9} {row['load']:>5.2f}   {row['errors'] or ''}",
                flush=True,
            )


if __name__ == "__main__":
    main()
