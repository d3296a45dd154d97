"""The transport seam between the round loop and the clients.

The round loop talks to clients only through a :class:`ClientPool`. Simulation uses the in-memory pool
(:mod:`simulations.inmemory`), deployment the gRPC pool; both deliver the same typed messages
(:mod:`fedcore.messages`), so one round loop serves both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from fedcore.messages import FitBatchRes, FitRes, PoolReply, ServerMessage, StageRes, packed_nbytes


class ClientPool(Protocol):
    """Connected clients, and a way to send them instructions and stream back their replies."""

    def available(self) -> list[str]:
        """Ids of the clients that can take an instruction now."""
        ...

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        """Block until at least ``num_clients`` are available, then return their ids.

        Raises:
            RoundFailed: the timeout passed; the message says how many are connected and how many are needed.
        """
        ...

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[PoolReply]:
        """Send each client its instruction (a fit or evaluate instruction, or a round protocol's stage) and yield
        replies as they arrive.

        Yields exactly one reply per client in ``instructions``: its result, or a :class:`~fedcore.messages.Failure`
        (the client raised, disconnected, or did not answer within ``timeout_s``). Replies that arrive after the
        deadline are dropped by the pool, never yielded later. A pool that trains clients together may instead
        answer several fit instructions with one :class:`~fedcore.messages.FitBatchRes` (their updates already
        summed), when it was set up for a round loop whose aggregation takes one.
        """
        ...


@runtime_checkable
class PayloadMeasure(Protocol):
    """A pool that knows what a message's payload costs on its wire (the gRPC pool: the safetensors header and the
    tensors). The round loop counts a round's bytes sent with it (``RoundRecord.bytes_down``); a pool without it
    counts the tensors' ``nbytes`` (:func:`fedcore.messages.packed_nbytes`)."""

    def payload_bytes(self, message: ServerMessage | StageRes) -> int:
        """The bytes of ``message``'s payload as this pool sends it to one client (a stage reply's: as a client
        sends it)."""
        ...


def sent_bytes(pool: ClientPool, message: ServerMessage) -> int:
    """The bytes of ``message``'s payload as ``pool`` sends it to one client (:class:`PayloadMeasure`: over gRPC the
    safetensors header and the tensors, and a stage message's encoded fields), else its content's bytes
    (:func:`fedcore.messages.packed_nbytes`: the tensors, a stage message's field values)."""
    return pool.payload_bytes(message) if isinstance(pool, PayloadMeasure) else packed_nbytes(message)


def received_bytes(pool: ClientPool, reply: PoolReply) -> int:
    """The bytes of ``reply`` as it came: a fit result's :attr:`~fedcore.messages.FitRes.payload_bytes` (else
    :func:`~fedcore.messages.packed_nbytes`), a batch's what each of its updates, summed or rejected, would have cost
    on its own, a stage reply's fields and tensors as ``pool`` measures them
    (:class:`PayloadMeasure`, else :func:`~fedcore.messages.packed_nbytes`); 0 for an evaluation result (a few
    scalars in its header) or a failure."""
    if isinstance(reply, FitBatchRes):
        return reply.received_bytes
    if isinstance(reply, FitRes):
        return reply.payload_bytes if reply.payload_bytes is not None else packed_nbytes(reply)
    if isinstance(reply, StageRes):
        return pool.payload_bytes(reply) if isinstance(pool, PayloadMeasure) else packed_nbytes(reply)
    return 0


class PoolWrapper:
    """A :class:`ClientPool` that wraps another and changes some of what passes through it (a simulation's attacks,
    simulated device times, batched training): everything it does not override goes to the wrapped pool, which a
    subclass reaches as ``self._pool``; any other attribute (e.g. the in-memory pool's ``task``) is the wrapped
    pool's too.

    Args:
        pool: the wrapped pool.
    """

    def __init__(self, pool: ClientPool) -> None:
        self._pool = pool

    def available(self) -> list[str]:
        """The wrapped pool's available clients."""
        return self._pool.available()

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        """As the wrapped pool."""
        return self._pool.wait_for(num_clients, timeout_s)

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[PoolReply]:
        """The wrapped pool's replies."""
        return self._pool.run(instructions, timeout_s=timeout_s)

    def __getattr__(self, name: str) -> Any:
        if name == "_pool":  # not set yet (during unpickling or before __init__): no recursion
            raise AttributeError(name)
        return getattr(self._pool, name)
