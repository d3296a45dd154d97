"""Simulated devices: how fast each virtual client trains and when it is online.

Speeds. A share ``slow_fraction`` of the clients (drawn from the seed) is ``slowdown`` times slower. A fit's
simulated duration is ``factor * step_seconds * local_epochs * ceil(num_examples / batch_size)`` (one unit of
``step_seconds`` per local mini-batch step on a normal device; communication is not modelled). It travels with
the reply as the metric ``simulated_seconds`` (:class:`SimulatedDevices`), where the client selection reads it as
the client's duration (:data:`fedcore.selection.DURATION_METRICS`) and the round loop takes a synchronous round's
duration as its slowest accepted client's (the history column ``simulated_seconds``). Nothing sleeps: the
durations are numbers, the same for the same seed, so time-to-accuracy can be compared between policies.

Availability (:func:`availability_trace`): ``always``; ``diurnal``, each client online for a share
``online_fraction`` of every ``period`` rounds, with a phase of its own drawn from the seed (clients spread over
time zones); or ``csv``, a file of ``client,from_round,to_round`` rows giving the rounds (inclusive) in which a
client is online (a client listed nowhere is always online). The trace goes to the client selection
(:class:`fedcore.selection.Selector`), which never makes an offline client a candidate.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from fedcore.config import check_regular_file
from fedcore.errors import ConfigError
from fedcore.messages import FitBatchRes, FitIns, FitRes, PoolReply, ServerMessage
from fedcore.seeding import numpy_rng
from fedcore.selection import SIZE_ATTRIBUTE, Availability, Selector, size_buckets
from server.pool import ClientPool, PoolWrapper

AVAILABILITY_NAMES = ("always", "diurnal", "csv")


@dataclass(frozen=True, kw_only=True)
class DevicesConfig:
    """The ``[devices]`` table of a recipe: simulated device speeds and availability.

    Attributes:
        simulate_time: give every fit a simulated duration and every round the history column
            ``simulated_seconds`` (on by itself when ``slow_fraction > 0``).
        slow_fraction: the share of clients that are slow, in [0, 1] (drawn from the seed).
        slowdown: how many times slower a slow client is, >= 1.
        step_seconds: simulated seconds of one local mini-batch step on a normal device, > 0.
        availability: ``always``, ``diurnal`` (each client online ``online_fraction`` of every ``period`` rounds,
            at a phase of its own) or ``csv`` (the rounds listed in ``availability_file``).
        online_fraction: ``diurnal``: the share of each period a client is online, in (0, 1].
        period: ``diurnal``: the length of a day in rounds, >= 1.
        availability_file: ``csv``: a file with the header ``client,from_round,to_round`` and one row per online
            interval (rounds inclusive); a client with no row is always online.
    """

    simulate_time: bool = False
    slow_fraction: float = 0.0
    slowdown: float = 1.0
    step_seconds: float = 0.01
    availability: Literal["always", "diurnal", "csv"] = "always"
    online_fraction: float = 0.5
    period: int = 24
    availability_file: Path | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.slow_fraction <= 1:
            raise ConfigError(f"devices.slow_fraction must be in [0, 1], got {self.slow_fraction}")
        if not 1 <= self.slowdown < math.inf:
            raise ConfigError(f"devices.slowdown must be a number >= 1, got {self.slowdown}")
        if not 0 < self.step_seconds < math.inf:
            raise ConfigError(f"devices.step_seconds must be > 0 seconds, got {self.step_seconds}")
        if self.availability not in AVAILABILITY_NAMES:
            raise ConfigError(
                f"unknown devices.availability {self.availability!r}; choose one of {', '.join(AVAILABILITY_NAMES)}"
            )
        if not 0 < self.online_fraction <= 1:
            raise ConfigError(f"devices.online_fraction must be in (0, 1], got {self.online_fraction}")
        if self.period < 1:
            raise ConfigError(f"devices.period must be >= 1 round, got {self.period}")
        if (self.availability == "csv") != (self.availability_file is not None):
            raise ConfigError("devices.availability = 'csv' needs devices.availability_file, and only it uses one")

    @property
    def timed(self) -> bool:
        """Whether fits get a simulated duration: with ``simulate_time``, or slow clients."""
        return self.simulate_time or self.slow_fraction > 0


def slow_clients(client_ids: Sequence[str], fraction: float, *, seed: int) -> frozenset[str]:
    """The ``round(fraction * N)`` slow clients: the first of a permutation of the sorted ids keyed by the seed."""
    ids = sorted(client_ids)
    count = round(fraction * len(ids))
    order = numpy_rng(seed, "devices", "slow").permutation(len(ids))
    return frozenset(ids[int(i)] for i in order[:count])


def fit_seconds(
    factor: float,
    step_seconds: float,
    local_epochs: int,
    batch_size: int,
    num_examples: int,
    max_steps: int | None = None,
) -> float:
    """A fit's simulated duration: ``factor * step_seconds * steps``, the steps training takes:
    ``local_epochs * ceil(num_examples / batch_size)``, at most ``max_steps`` (:class:`~fedcore.task.FitConfig`'s
    cap, where training stops) when given."""
    steps = local_epochs * math.ceil(num_examples / batch_size)
    return factor * step_seconds * (steps if max_steps is None else min(steps, max_steps))


def diurnal_phases(client_ids: Sequence[str], *, seed: int) -> dict[str, float]:
    """Each client's phase in [0, 1) for the diurnal trace, drawn in the order of the sorted ids."""
    ids = sorted(client_ids)
    phases = numpy_rng(seed, "devices", "diurnal").random(len(ids))
    return {cid: float(p) for cid, p in zip(ids, phases, strict=True)}


def diurnal(phases: Mapping[str, float], *, online_fraction: float, period: int) -> Availability:
    """A diurnal trace: client c is online in round r when ``frac(r / period + phase_c) < online_fraction`` (so
    online in ``online_fraction * period`` consecutive rounds of every ``period``, up to rounding); a client
    without a phase is always online."""

    def online(client_id: str, round: int) -> bool:
        phase = phases.get(client_id)
        return phase is None or (round / period + phase) % 1.0 < online_fraction

    return online


def read_trace(path: Path, client_ids: Sequence[str] | None = None) -> Availability:
    """The availability trace of a CSV file with the header ``client,from_round,to_round`` (see the module).

    Args:
        path: the CSV file.
        client_ids: the run's client ids; when given, the file must name at least one of them (a trace of other
            ids, e.g. ``0,1,2`` for ``client-000, ...``, or of no rows would leave every client always online), and
            rows naming none of them are ignored with a warning.

    Raises:
        ConfigError: the file cannot be read or is not UTF-8, lacks the header, a row is not ``id,int,int`` with
            1 <= from_round <= to_round (the message names the line), or it names none of ``client_ids``.
    """
    intervals = read_intervals(path, client_ids)

    def online(client_id: str, round: int) -> bool:
        spans = intervals.get(client_id)
        return spans is None or any(start <= round <= end for start, end in spans)

    return online


def read_intervals(
    path: Path, client_ids: Sequence[str] | None = None, *, warn: bool = True
) -> Mapping[str, list[tuple[int, int]]]:
    """The online intervals ``client -> [(from_round, to_round), ...]`` of a CSV trace, checked as
    :func:`read_trace` says (``warn``: log the rows naming no client of ``client_ids``; a second reader of the
    same file passes False)."""
    try:
        check_regular_file(path, "devices.availability_file", "a CSV file")
        stat = path.stat()
    except OSError as exc:
        raise ConfigError(f"cannot read availability_file {str(path)!r}: {exc.strerror or exc}") from None
    # parsed once for the start check and the selection alike (a trace of millions of rows takes seconds)
    intervals = _parsed_trace(str(path), stat.st_mtime_ns, stat.st_size)
    if client_ids is not None and not intervals.keys() & set(client_ids):
        listed = ", ".join(repr(cid) for cid in sorted(intervals)[:3]) or "no client"
        raise ConfigError(
            f"availability_file {str(path)!r} names none of the run's clients (it lists {listed}), so every client "
            f"would be always online; its client column must hold the virtual clients' ids "
            f"({client_ids[0]!r}..{client_ids[-1]!r}), or use availability = 'always'"
        )
    if warn and client_ids is not None and (unknown := sorted(intervals.keys() - set(client_ids))):
        logging.getLogger("fedcore.simulation").warning(
            "availability_file %r names %d id(s) that are no client of this run (%s%s): their rows are ignored; "
            "the run's clients are %r..%r, and a client listed nowhere is always online",
            str(path),
            len(unknown),
            ", ".join(repr(cid) for cid in unknown[:3]),
            ", ..." if len(unknown) > 3 else "",
            client_ids[0],
            client_ids[-1],
        )
    return intervals


@functools.lru_cache(maxsize=4)
def _parsed_trace(path_text: str, mtime_ns: int, size: int) -> dict[str, list[tuple[int, int]]]:
    """The intervals of the CSV trace at ``path_text``, cached by its modification time and size (see
    :func:`read_intervals`; callers only read the result).

    Raises:
        ConfigError: as :func:`read_trace`, but for naming none of the run's clients.
    """
    intervals: dict[str, list[tuple[int, int]]] = {}
    path = Path(path_text)
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:  # a byte-order mark (spreadsheet export) is skipped
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None or [h.strip() for h in header] != ["client", "from_round", "to_round"]:
                raise ConfigError(
                    f"availability_file {str(path)!r} must start with the header client,from_round,to_round"
                )
            for line, row in enumerate(reader, start=2):
                if not any(cell.strip() for cell in row):
                    continue  # a blank line (one at the end of the file, as editors leave)
                try:
                    if len(row) != 3 or not (row[1].strip().isascii() and row[2].strip().isascii()):
                        raise ValueError(row)
                    cid, start, end = row[0].strip(), int(row[1]), int(row[2])
                except (IndexError, ValueError):
                    raise ConfigError(
                        f"availability_file {str(path)!r} line {line}: expected client,from_round,to_round (three "
                        f"columns, the rounds as integers), got {','.join(row)[:80]!r}"
                    ) from None
                if not cid or not 1 <= start <= end:
                    raise ConfigError(
                        f"availability_file {str(path)!r} line {line}: need a client id and 1 <= from_round <= to_round"
                    )
                intervals.setdefault(cid, []).append((start, end))
    except OSError as exc:
        raise ConfigError(f"cannot read availability_file {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:  # a binary or UTF-16 file given by mistake
        raise ConfigError(
            f"availability_file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); it must be a CSV "
            "file with the header client,from_round,to_round"
        ) from None
    return intervals


ONLINE_COUNT_BUDGET = 50_000_000
"""The most (client, round) pairs :func:`online_counts` evaluates for a diurnal trace (about a second); a larger run
is not counted ahead, and its rounds say when too few clients are online."""


def online_counts(config: DevicesConfig, client_ids: Sequence[str], *, seed: int, rounds: int) -> np.ndarray | None:
    """How many of ``client_ids`` the trace of ``config`` has online in each round, computed as the selection
    computes it (int64, shape ``(rounds,)``, entry ``r - 1`` for round ``r``); None with no trace (``always``), or a
    diurnal one of more than :data:`ONLINE_COUNT_BUDGET` (client, round) pairs.

    Raises:
        ConfigError: as :func:`availability_trace`.
    """
    ids = list(client_ids)
    if config.availability == "diurnal":
        if len(ids) * rounds > ONLINE_COUNT_BUDGET:
            return None
        # diurnal()'s formula over all clients at once (the same float64 operations: its per-client closure stays
        # plain Python, as the selection calls it for every client every round); a test holds the two equal
        phases = np.fromiter(diurnal_phases(ids, seed=seed).values(), dtype=np.float64, count=len(ids))
        return np.array(
            [
                np.count_nonzero((r / config.period + phases) % 1.0 < config.online_fraction)
                for r in range(1, rounds + 1)
            ],
            dtype=np.int64,
        )
    if config.availability == "csv" and config.availability_file is not None:
        intervals = read_intervals(config.availability_file, ids, warn=False)  # the selection's reading warns
        listed = [cid for cid in ids if cid in intervals]
        change = np.zeros(rounds + 2, dtype=np.int64)  # +1 where a client comes online, -1 after it leaves
        for cid in listed:
            last = 0  # the union of the client's intervals, within rounds 1..rounds
            for start, end in sorted(intervals[cid]):
                start, end = max(start, last + 1), min(end, rounds)
                if start <= end:
                    change[start] += 1
                    change[end + 1] -= 1
                    last = end
        return (len(ids) - len(listed)) + np.cumsum(change)[1 : rounds + 1]
    return None


def availability_trace(config: DevicesConfig, client_ids: Sequence[str], *, seed: int) -> Availability | None:
    """The trace ``config`` describes for ``client_ids`` (None: ``always``).

    Raises:
        ConfigError: an unreadable or malformed CSV trace, or one that names none of ``client_ids``.
    """
    if config.availability == "diurnal":
        if config.online_fraction * config.period < 1:
            logging.getLogger("fedcore.simulation").warning(
                "a diurnal trace with online_fraction %g of a period of %d rounds has each client online %g rounds "
                "a period, less than one: some clients are never online and the others once a period; raise "
                "--period to at least %d or --online-fraction",
                config.online_fraction,
                config.period,
                config.online_fraction * config.period,
                math.ceil(1 / config.online_fraction - 1e-9),
            )
        phases = diurnal_phases(client_ids, seed=seed)
        return diurnal(phases, online_fraction=config.online_fraction, period=config.period)
    if config.availability == "csv" and config.availability_file is not None:
        return read_trace(config.availability_file, client_ids)
    return None


def simulation_selector(
    selection: Selector,
    devices: DevicesConfig,
    client_ids: Sequence[str],
    *,
    seed: int,
    sizes: Callable[[], Mapping[str, int]],
) -> Selector:
    """The client selection of a simulation: ``selection``'s policy and parameters, with the availability trace of
    ``devices`` and, for stratified selection by ``size``, each client's dataset-size bucket from ``sizes()``
    (client id -> training examples; called only then)."""
    attributes: dict[str, dict[str, str]] = {}
    if selection.policy == "stratified" and selection.config.stratify_by == SIZE_ATTRIBUTE:
        buckets = size_buckets(sizes(), selection.config.size_buckets)
        attributes = {cid: {SIZE_ATTRIBUTE: label} for cid, label in buckets.items()}
    return Selector(
        selection.policy,
        selection.config,
        attributes=attributes,
        availability=availability_trace(devices, client_ids, seed=seed),
    )


class SimulatedDevices(PoolWrapper):
    """A :class:`~server.pool.ClientPool` whose fit replies carry their simulated duration, the metric
    ``simulated_seconds`` (:func:`fit_seconds` with the client's speed factor and its instruction's settings).

    Args:
        pool: the pool of virtual clients.
        slow: the slow clients.
        config: speeds (``slowdown``, ``step_seconds``).
    """

    def __init__(self, pool: ClientPool, slow: frozenset[str], config: DevicesConfig) -> None:
        super().__init__(pool)
        self._slow = slow
        self._config = config

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[PoolReply]:
        """The wrapped pool's replies, each fit result (those of a batch too) with its ``simulated_seconds``."""
        for reply in self._pool.run(instructions, timeout_s=timeout_s):
            if isinstance(reply, FitBatchRes):
                reply = self._timed_batch(reply, instructions)
            elif isinstance(reply, FitRes):
                reply = self._timed(reply, instructions)
            yield reply
            del reply  # not kept while the next client trains (a model-sized update)

    def _timed_batch(self, batch: FitBatchRes, instructions: Mapping[str, ServerMessage]) -> FitBatchRes:
        """:meth:`_timed` for each client of a batch, as a ``simulated_seconds`` column; NaN for a client that was
        not sent a fit instruction (not reported)."""
        seconds = np.full(len(batch.client_ids), np.nan)
        for position, (cid, n) in enumerate(zip(batch.client_ids, batch.num_examples.tolist(), strict=True)):
            if (duration := self._duration(cid, n, instructions)) is not None:
                seconds[position] = duration
        return dataclasses.replace(batch, metrics={**batch.metrics, "simulated_seconds": seconds})

    def _duration(self, client_id: str, num_examples: int, instructions: Mapping[str, ServerMessage]) -> float | None:
        """The simulated duration of ``client_id``'s fit (:func:`fit_seconds`), None when it was not sent one."""
        instruction = instructions.get(client_id)
        if not isinstance(instruction, FitIns):
            return None
        factor = self._config.slowdown if client_id in self._slow else 1.0
        return fit_seconds(
            factor,
            self._config.step_seconds,
            instruction.config.local_epochs,
            instruction.config.batch_size,
            num_examples,
            instruction.config.max_steps,
        )

    def _timed(self, reply: FitRes, instructions: Mapping[str, ServerMessage]) -> FitRes:
        seconds = self._duration(reply.client_id, int(reply.num_examples), instructions)
        if seconds is None:
            return reply
        return dataclasses.replace(reply, metrics={**reply.metrics, "simulated_seconds": seconds})
