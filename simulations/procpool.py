"""The process-pool backend: virtual clients trained by worker processes, one per core, fed from one queue.

:class:`ProcessPool` is a :class:`server.pool.ClientPool` whose clients run in ``workers`` child processes. Each
worker is this module run as a program (``python -c`` :data:`_WORKER_LAUNCH`, given its pipes, the pool's process
id and shared-memory directory) started once per run: it builds the task factory once, keeps
one model for all the clients it trains (:class:`client.runner.ModelCache`, through an
:class:`~simulations.inmemory.InMemoryPool` of its own) and runs client after client. Nothing crosses a process
boundary as pickle:

- tensors (the global model and its tensor groups, each update) pass through shared memory as safetensors files
  in a private directory under ``/dev/shm`` (:func:`fedcore.payload.save_payload`, mapped back with
  :func:`fedcore.payload.open_safetensors`): the global model is written once per round and mapped by every
  worker; an update is written by its worker and mapped by the pool, then unlinked;
- everything else travels as the gRPC path's own protobuf headers (:func:`fedcore.wire.task_header`,
  :func:`fedcore.wire.result_header`) plus a small JSON envelope (client id, partition id, file name), framed by
  length over two pipes per worker.

The same protobuf conversions serve the gRPC path, which gives the in-process model bit for bit; the pool
therefore gives the in-process history bit for bit as long as each client trains with the same number of torch
threads (``threads``, 1 by default: one per worker, so ``workers`` threads in all).

Scheduling is a dynamic queue: each worker takes the next client when it is done with the last, so a slow client
(a large shard, a slow task) delays only its own worker. Clients of a multi-stage round protocol (SecAgg+) keep
their state machines in the worker that answered their first stage message of the round, so every later message
of that client in that round goes to the same worker.

Failures: a client whose task raises fails as in the in-memory pool. A worker that dies (a crash in native code,
killed for memory) fails the client it was running with a reason that says so, and is replaced at once; the round
goes on by the round loop's quorum rules. The pool never waits for a dead worker. :meth:`ProcessPool.close` (also
on ``with`` exit and at interpreter exit) ends the workers, killing any that do not exit within a few seconds, and
removes the shared-memory directory; a worker also exits by itself when the pool's process dies (its command pipe
reaches end of file, its reply cannot be written, or, mid-client, its watch thread sees another parent), removing
that directory once the pool's process has gone, and a later pool removes directories left by pools whose process
died (all of whose workers were killed too). A run that stops early (Ctrl-C) does not wait for the clients still
training: the next run does, and :meth:`ProcessPool.close` kills their workers instead.

Fit and evaluate instructions keep no deadline (as in the in-memory pool: a simulation's model never depends on
timing); a stage instruction is timed inside its worker against ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

import numpy as np

from fedcore.aggregation.blocks import release_mapped
from fedcore.errors import ConfigError, FedcoreError, TransportError
from fedcore.interrupts import deferred_interrupts
from fedcore.messages import (
    Failure,
    FitIns,
    FitRes,
    Reply,
    ServerMessage,
    Stage,
    StageIns,
    StageRes,
    bound_text,
    payload_arrays,
)
from fedcore.payload import open_safetensors, save_payload
from fedcore.tensors import NamedArrays, num_bytes
from simulations.inmemory import all_virtual_clients

log = logging.getLogger("fedcore.simulation")

SHM_ROOT = Path("/dev/shm")
"""Where the pool's shared-memory directory goes when it exists (else the system's temporary directory)."""
DIR_PREFIX = "fedcore-procpool-"
"""Name prefix of a pool's shared-memory directory: ``fedcore-procpool-<pid>-<random>``."""
_WORKER_LAUNCH = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "import runpy; runpy.run_module('simulations.procpool', run_name='__main__', alter_sys=True)"
)
"""A worker's ``python -c`` program: ``python -m simulations.procpool`` with Ctrl-C ignored from the start (a
terminal's Ctrl-C reaches the workers too, and one that came while they imported torch printed a traceback; the
pool ends them itself)."""
STOP = "stop"
"""The kind of the message that ends a worker (before its command pipe closes)."""
ORPHAN_WAIT_S = 5.0
"""How long a worker whose command pipe closed without a stop message waits for its watch thread to see its pool's
process gone."""
ORPHAN_POLL_S = 0.2
"""How often a worker's watch thread looks whether its pool's process is gone (then it ends the worker at once)."""
START_TIMEOUT_S = 300.0
"""How long a starting worker may take to import torch and build its task factory before the pool gives up."""
STOP_TIMEOUT_S = 10.0
"""How long :meth:`ProcessPool.close` waits for a worker to exit by itself before killing it."""
MAX_MESSAGE_BYTES = 64 << 20
"""The largest control message (envelope or protobuf header) either side reads; tensors travel as files."""


def default_workers() -> int:
    """The number of cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True, kw_only=True)
class ClientTasks:
    """How a worker builds a virtual client's task: the task factory by name, and the context it gets.

    A worker calls ``factory`` with ``TaskContext(role="client", client_id, partition_id, num_partitions,
    data_dir, seed, options)``, exactly as the in-process harness and a client daemon do.

    Attributes:
        factory: ``module:attr`` of the task factory, importable in a fresh interpreter with this process's
            ``sys.path``.
        options: the factory's string options.
        num_partitions: the number of virtual clients (partitions).
        seed: the run's seed.
        data_dir: handed to the factory (None: unset).
        attack: the run's ``[attack]`` table (:class:`simulations.attacks.AttackConfig` as a mapping); attacking
            clients (see :class:`ProcessPool`'s ``attackers``) of a label attack train on altered labels
            (:func:`simulations.attacks.attacked_tasks`).
        label_attack_classes: the number of classes a label attack draws from.
        max_tasks: how many clients' tasks a worker keeps built (least recently used first out).
        device: where each worker trains its clients (``cpu``, ``cuda``, ``cuda:N``; None: the CPU), as the
            in-process pool does on a device (:class:`~simulations.inmemory.InMemoryPool`'s ``device``). A Ray
            actor's ``cuda`` is the GPU Ray gave it (Ray sets ``CUDA_VISIBLE_DEVICES`` for an actor of
            ``num_gpus > 0``).
    """

    factory: str
    options: Mapping[str, str] = field(default_factory=dict)
    num_partitions: int
    seed: int
    data_dir: str | None = None
    attack: Mapping[str, Any] = field(default_factory=dict)
    label_attack_classes: int = 0
    max_tasks: int = 256
    device: str | None = None

    def __post_init__(self) -> None:
        module, sep, attr = self.factory.partition(":")
        if not (module and sep and attr):
            raise ConfigError(f"the task factory must look like module:attr, got {self.factory!r}")
        if self.num_partitions < 1 or self.max_tasks < 1 or self.label_attack_classes < 0:
            raise ConfigError("num_partitions and max_tasks must be >= 1, label_attack_classes >= 0")

    def worker_spec(self, *, threads: int, state_dir: str | None) -> dict[str, Any]:
        """What :func:`client_service` takes: these fields as JSON values, plus the worker's torch ``threads`` and
        the clients' state directory (None: no client keeps state)."""
        return {
            "factory": self.factory,
            "options": dict(self.options),
            "num_partitions": self.num_partitions,
            "seed": self.seed,
            "data_dir": self.data_dir,
            "attack": dict(self.attack),
            "label_attack_classes": self.label_attack_classes,
            "max_tasks": self.max_tasks,
            "device": self.device,
            "threads": threads,
            "state_dir": state_dir,
        }


class VirtualClients(ABC):
    """What the pools of workers (:class:`ProcessPool`, :class:`simulations.raypool.RayPool`) share: the virtual
    clients' ids (client ``client_ids[i]`` gets partition ``i``), all always available, and the attacking ones.

    Raises:
        ConfigError: repeated client ids.
    """

    kind = "pool"
    """The pool's name in messages."""

    def __init__(self, client_ids: Sequence[str], attackers: frozenset[str]) -> None:
        if len(set(client_ids)) != len(client_ids):
            raise ConfigError(f"client ids must be unique; {len(client_ids) - len(set(client_ids))} repeat")
        self._ids = list(client_ids)
        self._index = {cid: i for i, cid in enumerate(self._ids)}
        self._attackers = attackers
        self._affinity = StageAffinity()
        self._order: OrderWindow | None = None
        self._closed = False

    def run(
        self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None = None
    ) -> Generator[Reply, None, None]:
        """Hand the instructions to the workers and yield each reply as it comes (one per client, in the order the
        workers finish); a client whose task raised, or whose worker died, yields a Failure.

        Fit instructions whose global model holds float64 tensors have their replies yielded in the instructions'
        order instead, as the in-process pool yields them: the round loop's float64 running sum of float64 updates
        rounds differently in another order (one of float32 updates times example counts is exact in practice, so
        their replies need not wait). A reply that comes before those ahead of it is held until they have come, in
        memory (a process worker's update in ``/dev/shm``), and no client is started more than
        :func:`order_window` places after the first reply not yet yielded: behind a slow client, at most that many
        updates wait (about :data:`ORDER_BUDGET_BYTES` of them; other workers idle once it is reached).

        A caller that stops early (closes the generator: an error, Ctrl-C) leaves the clients still training to finish
        on their own: the next run waits for them first and drops their replies, and :meth:`close` ends their workers
        without waiting. So Ctrl-C ends a run at once, whether it came while the pool waited or while the caller
        folded a reply.

        Raises:
            TransportError: the pool is closed.
        """
        if self._closed:
            raise TransportError(f"the {self.kind} is closed; make a new one")
        self._drain()
        shared = self._affinity.split(instructions, self._slots())
        ordered = sums_depend_on_order(instructions)
        self._order = OrderWindow(instructions, order_window(instructions, len(self._slots()))) if ordered else None
        replies = self._schedule(instructions, shared, timeout_s)
        try:
            yield from in_order(instructions, replies, self._order) if self._order is not None else replies
        finally:
            replies.close()  # its own cleanup first, then the run's
            self._order = None
            self._end_run()

    def _may_start(self, client_id: str) -> bool:
        """Whether a free worker may take ``client_id`` now: always, unless the run's replies are yielded in order
        and it lies beyond the window (:class:`OrderWindow`) while some client is still running (:meth:`_busy`);
        with none running it starts anyway, so the run always moves on."""
        return self._order is None or self._order.allows(client_id) or not self._busy()

    @abstractmethod
    def _busy(self) -> bool:
        """Whether some worker is running a client."""

    @abstractmethod
    def close(self) -> None:
        """End the workers and free what the pool holds. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _slots(self) -> Sequence[Any]:
        """The workers, each with a ``pinned`` queue (None where one died and none took its place)."""

    @abstractmethod
    def _schedule(
        self, instructions: Mapping[str, ServerMessage], shared: deque[str], timeout_s: float | None
    ) -> Generator[Reply, None, None]:
        """Run every client: the ``shared`` queue and the workers' ``pinned`` ones."""

    @abstractmethod
    def _end_run(self) -> None:
        """Drop the run's inputs and the clients not yet handed out; leave the tasks still in flight (the caller
        stopped early) to :meth:`_drain` or :meth:`close`, never waiting for them here."""

    @abstractmethod
    def _drain(self) -> None:
        """Wait for the tasks a run that stopped early left in flight, and drop their replies."""

    def available(self) -> list[str]:
        """All virtual clients are always available."""
        return list(self._ids)

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        """Return all clients, or raise :class:`~fedcore.errors.RoundFailed` if there are fewer than ``num_clients``."""
        return all_virtual_clients(self._ids, num_clients)

    def _envelope(self, client_id: str, timeout_s: float | None) -> dict[str, Any]:
        """What a worker needs besides the instruction to run ``client_id`` (see :func:`client_service`)."""
        return {
            "client": client_id,
            "partition": self._index[client_id],
            "attacker": client_id in self._attackers,
            "timeout_s": timeout_s,
        }


# ---------------------------------------------------------------------------------------------------------------
# framing: [u32 envelope length][envelope JSON][u32 header length][header bytes]

_LEN = struct.Struct("<I")


def _write_message(fd: int, envelope: Mapping[str, Any], header: bytes = b"") -> None:
    body = json.dumps(envelope, separators=(",", ":")).encode()
    data = memoryview(b"".join((_LEN.pack(len(body)), body, _LEN.pack(len(header)), header)))
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _read_exact(fd: int, size: int) -> bytes | None:
    """``size`` bytes from ``fd``; None at end of file before the first byte.

    Raises:
        TransportError: end of file in the middle (the other side died while writing).
    """
    chunks: list[bytes] = []
    left = size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            if left == size:
                return None
            raise TransportError(f"pipe closed after {size - left} of {size} bytes of a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_message(fd: int) -> tuple[dict[str, Any], bytes] | None:
    """The next ``(envelope, header bytes)`` from ``fd``; None at end of file.

    Raises:
        TransportError: a truncated or oversized message.
    """
    parts: list[bytes] = []
    for _ in range(2):
        prefix = _read_exact(fd, _LEN.size)
        if prefix is None:
            if parts:
                raise TransportError("pipe closed between the envelope and the header of a message")
            return None
        (size,) = _LEN.unpack(prefix)
        if size > MAX_MESSAGE_BYTES:
            raise TransportError(f"a control message claims {size} bytes; at most {MAX_MESSAGE_BYTES} are read")
        body = _read_exact(fd, size) if size else b""
        if body is None:
            raise TransportError("pipe closed inside a message")
        parts.append(body)
    return json.loads(parts[0]), parts[1]


# ---------------------------------------------------------------------------------------------------------------
# the pool (parent side)


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen[bytes]
    commands: int  # our end of the worker's command pipe (we write)
    results: int  # our end of the worker's result pipe (we read)
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    task: tuple[int, str, ServerMessage] | None = None  # (seq, client id, instruction) in flight
    pinned: deque[str] = field(default_factory=deque)


class ProcessPool(VirtualClients):
    """A :class:`~server.pool.ClientPool` whose virtual clients train in worker processes (see the module
    docstring).

    Args:
        client_ids: the virtual clients' ids; client ``client_ids[i]`` gets partition ``i``.
        tasks: how workers build a client's task.
        workers: the number of worker processes (default: :func:`default_workers`, the cores this process may
            use).
        threads: torch threads of each worker (1: each worker one core).
        state_dir: the virtual clients' persistent state directory (:class:`client.state.ClientStateStore`),
            shared by the workers; None when no client keeps state.
        attackers: the attacking clients (a label attack in ``tasks.attack`` alters their training labels).
        shm_dir: where to make the shared-memory directory (default :data:`SHM_ROOT` when it exists).

    Raises:
        ConfigError: repeated client ids, workers or threads < 1.
        TransportError: a worker could not start (the message gives the worker's own error, e.g. a task factory
            that cannot be imported).
    """

    kind = "process pool"

    def __init__(
        self,
        client_ids: Sequence[str],
        tasks: ClientTasks,
        *,
        workers: int | None = None,
        threads: int = 1,
        state_dir: str | os.PathLike[str] | None = None,
        attackers: frozenset[str] = frozenset(),
        shm_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(client_ids, attackers)
        count = default_workers() if workers is None else workers
        if count < 1 or threads < 1:
            raise ConfigError(f"workers and threads must be >= 1, got workers={count}, threads={threads}")
        self._spec = tasks.worker_spec(
            threads=threads, state_dir=None if state_dir is None else str(Path(state_dir).resolve())
        )
        root = Path(shm_dir) if shm_dir is not None else (SHM_ROOT if SHM_ROOT.is_dir() else None)
        remove_stale_dirs(root or Path(tempfile.gettempdir()))
        self._dir = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=root))
        self._workers: list[_Worker | None] = [None] * count
        self._seq = 0
        self._files: dict[tuple[object, ...], tuple[str, int, NamedArrays]] = {}  # this run's inputs
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._dir)
        try:
            for i in range(count):
                self._workers[i] = self._spawn(i)
            self.wait_until_ready()
        except BaseException:
            self.close()
            raise

    # -- ClientPool ----------------------------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        """The number of worker processes."""
        return len(self._workers)

    @property
    def shm_dir(self) -> Path:
        """The pool's shared-memory directory (removed by :meth:`close`)."""
        return self._dir

    def worker_pids(self) -> list[int]:
        """The process ids of the live workers."""
        return [w.process.pid for w in self._workers if w is not None]

    def close(self) -> None:
        """End the workers (killing those that do not exit within :data:`STOP_TIMEOUT_S`) and remove the
        shared-memory directory. Idempotent.

        Ctrl-C is held back until both are done (:func:`fedcore.interrupts.deferred_interrupts`): close runs on
        the way out of a run the first Ctrl-C stopped, and a second one, raised while it waited for a worker, left
        the directory behind."""
        with deferred_interrupts():
            self._closed = True
            self._finalizer()

    # -- scheduling -----------------------------------------------------------------------------------------

    def _slots(self) -> Sequence[_Worker | None]:
        return self._workers

    def _busy(self) -> bool:
        return any(w is not None and w.task is not None for w in self._workers)

    def _schedule(
        self, instructions: Mapping[str, ServerMessage], shared: deque[str], timeout_s: float | None
    ) -> Generator[Reply, None, None]:
        while True:
            for worker in self._workers:
                if worker is None or not worker.ready or worker.task is not None:
                    continue
                queue = worker.pinned if worker.pinned else shared
                if queue and self._may_start(queue[0]):
                    client_id = queue.popleft()
                    failure = self._dispatch(worker, client_id, instructions[client_id], timeout_s)
                    if failure is not None:
                        yield failure
            live = [w for w in self._workers if w is not None]
            running = [w for w in live if w.task is not None]
            starting = [w for w in live if not w.ready]
            pending = bool(shared) or any(w.pinned for w in live)
            if not running and not pending:
                return
            if not running and not starting:
                if any(w.ready for w in live):
                    continue  # a worker freed up: hand it the next client
                for client_id in shared:  # no worker left to run them
                    instruction = instructions[client_id]
                    reason = "no simulation worker is left to run this client (they died and could not be replaced)"
                    yield Failure(client_id=client_id, round=instruction.round, stage=instruction.stage, reason=reason)
                return
            waiting = running + starting
            readable, _, _ = select.select([w.results for w in waiting], [], [], 1.0)
            for worker in waiting:
                if worker.results in readable:
                    yield from self._receive(worker, shared)
                elif not worker.ready and time.monotonic() - worker.started > START_TIMEOUT_S:
                    raise TransportError(
                        f"a replacement simulation worker did not start within {START_TIMEOUT_S:.0f} s"
                    )

    def _dispatch(
        self,
        worker: _Worker,
        client_id: str,
        instruction: ServerMessage,
        timeout_s: float | None,
    ) -> Failure | None:
        from fedcore.wire import task_header

        try:
            arrays, metadata = payload_arrays(instruction)
            name, size = "", 0
            if arrays:
                key = (*(id(a) for a in arrays.values()), *sorted(metadata.items()))
                files = self._files
                if key not in files:
                    self._seq += 1
                    name = f"in-{self._seq}.safetensors"
                    written = save_payload(self._dir / name, arrays, metadata, durable=False, digest=False)
                    release_mapped(arrays)  # a mapped global model: out of memory until a fold or the step reads it
                    files[key] = (name, written.size, arrays)  # the arrays stay referenced: ids stay unique
                name, size, _ = files[key]
            header = task_header(instruction, task_id="", payload_bytes=size).SerializeToString()
        except FedcoreError as exc:
            return Failure(client_id=client_id, round=instruction.round, stage=instruction.stage, reason=str(exc))
        except OSError as exc:
            raise TransportError(
                f"cannot write the model to the shared-memory directory {str(self._dir)!r}: {exc.strerror or exc}; "
                "give the pool more room (e.g. docker run --shm-size) or another directory (shm_dir)"
            ) from exc
        self._seq += 1
        envelope = {"seq": self._seq, "payload": name, **self._envelope(client_id, timeout_s)}
        self._affinity.pin(client_id, instruction, worker.index)
        worker.task = (self._seq, client_id, instruction)
        with contextlib.suppress(OSError):  # the worker died: its result pipe reports end of file, failing this client
            _write_message(worker.commands, envelope, header)
        return None

    def _receive(self, worker: _Worker, shared: deque[str]) -> Iterator[Reply]:
        try:
            message = _read_message(worker.results)
        except TransportError as exc:
            message, problem = None, f"died ({exc.message})"
        else:
            problem = "died"
        if message is None:
            if not worker.ready:  # a replacement that cannot start would be replaced forever
                raise TransportError(
                    f"a replacement simulation worker exited while starting ({_exit_status(worker.process)}); its "
                    "error is above"
                )
            yield from self._replace(worker, shared, problem)
            return
        envelope, header = message
        if envelope.get("kind") == "ready":
            worker.ready = True
            return
        if envelope.get("kind") == "error":  # the worker could not start: nothing will start better
            reason = bound_text(str(envelope.get("error", "")))
            self._kill(worker)
            self._workers[worker.index] = None
            raise TransportError(f"a simulation worker could not start: {reason}")
        task, worker.task = worker.task, None
        if task is None or envelope.get("seq") != task[0]:
            raise TransportError(f"worker {worker.index} answered a task it was not given ({envelope.get('seq')})")
        _, client_id, instruction = task
        name = envelope.get("payload") or ""

        def load() -> Payload:
            path = self._dir / Path(name).name
            try:
                return open_safetensors(path, round=instruction.round, client_id=client_id)
            finally:
                path.unlink(missing_ok=True)  # the mapping stays valid; the memory goes with the arrays

        yield decode_reply(header, client_id, instruction, load if name else None)

    def _replace(self, worker: _Worker, shared: deque[str], problem: str) -> Iterator[Failure]:
        """Fail the client ``worker`` was running, move its pinned clients out, and start a replacement."""
        status = _exit_status(worker.process)
        self._kill(worker)
        if worker.task is not None:
            _, client_id, instruction = worker.task
            yield Failure(
                client_id=client_id,
                round=instruction.round,
                stage=instruction.stage,
                reason=(
                    f"the simulation worker process {worker.process.pid} running this client {problem} ({status}); "
                    "its update is lost (out of memory, or a crash in native code?); a new worker takes its place"
                ),
            )
        self._affinity.forget(worker.index)  # their state machines died with the worker
        shared.extend(worker.pinned)
        log.warning(
            "simulation worker %d (pid %d) %s (%s); starting another", worker.index, worker.process.pid, problem, status
        )
        self._workers[worker.index] = None
        try:
            self._workers[worker.index] = self._spawn(worker.index)
        except OSError as exc:
            log.error("cannot start a replacement worker: %s", exc)

    def _end_run(self) -> None:
        for worker in self._workers:
            if worker is not None:
                worker.pinned.clear()
        for name, _, _ in self._files.values():  # a worker still training has mapped its input already
            (self._dir / name).unlink(missing_ok=True)
        self._files = {}

    def _drain(self) -> None:
        for worker in self._workers:
            if worker is not None and worker.task is not None:
                for _ in self._receive(worker, deque()):  # its update file is mapped, unlinked and dropped
                    pass

    # -- processes ------------------------------------------------------------------------------------------

    def _spawn(self, index: int) -> _Worker:
        commands_read, commands_write = os.pipe()
        results_read, results_write = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env.setdefault("OMP_NUM_THREADS", str(self._spec["threads"]))
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _WORKER_LAUNCH,
                    str(commands_read),
                    str(results_write),
                    str(os.getpid()),
                    str(self._dir),
                ],
                pass_fds=(commands_read, results_write),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (commands_read, commands_write, results_read, results_write):
                os.close(fd)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.close(commands_read)
                os.close(results_write)
        worker = _Worker(index, process, commands_write, results_read)
        with contextlib.suppress(OSError):  # it died at once: its result pipe says so
            _write_message(worker.commands, {"kind": "spec", **self._spec, "dir": str(self._dir), "index": index})
        return worker

    def wait_until_ready(self) -> None:
        """Wait until every worker has started (the pool's constructor does; a worker that replaces a dead one
        starts while the others train, and this waits for it too, e.g. before timing a round).

        Raises:
            TransportError: a worker exited while starting, reported an error, or took longer than
                :data:`START_TIMEOUT_S`.
        """
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            waiting = [w for w in self._workers if w is not None and not w.ready]
            if not waiting:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(
                    f"{len(waiting)} simulation worker(s) did not start within {START_TIMEOUT_S:.0f} s"
                )
            readable, _, _ = select.select([w.results for w in waiting], [], [], left)
            for worker in waiting:
                if worker.results in readable:
                    message = _read_message(worker.results)
                    if message is None:
                        raise TransportError(
                            f"a simulation worker exited while starting ({_exit_status(worker.process)}); its "
                            "error is above"
                        )
                    envelope, _ = message
                    if envelope.get("kind") == "error":
                        raise TransportError(
                            f"a simulation worker could not start: {bound_text(str(envelope.get('error', '')))}"
                        )
                    worker.ready = True

    def _kill(self, worker: _Worker) -> None:
        _stop(worker, timeout_s=0.0)


def sums_depend_on_order(instructions: Mapping[str, ServerMessage]) -> bool:
    """Whether the updates that ``instructions`` ask for sum to other bits in another order: a fit instruction's
    global model holds a float64 tensor (each model object looked at once)."""
    seen: set[int] = set()
    for message in instructions.values():
        if isinstance(message, FitIns) and id(message.parameters) not in seen:
            seen.add(id(message.parameters))
            if any(np.asarray(value).dtype == np.float64 for value in message.parameters.values()):
                return True
    return False


ORDER_BUDGET_BYTES = 1 << 30
"""About how many bytes of updates may wait for a slower client's reply when replies are yielded in order."""


def order_window(instructions: Mapping[str, ServerMessage], workers: int) -> int:
    """How many places past the first reply not yet yielded a client may be started when replies are yielded in
    order: :data:`ORDER_BUDGET_BYTES` worth of updates the size of the fit instructions' model, and at least
    ``4 * workers`` (so that small models never hold a worker back)."""
    models = {id(m.parameters): m.parameters for m in instructions.values() if isinstance(m, FitIns)}
    size = max((num_bytes(model) for model in models.values()), default=0)
    return max(4 * max(workers, 1), ORDER_BUDGET_BYTES // max(size, 1))


class OrderWindow:
    """The clients of a run whose replies are yielded in ``instructions``' order (:func:`in_order` advances
    :attr:`released`): a client may start while fewer than ``size`` places separate it from the first reply not yet
    yielded, which bounds the replies held back behind a slow client to ``size``."""

    def __init__(self, instructions: Mapping[str, ServerMessage], size: int) -> None:
        if size < 1:
            raise ConfigError(f"the order window must hold at least 1 client, got {size}")
        self.size = size
        self.released = 0
        self._position = {client_id: i for i, client_id in enumerate(instructions)}

    def allows(self, client_id: str) -> bool:
        """Whether ``client_id`` (one of the instructions) lies within the window."""
        return self._position[client_id] < self.released + self.size


def in_order(
    instructions: Mapping[str, ServerMessage], replies: Iterable[Reply], window: OrderWindow | None = None
) -> Iterator[Reply]:
    """``replies`` (one per client of ``instructions``, in any order) in the order of ``instructions``: each is
    yielded as soon as every reply ahead of it has been; one for a client not instructed, or a second one for a
    client, is yielded at once. ``window.released`` follows how many have been yielded in order."""
    order = list(instructions)
    held: dict[str, Reply] = {}
    seen: set[str] = set()
    position = 0
    for reply in replies:
        if reply.client_id not in instructions or reply.client_id in seen:
            yield reply
            continue
        seen.add(reply.client_id)
        held[reply.client_id] = reply
        while position < len(order) and order[position] in held:
            position += 1
            if window is not None:
                window.released = position
            yield held.pop(order[position - 1])
    yield from (held[cid] for cid in order[position:] if cid in held)  # after a client that never replied


def decode_reply(
    header: bytes, client_id: str, instruction: ServerMessage, load: Callable[[], Payload] | None
) -> Reply:
    """The reply of a worker (see :func:`client_service`) to ``instruction``: its ``ResultHeader`` bytes and, from
    ``load()``, its tensors (None: it sent none). A header or tensors that cannot be read fail the client (a
    Failure with the reason), never the pool; a failure keeps the stage of the instruction it answers."""
    from fedcore.proto.v1 import fedcore_pb2 as pb
    from fedcore.wire import reply_from_header

    try:
        parameters, metadata = load() if load is not None else (None, {})
        reply = reply_from_header(
            pb.ResultHeader.FromString(header), client_id=client_id, parameters=parameters, metadata=metadata
        )
    except (FedcoreError, OSError) as exc:
        reason = exc.message if isinstance(exc, FedcoreError) else str(exc)
        reply = Failure(client_id=client_id, round=instruction.round, stage=instruction.stage, reason=reason)
    if isinstance(reply, Failure) and reply.stage != instruction.stage:
        return Failure(client_id=reply.client_id, round=reply.round, stage=instruction.stage, reason=reply.reason)
    return reply


class StageAffinity:
    """Which worker holds each client's round protocol state machines this round.

    Clients of a multi-stage round protocol (SecAgg+) keep their state in the worker that answered their first
    stage message of the round; every later message of that client in that round goes to the same worker. A pool
    keeps one of these and asks it, for each batch of instructions, which clients any worker may take.
    """

    def __init__(self) -> None:
        self._round = -1
        self._worker: dict[str, int] = {}

    def split(self, instructions: Mapping[str, ServerMessage], workers: Sequence[Any]) -> deque[str]:
        """Append each client pinned to a live worker to that worker's ``pinned`` queue (``workers[i]`` is worker
        ``i`` or None) and return the others, in order: the shared queue. A new round forgets the pins."""
        shared: deque[str] = deque()
        for client_id, instruction in instructions.items():
            if instruction.round != self._round:
                self._worker, self._round = {}, instruction.round
            index = self._worker.get(client_id)
            worker = workers[index] if index is not None else None
            if worker is not None:
                worker.pinned.append(client_id)
            else:
                shared.append(client_id)
        return shared

    def pin(self, client_id: str, instruction: ServerMessage, worker: int) -> None:
        """``worker`` takes ``instruction``: a stage message pins the client to it for the round."""
        if isinstance(instruction, StageIns):
            self._worker[client_id] = worker

    def forget(self, worker: int) -> None:
        """``worker`` died: its clients' state machines died with it."""
        self._worker = {c: i for c, i in self._worker.items() if i != worker}


def _exit_status(process: subprocess.Popen[bytes]) -> str:
    try:
        code = process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop(worker: _Worker, *, timeout_s: float) -> None:
    for fd in (worker.commands, worker.results):
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(subprocess.TimeoutExpired):
        worker.process.wait(timeout=timeout_s)
    if worker.process.poll() is None:
        worker.process.kill()
        worker.process.wait()


def _shutdown(workers: list[_Worker | None], directory: Path) -> None:
    """End every worker (a :data:`STOP` message, then its command pipe closed) and remove ``directory``, with
    Ctrl-C held back until both are done (:func:`fedcore.interrupts.deferred_interrupts`; also when it runs as the
    pool's finalizer at interpreter exit)."""
    with deferred_interrupts():
        try:
            _end_workers(workers)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def _end_workers(workers: list[_Worker | None]) -> None:
    """:func:`_shutdown`'s first part: ask every worker to stop, kill those that do not, empty ``workers``."""
    live = [w for w in workers if w is not None]
    for worker in live:
        # still importing: nothing to finish, and it would read its pipe only once started; or training a client of a
        # run that stopped early (Ctrl-C), whose update nobody will read: it would read the stop message only after
        if not worker.ready or worker.task is not None:
            worker.process.kill()
    for worker in live:  # all asked at once, then each waited for
        with contextlib.suppress(OSError):  # a worker that died has closed its end
            _write_message(worker.commands, {"kind": STOP})  # an end of file without it: the pool died
        with contextlib.suppress(OSError):
            os.close(worker.commands)
        worker.commands = -1
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for worker in live:
        _stop(worker, timeout_s=max(0.0, deadline - time.monotonic()))
    workers[:] = [None] * len(workers)


def remove_stale_dirs(root: Path) -> list[Path]:
    """Remove the shared-memory directories of pools whose process is gone (killed before it could clean up);
    return those removed."""
    removed = []
    with contextlib.suppress(OSError):
        for path in root.glob(f"{DIR_PREFIX}*"):
            pid_text = path.name[len(DIR_PREFIX) :].partition("-")[0]
            if not pid_text.isdigit() or _alive(int(pid_text)):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------------------------
# the worker (child side)


def _worker_main(commands: int, results: int, pool: int, directory: Path) -> int:
    """Serve tasks from ``commands`` until a :data:`STOP` message or end of file; answer on ``results``. ``pool``
    and ``directory``: the pool's process id and shared-memory directory, given on the command line (the worker's
    parent may already have died while Python and torch were importing).

    Ctrl-C in a terminal reaches the whole process group: the worker ignores it, and the pool, which gets it too,
    ends the workers with a stop message. If the pool's process dies (SIGKILL, SIGTERM, the OOM killer), it cannot
    remove its shared-memory directory: a thread of the worker (:func:`_exit_when_orphaned`) sees it gone, removes
    the directory and ends the worker, whatever the worker was doing (each worker's thread tries; the first one does
    it). An end of file without a stop message, or a reply that cannot be written, gives that thread
    :data:`ORPHAN_WAIT_S` seconds to see it (a dying process closes its pipes before its children are reparented);
    a pool that lives closed this worker's pipe to end it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch = threading.Thread(target=_exit_when_orphaned, args=(pool, directory), name="fedcore-orphan-watch")
    watch.daemon = True
    watch.start()
    try:
        status = _serve_commands(commands, results)
    except (OSError, TransportError):  # a pipe broke mid-message: the pool died (or ended this worker)
        status = None
    if status is None:
        watch.join(ORPHAN_WAIT_S)  # ends the process if the pool has died
        return 0
    return status


def _serve_commands(commands: int, results: int) -> int | None:
    """:func:`_worker_main`'s loop: the exit status when it ends as the pool asked (a stop message; 1 for a task
    factory that could not be set up, reported to the pool), None at an end of file without a stop message.

    Raises:
        OSError, TransportError: a pipe broke (BrokenPipeError: a reply the pool's end no longer reads).
    """
    first = _read_message(commands)
    if first is None:
        return None
    try:
        serve = _worker_setup(first[0])
    except Exception as exc:  # reported to the pool, which raises it as a TransportError
        _write_message(results, {"kind": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _write_message(results, {"kind": "ready"})
    while True:
        message = _read_message(commands)
        if message is None:
            return None
        envelope, header = message
        if envelope.get("kind") == STOP:
            return 0
        _write_message(results, *serve(envelope, header))


def _exit_when_orphaned(pool: int, directory: Path) -> None:
    """A worker's watch thread: once the pool's process ``pool`` is gone (SIGKILL, SIGTERM, the OOM killer; this
    worker has another parent), remove the pool's shared-memory ``directory`` and end the worker at once, whatever
    its main thread is doing (a client's training, whose update nobody would read). Polls every
    :data:`ORPHAN_POLL_S` seconds; a file the main thread creates in the directory meanwhile leaves it to the next
    pool's :func:`remove_stale_dirs`."""
    while os.getppid() == pool:
        time.sleep(ORPHAN_POLL_S)
    shutil.rmtree(directory, ignore_errors=True)
    os._exit(0)


Payload = tuple[NamedArrays, dict[str, str]]
"""Tensors and their header metadata, as :func:`fedcore.messages.payload_arrays` gives them."""


Stored = TypeVar("Stored")
Serve = Callable[
    [Mapping[str, Any], bytes, object, Callable[[int, str], Payload] | None, Callable[[Payload], Stored]],
    tuple[bytes, Stored | None],
]
"""What :func:`client_service` returns (see there)."""


def client_service(spec: Mapping[str, Any]) -> Serve[Stored]:
    """The worker side of a pool of worker processes (this module's, and :mod:`simulations.raypool`'s actors):
    builds the task factory once and returns ``serve``, which runs one client's instruction.

    ``spec`` is the pool's :class:`ClientTasks` as a mapping plus ``threads`` (torch threads) and ``state_dir``.
    ``serve(envelope, header, key, load, store)`` takes the envelope (``client``, ``partition``, ``attacker``,
    ``timeout_s``), the instruction's protobuf ``TaskHeader`` bytes, a hashable ``key`` naming its tensors (the
    same key and header as the previous call: the instruction already decoded is reused, one model check per
    round), ``load(round, client_id)`` giving those tensors (None: the instruction has none) and ``store``, which
    keeps an update's tensors where the pool reads them (a file, bytes in Ray's object store). It returns the
    ``ResultHeader`` bytes and what ``store`` returned (None: no tensors). A client whose task raises, or whose
    tensors cannot be loaded or stored, answers a Failure; ``serve`` itself does not raise.

    Raises:
        ConfigError, ImportError...: the task factory cannot be loaded (the pool reports it as a worker that could
            not start).
    """
    import torch

    from client.state import ClientStateStore
    from fedcore.config import from_mapping
    from fedcore.proto.v1 import fedcore_pb2 as pb
    from fedcore.task import Task, TaskContext, load_task_factory
    from fedcore.wire import instruction_from_header, result_header
    from simulations.attacks import LABEL_ATTACKS, AttackConfig, attacked_tasks
    from simulations.inmemory import InMemoryPool

    torch.set_num_threads(int(spec["threads"]))
    factory = load_task_factory(spec["factory"])
    options = {str(k): str(v) for k, v in spec["options"].items()}
    data_dir = spec["data_dir"]
    attack = from_mapping(AttackConfig, spec["attack"], where="attack")
    current: dict[str, Any] = {}

    def make_task(client_id: str) -> Task:
        context = TaskContext(
            role="client",
            client_id=client_id,
            partition_id=int(current["partition"]),
            num_partitions=int(spec["num_partitions"]),
            data_dir=Path(data_dir) if data_dir is not None else None,
            seed=int(spec["seed"]),
            options=options,
        )
        if current["attacker"] and attack.kind in LABEL_ATTACKS:
            honest: Callable[[str], Task] = lambda _cid: factory(context)  # noqa: E731
            classes = int(spec["label_attack_classes"])
            return attacked_tasks(honest, frozenset({client_id}), attack, classes, seed=int(spec["seed"]))(client_id)
        return factory(context)

    state = ClientStateStore(spec["state_dir"]) if spec["state_dir"] is not None else None
    pool = InMemoryPool((), make_task, state=state, max_tasks=int(spec["max_tasks"]), device=spec["device"])
    last: tuple[tuple[object, bytes], ServerMessage] | None = None

    def serve(
        envelope: Mapping[str, Any],
        header: bytes,
        key: object,
        load: Callable[[int, str], Payload] | None,
        store: Callable[[Payload], Stored],
    ) -> tuple[bytes, Stored | None]:
        nonlocal last
        client_id = str(envelope["client"])
        current["partition"], current["attacker"] = envelope["partition"], bool(envelope["attacker"])
        parsed = pb.TaskHeader.FromString(header)
        out: Stored | None = None
        try:
            if last is not None and last[0] == (key, header):
                instruction = last[1]  # every client of a round: one instruction, one model check
            else:
                arrays, metadata = load(parsed.round, client_id) if load is not None else ({}, {})
                instruction = instruction_from_header(parsed, arrays, metadata)
                last = ((key, header), instruction)
            reply = next(iter(pool.run({client_id: instruction}, timeout_s=envelope.get("timeout_s"))))
            if isinstance(reply, FitRes | StageRes):
                arrays, metadata = payload_arrays(reply)
                if arrays:
                    out = store((arrays, metadata))
        except Exception as exc:  # the client fails, the worker goes on
            stage = {pb.STAGE_FIT: Stage.FIT, pb.STAGE_EVALUATE: Stage.EVALUATE}.get(parsed.stage, Stage.PROTOCOL)
            reason = exc.message if isinstance(exc, FedcoreError) else f"{type(exc).__name__}: {exc}"
            reply, out = Failure(client_id=client_id, round=parsed.round, stage=stage, reason=reason), None
        return result_header(reply, session="", task_id="").SerializeToString(), out

    return serve


def _worker_setup(spec: Mapping[str, Any]) -> Callable[[Mapping[str, Any], bytes], tuple[dict[str, Any], bytes]]:
    """:func:`client_service` over this pool's shared-memory files: an update goes to ``out-<worker>-<n>``."""
    service: Serve[str] = client_service(spec)
    directory = Path(spec["dir"])
    worker = int(spec["index"])
    count = 0

    def store(payload: Payload) -> str:
        nonlocal count
        count += 1
        name = f"out-{worker}-{count}.safetensors"
        save_payload(directory / name, *payload, durable=False, digest=False)
        return name

    def serve(envelope: Mapping[str, Any], header: bytes) -> tuple[dict[str, Any], bytes]:
        name = str(envelope["payload"] or "")

        def load(round: int, client_id: str) -> Payload:
            # Plain views of the mapping, not np.memmaps: a reader releases a memmap's pages as it copies them
            # (client.runner.load_parameters), which frees nothing for a file in shared memory (its pages are the
            # file's) and made each of the round's clients fault the model in again (2NN: 473 us a client, 136 in
            # memory).
            arrays, metadata = open_safetensors(directory / name, round=round, client_id=client_id)
            return {key: array.view(np.ndarray) for key, array in arrays.items()}, metadata

        reply_header, out = service(envelope, header, name, load if name else None, store)
        return {"seq": envelope["seq"], "payload": out or ""}, reply_header

    return serve


if __name__ == "__main__":
    sys.exit(_worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])))
