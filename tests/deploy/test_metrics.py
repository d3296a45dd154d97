"""The server's Prometheus metrics: bytes out counted as chunks are sent, the endpoint's address, what the
rejected-updates counter counts."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest

import server.metrics
from fedcore.cli import build_parser, main
from fedcore.messages import FitIns, Reply
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.task import FitConfig
from fedcore.wire import DataChunk
from server.grpc_pool import GrpcClientPool, PoolConfig
from server.metrics import ServerMetrics
from server.service import AuthPolicy, CoordinatorService

pytestmark = pytest.mark.timeout(60)


def _bytes_out(metrics: ServerMetrics) -> float:
    value = metrics.registry.get_sample_value("fedcore_bytes_out_total")
    assert value is not None
    return value


def test_bytes_out_counts_a_download_whose_client_cancels_after_the_trailer(tmp_path: Path) -> None:
    # A client that has read the trailer has the whole payload and may close the stream at once; gRPC then
    # closes the PullTask generator at its last yield, and nothing after that yield runs.
    metrics = ServerMetrics()
    pool = GrpcClientPool(
        PoolConfig(spill_dir=tmp_path, chunk_bytes=1024, heartbeat_interval_s=0.2, liveness_timeout_s=1.0), metrics
    )
    service = CoordinatorService(pool, AuthPolicy(), metrics)
    try:
        session = pool.join("c")
        params = {"w": np.arange(3000, dtype=np.float32)}  # a few chunks of 1 KiB
        ins = FitIns(round=1, parameters=params, config=FitConfig(), seed=0)
        replies: list[Reply] = []
        runner = threading.Thread(target=lambda: replies.extend(pool.run({"c": ins}, timeout_s=5)))
        runner.start()
        context = cast(grpc.ServicerContext, object())  # used only to abort, which this call does not
        stream = service.PullTask(pb.PullTaskRequest(session=session, wait_s=5), context)
        first = next(stream)
        assert isinstance(first, pb.TaskChunk) and first.WhichOneof("body") == "header"
        size = first.header.payload_bytes
        received = 0
        for chunk in stream:
            if isinstance(chunk, DataChunk):
                received += len(chunk.data)
            elif chunk.WhichOneof("body") == "trailer":
                break
        stream.close()  # what gRPC does when the client cancels: GeneratorExit at the trailer's yield
        assert received == size > 4 * 1024
        assert _bytes_out(metrics) == size
        pool.leave(session)  # the task fails at once; the round runner returns
        runner.join(10)
        assert len(replies) == 1
    finally:
        pool.close()


def test_metrics_endpoint_listens_on_loopback_unless_told_otherwise() -> None:
    metrics = ServerMetrics()
    host, port = metrics.serve(0)
    try:
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert b"fedcore_bytes_out_total" in response.read()
    finally:
        metrics.close()
    other = ServerMetrics()
    try:
        assert other.serve(0, "0.0.0.0")[0] == "0.0.0.0"
    finally:
        other.close()


def test_server_start_metrics_address_flag(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(server.metrics, "DEFAULT_METRICS_ADDRESS", server.metrics.DEFAULT_METRICS_ADDRESS)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server", "start", "--help"])
    start_help = " ".join(capsys.readouterr().out.split())
    assert "--metrics-address HOST" in start_help and "default 127.0.0.1" in start_help
    bound: list[tuple[str, int]] = []

    def fake_run_server(config: Any) -> None:  # what server.app.run_server does with the metrics settings
        metrics = ServerMetrics()
        if config.metrics_port is not None:
            bound.append(metrics.serve(config.metrics_port))
        metrics.close()

    monkeypatch.setattr("server.app.run_server", fake_run_server)
    base = ["server", "start", "--insecure", "--task", "simulations.tasks:demo_task", "--metrics-port", "0"]
    assert main(base) == 0
    assert main([*base, "--metrics-address", "0.0.0.0"]) == 0
    assert [host for host, _ in bound] == ["127.0.0.1", "0.0.0.0"]


def test_rejected_counter_help_says_what_it_counts() -> None:
    (family,) = [f for f in ServerMetrics().registry.collect() if f.name == "fedcore_updates_rejected"]
    assert "all reasons" not in family.documentation
    for counted in ("truncated", "corrupted", "size limit"):
        assert counted in family.documentation
    assert "Not counted" in family.documentation and "missed heartbeats" in family.documentation
