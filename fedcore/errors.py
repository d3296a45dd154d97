"""The one exception tree of fedcore.

Every error fedcore raises on purpose derives from :class:`FedcoreError` and carries
context (round, client id, stage) where it has it, plus a sentence on what to do::

    FedcoreError
    ├── ConfigError            (also ValueError)   invalid configuration, raised before a run starts
    ├── PayloadError           (also ValueError)   malformed or mismatched tensor payload
    │   ├── ModelMismatch                          the global model does not fit a client's own model
    │   └── NonFiniteError                         NaN or Inf values in a payload or update
    ├── UpdateRejected                             one client's update failed validation (the round goes on)
    ├── AggregationError                           nothing valid to aggregate (e.g. zero total weight)
    ├── RoundFailed                                a round could not complete (no quorum, all clients failed)
    ├── BudgetExhausted                            the next round would exceed the privacy budget: the run stops
    ├── ClientTaskError                            the user's Task raised while fitting or evaluating
    ├── PartitionError         (also ValueError)   a partition cannot satisfy its constraints
    ├── DatasetNotFoundError   (also FileNotFoundError)  dataset files are missing; says how to get them
    ├── StateError                                 the server's state directory cannot be used as it is (damaged
    │                                              database or checkpoints, records that disagree); says what to do
    ├── TransportError                             a client pool / transport could not deliver a message
    ├── ProtocolError                              a secure-aggregation message is invalid (tampered, replayed,
    │                                              from outside the neighbourhood, out of order)
    └── EngineError                                a parallel training worker failed (names the rank and cause)

A builtin exception (``ValueError``, ``RuntimeError``, ...) raised where a user can meet it is a bug:
``tests/fedcore/test_error_tree.py`` reads the source and refuses one, except the few it lists with the reason
(unreachable code, a protocol such as ``dict.__missing__``, control flow caught right where it is raised).
"""

from __future__ import annotations


class FedcoreError(Exception):
    """Base class of every error fedcore raises on purpose.

    Args:
        message: what went wrong and what to do about it.
        round: the federated round (1-based) the error happened in, if any.
        client_id: the client the error concerns, if any.
        stage: the protocol stage ("fit", "evaluate", "decode", ...), if any.
    """

    def __init__(
        self,
        message: str,
        *,
        round: int | None = None,
        client_id: str | None = None,
        stage: str | None = None,
    ) -> None:
        self.message = message
        self.round = round
        self.client_id = client_id
        self.stage = stage
        super().__init__(self._render())

    def _render(self) -> str:
        context = []
        if self.round is not None:
            context.append(f"round {self.round}")
        if self.client_id is not None:
            context.append(f"client {self.client_id!r}")
        if self.stage is not None:
            context.append(f"stage {self.stage}")
        prefix = f"[{', '.join(context)}] " if context else ""
        return prefix + self.message


class StateError(FedcoreError):
    """The server's state directory cannot be used as it is: a damaged state.db or checkpoint, records and
    checkpoints of different runs, a checkpoint that cannot be written. The message names the file and what to
    do (usually: restore it, or start a new run in a new state directory)."""


class ConfigError(FedcoreError, ValueError):
    """A configuration value is invalid. Raised when a config is built, never mid-run."""


class PayloadError(FedcoreError, ValueError):
    """A tensor payload is malformed (truncated, corrupted) or does not match the expected spec."""


class ModelMismatch(PayloadError):
    """The global model a client received does not fit the model its task builds (other tensor names, shapes or
    dtypes): the client runs another task than the server, which no retry fixes."""


class NonFiniteError(PayloadError):
    """A payload or update holds NaN or Inf values."""


class UpdateRejected(FedcoreError):
    """One client's update was rejected; the round continues without it."""


class AggregationError(FedcoreError):
    """There is nothing valid to aggregate, e.g. the example counts sum to zero."""


class RoundFailed(FedcoreError):
    """A round could not be completed (too few clients, no valid update)."""


class BudgetExhausted(FedcoreError):
    """The next round would spend more privacy than the configured target epsilon; the round loop ends the run
    cleanly with the last round within budget."""


class ClientTaskError(FedcoreError):
    """The user's Task raised while training or evaluating on a client."""


class PartitionError(FedcoreError, ValueError):
    """A partitioner cannot satisfy its constraints (e.g. minimum size after the redraw limit)."""


class DatasetNotFoundError(FedcoreError, FileNotFoundError):
    """Dataset files are missing. The message names the files and how to get them."""


class TransportError(FedcoreError):
    """A client pool / transport failed to deliver an instruction or a reply."""


class ProtocolError(FedcoreError):
    """A secure-aggregation protocol message is invalid: a ciphertext that fails authentication, a message of
    another round, from a client outside the neighbourhood, of the wrong size, or out of order. The receiving
    side refuses it and keeps nothing of it."""


class EngineError(FedcoreError):
    """A worker of the local parallel training engine failed; the message names the rank and the cause.

    Args:
        rank: the global rank of the worker that failed first, if known.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        round: int | None = None,
        client_id: str | None = None,
        stage: str | None = None,
    ) -> None:
        self.rank = rank
        super().__init__(message, round=round, client_id=client_id, stage=stage)


def failure_reason(exc: BaseException) -> str:
    """A client failure's reason for ``exc``, as the server records it: a fedcore error's own message (with its
    context), anything else as ``"TypeName: message"`` (a user's task or model raising). An :class:`EngineError`
    gives its first line, which names the failed rank and its exception; the lines after it, the worker's
    traceback with the client machine's paths, stay in the client's own log."""
    if isinstance(exc, EngineError):
        first, _, rest = str(exc).partition("\n")
        return f"{first} (the worker's traceback is in the client's log)" if rest.strip() else first
    return str(exc) if isinstance(exc, FedcoreError) else f"{type(exc).__name__}: {exc}"


def pip_install(arguments: str) -> str:
    """The pip command that installs ``arguments`` (e.g. ``"'fedcore[ray]'"``, already shell-quoted) into the
    environment of the Python running now: ``/path/to/.venv/bin/python -m pip install ...``.

    For an error message's hint, so that a user whose fedcore runs from a virtualenv they have not activated does not
    install into another environment with a bare ``pip``.
    """
    import shlex
    import sys

    return f"{shlex.quote(sys.executable or 'python3')} -m pip install {arguments}"
