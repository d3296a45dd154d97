"""Helpers for the deployment end-to-end tests: start `fedcore server start` / `fedcore client start` as real
processes on 127.0.0.1, wait for log lines with bounded timeouts, and build the matching simulation."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    (port,) = free_ports(1)
    return port


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all sockets are held until every port is picked)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


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

    def wait_for_line(self, needle: str, timeout_s: float) -> float:
        """Wait until ``needle`` is in the log; returns the monotonic time it was seen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if needle in self.text():
                return time.monotonic()
            if self.popen.poll() is not None and needle not in self.text():
                raise AssertionError(
                    f"{self.name} exited with {self.popen.returncode} before {needle!r}:\n{self.text()}"
                )
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no {needle!r} within {timeout_s} s:\n{self.text()[-4000:]}")

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
