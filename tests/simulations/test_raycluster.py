"""The Ray backend joining an existing cluster by address: a head node started by ``ray start`` on loopback (its own
processes, as a cluster's head is), a separate ``fedcore simulate --ray-address`` driver, and the in-process model
byte for byte."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from tests.simulations.test_procpool import DIGITS, history_overrides, run_in_process_on_one_thread

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def ray_head() -> Iterator[str]:
    """A one-node Ray cluster (2 CPUs) started by ``ray start --head --block`` in a short temporary directory (Unix
    socket paths must stay under 108 bytes); terminating the blocking command stops every process it started, so no
    other Ray instance on the machine is touched. Yields the head's ``host:port``."""
    pytest.importorskip("ray", reason="the ray extra is not installed: pip install -e '.[ray]'")
    ray_cli = Path(sys.executable).with_name("ray")
    if not ray_cli.exists():
        pytest.skip(f"the ray command is not next to {sys.executable}")
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="fcray", dir="/tmp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    env.pop("RAY_ADDRESS", None)
    command = [str(ray_cli), "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false"]
    command += ["--disable-usage-stats", f"--temp-dir={temp_dir}", "--block"]
    head = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not Path(temp_dir, "ray_current_cluster").exists():  # written once the head's GCS is up
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start did not bring the head up:\n{head.stdout.read() if head.stdout else ''}")
            time.sleep(0.5)
        yield address
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_simulate_joins_an_existing_ray_cluster_and_gives_the_in_process_model(ray_head: str, tmp_path: Path) -> None:
    common = history_overrides(DIGITS)
    local = run_in_process_on_one_thread(None, [*common, f"output.dir='{tmp_path / 'a'}'"])
    command = [sys.executable, "-m", "fedcore.cli", "simulate", "--backend", "ray", "--ray-address", ray_head]
    command += ["--workers", "2"]
    for item in [*common, f"output.dir='{tmp_path / 'b'}'"]:
        command += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert driver.returncode == 0, driver.stdout + driver.stderr
    port = ray_head.rsplit(":", 1)[1]  # Ray names the head by the node's IP, not the loopback address it was given
    assert re.search(rf"Connecting to existing Ray cluster at address: \S+:{port}", driver.stdout + driver.stderr)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    remote = pd.read_csv(tmp_path / "b" / "history.csv")
    columns = [c for c in local.history.columns if c not in {"seconds", "fit_seconds"}]
    expected = pd.read_csv(tmp_path / "a" / "history.csv")
    pd.testing.assert_frame_equal(expected[columns], remote[columns])
    assert list(remote["failures"]) == [0, 0, 0]
