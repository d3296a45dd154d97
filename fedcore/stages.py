"""The round protocol seam: what a multi-stage round protocol provides, on the server and on the client.

A round may be several exchanges with its selected clients (SecAgg+ needs four). The protocol's logic lives in
I/O-free state machines, one per round on the server (:class:`ServerStages`, made by the strategy's
:class:`RoundProtocol`) and one per (round, client) on each client (:class:`ClientStageMachine`, made by the
:class:`ClientProtocol` of the same name). Messages are generic (:class:`~fedcore.messages.StageIns` /
:class:`~fedcore.messages.StageRes`: the stage's name, small typed fields, optional tensors). The transports
only move them: :mod:`server.stages` drives the server side through any client pool, with a deadline per stage
and dropouts reported per stage; :mod:`client.stages` dispatches each instruction to the client's machine.

How SecAgg+ (Bell et al. 2020) maps onto it: ``advertise_keys`` and ``share_keys`` are exchanges before the fit
exchange (public keys and encrypted shares as bytes fields); the masked input is collected either by the fit
exchange itself, with a client mod masking the update using the round's client machine
(:meth:`client.stages.ClientStages.machine`), or by an exchange after fit whose reply carries the masked vector as
tensors (``uint32`` at the field's width); ``unmask`` is an exchange after fit, told by ``fit_done`` and the
dropouts which shares to ask for. The unmasked sum reaches the aggregate through the strategy's aggregator, whose
result the round loop takes only after the after-fit exchanges.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from fedcore.errors import ConfigError
from fedcore.messages import StageIns, StageRes


class Phase(StrEnum):
    """When in a round an exchange runs."""

    BEFORE_FIT = "before_fit"
    AFTER_FIT = "after_fit"


@dataclass(frozen=True, kw_only=True, eq=False)
class Exchange:
    """One stage of a round protocol: a message for each addressed client, and how long to wait for replies.

    Attributes:
        name: the stage's name (every instruction's ``name`` is this).
        instructions: ``client id -> StageIns``; only clients of the round still in it may be addressed (an
            instruction for a client dropped earlier is not sent). Clients left out simply sit this stage out.
        deadline_s: seconds to wait for this stage's replies; None: the round's deadline
            (``RoundConfig.round_timeout_s``; None there too: wait for every client). > 0.

    Raises:
        ConfigError: a deadline that is not > 0.
    """

    name: str
    instructions: Mapping[str, StageIns]
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ConfigError(f"the deadline of stage {self.name!r} must be > 0 or unset, got {self.deadline_s}")


class ServerStages(Protocol):
    """The server side of one round of a protocol: an I/O-free state machine (messages in, messages out).

    Every method may raise :class:`~fedcore.errors.RoundFailed` to stop the round (nothing of it is used).
    """

    def next_exchange(self, phase: Phase) -> Exchange | None:
        """The next exchange of ``phase``, or None when the phase is over."""
        ...

    def receive(self, stage: str, replies: Mapping[str, StageRes], dropped: Mapping[str, str]) -> Mapping[str, str]:
        """Take the outcome of the exchange ``stage``: the replies of the clients that answered in time (each
        checked to be a reply to that stage), and ``client id -> reason`` of those that dropped out at it.

        Returns ``client id -> reason`` of replies it refuses (a malformed key, a replayed message): those
        clients are dropped too.
        """
        ...

    def fit_done(self, accepted: Sequence[str], dropped: Mapping[str, str]) -> None:
        """The fit exchange is over: ``accepted`` clients' updates were folded; ``dropped`` (client id -> reason)
        failed it or had their update rejected. Called only when the round reached its quorum."""
        ...


class RoundProtocol(Protocol):
    """A multi-stage round protocol, declared by the strategy (``Strategy.protocol``).

    Attributes:
        name: its name, which every stage message carries and which picks the client-side state machine.
    """

    name: str

    def check(self, num_clients: int) -> None:
        """Refuse a round of ``num_clients`` the protocol cannot honour (its parameters against the selection),
        before any client is contacted.

        Raises:
            ConfigError: what does not fit, and what to change.
        """
        ...

    def start(self, *, round: int, attempt: int, clients: Sequence[str], seed: int) -> ServerStages:
        """The state machine of ``round``'s ``attempt`` (1-based: a round that misses its quorum is tried again
        with a fresh selection) with the selected ``clients`` (sorted), for the run's ``seed``. Every stage
        message it makes carries this round and attempt."""
        ...


class ClientStageMachine(Protocol):
    """The client side of one round of a protocol: an I/O-free state machine that answers one stage at a time."""

    def handle(self, instruction: StageIns) -> StageRes:
        """Answer ``instruction`` (the stages of the round arrive in order; a stage the client sat out does not).

        Raises:
            FedcoreError: the client cannot answer (a message out of order, a bad key); the client is then
                dropped from the round.
        """
        ...


class ClientProtocol(Protocol):
    """The client side of a round protocol: makes the per-round state machine.

    Attributes:
        name: the protocol's name (as :attr:`RoundProtocol.name`).
    """

    name: str

    def start(self, *, round: int, attempt: int, client_id: str) -> ClientStageMachine:
        """The state machine of ``client_id`` for ``round``'s ``attempt`` (made at the round's first stage
        message to this client, kept until the round is over)."""
        ...
