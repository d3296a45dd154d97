"""``fedcore server start`` keeps gRPC's C-core INFO lines off stderr (a real server process under mutual TLS).

A client without a certificate made grpcio 1.85 print ``I... ssl_transport_security.cc:...] Handshake failed with
error SSL_ERROR_SSL ... PEER_DID_NOT_RETURN_A_CERTIFICATE`` on the server's stderr for every attempt.
:func:`fedcore.cli.main` sets ``GRPC_VERBOSITY=ERROR`` unless the user set it; a user's ``INFO`` still shows them.
"""

from __future__ import annotations

import os
import re
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


def _wait_until_it_listens(server: subprocess.Popen[str]) -> None:
    assert server.stdout is not None
    for line in server.stdout:
        if "listening on" in line:
            return
    raise AssertionError(f"the server exited with code {server.wait()}")


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
            _wait_until_it_listens(proc)
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


def test_the_daemon_logs_its_join_each_round_it_trained_and_the_end_at_info(tmp_path: Path) -> None:
    port = _free_port()
    server = [sys.executable, "-m", "fedcore.cli", "server", "start", "--insecure", "--address", f"127.0.0.1:{port}",
              "--state-dir", str(tmp_path / "state"), "--task", "simulations.tasks:demo_task", *OPTS,
              "--rounds", "2", "--fraction-fit", "1.0", "--min-fit-clients", "2"]  # fmt: skip

    def client(i: int) -> list[str]:
        return [sys.executable, "-m", "fedcore.cli", "client", "start", "--insecure", "--server", f"127.0.0.1:{port}",
                "--client-id", f"client-00{i}", "--partition-id", str(i), "--num-partitions", "2", *OPTS]  # fmt: skip

    with subprocess.Popen(server, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as srv:
        try:
            _wait_until_it_listens(srv)
            procs = [
                subprocess.Popen(client(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)
            ]
            outputs = [p.communicate(timeout=100)[1] for p in procs]
        finally:
            srv.terminate()
            srv.wait(timeout=30)
    # the demo task's default partition of mnist-5k's 4000 training examples over 2 clients (seed 0): 2097 + 1903
    for i, (err, examples) in enumerate(zip(outputs, (2097, 1903), strict=True)):
        assert procs[i].returncode == 0, err
        lines = [re.sub(r"in \d+\.\d\d s$", "in S s", line) for line in err.splitlines()]
        assert [line.split(" ", 2)[2] for line in lines] == [  # past the timestamp: level, logger, message
            f"INFO fedcore.client: joined 127.0.0.1:{port} as client-00{i}",
            f"INFO fedcore.client: round 1 trained: {examples} examples in S s",
            f"INFO fedcore.client: round 2 trained: {examples} examples in S s",
            "INFO fedcore.client: the server finished the run; exiting",
        ], err
