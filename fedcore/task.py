"""The Task contract: what a user implements once, and what simulation and deployment both call.

A *task* knows how to build the model, train it on the local data for one round, and evaluate it. The same
task object is driven by the client-side runner (:mod:`client.runner`) whether the instruction came from the
in-memory simulation pool or from the gRPC daemon, so a task never sees the transport.

A *task factory* ``Callable[[TaskContext], Task]`` makes the task for one client (its data shard) or for the
server (initial model, optional centralized evaluation on a held-out set). ``fedcore client --task mod:attr``
and ``fedcore server --task mod:attr`` name such a factory.

Example::

    def make_task(ctx: TaskContext) -> Task:
        x, y = load_my_hospital_data(ctx.data_dir)
        return SupervisedTask(model_fn=MyNet, train_data=(x, y), test_data=None)
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, cast, runtime_checkable

import torch

from fedcore.config import scalar_fields
from fedcore.errors import ConfigError, FedcoreError
from fedcore.seeding import derive_seed
from fedcore.tensors import NamedArrays, from_state_dict, to_state_dict

FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: a training setting beyond it cannot multiply a float32 tensor."""


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    """Local training settings the server sends with each fit instruction.

    Attributes:
        local_epochs: passes over the local data per round (E in McMahan et al. 2017). >= 1.
        batch_size: local mini-batch size (B). >= 1.
        lr: local SGD learning rate (eta_l). > 0.
        momentum: local SGD momentum in [0, 1).
        weight_decay: L2 penalty coefficient, >= 0.
        mu: FedProx proximal coefficient (Li et al. 2020): adds ``mu/2 * ||w - w_global||^2`` to the local loss.
            0 gives plain FedAvg local training.
        max_steps: optional cap on local optimizer steps per round (None = no cap).
        report_validation: after training, evaluate the trained model on the client's held-out data (the task's
            evaluate, at batch_size) and report ``val_loss`` and ``val_<metric>`` (e.g. ``val_accuracy``) with the
            update, for quality weighting by a client-reported metric (``weighting = "metric"``). Not under a
            parallel training plan.
    """

    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    mu: float = 0.0
    max_steps: int | None = None
    report_validation: bool = False

    def __post_init__(self) -> None:
        for f in scalar_fields(type(self)):  # every float setting, declared once (the dataclass's fields)
            value = getattr(self, f.name)
            if f.kind is float and value is not None and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}")
            if f.kind is float and value is not None and abs(value) > FLOAT32_MAX:  # torch's float32 step overflows
                raise ConfigError(f"{f.name} must be within float32's range (at most {FLOAT32_MAX:.4g}), got {value}")
        if self.local_epochs < 1:
            raise ConfigError(f"local_epochs must be >= 1, got {self.local_epochs}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.mu < 0:
            raise ConfigError(f"mu (FedProx proximal coefficient) must be >= 0, got {self.mu}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1 or unset, got {self.max_steps}")


@dataclass(frozen=True, kw_only=True)
class TaskContext:
    """Who a task is being made for.

    Attributes:
        role: ``"client"`` (a data holder) or ``"server"`` (initial model, centralized evaluation).
        client_id: the client's identity (empty for the server).
        partition_id: for built-in demo data: which shard this client holds (0-based), else None.
        num_partitions: for built-in demo data: how many shards the dataset is split into, else None.
        data_dir: where the task should look for its data, if the user gave one.
        seed: the run's seed (for data splits that must agree between server and clients).
        options: free-form string options from the CLI/TOML (``--task-option key=value``).
    """

    role: Literal["client", "server"] = "client"
    client_id: str = ""
    partition_id: int | None = None
    num_partitions: int | None = None
    data_dir: Path | None = None
    seed: int = 0
    options: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TrainContext:
    """Per-call context the runner gives :meth:`Task.train`.

    Attributes:
        round: the federated round (1-based).
        client_id: the client being trained.
        generator: a ``torch.Generator`` seeded from (seed, round, client): use it for shuffling.
        global_parameters: the global model's parameters as received this round (for proximal terms),
            ``name -> tensor`` on the model's device, not to be modified.
    """

    round: int
    client_id: str
    generator: torch.Generator
    global_parameters: Mapping[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What :meth:`Task.train` returns besides the trained model.

    Attributes:
        num_examples: local training examples (the FedAvg weight n_k), >= 0.
        metrics: scalar metrics, e.g. ``{"train_loss": 0.41}`` (mean loss over the last epoch).
    """

    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """What :meth:`Task.evaluate` returns.

    Attributes:
        loss: mean loss per example.
        num_examples: evaluation examples, >= 0.
        metrics: scalar metrics, e.g. ``{"accuracy": 0.87}``.
    """

    loss: float
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    """The contract a user implements once; simulation and deployment both call it."""

    def build_model(self) -> torch.nn.Module:
        """Return a freshly initialized model. All clients and the server must build the same architecture."""
        ...

    def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        """Train ``model`` in place on the local data for one round under ``config``.

        Must honour ``config.mu`` (FedProx): :func:`fedcore.training.train_supervised` does.
        """
        ...

    def evaluate(self, model: torch.nn.Module, batch_size: int) -> EvalResult:
        """Evaluate ``model`` on the local held-out data (or the server's test set)."""
        ...


@dataclass(frozen=True)
class DeclaredMetrics:
    """The metric names a task declares it reports, so that a setting that reads one (the weighting metric,
    :mod:`fedcore.aggregation.weights`) is checked before the first round rather than in it.

    A task declares them with the class attributes ``fit_metric_names`` (the keys of :attr:`TrainResult.metrics`
    its ``train`` returns) and ``eval_metric_names`` (those of :attr:`EvalResult.metrics` from ``evaluate``), each
    a tuple of strings; :class:`fedcore.supervised.SupervisedTask` declares ``("train_loss",)`` and
    ``("accuracy",)``. Read them with :func:`declared_metrics`.

    Attributes:
        fit: what ``train`` reports, e.g. ``("train_loss",)``.
        evaluate: what ``evaluate`` reports besides its loss, e.g. ``("accuracy",)``.
    """

    fit: tuple[str, ...]
    evaluate: tuple[str, ...]


def declared_metrics(task: object) -> DeclaredMetrics | None:
    """The metric names ``task`` (a task or a task class) declares (see :class:`DeclaredMetrics`), or None when it
    declares none that can be
    trusted: no ``fit_metric_names`` / ``eval_metric_names``, names that are not a tuple of strings, or a class that
    overrides ``train`` or ``evaluate`` below the class that declared the names (its own loop may report others).
    """
    cls = task if isinstance(task, type) else type(task)
    found: list[tuple[str, ...]] = []
    for attr, method in (("fit_metric_names", "train"), ("eval_metric_names", "evaluate")):
        names = getattr(cls, attr, None)
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
            return None
        declaring = next(c for c in cls.__mro__ if attr in vars(c))
        defining = next((c for c in cls.__mro__ if method in vars(c)), None)
        if defining is not None and defining is not declaring and issubclass(defining, declaring):
            return None  # train/evaluate overridden below the declaration
        found.append(names)
    return DeclaredMetrics(fit=found[0], evaluate=found[1])


LossFn = Callable[..., torch.Tensor]
"""``loss_fn(output, target, reduction="mean" | "sum") -> scalar tensor``, like ``nn.functional.cross_entropy``."""


@runtime_checkable
class EngineTask(Task, Protocol):
    """A task the training engine (:mod:`fedcore.engine`) may train itself: it declares its model, data and loss.

    Under a parallel plan the engine does not call :meth:`Task.train`: it builds the model with
    :meth:`~Task.build_model` in every worker and runs its own loop, which equals
    :func:`fedcore.training.train_supervised` over ``training_data()`` with ``loss_fn`` (mini-batch SGD with
    momentum, weight decay and FedProx's ``mu``). A task declares that this is its training by providing both
    members below in the class that defines its ``train`` (:class:`fedcore.supervised.SupervisedTask` does).
    A task without them, or a subclass that overrides ``train`` below the class that declared them, has its own
    loop: it runs as-is on one device and is refused under a parallel plan (:func:`check_engine_task`).
    """

    @property
    def loss_fn(self) -> LossFn:
        """``loss_fn(output, target, reduction=...)``: the per-batch loss (mean over the batch by default)."""
        ...

    def training_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The local training tensors ``(x, y)``: inputs ``(N, ...)`` and targets ``(N,)``, on the CPU."""
        ...


def engine_task_problem(task: object) -> str | None:
    """Why the engine cannot train ``task`` (see :class:`EngineTask`), or None when it can.

    The answer says what to add or change. It depends only on the task's class, except for ``loss_fn``, which
    may be set per instance.
    """
    name = type(task).__name__
    missing = []
    if not callable(getattr(task, "training_data", None)):
        missing.append("a training_data() method returning the local (x, y) tensors")
    if not callable(getattr(task, "loss_fn", None)):
        missing.append("a loss_fn(output, target, reduction=...) attribute")
    if missing:
        return (
            f"{name} has its own training loop: it lacks {' and '.join(missing)}, which the engine trains "
            "(fedcore.supervised.SupervisedTask provides both)"
        )
    loss_fn = getattr(task, "loss_fn")  # noqa: B009  (a property of the instance, checked callable above)
    if not _accepts_reduction(loss_fn):
        return (
            f"{name}'s loss_fn {getattr(loss_fn, '__name__', type(loss_fn).__name__)} takes no reduction argument: "
            "the engine calls loss_fn(output, target, reduction='sum') to add up the parts of a batch exactly; give "
            "it a reduction parameter ('mean' and 'sum', as nn.functional.cross_entropy has)"
        )
    declaring = next(c for c in type(task).__mro__ if "training_data" in vars(c))
    trainer = next((c for c in type(task).__mro__ if "train" in vars(c)), None)
    if trainer is not None and trainer is not declaring and issubclass(trainer, declaring):
        return (
            f"{name} overrides train() of {declaring.__name__}: that is its own training loop, which the engine "
            f"would replace by its standard loop over training_data() and loss_fn; drop the override, or put the "
            "change in the model or the loss"
        )
    return None


def _accepts_reduction(fn: Callable[..., object]) -> bool:
    """Whether ``fn`` can be called with ``reduction=`` (a parameter of that name, or ``**kwargs``); True where its
    signature cannot be read (a builtin), which is then left to fail when called."""
    try:  # a loss module is called through forward (its __call__ takes anything)
        parameters = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn).parameters
    except (TypeError, ValueError):
        return True
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    reduction = parameters.get("reduction")
    return (reduction is not None and reduction.kind in keyword) or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def check_engine_task(task: object, *, round: int | None = None, client_id: str | None = None) -> EngineTask:
    """Return ``task`` as an :class:`EngineTask`, or refuse it.

    Raises:
        ConfigError: the task does not fit the engine's contract (:func:`engine_task_problem` says why); the
            message says what to add, or to train without a parallel plan, where ``train`` runs as-is.
    """
    problem = engine_task_problem(task)
    if problem is not None:
        raise ConfigError(
            f"a parallel plan cannot train this task: {problem}. Or run it without a parallel plan (--parallel): "
            "its own train() then runs as-is on one device",
            round=round,
            client_id=client_id,
        )
    return cast(EngineTask, task)


TaskFactory = Callable[[TaskContext], Task]
"""Makes the task for one client or for the server."""


def load_task_factory(spec: str) -> TaskFactory:
    """Resolve ``"package.module:attr"`` to a task factory.

    Raises:
        ConfigError: the string is not ``module:attr``, the module cannot be imported (not found, or its own
            code raised, or has a syntax error, at import: the message says where), or the attribute is missing or
            not callable.
    """
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"task must be given as 'module:attr' (e.g. 'simulations.tasks:fashion_cnn'), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None
        if missing and (module_name == exc.name or module_name.startswith(f"{exc.name}.")):  # not found itself
            raise ConfigError(
                f"cannot import task module {module_name!r}: {exc}. Install the package that holds it (pip install), "
                "or put the directory that holds it on PYTHONPATH (e.g. PYTHONPATH=. for a module in the current "
                "directory), for the server and for each client daemon"
            ) from exc
        raise ConfigError(f"cannot import task module {module_name!r}: importing it raised {exc!r}") from exc
    except (Exception, SystemExit) as exc:  # the module's own code failed: a syntax error, a bug, a missing file
        raise ConfigError(_import_failure(module_name, exc)) from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ConfigError(f"{module_name!r} has no callable {attr!r}; a task factory takes a TaskContext")
    return factory


def _import_failure(module_name: str, exc: BaseException) -> str:
    """The message for a task module whose import raised ``exc`` (not an ImportError): what, and where in the
    user's code (the traceback goes to the ``fedcore.task`` log at DEBUG, shown by ``fedcore -v``)."""
    import traceback

    logging.getLogger("fedcore.task").debug("importing the task module %s raised", module_name, exc_info=exc)
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename}, line {exc.lineno}" if exc.filename else "its source"
        what = f"a syntax error in {where}: {exc.msg}"
    elif isinstance(exc, SystemExit):
        what = f"it called sys.exit({exc.code!r})"
    else:
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {frames[-1].filename}, line {frames[-1].lineno}" if frames else ""
        what = f"its code raised {type(exc).__name__}{where}: {str(exc)[:300]}"
    return (
        f"cannot import task module {module_name!r}: {what}. Fix the module (fedcore -v shows the traceback); "
        "--task is imported by the server, by each client daemon and by fedcore simulate"
    )


def build_server_task(factory: TaskFactory, context: TaskContext, *, spec: str) -> Task:
    """The server's task: ``factory(context)``, with what it raises or returns wrong made a clear error (the
    factory's own traceback goes to the ``fedcore.task`` log at DEBUG, shown by ``fedcore -v``).

    Args:
        factory: the task factory (:func:`load_task_factory` of ``spec``).
        context: the server's context (``role="server"``).
        spec: the factory's ``module:attr``, for the message.

    Raises:
        ConfigError: the factory raised (not a fedcore error, which passes through), or returned no
            :class:`Task` (no ``build_model``, e.g. ``--task`` names a function that is not a task factory).
    """
    try:
        task = factory(context)
    except FedcoreError:
        raise
    except Exception as exc:  # a bug in the user's factory, or a callable that is not one
        logging.getLogger("fedcore.task").debug("the task factory %s raised", spec, exc_info=True)
        raise ConfigError(
            f"the task factory {spec!r} raised {type(exc).__name__} building the server's task: "
            f"{str(exc)[:300]}; --task must name a function taking a TaskContext and returning a Task "
            "(fedcore -v shows the traceback)"
        ) from None
    if not callable(getattr(task, "build_model", None)):
        raise ConfigError(
            f"the task factory {spec!r} returned a {type(task).__name__}, not a Task (it has no build_model); "
            "--task must name a function taking a TaskContext and returning a Task"
        )
    return task


def initial_parameters(model_fn: Callable[[], torch.nn.Module], seed: int) -> NamedArrays:
    """The initial global model, initialized from a generator keyed by (seed, "init").

    Simulation and deployment both start from it, so the same seed starts them alike. The model's tensors are
    copied to numpy one by one, each freed once copied: about 1x the model at peak, not 2x.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "init"))
        state = model_fn().state_dict()  # the model itself is dropped here; its tensors live on in ``state``
    return {name: from_state_dict({name: state.pop(name)})[name] for name in list(state)}


def trainable_names(model: torch.nn.Module | Callable[[], torch.nn.Module]) -> frozenset[str] | None:
    """The state-dict names of ``model``'s trainable parameters: what the server optimizer steps.

    Trainable: ``model.named_parameters()`` with ``requires_grad`` (tied parameters under every name they have
    in the state dict). Everything else in the state dict, buffers (BatchNorm running statistics and
    ``num_batches_tracked``) and frozen parameters, takes the clients' example-weighted average instead
    (:mod:`fedcore.server_opt`).

    Args:
        model: the model, or a constructor of it (``Task.build_model``), which is then called on the meta device
            (no memory, no initialization, global random state untouched; a constructor that cannot run there,
            e.g. one that loads weights from a file, is called normally under a forked random state).

    Returns:
        The names, or None when the model has no parameters at all: a model made only of buffers (the unnamed
        arrays of a Flower ``NumPyClient``, :class:`client.flower.FlowerParameters`) says nothing about which
        arrays are trained, and then every floating tensor is taken as trainable, as flwr's FedOpt strategies do.

    Raises:
        ConfigError: the constructor raised, or did not return a ``torch.nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        model = _build_cheaply(model)
    names = frozenset(name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad)
    if not names and not any(True for _ in model.parameters()):
        return None
    return names


def state_elements(model_fn: Callable[[], torch.nn.Module]) -> int:
    """The number of elements of the state dict of the model ``model_fn`` builds (parameters and buffers, a tied
    tensor once), built on the meta device where the constructor allows (no memory, no initialization, global
    random state untouched)."""
    state = _build_cheaply(model_fn).state_dict(keep_vars=True)
    tensors = {id(t): t for t in state.values() if isinstance(t, torch.Tensor)}  # not a module's extra state
    return sum(t.numel() for t in tensors.values())


def _build_cheaply(model_fn: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``model_fn()`` on the meta device, else for real, under a forked random state.

    Raises:
        ConfigError: ``model_fn`` raised, or returned something other than a ``torch.nn.Module``.
    """
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                model = model_fn()
        except Exception:  # a constructor that needs real tensors: build it for real (same names)
            try:
                model = model_fn()
            except FedcoreError:
                raise
            except Exception as exc:
                raise ConfigError(
                    f"the task's model could not be built: its model_fn raised {type(exc).__name__}: {exc}"
                ) from exc
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"the task's model_fn returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def central_evaluation(task: Task, batch_size: int) -> Callable[[NamedArrays, int], EvalResult]:
    """Centralized evaluation of global models with ``task`` (the server-role task's held-out data).

    The returned ``(parameters, round) -> EvalResult`` builds the model for each evaluation and drops it after,
    so no second copy of the model stays in memory between evaluations; building it does not touch the global
    random state. ``parameters`` may be read-only (mapped from a checkpoint): they are copied into the model.
    """

    def evaluate(parameters: NamedArrays, rnd: int) -> EvalResult:
        with torch.random.fork_rng(devices=[]):
            model = task.build_model()
        with warnings.catch_warnings():
            # a model mapped read-only from its file: load_state_dict copies it, nothing writes to it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            model.load_state_dict(to_state_dict(parameters))
        return task.evaluate(model, batch_size)

    return evaluate
