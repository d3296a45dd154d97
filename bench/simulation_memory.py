"""Benchmark: a simulation's peak memory as a multiple of the model, under FedAvgM and FedAvg (issue 12's target:
at most 4x the model plus the dataset).

    python bench/simulation_memory.py                    # a 20M-parameter model (76 MiB), FedAvgM and FedAvg
    python bench/simulation_memory.py --params 5e6 --rounds 2
    python bench/simulation_memory.py --strategies fedavgm --clients-per-round 10
    python bench/simulation_memory.py --sum-dtype float32  # the mean's float32 sum of differences (1x, not 2x)

Each run is ``fedcore simulate`` (:func:`simulations.harness.run_simulation`, the in-process backend) in a child
process over a wide 2NN (McMahan et al. 2017's MLP with ``--hidden`` units in both hidden layers; 784-4091-4091-10
gives 20.0M float32 parameters) on synthetic data: ``--clients`` clients of ``--samples`` Gaussian 784-feature
examples with random labels (the numbers do not matter to the memory), ``--clients-per-round`` a round, E=1, B=10,
SGD, with the server's evaluation on a held-out set of the same kind. The child reads its own resident memory
(``VmRSS`` from /proc/self/status) just before the simulation starts, after what a process pays once whatever the
model: its imports, the aggregation kernels' compilation (numba's LLVM, about 50 MiB), and one training step and
evaluation of a tiny 2NN (the first torch.optim optimizer imports ``torch._dynamo``, 24 MiB; the first forward,
backward and step fault in about 13 MiB of libtorch's code), before any data or model exists (the baseline); and
its high-water mark (``VmHWM``) when it ends. The table gives the peak above the baseline in MiB and as a multiple
of the model's float32 size, beside the dataset's size (train and test features and labels) and the target
``4 x model + dataset``.

Measured (2-core VM; memory does not depend on the load), before and after the update lent the client model's memory
(no copy), the model's step taken inside backward (one parameter's gradient at a time) and the model freed between
rounds, on the same baseline: FedAvgM 6.16x -> 6.00x, FedAvg 5.14x -> 4.98x with the default float64 sum; with
``--sum-dtype float32`` (``MeanAggregator(delta=True)``: a float32 sum of the differences from the global model, off
by default, see its docstring; the recipe's ``strategy.sum_dtype``) FedAvgM 5.30x -> 5.04x and FedAvg 4.20x -> 4.03x
= 307.5 MiB, within the target of 311.7 MiB. With the server optimizer's state mapped from a file between server
steps, FedAvgM 6.00x -> 5.01x (float64 sum) and 5.04x -> 4.32x (float32 sum); FedAvg, which keeps no state, 5.01x
and 4.06x in the same runs. With the global model mapped too (:func:`server.state.map_round_state`) and each reader
dropping the pages it has read (a client's model loaded block by block, the server step reading the old model and
momentum block by block): FedAvgM 4.01x (305.9-306.2 MiB, float64 sum) and 3.30-3.31x (float32 sum); FedAvg
4.00-4.01x and 3.22-3.23x. (Before issue 12's memory work: FedAvgM 14.00x, FedAvg 8.79x, on the older baseline,
which counted the 13 MiB of code as well.) While a client trains, the simulation now holds the running sum (2x in
float64, 1x as float32 differences) and the client's model (1x), plus the gradient of its largest parameter (0.84x
here: the 4091 x 4091 layer is 84% of this model) and the dataset: about 3.9x with the float64 sum. The server step
holds the average (which becomes the new model), the new momentum and a few blocks of the old model and momentum:
about 2x.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from fedcore.supervised import SupervisedTask
from fedcore.task import TaskContext
from simulations.models import MLP2NN

ROOT = Path(__file__).resolve().parents[1]
FEATURES = 784
CLASSES = 10


def hidden_for(params: float) -> int:
    """The hidden width ``h`` of a 784-h-h-10 2NN with about ``params`` parameters (``h^2 + 796 h + 10 ~ params``)."""
    return int((-(FEATURES + CLASSES + 2) + ((FEATURES + CLASSES + 2) ** 2 + 4 * params) ** 0.5) / 2)


def memory_task(context: TaskContext) -> SupervisedTask:
    """Task factory (``bench.simulation_memory:memory_task``): options ``hidden``, ``samples``, ``test_samples``.

    Client ``k``'s data are ``samples`` rows of N(0, 1) features and uniform labels from a generator seeded with
    ``k``; the server's test set is ``test_samples`` rows from seed ``-1``'s generator (offset past the clients).
    """
    hidden = int(context.options["hidden"])
    seed = 1_000_003 if context.role == "server" else int(context.partition_id or 0)
    count = int(context.options["test_samples" if context.role == "server" else "samples"])
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (count,), generator=generator)
    model_fn = ModelFn(hidden)
    if context.role == "server":
        return SupervisedTask(model_fn=model_fn, test_data=(x, y))
    return SupervisedTask(model_fn=model_fn, train_data=(x, y))


class ModelFn:
    """Builds the wide 2NN; equal instances build the same architecture (clients share one model object)."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelFn) and other.hidden == self.hidden

    def __hash__(self) -> int:
        return hash(self.hidden)

    def __call__(self) -> torch.nn.Module:
        return MLP2NN(num_inputs=FEATURES, num_classes=CLASSES, hidden=self.hidden)


def warm_up_training() -> None:
    """One SGD step and one evaluation of a tiny 2NN (784-8-8-10) through :func:`fedcore.training.train_supervised`
    and :func:`fedcore.training.evaluate_supervised`: what a process pays once, not per model byte."""
    from fedcore.task import FitConfig
    from fedcore.training import evaluate_supervised, train_supervised

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, FEATURES, generator=generator), torch.randint(0, CLASSES, (10,), generator=generator)
    model = MLP2NN(num_inputs=FEATURES, num_classes=CLASSES, hidden=8)
    train_supervised(model, x, y, FitConfig(local_epochs=1, batch_size=10, lr=0.05), generator=generator)
    evaluate_supervised(model, x, y, batch_size=10)


CHILD = """
import json, sys
def status(key):
    return int(next(line for line in open('/proc/self/status') if line.startswith(key + ':')).split()[1]) * 1024
from simulations.config import load_recipe
from simulations.harness import run_simulation
import bench.simulation_memory
from bench.simulation import warm_up
config = load_recipe(None, json.loads(sys.argv[1]))
warm_up()  # the aggregation kernels' compilation (numba, LLVM: a fixed ~100 MiB) is not the model's memory
# one step of a tiny 2NN with an evaluation: the first SGD imports torch._dynamo (~24 MiB), and the first forward,
# backward and step fault in libtorch's kernels (~13 MiB of code pages), once per process whatever the model
import bench.simulation_memory as memory
memory.warm_up_training()
base = status('VmRSS')
result = run_simulation(config, echo=lambda _: None)
print('memory', json.dumps({'base': base, 'peak': status('VmHWM'), 'rounds': int(result.final.round)}))
"""


def run(strategy: str, args: argparse.Namespace, hidden: int, out: str) -> dict[str, int]:
    """One simulation in a child process; returns its baseline and peak RSS (bytes)."""
    extra = {
        "fedavgm": ["strategy.name='fedavgm'", "strategy.server_momentum=0.7"],
        "fedavg": ["strategy.name='fedavg'"],
    }
    overrides = [
        "task.factory='bench.simulation_memory:memory_task'",
        f"task.options.hidden='{hidden}'",
        f"task.options.samples='{args.samples}'",
        f"task.options.test_samples='{args.test_samples}'",
        f"data.num_clients={args.clients}",
        f"sampling.min_fit_clients={args.clients_per_round}",
        "sampling.fraction_fit=1e-9",
        f"rounds={args.rounds}",
        "evaluate_every=1",
        "train.local_epochs=1",
        "train.batch_size=10",
        "train.lr=0.05",
        "output.progress=false",
        "output.plot=false",
        f"output.dir='{out}'",
        f"strategy.sum_dtype='{args.sum_dtype}'",
        *extra[strategy],
    ]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(overrides)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("memory ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the {strategy} run failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(lines[-1].split(" ", 1)[1]))


def main(argv: list[str] | None = None) -> int:
    """Run the bench and print its table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=20e6, help="model parameters (default 20M, 76 MiB)")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--clients-per-round", type=int, default=5)
    parser.add_argument("--samples", type=int, default=60, help="training examples per client")
    parser.add_argument("--test-samples", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads of the child")
    parser.add_argument("--strategies", nargs="+", default=["fedavgm", "fedavg"], choices=["fedavgm", "fedavg"])
    parser.add_argument(
        "--sum-dtype",
        default="float64",
        choices=["float64", "float32"],
        help="the mean's running sum (strategy.sum_dtype; float32: the differences from the global model, 1x)",
    )
    args = parser.parse_args(argv)
    hidden = hidden_for(args.params)
    params = sum(p.numel() for p in ModelFn(hidden)().parameters())
    model = 4 * params
    dataset = 4 * (FEATURES + 2) * (args.clients * args.samples + args.test_samples)  # float32 x, int64 y
    mib = 2**20
    print(
        f"model: 784-{hidden}-{hidden}-10 2NN, {params / 1e6:.2f}M parameters, {model / mib:.1f} MiB; dataset "
        f"{dataset / mib:.1f} MiB ({args.clients} clients x {args.samples} + {args.test_samples} test); "
        f"{args.clients_per_round} clients a round, {args.rounds} rounds, {args.threads} thread(s), "
        f"sum_dtype {args.sum_dtype}"
    )
    print(f"{'strategy':<10} {'peak - baseline (MiB)':>22} {'x model':>8} {'target (MiB)':>13} {'met':>4}")
    for strategy in args.strategies:
        with tempfile.TemporaryDirectory() as out:
            got = run(strategy, args, hidden, out)
        above = got["peak"] - got["base"]
        target = 4 * model + dataset
        met = "yes" if above <= target else "no"
        print(f"{strategy:<10} {above / mib:>22.1f} {above / model:>8.2f} {target / mib:>13.1f} {met:>4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
