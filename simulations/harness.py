"""The simulation harness: the server's round loop over in-process virtual clients, with a report.

:func:`run_simulation` partitions a built-in dataset, makes one virtual client per partition (the demo task
factory, the same one a client daemon would be given), runs :func:`server.round_loop.run_rounds` through the
in-memory pool, and reports: a progress bar, a per-round table on the console, a history CSV written after
every round (a crash never loses a finished round) by the same writer as the server's, a PNG plot, the final
model as safetensors (with its own digest, see :func:`fedcore.payload.check_digest`), and the resolved recipe as
JSON. For the same recipe and seed every file but the plot is byte for byte the same, except history.csv's
``seconds`` column (wall time).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from client.state import ClientStateStore
from fedcore.config import check_creatable_dir, to_mapping
from fedcore.convergence import Convergence, Stop
from fedcore.errors import ConfigError, FedcoreError, StateError
from fedcore.interrupts import deferred_interrupts
from fedcore.payload import save_payload
from fedcore.seeding import numpy_rng
from fedcore.strategy import build_strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import (
    Task,
    TaskContext,
    TaskFactory,
    build_server_task,
    central_evaluation,
    declared_metrics,
    initial_parameters,
    load_task_factory,
    state_elements,
    trainable_names,
)
from fedcore.training import STEP_IN_BACKWARD_MIN_ELEMENTS
from privacy.dp.config import apply_dp, weak_delta
from server.pool import ClientPool
from server.round_loop import (
    EvaluateFn,
    RoundConfig,
    RoundRecord,
    ServerState,
    initial_state,
    preflight,
    return_large_blocks_to_the_os,
    run_rounds,
)
from server.state import (
    MAPPED_STATE_PREFIX,
    STORE_ENTRIES,
    HistoryFile,
    StateAdvice,
    StateStore,
    checkpoint_files,
    continue_from,
    history_columns,
    lock_directory,
    map_round_state,
    release_hook,
    restore_strategy,
    resumed_for_model,
)
from simulations.attacks import (
    LABEL_ATTACKS,
    REWRITE_ATTACKS,
    AttackedPool,
    attacked_tasks,
    choose_attackers,
    num_classes,
)
from simulations.config import DEMO_TASK, SimulationConfig, training_device, worker_device
from simulations.devices import SimulatedDevices, online_counts, simulation_selector, slow_clients
from simulations.inmemory import InMemoryPool
from simulations.procpool import ClientTasks, ProcessPool

if TYPE_CHECKING:
    from simulations.raypool import RayPool
from simulations.tasks import demo_task

log = logging.getLogger("fedcore.simulation")

FLOAT32_ORDER_NOTICE = (
    "strategy.sum_dtype = 'float32' with backend %s: updates are summed in the order they arrive, so the history "
    "is not bit-identical to the in-process backend's (within float32 rounding of it)"
)
"""The notice of a float32 running sum on a backend that folds in arrival order (``%s``: the backend)."""

COLUMNS = ("round", "clients", "train_loss", "test_loss", "test_accuracy", "seconds")
OUTPUT_FILES = ("config.json", "history.csv", "history.png", "model.safetensors")
CLIENT_STATE_DIR = "client-state"
"""The virtual clients' persistent state under output.dir (one file per client that keeps state, e.g. SCAFFOLD's
control variate); emptied when a simulation starts, kept when it resumes."""
RUN_STATE_DIR = "state"
"""The run's checkpoints and round records under output.dir (``[output] checkpoints``): a
:class:`server.state.StateStore`, as a deployment server keeps them; emptied when a simulation starts, gone on from
when it resumes (``[output] resume``)."""
RUN_LOCK = ".run.lock"
"""The lock file under output.dir that a simulation holds from before it reads or removes anything there until it
ends (with checkpoints or without), so that two simulations never write one output.dir."""
SIMULATION_IN_USE = (
    "by another simulation{pid} (or a partition writing its report there); wait for it to end, or give another --out"
)
"""The refusal of an output.dir (or its checkpoints) that another simulation holds (``{pid}``: " (pid N)")."""
SIMULATION_ADVICE = StateAdvice(
    who="this simulation",
    new_run="run without --resume to start a new run (or give another --out)",
    resume="run the same command with --resume to go on",
    in_use=SIMULATION_IN_USE,
)
"""What the refusals of a simulation's checkpoints (:data:`RUN_STATE_DIR`) tell its user to do."""
RESUMABLE_CHANGES = ("rounds", "output", "simulation")
"""The recipe's keys (top-level) a resumed run may change: how many rounds, where and how results are written, how
the clients are run. Any other change would make the resumed rounds those of another run."""
MAX_TASKS = 1024
"""The most virtual clients' tasks (data shards) kept built at once, in this process or in each worker; a client
used less recently is built again when it is sampled, so memory does not grow with the number of clients."""


@dataclass(frozen=True)
class SimulationResult:
    """What a simulation produced.

    Attributes:
        history: one row per round (round 0 = the initial model): clients, failures, train/test loss, test
            accuracy, seconds.
        final: the final server state (round, global model, optimizer state).
        wall_seconds: wall time of the whole run, data loading included.
        csv_path, plot_path, model_path: where the history, the plot and the final model were written.
        diverged: the global model's test loss became NaN or infinite (the learning rate is too high).
        reached: ``(round, seconds)`` at which the test accuracy first reached the recipe's ``target_accuracy``
            (seconds: the run's wall time up to that round, the sum of the history's ``seconds``); None when not
            reached or no target was set.
        stop: the stop rule that ended the run early (:class:`fedcore.convergence.Stop`), else None.
    """

    history: pd.DataFrame
    final: ServerState
    wall_seconds: float
    csv_path: Path
    plot_path: Path | None
    model_path: Path
    diverged: bool = False
    reached: tuple[int, float] | None = None
    stop: Stop | None = None


def task_options(config: SimulationConfig) -> dict[str, str]:
    """The demo task options (strings, as a client daemon would get them) that describe ``config``'s data."""
    options = {k: str(v) for k, v in to_mapping(config.data).items()}
    options["model"] = config.model.name
    return options


def recipe_record(config: SimulationConfig) -> dict[str, Any]:
    """The recipe as written to config.json: every resolved value, loadable again with :func:`load_recipe`.

    With a custom task (``task.factory`` other than the demo task) the built-in dataset, partition and model do
    not take part in the run, so they are left out: ``[data]`` keeps only ``num_clients`` and ``data_dir`` (which
    the task receives), ``[model]`` is dropped, and ``[task]`` records the factory and its options.
    """
    record = to_mapping(config)
    if config.task.factory != DEMO_TASK:
        record.pop("model", None)
        data = record["data"]  # (to_mapping leaves out unset values, which TOML cannot hold)
        record["data"] = {key: data[key] for key in ("num_clients", "data_dir") if key in data}
    return record


def partition_sizes(config: SimulationConfig, ids: list[str]) -> dict[str, int]:
    """Each virtual client's training examples, from the demo task's partition (stratified selection by size).

    Raises:
        ConfigError: a custom task (its clients' sizes are not known before they train).
    """
    if config.task.factory != DEMO_TASK:
        raise ConfigError(
            "stratified selection by 'size' needs the demo task's partition (a custom task's clients' sizes are not "
            "known before they train, and virtual clients have no other attribute); use another selection"
        )
    from simulations.tasks import prepare_data

    sizes = prepare_data(config.data, config.seed).client_sizes()
    return {cid: int(size) for cid, size in zip(ids, sizes, strict=True)}


def client_ids(num_clients: int) -> list[str]:
    """Virtual client ids ``client-000``, ``client-001``, ... (zero-padded so they sort like their index)."""
    width = max(3, len(str(num_clients - 1)))
    return [f"client-{i:0{width}d}" for i in range(num_clients)]


_HEADINGS = {"train_sgd_epsilon": "sgd_eps"}
"""The console table's heading of a column whose name is wider than the table's 10 characters."""


def _format_row(row: Mapping[str, object], columns: tuple[str, ...] = COLUMNS) -> str:
    def fmt(key: str, value: object) -> str:
        if value is None or (isinstance(value, float) and value != value):
            return f"{'-':>10}"
        if key in ("round", "clients"):
            return f"{int(value):>10d}"  # type: ignore[call-overload]
        text = f"{float(value):.4f}"  # type: ignore[arg-type]
        if len(text) > 10:  # a diverging loss (2.79e30 is 36 digits): in the column's 10 characters
            text = f"{float(value):.3e}"  # type: ignore[arg-type]
        return f"{text:>10}"

    return " ".join(fmt(k, row.get(k)) for k in columns)


def clients_at_once(config: SimulationConfig) -> int:
    """The most virtual clients a round of ``config`` instructs at once: those it selects for training or for
    federated evaluation out of ``data.num_clients`` (:meth:`fedcore.strategy.SamplingConfig.num_fit`), whichever
    is more, never more than there are clients. A worker beyond this number would never get a client."""
    n, sampling = config.data.num_clients, config.sampling
    return max(1, min(n, max(sampling.num_fit(n), sampling.num_evaluate(n))))


def worker_count(config: SimulationConfig) -> int | None:
    """The process or ray backend's worker count: ``simulation.workers`` (process: by default one per core this
    process may use) capped at :func:`clients_at_once`, with a warning when a count the recipe gave is capped.
    None for ray without a count (the pool fits its actors to the cluster, capped likewise).
    """
    from simulations.procpool import default_workers

    sim, most = config.simulation, clients_at_once(config)
    if sim.workers is None:
        return None if sim.backend == "ray" else min(default_workers(), most)
    if sim.workers > most:
        log.warning(
            "workers = %d capped at %d: a round instructs at most %d of the %d clients at once, so more %s would "
            "never get one", sim.workers, most, most, config.data.num_clients,
            "actors" if sim.backend == "ray" else "worker processes",
        )  # fmt: skip
        return most
    return sim.workers


def enclosing_output(path: Path) -> Path | None:
    """The simulation output directory (one holding :data:`RUN_LOCK`) under whose checkpoints, client state or
    result files (:data:`RUN_STATE_DIR`, :data:`CLIENT_STATE_DIR`, :data:`OUTPUT_FILES`) ``path`` lies, or None.
    Writing there would put files no simulation wrote into that run's checkpoints or client state (which its
    ``--resume`` then refuses), and its next run would remove them. Any other folder of a run's directory is the
    user's (``runs/`` as one run's output and ``runs/ablation/`` as another's): neither run touches the other's.

    Raises:
        ConfigError: ``path`` cannot be resolved (a loop of symbolic links).
    """
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: Python 3.11's Path.resolve on a symbolic-link loop
        raise ConfigError(
            f"the directory {str(path)!r} cannot be resolved ({exc}); give a path without a loop of symbolic links"
        ) from None
    replaced = {RUN_STATE_DIR, CLIENT_STATE_DIR, *OUTPUT_FILES}
    return next(
        (
            parent
            for parent in resolved.parents
            if (parent / RUN_LOCK).exists() and resolved.relative_to(parent).parts[0] in replaced
        ),
        None,
    )


def lock_output(out_dir: Path) -> int:
    """Make ``out_dir`` if it is missing and hold the simulation's lock on it (:data:`RUN_LOCK`; released when the
    returned descriptor is closed, or the process ends).

    Raises:
        ConfigError: the directory cannot be made, or the lock file cannot be opened (e.g. a directory of that name
            is in the way).
        StateError: another simulation holds it (it is running).
    """
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create output.dir {str(out_dir)!r}: {exc.strerror or exc}") from None
    return lock_directory(out_dir, name=RUN_LOCK, what="output.dir", in_use=SIMULATION_IN_USE)


def prepare_output(out_dir: Path, config: SimulationConfig, *, resumed: bool = False) -> None:
    """Remove an earlier run's results, client state, checkpoints and mapped round state (a killed run's file,
    :func:`server.state.map_round_state`) from the run's output directory, and write the recipe (config.json).
    Called once the run's setup has succeeded, so that a recipe refused in its setup leaves no directory behind; the
    caller holds the directory's lock (:func:`lock_output`), so nothing is removed under a running simulation.

    Args:
        resumed: the run goes on from the checkpoints in the directory: its client state and checkpoints stay (its
            history.csv is written again from the checkpoints' records).

    Raises:
        ConfigError: the directory or config.json cannot be written, a file named :data:`RUN_STATE_DIR` is where
            the run's checkpoints go, or the directory holds what no simulation wrote under the names a run replaces
            (:func:`foreign_outputs`): nothing is removed then.
    """
    checkpoints = out_dir / RUN_STATE_DIR
    if config.output.checkpoints and (checkpoints.exists() or checkpoints.is_symlink()) and not checkpoints.is_dir():
        what = "a symbolic link to nothing" if checkpoints.is_symlink() and not checkpoints.exists() else "a file"
        raise ConfigError(
            f"{str(checkpoints)!r} is {what}, where this simulation keeps its checkpoints; move it, or give another "
            "--out (or run with --no-checkpoints)"
        )
    if foreign := foreign_outputs(out_dir):
        raise ConfigError(
            f"output.dir {str(out_dir)!r} holds {', '.join(repr(name) for name in foreign[:5])}"
            f"{f' and {len(foreign) - 5} more' if len(foreign) > 5 else ''}, which no fedcore simulation wrote there "
            + (
                f"(a simulation's {RUN_STATE_DIR}/ holds only its checkpoint store), and a run replaces that folder; "
                "move them out of it"
                if all(name.startswith(f"{RUN_STATE_DIR}/") for name in foreign)
                else "(no simulation's config.json beside them), and a run replaces what it finds under those names; "
                "give another --out (a new or empty directory), or move them"
            )
        )
    written = out_dir / ".config.json.tmp"  # replaced in one step: a kill never leaves the directory without one
    kept = " (an earlier run's results there are left as they were)"
    removing: Path | None = None  # the earlier run's tree being removed: a failure there names its file in it
    try:
        written.write_text(json.dumps(recipe_record(config), indent=2) + "\n")  # first: the directory is writable
        if not resumed:  # no earlier run's checkpoints and client state, removed before its results: a tree that
            for removing in (checkpoints, out_dir / CLIENT_STATE_DIR):  # cannot be removed leaves those in place
                _remove_tree(removing)
        removing, kept = None, ""
        for name in OUTPUT_FILES[1:]:  # never leave an earlier run's results beside this run's config
            (out_dir / name).unlink(missing_ok=True)
        for pattern in (f"{MAPPED_STATE_PREFIX}*", f".{MAPPED_STATE_PREFIX}*"):  # nor a killed run's mapped state
            for stale in out_dir.glob(pattern):
                if not stale.is_dir():  # a directory of that name is the user's
                    stale.unlink(missing_ok=True)
        written.replace(out_dir / "config.json")
    except OSError as exc:
        written.unlink(missing_ok=True)
        name = exc.filename
        if removing is not None and name and not Path(name).is_absolute():  # rmtree names files relative to a dir
            name = str(removing / name)
        where = f" ({name})" if name else ""
        raise ConfigError(
            f"cannot write results to output.dir {str(out_dir)!r}{where}: {exc.strerror or exc}{kept}; fix that "
            "(permissions, disk space, or what stands where the file goes), or give another --out"
        ) from None


def _remove_tree(path: Path) -> None:
    """Remove the directory ``path`` with what it holds (a symbolic link there: the link alone); nothing when it
    is missing or is another kind of file.

    Raises:
        OSError: something in it cannot be removed (the first such error; what was removed before it is gone).
    """
    if path.is_symlink():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


_RECIPE_KEYS = frozenset({"seed", "rounds", "data", "strategy", "output"})
"""Top-level keys every config.json of a simulation has (:func:`recipe_record`)."""


def foreign_outputs(out_dir: Path) -> list[str]:
    """What in ``out_dir`` a run would remove or replace (:data:`OUTPUT_FILES`, :data:`RUN_STATE_DIR`,
    :data:`CLIENT_STATE_DIR`) without a simulation having written it: everything of those names when ``out_dir`` has no
    simulation's config.json (none, or one that is not a recipe :func:`recipe_record` wrote), else what
    :data:`RUN_STATE_DIR` holds beyond a state store's entries. Paths relative to ``out_dir``, sorted; [] for a new,
    empty or fedcore-written directory."""
    present = [
        name
        for name in (*OUTPUT_FILES, RUN_STATE_DIR, CLIENT_STATE_DIR)
        if (out_dir / name).exists() or (out_dir / name).is_symlink()
    ]
    try:
        recorded = json.loads((out_dir / "config.json").read_text())
    except (OSError, ValueError):  # missing, unreadable or not JSON: not a simulation's
        recorded = None
    if not (isinstance(recorded, dict) and recorded.keys() >= _RECIPE_KEYS):
        return sorted(present)
    state = out_dir / RUN_STATE_DIR
    if not state.is_dir():
        return []
    return sorted(  # a dot-entry is a store's own temporary file (a killed rewrite's .history.csv.tmp-<pid>)
        f"{RUN_STATE_DIR}/{entry.name}"
        for entry in state.iterdir()
        if entry.name not in STORE_ENTRIES and not entry.name.startswith(".")
    )


def check_resumable(out_dir: Path, config: SimulationConfig) -> None:
    """Refuse to resume the run in ``out_dir`` with a recipe that differs from its recorded one (config.json) in
    anything but :data:`RESUMABLE_CHANGES` and the availability trace file's path (its contents are compared by
    :meth:`server.state.StateStore.check_trace`). A run with no checkpoint (no round finished) has nothing to resume and
    is not checked: it starts anew.

    Raises:
        ConfigError: config.json is missing or unreadable, or the recipe differs (each differing key with both
            values, and what to do).
    """
    if not checkpoint_files(out_dir / RUN_STATE_DIR):
        return  # no round finished: nothing to resume, and the run starts anew (whatever its recipe)
    path = out_dir / "config.json"
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot resume the run in {str(out_dir)!r}: its recipe {str(path)!r} cannot be read ({exc}); run "
            "without --resume to start afresh there, or give another --out"
        ) from None
    if not isinstance(recorded, dict):
        raise ConfigError(f"cannot resume the run in {str(out_dir)!r}: {str(path)!r} is not a recipe")
    now = json.loads(json.dumps(recipe_record(config)))  # as config.json holds it (lists, not tuples)
    for key in RESUMABLE_CHANGES:
        recorded.pop(key, None)
        now.pop(key, None)
    for record in (recorded, now):  # the trace file's path may change; its contents are checked (check_trace)
        if isinstance(record.get("devices"), dict):
            record["devices"].pop("availability_file", None)
    differ = _differences(recorded, now)
    if differ:
        raise ConfigError(
            f"cannot resume the run in {str(out_dir)!r} with another recipe ({'; '.join(differ[:6])}"
            f"{'; ...' if len(differ) > 6 else ''}): its rounds would not be the ones it ran. Resume with the "
            f"recorded recipe (--recipe {shlex.quote(str(path))} --resume; only rounds, [output] and [simulation] may "
            "change), or run without --resume, or give another --out"
        )


_RESUME_HINT = "run the same command with --resume (output.resume = true) to go on after the last round that finished"
"""How a run with checkpoints goes on after a failed round or a stop."""


def _open_store(out_dir: Path, config: SimulationConfig) -> StateStore:
    """The run's checkpoints and records (:data:`RUN_STATE_DIR`), with its strategy and seed recorded (or checked
    against the recorded ones when it resumes).

    Raises:
        ConfigError: the directory cannot be used, or holds a run of another strategy or seed.
        StateError: another process uses it (a second simulation into the same output.dir), or it is damaged.
    """
    store = StateStore(out_dir / RUN_STATE_DIR, advice=SIMULATION_ADVICE)
    try:
        store.check_strategy(config.strategy)
        store.check_seed(config.seed)
        store.check_trace(trace_digest(config))
    except BaseException:
        store.close()
        raise
    return store


def check_online_counts(config: SimulationConfig, ids: Sequence[str], needed: int) -> np.ndarray | None:
    """Refuse, before anything is written, a run whose availability trace has fewer than ``needed``
    (min_fit_clients) clients online in one of its rounds: the trace is fixed by the recipe and seed, so that round
    would fail at every attempt and every ``--resume`` (:func:`simulations.devices.online_counts`).

    Returns:
        Each round's online count (None where it is not counted ahead).

    Raises:
        ConfigError: the first such round, how many are online then, and what to change.
    """
    counts = online_counts(config.devices, ids, seed=config.seed, rounds=config.rounds)
    if counts is None:
        return None
    short = np.flatnonzero(counts < needed)
    if short.size:
        first = int(short[0]) + 1
        raise ConfigError(
            f"the availability trace has {int(counts[first - 1])} of the {len(ids)} clients online in round {first}"
            + (f" ({short.size} of the {config.rounds} rounds are short)" if short.size > 1 else "")
            + f", and a round needs min_fit_clients = {needed}; raise the trace's online share (online_fraction, or "
            "the file's intervals), lower --min-fit-clients, or run fewer --rounds"
        )
    return counts


def trace_digest(config: SimulationConfig) -> str | None:
    """The SHA-256 (hex) of the recipe's availability trace file, None without one (``availability`` not ``csv``).

    Raises:
        ConfigError: the file cannot be read (it was readable when the recipe was checked).
    """
    path = config.devices.availability_file
    if config.devices.availability != "csv" or path is None:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigError(f"devices.availability_file {str(path)!r} cannot be read: {exc.strerror or exc}") from None


_MISSING = object()


def _differences(recorded: object, now: object, key: str = "") -> list[str]:
    """The dotted keys at which two recipes (as config.json holds them) differ, sorted, each with both values."""
    if isinstance(recorded, Mapping) and isinstance(now, Mapping):
        return [
            difference
            for name in sorted(set(recorded) | set(now))
            for difference in _differences(recorded.get(name, _MISSING), now.get(name, _MISSING), f"{key}{name}.")
        ]
    if recorded == now:
        return []
    shown = ["unset" if value is _MISSING else json.dumps(value) for value in (recorded, now)]
    return [f"{key[:-1]}: {shown[0]} recorded, {shown[1]} now"]


def _freeze_first_round() -> None:
    """Collect, then freeze what is alive out of the collector, once at the end of a run's first round.

    The run's lasting objects that the first round builds (the sampled clients' tasks and their data views, kernels
    compiled on first use, modules imported then) would otherwise be walked by every round's full collection
    (:func:`server.round_loop.release_memory`): about 15 ms a round at 1,000 clients a round, a tenth of a batched
    round of issue 12's workload, against under 1.5 ms once frozen. Frozen objects are still freed when their last
    reference goes; only one that a reference cycle keeps stays until the run ends (:func:`run_simulation` unfreezes
    then), hence the collection first: nothing the first round left for the collector is frozen.
    """
    gc.collect()
    gc.freeze()


def run_simulation(config: SimulationConfig, *, echo: Callable[[str], None] = print) -> SimulationResult:
    """Run the simulation ``config`` describes and write its report, on ``[simulation] threads`` torch threads
    when set (the caller's thread count is restored after).

    Args:
        config: the recipe.
        echo: where console lines go (the per-round table and the final summary).

    Returns:
        The history, final state and output paths.

    Raises:
        ConfigError, DatasetNotFoundError, PartitionError: before the first round (ConfigError also for an
            output.dir that is a server's state directory, and for a resume with a changed recipe or with fewer
            rounds than it finished).
        StateError: another simulation is writing to output.dir (it holds :data:`RUN_LOCK`), or its checkpoints
            cannot be resumed (the message says why and what to do).
        RoundFailed: a round could not reach its quorum (or its server step failed); the last finished round's
            global model is written to ``model.safetensors`` first, beside the history of the rounds that finished.
    """
    threads = config.simulation.threads
    if threads is None:
        return _run_simulation(config, echo)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run_simulation(config, echo)
    finally:
        torch.set_num_threads(before)


def _run_simulation(config: SimulationConfig, echo: Callable[[str], None]) -> SimulationResult:
    started = time.perf_counter()
    out_dir = Path(config.output.dir)
    if (out_dir / "state.db").exists():  # its history.csv would be replaced by this simulation's
        raise ConfigError(
            f"output.dir {str(out_dir)!r} is a server's state directory (it holds state.db); give the simulation "
            "its own output.dir"
        )
    if (inside := enclosing_output(out_dir)) is not None:
        raise ConfigError(
            f"output.dir {str(out_dir)!r} lies inside the simulation output directory {str(inside)!r}, under the "
            "checkpoints, client state or results that run keeps and replaces; give --out outside those (another "
            "folder of that directory is fine), or, to run again there, that directory itself"
        )
    for name in (RUN_STATE_DIR, CLIENT_STATE_DIR):  # a link into another run's: this run would resume from, write
        linked = out_dir / name  # into or remove that run's checkpoints and client state
        owner = enclosing_output(linked) if linked.is_symlink() else None
        if linked.is_symlink() and owner is None and (linked / RUN_LOCK).exists():  # a link to a run's directory
            owner = linked.resolve()
        if owner is not None and owner != out_dir.resolve():
            raise ConfigError(
                f"{str(linked)!r} is a symbolic link into the simulation output directory {str(owner)!r}, whose "
                "checkpoints and client state are that run's; remove the link (a run makes its own folder), or give "
                "another --out"
            )
    check_creatable_dir(out_dir, what="output.dir (--out)")  # created once the setup has succeeded
    held: list[int] = []  # the output directory's lock (lock_output), held until the run ends
    try:
        if out_dir.is_dir():  # before anything there is read (a new directory's is taken once it is made)
            held.append(lock_output(out_dir))
        return _simulate(config, echo, out_dir, held, started)
    finally:
        for fd in held:
            os.close(fd)


def _simulate(
    config: SimulationConfig, echo: Callable[[str], None], out_dir: Path, held: list[int], started: float
) -> SimulationResult:
    resuming = config.output.resume and (out_dir / RUN_STATE_DIR / "state.db").exists()
    if config.output.resume and not resuming and (kept := checkpoint_files(out_dir / RUN_STATE_DIR)):
        raise ConfigError(
            f"cannot resume the run in {str(out_dir)!r}: its checkpoints ({kept[-1].name} the newest) are there but "
            f"not {RUN_STATE_DIR}/state.db, which records the run's rounds and strategy; put it back, or run without "
            "--resume to start afresh there (which removes the checkpoints), or give another --out"
        )
    if resuming:
        check_resumable(out_dir, config)  # before the setup, which may load a dataset
    notice = None  # said once the directory is this run's (held), not by a run that another one then refuses
    if config.output.resume and not resuming:
        notice = f"nothing to resume in {out_dir} (no {RUN_STATE_DIR}/state.db there): starting a new run"
    demo = config.task.factory == DEMO_TASK
    factory: TaskFactory = demo_task if demo else load_task_factory(config.task.factory)
    options = task_options(config) if demo else dict(config.task.options)
    data_dir = None if demo else config.data.data_dir
    ids = client_ids(config.data.num_clients)
    index = {cid: i for i, cid in enumerate(ids)}

    def make_task(cid: str) -> Task:
        context = TaskContext(
            role="client",
            client_id=cid,
            partition_id=index[cid],
            num_partitions=len(ids),
            data_dir=data_dir,
            seed=config.seed,
            options=options,
        )
        return factory(context)

    server_task = build_server_task(
        factory,
        TaskContext(role="server", data_dir=data_dir, seed=config.seed, options=options),
        spec=config.task.factory,
    )
    if not demo:  # the demo task's metrics were checked with the recipe
        config.check_weight_metric(declared_metrics(server_task))
        if config.task.server_evaluation and config.sampling.fraction_evaluate == 0:  # the one source of accuracy
            config.stop_rules().check_task_reports_accuracy(server_task, name=repr(config.task.factory))
    trainable = trainable_names(server_task.build_model)  # a model that cannot be built: refused before output.dir
    strategy = apply_dp(
        build_strategy(config.strategy, config.train, config.sampling), config.privacy, population=len(ids)
    )
    if (weak := weak_delta(config.privacy, len(ids))) is not None:
        log.warning("%s", weak)
    # before output.dir is made: a robust rule's bound, SecAgg+'s graph and field, for the fewest clients a round
    # selects: as many as every round when all are always available; with a trace, the fewest its rounds select
    # from their online counts (min_fit_clients where they are not counted ahead)
    if config.devices.availability == "always":
        every = min(strategy.sampling.num_fit(len(ids)), len(ids))
        strategy.aggregator.check(every)
        preflight(strategy, every, server_task.build_model)
    else:  # a round selects num_fit of the clients online then
        counts = check_online_counts(config, ids, strategy.sampling.min_fit_clients)
        smallest = (
            min(min(strategy.sampling.num_fit(int(c)), int(c)) for c in np.unique(counts))
            if counts is not None
            else min(strategy.sampling.min_fit_clients, len(ids))
        )
        preflight(strategy, smallest, server_task.build_model)
    attackers = choose_attackers(ids, config.attack, seed=config.seed)
    client_task: Callable[[str], Task] = make_task
    classes = 0
    if attackers:
        kind, count = config.attack.kind, len(attackers)
        log.warning("attack %s by %d of %d clients: %s", kind, count, len(ids), sorted(attackers))
        classes = num_classes(server_task) if config.attack.kind in LABEL_ATTACKS else 0
        client_task = attacked_tasks(make_task, attackers, config.attack, classes, seed=config.seed)
    state = ClientStateStore(out_dir / CLIENT_STATE_DIR)
    device = training_device(config.simulation)  # a missing GPU refused before the first round, not in one
    if device.type != "cpu":
        log.info("the clients train on %s (%s)", device, torch.cuda.get_device_name(device))
    clients = InMemoryPool(ids, client_task, state=state, max_tasks=MAX_TASKS, device=device)
    backend: ClientPool = clients
    if config.simulation.backend == "batched":
        from simulations.batched import BatchedPool, check_batchable_clients, presum_weight

        # refused before the first round, not in one; a client whose task raises or whose data fail is passed over
        unbatched = check_batchable_clients(clients, ids[:16], strategy)
        if unbatched:
            log.warning(
                "batched clients: torch.func has no batching rule for %s, which it runs one client at a time: this "
                "model may train slower batched than with backend = 'inprocess' (LEAF's char-lstm on this project's "
                "2-core CPU: 51 s a round against 20)",
                ", ".join(unbatched),
            )
        # each batch's updates summed where they were trained, unless an attacker's update must be rewritten first
        rewritten = bool(attackers) and config.attack.kind in REWRITE_ATTACKS
        weigh = None if rewritten else presum_weight(strategy)
        backend = BatchedPool(
            clients,
            batch_clients=config.simulation.batch_clients,
            device=device,
            weigh=weigh,
            defer_first_layer=config.simulation.defer_first_layer,
        )
    process: ProcessPool | RayPool | None = None
    if config.simulation.backend in ("process", "ray"):
        if config.strategy.sum_dtype == "float32":
            log.warning(FLOAT32_ORDER_NOTICE, config.simulation.backend)
        tasks = ClientTasks(
            factory=DEMO_TASK if demo else config.task.factory,
            options=options,
            num_partitions=len(ids),
            seed=config.seed,
            data_dir=None if data_dir is None else str(data_dir),
            attack=to_mapping(config.attack),
            label_attack_classes=classes,
            max_tasks=MAX_TASKS,
            device=worker_device(config.simulation),
        )
        if tasks.device is not None:
            log.info("the %s backend's workers train on %s", config.simulation.backend, tasks.device)
        sim = config.simulation
        workers = worker_count(config)
        if sim.backend == "ray":
            from simulations.raypool import RayPool

            process = RayPool(
                ids,
                tasks,
                workers=workers,
                max_workers=clients_at_once(config),
                num_cpus=sim.num_cpus,
                num_gpus=sim.num_gpus,
                address=sim.ray_address,
                state_dir=state.root,
                attackers=attackers,
            )
        else:
            process = ProcessPool(ids, tasks, workers=workers, state_dir=state.root, attackers=attackers)
        backend = process
    pool: ClientPool = AttackedPool(backend, attackers, config.attack, seed=config.seed)
    if config.devices.timed or config.strategy.selection == "oort":  # oort reads durations: simulated, reproducible
        pool = SimulatedDevices(pool, slow_clients(ids, config.devices.slow_fraction, seed=config.seed), config.devices)
    selection = simulation_selector(
        strategy.selection, config.devices, ids, seed=config.seed, sizes=lambda: partition_sizes(config, ids)
    )
    strategy = replace(strategy, selection=selection)
    store: StateStore | None = None
    resumed: ServerState | None = None
    try:
        if resuming:
            store = _open_store(out_dir, config)
            resumed = store.resume(mapped=True, rounds=config.rounds)  # refused before config.json records fewer
            if resumed is None:  # nothing trained yet: a new run
                store.close()
                store = None
                echo(f"nothing to resume in {out_dir} (no round finished): starting a new run")
            else:
                resumed = resumed_for_model(
                    resumed,
                    server_task.build_model,
                    where=str(out_dir / RUN_STATE_DIR),
                    advice="resume with the task of the recorded run, or run without --resume",
                )
        if not held:  # a new directory, made now that the setup has succeeded
            held.append(lock_output(out_dir))
        if notice:
            echo(notice)
        prepare_output(out_dir, config, resumed=resumed is not None)
        if store is None and config.output.checkpoints:
            store = _open_store(out_dir, config)
    except BaseException:
        with deferred_interrupts():  # a Ctrl-C more must not leave the pool's processes (see the run's end below)
            try:
                if store is not None:
                    store.close()
            finally:
                if process is not None:
                    process.close()
        raise

    resumed_round = resumed.round if resumed is not None else 0
    start = [resumed] if resumed is not None else []  # handed to the round loop, which drops it after round 1
    del resumed
    csv_path, model_path = out_dir / "history.csv", out_dir / "model.safetensors"
    history_file = HistoryFile(csv_path)  # the server's writer: one schema for both history files
    earlier: list[dict[str, float | int | None]] = []  # a resumed run's rounds before it
    if store is not None and start:
        earlier = store.history()
        _write_history(history_file, earlier, at_round=resumed_round, kept_checkpoints=True)
        restore_strategy(strategy, store, resumed_round)  # as a server's is
        echo(f"resuming after round {resumed_round} from {out_dir / RUN_STATE_DIR}")
        stateful = (
            any(mod.name in ("scaffold", "dp-sgd") for mod in strategy.mods) or config.strategy.compression == "topk"
        )
        client_state = out_dir / CLIENT_STATE_DIR
        if stateful and not (client_state.is_dir() and any(client_state.iterdir())):
            echo(
                f"warning: {client_state} is missing or empty, but this run's clients keep state between rounds "
                "(SCAFFOLD's control variates, top-k's residuals, DP-SGD's privacy accounting): they go on from "
                "none, so the run will differ from the run never stopped (and DP-SGD's epsilon will be understated)"
            )
    divergent_rounds: list[int] = []
    first_round_frozen = False  # the run's lasting objects frozen out of the collector (after its first round)
    # The bar only on a terminal: piped into a file or `tee`, its redraws would garble the per-round table.
    bar = config.output.progress and sys.stderr.isatty()
    progress = tqdm(
        total=config.rounds,
        initial=resumed_round,
        desc="rounds",
        unit="round",
        disable=not bar,
        leave=False,
    )
    say = tqdm.write if config.output.progress else echo
    spent = (("epsilon", config.privacy.enabled), ("train_sgd_epsilon", config.privacy.dp_sgd))
    columns = (*COLUMNS[:-1], *(name for name, shown in spent if shown), COLUMNS[-1])
    if config.output.progress:
        say(" ".join(f"{_HEADINGS.get(c, c):>10}" for c in columns))

    # the last trained round's state (a resumed run's checkpoint, mapped, until this run finishes a round)
    finished: list[ServerState] = start[:1]

    def on_round_end(record: RoundRecord, state: ServerState) -> ServerState:
        row = record.as_row()
        if record.eval_loss is not None and not math.isfinite(record.eval_loss):
            divergent_rounds.append(record.round)
            log.warning("round %d: test loss %s: training diverged", record.round, record.eval_loss)
        if record.round > 0:
            progress.update(1)
            acc = record.eval_metrics.get("accuracy")
            if acc is not None:
                progress.set_postfix(acc=f"{acc:.4f}")
        # a large global model and FedAvgM's momentum (FedAdam's moments) wait for the next round in a file: the
        # clients read the model from it block by block, and the momentum sits untouched until the server step
        checkpoint = None  # round 0 (the initial model's evaluation) has none
        if store is not None:
            if record.round > 0:  # the record in it too: a kill before the record's row loses nothing
                checkpoint = store.save_checkpoint(state, record)
            store.record_round(record)
        # after the checkpoint: a round whose checkpoint failed is not in history.csv either
        _write_history(history_file, row, at_round=record.round, kept_checkpoints=store is not None)
        if config.output.progress:
            say(_format_row(row, columns))
        mapped = continue_from(state, checkpoint) if checkpoint is not None else map_round_state(state, out_dir)
        if record.round > 0:  # written as the model if a later round fails (a small model held, or a mapping)
            finished[:] = [mapped]
        nonlocal first_round_frozen
        if record.round > 0 and not first_round_frozen:
            _freeze_first_round()
            first_round_frozen = True
        return mapped

    # A large model's tensors and arrays are made and freed with every client: each in its own mapping, handed back
    # when freed, rather than left resident in glibc's heap (bench/simulation_memory.py's 20M-parameter model:
    # 14 MiB less peak). Not for a smaller model, whose step's gradients and activations of 1 MiB or more would then
    # fault in anew at every step (the CNN, 1.7M parameters, in-process: 4.0 s for 30 clients with mappings, 3.3 s
    # without, the plain loop's time), nor for batched clients, which allocate a few stacks of at most
    # CPU_STACK_BYTES per batch and step (issue 12's workload, 2 threads: 0.115 s a round with mappings, 0.095
    # without); glibc's heap reuses those blocks and the round's end trims it (release_memory). The threshold is
    # process-wide and stays once set: a run after a large model's in the same process keeps it
    large = state_elements(server_task.build_model) >= STEP_IN_BACKWARD_MIN_ELEMENTS
    if large and config.simulation.backend != "batched":
        return_large_blocks_to_the_os()
    evaluate_fn = (
        central_evaluation(server_task, strategy.evaluate_batch_size) if config.task.server_evaluation else None
    )
    validate_fn = (
        validation_evaluation(server_task, strategy.evaluate_batch_size, seed=config.seed)
        if strategy.weighting == "server"
        else None
    )
    round_config = RoundConfig(
        num_rounds=config.rounds,
        seed=config.seed,
        min_fit_results=1,
        evaluate_every=config.evaluate_every,
        stop=config.stop_rules(),
    )
    # The modules, the dataset and the tasks built so far live for the whole run: freezing them out of the
    # collector keeps the round loop's collection after each round from walking them (about 1 s a round).
    frozen_by_caller = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        final, _ = run_rounds(
            pool,
            strategy,
            # made in the call, so that no reference here keeps the initial model alive for the whole run
            start.pop()
            if start
            else initial_state(initial_parameters(server_task.build_model, config.seed), strategy, trainable=trainable),
            round_config,
            evaluate_fn=evaluate_fn,
            on_round_end=on_round_end,
            validate_fn=validate_fn,
            keep_records=False,  # each round's row is written as it ends; a record holds an observation per client
            history=earlier,  # a resumed run's stop rules count on
            on_release=release_hook(strategy, store),
        )
    except FedcoreError as exc:  # a round failed: the rounds that finished keep their model as well as their history
        if finished:
            last = finished[0]
            what = f"round {last.round}'s global model, the last round that finished,"
            try:
                _save_model(model_path, last)
            except OSError as unwritten:  # e.g. the disk that failed the round is full: the round's error is raised
                echo(f"{what} could not be written to {model_path}: {unwritten}")
            else:
                echo(f"{what} is in {model_path}")
        checkpointed = store is not None and bool(finished)
        if checkpointed and isinstance(exc, ConfigError):  # the same recipe would fail the same round again
            echo(
                "checkpoints kept, but the error is in the recipe, and a resumed run may change only rounds, "
                "[output] and [simulation]: after a fix there, run the same command with --resume; a fix anywhere "
                "else needs a new run (without --resume)"
            )
        elif checkpointed:
            echo(f"checkpoints kept: {_RESUME_HINT}")
        raise
    except KeyboardInterrupt:
        if store is not None and finished:
            echo(f"stopped; {_RESUME_HINT}")
        raise
    finally:
        # The way out of a run that Ctrl-C stopped: a second Ctrl-C here (an impatient user presses it two or three
        # times) cut it short and left the process pool's shared-memory directory, or Ray's processes, behind. It
        # is held back until the pool is closed, and the pool is closed even if the state store's close fails.
        with deferred_interrupts():
            try:
                if store is not None:
                    store.close()
                gc.unfreeze()  # the run's objects go back to the collector (gc cannot unfreeze only some)
                if frozen_by_caller:  # what the caller froze stays frozen (with what is alive of the run now)
                    gc.freeze()
                progress.close()
            finally:
                if process is not None:
                    process.close()
    _write_final_model(model_path, final, kept_checkpoints=config.output.checkpoints)
    rows = history_file.rows
    history = pd.DataFrame(rows, columns=history_columns(rows))
    plot_path = None
    if config.output.plot:
        try:
            plot_path = plot_history(history, out_dir / "history.png")
        except OSError as unwritten:  # the plot is a view of history.csv: the run's results are written
            echo(f"WARNING: the plot could not be written to {out_dir / 'history.png'}: {unwritten}")
    wall = time.perf_counter() - started
    accuracy = history["test_accuracy"].dropna()
    final_acc = f"{float(accuracy.iloc[-1]):.4f}" if len(accuracy) else "none (no round has a server evaluation of it)"
    diverged = bool(divergent_rounds)
    if diverged:
        echo(
            "WARNING: training diverged: the global model's test loss became NaN or infinite; "
            "lower train.lr (or strategy.server_lr) and run again"
        )
    if line := clients_left_out(history):
        echo(line)
    echo(
        f"final test accuracy {final_acc} after {final.round} rounds in {wall:.1f} s; "
        f"history: {csv_path}; plot: {plot_path if plot_path else 'off'}"
    )
    convergence = Convergence.replay(round_config.stop, rows)
    if line := convergence.summary(final.round):
        echo(line)
    return SimulationResult(
        history=history,
        final=final,
        wall_seconds=wall,
        csv_path=csv_path,
        plot_path=plot_path,
        model_path=model_path,
        diverged=diverged,
        reached=convergence.reached,
        stop=convergence.stop,
    )


def _save_model(model_path: Path, state: ServerState) -> None:
    """Write ``state``'s global model to ``model_path`` (safetensors, its round in the header, self-digested).

    Raises:
        OSError: the file cannot be written.
    """
    save_payload(model_path, state.parameters, {"round": str(state.round)}, self_digest=True)


def _write_history(
    history: HistoryFile,
    rows: Mapping[str, object] | Sequence[Mapping[str, object]],
    *,
    at_round: int,
    kept_checkpoints: bool,
) -> None:
    """Add one round's row to ``history`` (a mapping), or rewrite it with a resumed run's earlier rows (a sequence).

    Raises:
        StateError: the file cannot be written (disk full, a file size limit); says which round's model the
            checkpoints hold and that ``--resume`` goes on from it (rewriting history.csv from the checkpoints'
            records), or, without checkpoints, that the run cannot go on.
    """
    try:
        if isinstance(rows, Mapping):
            history.add(rows)
        else:
            history.reset(rows)
    except OSError as exc:
        fix = "fix what stops the write (a full disk, or something else where the file goes)"
        if at_round == 0:
            advice = f"no round was trained yet: {fix} and run again"
        elif kept_checkpoints:
            advice = (
                f"round {at_round}'s checkpoint is saved: {fix} and run the same command with --resume "
                "(output.resume = true), which writes history.csv again from the checkpoints' records and goes on"
            )
        else:
            advice = f"the run kept no checkpoints (--no-checkpoints), so it cannot go on: {fix} and run again"
        raise StateError(f"cannot write the history {str(history.path)!r}: {exc}; {advice}", round=at_round) from exc


def _write_final_model(model_path: Path, final: ServerState, *, kept_checkpoints: bool) -> None:
    """Write the run's final global model to ``model_path``.

    Raises:
        StateError: the file cannot be written (disk full, a file size limit); says that training finished and how
            to get the model: ``--resume`` from the checkpoints, which writes it without training again, or (a run
            without checkpoints) a new run.
    """
    try:
        _save_model(model_path, final)
    except OSError as exc:
        if kept_checkpoints:
            advice = (
                "its checkpoints hold the model: free disk space and run the same command with --resume "
                "(output.resume = true), which writes it without training again"
            )
        else:
            advice = "the run kept no checkpoints (--no-checkpoints), so the model is lost: free space and run again"
        raise StateError(
            f"training finished after round {final.round}, but its model could not be written to "
            f"{str(model_path)!r}: {exc}; {advice}",
            round=final.round,
        ) from exc


def clients_left_out(history: pd.DataFrame) -> str | None:
    """One line on the rounds of ``history`` (the ``clients`` and ``failures`` columns of its rows after round 0)
    that went on without some of their clients (failed, or their updates rejected), or None when none did. It
    starts with ``WARNING:`` when a round kept fewer than half of its clients' updates: such a model learned from
    few clients, which the final accuracy alone does not say (e.g. DP noise that breaks most clients' training)."""
    rounds = history[history["round"] > 0]
    lossy = rounds[rounds["failures"] > 0]
    if lossy.empty:
        return None
    share = (lossy["clients"] / (lossy["clients"] + lossy["failures"])).to_numpy(dtype=np.float64)
    worst = lossy.iloc[int(np.argmin(share))]
    kept, failed = int(worst["clients"]), int(worst["failures"])
    warning = "WARNING: " if float(share.min()) < 0.5 else ""
    return (
        f"{warning}{len(lossy)} of {len(rounds)} round(s) went on without some of their clients "
        f"({int(lossy['failures'].sum())} failed or rejected update(s) in all; the fewest kept: round "
        f"{int(worst['round'])}, {kept} update(s) kept and {failed} failed or rejected); the log gives each reason, "
        "history.csv's failures column the counts"
    )


VALIDATION_EXAMPLES = 1000
"""How many examples of the central test split the server weighs each update on (weighting ``server``)."""


def validation_evaluation(task: Task, batch_size: int, *, seed: int) -> EvaluateFn:
    """The server's evaluation of one update for weighting ``server`` in a simulation: on
    :data:`VALIDATION_EXAMPLES` examples of the server task's test split, drawn from (seed, "validation") (the
    whole split when smaller, or when the task is not a :class:`~fedcore.supervised.SupervisedTask`).

    The validation examples come from the central test split, so the test accuracy of a run weighted this way has
    seen them in its aggregation: it is optimistic by the part they play (1000 of fashion-mnist's 10,000).
    """
    data = getattr(task, "test_data", None)
    if isinstance(task, SupervisedTask) and data is not None and len(data[1]) > VALIDATION_EXAMPLES:
        chosen = numpy_rng(seed, "validation").choice(len(data[1]), size=VALIDATION_EXAMPLES, replace=False)
        index = torch.from_numpy(np.sort(chosen))
        task = replace(task, test_data=(data[0][index], data[1][index]))
    return central_evaluation(task, batch_size)


def unplotted(history: pd.DataFrame) -> tuple[str | None, str | None]:
    """What :func:`plot_history` cannot draw, written on the plot instead so that an empty or partial panel is not
    read as a run without trouble: (the note of the accuracy panels, of the loss panel), each None when all is drawn.

    The accuracy panels are empty when no round has a test evaluation; the loss panel leaves out infinite losses
    (a diverged run's, which a line cannot reach), and a NaN test loss of a round whose accuracy was evaluated."""

    def rounds(mask: pd.Series) -> str:
        return ", ".join(str(int(r)) for r in history["round"][mask])

    accuracy = history["test_accuracy"].notna()
    train = pd.to_numeric(history["train_loss"], errors="coerce")
    test = pd.to_numeric(history["test_loss"], errors="coerce")
    lost = [
        f"{what} in round(s) {where}"
        for what, mask in (("train loss", np.isinf(train)), ("test loss", accuracy & ~np.isfinite(test)))
        if (where := rounds(mask))
    ]
    return (
        None if accuracy.any() else "no round has a test evaluation",
        "not finite, not drawn:\n" + "\n".join(lost) if lost else None,
    )


def plot_history(history: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
    """Write a PNG of the run and return its path: test accuracy per round (top left), train/test loss per round
    (top right), test accuracy against the run's wall time (bottom left: the cumulative ``seconds``) and against
    the bytes sent (bottom right: the cumulative ``bytes_up + bytes_down``, in MB; a history without those
    columns counts 0). What it cannot draw (:func:`unplotted`) is written on its panels."""
    path = Path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ((ax_acc, ax_loss), (ax_time, ax_bytes)) = plt.subplots(2, 2, figsize=(11, 8))
    evaluated_mask = history["test_accuracy"].notna()
    evaluated = history[evaluated_mask]
    ax_acc.plot(evaluated["round"], evaluated["test_accuracy"], marker=".", color="tab:blue")
    for ax in (ax_acc, ax_loss):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_acc.set_xlabel("round")
    ax_acc.set_ylabel("test accuracy")
    ax_acc.grid(alpha=0.3)
    ax_loss.plot(evaluated["round"], evaluated["test_loss"], marker=".", label="test loss", color="tab:orange")
    trained = history.dropna(subset=["train_loss"])
    ax_loss.plot(trained["round"], trained["train_loss"], marker=".", label="train loss", color="tab:green")
    ax_loss.set_xlabel("round")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)

    def cumulative(*columns: str) -> pd.Series:
        total = pd.Series(0.0, index=history.index)
        for column in columns:
            if column in history:
                total = total + pd.to_numeric(history[column], errors="coerce").fillna(0.0)
        return total.cumsum()[evaluated_mask]

    ax_time.plot(cumulative("seconds"), evaluated["test_accuracy"], marker=".", color="tab:blue")
    ax_time.set_xlabel("wall time (s)")
    ax_time.set_ylabel("test accuracy")
    ax_time.grid(alpha=0.3)
    ax_bytes.plot(cumulative("bytes_up", "bytes_down") / 1e6, evaluated["test_accuracy"], marker=".", color="tab:blue")
    ax_bytes.set_xlabel("MB sent (up + down)")
    ax_bytes.set_ylabel("test accuracy")
    ax_bytes.grid(alpha=0.3)
    accuracy_note, loss_note = unplotted(history)
    for ax, note in (
        (ax_acc, accuracy_note),
        (ax_time, accuracy_note),
        (ax_bytes, accuracy_note),
        (ax_loss, loss_note),
    ):
        if note:
            ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
