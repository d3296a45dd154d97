"""The gRPC client pool: connected client daemons behind the :class:`server.pool.ClientPool` seam.

The round loop calls :meth:`GrpcClientPool.run` exactly as it calls the in-memory pool; the gRPC service
(:mod:`server.service`) feeds this pool from the network side: joins, heartbeats, long-poll pulls and pushes.

- Registry and liveness: a client is *available* while its session is alive. A reaper thread marks a client
  gone once no call or heartbeat arrived for ``liveness_timeout_s``, and fails its outstanding task at once
  (not at the round deadline). A live session keeps its client id: a second daemon claiming it is refused
  (:class:`ClientIdInUse`), while a restarted daemon whose old session is dead takes the id over at once.
- Calls: each session has at most ``max_calls_per_client`` calls in progress and one waiting pull (a newer
  pull ends the older one), so one client cannot hold the server's threads.
- Instructions: each ``run`` writes the global model once to a payload file in the spill directory; every
  selected client streams it from there, so no per-client copy is held in RAM.
- Replies: a pushed update is spilled to a file by the service, digest-checked, and only then handed here; the
  pool maps it read-only (``np.memmap``) when the round loop asks for the next reply, so the loop folds it from
  disk, and drops its pages after the fold. Replies that arrive after the round's deadline are discarded with a
  logged reason and never reach a later round.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import mmap
import queue
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from fedcore.errors import ConfigError, FedcoreError, RoundFailed, TransportError
from fedcore.messages import Failure, FitIns, FitRes, Instruction, Reply, Stage, bound_text
from fedcore.payload import DEFAULT_CHUNK_BYTES, PayloadFile, open_safetensors, save_payload
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.wire import payload_arrays, reply_from_header, task_header
from server.metrics import ServerMetrics

log = logging.getLogger("fedcore.server")

_COMPLETED_MEMORY = 4096
"""How many finished task ids are remembered to answer repeated pushes as duplicates."""


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


class ClientIdInUse(TransportError):
    """A join claimed a client id whose session is alive (another daemon runs with the same ``--client-id``)."""


class TooManyCalls(TransportError):
    """A session has ``max_calls_per_client`` calls in progress already."""


@dataclass(eq=False)
class Task:
    """One outstanding instruction for one client (at most one per client at a time)."""

    task_id: str
    client_id: str
    round: int
    stage: Stage
    header: pb.TaskHeader
    payload: PayloadFile
    replies: queue.Queue[tuple[Task, Reply | pb.ResultHeader, Path | None]]
    closed: bool = False
    answered: bool = False
    rejection: str = ""  # why the server refused the pushed result ("" when it took it)
    receiving: bool = False  # a push of this task is being read
    deadline: float | None = None  # the round's deadline (time.monotonic()); sent as seconds left when handed out


@dataclass(eq=False)
class _Client:
    client_id: str
    session: str
    last_seen: float
    wake: threading.Condition  # on the pool's lock: notified when this client's pull should look again
    task: Task | None = None
    calls: int = 0  # calls of this session in progress
    pulls: int = 0  # generation of the waiting pull: a newer pull ends the older one
    disconnected: bool = False  # the last call ended because its connection broke, and none came since
    claimed: bool = False  # a join for this id waits to see whether this session is alive


@dataclass
class _Run:
    finished: bool = False
    # task id -> "" when its result was taken, else why it was refused; the most recent _COMPLETED_MEMORY tasks
    completed: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def remember(self, task: Task) -> None:
        self.completed[task.task_id] = task.rejection
        while len(self.completed) > _COMPLETED_MEMORY:
            self.completed.popitem(last=False)


def _repeat_answer(rejection: str) -> str:
    """What a repeated push of an answered task is told: a duplicate of a taken result, or the original refusal."""
    return f"already refused: {rejection}" if rejection else "duplicate"


class GrpcClientPool:
    """A :class:`~server.pool.ClientPool` over client daemons connected through :mod:`server.service`.

    Args:
        config: liveness, limits and spill directory.
        metrics: optional Prometheus metrics to update.
    """

    def __init__(self, config: PoolConfig, metrics: ServerMetrics | None = None) -> None:
        self.config = config
        self._metrics = metrics
        config.spill_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # round loop waiters: joins, departures
        self._clients: dict[str, _Client] = {}
        self._sessions: dict[str, str] = {}
        self._run = _Run()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="fedcore-liveness", daemon=True)
        self._reaper.start()

    # ---------------------------------------------------------------- ClientPool
    def available(self) -> list[str]:
        """Ids of clients with a live session, sorted."""
        with self._cond:
            return sorted(self._clients)

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        """Block until ``num_clients`` are connected (at most ``timeout_s``), then return the connected ids.

        Raises:
            RoundFailed: the timeout passed; says how many are connected and how many are needed.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._clients) < num_clients:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    raise RoundFailed(
                        f"{len(self._clients)} client(s) connected after waiting {timeout_s:.0f} s, {num_clients} "
                        "needed; start more client daemons, check their logs for connection errors, or lower "
                        "sampling.min_fit_clients / min_fit_results"
                    )
                self._cond.wait(min(remaining, 1.0))
            log.info("%d client(s) connected (%d needed)", len(self._clients), num_clients)
            return sorted(self._clients)

    def run(self, instructions: Mapping[str, Instruction], *, timeout_s: float | None) -> Iterator[Reply]:
        """Hand each client its instruction and yield one reply or Failure per client as they arrive."""
        if not instructions:
            return
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        replies: queue.Queue[tuple[Task, Reply | pb.ResultHeader, Path | None]] = queue.Queue()
        files: dict[tuple[int, int], PayloadFile] = {}
        outstanding: dict[str, Task] = {}
        immediate: list[Failure] = []
        for instruction in instructions.values():
            key = _payload_key(instruction)
            if key not in files:
                name = f"global-r{instruction.round}-{instruction.stage.value}-{uuid.uuid4().hex[:8]}.safetensors"
                # framed for the wire; not fsynced: after a crash the round is run again from the checkpoint
                arrays, metadata = payload_arrays(instruction)  # the model and its tensor groups, in one payload
                files[key] = save_payload(
                    self.config.spill_dir / name,
                    arrays,
                    metadata,
                    frame_bytes=self.config.chunk_bytes,
                    durable=False,
                )
                _drop_pages(instruction.parameters)  # a global model mapped from its checkpoint: pages read once
        with self._cond:
            for client_id, instruction in instructions.items():
                client = self._clients.get(client_id)
                if client is None:
                    immediate.append(self._failure(client_id, instruction, "client is not connected"))
                    continue
                payload = files[_payload_key(instruction)]
                task_id = uuid.uuid4().hex
                task = Task(
                    task_id=task_id,
                    client_id=client_id,
                    round=instruction.round,
                    stage=instruction.stage,
                    header=task_header(instruction, task_id=task_id, payload_bytes=payload.size),
                    payload=payload,
                    replies=replies,
                    deadline=deadline,
                )
                if client.task is not None:
                    client.task.closed = True
                client.task = task
                outstanding[task_id] = task
                client.wake.notify_all()
        try:
            yield from immediate
            while outstanding:
                wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if wait <= 0:
                    break
                try:
                    task, body, path = replies.get(timeout=wait)
                except queue.Empty:
                    continue
                with self._cond:
                    if outstanding.pop(task.task_id, None) is None:
                        continue
                    self._close(task, completed=True)
                reply = self._materialize(task, body, path)
                yield reply
                if isinstance(reply, FitRes):
                    _drop_pages(reply.parameters)
                del reply
            for task in outstanding.values():
                log.warning(
                    "round %d: client %s gave no %s reply within the deadline of %s s",
                    task.round,
                    task.client_id,
                    task.stage.value,
                    timeout_s,
                )
                yield Failure(
                    client_id=task.client_id,
                    round=task.round,
                    stage=task.stage,
                    reason=f"no reply within the round deadline of {timeout_s} s",
                )
        finally:
            with self._cond:
                for task in outstanding.values():
                    self._close(task, completed=False)
            self._drain(replies)
            for payload in files.values():
                payload.path.unlink(missing_ok=True)

    # ------------------------------------------------------------- service side
    def join(self, client_id: str, *, previous_session: str = "") -> str:
        """Open a session for ``client_id``.

        An id whose session is alive stays with that session: a second claimant is refused. The older session
        is replaced at once when ``previous_session`` names it (the same daemon reconnecting), when its last call
        ended with a broken connection (a killed daemon), or when it shows no sign of life for
        :attr:`PoolConfig.takeover_wait_s` (this call waits that long); its unanswered task goes to the new one.

        Raises:
            ClientIdInUse: the id's session is alive, or another join for the id is already waiting.
        """
        with self._cond:
            old = self._clients.get(client_id)
            if old is not None and not (previous_session and hmac.compare_digest(previous_session, old.session)):
                self._wait_until_gone(old)
            session = secrets.token_urlsafe(24)
            old = self._clients.get(client_id)
            if old is not None:
                self._sessions.pop(old.session, None)
                old.wake.notify_all()  # its waiting pull, if any, ends: the session is gone
            client = _Client(
                client_id=client_id, session=session, last_seen=time.monotonic(), wake=threading.Condition(self._lock)
            )
            if old is not None:
                client.task = old.task  # an unanswered task is delivered again to the restarted daemon
            self._clients[client_id] = client
            self._sessions[session] = client_id
            self._cond.notify_all()
            self._set_connected()
        log.info("client %s joined%s", client_id, " (rejoined)" if old is not None else "")
        return session

    def _wait_until_gone(self, old: _Client) -> None:
        """With the lock held: return once ``old`` may be replaced, else raise ClientIdInUse."""
        if old.claimed:
            raise ClientIdInUse(f"another daemon is already claiming client id {old.client_id!r}")
        seen = old.last_seen
        if old.calls == 0 and old.disconnected:
            return  # its last call broke with its connection, and nothing came since: a killed daemon
        if old.calls == 0:
            old.claimed = True
            try:
                deadline = time.monotonic() + self.config.takeover_wait_s
                while True:
                    current = self._clients.get(old.client_id)
                    if current is None:
                        return  # it left, or was dropped, meanwhile
                    if current is not old or old.last_seen != seen or old.calls > 0:
                        break  # alive (or taken back by its own daemon reconnecting)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._stop.is_set():
                        return  # silent for one and a half heartbeat intervals: the old daemon is gone
                    self._cond.wait(remaining)
            finally:
                old.claimed = False
        live = self._clients.get(old.client_id, old)
        silent = time.monotonic() - live.last_seen
        raise ClientIdInUse(
            f"client id {old.client_id!r} is in use by a live session (seen {silent:.1f} s ago); another daemon "
            "runs with this --client-id: give each daemon its own id (a restarted daemon takes its id over once "
            "the old one is gone)"
        )

    def begin_call(self, session: str) -> str:
        """Count a call of ``session`` in progress (end it with :meth:`end_call`); returns its client id.

        Raises:
            KeyError: unknown or expired session.
            TooManyCalls: the session has ``max_calls_per_client`` calls in progress.
        """
        with self._cond:
            client = self._client(session)
            if client is None:
                raise KeyError(session)
            if client.calls >= self.config.max_calls_per_client:
                raise TooManyCalls(
                    f"{client.calls} calls of this session are in progress (at most "
                    f"{self.config.max_calls_per_client}); a daemon needs no more than three",
                    client_id=client.client_id,
                )
            client.calls += 1
            client.disconnected = False
            client.last_seen = time.monotonic()
            if client.claimed:
                self._cond.notify_all()  # the join waiting on this id sees the session is alive
            return client.client_id

    def end_call(self, session: str, *, disconnected: bool) -> None:
        """End a call counted by :meth:`begin_call`; ``disconnected`` when its connection broke."""
        with self._cond:
            client = self._client(session)
            if client is None:
                return
            client.calls = max(0, client.calls - 1)
            if disconnected:
                client.disconnected = True
                if client.claimed:
                    self._cond.notify_all()

    def wake(self, session: str) -> None:
        """Make the session's waiting pull look again (its call was cancelled)."""
        with self._cond:
            client = self._client(session)
            if client is not None:
                client.wake.notify_all()

    def leave(self, session: str) -> None:
        """Close a session; the client's outstanding task fails at once."""
        with self._cond:
            client = self._client(session)
            if client is not None:
                self._remove(client, "client left")

    def touch(self, session: str) -> str | None:
        """Record that the session's client is alive; its client id, or None for an unknown session."""
        with self._cond:
            client = self._client(session)
            if client is None:
                return None
            client.last_seen = time.monotonic()
            if client.claimed:
                self._cond.notify_all()  # the join waiting on this id sees the session is alive
            return client.client_id

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
        deadline = time.monotonic() + min(wait, self.config.max_poll_s)
        with self._cond:
            client = self._client(session)
            if client is None:
                raise KeyError(session)
            client.pulls += 1
            generation = client.pulls
            client.wake.notify_all()  # an older pull of this session ends
            while True:
                if self._client(session) is not client:
                    raise KeyError(session)
                client.last_seen = time.monotonic()
                task = client.task
                if task is not None and not task.closed and not task.answered:
                    if task.deadline is not None:  # the client bounds its training by it
                        task.header.deadline_s = max(0.001, task.deadline - time.monotonic())
                    return task, task.payload.path.open("rb")
                if self._run.finished:
                    return True
                remaining = deadline - time.monotonic()
                superseded = client.pulls != generation
                if remaining <= 0 or self._stop.is_set() or superseded or (cancelled and cancelled.is_set()):
                    return False
                client.wake.wait(remaining)

    def lookup(self, session: str, task_id: str) -> tuple[str, Task | None, str]:
        """Check a push before its payload is read: ``(client id, task or None, reason)``.

        The task is None with ``reason == "duplicate"`` for a result already taken, else with the reason it is
        refused (late, unknown task).

        Raises:
            KeyError: unknown or expired session.
        """
        with self._cond:
            client = self._client(session)
            if client is None:
                raise KeyError(session)
            client.last_seen = time.monotonic()
            task = client.task
            if task is not None and task.task_id == task_id and not task.closed:
                if task.answered:
                    return client.client_id, None, _repeat_answer(task.rejection)
                return client.client_id, task, ""
            if task_id in self._run.completed:
                return client.client_id, None, _repeat_answer(self._run.completed[task_id])
            return client.client_id, None, "no open task with this id (the round closed or the task was cancelled)"

    def deliver(self, task: Task, body: pb.ResultHeader | Failure, path: Path | None, *, rejected: bool = False) -> str:
        """Hand a received reply (header + verified spill file, or a Failure) to the round it belongs to.

        ``rejected`` marks a Failure the server made because it refused the pushed result; a repeated push of the
        task is then told that reason again, not that it was a duplicate.

        Returns ``""`` when taken, else why it was discarded (the spill file is then deleted).
        """
        with self._cond:
            if task.closed:
                if path is not None:
                    path.unlink(missing_ok=True)
                if task.task_id in self._run.completed:
                    return _repeat_answer(self._run.completed[task.task_id])
                log.warning(
                    "round %d: discarding a late result of client %s (the round closed)", task.round, task.client_id
                )
                return f"late: round {task.round} already closed"
            if task.answered:
                if path is not None:
                    path.unlink(missing_ok=True)
                return _repeat_answer(task.rejection)
            task.answered = True
            if rejected and isinstance(body, Failure):
                task.rejection = body.reason
            task.replies.put((task, body, path))
            return ""

    def begin_receive(self, task: Task) -> bool:
        """Claim ``task`` for one push being read; False when another push of it is being read now."""
        with self._cond:
            if task.receiving:
                return False
            task.receiving = True
            return True

    def end_receive(self, task: Task) -> None:
        """Release the claim of :meth:`begin_receive`."""
        with self._cond:
            task.receiving = False

    def new_spill_path(self, task: Task) -> Path:
        """A fresh file name in the spill directory for an incoming payload of ``task``."""
        # named by the server's own task id, never the client id (which may hold '/' or be too long for a name)
        return self.config.spill_dir / f"update-{task.task_id}-{uuid.uuid4().hex[:6]}.part"

    def finish(self) -> None:
        """Mark the run finished: idle pulls now tell daemons they may exit."""
        with self._cond:
            self._run.finished = True
            self._wake_all()

    def close(self) -> None:
        """Stop the liveness thread and wake every waiter."""
        self._stop.set()
        with self._cond:
            self._wake_all()
        self._reaper.join(timeout=5)

    def is_receiving_open(self, task: Task) -> bool:
        """Whether a push of ``task`` being read may go on (its round has not closed)."""
        with self._cond:
            return not task.closed

    # ------------------------------------------------------------------ helpers
    def _wake_all(self) -> None:
        self._cond.notify_all()
        for client in self._clients.values():
            client.wake.notify_all()

    def _client(self, session: str) -> _Client | None:
        client_id = self._sessions.get(session)
        return None if client_id is None else self._clients.get(client_id)

    def _remove(self, client: _Client, reason: str) -> None:
        self._clients.pop(client.client_id, None)
        self._sessions.pop(client.session, None)
        task = client.task
        if task is not None and not task.closed and not task.answered:
            log.warning("round %d: client %s is gone (%s); failing its task now", task.round, client.client_id, reason)
            failure = Failure(client_id=client.client_id, round=task.round, stage=task.stage, reason=reason)
            task.replies.put((task, failure, None))
        self._set_connected()
        self._cond.notify_all()
        client.wake.notify_all()

    def _close(self, task: Task, *, completed: bool) -> None:
        task.closed = True
        if completed:
            self._run.remember(task)
        client = self._clients.get(task.client_id)
        if client is not None and client.task is task:
            client.task = None

    def _reap_loop(self) -> None:
        period = min(0.25, self.config.liveness_timeout_s / 10)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._cond:
                for client in list(self._clients.values()):
                    silent = now - client.last_seen
                    if silent > self.config.liveness_timeout_s:
                        self._remove(client, f"client gone: no heartbeat for {silent:.1f} s")
                        if self._metrics is not None:
                            self._metrics.dropped.inc()

    def _set_connected(self) -> None:
        if self._metrics is not None:
            self._metrics.connected.set(len(self._clients))

    def _failure(self, client_id: str, instruction: Instruction, reason: str) -> Failure:
        return Failure(client_id=client_id, round=instruction.round, stage=instruction.stage, reason=reason)

    def _materialize(self, task: Task, body: Reply | pb.ResultHeader, path: Path | None) -> Reply:
        if not isinstance(body, pb.ResultHeader):
            return body
        try:
            parameters, metadata = None, None
            if path is not None:
                parameters, metadata = open_safetensors(path, round=task.round, client_id=task.client_id)
            return reply_from_header(body, client_id=task.client_id, parameters=parameters, metadata=metadata)
        except FedcoreError as exc:
            reason = bound_text(str(exc))
            log.warning("round %d: rejected the reply of client %s: %s", task.round, task.client_id, reason)
            return Failure(client_id=task.client_id, round=task.round, stage=task.stage, reason=reason)
        except Exception as exc:  # a reply no check foresaw must still not end the round for everyone
            log.exception("round %d: the reply of client %s could not be read", task.round, task.client_id)
            reason = bound_text(f"the update could not be read ({type(exc).__name__}: {exc})")
            return Failure(client_id=task.client_id, round=task.round, stage=task.stage, reason=reason)
        finally:
            if path is not None:
                path.unlink(missing_ok=True)  # the mapping keeps the data readable until it is dropped

    @staticmethod
    def _drain(replies: queue.Queue[tuple[Task, Reply | pb.ResultHeader, Path | None]]) -> None:
        while True:
            try:
                _, _, path = replies.get_nowait()
            except queue.Empty:
                return
            if path is not None:
                path.unlink(missing_ok=True)


def _payload_key(instruction: Instruction) -> tuple[int, int]:
    """Instructions that share a model and tensor groups (the same objects) share one payload file."""
    groups = instruction.groups if isinstance(instruction, FitIns) else None
    return id(instruction.parameters), id(groups)


def _drop_pages(arrays: Mapping[str, np.ndarray]) -> None:
    """Unmap the pages of read-only file-mapped arrays (a folded update, a global model mapped from its
    checkpoint), so they no longer count towards server memory; touching them again reads them back from the file.
    Other arrays are left alone."""
    for array in arrays.values():
        handle = getattr(array, "_mmap", None)
        if isinstance(array, np.memmap) and array.mode == "r" and isinstance(handle, mmap.mmap):
            with contextlib.suppress(OSError, ValueError):
                handle.madvise(mmap.MADV_DONTNEED)
