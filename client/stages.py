"""The client side of multi-stage rounds: stage instructions dispatched to per-round state machines.

A :class:`~fedcore.messages.StageIns` names its protocol; :class:`ClientStages` hands it to that protocol's
client-side state machine (:class:`~fedcore.stages.ClientStageMachine`) for the instruction's (round, attempt)
and client, made at the first stage message and kept for the round's duration: machines of older rounds and
attempts are dropped when a message of a newer one arrives, so a client holds at most one round's machines.
Simulation (:mod:`simulations.inmemory`, one dispatcher for every virtual client) and the daemon
(:mod:`client.daemon`) use the same dispatcher.

Which protocols a client answers: those given to the dispatcher, by default those registered in this process
(:func:`register_client_protocol`; a protocol's module registers its client side when it is imported, e.g. by
the task module a daemon is started with). A stage message of a protocol the client does not know fails that
client's stage (it is dropped from the round), never the client.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable, Mapping

from fedcore.errors import ClientTaskError, ConfigError, FedcoreError
from fedcore.messages import StageIns, StageRes, bound_text
from fedcore.stages import ClientProtocol, ClientStageMachine

_BUILTIN: dict[str, str] = {"secagg+": "privacy.secagg.rounds:CLIENT_PROTOCOL"}
"""Built-in client protocols, imported on their first stage message: ``name -> "module:attribute"``."""

_REGISTERED: dict[str, ClientProtocol] = {}
_REGISTERED_LOCK = threading.Lock()


def register_client_protocol(protocol: ClientProtocol) -> None:
    """Make ``protocol`` answer stage messages of its name in this process (idempotent for the same object).

    Raises:
        ConfigError: another protocol object is registered under the same name.
    """
    with _REGISTERED_LOCK:
        known = _REGISTERED.get(protocol.name)
        if known is not None and known is not protocol:
            raise ConfigError(
                f"a client protocol named {protocol.name!r} is registered already ({type(known).__name__}); "
                "give each round protocol its own name"
            )
        _REGISTERED[protocol.name] = protocol


def registered_client_protocols() -> dict[str, ClientProtocol]:
    """The client protocols registered in this process, by name."""
    with _REGISTERED_LOCK:
        return dict(_REGISTERED)


class ClientStages:
    """Dispatches stage instructions to client-side state machines, one per (round, attempt, client, protocol).

    Thread-safe (a daemon answers one task at a time; simulation backends may run clients on threads).

    Args:
        protocols: the protocols this client answers (default: those registered, :func:`register_client_protocol`,
            looked up when an instruction arrives).
    """

    def __init__(self, protocols: Iterable[ClientProtocol] | None = None) -> None:
        self._protocols: dict[str, ClientProtocol] | None = None
        if protocols is not None:
            self._protocols = {}
            for protocol in protocols:
                if protocol.name in self._protocols:
                    raise ConfigError(f"two client protocols are named {protocol.name!r}")
                self._protocols[protocol.name] = protocol
        self._machines: dict[tuple[int, int, str, str], ClientStageMachine] = {}
        self._lock = threading.Lock()

    def handle(self, instruction: StageIns, client_id: str) -> StageRes:
        """Answer ``instruction`` for ``client_id`` with the state machine of its round and protocol.

        Raises:
            ClientTaskError: no client protocol of that name here, or the state machine raised something else
                than a FedcoreError, or answered with something else than a reply to this stage.
            FedcoreError: the state machine refused the instruction.
        """
        machine = self._machine(instruction, client_id)
        where = {"round": instruction.round, "client_id": client_id, "stage": instruction.name}
        try:
            reply = machine.handle(instruction)
        except FedcoreError:
            raise
        except Exception as exc:
            raise ClientTaskError(
                f"the client side of protocol {instruction.protocol!r} raised {type(exc).__name__}: "
                f"{bound_text(str(exc), 300)}",
                **where,  # type: ignore[arg-type]
            ) from exc
        expected = (instruction.round, instruction.attempt, instruction.protocol, instruction.name, client_id)
        if not isinstance(reply, StageRes) or (
            (reply.round, reply.attempt, reply.protocol, reply.name, reply.client_id) != expected
        ):
            raise ClientTaskError(
                f"the client side of protocol {instruction.protocol!r} answered stage {instruction.name!r} with "
                f"something else than its reply ({type(reply).__name__})",
                **where,  # type: ignore[arg-type]
            )
        return reply

    def observe(self, round: int) -> None:
        """A message of ``round`` arrived (a fit or evaluate instruction too): machines of older rounds go."""
        with self._lock:
            for key in [k for k in self._machines if k[0] < round]:
                del self._machines[key]

    def machine(self, round: int, client_id: str, protocol: str) -> ClientStageMachine | None:
        """The live state machine of ``client_id`` for ``protocol`` in ``round`` (its latest attempt), or None;
        for a client mod that needs the round's protocol state (e.g. masking an update with the round's keys)."""
        with self._lock:
            found = [(k[1], m) for k, m in self._machines.items() if (k[0], k[2], k[3]) == (round, client_id, protocol)]
        return max(found, key=lambda item: item[0])[1] if found else None

    def __len__(self) -> int:
        """How many state machines are kept now."""
        with self._lock:
            return len(self._machines)

    def _known(self) -> Mapping[str, ClientProtocol]:
        return self._protocols if self._protocols is not None else registered_client_protocols()

    def _lookup(self, name: str) -> ClientProtocol | None:
        protocol = self._known().get(name)
        if protocol is None and self._protocols is None and name in _BUILTIN:
            module, _, attr = _BUILTIN[name].partition(":")
            register_client_protocol(getattr(importlib.import_module(module), attr))
            protocol = self._known().get(name)
        return protocol

    def _machine(self, instruction: StageIns, client_id: str) -> ClientStageMachine:
        protocol = self._lookup(instruction.protocol)
        if protocol is None:
            raise ClientTaskError(
                f"this client has no client side of the round protocol {instruction.protocol!r}; start it with the "
                "module that registers that protocol (client.stages.register_client_protocol)",
                round=instruction.round,
                client_id=client_id,
                stage=instruction.name,
            )
        key = (instruction.round, instruction.attempt, client_id, instruction.protocol)
        with self._lock:
            stale = [
                k for k in self._machines if k[0] < key[0] or (k[0] == key[0] and k[2:] == key[2:] and k[1] < key[1])
            ]
            for old in stale:
                del self._machines[old]
            machine = self._machines.get(key)
            if machine is None:
                machine = protocol.start(round=instruction.round, attempt=instruction.attempt, client_id=client_id)
                self._machines[key] = machine
            return machine
