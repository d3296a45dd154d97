"""The state directory: records and checkpoints that must agree, checkpoint digests, a damaged state.db, the run's
strategy, atomic checkpoint writes, and one history schema."""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedcore.errors import ConfigError, PayloadError, RoundFailed, StateError
from fedcore.messages import Failure, Stage
from fedcore.payload import DIGEST_KEY, check_digest, open_safetensors, read_safetensors_header, save_payload
from fedcore.selection import ClientObservation
from fedcore.strategy import StrategyConfig, build_strategy
from fedcore.tensors import NamedArrays
from server.config import RoundSettings
from server.round_loop import RoundRecord, ServerState
from server.state import HISTORY_COLUMNS, HistoryFile, StateStore, load_checkpoint, write_history
from tests.server.starting import refused_before_listening


def _state(rnd: int) -> ServerState:
    """Round ``rnd``'s state: w = [rnd, rnd + 0.5, rnd + 0.25], momentum 10 * rnd."""
    w = np.array([rnd, rnd + 0.5, rnd + 0.25], np.float32)
    return ServerState(round=rnd, parameters={"w": w}, optimizer_state={"m/w": np.full(3, 10.0 * rnd, np.float32)})


def _record(rnd: int, loss: float) -> RoundRecord:
    return RoundRecord(
        round=rnd,
        selected=("a", "b") if rnd else (),
        accepted=("a", "b") if rnd else (),
        train_metrics={"train_loss": loss} if rnd else {},
        eval_loss=loss + 1.0,
        eval_metrics={"accuracy": 0.5},
        seconds=0.25,
    )


def _run(directory: Path, rounds: int) -> StateStore:
    """A state directory as the server leaves it after ``rounds`` rounds (fedavg; train_loss 1/r)."""
    store = StateStore(directory)
    store.check_strategy(StrategyConfig())
    store.record_round(_record(0, 0.0))
    for rnd in range(1, rounds + 1):
        store.save_checkpoint(_state(rnd), _record(rnd, 1.0 / rnd))  # the server's order: checkpoint, then row
        store.record_round(_record(rnd, 1.0 / rnd))
    return store


def _flip_last_data_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------- records vs checkpoints


def test_records_kept_but_all_checkpoints_deleted_is_refused_and_nothing_is_overwritten(tmp_path: Path) -> None:
    _run(tmp_path, 5).close()
    for path in (tmp_path / "checkpoints").iterdir():
        path.unlink()
    store = StateStore(tmp_path)
    with pytest.raises(StateError, match=r"records rounds 1-5 but checkpoints/ holds no checkpoint.*new --state-dir"):
        store.resume()
    assert store.recorded_rounds() == [0, 1, 2, 3, 4, 5]
    assert [row["train_loss"] for row in store.history()][1:] == [1.0, 0.5, 1 / 3, 0.25, 0.2]
    store.close()


def test_a_history_without_its_database_is_refused_and_kept(tmp_path: Path) -> None:
    # state.db and the checkpoints deleted, history.csv kept: a fresh server would overwrite the old run's history
    _run(tmp_path, 2).close()
    for path in [tmp_path / "state.db", *(tmp_path / "checkpoints").iterdir()]:
        path.unlink()
    before = (tmp_path / "history.csv").read_bytes()
    with pytest.raises(StateError, match=r"no state\.db\) but holds history\.csv"):
        StateStore(tmp_path)
    assert (tmp_path / "history.csv").read_bytes() == before and not (tmp_path / "state.db").exists()


def test_checkpoints_newer_than_the_records_are_refused(tmp_path: Path) -> None:
    _run(tmp_path, 4).close()
    (tmp_path / "state.db").unlink()  # a replaced database: no rounds, no strategy
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"state.db{suffix}").unlink(missing_ok=True)
    store = StateStore(tmp_path)
    with pytest.raises(StateError, match=r"round 4 but state.db records no trained round"):
        store.resume()
    with pytest.raises(StateError, match=r"checkpoints \(round-000004.safetensors\) but state.db records no strategy"):
        store.check_strategy(StrategyConfig())
    store.close()


def test_a_checkpoint_one_round_ahead_of_its_record_resumes_after_it_with_the_record_restored(
    tmp_path: Path,
) -> None:
    """Killed between writing round 3's checkpoint and its row: the row, failures and selection feedback come from
    the checkpoint, history.csv has round 3 as an uninterrupted run's, and the run resumes after round 3."""
    record = replace(
        _record(3, 1.0 / 3),
        selected=("a", "b", "c"),
        failures=(Failure(client_id="c", round=3, stage=Stage.FIT, reason="it holds NaN"),),
        observations=(ClientObservation("a", 10, 0.5, 1.25), ClientObservation("b", 20, None, None)),
        eval_loss=float("nan"),
    )
    uninterrupted = _run(tmp_path / "whole", 2)
    uninterrupted.save_checkpoint(_state(3), record)
    uninterrupted.record_round(record)
    uninterrupted.close()
    store = _run(tmp_path / "killed", 2)
    store.save_checkpoint(_state(3), record)
    store.close()  # killed here: no row for round 3
    store = StateStore(tmp_path / "killed")
    assert store.recorded_rounds() == [0, 1, 2]
    resumed = store.resume()
    assert resumed is not None and resumed.round == 3
    np.testing.assert_array_equal(resumed.parameters["w"], [3.0, 3.5, 3.25])
    assert store.recorded_rounds() == [0, 1, 2, 3]
    assert (tmp_path / "killed" / "history.csv").read_bytes() == (tmp_path / "whole" / "history.csv").read_bytes()
    assert store.selection_history()[-1] == (3, list(record.observations))
    store.close()
    store, whole = StateStore(tmp_path / "killed"), StateStore(tmp_path / "whole")
    for table in ("rounds", "round_metrics", "failures", "selection"):
        query = f"SELECT * FROM {table} ORDER BY 1, 2"
        got = [row for row in store._db.execute(query)]
        want = [row for row in whole._db.execute(query)]
        if table == "rounds":  # finished_at: when each was stored
            got, want = [row[:1] + row[2:] for row in got], [row[:1] + row[2:] for row in want]
        assert got == want, table
    whole.close()
    store.close()


def test_a_checkpoint_without_a_record_one_round_ahead_resumes_after_it_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint of an earlier fedcore (no record in it), one round ahead of the records: resume after it."""
    store = _run(tmp_path, 2)
    store.save_checkpoint(_state(3))
    store.close()
    store = StateStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fedcore.server"):
        resumed = store.resume()
    assert resumed is not None and resumed.round == 3
    assert store.recorded_rounds() == [0, 1, 2]
    assert "holds no record of the round" in caplog.text
    store.close()


def test_damaged_newest_checkpoint_falls_back_and_supersedes_the_later_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run(tmp_path, 3).close()
    newest = tmp_path / "checkpoints" / "round-000003.safetensors"
    _flip_last_data_byte(newest)
    views, _ = open_safetensors(newest)
    assert views["opt/m/w"][-1] != 30.0  # the flip changed a stored value: without the digest it would be resumed
    store = StateStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fedcore.server"):
        resumed = store.resume()
    assert resumed is not None and resumed.round == 2
    np.testing.assert_array_equal(resumed.parameters["w"], [2.0, 2.5, 2.25])
    np.testing.assert_array_equal(resumed.optimizer_state["m/w"], [20.0, 20.0, 20.0])
    assert "round-000003.safetensors is damaged (its bytes do not match its recorded SHA-256" in caplog.text
    assert "round 3 after it: those records are marked superseded" in caplog.text
    assert store.recorded_rounds() == [0, 1, 2]
    assert list(pd.read_csv(tmp_path / "history.csv")["round"]) == [0, 1, 2]
    # round 3 runs again: the new row is current, the old one stays in state.db, marked
    store.record_round(_record(3, 0.125))
    assert [row["train_loss"] for row in store.history()] == [None, 1.0, 0.5, 0.125]
    store.close()
    with sqlite3.connect(tmp_path / "state.db") as db:
        rows = list(db.execute("SELECT round, superseded FROM rounds WHERE round = 3 ORDER BY superseded"))
        old = db.execute("SELECT value FROM round_metrics WHERE round = 3 AND superseded = 1 AND key = 'train_loss'")
        assert rows == [(3, 0), (3, 1)] and old.fetchone() == (1 / 3,)


def test_no_intact_checkpoint_is_refused_naming_each(tmp_path: Path) -> None:
    _run(tmp_path, 3).close()
    _flip_last_data_byte(tmp_path / "checkpoints" / "round-000003.safetensors")
    (tmp_path / "checkpoints" / "round-000002.safetensors").write_bytes(b"\x01" * 5)
    store = StateStore(tmp_path)
    with pytest.raises(StateError) as info:
        store.resume()
    assert "round-000003.safetensors: its bytes do not match its recorded SHA-256" in info.value.message
    assert "round-000002.safetensors: payload of 5 bytes is too short" in info.value.message
    store.close()


# ------------------------------------------------------------------------------------------ checkpoint digests


def test_a_flipped_byte_anywhere_in_a_checkpoint_is_detected(tmp_path: Path) -> None:
    path = StateStore(tmp_path).save_checkpoint(_state(7))
    _, metadata, body = read_safetensors_header(path)
    assert len(metadata[DIGEST_KEY]) == 64 and check_digest(path) is True
    assert load_checkpoint(str(path)).round == 7  # a str path works
    original = path.read_bytes()
    round_at = original.index(b'"round":"7"') + len(b'"round":"')
    for at in (body, len(original) - 1, round_at):  # first and last data byte; the round in the header
        damaged = bytearray(original)
        damaged[at] ^= 0x02  # '7' -> '5' in the header: still valid JSON
        path.write_bytes(bytes(damaged))
        assert check_digest(path) is False, at
        with pytest.raises(PayloadError, match="do not match its recorded SHA-256"):
            load_checkpoint(path)
    plain = tmp_path / "plain.safetensors"
    save_payload(plain, {"w": np.ones(2, np.float32)})
    assert check_digest(plain) is None and load_checkpoint(plain).round == 0  # a plain model: no digest to check


# ------------------------------------------------------------------------------------------ damaged state.db


def test_a_state_db_that_is_not_a_database_gives_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "state.db").write_bytes(b"this is not sqlite\n" * 500)
    with pytest.raises(StateError, match=r"state.db' failed while opening it: file is not a database.*--state-dir"):
        StateStore(tmp_path)


def test_a_state_db_with_damaged_pages_gives_a_clear_error(tmp_path: Path) -> None:
    store = _run(tmp_path, 2)
    for rnd in range(3, 200):  # enough rows for several pages
        store.record_round(_record(rnd, 1.0))
    store.close()
    db = tmp_path / "state.db"
    data = bytearray(db.read_bytes())
    assert len(data) > 8 * 4096
    data[4096 * 3 : 4096 * 6] = b"\xa5" * (4096 * 3)  # three pages in the middle overwritten
    db.write_bytes(bytes(data))
    with pytest.raises(StateError, match=r"state.db' failed while opening it: .*(malformed|corrupt|Tree|Page)"):
        StateStore(tmp_path)


def test_every_database_call_of_an_open_store_fails_with_a_state_error(tmp_path: Path) -> None:
    """A failure after opening (here: the connection is gone, as after a disk error) reaches no caller as a raw
    sqlite3 error on any path: registry, rounds, history, superseding, the strategy record."""
    store = _run(tmp_path, 2)
    store._db.close()  # every later statement raises sqlite3.ProgrammingError, a sqlite3.Error
    calls: list[Callable[[], object]] = [
        lambda: store.record_join("c"),
        store.clients,
        lambda: store.record_round(_record(3, 0.1)),
        store.recorded_rounds,
        store.history,
        store.export_csv,
        lambda: store.check_strategy(StrategyConfig()),
        store.resume,
    ]
    for call in calls:
        with pytest.raises(StateError, match=r"state\.db' failed while"):
            call()


@pytest.mark.slow
def test_the_cli_reports_a_damaged_state_db_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "state.db").write_bytes(b"\x00garbage" * 1000)
    args = ["server", "start", "--insecure", "--address", "127.0.0.1:0", "--state-dir", str(tmp_path)]
    args += ["--task", "simulations.tasks:demo_task", "--task-option", "dataset=digits"]
    proc = subprocess.run(
        [sys.executable, "-m", "fedcore.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "listening" not in proc.stdout
    assert (
        f"the state database '{tmp_path / 'state.db'}' failed while opening it: file is not a database" in proc.stderr
    )


def test_an_older_state_db_is_refused(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute("CREATE TABLE rounds (round INTEGER PRIMARY KEY, finished_at REAL NOT NULL)")
    with pytest.raises(StateError, match="written by an older fedcore"):
        StateStore(tmp_path)


# ------------------------------------------------------------------------------------------ the run's strategy


@pytest.mark.parametrize(
    ("first", "second", "named"),
    [
        (
            StrategyConfig(),
            StrategyConfig(name="fedadam", server_lr=0.1),
            r"fedavg, .*fedadam \(beta1=0.9, beta2=0.99\)",
        ),
        (
            StrategyConfig(name="fedadam"),
            StrategyConfig(name="fedavgm", server_momentum=0.9),
            r"fedadam \(beta1=0.9, beta2=0.99\), .*fedavgm \(server_momentum=0.9\)",
        ),
        (
            StrategyConfig(name="fedyogi"),
            StrategyConfig(name="fedyogi", beta2=0.9),
            r"fedyogi \(beta1=0.9, beta2=0.99\), .*fedyogi \(beta1=0.9, beta2=0.9\)",
        ),
        (
            StrategyConfig(name="fedavgm", server_momentum=0.9),
            StrategyConfig(name="fedavgm", server_momentum=0.5),
            r"fedavgm \(server_momentum=0.9\), .*fedavgm \(server_momentum=0.5\)",
        ),
        (StrategyConfig(name="fedavg"), StrategyConfig(name="fedprox"), r"fedavg, .*fedprox:"),
    ],
)
def test_restarting_with_another_strategy_is_refused_naming_both(
    tmp_path: Path, first: StrategyConfig, second: StrategyConfig, named: str
) -> None:
    store = StateStore(tmp_path)
    store.check_strategy(first)
    store.save_checkpoint(_state(1))
    store.record_round(_record(1, 1.0))
    with pytest.raises(ConfigError, match=r"holds a run of strategy " + named):
        store.check_strategy(second)
    store.check_strategy(first)  # the same strategy resumes
    store.close()


def test_learning_rate_may_change_and_an_untrained_directory_takes_any_strategy(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.check_strategy(StrategyConfig(name="fedadam"))
    store.record_round(_record(0, 0.0))  # round 0 only: nothing depends on the strategy yet
    store.check_strategy(StrategyConfig(name="fedavg"))
    store.save_checkpoint(_state(1))
    store.record_round(_record(1, 1.0))
    store.check_strategy(StrategyConfig(name="fedavg", server_lr=0.5, weighting="uniform"))
    with pytest.raises(ConfigError, match="holds a run of strategy fedavg"):
        store.check_strategy(StrategyConfig(name="fedadam"))
    store.close()


def test_the_server_refuses_another_strategy_before_it_listens(tmp_path: Path) -> None:
    _run(tmp_path, 2).close()
    match = r"holds a run of strategy fedavg, but this server is configured for fedadam"
    refused_before_listening(tmp_path, ConfigError, match, strategy=StrategyConfig(name="fedadam"))


def test_a_restart_with_other_privacy_settings_is_refused_naming_each(tmp_path: Path) -> None:
    """A DP run restarted with its noise multiplier raised from 0.5 to 10 reported the epsilon of all its rounds as
    if they had run at 10 (0.74 after round 2, then 0.0036 after round 3). Refused; the same settings resume, and
    the budget (target_epsilon) may change."""
    from fedcore.strategy import SamplingConfig, Strategy
    from privacy.dp.config import PrivacyConfig, accounting_identity

    strategy = Strategy(sampling=SamplingConfig(fraction_fit=0.5, min_fit_clients=2))
    first = PrivacyConfig(dp="central", noise_multiplier=0.5, population=4)
    store = StateStore(tmp_path)
    store.check_privacy(accounting_identity(first, strategy))
    store.save_checkpoint(_state(1))
    store.record_round(_record(1, 1.0))
    refusals = [
        (replace(first, noise_multiplier=10.0), r"noise_multiplier \(--noise-multiplier\) 0\.5 -> 10\.0\)"),
        (
            replace(first, population=1000),
            r"clients per round \(--fraction-fit, --min-fit-clients\) 2 -> 500; population \(--population\) 4 -> "
            r"1000\)",
        ),
        (PrivacyConfig(), r"dp \(--dp\) 'central' -> 'off'\)"),
        (
            replace(first, delta=1e-3, accountant="pld"),
            r"accountant.*'rdp' -> 'pld'; delta \(--delta\) 1e-05 -> 0\.001",
        ),
    ]
    for changed, named in refusals:
        with pytest.raises(ConfigError, match=r"holds a run with other privacy settings \(.*" + named):
            store.check_privacy(accounting_identity(changed, strategy))
    with pytest.raises(ConfigError, match=r"clients per round \(--fraction-fit, --min-fit-clients\) 2 -> 3"):
        store.check_privacy(accounting_identity(first, Strategy(sampling=SamplingConfig(min_fit_clients=3))))
    store.check_privacy(accounting_identity(replace(first, target_epsilon=3.0), strategy))  # the same settings
    store.close()


def test_a_run_without_privacy_refuses_a_restart_with_it_and_an_untrained_directory_takes_any(tmp_path: Path) -> None:
    from fedcore.strategy import Strategy
    from privacy.dp.config import PrivacyConfig, accounting_identity

    store = StateStore(tmp_path)
    store.check_privacy(accounting_identity(PrivacyConfig(dp="central", population=10), Strategy()))
    store.check_privacy(accounting_identity(PrivacyConfig(), Strategy()))  # nothing trained: recorded anew
    off = PrivacyConfig(noise_multiplier=3.0)  # settings of a DP that is off do not count
    store.save_checkpoint(_state(1))
    store.record_round(_record(1, 1.0))
    store.check_privacy(accounting_identity(off, Strategy()))
    with pytest.raises(ConfigError, match=r"dp \(--dp\) 'off' -> 'distributed'"):
        store.check_privacy(accounting_identity(PrivacyConfig(dp="distributed", population=10), Strategy()))
    with pytest.raises(ConfigError, match=r"dp_sgd \(--dp-sgd\) False -> True"):
        store.check_privacy(accounting_identity(PrivacyConfig(dp_sgd=True), Strategy()))
    store.close()


def test_the_server_refuses_other_privacy_settings_before_it_listens(tmp_path: Path) -> None:
    from privacy.dp.config import PrivacyConfig, accounting_identity
    from server.config import ServerConfig, TlsSettings

    privacy = PrivacyConfig(dp="central", noise_multiplier=0.5, population=2)
    defaults = ServerConfig(task="simulations.tasks:demo_task", tls=TlsSettings(insecure=True))
    strategy = build_strategy(defaults.strategy, defaults.train, defaults.sampling)
    store = _run(tmp_path, 0)
    store.check_privacy(accounting_identity(privacy, strategy))
    store.save_checkpoint(_state(1))
    store.record_round(_record(1, 1.0))
    store.close()
    match = r"other privacy settings \(noise_multiplier \(--noise-multiplier\) 0\.5 -> 10\.0\)"
    refused_before_listening(tmp_path, ConfigError, match, privacy=replace(privacy, noise_multiplier=10.0))


def test_the_server_refuses_fewer_rounds_than_it_finished_before_it_listens_and_changes_nothing(
    tmp_path: Path,
) -> None:
    _run(tmp_path, 3).close()
    history = (tmp_path / "history.csv").read_bytes()
    match = r"with rounds = 2: it has finished 3 rounds already\. Resume with rounds >= 3 .*new --state-dir"
    refused_before_listening(tmp_path, ConfigError, match, round=RoundSettings(rounds=2))
    assert (tmp_path / "history.csv").read_bytes() == history
    store = StateStore(tmp_path)
    assert store.recorded_rounds() == [0, 1, 2, 3]  # nothing superseded
    resumed = store.resume(rounds=3)  # as many rounds as finished: resumed (the run then ends at once)
    assert resumed is not None and resumed.round == 3
    store.close()


def test_the_server_refuses_records_without_checkpoints_before_it_listens(tmp_path: Path) -> None:
    _run(tmp_path, 3).close()
    for path in (tmp_path / "checkpoints").iterdir():
        path.unlink()
    history = (tmp_path / "history.csv").read_bytes()
    refused_before_listening(tmp_path, StateError, r"records rounds 1-3 but checkpoints/ holds no checkpoint")
    assert (tmp_path / "history.csv").read_bytes() == history  # nothing overwritten


# ---------------------------------------------------------------------------------------- atomic checkpoints

_FAILING_WRITE = """
import resource, signal, sys
import numpy as np
from server.round_loop import ServerState
from server.state import StateStore
from fedcore.errors import StateError

store = StateStore(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
big = ServerState(round=2, parameters={"w": np.full(1 << 18, 2.0, np.float32)}, optimizer_state={})
try:
    store.save_checkpoint(big)
except StateError as exc:
    print(exc.message)
"""


def test_a_checkpoint_write_that_fails_midway_leaves_the_previous_one_intact(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    first = store.save_checkpoint(_state(1))
    before = first.read_bytes()
    store.close()
    limit = 64 * 1024  # the new checkpoint (1 MiB) fails a sixteenth of the way in
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FAILING_WRITE), str(tmp_path), str(limit)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    assert "cannot write the checkpoint" in proc.stdout and "File too large" in proc.stdout
    assert "previous checkpoints are intact" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["round-000001.safetensors"]
    assert first.read_bytes() == before
    store = StateStore(tmp_path)
    latest = store.latest_checkpoint()
    assert latest is not None and latest.round == 1
    np.testing.assert_array_equal(latest.parameters["w"], [1.0, 1.5, 1.25])
    store.close()


def test_a_checkpoint_is_fsynced_under_a_temporary_name_then_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Watch the real calls (they still run): the file's data reaches the disk under a temporary name while the
    final name still holds the previous checkpoint; then one rename; then the directory is fsynced."""
    store = StateStore(tmp_path)
    store.save_checkpoint(_state(1))
    final = store.checkpoints / "round-000002.safetensors"
    events: list[tuple[str, ...]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        content = Path(target).read_bytes() if os.path.isfile(target) else b""
        events.append(("fsync", os.path.basename(target), hashlib.sha256(content).hexdigest(), str(final.exists())))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("replace", os.path.basename(src), os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store.save_checkpoint(_state(2))
    monkeypatch.undo()
    written = hashlib.sha256(final.read_bytes()).hexdigest()
    temporary = f".round-000002.safetensors.tmp-{os.getpid()}"
    empty = hashlib.sha256(b"").hexdigest()
    assert events == [
        ("fsync", temporary, written, "False"),  # all of the file's bytes, durable, before it has its name
        ("replace", temporary, "round-000002.safetensors"),
        ("fsync", "checkpoints", empty, "True"),  # then the rename itself is made durable
    ]
    loaded = load_checkpoint(final)
    np.testing.assert_array_equal(loaded.parameters["w"], [2.0, 2.5, 2.25])
    store.close()


# --------------------------------------------------------------------------------------------- history schema


def test_the_server_history_keeps_integers_and_pads_every_column(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    records = [
        RoundRecord(round=0, eval_loss=2.5, eval_metrics={"accuracy": 0.125}),
        RoundRecord(
            round=1,
            selected=("a", "b", "c"),
            accepted=("a", "b"),
            failures=(Failure(client_id="c", round=1, stage=Stage.FIT, reason="timeout"),),
            train_metrics={"train_loss": 0.75},
            eval_loss=1.5,
            eval_metrics={"accuracy": 0.625},
            federated_eval_loss=1.25,
            federated_eval_metrics={"accuracy": 0.5},
            seconds=0.5,
        ),
    ]
    for record in records:
        store.record_round(record)
    store.close()
    text = (tmp_path / "history.csv").read_text()
    # the same rows written in memory (the simulation's way) give the same bytes: one schema, one writer
    write_history(tmp_path / "memory.csv", [r.as_row() for r in records])
    assert (tmp_path / "memory.csv").read_text() == text
    frame = pd.read_csv(tmp_path / "history.csv")
    assert list(frame.columns)[: len(HISTORY_COLUMNS)] == list(HISTORY_COLUMNS) and frame.columns[-1] == "seconds"
    assert list(frame["clients"]) == [0, 2] and frame["clients"].dtype == np.int64
    assert list(frame["failures"]) == [0, 1] and frame["failures"].dtype == np.int64
    assert np.isnan(frame["federated_loss"][0]) and frame["federated_loss"][1] == 1.25
    assert np.isnan(frame["train_loss"][0]) and list(frame["test_accuracy"]) == [0.125, 0.625]


def test_a_diverged_rounds_nan_and_inf_values_survive_the_database(tmp_path: Path) -> None:
    # SQLite stores a NaN REAL as NULL; the server's history.csv must still show the NaN test loss of a diverged
    # model (as the simulation's does), not an empty cell that reads as "not evaluated"
    store = StateStore(tmp_path)
    records = [
        RoundRecord(round=0, eval_loss=2.5, eval_metrics={"accuracy": 0.125}),
        RoundRecord(round=1, accepted=("a",), eval_loss=float("nan"), eval_metrics={"accuracy": 0.1, "x": -np.inf}),
        RoundRecord(round=2, accepted=("a",), train_metrics={"train_loss": float("inf")}),
    ]
    for record in records:
        store.record_round(record)
    history = store.history()
    store.close()
    assert np.isnan(history[1]["test_loss"]) and history[1]["test_x"] == -np.inf  # type: ignore[arg-type]
    assert history[2]["train_loss"] == np.inf and history[2]["test_loss"] is None
    write_history(tmp_path / "memory.csv", [r.as_row() for r in records])
    assert (tmp_path / "history.csv").read_text() == (tmp_path / "memory.csv").read_text()
    frame = pd.read_csv(tmp_path / "history.csv")
    assert np.isnan(frame["test_loss"][1]) and frame["test_loss"][0] == 2.5 and frame["train_loss"][2] == np.inf
    assert "1,1,0,,nan,0.1," in (tmp_path / "history.csv").read_text()


def test_write_history_pads_every_row_and_writes_counts_as_integers(tmp_path: Path) -> None:
    rows: list[dict[str, object]] = [
        {"round": 0, "clients": 0, "failures": 0, "test_loss": 2.5, "test_accuracy": 0.125, "seconds": 0.0},
        {
            "round": 1,
            "clients": np.int64(2),
            "failures": 1,
            "train_loss": np.float32(0.75),
            "test_loss": 1.5,
            "test_accuracy": 0.625,
            "federated_loss": 1.25,
            "federated_accuracy": 0.5,
            "metrics_left_out": 1,  # a count a newer round loop adds: it just appears, as an integer
            "seconds": 0.5,
        },
    ]
    write_history(str(tmp_path / "h.csv"), rows)
    assert (tmp_path / "h.csv").read_text() == (
        "round,clients,failures,train_loss,test_loss,test_accuracy,federated_loss,federated_accuracy,"
        "metrics_left_out,seconds\n"
        "0,0,0,,2.5,0.125,,,,0.0\n"
        "1,2,1,0.75,1.5,0.625,1.25,0.5,1,0.5\n"
    )


def test_a_history_file_appends_rows_and_always_holds_write_historys_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows with the file's columns are appended (one line each); a row with a new column rewrites the file; after
    every row the bytes are write_history's of all rows so far, NaN, inf and missing values included."""
    import server.state

    rewrites: list[int] = []
    original = server.state.write_history

    def counted(path: str | os.PathLike[str], rows: Sequence[Mapping[str, object]]) -> Path:
        rewrites.append(len(rows))
        return original(path, rows)

    monkeypatch.setattr(server.state, "write_history", counted)
    rows: list[dict[str, object]] = [
        {"round": 0, "clients": 0, "failures": 0, "test_loss": 2.5, "seconds": 0.0},
        {"round": 1, "clients": 2, "failures": 0, "train_loss": 0.75, "seconds": 0.5},
        {"round": 2, "clients": np.int64(2), "failures": 1, "train_loss": float("nan"), "seconds": 0.25},
        {"round": 3, "clients": 2, "failures": 0, "train_loss": 1.0, "metrics_left_out": 3, "seconds": 0.5},
        {"round": 4, "clients": 2, "failures": 0, "test_loss": float("inf"), "seconds": 0.5},
    ]
    history = HistoryFile(tmp_path / "history.csv")
    for k, row in enumerate(rows, start=1):
        history.add(row)
        original(tmp_path / "all.csv", rows[:k])
        assert (tmp_path / "history.csv").read_bytes() == (tmp_path / "all.csv").read_bytes()
    assert rewrites == [1, 4]  # the first row, and the one that brought metrics_left_out
    assert history.rows == rows


def test_a_fifo_put_where_the_history_was_fails_the_write_rather_than_hanging(tmp_path: Path) -> None:
    """A named pipe swapped in for history.csv while a run goes on: the next round's append waited for a reader
    forever (the run hung until Ctrl-C). It now fails with an OSError (the row kept), with or without a reader on
    the pipe, and the next add writes the whole history as a file in its place."""
    path = tmp_path / "history.csv"
    history = HistoryFile(path)
    rows: list[dict[str, object]] = [{"round": r, "clients": 2, "failures": 0, "seconds": 0.5} for r in range(5)]
    history.add(rows[0])
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(OSError, match="No such device or address"):  # ENXIO: no reader
        history.add(rows[1])
    history.add(rows[2])  # after a failed append, the whole file is written anew (in place of the pipe)
    assert path.is_file() and list(pd.read_csv(path)["round"]) == [0, 1, 2]
    path.unlink()
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(OSError, match="not a regular file"):
            history.add(rows[3])
        assert os.read(reader, 4096) == b""  # nothing went down the pipe
    finally:
        os.close(reader)
    history.add(rows[4])
    assert list(pd.read_csv(path)["round"]) == [0, 1, 2, 3, 4]


def test_the_servers_history_file_holds_state_db_after_every_round(tmp_path: Path) -> None:
    """The server appends each new round's row to history.csv and rewrites it from state.db when a round is
    recorded again, when a row brings a new column and when the store is opened anew; after each, the file is
    write_history's of state.db's rows."""

    def matches(store: StateStore) -> bool:
        write_history(tmp_path / "want.csv", store.history())
        return (tmp_path / "history.csv").read_bytes() == (tmp_path / "want.csv").read_bytes()

    store = StateStore(tmp_path)
    for rnd in range(4):
        store.record_round(_record(rnd, 1.0 / (rnd + 1)))
        assert matches(store)
    store.record_round(_record(2, 0.75))  # recorded again: the file is rewritten, round 2's row replaced
    assert matches(store) and pd.read_csv(tmp_path / "history.csv")["train_loss"][2] == 0.75
    store.record_round(replace(_record(4, 0.1), eval_metrics={"accuracy": 0.5, "f1": 0.25}))  # a new column
    assert matches(store) and "test_f1" in pd.read_csv(tmp_path / "history.csv")
    store.close()
    store = StateStore(tmp_path)
    store.record_round(_record(5, 0.05))
    assert matches(store) and list(pd.read_csv(tmp_path / "history.csv")["round"]) == [0, 1, 2, 3, 4, 5]
    store.close()


def test_a_second_server_on_the_same_state_directory_is_refused(tmp_path: Path) -> None:
    store = _run(tmp_path, 1)
    with pytest.raises(
        StateError, match=rf"in use by another fedcore server \(pid {os.getpid()}\).*another --state-dir"
    ):
        StateStore(tmp_path)
    assert store.recorded_rounds() == [0, 1]  # the first one is untouched
    store.close()
    StateStore(tmp_path).close()  # free again once the first one is closed


def test_a_checkpoint_of_another_run_is_not_taken_for_this_runs(tmp_path: Path) -> None:
    """Same model, same rounds, another run's values: its file is intact, but it is not the checkpoint this
    state.db recorded, so it is skipped like a damaged one."""
    _run(tmp_path / "ours", 3).close()
    other = StateStore(tmp_path / "other")
    foreign = ServerState(round=3, parameters={"w": np.zeros(3, np.float32)}, optimizer_state={"m/w": np.zeros(3)})
    other.save_checkpoint(foreign)
    other.close()
    (tmp_path / "other" / "checkpoints" / "round-000003.safetensors").replace(
        tmp_path / "ours" / "checkpoints" / "round-000003.safetensors"
    )
    store = StateStore(tmp_path / "ours")
    resumed = store.resume()
    assert resumed is not None and resumed.round == 2  # ours, not the foreign round 3
    np.testing.assert_array_equal(resumed.parameters["w"], [2.0, 2.5, 2.25])
    assert store.recorded_rounds() == [0, 1, 2]
    store.close()


def test_another_runs_checkpoint_of_the_round_after_the_last_recorded_is_not_taken_for_this_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint of round R + 1 has no digest in state.db yet (as after a crash right after writing it), so its
    digest cannot tell; the run identity it carries does: another run's round 3 in a directory that recorded
    rounds 1-2 is skipped, and the run resumes after its own round 2 with its own records."""
    _run(tmp_path / "ours", 2).close()
    _run(tmp_path / "other", 3).close()
    (tmp_path / "other" / "checkpoints" / "round-000003.safetensors").replace(
        tmp_path / "ours" / "checkpoints" / "round-000003.safetensors"
    )
    store = StateStore(tmp_path / "ours")
    with caplog.at_level(logging.WARNING):
        resumed = store.resume()
    assert resumed is not None and resumed.round == 2
    np.testing.assert_array_equal(resumed.parameters["w"], [2.0, 2.5, 2.25])
    assert store.recorded_rounds() == [0, 1, 2]  # the other run's round-3 record is not restored into ours
    assert "written by another run" in caplog.text
    store.close()


def test_a_release_without_its_record_counts_once_more_after_a_restart_and_a_recorded_one_does_not(
    tmp_path: Path,
) -> None:
    """Round 3's model went out to federated evaluation (``record_release``) and the server died before round 3's
    checkpoint and record: the restart runs round 3 again, and the first release is counted in
    ``superseded_rounds`` (once, however often the store is opened). A release whose round was recorded counts
    nothing more."""
    store = _run(tmp_path, 2)
    store.record_release(2)  # released, then recorded (by _run above it was recorded first: recorded again now)
    store.record_round(_record(2, 0.5))
    store.record_release(3)
    store.close()
    for _ in range(2):
        store = StateStore(tmp_path)
        resumed = store.resume()
        assert resumed is not None and resumed.round == 2
        assert store.superseded_rounds() == 1
        store.close()


# ------------------------------------------------------------------------------------------ deterministic files


def test_the_same_tensors_and_metadata_always_give_the_same_bytes(tmp_path: Path) -> None:
    """safetensors' own writer orders metadata by a hash map (6 orders seen in 50 calls with 3 keys): fedcore's
    writer sorts it, in memory (encode) and on disk (save_payload) alike."""
    from fedcore.tensors import encode

    arrays: NamedArrays = {"b": np.arange(3, dtype=np.float32), "a": np.ones((2, 2), np.int64)}
    payloads = {encode(arrays, {"round": "3", "x": "y"}) for _ in range(50)} | {
        encode(arrays, {"x": "y", "round": "3"})
    }
    assert len(payloads) == 1
    (payload,) = payloads
    assert payload[8:].startswith(b'{"__metadata__":{"fedcore.order":"[\\"b\\", \\"a\\"]","round":"3","x":"y"},"b":')
    save_payload(str(tmp_path / "p.safetensors"), arrays, {"x": "y", "round": "3"})
    assert (tmp_path / "p.safetensors").read_bytes() == payload
    with pytest.raises(PayloadError, match="reserved"):
        save_payload(tmp_path / "q.safetensors", arrays, {DIGEST_KEY: "0"}, self_digest=True)
    with pytest.raises(PayloadError, match="cannot carry its own digest"):
        save_payload(tmp_path / "q.safetensors", arrays, self_digest=True, frame_bytes=1024)
    assert not (tmp_path / "q.safetensors").exists()


def test_checkpoints_and_simulations_do_not_load_grpc() -> None:
    """Checkpoint files and the simulation harness depend on fedcore.payload alone, never on the gRPC edge."""
    import subprocess
    import sys

    code = (
        "import sys, server.state, simulations.harness\n"
        "print(sorted(m for m in ('grpc', 'fedcore.wire') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_a_large_round_state_is_mapped_from_an_unlinked_file(tmp_path: Path) -> None:
    """map_round_state: the global model, the optimizer state, the groups' and the aggregator's state keep their
    values, as read-only maps of a file that is gone from the directory; a state under MAP_STATE_BYTES in all stays
    as it was (the same object), and one over it only through its parameters (FedAvg keeps no optimizer state) is
    mapped."""
    from server.state import MAP_STATE_BYTES, map_round_state

    rows = MAP_STATE_BYTES // (4 * 1000) // 2 + 1  # half the threshold in float32: the model and its momentum
    weights = np.arange(rows * 1000, dtype=np.float32).reshape(rows, 1000) / 3
    momentum = np.arange(rows * 1000, dtype=np.float32).reshape(rows, 1000) / 7
    state = ServerState(
        round=4,
        parameters={"w": weights, "n": np.array(9, np.int64)},
        optimizer_state={"m/w": momentum, "m/b": np.array(2.5, np.float32)},
        trainable=frozenset({"w"}),
        groups={"control": {"w": np.full(3, 0.5, np.float32)}},
        aggregator_state={"scale": np.array([4.0])},
    )
    mapped = map_round_state(state, tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert mapped.round == 4 and mapped.trainable == frozenset({"w"})
    assert list(mapped.parameters) == ["w", "n"] and set(mapped.optimizer_state) == {"m/w", "m/b"}
    assert isinstance(mapped.parameters["w"], np.memmap) and isinstance(mapped.optimizer_state["m/w"], np.memmap)
    np.testing.assert_array_equal(mapped.parameters["w"], weights)
    np.testing.assert_array_equal(mapped.optimizer_state["m/w"], momentum)
    assert mapped.parameters["n"].shape == () and int(mapped.parameters["n"]) == 9
    assert mapped.optimizer_state["m/b"].shape == () and float(mapped.optimizer_state["m/b"]) == 2.5
    np.testing.assert_array_equal(mapped.groups["control"]["w"], np.full(3, 0.5, np.float32))
    np.testing.assert_array_equal(mapped.aggregator_state["scale"], [4.0])
    for array in (mapped.parameters["w"], mapped.optimizer_state["m/w"]):
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0] = 1.0
    small = _state(3)
    assert map_round_state(small, tmp_path) is small
    model_only = ServerState(round=1, parameters={"w": np.ones(MAP_STATE_BYTES // 4, np.float32)}, optimizer_state={})
    assert isinstance(map_round_state(model_only, tmp_path).parameters["w"], np.memmap)


def test_a_round_state_that_cannot_be_mapped_stays_in_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A directory the file cannot be written to (here: one that does not exist) leaves the state as it was, with a
    warning that names the round and the file: a run never stops for this."""
    from server.state import MAP_STATE_BYTES, map_round_state

    momentum = np.ones(MAP_STATE_BYTES // 4 + 1, np.float32)
    state = ServerState(round=2, parameters={"w": momentum.copy()}, optimizer_state={"m/w": momentum})
    with caplog.at_level(logging.WARNING, logger="fedcore.server"):
        kept = map_round_state(state, tmp_path / "missing")
    assert kept is state
    assert "round 2: the global model and server state stay in memory" in caplog.text and "missing" in caplog.text


def test_two_states_of_one_round_mapped_into_one_directory_keep_their_own_values(tmp_path: Path) -> None:
    """Two runs of one process may map the same round's state into one directory: each file has its own name."""
    from server.state import MAP_STATE_BYTES, map_round_state

    size = MAP_STATE_BYTES // 4 + 1
    states = [
        ServerState(round=5, parameters={}, optimizer_state={"m/w": np.full(size, value, np.float32)})
        for value in (1.0, 2.0)
    ]
    mapped = [map_round_state(state, tmp_path) for state in states]
    assert [float(m.optimizer_state["m/w"][0]) for m in mapped] == [1.0, 2.0]
    assert [float(m.optimizer_state["m/w"][-1]) for m in mapped] == [1.0, 2.0]


def test_a_restart_with_another_seed_is_refused_and_the_same_seed_resumes(tmp_path: Path) -> None:
    """The seed keys selection and every client's randomness: a run resumed under another seed would match
    neither run, so it is refused with both seeds named; the same seed resumes; nothing trained yet takes any."""
    store = StateStore(tmp_path / "fresh")
    store.check_seed(7)
    store.check_seed(8)  # nothing trained yet: the new seed is taken
    store.close()
    store = _run(tmp_path / "run", 2)
    store.check_seed(7)
    store.close()
    store = StateStore(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"started with --seed 7, but this server is configured with --seed 0.*"
                       r"Resume with --seed 7, or use a new --state-dir"):  # fmt: skip
        store.check_seed(0)
    store.check_seed(7)
    resumed = store.resume()
    assert resumed is not None and resumed.round == 2
    store.close()


def test_a_robust_rule_too_strict_for_min_fit_clients_is_refused_before_listening(tmp_path: Path) -> None:
    """Krum for 1 Byzantine client needs 5 clients a round, and a round may start with min_fit_clients = 2
    connected: the server listened, made its state directory and exited 2 at round 1 once its clients joined."""
    match = (
        r"krum tolerates 1 Byzantine client\(s\) only with at least 5 clients per round \(n > 2f \+ 2\), got 2; "
        r".* \(a round may select as few as 2 clients: min_fit_clients, --min-fit-clients\)"
    )
    state = tmp_path / "state"
    refused_before_listening(state, ConfigError, match, strategy=StrategyConfig(aggregator="krum", byzantine=1))
    assert not state.exists()


def test_a_robust_rule_that_min_fit_results_makes_room_for_is_not_refused(tmp_path: Path) -> None:
    """--min-fit-results 5 makes every round wait for 5 clients, enough for Krum with f = 1, whatever
    min_fit_clients (2) says: the server starts (and, with no client, fails waiting for them)."""
    from server.app import run_server
    from server.config import RoundSettings, ServerConfig, TlsSettings

    config = ServerConfig(
        tls=TlsSettings(insecure=True),
        address="127.0.0.1:0",
        state_dir=tmp_path / "state",
        task="simulations.tasks:demo_task",
        task_options={"dataset": "digits", "num_clients": "2", "partition": "iid", "model": "2nn"},
        strategy=StrategyConfig(aggregator="krum", byzantine=1),
        round=RoundSettings(min_fit_results=5, wait_for_clients_s=1.0),
    )
    lines: list[str] = []
    with pytest.raises(RoundFailed, match="0 client\\(s\\) connected after waiting 1 s, 5 needed"):
        run_server(config, echo=lines.append)
    assert any("listening" in line for line in lines)
