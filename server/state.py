"""The server's state directory: SQLite (stdlib) for clients, rounds and metrics; safetensors checkpoints.

Layout of a state directory::

    state.db                        meta (format, the run's strategy), clients, rounds, round_metrics, failures,
                                    checkpoints (the digest of each checkpoint written), releases (DP-FedAvg:
                                    rounds whose model was sent to clients before their record, see
                                    StateStore.record_release)
    state.lock                      held (flock) by the one process using the directory; holds its pid
    checkpoints/round-000003.safetensors
                                    global model ("param/<name>"), server optimizer state ("opt/<name>"), the
                                    server state of each tensor group ("group/<group>/<name>", e.g. SCAFFOLD's
                                    control variate), the aggregator's state ("aggregator/<name>", e.g. adaptive
                                    clipping's norm), the round, the round's record (header metadata
                                    "fedcore.round_record": its history row, failures and selection feedback), the
                                    run's identity (header metadata "fedcore.run", drawn when state.db was created)
                                    and the file's own SHA-256 (header metadata "fedcore.sha256")
    history.csv                     one row per round (the current rows of the rounds table), see write_history
    spill/                          payload files in flight (emptied at start)

A checkpoint is written to a temporary file, fsynced, renamed, and its directory fsynced, so a crash (or a full
disk) leaves the previous checkpoint or the new one, never a torn file; the newest two are kept. Each carries a
digest of its own bytes, checked when a run resumes.

Resuming (:meth:`StateStore.resume`) takes the newest *intact* checkpoint, round C (a damaged newer one is
reported in the log and skipped, and so is a checkpoint whose digest is not the one state.db recorded when it
wrote that round's checkpoint, or whose run identity is not state.db's: another run's), and holds it against the
records in state.db, whose last trained round is R:

- no checkpoint and no trained round recorded: a fresh run (a round-0 row is simply written again);
- C = R: resume after C;
- C = R + 1 (the server stopped between writing round C's checkpoint and its row): round C's record, which the
  checkpoint keeps in its header (``fedcore.round_record``), is stored (its history row, failures and selection
  feedback), and the run resumes after C;
- C < R (the newer checkpoints are damaged or gone): resume after C; the rows of rounds C+1..R stay in state.db
  but are marked superseded (``superseded`` > 0: the k-th such fallback) and leave history.csv, and the rounds
  run again — the old rows are never mixed with the new ones;
- trained rounds recorded but no intact checkpoint, or C > R + 1 (state.db replaced): refused with
  :class:`~fedcore.errors.StateError`, which says what to do.

The run's strategy and seed are recorded at the first start; a restart with another strategy, with settings that
give the stored server optimizer state another meaning, or with another seed is refused
(:meth:`StateStore.check_strategy`, :meth:`StateStore.check_seed`). Every SQLite
failure (a damaged file, a full disk) surfaces as a StateError that names the file.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import io
import json
import logging
import math
import os
import secrets
import shutil
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcore.errors import ConfigError, PayloadError, StateError
from fedcore.payload import (
    DIGEST_KEY,
    PayloadFile,
    check_digest,
    open_safetensors,
    read_safetensors_header,
    save_payload,
)
from fedcore.selection import ClientObservation
from fedcore.strategy import Strategy, StrategyConfig
from fedcore.task import trainable_names
from fedcore.tensors import NamedArrays, check_spec, num_bytes, state_spec
from server.round_loop import Rereleased, RoundRecord, ServerState

log = logging.getLogger("fedcore.server")

_PARAM = "param/"
_OPT = "opt/"
_GROUP = "group/"
_AGGREGATOR = "aggregator/"
_KEEP_CHECKPOINTS = 2
_FORMAT = "2"
STORE_ENTRIES = frozenset(
    (
        "checkpoints",
        "spill",
        "history.csv",
        "state.lock",
        "state.db",
        "state.db-journal",
        "state.db-wal",
        "state.db-shm",
    )
)
"""What a :class:`StateStore` keeps in its directory (SQLite's side files included); its temporary files begin
with a dot."""
_MAX_TEXT = 2000  # characters of client-derived text (ids, failure reasons) stored per row

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS clients (
    client_id TEXT PRIMARY KEY, first_seen REAL NOT NULL, last_seen REAL NOT NULL, joins INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER NOT NULL, finished_at REAL NOT NULL, seconds REAL, attempts INTEGER,
    selected INTEGER, accepted INTEGER, failures INTEGER, superseded INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (round, superseded)
);
CREATE TABLE IF NOT EXISTS round_metrics (
    round INTEGER NOT NULL, key TEXT NOT NULL, value, superseded INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (round, key, superseded)
);
CREATE TABLE IF NOT EXISTS checkpoints (round INTEGER PRIMARY KEY, sha256 TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS failures (
    round INTEGER NOT NULL, client_id TEXT NOT NULL, stage TEXT NOT NULL, reason TEXT NOT NULL,
    superseded INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS selection (
    round INTEGER NOT NULL, client_id TEXT NOT NULL, num_examples INTEGER NOT NULL, loss REAL, seconds REAL,
    superseded INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS releases (round INTEGER NOT NULL);
"""
# round_metrics.value has no type on purpose: SQLite then keeps integers (counts) as integers and floats as floats
# (a NaN as the text "nan", see _to_sql).

_NEW_RUN = "use a new --state-dir for a new run (add --initial FILE to start it from a saved model, e.g. a checkpoint)"

HISTORY_COLUMNS = ("round", "clients", "failures", "train_loss", "test_loss", "test_accuracy", "federated_loss")
"""The fixed leading columns of every history.csv, in order; see :func:`write_history`."""


def history_columns(rows: Sequence[Mapping[str, object]]) -> list[str]:
    """The columns of a history file holding ``rows``: :data:`HISTORY_COLUMNS`, then every other key of any row
    sorted by name, then ``seconds`` (wall time: the one column that differs between two runs of the same seed)."""
    fixed = {*HISTORY_COLUMNS, "seconds"}
    extra = sorted({str(key) for row in rows for key in row} - fixed)
    return [*HISTORY_COLUMNS, *extra, "seconds"]


def _cell(value: object) -> str:
    """One CSV cell: empty for None, integers as integers, floats in Python's shortest round-trip form."""
    plain = _db_value(value)
    return "" if plain is None else str(plain) if isinstance(plain, int) else repr(plain)


def write_history(path: str | os.PathLike[str], rows: Sequence[Mapping[str, object]]) -> Path:
    """Write the round history as CSV, atomically (temporary file, rename), and return its path.

    The one writer of history.csv, for the server (rows from state.db) and the simulation (rows in memory), so
    both files have one schema: the columns of :func:`history_columns` (any metric column, such as a new count
    in :meth:`RoundRecord.as_row`, just appears), every row with every column (empty where a round has no
    value), integer counts as integers. The bytes depend only on ``rows``.

    Args:
        path: the CSV file (its directory must exist).
        rows: one mapping per round, e.g. :meth:`RoundRecord.as_row`; values None, int or float.

    Raises:
        OSError: the file cannot be written.
    """
    path = Path(path)
    columns = history_columns(rows)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", newline="") as fh:
            writer = csv.writer(fh, lineterminator="\n")
            writer.writerow(columns)
            writer.writerows(_cells(row, columns) for row in rows)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _cells(row: Mapping[str, object], columns: Sequence[str]) -> list[str]:
    """One history row's CSV cells, in ``columns``' order (empty where the round has no value)."""
    return [_cell(row.get(column)) for column in columns]


class HistoryFile:
    """A history.csv written as rounds end: each row appended while the columns stay the same, the whole file
    rewritten (:func:`write_history`, atomically) when a row brings a column the file lacks. The file's bytes are
    always :func:`write_history`'s of every row added, but a round costs one line, not the whole history (rewritten
    every round, a run of 300 rounds of 100 clients spent a tenth of its time on it).

    Args:
        path: the CSV file (its directory must exist); written anew by the first :meth:`add`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.rows: list[Mapping[str, object]] = []
        self._columns: list[str] = []

    def reset(self, rows: Sequence[Mapping[str, object]]) -> None:
        """Rewrite the file with ``rows`` (:func:`write_history`); the next :meth:`add` appends after them.

        Raises:
            OSError: the file cannot be written (the next :meth:`add` rewrites the file).
        """
        self.rows[:] = rows  # the same list: a reader's reference to it stays current
        self._columns = []
        write_history(self.path, self.rows)
        self._columns = history_columns(self.rows)

    def add(self, row: Mapping[str, object]) -> None:
        """Add one round's row (as :func:`write_history` takes it).

        Raises:
            OSError: the file cannot be written (the row is kept: the next :meth:`add` rewrites the file).
        """
        known = set(self._columns)
        if not self._columns or any(str(key) not in known for key in row):  # a failed rewrite is retried here
            self.reset([*self.rows, row])
            return
        self.rows.append(row)
        line = io.StringIO()
        csv.writer(line, lineterminator="\n").writerow(_cells(row, self._columns))
        try:  # O_NONBLOCK: a FIFO put where the file was fails (ENXIO) rather than waiting for a reader forever
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
            with os.fdopen(fd, "a", newline="") as fh:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file (a run's history.csv is one)", str(self.path))
                fh.write(line.getvalue())  # one write: a process killed around it leaves the line whole or absent
        except OSError:
            self._columns = []
            raise


def _db_value(value: object) -> int | float | None:
    """A metric value as stored: None, a Python int (counts, numpy integers, bools) or a Python float."""
    if value is None:
        return None
    if isinstance(value, (bool, int, np.integer)):
        return int(value)
    return float(value)  # type: ignore[arg-type]


_NAN = "nan"
"""How a NaN metric value (a diverged model's test loss) is stored in round_metrics: SQLite would store a NaN
REAL as NULL, which reads back as "no value", so the server's history.csv would lose the divergence that the
simulation's shows."""


def _to_sql(value: object) -> int | float | str | None:
    plain = _db_value(value)
    return _NAN if isinstance(plain, float) and math.isnan(plain) else plain


def _from_sql(value: object) -> int | float | None:
    if value == _NAN:
        return math.nan
    return value if value is None or isinstance(value, (int, float)) else None


def _strategy_identity(config: StrategyConfig) -> dict[str, object]:
    """The strategy name plus the settings that decide what its stored server-optimizer state means: FedAvgM's
    momentum (the velocity's decay) and the adaptive optimizers' moment decays. The learning rate, tau and the
    weighting may change between restarts: they change later steps, not the meaning of the stored state."""
    identity: dict[str, object] = {"name": config.name}
    if config.name == "fedavgm":
        identity["server_momentum"] = config.server_momentum
    elif config.name == "fedadagrad":
        identity["beta1"] = config.beta1
    elif config.name in ("fedadam", "fedyogi"):
        identity.update(beta1=config.beta1, beta2=config.beta2)
    return identity


def restore_strategy(strategy: Strategy, store: StateStore, round: int) -> None:
    """What a run resumed after round ``round`` learns from its stored rounds rather than its checkpoint: the
    selection's state (losses, durations of the rounds up to ``round``) and, for DP-FedAvg
    (:class:`~server.round_loop.Rereleased`), the rounds released and then superseded."""
    strategy.selection.restore((rnd, seen) for rnd, seen in store.selection_history() if rnd <= round)
    if isinstance(strategy.aggregator, Rereleased):
        strategy.aggregator.superseded_releases(store.superseded_rounds())


def release_hook(strategy: Strategy, store: StateStore | None) -> Callable[[int], None] | None:
    """:func:`server.round_loop.run_rounds`' ``on_release`` for a run that checkpoints into ``store``: the store's
    :meth:`StateStore.record_release` when the strategy's aggregator counts every release (DP-FedAvg,
    :class:`~server.round_loop.Rereleased`), else None."""
    if store is None or not isinstance(strategy.aggregator, Rereleased):
        return None
    return store.record_release


def _privacy_flag(key: str) -> str:
    """A privacy setting's name with its server flag: ``noise_multiplier (--noise-multiplier)``."""
    if key == "clients_per_round":
        return "clients per round (--fraction-fit, --min-fit-clients)"
    return f"{key} (--{key.replace('_', '-')})"


def _shown(value: object) -> str:
    return "unset" if value is None else repr(value)


def _describe(identity: Mapping[str, object]) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in identity.items() if k != "name")
    return f"{identity.get('name')}" + (f" ({settings})" if settings else "")


def _rounds_text(rounds: Sequence[int]) -> str:
    return f"round {rounds[0]}" if len(rounds) == 1 else f"rounds {rounds[0]}-{rounds[-1]}"


SERVER_IN_USE = "by another fedcore server{pid}; stop it first, or give this one another --state-dir"
"""The refusal of a server's state directory that another process holds (``{pid}``: " (pid N)" when known)."""


@dataclass(frozen=True)
class StateAdvice:
    """What a :class:`StateStore`'s refusals call the run and tell its user to do, in the words of the command that
    opened it (a server's flags, or a simulation's).

    Attributes:
        who: the run, as the subject of "... is configured with" (e.g. "this server").
        new_run: how to start a new run instead, after "or" (a lower-case clause).
        resume: how to go on once a problem outside the directory is fixed (a lower-case clause).
        in_use: the end of the refusal of a directory another process holds, after "is in use " (``{pid}``: the
            holder's pid, " (pid N)", when known).
    """

    who: str
    new_run: str
    resume: str
    in_use: str


SERVER_ADVICE = StateAdvice(
    who="this server",
    new_run=_NEW_RUN,
    resume="restart with the same --state-dir to resume",
    in_use=SERVER_IN_USE,
)
"""A deployment server's state directory (``--state-dir``)."""


class StateStore:
    """The state directory of one run. Thread-safe (one connection behind a lock).

    Args:
        directory: created if missing.
        advice: what its refusals tell the user to do (:class:`StateAdvice`; default: a server's flags).

    Raises:
        ConfigError: the directory cannot be created or written.
        StateError: another process holds the directory (a second server on it), or state.db is damaged, not a
            database, or written by an older fedcore, or the directory has no state.db but results of another run
            (history.csv, a simulation's files) that the server would overwrite (the message says what to do).
    """

    def __init__(self, directory: str | os.PathLike[str], *, advice: StateAdvice = SERVER_ADVICE) -> None:
        self._advice = advice
        self.directory = Path(directory)
        self.checkpoints = self.directory / "checkpoints"
        self.spill = self.directory / "spill"
        self.database = self.directory / "state.db"
        _refuse_results_of_another_kind(self.directory, self.database)
        try:
            self.checkpoints.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot use {str(self.directory)!r} as the state directory: {exc}") from exc
        self._owner = lock_directory(self.directory, in_use=advice.in_use)  # before anything in it is cleaned or opened
        try:
            for torn in self.checkpoints.glob(".*.tmp-*"):  # a write interrupted by a crash; never a checkpoint
                torn.unlink()
            if self.spill.exists():
                shutil.rmtree(self.spill)  # payloads of an interrupted run are never reused
            self.spill.mkdir()
        except OSError as exc:
            os.close(self._owner)
            raise ConfigError(f"cannot use {str(self.directory)!r} as the state directory: {exc}") from exc
        self._lock = threading.Lock()
        self._history_file = HistoryFile(self.directory / "history.csv")  # rewritten whole by the first round recorded
        try:
            with self._sqlite("opening it"):
                self._db = sqlite3.connect(self.database, check_same_thread=False, isolation_level=None)
            try:
                with self._sqlite("opening it"):
                    self._open()
            except BaseException:
                self._db.close()
                raise
        except BaseException:
            os.close(self._owner)
            raise

    def _open(self) -> None:
        self._db.execute("PRAGMA journal_mode=WAL")
        problems = [str(row[0]) for row in self._db.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError("; ".join(problems)[:_MAX_TEXT])
        tables = {str(name) for (name,) in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if tables and "meta" not in tables:
            raise StateError(
                f"the state database {str(self.database)!r} was written by an older fedcore (no format record) "
                f"and cannot be resumed; {self._advice.new_run}"
            )
        self._db.executescript(_SCHEMA)
        self._db.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?)", (_FORMAT,))
        self._db.execute("INSERT OR IGNORE INTO meta VALUES ('run', ?)", (secrets.token_hex(16),))
        (found,) = self._db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
        if found != _FORMAT:
            raise StateError(
                f"the state database {str(self.database)!r} has format {str(found)[:20]!r}, this fedcore reads "
                f"format {_FORMAT}; use the fedcore that wrote it, or {self._advice.new_run}"
            )
        # the run's identity, drawn when its state.db was created: every checkpoint carries it (RUN_KEY)
        self._run = str(self._db.execute("SELECT value FROM meta WHERE key = 'run'").fetchone()[0])

    @contextmanager
    def _sqlite(self, doing: str) -> Iterator[None]:
        """Turn a SQLite failure into a StateError that names the file and says what to do."""
        try:
            yield
        except sqlite3.Error as exc:
            raise StateError(
                f"the state database {str(self.database)!r} failed while {doing}: {exc}. If it is damaged "
                "('not a database', 'malformed'), move the state directory aside and "
                f"{self._advice.new_run}; if the disk is full or read-only, fix that and {self._advice.resume}"
            ) from exc

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction (the caller holds the lock): committed at the end, rolled back on any error."""
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        """Close the database and let another process use the directory."""
        with self._lock:
            self._db.close()
            if self._owner >= 0:
                os.close(self._owner)  # releases the directory lock
                self._owner = -1

    def _meta(self, key: str) -> str | None:
        with self._lock, self._sqlite(f"reading {key!r}"):
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _set_meta(self, key: str, value: str) -> None:
        with self._lock, self._sqlite(f"recording {key!r}"):
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    # ----------------------------------------------------------------- registry
    def record_join(self, client_id: str) -> None:
        """Note that ``client_id`` joined now.

        Raises:
            StateError: the database cannot be written.
        """
        now = time.time()
        with self._lock, self._sqlite("recording a join"):
            self._db.execute(
                "INSERT INTO clients VALUES (?, ?, ?, 1) ON CONFLICT(client_id) "
                "DO UPDATE SET last_seen = excluded.last_seen, joins = joins + 1",
                (client_id[:_MAX_TEXT], now, now),
            )

    def clients(self) -> list[tuple[str, int]]:
        """``(client id, number of joins)`` of every client ever seen."""
        with self._lock, self._sqlite("reading the clients"):
            return [(str(c), int(n)) for c, n in self._db.execute("SELECT client_id, joins FROM clients ORDER BY 1")]

    # ------------------------------------------------------------------- rounds
    def record_round(self, record: RoundRecord) -> None:
        """Store one round's record (metrics and failures), replacing a current row of the same round, and
        rewrite history.csv.

        Raises:
            StateError: the database or history.csv cannot be written.
        """
        self._store_round(round_rows(record))

    def _store_round(self, rows: Mapping[str, object]) -> None:
        """:meth:`record_round` of a record's rows (:func:`round_rows`)."""
        rnd = _int(rows["round"])
        row, failures, observations = rows["row"], rows["failures"], rows["observations"]
        if not isinstance(row, Mapping) or not isinstance(failures, list) or not isinstance(observations, list):
            raise StateError(f"a stored record of round {rnd} is not a round record (row, failures, observations)")
        with self._lock, self._sqlite(f"recording round {rnd}"), self._transaction():
            self._db.execute("DELETE FROM rounds WHERE round = ? AND superseded = 0", (rnd,))
            self._db.execute(
                "INSERT INTO rounds (round, finished_at, seconds, attempts, selected, accepted, failures) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    rnd,
                    time.time(),
                    rows["seconds"],
                    rows["attempts"],
                    rows["selected"],
                    rows["accepted"],
                    len(failures),
                ),
            )
            self._db.execute("DELETE FROM round_metrics WHERE round = ? AND superseded = 0", (rnd,))
            self._db.executemany(
                "INSERT INTO round_metrics (round, key, value) VALUES (?, ?, ?)",
                [(rnd, k, _to_sql(v)) for k, v in row.items() if k != "round"],
            )
            self._db.execute("DELETE FROM failures WHERE round = ? AND superseded = 0", (rnd,))
            self._db.executemany(
                "INSERT INTO failures (round, client_id, stage, reason) VALUES (?, ?, ?, ?)",
                [(f_round, cid[:_MAX_TEXT], stage, reason[:_MAX_TEXT]) for f_round, cid, stage, reason in failures],
            )
            self._db.execute("DELETE FROM selection WHERE round = ? AND superseded = 0", (rnd,))
            self._db.executemany(
                "INSERT INTO selection (round, client_id, num_examples, loss, seconds) VALUES (?, ?, ?, ?, ?)",
                [(rnd, cid[:_MAX_TEXT], n, loss, seconds) for cid, n, loss, seconds in observations],
            )
            self._db.execute("DELETE FROM releases WHERE round = ?", (rnd,))  # the record now stands for it
        self._export_round(rnd)

    def _export_round(self, rnd: int) -> None:
        """history.csv after round ``rnd`` was recorded: its row appended when it follows the rounds the file holds
        (each round of a run), else the whole file rewritten from state.db (the first round a store records, a
        round recorded again, the rounds after superseded ones).

        Raises:
            StateError: the file cannot be written.
        """
        rows = self._history_file.rows
        last = rows[-1].get("round") if rows else None
        if not isinstance(last, int) or rnd <= last:
            self.export_csv()
            return
        try:
            self._history_file.add(self._history_rows(rnd)[0])
        except OSError as exc:
            raise StateError(
                f"cannot write the round history {str(self._history_file.path)!r}: {exc}. Round {rnd} is recorded in "
                f"{str(self.database)!r}; free disk space (or raise the file size limit) and {self._advice.resume}",
                round=rnd,
            ) from exc

    def selection_history(self) -> list[tuple[int, list[ClientObservation]]]:
        """The client selection's feedback of every current round, ascending: ``(round, observations)`` as the
        round loop gave them to :meth:`fedcore.selection.Selector.observe`, to rebuild it on restart
        (:meth:`fedcore.selection.Selector.restore`). Client ids are the ones accepted into the round (their
        length is bounded at join)."""
        rounds: dict[int, list[ClientObservation]] = {}
        with self._lock, self._sqlite("reading the selection history"):
            for rnd, cid, examples, loss, seconds in self._db.execute(
                "SELECT round, client_id, num_examples, loss, seconds FROM selection WHERE superseded = 0 "
                "ORDER BY round, rowid"
            ):
                rounds.setdefault(int(rnd), []).append(
                    ClientObservation(client_id=str(cid), num_examples=int(examples), loss=loss, seconds=seconds)
                )
        return sorted(rounds.items())

    def recorded_rounds(self) -> list[int]:
        """The rounds with a current (not superseded) record, ascending."""
        with self._lock, self._sqlite("reading the rounds"):
            return [int(r) for (r,) in self._db.execute("SELECT round FROM rounds WHERE superseded = 0 ORDER BY 1")]

    def superseded_rounds(self) -> int:
        """How many rounds were released and then run again, each a release of its own for differential
        privacy's accounting: the round records superseded (:meth:`resume` fell back past them: a damaged or
        missing checkpoint), and the releases without a record (:meth:`record_release`) that a resume found."""
        with self._lock, self._sqlite("reading the rounds"):
            (count,) = self._db.execute("SELECT COUNT(*) FROM rounds WHERE superseded > 0 AND round > 0").fetchone()
        return int(count) + int(self._meta("unrecorded_releases") or 0)

    def record_release(self, rnd: int) -> None:
        """Note, before it happens, that round ``rnd``'s global model is sent out ahead of its checkpoint and
        record (to its federated evaluation's clients, :func:`server.round_loop.run_rounds`' ``on_release``). A
        process that dies before the round is recorded has released a model that the restart trains again with
        fresh noise: :meth:`resume` counts the release in :meth:`superseded_rounds`. Recording the round
        (:meth:`record_round`) clears the note.

        Raises:
            StateError: the database cannot be written (the model is then not sent).
        """
        with self._lock, self._sqlite(f"recording the release of round {rnd}"):
            self._db.execute("INSERT INTO releases (round) VALUES (?)", (rnd,))

    def _count_unrecorded_releases(self, after: int) -> None:
        """Move the releases of rounds after ``after`` (the round a run resumes after, whose later rounds run
        again) into the count :meth:`superseded_rounds` adds."""
        with self._lock, self._sqlite("counting the releases of rounds run again"), self._transaction():
            (found,) = self._db.execute("SELECT COUNT(*) FROM releases WHERE round > ?", (after,)).fetchone()
            if not found:
                return
            row = self._db.execute("SELECT value FROM meta WHERE key = 'unrecorded_releases'").fetchone()
            total = (int(row[0]) if row is not None else 0) + int(found)
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('unrecorded_releases', ?)", (str(total),))
            self._db.execute("DELETE FROM releases WHERE round > ?", (after,))
        log.warning(
            "%d global model(s) of rounds after round %d were sent to clients (federated evaluation) before the "
            "server stopped, and those rounds run again: each counts as a release of its own in the privacy "
            "accounting",
            found,
            after,
        )

    def history(self) -> list[dict[str, float | int | None]]:
        """One dict per current round record, ``round`` first, then its metrics (integers stay integers)."""
        return self._history_rows()

    def _history_rows(self, only: int | None = None) -> list[dict[str, float | int | None]]:
        """:meth:`history`, or its row of round ``only`` alone."""
        where, args = ("AND round = ?", (only,)) if only is not None else ("", ())
        with self._lock, self._sqlite("reading the history"):
            rows: dict[int, dict[str, float | int | None]] = {}
            query = f"SELECT round FROM rounds WHERE superseded = 0 {where} ORDER BY round"
            for (rnd,) in self._db.execute(query, args):
                rows[int(rnd)] = {"round": int(rnd)}
            for rnd, key, value in self._db.execute(
                f"SELECT round, key, value FROM round_metrics WHERE superseded = 0 {where} ORDER BY round, rowid", args
            ):
                if int(rnd) in rows:
                    rows[int(rnd)][str(key)] = _from_sql(value)
        return list(rows.values())

    def export_csv(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the round history with :func:`write_history` (default: ``history.csv`` in the state directory).

        Raises:
            StateError: the file cannot be written.
        """
        target = self.directory / "history.csv" if path is None else Path(path)
        try:
            if path is None:  # the store's own file: later rounds are appended to it
                self._history_file.reset(self.history())
                return target
            return write_history(target, self.history())
        except OSError as exc:
            raise StateError(
                f"cannot write the round history {str(target)!r}: {exc}. The rounds are recorded in "
                f"{str(self.database)!r}; free disk space (or raise the file size limit) and {self._advice.resume}"
            ) from exc

    def _supersede_after(self, rnd: int) -> list[int]:
        """Mark the current records of rounds after ``rnd`` superseded; return those rounds."""
        with self._lock, self._sqlite(f"marking the rounds after {rnd} superseded"), self._transaction():
            rounds = [
                int(r)
                for (r,) in self._db.execute(
                    "SELECT round FROM rounds WHERE superseded = 0 AND round > ? ORDER BY 1", (rnd,)
                )
            ]
            (mark,) = self._db.execute("SELECT COALESCE(MAX(superseded), 0) + 1 FROM rounds").fetchone()
            for table in ("rounds", "round_metrics", "failures", "selection"):
                self._db.execute(
                    f"UPDATE {table} SET superseded = ? WHERE superseded = 0 AND round > ?",
                    (mark, rnd),
                )
        return rounds

    # ------------------------------------------------------------------ the run
    def _started(self) -> bool:
        """Whether the run in this directory trained a round (a record past round 0, or a checkpoint): what its
        recorded seed and settings are held against."""
        return any(r > 0 for r in self.recorded_rounds()) or bool(checkpoint_files(self.directory))

    def check_seed(self, seed: int) -> None:
        """Record the run's seed at its first start; refuse a restart with another one (the seed keys the client
        selection and every client's randomness: a run resumed under another seed would match neither seed's
        run). A state directory where nothing was trained yet, or one whose run recorded no seed (an earlier
        fedcore's), takes the given seed.

        Raises:
            ConfigError: the state directory holds a run of another seed (both are named, with what to do).
            StateError: the recorded seed cannot be read.
        """
        recorded = self._meta("seed")
        started = self._started()
        if recorded is not None and started:
            try:
                previous = int(recorded)
            except ValueError as exc:
                raise StateError(
                    f"the state database {str(self.database)!r} holds an unreadable seed record; {self._advice.new_run}"
                ) from exc
            if previous != seed:
                raise ConfigError(
                    f"the state directory {str(self.directory)!r} holds a run started with --seed {previous}, but "
                    f"{self._advice.who} is configured with --seed {seed}: the resumed rounds would select and train "
                    f"as neither run does. Resume with --seed {previous}, or {self._advice.new_run}"
                )
            return
        self._set_meta("seed", str(seed))

    def check_trace(self, digest: str | None) -> None:
        """Record the SHA-256 of the run's availability trace file (None: no such file) at its first start; refuse a
        restart whose file holds other contents, wherever it lies: the rounds after it would have other clients
        online than the run's recipe says (config.json records only the file's path).

        Raises:
            ConfigError: the trace differs from the recorded one (what to do).
        """
        recorded = self._meta("trace")
        now = digest or ""
        if recorded is None and digest is not None and self._started():  # a run of an earlier fedcore
            log.warning(
                "the run in %s recorded no availability trace contents (an earlier fedcore's run): the trace file "
                "given now is taken as its own without a check; resume with the file it started with",
                str(self.directory),
            )
        elif recorded is not None and self._started():
            if recorded != now:
                raise ConfigError(
                    "the availability trace file (devices.availability_file) holds other contents than the one this "
                    f"run in {str(self.directory)!r} started with (SHA-256 {recorded[:12] or 'none'}..., now "
                    f"{now[:12] or 'none'}...): the resumed rounds would have other clients online. Resume with the "
                    f"file as it was, or {self._advice.new_run}"
                )
            return
        self._set_meta("trace", now)

    def _parsed_record(self, recorded: str, what: str) -> Any:
        """A JSON record of state.db's meta table (``what``: its name in the error).

        Raises:
            StateError: it is not JSON.
        """
        try:
            return json.loads(recorded)
        except json.JSONDecodeError as exc:
            raise StateError(
                f"the state database {str(self.database)!r} holds an unreadable {what} record; {self._advice.new_run}"
            ) from exc

    def check_privacy(self, identity: Mapping[str, object]) -> None:
        """Record the run's privacy settings at its first start; refuse a restart with others.

        ``identity`` is :func:`privacy.dp.config.accounting_identity`'s: the epsilon reported after a restart
        composes every round released so far at the settings given now, so other settings (a noise multiplier,
        population, delta, accountant or clients per round changed; DP turned on or off) would report an epsilon
        that holds for neither run. A state directory where nothing was trained yet, or whose run recorded no
        privacy settings (an earlier fedcore's), takes the given ones.

        Raises:
            ConfigError: the settings differ (each differing key with both values, and what to do).
            StateError: the recorded settings cannot be read.
        """
        recorded = self._meta("privacy")
        started = self._started()
        now = json.loads(json.dumps(dict(identity), sort_keys=True))
        if recorded is not None and started:
            previous = self._parsed_record(recorded, "privacy")
            if previous != now:
                # a key of one side only follows from dp or dp_sgd turned on or off: those two say it
                keys = sorted(
                    (k for k in set(previous) | set(now) if k in ("dp", "dp_sgd") or (k in previous and k in now)),
                    key=lambda k: (k != "dp", k),
                )
                differ = [
                    f"{_privacy_flag(k)} {_shown(previous.get(k))} -> {_shown(now.get(k))}"
                    for k in keys
                    if previous.get(k) != now.get(k)
                ]
                raise ConfigError(
                    f"the state directory {str(self.directory)!r} holds a run with other privacy settings "
                    f"({'; '.join(differ)}): the epsilon of its rounds would be reported as if they had run with "
                    f"these. Resume with the recorded settings (given as before), or {self._advice.new_run}"
                )
            return
        self._set_meta("privacy", json.dumps(now, sort_keys=True))

    def check_strategy(self, config: StrategyConfig) -> None:
        """Record the run's strategy at its first start; refuse a restart with another one.

        Refused: another strategy name, or other settings that change what the stored server-optimizer state
        means (FedAvgM's ``server_momentum``; ``beta1`` of the adaptive ones and ``beta2`` of FedAdam/FedYogi).
        ``server_lr``, ``tau`` and ``weighting`` may change. A state directory where nothing was trained yet
        simply takes the new strategy.

        Raises:
            ConfigError: the state directory holds a run of another strategy (both are named).
            StateError: checkpoints or trained rounds exist but no strategy was recorded (state.db replaced).
        """
        identity = _strategy_identity(config)
        recorded = self._meta("strategy")
        trained = [r for r in self.recorded_rounds() if r > 0]
        files = checkpoint_files(self.directory)
        started = bool(trained or files)
        if recorded is None and started:
            raise StateError(
                f"the state directory {str(self.directory)!r} holds "
                + (f"checkpoints ({files[-1].name})" if files else f"records of {_rounds_text(trained)}")
                + " but state.db records no strategy for them (the database was replaced or deleted); "
                + self._advice.new_run
            )
        if recorded is not None and started:
            previous = self._parsed_record(recorded, "strategy")
            if previous != identity:
                raise ConfigError(
                    f"the state directory {str(self.directory)!r} holds a run of strategy {_describe(previous)}, "
                    f"but {self._advice.who} is configured for {_describe(identity)}: the stored server optimizer "
                    f"state would be read as something else. Resume with the recorded strategy (--strategy "
                    f"{previous.get('name')} and its settings), or {self._advice.new_run}"
                )
            return
        self._set_meta("strategy", json.dumps(identity, sort_keys=True))

    def resume(self, *, mapped: bool = False, rounds: int | None = None) -> ServerState | None:
        """The state to continue from: the newest intact checkpoint, held against the round records (see the
        module docstring), or None for a fresh run. Rounds recorded after the checkpoint are marked superseded.

        Args:
            mapped: the checkpoint's arrays mapped read-only from its file (see :func:`load_checkpoint`).
            rounds: the rounds the resumed run is configured for: a run that finished more is refused before
                anything is changed (None: not checked).

        Raises:
            ConfigError: the newest intact checkpoint is of a round after ``rounds``.
            StateError: the records and the checkpoints disagree (trained rounds recorded but no intact checkpoint,
                or checkpoints newer than the records by more than one round), or checkpoints exist and none is
                intact. The message says which files and what to do.
        """
        trained = [r for r in self.recorded_rounds() if r > 0]
        last = trained[-1] if trained else 0
        state = self.latest_checkpoint(mapped=mapped)
        if state is None:
            if trained:
                raise StateError(
                    f"state.db in {str(self.directory)!r} records {_rounds_text(trained)} but checkpoints/ holds no "
                    "checkpoint: resuming would mix two runs. Restore the checkpoints, or " + self._advice.new_run
                )
            self._count_unrecorded_releases(0)
            return None
        if state.round > last + 1:
            raise StateError(
                f"the newest checkpoint in {str(self.checkpoints)!r} is of round {state.round} but state.db "
                + (f"records only up to round {last}" if trained else "records no trained round")
                + ": they are of different runs (or state.db was replaced). Restore the matching state.db, or "
                + self._advice.new_run
            )
        if rounds is not None and state.round > rounds:
            raise ConfigError(
                f"cannot resume the run in {str(self.directory)!r} with rounds = {rounds}: it has finished "
                f"{state.round} rounds already. Resume with rounds >= {state.round} (rounds = {state.round} trains no "
                f"round and writes its results again), or {self._advice.new_run}"
            )
        if state.round == last + 1:  # stopped between the checkpoint and its round's record: the record is in it
            self._restore_record(state.round)
        if state.round < last:
            superseded = self._supersede_after(state.round)
            log.warning(
                "the newest intact checkpoint is of round %d but state.db recorded %s after it: those records are "
                "marked superseded and the rounds run again",
                state.round,
                _rounds_text(superseded),
            )
            self.export_csv()
        self._count_unrecorded_releases(state.round)
        return state

    def _restore_record(self, rnd: int) -> None:
        """Store round ``rnd``'s record from its checkpoint (the server stopped after writing the checkpoint, before
        the record); a checkpoint without one leaves the round without a history row, with a warning."""
        rows = _checkpoint_record(self.checkpoints / f"round-{rnd:06d}.safetensors")
        if rows is None or rows.get("round") != rnd:
            log.warning(
                "round %d's checkpoint holds no record of the round (written by an earlier fedcore): the run resumes "
                "after it, and the history has no row for round %d",
                rnd,
                rnd,
            )
            return
        try:
            self._store_round(rows)
        except (KeyError, TypeError, ValueError, StateError) as exc:
            raise StateError(
                f"round {rnd}'s checkpoint holds a round record that cannot be stored ({exc!r}); it is damaged: "
                "restore it from a backup, or " + self._advice.new_run
            ) from exc
        log.info("round %d's record restored from its checkpoint (the server stopped before writing it)", rnd)

    # -------------------------------------------------------------- checkpoints
    def save_checkpoint(self, state: ServerState, record: RoundRecord | None = None) -> Path:
        """Write the global model and optimizer state of ``state.round`` atomically, with its digest; keep the
        newest two.

        Args:
            record: the round's record, kept in the checkpoint's header (:data:`RECORD_KEY`) as well, so that a
                server stopped after writing the checkpoint but before :meth:`record_round` loses nothing: the
                restart (:meth:`resume`) stores the record from the checkpoint.

        Raises:
            StateError: the file cannot be written (disk full, file size limit); the previous checkpoints are
                untouched and a restart resumes from them.
        """
        path = self.checkpoints / f"round-{state.round:06d}.safetensors"
        extra = {RUN_KEY: self._run}
        if record is not None:
            extra[RECORD_KEY] = json.dumps(round_rows(record), allow_nan=True)
        try:
            written = _write_state(path, state, self_digest=True, extra=extra)
        except OSError as exc:
            raise StateError(
                f"cannot write the checkpoint {str(path)!r}: {exc}. The previous checkpoints are intact; free disk "
                f"space (or raise the file size limit) and {self._advice.resume}",
                round=state.round,
            ) from exc
        with self._lock, self._sqlite(f"recording the checkpoint of round {state.round}"):
            self._db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?, ?)", (state.round, written.sha256.hex()))
        for old in checkpoint_files(self.directory)[:-_KEEP_CHECKPOINTS]:
            old.unlink(missing_ok=True)
        return path

    def map_initial(self, state: ServerState) -> ServerState:
        """Write a fresh run's initial state to the spill directory and return it mapped read-only from there
        (see :func:`load_checkpoint`), so the server holds it as clean file pages during round 1 as it holds
        each later round's model mapped from its checkpoint. Not a checkpoint: a restart does not resume from it."""
        return _mapped_copy(self.spill / f"initial-r{state.round:06d}.safetensors", state)

    def latest_checkpoint(self, *, mapped: bool = False) -> ServerState | None:
        """The newest intact checkpoint as a :class:`ServerState` (arrays loaded into memory, or mapped: see
        :func:`load_checkpoint`), or None if there is none.

        Intact: its digest matches its bytes, its recorded round matches its name, and it is the checkpoint that
        state.db recorded for that round when it was written (its digest), not one of another run. (A checkpoint
        with no such record yet, as after a crash right after writing it, is taken on its own digest.) A damaged
        newer checkpoint is reported in the log (which file, why) and the previous one is tried.

        Raises:
            StateError: checkpoints exist but none is intact (the message lists each and why).
        """
        found = checkpoint_files(self.directory)[::-1]
        with self._lock, self._sqlite("reading the checkpoint records"):
            recorded = {int(r): str(d) for r, d in self._db.execute("SELECT round, sha256 FROM checkpoints")}
        run = self._run
        damaged: list[str] = []
        for i, path in enumerate(found):
            problem = _checkpoint_problem(path, recorded, run)
            if problem is None:
                try:
                    return load_checkpoint(path, mapped=mapped, verify=False)
                except PayloadError as exc:
                    problem = exc.message
            damaged.append(f"{path.name}: {problem}")
            then = "trying the previous one" if i + 1 < len(found) else "no older checkpoint is left"
            log.warning("checkpoint %s is damaged (%s); %s", path, problem, then)
        if damaged:
            raise StateError(
                f"no intact checkpoint in {str(self.checkpoints)!r} ({'; '.join(damaged)}). Restore one from a "
                "backup, or " + self._advice.new_run
            )
        return None


def checkpoint_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint files of the state directory ``directory`` (``checkpoints/round-NNNNNN.safetensors``), oldest
    round first; empty when there are none (or no such directory)."""
    return sorted((Path(directory) / "checkpoints").glob("round-*.safetensors"))


_RESULT_FILES = ("history.csv", "config.json", "model.safetensors", "history.png")
"""Files that, in a directory without state.db, are results of another run (a simulation's output directory, or a
server's history whose database is gone) that a fresh server would overwrite or mix with its own."""


def _refuse_results_of_another_kind(directory: Path, database: Path) -> None:
    """Refuse, before anything is written, a directory without state.db (nor checkpoints) that holds results of
    another run.

    Raises:
        StateError: names the files found and what to do.
    """
    if database.exists() or not directory.is_dir() or checkpoint_files(directory):
        return  # (checkpoints without state.db are refused later, with a message about them)
    found = [name for name in _RESULT_FILES if (directory / name).exists()]
    if found:
        raise StateError(
            f"{str(directory)!r} is not a server state directory (no state.db) but holds {', '.join(found)}, the "
            "results of another run (a simulation's output directory?), which this server would overwrite; give "
            "--state-dir a new or empty directory, or restore that run's state.db to resume it"
        )


def lock_directory(
    directory: Path, *, in_use: str = SERVER_IN_USE, name: str = "state.lock", what: str = "the state directory"
) -> int:
    """Hold an exclusive lock on ``directory``'s lock file ``name`` (released when the returned descriptor is
    closed, or the process ends), so that two processes never write one directory (a server's state directory, a
    simulation's output directory).

    Args:
        in_use: the end of the refusal, after "is in use " (``{pid}``: the holder's pid, when it wrote one).
        name: the lock file's name in ``directory`` (written with the holder's pid).
        what: the directory in the refusals, before its path (e.g. "the state directory").

    Raises:
        ConfigError: the lock file cannot be opened (e.g. a directory of that name is in the way).
        StateError: another process holds it.
    """
    path = directory / name

    def unusable(doing: str, exc: OSError, must: str = "") -> ConfigError:
        return ConfigError(
            f"cannot use {what} {str(directory)!r}: its lock file {str(path)!r} cannot be {doing} "
            f"({exc.strerror or exc}); move what is in the way{must}, or use another directory"
        )

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)  # a link is not followed
    except OSError as exc:
        raise unusable("opened", exc) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        pid = f" (pid {holder})" if holder.isdigit() else ""
        raise StateError(f"{what} {str(directory)!r} is in use " + in_use.format(pid=pid)) from exc
    try:
        os.ftruncate(fd, 0)  # e.g. EINVAL for a FIFO or a device of that name
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise unusable("written", exc, " (it must be a plain file)") from exc
    return fd


def _checkpoint_problem(path: Path, recorded: Mapping[int, str], run: str) -> str | None:
    """Why the checkpoint ``path`` cannot be trusted, or None if it is intact (``recorded``: round -> the digest
    state.db recorded for its checkpoint; ``run``: the run's identity in state.db, which a checkpoint written by
    this fedcore carries, :data:`RUN_KEY`; held against it once state.db has recorded a checkpoint: a state.db
    replaced by a fresh one is refused by :meth:`StateStore.resume` with its own message)."""
    try:
        named = int(path.stem.removeprefix("round-"))
    except ValueError:
        return "its name is not round-NNNNNN.safetensors"
    try:
        verdict = check_digest(path)
        _, metadata, _ = read_safetensors_header(path)
    except PayloadError as exc:
        return exc.message
    except OSError as exc:
        return str(exc)
    if verdict is None:
        return "it carries no digest (not written by this fedcore's server)"
    if not verdict:
        return "its bytes do not match its recorded SHA-256 (a changed byte)"
    if metadata.get("round") != str(named):
        return f"it records round {metadata.get('round', '')[:20]!r}, not the round {named} in its name"
    if named in recorded and metadata.get(DIGEST_KEY) != recorded[named]:
        return f"it is not the checkpoint state.db recorded for round {named} (another run's?)"
    if recorded and RUN_KEY in metadata and metadata[RUN_KEY] != run:  # (a state.db that recorded none cannot tell)
        return "it was written by another run (its run identity is not the one state.db holds)"
    return None


def _mapped_copy(path: Path, state: ServerState) -> ServerState:
    """``state`` written to ``path``, mapped read-only from it (:func:`load_checkpoint`) and the file unlinked (on
    POSIX the mapping keeps it readable; nothing is left behind). Read back at once, never after a crash: no digest,
    no fsync. ``trainable`` is not stored: the copy has None.

    Raises:
        OSError, PayloadError: the file cannot be written or read back (it is removed all the same).
    """
    try:
        _write_state(path, state, self_digest=False, durable=False)
        return load_checkpoint(path, mapped=True, verify=False)
    finally:
        path.unlink(missing_ok=True)


def _write_state(
    path: Path, state: ServerState, *, self_digest: bool, durable: bool = True, extra: Mapping[str, str] | None = None
) -> PayloadFile:
    arrays: dict[str, np.ndarray] = {_PARAM + n: a for n, a in state.parameters.items()}
    arrays.update({_OPT + n: a for n, a in state.optimizer_state.items()})
    for group, tensors in state.groups.items():
        arrays.update({f"{_GROUP}{group}/{n}": a for n, a in tensors.items()})
    arrays.update({_AGGREGATOR + n: a for n, a in state.aggregator_state.items()})
    metadata = {"round": str(state.round), **(extra or {})}
    return save_payload(path, arrays, metadata, self_digest=self_digest, durable=durable)


RUN_KEY = "fedcore.run"
"""The header metadata key under which a checkpoint keeps the identity of its run (drawn when the run's state.db
was created), so that another run's checkpoint of a round state.db has no digest for yet (the round after the last
one recorded) is not taken for this run's."""

RECORD_KEY = "fedcore.round_record"
"""The header metadata key under which a checkpoint keeps its round's record (:func:`round_rows`, as JSON)."""


def round_rows(record: RoundRecord) -> dict[str, object]:
    """What :meth:`StateStore.record_round` stores of ``record``, as plain JSON values: the round, its seconds,
    attempts and client counts, its history row (:meth:`RoundRecord.as_row`), its failures ``[round, client,
    stage, reason]`` and its selection observations ``[client, examples, loss, seconds]``."""
    return {
        "round": record.round,
        "seconds": record.seconds,
        "attempts": record.attempts,
        "selected": len(record.selected),
        "accepted": len(record.accepted),
        "row": record.as_row(),
        "failures": [[f.round, f.client_id, f.stage.value, f.reason] for f in record.failures],
        "observations": [[o.client_id, o.num_examples, o.loss, o.seconds] for o in record.observations],
    }


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise StateError(f"a stored round record holds {value!r} where a round number belongs")
    return value


def _checkpoint_record(path: Path) -> dict[str, object] | None:
    """The round record a checkpoint keeps (:data:`RECORD_KEY`), or None for a checkpoint without one (written by
    an earlier fedcore) or one whose record cannot be read."""
    try:
        _, metadata, _ = read_safetensors_header(path)
        text = metadata.get(RECORD_KEY)
        rows = json.loads(text) if text is not None else None
    except (PayloadError, OSError, ValueError):
        return None
    return rows if isinstance(rows, dict) else None


MAP_STATE_BYTES = 16 << 20
""":func:`map_round_state` leaves a state smaller than this in memory (counted over the model and every state: a
float32 model of 4M parameters under FedAvg, 2M under FedAvgM, 1.4M under FedAdam): smaller, it is a small part of
what a round holds, and writing 64 MiB took 60-220 ms on this repository's VM (a round of a 20M-parameter model
trains for seconds)."""


MAPPED_STATE_PREFIX = ".round-state-"
"""The names of :func:`map_round_state`'s files begin with this (their temporary files while written, with a dot
before it); unlinked as soon as mapped, so one is left only by a process killed in between."""


def map_round_state(state: ServerState, directory: str | os.PathLike[str]) -> ServerState:
    """``state`` with its arrays (the global model, the server optimizer's state such as FedAvgM's momentum or
    FedAdam's two moments, the tensor groups' and the aggregator's state) written to a file in ``directory`` and
    mapped read-only from it, the file unlinked at once (on POSIX the mapping keeps it readable). Between two
    rounds the state is then clean file pages, not resident anonymous memory, and those who read it drop what they
    read from the resident set as they go: a client's model loaded from the global model block by block
    (:func:`client.runner.load_parameters`, the in-process clients' model cache) and the server step reading the
    old model and optimizer state (:mod:`fedcore.server_opt`). A deployment's server maps its state from each
    checkpoint the same way; a simulation calls this at each round's end. ``state`` itself when its arrays hold
    fewer than :data:`MAP_STATE_BYTES` bytes.

    Measured with a 20M-parameter model (76 MiB, ``bench/simulation_memory.py``): the peak of FedAvgM with the
    default float64 sum fell from 5.01x to 4.01x the model (the global model is not resident while clients
    train), and from 4.32x to 3.30x with the float32 sum (the old momentum is not resident beside the new one in
    the server step).

    A file that cannot be written or read back (disk full, permissions) leaves the state in memory, with a warning
    that says why: the run goes on as it would without this.
    """
    if _state_bytes(state) < MAP_STATE_BYTES:
        return state
    # unique: two runs of one process may map the same round into one directory
    path = Path(directory) / f"{MAPPED_STATE_PREFIX}r{state.round:06d}-{os.getpid()}-{secrets.token_hex(8)}.safetensors"
    try:
        mapped = _mapped_copy(path, state)
    except (OSError, PayloadError) as exc:
        log.warning(
            "round %d: the global model and server state stay in memory (%s could not be written and mapped: %s)",
            state.round,
            path,
            exc,
        )
        return state
    return replace(mapped, trainable=state.trainable)


def resumed_for_model(
    state: ServerState, build_model: Callable[[], torch.nn.Module], *, where: str, advice: str
) -> ServerState:
    """A resumed checkpoint's state, once its tensors are found to be those of the model ``build_model`` builds, with
    that model's trainable names (a property of the model, not kept in a checkpoint). The model is built with the
    global random generators forked, so that building it draws nothing from the run's.

    Args:
        where: the state directory, as the refusal names it.
        advice: what the refusal tells the user to do (after the mismatch).

    Raises:
        ConfigError: the checkpoint holds another model than ``build_model`` builds (round, what differs, advice).
    """
    with torch.random.fork_rng(devices=[]):
        model = build_model()
    expected, trainable = state_spec(model.state_dict()), trainable_names(model)
    del model
    try:
        check_spec(state.parameters, expected)
    except PayloadError as exc:
        raise ConfigError(
            f"the checkpoint in {where!r} (round {state.round}) is of another model than the task builds "
            f"({exc.message}); {advice}"
        ) from None
    return replace(state, trainable=trainable)


def _state_bytes(state: ServerState) -> int:
    """The bytes of ``state``'s arrays: the global model, the server optimizer's, the aggregator's and the tensor
    groups' state."""
    arrays = [state.parameters, state.optimizer_state, state.aggregator_state, *state.groups.values()]
    return sum(num_bytes(tensors) for tensors in arrays)


def continue_from(state: ServerState, checkpoint: str | os.PathLike[str]) -> ServerState:
    """The state to go on from once ``state`` was written to ``checkpoint``: mapped read-only from that file when it
    holds :data:`MAP_STATE_BYTES` or more (clean file pages between rounds, as :func:`map_round_state` gives without
    a checkpoint), else ``state`` itself, whose small arrays clients read faster from memory than from a mapping
    they drop as they read.

    Raises:
        PayloadError: the checkpoint cannot be read back.
    """
    if _state_bytes(state) < MAP_STATE_BYTES:
        return state
    return replace(load_checkpoint(checkpoint, mapped=True, verify=False), trainable=state.trainable)


def load_checkpoint(path: str | os.PathLike[str], *, mapped: bool = False, verify: bool = True) -> ServerState:
    """Read a checkpoint written by :meth:`StateStore.save_checkpoint` (or a plain safetensors model: round 0).

    Args:
        path: the safetensors file.
        mapped: return read-only ``np.memmap`` views of the file instead of copies in memory: its pages are clean
            file pages that the OS can drop and read back, not anonymous memory (the server holds its global
            model this way between rounds). The file must stay in place while the arrays are used (on POSIX an
            unlinked file stays readable through its mapping).
        verify: check the digest the file carries (if it carries one: a plain model has none) before reading it;
            one read of the file.

    Raises:
        PayloadError: missing, truncated or corrupted file (a digest that does not match), or a round that is not
            a number.
    """
    path = Path(path)
    try:
        if verify and check_digest(path) is False:
            raise PayloadError("its bytes do not match its recorded SHA-256 (a changed byte)")
        views, metadata = open_safetensors(path)
    except FileNotFoundError as exc:
        raise PayloadError(f"checkpoint {str(path)!r} does not exist") from exc
    except OSError as exc:
        raise PayloadError(f"checkpoint {str(path)!r} cannot be read: {exc}") from exc
    except PayloadError as exc:
        raise PayloadError(f"checkpoint {str(path)!r} is unreadable: {exc.message}") from exc
    params: NamedArrays = {}
    opt: NamedArrays = {}
    groups: dict[str, NamedArrays] = {}
    aggregator: NamedArrays = {}
    for name, array in views.items():
        value = array if mapped else np.array(array)
        if name.startswith(_PARAM):
            params[name[len(_PARAM) :]] = value
        elif name.startswith(_OPT):
            opt[name[len(_OPT) :]] = value
        elif name.startswith(_GROUP) and "/" in name[len(_GROUP) :]:
            group, _, tensor = name[len(_GROUP) :].partition("/")
            groups.setdefault(group, {})[tensor] = value
        elif name.startswith(_AGGREGATOR):
            aggregator[name[len(_AGGREGATOR) :]] = value
        else:
            params[name] = value
    try:
        rnd = int(metadata.get("round", "0"))
    except ValueError as exc:
        raise PayloadError(f"checkpoint {str(path)!r} has a non-numeric round {metadata.get('round')!r}") from exc
    return ServerState(round=rnd, parameters=params, optimizer_state=opt, groups=groups, aggregator_state=aggregator)
