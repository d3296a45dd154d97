"""``train_with_plan``: one client's local training round under a parallel plan.

The caller (client runner or simulation worker) hands over the task factory, the global model and the plan,
and gets back the updated model in the global model's names, order and dtypes, plus the training result.
Validation happens first, in the caller's process: the plan against the model (split points) and the machine
(GPUs, bf16), and the data against the micro-batching. A plan of all ones then trains in-process with no
process group; any other plan starts ``data_parallel * pipeline * tensor_parallel`` workers
(:mod:`fedcore.engine.launch`).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import torch
from torch import nn

from fedcore.engine.batch_stats import check_batches
from fedcore.engine.launch import DEFAULT_TIMEOUT_S, run_workers, worker_directory
from fedcore.engine.plan import Device, ParallelPlan
from fedcore.engine.runner import train_rank
from fedcore.engine.runtime import single_process_env
from fedcore.engine.tensor_parallel import resolve_plan
from fedcore.engine.worker import task_context_to_json
from fedcore.errors import ConfigError, EngineError
from fedcore.task import (
    FitConfig,
    Task,
    TaskContext,
    TrainResult,
    check_engine_task,
    engine_task_problem,
    load_task_factory,
)
from fedcore.tensors import NamedArrays, decode, encode, from_state_dict, to_state_dict
from fedcore.training import train_task


def check_plan_here(task: Task, model: nn.Module, plan: ParallelPlan) -> Device:
    """Check ``plan`` against ``task``'s ``model`` and this machine, as every round would: split points and
    stages (:meth:`ParallelPlan.check_model`), tensor parallelism's layers and degree
    (:func:`~fedcore.engine.tensor_parallel.resolve_plan`), the devices and precision (:meth:`ParallelPlan.
    check_runtime`). A client daemon calls it when it starts, so that a plan no round can run is refused then.

    Returns:
        The device the ranks run on (``cpu`` or ``cuda``).

    Raises:
        ConfigError: what does not fit, and what to change.
    """
    plan.check_model(model)
    if plan.tp_enabled:
        resolve_plan(task, model, plan.tensor_parallel)  # the layers to split exist and the degree divides them
    return plan.check_runtime()


def train_with_plan(
    task_factory: str,
    task_context: TaskContext,
    global_parameters: NamedArrays,
    config: FitConfig,
    plan: ParallelPlan,
    *,
    seed: int,
    round: int,
    client_id: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    task: Task | None = None,
) -> tuple[NamedArrays, TrainResult]:
    """Train the task's model for one round under ``plan``; return the updated state and the result.

    Shuffling uses ``torch.randperm`` with a generator seeded by ``derive_seed(seed, round, client_id)``, the
    global batch is ``config.batch_size`` samples however it is split over ranks, micro-steps and
    micro-batches, and FedProx's term is included, so the result equals single-device
    :func:`fedcore.training.train_supervised` with that generator (up to float rounding).

    Args:
        task_factory: ``"module:attr"`` naming a :data:`~fedcore.task.TaskFactory` importable by workers.
        task_context: the context the factory gets (in every worker).
        global_parameters: the round's global model, ``name -> array`` in ``state_dict`` order.
        config: local training settings (epochs, batch size, lr, momentum, weight decay, mu, max_steps).
        plan: the parallel plan.
        seed, round, client_id: key the shuffling generator.
        timeout_s: kill the workers and fail after this many seconds (> 0; the client daemon passes the time
            left until the round's deadline). In-process training (a plan of all ones) is not bounded.
        task: the task ``task_factory`` makes for ``task_context``, when the caller holds it already (a daemon
            builds it once): this process then does not build it (and load its data) again. Workers always build
            their own.

    Returns:
        ``(updated, result)``: ``updated`` has exactly the names, order, shapes and dtypes of
        ``global_parameters``; ``result.metrics["train_loss"]`` is the mean loss over the last epoch.

    Raises:
        ConfigError: the factory cannot be loaded, the plan does not fit the model or the machine, the
            global parameters do not match the model, the model (or task) declares no tensor-parallel plan that
            fits ``plan.tensor_parallel``, or a plan other than all ones meets a task that does not
            fit the engine's contract (:class:`~fedcore.task.EngineTask`; a plan of all ones runs such a
            task's own ``train``, as :func:`fedcore.training.train_task` does).
        EngineError: a worker failed (the message names the rank and the cause) or ``timeout_s`` passed; no
            worker is left running and the temporary directory is removed.
        SystemExit: SIGTERM arrived while workers ran (status 143), after they were stopped and the temporary
            directory removed; only when called on the main thread and SIGTERM had its default action.
    """
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ConfigError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if task is None:
        task = load_task_factory(task_factory)(task_context)
    if not plan.is_single_process:
        check_engine_task(task, round=round, client_id=client_id)  # before any worker starts
    model = task.build_model()
    device = check_plan_here(task, model, plan)
    expected = list(model.state_dict())
    if expected != list(global_parameters):
        missing = [n for n in expected if n not in global_parameters][:5]
        extra = [n for n in global_parameters if n not in expected][:5]
        raise ConfigError(
            f"the global parameters do not match the task's model (missing {missing}, unexpected {extra}, "
            "or a different order)",
            round=round,
            client_id=client_id,
        )
    if plan.is_single_process:
        if engine_task_problem(task) is not None:  # a task with its own loop: run as-is on one device
            return _train_task_directly(task, model, global_parameters, config, seed, round, client_id)
        result = train_rank(
            check_engine_task(task),
            global_parameters,
            config,
            plan,
            single_process_env(device),
            seed=seed,
            round=round,
            client_id=client_id,
        )
        if result.state is None:
            raise EngineError("rank 0 returned no state", rank=0, round=round, client_id=client_id)
        updated = from_state_dict(result.state)
        num_examples, train_loss = result.num_examples, result.train_loss
    else:
        x, _ = check_engine_task(task).training_data()
        check_batches(plan, model, len(x), config.batch_size)
        with worker_directory() as workdir:
            spec = {
                "task_factory": task_factory,
                "task_context": task_context_to_json(task_context),
                "config": dataclasses.asdict(config),  # every FitConfig field; the worker rebuilds it
                "plan": plan.to_mapping(),
                "device": device.value,
                "seed": seed,
                "round": round,
                "client_id": client_id,
                # a file in this call's own directory: no port to pick, so no race with another process for one
                "init_method": (workdir / "rendezvous").resolve().as_uri(),
                "global_path": str(workdir / "global.safetensors"),
                "state_path": str(workdir / "updated.safetensors"),
                "metrics_path": str(workdir / "metrics.json"),
            }
            (workdir / "global.safetensors").write_bytes(encode(global_parameters))
            spec_path = workdir / "spec.json"
            spec_path.write_text(json.dumps(spec))
            try:
                run_workers(spec_path, plan.total_ranks, workdir, timeout_s=timeout_s)
            except EngineError as exc:
                raise EngineError(exc.message, rank=exc.rank, round=round, client_id=client_id) from None
            updated = decode((workdir / "updated.safetensors").read_bytes())
            metrics = json.loads((workdir / "metrics.json").read_text())
            num_examples, train_loss = int(metrics["num_examples"]), float(metrics["train_loss"])
    ordered = {
        name: np.asarray(updated[name]).astype(array.dtype, copy=False) for name, array in global_parameters.items()
    }
    metrics_out = {} if np.isnan(train_loss) else {"train_loss": train_loss}
    return ordered, TrainResult(num_examples=num_examples, metrics=metrics_out)


def _train_task_directly(
    task: Task,
    model: torch.nn.Module,
    global_parameters: NamedArrays,
    config: FitConfig,
    seed: int,
    round: int,
    client_id: str,
) -> tuple[NamedArrays, TrainResult]:
    """World size 1 with a task that has its own loop: its ``train`` runs as the client runner runs it."""
    model.load_state_dict(to_state_dict(global_parameters), strict=True)
    result = train_task(task, model, config, global_parameters, seed=seed, round=round, client_id=client_id)
    updated = from_state_dict(model.state_dict())
    return {n: updated[n].astype(a.dtype, copy=False) for n, a in global_parameters.items()}, result
