"""Prometheus metrics of the coordinator (prometheus-client), on their own registry.

Exposed names: ``fedcore_rounds_completed_total``, ``fedcore_connected_clients``, ``fedcore_bytes_in_total``,
``fedcore_bytes_out_total``, ``fedcore_round_duration_seconds`` (histogram), ``fedcore_updates_rejected_total``
and ``fedcore_current_round``. :meth:`ServerMetrics.serve` starts the HTTP endpoint (``/metrics``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class ServerMetrics:
    """The server's counters and gauges; every method is thread-safe (prometheus-client's own locking)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rounds = Counter("fedcore_rounds_completed", "Federated rounds completed", registry=self.registry)
        self.current_round = Gauge("fedcore_current_round", "Last completed round", registry=self.registry)
        self.connected = Gauge("fedcore_connected_clients", "Clients with a live session", registry=self.registry)
        self.bytes_in = Counter("fedcore_bytes_in", "Payload bytes received from clients", registry=self.registry)
        self.bytes_out = Counter("fedcore_bytes_out", "Payload bytes sent to clients", registry=self.registry)
        self.rejected = Counter(
            "fedcore_updates_rejected", "Client replies rejected or failed (all reasons)", registry=self.registry
        )
        self.round_seconds = Histogram(
            "fedcore_round_duration_seconds",
            "Wall time of a round, evaluation included",
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
            registry=self.registry,
        )

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Start the ``/metrics`` HTTP endpoint on ``address:port`` in a daemon thread."""
        start_http_server(port, addr=address, registry=self.registry)
