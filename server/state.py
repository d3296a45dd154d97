"""The server's state directory: SQLite (stdlib) for clients, rounds and metrics; safetensors checkpoints.

Layout of a state directory::

    state.db                        clients, rounds, round_metrics, failures
    checkpoints/round-000003.safetensors
                                    global model ("param/<name>") and server optimizer state ("opt/<name>")
    history.csv                     one row per round (the same as the rounds table)
    spill/                          payload files in flight (emptied at start)

A checkpoint is written to a temporary file, fsynced and renamed, so a crash leaves the previous checkpoint or
the new one, never a torn file; the newest two are kept. Restarting on the same directory resumes at the round
after the newest checkpoint.
"""

from __future__ import annotations

import csv
import logging
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np

from fedcore.errors import ConfigError, PayloadError
from fedcore.tensors import NamedArrays
from fedcore.wire import open_safetensors, save_payload
from server.round_loop import RoundRecord, ServerState

log = logging.getLogger("fedcore.server")

_PARAM = "param/"
_OPT = "opt/"
_KEEP_CHECKPOINTS = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS clients (
    client_id TEXT PRIMARY KEY, first_seen REAL NOT NULL, last_seen REAL NOT NULL, joins INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER PRIMARY KEY, finished_at REAL NOT NULL, seconds REAL, attempts INTEGER,
    selected INTEGER, accepted INTEGER, failures INTEGER
);
CREATE TABLE IF NOT EXISTS round_metrics (
    round INTEGER NOT NULL, key TEXT NOT NULL, value REAL, PRIMARY KEY (round, key)
);
CREATE TABLE IF NOT EXISTS failures (
    round INTEGER NOT NULL, client_id TEXT NOT NULL, stage TEXT NOT NULL, reason TEXT NOT NULL
);
"""


class StateStore:
    """The state directory of one run. Thread-safe (one connection behind a lock).

    Args:
        directory: created if missing.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.checkpoints = self.directory / "checkpoints"
        self.spill = self.directory / "spill"
        try:
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            if self.spill.exists():
                shutil.rmtree(self.spill)  # payloads of an interrupted run are never reused
            self.spill.mkdir()
        except OSError as exc:
            raise ConfigError(f"cannot use {str(self.directory)!r} as the state directory: {exc}") from exc
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.directory / "state.db", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()

    # ----------------------------------------------------------------- registry
    def record_join(self, client_id: str) -> None:
        """Note that ``client_id`` joined now."""
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT INTO clients VALUES (?, ?, ?, 1) ON CONFLICT(client_id) "
                "DO UPDATE SET last_seen = excluded.last_seen, joins = joins + 1",
                (client_id, now, now),
            )

    def clients(self) -> list[tuple[str, int]]:
        """``(client id, number of joins)`` of every client ever seen."""
        with self._lock:
            return [(str(c), int(n)) for c, n in self._db.execute("SELECT client_id, joins FROM clients ORDER BY 1")]

    # ------------------------------------------------------------------- rounds
    def record_round(self, record: RoundRecord) -> None:
        """Store one round's record (metrics and failures) and append it to history.csv."""
        row = record.as_row()
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO rounds VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    record.round,
                    time.time(),
                    record.seconds,
                    record.attempts,
                    len(record.selected),
                    len(record.accepted),
                    len(record.failures),
                ),
            )
            self._db.execute("DELETE FROM round_metrics WHERE round = ?", (record.round,))
            self._db.executemany(
                "INSERT INTO round_metrics VALUES (?, ?, ?)",
                [(record.round, k, None if v is None else float(v)) for k, v in row.items() if k != "round"],
            )
            self._db.execute("DELETE FROM failures WHERE round = ?", (record.round,))
            self._db.executemany(
                "INSERT INTO failures VALUES (?, ?, ?, ?)",
                [(f.round, f.client_id, f.stage.value, f.reason) for f in record.failures],
            )
        self.export_csv(self.directory / "history.csv")

    def history(self) -> list[dict[str, float | int | None]]:
        """One dict per stored round, ``round`` first, then its metrics."""
        with self._lock:
            rounds = [int(r) for (r,) in self._db.execute("SELECT round FROM rounds ORDER BY round")]
            rows = []
            for rnd in rounds:
                row: dict[str, float | int | None] = {"round": rnd}
                for key, value in self._db.execute("SELECT key, value FROM round_metrics WHERE round = ?", (rnd,)):
                    row[str(key)] = value
                rows.append(row)
        return rows

    def export_csv(self, path: Path) -> Path:
        """Write the round history as CSV (atomically) and return its path."""
        rows = self.history()
        keys: list[str] = []
        for row in rows:
            keys.extend(k for k in row if k not in keys)
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(path)
        return path

    # -------------------------------------------------------------- checkpoints
    def save_checkpoint(self, state: ServerState) -> Path:
        """Write the global model and optimizer state of ``state.round`` atomically; keep the newest two."""
        path = self.checkpoints / f"round-{state.round:06d}.safetensors"
        _write_state(path, state)
        for old in sorted(self.checkpoints.glob("round-*.safetensors"))[:-_KEEP_CHECKPOINTS]:
            old.unlink(missing_ok=True)
        return path

    def map_initial(self, state: ServerState) -> ServerState:
        """Write a fresh run's initial state to the spill directory and return it mapped read-only from there
        (see :func:`load_checkpoint`), so the server holds it as clean file pages during round 1 as it holds
        each later round's model mapped from its checkpoint. Not a checkpoint: a restart does not resume from it."""
        path = self.spill / f"initial-r{state.round:06d}.safetensors"
        _write_state(path, state)
        mapped = load_checkpoint(path, mapped=True)
        path.unlink()  # the mapping keeps the data readable (POSIX); nothing is left behind in spill/
        return mapped

    def latest_checkpoint(self, *, mapped: bool = False) -> ServerState | None:
        """The newest checkpoint as a :class:`ServerState` (arrays loaded into memory, or mapped: see
        :func:`load_checkpoint`), or None.

        Raises:
            PayloadError: the newest checkpoint is unreadable (the message names the file).
        """
        found = sorted(self.checkpoints.glob("round-*.safetensors"))
        if not found:
            return None
        return load_checkpoint(found[-1], mapped=mapped)


def _write_state(path: Path, state: ServerState) -> None:
    arrays: dict[str, np.ndarray] = {_PARAM + n: a for n, a in state.parameters.items()}
    arrays.update({_OPT + n: a for n, a in state.optimizer_state.items()})
    save_payload(path, arrays, {"round": str(state.round)})


def load_checkpoint(path: Path, *, mapped: bool = False) -> ServerState:
    """Read a checkpoint written by :meth:`StateStore.save_checkpoint` (or a plain safetensors model: round 0).

    Args:
        path: the safetensors file.
        mapped: return read-only ``np.memmap`` views of the file instead of copies in memory: its pages are clean
            file pages that the OS can drop and read back, not anonymous memory (the server holds its global
            model this way between rounds). The file must stay in place while the arrays are used (on POSIX an
            unlinked file stays readable through its mapping).

    Raises:
        PayloadError: truncated or corrupted file, or a round that is not a number.
    """
    try:
        views, metadata = open_safetensors(path)
    except FileNotFoundError as exc:
        raise PayloadError(f"checkpoint {str(path)!r} does not exist") from exc
    except PayloadError as exc:
        raise PayloadError(f"checkpoint {str(path)!r} is unreadable: {exc.message}") from exc
    params: NamedArrays = {}
    opt: NamedArrays = {}
    for name, array in views.items():
        value = array if mapped else np.array(array)
        if name.startswith(_PARAM):
            params[name[len(_PARAM) :]] = value
        elif name.startswith(_OPT):
            opt[name[len(_OPT) :]] = value
        else:
            params[name] = value
    try:
        rnd = int(metadata.get("round", "0"))
    except ValueError as exc:
        raise PayloadError(f"checkpoint {str(path)!r} has a non-numeric round {metadata.get('round')!r}") from exc
    return ServerState(round=rnd, parameters=params, optimizer_state=opt)
