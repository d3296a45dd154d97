"""Benchmark: what a simulation's checkpoints (``[output] checkpoints``, on by default) cost a round.

    python bench/simulation_checkpoints.py                       # the 2NN, 100 clients a round, both backends
    python bench/simulation_checkpoints.py --model cnn --rounds 6 --backend inprocess

Issue 12's workload (Fashion-MNIST, 1000 IID clients of 60, E=1, B=10, lr 0.05, FedAvg; bench/simulation.py's
recipe), run with checkpoints off and on, alternately, ``--repeat`` times each. After every round a run with
checkpoints writes the round's server state to ``state/checkpoints/`` (fsynced: a crash or a power cut leaves the
previous checkpoint or the new one) and its record to SQLite, and goes on with the model mapped from that file.

Per configuration: the wall seconds of a whole run divided by its rounds (the end of each round included, where the
checkpoint is written; the round loop's own ``seconds`` column leaves it out), the best of the repeats, and the
difference per round, also as a share of the round without checkpoints.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.simulation import recipe, run_fedcore  # noqa: E402
from simulations.config import BackendName  # noqa: E402


def seconds_a_round(args: argparse.Namespace, backend: BackendName, checkpoints: bool) -> float:
    """Wall seconds of one run divided by its rounds (data loading included, alike in both)."""
    with tempfile.TemporaryDirectory() as out:
        config = recipe(args, Path(out))
        config = replace(config, output=replace(config.output, checkpoints=checkpoints))
        started = time.perf_counter()
        run_fedcore(config, backend)
        return (time.perf_counter() - started) / args.rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="2nn", choices=("2nn", "cnn", "logreg"))
    parser.add_argument("--per-round", type=int, default=100, help="clients a round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each configuration (the best is shown)")
    parser.add_argument("--backend", nargs="+", default=["batched", "inprocess"], help="inprocess, batched")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workload = argparse.Namespace(
        seed=args.seed,
        rounds=args.rounds,
        clients=1000,
        per_round=args.per_round,
        model=args.model,
        epochs=1,
        batch_size=10,
        lr=0.05,
    )
    print(f"{args.model}, {args.per_round} clients a round, {args.rounds} rounds, best of {args.repeat}, 1 thread")
    print(f"{'backend':10} {'s/round off':>12} {'s/round on':>11} {'ms a round':>11} {'share':>7}")
    for backend in args.backend:
        off: list[float] = []
        on: list[float] = []
        for _ in range(args.repeat):
            off.append(seconds_a_round(workload, backend, checkpoints=False))
            on.append(seconds_a_round(workload, backend, checkpoints=True))
        cost = min(on) - min(off)
        print(f"{backend:10} {min(off):12.3f} {min(on):11.3f} {1e3 * cost:11.1f} {cost / min(off):7.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
