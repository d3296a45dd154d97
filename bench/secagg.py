"""Benchmark: one SecAgg+ round (privacy/secagg) against plain aggregation, on one machine, in memory.

    python bench/secagg.py                                   # 1M float32 params; n=10, n=50, n=50 with 10% dropout
    python bench/secagg.py --clients 100 --neighbours 15 --dropout 0 0.1   # the issue's setup (about 2 minutes)
    python bench/secagg.py --clients 10 --params 100000 --flwr-timeout 120  # a quick run, flwr's rows included

For each row, every client's update is a fresh random 1M-parameter float32 model; the round runs through
``privacy.secagg.inmemory.run_round`` (the client and server state machines passing messages by reference), and
the dropouts (a fraction of the clients) vanish after sharing keys, the costly case for the server (their
masks are rebuilt from neighbours' shares). Beside it, the plain round over the same updates: every surviving
client serializes its float32 update (safetensors, ``fedcore.tensors.encode``), the server decodes each
(``fedcore.tensors.decode``, from its receive buffer, no copy) and folds it into the streaming weighted mean
(``fedcore.aggregation.WeightedMean``, one thread). The masked upload is serialized and decoded the same way.
Printed per row, plain beside SecAgg+:

- client s: the clients' compute as a deployment waits for it (clients run in parallel on their own machines,
  the server waits for the slowest): plain, a client's serialization of its update; SecAgg+, a client's compute
  in each stage (key agreement, share encryption, quantizing and masking with the upload's serialization, unmask
  shares), summed over the four stages. The clients do the same work here, so the slowest is a typical one: the
  median over the clients (on a shared machine their spread is its scheduling, not a slower client);
- server s: the server's compute for every stage (plain: decoding and the streaming mean; SecAgg+: checking
  keys and ciphertexts, decoding and summing the masked uploads, Shamir reconstruction, unmasking, dequantizing);
- round s: client s + server s, and the ratio SecAgg+ : plain (the issue's target: at most 2);
- one core s: every client's compute one after another plus the server's, what this one-machine simulation pays;
- upload bytes: a surviving client's fit-result payload as sent (safetensors: header and data), the masked
  upload against the plain float32 update, and ``+stages``, the protobuf bytes of its other stage replies (two
  public keys, share ciphertexts, the empty acknowledgement, unmask shares), which do not grow with the model.

Each figure is the best of ``--repeat`` rounds. It also prints the mask PRG's rate (MaskExpander adding 16M uint32
elements into a vector) against the raw AES-128-CTR keystream (the PRG's cipher) of ``cryptography`` written into a
preallocated buffer of the same size (best of 5). One core; times are wall seconds. On a shared machine compare numbers
only within one run (the header prints the load average).

Then the same rows through flwr's SecAgg+ (``flwr.server.workflow.SecAggPlusWorkflow`` on the server,
``flwr.client.mod.secaggplus_mod`` on the clients, one ServerApp and one ClientApp run by
``flwr.simulation.run_simulation`` on its Ray backend), and flwr's plain round (the same apps, default fit workflow,
no mod) as its own reference. The setup matches ours: each client replies with a fresh random float32 update of
``--params`` values in [-0.5, 0.5) and an example count in [1, 1000) (``clipping_range=0.5``, ``max_weight=1000``);
``k`` shares per secret (flwr's ``num_shares``, which counts the client's own share, so ``k - 1`` neighbours; ours
has ``k`` neighbours) and threshold ``k // 2 + 1``; the dropouts vanish at the masked-input stage (their reply is an
error), after sharing keys, as in our rows. flwr runs in a child process (one Ray start for all its rows, a warm-up
plain round first, untimed) under ``--flwr-timeout`` seconds, with ``--flwr-cpus`` Ray CPUs, one per ClientApp
actor (default 1: clients one after another, as our rows count them). Printed per row: seconds per round, the
server's wall time of the fit workflow (sending the model, every client's reply including drawing its update,
about 3 ms, the protocol stages, aggregation), and the max error of the aggregate against the weighted mean of
the survivors' updates; beside it our one-core figures (clients one after another, as flwr's single actor runs
them). Needs Ray (``pip install -e '.[bench]'``);
without it the flwr rows are skipped with a line saying so. ``--flwr-clients 0`` skips them too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedcore.aggregation import WeightedMean
from fedcore.errors import pip_install
from fedcore.messages import StageIns
from fedcore.tensors import TensorSpec, decode, encode, spec_of
from fedcore.wire import stage_message_to_pb
from privacy.secagg import ClientMessage, SecAggConfig, Stage, codec
from privacy.secagg.crypto import MASK_KEY_BYTES, MaskExpander
from privacy.secagg.inmemory import run_round
from privacy.secagg.messages import MaskedInputRes
from privacy.secagg.quantize import quantize


def _updates(clients: int, params: int, seed: int) -> dict[str, tuple[dict[str, np.ndarray], int]]:
    rng = np.random.default_rng(seed)
    a = params * 3 // 4
    return {
        f"client-{i}": (
            {
                "fc1.weight": rng.uniform(-0.5, 0.5, a).astype(np.float32),
                "fc2.weight": rng.uniform(-0.5, 0.5, params - a).astype(np.float32),
            },
            int(rng.integers(1, 1000)),
        )
        for i in range(clients)
    }


def _row(clients: int, params: int, dropout: float, neighbours: int | None) -> dict[str, float]:
    """One SecAgg+ round and one plain round over the same updates; the seconds and bytes the module docstring
    lists."""
    updates = _updates(clients, params, seed=clients)
    spec = spec_of(next(iter(updates.values()))[0])
    config = SecAggConfig(neighbours=neighbours, clip=0.5, max_weight=1000)
    gone = {f"client-{i}" for i in range(round(dropout * clients))}
    stage_bytes: dict[str, int] = {}
    upload_bytes: dict[str, int] = {}
    serialize: dict[tuple[str, str], float] = {}
    deserialize = 0.0
    masked_spec: list[TensorSpec] = []

    def wire(reply: ClientMessage) -> None:
        """What the gRPC path does with a reply: a stage reply becomes a protobuf stage message; the masked upload
        is the fit result's payload (safetensors), encoded by the client and decoded by the server (timed)."""
        nonlocal deserialize
        cid = reply.client_id
        ins = StageIns(round=reply.round, attempt=1, protocol=codec.PROTOCOL, name=reply.stage.value, fields={})
        carried = None if isinstance(reply, MaskedInputRes) else reply  # the masked-input stage: an empty ack
        size = stage_message_to_pb(codec.client_stage(carried, ins, cid)).ByteSize()
        stage_bytes[cid] = stage_bytes.get(cid, 0) + size
        if isinstance(reply, MaskedInputRes):
            if not masked_spec:
                masked_spec.append(TensorSpec(codec.MASKED, reply.masked.shape, reply.masked.dtype.name))
            start = time.perf_counter()
            data = encode({codec.MASKED: reply.masked})
            serialize[reply.stage.value, cid] = time.perf_counter() - start
            upload_bytes[cid] = len(data)
            received = bytearray(data)  # the server's receive buffer (a spill file, mapped, on the gRPC path)
            start = time.perf_counter()
            decode(received, masked_spec, copy=False)
            deserialize += time.perf_counter() - start

    # the compiled quantization kernel compiles on first use in a process: not part of a round
    warm_params = config.resolve(clients)
    quantize(next(iter(updates.values()))[0], 1, warm_params, spec, bytes(32))
    timings: dict[str, float] = {}
    per_client: dict[tuple[str, str], float] = {}
    result = run_round(
        config,
        updates,
        spec,
        dropouts={Stage.COLLECT_MASKED_INPUT: gone},
        on_reply=wire,
        timings=timings,
        client_timings=per_client,
    )
    for key, seconds in serialize.items():
        per_client[key] = per_client.get(key, 0.0) + seconds
    stages = {stage for stage, _ in per_client}
    # a deployment: the clients of a stage run in parallel, the server waits for the slowest, then closes it. The
    # clients here do the same work on the same machine, so the slowest is a typical one: the median, since the
    # spread on a shared machine is its scheduling (the max measures the longest stall, not a slower client)
    secure_critical = sum(float(np.median([t for (s, _), t in per_client.items() if s == stage])) for stage in stages)
    secure_server = sum(v for k, v in timings.items() if k.startswith("server:")) + deserialize

    warm = WeightedMean(spec, threads=1)  # the fold kernels compile on first use: not part of a round
    warm.add(next(iter(updates.values()))[0], 1.0)
    warm.result()
    plain = WeightedMean(spec, threads=1)
    plain_client: list[float] = []
    plain_server = 0.0
    plain_bytes = 0
    for cid, (update, weight) in updates.items():
        if cid in gone:
            continue
        start = time.perf_counter()
        data = encode(update)
        plain_client.append(time.perf_counter() - start)
        plain_bytes = len(data)
        received = bytearray(data)
        start = time.perf_counter()
        plain.add(decode(received, spec, copy=False), weight)
        plain_server += time.perf_counter() - start
    start = time.perf_counter()
    reference = plain.result()
    plain_server += time.perf_counter() - start

    secure = result.mean(spec)
    error = max(float(np.abs(secure[s.name] - reference[s.name]).max()) for s in spec)
    survivor = next(c for c in updates if c not in gone)
    return {
        "secure_client": secure_critical,
        "secure_server": secure_server,
        "secure_round": secure_critical + secure_server,
        "secure_serial": sum(per_client.values()) + secure_server,
        "plain_client": float(np.median(plain_client)),
        "plain_server": plain_server,
        "plain_round": float(np.median(plain_client)) + plain_server,
        "plain_serial": sum(plain_client) + plain_server,
        "upload": float(upload_bytes[survivor]),
        "stage_upload": float(stage_bytes[survivor]),
        "plain_upload": float(plain_bytes),
        "error": error,
        "bound": config.resolve(clients).error_bound,
        "neighbours": float(config.resolve(clients).neighbours),
    }


def _prg_rates(elements: int = 16 << 20) -> tuple[float, float]:
    seed = bytes(range(32))
    nbytes = elements * 4
    zeros = bytes(nbytes)
    buffer = bytearray(nbytes + 15)
    out = np.ones(elements, dtype="<u4")  # written already, as a client's quantized vector is
    best_raw = best_mask = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        Cipher(algorithms.AES(seed[:MASK_KEY_BYTES]), modes.CTR(bytes(16))).encryptor().update_into(zeros, buffer)
        best_raw = min(best_raw, time.perf_counter() - start)
        expander = MaskExpander(np.dtype("<u4"))
        start = time.perf_counter()
        expander.apply(out, [(expander.stream(seed), 1)])
        best_mask = min(best_mask, time.perf_counter() - start)
    return nbytes / best_raw / 1e9, nbytes / best_mask / 1e9


BENCH_EXTRA = "-e '.[bench]'"  # pip's arguments for the bench extras (flwr, Ray), from this checkout
_FLWR_ROW = "FLWR_ROW "  # prefix of the child's result lines on stdout


def _flwr_update(partition: int, params: int) -> tuple[list[np.ndarray], int]:
    """Client ``partition``'s update for flwr's rows: float32 values in [-0.5, 0.5) in two tensors (3/4 and 1/4
    of ``params``), and its example count in [1, 1000). Deterministic in (partition, params)."""
    rng = np.random.default_rng([partition, params])
    values = rng.random(params, dtype=np.float32) - np.float32(0.5)
    a = params * 3 // 4
    return [values[:a], values[a:]], int(rng.integers(1, 1000))


def _flwr_child(spec: dict[str, Any]) -> None:
    """Run flwr's rows in this process: one ``run_simulation`` (one Ray start) of ``max(n)`` SuperNodes whose
    ServerApp runs an untimed plain warm-up round, then per row a plain round (the row's own reference) and a
    SecAgg+ round, and prints one ``FLWR_ROW`` JSON line per round as it finishes.

    ``spec``: ``params``, ``rows`` (list of [n, dropout, k]), ``cpus`` (Ray CPUs, one per ClientApp actor),
    ``stage_timeout`` (seconds SecAggPlusWorkflow waits for each stage's replies)."""
    import flwr  # noqa: F401  (the version is printed by the parent)
    from flwr.app import Error, Message
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, FitIns, ndarrays_to_parameters
    from flwr.common.constant import ErrorCode
    from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_PARAMS_RECORD
    from flwr.server.workflow.default_workflows import default_fit_workflow
    from flwr.simulation import run_simulation

    params: int = spec["params"]
    rows: list[tuple[int, float, int]] = [(int(n), float(d), int(k)) for n, d, k in spec["rows"]]
    supernodes = max(n for n, _, _ in rows)

    class BenchClient(NumPyClient):
        def __init__(self, partition: int) -> None:
            self.partition = partition

        def fit(
            self, parameters: list[np.ndarray], config: dict[str, Any]
        ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            arrays, weight = _flwr_update(self.partition, params)
            return arrays, weight, {"partition": self.partition}

    def client_fn(context: Context) -> Any:
        return BenchClient(int(context.node_config["partition-id"])).to_client()

    def secagg_if_asked(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        """secaggplus_mod for SecAgg+ messages, and the bench's dropout: a client whose fit config says ``drop``
        replies with an error at the masked-input stage (after sharing keys). Plain fit messages go straight
        to the client."""
        records = msg.content.config_records
        if "secaggplus_configs" not in records:
            return call_next(msg, context)
        if records["secaggplus_configs"].get("stage") == "collect_masked_vectors" and records["fitins.config"].get(
            "drop", False
        ):
            return Message(Error(code=ErrorCode.UNKNOWN, reason="dropped out (bench)"), reply_to=msg)
        reply: Message = secaggplus_mod(msg, context, call_next)
        return reply

    class BenchFedAvg(FedAvg):
        """FedAvg over exactly ``n`` sampled clients, the first ``dropouts`` of them told to vanish at the
        masked-input stage; remembers which clients' updates went into the aggregate."""

        def __init__(self, n: int, dropouts: int, initial: Any) -> None:
            super().__init__(
                fraction_evaluate=0.0, min_fit_clients=n, min_available_clients=n, initial_parameters=initial
            )
            self.n, self.dropouts = n, dropouts
            self.survivors: list[int] = []

        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list[tuple[Any, Any]]:
            clients = client_manager.sample(num_clients=self.n, min_num_clients=self.n)
            return [(c, FitIns(parameters, {"drop": i < self.dropouts})) for i, c in enumerate(clients)]

        def aggregate_fit(self, server_round: int, results: list[tuple[Any, Any]], failures: list[Any]) -> Any:
            self.survivors = [int(res.metrics["partition"]) for _, res in results]
            return super().aggregate_fit(server_round, results, failures)

    def max_error(survivors: list[int], aggregate: list[np.ndarray]) -> float:
        total = np.zeros(params)
        weights = 0
        for partition in survivors:
            arrays, weight = _flwr_update(partition, params)
            total += weight * np.concatenate(arrays).astype(np.float64)
            weights += weight
        return float(np.abs(np.concatenate(aggregate) - total / weights).max())

    def one_round(grid: Grid, context: Context, n: int, dropout: float, k: int, secure: bool) -> dict[str, Any]:
        zeros = ndarrays_to_parameters(
            [np.zeros(params * 3 // 4, np.float32), np.zeros(params - params * 3 // 4, np.float32)]
        )
        strategy = BenchFedAvg(n, round(dropout * n), zeros)
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
        fit: Callable[[Grid, Context], None] = (
            SecAggPlusWorkflow(
                num_shares=k,
                reconstruction_threshold=k // 2 + 1,
                clipping_range=0.5,
                max_weight=1000.0,
                timeout=spec["stage_timeout"],
            )
            if secure
            else default_fit_workflow
        )
        seconds: list[float] = []

        def timed_fit(grid: Grid, context: Context) -> None:
            start = time.perf_counter()
            fit(grid, context)
            seconds.append(time.perf_counter() - start)

        DefaultWorkflow(fit_workflow=timed_fit)(grid, legacy)
        aggregate = legacy.state.array_records[MAIN_PARAMS_RECORD].to_numpy_ndarrays()
        return {
            "n": n,
            "dropout": dropout,
            "k": k,
            "secure": secure,
            "seconds": seconds[0],
            "survivors": len(strategy.survivors),
            "error": max_error(strategy.survivors, aggregate) if strategy.survivors else float("nan"),
        }

    server = ServerApp()

    @server.main()
    def _(grid: Grid, context: Context) -> None:
        one_round(grid, context, rows[0][0], 0.0, rows[0][2], secure=False)  # warm-up: actors start, imports load
        for n, dropout, k in rows:
            for secure in (False, True) if dropout == 0 else (True,):
                print(_FLWR_ROW + json.dumps(one_round(grid, context, n, dropout, k, secure)), flush=True)

    run_simulation(
        server_app=server,
        client_app=ClientApp(client_fn=client_fn, mods=[secagg_if_asked]),
        num_supernodes=supernodes,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {
                "num_cpus": spec["cpus"],
                "include_dashboard": False,
                "object_store_memory": 1 << 30,
                "log_to_driver": False,
            },
        },
    )


def _flwr_rows(rows: list[tuple[int, float, int]], params: int, cpus: int, timeout: float) -> list[dict[str, Any]]:
    """flwr's rows from a child process (:func:`_flwr_child`) given ``timeout`` seconds in all; its own process
    group is killed at the deadline (Ray's processes with it) and the rows finished by then are returned."""
    spec = {"params": params, "rows": rows, "cpus": cpus, "stage_timeout": timeout}
    child = subprocess.Popen(
        [sys.executable, __file__, "--flwr-child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, _ = child.communicate()
        print(f"flwr: stopped after {timeout:.0f} s (--flwr-timeout); rows finished by then:")
    else:
        if child.returncode != 0:
            tail = "\n".join(out.splitlines()[-20:])
            print(f"flwr: the simulation failed (exit {child.returncode}); its last lines:\n{tail}")
    return [json.loads(line[len(_FLWR_ROW) :]) for line in out.splitlines() if line.startswith(_FLWR_ROW)]


def _compare_flwr(
    rows: list[tuple[int, float]], ours: dict[tuple[int, float], dict[str, float]], args: argparse.Namespace
) -> None:
    """Run flwr's rows and print them beside ours: seconds per round (fedcore: the one-core figure, every client's
    compute one after another plus the server's, as flwr's single ClientApp actor runs them) and
    the ratio fedcore SecAgg+ : flwr SecAgg+ where the same (n, dropout) has a fedcore row."""
    if importlib.util.find_spec("flwr") is None or importlib.util.find_spec("ray") is None:
        print(f"flwr SecAgg+: skipped ({pip_install(BENCH_EXTRA)})")
        return
    from importlib.metadata import version

    k_of = {n: SecAggConfig(neighbours=args.neighbours).resolve(n).neighbours for n, _ in rows}
    print(
        f"flwr {version('flwr')} SecAgg+ (SecAggPlusWorkflow + secaggplus_mod, run_simulation on Ray "
        f"{version('ray')}, {args.flwr_cpus} CPU(s), one ClientApp actor each), seconds per round:",
        flush=True,
    )
    start = time.perf_counter()
    results = _flwr_rows([(n, d, k_of[n]) for n, d in rows], args.params, args.flwr_cpus, args.flwr_timeout)
    flwr_s = {(r["n"], r["dropout"], r["secure"]): r for r in results}
    header = (
        f"{'n':>4} {'k':>3} {'drop':>5} | {'fedcore':>8} {'plain':>8} | {'flwr':>8} {'plain':>8} {'max err':>8} | "
        f"{'fedcore:flwr':>12}"
    )
    print(header)
    print("-" * len(header))
    for n, drop in rows:
        mine, theirs, theirs_plain = ours.get((n, drop)), flwr_s.get((n, drop, True)), flwr_s.get((n, 0.0, False))
        ours_s = mine["secure_serial"] if mine else None
        cells = [
            f"{ours_s:>8.3f} {mine['plain_serial']:>8.3f}" if mine and ours_s else f"{'-':>8} {'-':>8}",
            f"{theirs['seconds']:>8.3f}" if theirs else f"{'-':>8}",
            f"{theirs_plain['seconds']:>8.3f}" if theirs_plain else f"{'-':>8}",
            f"{theirs['error']:>8.1e}" if theirs else f"{'-':>8}",
            f"{'1 : ' + format(theirs['seconds'] / ours_s, '.1f'):>12}" if theirs and ours_s else f"{'-':>12}",
        ]
        print(f"{n:>4} {k_of[n]:>3} {drop:>5.0%} | {cells[0]} | {cells[1]} {cells[2]} {cells[3]} | {cells[4]}")
    print(f"flwr rows took {time.perf_counter() - start:.0f} s in all (Ray start and warm-up round included)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0], help="fractions dropping after sharing")
    parser.add_argument("--extra-dropout-row", type=float, default=0.1, help="also run the largest n at this dropout")
    parser.add_argument("--neighbours", type=int, default=None, help="k (default: SecAggConfig's)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--flwr-clients", type=int, nargs="+", default=None, help="n for flwr's rows (default: --clients; 0: skip flwr)"
    )
    parser.add_argument("--flwr-timeout", type=float, default=600.0, help="seconds for all flwr rows together")
    parser.add_argument("--flwr-cpus", type=int, default=1, help="Ray CPUs for flwr's ClientApp actors (one each)")
    parser.add_argument("--flwr-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flwr_child is not None:
        _flwr_child(json.loads(args.flwr_child))
        return

    print(f"load average before: {os.getloadavg()[0]:.2f}; {args.params:,} float32 parameters per client")
    rows = [(n, d) for n in args.clients for d in args.dropout]
    if args.extra_dropout_row and (max(args.clients), args.extra_dropout_row) not in rows:
        rows.append((max(args.clients), args.extra_dropout_row))
    header = (
        f"{'n':>4} {'k':>3} {'drop':>5} | {'client s':>17} | {'server s':>17} | {'round s':>23} | "
        f"{'one core s':>23} | {'upload bytes':>27} {'+stages':>7} | {'max err':>8} {'bound':>8}"
    )
    print(header)
    print(
        f"{'':>14} | {'plain':>8} {'secure':>8} | {'plain':>8} {'secure':>8} | {'plain':>8} {'secure':>8} "
        f"{'ratio':>5} | {'plain':>8} {'secure':>8} {'ratio':>5} | {'plain':>10} {'masked':>10} {'ratio':>5} "
        f"{'':>7} |"
    )
    print("-" * len(header))
    ours: dict[tuple[int, float], dict[str, float]] = {}
    for n, drop in rows:
        runs = [_row(n, args.params, drop, args.neighbours) for _ in range(args.repeat)]
        b = ours[n, drop] = {key: min(r[key] for r in runs) for key in runs[0]}  # best of --repeat, per figure
        print(
            f"{n:>4} {int(b['neighbours']):>3} {drop:>5.0%} | {b['plain_client']:>8.3f} {b['secure_client']:>8.3f} | "
            f"{b['plain_server']:>8.3f} {b['secure_server']:>8.3f} | "
            f"{b['plain_round']:>8.3f} {b['secure_round']:>8.3f} {b['secure_round'] / b['plain_round']:>5.1f} | "
            f"{b['plain_serial']:>8.3f} {b['secure_serial']:>8.3f} {b['secure_serial'] / b['plain_serial']:>5.1f} | "
            f"{b['plain_upload']:>10.0f} {b['upload']:>10.0f} {b['upload'] / b['plain_upload']:>5.3f} "
            f"{b['stage_upload']:>7.0f} | {b['error']:>8.1e} {b['bound']:>8.1e}",
            flush=True,
        )
    raw, mask = _prg_rates()
    print(
        f"mask PRG: {mask:.2f} GB/s added into a uint32 vector; raw AES-128-CTR keystream {raw:.2f} GB/s "
        f"({mask / raw:.0%} of raw)"
    )
    flwr_clients = args.clients if args.flwr_clients is None else [n for n in args.flwr_clients if n > 0]
    if flwr_clients:
        flwr_rows = [(n, d) for n in flwr_clients for d in args.dropout]
        if args.extra_dropout_row and (max(flwr_clients), args.extra_dropout_row) not in flwr_rows:
            flwr_rows.append((max(flwr_clients), args.extra_dropout_row))
        _compare_flwr(flwr_rows, ours, args)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
