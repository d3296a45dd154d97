"""The Ray backend: virtual clients trained by Ray actors, on this machine or on an existing Ray cluster.

:class:`RayPool` is a :class:`server.pool.ClientPool` built like the process pool (:mod:`simulations.procpool`),
with Ray for processes and transport. Each worker is one Ray actor started once per run: it builds the task factory
once, keeps one model for all the clients it trains and runs client after client, through the same worker code as
a process-pool worker (:func:`simulations.procpool.client_service`). Nothing crosses a process boundary as a pickled
torch object:

- tensors (the global model, each update) travel as safetensors bytes (:func:`fedcore.tensors.encode`) held by Ray's
  object store as uint8 arrays: the global model is put once per round and read by every actor (zero copy on the
  same node), an update is returned by its actor and decoded by the pool;
- everything else travels as the gRPC path's protobuf headers (:func:`fedcore.wire.task_header`,
  :func:`fedcore.wire.result_header`) plus a small envelope (client id, partition id).

The same conversions serve the gRPC path and the process pool, so the pool gives the in-process history bit for bit
as long as each actor trains with the same number of torch threads (``threads``, 1 by default).

Scheduling is a dynamic queue: each actor holds :data:`QUEUE_DEPTH` (one) client at a time and gets the next client
of the round's queue once the reply has reached the driver, so a slow client delays only its own actor. Clients of
a multi-stage round protocol (SecAgg+) stay on the actor that answered their first stage message of the round
(:class:`simulations.procpool.StageAffinity`).

Failures: a client whose task raises fails as in the in-memory pool. An actor that dies (a crash in native code,
killed for memory, its node lost) fails the client it was running with a reason that says so, and a new actor
takes its place. :meth:`RayPool.close` kills the actors and, when the pool started Ray itself, shuts Ray down.

Ray (``pip install -e '.[ray]'`` from a checkout) is imported only when a pool is made. With ``address=None`` the
pool joins the Ray instance this process already started, or starts a local one (``ray.init()``); with an address
(``"ray://head:10001"``, ``"auto"``) it joins that cluster, whose nodes must have fedcore, the task factory's module
and the task's data at the same paths.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import sys
import threading
import warnings
from collections import deque
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from fedcore.aggregation.blocks import release_mapped
from fedcore.errors import ConfigError, FedcoreError, TransportError, pip_install
from fedcore.interrupts import deferred_interrupts
from fedcore.messages import Failure, Reply, ServerMessage, bound_text, payload_arrays
from fedcore.tensors import decode, encode, read_metadata
from simulations.procpool import (
    START_TIMEOUT_S,
    ClientTasks,
    Payload,
    Serve,
    VirtualClients,
    client_service,
    decode_reply,
)

log = logging.getLogger("fedcore.simulation")

QUEUE_DEPTH = 1
"""Clients handed to one actor at a time. One, so that the call Ray fails when an actor dies is the client it was
running: Ray fails every unanswered call of a dead actor, and with a second call queued that includes a client that
had finished while its reply was still in the actor's process (it then starts the next client before sending it),
so the pool would fail that finished client and requeue the one that killed the actor, which kills its replacement
too. The price is one round trip to the driver (about 1-2 ms) between two clients of an actor."""
RAY_EXTRA = "'fedcore[ray]'"
RAY_CHECKOUT = "-e '.[ray]'"
"""What pip installs for Ray with fedcore, as shell words: from PyPI, and from a checkout of fedcore."""


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        ConfigError: Ray is not installed (the message says how to install it).
    """
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"the ray simulation backend needs Ray, which is not installed ({exc}); {pip_install(RAY_EXTRA)} (from a "
            f"checkout: {pip_install(RAY_CHECKOUT)}), or choose backend = 'process' for every core "
            "of one machine"
        ) from None
    return ray


REACH_TIMEOUT_S = 10.0
"""How long :func:`check_reachable` waits for a Ray cluster's head to accept a connection."""


def _init_ray(ray: Any, address: str | None) -> None:
    """``ray.init`` for the pool: a local instance (no dashboard, Ray leaves the process's logging alone) when
    ``address`` is None, else the cluster at ``address`` (or Ray Client, which takes no other arguments).

    Raises:
        ConfigError: nothing answers at ``address``, or ``auto`` finds no Ray running here (or several).
    """
    with warnings.catch_warnings():  # Ray's notice about a future default of accelerator variables
        warnings.simplefilter("ignore", FutureWarning)
        if address is None:
            ray.init(include_dashboard=False, configure_logging=False)
            return
        check_reachable(address)  # else ray.init retries an address where nothing listens for ever
        try:
            ray.init(address=address)
        except ConnectionError as exc:  # 'auto' with no Ray running here, or several
            found = str(exc).partition(". ")[0]  # its advice names ray's own --address flag
            raise ConfigError(
                f"ray_address {address!r}: {found}; start a cluster (ray start --head) or give its address "
                "(host:port, ray://host:10001), or leave ray_address unset to start Ray on this machine"
            ) from None


_TERMINATED = threading.Event()
"""Set by :func:`_exit_on_sigterm`: Ray's wait replaces the SystemExit the handler raises with SystemExit(1)."""


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    """SIGTERM during a run on Ray: leave through the run's cleanup (the pool's ``close`` stops the Ray this run
    started) with the status a process killed by the signal reports, 128 + 15."""
    _TERMINATED.set()
    raise SystemExit(128 + signum)


def _sigterm_before_init() -> Any:
    """The SIGTERM handler before ``ray.init``, which replaces whatever it finds with its own (``sys.exit(15)``:
    a terminated run printed a native stack dump and exited 1); None outside the main thread, where Python sets no
    handler. :func:`_sigterm_after_init` puts it back, or :func:`_exit_on_sigterm` where it was the default."""
    return signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None


def _sigterm_after_init(before: Any) -> None:
    """After ``ray.init``: a handler the program installed itself is put back, the default becomes
    :func:`_exit_on_sigterm` (the run's cleanup runs, and the status is the signal's)."""
    _TERMINATED.clear()  # a SIGTERM an earlier pool of this process exited through is not this run's
    if before is not None:
        signal.signal(signal.SIGTERM, _exit_on_sigterm if before == signal.SIG_DFL else before)


def check_reachable(address: str, *, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Refuse a Ray cluster address (``host:port`` or ``ray://host:port``) where nothing accepts a TCP connection
    within ``timeout_s`` seconds: ``ray.init`` itself retries such an address without end. ``"auto"`` and
    ``"local"``, which Ray resolves on this machine, and other schemes (Ray's plug-ins) are not checked.

    Raises:
        ConfigError: the address is not ``host:port``, or no connection to it was made (with the OS's reason).
    """
    if address in ("auto", "local"):
        return  # resolved by Ray on this machine
    if "://" in address and not address.startswith("ray://"):
        _check_plugin_scheme(address)  # a plug-in scheme (module://...) Ray hands to its module
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"ray_address {address!r} is not host:port, ray://host:port or 'auto'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            f"no Ray cluster answers at ray_address {address!r} ({exc.strerror or exc}); check the host and port "
            "(a head started with `ray start --head` listens on 6379, Ray Client on ray://host:10001), or leave "
            "ray_address unset to start Ray on this machine"
        ) from None


def _check_plugin_scheme(address: str) -> None:
    """Refuse an address ``scheme://...`` whose scheme names no Ray Client plug-in (a module with a
    ``ClientBuilder``, which Ray imports and calls): Ray itself fails on it with a traceback (an AssertionError for
    ``http://``, the dashboard's address, given in place of the cluster's).

    Raises:
        ConfigError: no module of that name, or one without ``ClientBuilder``.
    """
    scheme = address.partition("://")[0]
    try:
        module = importlib.import_module(scheme) if scheme else None
    except Exception:  # anything a module the user named raises on import: it is no plug-in
        module = None
    if hasattr(module, "ClientBuilder"):
        return
    hint = (
        " (http:// is the Ray dashboard's and job submission's address, not the cluster's: give ray://HOST:10001 "
        "for Ray Client, or HOST:6379 for the head's GCS)"
        if scheme in ("http", "https")
        else ""
    )
    raise ConfigError(
        f"ray_address {address!r}: {scheme!r} is no Ray Client plug-in module (one with a ClientBuilder); give "
        f"host:port, ray://host:port or 'auto'{hint}"
    )


def _to_bytes(payload: Payload) -> np.ndarray:
    """Safetensors bytes of ``payload`` as a uint8 array (Ray keeps arrays in its object store without a copy)."""
    return np.frombuffer(encode(*payload), dtype=np.uint8)


def _from_bytes(data: np.ndarray, round: int, client_id: str) -> Payload:
    """The tensors and metadata of safetensors bytes (copied out of Ray's read-only object store).

    Raises:
        PayloadError: truncated or corrupted bytes.
    """
    view = np.ascontiguousarray(data, dtype=np.uint8).data
    arrays = decode(view, allow_nonfinite=True, round=round, client_id=client_id)  # the server checks values
    return arrays, read_metadata(view)


class _ClientActor:
    """A Ray actor's body: one :func:`simulations.procpool.client_service` for its lifetime."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self._serve: Serve[np.ndarray] = client_service(spec)

    def run(
        self, envelope: Mapping[str, Any], header: bytes, key: str, model: np.ndarray | None
    ) -> tuple[bytes, np.ndarray | None]:
        """Train one client: ``model`` is the instruction's safetensors bytes (None: it has no tensors)."""
        load = partial(_from_bytes, model) if model is not None else None
        return self._serve(envelope, header, key, load, _to_bytes)

    def pid(self) -> int:
        """The actor's process id."""
        return os.getpid()


@dataclass
class _Actor:
    index: int
    handle: Any
    inflight: deque[tuple[Any, str, ServerMessage]] = field(default_factory=deque)  # (result ref, client, ins)
    pinned: deque[str] = field(default_factory=deque)


class RayPool(VirtualClients):
    """A :class:`~server.pool.ClientPool` whose virtual clients train in Ray actors (see the module docstring).

    Args:
        client_ids: the virtual clients' ids; client ``client_ids[i]`` gets partition ``i``.
        tasks: how actors build a client's task (:class:`simulations.procpool.ClientTasks`).
        workers: the number of actors (default: as many as the cluster's CPUs hold at ``num_cpus`` each, or its
            GPUs at ``num_gpus`` each when that is fewer, at most ``max_workers``).
        max_workers: the most actors that can have work at once (the clients of a round); caps the default.
        threads: torch threads of each actor (1: bit for bit the in-process history on one thread).
        num_cpus, num_gpus: Ray resources each actor holds (fractions allowed, e.g. ``num_gpus=0.25``: four actors
            share a GPU).
        address: the Ray cluster to join (``"host:port"``, ``"auto"``, ``"ray://head:10001"``); None: ``ray.init()``,
            which joins the cluster in ``RAY_ADDRESS`` or the one ``ray start`` last brought up on this machine, and
            otherwise starts a new local Ray instance.
            A process that already started Ray (``ray.init``) keeps its instance, and the pool leaves it running.
        state_dir: the virtual clients' persistent state directory, shared by the actors (on a cluster: a path
            every node sees); None when no client keeps state.
        attackers: the attacking clients (a label attack in ``tasks.attack`` alters their training labels).

    Raises:
        ConfigError: Ray is not installed, repeated client ids, workers or threads < 1, negative resources, or a
            cluster whose resources hold no actor of this size, or more ``workers`` than Ray on this machine holds.
        TransportError: an actor could not start (the message gives its error, e.g. a task factory that cannot be
            imported on the cluster).
    """

    kind = "Ray pool"

    def __init__(
        self,
        client_ids: Sequence[str],
        tasks: ClientTasks,
        *,
        workers: int | None = None,
        max_workers: int | None = None,
        threads: int = 1,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        address: str | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        attackers: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(client_ids, attackers)
        if threads < 1 or (workers is not None and workers < 1):
            raise ConfigError(f"workers and threads must be >= 1, got workers={workers}, threads={threads}")
        if not (num_cpus >= 0 and num_gpus >= 0 and num_cpus + num_gpus > 0):
            raise ConfigError(f"num_cpus and num_gpus must be >= 0 and not both 0, got {num_cpus} and {num_gpus}")
        ray = self._ray = import_ray()
        self._spec = tasks.worker_spec(threads=threads, state_dir=None if state_dir is None else os.fspath(state_dir))
        self._started_ray = not ray.is_initialized()
        self._sigterm: Any = None  # the SIGTERM handler ray.init replaced, put back by close
        if self._started_ray:
            self._sigterm = _sigterm_before_init()
            try:
                _init_ray(ray, address)
            except BaseException:
                if self._sigterm is not None:
                    signal.signal(signal.SIGTERM, self._sigterm)
                raise
            _sigterm_after_init(self._sigterm)
        env = {"OMP_NUM_THREADS": str(threads)}
        if address is None:  # this machine: the actors import what this process imports (a cluster's own paths stay)
            env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self._options: dict[str, Any] = {
            "num_cpus": num_cpus,
            "num_gpus": num_gpus,
            "max_restarts": 0,  # a dead actor fails its client and is replaced by the pool, not restarted by Ray
            "runtime_env": {"env_vars": env},
        }
        self._actor_class = ray.remote(_ClientActor)
        self._models: dict[tuple[object, ...], tuple[Any, str, int]] = {}  # this run's global models in Ray
        self._actors: list[_Actor | None] = []
        try:
            count = workers if workers is not None else self._fitting_workers(num_cpus, num_gpus)
            count = count if max_workers is None else max(1, min(count, max_workers))
            if address is None:
                self._check_fits(count, num_cpus, num_gpus)
            self._actors = [self._spawn(i) for i in range(count)]
            self.wait_until_ready()
        except BaseException:
            self.close()
            raise

    def _fitting_workers(self, num_cpus: float, num_gpus: float) -> int:
        resources = self._ray.cluster_resources()
        counts = [int(resources.get(name, 0.0) / need) for name, need in (("CPU", num_cpus), ("GPU", num_gpus)) if need]
        if min(counts) < 1:
            raise ConfigError(
                f"the Ray cluster has {resources.get('CPU', 0.0)} CPUs and {resources.get('GPU', 0.0)} GPUs: not "
                f"enough for one actor of num_cpus={num_cpus}, num_gpus={num_gpus}; lower them"
            )
        return min(counts)

    def _check_fits(self, count: int, num_cpus: float, num_gpus: float) -> None:
        """Refuse ``count`` actors that this machine's Ray cannot hold all at once: those beyond its CPUs (or GPUs)
        would never start, and the pool would wait :data:`~simulations.procpool.START_TIMEOUT_S` for them. Only for
        Ray on this machine (``address`` None), whose resources are fixed; a cluster's autoscaler may add nodes."""
        resources = self._ray.cluster_resources()
        for name, need in (("CPU", num_cpus), ("GPU", num_gpus)):
            have = resources.get(name, 0.0)
            if need and count * need > have + 1e-9:
                key = f"num_{name.lower()}s"
                raise ConfigError(
                    f"workers = {count} Ray actors of {key}={need} need {count * need:g} {name}s, and Ray on this "
                    f"machine has {have:g}: the actors beyond {int(have / need + 1e-9)} would never start; lower "
                    f"workers (or leave it unset: as many as fit) or {key} (fractions allowed)"
                )

    # -- ClientPool ----------------------------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        """The number of actors."""
        return len(self._actors)

    def worker_pids(self) -> list[int]:
        """The process ids of the live actors (on their nodes)."""
        return [int(p) for p in self._ray.get([a.handle.pid.remote() for a in self._actors if a is not None])]

    def close(self) -> None:
        """Kill the actors and, when this pool started Ray, shut it down. Idempotent.

        Ctrl-C is held back until both are done (:func:`fedcore.interrupts.deferred_interrupts`): close runs on
        the way out of a run the first Ctrl-C stopped, and a second one, raised inside ``ray.shutdown``, left Ray's
        agent processes running."""
        with deferred_interrupts():
            if self._closed:
                return
            self._closed = True
            for actor in self._actors:
                if actor is not None:
                    self._ray.kill(actor.handle, no_restart=True)
            self._actors = [None] * len(self._actors)
            if self._started_ray and self._ray.is_initialized():
                self._ray.shutdown()
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)
                self._sigterm = None

    # -- scheduling -----------------------------------------------------------------------------------------

    def _slots(self) -> Sequence[_Actor | None]:
        return self._actors

    def _busy(self) -> bool:
        return any(a is not None and a.inflight for a in self._actors)

    def _schedule(
        self, instructions: Mapping[str, ServerMessage], shared: deque[str], timeout_s: float | None
    ) -> Generator[Reply, None, None]:
        ray = self._ray
        while True:
            for actor in self._actors:
                while actor is not None and len(actor.inflight) < QUEUE_DEPTH:
                    queue = actor.pinned if actor.pinned else shared
                    if not queue or not self._may_start(queue[0]):
                        break
                    client_id = queue.popleft()
                    failure = self._dispatch(actor, client_id, instructions[client_id], timeout_s)
                    if failure is not None:
                        yield failure
            live = [a for a in self._actors if a is not None]
            refs = {ref: actor for actor in live for ref, _, _ in actor.inflight}
            if not refs:
                if not live:
                    for client_id in shared:
                        instruction = instructions[client_id]
                        reason = "no Ray actor is left to run this client (they died and could not be replaced)"
                        yield Failure(
                            client_id=client_id, round=instruction.round, stage=instruction.stage, reason=reason
                        )
                return
            try:
                ready, _ = ray.wait(list(refs), num_returns=1)
            except SystemExit:  # Ray turns any exception a signal handler raises in its wait into SystemExit(1)
                if _TERMINATED.is_set():
                    raise SystemExit(128 + signal.SIGTERM) from None
                raise
            yield from self._receive(refs[ready[0]], ready[0], shared)

    def _dispatch(
        self,
        actor: _Actor,
        client_id: str,
        instruction: ServerMessage,
        timeout_s: float | None,
    ) -> Failure | None:
        from fedcore.wire import task_header

        try:
            arrays, metadata = payload_arrays(instruction)
            model, key, size = None, "", 0
            if arrays:
                ident = (*(id(a) for a in arrays.values()), *sorted(metadata.items()))
                models = self._models
                if ident not in models:  # once per round: every actor reads the same object
                    data = _to_bytes((arrays, metadata))
                    release_mapped(arrays)  # a mapped global model: out of memory until a fold or the step reads it
                    models[ident] = (self._ray.put(data), f"{instruction.round}-{len(models)}", data.size)
                model, key, size = models[ident]
            header = task_header(instruction, task_id="", payload_bytes=size).SerializeToString()
        except FedcoreError as exc:
            return Failure(client_id=client_id, round=instruction.round, stage=instruction.stage, reason=str(exc))
        envelope = self._envelope(client_id, timeout_s)
        self._affinity.pin(client_id, instruction, actor.index)
        ref = actor.handle.run.remote(envelope, header, key, model)
        actor.inflight.append((ref, client_id, instruction))
        return None

    def _receive(self, actor: _Actor, ready: Any, shared: deque[str]) -> Iterator[Reply]:
        """The replies of ``actor``'s calls up to ``ready`` (an actor answers in order)."""
        ray = self._ray
        while actor.inflight:
            ref, client_id, instruction = actor.inflight.popleft()
            try:
                header, data = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                yield self._replace(actor, client_id, instruction, exc, shared)
                return
            except ray.exceptions.RayError as exc:  # e.g. the object was lost with its node
                reason = f"the Ray call for this client failed: {bound_text(str(exc))}"
                yield Failure(client_id=client_id, round=instruction.round, stage=instruction.stage, reason=reason)
            else:
                load = partial(_from_bytes, data, instruction.round, client_id) if data is not None else None
                yield decode_reply(header, client_id, instruction, load)
            if ref == ready:
                return

    def _replace(
        self, actor: _Actor, client_id: str, instruction: ServerMessage, exc: Exception, shared: deque[str]
    ) -> Failure:
        """Fail the client ``actor`` was running (its only call, :data:`QUEUE_DEPTH`), put its pinned clients back,
        start a replacement.

        Raises:
            TransportError: the actor died while starting (a replacement that cannot start would be replaced
                forever).
        """
        if isinstance(exc, self._ray.exceptions.RayActorError) and exc.actor_init_failed:
            raise TransportError(f"a simulation actor could not start: {bound_text(str(exc))}")
        cause = bound_text(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        log.warning("Ray actor %d died (%s); starting another", actor.index, cause)
        self._affinity.forget(actor.index)  # their state machines died with the actor
        shared.extend(actor.pinned)
        self._ray.kill(actor.handle, no_restart=True)
        self._actors[actor.index] = None
        try:
            self._actors[actor.index] = self._spawn(actor.index)
        except Exception as error:
            log.error("cannot start a replacement Ray actor: %s", error)
        return Failure(
            client_id=client_id,
            round=instruction.round,
            stage=instruction.stage,
            reason=(
                f"the Ray actor running this client died ({type(exc).__name__}: {cause}); its update is lost (out "
                "of memory, or a crash in native code?); a new actor takes its place"
            ),
        )

    def _end_run(self) -> None:
        for actor in self._actors:
            if actor is not None:
                actor.pinned.clear()
        self._models = {}  # Ray frees an object when no reference is left (a call in flight holds its own)

    def _drain(self) -> None:
        for actor in self._actors:
            if actor is not None and actor.inflight:
                self._ray.wait([ref for ref, _, _ in actor.inflight], num_returns=len(actor.inflight))
                actor.inflight.clear()

    # -- actors ---------------------------------------------------------------------------------------------

    def _spawn(self, index: int) -> _Actor:
        return _Actor(index, self._actor_class.options(**self._options).remote(self._spec))

    def wait_until_ready(self) -> None:
        """Wait until every actor has built its task factory (the constructor does).

        Raises:
            TransportError: an actor could not start (its error in the message), or not within
                :data:`~simulations.procpool.START_TIMEOUT_S` (the cluster lacks the free resources).
        """
        ray = self._ray
        live = [a for a in self._actors if a is not None]
        try:
            ray.get([a.handle.pid.remote() for a in live], timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            need = f"num_cpus={self._options['num_cpus']}, num_gpus={self._options['num_gpus']}"
            raise TransportError(
                f"{len(live)} Ray actors ({need} each) did not start within {START_TIMEOUT_S:.0f} s: the cluster has "
                f"{ray.available_resources()} free; lower workers or the resources per actor"
            ) from None
        except ray.exceptions.RayError as exc:
            reason = bound_text(str(exc))
            raise TransportError(f"a simulation actor could not start: {reason}") from None
