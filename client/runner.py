"""The client-side runner: the one function that turns an instruction into a reply.

The gRPC daemon calls it after pulling a task; the simulation's virtual clients call it directly. Both get the
same numbers for the same (seed, round, client), because every random draw inside is keyed by them.

What a task may return: an example count that is an integer >= 0 (Python or numpy int, not bool), else the
instruction fails with :class:`~fedcore.errors.ClientTaskError`; an evaluation loss that is a number (NaN or Inf
too, as a diverged model or an empty test split gives, is passed on: the server leaves it out of the federated
loss and counts it; a loss that is no number fails the evaluation); metrics as a
dict whose values become floats (:func:`fedcore.aggregation.metric_value`: bools as 0/1, huge ints as ±inf, NaN
kept) under ``str`` names cut to :data:`~fedcore.messages.MAX_METRIC_NAME` characters, values that are not
numbers (strings, None, arrays) and metrics beyond :data:`~fedcore.messages.MAX_METRICS` dropped with a warning. The
server leaves non-finite values out of its averages (:func:`fedcore.aggregation.weighted_metrics`), so no
metric can fail a round.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import torch

from client.mods import run_chain
from client.state import ClientStateStore
from fedcore.aggregation import metric_value
from fedcore.engine.launch import DEFAULT_TIMEOUT_S
from fedcore.engine.plan import ParallelPlan
from fedcore.errors import ClientTaskError, FedcoreError, PayloadError
from fedcore.messages import (
    MAX_METRIC_NAME,
    MAX_METRICS,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Instruction,
    Stage,
    bounded_repr,
)
from fedcore.mods import ModContext
from fedcore.seeding import derive_seed
from fedcore.task import EvalResult, Task, TaskContext, TrainContext, TrainResult
from fedcore.tensors import NamedArrays, check_spec, from_state_dict, state_spec, to_state_dict

log = logging.getLogger("fedcore.client")


@dataclass(frozen=True, kw_only=True)
class ParallelTraining:
    """Train fit instructions with the parallel engine (:func:`fedcore.engine.train_with_plan`).

    The engine's workers rebuild the task in their own processes, so it is named by its factory rather than
    passed as an object.

    Attributes:
        task_factory: ``"module:attr"`` of the task factory (the one the daemon was started with).
        task_context: the context that factory gets in every worker.
        plan: the parallel plan; a plan of all ones trains in-process.
        timeout_s: kill the workers and fail the instruction after this many seconds; the daemon sets it per
            task to the time left until the round's deadline.
    """

    task_factory: str
    task_context: TaskContext
    plan: ParallelPlan
    timeout_s: float = DEFAULT_TIMEOUT_S


def load_parameters(model: torch.nn.Module, parameters: NamedArrays, *, round: int, client_id: str) -> None:
    """Copy the global ``parameters`` (name -> numpy array) into ``model`` in place.

    Raises:
        PayloadError: names, shapes or dtypes differ from the model's state dict.
    """
    check_spec(parameters, state_spec(model.state_dict()), round=round, client_id=client_id)
    model.load_state_dict(to_state_dict(parameters), strict=True)


def run_instruction(
    task: Task,
    instruction: Instruction,
    client_id: str,
    *,
    model: torch.nn.Module | None = None,
    parallel: ParallelTraining | None = None,
    state: ClientStateStore | None = None,
) -> FitRes | EvaluateRes:
    """Execute one instruction with ``task`` on this client.

    A fit instruction that declares client mods runs through their chain (:func:`client.mods.run_chain`), with
    the training below at its end.

    Args:
        task: the user's task for this client's data.
        instruction: :class:`FitIns` (train one round) or :class:`EvaluateIns`.
        client_id: this client's id (keys its random streams together with the seed and round).
        model: a model of the task's architecture to reuse (its state is overwritten); built if None.
        parallel: train fit instructions under this parallel plan (evaluation stays in-process).
        state: the clients' persistent state (:class:`client.state.ClientStateStore`), which mods use; None when
            this client keeps none.

    Returns:
        :class:`FitRes` with the trained parameters in the global model's names and dtypes, or
        :class:`EvaluateRes`.

    Raises:
        PayloadError: the global parameters do not fit the task's model.
        ClientTaskError: the task raised, returned an example count that is not an integer >= 0, a loss that is not
            a number, or metrics that are not a dict.
        EngineError: a parallel worker failed (names the rank and the cause).
        ConfigError: a declared client mod is unknown or refuses its parameters.
    """
    if isinstance(instruction, FitIns) and instruction.mods:
        if model is None:
            with torch.random.fork_rng(devices=[]):
                model = task.build_model()
        local = parallel is None or parallel.plan.is_single_process
        context = ModContext(
            client_id=client_id,
            model=model if local else None,
            state=state.entry(client_id) if state is not None else None,
        )
        built = model
        return run_chain(
            instruction,
            context,
            lambda ins: cast(FitRes, _run_instruction(task, ins, client_id, model=built, parallel=parallel)),
        )
    return _run_instruction(task, instruction, client_id, model=model, parallel=parallel)


def _run_instruction(
    task: Task,
    instruction: Instruction,
    client_id: str,
    *,
    model: torch.nn.Module | None = None,
    parallel: ParallelTraining | None = None,
) -> FitRes | EvaluateRes:
    if model is None:
        with torch.random.fork_rng(devices=[]):  # the initial weights are overwritten; keep global RNG untouched
            model = task.build_model()
    load_parameters(model, instruction.parameters, round=instruction.round, client_id=client_id)
    try:
        if isinstance(instruction, FitIns):
            if parallel is not None and not parallel.plan.is_single_process:
                return _fit_parallel(parallel, instruction, client_id)
            return _fit(task, model, instruction, client_id)
        return _evaluate(task, model, instruction, client_id)
    except FedcoreError:
        raise
    except Exception as exc:
        raise ClientTaskError(
            f"the task raised {type(exc).__name__}: {exc}",
            round=instruction.round,
            client_id=client_id,
            stage=instruction.stage.value,
        ) from exc


def _fit(task: Task, model: torch.nn.Module, ins: FitIns, client_id: str) -> FitRes:
    seed = derive_seed(ins.seed, ins.round, client_id)
    generator = torch.Generator().manual_seed(seed)
    global_parameters = {n: p.detach().clone() for n, p in model.named_parameters()}
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "torch"))
        result: TrainResult = task.train(
            model,
            ins.config,
            TrainContext(
                round=ins.round, client_id=client_id, generator=generator, global_parameters=global_parameters
            ),
        )
    num_examples = _example_count(result.num_examples, round=ins.round, client_id=client_id, stage=Stage.FIT)
    fit_metrics = _metrics(result.metrics, round=ins.round, client_id=client_id, stage=Stage.FIT)
    updated = from_state_dict(model.state_dict())
    spec = {n: a.dtype for n, a in ins.parameters.items()}
    for name, array in updated.items():
        if array.dtype != spec[name]:
            raise PayloadError(
                f"the task changed the dtype of {name!r} from {spec[name]} to {array.dtype}",
                round=ins.round,
                client_id=client_id,
            )
    fit_metrics["fit_seconds"] = time.perf_counter() - started
    return FitRes(
        client_id=client_id,
        round=ins.round,
        parameters=updated,
        num_examples=num_examples,
        metrics=fit_metrics,
    )


def _fit_parallel(parallel: ParallelTraining, ins: FitIns, client_id: str) -> FitRes:
    from fedcore.engine import train_with_plan

    started = time.perf_counter()
    updated, result = train_with_plan(
        parallel.task_factory,
        parallel.task_context,
        ins.parameters,
        ins.config,
        parallel.plan,
        seed=ins.seed,
        round=ins.round,
        client_id=client_id,
        timeout_s=parallel.timeout_s,
    )
    num_examples = _example_count(result.num_examples, round=ins.round, client_id=client_id, stage=Stage.FIT)
    metrics = _metrics(result.metrics, round=ins.round, client_id=client_id, stage=Stage.FIT)
    metrics["fit_seconds"] = time.perf_counter() - started
    return FitRes(client_id=client_id, round=ins.round, parameters=updated, num_examples=num_examples, metrics=metrics)


def _evaluate(task: Task, model: torch.nn.Module, ins: EvaluateIns, client_id: str) -> EvaluateRes:
    result: EvalResult = task.evaluate(model, ins.batch_size)
    num_examples = _example_count(result.num_examples, round=ins.round, client_id=client_id, stage=Stage.EVALUATE)
    loss = metric_value(result.loss)
    if loss is None:  # not a number at all: a bug in the task; NaN/Inf are values the server leaves out and counts
        raise ClientTaskError(
            f"task.evaluate returned loss={bounded_repr(result.loss)} ({type(result.loss).__name__}); the loss must "
            "be a number",
            round=ins.round,
            client_id=client_id,
            stage=Stage.EVALUATE.value,
        )
    return EvaluateRes(
        client_id=client_id,
        round=ins.round,
        loss=loss,
        num_examples=num_examples,
        metrics=_metrics(result.metrics, round=ins.round, client_id=client_id, stage=Stage.EVALUATE),
    )


def _example_count(value: object, *, round: int, client_id: str, stage: Stage) -> int:
    """The task's example count as an int >= 0 (numpy and torch integers too).

    Raises:
        ClientTaskError: a bool, a float, a negative number or anything else.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        count = -1
    if count < 0:
        raise ClientTaskError(
            f"task.{'train' if stage is Stage.FIT else 'evaluate'} returned num_examples={bounded_repr(value)} "
            f"({type(value).__name__}); it must be an integer >= 0",
            round=round,
            client_id=client_id,
            stage=stage.value,
        )
    return count


def _metrics(metrics: object, *, round: int, client_id: str, stage: Stage) -> dict[str, float]:
    """The task's metrics as ``{str name: float}`` (see the module docstring); what is not a number is dropped.

    Raises:
        ClientTaskError: ``metrics`` is not a dict (a mapping).
    """
    if not isinstance(metrics, Mapping):
        raise ClientTaskError(
            f"the task returned metrics of type {type(metrics).__name__}; they must be a dict of name -> number",
            round=round,
            client_id=client_id,
            stage=stage.value,
        )
    kept: dict[str, float] = {}
    dropped: list[str] = []
    for key, raw in metrics.items():
        name = str(key)[:MAX_METRIC_NAME]
        value = metric_value(raw)
        if value is None or len(kept) >= MAX_METRICS - 1:  # one place is kept for fit_seconds
            dropped.append(f"{bounded_repr(name, 40)} ({type(raw).__name__})")
        else:
            kept[name] = value
    if dropped:
        log.warning(
            "round %d, %s: dropping %d metric(s) that are not numbers or beyond the first %d: %s",
            round,
            stage.value,
            len(dropped),
            MAX_METRICS - 1,
            ", ".join(dropped[:5]),
        )
    return kept
