"""Prometheus metrics of the coordinator (prometheus-client), on their own registry.

Exposed names: ``fedcore_rounds_completed_total``, ``fedcore_connected_clients``, ``fedcore_bytes_in_total``,
``fedcore_bytes_out_total``, ``fedcore_round_duration_seconds`` (histogram), ``fedcore_updates_rejected_total``,
``fedcore_clients_dropped_total``, ``fedcore_calls_refused_total`` (by cause) and ``fedcore_current_round``.
:meth:`ServerMetrics.serve` starts the HTTP endpoint (``/metrics``), on the loopback interface unless told
otherwise (``fedcore server start --metrics-address``).
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

#: Where :meth:`ServerMetrics.serve` listens when no address is given: loopback only, so the endpoint is not
#: reachable from other machines unless asked for (``ServerConfig.metrics_address`` / ``--metrics-address``).
DEFAULT_METRICS_ADDRESS = "127.0.0.1"


class ServerMetrics:
    """The server's counters and gauges; every method is thread-safe (prometheus-client's own locking)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._http: WSGIServer | None = None
        self.rounds = Counter("fedcore_rounds_completed", "Federated rounds completed", registry=self.registry)
        self.current_round = Gauge("fedcore_current_round", "Last completed round", registry=self.registry)
        self.connected = Gauge("fedcore_connected_clients", "Clients with a live session", registry=self.registry)
        self.bytes_in = Counter("fedcore_bytes_in", "Payload bytes received from clients", registry=self.registry)
        self.bytes_out = Counter("fedcore_bytes_out", "Payload bytes sent to clients", registry=self.registry)
        self.rejected = Counter(
            "fedcore_updates_rejected",
            "Client results refused by the server while receiving them: payload truncated, corrupted (SHA-256), "
            "over the size limit, or not matching its task's round/stage. Not counted: updates the round loop "
            "rejects later (NaN/Inf, wrong shapes), failures clients report, missed deadlines, and clients "
            "dropped for missed heartbeats",
            registry=self.registry,
        )
        self.dropped = Counter(
            "fedcore_clients_dropped",
            "Clients marked gone because their heartbeats stopped (their task of the round failed at once)",
            registry=self.registry,
        )
        self.refused_calls = Counter(
            "fedcore_calls_refused",
            "Calls refused before any work was done for them, by cause: no or unknown credentials, a limit "
            "reached (calls per client, joins at once, long calls at once), a client id in use, a malformed push",
            ["cause"],
            registry=self.registry,
        )
        self.round_seconds = Histogram(
            "fedcore_round_duration_seconds",
            "Wall time of a round, evaluation included",
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
            registry=self.registry,
        )

    def serve(self, port: int, address: str | None = None) -> tuple[str, int]:
        """Start the ``/metrics`` HTTP endpoint on ``address:port`` in a daemon thread.

        ``address`` None means :data:`DEFAULT_METRICS_ADDRESS` (loopback); port 0 picks a free one. Returns the
        bound host and port.
        """
        host = DEFAULT_METRICS_ADDRESS if address is None else address
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self._http.server_address
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        """Stop the HTTP endpoint, if :meth:`serve` started one."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
