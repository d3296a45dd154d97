"""Helpers for the deployment end-to-end tests: start `fedcore server start` / `fedcore client start` as real
processes on 127.0.0.1, wait for log lines with bounded timeouts, and build the matching simulation.

Servers listen on port 0 and report the port the OS gave them (:meth:`Proc.listening_port`): picking a free
port in the test and releasing it for the server to bind races with every other process on the machine."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def task_option_flags(options: dict[str, str]) -> list[str]:
    flags: list[str] = []
    for key, value in options.items():
        flags += ["--task-option", f"{key}={value}"]
    return flags


class Proc:
    """A fedcore CLI process whose combined output goes to a log file."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self._fh = self.log.open("ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "fedcore.cli", *args],
            cwd=ROOT,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            env=full_env,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_line(self, needle: str, timeout_s: float, *, since: int = 0) -> float:
        """Wait until ``needle`` is in the log after its first ``since`` characters; returns the monotonic time
        it was seen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if needle in self.text()[since:]:
                return time.monotonic()
            if self.popen.poll() is not None and needle not in self.text()[since:]:
                raise AssertionError(
                    f"{self.name} exited with {self.popen.returncode} before {needle!r}:\n{self.text()}"
                )
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no {needle!r} within {timeout_s} s:\n{self.text()[-4000:]}")

    def listening_port(self, timeout_s: float = 60) -> int:
        """The port a server started on port 0 got, from its "fedcore server listening on HOST:PORT" line."""
        return self._reported_port("fedcore server listening on", r"fedcore server listening on \S+:(\d+) ", timeout_s)

    def metrics_port(self, timeout_s: float = 60) -> int:
        """The port of a server's Prometheus endpoint (``--metrics-port 0``), from its "metrics on" line."""
        return self._reported_port("metrics on http://", r"metrics on http://\S+:(\d+)/metrics", timeout_s)

    def _reported_port(self, needle: str, pattern: str, timeout_s: float) -> int:
        self.wait_for_line(needle, timeout_s)
        found = re.search(pattern, self.text())
        if found is None:
            raise AssertionError(f"{self.name}: no line matching {pattern!r}:\n{self.text()[-4000:]}")
        return int(found.group(1))

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout_s} s:\n{self.text()[-4000:]}") from None

    def kill9(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)

    def close(self) -> None:
        self.kill9()
        self._fh.close()


def server_args(port: int, state_dir: Path, options: dict[str, str], *extra: str) -> list[str]:
    """``server start`` flags for 127.0.0.1:``port``; port 0 lets the OS pick (read it with
    :meth:`Proc.listening_port`)."""
    return [
        "server",
        "start",
        "--insecure",
        "--address",
        f"127.0.0.1:{port}",
        "--state-dir",
        str(state_dir),
        "--task",
        "simulations.tasks:demo_task",
        *task_option_flags(options),
        "--heartbeat-interval-s",
        "0.5",
        "--liveness-timeout-s",
        "2.5",
        "--linger-s",
        "3",
        "--wait-for-clients-s",
        "90",
        *extra,
    ]


def client_args(port: int, client_id: str, index: int, total: int, options: dict[str, str], *extra: str) -> list[str]:
    return [
        "-v",
        "client",
        "start",
        "--insecure",
        "--server",
        f"127.0.0.1:{port}",
        "--client-id",
        client_id,
        "--partition-id",
        str(index),
        "--num-partitions",
        str(total),
        *task_option_flags(options),
        "--backoff-max-s",
        "1",
        "--give-up-after-s",
        "60",
        "--poll-s",
        "2",
        *extra,
    ]


def certs_init(out: Path, *clients: str) -> None:
    """``fedcore certs init --out out --client ...``: a CA, a server certificate for 127.0.0.1, one certificate and
    token per client."""
    flags = [item for cid in clients for item in ("--client", cid)]
    subprocess.run(
        [sys.executable, "-m", "fedcore.cli", "certs", "init", "--out", str(out), *flags],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )


def read_tokens(certs: Path) -> dict[str, str]:
    """``client id -> token`` from the ``tokens.txt`` that :func:`certs_init` wrote."""
    lines = (certs / "tokens.txt").read_text().splitlines()
    pairs = (line.split() for line in lines if line and not line.startswith("#"))
    return {cid: token for cid, token in pairs}


def tls_server_args(
    port: int, state_dir: Path, certs: Path, options: dict[str, str], *extra: str, verbose: bool = True
) -> list[str]:
    """:func:`server_args` with TLS on: the server certificate, mutual TLS against the CA, and the tokens file;
    ``verbose`` logs at debug level (``-v``)."""
    args = [a for a in server_args(port, state_dir, options, *extra) if a != "--insecure"]
    tls = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
           "--client-ca", str(certs / "ca.pem"), "--tokens-file", str(certs / "tokens.txt")]  # fmt: skip
    return [*(["-v"] if verbose else []), *args, *tls]


def tls_client_args(
    port: int,
    client_id: str,
    index: int,
    total: int,
    certs: Path,
    token: str,
    options: dict[str, str],
    *extra: str,
    identity: Path | None = None,
) -> list[str]:
    """:func:`client_args` with TLS on: the server's CA, the client certificate from ``identity`` (default:
    ``certs``) and the token."""
    identity = identity if identity is not None else certs
    args = [a for a in client_args(port, client_id, index, total, options, *extra) if a != "--insecure"]
    return [*args, "--ca-cert", str(certs / "ca.pem"), "--cert", str(identity / "clients" / f"{client_id}.pem"),
            "--key", str(identity / "clients" / f"{client_id}.key"), f"--token={token}"]  # fmt: skip
