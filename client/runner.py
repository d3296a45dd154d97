"""The client-side runner: the one function that turns an instruction into a reply.

The gRPC daemon calls it after pulling a task; the simulation's virtual clients call it directly. Both get the
same numbers for the same (seed, round, client), because every random draw inside is keyed by them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from fedcore.engine.launch import DEFAULT_TIMEOUT_S
from fedcore.engine.plan import ParallelPlan
from fedcore.errors import ClientTaskError, FedcoreError, PayloadError
from fedcore.messages import EvaluateIns, EvaluateRes, FitIns, FitRes, Instruction, Stage
from fedcore.seeding import derive_seed
from fedcore.task import EvalResult, Task, TaskContext, TrainContext, TrainResult
from fedcore.tensors import NamedArrays, check_spec, from_state_dict, state_spec, to_state_dict


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
) -> FitRes | EvaluateRes:
    """Execute one instruction with ``task`` on this client.

    Args:
        task: the user's task for this client's data.
        instruction: :class:`FitIns` (train one round) or :class:`EvaluateIns`.
        client_id: this client's id (keys its random streams together with the seed and round).
        model: a model of the task's architecture to reuse (its state is overwritten); built if None.
        parallel: train fit instructions under this parallel plan (evaluation stays in-process).

    Returns:
        :class:`FitRes` with the trained parameters in the global model's names and dtypes, or
        :class:`EvaluateRes`.

    Raises:
        PayloadError: the global parameters do not fit the task's model.
        ClientTaskError: the task raised, returned a negative example count or a non-finite loss.
        EngineError: a parallel worker failed (names the rank and the cause).
    """
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
    if result.num_examples < 0:
        raise ClientTaskError(
            f"task.train returned num_examples={result.num_examples}; it must be >= 0",
            round=ins.round,
            client_id=client_id,
            stage=Stage.FIT.value,
        )
    updated = from_state_dict(model.state_dict())
    spec = {n: a.dtype for n, a in ins.parameters.items()}
    for name, array in updated.items():
        if array.dtype != spec[name]:
            raise PayloadError(
                f"the task changed the dtype of {name!r} from {spec[name]} to {array.dtype}",
                round=ins.round,
                client_id=client_id,
            )
    metrics = dict(result.metrics)
    metrics["fit_seconds"] = time.perf_counter() - started
    return FitRes(
        client_id=client_id,
        round=ins.round,
        parameters=updated,
        num_examples=result.num_examples,
        metrics=metrics,
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
    metrics = dict(result.metrics)
    metrics["fit_seconds"] = time.perf_counter() - started
    return FitRes(
        client_id=client_id, round=ins.round, parameters=updated, num_examples=result.num_examples, metrics=metrics
    )


def _evaluate(task: Task, model: torch.nn.Module, ins: EvaluateIns, client_id: str) -> EvaluateRes:
    result: EvalResult = task.evaluate(model, ins.batch_size)
    if result.num_examples < 0 or (result.num_examples > 0 and not math.isfinite(result.loss)):
        raise ClientTaskError(
            f"task.evaluate returned loss={result.loss}, num_examples={result.num_examples}",
            round=ins.round,
            client_id=client_id,
            stage=Stage.EVALUATE.value,
        )
    return EvaluateRes(
        client_id=client_id,
        round=ins.round,
        loss=result.loss,
        num_examples=result.num_examples,
        metrics=dict(result.metrics),
    )
