"""Benchmark: streaming weighted mean (fedcore) vs flwr's aggregate / aggregate_inplace vs the machine's `a += b`.

    python bench/aggregation.py                       # 100 clients x 10M float32 params (4 GB of updates)
    python bench/aggregation.py --clients 10 --params 1_000_000   # quick run

Every method runs in a fresh subprocess that builds its own inputs (client updates as arrays, or as
serialized bytes), resets the peak-RSS counter (/proc/self/clear_refs), aggregates once (after a tiny warm-up),
and reports wall time and VmHWM − VmRSS(before): the peak memory the aggregation itself needed above its
inputs. Throughput is GB/s of client updates consumed (clients x params x 4 bytes / seconds), including the
final division / cast. The limit is numpy's in-place float32 `a += b` on 10M-element arrays, one core, best of
several (it consumes 4 bytes of `b` per element).
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


def _worker(method: str, clients: int, params: int) -> dict[str, float | str | bool]:
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
        import torch

        from fedcore.aggregation import WeightedMean
        from fedcore.tensors import encode, spec_of

        if method.endswith("1thread"):
            torch.set_num_threads(1)
        updates: list = []
        for _ in range(clients):
            arrays = _client_arrays(rng, shapes)
            updates.append(encode(arrays) if method.startswith("ours_bytes") else arrays)
        spec = spec_of(_client_arrays(rng, shapes))
        warm = WeightedMean(spec_of({"w": np.zeros(1 << 20, np.float32)}))  # torch's first-call setup
        warm.add({"w": np.ones(1 << 20, np.float32)}, 1.0)
        warm.add_bytes(encode({"w": np.ones(1 << 20, np.float32)}), 1.0)
        del warm
        rss0 = _status_kb("VmRSS")
        reset = _reset_peak()
        t0 = time.perf_counter()
        acc = WeightedMean(spec)
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
        out = aggregate_inplace(fit)
    else:
        raise SystemExit(f"unknown method {method}")
    seconds = time.perf_counter() - t0
    peak = _status_kb("VmHWM") - rss0
    del out
    return {"seconds": seconds, "bytes": clients * params * 4, "peak_kb": peak, "peak_reset": reset}


def _run(method: str, clients: int, params: int) -> dict[str, float | str | bool]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, __file__, "--worker", method, "--clients", str(clients), "--params", str(params)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--params", type=lambda s: int(s.replace("_", "")), default=10_000_000)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.clients, args.params)))
        return

    import torch

    model_mb = args.params * 4 / 1e6
    small = max(2, args.clients // 5)
    print(
        f"{args.clients} clients x {args.params:,} float32 params in 4 tensors = "
        f"{args.clients * model_mb / 1e3:.2f} GB of updates; model = {model_mb:.0f} MB; "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, numpy {np.__version__}"
    )
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
    rows = {}
    for method, label, clients in runs:
        r = _run(method, clients, args.params)
        rows[(method, clients)] = r
        gbs = float(r["bytes"]) / float(r["seconds"]) / 1e9
        r["gbs"] = gbs
        peak = (
            ""
            if method == "inplace_add"
            else f"{float(r['peak_kb']) * 1024 / 1e6:9.0f} MB {float(r['peak_kb']) * 1024 / 1e6 / model_mb:5.2f}x"
        )
        note = "" if r.get("peak_reset", True) else "  (peak not reset: includes input building)"
        print(f"  {label:<42} {float(r['seconds']):8.3f} s {gbs:7.2f} GB/s {peak}{note}")

    limit = rows[("inplace_add", args.clients)]["gbs"]
    flwr_best = max(rows[("flwr_aggregate", args.clients)]["gbs"], rows[("flwr_inplace", args.clients)]["gbs"])
    ours = rows[("ours_arrays", args.clients)]
    ours_b = rows[("ours_bytes", args.clients)]
    ours_1 = rows[("ours_arrays_1thread", args.clients)]
    print()
    print(f"  faster flwr path: {flwr_best:.2f} GB/s; a += b limit: {limit:.2f} GB/s")
    for name, r in (("add (arrays)", ours), ("add_bytes", ours_b), ("add, 1 thread", ours_1)):
        print(
            f"  fedcore {name:<14} / flwr = {float(r['gbs']) / float(flwr_best):5.2f}x   "
            f"/ a+=b = {float(r['gbs']) / float(limit):4.2f}"
        )
    peak_small = max(float(rows[("ours_arrays", small)]["peak_kb"]), float(rows[("ours_bytes", small)]["peak_kb"]))
    peak_big = max(float(ours["peak_kb"]), float(ours_b["peak_kb"]))
    peak_models = peak_big * 1024 / 1e6 / model_mb
    print()
    verdicts = [
        (">= 2x the faster flwr path", min(float(ours["gbs"]), float(ours_b["gbs"])) >= 2 * float(flwr_best)),
        (">= 0.5 of a += b bandwidth", min(float(ours["gbs"]), float(ours_b["gbs"])) >= 0.5 * float(limit)),
        ("peak memory < 3x one model", peak_models < 3.0),
        (
            f"peak memory independent of clients "
            f"({small}: {peak_small / 1e3:.0f} MB, {args.clients}: {peak_big / 1e3:.0f} MB)",
            abs(peak_big - peak_small) <= 0.1 * max(peak_big, 1.0) + 4096,
        ),
    ]
    for target, ok in verdicts:
        print(f"  {'PASS' if ok else 'MISS'}  {target}")


if __name__ == "__main__":
    main()
