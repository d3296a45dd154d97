"""Benchmark: the host's work per client of a batched round, beside the training itself.

    python bench/simulation_host.py                          # logreg and the 2NN, 100 and 1,000 clients a round
    python bench/simulation_host.py --model logreg --per-round 1000 --rounds 12
    python bench/simulation_host.py --device cuda            # on a GPU (the training there, the host's work here)
    python bench/simulation_host.py --model 2nn --per-round 100 --profile prof   # and where a round's time goes

Issue 12's workload (Fashion-MNIST, 1000 IID clients of 60, E=1, B=10, lr 0.05, FedAvg; bench/simulation.py's
recipe) with ``backend = "batched"`` on one torch thread. A batched round's time is the training's (the stacked
SGD steps, the mini-batch gathers, the stacked copies of the global model: what a GPU speeds up) and the host's:
the round's sampling, each client's shuffles and data, the batch's results, the metrics, the selector's feedback,
the aggregation of the batch's sum, the server's step, the history, the collection at the round's end. A GPU can
only take the first part; the second bounds client updates per second whatever the accelerator, so issue 12's
target of 50,000 updates/s at 1,000 clients a round needs it well under 20 us a client.

Per configuration: the wall time of a round from one round's end to the next (after the collection each round
ends with), the parts spent in the training's calls and in the batch's weighted sum (timed around them; on a GPU
they are asynchronous, so there this split is not meaningful and only the wall time and updates/s are), the rest
per client, and client updates per second, as medians over the rounds after the second (the first pays for
compiling and building the tasks).

With ``--profile DIR``, each configuration then runs twice more, its rounds after the second profiled: once under
cProfile (Python's time by function: ``DIR/<model>-<clients>.pstats``, and its top functions by own and by
cumulative time in ``DIR/<model>-<clients>-python.txt``) and once under torch.profiler (each op's time on the host
and, on a GPU, the device's kernels: ``DIR/<model>-<clients>-torch.txt``). The summary line printed for each gives
the device's busy milliseconds a round beside the wall time: far below it, the round waits on the host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import server.round_loop as round_loop  # noqa: E402
import simulations.batched as batched  # noqa: E402
from bench.simulation import recipe, run_fedcore  # noqa: E402

TRAINING_CALLS = (
    (batched._LinearChain, "step"),
    (batched._Batched, "grad"),
    (batched, "_sgd_step"),
    (batched, "_gather"),
    (batched, "_stacked"),
    (batched, "_fill_rows"),
)
"""What a batched round spends in the training itself: the SGD steps (the fused path's for the 2NN and logreg,
else vmap's gradients and the stacked update), the mini-batch gathers, the stacked copies of the global model (made
all at once, or a chunk of clients at a time on the CPU's fused path)."""
SUM_CALLS = ((batched.TrainedClients, "weighted_sum"),)
"""The batch's weighted sum of its clients' updates (on the CPU a pass over every update; on a GPU a matrix-vector
product per tensor there)."""


def measure(args: argparse.Namespace, model: str, per_round: int, device: str) -> dict[str, float]:
    """Medians over the rounds after the second: wall, training and sum seconds a round, the rest in microseconds
    a client, and client updates per second."""
    spent = {"training": 0.0, "sum": 0.0}
    ends: list[float] = []  # each round's end, after its collection
    marks: list[dict[str, float]] = []  # the seconds spent so far at each round's end
    originals: list[tuple[Any, str, Callable[..., Any]]] = []

    def timed(function: Callable[..., Any], part: str) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                spent[part] += time.perf_counter() - started

        return call

    def round_end() -> None:
        ends.append(time.perf_counter())
        marks.append(dict(spent))

    for part, calls in (("training", TRAINING_CALLS), ("sum", SUM_CALLS)):
        for owner, name in calls:
            originals.append((owner, name, getattr(owner, name)))
            setattr(owner, name, timed(getattr(owner, name), part))
    try:
        run_batched(args, model, per_round, device, round_end)
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)
    got = {"wall": statistics.median(b - a for a, b in itertools.pairwise(ends[1:]))}  # rounds 3.. (ends[0]: round 1)
    for part in spent:
        got[part] = statistics.median(b[part] - a[part] for a, b in itertools.pairwise(marks[1:]))
    got["host_us"] = 1e6 * (got["wall"] - got["training"] - got["sum"]) / per_round
    got["rate"] = per_round / got["wall"]
    return got


def profile(args: argparse.Namespace, model: str, per_round: int, device: str, out: Path, top: int) -> str:
    """Two more runs of one configuration, rounds 3.. profiled (cProfile, then torch.profiler), written under
    ``out`` (see the module docstring); returns a one-line summary: the profiled rounds' wall and device busy
    milliseconds a round, and the Python functions of most own time."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{model}-{per_round}"
    python = cProfile.Profile()
    wall, rounds = _profiled_run(args, model, per_round, device, python.enable, python.disable)
    python.dump_stats(f"{stem}.pstats")
    text = io.StringIO()
    stats = pstats.Stats(python, stream=text)
    text.write(f"{rounds} rounds profiled, {1e3 * wall / max(rounds, 1):.1f} ms a round under cProfile\n")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    Path(f"{stem}-python.txt").write_text(text.getvalue())
    on_cuda = device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ops = torch.profiler.profile(activities=activities)
    wall, rounds = _profiled_run(args, model, per_round, device, ops.start, ops.stop)
    averages = ops.key_averages()
    table = averages.table(sort_by="self_device_time_total" if on_cuda else "self_cpu_time_total", row_limit=top)
    kernels = [event for event in averages if str(getattr(event, "device_type", "")).endswith("CUDA")]
    busy = sum(event.self_device_time_total for event in kernels) / 1e3 / max(rounds, 1)  # the kernels', once each
    device_busy = f"device busy {busy:.1f} ms a round" if on_cuda else "no device"
    Path(f"{stem}-torch.txt").write_text(
        f"{rounds} rounds profiled, {1e3 * wall / max(rounds, 1):.1f} ms a round under torch.profiler, "
        f"{device_busy}\n{table}\n"
    )
    ranked = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:5]  # type: ignore[attr-defined]
    heaviest = ", ".join(f"{key[2]} {1e3 * row[2] / max(rounds, 1):.2f}" for key, row in ranked)
    return f"{model} {per_round}: {device_busy}; most own time (ms a round): {heaviest}"


def _profiled_run(
    args: argparse.Namespace,
    model: str,
    per_round: int,
    device: str,
    start: Callable[[], Any],
    stop: Callable[[], Any],
) -> tuple[float, int]:
    """Run one configuration with ``start()`` called at the end of round 2 and ``stop()`` at the end of the last
    round (before the run saves its results; on an error, as the run ends); returns the profiled rounds' wall
    seconds and their number."""
    ends: list[float] = []
    running = False

    def round_end() -> None:
        nonlocal running
        ends.append(time.perf_counter())
        if len(ends) == 2:
            start()
            running = True
        elif running and len(ends) == args.rounds:
            stop()
            running = False

    try:
        run_batched(args, model, per_round, device, round_end)
    finally:
        if running:
            stop()
    return (ends[-1] - ends[1], len(ends) - 2) if len(ends) > 2 else (0.0, 0)


def run_batched(
    args: argparse.Namespace, model: str, per_round: int, device: str, round_end: Callable[[], None]
) -> None:
    """One batched run of the workload (``args`` with ``model`` and ``per_round``) on ``device`` and one torch
    thread, ``round_end()`` called at each round's end, after the collection each round ends with."""
    release = round_loop.release_memory

    def collected() -> None:
        release()
        round_end()

    round_loop.release_memory = collected
    try:
        workload = argparse.Namespace(**{**vars(args), "model": model, "per_round": per_round})
        with tempfile.TemporaryDirectory() as out:
            config = recipe(workload, Path(out))
            # always given: the recipe's default, auto, would take a GPU where one is visible even for --device cpu
            config = replace(config, simulation=replace(config.simulation, device=device))
            run_fedcore(config, "batched", threads=1)
    finally:
        round_loop.release_memory = release


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["logreg", "2nn"], help="logreg, 2nn")
    parser.add_argument("--per-round", type=int, nargs="+", default=[100, 1000], help="clients a round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each run (>= 4; the first two left out)")
    parser.add_argument("--device", default="cpu", help="where the batched clients train (cpu, cuda)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, help="also profile each configuration, into this directory")
    parser.add_argument("--top", type=int, default=40, help="functions and ops listed in each profile")
    args = parser.parse_args()
    if args.rounds < 4:
        parser.error("--rounds must be at least 4: the first two rounds are left out")
    workload = argparse.Namespace(seed=args.seed, rounds=args.rounds, clients=1000, epochs=1, batch_size=10, lr=0.05)
    print(f"batched, 1 thread, {args.rounds} rounds (medians of rounds 3..), device {args.device}")
    print(
        f"{'model':8} {'clients':>8} {'wall ms':>9} {'training ms':>12} {'sum ms':>7} {'host us/client':>15} "
        f"{'updates/s':>10}"
    )
    for model in args.model:
        for per_round in args.per_round:
            got = measure(workload, model, per_round, args.device)
            print(
                f"{model:8} {per_round:8d} {1e3 * got['wall']:9.1f} {1e3 * got['training']:12.1f} "
                f"{1e3 * got['sum']:7.1f} {got['host_us']:15.1f} {got['rate']:10.0f}"
            )
    if args.profile is not None:
        for model in args.model:
            for per_round in args.per_round:
                print(profile(workload, model, per_round, args.device, args.profile, args.top))
        print(f"profiles in {args.profile}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
