"""The ``fedcore`` command line: ``simulate``, ``partition`` (and the deployment commands as they land).

Role packages are imported lazily inside the sub-command that needs them, so ``fedcore --help`` is fast and
the core never depends on them at import time.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from fedcore.errors import FedcoreError

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
    "clients_per_round": "sampling.min_fit_clients",
    "epochs": "train.local_epochs",
    "batch_size": "train.batch_size",
    "lr": "train.lr",
    "mu": "train.mu",
    "out": "output.dir",
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
        help="override any recipe value, e.g. --set train.lr=0.1 --set strategy.name=fedadam",
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
    p.add_argument("--clients-per-round", type=int, help="minimum clients selected per round")
    p.add_argument("--epochs", type=int, help="local epochs per round")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float, help="client learning rate")
    p.add_argument("--mu", type=float, help="FedProx proximal coefficient")
    p.add_argument("--out", help="output directory (default runs/latest)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or per-round table")
    p.set_defaults(func=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from simulations.config import load_recipe
    from simulations.harness import run_simulation

    overrides = list(args.overrides)
    for flag, key in SIMULATE_SHORTCUTS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={_toml_literal(value)}")
    if args.no_progress:
        overrides.append("output.progress=false")
    config = load_recipe(args.recipe, overrides)
    run_simulation(config)
    return 0


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

    overrides = list(args.overrides)
    for flag in ("seed", "dataset", "data_dir", "clients", "partition", "alpha"):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{SIMULATE_SHORTCUTS[flag]}={_toml_literal(value)}")
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


def build_parser() -> argparse.ArgumentParser:
    """The ``fedcore`` argument parser with every sub-command."""
    parser = argparse.ArgumentParser(prog="fedcore", description="Federated learning: simulate, serve, train.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_simulate(sub)
    _add_partition(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedcore`` console script. Returns the process exit code.

    fedcore's own errors are printed as one clear line (exit code 2), not a traceback.
    """
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
    except KeyboardInterrupt:
        print("fedcore: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
