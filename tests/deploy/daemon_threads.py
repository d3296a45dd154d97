"""Client daemons as threads in the test process, against a :class:`tests.deploy.test_service.Harness` server:
the in-process gRPC set-up the SCAFFOLD, SecAgg and DP tests share."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypedDict

from client.daemon import ClientDaemon, DaemonConfig
from fedcore.task import Task, TaskContext
from tests.deploy.test_service import Harness


class _StateDir(TypedDict, total=False):
    """The optional ``state_dir`` keyword of :class:`DaemonConfig`."""

    state_dir: Path


@contextmanager
def daemon_threads(
    h: Harness, ids: Sequence[str], make_task: Callable[[str], Task], *, state_root: Path | None = None
) -> Iterator[list[ClientDaemon]]:
    """Start one daemon thread per client id (its task ``make_task(id)``; its state directory
    ``state_root / f"state-{id}"`` when given), wait until all joined, and stop them on exit."""
    daemons: list[ClientDaemon] = []
    threads: list[threading.Thread] = []
    for cid in ids:
        extra: _StateDir = {} if state_root is None else {"state_dir": state_root / f"state-{cid}"}
        config = DaemonConfig(server=f"127.0.0.1:{h.port}", client_id=cid, task="unused:factory", insecure=True,
                              poll_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.2, exit_when_finished=False,
                              **extra)  # fmt: skip

        def factory(context: TaskContext, cid: str = cid) -> Task:
            return make_task(cid)

        daemons.append(ClientDaemon(config, factory=factory))
        threads.append(threading.Thread(target=daemons[-1].run, daemon=True))
    try:
        for thread in threads:
            thread.start()
        h.pool.wait_for(len(ids), timeout_s=30)
        yield daemons
    finally:
        for daemon in daemons:
            daemon.stop()
        for thread in threads:
            thread.join(10)
