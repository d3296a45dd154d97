"""Benchmark: seconds per round of ``fedcore simulate``'s backends beside a plain PyTorch loop.

    python bench/simulation.py                  # issue 12's workload, 5 rounds
    python bench/simulation.py --rounds 3 --model cnn
    python bench/simulation.py --batched-threads 2   # the batched backend also on 2 threads
    python bench/simulation.py --scale 100000   # and runs of 1,000 and 100,000 synthetic clients (s/round, peak RSS)

The workload of issue 12 ("Simulation at scale"): Fashion-MNIST, 1000 IID clients of 60 samples, 100 clients per
round, the FedAvg paper's 2NN, E=1, B=10, SGD lr 0.05, FedAvg. Both sides run in this process on one thread
(``torch.set_num_threads(1)``) over the same clients:

- fedcore: :func:`simulations.harness.run_simulation` (the in-memory pool, the client runner, the round loop with
  its streaming aggregation), without server evaluation, plots or the progress bar; a round's seconds are the
  round loop's own (``RoundRecord.seconds``: the round's tasks built on first use, training, aggregation, step).
- fedcore batched: the same, with ``[simulation] backend = "batched"`` (:mod:`simulations.batched`: the round's
  clients trained together with torch.func); ``--batched-threads N`` adds a row of it on N threads.
- fedcore process pool: ``[simulation] backend = "process"`` (:mod:`simulations.procpool`) with ``--workers``
  worker processes of one torch thread each (default: the cores this process may use), so its ratio to the
  one-thread plain loop is bounded by the number of cores; its final model equals the in-process one bit for bit.
  Its CPU column counts the parent process only; its first round includes the workers loading the dataset (the
  median leaves it out).
- plain: the machine's practical floor, a loop a researcher would write: one model, and per sampled client
  ``load_state_dict``, SGD over the client's shuffled mini-batches, and the example-weighted sum in float64.
  It samples the same clients and shuffles with the same generators as fedcore (``sample_clients``,
  ``derive_seed(seed, round, client)``), so both train on the same batches in the same float order, and the
  bench prints the largest difference between the two final models (0.0 when they agree bit for bit).

Both gather a batch with ``index_select`` (``x[idx]``, advanced indexing, costs more than the training step on
these small batches). The aggregation kernels are compiled before anything is timed. The table gives each side's
median wall seconds per round over all rounds of all repeats (``--repeat``, the two sides alternating), its
process CPU seconds per round (the whole run's CPU time over its rounds, median of the repeats; steadier than
wall time on a shared machine), the final model's test accuracy, and the ratios fedcore / plain; issue 12's
targets: in-process at most 1.3, batched at most 0.5 with the accuracy within 1 point. The batched backend sums
in another float order, so its model is compared with the others' within a tolerance, not bit for bit. On a
shared machine run it with ``nice``; the header prints the load average before and after.

``--scale N`` adds runs of 1,000 and N virtual clients of FedProx Synthetic(1, 1) (devices generated when
sampled), logistic regression, 10 clients a round, E=1 capped at 50 steps, B=10, 3 rounds, through the ``fedcore``
command in a child process: median seconds per round and the child's peak RSS. The peak follows the largest device
sampled (lognormal sizes), not the number of clients.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedcore.config import from_mapping  # noqa: E402
from fedcore.seeding import derive_seed  # noqa: E402
from fedcore.strategy import sample_clients  # noqa: E402
from fedcore.task import initial_parameters  # noqa: E402
from fedcore.training import evaluate_supervised  # noqa: E402
from simulations.config import BackendName, DataConfig, SimulationConfig  # noqa: E402
from simulations.harness import client_ids, run_simulation  # noqa: E402
from simulations.models import build_model  # noqa: E402
from simulations.procpool import default_workers  # noqa: E402
from simulations.tasks import prepare_data  # noqa: E402


def recipe(args: argparse.Namespace, out_dir: Path) -> SimulationConfig:
    """The workload as a simulation recipe."""
    return from_mapping(
        SimulationConfig,
        {
            "seed": args.seed,
            "rounds": args.rounds,
            "evaluate_every": args.rounds,
            "data": {"dataset": "fashion-mnist", "num_clients": args.clients, "partition": "iid"},
            "model": {"name": args.model},
            "task": {"server_evaluation": False},
            "strategy": {"name": "fedavg"},
            "sampling": {"fraction_fit": args.per_round / args.clients, "min_fit_clients": 1},
            "train": {"local_epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr},
            "output": {"dir": str(out_dir), "progress": False, "plot": False},
        },
    )


Run = Callable[[SimulationConfig], tuple[list[float], dict[str, np.ndarray]]]
"""One system's run of the workload: the wall seconds of each round and the final model."""


def run_fedcore(
    config: SimulationConfig, backend: BackendName = "inprocess", threads: int = 1, workers: int | None = None
) -> tuple[list[float], dict[str, np.ndarray]]:
    """Seconds of each round and the final model of ``run_simulation`` with ``backend``, on ``threads`` torch
    threads (``workers``: the process backend's worker count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        config = replace(config, simulation=replace(config.simulation, backend=backend, workers=workers))
        result = run_simulation(config, echo=lambda _line: None)
    finally:
        torch.set_num_threads(before)
    seconds = [float(s) for r, s in zip(result.history["round"], result.history["seconds"], strict=True) if r > 0]
    return seconds, {n: np.asarray(a) for n, a in result.final.parameters.items()}


def run_plain(config: SimulationConfig) -> tuple[list[float], dict[str, np.ndarray]]:
    """The same rounds as a plain PyTorch loop; seconds of each round and the final model."""
    data_config = DataConfig(
        dataset=config.data.dataset, num_clients=config.data.num_clients, partition=config.data.partition
    )
    data = prepare_data(data_config, config.seed)
    shards = [data.shard(i) for i in range(data.num_clients)]

    def model_fn() -> torch.nn.Module:
        return build_model(config.model.name, data.input_shape, data.num_classes)

    global_state = {n: torch.from_numpy(a) for n, a in initial_parameters(model_fn, config.seed).items()}
    model = model_fn()
    ids = client_ids(config.data.num_clients)
    num = config.sampling.num_fit(len(ids))
    fit = config.train
    seconds = []
    for rnd in range(1, config.rounds + 1):
        started = time.perf_counter()
        sums = {n: torch.zeros(t.shape, dtype=torch.float64) for n, t in global_state.items()}
        total = 0.0
        for cid in sample_clients(ids, num, seed=config.seed, round=rnd, stage="fit"):
            x, y = shards[ids.index(cid)]
            model.load_state_dict(global_state)
            generator = torch.Generator().manual_seed(derive_seed(config.seed, rnd, cid))
            optimizer = torch.optim.SGD(model.parameters(), lr=fit.lr)
            model.train()
            for _ in range(fit.local_epochs):
                order = torch.randperm(len(x), generator=generator)
                for start in range(0, len(x), fit.batch_size):
                    idx = order[start : start + fit.batch_size]
                    optimizer.zero_grad(set_to_none=True)
                    xb, yb = x.index_select(0, idx), y.index_select(0, idx)
                    torch.nn.functional.cross_entropy(model(xb), yb).backward()
                    optimizer.step()
            weight = float(len(x))
            for name, value in model.state_dict().items():
                sums[name].add_(value.double() * weight)
            total += weight
        global_state = {n: (s / total).to(global_state[n].dtype) for n, s in sums.items()}
        seconds.append(time.perf_counter() - started)
    return seconds, {n: t.numpy() for n, t in global_state.items()}


def test_accuracy(config: SimulationConfig, parameters: dict[str, np.ndarray]) -> float:
    """The model's accuracy on the dataset's test split (not timed)."""
    data = prepare_data(
        DataConfig(dataset=config.data.dataset, num_clients=config.data.num_clients, partition=config.data.partition),
        config.seed,
    )
    model = build_model(config.model.name, data.input_shape, data.num_classes)
    model.load_state_dict({n: torch.from_numpy(np.array(a)) for n, a in parameters.items()})
    return float(evaluate_supervised(model, data.x_test, data.y_test).metrics["accuracy"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=1000, help="virtual clients (IID shards)")
    parser.add_argument("--per-round", type=int, default=100, help="clients sampled per round")
    parser.add_argument("--model", default="2nn", choices=("2nn", "cnn", "logreg"))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="run every system this many times, alternating")
    parser.add_argument("--batched-threads", type=int, default=0, help="also run the batched backend on N threads")
    parser.add_argument("--workers", type=int, default=None, help="process pool workers (default: one per core)")
    parser.add_argument("--scale", type=int, default=0, help="also run 1,000 and this many synthetic clients")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warm_up()
    prepare_data(DataConfig(dataset="fashion-mnist", num_clients=args.clients, partition="iid"), args.seed)
    systems: dict[str, Run] = {
        "plain PyTorch loop": run_plain,
        "fedcore in-process": run_fedcore,
        "fedcore batched": partial(run_fedcore, backend="batched"),
    }
    pool = f"fedcore process pool x{args.workers or default_workers()}"
    systems[pool] = partial(run_fedcore, backend="process", workers=args.workers)
    if args.batched_threads > 1:
        systems[f"fedcore batched, {args.batched_threads} thr"] = partial(
            run_fedcore, backend="batched", threads=args.batched_threads
        )
    runs: dict[str, list[tuple[list[float], float]]] = {name: [] for name in systems}
    models: dict[str, dict[str, np.ndarray]] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        config = recipe(args, Path(tmp))
        for _ in range(args.repeat):
            for name, run in systems.items():
                cpu = time.process_time()
                seconds, models[name] = run(config)
                runs[name].append((seconds, (time.process_time() - cpu) / args.rounds))
    load_after = os.getloadavg()
    print(
        f"workload: {args.clients} clients, {args.per_round} per round, {args.model}, E={args.epochs}, "
        f"B={args.batch_size}, lr={args.lr}, FedAvg, {args.rounds} rounds x {args.repeat}, 1 thread unless stated"
    )
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    print(f"{'system':<28}{'s/round':>9}{'CPU s/round':>13}{'accuracy':>10}  wall seconds of each round")
    medians = {}
    for name, results in runs.items():
        rounds = [s for seconds, _ in results for s in seconds]
        medians[name] = (statistics.median(rounds), statistics.median(cpu for _, cpu in results))
        print(
            f"{name:<28}{medians[name][0]:>9.3f}{medians[name][1]:>13.3f}{test_accuracy(config, models[name]):>10.4f}  "
            + " | ".join(" ".join(f"{s:.3f}" for s in seconds) for seconds, _ in results)
        )
    plain, plain_cpu = medians["plain PyTorch loop"]
    plain_model = models["plain PyTorch loop"]
    targets = {"fedcore in-process": "target <= 1.3", "fedcore batched": "target <= 0.5"}
    for name in list(systems)[1:]:
        wall, cpu = medians[name]
        diff = max(float(np.max(np.abs(plain_model[n].astype(np.float64) - models[name][n]))) for n in plain_model)
        print(
            f"ratio {name} / plain: {wall / plain:.2f} wall, {cpu / plain_cpu:.2f} CPU"
            + (f" ({targets[name]})" if name in targets else "")
            + f"; largest difference from the plain loop's final model: {diff:.3g}"
        )
    same = all(np.array_equal(models[pool][n], models["fedcore in-process"][n]) for n in plain_model)
    print(f"process pool model {'equals' if same else 'DIFFERS from'} the in-process model bit for bit")
    for clients in (1000, args.scale) if args.scale else ():
        per_round, peak = run_scale(clients, args.seed)
        print(f"{clients} synthetic clients, 10 a round, logreg: {per_round:.3f} s/round, peak RSS {peak:.0f} MiB")
    return 0


PEAK_SCRIPT = (
    "import sys\n"
    "from fedcore.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "peak = [line for line in open('/proc/self/status') if line.startswith('VmHWM:')][0].split()[1]\n"
    "print('peak-kib', peak)\n"
    "sys.exit(code)\n"
)
"""``fedcore`` in a child that prints its own peak RSS at the end (VmHWM: the child's own high-water mark; a
child's ``ru_maxrss`` starts at its parent's RSS at fork on Linux, which here would be the bench's)."""


def run_scale(clients: int, seed: int) -> tuple[float, float]:
    """Median seconds per round and peak RSS (MiB) of ``fedcore simulate`` over ``clients`` synthetic devices."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            "-c",
            PEAK_SCRIPT,
            "simulate",
            *("--dataset", "synthetic", "--partition", "natural", "--clients", str(clients), "--model", "logreg"),
            *("--strategy", "fedavg", "--clients-per-round", "10", "--fraction-fit", str(1e-9), "--epochs", "1"),
            *("--batch-size", "10", "--max-steps", "50", "--lr", "0.01", "--rounds", "3", "--seed", str(seed)),
            "--no-progress",
            *("--set", "data.normalize=false", "--set", "output.plot=false", "--out", tmp),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
        peaks = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("peak-kib ")]
        if done.returncode != 0 or not peaks:
            raise SystemExit(f"the {clients}-client run failed: {done.stderr[-2000:]}")
        history = pd.read_csv(Path(tmp) / "history.csv")
    return float(history.loc[history["round"] > 0, "seconds"].median()), int(peaks[0]) / 1024


def warm_up() -> None:
    """Compile the aggregation kernels (numba, once per process) before anything is timed."""
    from fedcore.aggregation import WeightedMean
    from fedcore.tensors import spec_of

    update = {"w": np.zeros(8, np.float32)}
    mean = WeightedMean(spec_of(update), threads=1)
    mean.add(update, 1.0)
    mean.result()


if __name__ == "__main__":
    sys.exit(main())
