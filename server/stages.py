"""Multi-stage rounds: the driver of a round protocol's exchanges with the selected clients.

A strategy may carry a :class:`~fedcore.stages.RoundProtocol` (``Strategy.protocol``; default None: a round is one
fit exchange, unchanged). Its logic is an I/O-free state machine, :class:`~fedcore.stages.ServerStages`, made
afresh for each round attempt: it says which exchange comes next (``next_exchange``: the stage's name, a
:class:`~fedcore.messages.StageIns` per client, a deadline) and is told what came back (``receive``: the replies,
and which clients dropped out at that stage and why). This module only moves those messages through a
:class:`~server.pool.ClientPool` (in memory or gRPC, the same code) and keeps the books:

- Exchanges run in two phases around the round's fit exchange (:class:`~fedcore.stages.Phase`): before it
  (SecAgg+'s advertise and share keys) and after it (unmask). The state machine hears the fit exchange's outcome
  in between (``fit_done``).
- A client that fails a stage, answers with something else than that stage's reply, has its reply refused by
  the state machine, or misses the stage's deadline is *dropped* for the rest of the round: it gets no further
  exchange and no fit instruction, and its dropout is reported to the state machine once, at the stage it
  happened, and recorded as a :class:`~fedcore.messages.Failure` of the round.
- The state machine may stop the round (raise :class:`~fedcore.errors.RoundFailed`, e.g. fewer clients left than
  its threshold): the round attempt then fails, as a missed quorum does, and is retried with a fresh selection.

A protocol whose outcome changes the aggregate (SecAgg+'s unmasking) pairs with the strategy's aggregator: the
round loop takes the accumulator's result only after the after-fit exchanges have run.

The client side answers through :mod:`client.stages`, which keeps one client-side state machine per (round,
client) and protocol.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fedcore.errors import FedcoreError, RoundFailed
from fedcore.messages import Failure, FitBatchRes, ServerMessage, Stage, StageIns, StageRes, bound_text
from fedcore.stages import Exchange, Phase, RoundProtocol, ServerStages
from server.pool import ClientPool, received_bytes, sent_bytes

log = logging.getLogger("fedcore.server")


@dataclass(eq=False)
class ProtocolRun:
    """One round of a protocol being driven: its state machine, the clients still in, the dropouts by stage.

    Attributes:
        protocol: the protocol's name.
        round: the round.
        attempt: the round's attempt (1-based).
        machine: the round's server state machine.
        alive: the clients still in the round, in selection order.
        dropped: ``stage name -> client ids`` dropped at that stage ("fit" for the fit exchange).
        stopped: why the state machine stopped the round ("" while it goes on).
        bytes_down, bytes_up: the bytes of the stage instructions sent and of the stage replies received
            so far (:func:`server.pool.sent_bytes`, :func:`server.pool.received_bytes`); the round loop adds them
            to the round's ``bytes_down`` and ``bytes_up``.
    """

    protocol: str
    round: int
    attempt: int
    machine: ServerStages
    alive: list[str]
    dropped: dict[str, list[str]] = field(default_factory=dict)
    stopped: str = ""
    bytes_down: int = 0
    bytes_up: int = 0

    def run_phase(self, pool: ClientPool, phase: Phase, default_deadline_s: float | None) -> list[Failure]:
        """Run the exchanges of ``phase`` until the state machine has no more (or stops the round); returns the
        dropouts as failures of the round.

        Raises:
            RoundFailed: the state machine stopped the round, or addressed a message wrongly (a bug of the
                protocol: a client not in the round, another round, protocol or stage name).
        """
        failures: list[Failure] = []
        while True:
            exchange = self.machine.next_exchange(phase)
            if exchange is None:
                return failures
            failures += self._exchange(pool, exchange, default_deadline_s)

    def fit_done(self, accepted: Sequence[str], failures: Sequence[Failure]) -> None:
        """Drop the clients of the round that did not have their update folded, and tell the state machine."""
        taken = set(accepted)
        reasons = {f.client_id: f.reason for f in failures}
        dropped = {cid: reasons.get(cid, "gave no fit result") for cid in self.alive if cid not in taken}
        self._drop("fit", dropped)
        self.machine.fit_done(list(accepted), dropped)

    def _exchange(self, pool: ClientPool, exchange: Exchange, default_deadline_s: float | None) -> list[Failure]:
        name = exchange.name
        alive = set(self.alive)
        for client_id, ins in exchange.instructions.items():
            if not isinstance(ins, StageIns) or (ins.round, ins.attempt, ins.protocol, ins.name) != self._key(name):
                raise RoundFailed(
                    f"the round protocol {self.protocol!r} sent client {bound_text(client_id, 64)!r} a message that is "
                    f"not a stage {name!r} instruction of this round, attempt and protocol (a bug of the protocol)",
                    round=self.round,
                    stage=name,
                )
        unknown = [cid for cid in exchange.instructions if cid not in alive and not self._was_dropped(cid)]
        if unknown:
            raise RoundFailed(
                f"the round protocol {self.protocol!r} addressed {len(unknown)} client(s) not selected for this round "
                f"at stage {name!r}, e.g. {bound_text(unknown[0], 64)!r} (a bug of the protocol)",
                round=self.round,
                stage=name,
            )
        sent: dict[str, ServerMessage] = {cid: ins for cid, ins in exchange.instructions.items() if cid in alive}
        deadline = exchange.deadline_s if exchange.deadline_s is not None else default_deadline_s
        replies: dict[str, StageRes] = {}
        dropped: dict[str, str] = {}
        self.bytes_down += sum(sent_bytes(pool, ins) for ins in sent.values())
        try:
            for reply in pool.run(sent, timeout_s=deadline):
                if isinstance(reply, FitBatchRes):  # only ever an answer to fit instructions
                    log.warning("round %d stage %s: discarding a batch of fit results", self.round, name)
                    continue
                client_id = reply.client_id
                self.bytes_up += received_bytes(pool, reply)
                if client_id not in sent or client_id in replies or client_id in dropped:
                    log.warning("round %d stage %s: discarding an unexpected reply", self.round, name)
                elif isinstance(reply, Failure):
                    dropped[client_id] = reply.reason
                elif not isinstance(reply, StageRes) or (
                    (reply.round, reply.attempt, reply.protocol, reply.name) != self._key(name)
                ):
                    dropped[client_id] = f"answered with something else than a reply to stage {name!r}"
                else:
                    replies[client_id] = reply
        except FedcoreError as exc:  # the transport gave up: whoever has not answered is out
            log.warning("round %d stage %s: the exchange stopped early: %s", self.round, name, exc)
            for client_id in sent:
                if client_id not in replies:
                    dropped.setdefault(client_id, f"the exchange stopped early: {exc}")
        for client_id in sent:
            if client_id not in replies:
                dropped.setdefault(client_id, "gave no reply")
        try:
            refused = self.machine.receive(name, replies, dict(dropped))
        finally:
            self._drop(name, dropped)
        refused = {cid: reason for cid, reason in refused.items() if cid in replies}
        self._drop(name, refused)
        everyone = {**dropped, **refused}
        for client_id, reason in everyone.items():
            log.warning("round %d: client %s dropped at stage %s: %s", self.round, client_id, name, bound_text(reason))
        return [
            Failure(
                client_id=cid,
                round=self.round,
                stage=Stage.PROTOCOL,
                reason=f"dropped at stage {name!r} of {self.protocol!r}: {bound_text(reason)}",
            )
            for cid, reason in everyone.items()
        ]

    def stop(self, reason: str) -> list[Failure]:
        """Mark the round stopped by its protocol for ``reason``; returns the failures of the clients still in it
        (they are out: the round is retried, or fails)."""
        failures = [
            Failure(
                client_id=cid,
                round=self.round,
                stage=Stage.PROTOCOL,
                reason=f"the round protocol {self.protocol!r} stopped the round: {bound_text(reason)}",
            )
            for cid in self.alive
        ]
        self.stopped = reason
        self._drop("stopped", {cid: reason for cid in self.alive})
        return failures

    def _key(self, name: str) -> tuple[int, int, str, str]:
        return self.round, self.attempt, self.protocol, name

    def _drop(self, stage: str, clients: Mapping[str, str]) -> None:
        if not clients:
            return
        self.dropped.setdefault(stage, []).extend(cid for cid in clients if cid in self.alive)
        self.alive = [cid for cid in self.alive if cid not in clients]

    def _was_dropped(self, client_id: str) -> bool:
        return any(client_id in ids for ids in self.dropped.values())


def start_protocol(
    protocol: RoundProtocol, *, round: int, attempt: int, clients: Sequence[str], seed: int
) -> ProtocolRun:
    """Check ``protocol`` against the selection and start its state machine for ``round``'s ``attempt``.

    Raises:
        ConfigError: the protocol cannot run with this many clients (``RoundProtocol.check``).
    """
    protocol.check(len(clients))
    machine = protocol.start(round=round, attempt=attempt, clients=sorted(clients), seed=seed)
    return ProtocolRun(protocol=protocol.name, round=round, attempt=attempt, machine=machine, alive=list(clients))
