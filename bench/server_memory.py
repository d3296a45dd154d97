"""Benchmark: peak and per-round resident memory of a real `fedcore server start` under large updates.

    python bench/server_memory.py                  # both parts (a) and (b), the issue's figures
    python bench/server_memory.py --part a         # 20 clients x 256 MiB update, one round: peak RSS / model size
    python bench/server_memory.py --part b         # 50 rounds of a 64 MiB model, 10 clients: RSS after each round
    python bench/server_memory.py --part a --mib 64 --clients 4    # a quick run

Everything is real and runs as separate processes over loopback gRPC (plaintext): the server is
``python -m fedcore.cli server start`` (server.app: the gRPC pool and service, streaming aggregation, the server
optimizer, SQLite and atomic checkpoints after every round). The clients are the real
:class:`client.daemon.ClientDaemon` (pull, decode, :func:`client.runner.run_instruction`, encode, push), several
daemons per process to spare each one a torch import, with this module's task: a model of ``--mib`` MiB of float32
tensors whose ``train()`` adds a small per-client constant (no data). So that 20 clients x ~1 GiB of client-side
buffers fit a shared machine, each client process lets ``--slots`` daemons at a time go from a pulled task to its
pushed result, first come first served; the others stay connected (heartbeats) and wait their turn.

Peak memory is the server process's ``VmHWM`` from /proc/PID/status, read by this script; the baseline
subtracted from it is the server's own RSS before the model exists (its "memory before the model" line: Python,
torch, gRPC, the task factory). The breakdown comes from the server's memory lines and its debug trace (logger
``fedcore.server.memory``: RSS at each stage of a round).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from fedcore.messages import Reply
from fedcore.task import EvalResult, FitConfig, TaskContext, TrainContext, TrainResult

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


# --------------------------------------------------------------------------------------------- the task
class _Blob(torch.nn.Module):
    """``tensors`` float32 vectors that together hold ``mib`` MiB."""

    def __init__(self, mib: float, tensors: int) -> None:
        super().__init__()
        total = int(mib * MIB) // 4
        for k in range(tensors):
            size = total // tensors + (1 if k < total % tensors else 0)
            self.register_parameter(f"w{k}", torch.nn.Parameter(torch.full((size,), 0.5)))


class MemoryTask:
    """The bench's task: no data; ``train`` adds ``1e-3 * (1 + client index % 7)`` to every weight."""

    def __init__(self, context: TaskContext) -> None:
        self.mib = float(context.options.get("mib", "64"))
        self.tensors = int(context.options.get("tensors", "8"))
        digits = re.findall(r"\d+", context.client_id)
        self.index = int(digits[-1]) if digits else 0

    def build_model(self) -> torch.nn.Module:
        return _Blob(self.mib, self.tensors)

    def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        delta = 1e-3 * (1 + self.index % 7)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(delta)
        return TrainResult(num_examples=100 + self.index, metrics={"train_loss": delta})

    def evaluate(self, model: torch.nn.Module, batch_size: int) -> EvalResult:
        return EvalResult(loss=0.0, num_examples=1)


def memory_task(context: TaskContext) -> MemoryTask:
    """Task factory (``--task bench.server_memory:memory_task``); options ``mib`` and ``tensors``."""
    return MemoryTask(context)


# ------------------------------------------------------------------------------------ client processes
class _FifoGate:
    """At most ``slots`` holders; waiters are served in arrival order (a daemon that just pushed queues last)."""

    def __init__(self, slots: int) -> None:
        self._slots = slots
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()

    def acquire(self) -> None:
        me = object()
        with self._cond:
            self._queue.append(me)
            while self._queue[0] is not me or self._slots == 0:
                self._cond.wait()
            self._queue.popleft()
            self._slots -= 1
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._slots += 1
            self._cond.notify_all()


def _run_clients(server: str, ids: list[str], options: Mapping[str, str], slots: int) -> int:
    """Run one real ClientDaemon per id on threads of this process; return 0 when all finished cleanly."""
    from client.daemon import ClientDaemon, DaemonConfig

    gate = _FifoGate(slots)

    class GatedDaemon(ClientDaemon):
        # the daemon's own pull / execute / push; the gate only bounds how many hold a model at once
        def _pull(self, stub: object) -> object:  # type: ignore[override]
            gate.acquire()
            try:
                got = super()._pull(stub)  # type: ignore[arg-type]
            except BaseException:
                gate.release()
                raise
            if isinstance(got, bool):
                gate.release()
            return got

        def _push(self, stub: object, task_id: str, reply: Reply) -> None:
            try:
                super()._push(stub, task_id, reply)  # type: ignore[arg-type]
            finally:
                gate.release()

    torch.set_num_threads(1)
    codes: dict[str, int] = {}

    def one(cid: str) -> None:
        config = DaemonConfig(
            server=server,
            client_id=cid,
            task="bench.server_memory:memory_task",
            task_options=dict(options),
            insecure=True,
            poll_s=1.0,
            backoff_max_s=2.0,
            give_up_after_s=120.0,
        )
        codes[cid] = GatedDaemon(config, memory_task).run()

    threads = [threading.Thread(target=one, args=(cid,), name=cid) for cid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0 if all(code == 0 for code in codes.values()) and len(codes) == len(ids) else 1


# --------------------------------------------------------------------------------------------- driver
def _status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


class _Run:
    """One server process plus client processes; samples the server's /proc status while it runs."""

    def __init__(self, args: argparse.Namespace, *, mib: float, clients: int, rounds: int, name: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"fedcore-memory-{name}-", dir=args.tmp))
        self.mib = mib
        self.options = {"mib": f"{mib:g}", "tensors": str(args.tensors)}
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.env = env
        self.server_log = self.dir / "server.log"
        opts: list[str] = []
        for key, value in self.options.items():
            opts += ["--task-option", f"{key}={value}"]
        cmd = [
            sys.executable, "-m", "fedcore.cli", "-v", "server", "start", "--insecure",
            "--address", "127.0.0.1:0", "--state-dir", str(self.dir / "state"),
            "--task", "bench.server_memory:memory_task", *opts,
            "--rounds", str(rounds), "--fraction-fit", "1.0", "--min-fit-clients", str(clients),
            "--no-evaluate", "--round-timeout-s", "1200", "--wait-for-clients-s", "300",
            "--heartbeat-interval-s", "5", "--liveness-timeout-s", "60", "--linger-s", "3",
            "--max-workers", str(max(64, 4 * clients)),
        ]  # fmt: skip
        self.started = time.perf_counter()
        self._log_fh = self.server_log.open("wb")
        self.server = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log_fh, stderr=subprocess.STDOUT, env=env)
        self.max_rss = 0
        self.at_max: dict[str, int] = {}
        self._sampling = True
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        port = self._wait_port()
        ids = [f"client-{i:03d}" for i in range(clients)]
        procs = max(1, min(args.client_procs, clients))
        self.clients: list[subprocess.Popen[bytes]] = []
        for p in range(procs):
            mine = ids[p::procs]
            ccmd = [
                sys.executable, str(Path(__file__).resolve()), "--role", "clients", "--server", f"127.0.0.1:{port}",
                "--ids", ",".join(mine), "--slots", str(args.slots), "--mib", f"{mib:g}",
                "--tensors", str(args.tensors),
            ]  # fmt: skip
            log = (self.dir / f"clients-{p}.log").open("wb")
            self.clients.append(subprocess.Popen(ccmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env))

    def _sample(self) -> None:
        while self._sampling:
            status = _status(self.server.pid)
            if status.get("VmRSS", 0) > self.max_rss:
                self.max_rss, self.at_max = status["VmRSS"], status
            time.sleep(0.02)

    def text(self) -> str:
        return self.server_log.read_text(errors="replace")

    def _wait_port(self) -> int:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = re.search(r"listening on [\d.]+:(\d+)", self.text())
            if found:
                return int(found.group(1))
            if self.server.poll() is not None:
                raise SystemExit(f"the server exited early:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        raise SystemExit(f"the server did not start:\n{self.text()[-3000:]}")

    def wait_finished(self, timeout_s: float) -> dict[str, int]:
        """Wait for "finished"; return the server's last /proc status (read before it exits)."""
        deadline = time.monotonic() + timeout_s
        while "finished " not in self.text():
            if self.server.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the server did not finish:\n{self.text()[-4000:]}")
            time.sleep(0.1)
        status = _status(self.server.pid)
        self.seconds = time.perf_counter() - self.started
        self._sampling = False
        return status

    def stop(self) -> None:
        self._sampling = False
        for proc in [*self.clients, self.server]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log_fh.close()


def _mib(n: float) -> str:
    return f"{n / MIB:8.1f} MiB"


def _memory_lines(text: str) -> dict[str, float]:
    """The server's "memory <stage>: rss X MiB" lines."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"memory ([^:\n]+): rss ([\d.]+) MiB", text)}


def _trace(text: str) -> list[tuple[int, str, float, float]]:
    """The round loop's debug trace: ``(round, stage, rss MiB, peak MiB)``."""
    pattern = r"round (\d+) ([^:\n]+): rss ([\d.]+) MiB, peak ([\d.]+) MiB"
    return [(int(a), b, float(c), float(d)) for a, b, c, d in re.findall(pattern, text)]


def _round_seconds(text: str) -> dict[int, float]:
    """Seconds from each round's start (its clients connected) to its end (after the checkpoint), from the trace."""
    stamp = (
        r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) DEBUG fedcore\.server\.memory: "
        r"round (\d+) (round start|round end)"
    )
    marks: dict[tuple[int, str], float] = {}
    for day, ms, rnd, stage in re.findall(stamp, text):
        marks[(int(rnd), stage)] = time.mktime(time.strptime(day, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
    ends = {r: t for (r, st), t in marks.items() if st == "round end"}
    return {r: ends[r] - t for (r, st), t in marks.items() if st == "round start" and r in ends}


def part_a(args: argparse.Namespace) -> bool:
    mib, clients = args.mib or 256.0, args.clients or 20
    model = mib * MIB
    print(f"(a) one round: {clients} clients each push a {mib:g} MiB update ({args.tensors} float32 tensors); "
          f"{args.client_procs} client processes x {args.slots} slot(s)")  # fmt: skip
    run = _Run(args, mib=mib, clients=clients, rounds=1, name="a")
    status = run.wait_finished(args.timeout_s)
    run.stop()
    text = run.text()
    lines = _memory_lines(text)
    base = lines.get("before the model", 0.0) * MIB
    hwm = status.get("VmHWM", 0)
    print(f"  server log: {run.server_log}")
    print(f"  baseline: server RSS before the model exists      {_mib(base)}")
    if "with the model in memory" in lines:
        built = lines["with the model in memory"] * MIB - base
        held = lines.get("with the model mapped from its file", 0) * MIB - base
        print(f"  + the initial model (anonymous, being written)  {_mib(built)}"
              f"   (then held mapped from its file: {_mib(held).strip()} above baseline)")  # fmt: skip
    for rnd, stage, rss, peak in _trace(text):
        print(f"  round {rnd} {stage:<22} rss {_mib(rss * MIB - base)} above baseline   (peak so far "
              f"{_mib(peak * MIB - base).strip()} = {(peak * MIB - base) / model:.2f}x)")  # fmt: skip
    print("  (stages: the running sum is 2x (float64) and fills on the first fold; updates are folded from their "
          "spill files and unmapped block by block; the average is built inside the sum, whose unused half is "
          "freed; the server step copies the average (FedAvg))")  # fmt: skip
    ratio = (hwm - base) / model
    print(f"  peak server RSS (VmHWM)                          {_mib(hwm)}"
          f"  (sampled max VmRSS {_mib(run.max_rss).strip()})")  # fmt: skip
    print(f"  peak above baseline                              {_mib(hwm - base)}  = {ratio:.2f}x the model size")
    print(f"  peak including the baseline                      {hwm / model:.2f}x the model size")
    round_s = _round_seconds(text).get(1, float("nan"))
    print(f"  time: round {round_s:.1f} s (clients connected -> checkpoint written), whole run {run.seconds:.1f} s "
          f"({2 * clients * model / MIB / 1024:.1f} GiB over loopback)")  # fmt: skip
    ok = ratio < 3.0 and f"round 1: {clients} update(s)" in text
    print(f"  verdict: {'PASS' if ok else 'FAIL'} (target: peak above baseline < 3x the model size; "
          f"all {clients} updates folded: {f'round 1: {clients} update(s)' in text})")  # fmt: skip
    return ok


def part_b(args: argparse.Namespace) -> bool:
    mib, clients, rounds = args.mib or 64.0, args.clients or 10, args.rounds
    print(f"(b) {rounds} rounds of a {mib:g} MiB model with {clients} clients")
    run = _Run(args, mib=mib, clients=clients, rounds=rounds, name="b")
    status = run.wait_finished(args.timeout_s)
    run.stop()
    text = run.text()
    base = _memory_lines(text).get("before the model", 0.0)
    after = {rnd: rss for rnd, stage, rss, _ in _trace(text) if stage == "round end"}
    print(f"  server log: {run.server_log}")
    print(f"  baseline before the model: {base:.1f} MiB; RSS after each round (after the checkpoint, MiB):")
    values = [after[r] for r in sorted(after)]
    for i in range(0, len(values), 10):
        chunk = values[i : i + 10]
        print(f"    rounds {i + 1:>2}-{i + len(chunk):<2}: " + " ".join(f"{v:7.1f}" for v in chunk))
    if len(values) < 2:
        print("  verdict: FAIL (no per-round trace)")
        return False
    ok = _flatness(values, mib, rounds)
    print(f"  peak (VmHWM) {status.get('VmHWM', 0) / MIB:.1f} MiB = "
          f"{(status.get('VmHWM', 0) / MIB - base) / mib:.2f}x the model above baseline")  # fmt: skip
    per_round = list(_round_seconds(text).values())
    mean_s = sum(per_round) / max(len(per_round), 1)
    print(f"  time: {run.seconds:.1f} s in all, {mean_s:.2f} s per round on average")
    return ok


def _flatness(values: list[float], mib: float, rounds: int) -> bool:
    """Print the trend of the per-round RSS and the verdict: no growth beyond noise.

    Round-to-round RSS moves by tens of MiB (transfer buffers in flight when a round ends), so the verdict looks at
    the trend, not single rounds: the least-squares growth over the whole run and the mean of the last 10 rounds
    against the first 10 must each stay under 5% of the model size.
    """
    n = len(values)
    xs = list(range(1, n + 1))
    mx, my = sum(xs) / n, sum(values) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, values, strict=True)) / sum((x - mx) ** 2 for x in xs)
    k = min(10, n // 2)
    first, last = sum(values[:k]) / k, sum(values[-k:]) / k
    print(f"  first {values[0]:.1f} MiB, last {values[-1]:.1f} MiB (last - first {values[-1] - values[0]:+.1f} MiB), "
          f"min {min(values):.1f}, max {max(values):.1f}")  # fmt: skip
    print(f"  slope {slope:+.3f} MiB/round = {slope * (n - 1):+.1f} MiB over the run; mean of the first {k} rounds "
          f"{first:.1f} MiB, of the last {k} {last:.1f} MiB ({last - first:+.1f} MiB)")  # fmt: skip
    limit = 0.05 * mib
    ok = n == rounds and slope * (n - 1) < limit and last - first < limit
    print(f"  verdict: {'PASS' if ok else 'FAIL'} (does not grow: trend over the run and last-vs-first means each "
          f"< {limit:.1f} MiB, 5% of the model)")  # fmt: skip
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["a", "b", "both"], default="both")
    parser.add_argument("--mib", type=float, help="model size in MiB (default: 256 for a, 64 for b)")
    parser.add_argument("--clients", type=int, help="clients (default: 20 for a, 10 for b)")
    parser.add_argument("--rounds", type=int, default=50, help="rounds of part b")
    parser.add_argument("--tensors", type=int, default=8, help="float32 tensors the model is split into")
    parser.add_argument("--client-procs", type=int, default=4, help="client processes (daemons spread over them)")
    parser.add_argument("--slots", type=int, default=1, help="daemons per client process holding a model at once")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--tmp", help="directory for state directories and logs (default: the system's)")
    parser.add_argument("--role", choices=["driver", "clients"], default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "clients":
        options = {"mib": f"{args.mib:g}", "tensors": str(args.tensors)}
        return _run_clients(args.server, args.ids.split(","), options, args.slots)
    ok = True
    if args.part in ("a", "both"):
        ok = part_a(args) and ok
    if args.part in ("b", "both"):
        ok = part_b(args) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
