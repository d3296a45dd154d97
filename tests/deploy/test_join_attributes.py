"""Attributes a daemon declares at join reach the server's client selection (stratified by region), over real gRPC
on loopback; bad attributes are refused at join."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from client.daemon import DaemonConfig
from fedcore.cli import build_parser
from fedcore.errors import ConfigError
from fedcore.proto.v1 import fedcore_pb2 as pb
from fedcore.proto.v1 import fedcore_pb2_grpc as pb_grpc
from fedcore.selection import SelectionConfig, Selector
from server.grpc_pool import GrpcClientPool, PoolConfig
from server.metrics import ServerMetrics
from server.service import AuthPolicy, CoordinatorService, build_server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[pb_grpc.CoordinatorStub, Selector]]:
    selector = Selector("stratified", SelectionConfig(stratify_by="region"))
    pool = GrpcClientPool(PoolConfig(spill_dir=tmp_path / "spill", liveness_timeout_s=30.0), ServerMetrics())
    service = CoordinatorService(pool, AuthPolicy(), on_join=selector.declare)
    server, port = build_server(service, "127.0.0.1:0", credentials=None, max_workers=16, chunk_bytes=1 << 16)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.CoordinatorStub(channel), selector
    channel.close()
    server.stop(0)
    pool.close()


def test_declared_regions_decide_the_strata(served: tuple[pb_grpc.CoordinatorStub, Selector]) -> None:
    stub, selector = served
    regions = {"a": "eu", "b": "eu", "c": "eu", "d": "us", "e": "us", "f": "us"}
    for cid, region in regions.items():
        assert stub.Join(pb.JoinRequest(client_id=cid, attributes={"region": region}), timeout=10).session
    # 2 of (eu: 3, us: 3): one from each region, every round and seed
    for rnd in range(1, 11):
        picked = selector.select(sorted(regions), 2, seed=rnd, round=rnd)
        assert sorted(regions[c] for c in picked) == ["eu", "us"]


def test_bad_attributes_are_refused_at_join(served: tuple[pb_grpc.CoordinatorStub, Selector]) -> None:
    stub, _ = served
    with pytest.raises(grpc.RpcError) as caught:
        stub.Join(pb.JoinRequest(client_id="x", attributes={"region": "e" * 65}), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1..64 printable" in str(caught.value.details())
    # an old daemon sends none: it joins, in the stratum of its own
    assert stub.Join(pb.JoinRequest(client_id="old"), timeout=10).session


def test_the_daemon_flag_and_its_checks() -> None:
    args = build_parser().parse_args(
        ["client", "start", "--server", "127.0.0.1:1", "--client-id", "c", "--attribute", "region=eu"]
    )
    given = {k: v for k, v in vars(args).items() if k == "config:attributes"}
    assert given == {"config:attributes": ["region=eu"]}
    assert DaemonConfig(server="127.0.0.1:1", client_id="c", attributes={"region": "eu"}).attributes == {"region": "eu"}
    with pytest.raises(ConfigError, match=r"1\.\.64 printable"):
        DaemonConfig(server="127.0.0.1:1", client_id="c", attributes={"region": ""})
