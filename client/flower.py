"""Run an existing Flower ``NumPyClient`` unchanged under fedcore, as a :class:`fedcore.task.Task`.

A Flower client speaks in lists of numpy arrays (``get_parameters(config)``, ``fit(parameters, config)``,
``evaluate(parameters, config)``; flwr 1.x, ``flwr.client.NumPyClient``). fedcore speaks in torch modules whose
state dict is the model. :class:`FlowerTask` bridges the two without a second code path: its model is a
:class:`FlowerParameters` module holding one *buffer* per array, so the client-side runner
(:func:`client.runner.run_instruction`), the gRPC daemon and the simulation pools drive it like any other task.

Names and order: the i-th array of ``get_parameters`` is the buffer ``param_{i:04d}`` (``param_0000``,
``param_0001``, ...), with its shape and dtype preserved; the server aggregates those names.

The ``config`` dict a Flower client receives in ``fit`` (see :func:`fit_config_dict`)::

    server_round   int    the federated round, 1-based
    seed           int    a 63-bit seed keyed by (run seed, round, client id): seed local shuffling with it

and every field of :class:`fedcore.task.FitConfig` under its own name and type (today ``local_epochs`` (E),
``batch_size`` (B), ``lr``, ``momentum``, ``weight_decay``, ``mu`` (FedProx; 0 = FedAvg) and ``max_steps``, the
last only when set),

and in ``evaluate``: ``{"batch_size": int}``.

Use from the command line (both the server, for the initial model, and each daemon)::

    # mymodule.py
    def client_fn(context: flwr.common.Context) -> flwr.client.Client:
        pid = context.node_config["partition-id"]
        return MyNumPyClient(load_partition(pid)).to_client()

    factory = flower_task_factory(client_fn)

    fedcore client start --task mymodule:factory --partition-id 0 --num-partitions 2 ...
    fedcore server start --task mymodule:factory ...   # client_fn gets partition 0 of 1 here

The Flower ``Context`` a ``client_fn`` gets is built by :func:`flower_context`. The server's call has no partition
of its own: it gets :data:`SERVER_NODE_CONFIG` (partition 0 of 1), or the factory names a ``server_fn``.
Arrays may come back as numpy scalars where 0-d arrays went in, as flwr allows (:func:`as_flower_array`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
import tomllib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, cast

import numpy as np
import torch

from fedcore.aggregation import metric_value
from fedcore.config import scalar_fields
from fedcore.errors import ClientTaskError, ConfigError, PayloadError, pip_install
from fedcore.messages import bounded_repr
from fedcore.task import EvalResult, FitConfig, Task, TaskContext, TaskFactory, TrainContext, TrainResult

log = logging.getLogger("fedcore.client")

FlowerScalar = bool | bytes | float | int | str
"""Flower's ``Scalar``: the value type of its config and metrics dicts."""

NodeConfigValue = bool | float | int | str
"""The value type of a Flower ``Context.node_config``."""


class NumPyClientLike(Protocol):
    """The three methods of ``flwr.client.NumPyClient`` fedcore calls (flwr need not be installed to type them)."""

    def get_parameters(self, config: dict[str, FlowerScalar]) -> list[np.ndarray]: ...

    def fit(
        self, parameters: list[np.ndarray], config: dict[str, FlowerScalar]
    ) -> tuple[list[np.ndarray], int, dict[str, FlowerScalar]]: ...

    def evaluate(
        self, parameters: list[np.ndarray], config: dict[str, FlowerScalar]
    ) -> tuple[float, int, dict[str, FlowerScalar]]: ...


def buffer_name(index: int) -> str:
    """The fedcore tensor name of the ``index``-th Flower array: ``param_0000``, ``param_0001``, ..."""
    return f"param_{index:04d}"


class FlowerParameters(torch.nn.Module):
    """A module whose state dict is a Flower parameter list: buffer ``param_{i:04d}`` holds array ``i``.

    Args:
        arrays: the arrays in Flower's order; copied (C order), shapes and dtypes kept, 0-d arrays stay 0-d.

    Raises:
        PayloadError: an array's dtype has no torch equivalent (object, strings, ...).
    """

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        super().__init__()
        for index, array in enumerate(arrays):
            try:
                tensor = torch.from_numpy(np.array(array, order="C", copy=True))
            except TypeError as exc:
                raise PayloadError(
                    f"array {index} ({buffer_name(index)}) has dtype {array.dtype}, which torch cannot hold; "
                    "return numeric arrays from get_parameters"
                ) from exc
            self.register_buffer(buffer_name(index), tensor)

    def arrays(self) -> list[np.ndarray]:
        """The buffers as a fresh list of numpy arrays (copies, in Flower's order)."""
        return [buf.detach().cpu().numpy().copy() for _, buf in self.named_buffers()]

    def assign(self, arrays: Sequence[np.ndarray], *, round: int | None = None, client_id: str | None = None) -> None:
        """Copy ``arrays`` into the buffers after checking count, shapes and dtypes.

        Raises:
            PayloadError: the count, a shape or a dtype differs; names the first offending array.
        """
        buffers = list(self.named_buffers())
        if len(arrays) != len(buffers):
            raise PayloadError(
                f"the Flower client returned {len(arrays)} array(s) from fit, expected {len(buffers)} (one per array "
                "of get_parameters); return the whole model, in the same order",
                round=round,
                client_id=client_id,
                stage="fit",
            )
        arrays = [
            as_flower_array(a, index=i, stage="fit", round=round, client_id=client_id) for i, a in enumerate(arrays)
        ]
        for index, ((name, buf), array) in enumerate(zip(buffers, arrays, strict=True)):
            want_shape = tuple(buf.shape)
            want_dtype = buf.numpy().dtype
            if tuple(array.shape) != want_shape:
                raise PayloadError(
                    f"fit returned array {index} ({name}) with shape {tuple(array.shape)}, expected {want_shape}",
                    round=round,
                    client_id=client_id,
                    stage="fit",
                )
            if array.dtype != want_dtype:
                raise PayloadError(
                    f"fit returned array {index} ({name}) with dtype {array.dtype}, expected {want_dtype}; cast it "
                    f"back (e.g. .astype(np.{want_dtype.name})) before returning",
                    round=round,
                    client_id=client_id,
                    stage="fit",
                )
        with torch.no_grad():
            for (_, buf), array in zip(buffers, arrays, strict=True):
                buf.copy_(torch.from_numpy(np.require(array, requirements="C")))


def as_flower_array(
    value: object, *, index: int, stage: str, round: int | None = None, client_id: str | None = None
) -> np.ndarray:
    """One array a Flower client returned, as flwr takes it: a numpy array, or a numpy scalar or plain number
    (what ``p + 1`` gives for a 0-d array ``p``) as the 0-d array of its dtype.

    flwr serializes each returned value with ``np.save``, so it accepts scalars in place of 0-d arrays; so does
    fedcore. Python ``float``/``int``/``bool`` become float64/int64/bool, as numpy makes them.

    Raises:
        PayloadError: anything else (a list, None, a string, an object array), naming the array and stage.
    """
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (np.generic, numbers.Number)) and not isinstance(value, (np.str_, np.bytes_, np.void)):
        array = np.asarray(value)
    else:
        array = None
    if array is None or array.dtype.kind not in "biufc":
        raise PayloadError(
            f"{stage} returned a {type(value).__name__} as array {index} ({buffer_name(index)}); return numeric "
            "numpy arrays (or numpy scalars for 0-d arrays)",
            round=round,
            client_id=client_id,
            stage=stage,
        )
    return array


def fit_config_dict(config: FitConfig, *, server_round: int, seed: int) -> dict[str, FlowerScalar]:
    """The Flower ``config`` dict for ``fit``: ``server_round``, ``seed``, then every field of the FitConfig by
    its name (derived from the dataclass; an unset optional field is left out). Plain bool/int/float/str only."""
    out: dict[str, FlowerScalar] = {"server_round": int(server_round), "seed": int(seed)}
    for f in scalar_fields(type(config)):
        value = getattr(config, f.name)
        if value is not None:
            out[f.name] = f.kind(value)
    return out


def scalar_metrics(metrics: object, *, stage: str) -> dict[str, float]:
    """Keep the numeric entries (bool, int, float, numpy numbers and 0-d arrays) of a Flower metrics dict, as
    floats (:func:`fedcore.aggregation.metric_value`: an int beyond the float range becomes ±inf, which the server
    leaves out of its averages; no value can fail the instruction).

    String and bytes values, which fedcore's metrics cannot carry, are dropped (logged at debug level); values that
    are no Flower ``Scalar`` at all (None, a list, a dict) are dropped with a warning that names them.

    Raises:
        ClientTaskError: ``metrics`` is not a dict.
    """
    if not isinstance(metrics, dict):
        raise ClientTaskError(
            f"the Flower client's {stage} returned metrics of type {type(metrics).__name__}, not a dict"
        )
    kept: dict[str, float] = {}
    invalid: list[str] = []  # not a Flower Scalar at all (None, a list, a dict): a bug in the client, said out loud
    for key, value in metrics.items():
        number = metric_value(value)  # 0-d arrays and numpy scalars too; an int beyond the float range is ±inf
        if number is not None:
            kept[str(key)] = number
        elif isinstance(value, (str, bytes)):  # a Flower Scalar that fedcore's metrics cannot carry
            log.debug("dropping non-numeric Flower metric %r (%s)", key, type(value).__name__)
        else:
            invalid.append(f"{bounded_repr(str(key), 40)} ({type(value).__name__})")
    if invalid:
        log.warning(
            "the Flower client's %s returned %d metric(s) that are not Flower Scalars (bool, bytes, float, int, "
            "str), dropped: %s",
            stage,
            len(invalid),
            ", ".join(invalid[:5]),
        )
    return kept


def _count(value: object, *, what: str, round: int | None, client_id: str | None, stage: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ClientTaskError(
            f"the Flower client's {stage} returned {what}={value!r} ({type(value).__name__}); it must be an int",
            round=round,
            client_id=client_id,
            stage=stage,
        )
    return int(value)


class FlowerTask:
    """A :class:`fedcore.task.Task` that drives a Flower ``NumPyClient``.

    Args:
        client: the Flower client (a ``NumPyClient``, or the ``Client`` its ``to_client()`` returns).

    Raises:
        ConfigError: ``client`` is neither (no ``get_parameters``/``fit``/``evaluate`` to call).
    """

    def __init__(self, client: object) -> None:
        self.client = as_numpy_client(client)

    def build_model(self) -> torch.nn.Module:
        """A :class:`FlowerParameters` module of the client's ``get_parameters({})``.

        Raises:
            ClientTaskError: ``get_parameters`` did not return a non-empty list.
            PayloadError: an entry is not a numeric numpy array or scalar.
        """
        arrays = self.client.get_parameters({})
        if not isinstance(arrays, (list, tuple)) or not arrays:
            raise ClientTaskError(
                "the Flower client's get_parameters({}) must return a non-empty list of numpy arrays (the model), "
                f"got {type(arrays).__name__}",
                stage="build",
            )
        return FlowerParameters([as_flower_array(a, index=i, stage="get_parameters") for i, a in enumerate(arrays)])

    def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        """One round of ``client.fit``; the returned arrays replace the module's buffers.

        Raises:
            ClientTaskError: ``fit`` did not return ``(list of arrays, int, dict)``.
            PayloadError: the returned arrays differ in count, shape or dtype from the global model.
        """
        module = _flower_module(model)
        rnd, cid = context.round, context.client_id
        flower_config = fit_config_dict(config, server_round=rnd, seed=context.generator.initial_seed())
        result = self.client.fit(module.arrays(), flower_config)
        if not isinstance(result, tuple) or len(result) != 3 or not isinstance(result[0], (list, tuple)):
            raise ClientTaskError(
                "the Flower client's fit must return (parameters: list of numpy arrays, num_examples: int, "
                f"metrics: dict), got {_describe(result)}",
                round=rnd,
                client_id=cid,
                stage="fit",
            )
        arrays, num_examples, metrics = result
        count = _count(num_examples, what="num_examples", round=rnd, client_id=cid, stage="fit")
        module.assign(list(arrays), round=rnd, client_id=cid)
        return TrainResult(num_examples=count, metrics=scalar_metrics(metrics, stage="fit"))

    def evaluate(self, model: torch.nn.Module, batch_size: int) -> EvalResult:
        """``client.evaluate`` on the module's arrays.

        Raises:
            ClientTaskError: ``evaluate`` did not return ``(loss: float, num_examples: int, metrics: dict)``.
        """
        module = _flower_module(model)
        result = self.client.evaluate(module.arrays(), {"batch_size": int(batch_size)})
        if isinstance(result, tuple) and result and isinstance(result[0], np.ndarray) and result[0].ndim == 0:
            result = (result[0].item(), *result[1:])  # a 0-d array loss, as numpy reductions of arrays can give
        if not isinstance(result, tuple) or len(result) != 3 or not isinstance(result[0], numbers.Real):
            raise ClientTaskError(
                "the Flower client's evaluate must return (loss: float, num_examples: int, metrics: dict), got "
                f"{_describe(result)}",
                stage="evaluate",
            )
        loss, num_examples, metrics = result
        count = _count(num_examples, what="num_examples", round=None, client_id=None, stage="evaluate")
        value = metric_value(loss)  # a real number: never None; an int beyond the float range is ±inf
        return EvalResult(
            loss=math.nan if value is None else value,
            num_examples=count,
            metrics=scalar_metrics(metrics, stage="evaluate"),
        )


def _flower_module(model: torch.nn.Module) -> FlowerParameters:
    if not isinstance(model, FlowerParameters):
        raise ClientTaskError(
            f"a FlowerTask trains the FlowerParameters module it builds, got a {type(model).__name__}"
        )
    return model


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return "a tuple of (" + ", ".join(type(v).__name__ for v in value) + ")"
    return f"a {type(value).__name__}"


def as_numpy_client(client: object) -> NumPyClientLike:
    """Unwrap what a Flower ``client_fn`` returns to the ``NumPyClient`` fedcore calls.

    Accepts a ``NumPyClient`` (or any object with ``get_parameters``, ``fit`` and ``evaluate`` taking arrays),
    or the ``Client`` wrapper ``NumPyClient.to_client()`` returns (whose ``numpy_client`` attribute is unwrapped).

    Raises:
        ConfigError: a plain Flower ``Client`` (message-based API) or an object without those methods.
    """
    inner = getattr(client, "numpy_client", None)
    if inner is not None:
        client = inner
    missing = [m for m in ("get_parameters", "fit", "evaluate") if not callable(getattr(client, m, None))]
    if missing:
        raise ConfigError(
            f"{type(client).__name__} is not a Flower NumPyClient (missing {', '.join(missing)}); fedcore runs "
            "flwr.client.NumPyClient subclasses or what their to_client() returns"
        )
    try:
        from flwr.client import Client as FlowerClient
        from flwr.client import NumPyClient
    except ImportError:  # flwr is optional: a duck-typed client needs no flwr
        return cast(NumPyClientLike, client)
    if isinstance(client, FlowerClient):
        raise ConfigError(
            f"{type(client).__name__} is a message-based flwr.client.Client; fedcore runs NumPyClient subclasses "
            "(or the Client their to_client() returns)"
        )
    if isinstance(client, NumPyClient) and type(client).get_parameters is NumPyClient.get_parameters:
        raise ConfigError(
            f"{type(client).__name__} does not implement get_parameters; fedcore builds the model from it "
            "(the initial global model on the server, the tensor names and shapes on every client)"
        )
    return cast(NumPyClientLike, client)


def _option_value(text: str) -> bool | int | float | str:
    """A ``--task-option`` string as Flower's run_config would type it: a TOML value (``flwr run --run-config``
    and ``[tool.flwr.app.config]`` are TOML: ``true``, ``3``, ``1e-3``, ``nan``, ``inf``, ``"quoted"``), else the
    string as given (Flower would need it quoted). ``NaN`` or ``Infinity`` are not TOML numbers, so they stay
    strings (Python's ``float`` read them as numbers); ``True``/``False`` in any case are booleans, since the
    string ``"False"`` would test true."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        value = tomllib.loads(f"value = {text.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        return text
    return value if isinstance(value, bool | int | float | str) else text


#: The ``node_config`` the server-side ``client_fn`` call gets unless the factory names its own: partition 0 of 1,
#: i.e. the whole data set as one partition (a standard Flower ``client_fn`` then builds a client whose
#: ``get_parameters`` gives the initial model and whose ``evaluate`` scores the global model on that client's
#: validation split of the whole data).
SERVER_NODE_CONFIG: Mapping[str, int] = {"partition-id": 0, "num-partitions": 1}


class _NotingMissing(dict[str, NodeConfigValue]):
    """A Flower ``node_config``/``run_config`` that notes each key a ``client_fn`` read and did not find (then
    raises KeyError as a dict does), so the error can say which dict lacked it and how to give it."""

    def __init__(self, items: Mapping[str, NodeConfigValue]) -> None:
        super().__init__(items)
        self.missing: list[str] = []

    def __missing__(self, key: str) -> NodeConfigValue:
        self.missing.append(str(key))
        raise KeyError(key)


def _missing_key_advice(flower: Any) -> str:
    """How to give the key a ``client_fn`` read and was not given (see :class:`_NotingMissing`)."""
    node = getattr(flower.node_config, "missing", [])
    run = getattr(flower.run_config, "missing", [])
    if node and node[0] in SERVER_NODE_CONFIG:
        return (
            "give the daemon --partition-id/--num-partitions, or name server_fn=/server_node_config= in "
            "flower_task_factory for the server"
        )
    if node:
        return (
            "fedcore's node_config gives only partition-id and num-partitions (--partition-id/--num-partitions) "
            f"and data-dir (--data-dir), not {node[0]!r}: read such a setting from context.run_config and give it "
            "as --task-option key=value, or name server_fn=/server_node_config= in flower_task_factory"
        )
    if run:
        return f"give it as --task-option {run[0]}=VALUE, to the server and to every daemon"
    return (
        "give the daemon --partition-id/--num-partitions, pass the key as --task-option, or name "
        "server_fn=/server_node_config= in flower_task_factory"
    )


def flower_context(context: TaskContext, *, server_node_config: Mapping[str, NodeConfigValue] | None = None) -> Any:
    """The ``flwr.common.Context`` a Flower ``client_fn`` gets for fedcore's ``context``.

    - ``node_id``: a stable 63-bit number from the client id (SHA-256), ``run_id`` 0, an empty ``state``;
    - ``node_config``: ``partition-id`` and ``num-partitions`` (Flower's simulation keys) when fedcore has them,
      ``data-dir`` when given, ``fedcore-role`` (``"client"`` or ``"server"``) and ``fedcore-client-id``; for the
      server (``context.role == "server"``, which has no partition), ``server_node_config`` (default
      :data:`SERVER_NODE_CONFIG`, partition 0 of 1) supplies the keys a standard ``client_fn`` reads;
    - ``run_config``: the task options (``--task-option key=value``), values typed as bool/int/float when they
      parse as such, else strings.

    Raises:
        ConfigError: flwr is not installed.
    """
    try:
        from flwr.common import Context, RecordDict
    except ImportError as exc:
        raise ConfigError(f"a Flower client_fn needs flwr installed ({pip_install('flwr')})") from exc
    node_config: dict[str, NodeConfigValue] = {}
    if context.role == "server":
        node_config.update(SERVER_NODE_CONFIG if server_node_config is None else server_node_config)
    if context.partition_id is not None:
        node_config["partition-id"] = int(context.partition_id)
    if context.num_partitions is not None:
        node_config["num-partitions"] = int(context.num_partitions)
    if context.data_dir is not None:
        node_config["data-dir"] = str(context.data_dir)
    node_config["fedcore-role"] = context.role
    node_config["fedcore-client-id"] = context.client_id
    node_id = int.from_bytes(hashlib.sha256(context.client_id.encode()).digest()[:8], "little") >> 1
    run_config = {str(k): _option_value(str(v)) for k, v in context.options.items()}
    return Context(
        run_id=0,
        node_id=node_id,
        node_config=_NotingMissing(node_config),
        state=RecordDict(),
        run_config=_NotingMissing(run_config),
    )


def flower_task_factory(
    client_fn: Callable[[Any], object],
    *,
    context: Literal["flower", "fedcore"] = "flower",
    server_fn: Callable[[Any], object] | None = None,
    server_node_config: Mapping[str, NodeConfigValue] | None = None,
) -> TaskFactory:
    """Turn a Flower ``client_fn`` into a fedcore task factory (for ``--task module:attr``).

    Args:
        client_fn: returns a ``NumPyClient`` (or its ``to_client()``) for one client.
        context: what ``client_fn`` takes: ``"flower"`` a ``flwr.common.Context`` (:func:`flower_context`), as
            Flower's ``ClientApp(client_fn=...)`` does; ``"fedcore"`` the :class:`fedcore.task.TaskContext`.
        server_fn: called instead of ``client_fn`` for the server (same argument kind): the ``NumPyClient``
            whose ``get_parameters`` gives the initial global model and whose ``evaluate`` scores the global
            model after each round (e.g. one on held-out test data). None: ``client_fn`` serves the server too.
        server_node_config: the ``node_config`` of the server-side call (default :data:`SERVER_NODE_CONFIG`,
            partition 0 of 1); only with ``context="flower"``.

    The factory is also called for the server (``context.role == "server"``, no partition id): the server builds
    the initial global model from that client's ``get_parameters`` and, unless ``--no-evaluate``, evaluates the
    global model with its ``evaluate``. A standard Flower ``client_fn`` that reads
    ``context.node_config["partition-id"]`` and ``["num-partitions"]`` runs unchanged: the server's call gets
    partition 0 of 1. Bind the factory to a module-level name so daemons (and parallel workers) can import it.

    Raises:
        ConfigError: ``context`` is neither value, or ``server_node_config`` is given with ``context="fedcore"``;
            (when called) the function returned no NumPyClient.
    """
    if context not in ("flower", "fedcore"):
        raise ConfigError(f"context must be 'flower' or 'fedcore', got {context!r}")
    if server_node_config is not None and context != "flower":
        raise ConfigError("server_node_config is a Flower node_config: it needs context='flower'")

    def factory(task_context: TaskContext) -> Task:
        fn = server_fn if task_context.role == "server" and server_fn is not None else client_fn
        if context == "fedcore":
            return FlowerTask(fn(task_context))
        flower = flower_context(task_context, server_node_config=server_node_config)
        try:
            client = fn(flower)
        except KeyError as exc:
            role = "the server" if task_context.role == "server" else f"client {task_context.client_id!r}"
            raise ConfigError(
                f"the Flower client_fn for {role} read a key it was not given: {exc}; its node_config holds "
                f"{sorted(flower.node_config)} and its run_config {sorted(flower.run_config)} (--task-option "
                f"key=value); {_missing_key_advice(flower)}"
            ) from exc
        return FlowerTask(client)

    return factory
