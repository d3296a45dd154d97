"""Start the worker processes of a plan, watch them, and tear them all down if one fails.

Workers are started the way ``torchrun`` starts them: one fresh interpreter per rank
(``python -m fedcore.engine.worker SPEC RANK``) that joins the process group through the rendezvous named in the
spec (the engine's: a file in the run's own directory, so no port is picked). Nothing is pickled across the
boundary: the spec is JSON, tensors are safetensors files, and a failing worker writes its rank, exception type,
message and traceback as JSON.

Each worker runs in its own session (process group), so on failure or timeout the launcher kills every
worker's whole group (SIGTERM, then SIGKILL after a grace period) and leaves no stray processes. Every wait is
bounded: the whole run by ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`), the teardown by :data:`GRACE_S`.
Workers also die with their launcher, however it ends (:func:`die_with_parent`: ``PR_SET_PDEATHSIG`` on Linux
and a watchdog thread that polls the parent pid everywhere), so none outlives it with parent 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from fedcore.errors import EngineError

DEFAULT_TIMEOUT_S = 3600.0
"""Seconds a multi-process round may take before its workers are killed (the client daemon passes the time left
until the round's deadline instead)."""

PARENT_ENV = "FEDCORE_ENGINE_PARENT"
"""Environment variable holding the launcher's pid; a worker exits when its parent is no longer that process."""

WATCHDOG_PERIOD_S = 0.5
"""How often a worker's watchdog checks that its launcher is alive."""

GRACE_S = 5.0
"""Seconds a worker gets to exit after SIGTERM before SIGKILL."""

REPORT_WAIT_S = 2.0
"""After the first failure, seconds to wait for the other ranks' reports before naming the root cause."""


def error_path(workdir: Path, rank: int) -> Path:
    """Where worker ``rank`` writes its failure report."""
    return workdir / f"error-rank{rank}.json"


def log_path(workdir: Path, rank: int) -> Path:
    """Where worker ``rank``'s stdout and stderr go."""
    return workdir / f"log-rank{rank}.txt"


def _worker_env(world_size: int) -> dict[str, str]:
    env = dict(os.environ)
    env[PARENT_ENV] = str(os.getpid())
    paths = [p if p else os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
    return env


_WORKDIR_PREFIX = "fedcore-engine-"


def remove_stale_workdirs(root: Path | None = None) -> list[Path]:
    """Remove the temporary directories of earlier callers that were killed outright (SIGKILL).

    A caller's directory is named ``fedcore-engine-<pid>-*``; it is stale when no process ``<pid>`` exists
    any more (a caller that ends any other way removes its own). Returns the directories removed.
    """
    removed = []
    for path in (root or Path(tempfile.gettempdir())).glob(f"{_WORKDIR_PREFIX}*-*"):
        pid_text = path.name[len(_WORKDIR_PREFIX) :].split("-", 1)[0]
        try:
            mine = path.is_dir() and path.stat().st_uid == os.getuid()
        except OSError:  # removed meanwhile
            continue
        if not pid_text.isdigit() or not mine:
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except PermissionError:  # a live process of another user
            continue
    return removed


@contextlib.contextmanager
def sigterm_raises_exit() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``SystemExit(143)`` instead of ending the process on the spot.

    The workers are then killed and the temporary directory removed by the usual exception path (a second
    SIGTERM meanwhile is ignored). Only on the main thread, and only when SIGTERM has its default action: a
    program that handles SIGTERM itself keeps its handler.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        yield
        return
    raised = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def worker_directory() -> Iterator[Path]:
    """A fresh temporary directory for one multi-process run, removed when the block ends, however it ends.

    It is named ``fedcore-engine-<caller pid>-*`` so that :func:`remove_stale_workdirs` (run first) can tell
    when its owner was killed outright; while the block runs, SIGTERM raises :class:`SystemExit`
    (:func:`sigterm_raises_exit`), so the workers are stopped and the directory removed.
    """
    remove_stale_workdirs()
    with sigterm_raises_exit(), tempfile.TemporaryDirectory(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-") as tmp:
        yield Path(tmp)


def run_workers(spec_path: Path, world_size: int, workdir: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run ``world_size`` workers on ``spec_path`` and wait for all of them to exit cleanly.

    Args:
        spec_path: the JSON spec every worker reads (in ``workdir``).
        world_size: the number of worker processes (ranks).
        workdir: where workers write their logs and failure reports.
        timeout_s: seconds to wait for all workers (> 0); then every worker is killed.

    Raises:
        EngineError: a worker exited non-zero or was killed by a signal (the first one to fail is named with
            its exception and traceback tail, or its log tail), or ``timeout_s`` passed (names the ranks still
            running and their log tails). No worker is left running either way.
    """
    env = _worker_env(world_size)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world_size):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)}
            with open(log_path(workdir, rank), "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _BOOTSTRAP, str(spec_path), str(rank)],
                        env=rank_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout_s
        alive_ns = [time.monotonic_ns()] * world_size
        while True:
            codes = _poll(procs, alive_ns)
            if any(c not in (None, 0) for c in codes):
                raise _failure(procs, workdir, alive_ns)
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise _timeout(procs, workdir, timeout_s)
            time.sleep(0.05)
    finally:
        _kill_all(procs)


def _poll(procs: list[subprocess.Popen[bytes]], alive_ns: list[int]) -> list[int | None]:
    """Each worker's exit status (None while running); ``alive_ns[r]`` becomes now for each rank still running."""
    now = time.monotonic_ns()
    codes = [p.poll() for p in procs]
    for r, code in enumerate(codes):
        if code is None:
            alive_ns[r] = now
    return codes


def _failure(procs: list[subprocess.Popen[bytes]], workdir: Path, alive_ns: list[int]) -> EngineError:
    """Name the root cause: the rank that failed first.

    When one rank fails, its peers soon fail too with connection errors; they are symptoms. A worker reports its
    exception, with the CLOCK_MONOTONIC time it was caught, before it leaves the process group. A worker that dies
    without raising (a signal, ``os._exit``, the out-of-memory killer, a crash in native code) writes no report;
    it died after ``alive_ns[r]``, the last poll that saw it running (polls are 50 ms apart). The launcher waits a
    moment for the peers' reports, then blames the earliest of the reports' times and the unreported deaths'
    last-seen times: a peer's connection error is caught after the death that caused it, so the dead rank is
    named, not the peer that reported its lost connection.
    """
    deadline = time.monotonic() + REPORT_WAIT_S
    while time.monotonic() < deadline and any(code is None for code in _poll(procs, alive_ns)):
        time.sleep(0.05)
    reports: dict[int, dict[str, Any]] = {}
    for r in range(len(procs)):
        try:
            reports[r] = json.loads(error_path(workdir, r).read_text())
        except (OSError, ValueError):  # no report (killed, or still being written): judged by its exit status
            continue
    failed_at = {r: int(info["failed_at_ns"]) for r, info in reports.items()}
    for r, p in enumerate(procs):
        if r not in failed_at and p.poll() not in (None, 0):
            failed_at[r] = alive_ns[r]
    rank = min(failed_at, key=lambda r: (failed_at[r], r))
    code = procs[rank].poll()
    if rank in reports:
        info = reports[rank]
        cause = f"{info['type']}: {info['message']}"
        detail = info.get("traceback", "")
    else:
        cause = f"killed by signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
        detail = _tail(log_path(workdir, rank))
    tail = "\n".join(detail.strip().splitlines()[-12:])
    return EngineError(f"worker rank {rank} failed: {cause}\n{tail}".rstrip(), rank=rank)


def _timeout(procs: list[subprocess.Popen[bytes]], workdir: Path, timeout_s: float) -> EngineError:
    """The error for a run past its bound: which ranks were still running, and the end of their logs."""
    running = [r for r, p in enumerate(procs) if p.poll() is None]
    lines = {r: _tail(log_path(workdir, r), 1000).strip().splitlines()[-5:] for r in running[:2]}
    tails = "".join(f"\n--- rank {r} log tail ---\n" + "\n".join(lines[r]) for r in lines if lines[r])  # none: none
    if lines and not tails:
        tails = " (they logged nothing)"
    return EngineError(
        f"parallel training did not finish within {timeout_s:g} s (ranks {running} still running: hung or too "
        "slow); all workers were killed. Raise the timeout (the client daemon uses the time left until the "
        f"round's deadline) or look for a rank stuck in a collective{tails}",
        rank=running[0] if running else None,
    )


_BOOTSTRAP = (
    "import ctypes, os, runpy, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG = 1, SIGKILL = 9\n"
    "if os.getppid() != int(os.environ['" + PARENT_ENV + "']):\n"
    "    os._exit(1)  # the launcher died before the request took effect\n"
    "runpy.run_module('fedcore.engine.worker', run_name='__main__', alter_sys=True)\n"
)
"""The worker's first lines, run by a fresh interpreter before it imports anything heavy (torch takes seconds):
ask Linux to SIGKILL this process when its launcher dies (``prctl(PR_SET_PDEATHSIG)``), exit if the launcher is
already gone, then run :mod:`fedcore.engine.worker` as ``__main__``.

This is done in the child rather than in a ``preexec_fn``: a ``preexec_fn`` makes ``subprocess`` use a real
``fork()``, which runs every library's at-fork handlers in the child; in the client daemon gRPC's handlers then
abort the child now and then (``epoll_wait error: Bad file descriptor``, SIGABRT). Without one, ``subprocess``
starts the child without running them."""


def die_with_parent(parent_pid: int) -> None:
    """Make this worker die when its launcher ``parent_pid`` does, however the launcher ends.

    On Linux the worker's bootstrap has already asked the kernel for SIGKILL on the launcher's death
    (``prctl(PR_SET_PDEATHSIG)`` in :data:`_BOOTSTRAP`); everywhere, a daemon thread checks every
    :data:`WATCHDOG_PERIOD_S` whether the parent pid changed (the orphan was re-parented) and then kills this
    worker's process group. A worker whose parent is already gone exits at once.
    """
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_PERIOD_S)
        if os.getpgid(0) == os.getpid():  # a session leader, as the launcher starts it: take its children along
            with contextlib.suppress(OSError):
                os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="fedcore-parent-watchdog", daemon=True).start()


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop every worker's process group: SIGTERM, then SIGKILL after :data:`GRACE_S`."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for proc in alive:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL ends it unless stuck in the kernel
                proc.wait(timeout=GRACE_S)
    for proc in procs:
        # the worker's own children (if any) live in its session; make sure none survive it
        _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
