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

from fedcore.cli import main
from fedcore.messages import FitIns, Reply
from fedcore.payload import DataChunk
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.task import FitConfig
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
                received += len(chunk.payload)
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


def test_server_start_metrics_address_reaches_the_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr("server.app.run_server", seen.append)  # capture the config instead of serving
    base = ["server", "start", "--insecure", "--task", "simulations.tasks:demo_task", "--metrics-port", "0"]
    assert main(base) == 0
    assert main([*base, "--metrics-address", "0.0.0.0"]) == 0
    assert [config.metrics_address for config in seen] == ["127.0.0.1", "0.0.0.0"]


def test_rejected_counter_help_says_what_it_counts() -> None:
    (family,) = [f for f in ServerMetrics().registry.collect() if f.name == "fedcore_updates_rejected"]
    assert "all reasons" not in family.documentation
    for counted in ("truncated", "corrupted", "size limit"):
        assert counted in family.documentation
    assert "Not counted" in family.documentation and "missed heartbeats" in family.documentation
