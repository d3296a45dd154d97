"""The session registry of the gRPC pool: joins, heartbeats, liveness, calls in progress and waiting pulls.

A client is *connected* while its session is alive. A reaper thread marks a client gone once no call or
heartbeat arrived for ``liveness_timeout_s`` (and tells the pool, which fails the client's outstanding task at
once). A live session keeps its client id: a second daemon claiming it is refused (:class:`ClientIdInUse`), while
a restarted daemon whose old session is dead takes the id over at once. Each session has at most
``max_calls_per_client`` calls in progress and one waiting pull (a newer pull ends the older one).

Nothing here knows about tasks or messages: the task board (:mod:`server.task_board`) holds those, keyed by client
id, so a task outlives the session that pulled it and goes to the daemon's next session.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fedcore.errors import RoundFailed, TransportError
from server.metrics import ServerMetrics

log = logging.getLogger("fedcore.server")


class ClientIdInUse(TransportError):
    """A join claimed a client id whose session is alive (another daemon runs with the same ``--client-id``)."""


class TooManyCalls(TransportError):
    """A session has ``max_calls_per_client`` calls in progress already."""


@dataclass(eq=False)
class _Client:
    client_id: str
    session: str
    last_seen: float
    wake: threading.Condition  # on the registry's lock: notified when this client's pull should look again
    calls: int = 0  # calls of this session in progress
    pulls: int = 0  # generation of the waiting pull: a newer pull ends the older one
    disconnected: bool = False  # the last call ended because its connection broke, and none came since
    claimed: bool = False  # a join for this id waits to see whether this session is alive


class SessionRegistry:
    """Who is connected, under which session, and whether they are alive.

    Args:
        lock: the lock shared with the task board (reentrant: the pool holds it across both).
        liveness_timeout_s: a client silent this long is marked gone.
        takeover_wait_s: how long a join waits for a sign of life of an older session of the same id.
        max_calls_per_client: calls one session may have in progress at once.
        on_gone: called (with the lock held) with the client id and the reason when a client is gone (left,
            silent), not when a restarted daemon takes its id over.
        metrics: optional Prometheus metrics (connected clients, dropped clients).
    """

    def __init__(
        self,
        lock: threading.RLock,
        *,
        liveness_timeout_s: float,
        takeover_wait_s: float,
        max_calls_per_client: int,
        on_gone: Callable[[str, str], None],
        metrics: ServerMetrics | None = None,
    ) -> None:
        self._lock = lock
        self._cond = threading.Condition(lock)  # round loop waiters: joins, departures
        self._liveness_timeout_s = liveness_timeout_s
        self._takeover_wait_s = takeover_wait_s
        self._max_calls = max_calls_per_client
        self._on_gone = on_gone
        self._metrics = metrics
        self._clients: dict[str, _Client] = {}
        self._sessions: dict[str, str] = {}
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="fedcore-liveness", daemon=True)
        self._reaper.start()

    # ----------------------------------------------------------- the round's view
    def available(self) -> list[str]:
        """Ids of clients with a live session, sorted."""
        with self._cond:
            return sorted(self._clients)

    def connected(self, client_id: str) -> bool:
        """Whether ``client_id`` has a live session."""
        with self._cond:
            return client_id in self._clients

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

    def notify(self, client_id: str) -> None:
        """Make ``client_id``'s waiting pull look again (a task was posted or closed for it)."""
        with self._cond:
            client = self._clients.get(client_id)
            if client is not None:
                client.wake.notify_all()

    # -------------------------------------------------------------- the network's
    def join(self, client_id: str, *, previous_session: str = "") -> str:
        """Open a session for ``client_id``; see :meth:`server.grpc_pool.GrpcClientPool.join`.

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
            self._clients[client_id] = _Client(
                client_id=client_id, session=session, last_seen=time.monotonic(), wake=threading.Condition(self._lock)
            )
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
                deadline = time.monotonic() + self._takeover_wait_s
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
            if client.calls >= self._max_calls:
                raise TooManyCalls(
                    f"{client.calls} calls of this session are in progress (at most {self._max_calls}); a daemon "
                    "needs no more than three",
                    client_id=client.client_id,
                )
            client.calls += 1
            client.disconnected = False
            self._seen(client)
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
        """Close a session; the pool fails the client's outstanding task at once."""
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
            self._seen(client)
            return client.client_id

    def wait_pull(
        self,
        session: str,
        wait_s: float,
        ready: Callable[[str], object],
        cancelled: threading.Event | None = None,
    ) -> object:
        """Wait up to ``wait_s`` until ``ready(client id)`` (called with the lock held) gives something, and return
        it; None when the wait ends first. One pull per session waits at a time: a newer one ends the older one
        (which returns None); so do :meth:`close`, and ``cancelled`` set (with :meth:`wake` called).

        Raises:
            KeyError: unknown or expired session (also when the session ends while waiting).
        """
        deadline = time.monotonic() + wait_s
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
                got = ready(client.client_id)
                if got is not None:
                    return got
                remaining = deadline - time.monotonic()
                superseded = client.pulls != generation
                if remaining <= 0 or self._stop.is_set() or superseded or (cancelled and cancelled.is_set()):
                    return None
                client.wake.wait(remaining)

    def wake_all(self) -> None:
        """Wake every waiter (the run finished, or the pool closes)."""
        with self._cond:
            self._cond.notify_all()
            for client in self._clients.values():
                client.wake.notify_all()

    def close(self) -> None:
        """Stop the liveness thread and wake every waiter."""
        self._stop.set()
        self.wake_all()
        self._reaper.join(timeout=5)

    # ------------------------------------------------------------------ helpers
    def _seen(self, client: _Client) -> None:
        client.last_seen = time.monotonic()
        if client.claimed:
            self._cond.notify_all()  # the join waiting on this id sees the session is alive

    def _client(self, session: str) -> _Client | None:
        client_id = self._sessions.get(session)
        return None if client_id is None else self._clients.get(client_id)

    def _remove(self, client: _Client, reason: str) -> None:
        self._clients.pop(client.client_id, None)
        self._sessions.pop(client.session, None)
        self._on_gone(client.client_id, reason)
        self._set_connected()
        self._cond.notify_all()
        client.wake.notify_all()

    def _reap_loop(self) -> None:
        period = min(0.25, self._liveness_timeout_s / 10)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._cond:
                for client in list(self._clients.values()):
                    silent = now - client.last_seen
                    if silent > self._liveness_timeout_s:
                        self._remove(client, f"client gone: no heartbeat for {silent:.1f} s")
                        if self._metrics is not None:
                            self._metrics.dropped.inc()

    def _set_connected(self) -> None:
        if self._metrics is not None:
            self._metrics.connected.set(len(self._clients))
