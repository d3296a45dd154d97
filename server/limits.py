"""Limits on what one call to the coordinator may hold: the settings (:class:`ServiceLimits`), the worker threads
kept for quick calls, counted slots that never wait, a watchdog that cuts off stalled or overlong calls, and a
log that says each repeated cause once per interval. :mod:`server.service` applies them to every call."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from fedcore.errors import ConfigError
from fedcore.messages import bound_text


@dataclass(frozen=True, kw_only=True)
class ServiceLimits:
    """What one call may hold, so that no client (authenticated or not) can take the server's threads, disk or
    log away from the others.

    Attributes:
        max_unauthenticated_calls: joins whose request is being read or checked at once (beyond: refused with
            RESOURCE_EXHAUSTED, the daemon retries). A join whose token in the metadata passed (checked before
            its request is read) counts against its own client id instead: two at a time.
        stream_idle_s: a request or stream that makes no progress this long is cut off (a push whose chunks
            stop, a pull whose client stops reading, a request that never arrives). Seconds, > 0.
        stream_total_s: no push or pull stream lasts longer (after its pull's wait). Seconds, > stream_idle_s;
            size it for the largest update on the slowest link (8 GiB at 10 MB/s: about 900 s).
        log_every_s: a repeated warning of one cause (a wrong token, a cut-off stream) is logged once per this
            many seconds, with the count of repeats. Seconds, > 0.
    """

    max_unauthenticated_calls: int = 32
    stream_idle_s: float = 60.0
    stream_total_s: float = 1800.0
    log_every_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_unauthenticated_calls < 1:
            raise ConfigError(f"max_unauthenticated_calls must be >= 1, got {self.max_unauthenticated_calls}")
        if not self.stream_idle_s > 0:
            raise ConfigError(f"stream_idle_s must be > 0, got {self.stream_idle_s}")
        if not self.stream_total_s > self.stream_idle_s:
            raise ConfigError(
                f"stream_total_s ({self.stream_total_s}) must exceed stream_idle_s ({self.stream_idle_s})"
            )
        if not self.log_every_s > 0:
            raise ConfigError(f"log_every_s must be > 0, got {self.log_every_s}")


def quick_call_reserve(max_workers: int) -> int:
    """Worker threads kept for quick calls (heartbeats, joins, leaves): long calls (pulls, pushes) may hold the
    other ``max_workers - quick_call_reserve(max_workers)`` at most, so a heartbeat never waits behind them."""
    return max(min(_MIN_QUICK_RESERVE, max_workers // 2), max_workers // 10)


_MIN_QUICK_RESERVE = 8 + 32  # heartbeats in flight plus the default max_unauthenticated_calls


class RepeatLog:
    """Logs a warning once per cause per ``every_s`` seconds; the next line of a cause says how many were left
    out. Causes are fixed strings chosen by the server (never client input), so their number is bounded."""

    def __init__(self, logger: logging.Logger, every_s: float) -> None:
        self._log = logger
        self._every = every_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warning(self, cause: str, message: str, *args: object) -> None:
        """Log ``message % args`` unless ``cause`` was logged less than ``every_s`` ago (then count it)."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(cause)
            if last is not None and now - last < self._every:
                self._skipped[cause] = self._skipped.get(cause, 0) + 1
                return
            self._last[cause] = now
            skipped = self._skipped.pop(cause, 0)
        suffix = f" ({skipped} more like this in the last {self._every:.0f} s)" if skipped else ""
        self._log.warning(message + suffix, *args)


class Slots:
    """A count of things held at once with a limit; acquiring never waits."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    def try_acquire(self) -> bool:
        with self._lock:
            if self._held >= self.limit:
                return False
            self._held += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._held -= 1


class Guard:
    """One call watched by the watchdog: cut off when idle or over time (or when ``open_while`` turns False)."""

    __slots__ = ("context", "cut", "idle_s", "last", "open_while", "started", "total_s", "waiting", "what")

    def __init__(self, context: grpc.ServicerContext, what: str, idle_s: float, total_s: float) -> None:
        self.context = context
        self.what = what
        self.idle_s = idle_s
        self.total_s = total_s
        self.started = self.last = time.monotonic()
        self.waiting = False  # a pull waiting for its task: not idle
        self.open_while: Callable[[], bool] | None = None
        self.cut = ""

    def progress(self) -> None:
        self.last = time.monotonic()


class Watchdog:
    """A thread that cancels guarded calls that stall or run too long, logging each cause once per interval."""

    def __init__(self, log_once: RepeatLog) -> None:
        self._guards: dict[int, Guard] = {}
        self._lock = threading.Lock()
        self._log = log_once
        self._thread = threading.Thread(target=self._loop, name="fedcore-stream-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, context: grpc.ServicerContext, what: str, idle_s: float, total_s: float) -> Iterator[Guard]:
        g = Guard(context, what, idle_s, total_s)
        with self._lock:
            self._guards[id(g)] = g
        try:
            yield g
        finally:
            with self._lock:
                self._guards.pop(id(g), None)

    def _loop(self) -> None:
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            with self._lock:
                guards = list(self._guards.values())
            for g in guards:
                if g.cut:
                    continue
                if now - g.started > g.total_s:
                    g.cut = f"it ran longer than {g.total_s:.0f} s"
                elif not g.waiting and now - g.last > g.idle_s:
                    g.cut = f"it made no progress for {g.idle_s:.0f} s"
                elif g.open_while is not None and not g.open_while():
                    g.cut = "its round closed"
                if g.cut:
                    self._log.warning(f"cut {g.what}", "cut off %s from %s: %s", g.what, bounded_peer(g.context), g.cut)
                    g.context.cancel()


def bounded_peer(context: grpc.ServicerContext) -> str:
    return bound_text(context.peer(), 64)
