"""The gRPC client pool: connected client daemons behind the :class:`server.pool.ClientPool` seam.

The round loop calls :meth:`GrpcClientPool.run` exactly as it calls the in-memory pool; the gRPC service
(:mod:`server.service`) feeds this pool from the network side: joins, heartbeats, long-poll pulls and pushes.
The pool is two parts under one lock:

- the session registry (:mod:`server.sessions`): joins, heartbeats, liveness, calls in progress, waiting pulls.
  A client is *available* while its session is alive; a client gone silent for ``liveness_timeout_s`` has its
  outstanding task failed at once (not at the round deadline); a live session keeps its client id
  (:class:`ClientIdInUse`), a restarted daemon whose old session is dead takes it over at once; each session has
  at most ``max_calls_per_client`` calls in progress and one waiting pull.
- the task board (:mod:`server.task_board`): each exchange's tasks by client id, their payload files (the global
  model written once per exchange, streamed to every client from disk), and the typed replies the service hands
  in (their payloads in verified spill files, mapped read-only when the round loop folds them). Replies after an
  exchange's deadline are discarded with a logged reason and never reach a later exchange.

Protobuf stays at the gRPC edge: the service converts headers to and from :mod:`fedcore.messages` types.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fedcore.errors import ConfigError
from fedcore.messages import Reply, ServerMessage, StageIns, StageRes, payload_arrays
from fedcore.payload import DEFAULT_CHUNK_BYTES
from fedcore.tensors import num_bytes, safetensors_header
from fedcore.wire import stage_message_to_pb
from server.metrics import ServerMetrics
from server.sessions import ClientIdInUse, SessionRegistry, TooManyCalls
from server.task_board import Delivery, Task, TaskBoard

log = logging.getLogger("fedcore.server")

__all__ = ["ClientIdInUse", "Delivery", "GrpcClientPool", "PoolConfig", "Task", "TooManyCalls"]


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """Liveness, limits and where spill files go.

    Attributes:
        spill_dir: directory for payload files (global model per round, received updates); created if missing.
        seed: the run's seed, told to clients at join (their data split and randomness derive from it).
        heartbeat_interval_s: how often clients are asked to send a heartbeat. > 0.
        liveness_timeout_s: a client silent this long is marked gone and its task failed; > heartbeat interval.
        max_payload_bytes: largest update a client may push, in bytes (refused before it is read).
        chunk_bytes: payload chunk size on the wire, in bytes.
        max_poll_s: longest a pull may wait for a task before answering idle.
        max_calls_per_client: calls one session may have in progress at once (a daemon uses up to three: a
            pull, a heartbeat and a push); more are refused with RESOURCE_EXHAUSTED. >= 2.
    """

    spill_dir: Path
    seed: int = 0
    heartbeat_interval_s: float = 5.0
    liveness_timeout_s: float = 15.0
    max_payload_bytes: int = 8 << 30
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_poll_s: float = 30.0
    max_calls_per_client: int = 4

    def __post_init__(self) -> None:
        if not self.heartbeat_interval_s > 0:
            raise ConfigError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if not self.liveness_timeout_s > self.heartbeat_interval_s:
            raise ConfigError(
                f"liveness_timeout_s ({self.liveness_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}); 3x is a good choice"
            )
        if self.max_payload_bytes < 1:
            raise ConfigError(f"max_payload_bytes must be >= 1, got {self.max_payload_bytes}")
        if not 1024 <= self.chunk_bytes <= 64 << 20:
            raise ConfigError(f"chunk_bytes must be in [1 KiB, 64 MiB], got {self.chunk_bytes}")
        if not self.max_poll_s > 0:
            raise ConfigError(f"max_poll_s must be > 0, got {self.max_poll_s}")
        if self.max_calls_per_client < 2:
            raise ConfigError(f"max_calls_per_client must be >= 2, got {self.max_calls_per_client}")

    @property
    def takeover_wait_s(self) -> float:
        """How long a join waits for a sign of life of an older session of the same client id before taking
        the id over: one and a half heartbeat intervals (a live daemon heartbeats once per interval)."""
        return min(1.5 * self.heartbeat_interval_s + 0.5, self.liveness_timeout_s)


class GrpcClientPool:
    """A :class:`~server.pool.ClientPool` over client daemons connected through :mod:`server.service`.

    Args:
        config: liveness, limits and spill directory.
        metrics: optional Prometheus metrics to update.
    """

    def __init__(self, config: PoolConfig, metrics: ServerMetrics | None = None) -> None:
        self.config = config
        config.spill_dir.mkdir(parents=True, exist_ok=True)
        lock = threading.RLock()
        self.sessions = SessionRegistry(
            lock,
            liveness_timeout_s=config.liveness_timeout_s,
            takeover_wait_s=config.takeover_wait_s,
            max_calls_per_client=config.max_calls_per_client,
            on_gone=lambda client_id, reason: self.board.fail(client_id, reason),
            metrics=metrics,
        )
        self.board = TaskBoard(
            lock, spill_dir=config.spill_dir, chunk_bytes=config.chunk_bytes, notify=self.sessions.notify
        )

    # ---------------------------------------------------------------- ClientPool
    def available(self) -> list[str]:
        """Ids of clients with a live session, sorted."""
        return self.sessions.available()

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        """Block until ``num_clients`` are connected (at most ``timeout_s``), then return the connected ids.

        Raises:
            RoundFailed: the timeout passed; says how many are connected and how many are needed.
        """
        return self.sessions.wait_for(num_clients, timeout_s)

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[Reply]:
        """Hand each client its instruction and yield one reply or Failure per client as they arrive."""
        return self.board.run(instructions, timeout_s=timeout_s, connected=self.sessions.connected)

    def payload_bytes(self, message: ServerMessage | StageRes) -> int:
        """The bytes of ``message``'s payload on the wire (:class:`server.pool.PayloadMeasure`): the safetensors
        header and the tensors' data (a fit instruction's tensor groups included), as :meth:`run` writes it to one
        file per exchange and streams it to each client. A stage message adds its protocol, name and fields as
        the task header or the pushed result's header encodes them (``StageMessage``, protobuf); a stage reply
        without tensors pushes no payload."""
        arrays, metadata = payload_arrays(message)
        payload = len(safetensors_header(arrays, metadata)) + num_bytes(arrays)
        if isinstance(message, StageIns | StageRes):
            stage = stage_message_to_pb(message).ByteSize()
            return stage + (payload if isinstance(message, StageIns) or arrays else 0)
        return payload

    # ------------------------------------------------------------- service side
    def join(self, client_id: str, *, previous_session: str = "") -> str:
        """Open a session for ``client_id``.

        An id whose session is alive stays with that session: a second claimant is refused. The older session
        is replaced at once when ``previous_session`` names it (the same daemon reconnecting), when its last call
        ended with a broken connection (a killed daemon), or when it shows no sign of life for
        :attr:`PoolConfig.takeover_wait_s` (this call waits that long); its unanswered task goes to the new one
        (tasks are kept by client id).

        Raises:
            ClientIdInUse: the id's session is alive, or another join for the id is already waiting.
        """
        return self.sessions.join(client_id, previous_session=previous_session)

    def begin_call(self, session: str) -> str:
        """Count a call of ``session`` in progress (:meth:`SessionRegistry.begin_call`); returns its client id.

        Raises:
            KeyError: unknown or expired session.
            TooManyCalls: the session has ``max_calls_per_client`` calls in progress.
        """
        return self.sessions.begin_call(session)

    def end_call(self, session: str, *, disconnected: bool) -> None:
        """End a call counted by :meth:`begin_call`; ``disconnected`` when its connection broke."""
        self.sessions.end_call(session, disconnected=disconnected)

    def wake(self, session: str) -> None:
        """Make the session's waiting pull look again (its call was cancelled)."""
        self.sessions.wake(session)

    def leave(self, session: str) -> None:
        """Close a session; the client's outstanding task fails at once."""
        self.sessions.leave(session)

    def touch(self, session: str) -> str | None:
        """Record that the session's client is alive; its client id, or None for an unknown session."""
        return self.sessions.touch(session)

    def pull(
        self, session: str, wait_s: float, cancelled: threading.Event | None = None
    ) -> tuple[Task, BinaryIO] | bool:
        """Wait up to ``wait_s`` for the session's task; return it with its payload file opened, or whether the
        run is finished (False: nothing yet, poll again). One pull per session waits at a time: a newer pull
        ends the older one (it answers False). ``cancelled`` set (and :meth:`wake` called) ends the wait too.

        Raises:
            KeyError: unknown or expired session.
        """
        wait = wait_s if wait_s > 0 else 0.0  # NaN and negatives: do not wait

        def ready(client_id: str) -> Task | bool | None:
            task = self.board.open_task(client_id)
            return task if task is not None else (True if self.board.finished else None)

        got = self.sessions.wait_pull(session, min(wait, self.config.max_poll_s), ready, cancelled)
        if not isinstance(got, Task):
            return bool(got)
        try:
            return got, got.payload.path.open("rb")
        except FileNotFoundError:  # the task closed (its round's deadline) between the look and the open, and the
            # board removed its payload: nothing for this pull; the next one sees the task closed
            log.info("client %s's task %s closed as it was pulled", got.client_id, got.task_id)
            return False

    def lookup(self, session: str, task_id: str) -> tuple[str, Task | None, str]:
        """Check a push before its payload is read: ``(client id, task or None, reason)``.

        The task is None with ``reason == "duplicate"`` for a result already taken, else with the reason it is
        refused (late, unknown task).

        Raises:
            KeyError: unknown or expired session.
        """
        client_id = self.sessions.touch(session)
        if client_id is None:
            raise KeyError(session)
        task, reason = self.board.lookup(client_id, task_id)
        return client_id, task, reason

    def deliver(self, task: Task, reply: Reply, path: Path | None, *, rejected: bool = False) -> str:
        """Hand a received reply (typed, its payload, if any, in the verified spill file ``path``) to the exchange it
        belongs to. ``rejected`` marks a Failure the server made because it refused the pushed result; a repeated
        push of the task is then told that reason again, not that it was a duplicate.

        Returns ``""`` when taken, else why it was discarded (the spill file is then deleted).
        """
        return self.board.deliver(Delivery(task, reply, path), rejected=rejected)

    def begin_receive(self, task: Task) -> bool:
        """Claim ``task`` for one push being read; False when another push of it is being read now."""
        return self.board.begin_receive(task)

    def end_receive(self, task: Task) -> None:
        """Release the claim of :meth:`begin_receive`."""
        self.board.end_receive(task)

    def new_spill_path(self, task: Task) -> Path:
        """A fresh file name in the spill directory for an incoming payload of ``task``."""
        return self.board.new_spill_path(task)

    def is_receiving_open(self, task: Task) -> bool:
        """Whether a push of ``task`` being read may go on (its exchange has not closed)."""
        return self.board.is_receiving_open(task)

    def finish(self) -> None:
        """Mark the run finished: idle pulls now tell daemons they may exit."""
        self.board.finished = True
        self.sessions.wake_all()

    def close(self) -> None:
        """Stop the liveness thread and wake every waiter."""
        self.sessions.close()
