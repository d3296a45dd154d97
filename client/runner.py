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

import itertools
import logging
import operator
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from client.mods import run_chain
from client.state import ClientStateStore
from fedcore.aggregation import metric_value
from fedcore.aggregation.blocks import drop_read, file_mapping
from fedcore.engine.launch import DEFAULT_TIMEOUT_S
from fedcore.engine.plan import ParallelPlan
from fedcore.errors import ClientTaskError, FedcoreError, PayloadError
from fedcore.messages import (
    MAX_EXAMPLES,
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
from fedcore.mods import ModContext, StageMachines
from fedcore.task import EvalResult, Task, TaskContext, check_engine_task
from fedcore.tensors import NamedArrays, TensorSpec, check_spec, from_state_dict, state_spec, to_state_dict
from fedcore.training import train_task

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
        ModelMismatch: names, shapes or dtypes differ from the model's state dict (the message names each side).
    """
    check_spec(parameters, state_spec(model.state_dict()), round=round, client_id=client_id, received_global=True)
    _copy_into(model, parameters)


COPY_BLOCK_BYTES = 4 << 20
"""A global model's tensor mapped read-only from a file is copied into the model this many bytes at a time, each
block's pages dropped from the process once copied (they stay in the file)."""


def _copy_into(model: torch.nn.Module, parameters: NamedArrays) -> None:
    """``model.load_state_dict(parameters, strict=True)``, with each tensor mapped read-only from a file (a
    simulation's global model between rounds, :func:`server.state.map_round_state`) copied block by block and its
    pages dropped from the resident set as it goes: the mapped global model is never resident whole beside the
    model it is copied into (a 20M-parameter model: 76 MiB less while a client's model is loaded). A tensor that
    ``load_state_dict`` might treat otherwise than a plain copy (one of tied weights, a model with load hooks, an
    array that is not C-contiguous or differs from the model's tensor in shape or dtype) is left to it."""
    with warnings.catch_warnings():  # arrays mapped read-only (a checkpoint, a payload) are copied, never written
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        state = to_state_dict(parameters)
        mapped = [name for name, array in parameters.items() if isinstance(array, np.memmap)]
        if mapped and not any(module._load_state_dict_pre_hooks for module in model.modules()):
            own = model.state_dict()
            storages = [tensor.untyped_storage().data_ptr() for tensor in own.values() if tensor.numel()]
            for name in mapped:
                array, source, target = parameters[name], state[name], own.get(name)
                if target is None or target.shape != source.shape or target.dtype != source.dtype:
                    continue  # load_state_dict copies it whole (or says what does not match)
                if not (array.flags.c_contiguous and target.is_contiguous()):
                    continue  # ``source`` is a copy (to_state_dict made it contiguous), or ``target`` is strided
                if target.numel() and storages.count(target.untyped_storage().data_ptr()) > 1:
                    continue  # tied weights: load_state_dict's order decides which value they keep
                flat = array.reshape(-1)
                if (handle := file_mapping(array, flat)) is None:
                    continue
                into, step = target.view(-1), max(1, COPY_BLOCK_BYTES // max(flat.itemsize, 1))
                for i, block in enumerate(source.view(-1).split(step)):
                    into[i * step : i * step + len(block)].copy_(block)
                    drop_read(handle, flat, i * step, i * step + len(block))
                state[name] = target  # in place already: load_state_dict's copy of a tensor onto itself does nothing
        model.load_state_dict(state, strict=True)


class ModelCache:
    """The task's model, built once and reused by every instruction (in simulation, by every client).

    Building and randomly initializing a model for each instruction only to overwrite its state costs more than
    the training of a small client. The cache keeps one model per kind of task: tasks whose class and model
    constructor (``task.model_fn`` where the task has one, e.g. :class:`~fedcore.supervised.SupervisedTask`) are
    equal share it, as :meth:`~fedcore.task.Task.build_model` promises the same architecture everywhere; a task
    of another kind replaces it (memory stays at one model), and one whose key cannot be hashed gets a fresh
    model each time.

    A reused model trains exactly as a fresh one, bit for bit: each instruction overwrites its whole state
    (parameters and buffers, e.g. BatchNorm statistics), and before it is handed out again every module's
    train/eval mode, every parameter's ``requires_grad`` and the buffers left out of the state dict
    (``persistent=False``) are put back as they were built, and gradients are dropped. The optimizer and the
    random streams come from the instruction. A task must not change the model's structure in ``train``
    (replace modules, register hooks): a model whose instruction failed is dropped and built again.

    The spec of the model's state and the last global model checked against it are kept, so the same global
    model (one per round, shared by a simulation's clients) is validated once.

    A trained model's state goes out as the update without a copy (:meth:`lend`): the update's arrays share the
    model's memory. The next :meth:`load` writes the new global model into that memory only where nothing holds
    the lent arrays any more (the round loop folded the update and dropped it, as the in-memory pool does); a
    tensor whose update is still held (kept by a robust aggregator, a stage's state, the caller) gets new memory
    first, so a lent update never changes. While a simulation's client trains, the memory is then the model and
    its gradients, and after training the update alone, rather than the model and a copy of it beside it.

    Args:
        device: where the models it builds go (``model.to(device)`` once, when built); None leaves them where
            the task builds them (the CPU). The global model is copied onto it at each load; an update of a
            model on another device than the CPU is copied back (only CPU memory can be lent).
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._device = torch.device(device) if device is not None else None
        self._key: object = None
        self._model: torch.nn.Module | None = None
        self._spec: tuple[TensorSpec, ...] = ()
        self._modes: list[tuple[torch.nn.Module, bool]] = []
        self._requires_grad: list[tuple[torch.nn.Parameter, bool]] = []
        self._extra_buffers: list[tuple[torch.nn.Module, str, torch.Tensor | None]] = []
        self._checked: tuple[tuple[str, weakref.ref[np.ndarray]], ...] = ()
        self._lent: list[tuple[torch.Tensor, weakref.ref[torch.Tensor]]] = []
        self._released: list[tuple[torch.Tensor, torch.Size]] = []

    def load(self, task: Task, parameters: NamedArrays, *, round: int, client_id: str) -> torch.nn.Module:
        """A model of ``task``'s architecture holding ``parameters``: the cached one when it fits, else built.

        Raises:
            PayloadError: names, shapes or dtypes of ``parameters`` differ from the model's state dict.
        """
        key = _model_key(task)
        model = self._model
        if model is None or key is None or key != self._key:
            self.discard()
            model = _build(task)
            if self._device is not None:
                model.to(self._device)
            if key is None:  # cannot be told apart from other tasks' models: not kept
                load_parameters(model, parameters, round=round, client_id=client_id)
                return model
            self._remember(key, model)
        else:
            self._restore()
            self._reclaim()
        if not self._is_checked(parameters):
            check_spec(parameters, self._spec, round=round, client_id=client_id, received_global=True)
            # weak references to the arrays themselves: no other arrays can pass for them, and a global model the
            # server has replaced is not kept alive here (it would be a model-sized copy beside the next one)
            try:
                self._checked = tuple((name, weakref.ref(array)) for name, array in parameters.items())
            except TypeError:  # a value that takes no weak reference: checked again next time
                self._checked = ()
        _copy_into(model, parameters)
        return model

    def discard(self) -> None:
        """Drop the cached model (after a failed instruction: the task may have left it changed)."""
        self._key, self._model, self._spec, self._checked = None, None, (), ()
        self._modes, self._requires_grad, self._extra_buffers, self._lent, self._released = [], [], [], [], []

    def lend(self, model: torch.nn.Module) -> NamedArrays:
        """``model``'s state as ``state_dict`` name -> numpy array, sharing the model's memory where it can.

        Only the cache's own model lends (any other is copied, as :func:`fedcore.tensors.from_state_dict` does);
        of its state, the contiguous CPU tensors that are a parameter's or buffer's own memory, which numpy can
        hold. The arrays stay as they are until nothing refers to them (see the class docstring); a caller may
        change them in place, which changes nothing but the lent memory.

        Raises:
            PayloadError: a tensor is bfloat16, which numpy cannot hold.
        """
        state = model.state_dict()
        if model is not self._model:
            return from_state_dict(state)
        owners = _own_memory(model, state)
        arrays: NamedArrays = {}
        for name, value in state.items():
            owner = owners[name]
            array = value.detach().numpy() if owner is not None else None
            if owner is None or array is None or not isinstance(array.base, torch.Tensor):
                arrays[name] = from_state_dict({name: value})[name]
                continue
            # every array made from this one refers to its base (the tensor numpy holds): while any is alive,
            # the update is held
            self._lent.append((owner, weakref.ref(array.base)))
            arrays[name] = array
        return arrays

    def release(self) -> None:
        """Free the cached model's memory until the next :meth:`load` (which gives it new memory first).

        Between rounds of a simulation the model is not needed: without this it would sit beside the server's
        step (the new global model, the optimizer's state). A lent update that is still held keeps its memory.
        Only the state's tensors that :meth:`lend` would lend are freed; the model's structure stays.
        """
        model = self._model
        if model is None:
            return
        freed: set[int] = {id(owner) for owner, _ in self._released}
        for owner in _own_memory(model, model.state_dict()).values():
            if owner is not None and id(owner) not in freed:
                self._released.append((owner, owner.shape))
                owner.data = torch.empty(0, dtype=owner.dtype, device=owner.device)
                freed.add(id(owner))

    def _reclaim(self) -> None:
        """Before a load: new memory for the released tensors, and for each tensor whose lent array is still held,
        so that the load cannot change a lent update."""
        moved: set[int] = set()
        for owner, shape in self._released:
            owner.data = torch.empty(shape, dtype=owner.dtype, device=owner.device)
            moved.add(id(owner))
        for owner, held in self._lent:
            if held() is not None and id(owner) not in moved:
                owner.data = torch.empty_like(owner)
                moved.add(id(owner))
        self._lent, self._released = [], []

    def _is_checked(self, parameters: NamedArrays) -> bool:
        """Whether ``parameters`` holds exactly the array objects last checked against the spec, by name."""
        if len(parameters) != len(self._checked) or not self._checked:
            return False
        return all(parameters.get(name) is ref() for name, ref in self._checked)

    def _remember(self, key: object, model: torch.nn.Module) -> None:
        self._key, self._model = key, model
        self._spec = state_spec(model.state_dict())
        self._modes = [(module, module.training) for module in model.modules()]
        self._requires_grad = [(p, p.requires_grad) for p in model.parameters()]
        self._extra_buffers = [
            (module, name, None if buffer is None else buffer.detach().clone())
            for module in model.modules()
            for name, buffer in module.named_buffers(prefix="", recurse=False)
            if name in module._non_persistent_buffers_set
        ]

    def _restore(self) -> None:
        for module, training in self._modes:
            if module.training != training:  # nn.Module.__setattr__ is slow; usually nothing changed
                module.training = training
        for param, flag in self._requires_grad:
            param.grad = None
            if param.requires_grad != flag:
                param.requires_grad_(flag)
        with torch.no_grad():
            for module, name, value in self._extra_buffers:
                current = getattr(module, name)
                if (
                    value is not None
                    and current is not None
                    and current.shape == value.shape
                    and current.dtype == value.dtype
                ):
                    current.copy_(value)
                else:
                    setattr(module, name, None if value is None else value.clone())


def _own_memory(model: torch.nn.Module, state: Mapping[str, object]) -> dict[str, torch.Tensor | None]:
    """For each entry of ``model``'s ``state`` (its ``state_dict()``), the parameter or buffer whose own memory it
    is, where an array can share it: a contiguous CPU tensor numpy can hold (not bfloat16, not empty), with the
    owner's shape, in memory no other parameter or buffer starts at; else None (the entry must be copied)."""
    owners: dict[int, torch.Tensor] = {}
    shared: set[int] = set()  # memory two tensors start at (one a view of the other): copied, not lent
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        address = tensor.data_ptr()
        if address in owners and owners[address] is not tensor:
            shared.add(address)
        owners[address] = tensor
    found: dict[str, torch.Tensor | None] = {}
    for name, value in state.items():
        owner = owners.get(value.data_ptr()) if isinstance(value, torch.Tensor) else None
        ok = (
            isinstance(value, torch.Tensor)
            and owner is not None
            and value.data_ptr() not in shared
            and value.device.type == "cpu"
            and value.dtype != torch.bfloat16
            and value.numel() > 0
            and value.is_contiguous()
            and value.shape == owner.shape
        )
        found[name] = owner if ok else None
    return found


def _model_key(task: Task) -> object:
    """What identifies the model ``task`` builds: its class and model constructor; None when not hashable."""
    key = (type(task), getattr(task, "model_fn", None))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _build(task: Task) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):  # the initial weights are overwritten; keep global RNG untouched
        return task.build_model()


def run_instruction(
    task: Task,
    instruction: Instruction,
    client_id: str,
    *,
    model: torch.nn.Module | None = None,
    models: ModelCache | None = None,
    parallel: ParallelTraining | None = None,
    state: ClientStateStore | None = None,
    stages: StageMachines | None = None,
) -> FitRes | EvaluateRes:
    """Execute one instruction with ``task`` on this client.

    A fit instruction that declares client mods runs through their chain (:func:`client.mods.run_chain`), with
    the training below at its end.

    Args:
        task: the user's task for this client's data.
        instruction: :class:`FitIns` (train one round) or :class:`EvaluateIns`.
        client_id: this client's id (keys its random streams together with the seed and round).
        model: a model of the task's architecture to reuse (its state is overwritten).
        models: where to take the model from and keep it for the next instruction (:class:`ModelCache`); used
            when ``model`` is None. Without either, a model is built for this instruction.
        parallel: train fit instructions under this parallel plan (evaluation stays in-process); the task must
            then fit the engine's contract (:class:`~fedcore.task.EngineTask`).
        state: the clients' persistent state (:class:`client.state.ClientStateStore`), which mods use; None when
            this client keeps none.
        stages: the client's round protocol state machines (:class:`client.stages.ClientStages`), which mods
            acting for a protocol use (SecAgg+'s masking); None when it answers none.

    Returns:
        :class:`FitRes` with the trained parameters in the global model's names and dtypes, or
        :class:`EvaluateRes`.

    Raises:
        PayloadError: the global parameters do not fit the task's model.
        ConfigError: a parallel plan was given for a task that does not fit the engine's contract.
        ClientTaskError: the task raised, returned an example count that is not an integer >= 0, a loss that is not
            a number, or metrics that are not a dict.
        EngineError: a parallel worker failed (names the rank and the cause).
        ConfigError: a declared client mod is unknown or refuses its parameters.
    """
    if parallel is not None and (parallel.plan.is_single_process or not isinstance(instruction, FitIns)):
        parallel = None  # a plan of all ones trains in-process; evaluation always does
    if isinstance(instruction, FitIns) and instruction.mods:
        if model is None and parallel is None:  # the mods see the model that trains (hooks, names)
            if models is not None:
                model = models.load(task, instruction.parameters, round=instruction.round, client_id=client_id)
            else:
                model = _build(task)
        context = ModContext(
            client_id=client_id,
            model=model,
            state=state.entry(client_id) if state is not None else None,
            stages=stages,
        )
        built = model
        try:
            return run_chain(
                instruction,
                context,
                lambda ins: cast(
                    FitRes, _run_instruction(task, ins, client_id, model=built, models=models, parallel=parallel)
                ),
            )
        except BaseException:
            if models is not None:
                models.discard()  # a mod may have left the model half changed
            raise
    return _run_instruction(task, instruction, client_id, model=model, models=models, parallel=parallel)


def _run_instruction(
    task: Task,
    instruction: Instruction,
    client_id: str,
    *,
    model: torch.nn.Module | None = None,
    models: ModelCache | None = None,
    parallel: ParallelTraining | None = None,
) -> FitRes | EvaluateRes:
    if parallel is not None:
        check_engine_task(task, round=instruction.round, client_id=client_id)
    try:
        if model is not None:
            load_parameters(model, instruction.parameters, round=instruction.round, client_id=client_id)
        elif models is not None:
            model = models.load(task, instruction.parameters, round=instruction.round, client_id=client_id)
        else:
            model = _build(task)
            load_parameters(model, instruction.parameters, round=instruction.round, client_id=client_id)
        if isinstance(instruction, FitIns):
            if parallel is not None:
                return _fit_parallel(task, parallel, instruction, client_id)
            return _fit(task, model, instruction, client_id, models)
        return _evaluate(task, model, instruction, client_id)
    except BaseException as exc:
        if models is not None:
            models.discard()  # the task may have left the model half changed
        if isinstance(exc, FedcoreError) or not isinstance(exc, Exception):
            raise
        raise _task_error(exc, instruction, client_id) from exc


def _task_error(exc: Exception, instruction: Instruction, client_id: str) -> ClientTaskError:
    return ClientTaskError(
        f"the task raised {type(exc).__name__}: {exc}",
        round=instruction.round,
        client_id=client_id,
        stage=instruction.stage.value,
    )


def _returned(result: object, ins: Instruction, client_id: str) -> None:
    """Refuse what ``task.train`` (a fit) or ``task.evaluate`` (an evaluation) returned when it is not a
    :class:`~fedcore.task.TrainResult` / :class:`~fedcore.task.EvalResult` (``None``: a ``return`` forgotten; a
    tuple: Flower's ``fit`` convention), rather than failing on its first missing field.

    Raises:
        ClientTaskError: naming the method, what it returned and what it must return.
    """
    fit = isinstance(ins, FitIns)
    fields = ("num_examples", "metrics") if fit else ("loss", "num_examples", "metrics")
    if all(hasattr(result, name) for name in fields):
        return
    method, kind = ("task.train", "a TrainResult") if fit else ("task.evaluate", "an EvalResult")
    raise ClientTaskError(
        f"{method} returned {bounded_repr(result)} ({type(result).__name__}), not {kind}; it must return "
        f"{kind.split()[1]}({', '.join(f'{name}=...' for name in fields)}) (fedcore.task)",
        round=ins.round,
        client_id=client_id,
        stage=ins.stage.value,
    )


def _fit(task: Task, model: torch.nn.Module, ins: FitIns, client_id: str, models: ModelCache | None) -> FitRes:
    started = time.perf_counter()
    result = train_task(task, model, ins.config, ins.parameters, seed=ins.seed, round=ins.round, client_id=client_id)
    _returned(result, ins, client_id)
    num_examples = _example_count(result.num_examples, round=ins.round, client_id=client_id, stage=Stage.FIT)
    for param in model.parameters():  # the gradients are done with: not held beside the update
        param.grad = None
    # the cache's own model lends its memory to the update (no copy); any other model's state is copied
    updated = models.lend(model) if models is not None else from_state_dict(model.state_dict())
    for name, array in updated.items():
        expected = ins.parameters[name].dtype
        if array.dtype != expected:
            raise PayloadError(
                f"the task changed the dtype of {name!r} from {expected} to {array.dtype}",
                round=ins.round,
                client_id=client_id,
            )
    reported: object = result.metrics
    if ins.config.report_validation and isinstance(reported, Mapping):
        training = model.training
        reported = {**reported, **validation_metrics(task.evaluate(model, ins.config.batch_size))}
        model.train(training)  # a reused model goes to the next client as the task left it
    fit_metrics = _metrics(reported, round=ins.round, client_id=client_id, stage=Stage.FIT)
    fit_metrics["fit_seconds"] = time.perf_counter() - started
    return FitRes(
        client_id=client_id,
        round=ins.round,
        parameters=updated,
        num_examples=num_examples,
        metrics=fit_metrics,
    )


def validation_metrics(result: EvalResult) -> dict[str, object]:
    """A client's evaluation of its trained model as fit metrics (``FitConfig.report_validation``): ``val_loss``
    and ``val_<name>`` for each of its metrics; nothing from an evaluation on 0 examples."""
    if isinstance(result.num_examples, bool) or not isinstance(result.num_examples, int) or result.num_examples <= 0:
        return {}
    metrics = result.metrics if isinstance(result.metrics, Mapping) else {}
    return {"val_loss": result.loss, **{f"val_{key}": value for key, value in metrics.items()}}


def _fit_parallel(task: Task, parallel: ParallelTraining, ins: FitIns, client_id: str) -> FitRes:
    from fedcore.engine import train_with_plan

    if ins.config.report_validation:
        raise ClientTaskError(
            "train.report_validation evaluates the trained model in this process, which a parallel training plan "
            "does not keep; run this client without --parallel or turn report_validation off",
            round=ins.round,
            client_id=client_id,
            stage=Stage.FIT.value,
        )
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
        task=task,
    )
    num_examples = _example_count(result.num_examples, round=ins.round, client_id=client_id, stage=Stage.FIT)
    metrics = _metrics(result.metrics, round=ins.round, client_id=client_id, stage=Stage.FIT)
    metrics["fit_seconds"] = time.perf_counter() - started
    return FitRes(client_id=client_id, round=ins.round, parameters=updated, num_examples=num_examples, metrics=metrics)


def _evaluate(task: Task, model: torch.nn.Module, ins: EvaluateIns, client_id: str) -> EvaluateRes:
    result: EvalResult = task.evaluate(model, ins.batch_size)
    _returned(result, ins, client_id)
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
        ClientTaskError: a bool, a float, a number outside 0..:data:`~fedcore.messages.MAX_EXAMPLES` or anything
            else.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        count = -1
    if not 0 <= count <= MAX_EXAMPLES:
        raise ClientTaskError(
            f"task.{'train' if stage is Stage.FIT else 'evaluate'} returned num_examples={bounded_repr(value)} "
            f"({type(value).__name__}); it must be an integer in 0..2**63-1",
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
