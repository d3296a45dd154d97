"""Benchmark: update compression (fedcore.compression) on the default recipe's model and data.

    nice python bench/compression.py                      # bytes, throughput, and accuracy after 10 rounds
    nice python bench/compression.py --rounds 30          # the default recipe's full 30 rounds (~5 min per run)
    nice python bench/compression.py --no-codecs --methods int8 --rounds 5   # one accuracy run (run several at once)
    python bench/compression.py --rounds 0                # bytes and throughput only (seconds)
    python bench/compression.py --methods none,int8,topk  # which accuracy runs

Part 1, per method, for one client update of the default recipe's CNN (the FedAvg paper's, 1,663,370 float32
parameters; the update is N(0, 1e-3) noise, the speed of the codecs does not depend on the values):

- bytes per update (``topk/model``: ``topk_scope = "model"``): the safetensors payload a gRPC push carries
  (tensors, tensor groups and header; the same bytes ``tests/deploy/test_compression_grpc.py`` counts on a real
  upload), and the ratio to the uncompressed update;
- encode MB/s: the client mod (``CompressionMod.__call__`` after training) over the float32 update's size;
- decode MB/s: the server's decode plus the streaming mean's fold (``WeightedMean.add`` of the lazily decoded
  update, its two block passes: finite check and fold), against the same fold of the plain float32 update (the
  "none" row), again over the float32 update's size. Best of ``--repeat`` runs, one thread (``--threads``).

Part 1b (``--energy``): how much of a real update top-k keeps: ``clients`` clients of the default recipe each train
one round from the initial model (their first round), and the share of the update's squared L2 norm in the k entries
sent, per tensor (``topk_scope = "tensor"``) and over the whole update (``"model"``), with how the entire-model top-k
splits its k over the tensors.

Part 2: the default recipe (simulations/recipes/default.toml: Fashion-MNIST, 100 clients, Dirichlet 0.5, CNN,
FedAvgM 0.7, 10 clients a round) run for ``--rounds`` rounds once per method, same seed; the test accuracy of the
global model after the last round, and the difference to the uncompressed run in points. The targets (issue 13):
int8 at ~4x fewer bytes within 1 point, top-k 1% with error feedback within 2 points.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedcore.aggregation import WeightedMean  # noqa: E402
from fedcore.compression import CompressionMod  # noqa: E402
from fedcore.messages import FitIns, FitRes, payload_arrays  # noqa: E402
from fedcore.mods import ModContext  # noqa: E402
from fedcore.task import FitConfig  # noqa: E402
from fedcore.tensors import NamedArrays, safetensors_header, spec_of  # noqa: E402
from simulations.config import load_recipe  # noqa: E402
from simulations.models import build_model  # noqa: E402

METHODS = ("none", "float16", "bfloat16", "int8", "topk")


def wire_bytes(reply: FitRes) -> int:
    """The safetensors payload of ``reply`` as a push carries it (tensors, groups, header)."""
    arrays, metadata = payload_arrays(reply)
    return len(safetensors_header(arrays, metadata)) + sum(int(a.nbytes) for a in arrays.values())


def _trained(reply: FitRes, instruction: FitIns) -> FitRes:
    """The training a benchmark run stands for: the reply it made earlier."""
    return reply


def best(seconds: list[float]) -> float:
    return min(seconds)


def codec_rows(repeat: int, threads: int, fraction: float) -> list[dict[str, object]]:
    torch_model = build_model("cnn", (1, 28, 28), 10)
    model = {n: t.detach().numpy().copy() for n, t in torch_model.state_dict().items()}
    rng = np.random.default_rng(0)
    trained = {n: (a + rng.normal(scale=1e-3, size=a.shape)).astype(a.dtype) for n, a in model.items()}
    size_mb = sum(a.nbytes for a in model.values()) / 1e6
    ins = FitIns(round=1, parameters=model, config=FitConfig(), seed=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from client.state import ClientStateStore

        store = ClientStateStore(tmp)
        for method in (*METHODS, "topk/model"):
            plain = FitRes(client_id="c", round=1, parameters=trained, num_examples=1)
            name, _, scope = method.partition("/")
            mod = None if method == "none" else CompressionMod(method=name, fraction=fraction, scope=scope or "tensor")
            encode_s, decode_s = [], []
            reply = plain
            for _ in range(repeat):
                context = ModContext(client_id="c", model=None, state=store.entry("c"))
                started = time.perf_counter()
                reply = plain if mod is None else mod(ins, context, functools.partial(_trained, plain))
                encode_s.append(time.perf_counter() - started)
                accumulator = WeightedMean(spec_of(model), threads=threads)
                started = time.perf_counter()
                update: NamedArrays = (
                    reply.parameters if mod is None else mod.decode(reply, reference=model, round=1).parameters
                )
                accumulator.add(update, 1.0)
                decode_s.append(time.perf_counter() - started)
            rows.append(
                {
                    "method": method,
                    "bytes": wire_bytes(reply),
                    "encode": size_mb / best(encode_s) if mod is not None else float("nan"),
                    "decode": size_mb / best(decode_s),
                }
            )
    base = rows[0]["bytes"]
    for row in rows:
        row["ratio"] = float(str(base)) / float(str(row["bytes"]))
    return rows


def energy_rows(clients: int, fraction: float) -> list[str]:
    """Part 1b: for each of the first ``clients`` clients of the default recipe, one local round from the initial
    model; the share of the update's squared norm that top-k of ``fraction`` keeps per tensor and over the model,
    and how many of the model-wide k each tensor gets."""
    import torch

    from fedcore.compression import top_k, topk_count
    from fedcore.seeding import derive_seed
    from fedcore.task import TaskContext, TrainContext, initial_parameters
    from simulations.harness import task_options
    from simulations.tasks import demo_task

    config = load_recipe(ROOT / "simulations" / "recipes" / "default.toml", [])
    options = task_options(config)
    lines = []
    for client in range(clients):
        context = TaskContext(client_id=str(client), partition_id=client, seed=config.seed, options=options)
        task = demo_task(context)
        start = initial_parameters(task.build_model, config.seed)
        model = task.build_model()
        model.load_state_dict({n: torch.from_numpy(a.copy()) for n, a in start.items()})
        generator = torch.Generator().manual_seed(derive_seed(config.seed, "energy", client))
        task.train(
            model,
            config.train,
            TrainContext(
                round=1, client_id=str(client), generator=generator, global_parameters=dict(model.state_dict())
            ),
        )
        update = {
            n: t.detach().double().numpy().reshape(-1) - start[n].reshape(-1) for n, t in model.state_dict().items()
        }
        total = sum(float(u @ u) for u in update.values())
        per_tensor = sum(float((u[top_k(u, topk_count(u.size, fraction))] ** 2).sum()) for u in update.values())
        flat = np.concatenate(list(update.values()))
        chosen = top_k(flat, topk_count(flat.size, fraction)).astype(np.int64)
        offsets = np.cumsum([0, *(u.size for u in update.values())])
        split = {
            n: int(((chosen >= lo) & (chosen < hi)).sum())
            for n, lo, hi in zip(update, offsets[:-1], offsets[1:], strict=True)
        }
        model_wide = float((flat[chosen] ** 2).sum())
        lines.append(
            f"client {client}: kept {per_tensor / total:.3f} per tensor, {model_wide / total:.3f} over the model; "
            f"model-wide k by tensor {split}"
        )
    return lines


def accuracy(method: str, rounds: int, fraction: float, out: Path, extra: list[str]) -> tuple[float, float, int]:
    """Test accuracy after the last round, wall seconds, and the run's total bytes up (every fit reply)."""
    from simulations.harness import run_simulation

    overrides = [
        f"rounds={rounds}",
        f"evaluate_every={rounds}",
        f"output.dir='{out / method}'",
        "output.progress=false",
    ]
    if method != "none":
        overrides += [f"strategy.compression='{method}'", f"strategy.topk_fraction={fraction}", *extra]
    config = load_recipe(ROOT / "simulations" / "recipes" / "default.toml", overrides)
    started = time.perf_counter()
    result = run_simulation(config, echo=lambda line: None)
    last = result.history.iloc[-1]
    return float(last["test_accuracy"]), time.perf_counter() - started, int(result.history["bytes_up"].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the default recipe per run (0: skip)")
    parser.add_argument("--methods", default="none,int8,topk", help="comma-separated methods for the accuracy runs")
    parser.add_argument("--fraction", type=float, default=0.01, help="top-k fraction")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for the compressed runs, e.g. strategy.topk_scope='model' (repeatable)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="codec timing runs per method (best is shown)")
    parser.add_argument("--threads", type=int, default=1, help="fold threads of the streaming mean")
    parser.add_argument("--out", type=Path, default=None, help="where the simulations write (default: a temp dir)")
    parser.add_argument("--no-codecs", action="store_true", help="skip part 1 (bytes and throughput)")
    parser.add_argument("--energy", type=int, default=0, metavar="CLIENTS", help="part 1b for this many clients")
    args = parser.parse_args()

    print(f"update of the default recipe's CNN (1,663,370 float32 parameters), top-k fraction {args.fraction}")
    print(f"{'method':>9} {'bytes/update':>13} {'ratio':>7} {'encode MB/s':>12} {'decode+fold MB/s':>17}")
    for row in [] if args.no_codecs else codec_rows(args.repeat, args.threads, args.fraction):
        print(
            f"{row['method']:>9} {row['bytes']:>13,} {row['ratio']:>6.2f}x {row['encode']:>12.0f} "
            f"{row['decode']:>17.0f}"
        )
    if args.energy:
        print(f"\nshare of a first-round update's squared norm that top-k {args.fraction} keeps")
        for line in energy_rows(args.energy, args.fraction):
            print(line)
    if args.rounds <= 0:
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    print(f"\ndefault recipe, {args.rounds} rounds, seed 0: test accuracy after the last round")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        results = {m: accuracy(m, args.rounds, args.fraction, out, args.set) for m in methods}
    base, base_bytes = results.get("none", (float("nan"), 0.0, 0))[0::2]
    for method, (acc, seconds, sent) in results.items():
        ratio = f" ({base_bytes / sent:.1f}x fewer than none)" if base_bytes and method != "none" else ""
        print(
            f"{method:>9} accuracy {acc:.4f} ({100 * (acc - base):+.2f} points vs none) in {seconds:.0f} s; "
            f"{sent:,} bytes up in all{ratio}"
        )


if __name__ == "__main__":
    main()
