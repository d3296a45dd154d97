"""The ``fedcore.v1.Coordinator`` gRPC service: authentication, sessions, task streaming and result intake.

It is the network side of :class:`server.grpc_pool.GrpcClientPool`: every call is checked against the caller's
session (and, with mutual TLS, against the certificate the call arrived with); pulled tasks stream the global
model from its payload file in chunks with a SHA-256 trailer; pushed updates stream into a spill file whose size
and digest are verified before the round loop sees them. A push whose announced size exceeds the limit is
refused before its payload is read.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import grpc

from fedcore.errors import ConfigError, FedcoreError, PayloadError, TransportError
from fedcore.messages import Failure, Stage
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.proto.v1 import fedcore_pb2_grpc as pb_grpc
from fedcore.wire import (
    TRANSFER_OPTIONS,
    DataChunk,
    PayloadReceiver,
    framed_sizes,
    parse_result_chunk,
    preallocate,
    read_safetensors_header,
    serialize_chunk,
)
from server.grpc_pool import GrpcClientPool, Task
from server.metrics import ServerMetrics

log = logging.getLogger("fedcore.server")

_STAGES = {pb.STAGE_FIT: Stage.FIT, pb.STAGE_EVALUATE: Stage.EVALUATE}
_MAX_METRICS = 256
_MAX_METRIC_NAME = 128


@dataclass(frozen=True, kw_only=True)
class AuthPolicy:
    """Who may join.

    Attributes:
        tokens: ``client id -> SHA-256 hex digest of its token``; when non-empty, only these clients may join
            and each must present its token.
        require_client_cert: mutual TLS: the client certificate's common name must equal the client id.
        revoked: client ids refused at join whatever their credentials.
    """

    tokens: Mapping[str, str] = field(default_factory=dict)
    require_client_cert: bool = False
    revoked: frozenset[str] = frozenset()

    @property
    def open(self) -> bool:
        """True when any client id may join (no tokens and no client certificates)."""
        return not self.tokens and not self.require_client_cert


def hash_token(token: str) -> str:
    """The SHA-256 hex digest under which a token is kept (tokens themselves are never stored by the server)."""
    return hashlib.sha256(token.encode()).hexdigest()


def load_tokens(path: Path) -> dict[str, str]:
    """Read a tokens file: one ``client_id token`` pair per line (``#`` comments), as ``fedcore certs init`` writes.

    Returns ``client id -> token digest``.

    Raises:
        ConfigError: the file is missing, holds no token, a line is malformed or a client id repeats.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the tokens file {str(path)!r}: {exc}") from exc
    tokens: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        if len(parts) != 2:
            raise ConfigError(f"{path}:{number}: expected 'client_id token', got {len(parts)} field(s)")
        if parts[0] in tokens:
            raise ConfigError(f"{path}:{number}: client id {parts[0]!r} appears twice")
        tokens[parts[0]] = hash_token(parts[1])
    if not tokens:  # no tokens would mean no check at all: an open server where tokens were asked for
        raise ConfigError(
            f"the tokens file {str(path)!r} holds no 'client_id token' line; add the clients' tokens "
            "(`fedcore certs init --clients N` writes them), or leave out --tokens-file"
        )
    return tokens


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    context.abort(code, details)  # raises
    raise RuntimeError(details)  # pragma: no cover - grpc's abort always raises


def _peer_common_name(context: grpc.ServicerContext) -> str | None:
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else None


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """The servicer; thread-safe (gRPC runs each call on a worker thread).

    Args:
        pool: the client pool it feeds.
        auth: who may join.
        metrics: optional Prometheus metrics.
    """

    def __init__(self, pool: GrpcClientPool, auth: AuthPolicy, metrics: ServerMetrics | None = None) -> None:
        self._pool = pool
        self._auth = auth
        self._metrics = metrics

    # ------------------------------------------------------------------ calls
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:  # noqa: N802 - name fixed by the gRPC service
        client_id = request.client_id
        if not client_id or len(client_id) > 256 or not client_id.isprintable():
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "client_id must be 1..256 printable characters")
        if client_id in self._auth.revoked:
            log.warning("refused join of revoked client %s from %s", client_id, context.peer())
            _abort(context, grpc.StatusCode.PERMISSION_DENIED, f"client {client_id!r} is revoked")
        if self._auth.tokens:
            want = self._auth.tokens.get(client_id)
            if want is None or not hmac.compare_digest(want, hash_token(request.token)):
                log.warning(
                    "refused join of client %s from %s: unknown client or wrong token", client_id, context.peer()
                )
                _abort(context, grpc.StatusCode.UNAUTHENTICATED, f"unknown client {client_id!r} or wrong token")
        if self._auth.require_client_cert:
            name = _peer_common_name(context)
            if name != client_id:
                log.warning("refused join of client %s: certificate is for %r", client_id, name)
                _abort(
                    context,
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"the client certificate is issued to {name!r}, not to {client_id!r}",
                )
        session = self._pool.join(client_id)
        config = self._pool.config
        return pb.JoinReply(
            session=session,
            seed=config.seed,
            heartbeat_interval_s=config.heartbeat_interval_s,
            liveness_timeout_s=config.liveness_timeout_s,
            max_payload_bytes=config.max_payload_bytes,
            chunk_bytes=config.chunk_bytes,
        )

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:  # noqa: N802 - name fixed by the gRPC service
        client_id = self._pool.touch(request.session)
        if client_id is not None:
            self._check_peer(client_id, context)
        return pb.HeartbeatReply(ok=client_id is not None)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:  # noqa: N802 - name fixed by the gRPC service
        client_id = self._pool.touch(request.session)
        if client_id is not None:
            self._check_peer(client_id, context)
            self._pool.leave(request.session)
        return pb.LeaveReply()

    def PullTask(  # type: ignore[override]  # noqa: N802 - name fixed by the gRPC service; yields DataChunk too
        self, request: pb.PullTaskRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TaskChunk | DataChunk]:
        client_id = self._session_client(request.session, context)
        try:
            got = self._pool.pull(request.session, request.wait_s)
        except KeyError:
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, "unknown or expired session; join again")
        if isinstance(got, bool):
            yield pb.TaskChunk(idle=pb.Idle(finished=got))
            return
        task, fh = got
        sent = 0
        with fh:
            yield pb.TaskChunk(header=task.header)
            frame_bytes = task.payload.frame_bytes
            assert frame_bytes is not None, "the pool writes every task payload framed for the wire"
            # the file holds the chunks already framed: each is sent as read, without another copy
            for size, framed in framed_sizes(task.payload.size, frame_bytes):
                chunk = DataChunk(fh.read(framed), framed - size)
                if len(chunk.framed) != framed:
                    raise PayloadError(f"payload file {task.payload.path} is shorter than recorded", round=task.round)
                sent += size
                # counted as each chunk is handed to gRPC: a client that has read the whole payload may cancel
                # the stream before this generator runs past its last yield, so nothing may be counted after it
                if self._metrics is not None:
                    self._metrics.bytes_out.inc(size)
                yield chunk
        log.debug("sending round %d %s task to %s (%d bytes)", task.round, task.stage.value, client_id, sent)
        yield pb.TaskChunk(trailer=pb.Trailer(sha256=task.payload.sha256))

    def PushResult(  # noqa: N802 - name fixed by the gRPC service
        self, request_iterator: Iterator[pb.ResultChunk | memoryview], context: grpc.ServicerContext
    ) -> pb.PushReply:
        first = next(request_iterator, None)
        if first is None or isinstance(first, memoryview) or first.WhichOneof("body") != "header":
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a push must start with a ResultHeader")
        header = first.header
        client_id = self._session_client(header.session, context)
        try:
            client_id, task, reason = self._pool.lookup(header.session, header.task_id)
        except KeyError:
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, "unknown or expired session; join again")
        if task is None:
            if reason == "duplicate":
                return pb.PushReply(accepted=True, duplicate=True)
            log.warning("discarding a result of client %s for task %s: %s", client_id, header.task_id, reason)
            return pb.PushReply(accepted=False, reason=reason)
        problem = _header_problem(header, task)
        if problem:
            return self._reject(task, problem)
        if header.failure or task.stage is not Stage.FIT:
            return self._reply(task, self._pool.deliver(task, header, None))
        if not self._pool.begin_receive(task):
            # one push per task at a time: a client cannot reserve spill space many times over; a daemon that
            # retries after a broken connection backs off until the server has let go of the first attempt
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "a push of this task is already in progress")
        try:
            return self._receive_update(task, header, request_iterator, context)
        finally:
            self._pool.end_receive(task)

    # ---------------------------------------------------------------- helpers
    def _receive_update(
        self,
        task: Task,
        header: pb.ResultHeader,
        chunks: Iterator[pb.ResultChunk | memoryview],
        context: grpc.ServicerContext,
    ) -> pb.PushReply:
        limit = self._pool.config.max_payload_bytes
        path = self._pool.new_spill_path(task)
        try:
            with (
                path.open("wb") as sink,
                PayloadReceiver(
                    sink, announced=header.payload_bytes, limit=limit, round=task.round, client_id=task.client_id
                ) as receiver,
            ):
                try:  # after the receiver accepted the announced size, before a byte is written
                    preallocate(sink, header.payload_bytes)
                except OSError as exc:
                    raise TransportError(
                        f"no room in the spill directory for an update of {header.payload_bytes} bytes ({exc}); "
                        "free disk space or point spill_dir elsewhere",
                        round=task.round,
                        client_id=task.client_id,
                    ) from exc
                digest = receiver.read_until_trailer(chunks)
                if not context.is_active():
                    # the connection broke mid-push: the daemon retries the same task
                    path.unlink(missing_ok=True)
                    _abort(context, grpc.StatusCode.CANCELLED, "push interrupted")
                receiver.finish(digest)
            # the structure (header, dtypes, offsets, shapes) is checked now, so the client hears what is wrong;
            # names, shapes and values against the model are checked when the round folds the update
            read_safetensors_header(path, round=task.round, client_id=task.client_id)
        except FedcoreError as exc:
            path.unlink(missing_ok=True)
            return self._reject(task, str(exc))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        if self._metrics is not None:
            self._metrics.bytes_in.inc(receiver.received)
        return self._reply(task, self._pool.deliver(task, header, path))

    def _reject(self, task: Task, reason: str) -> pb.PushReply:
        log.warning("round %d: rejected the update of client %s: %s", task.round, task.client_id, reason)
        if self._metrics is not None:
            self._metrics.rejected.inc()
        failure = Failure(client_id=task.client_id, round=task.round, stage=task.stage, reason=reason)
        self._pool.deliver(task, failure, None, rejected=True)
        return pb.PushReply(accepted=False, reason=reason)

    @staticmethod
    def _reply(task: Task, discarded: str) -> pb.PushReply:
        if discarded == "duplicate":
            return pb.PushReply(accepted=True, duplicate=True)
        return pb.PushReply(accepted=not discarded, reason=discarded)

    def _session_client(self, session: str, context: grpc.ServicerContext) -> str:
        client_id = self._pool.touch(session)
        if client_id is None:
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, "unknown or expired session; join again")
        self._check_peer(client_id, context)
        return client_id

    def _check_peer(self, client_id: str, context: grpc.ServicerContext) -> None:
        if self._auth.require_client_cert and _peer_common_name(context) != client_id:
            _abort(context, grpc.StatusCode.PERMISSION_DENIED, "this session belongs to another client certificate")


def _header_problem(header: pb.ResultHeader, task: Task) -> str:
    """Why a pushed result's header cannot belong to ``task`` ("" when it can)."""
    stage = _STAGES.get(header.stage)
    if header.round != task.round or stage is not task.stage:
        named = stage.value if stage is not None else f"unknown stage {header.stage}"
        return (
            f"the result is for round {header.round} ({named}), but task {task.task_id} is round {task.round} "
            f"({task.stage.value})"
        )
    if len(header.metrics) > _MAX_METRICS or any(len(key) > _MAX_METRIC_NAME for key in header.metrics):
        return (
            f"the result reports {len(header.metrics)} metrics; at most {_MAX_METRICS} are taken, each named in at "
            f"most {_MAX_METRIC_NAME} characters (they become columns of the run's history)"
        )
    if header.failure:
        return ""
    if header.num_examples < 0:
        return f"num_examples is {header.num_examples}; it must be 0 or more"
    if task.stage is Stage.FIT and header.payload_bytes == 0:
        return "a fit result must carry the updated parameters, but its payload is empty"
    return ""


def _add_service(service: CoordinatorService, server: grpc.Server) -> None:
    """Register ``service`` as the generated ``add_CoordinatorServicer_to_server`` does, except that the two
    payload streams use :mod:`fedcore.wire`'s chunk codec (same bytes on the wire, no protobuf copies of the data);
    the mirror of :func:`fedcore.wire.coordinator_stub` on the client."""

    handlers: dict[str, grpc.RpcMethodHandler] = {}

    class _Collect:  # stands in for the server: receives the generated handler table
        def add_generic_rpc_handlers(self, generic: object) -> None:
            pass

        def add_registered_method_handlers(self, name: str, table: dict[str, grpc.RpcMethodHandler]) -> None:
            handlers.update(table)

    pb_grpc.add_CoordinatorServicer_to_server(service, _Collect())
    handlers["PullTask"] = grpc.unary_stream_rpc_method_handler(
        service.PullTask, request_deserializer=pb.PullTaskRequest.FromString, response_serializer=serialize_chunk
    )
    handlers["PushResult"] = grpc.stream_unary_rpc_method_handler(
        service.PushResult, request_deserializer=parse_result_chunk, response_serializer=pb.PushReply.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)


_SERVICE = "fedcore.v1.Coordinator"


def build_server(
    service: CoordinatorService,
    address: str,
    *,
    credentials: grpc.ServerCredentials | None,
    max_workers: int,
    chunk_bytes: int,
) -> tuple[grpc.Server, int]:
    """Create (not start) a gRPC server for ``service`` on ``address``; returns it and the bound port.

    ``credentials`` None means plaintext (``--insecure``). Every long-poll holds a worker thread, so
    ``max_workers`` must exceed twice the number of clients.

    Raises:
        ConfigError: the address cannot be bound.
    """
    message_cap = chunk_bytes + (1 << 20)
    options = [
        ("grpc.max_receive_message_length", message_cap),
        ("grpc.max_send_message_length", message_cap),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]
    options += list(TRANSFER_OPTIONS)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options)
    _add_service(service, server)
    try:
        port = (
            server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
        )
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {address!r}: {exc}") from exc
    if port == 0:
        raise ConfigError(f"cannot listen on {address!r} (in use, or not a valid host:port)")
    return server, port
