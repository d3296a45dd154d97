"""A server start that must be refused before it listens: the shared helper of the server's start-up tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest


def refused_before_listening(state_dir: Path, error: type[Exception], match: str, **settings: Any) -> None:
    """Start the demo server (digits, 2NN) on ``state_dir`` with ``settings`` (ServerConfig fields); it must raise
    ``error`` matching ``match`` before it listens. A server that does start waits 3 s for clients, not 300, and
    fails the test."""
    from server.app import run_server
    from server.config import RoundSettings, ServerConfig, TlsSettings

    settings["round"] = replace(settings.get("round", RoundSettings()), wait_for_clients_s=3.0)
    config = ServerConfig(
        tls=TlsSettings(insecure=True),
        address="127.0.0.1:0",
        state_dir=state_dir,
        task="simulations.tasks:demo_task",
        task_options={"dataset": "digits", "num_clients": "2", "partition": "iid", "model": "2nn"},
        **settings,
    )
    lines: list[str] = []
    with pytest.raises(error, match=match):
        run_server(config, echo=lines.append)
    assert not any("listening" in line for line in lines)
