"""``fedcore server start`` keeps gRPC's C-core INFO lines off stderr (a real server process under mutual TLS).

A client without a certificate made grpcio 1.85 print ``I... ssl_transport_security.cc:...] Handshake failed with
error SSL_ERROR_SSL ... PEER_DID_NOT_RETURN_A_CERTIFICATE`` on the server's stderr for every attempt.
:func:`fedcore.cli.main` sets ``GRPC_VERBOSITY=ERROR`` unless the user set it; a user's ``INFO`` still shows them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from privacy.tls import init_certs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

OPTS = ["--task-option", "dataset=mnist-5k", "--task-option", "num_clients=2", "--task-option", "model=2nn"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_stderr_after_a_certless_client(tmp: Path, certs: Path, verbosity: str | None) -> str:
    """Start a mutual-TLS server, let a TLS client without a certificate try to connect, return its stderr."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    if verbosity is not None:
        env["GRPC_VERBOSITY"] = verbosity
    cmd = [sys.executable, "-m", "fedcore.cli", "server", "start", "--address", f"127.0.0.1:{port}",
           "--state-dir", str(tmp / "state"), "--tls-cert", str(certs / "server.pem"),
           "--tls-key", str(certs / "server.key"), "--client-ca", str(certs / "ca.pem"),
           "--task", "simulations.tasks:demo_task", *OPTS, "--rounds", "1", "--min-fit-clients", "2"]  # fmt: skip
    with (
        (tmp / "err").open("w") as err,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc,
    ):
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # wait until it listens
                if "listening on" in line:
                    break
            else:
                raise AssertionError(f"the server exited: {(tmp / 'err').read_text()}")
            credentials = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
            # the handshake fails: the server asks for a client certificate and this channel has none
            with (
                grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel,
                pytest.raises(grpc.FutureTimeoutError),
            ):
                grpc.channel_ready_future(channel).result(timeout=2)
            time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return (tmp / "err").read_text()


def test_failed_handshakes_are_not_logged_unless_the_user_asks(tmp_path: Path) -> None:
    init_certs(tmp_path / "certs", clients=["client-000"])
    (tmp_path / "quiet").mkdir()
    (tmp_path / "info").mkdir()
    quiet = _server_stderr_after_a_certless_client(tmp_path / "quiet", tmp_path / "certs", None)
    info = _server_stderr_after_a_certless_client(tmp_path / "info", tmp_path / "certs", "INFO")
    assert "Handshake failed" not in quiet, quiet
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in info, info  # the user's GRPC_VERBOSITY wins
