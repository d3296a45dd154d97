"""Benchmark: seconds per round, peak memory and accuracy of ``fedcore simulate``'s backends, Flower's simulation
engine and a plain PyTorch loop, side by side in one run.

    python bench/simulation.py                  # issue 12's workload, 5 rounds
    python bench/simulation.py --clients-per-round 1000   # every client of the 1000 in every round
    python bench/simulation.py --rounds 3 --model cnn
    python bench/simulation.py --batched-threads 2   # the batched backend also on 2 threads
    python bench/simulation.py --scale 100000   # and runs of 1,000 and 100,000 synthetic clients (s/round, peak RSS)

The workload of issue 12 ("Simulation at scale"): Fashion-MNIST, 1000 IID clients of 60 samples, 100 clients per
round, the FedAvg paper's 2NN, E=1, B=10, SGD lr 0.05, FedAvg. Every system runs in a child process of its own
(``--child-timeout`` seconds at most, its whole process group killed then) on one torch thread per worker, over
the same clients:

- plain: the machine's practical floor, a loop a researcher would write: one model, and per sampled client
  ``load_state_dict``, SGD over the client's shuffled mini-batches, and the example-weighted sum in float64.
  It samples the same clients and shuffles with the same generators as fedcore (``sample_clients``,
  ``derive_seed(seed, round, client)``), so both train on the same batches in the same float order, and the
  bench prints the largest difference between each final model and the plain loop's (0.0: bit for bit).
- fedcore in-process: :func:`simulations.harness.run_simulation` (the in-memory pool, the client runner, the round
  loop with its streaming aggregation), without server evaluation, plots or the progress bar; a round's seconds
  are the round loop's own (``RoundRecord.seconds``: the round's tasks built on first use, training, aggregation,
  step).
- fedcore batched: ``[simulation] backend = "batched"`` (:mod:`simulations.batched`: the round's clients trained
  together with torch.func); ``--batched-threads N`` adds a row of it on N threads. It sums in another float order,
  so its model is compared within a tolerance, not bit for bit. "fedcore batched, deferred 1st layer" is the same
  with ``[simulation] defer_first_layer = true`` (the first layer's updates taken once per window of steps: faster,
  and further from the plain loop's model, see :class:`simulations.config.BackendConfig`).
- fedcore process pool and fedcore Ray: ``backend = "process"`` (:mod:`simulations.procpool`) and ``backend =
  "ray"`` (:mod:`simulations.raypool`, a local Ray started by the run) with ``--workers`` workers of one torch
  thread each (default: the cores this process may use), so their ratio to the one-thread plain loop is bounded by
  the number of cores; their final models equal the in-process one bit for bit (printed). Their first round
  includes the workers loading the dataset (the median leaves it out).
- Flower: ``flwr.simulation.run_simulation`` (flwr 1.42, Ray backend, ``--workers`` CPUs, one ClientApp actor
  each) of Flower's FedAvg over 1000 SuperNodes, the same fraction sampled by Flower's own draw, each ClientApp
  training the same model on the same shard with the same E, B, lr and shuffling (:func:`run_flower`); its
  accuracy is therefore close to, not equal to, the others'. Skipped, with a line saying so, without flwr and Ray
  (``pip install -e '.[bench]'``); the fedcore Ray row likewise without Ray.

Columns: the median wall seconds per round over all rounds of all repeats (``--repeat``, the systems alternating);
the CPU seconds per round of the child's own process (the driver only for the process pool, Ray and Flower, whose
work is in other processes); the peak memory of the child's whole process tree (the sum of the processes'
proportional set sizes, shared pages split between them, sampled every 0.25 s: Ray's own processes and object
store included); the final model's test accuracy; the ratio to the plain loop's seconds per round. Issue 12's
targets: in-process at most 1.3, batched at most 0.5 with the accuracy within 1 point. The aggregation kernels are
compiled before anything is timed. On a shared machine run it with ``nice``; the header prints the load average
before and after.

``--scale N`` adds runs of 1,000 and N virtual clients of FedProx Synthetic(1, 1) (devices generated when
sampled), logistic regression, 10 clients a round, E=1 capped at 50 steps, B=10, 3 rounds, through the ``fedcore``
command in a child process: median seconds per round and the child's peak RSS. The peak follows the largest device
sampled (lognormal sizes), not the number of clients.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH_EXTRA = "-e '.[bench]'"  # pip's arguments for the bench extras (flwr, Ray), from this checkout
sys.path.insert(0, str(ROOT))

from fedcore.config import from_mapping  # noqa: E402
from fedcore.errors import pip_install  # noqa: E402
from fedcore.payload import open_safetensors  # noqa: E402
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
            # no checkpoints: no other system here writes any (their cost: bench/simulation_checkpoints.py)
            "output": {"dir": str(out_dir), "progress": False, "plot": False, "checkpoints": False},
        },
    )


Run = Callable[[SimulationConfig], tuple[list[float], dict[str, np.ndarray]]]
"""One system's run of the workload: the wall seconds of each round and the final model."""


def run_fedcore(
    config: SimulationConfig,
    backend: BackendName = "inprocess",
    threads: int = 1,
    workers: int | None = None,
    defer_first_layer: bool = False,
) -> tuple[list[float], dict[str, np.ndarray]]:
    """Seconds of each round and the final model of ``run_simulation`` with ``backend``, on ``threads`` torch
    threads (``workers``: the process backend's worker count; ``defer_first_layer``: the batched backend's)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        simulation = replace(config.simulation, backend=backend, workers=workers, defer_first_layer=defer_first_layer)
        config = replace(config, simulation=simulation)
        result = run_simulation(config, echo=lambda _line: None)
    finally:
        torch.set_num_threads(before)
    seconds = [float(s) for r, s in zip(result.history["round"], result.history["seconds"], strict=True) if r > 0]
    return seconds, {n: np.asarray(a) for n, a in result.final.parameters.items()}


def train_plain(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, config: SimulationConfig, rnd: int, client_id: str
) -> None:
    """Client ``client_id``'s local SGD in round ``rnd`` as a plain loop: E epochs over its shard ``(x, y)``,
    shuffled by ``derive_seed(seed, round, client)``, in mini-batches of B (the last one partial)."""
    fit = config.train
    generator = torch.Generator().manual_seed(derive_seed(config.seed, rnd, client_id))
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
    seconds = []
    for rnd in range(1, config.rounds + 1):
        started = time.perf_counter()
        sums = {n: torch.zeros(t.shape, dtype=torch.float64) for n, t in global_state.items()}
        total = 0.0
        for cid in sample_clients(ids, num, seed=config.seed, round=rnd, stage="fit"):
            x, y = shards[ids.index(cid)]
            model.load_state_dict(global_state)
            train_plain(model, x, y, config, rnd, cid)
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


def run_flower(config: SimulationConfig, workers: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """The workload through Flower's simulation engine: ``flwr.simulation.run_simulation`` of a ServerApp with
    Flower's FedAvg (``flwr.server.strategy.FedAvg``, the same fraction of clients sampled by Flower's own draw) and
    a ClientApp training the same model on the same IID shards with the same E, B and lr (each client shuffles with
    fedcore's ``derive_seed(seed, round, client)``, one torch thread), on Flower's Ray backend with ``workers`` CPUs
    (one ClientApp actor each). A round's seconds run from Flower's ``configure_fit`` to the end of its
    ``aggregate_fit``. Returns the seconds of each round and the final model."""
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Context, FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    data_config = DataConfig(
        dataset=config.data.dataset, num_clients=config.data.num_clients, partition=config.data.partition
    )
    data = prepare_data(data_config, config.seed)
    ids = client_ids(config.data.num_clients)
    shape, classes = data.input_shape, data.num_classes  # what the ClientApp's closure takes to the actors: not data
    del data

    def model_fn() -> torch.nn.Module:
        return build_model(config.model.name, shape, classes)

    names = list(initial_parameters(model_fn, config.seed))
    initial = ndarrays_to_parameters(list(initial_parameters(model_fn, config.seed).values()))
    cache: dict[str, Any] = {}

    class Client(NumPyClient):
        def __init__(self, partition: int) -> None:
            self.partition = partition

        def fit(self, parameters: list[np.ndarray], fit_config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
            torch.set_num_threads(1)
            if "model" not in cache:  # once per actor process, as a user would
                cache["model"], cache["data"] = model_fn(), prepare_data(data_config, config.seed)
            model: torch.nn.Module = cache["model"]
            x, y = cache["data"].shard(self.partition)
            model.load_state_dict({n: torch.from_numpy(np.array(a)) for n, a in zip(names, parameters, strict=True)})
            train_plain(model, x, y, config, int(fit_config["round"]), ids[self.partition])
            return [t.detach().numpy().copy() for t in model.state_dict().values()], len(x), {}

    def client_fn(context: Context) -> Any:
        return Client(int(context.node_config["partition-id"])).to_client()

    seconds: list[float] = []
    final: dict[str, np.ndarray] = {}

    class TimedFedAvg(FedAvg):
        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list[tuple[Any, Any]]:
            self.started = time.perf_counter()
            return [
                (c, FitIns(ins.parameters, {"round": server_round}))
                for c, ins in super().configure_fit(server_round, parameters, client_manager)
            ]

        def aggregate_fit(self, server_round: int, results: list[Any], failures: list[Any]) -> Any:
            out = super().aggregate_fit(server_round, results, failures)
            seconds.append(time.perf_counter() - self.started)
            if out[0] is not None:
                final.update(zip(names, parameters_to_ndarrays(out[0]), strict=True))
            return out

    num = config.sampling.num_fit(len(ids))
    strategy = TimedFedAvg(
        fraction_fit=num / len(ids),
        min_fit_clients=num,
        min_available_clients=len(ids),
        fraction_evaluate=0.0,
        min_evaluate_clients=0,
        initial_parameters=initial,
    )

    def server_fn(context: Context) -> ServerAppComponents:
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=config.rounds))

    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(client_fn=client_fn),
        num_supernodes=len(ids),
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": workers, "include_dashboard": False, "log_to_driver": False},
        },
    )
    if len(seconds) != config.rounds or not final:
        raise SystemExit(f"Flower finished {len(seconds)} of {config.rounds} rounds")
    return seconds, final


def run_pfl(config: SimulationConfig, threads: int = 1) -> tuple[list[float], dict[str, np.ndarray]]:
    """The workload through pfl-research (Apple's simulator, ``pfl`` 0.6, one process): ``FederatedAveraging`` with
    ``SimulatedBackend`` over a ``FederatedDataset`` of the same IID shards (its own ``minimize_reuse`` sampling of
    the same number of clients a round), ``PyTorchModel`` of the same model with local SGD (E, B, lr; pfl's datasets
    are not shuffled) and central SGD of learning rate 1 (FedAvg's plain average). A round's seconds run from one
    central iteration's end to the next's (the first from the start of training). Runs in the interpreter of
    ``--pfl-python`` (a virtualenv with ``pip install pfl==0.6.0``, whose pins would clash with this project's), on
    ``threads`` torch threads (``--pfl-threads N`` adds a row on N, beside ``--batched-threads N``'s)."""
    torch.set_num_threads(threads)
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    data = prepare_data(
        DataConfig(dataset=config.data.dataset, num_clients=config.data.num_clients, partition=config.data.partition),
        config.seed,
    )
    net = build_model(config.model.name, data.input_shape, data.num_classes)
    net.load_state_dict({n: torch.from_numpy(a) for n, a in initial_parameters(lambda: net, config.seed).items()})

    def loss(x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        net.train(not eval)
        return torch.nn.functional.cross_entropy(net(x), y)

    @torch.no_grad()
    def metrics(x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict[str, Any]:
        net.eval()
        return {"loss": Weighted(float(torch.nn.functional.cross_entropy(net(x), y, reduction="sum")), len(y))}

    net.__dict__.update(loss=loss, metrics=metrics)  # what pfl's PyTorchModel calls
    shards = {i: list(data.shard(i)) for i in range(data.num_clients)}
    federated = FederatedDataset(lambda user: Dataset(shards[user]), get_user_sampler("minimize_reuse", list(shards)))
    model = PyTorchModel(net, torch.optim.SGD, torch.optim.SGD(net.parameters(), lr=1.0))
    fit = config.train
    seconds: list[float] = []

    class Timing(TrainingProcessCallback):
        def on_train_begin(self, *, model: Any) -> Any:
            self.last = time.perf_counter()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics: Any, model: Any, *, central_iteration: int) -> Any:
            now = time.perf_counter()
            seconds.append(now - self.last)
            self.last = now
            return False, Metrics()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=config.rounds,
            evaluation_frequency=config.rounds + 1,
            train_cohort_size=config.sampling.num_fit(data.num_clients),
            val_cohort_size=0,
        ),
        backend=SimulatedBackend(training_data=federated, val_data=federated),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=fit.local_epochs, local_learning_rate=fit.lr, local_batch_size=fit.batch_size
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=1000),
        callbacks=[Timing()],
    )
    return seconds, {n: t.detach().numpy().copy() for n, t in net.state_dict().items()}


def systems_of(args: argparse.Namespace) -> dict[str, tuple[str, Run | None]]:
    """The bench's rows: name -> (child key, run; None: skipped, the key then says why)."""
    workers = args.workers or default_workers()
    have_ray = importlib.util.find_spec("ray") is not None
    have_flwr = have_ray and importlib.util.find_spec("flwr") is not None
    rows: dict[str, tuple[str, Run | None]] = {
        "plain PyTorch loop": ("plain", run_plain),
        "fedcore in-process": ("inprocess", run_fedcore),
        "fedcore batched": ("batched", partial(run_fedcore, backend="batched")),
        f"fedcore process pool x{workers}": ("process", partial(run_fedcore, backend="process", workers=workers)),
    }
    rows["fedcore batched, deferred 1st layer"] = (
        "batched-deferred",
        partial(run_fedcore, backend="batched", defer_first_layer=True),
    )
    if args.batched_threads > 1:
        rows[f"fedcore batched, {args.batched_threads} thr"] = (
            "batched-threads",
            partial(run_fedcore, backend="batched", threads=args.batched_threads),
        )
    bench = f"skipped: {pip_install(BENCH_EXTRA)}"
    rows[f"fedcore Ray x{workers}"] = ("ray", partial(run_fedcore, backend="ray", workers=workers))
    rows[f"Flower {_version('flwr')} (Ray) x{workers}"] = ("flower", partial(run_flower, workers=workers))
    rows["pfl-research 0.6"] = ("pfl", run_pfl)
    if args.pfl_threads > 1:
        rows[f"pfl-research 0.6, {args.pfl_threads} thr"] = ("pfl-threads", partial(run_pfl, threads=args.pfl_threads))
    missing = {
        "ray": None if have_ray else bench,
        "flower": None if have_flwr else bench,
        "pfl": None
        if args.child in ("pfl", "pfl-threads") or args.pfl_python
        else "skipped: --pfl-python PATH (a venv with pfl==0.6.0)",
    }
    missing["pfl-threads"] = missing["pfl"]
    return {name: (missing.get(key) or key, None if missing.get(key) else run) for name, (key, run) in rows.items()}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return ""


def run_child(args: argparse.Namespace) -> int:
    """``--child KEY --child-out DIR``: run one system, write its seconds and CPU time (``result.json``) and final
    model (``model.safetensors``) to DIR."""
    from fedcore.payload import save_payload

    torch.set_num_threads(1)
    warm_up()
    prepare_data(DataConfig(dataset="fashion-mnist", num_clients=args.clients, partition="iid"), args.seed)
    run = next((run for key, run in systems_of(args).values() if key == args.child), None)
    if run is None:
        raise SystemExit(f"no system {args.child!r} to run here (its package is missing?)")
    out = Path(args.child_out)
    with tempfile.TemporaryDirectory() as tmp:
        cpu = time.process_time()
        seconds, model = run(recipe(args, Path(tmp)))
        cpu = (time.process_time() - cpu) / args.rounds
    save_payload(out / "model.safetensors", {n: np.ascontiguousarray(a) for n, a in model.items()}, durable=False)
    (out / "result.json").write_text(json.dumps({"seconds": seconds, "cpu": cpu}))
    return 0


def process_tree(root: int) -> list[int]:
    """Process ``root`` and all its descendants (by the parent ids in ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def pss_mib(pids: list[int]) -> float:
    """The summed proportional set size (MiB) of ``pids`` (shared pages split between the processes that map them,
    so a process tree's figure is what it holds in all; 0 for a process that is gone)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
    return total / 1024


def measure(args: argparse.Namespace, key: str, out: Path) -> tuple[list[float], float, float, str]:
    """Run system ``key`` in a child process under ``--child-timeout`` (its whole process group killed then),
    sampling its process tree's memory every 0.25 s: (seconds of each round, CPU s/round of the child's own
    process, peak PSS MiB of the tree, problem or "")."""
    python = args.pfl_python if key in ("pfl", "pfl-threads") else sys.executable
    command = [python, __file__, *(args.argv), "--child", key, "--child-out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(child.stdout or ()), daemon=True)
    reader.start()
    peak, deadline, tree, polls = 0.0, time.monotonic() + args.child_timeout, [child.pid], 0
    while child.poll() is None:
        if polls % 8 == 0:  # the tree every 2 s: walking /proc costs more than reading the memory of a few processes
            tree = process_tree(child.pid)
        polls += 1
        peak = max(peak, pss_mib(tree))
        if time.monotonic() > deadline:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return [], 0.0, peak, f"stopped after {args.child_timeout:.0f} s (--child-timeout)"
        time.sleep(0.25)
    with contextlib.suppress(ProcessLookupError):  # what the child left running (Ray's processes)
        os.killpg(child.pid, signal.SIGKILL)
    reader.join(timeout=5)
    if child.returncode != 0 or not (out / "result.json").exists():
        return [], 0.0, peak, f"failed (exit {child.returncode}): " + " | ".join(lines[-3:]).replace("\n", " ")
    result = json.loads((out / "result.json").read_text())
    return [float(s) for s in result["seconds"]], float(result["cpu"]), peak, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=1000, help="virtual clients (IID shards)")
    parser.add_argument("--per-round", "--clients-per-round", type=int, default=100, help="clients sampled per round")
    parser.add_argument("--model", default="2nn", choices=("2nn", "cnn", "logreg"))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="run every system this many times, alternating")
    parser.add_argument("--batched-threads", type=int, default=0, help="also run the batched backend on N threads")
    parser.add_argument(
        "--workers", type=int, default=None, help="process pool, Ray and Flower workers (default: cores)"
    )
    parser.add_argument("--scale", type=int, default=0, help="also run 1,000 and this many synthetic clients")
    parser.add_argument("--child-timeout", type=float, default=900.0, help="seconds each system's run may take")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated rows to run: plain,inprocess,batched,batched-deferred,batched-threads,process,ray,flower,"
        "pfl,pfl-threads",
    )
    parser.add_argument("--pfl-threads", type=int, default=0, help="also run pfl-research on N torch threads")
    parser.add_argument("--pfl-python", default=None, help="python of a virtualenv with pfl 0.6 (a pfl-research row)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.per_round > args.clients:
        parser.error(f"--clients-per-round {args.per_round} exceeds --clients {args.clients}")
    if args.child is not None:
        return run_child(args)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv)]
    systems = systems_of(args)
    if args.only:
        keep = set(args.only.split(",")) | {"plain"}  # the ratios' reference
        systems = {name: (key, run) for name, (key, run) in systems.items() if key in keep or key.startswith("skip")}
    runs: dict[str, list[tuple[list[float], float, float]]] = {name: [] for name in systems}
    models: dict[str, dict[str, np.ndarray]] = {}
    problems: dict[str, str] = {name: key for name, (key, run) in systems.items() if run is None}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeat):
            for name, (key, _) in systems.items():
                if name in problems:
                    continue
                out = Path(tmp) / f"{key}-{repeat}"
                out.mkdir()
                seconds, cpu, peak, problem = measure(args, key, out)
                if problem:
                    problems[name] = problem
                    continue
                runs[name].append((seconds, cpu, peak))
                models[name] = open_safetensors(out / "model.safetensors")[0]
                models[name] = {n: np.array(a) for n, a in models[name].items()}
        config = recipe(args, Path(tmp))
    load_after = os.getloadavg()
    print(
        f"workload: {args.clients} clients, {args.per_round} per round, {args.model}, E={args.epochs}, "
        f"B={args.batch_size}, lr={args.lr}, FedAvg, {args.rounds} rounds x {args.repeat}, 1 thread a worker"
    )
    print(
        f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}; each system in a child process"
    )
    if args.rounds < 3:
        print(
            f"note: with {args.rounds} round(s) the median includes round 1, whose time holds the run's start-up (the "
            "pools' workers loading the dataset, first calls compiling); use --rounds 3 or more for the ratios"
        )
    width = max(len("system"), *map(len, runs)) + 2
    print(
        f"{'system':<{width}}{'s/round':>9}{'CPU s/round':>13}{'peak MiB':>10}{'accuracy':>10}{'x plain':>9}  "
        "wall seconds of each round"
    )
    medians: dict[str, tuple[float, float]] = {}
    for name, results in runs.items():
        if name in problems:
            print(f"{name:<{width}}{problems[name]}")
            continue
        rounds = [s for seconds, _, _ in results for s in seconds]
        medians[name] = (statistics.median(rounds), statistics.median(cpu for _, cpu, _ in results))
        plain = medians.get("plain PyTorch loop", (float("nan"), 0.0))[0]
        print(
            f"{name:<{width}}{medians[name][0]:>9.3f}{medians[name][1]:>13.3f}{max(p for _, _, p in results):>10.0f}"
            f"{test_accuracy(config, models[name]):>10.4f}{medians[name][0] / plain:>9.2f}  "
            + " | ".join(" ".join(f"{s:.3f}" for s in seconds) for seconds, _, _ in results)
        )
    if "plain PyTorch loop" not in medians:
        return 1
    plain, plain_cpu = medians["plain PyTorch loop"]
    plain_model = models["plain PyTorch loop"]
    targets = {"fedcore in-process": "target <= 1.3", "fedcore batched": "target <= 0.5"}
    for name in medians:
        if name == "plain PyTorch loop":
            continue
        wall, cpu = medians[name]
        diff = max(float(np.max(np.abs(plain_model[n].astype(np.float64) - models[name][n]))) for n in plain_model)
        print(
            f"ratio {name} / plain: {wall / plain:.2f} wall, {cpu / plain_cpu:.2f} CPU"
            + (f" ({targets[name]})" if name in targets else "")
            + f"; largest difference from the plain loop's final model: {diff:.3g}"
        )
    local = models.get("fedcore in-process")
    for name in (n for n in medians if n.startswith(("fedcore process pool", "fedcore Ray"))):
        if local is not None:
            same = all(np.array_equal(models[name][n], local[n]) for n in plain_model)
            print(f"{name} model {'equals' if same else 'DIFFERS from'} the in-process model bit for bit")
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
