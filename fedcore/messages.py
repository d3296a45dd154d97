"""Typed messages between the server's round loop and the client-side runner.

One module for every message; the wire conversion (protobuf, safetensors) lives in one other place, the gRPC
transport. The in-memory transport passes these objects as they are.

An *instruction* (server -> client) is :class:`FitIns` or :class:`EvaluateIns`; a *reply* (client -> server) is
:class:`FitRes`, :class:`EvaluateRes`, or :class:`Failure` when the client could not produce a result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from fedcore.task import FitConfig
from fedcore.tensors import NamedArrays

MAX_METRICS = 256
"""The most metrics one reply carries (the gRPC server refuses a result with more: they become history columns)."""

MAX_METRIC_NAME = 128
"""The longest metric name, in characters (the gRPC server refuses a result with a longer one)."""


def bounded_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for text made from client input before it is logged or stored.
    Never raises (an object whose repr fails, or an int too long for Python to print, gives its type name)."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


ModParam = bool | int | float | str
"""A client mod's parameter value: a scalar (see :class:`ModSpec`)."""


@dataclass(frozen=True)
class ModSpec:
    """A client mod as the strategy declares it and the fit instruction carries it: a registered name and its
    parameters (see :mod:`fedcore.mods`, which checks both, and :mod:`client.mods`, which runs the chain).

    Attributes:
        name: the mod's registered name (e.g. ``"scaffold"``).
        params: its parameters, ``name -> bool | int | float | str``.
    """

    name: str
    params: Mapping[str, ModParam] = field(default_factory=dict)


class Stage(StrEnum):
    """The protocol stage a message belongs to."""

    FIT = "fit"
    EVALUATE = "evaluate"


@dataclass(frozen=True, kw_only=True, eq=False)
class FitIns:
    """Train the global model locally for one round.

    Attributes:
        round: the federated round, 1-based.
        parameters: the global model, ``name -> array`` in the model's order.
        config: local training settings.
        seed: the run's seed; the client derives its generators from (seed, round, client id).
        groups: algorithm state sent besides the model, ``group -> name -> array`` (SCAFFOLD's server control
            variate under ``"control"``); empty for plain FedAvg. The strategy declares each group's rule
            (:class:`fedcore.strategy.GroupRule`).
        mods: the client mods to run around the local training, in order, outermost first (:mod:`client.mods`).
    """

    round: int
    parameters: NamedArrays
    config: FitConfig
    seed: int
    stage: Stage = Stage.FIT
    groups: Mapping[str, NamedArrays] = field(default_factory=dict)
    mods: tuple[ModSpec, ...] = ()


@dataclass(frozen=True, kw_only=True, eq=False)
class EvaluateIns:
    """Evaluate the global model on the client's held-out data.

    Attributes:
        round: the federated round, 1-based.
        parameters: the global model.
        batch_size: evaluation batch size.
    """

    round: int
    parameters: NamedArrays
    batch_size: int = 256
    stage: Stage = Stage.EVALUATE


@dataclass(frozen=True, kw_only=True, eq=False)
class FitRes:
    """A client's update for one round.

    Attributes:
        client_id: who trained.
        round: the round the update belongs to (late results of an older round are discarded).
        parameters: the locally trained model, same names, shapes and dtypes as the global model.
        num_examples: local training examples (FedAvg weight), >= 0.
        metrics: scalar training metrics (e.g. ``train_loss``).
        groups: algorithm state returned besides the model, ``group -> name -> array`` (SCAFFOLD: the change of
            the client's control variate under ``"control"``); each group the strategy declares must be present
            with the spec of the server's state of that group, else the update is rejected.
    """

    client_id: str
    round: int
    parameters: NamedArrays
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    groups: Mapping[str, NamedArrays] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class EvaluateRes:
    """A client's evaluation of the global model.

    Attributes:
        client_id, round: as in :class:`FitRes`.
        loss: mean loss per example.
        num_examples: evaluation examples.
        metrics: scalar metrics (e.g. ``accuracy``).
    """

    client_id: str
    round: int
    loss: float
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Failure:
    """A client could not produce a reply; the round goes on without it.

    Attributes:
        client_id: the client.
        round: the round.
        stage: fit or evaluate.
        reason: what went wrong, in words (exception type and message, timeout, disconnect, rejection).
    """

    client_id: str
    round: int
    stage: Stage
    reason: str


Instruction = FitIns | EvaluateIns
Reply = FitRes | EvaluateRes | Failure


def bound_text(text: str, limit: int = 1000) -> str:
    """``text`` made safe to log or store when it comes from client input: at most ``limit`` characters (a
    longer text is cut and says how long it was), with control characters shown as ``?``."""
    cut = text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"
    return "".join(c if c.isprintable() else "?" for c in cut)
