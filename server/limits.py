"""Limits on what one call to the coordinator may hold: the settings (:class:`ServiceLimits`), the worker threads
kept for quick calls, counted slots that never wait, token buckets that pace a caller who calls too often
(:class:`TokenBuckets`), a watchdog that cuts off stalled or overlong calls, and a log that says each repeated
cause once per interval. :mod:`server.service` applies them to every call."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
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
        refusal_burst, refusal_rate: refusals one connection gets answered at once (a wrong token, an unknown
            session, a call over its session's limits), then at most ``refusal_rate`` a second: a refusal beyond
            waits its turn (at most ``refusal_max_wait_s``) before it is answered, so a caller that calls again as
            soon as it is refused is slowed to that pace. An honest daemon is refused this way a few times at most.
        refusal_max_wait_s: the longest a refusal waits. Seconds, > 0.
        max_waiting_refusals: refusals waiting at once, over all connections (each holds a worker thread; beyond,
            refusals are answered at once).
        pull_burst, pull_rate: pulls one session may make at once, then per second (a daemon pulls once per task
            or long-poll); beyond, a pull is refused (RESOURCE_EXHAUSTED, with the seconds to wait in the
            ``fedcore-retry-after-s`` trailing metadata).
        join_burst, join_rate: the same for the joins of one client id whose credentials passed.
    """

    max_unauthenticated_calls: int = 32
    stream_idle_s: float = 60.0
    stream_total_s: float = 1800.0
    log_every_s: float = 60.0
    refusal_burst: int = 50
    refusal_rate: float = 20.0
    refusal_max_wait_s: float = 1.0
    max_waiting_refusals: int = 64
    pull_burst: int = 60
    pull_rate: float = 10.0
    join_burst: int = 10
    join_rate: float = 1.0

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
        for name in ("refusal", "pull", "join"):
            burst, rate = getattr(self, f"{name}_burst"), getattr(self, f"{name}_rate")
            if burst < 1 or not 0 < rate < float("inf"):
                raise ConfigError(f"{name}_burst must be >= 1 and {name}_rate a number > 0, got {burst} and {rate}")
        if not 0 < self.refusal_max_wait_s < float("inf") or self.max_waiting_refusals < 0:
            raise ConfigError(
                f"refusal_max_wait_s must be a number > 0 and max_waiting_refusals >= 0, got "
                f"{self.refusal_max_wait_s} and {self.max_waiting_refusals}"
            )


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


class TokenBuckets:
    """One token bucket per key (a session, a client id, a connection): ``burst`` tokens, refilled at ``rate`` a
    second. At most ``max_keys`` keys are kept, the least recently used forgotten first (a forgotten key starts
    full again), so that callers choosing new keys cannot grow it.

    :meth:`take` is the bucket as a limit (a call is allowed or told how long to wait); :meth:`debit` as a pace
    (every call is allowed, after the wait its turn comes at).
    """

    def __init__(
        self, burst: int, rate: float, *, max_keys: int = 4096, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.rate = rate
        self._max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # key -> [tokens, time of the last refill]

    def _refilled(self, key: str) -> list[float]:
        now = self._clock()
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            bucket = [float(self.burst), now]
        bucket[0] = min(float(self.burst), bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        self._buckets[key] = bucket
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)
        return bucket

    def take(self, key: str) -> float:
        """Take one token of ``key``'s bucket: 0.0 when there was one, else (none taken) the seconds until there
        is one."""
        with self._lock:
            bucket = self._refilled(key)
            if bucket[0] >= 1:
                bucket[0] -= 1
                return 0.0
            return (1 - bucket[0]) / self.rate

    def debit(self, key: str, max_wait_s: float) -> float:
        """Take one token of ``key``'s bucket, into debt when it is empty: the seconds the call should wait for its
        turn (0.0 while tokens are left), at most ``max_wait_s`` (the debt is capped there, so that a caller that
        stops is soon answered at once again)."""
        with self._lock:
            bucket = self._refilled(key)
            bucket[0] = max(bucket[0] - 1, -max_wait_s * self.rate)
            return max(0.0, -bucket[0] / self.rate)


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
