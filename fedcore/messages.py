"""Typed messages between the server's round loop and the client-side runner.

One module for every message; the wire conversion (protobuf, safetensors) lives in one other place, the gRPC
transport. The in-memory transport passes these objects as they are.

An *instruction* (server -> client) is :class:`FitIns` or :class:`EvaluateIns`; a *reply* (client -> server) is
:class:`FitRes`, :class:`EvaluateRes`, or :class:`Failure` when the client could not produce a result. A round
protocol (several exchanges in one round, :mod:`server.stages`) adds :class:`StageIns` and :class:`StageRes`:
generic messages carrying the stage's name, a few small typed fields and optional named tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np

from fedcore.errors import PayloadError
from fedcore.payload import pack_groups
from fedcore.task import FitConfig
from fedcore.tensors import NON_FINITE_WORDS, NamedArrays, num_bytes

MAX_METRICS = 256
"""The most metrics one reply carries (the gRPC server refuses a result with more: they become history columns)."""

MAX_METRIC_NAME = 128
"""The longest metric name, in characters (the gRPC server refuses a result with a longer one)."""

MAX_EXAMPLES = 2**63 - 1
"""The largest example count a reply may carry: the wire's ``int64 num_examples`` and the state database's INTEGER.
A larger one is refused (the client's task fails; the round loop rejects such an update) rather than failing the
round when its record is written."""


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
    PROTOCOL = "protocol"
    """An exchange of a round protocol (:class:`StageIns` / :class:`StageRes`; their ``name`` says which)."""


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
        payload_bytes: the bytes of the update as it travelled, set by the pool that delivered it: the gRPC pool,
            the size of the received payload (safetensors header and data); the in-memory pool,
            :func:`packed_nbytes` (the tensors' ``nbytes``, no header). None: not measured (the round loop then
            counts :func:`packed_nbytes`). Measured before any decoding, so a compressed update counts as sent.
    """

    client_id: str
    round: int
    parameters: NamedArrays
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    groups: Mapping[str, NamedArrays] = field(default_factory=dict)
    payload_bytes: int | None = None


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


DEADLINE_MISSED = "no reply within the"
"""The words every pool's :class:`Failure` reason holds for a client that missed an exchange's deadline
(:func:`missed_deadline`)."""


DP_NOISE_WORDS = "carries distributed DP's noise"
"""The words a client's :class:`Failure` reason holds when its non-finite update is put down to the noise the
global model carries under distributed DP (the SecAgg+ client mod's advice)."""


def non_finite_update(failure: Failure) -> bool:
    """Whether ``failure`` is a client whose update held NaN or Inf (:func:`fedcore.tensors.check_finite`)."""
    return NON_FINITE_WORDS in failure.reason


def missed_deadline(failure: Failure) -> bool:
    """Whether ``failure`` is a client that gave no reply before the exchange's deadline (a later deadline could
    have helped), rather than one that failed or whose reply was rejected."""
    return DEADLINE_MISSED in failure.reason


StageValue = bytes | int | str
"""The value of one field of a stage message: bytes (keys, ciphertexts, digests), an int of 64 bits, or text."""

MAX_STAGE_NAME = 64
"""The longest protocol or stage name, in characters (printable, not empty)."""
MAX_STAGE_FIELDS = 4096
"""The most fields one stage message carries."""
MAX_STAGE_FIELD_NAME = 256
"""The longest field name, in characters (printable, not empty)."""
MAX_STAGE_FIELD_BYTES = 512 << 10
"""The most bytes a stage message's fields hold in all (names and values, text counted as UTF-8): they travel in
one protobuf header, which must stay far below the gRPC message cap; bulk data travels as ``tensors``."""

_INT64 = 1 << 63


def check_stage_message(protocol: object, name: object, fields: object, *, round: int | None = None) -> None:
    """Check the names and fields of a stage message against the bounds above.

    Raises:
        PayloadError: a name that is empty, too long or not printable; fields that are not a mapping of names to
            :data:`StageValue`, too many, an int beyond 64 bits, or more than :data:`MAX_STAGE_FIELD_BYTES` in all.
    """

    def fail(message: str) -> PayloadError:
        return PayloadError(message, round=round, stage=Stage.PROTOCOL.value)

    for what, text in (("protocol", protocol), ("stage", name)):
        if not isinstance(text, str) or not 0 < len(text) <= MAX_STAGE_NAME or not text.isprintable():
            raise fail(
                f"the {what} name {bounded_repr(text, 80)} is not a printable text of 1 to {MAX_STAGE_NAME} characters"
            )
    if not isinstance(fields, Mapping):
        raise fail(f"stage fields must be a mapping of name -> bytes, int or str, not {type(fields).__name__}")
    if len(fields) > MAX_STAGE_FIELDS:
        raise fail(f"a stage message carries {len(fields)} fields; at most {MAX_STAGE_FIELDS} are taken")
    total = 0
    for key, value in fields.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_STAGE_FIELD_NAME or not key.isprintable():
            raise fail(
                f"the field name {bounded_repr(key, 80)} is not a printable text of 1 to {MAX_STAGE_FIELD_NAME} "
                "characters"
            )
        if isinstance(value, bool) or not isinstance(value, bytes | int | str):
            raise fail(f"field {key!r} holds a {type(value).__name__}; a field holds bytes, an int or a str")
        if isinstance(value, int):
            if not -_INT64 <= value < _INT64:
                raise fail(f"field {key!r} holds an int of {value.bit_length()} bits; at most 64 travel")
            size = 8
        else:
            size = len(value) if isinstance(value, bytes) else len(value.encode("utf-8", "surrogatepass"))
        total += len(key) + size
        if total > MAX_STAGE_FIELD_BYTES:
            raise fail(
                f"the stage fields hold more than {MAX_STAGE_FIELD_BYTES} bytes; send bulk data as tensors instead"
            )


@dataclass(frozen=True, kw_only=True, eq=False)
class _StageMessage:
    """What both directions of a stage exchange carry (see :class:`StageIns`)."""

    round: int
    attempt: int
    protocol: str
    name: str
    fields: Mapping[str, StageValue] = field(default_factory=dict)
    tensors: NamedArrays = field(default_factory=dict)
    stage: Stage = Stage.PROTOCOL

    def __post_init__(self) -> None:
        check_stage_message(self.protocol, self.name, self.fields, round=self.round)
        if isinstance(self.attempt, bool) or not isinstance(self.attempt, int) or self.attempt < 1:
            raise PayloadError(f"the attempt must be an int >= 1, got {bounded_repr(self.attempt)}", round=self.round)


@dataclass(frozen=True, kw_only=True, eq=False)
class StageIns(_StageMessage):
    """One exchange of a round protocol, server -> client (e.g. SecAgg+'s "share_keys").

    The client hands it to its state machine for ``protocol`` in this round (:mod:`client.stages`).

    Attributes:
        round: the federated round, 1-based.
        attempt: the round's attempt (1-based; a round that missed its quorum is tried again, and each attempt
            runs the protocol afresh).
        protocol: the round protocol's name (which client-side state machine answers it).
        name: the stage's name within the protocol.
        fields: small typed values (see :data:`StageValue` and the bounds above).
        tensors: named arrays sent with it (empty: none), at any size the payload limits allow.

    Raises:
        PayloadError: names, attempt or fields out of bounds (:func:`check_stage_message`).
    """


@dataclass(frozen=True, kw_only=True, eq=False)
class StageRes(_StageMessage):
    """A client's answer to a :class:`StageIns`.

    Attributes:
        client_id: who answered (on the server, from the session, never from the message).
        round, attempt, protocol, name: those of the instruction it answers.
        fields: small typed values (see :data:`StageValue`).
        tensors: named arrays sent with it (empty: none).

    Raises:
        PayloadError: names, attempt or fields out of bounds (:func:`check_stage_message`).
    """

    client_id: str


Instruction = FitIns | EvaluateIns
"""What a client's task runs (:func:`client.runner.run_instruction`)."""
ServerMessage = FitIns | EvaluateIns | StageIns
"""Anything a pool delivers to a client: a task's instruction or a round protocol's stage."""
Reply = FitRes | EvaluateRes | StageRes | Failure


@dataclass(frozen=True, kw_only=True, eq=False)
class FitBatchRes:
    """The fit results of several clients trained together, as columns, their updates already combined into one
    weighted sum.

    A pool that trains a round's clients as one computation (:class:`simulations.batched.BatchedPool`) sends it in
    place of one :class:`FitRes` per client when the round's aggregation is a plain weighted mean: the stacked
    updates are summed where they were trained (one matrix-vector product per tensor), and the round loop folds the
    sum once (:meth:`fedcore.aggregation.WeightedMean.add_sum`) instead of every update on its own. The clients'
    ids, example counts, weights and metrics come as columns, one entry per client, which the round loop reads a
    column at a time (its metrics, the selector's observations), with no object per client. It never crosses a
    process or trust boundary: a client over a network always sends its own :class:`FitRes`.

    Attributes:
        round: the round.
        client_ids: the clients whose updates are in the sum, in the order their weights were summed.
        num_examples: int64 ``(clients,)``: each client's training examples (>= 0).
        weights: float64 ``(clients,)``: each client's aggregation weight, as
            :meth:`fedcore.strategy.Strategy.weight` gives it for that client's result (finite, >= 0).
        metrics: ``name -> float64 (clients,)``: each client's reported value of each metric, NaN where a client
            reports none (a batched client's training loss is NaN only when it has no data: one with data and a NaN
            loss replies with its own :class:`FitRes`, or fails when its update is not finite).
        weighted_sum: ``name -> float64 array`` of the model's shapes: ``sum_k weights[k] * update_k``, summed in
            float64 (unread when there are no clients).
        update_bytes: the bytes one client's update would have cost as a :class:`FitRes` (its ``payload_bytes``):
            each client's update counts as received.
        rejected_bytes: the bytes of the updates of the batch's clients that were left out of the sum (not finite,
            weight refused; each also sent as a :class:`Failure`): counted as received, as the round loop counts an
            update it receives and then rejects.

    Raises:
        PayloadError: the columns are not one entry per client, or of other dtypes.
    """

    round: int
    client_ids: tuple[str, ...]
    num_examples: np.ndarray
    weights: np.ndarray
    metrics: Mapping[str, np.ndarray]
    weighted_sum: NamedArrays
    update_bytes: int
    rejected_bytes: int = 0

    def __post_init__(self) -> None:
        _check_column("num_examples", self.num_examples, np.dtype(np.int64), len(self.client_ids), self.round)
        _check_column("weights", self.weights, np.dtype(np.float64), len(self.client_ids), self.round)
        for name, column in self.metrics.items():
            _check_column(f"metric {name!r}", column, np.dtype(np.float64), len(self.client_ids), self.round)

    @property
    def received_bytes(self) -> int:
        """The bytes of the batch's updates as if each had come on its own: the summed ones and the rejected ones."""
        return self.update_bytes * len(self.client_ids) + self.rejected_bytes


def _check_column(what: str, column: object, dtype: np.dtype, count: int, rnd: int) -> None:
    """Refuse a batch's column that is not a ``dtype`` array of one entry per client."""
    if isinstance(column, np.ndarray) and column.shape == (count,) and column.dtype == dtype:
        return
    got = f"a {column.dtype} array of shape {column.shape}" if isinstance(column, np.ndarray) else type(column).__name__
    raise PayloadError(
        f"a batch of {count} clients carries {what} as {got}; give a {dtype} array of shape ({count},), one entry per "
        "client",
        round=rnd,
    )


PoolReply = Reply | FitBatchRes
"""What a pool yields to the round loop: one client's reply, or a pre-summed batch of fit results."""


def payload_of(message: ServerMessage | Reply) -> NamedArrays:
    """The tensors that travel as a message's payload: the model of a fit or evaluate instruction, the update of
    a fit result, a stage message's tensors; none for an evaluation result or a failure."""
    if isinstance(message, FitIns | EvaluateIns | FitRes):
        return message.parameters
    if isinstance(message, StageIns | StageRes):
        return message.tensors
    return {}


def with_payload(reply: Reply, arrays: NamedArrays) -> Reply:
    """``reply`` carrying ``arrays`` as its payload (a fit result's update, a stage reply's tensors), e.g. once
    they are mapped from the file they were received into; other replies are returned as they are."""
    if isinstance(reply, FitRes):
        return replace(reply, parameters=arrays)
    if isinstance(reply, StageRes):
        return replace(reply, tensors=arrays)
    return reply


def packed_nbytes(message: ServerMessage | Reply) -> int:
    """The bytes of a message's content as the in-memory pool hands it over: the ``nbytes`` of its payload
    (:func:`payload_of`) plus those of a fit message's tensor groups, and a stage message's fields
    (:func:`stage_field_bytes`); no header. An int8 or float16 tensor counts its own size, so a compressed update
    is smaller here too."""
    groups = message.groups if isinstance(message, FitIns | FitRes) else {}
    fields = stage_field_bytes(message.fields) if isinstance(message, StageIns | StageRes) else 0
    return num_bytes(payload_of(message)) + sum(num_bytes(arrays) for arrays in groups.values()) + fields


def stage_field_bytes(fields: Mapping[str, StageValue]) -> int:
    """The bytes of a stage message's field values (SecAgg+'s keys, encrypted shares, seeds): a bytes value its
    length, an int 8 (64 bits), a text its UTF-8 length; names not counted."""
    return sum(
        len(v) if isinstance(v, bytes) else 8 if isinstance(v, int) else len(v.encode()) for v in fields.values()
    )


def bound_text(text: str, limit: int = 1000) -> str:
    """``text`` made safe to log or store when it comes from client input: at most ``limit`` characters (a
    longer text is cut and says how long it was), with control characters shown as ``?``."""
    cut = text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"
    return "".join(c if c.isprintable() else "?" for c in cut)


def payload_arrays(message: ServerMessage | Reply) -> tuple[NamedArrays, dict[str, str]]:
    """The arrays and header metadata of the payload that carries ``message``: its tensors
    (:func:`fedcore.messages.payload_of`: a model, an update, a stage message's tensors) and, for a fit message, its
    tensor groups (:func:`fedcore.payload.pack_groups`; without groups, the tensors alone and no metadata).

    Raises:
        PayloadError: a group name that cannot travel, an empty group, or a model tensor named like a group's.
    """
    groups = message.groups if isinstance(message, FitIns | FitRes) else {}
    return pack_groups(payload_of(message), groups)
