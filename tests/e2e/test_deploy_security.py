"""Deployment end to end with TLS on (certificates and tokens from `fedcore certs init`), real processes on loopback.

- clients without valid credentials (a wrong token; a client certificate from another CA, or none; a server
  certificate from a CA the client does not know) end at their first attempt with exit code 2 and a message that
  names the problem, and the rounds go on with the valid clients; the Prometheus endpoint then serves rounds,
  connected clients, bytes in/out and round durations with the values the run implies;
- a client daemon killed with SIGKILL and restarted with the same identity rejoins on its first attempt (no
  backoff), takes over its predecessor's unanswered task and takes part in the next round; then SIGTERM stops
  the server cleanly mid-run: exit code 0, the state directory intact, the newest checkpoint (the last finished
  round) loadable.

One server start per test; the built-in digits data with a logistic-regression model keeps rounds short.
"""

from __future__ import annotations

import signal
import sqlite3
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedcore.payload import save_payload
from fedcore.tensors import encode
from server.state import StateStore, load_checkpoint
from tests.e2e.deploy_helpers import Proc, certs_init, read_tokens, task_option_flags, tls_client_args, tls_server_args

pytestmark = pytest.mark.slow

OPTIONS = {"dataset": "digits", "num_clients": "2", "partition": "iid", "model": "logreg"}
SLOW = ["--task", "tests.e2e.slow_task:slow_demo_task"]


def _tls_server(port: int, state: Path, certs: Path, *extra: str) -> list[str]:
    return tls_server_args(port, state, certs, OPTIONS, *extra)


def _tls_client(
    port: int, cid: str, index: int, certs: Path, token: str, *extra: str, identity: Path | None = None
) -> list[str]:
    """Client flags with TLS: the server's CA, the client certificate from ``identity`` (default: ``certs``)."""
    return tls_client_args(port, cid, index, 2, certs, token, OPTIONS, *extra, identity=identity)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def _rounds_table(state: Path) -> list[tuple[int, int, int, int]]:
    with sqlite3.connect(state / "state.db") as db:
        return list(db.execute("SELECT round, selected, accepted, failures FROM rounds ORDER BY round"))


def _joins(state: Path) -> dict[str, int]:
    with sqlite3.connect(state / "state.db") as db:
        return dict(db.execute("SELECT client_id, joins FROM clients"))


def test_invalid_credentials_are_refused_and_metrics_match_the_run(tmp_path: Path) -> None:
    certs, other = tmp_path / "certs", tmp_path / "other-ca"
    certs_init(certs, "client-000", "client-001", "client-002")
    certs_init(other, "client-002")  # a second CA issuing a certificate with the right name
    tokens = read_tokens(certs)
    state = tmp_path / "state"
    rounds = 2
    server = Proc(
        "server",
        _tls_server(0, state, certs, "--rounds", str(rounds), "--min-fit-clients", "2", "--fraction-fit", "1.0",
                    "--metrics-port", "0", "--linger-s", "60", "--liveness-timeout-s", "30"),
        tmp_path,
    )  # fmt: skip
    procs = [server]
    try:
        port, metrics_port = server.listening_port(), server.metrics_port()
        good = [Proc(cid, _tls_client(port, cid, i, certs, tokens[cid], "--stay"), tmp_path)
                for i, cid in enumerate(["client-000", "client-001"])]  # fmt: skip
        # each refused daemon ends at its first attempt (exit code 2), long before it would give up (60 s)
        refused = {
            "wrong-token": _tls_client(port, "client-002", 0, certs, "not-the-token"),
            "foreign-ca": _tls_client(port, "client-002", 0, certs, tokens["client-002"], identity=other),
            "no-client-cert": [a for a in _tls_client(port, "client-002", 0, certs, tokens["client-002"])
                               if a not in ("--cert", "--key") and not a.startswith(str(certs / "clients"))],
            "server-ca-unknown": [a.replace(str(certs / "ca.pem"), str(other / "ca.pem"))
                                  for a in _tls_client(port, "client-002", 0, certs, tokens["client-002"])],
        }  # fmt: skip
        bad = {name: Proc(name, args, tmp_path) for name, args in refused.items()}
        procs += [*good, *bad.values()]
        expected = {
            "wrong-token": "the server refused to let this client join: unknown client 'client-002' or wrong token",
            "foreign-ca": "TLS: the server does not accept this client certificate",
            "no-client-cert": "TLS: the server requires a client certificate (mutual TLS) and this client has none",
            "server-ca-unknown": "TLS: this client could not verify the server certificate",
        }
        for name, proc in bad.items():
            assert proc.wait(180) == 2, proc.text()  # most of it starting Python and torch on a loaded machine
            assert f"fedcore: error: [client 'client-002'] {expected[name]}" in proc.text(), proc.text()
            assert "joined" not in proc.text() and "retrying in" not in proc.text()
        assert "refused a call (wrong token)" in server.text()
        assert "unknown client 'client-002' or wrong token" in server.text()

        server.wait_for_line(f"finished {rounds} rounds", 90)
        # during --linger-s: the --stay daemons are still connected
        metrics = _scrape(metrics_port)
        final = load_checkpoint(state / "checkpoints" / f"round-{rounds:06d}.safetensors")
        download = save_payload(tmp_path / "payload.safetensors", final.parameters).size
        upload = len(encode(final.parameters))
        updates = rounds * 2  # two valid clients per round, no federated evaluation
        assert metrics["fedcore_rounds_completed_total"] == rounds
        assert metrics["fedcore_current_round"] == rounds
        assert metrics["fedcore_connected_clients"] == 2
        # every client downloaded every task once (it trained it); counted as the chunks are sent, so a client
        # that closes the stream once it has the trailer is counted in full
        assert metrics["fedcore_bytes_out_total"] == updates * download
        assert metrics["fedcore_bytes_in_total"] == updates * upload
        assert metrics["fedcore_updates_rejected_total"] == 0
        assert metrics["fedcore_round_duration_seconds_count"] == rounds
        with sqlite3.connect(state / "state.db") as db:
            seconds = sum(s for (s,) in db.execute("SELECT seconds FROM rounds WHERE round > 0"))
        assert metrics["fedcore_round_duration_seconds_sum"] == pytest.approx(seconds, abs=1e-3)

        server.popen.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0, server.text()
    finally:
        for proc in procs:
            proc.close()
    assert _rounds_table(state) == [(0, 0, 0, 0), (1, 2, 2, 0), (2, 2, 2, 0)]
    assert _joins(state) == {"client-000": 1, "client-001": 1}  # the refused ones never got a session


def test_restarted_client_rejoins_at_once_then_sigterm_stops_the_server_cleanly(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    certs_init(certs, "client-000", "client-001")
    tokens = read_tokens(certs)
    state = tmp_path / "state"
    rounds = 30  # more than run before the SIGTERM
    flags = ["--rounds", str(rounds), "--min-fit-clients", "2", "--liveness-timeout-s", "30", "--no-evaluate"]
    server = Proc("server", _tls_server(0, state, certs, *flags), tmp_path)
    try:
        port = server.listening_port()
    except AssertionError:
        server.close()
        raise

    def client(cid: str, index: int, name: str, sleep_s: int = 1, sleep_from_round: int = 1) -> Proc:
        # a reconnect ceiling of 30 s: a rejoin that needed any backoff would show as a retry in the log
        options = {"sleep_s": str(sleep_s), "sleep_from_round": str(sleep_from_round)}
        extra = [*SLOW, *task_option_flags(options), "--backoff-max-s", "30"]
        return Proc(name, _tls_client(port, cid, index, certs, tokens[cid], *extra), tmp_path)

    # the victim trains slowly in round 2 (not before: round 1 need not wait), so it is surely killed before it
    # pushes its round-2 update
    steady = client("client-000", 0, "client-000")
    victim = client("client-001", 1, "client-001", sleep_s=8, sleep_from_round=2)
    restarted: Proc | None = None
    try:
        victim.wait_for_line("round 2 fit started", 90)
        victim.kill9()
        started = time.monotonic()
        restarted = client("client-001", 1, "client-001-restarted")
        joined = restarted.wait_for_line("joined 127.0.0.1", 30)
        assert joined - started < 25, "the restarted daemon took too long to rejoin"
        assert "retrying" not in restarted.text()  # joined on the first attempt, no backoff
        server.wait_for_line("round 3: 2 update(s), 0 failure(s)", 60)
        restarted.wait_for_line("round 3 result accepted", 10)

        server.popen.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        assert server.wait(30) == 0, server.text()
        assert time.monotonic() - stopping < 15
    finally:
        for proc in [server, steady, victim, *([restarted] if restarted else [])]:
            proc.close()
    text = server.text()
    # the restarted daemon took over the unanswered round-2 task of its killed predecessor, then trained round 3
    assert "client client-001 joined (rejoined)" in text
    assert "round 2: 2 update(s), 0 failure(s)" in text
    assert "round 2 fit started" in restarted.text() and "round 3 fit started" in restarted.text()

    # SIGTERM: a clean stop, the state directory intact, the last finished round's checkpoint loadable
    assert "stopping (signal); restart with the same state directory to resume" in text
    assert "Traceback" not in text
    finished = max(int(line.split(":")[0].split()[1]) for line in text.splitlines() if line.startswith("round "))
    assert 3 <= finished < rounds
    with sqlite3.connect(state / "state.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert [r[0] for r in _rounds_table(state)] == list(range(1, finished + 1))
    assert _joins(state) == {"client-000": 1, "client-001": 2}
    checkpoints = sorted(p.name for p in (state / "checkpoints").iterdir())
    assert checkpoints == [f"round-{r:06d}.safetensors" for r in (finished - 1, finished)]
    store = StateStore(state)
    try:
        latest = store.latest_checkpoint()
    finally:
        store.close()
    assert latest is not None and latest.round == finished
    assert latest.parameters and all(np.isfinite(a).all() for a in latest.parameters.values())
