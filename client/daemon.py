"""``fedcore client start``: the client daemon on a data holder's machine.

It connects out to the server (the client initiates every call), authenticates (token and/or client
certificate), then loops: long-poll for a task, run it through :func:`client.runner.run_instruction` (the same
code path simulation uses), push the reply. A heartbeat thread keeps the session alive independently of
training. Every network failure leads to a reconnect with exponential backoff and full jitter; a lost session
(server restart) to a fresh join. A push is retried with the same task id until the server answers, and the
server treats a repeated push as a duplicate, so retrying is harmless.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from client.runner import ParallelTraining, run_instruction
from fedcore.engine.plan import ParallelPlan
from fedcore.errors import ConfigError, FedcoreError, PayloadError, TransportError
from fedcore.messages import Failure, Instruction, Reply, Stage
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.proto.v1 import fedcore_pb2_grpc as pb_grpc
from fedcore.task import Task, TaskContext, TaskFactory, load_task_factory
from fedcore.tensors import NamedArrays, decode
from fedcore.wire import (
    DEFAULT_CHUNK_BYTES,
    TRANSFER_OPTIONS,
    BackgroundDigest,
    BufferSink,
    DataChunk,
    PayloadReceiver,
    chunk_body,
    coordinator_stub,
    instruction_from_header,
    iter_data_chunks,
    join_metadata,
    message_kind,
    payload_segments,
    result_header,
    session_metadata,
)
from privacy.tls import read_pem

log = logging.getLogger("fedcore.client")

_RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Settings of one client daemon.

    Attributes:
        server: the coordinator's ``host:port``.
        client_id: this client's identity (with mutual TLS: its certificate's common name).
        task: the task factory ``module:attr``.
        task_options: string options for the factory (the demo task: dataset, partition, model, ...).
        partition_id, num_partitions: for built-in demo data, which shard this client holds.
        data_dir: handed to the task (where the user's data lives).
        token: the client's token, if the server uses tokens.
        insecure: plaintext (no TLS); the server must be started with ``--insecure`` too.
        ca_cert: CA certificate (PEM) that signed the server's certificate (None: the system roots).
        cert, key: this client's certificate and key (PEM) for mutual TLS.
        server_name: expected name in the server certificate, when it differs from the host in ``server``.
        poll_s: how long one long-poll may wait on the server.
        backoff_initial_s, backoff_max_s: reconnect delays (exponential, full jitter).
        give_up_after_s: stop when the server stays unreachable this long (None: never).
        exit_when_finished: exit once the server says the run is over.
        max_payload_bytes: largest global model accepted from the server.
        threads: torch intra-op threads for local training (None: torch's default, one per core).
        parallel: train each round under this parallel plan (data/sharded/pipeline parallel, see
            :mod:`fedcore.engine`); None or a plan of all ones trains in this process.
    """

    server: str
    client_id: str
    task: str
    task_options: Mapping[str, str] = field(default_factory=dict)
    partition_id: int | None = None
    num_partitions: int | None = None
    data_dir: Path | None = None
    token: str = ""
    insecure: bool = False
    ca_cert: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None
    poll_s: float = 20.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    give_up_after_s: float | None = None
    exit_when_finished: bool = True
    max_payload_bytes: int = 8 << 30
    threads: int | None = None
    parallel: ParallelPlan | None = None

    def __post_init__(self) -> None:
        if not self.client_id:
            raise ConfigError("client_id must not be empty")
        if (self.cert is None) != (self.key is None):
            raise ConfigError("give both --cert and --key for mutual TLS, or neither")
        if self.insecure and (self.cert is not None or self.ca_cert is not None):
            raise ConfigError("--insecure cannot be combined with certificates")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ConfigError("need 0 < backoff_initial_s <= backoff_max_s")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if not self.poll_s > 0:
            raise ConfigError(f"poll_s must be > 0, got {self.poll_s}")


class DamagedTask(FedcoreError):
    """A task whose header arrived but which cannot be used: its payload is over the limit, truncated, corrupted
    or not safetensors, or its settings are invalid. ``header`` names the task; ``cause`` is the error."""

    def __init__(self, header: pb.TaskHeader, cause: FedcoreError) -> None:
        super().__init__(cause.message, round=cause.round, client_id=cause.client_id, stage=cause.stage)
        self.header = header
        self.cause = cause


class _SessionLost(Exception):
    """The server no longer knows our session: join again."""


def backoff_delays(initial_s: float, max_s: float, rng: random.Random) -> Iterator[float]:
    """Exponential backoff with full jitter: the k-th delay is uniform in [0, min(max, initial * 2^k)]."""
    ceiling = initial_s
    while True:
        yield rng.uniform(0.0, ceiling)
        ceiling = min(max_s, ceiling * 2)


class ClientDaemon:
    """Runs one client until the run finishes, it is stopped, or the server stays unreachable.

    Args:
        config: the daemon's settings.
        factory: the task factory (default: ``load_task_factory(config.task)``).
    """

    def __init__(self, config: DaemonConfig, factory: TaskFactory | None = None) -> None:
        self.config = config
        self._factory = factory if factory is not None else load_task_factory(config.task)
        self._stop = threading.Event()
        self._session = ""
        self._session_ok = threading.Event()
        self._heartbeat_s = 5.0
        self._chunk_bytes = DEFAULT_CHUNK_BYTES
        self._task: Task | None = None
        self._task_seed: int | None = None
        self._parallel: ParallelTraining | None = None
        self._rng = random.Random()
        self._damage_delays: Iterator[float] | None = None  # backoff while the server hands out unusable tasks

    def stop(self) -> None:
        """Ask the daemon to stop after the current call."""
        self._stop.set()

    # ----------------------------------------------------------------- channel
    def _channel(self) -> grpc.Channel:
        cfg = self.config
        cap = 64 << 20
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", cap),
            ("grpc.max_send_message_length", cap),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.enable_retries", 0),
            *TRANSFER_OPTIONS,
        ]
        if cfg.insecure:
            return grpc.insecure_channel(cfg.server, options=options)
        if cfg.server_name:
            options.append(("grpc.ssl_target_name_override", cfg.server_name))

        credentials = grpc.ssl_channel_credentials(
            root_certificates=read_pem(cfg.ca_cert), private_key=read_pem(cfg.key), certificate_chain=read_pem(cfg.cert)
        )
        return grpc.secure_channel(cfg.server, credentials, options=options)

    # ------------------------------------------------------------------- main
    def run(self) -> int:
        """Serve until finished or stopped. Returns the process exit code (0 finished/stopped, 3 gave up)."""
        if self.config.threads is not None:
            import torch

            torch.set_num_threads(self.config.threads)
        delays = backoff_delays(self.config.backoff_initial_s, self.config.backoff_max_s, self._rng)
        unreachable_since: float | None = None
        shown_hint = ""
        while not self._stop.is_set():
            channel = self._channel()
            stub = coordinator_stub(channel)  # payload chunks without protobuf copies
            heartbeat: threading.Thread | None = None
            try:
                seed = self._join(stub)
                unreachable_since = None
                delays = backoff_delays(self.config.backoff_initial_s, self.config.backoff_max_s, self._rng)
                # heartbeats start before the task is built: loading data can outlast the server's liveness
                # timeout, and the session must stay alive meanwhile
                heartbeat = threading.Thread(target=self._heartbeat_loop, args=(stub,), daemon=True)
                heartbeat.start()
                self._prepare_task(seed)
                if self._serve(stub):
                    log.info("the server finished the run; exiting")
                    self._leave(stub)
                    return 0
            except _SessionLost:
                log.info("session lost; joining again")
                continue
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) and not self._session:
                    raise TransportError(
                        f"the server refused to let this client join: {exc.details()}",
                        client_id=self.config.client_id,
                    ) from exc
                now = time.monotonic()
                unreachable_since = unreachable_since if unreachable_since is not None else now
                limit = self.config.give_up_after_s
                hint = "" if self._session else tls_hint(exc, self.config)
                if hint and hint != shown_hint:
                    log.warning("%s", hint)  # once per distinct cause, not on every retry
                    shown_hint = hint
                if limit is not None and now - unreachable_since > limit:
                    log.error(
                        "server %s unreachable for %.0f s; giving up%s",
                        self.config.server,
                        now - unreachable_since,
                        f" ({hint})" if hint else "",
                    )
                    return 3
                delay = next(delays)
                log.warning("connection problem (%s: %s); retrying in %.1f s", code, _details(exc), delay)
                self._stop.wait(delay)
            finally:
                self._session_ok.clear()
                if heartbeat is not None:
                    heartbeat.join(timeout=1)
                channel.close()
        return 0

    def _join(self, stub: pb_grpc.CoordinatorStub) -> int:
        """Open a session; returns the run's seed (for :meth:`_prepare_task`). Heartbeats may start at once.

        The credentials travel in the call metadata; so does the session held before a reconnect, which lets the
        server hand this daemon its id back at once. While another daemon holds the id (ALREADY_EXISTS), the
        server's reason is logged once and the join is tried again every ``backoff_max_s``.
        """
        previous, self._session = self._session, ""
        cfg = self.config
        request = pb.JoinRequest(client_id=cfg.client_id, token=cfg.token)
        refused = False
        while True:
            try:
                reply = stub.Join(request, metadata=join_metadata(cfg.client_id, cfg.token, previous), timeout=30)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.ALREADY_EXISTS or self._stop.is_set():
                    raise
                if not refused:  # once: the reason stays the same while the other daemon runs
                    refused = True
                    log.error(
                        "the server refused client id %r: %s; trying again every %.0f s",
                        cfg.client_id,
                        _details(exc),
                        cfg.backoff_max_s,
                    )
                self._stop.wait(cfg.backoff_max_s)
        self._session = reply.session
        self._heartbeat_s = max(0.1, reply.heartbeat_interval_s)
        self._chunk_bytes = reply.chunk_bytes or DEFAULT_CHUNK_BYTES
        self._session_ok.set()
        log.info("joined %s as %s", self.config.server, self.config.client_id)
        return int(reply.seed)

    def _prepare_task(self, seed: int) -> None:
        """Build the task for the run's ``seed`` (loads the data; may take long), unless built for it already.

        Called with the heartbeat thread running, so the session stays alive however long it takes.
        """
        if self._task is not None and self._task_seed == seed:
            return
        context = TaskContext(
            role="client",
            client_id=self.config.client_id,
            partition_id=self.config.partition_id,
            num_partitions=self.config.num_partitions,
            data_dir=self.config.data_dir,
            seed=seed,
            options=dict(self.config.task_options),
        )
        started = time.perf_counter()
        self._task = self._factory(context)
        self._task_seed = seed
        plan = self.config.parallel
        if plan is not None and not plan.is_single_process:
            plan.check_model(self._task.build_model())  # a bad split point fails here, before any round
            self._parallel = ParallelTraining(task_factory=self.config.task, task_context=context, plan=plan)
        log.info("task ready in %.2f s", time.perf_counter() - started)

    def _heartbeat_loop(self, stub: pb_grpc.CoordinatorStub) -> None:
        while self._session_ok.is_set() and not self._stop.wait(self._heartbeat_s):
            try:
                stub.Heartbeat(
                    pb.HeartbeatRequest(session=self._session),
                    metadata=session_metadata(self._session),
                    timeout=max(2.0, self._heartbeat_s * 2),
                )
            except grpc.RpcError as exc:
                log.debug("heartbeat failed: %s", _details(exc))
            except ValueError:  # the channel was closed under us (reconnecting or stopping): this loop is done
                return

    def _leave(self, stub: pb_grpc.CoordinatorStub) -> None:
        with contextlib.suppress(grpc.RpcError):
            stub.Leave(pb.LeaveRequest(session=self._session), metadata=session_metadata(self._session), timeout=5)

    def _serve(self, stub: pb_grpc.CoordinatorStub) -> bool:
        """Pull, run and push until the run finishes (True) or the daemon is stopped (False)."""
        while not self._stop.is_set():
            pulled = self._pull(stub)
            if pulled is True:
                if self.config.exit_when_finished:
                    return True
                self._stop.wait(self.config.poll_s)
                continue
            if pulled is False:
                continue
            task_id, instruction = pulled
            reply = self._execute(instruction)
            self._push(stub, task_id, reply)
        return False

    def _pull(self, stub: pb_grpc.CoordinatorStub) -> tuple[str, Instruction] | bool:
        timeout = self.config.poll_s + 600.0
        stream = stub.PullTask(
            pb.PullTaskRequest(session=self._session, wait_s=self.config.poll_s),
            metadata=session_metadata(self._session),
            timeout=timeout,
        )
        try:
            got = receive_task(stream, max_payload_bytes=self.config.max_payload_bytes, client_id=self.config.client_id)
            if isinstance(got, bool):
                return got
            header, parameters = got
            try:
                instruction = instruction_from_header(header, parameters)
            except FedcoreError as exc:  # an unknown stage or invalid settings: the task cannot run here
                raise DamagedTask(header, exc) from exc
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise _SessionLost() from exc
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the server is at its limit of long-polls
                delay = self._rng.uniform(0.5, 2.0)
                log.debug("pull refused (%s); pulling again in %.1f s", _details(exc), delay)
                self._stop.wait(delay)
                return False
            raise
        except FedcoreError as exc:
            if isinstance(exc, DamagedTask):
                # tell the server at once, so the round goes on without waiting for its deadline and this task is
                # not handed out again
                self._report_unusable(stub, exc.header, exc.cause)
            if self._damage_delays is None:
                self._damage_delays = backoff_delays(
                    self.config.backoff_initial_s, self.config.backoff_max_s, self._rng
                )
            delay = next(self._damage_delays)
            log.warning("discarded a task that cannot be used (%s); pulling again in %.1f s", exc, delay)
            self._stop.wait(delay)
            return False
        self._damage_delays = None
        return header.task_id, instruction

    def _report_unusable(self, stub: pb_grpc.CoordinatorStub, header: pb.TaskHeader, cause: FedcoreError) -> None:
        failure = pb.ResultHeader(
            session=self._session,
            task_id=header.task_id,
            round=header.round,
            stage=header.stage,
            failure=f"the client could not use the task: {cause}",
        )
        try:
            stub.PushResult(
                iter([pb.ResultChunk(header=failure)]), metadata=session_metadata(self._session), timeout=30
            )
        except grpc.RpcError as exc:
            log.warning("could not tell the server about the unusable task: %s", _details(exc))

    def _execute(self, instruction: Instruction) -> Reply:
        assert self._task is not None  # set by _prepare_task
        started = time.perf_counter()
        log.info("round %d %s started", instruction.round, instruction.stage.value)
        try:
            reply: Reply = run_instruction(self._task, instruction, self.config.client_id, parallel=self._parallel)
        except FedcoreError as exc:
            log.warning("round %d %s failed: %s", instruction.round, instruction.stage.value, exc)
            reply = Failure(
                client_id=self.config.client_id, round=instruction.round, stage=instruction.stage, reason=str(exc)
            )
        except Exception as exc:  # a bug in user code is reported, not fatal
            log.exception("the task raised")
            reply = Failure(
                client_id=self.config.client_id,
                round=instruction.round,
                stage=instruction.stage,
                reason=f"{type(exc).__name__}: {exc}",
            )
        log.info(
            "round %d %s done in %.2f s", instruction.round, instruction.stage.value, time.perf_counter() - started
        )
        return reply

    def _push(self, stub: pb_grpc.CoordinatorStub, task_id: str, reply: Reply) -> None:
        segments: list[memoryview] = []
        if not isinstance(reply, Failure) and hasattr(reply, "parameters"):
            try:
                segments = payload_segments(reply.parameters)  # views of the update: no encoded copy of the model
            except FedcoreError as exc:  # e.g. a dtype safetensors cannot hold: the server hears why
                log.warning("round %d: cannot send the update: %s", reply.round, exc)
                reply = Failure(client_id=self.config.client_id, round=reply.round, stage=Stage.FIT, reason=str(exc))
        digest = BackgroundDigest(segments)  # overlaps the first push
        delays = backoff_delays(self.config.backoff_initial_s, self.config.backoff_max_s, self._rng)
        for attempt in range(1, 1000):
            if self._stop.is_set():
                return
            header = result_header(
                reply, session=self._session, task_id=task_id, payload_bytes=sum(len(s) for s in segments)
            )
            try:
                chunks = result_chunks(header, segments, digest, self._chunk_bytes)
                answer = stub.PushResult(chunks, metadata=session_metadata(self._session), timeout=600)  # type: ignore[arg-type]  # the stub's serializer takes DataChunk
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    # the server restarted: join again and push under the new session (the task may be gone)
                    self._rejoin(stub)
                    continue
                if exc.code() not in _RETRYABLE:
                    log.warning("push of round %d refused: %s", reply.round, _details(exc))
                    return
                delay = next(delays)
                log.warning("push attempt %d failed (%s); retrying in %.1f s", attempt, _details(exc), delay)
                self._stop.wait(delay)
                continue
            if answer.accepted:
                log.info("round %d result accepted%s", reply.round, " (duplicate)" if answer.duplicate else "")
            else:
                log.warning("round %d result not taken: %s", reply.round, answer.reason)
            return

    def _rejoin(self, stub: pb_grpc.CoordinatorStub) -> None:
        # the heartbeat thread of run() is still running and picks up the new session
        self._prepare_task(self._join(stub))


def receive_task(
    chunks: Iterator[memoryview | pb.TaskChunk], *, max_payload_bytes: int, client_id: str
) -> tuple[pb.TaskHeader, NamedArrays] | bool:
    """Read one ``PullTask`` stream: the task header and its payload, decoded.

    The payload is received into one buffer allocated after its announced size passed ``max_payload_bytes``,
    with its SHA-256 computed alongside on a helper thread and checked against the trailer; the returned arrays
    are views into that buffer (no further copy of the model).

    Returns:
        ``(header, parameters)``; or a bool when the server had no task: True when the run is finished, False
        when there is nothing yet (or the stream ended early), so the caller polls again.

    Raises:
        DamagedTask: the header arrived but the payload is over the limit, truncated, corrupted or not
            safetensors (``cause`` says which).
        PayloadError: the stream did not start with a header or an idle message.
        grpc.RpcError: the call failed.
    """
    first = next(chunks, None)
    if first is None:
        return False
    kind = chunk_body(first)[0]
    if kind == "idle" and not isinstance(first, memoryview):
        return bool(first.idle.finished)
    if kind != "header" or isinstance(first, memoryview):
        raise PayloadError(f"a task stream must start with a header, not {message_kind(kind)}", stage="transfer")
    header = first.header
    try:
        sink = BufferSink(header.payload_bytes)  # allocated at the first chunk, after the limit check
        receiver = PayloadReceiver(
            sink, announced=header.payload_bytes, limit=max_payload_bytes, round=header.round, client_id=client_id
        )
        with receiver:
            receiver.finish(receiver.read_until_trailer(chunks))
        parameters = decode(sink.buffer, allow_nonfinite=True, copy=False, round=header.round, client_id=client_id)
    except FedcoreError as exc:
        raise DamagedTask(header, exc) from exc
    return header, parameters


def result_chunks(
    header: pb.ResultHeader, segments: list[memoryview], digest: BackgroundDigest, chunk_bytes: int
) -> Iterator[pb.ResultChunk | DataChunk]:
    """One ``PushResult`` stream: the header, the payload ``segments`` (see :func:`fedcore.wire.payload_segments`)
    cut into framed chunks of ``chunk_bytes`` (each byte copied once), then the trailer with ``digest``."""
    yield pb.ResultChunk(header=header)
    if segments:
        yield from iter_data_chunks(segments, chunk_bytes)
        yield pb.ResultChunk(trailer=pb.Trailer(sha256=digest.digest()))


def tls_hint(exc: grpc.RpcError, config: DaemonConfig) -> str:
    """A hint for a join that failed in the TLS handshake, or "" when ``exc`` does not look like one.

    gRPC reports handshake failures as UNAVAILABLE: a server certificate this client cannot verify shows its
    cause in the details; a client certificate the server does not trust shows only as "Socket closed" (the
    server ends the handshake), so that hint is a "may".
    """
    code = exc.code() if hasattr(exc, "code") else None
    if config.insecure or code != grpc.StatusCode.UNAVAILABLE:
        return ""
    text = _details(exc)
    lowered = text.lower()
    if "hostname verification" in lowered or "no match found for server name" in lowered:
        return (
            "TLS: the server certificate is not issued to the name this client connects to; pass --server-name "
            "with a name in the server certificate (or connect by such a name)"
        )
    if "wrong_version_number" in lowered:
        return (
            "TLS: the server did not answer with TLS; it may have been started with --insecure (then pass "
            "--insecure here too)"
        )
    if "handshake failed" in lowered or "certificate" in lowered:
        return (
            "TLS: this client could not verify the server certificate; check that --ca-cert is the CA that "
            "signed the server's --tls-cert, and --server-name if you connect by an address not in the "
            "certificate"
        )
    if config.cert is not None and ("socket closed" in lowered or "connection reset" in lowered):
        return (
            "TLS: the server closed the connection during the handshake; it may not trust this client "
            f"certificate: check --cert {config.cert} / --key {config.key}, and that the CA given to the "
            "server as --client-ca signed it"
        )
    return ""


def _details(exc: grpc.RpcError) -> str:
    details = getattr(exc, "details", None)
    return str(details()) if callable(details) else str(exc)
