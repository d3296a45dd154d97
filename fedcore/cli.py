"""The ``fedcore`` command line: ``simulate``, ``partition`` (and the deployment commands as they land).

Role packages are imported lazily inside the sub-command that needs them, so ``fedcore --help`` is fast and
the core never depends on them at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from fedcore.errors import ConfigError, FedcoreError
from fedcore.interrupts import first_interrupt_only
from fedcore.options import Option, add_options, derive_options, given_values, to_overrides

if TYPE_CHECKING:
    from pathlib import Path

    from simulations.config import DataConfig

#: simulate's flags whose name is not their key's last part (the others are derived: ``--server-lr`` sets
#: ``strategy.server_lr``); see :mod:`fedcore.options`.
SIMULATE_FLAGS = {
    "data.num_clients": "clients",
    "model.name": "model",
    "strategy.name": "strategy",
    "train.local_epochs": "epochs",
    "output.dir": "out",
    "output.progress": "no-progress",
    "task.factory": "task",
    "task.options": "task-option",
}
_RESERVED = ("recipe", "config", "set", "help")


def simulate_options() -> tuple[Option, ...]:
    """``fedcore simulate``'s flags, one per field of :class:`simulations.config.SimulationConfig`."""
    from simulations.config import SimulationConfig

    return derive_options(SimulationConfig, flags=SIMULATE_FLAGS, reserved=_RESERVED)


def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate",
        help="run a federated simulation with virtual clients on a built-in dataset",
        description=(
            "Run FedAvg-family rounds with in-process virtual clients over a dataset partitioned non-IID. "
            "Defaults: fashion-mnist, 100 clients, Dirichlet alpha=0.5, the FedAvg CNN, 10 clients per round. "
            "The common recipe keys have flags (below); --set reaches every key."
        ),
    )
    p.add_argument(
        "--recipe", help="TOML recipe (see simulations/recipes/) or a run's config.json; flags below override it"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any recipe value (wins over the flags below), e.g. --set train.lr=0.1",
    )
    add_options(p, simulate_options())
    p.set_defaults(func=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from simulations.config import DEMO_TASK, check_given_data_keys, check_given_effective, load_recipe
    from simulations.harness import run_simulation

    options = simulate_options()
    overrides = to_overrides(given_values(args, options))
    overrides += args.overrides  # explicit --set comes last, so it wins over the flags
    config = load_recipe(args.recipe, overrides)
    flags = _given_flags(args, options)
    check_given_data_keys(config.data, overrides, flags, own_task=config.task.factory != DEMO_TASK)
    check_given_effective(config, overrides, flags)
    result = run_simulation(config)
    return 3 if result.diverged else 0


def _given_flags(args: argparse.Namespace, options: Sequence[Option]) -> dict[str, str]:
    """Each key the user gave a flag for, with that flag (``data.alpha`` -> ``--alpha``): a message about a key names
    the flag when that is how it was given (not when it came by ``--set``)."""
    return {o.key: o.flag for o in options if getattr(args, o.dest, None) is not None}


def _add_partition(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "partition",
        help="partition a dataset over clients and show the label skew (no training)",
        description=(
            "Show per-client class counts, a label-skew summary, the spread of samples per client and a heatmap PNG "
            "for a partition."
        ),
    )
    p.add_argument("--recipe", help="TOML recipe (or a run's config.json) whose [data] table to use")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    add_options(p, _partition_options())
    p.add_argument("--out", default="runs/partition", help="where to write counts.csv and heatmap.png")
    p.set_defaults(func=_cmd_partition)


def _partition_options() -> tuple[Option, ...]:
    """simulate's ``[data]`` flags and ``--seed``: what a partition depends on."""
    return tuple(o for o in simulate_options() if o.key.startswith("data.") or o.key == "seed")


def _cmd_partition(args: argparse.Namespace) -> int:
    import tempfile

    from fedcore.config import expand_home
    from server.state import lock_directory
    from simulations.config import check_given_data_keys, load_data_recipe
    from simulations.harness import RUN_LOCK, enclosing_output

    options = _partition_options()
    overrides = to_overrides(given_values(args, options)) + args.overrides
    data, seed = load_data_recipe(args.recipe, overrides)
    check_given_data_keys(data, overrides, _given_flags(args, options))
    if not args.out.strip():
        raise ConfigError("--out is empty; give the directory to write counts.csv and heatmap.png into")
    out = expand_home(args.out, "--out")  # --out=~/p: no shell expands a '~' after '='
    written = (out / "counts.csv", out / "heatmap.png")
    try:  # before the partition, which can take minutes (100,000 synthetic devices)
        out.mkdir(parents=True, exist_ok=True)
        for path in written:
            if path.is_dir():
                raise ConfigError(
                    f"{str(path)!r} is a directory, where the partition report goes; move it, or give another --out"
                )
        tempfile.TemporaryFile(dir=out).close()  # the directory can be written
    except OSError as exc:
        raise ConfigError(
            f"cannot write the partition report into --out {str(out)!r}: {exc.strerror or exc}"
            f"{f' ({exc.filename})' if exc.filename else ''}; give a directory that can be written"
        ) from None
    for path in written:  # a link would write elsewhere; a FIFO would block; a dangling link fails after the work
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise ConfigError(
                f"{str(path)!r} is a symbolic link or a special file, where the partition report goes; move it, or "
                "give another --out"
            )
    if (inside := enclosing_output(out)) is not None:
        raise ConfigError(
            f"--out {str(out)!r} lies inside the simulation output directory {str(inside)!r}, whose checkpoints and "
            "client state would then hold files no simulation wrote; give --out outside it (or that directory itself)"
        )
    lock = None
    if (out / RUN_LOCK).is_file():  # a simulation's output directory: not while it runs
        lock = lock_directory(
            out,
            name=RUN_LOCK,
            what="--out",
            in_use="by another fedcore process{pid} (a simulation writing its results there, or a partition); wait "
            "for it to end, or give another --out",
        )
    try:
        _write_partition_report(out, data, seed)
    finally:
        if lock is not None:
            os.close(lock)
    return 0


def _write_partition_report(out: Path, data: DataConfig, seed: int) -> None:
    """Partition ``data`` and write counts.csv and heatmap.png into ``out`` (which can be written); print the
    table's head, the label-skew summary and the spread of client sizes."""
    from simulations.report import (
        format_size_summary,
        format_summary,
        label_counts,
        plot_heatmap,
        size_summary,
        skew_summary,
    )
    from simulations.tasks import prepare_data

    # the labels are all a report reads: normalizing the inputs would only cost time, and refuse constant ones
    prepared = prepare_data(dataclasses.replace(data, normalize=False), seed)
    counts = label_counts(prepared.client_labels(), prepared.num_classes)
    names = getattr(prepared, "roles", None)  # a natural split's own client names (shakespeare's roles)
    table = counts if names is None else counts.assign(role=list(names))
    table.to_csv(out / "counts.csv", index_label="client")
    heatmap = plot_heatmap(
        counts,
        out / "heatmap.png",
        title=f"{data.dataset}: {data.partition} over {data.num_clients} clients",
    )
    # A table of many classes (shakespeare's 76 next characters) is unreadable on a console: its sizes only.
    shown = table if prepared.num_classes <= 20 else table[[c for c in ("role", "total") if c in table]]
    print(shown.head(10).to_string())
    if len(counts) > 10:
        print(f"... ({len(counts)} clients)")
    print(format_summary(skew_summary(counts)))
    print(format_size_summary(size_summary(counts["total"])))
    print(f"per-client class counts: {out / 'counts.csv'}; heatmap: {heatmap}")


# ---------------------------------------------------------------------------------------------------------------
# deployment: fedcore server start, fedcore client start, fedcore certs init

#: ``server start`` flags whose name is not their key's last part; every other field of
#: :class:`server.config.ServerConfig` (nested tables included) is a flag of its own name (:mod:`fedcore.options`).
SERVER_FLAGS = {
    "strategy.name": "strategy",
    "train.local_epochs": "epochs",
    "tls.cert": "tls-cert",
    "tls.key": "tls-key",
    "auth.revoked": "revoke",
    "task_options": "task-option",
}


def server_options() -> tuple[Option, ...]:
    """``fedcore server start``'s flags, one per field of :class:`server.config.ServerConfig`."""
    from server.config import ServerConfig

    return derive_options(ServerConfig, flags=SERVER_FLAGS, reserved=_RESERVED)


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
    start.add_argument("--config", help="server TOML file (keys and tables of server.config.ServerConfig)")
    start.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="e.g. --set round.rounds=5"
    )
    add_options(start, server_options())
    start.set_defaults(func=_cmd_server_start)


def _cmd_server_start(args: argparse.Namespace) -> int:
    from fedcore.config import apply_overrides, without_effect
    from server.app import run_server
    from server.config import load_server_config

    flags = given_values(args, server_options())  # the flags win over --set, which wins over the file
    config = load_server_config(args.config, list(args.overrides), flags)
    given = apply_overrides({}, list(args.overrides))  # round.min_delta=X, or min_delta=X of the flat layout
    given_delta = "min_delta" in given or "min_delta" in given.get("round", {})
    if config.round.patience is None and ("min_delta" in flags.get("round", {}) or given_delta):
        raise without_effect("round.min_delta", "a plateau rule (--patience N)", "--min-delta")  # a file's: not
    run_server(config)
    return 0


#: ``client start`` flags whose name is not their key's last part; every other field of
#: :class:`client.daemon.DaemonConfig` is a flag of its own name (:mod:`fedcore.options`).
CLIENT_FLAGS = {"exit_when_finished": "stay", "task_options": "task-option", "attributes": "attribute"}


def client_options() -> tuple[Option, ...]:
    """``fedcore client start``'s flags, one per field of :class:`client.daemon.DaemonConfig` (the parallel
    plan has its own: ``--parallel``, ``--parallel-config``)."""
    from client.daemon import DaemonConfig

    return derive_options(DaemonConfig, flags=CLIENT_FLAGS, skip=("parallel",), reserved=_RESERVED)


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
    start.add_argument("--config", help="daemon TOML file (keys of client.daemon.DaemonConfig, [parallel]); flags win")
    start.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    add_options(start, client_options())
    start.add_argument("--dataset", help="demo task: built-in dataset (sets the task option)")
    start.add_argument("--partition", help="demo task: partitioner (sets the task option)")
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
    from client.daemon import ClientDaemon, load_daemon_config

    flags = given_values(args, client_options())
    shortcuts = {k: v for k, v in (("dataset", args.dataset), ("partition", args.partition)) if v}
    if shortcuts:  # the demo task's options, by their own flags
        flags["task_options"] = {**flags.get("task_options", {}), **shortcuts}
    # the plan: --parallel over --set parallel.* over --parallel-config's [parallel] table, else --config's
    config = load_daemon_config(
        args.config, args.overrides, flags, parallel_items=args.parallel, parallel_file=args.parallel_config
    )
    if not args.verbose:  # on success the daemon says it joined, each round it trained and the run's end (INFO)
        logging.getLogger("fedcore.client").setLevel(logging.INFO)
    if config.insecure:
        print("WARNING: connecting without TLS (--insecure): the model and updates travel in plaintext")
    return ClientDaemon(config).run()


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
        "--host",
        action="append",
        default=[],
        help="server DNS name or IP (repeatable; default localhost, 127.0.0.1, or the existing server certificate's "
        "names when --out holds one)",
    )
    init.add_argument("--client", action="append", default=[], metavar="CLIENT_ID", help="repeatable")
    init.add_argument("--clients", type=int, help="also make client-000 .. client-(N-1)")
    init.set_defaults(func=_cmd_certs_init)


def _cmd_certs_init(args: argparse.Namespace) -> int:

    from fedcore.config import expand_home
    from privacy.tls import init_certs

    clients = list(args.client)
    if args.clients:
        width = max(3, len(str(args.clients - 1)))
        clients += [f"client-{i:0{width}d}" for i in range(args.clients)]
    out = expand_home(args.out, "--out")  # --out=~/certs: not a directory named '~' here
    for cid in clients:
        if (out / "clients" / f"{cid}.pem").exists():
            print(f"note: {cid} gets a new certificate and token; its old token stops working", file=sys.stderr)
    written = init_certs(out, hosts=args.host or None, clients=clients)  # no --host: an existing server identity stays
    for path in written:
        print(path)
    return 0


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are the message and where the help is: ``fedcore simulate`` has about a
    hundred flags, and argparse's usage block before a one-line error (84 lines of it) hid the error itself."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(all options: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``fedcore`` argument parser with every sub-command (their parsers of its class)."""
    parser: argparse.ArgumentParser = _Parser(prog="fedcore", description="Federated learning: simulate, serve, train.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_simulate(sub)
    _add_partition(sub)
    _add_server(sub)
    _add_client(sub)
    _add_certs(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fedcore`` command line on ``argv`` (``sys.argv[1:]`` when None); returns the process exit code.

    The console script calls it through :func:`console_main`, which also handles Ctrl-C before and after it.

    fedcore's own errors are printed as one clear line (exit code 2), not a traceback. Ctrl-C prints
    ``fedcore: interrupted`` (exit code 130); in ``simulate``, more Ctrl-C after the first are ignored while the
    run cleans up and the process exits (:func:`fedcore.interrupts.first_interrupt_only`).
    """
    # OpenMP threads that spin while waiting (libgomp's default) slow torch several-fold when another process
    # shares the cores, which is the normal case on a data holder's machine or a CI runner; passive waiting
    # costs little when the machine is idle. Set before torch is imported (sub-commands import it lazily).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # gRPC's C core (grpcio 1.85) logs every failed TLS handshake on stderr at INFO, e.g. "I1202 ...
    # ssl_transport_security.cc:2563] Handshake failed ... PEER_DID_NOT_RETURN_A_CERTIFICATE" for each attempt of
    # a client without a certificate; its errors still show at ERROR. It reads GRPC_VERBOSITY when grpc is first
    # imported, which building the parser does (server and client options), so set it first; the user's wins.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # -v is for fedcore's own DEBUG lines: numba's compiler logs every bytecode pass at DEBUG (about 1.4 MB for
    # the first SecAgg+ round of a server), which buries them.
    logging.getLogger("numba").setLevel(logging.WARNING)
    # A simulation's first Ctrl-C stops it; more of them (an impatient user presses it two or three times) are
    # ignored, until the process exits: they cut its cleanup short (the process pool's shared-memory directory and
    # Ray's processes were left behind) or interrupted Ray's own atexit shutdown (a traceback, or exit status 1).
    once = first_interrupt_only() if args.command == "simulate" else contextlib.nullcontext()
    with once:
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


def console_main() -> int:
    """The ``fedcore`` console script (and ``python -m fedcore.cli``): :func:`main`, with Ctrl-C handled from the
    process's start to its exit. A Ctrl-C before :func:`main` handles it (while the parser is built, which imports
    torch and grpc) prints ``fedcore: interrupted`` (exit code 130) rather than a traceback; once :func:`main` has
    returned, SIGINT is ignored, because the process only exits then: a Ctrl-C during the interpreter's exit
    (torch's and Ray's ``atexit`` hooks) turned a finished run into a ``KeyboardInterrupt`` traceback and a
    killed-by-SIGINT exit status. Returns the process exit code."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("fedcore: interrupted", file=sys.stderr)
        code = 130
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(console_main())
