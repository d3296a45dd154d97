"""Entry point of one worker process: ``python -m fedcore.engine.worker SPEC_JSON RANK``.

Reads the JSON spec the launcher wrote, rebuilds the task from its ``module:attr`` factory and the
:class:`~fedcore.task.TaskContext` fields, loads the global parameters from safetensors, joins the process
group, trains its part of the model, and on rank 0 writes the updated state (safetensors) and metrics (JSON).
On any exception it writes ``error-rank<RANK>.json`` and exits with status 1. It dies with its launcher
(:func:`~fedcore.engine.launch.die_with_parent`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from fedcore.engine.launch import PARENT_ENV, die_with_parent, error_path
from fedcore.engine.plan import Device, ParallelPlan
from fedcore.errors import EngineError
from fedcore.task import FitConfig, TaskContext, check_engine_task, load_task_factory
from fedcore.tensors import decode, encode, from_state_dict


def task_context_to_json(ctx: TaskContext) -> dict[str, Any]:
    """The context's fields as JSON-ready values."""
    return {
        "role": ctx.role,
        "client_id": ctx.client_id,
        "partition_id": ctx.partition_id,
        "num_partitions": ctx.num_partitions,
        "data_dir": None if ctx.data_dir is None else str(ctx.data_dir),
        "seed": ctx.seed,
        "options": dict(ctx.options),
    }


def task_context_from_json(data: dict[str, Any]) -> TaskContext:
    """Inverse of :func:`task_context_to_json`."""
    return TaskContext(
        role=data["role"],
        client_id=data["client_id"],
        partition_id=data["partition_id"],
        num_partitions=data["num_partitions"],
        data_dir=None if data["data_dir"] is None else Path(data["data_dir"]),
        seed=int(data["seed"]),
        options={str(k): str(v) for k, v in data["options"].items()},
    )


def write_report(workdir: Path, rank: int, exc: BaseException, failed_at_ns: int) -> None:
    """Write ``error-rank<RANK>.json``: the exception's type, message and traceback, and when it was raised.

    ``failed_at_ns`` is ``time.monotonic_ns()`` taken when the exception was caught; CLOCK_MONOTONIC is shared by
    every process on the machine, so the launcher orders the ranks' reports by it (file times can tie).
    """
    report = {
        "rank": rank,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "failed_at_ns": failed_at_ns,
    }
    path = error_path(workdir, rank)
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(report))
    partial.replace(path)  # atomic: the launcher never reads half a report


def run(spec: dict[str, Any], rank: int) -> None:
    """Train as ``rank`` under ``spec``; rank 0 writes ``spec['state_path']`` and ``spec['metrics_path']``.

    Joins the process group and stays in it; :func:`main` leaves it, after reporting any failure.
    """
    from fedcore.engine.runner import train_rank
    from fedcore.engine.runtime import init_distributed

    plan = ParallelPlan.from_mapping(spec["plan"])
    config = FitConfig(**spec["config"])
    task = check_engine_task(load_task_factory(spec["task_factory"])(task_context_from_json(spec["task_context"])))
    global_parameters = decode(Path(spec["global_path"]).read_bytes())
    env = init_distributed(plan, Device(spec["device"]), rank=rank, init_method=spec["init_method"])
    result = train_rank(
        task,
        global_parameters,
        config,
        plan,
        env,
        seed=int(spec["seed"]),
        round=int(spec["round"]),
        client_id=str(spec["client_id"]),
    )
    if rank == 0:
        if result.state is None:
            raise EngineError("rank 0 holds no model state after training", rank=0)
        Path(spec["state_path"]).write_bytes(encode(from_state_dict(result.state)))
        metrics = {"num_examples": result.num_examples, "train_loss": result.train_loss}
        Path(spec["metrics_path"]).write_text(json.dumps(metrics))


def main(argv: list[str]) -> int:
    """Run the worker; returns the process exit status (1 after writing ``error-rank<RANK>.json``).

    A failure is reported (:func:`write_report`) before this rank leaves the process group: leaving closes its
    connections, which makes the peers fail too, and the root cause must be the first report.
    """
    from fedcore.engine.runtime import shutdown_distributed

    spec_path, rank = Path(argv[0]), int(argv[1])
    parent = os.environ.get(PARENT_ENV)
    if parent is not None:
        die_with_parent(int(parent))
    try:
        run(json.loads(spec_path.read_text()), rank)
    except BaseException as exc:
        write_report(spec_path.parent, rank, exc, time.monotonic_ns())
        return 1
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
