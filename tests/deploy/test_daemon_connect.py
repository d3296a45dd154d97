"""The client daemon tells connection errors that retrying cannot fix from transient ones (in-process servers
on 127.0.0.1, certificates from :func:`privacy.tls.init_certs` as `fedcore certs init` makes them).

Errors retrying cannot fix end :meth:`ClientDaemon.run` at the first attempt with a TransportError that says
what is wrong (the CLI prints it and exits with code 2); before, most showed as "Socket closed" and were retried
forever. Transient ones are retried with backoff and their reason is logged once, not once per attempt.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import cast

import grpc
import pytest

from client.daemon import EXIT_GAVE_UP, ClientDaemon, DaemonConfig
from fedcore.errors import TransportError
from fedcore.task import Task
from privacy.tls import init_certs
from server.service import AuthPolicy, hash_token
from tests.deploy.test_service import Harness

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("certs")
    init_certs(root / "ours", clients=["client-000"])
    init_certs(root / "other", clients=["client-000"])  # another CA: same names, different signatures
    return root / "ours", root / "other"


def _tls_harness(tmp: Path, ours: Path, *, mutual: bool = True, auth: AuthPolicy | None = None) -> Harness:
    credentials = grpc.ssl_server_credentials(
        [((ours / "server.key").read_bytes(), (ours / "server.pem").read_bytes())],
        root_certificates=(ours / "ca.pem").read_bytes() if mutual else None,
        require_client_auth=mutual,
    )
    return Harness(tmp, auth=auth or AuthPolicy(require_client_cert=mutual), credentials=credentials)


def _config(port: int, *, ca: Path | None, identity: Path | None, **kw: object) -> DaemonConfig:
    """A daemon that would retry every 0.05-0.1 s and give up after 20 s."""
    cert = identity / "clients" / "client-000.pem" if identity is not None else None
    key = identity / "clients" / "client-000.key" if identity is not None else None
    settings: dict[str, object] = {"backoff_initial_s": 0.05, "backoff_max_s": 0.1, "give_up_after_s": 20.0, **kw}
    return DaemonConfig(server=f"127.0.0.1:{port}", client_id="client-000", task="unused:factory", ca_cert=ca,
                        cert=cert, key=key, **settings)  # type: ignore[arg-type]  # fmt: skip


def _never_built(ctx: object) -> Task:
    raise AssertionError("a refused client must not build its task")


def _run_refused(config: DaemonConfig, caplog: pytest.LogCaptureFixture) -> tuple[str, float, list[str]]:
    caplog.set_level(logging.DEBUG, logger="fedcore.client")
    started = time.monotonic()
    with pytest.raises(TransportError) as info:
        ClientDaemon(config, factory=_never_built).run()
    seconds = time.monotonic() - started
    messages = [r.getMessage() for r in caplog.records if r.name == "fedcore.client"]
    return info.value.message, seconds, messages


# case: (server CA dir, client identity dir or None, server name, words the message must hold)
TLS_CASES = {
    "client certificate from another CA": ("ours", "other", None, [
        "the server does not accept this client certificate", "--client-ca"]),
    "no client certificate under mutual TLS": ("ours", None, None, [
        "the server requires a client certificate (mutual TLS) and this client has none", "--cert", "--key"]),
    "server certificate from another CA": ("other", "ours", None, [
        "could not verify the server certificate (BAD_SIGNATURE: certificate signature failure)", "--ca-cert"]),
    "server certificate for another name": ("ours", "ours", "example.org", [
        "the server certificate is not issued to the name this client connects to (example.org)",
        "--server-name"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TLS_CASES))
def test_tls_errors_retrying_cannot_fix_end_the_daemon_at_once(
    case: str, tmp_path: Path, certs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    ca_from, identity_from, server_name, needles = TLS_CASES[case]
    dirs = {"ours": certs[0], "other": certs[1]}
    h = _tls_harness(tmp_path, certs[0])
    identity = dirs[identity_from] if identity_from is not None else None
    try:
        config = _config(h.port, ca=dirs[ca_from] / "ca.pem", identity=identity, server_name=server_name)
        message, seconds, messages = _run_refused(config, caplog)
    finally:
        h.close()
    assert message.startswith("TLS: ")
    assert all(needle in message for needle in needles), message
    assert seconds < 10  # the first attempt, not after give_up_after_s (20 s)
    assert not any("retrying" in m for m in messages), messages
    assert h.pool.available() == []


def test_a_tls_client_of_a_plaintext_server_and_the_reverse(
    tmp_path: Path, certs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    plain = Harness(tmp_path / "plain")
    try:
        message, _, _ = _run_refused(_config(plain.port, ca=certs[0] / "ca.pem", identity=None), caplog)
    finally:
        plain.close()
    assert "the server does not speak TLS; it was probably started with --insecure" in message
    tls = _tls_harness(tmp_path / "tls", certs[0], mutual=False)
    try:
        message, _, _ = _run_refused(_config(tls.port, ca=None, identity=None, insecure=True), caplog)
    finally:
        tls.close()
    assert "the server speaks TLS, and this client was started with --insecure; drop --insecure" in message


@pytest.mark.parametrize(
    ("token", "client_id_revoked", "want"),
    [
        ("wrong", False, "the server refused to let this client join: unknown client 'client-000' or wrong token"),
        ("right", True, "the server refused to let this client join: client 'client-000' is revoked"),
    ],
)
def test_a_refused_join_ends_the_daemon_at_once(
    token: str,
    client_id_revoked: bool,
    want: str,
    tmp_path: Path,
    certs: tuple[Path, Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    auth = AuthPolicy(
        tokens={"client-000": hash_token("right")},
        require_client_cert=True,
        revoked=frozenset({"client-000"} if client_id_revoked else set()),
    )
    h = _tls_harness(tmp_path, certs[0], auth=auth)
    try:
        config = _config(h.port, ca=certs[0] / "ca.pem", identity=certs[0], token=token)
        message, seconds, messages = _run_refused(config, caplog)
    finally:
        h.close()
    assert message == want
    assert seconds < 10 and not any("retrying" in m for m in messages)


def test_a_server_that_is_down_is_retried_with_the_reason_logged_once(
    certs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    h = Harness(Path(certs[0]) / "spill-down")
    port = h.port
    h.close()  # nothing listens there now: connection refused
    config = _config(port, ca=certs[0] / "ca.pem", identity=certs[0], give_up_after_s=1.0)
    caplog.set_level(logging.DEBUG, logger="fedcore.client")
    assert ClientDaemon(config, factory=lambda ctx: cast(Task, object())).run() == EXIT_GAVE_UP == 3
    messages = [r.getMessage() for r in caplog.records if r.name == "fedcore.client"]
    reasons = [m for m in messages if m.startswith("cannot reach the server")]
    assert reasons == [
        f"cannot reach the server 127.0.0.1:{port}: connection refused (the server is not running, or restarting); "
        "retrying with backoff (up to 0.1 s apart), giving up after 1 s"
    ]
    retries = [m for m in messages if "retrying in" in m]
    assert len(retries) >= 3  # each attempt at debug level only
    assert any(m.startswith(f"server 127.0.0.1:{port} unreachable for") and "giving up" in m for m in messages)
