"""The ``fedcore`` command line: ``simulate``, ``partition`` (and the deployment commands as they land).

Role packages are imported lazily inside the sub-command that needs them, so ``fedcore --help`` is fast and
the core never depends on them at import time.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fedcore.errors import ConfigError, FedcoreError

if TYPE_CHECKING:
    from fedcore.engine.plan import ParallelPlan

#: simulate's shortcut flags and the recipe key each one sets.
SIMULATE_SHORTCUTS = {
    "rounds": "rounds",
    "seed": "seed",
    "dataset": "data.dataset",
    "data_dir": "data.data_dir",
    "clients": "data.num_clients",
    "partition": "data.partition",
    "alpha": "data.alpha",
    "model": "model.name",
    "strategy": "strategy.name",
    "aggregator": "strategy.aggregator",
    "clients_per_round": "sampling.min_fit_clients",
    "epochs": "train.local_epochs",
    "batch_size": "train.batch_size",
    "lr": "train.lr",
    "mu": "train.mu",
    "out": "output.dir",
    "task": "task.factory",
}


def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate",
        help="run a federated simulation with virtual clients on a built-in dataset",
        description=(
            "Run FedAvg-family rounds with in-process virtual clients over a dataset partitioned non-IID. "
            "Defaults: fashion-mnist, 100 clients, Dirichlet alpha=0.5, the FedAvg CNN, 10 clients per round."
        ),
    )
    p.add_argument("--recipe", help="TOML recipe (see simulations/recipes/); flags below override it")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any recipe value (wins over the flags below), e.g. --set train.lr=0.1",
    )
    p.add_argument("--rounds", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--dataset", help="fashion-mnist, mnist-5k, digits, synthetic")
    p.add_argument("--data-dir", help="directory holding the dataset files (else $FEDCORE_DATA / system path)")
    p.add_argument("--clients", type=int, help="number of virtual clients")
    p.add_argument("--partition", help="iid, dirichlet, dirichlet-client, shards, quantity, natural")
    p.add_argument("--alpha", type=float, help="Dirichlet concentration")
    p.add_argument("--model", help="cnn, 2nn, logreg")
    p.add_argument("--strategy", help="fedavg, fedavgm, fedprox, fedadagrad, fedadam, fedyogi")
    p.add_argument(
        "--aggregator",
        help="mean, median, trimmed_mean, krum, multi_krum, norm_bound (parameters: --set strategy.byzantine=2 ...)",
    )
    p.add_argument("--clients-per-round", type=int, help="minimum clients selected per round")
    p.add_argument("--epochs", type=int, help="local epochs per round")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float, help="client learning rate")
    p.add_argument("--mu", type=float, help="FedProx proximal coefficient")
    p.add_argument("--out", help="output directory (default runs/latest)")
    p.add_argument(
        "--task",
        help="your own task factory module:attr (importable, e.g. via PYTHONPATH); each virtual client i of N gets "
        "TaskContext(partition_id=i, num_partitions=N); default: the built-in demo task",
    )
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE", help="option for --task")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or per-round table")
    p.set_defaults(func=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from simulations.config import load_recipe
    from simulations.harness import run_simulation

    overrides = []
    for flag, key in SIMULATE_SHORTCUTS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={_toml_literal(value)}")
    if args.no_progress:
        overrides.append("output.progress=false")
    overrides += [f"task.options.{k}={_toml_literal(v)}" for k, v in _pairs(args.task_option, "--task-option")]
    overrides += args.overrides  # explicit --set comes last, so it wins over the shortcut flags
    config = load_recipe(args.recipe, overrides)
    result = run_simulation(config)
    return 3 if result.diverged else 0


def _toml_literal(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def _add_partition(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "partition",
        help="partition a dataset over clients and show the label skew (no training)",
        description="Show per-client class counts, a label-skew summary and a heatmap PNG for a partition.",
    )
    p.add_argument("--recipe", help="TOML recipe whose [data] table to use")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    for flag in ("dataset", "data-dir", "partition"):
        p.add_argument(f"--{flag}")
    p.add_argument("--clients", type=int)
    p.add_argument("--alpha", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--out", default="runs/partition", help="where to write counts.csv and heatmap.png")
    p.set_defaults(func=_cmd_partition)


def _cmd_partition(args: argparse.Namespace) -> int:
    from pathlib import Path

    from simulations.config import load_recipe
    from simulations.report import class_counts, format_summary, plot_heatmap, skew_summary
    from simulations.tasks import prepare_data

    overrides = ["sampling.min_fit_clients=1"]  # no training here: sampling must not limit the client count
    for flag in ("seed", "dataset", "data_dir", "clients", "partition", "alpha"):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{SIMULATE_SHORTCUTS[flag]}={_toml_literal(value)}")
    overrides += args.overrides
    config = load_recipe(args.recipe, overrides)
    prepared = prepare_data(config.data, config.seed)
    counts = class_counts(prepared.labels, prepared.partitions, prepared.num_classes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts.to_csv(out / "counts.csv", index_label="client")
    heatmap = plot_heatmap(
        counts,
        out / "heatmap.png",
        title=f"{config.data.dataset}: {config.data.partition} over {config.data.num_clients} clients",
    )
    print(counts.head(10).to_string())
    if len(counts) > 10:
        print(f"... ({len(counts)} clients)")
    print(format_summary(skew_summary(counts)))
    print(f"per-client class counts: {out / 'counts.csv'}; heatmap: {heatmap}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# deployment: fedcore server start, fedcore client start, fedcore certs init

#: ``server start`` flags that set a top-level key of the server config, with their types.
SERVER_FLAGS: dict[str, type] = {
    "address": str,
    "state_dir": str,
    "task": str,
    "data_dir": str,
    "initial": str,
    "rounds": int,
    "seed": int,
    "evaluate_every": int,
    "round_timeout_s": float,
    "wait_for_clients_s": float,
    "min_fit_results": int,
    "max_round_attempts": int,
    "heartbeat_interval_s": float,
    "liveness_timeout_s": float,
    "max_payload_bytes": int,
    "chunk_bytes": int,
    "max_workers": int,
    "max_calls_per_client": int,
    "max_unauthenticated_calls": int,
    "stream_idle_s": float,
    "stream_total_s": float,
    "tls_cert": str,
    "tls_key": str,
    "client_ca": str,
    "tokens_file": str,
    "metrics_port": int,
    "metrics_address": str,
    "linger_s": float,
}

#: Help for the ``server start`` flags (each is also a key of ``server.app.ServerConfig``).
SERVER_FLAG_HELP = {
    "address": "HOST:PORT to listen on ([::]:8443 for IPv6; default 0.0.0.0:8443); port 0 lets the OS pick one, "
    "and the 'listening on' line says which",
    "state_dir": "SQLite state, checkpoints, history.csv; restarting on it resumes the run",
    "task": "task factory module:attr: the initial model and server-side evaluation (e.g. simulations.tasks:demo_task)",
    "data_dir": "data directory handed to the server-side task (its held-out data)",
    "initial": "start from this safetensors model instead of the task's freshly initialized one",
    "rounds": "number of federated rounds",
    "seed": "run seed: client selection and every client's randomness derive from it",
    "evaluate_every": "evaluate the global model every this many rounds",
    "round_timeout_s": "round deadline: close with the results in hand if the quorum reported",
    "wait_for_clients_s": "how long to wait for enough clients before a round",
    "min_fit_results": "quorum: accepted updates a round needs",
    "max_round_attempts": "selections tried per round before the run fails",
    "heartbeat_interval_s": "how often clients send heartbeats",
    "liveness_timeout_s": "a client silent this long is dropped and its task failed",
    "max_payload_bytes": "largest update accepted from a client",
    "chunk_bytes": "payload chunk size on the wire",
    "max_workers": "gRPC server threads: about 1.1x the number of daemons + 40 (default 1200 holds 1,000 daemons)",
    "max_calls_per_client": "calls one client may have in progress at once (a daemon uses up to 3)",
    "max_unauthenticated_calls": "joins being read or checked at once; more are refused and retried",
    "stream_idle_s": "cut off a request, upload or download that makes no progress this long",
    "stream_total_s": "cut off an upload or download that takes longer than this",
    "tls_cert": "server certificate (PEM)",
    "tls_key": "server private key (PEM)",
    "client_ca": "CA that signs client certificates: turns on mutual TLS",
    "tokens_file": "file of 'client_id token' lines: only these clients may join",
    "metrics_port": "serve Prometheus metrics on this port (0: the OS picks one, printed at start)",
    "metrics_address": "interface for the metrics endpoint (default 127.0.0.1; 0.0.0.0 for remote scraping)",
    "linger_s": "keep serving this long after the last round so that clients learn the run is over",
}

#: ``server start`` shortcuts for nested keys.
SERVER_SHORTCUTS: dict[str, tuple[str, type]] = {
    "strategy": ("strategy.name", str),
    "server_lr": ("strategy.server_lr", float),
    "aggregator": ("strategy.aggregator", str),
    "fraction_fit": ("sampling.fraction_fit", float),
    "min_fit_clients": ("sampling.min_fit_clients", int),
    "fraction_evaluate": ("sampling.fraction_evaluate", float),
    "epochs": ("train.local_epochs", int),
    "batch_size": ("train.batch_size", int),
    "lr": ("train.lr", float),
    "mu": ("train.mu", float),
}


def _add_server(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("server", help="the coordinator server")
    actions = p.add_subparsers(dest="action", required=True)
    start = actions.add_parser(
        "start",
        help="start the aggregation server (TLS unless --insecure)",
        description=(
            "Run federated rounds for client daemons that connect over gRPC. Settings come from --config (TOML), "
            "then --set KEY=VALUE, then the flags below. Restarting with the same --state-dir resumes the run."
        ),
    )
    start.add_argument("--config", help="server TOML file (keys of server.app.ServerConfig)")
    start.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    for name, kind in SERVER_FLAGS.items():
        start.add_argument("--" + name.replace("_", "-"), type=kind, dest=name, help=SERVER_FLAG_HELP.get(name))
    for name, (key, kind) in SERVER_SHORTCUTS.items():
        start.add_argument("--" + name.replace("_", "-"), type=kind, dest=name, help=f"sets {key}")
    start.add_argument(
        "--task-option", action="append", default=[], metavar="KEY=VALUE", help="option for the task factory"
    )
    start.add_argument("--revoke", action="append", default=[], metavar="CLIENT_ID", help="refuse this client id")
    start.add_argument("--insecure", action="store_true", default=None, help="plaintext gRPC (prints a warning)")
    start.add_argument("--no-evaluate", action="store_true", help="no server-side evaluation")
    start.set_defaults(func=_cmd_server_start)


def _cmd_server_start(args: argparse.Namespace) -> int:
    from pathlib import Path

    from server.app import load_server_config, run_server

    overrides = list(args.overrides)
    for name in SERVER_FLAGS:
        value = getattr(args, name)
        if value is not None:
            overrides.append(f"{name}={_toml_literal(value)}")
    for name, (key, _) in SERVER_SHORTCUTS.items():
        value = getattr(args, name)
        if value is not None:
            overrides.append(f"{key}={_toml_literal(value)}")
    overrides += [f"task_options.{k}={_toml_literal(v)}" for k, v in _pairs(args.task_option, "--task-option")]
    if args.revoke:
        overrides.append("revoked=[" + ", ".join(_toml_literal(r) for r in args.revoke) + "]")
    if args.insecure:
        overrides.append("insecure=true")
    if args.no_evaluate:
        overrides.append("evaluate=false")
    config = load_server_config(Path(args.config) if args.config else None, overrides)
    run_server(config)
    return 0


def _pairs(items: Sequence[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FedcoreError(f"{flag} {item!r} must look like KEY=VALUE")
        out.append((key.strip(), value.strip()))
    return out


def _add_client(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("client", help="the client daemon")
    actions = p.add_subparsers(dest="action", required=True)
    start = actions.add_parser(
        "start",
        help="run the client daemon: connect, pull tasks, train, push updates",
        description=(
            "Connect to a fedcore server and train its rounds on this machine's data, through the task factory "
            "--task. For demos, the built-in demo task takes a shard of a built-in dataset: --dataset, "
            "--partition, --partition-id I --num-partitions N."
        ),
    )
    start.add_argument("--server", required=True, help="HOST:PORT of the coordinator ([::1]:8443 for IPv6)")
    start.add_argument("--client-id", required=True, help="this client's id (with mTLS: its certificate's name)")
    start.add_argument("--task", default="simulations.tasks:demo_task", help="task factory module:attr")
    start.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE")
    start.add_argument("--dataset", help="demo task: built-in dataset (sets the task option)")
    start.add_argument("--partition", help="demo task: partitioner (sets the task option)")
    start.add_argument("--partition-id", type=int, help="which shard of the built-in dataset this client holds")
    start.add_argument("--num-partitions", type=int, help="into how many shards the dataset is split")
    start.add_argument("--data-dir", help="data directory handed to the task")
    start.add_argument(
        "--token", default="", help="this client's token; write --token=VALUE if it begins with '-' (or FEDCORE_TOKEN)"
    )
    start.add_argument("--token-file", help="read the token from this file")
    start.add_argument("--insecure", action="store_true", help="plaintext gRPC (the server must be --insecure)")
    start.add_argument("--ca-cert", help="CA certificate (PEM) that signed the server certificate")
    start.add_argument("--cert", help="client certificate (PEM) for mutual TLS")
    start.add_argument("--key", help="client key (PEM) for mutual TLS")
    start.add_argument("--server-name", help="name expected in the server certificate (default: the host)")
    start.add_argument("--poll-s", type=float, default=20.0, help="long-poll duration")
    start.add_argument("--backoff-max-s", type=float, default=30.0, help="longest reconnect delay")
    start.add_argument("--give-up-after-s", type=float, help="exit when the server stays unreachable this long")
    start.add_argument("--stay", action="store_true", help="keep running after the server's run finishes")
    start.add_argument("--threads", type=int, help="torch threads for local training (default: one per core)")
    start.add_argument(
        "--parallel",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="train under a parallel plan, e.g. --parallel dp=2 pp=2 split_points=blocks.4 microbatches=8 "
        "schedule=1f1b (see the README's section on large models)",
    )
    start.add_argument("--parallel-config", help="TOML file whose [parallel] table is the plan")
    start.set_defaults(func=_cmd_client_start)


def _cmd_client_start(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from client.daemon import ClientDaemon, DaemonConfig

    options = dict(_pairs(args.task_option, "--task-option"))
    if args.dataset:
        options["dataset"] = args.dataset
    if args.partition:
        options["partition"] = args.partition
    token = args.token or os.environ.get("FEDCORE_TOKEN", "")
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    config = DaemonConfig(
        parallel=_parallel_plan(args.parallel_config, args.parallel),
        server=args.server,
        client_id=args.client_id,
        task=args.task,
        task_options=options,
        partition_id=args.partition_id,
        num_partitions=args.num_partitions,
        data_dir=Path(args.data_dir) if args.data_dir else None,
        token=token,
        insecure=args.insecure,
        ca_cert=Path(args.ca_cert) if args.ca_cert else None,
        cert=Path(args.cert) if args.cert else None,
        key=Path(args.key) if args.key else None,
        server_name=args.server_name,
        poll_s=args.poll_s,
        backoff_max_s=args.backoff_max_s,
        give_up_after_s=args.give_up_after_s,
        exit_when_finished=not args.stay,
        threads=args.threads,
    )
    if config.insecure:
        print("WARNING: connecting without TLS (--insecure): the model and updates travel in plaintext")
    return ClientDaemon(config).run()


def _parallel_plan(path: str | None, pairs: list[str]) -> ParallelPlan | None:
    """The client's parallel plan: ``--parallel-config``'s ``[parallel]`` table, overridden by ``--parallel``."""
    if path is None and not pairs:
        return None
    from fedcore.config import load_toml
    from fedcore.engine.plan import ParallelPlan

    table = load_toml(path).get("parallel", {}) if path is not None else {}
    if not isinstance(table, dict):
        raise ConfigError(f"[parallel] in {path!r} must be a table")
    merged: dict[str, object] = dict(table)
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--parallel expects key=value, got {item!r}")
        merged[key.strip()] = value.strip()
    return ParallelPlan.from_mapping(merged)


def _add_certs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("certs", help="TLS certificates and client tokens")
    actions = p.add_subparsers(dest="action", required=True)
    init = actions.add_parser(
        "init",
        help="make a CA, a server certificate, client certificates and tokens",
        description="Write ca.pem/key, server.pem/key, clients/<id>.pem/key and tokens.txt into --out.",
    )
    init.add_argument("--out", default="certs", help="output directory (an existing CA there is reused)")
    init.add_argument(
        "--host", action="append", default=[], help="server DNS name or IP (repeatable; default localhost, 127.0.0.1)"
    )
    init.add_argument("--client", action="append", default=[], metavar="CLIENT_ID", help="repeatable")
    init.add_argument("--clients", type=int, help="also make client-000 .. client-(N-1)")
    init.set_defaults(func=_cmd_certs_init)


def _cmd_certs_init(args: argparse.Namespace) -> int:
    from pathlib import Path

    from privacy.tls import init_certs

    clients = list(args.client)
    if args.clients:
        width = max(3, len(str(args.clients - 1)))
        clients += [f"client-{i:0{width}d}" for i in range(args.clients)]
    out = Path(args.out)
    for cid in clients:
        if (out / "clients" / f"{cid}.pem").exists():
            print(f"note: {cid} gets a new certificate and token; its old token stops working", file=sys.stderr)
    written = init_certs(out, hosts=args.host or ("localhost", "127.0.0.1"), clients=clients)
    for path in written:
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fedcore`` argument parser with every sub-command."""
    parser = argparse.ArgumentParser(prog="fedcore", description="Federated learning: simulate, serve, train.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_simulate(sub)
    _add_partition(sub)
    _add_server(sub)
    _add_client(sub)
    _add_certs(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedcore`` console script. Returns the process exit code.

    fedcore's own errors are printed as one clear line (exit code 2), not a traceback.
    """
    # OpenMP threads that spin while waiting (libgomp's default) slow torch several-fold when another process
    # shares the cores, which is the normal case on a data holder's machine or a CI runner; passive waiting
    # costs little when the machine is idle. Set before torch is imported (sub-commands import it lazily).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except FedcoreError as exc:
        print(f"fedcore: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave cannot be read or written
        print(f"fedcore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedcore: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
