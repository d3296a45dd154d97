"""Benchmark: streaming weighted mean (fedcore) vs flwr's aggregate / aggregate_inplace vs the machine's `a += b`;
robust aggregators (median, trimmed mean, Krum) vs numpy's np.median over the stacked updates.

    python bench/aggregation.py                       # 100 clients x 10M float32 params (4 GB of updates)
    python bench/aggregation.py --clients 10 --params 1_000_000   # quick run
    python bench/aggregation.py --repeat 3                        # best and spread of 3 interleaved rounds
    python bench/aggregation.py --robust --params 1_000_000       # the robust rows only

The robust rows (``--robust``, or all rows without ``--only``) read the updates as the server does: each client's
update is written to a safetensors file first (outside the measurement), then mapped read-only
(``open_safetensors``) and added; the files are the updates' only copy, so the peak is the aggregator's own
memory: the target is under 4x one model plus the gather buffers, whatever the number of clients. numpy's row
stacks the updates in memory (clients x model) and takes ``np.median(axis=0)`` per tensor; its peak is counted
above the stacked input.

Every method runs in a fresh subprocess that builds its own inputs (client updates as arrays, or as
serialized bytes), resets the peak-RSS counter (/proc/self/clear_refs), aggregates once (after a tiny warm-up),
and reports wall time and VmHWM − VmRSS(before): the peak memory the aggregation itself needed above its
inputs. Throughput is GB/s of client updates consumed (clients x params x 4 bytes / seconds), including the
final division / cast. The limit is numpy's in-place float32 `a += b` on 10M-element arrays, one core, best of
several (it consumes 4 bytes of `b` per element).

With --repeat N every row runs N times, the rounds interleaved (all rows, then all rows again) so that a burst
of load from other processes hits every row alike; a row shows the best run and the spread (worst..best GB/s),
and the verdicts use the best runs. The header prints os.getloadavg() before and after: on a shared machine
compare numbers only within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _shapes(params: int) -> list[tuple[int, ...]]:
    a, b, c = params // 2, params * 3 // 10, params * 3 // 20
    return [(a // 1000, 1000) if a % 1000 == 0 else (a,), (b,), (c,), (params - a - b - c,)]


def _client_arrays(rng: np.random.Generator, shapes: list[tuple[int, ...]]) -> dict[str, np.ndarray]:
    return {f"layer{i}.weight": rng.random(s, dtype=np.float32) - 0.5 for i, s in enumerate(shapes)}


def _worker(method: str, clients: int, params: int, block: int | None) -> dict[str, float | str | bool]:
    rng = np.random.default_rng(0)
    shapes = _shapes(params)
    weights = [int(w) for w in rng.integers(10, 1000, clients)]
    if method == "inplace_add":
        n = 10_000_000
        a = np.zeros(n, np.float32)
        bs = [rng.random(n, dtype=np.float32) for _ in range(8)]
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for b in bs:
                a += b
            best = min(best, time.perf_counter() - t0)
        return {"seconds": best, "bytes": 8 * n * 4, "peak_kb": 0, "peak_reset": True}

    if method.startswith("ours"):
        import fedcore.aggregation.streaming
        from fedcore.aggregation import WeightedMean
        from fedcore.tensors import encode, spec_of

        if block is not None:
            fedcore.aggregation.streaming._BLOCK = block  # tuning runs only (read when a WeightedMean is built)
        threads = 1 if method.endswith("1thread") else None
        updates: list = []
        for _ in range(clients):
            arrays = _client_arrays(rng, shapes)
            updates.append(encode(arrays) if method.startswith("ours_bytes") else arrays)
        spec = spec_of(_client_arrays(rng, shapes))
        warm = WeightedMean(spec_of({"w": np.zeros(1 << 20, np.float32)}), threads=threads)  # starts the threads
        warm.add({"w": np.ones(1 << 20, np.float32)}, 1.0)
        warm.add_bytes(encode({"w": np.ones(1 << 20, np.float32)}), 1.0)
        del warm
        rss0 = _status_kb("VmRSS")
        reset = _reset_peak()
        t0 = time.perf_counter()
        acc = WeightedMean(spec, threads=threads)
        if method.startswith("ours_bytes"):
            for k, (payload, w) in enumerate(zip(updates, weights, strict=True)):
                acc.add_bytes(payload, w, client_id=str(k))
        else:
            for k, (arrays, w) in enumerate(zip(updates, weights, strict=True)):
                acc.add(arrays, w, client_id=str(k))
        result = acc.result()
        seconds = time.perf_counter() - t0
        peak = _status_kb("VmHWM") - rss0
        del result
        return {
            "seconds": seconds,
            "bytes": clients * params * 4,
            "peak_kb": peak,
            "peak_reset": reset,
            "threads": acc.threads,
        }

    if method.startswith("robust_"):
        return _robust_worker(method.removeprefix("robust_"), clients, shapes, rng)
    if method == "numpy_median":
        stacked = [np.stack([rng.random(s, dtype=np.float32) - 0.5 for _ in range(clients)]) for s in shapes]
        rss0 = _status_kb("VmRSS")
        reset = _reset_peak()
        t0 = time.perf_counter()
        medians = [np.median(x, axis=0) for x in stacked]
        seconds = time.perf_counter() - t0
        peak = _status_kb("VmHWM") - rss0
        del medians
        return {"seconds": seconds, "bytes": clients * params * 4, "peak_kb": peak, "peak_reset": reset}

    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.server.strategy.aggregate import aggregate, aggregate_inplace

    if method == "flwr_aggregate":
        results = [(list(_client_arrays(rng, shapes).values()), w) for w in weights]
        rss0 = _status_kb("VmRSS")
        reset = _reset_peak()
        t0 = time.perf_counter()
        out = aggregate(results)
    elif method == "flwr_inplace":
        fit = [
            (
                None,
                FitRes(Status(Code.OK, ""), ndarrays_to_parameters(list(_client_arrays(rng, shapes).values())), w, {}),
            )
            for w in weights
        ]
        rss0 = _status_kb("VmRSS")
        reset = _reset_peak()
        t0 = time.perf_counter()
        out = aggregate_inplace(fit)  # type: ignore[arg-type]
    else:
        raise SystemExit(f"unknown method {method}")
    seconds = time.perf_counter() - t0
    peak = _status_kb("VmHWM") - rss0
    del out
    return {"seconds": seconds, "bytes": clients * params * 4, "peak_kb": peak, "peak_reset": reset}


def _robust_worker(
    rule: str, clients: int, shapes: list[tuple[int, ...]], rng: np.random.Generator
) -> dict[str, float | str | bool]:
    import tempfile

    from fedcore.aggregation import Aggregator, KrumAggregator, MedianAggregator, TrimmedMeanAggregator, robust
    from fedcore.payload import open_safetensors, save_payload
    from fedcore.tensors import spec_of

    aggregators: dict[str, Aggregator] = {
        "median": MedianAggregator(),
        "trimmed": TrimmedMeanAggregator(beta=0.1),
        "krum": KrumAggregator(byzantine=max(0, (clients - 3) // 4)),
    }
    aggregator = aggregators[rule]
    with tempfile.TemporaryDirectory(prefix="fedcore-bench-") as directory:
        paths = []
        for k in range(clients):  # one update in memory at a time, written as the server spills them
            paths.append(Path(directory) / f"update-{k}.safetensors")
            save_payload(paths[-1], _client_arrays(rng, shapes), durable=False)
        spec = spec_of(_client_arrays(rng, shapes))
        from fedcore.kernels import warm_up

        warm_up()  # kernels compiled for read-only (mapped) updates too, as a server does before it listens
        warm = aggregator.start(spec_of({"w": np.zeros(64, np.float32)}), round=0)
        for k in range(clients):
            warm.add({"w": np.full(64, k, np.float32)}, 1.0)
        warm.result(release=True)  # threads started
        rss0 = _status_kb("VmRSS")
        reset = _reset_peak()
        t0 = time.perf_counter()
        accumulator = aggregator.start(spec, round=1)
        for k, path in enumerate(paths):
            update, _ = open_safetensors(path)
            accumulator.add(update, 1.0, client_id=str(k))
            del update
        result = accumulator.result(release=True)
        seconds = time.perf_counter() - t0
        peak = _status_kb("VmHWM") - rss0
        del result, accumulator
    params = sum(int(np.prod(s)) for s in shapes)
    buffers = robust.SpilledUpdates(spec).threads * robust._GATHER_BYTES  # one gather buffer per thread
    return {
        "seconds": seconds,
        "bytes": clients * params * 4,
        "peak_kb": peak,
        "peak_reset": reset,
        "buffers_kb": buffers / 1024,
    }


def _run(method: str, clients: int, params: int, block: int | None) -> dict[str, float | str | bool]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, __file__, "--worker", method, "--clients", str(clients), "--params", str(params)]
    if block is not None:
        cmd += ["--block", str(block)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--params", type=lambda s: int(s.replace("_", "")), default=10_000_000)
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds; rows show best and spread")
    parser.add_argument("--block", type=int, default=None, help="override fedcore's fold block size (tuning)")
    parser.add_argument("--only", default=None, help="comma-separated methods to run (tuning); no verdicts")
    parser.add_argument("--robust", action="store_true", help="only the robust rows (and numpy's median)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.clients, args.params, args.block)))
        return

    model_mb = args.params * 4 / 1e6
    small = max(2, args.clients // 5)
    print(
        f"{args.clients} clients x {args.params:,} float32 params in 4 tensors = "
        f"{args.clients * model_mb / 1e3:.2f} GB of updates; model = {model_mb:.0f} MB; "
        f"{os.cpu_count()} CPUs, numpy {np.__version__}" + (f"; block {args.block}" if args.block else "")
    )
    print(f"  load average (1/5/15 min) at start: {_load()}")
    runs = [
        ("inplace_add", "numpy a += b (f32, 1 core): limit", args.clients),
        ("ours_arrays", "fedcore add (arrays)", args.clients),
        ("ours_arrays_1thread", "fedcore add (arrays), 1 thread", args.clients),
        ("ours_bytes", "fedcore add_bytes (safetensors)", args.clients),
        ("flwr_aggregate", "flwr aggregate (arrays)", args.clients),
        ("flwr_inplace", "flwr aggregate_inplace (bytes)", args.clients),
        ("ours_arrays", f"fedcore add (arrays), {small} clients", small),
        ("ours_bytes", f"fedcore add_bytes, {small} clients", small),
    ]
    robust_runs = [
        ("numpy_median", "numpy np.median (stacked in memory)", args.clients),
        ("robust_median", "fedcore median (mapped files)", args.clients),
        ("robust_trimmed", "fedcore trimmed mean 0.1 (mapped)", args.clients),
        ("robust_krum", f"fedcore Krum f={max(0, (args.clients - 3) // 4)} (mapped)", args.clients),
        ("robust_median", f"fedcore median, {small} clients", small),
    ]
    runs = robust_runs if args.robust else runs + robust_runs
    if args.only:
        runs = [r for r in runs if r[0] in args.only.split(",")]
    results: dict[tuple[str, int], list[dict[str, float | str | bool]]] = {}
    for _ in range(args.repeat):
        for method, _label, clients in runs:
            r = _run(method, clients, args.params, args.block)
            r["gbs"] = float(r["bytes"]) / float(r["seconds"]) / 1e9
            results.setdefault((method, clients), []).append(r)
    print(f"  load average (1/5/15 min) at end:   {_load()}")
    rows = {key: max(rs, key=lambda r: float(r["gbs"])) for key, rs in results.items()}
    for method, label, clients in runs:
        r = rows[(method, clients)]
        spread = [float(x["gbs"]) for x in results[(method, clients)]]
        spread_s = f" ({min(spread):5.2f}..{max(spread):5.2f})" if len(spread) > 1 else ""
        peak_mb = max(float(x["peak_kb"]) for x in results[(method, clients)]) * 1024 / 1e6
        peak = "" if method == "inplace_add" else f"{peak_mb:9.0f} MB {peak_mb / model_mb:5.2f}x"
        threads = f" [{r['threads']} thr]" if "threads" in r else ""
        note = "" if r.get("peak_reset", True) else "  (peak not reset: includes input building)"
        print(
            f"  {label + threads:<48} {float(r['seconds']):8.3f} s {float(r['gbs']):7.2f} GB/s{spread_s} {peak}{note}"
        )
    robust_rows = [(m, c) for m, _, c in runs if m.startswith("robust_")]
    if robust_rows:
        print()
        for method, clients in robust_rows:
            r = rows[(method, clients)]
            peak_mb = max(float(x["peak_kb"]) for x in results[(method, clients)]) * 1024 / 1e6
            bound = 4 * model_mb + float(r["buffers_kb"]) * 1024 / 1e6
            verdict = "PASS" if peak_mb < bound else "MISS"
            print(
                f"  {verdict}  {method} at {clients} clients: peak {peak_mb:.0f} MB < 4x model + gather buffers = "
                f"{bound:.0f} MB"
            )
    if args.only or args.robust:
        return

    limit = float(rows[("inplace_add", args.clients)]["gbs"])
    flwr_best = max(
        float(rows[("flwr_aggregate", args.clients)]["gbs"]), float(rows[("flwr_inplace", args.clients)]["gbs"])
    )
    ours = rows[("ours_arrays", args.clients)]
    ours_b = rows[("ours_bytes", args.clients)]
    ours_1 = rows[("ours_arrays_1thread", args.clients)]
    print()
    print(f"  faster flwr path: {flwr_best:.2f} GB/s; a += b limit: {limit:.2f} GB/s (best runs)")
    for name, r in (("add (arrays)", ours), ("add_bytes", ours_b), ("add, 1 thread", ours_1)):
        print(
            f"  fedcore {name:<14} / flwr = {float(r['gbs']) / flwr_best:5.2f}x   "
            f"/ a+=b = {float(r['gbs']) / limit:4.2f}"
        )

    # Peak memory above the inputs, worst over repeats and over add/add_bytes. It is noisy (allocator reuse, page
    # cache, lazily touched pages), so "independent of the number of clients" is judged as: under the same
    # 3x-model bound at both client counts, not as "equal within x%" of two noisy numbers.
    def peak_models(clients: int) -> float:
        kb = max(float(x["peak_kb"]) for m in ("ours_arrays", "ours_bytes") for x in results[(m, clients)])
        return kb * 1024 / 1e6 / model_mb

    p_small, p_big = peak_models(small), peak_models(args.clients)
    print()
    verdicts = [
        (">= 2x the faster flwr path", min(float(ours["gbs"]), float(ours_b["gbs"])) >= 2 * flwr_best),
        (">= 0.5 of a += b bandwidth", min(float(ours["gbs"]), float(ours_b["gbs"])) >= 0.5 * limit),
        (
            f"peak memory above inputs < 3x one model at {small} clients ({p_small:.2f}x) "
            f"and at {args.clients} clients ({p_big:.2f}x)",
            max(p_small, p_big) < 3.0,
        ),
    ]
    for target, ok in verdicts:
        print(f"  {'PASS' if ok else 'MISS'}  {target}")


if __name__ == "__main__":
    main()
