"""The task board of the gRPC pool: per-client outstanding tasks, their payload files, and the results handed in.

Each :meth:`TaskBoard.run` (one exchange of a round: fit, evaluate, or a round protocol's stage) writes each
distinct payload (the global model once, a stage's tensors) to a file in the spill directory and posts one task
per client, keyed by client id (at most one per client: a newer one closes the older). The service streams a
pulled task's payload from its file, so no per-client copy is held in RAM. A pushed result arrives here already
converted to a typed reply (:mod:`fedcore.messages`) by the service, its payload (if any) in a verified spill
file; the board maps that file read-only (``np.memmap``) when the round loop asks for the next reply, so the
loop folds it from disk, and drops its pages after the fold. Replies that arrive after the exchange's deadline
are discarded with a logged reason and never reach a later exchange. No protobuf type is queued here.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from fedcore.errors import FedcoreError
from fedcore.messages import (
    DEADLINE_MISSED,
    Failure,
    FitIns,
    FitRes,
    Reply,
    ServerMessage,
    Stage,
    bound_text,
    payload_arrays,
    payload_of,
    with_payload,
)
from fedcore.payload import PayloadFile, open_safetensors, save_payload, unpack_groups

log = logging.getLogger("fedcore.server")

_COMPLETED_MEMORY = 4096
"""How many finished task ids are remembered to answer repeated pushes as duplicates."""


@dataclass(eq=False)
class Task:
    """One outstanding instruction for one client (at most one per client at a time).

    Attributes:
        instruction: what the client is asked (its payload is in ``payload``).
        deadline: the exchange's deadline (``time.monotonic()``), None: none.
    """

    task_id: str
    client_id: str
    round: int
    stage: Stage
    instruction: ServerMessage
    payload: PayloadFile
    replies: queue.Queue[Delivery]
    closed: bool = False
    answered: bool = False
    rejection: str = ""  # why the server refused the pushed result ("" when it took it)
    receiving: bool = False  # a push of this task is being read
    deadline: float | None = None

    def seconds_left(self) -> float:
        """Seconds until the exchange's deadline (at least 0.001), or 0.0 when it has none; the client bounds its
        work by it."""
        return 0.0 if self.deadline is None else max(0.001, self.deadline - time.monotonic())


@dataclass(frozen=True, eq=False)
class Delivery:
    """A reply handed in for ``task``: the typed reply and, when its tensors came as a payload, the verified spill
    file holding them (the reply's own tensors are then empty until the file is mapped)."""

    task: Task
    reply: Reply
    payload: Path | None = None


@dataclass
class _Completed:
    # (client id, task id) -> "" when its result was taken, else why it was refused; the most recent
    # _COMPLETED_MEMORY tasks. Kept by client too: a push naming another client's task id hears nothing of that task
    tasks: OrderedDict[tuple[str, str], str] = field(default_factory=OrderedDict)

    def remember(self, task: Task) -> None:
        self.tasks[task.client_id, task.task_id] = task.rejection
        while len(self.tasks) > _COMPLETED_MEMORY:
            self.tasks.popitem(last=False)

    def answer(self, client_id: str, task_id: str) -> str | None:
        """What a repeated push of ``client_id``'s completed task ``task_id`` is told; None when it has none such."""
        rejection = self.tasks.get((client_id, task_id))
        return None if rejection is None else repeat_answer(rejection)


def repeat_answer(rejection: str) -> str:
    """What a repeated push of an answered task is told: a duplicate of a taken result, or the original refusal."""
    return f"already refused: {rejection}" if rejection else "duplicate"


class TaskBoard:
    """Outstanding tasks by client id, and the results handed in for them.

    Args:
        lock: the lock shared with the session registry (reentrant).
        spill_dir: directory for payload files (created by the pool).
        chunk_bytes: payload chunk size on the wire; payload files are framed for it.
        notify: called (lock held) with a client id when its waiting pull should look again.
    """

    def __init__(
        self, lock: threading.RLock, *, spill_dir: Path, chunk_bytes: int, notify: Callable[[str], None]
    ) -> None:
        self._lock = lock
        self._spill_dir = spill_dir
        self._chunk_bytes = chunk_bytes
        self._notify = notify
        self._tasks: dict[str, Task] = {}
        self._completed = _Completed()
        self.finished = False

    def run(
        self,
        instructions: Mapping[str, ServerMessage],
        *,
        timeout_s: float | None,
        connected: Callable[[str], bool],
    ) -> Iterator[Reply]:
        """Post each client its instruction and yield one reply or Failure per client as they arrive (a client
        that is not ``connected`` fails at once; one that gives no reply within ``timeout_s`` fails then)."""
        if not instructions:
            return
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        replies: queue.Queue[Delivery] = queue.Queue()
        files: dict[tuple[int, int], PayloadFile] = {}
        outstanding: dict[str, Task] = {}
        immediate: list[Failure] = []
        for instruction in instructions.values():
            key = _payload_key(instruction)
            if key not in files:
                name = f"{instruction.stage.value}-r{instruction.round}-{uuid.uuid4().hex[:8]}.safetensors"
                arrays, metadata = payload_arrays(instruction)  # the tensors and a fit's tensor groups, in one payload
                # framed for the wire; not fsynced: after a crash the round is run again from the checkpoint
                files[key] = save_payload(
                    self._spill_dir / name, arrays, metadata, frame_bytes=self._chunk_bytes, durable=False
                )
                drop_pages(payload_of(instruction))  # a global model mapped from its checkpoint: pages read once
        with self._lock:
            for client_id, instruction in instructions.items():
                if not connected(client_id):
                    immediate.append(_failure(client_id, instruction, "client is not connected"))
                    continue
                task_id = uuid.uuid4().hex
                task = Task(
                    task_id=task_id,
                    client_id=client_id,
                    round=instruction.round,
                    stage=instruction.stage,
                    instruction=instruction,
                    payload=files[_payload_key(instruction)],
                    replies=replies,
                    deadline=deadline,
                )
                older = self._tasks.get(client_id)
                if older is not None:
                    older.closed = True
                self._tasks[client_id] = task
                outstanding[task_id] = task
                self._notify(client_id)
        try:
            yield from immediate
            while outstanding:
                wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if wait <= 0:
                    break
                try:
                    delivery = replies.get(timeout=wait)
                except queue.Empty:
                    continue
                with self._lock:
                    if outstanding.pop(delivery.task.task_id, None) is None:
                        continue
                    self._close(delivery.task, completed=True)
                reply = _materialize(delivery)
                yield reply
                if isinstance(reply, FitRes):
                    drop_pages(reply.parameters)
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
                    reason=f"{DEADLINE_MISSED} {_exchange(task.stage)} deadline of {timeout_s} s",
                )
        finally:
            with self._lock:
                for task in outstanding.values():
                    self._close(task, completed=False)
            _drain(replies)
            for payload in files.values():
                payload.path.unlink(missing_ok=True)

    def open_task(self, client_id: str) -> Task | None:
        """The client's task if it is still to be answered (for a pull), else None."""
        with self._lock:
            task = self._tasks.get(client_id)
            return task if task is not None and not task.closed and not task.answered else None

    def lookup(self, client_id: str, task_id: str) -> tuple[Task | None, str]:
        """Check a push of ``client_id`` before its payload is read: ``(task or None, reason)``; see
        :meth:`server.grpc_pool.GrpcClientPool.lookup`."""
        with self._lock:
            task = self._tasks.get(client_id)
            if task is not None and task.task_id == task_id and not task.closed:
                if task.answered:
                    return None, repeat_answer(task.rejection)
                return task, ""
            if (answer := self._completed.answer(client_id, task_id)) is not None:
                return None, answer
            return None, "no open task with this id (the round closed or the task was cancelled)"

    def deliver(self, delivery: Delivery, *, rejected: bool = False) -> str:
        """Hand a received reply to the exchange it belongs to; ``rejected`` marks a Failure the server made because
        it refused the pushed result (a repeated push is then told that reason again, not that it was a duplicate).

        Returns ``""`` when taken, else why it was discarded (the spill file is then deleted).
        """
        task, path = delivery.task, delivery.payload
        with self._lock:
            if task.closed:
                if path is not None:
                    path.unlink(missing_ok=True)
                if (answer := self._completed.answer(task.client_id, task.task_id)) is not None:
                    return answer
                log.warning(
                    "round %d: discarding a late result of client %s (the round closed)", task.round, task.client_id
                )
                return f"late: round {task.round} already closed"
            if task.answered:
                if path is not None:
                    path.unlink(missing_ok=True)
                return repeat_answer(task.rejection)
            task.answered = True
            if rejected and isinstance(delivery.reply, Failure):
                task.rejection = delivery.reply.reason
            task.replies.put(delivery)
            return ""

    def fail(self, client_id: str, reason: str) -> None:
        """The client is gone: its unanswered task fails now (not at the deadline)."""
        with self._lock:
            task = self._tasks.pop(client_id, None)
            if task is not None and not task.closed and not task.answered:
                log.warning("round %d: client %s is gone (%s); failing its task now", task.round, client_id, reason)
                # answered with this failure: a push of the task that ends now, or comes later under a new
                # session, is told so (not that its result was taken) and its payload is not kept
                task.answered = True
                task.rejection = f"the session of client {client_id} ended before its result came ({reason})"
                failure = Failure(client_id=client_id, round=task.round, stage=task.stage, reason=reason)
                task.replies.put(Delivery(task, failure))

    def begin_receive(self, task: Task) -> bool:
        """Claim ``task`` for one push being read; False when another push of it is being read now."""
        with self._lock:
            if task.receiving:
                return False
            task.receiving = True
            return True

    def end_receive(self, task: Task) -> None:
        """Release the claim of :meth:`begin_receive`."""
        with self._lock:
            task.receiving = False

    def is_receiving_open(self, task: Task) -> bool:
        """Whether a push of ``task`` being read may go on (its exchange has not closed)."""
        with self._lock:
            return not task.closed

    def new_spill_path(self, task: Task) -> Path:
        """A fresh file name in the spill directory for an incoming payload of ``task``."""
        # named by the server's own task id, never the client id (which may hold '/' or be too long for a name)
        return self._spill_dir / f"update-{task.task_id}-{uuid.uuid4().hex[:6]}.part"

    def _close(self, task: Task, *, completed: bool) -> None:
        task.closed = True
        if completed:
            self._completed.remember(task)
        if self._tasks.get(task.client_id) is task:
            del self._tasks[task.client_id]
            self._notify(task.client_id)


def _exchange(stage: Stage) -> str:
    return "stage" if stage is Stage.PROTOCOL else "round"


def _payload_key(instruction: ServerMessage) -> tuple[int, int]:
    """Instructions that share their tensors and tensor groups (the same objects) share one payload file."""
    groups = instruction.groups if isinstance(instruction, FitIns) else None
    return id(payload_of(instruction)), id(groups)


def _failure(client_id: str, instruction: ServerMessage, reason: str) -> Failure:
    return Failure(client_id=client_id, round=instruction.round, stage=instruction.stage, reason=reason)


def _materialize(delivery: Delivery) -> Reply:
    """The delivered reply with its payload mapped from its spill file (a Failure when the file cannot be read); a
    fit result's ``payload_bytes`` is the size of that file: the payload as received."""
    task, path = delivery.task, delivery.payload
    if path is None:
        return delivery.reply
    try:
        received = path.stat().st_size  # the verified payload as it came over the wire
        arrays, metadata = open_safetensors(path, round=task.round, client_id=task.client_id)
        if isinstance(delivery.reply, FitRes):  # the update and its tensor groups, split by the header's list
            model, groups = unpack_groups(arrays, metadata, round=task.round, client_id=task.client_id)
            return replace(delivery.reply, parameters=model, groups=groups, payload_bytes=received)
        return with_payload(delivery.reply, arrays)
    except FedcoreError as exc:
        reason = bound_text(str(exc))
        log.warning("round %d: rejected the reply of client %s: %s", task.round, task.client_id, reason)
        return Failure(client_id=task.client_id, round=task.round, stage=task.stage, reason=reason)
    except Exception as exc:  # a reply no check foresaw must still not end the round for everyone
        log.exception("round %d: the reply of client %s could not be read", task.round, task.client_id)
        reason = bound_text(f"the update could not be read ({type(exc).__name__}: {exc})")
        return Failure(client_id=task.client_id, round=task.round, stage=task.stage, reason=reason)
    finally:
        path.unlink(missing_ok=True)  # the mapping keeps the data readable until it is dropped


def _drain(replies: queue.Queue[Delivery]) -> None:
    while True:
        try:
            delivery = replies.get_nowait()
        except queue.Empty:
            return
        if delivery.payload is not None:
            delivery.payload.unlink(missing_ok=True)


def drop_pages(arrays: Mapping[str, np.ndarray]) -> None:
    """Unmap the pages of read-only file-mapped arrays (a folded update, a global model mapped from its
    checkpoint), so they no longer count towards server memory; touching them again reads them back from the file.
    Other arrays are left alone."""
    for array in arrays.values():
        handle = getattr(array, "_mmap", None)
        if isinstance(array, np.memmap) and array.mode == "r" and isinstance(handle, mmap.mmap):
            with contextlib.suppress(OSError, ValueError):
                handle.madvise(mmap.MADV_DONTNEED)
