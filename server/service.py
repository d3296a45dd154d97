"""The ``fedcore.v1.Coordinator`` gRPC service: authentication, sessions, task streaming and result intake.

It is the network side of :class:`server.grpc_pool.GrpcClientPool`: every call is checked against the caller's
session (and, with mutual TLS, against the certificate the call arrived with); pulled tasks stream the global
model from its payload file in chunks with a SHA-256 trailer; pushed updates stream into a spill file whose size
and digest are verified before the round loop sees them. A push whose announced size exceeds the limit is
refused before its payload is read.

Availability (no client, with or without credentials, can take the server away from the others):

- Credentials travel in call metadata (``fedcore-session``; for Join ``fedcore-client-id`` and
  ``fedcore-token``) and are checked before a request is read; every RPC is registered as a request stream, so
  no worker thread waits for a request that has not passed that check.
- Long calls (pulls, pushes) hold at most ``max_workers - quick_call_reserve(max_workers)`` worker threads
  (:func:`server.limits.quick_call_reserve`); the rest are kept for heartbeats and joins. Each session has at
  most ``max_calls_per_client`` calls and one waiting pull; joins being read or checked are at most
  ``max_unauthenticated_calls``. A call over a limit is refused at once (RESOURCE_EXHAUSTED), never queued.
- A caller that keeps being refused (wrong tokens, unknown sessions, calls over its session's limits) is paced:
  past ``refusal_burst`` refusals, its connection's refusals are answered ``refusal_rate`` a second (each waits
  its turn, at most ``refusal_max_wait_s``; at most ``max_waiting_refusals`` wait at once), so that a caller in a
  tight loop costs the server that many calls a second, not as many as it can make. A session's pulls and a
  client id's joins are limited by token buckets (``pull_burst``/``pull_rate``, ``join_burst``/``join_rate``):
  beyond, they are refused with the seconds to wait in the ``fedcore-retry-after-s`` trailing metadata.
- A watchdog cuts off any request or stream idle for ``stream_idle_s`` or older than ``stream_total_s``, and an
  upload whose round closed; spill space is reserved only as bytes arrive (:class:`fedcore.payload.SpillFile`).
- Warnings caused by clients are logged once per cause per ``log_every_s`` (:class:`server.limits.RepeatLog`),
  and text from client input is bounded before it is logged or stored.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc

from fedcore.config import Address
from fedcore.errors import ConfigError, FedcoreError, PayloadError
from fedcore.messages import Failure, Reply, Stage, StageIns, bound_text
from fedcore.payload import DataChunk, SpillFile, framed_sizes, read_safetensors_header
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.proto.v1 import fedcore_pb2_grpc as pb_grpc
from fedcore.selection import check_attributes
from fedcore.wire import (
    CLIENT_ID_KEY,
    SESSION_KEY,
    TOKEN_KEY,
    TRANSFER_OPTIONS,
    PayloadReceiver,
    parse_result_chunk,
    reply_from_header,
    serialize_chunk,
    task_header,
)
from server.grpc_pool import GrpcClientPool
from server.limits import (
    Guard,
    RepeatLog,
    ServiceLimits,
    Slots,
    TokenBuckets,
    Watchdog,
    bounded_peer,
    quick_call_reserve,
)
from server.metrics import ServerMetrics
from server.sessions import ClientIdInUse, TooManyCalls
from server.task_board import Task

log = logging.getLogger("fedcore.server")

RETRY_AFTER_KEY = "fedcore-retry-after-s"
"""Trailing metadata of a call refused by a rate limit: the seconds after which the same call would be allowed."""

_STAGES = {pb.STAGE_FIT: Stage.FIT, pb.STAGE_EVALUATE: Stage.EVALUATE, pb.STAGE_PROTOCOL: Stage.PROTOCOL}
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
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a byte-order mark (Windows editors) is not text
    except OSError as exc:
        raise ConfigError(f"cannot read the tokens file {str(path)!r}: {exc}") from exc
    except UnicodeDecodeError as exc:  # a binary or UTF-16 file given by mistake
        raise ConfigError(
            f"the tokens file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); it must hold "
            "'client_id token' lines, as `fedcore certs init --clients N` writes them"
        ) from None
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


def _metadata(context: grpc.ServicerContext, key: str) -> str:
    for item in context.invocation_metadata() or ():
        if item.key == key and isinstance(item.value, str):
            return item.value
    return ""


_JOINS_PER_CLIENT = 2  # joins of one authenticated client id being read at once


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """The servicer; thread-safe (gRPC runs each call on a worker thread).

    The methods named after the RPCs take a request already read; :func:`build_server` registers every RPC as
    a request stream instead, so that the call's credentials (metadata) are checked, and its limits taken,
    before the request is read (:meth:`serve_unary`, :meth:`serve_pull`, :meth:`PushResult`).

    Args:
        pool: the client pool it feeds.
        auth: who may join.
        metrics: optional Prometheus metrics.
        limits: what one call may hold.
        on_join: called with each client's id and the attributes it declared once its join is accepted (the
            strategy's client selection, :meth:`fedcore.selection.Selector.declare`).
    """

    def __init__(
        self,
        pool: GrpcClientPool,
        auth: AuthPolicy,
        metrics: ServerMetrics | None = None,
        limits: ServiceLimits | None = None,
        on_join: Callable[[str, Mapping[str, str]], None] | None = None,
    ) -> None:
        self._on_join = on_join
        self._pool = pool
        self._auth = auth
        self._metrics = metrics
        self.limits = limits if limits is not None else ServiceLimits()
        self._log = RepeatLog(log, self.limits.log_every_s)
        self._watchdog = Watchdog(self._log)
        self._joins = Slots(self.limits.max_unauthenticated_calls)
        self._client_joins: dict[str, Slots] = {}  # per client id whose token passed; ids come from the tokens file
        self._client_joins_lock = threading.Lock()
        self._long_calls = Slots(1 << 30)  # sized by size_for_workers
        limits = self.limits
        self._refusals = TokenBuckets(limits.refusal_burst, limits.refusal_rate)  # per connection (peer)
        self._waiting_refusals = Slots(limits.max_waiting_refusals)
        self._pulls = TokenBuckets(limits.pull_burst, limits.pull_rate)  # per session
        self._joined = TokenBuckets(limits.join_burst, limits.join_rate)  # per client id whose credentials passed

    def size_for_workers(self, max_workers: int) -> int:
        """Let long calls (pulls, pushes) hold at most ``max_workers - quick_call_reserve(max_workers)`` worker
        threads at once; returns that number."""
        self._long_calls.limit = max(1, max_workers - quick_call_reserve(max_workers))
        return self._long_calls.limit

    # ------------------------------------------------------------ request streams
    def serve_unary(
        self, method: Callable[[Any, grpc.ServicerContext], Any], *, session_call: bool
    ) -> Callable[[Iterator[Any], grpc.ServicerContext], Any]:
        """The handler of a unary RPC registered as a request stream: credentials, then the request, then
        ``method``. ``session_call``: the call needs the session in its metadata (all but Join)."""

        def handle(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            name = getattr(method, "__name__", "call")
            if not session_call:
                return self._join_call(requests, context, method)
            with self._session_call(context) as session:
                request = self._read_request(requests, context, name)
                self._check_request_session(request.session, session, context)
                return method(request, context)

        return handle

    def serve_pull(
        self, requests: Iterator[pb.PullTaskRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.TaskChunk | DataChunk]:
        """The PullTask handler: session check, a long-call slot, the request, then :meth:`PullTask` under the
        watchdog (idle while sending, total time)."""
        with self._session_call(context) as session, self._long_call(context):
            self._rate_limit(context, self._pulls, session, "pull rate", "pulls of this session")
            request = self._read_request(requests, context, "PullTask")
            self._check_request_session(request.session, session, context)
            limits = self.limits
            total = self._pool.config.max_poll_s + limits.stream_total_s
            with self._watchdog.guard(context, "a task download", limits.stream_idle_s, total) as guard:
                cancelled = threading.Event()

                def on_end() -> None:  # the call ended (also: its client went away); its waiting pull stops
                    cancelled.set()
                    self._pool.wake(session)

                context.add_callback(on_end)
                guard.waiting = True
                stream = self.PullTask(request, context, cancelled=cancelled)
                first = next(stream, None)
                guard.waiting = False
                guard.progress()
                if first is None:
                    return
                yield first
                for chunk in stream:
                    guard.progress()
                    yield chunk

    def _join_call(
        self, requests: Iterator[pb.JoinRequest], context: grpc.ServicerContext, method: Callable[..., Any]
    ) -> Any:
        client_id, token = _metadata(context, CLIENT_ID_KEY), _metadata(context, TOKEN_KEY)
        authenticated = bool(client_id and self._auth.tokens)
        if authenticated:
            self._check_token(client_id, token, context)  # before the request is read
        # a join whose token passed counts against its client id (two at a time), any other against all
        # unauthenticated calls (max_unauthenticated_calls at a time)
        slots = self._joins_of(client_id) if authenticated else self._joins
        if not slots.try_acquire():
            self._refuse(
                context, "joins", grpc.StatusCode.RESOURCE_EXHAUSTED, "too many joins at once; retry soon", pace=False
            )
        try:
            request = self._read_request(requests, context, "Join")
        finally:
            slots.release()
        if client_id and request.client_id != client_id:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the client id in the metadata and the request differ")
        return method(request, context)

    def _joins_of(self, client_id: str) -> Slots:
        with self._client_joins_lock:
            return self._client_joins.setdefault(client_id, Slots(_JOINS_PER_CLIENT))

    def _read_request(self, requests: Iterator[Any], context: grpc.ServicerContext, name: str) -> Any:
        """The one request message of a call, within ``stream_idle_s``; INVALID_ARGUMENT when it never comes."""
        limits = self.limits
        with self._watchdog.guard(context, f"a {name} request", limits.stream_idle_s, limits.stream_total_s):
            request = next(requests, None)
        if request is None or isinstance(request, memoryview):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{name} takes exactly one request message")
        return request

    @contextlib.contextmanager
    def _session_call(self, context: grpc.ServicerContext) -> Iterator[str]:
        """Check the metadata's session and count the call against its client (before any request is read)."""
        session = _metadata(context, SESSION_KEY)
        if not session:
            self._refuse(
                context,
                "no session",
                grpc.StatusCode.UNAUTHENTICATED,
                f"no session in the call metadata ({SESSION_KEY!r}); join first",
            )
        try:
            client_id = self._pool.begin_call(session)
        except KeyError:
            self._pace_refusal(context)
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, "unknown or expired session; join again")
        except TooManyCalls as exc:
            self._refuse(context, "calls per client", grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message, exc.client_id)
        try:
            self._check_peer(client_id, context)
            yield session
        finally:
            self._pool.end_call(session, disconnected=not context.is_active())

    @contextlib.contextmanager
    def _long_call(self, context: grpc.ServicerContext) -> Iterator[None]:
        if not self._long_calls.try_acquire():
            self._refuse(
                context,
                "long calls",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server holds {self._long_calls.limit} pulls and pushes at once; retry soon",
                pace=False,
            )
        try:
            yield
        finally:
            self._long_calls.release()

    def _refuse(
        self,
        context: grpc.ServicerContext,
        cause: str,
        code: grpc.StatusCode,
        details: str,
        client_id: str | None = "",
        *,
        pace: bool = True,
    ) -> NoReturn:
        """Log (once per cause per interval), count and answer a refused call; with ``pace`` (every cause but the
        server's own capacity, which honest daemons meet under load) the answer waits its connection's turn
        (:meth:`_pace_refusal`)."""
        self._log.warning(
            f"refused {cause}", "refused a call (%s) from %s%s: %s", cause, bounded_peer(context),
            f" (client {client_id})" if client_id else "", details,
        )  # fmt: skip
        if self._metrics is not None:
            self._metrics.refused_calls.labels(cause=cause).inc()
        if pace:
            self._pace_refusal(context)
        _abort(context, code, details)

    def _pace_refusal(self, context: grpc.ServicerContext) -> None:
        """Past ``refusal_burst`` refusals of this call's connection, wait for its turn at ``refusal_rate`` a second
        (at most ``refusal_max_wait_s``) before the refusal is answered; at once when ``max_waiting_refusals``
        already wait."""
        limits = self.limits
        wait = self._refusals.debit(context.peer(), limits.refusal_max_wait_s)
        if wait <= 0 or not self._waiting_refusals.try_acquire():
            return
        try:
            self._log.warning(
                "paced refusals", "pacing the refusals of %s: more than %d in a burst; each waits up to %.1f s",
                bounded_peer(context), limits.refusal_burst, limits.refusal_max_wait_s,
            )  # fmt: skip
            if self._metrics is not None:
                self._metrics.refused_calls.labels(cause="paced").inc()
            time.sleep(wait)
        finally:
            self._waiting_refusals.release()

    def _rate_limit(
        self, context: grpc.ServicerContext, buckets: TokenBuckets, key: str, cause: str, what: str
    ) -> None:
        """Refuse the call (RESOURCE_EXHAUSTED, the seconds to wait in trailing metadata) when ``key``'s bucket is
        empty."""
        retry_after = buckets.take(key)
        if retry_after > 0:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{retry_after:.3f}"),))
            self._refuse(
                context,
                cause,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"more than {buckets.burst} {what} at once and {buckets.rate:g} a second after; retry in "
                f"{retry_after:.1f} s",
            )

    def _check_request_session(self, in_request: str, session: str, context: grpc.ServicerContext) -> None:
        if in_request and not hmac.compare_digest(in_request, session):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the session in the metadata and the request differ")

    def _check_token(self, client_id: str, token: str, context: grpc.ServicerContext) -> None:
        want = self._auth.tokens.get(client_id)
        if want is None or not hmac.compare_digest(want, hash_token(token)):
            self._refuse(
                context,
                "wrong token",
                grpc.StatusCode.UNAUTHENTICATED,
                f"unknown client {bound_text(client_id, 64)!r} or wrong token",
            )

    # ------------------------------------------------------------------ calls
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:  # noqa: N802 - name fixed by the gRPC service
        client_id = request.client_id
        if not client_id or len(client_id) > 256 or not client_id.isprintable():
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "client_id must be 1..256 printable characters")
        if client_id in self._auth.revoked:
            self._refuse(
                context, "revoked client", grpc.StatusCode.PERMISSION_DENIED, f"client {client_id!r} is revoked"
            )
        if self._auth.tokens:
            self._check_token(client_id, _metadata(context, TOKEN_KEY) or request.token, context)
        if self._auth.require_client_cert:
            name = _peer_common_name(context)
            if name != client_id:
                self._refuse(
                    context,
                    "certificate name",
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"the client certificate is issued to {bound_text(str(name), 64)!r}, not to {client_id!r}",
                )
        joins = f"joins of client {bound_text(client_id, 64)!r}"
        self._rate_limit(context, self._joined, client_id, "join rate", joins)
        try:
            attributes = check_attributes(request.attributes)
        except ConfigError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        try:
            session = self._pool.join(client_id, previous_session=_metadata(context, SESSION_KEY))
        except ClientIdInUse as exc:
            self._refuse(context, "client id in use", grpc.StatusCode.ALREADY_EXISTS, exc.message)
        if self._on_join is not None:
            self._on_join(client_id, attributes)
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
        self,
        request: pb.PullTaskRequest,
        context: grpc.ServicerContext,
        cancelled: threading.Event | None = None,
    ) -> Generator[pb.TaskChunk | DataChunk, None, None]:
        client_id = self._session_client(request.session, context)
        try:
            got = self._pool.pull(request.session, request.wait_s, cancelled)
        except KeyError:
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, "unknown or expired session; join again")
        if isinstance(got, bool):
            yield pb.TaskChunk(idle=pb.Idle(finished=got))
            return
        task, fh = got
        sent = 0
        with fh:
            header = task_header(
                task.instruction, task_id=task.task_id, payload_bytes=task.payload.size, deadline_s=task.seconds_left()
            )
            yield pb.TaskChunk(header=header)
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
        with self._session_call(context) as session, self._long_call(context):
            limits = self.limits
            with self._watchdog.guard(context, "an update upload", limits.stream_idle_s, limits.stream_total_s) as g:
                return self._push(_progress(request_iterator, g), context, session, g)

    # ---------------------------------------------------------------- helpers
    def _push(
        self,
        request_iterator: Iterator[pb.ResultChunk | memoryview],
        context: grpc.ServicerContext,
        session: str,
        guard: Guard,
    ) -> pb.PushReply:
        first = next(request_iterator, None)
        if first is None or isinstance(first, memoryview) or first.WhichOneof("body") != "header":
            self._refuse(  # logged with the session's client: the daemon's operator is not the only one to hear
                context,
                "malformed push",
                grpc.StatusCode.INVALID_ARGUMENT,
                "a push must start with a ResultHeader",
                self._pool.touch(session),
            )
        header = first.header
        self._check_request_session(header.session, session, context)
        try:
            client_id, task, reason = self._pool.lookup(session, header.task_id)
        except KeyError:
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, "unknown or expired session; join again")
        if task is None:
            if reason == "duplicate":
                return pb.PushReply(accepted=True, duplicate=True)
            self._log.warning(
                "discarded result", "discarding a result of client %s for task %s: %s", client_id,
                bound_text(repr(header.task_id), 48), reason,
            )  # fmt: skip
            return pb.PushReply(accepted=False, reason=reason)
        problem = _header_problem(header, task)
        if problem:
            return self._reject(task, problem)
        if header.failure or not _carries_payload(header, task):
            return self._deliver(task, header, None)
        if not self._pool.begin_receive(task):
            # one push per task at a time: a client cannot reserve spill space many times over; a daemon that
            # retries after a broken connection backs off until the server has let go of the first attempt
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "a push of this task is already in progress")
        try:
            guard.open_while = lambda: self._pool.is_receiving_open(task)  # cut off when the round closes
            return self._receive_update(task, header, request_iterator, context, guard)
        except grpc.RpcError:
            if guard.cut:  # the round hears at once why this client's update will not come
                return self._reject(task, f"the upload was cut off: {guard.cut}")
            raise
        finally:
            self._pool.end_receive(task)

    def _receive_update(
        self,
        task: Task,
        header: pb.ResultHeader,
        chunks: Iterator[pb.ResultChunk | memoryview],
        context: grpc.ServicerContext,
        guard: Guard,
    ) -> pb.PushReply:
        limit = self._pool.config.max_payload_bytes
        path = self._pool.new_spill_path(task)
        try:
            with (
                path.open("wb") as file,
                PayloadReceiver(
                    SpillFile(file, header.payload_bytes, round=task.round, client_id=task.client_id),
                    announced=header.payload_bytes,
                    limit=limit,
                    round=task.round,
                    client_id=task.client_id,
                ) as receiver,
            ):
                digest = receiver.read_until_trailer(chunks)
                if guard.cut:
                    path.unlink(missing_ok=True)
                    return self._reject(task, f"the upload was cut off: {guard.cut}")
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
        return self._deliver(task, header, path)

    def _deliver(self, task: Task, header: pb.ResultHeader, path: Path | None) -> pb.PushReply:
        """Convert the pushed header to a typed reply (here, at the gRPC edge) and hand it to the pool with the
        verified spill file of its payload, if any."""
        try:
            # the payload's tensors are attached when the round loop takes the reply (mapped from ``path``)
            reply: Reply = reply_from_header(header, client_id=task.client_id, parameters=None if path is None else {})
        except FedcoreError as exc:
            if path is not None:
                path.unlink(missing_ok=True)
            return self._reject(task, str(exc))
        return self._reply(task, self._pool.deliver(task, reply, path))

    def _reject(self, task: Task, reason: str) -> pb.PushReply:
        reason = bound_text(reason)
        self._log.warning(
            "rejected update", "round %d: rejected the update of client %s: %s", task.round, task.client_id, reason
        )
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


def _progress(chunks: Iterator[pb.ResultChunk | memoryview], guard: Guard) -> Iterator[pb.ResultChunk | memoryview]:
    """``chunks``, telling ``guard`` of each one (a push that stops sending is cut off when idle)."""
    for chunk in chunks:
        guard.progress()
        yield chunk


def _carries_payload(header: pb.ResultHeader, task: Task) -> bool:
    """Whether a payload follows the header: a fit result's update always, a stage reply's tensors when announced."""
    return task.stage is Stage.FIT or (task.stage is Stage.PROTOCOL and header.payload_bytes > 0)


def _header_problem(header: pb.ResultHeader, task: Task) -> str:
    """Why a pushed result's header cannot belong to ``task`` ("" when it can)."""
    stage = _STAGES.get(header.stage)
    if header.round != task.round or stage is not task.stage:
        named = stage.value if stage is not None else f"unknown stage {header.stage}"
        return (
            f"the result is for round {header.round} ({named}), but task {task.task_id} is round {task.round} "
            f"({task.stage.value})"
        )
    if len(header.metrics) > _MAX_METRICS or any(
        len(key) > _MAX_METRIC_NAME or not key.isprintable() for key in header.metrics
    ):
        return (
            f"the result reports {len(header.metrics)} metrics; at most {_MAX_METRICS} are taken, each named in at "
            f"most {_MAX_METRIC_NAME} printable characters (they become columns of the run's history)"
        )
    if header.failure:
        return ""
    instruction = task.instruction
    if isinstance(instruction, StageIns):
        got = header.protocol_stage
        if (got.protocol, got.name, got.attempt) != (instruction.protocol, instruction.name, instruction.attempt):
            return (
                f"the result answers stage {bound_text(got.name, 64)!r} of protocol {bound_text(got.protocol, 64)!r} "
                f"(attempt {got.attempt}), but task {task.task_id} is stage {instruction.name!r} of "
                f"{instruction.protocol!r} (attempt {instruction.attempt})"
            )
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
    # every RPC is served as a request stream: the handler runs before the request is read, checks the call's
    # metadata, and reads the request under the watchdog (a unary request and a stream of one message are the
    # same bytes on the wire, so the clients' stubs are unchanged)
    for name, request_type, session_call in (
        ("Join", pb.JoinRequest, False),
        ("Heartbeat", pb.HeartbeatRequest, True),
        ("Leave", pb.LeaveRequest, True),
    ):
        unary = handlers[name]
        handlers[name] = grpc.stream_unary_rpc_method_handler(
            service.serve_unary(getattr(service, name), session_call=session_call),
            request_deserializer=request_type.FromString,
            response_serializer=unary.response_serializer,
        )
    handlers["PullTask"] = grpc.stream_stream_rpc_method_handler(
        service.serve_pull, request_deserializer=pb.PullTaskRequest.FromString, response_serializer=serialize_chunk
    )
    handlers["PushResult"] = grpc.stream_unary_rpc_method_handler(
        service.PushResult, request_deserializer=parse_result_chunk, response_serializer=pb.PushReply.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)


_SERVICE = "fedcore.v1.Coordinator"
_MAX_STREAMS_PER_CONNECTION = 16
"""HTTP/2 streams one connection may have open; a daemon uses three at most (pull, heartbeat, push)."""


def check_listen_address(address: Address) -> None:
    """Bind ``address`` as the gRPC server will (``SO_REUSEADDR``), and let it go at once: a port another process
    listens on, a host that is not one of this machine's addresses or cannot be resolved, or a port the user may
    not bind is refused with the OS's reason, before the server creates its state directory. (gRPC's own bind
    error says only "Failed to bind ... set GRPC_VERBOSITY=debug", after the state directory exists.)

    Raises:
        ConfigError: no socket address of ``address`` can be bound: which, why, and what to give instead.
    """
    try:
        found = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(
            f"cannot listen on {address}: the host {address.host!r} cannot be resolved ({exc}); give an address of "
            f"this machine, e.g. 0.0.0.0:{address.port} (every interface) or 127.0.0.1:{address.port} (this "
            "machine only)"
        ) from None
    failure: OSError | None = None
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
                return  # gRPC listens on every address it can bind, and needs one
            except OSError as exc:
                failure = failure or exc
    advice = {
        errno.EADDRINUSE: "another process listens there (a server still running?): stop it, or give another port",
        errno.EADDRNOTAVAIL: f"it is not an address of this machine; give one of its addresses, or 0.0.0.0:"
        f"{address.port} for every interface",
        errno.EACCES: "a port below 1024 needs privileges: give a port of 1024 or above (e.g. 8443)",
    }
    reason = failure.strerror if failure is not None and failure.strerror else "no socket address to bind"
    hint = "give an address of this machine and a free port"
    if failure is not None and failure.errno is not None:
        hint = advice.get(failure.errno, hint)
    raise ConfigError(f"cannot listen on {address}: {reason}; {hint}")


def build_server(
    service: CoordinatorService,
    address: str,
    *,
    credentials: grpc.ServerCredentials | None,
    max_workers: int,
    chunk_bytes: int,
) -> tuple[grpc.Server, int]:
    """Create (not start) a gRPC server for ``service`` on ``address``; returns it and the bound port.

    ``credentials`` None means plaintext (``--insecure``). Every waiting long-poll and every upload holds a
    worker thread; they may hold all but :func:`quick_call_reserve` of the ``max_workers`` threads, and a
    pull over that limit is refused at once (the daemon polls again a moment later), so heartbeats never wait.
    For N daemons, ``max_workers`` of about 1.1 N + 40 lets every daemon keep a long-poll open.

    Raises:
        ConfigError: the address cannot be bound.
    """
    message_cap = chunk_bytes + (1 << 20)
    service.size_for_workers(max_workers)
    options = [
        # calls beyond what the threads can run are refused by gRPC itself (RESOURCE_EXHAUSTED), not queued
        ("grpc.max_concurrent_streams", _MAX_STREAMS_PER_CONNECTION),
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
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fedcore-rpc"),
        options=options,
        maximum_concurrent_rpcs=2 * max_workers,
    )
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
