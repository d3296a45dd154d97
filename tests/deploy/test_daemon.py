"""The client daemon against an in-process server on 127.0.0.1: heartbeats while the task is built, and clear
hints when the TLS handshake fails."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import cast

import grpc
import pytest

from client.daemon import ClientDaemon, DaemonConfig
from fedcore.task import Task, TaskContext
from privacy.tls import init_certs
from server.service import AuthPolicy
from tests.deploy.test_service import Harness

pytestmark = pytest.mark.timeout(60)


def test_heartbeats_keep_the_session_alive_while_the_task_is_built(tmp_path: Path) -> None:
    liveness_s = 1.0
    h = Harness(tmp_path, seed=7, heartbeat_interval_s=0.2, liveness_timeout_s=liveness_s)
    seen: list[bool] = []
    seeds: list[int | None] = []

    def slow_factory(context: TaskContext) -> Task:
        # loading data that takes longer than the server's liveness timeout
        seeds.append(context.seed)
        until = time.monotonic() + 2.5 * liveness_s
        while time.monotonic() < until:
            seen.append("slow" in h.pool.available())
            time.sleep(0.05)
        return cast(Task, object())  # never run: the server hands out no task

    config = DaemonConfig(server=f"127.0.0.1:{h.port}", client_id="slow", task="unused:factory", insecure=True,
                          poll_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.2)  # fmt: skip
    daemon = ClientDaemon(config, factory=slow_factory)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run()), daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 20
        while len(seen) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert seeds == [7]  # the task is built once, with the run's seed from the join reply
        assert seen and all(seen), "the client was dropped while its task was being built"
        assert h.pool.available() == ["slow"]
        h.pool.finish()
        thread.join(20)
        assert codes == [0]
    finally:
        daemon.stop()
        h.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("certs")
    init_certs(root / "ours", clients=["client-000"])
    init_certs(root / "other", clients=["client-000"])  # another CA: same names, different signatures
    return root / "ours", root / "other"


def _mtls_harness(tmp: Path, ours: Path) -> Harness:
    credentials = grpc.ssl_server_credentials(
        [((ours / "server.key").read_bytes(), (ours / "server.pem").read_bytes())],
        root_certificates=(ours / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    return Harness(tmp, auth=AuthPolicy(require_client_cert=True), credentials=credentials)


CASES = {
    # the server's --client-ca did not sign the client certificate: the client sees only "Socket closed"
    "foreign client certificate": (
        "ours", "other", None, ["may not trust this client certificate", "--cert", "--key", "--client-ca"]
    ),
    "wrong --ca-cert": ("other", "ours", None, ["could not verify the server certificate", "--ca-cert"]),
    "wrong --server-name": ("ours", "ours", "example.org", ["not issued to the name", "--server-name"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_tls_handshake_failures_log_a_hint_and_keep_retrying(
    case: str, tmp_path: Path, certs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    ca_from, identity_from, server_name, needles = CASES[case]
    dirs = {"ours": certs[0], "other": certs[1]}
    h = _mtls_harness(tmp_path, certs[0])
    identity = dirs[identity_from] / "clients"
    config = DaemonConfig(
        server=f"127.0.0.1:{h.port}",
        client_id="client-000",
        task="unused:factory",
        ca_cert=dirs[ca_from] / "ca.pem",
        cert=identity / "client-000.pem",
        key=identity / "client-000.key",
        server_name=server_name,
        backoff_initial_s=0.05,
        backoff_max_s=0.1,
        give_up_after_s=1.0,
    )
    caplog.set_level(logging.INFO, logger="fedcore.client")
    try:
        assert ClientDaemon(config, factory=lambda ctx: cast(Task, object())).run() == 3
    finally:
        h.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "fedcore.client"]
    hints = [m for m in messages if m.startswith("TLS:")]
    assert len(hints) == 1, messages  # once, not on every retry
    assert all(needle in hints[0] for needle in needles), hints[0]
    retries = [m for m in messages if "retrying in" in m]
    assert len(retries) >= 2  # the retry behaviour is unchanged
    assert any("giving up" in m and hints[0] in m for m in messages)
    assert not any("joined" in m for m in messages)


def test_no_tls_hint_when_the_server_is_down(certs: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    ours = certs[0]
    config = DaemonConfig(server="127.0.0.1:1", client_id="client-000", task="unused:factory",
                          ca_cert=ours / "ca.pem", cert=ours / "clients" / "client-000.pem",
                          key=ours / "clients" / "client-000.key", backoff_initial_s=0.05, backoff_max_s=0.1,
                          give_up_after_s=0.5)  # fmt: skip
    caplog.set_level(logging.INFO, logger="fedcore.client")
    assert ClientDaemon(config, factory=lambda ctx: cast(Task, object())).run() == 3
    assert not [r for r in caplog.records if r.getMessage().startswith("TLS:")]
