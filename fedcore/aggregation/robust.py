"""Robust aggregation: coordinate-wise median and trimmed mean, Krum and Multi-Krum, norm bounding.

Each rule says how many Byzantine clients (clients that send arbitrary updates) of the ``n`` whose updates it
aggregates it tolerates, and its aggregator's ``check(n)`` refuses a round it cannot honour with a ConfigError
before any client is contacted; ``result()`` refuses in the same way (AggregationError) when fewer updates than
that arrived.

Median, trimmed mean and Krum must see every update whole before they can answer. They keep the updates as
read-only file mappings (:class:`SpilledUpdates`): an update that arrives mapped from its spill file
(``np.memmap`` with mode ``"r"``, as the gRPC server hands them over) is kept as it is; one in memory (simulation)
is written to a temporary safetensors file (:func:`fedcore.payload.save_payload`, not fsynced) and mapped. The
rule then reads all updates block by block, a block of every client at a time, and unmaps each block's pages
once read, so memory stays O(model + clients x block), never O(clients x model): the files, not the process,
hold the updates. Norm bounding needs only one update at a time and is a streaming weighted mean.

These rules ignore the clients' weights (example counts), except that an update of weight 0 (a client that
trained on nothing) takes no part: a Byzantine client chooses its reported weight too, so a rule that trusted it
would not be robust. The exceptions are norm bounding (a weighted mean of clipped updates, Sun et al. 2019) and
Multi-Krum's final average over the selected updates (weighted, as flwr's ``aggregate_krum``; with the strategy's
``weighting = "uniform"`` it is Blanchard et al.'s plain average).

The kept updates are taken in the order of their client ids (then arrival), so the result does not depend on the
order in which replies arrived: simulation and deployment give the same model bit for bit.
"""

from __future__ import annotations

import logging
import math
import mmap
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from fedcore.aggregation.blocks import (
    MAX_THREADS,
    Block,
    blocks_of,
    check_finite_blocks,
    check_spec_kinds,
    check_threads,
    check_weight,
    drop_mapped,
    drop_read,
    file_mapping,
    run_blocks,
)
from fedcore.aggregation.streaming import WeightedMean
from fedcore.errors import AggregationError, ConfigError
from fedcore.kernels import FUSED_DTYPES, squared_distance, trimmed_mean_columns
from fedcore.payload import read_safetensors_header, save_payload
from fedcore.tensors import NamedArrays, TensorSpec, check_finite, check_spec

log = logging.getLogger("fedcore.aggregation")

_GATHER_BYTES = 8 << 20
"""Bytes of the float64 buffer (clients x block) each thread gathers one block of every update into; a block has
``_GATHER_BYTES / (8 * clients)`` elements (at least :data:`_MIN_BLOCK`, at most :data:`_MAX_BLOCK`)."""

_MIN_BLOCK = 1024
_MAX_BLOCK = 1 << 18


def _block_elements(clients: int) -> int:
    return max(_MIN_BLOCK, min(_MAX_BLOCK, _GATHER_BYTES // (8 * max(clients, 1))))


@dataclass(frozen=True, eq=False)
class KeptUpdate:
    """One kept update: its client, arrival number, weight, tensors (read-only file mappings in the spec's shapes),
    their flat views, and the mapping behind each non-empty tensor."""

    client: str
    arrival: int
    weight: float
    arrays: dict[str, np.ndarray]
    flat: dict[str, np.ndarray]
    handles: dict[str, mmap.mmap]


def _refuse_small_rounds(check: Callable[[int], None], smallest: int) -> None:
    """``check(smallest)``, its refusal saying that a round may be that small (a server's min_fit_clients)."""
    try:
        check(smallest)
    except ConfigError as exc:
        raise ConfigError(
            f"{exc.message.rstrip('.')} (a round may select as few as {smallest} clients: min_fit_clients, "
            "--min-fit-clients)"
        ) from None


def _check_byzantine(byzantine: int) -> None:
    if isinstance(byzantine, bool) or not isinstance(byzantine, int) or byzantine < 0:
        raise ConfigError(
            f"byzantine (the number of Byzantine clients to tolerate) must be an integer >= 0, got {byzantine!r}"
        )


class SpilledUpdates:
    """Whole client updates kept as read-only file mappings, for rules that read every update block by block.

    Args:
        spec: names, shapes and dtypes every update must match (checked like :class:`WeightedMean` does).
        threads: threads for the validation pass (None: the CPUs this process may run on, at most 8).
        spill_dir: where the temporary directory for in-memory updates is made (None: the system's temp dir).

    An added update is validated completely first (weight, spec, finiteness); a rejected one leaves nothing
    behind. A kept update costs no resident memory: an update mapped read-only from a file is kept as is (its
    pages are unmapped after validation), an in-memory one is written to ``<temporary dir>/update-<k>.safetensors``,
    mapped as one read-only mapping and unlinked at once (the mapping keeps its data until :meth:`close`). Each kept
    update holds one open file (a mapped update from elsewhere: one per tensor, as Python's mmap keeps a duplicate
    descriptor), so the process's open-file limit bounds how many updates one round can keep.

    Raises:
        ConfigError: the spec is empty, has duplicate names or a non-numeric dtype, or ``threads`` < 1.
    """

    def __init__(self, spec: Sequence[TensorSpec], *, threads: int | None = None, spill_dir: str | None = None) -> None:
        self.spec = check_spec_kinds(spec, "a robust aggregator")
        self._threads = min(check_threads(threads), MAX_THREADS)
        self._sizes = {s.name: math.prod(s.shape) for s in self.spec}
        floating = {s.name for s in self.spec if np.dtype(s.dtype).kind == "f"}
        self._float_blocks = [b for b in blocks_of(self._sizes, _MAX_BLOCK) if b[0] in floating]
        self._spill_dir = spill_dir
        self._directory: Path | None = None
        self._cleanup: weakref.finalize | None = None
        self._kept: list[KeptUpdate] = []
        self.count = 0
        self.total_weight = 0.0
        self._closed = False

    @property
    def threads(self) -> int:
        """Threads the passes over the updates run on."""
        return self._threads

    def add(
        self, update: Mapping[str, np.ndarray], weight: float, *, client_id: str | None = None, round: int | None = None
    ) -> None:
        """Validate one client's update, then keep it (mapped) unless its weight is 0.

        Raises:
            UpdateRejected: the weight is negative, NaN or infinite.
            PayloadError: names, shapes or dtypes differ from the spec.
            NonFiniteError: a floating tensor holds NaN or Inf.
            AggregationError: the in-memory update could not be written to the spill directory (disk full).
        """
        self._check_open()
        w = check_weight(weight, self.total_weight, client_id=client_id, round=round)
        check_spec(update, self.spec, round=round, client_id=client_id)
        flat = {name: np.ascontiguousarray(update[name]).reshape(-1) for name in self._sizes}
        mapped = {name: m for name in self._sizes if (m := file_mapping(update[name], flat[name])) is not None}
        check_finite_blocks(flat, self._float_blocks, self._threads, round=round, client_id=client_id, mapped=mapped)
        for name, handle in mapped.items():  # what fault-around mapped past the blocks read, too
            drop_mapped(handle, flat[name], 0, flat[name].size)
        self.count += 1
        self.total_weight += w
        if w == 0.0:
            return
        if len(mapped) == sum(1 for size in self._sizes.values() if size > 0):
            arrays = {s.name: update[s.name] for s in self.spec}
        else:
            arrays = self._spill(flat, round=round, client_id=client_id)
            flat = {name: np.asarray(array).reshape(-1) for name, array in arrays.items()}
            mapped = {name: m for name in flat if (m := file_mapping(arrays[name], flat[name])) is not None}
        client = client_id if client_id is not None else f"#{self.count}"
        self._kept.append(KeptUpdate(client, self.count, w, arrays, flat, mapped))

    def kept(self) -> list[KeptUpdate]:
        """The kept updates, ordered by client id (then arrival), so the order does not depend on when replies
        arrived."""
        return sorted(self._kept, key=lambda kept: (kept.client, kept.arrival))

    def blocks(self) -> list[Block]:
        """Work items over the spec's tensors sized for the kept updates (see :data:`_GATHER_BYTES`)."""
        return blocks_of(self._sizes, _block_elements(len(self._kept)))

    @staticmethod
    def gather(rows: Sequence[KeptUpdate], block: Block, out: np.ndarray) -> np.ndarray:
        """Copy ``block`` of every update in ``rows`` into the flat float64 buffer ``out`` (at least ``len(rows)``
        x block elements) and unmap the pages read; returns the filled C-contiguous ``len(rows) x (end - start)``
        view.

        A page fault maps a whole window around it (fault-around, large page-cache folios: up to a huge page before
        and hundreds of KiB past the block), and the next block's fault maps the next window: unmapping only the
        block would leave a growing residue per update. Everything from a huge page before the block to the end of
        the tensor is unmapped instead (what the next block needs comes back from the page cache)."""
        name, i, j = block
        values = out[: len(rows) * (j - i)].reshape(len(rows), j - i)
        for row, kept in enumerate(rows):
            source = kept.flat[name]
            values[row] = source[i:j]
            if name in kept.handles:
                drop_read(kept.handles[name], source, i, j)
        return values

    @staticmethod
    def copy(kept: KeptUpdate) -> NamedArrays:
        """A copy of a kept update in memory, its mappings' pages unmapped after reading."""
        out = {}
        for name, array in kept.arrays.items():
            out[name] = np.array(array)
            if name in kept.handles:
                drop_mapped(kept.handles[name], kept.flat[name], 0, kept.flat[name].size)
        return out

    def close(self) -> None:
        """Drop every kept update and remove the temporary directory (idempotent)."""
        self._closed = True
        self._kept = []
        if self._cleanup is not None:
            self._cleanup()

    def _check_open(self) -> None:
        if self._closed:
            raise AggregationError("this accumulator's result was taken with release=True; start a new one")

    def _spill(
        self, flat: Mapping[str, np.ndarray], *, round: int | None, client_id: str | None
    ) -> dict[str, np.ndarray]:
        if self._directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="fedcore-robust-", dir=self._spill_dir))
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._directory, ignore_errors=True)
        path = self._directory / f"update-{self.count}.safetensors"
        try:
            save_payload(path, {s.name: flat[s.name].reshape(s.shape) for s in self.spec}, durable=False, digest=False)
            return _map_file(path, self.spec)
        except OSError as exc:
            raise AggregationError(
                f"cannot spill the update to {str(self._directory)!r} ({exc.strerror or exc}); free disk space there "
                "or point spill_dir elsewhere",
                round=round,
                client_id=client_id,
                stage="aggregate",
            ) from exc
        finally:
            path.unlink(missing_ok=True)  # the mapping keeps the data readable until it is dropped


def _map_file(path: Path, spec: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """Read-only views (``np.memmap``) of the tensors of the safetensors file ``path`` in the spec's shapes, all in
    one mapping (one descriptor)."""
    entries, _, body = read_safetensors_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    views: dict[str, np.ndarray] = {}
    for s in spec:
        e = entries[s.name]
        if e.end == e.start:
            views[s.name] = np.zeros(s.shape, dtype=e.dtype)
        else:
            views[s.name] = raw[body + e.start : body + e.end].view(e.dtype).reshape(s.shape)
    return views


class _KeepsWholeUpdates:
    """An accumulator that keeps every update whole in a :class:`SpilledUpdates` until its result is taken, and
    counts the clients whose updates the round loop refused
    (:class:`~fedcore.aggregation.protocol.CountsRejections`)."""

    _updates: SpilledUpdates
    _byzantine: int
    _refused: set[str]

    def rejected(self, client_id: str) -> None:
        """Record that ``client_id``'s update was refused: one of the ``f`` faulty clients the rule tolerates."""
        self._refused.add(client_id)

    @property
    def byzantine_left(self) -> int:
        """``max(f - r, 0)``: the Byzantine clients the kept updates may still hold after ``r`` were refused."""
        return max(self._byzantine - len(self._refused), 0)

    @property
    def count(self) -> int:
        """Updates accepted so far (including those of weight 0, which take no part)."""
        return self._updates.count

    def add(
        self, update: Mapping[str, np.ndarray], weight: float, *, client_id: str | None = None, round: int | None = None
    ) -> None:
        """Validate and keep one update (see :meth:`SpilledUpdates.add`)."""
        self._updates.add(update, weight, client_id=client_id, round=round)


class CoordinateWiseAccumulator(_KeepsWholeUpdates):
    """One round of a coordinate-wise rule: per element, the mean of the values left once the ``trim(n)``
    smallest and largest of the ``n`` kept updates are removed (the median: ``trim(n) = (n - 1) // 2``).

    Made by :class:`MedianAggregator` and :class:`TrimmedMeanAggregator`; see :class:`SpilledUpdates` for how
    updates are kept and validated.

    Memory: the result (1x the model, in its dtypes), one float64 gather buffer of :data:`_GATHER_BYTES` per
    thread, and the pages of the block being read; whatever the number of clients.
    """

    def __init__(
        self,
        updates: SpilledUpdates,
        trim: Callable[[int], int],
        *,
        byzantine: int,
        minimum: Callable[[int], int],
        rule: str,
    ) -> None:
        self._updates = updates
        self._trim = trim
        self._byzantine = byzantine
        self._refused = set()
        self._minimum = minimum
        self._rule = rule

    def result(self, *, release: bool = False) -> NamedArrays:
        """The coordinate-wise trimmed mean of the kept updates, cast to the spec's dtypes (integers rounded).

        Args:
            release: also drop the kept updates and their files; the accumulator is spent afterwards.

        Raises:
            AggregationError: fewer kept updates than the rule needs for the Byzantine clients they may hold
                (``f`` less the clients whose updates were refused).
        """
        updates = self._updates
        updates._check_open()
        kept = updates.kept()
        n, f = len(kept), self.byzantine_left
        minimum = self._minimum(f)
        if n < minimum:
            refused = f" ({len(self._refused)} of the {self._byzantine} refused)" if self._refused else ""
            raise AggregationError(
                f"{self._rule} needs at least {minimum} updates of positive weight to tolerate {f} Byzantine "
                f"client(s){refused}, got {n}",
                stage="aggregate",
            )
        trim = self._trim(n)
        rows = kept
        blocks = updates.blocks()
        width = max(j - i for _, i, j in blocks)
        threads = min(updates.threads, len(blocks))
        buffers = [np.empty(n * width) for _ in range(threads)]
        outputs = [np.empty(width) for _ in range(threads)]
        result = {s.name: np.empty(math.prod(s.shape), dtype=s.dtype) for s in updates.spec}

        def reduce(worker: int, k: int) -> None:
            name, i, j = blocks[k]
            values = updates.gather(rows, blocks[k], buffers[worker])
            out = outputs[worker][: j - i]
            trimmed_mean_columns(values, trim, out)
            target = result[name]
            if target.dtype.kind in "iub":
                np.rint(out, out=out)
            np.copyto(target[i:j], out, casting="unsafe")

        run_blocks(threads, len(blocks), reduce)
        if release:
            updates.close()
        return {s.name: result[s.name].reshape(s.shape) for s in updates.spec}


@dataclass(frozen=True, kw_only=True)
class MedianAggregator:
    """Coordinate-wise median (Yin et al. 2018, "Byzantine-robust distributed learning: towards optimal
    statistical rates"): each element of the result is the median of that element over the kept updates (the mean
    of the two middle values for an even count).

    Tolerates ``f`` Byzantine clients of ``n`` when ``n >= 2f + 1`` (breakdown point 1/2): the median then lies
    between two honest values in every coordinate.

    Attributes:
        byzantine: ``f``, the Byzantine clients each round must tolerate (>= 0); ``check(n)`` refuses
            ``n < 2f + 1``.
        threads: threads per pass (None: the CPUs this process may run on, at most 8).
        spill_dir: where in-memory updates are spilled (None: the system's temp dir).
    """

    byzantine: int = 0
    threads: int | None = None
    spill_dir: str | None = None
    name: str = "median"

    def __post_init__(self) -> None:
        _check_byzantine(self.byzantine)
        check_threads(self.threads)

    def check(self, num_clients: int) -> None:
        """Refuse ``num_clients < 2 * byzantine + 1``."""
        if num_clients < 2 * self.byzantine + 1:
            raise ConfigError(
                f"the coordinate-wise median tolerates {self.byzantine} Byzantine client(s) only with at least "
                f"{2 * self.byzantine + 1} clients per round, got {num_clients}; select more clients or lower "
                "strategy.byzantine"
            )

    def preflight(self, smallest: int, spec: Sequence[TensorSpec] | None) -> None:
        """Refuse before the first round what :meth:`check` refuses of a round of ``smallest`` clients, the fewest
        a round selects (:class:`server.round_loop.Preflighted`).

        Raises:
            ConfigError: as :meth:`check`, saying that rounds may be that small.
        """
        _refuse_small_rounds(self.check, smallest)

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> CoordinateWiseAccumulator:
        """A fresh accumulator for one round (``reference`` is not needed)."""
        updates = SpilledUpdates(spec, threads=self.threads, spill_dir=self.spill_dir)
        return CoordinateWiseAccumulator(
            updates, lambda n: (n - 1) // 2, byzantine=self.byzantine, minimum=lambda f: 2 * f + 1, rule="the median"
        )


@dataclass(frozen=True, kw_only=True)
class TrimmedMeanAggregator:
    """Coordinate-wise trimmed mean (Yin et al. 2018): per element, drop the ``k = floor(beta * n)`` largest and
    ``k`` smallest of the ``n`` kept values and average the rest.

    Tolerates ``f`` Byzantine clients of ``n`` when ``f <= floor(beta * n)``: every Byzantine value is then
    either trimmed or lies between two honest ones.

    Attributes:
        beta: the fraction trimmed at each end, in [0, 0.5) (0 is the plain mean).
        byzantine: ``f`` (>= 0); ``check(n)`` refuses ``floor(beta * n) < f``.
        threads, spill_dir: as in :class:`MedianAggregator`.
    """

    beta: float = 0.1
    byzantine: int = 0
    threads: int | None = None
    spill_dir: str | None = None
    name: str = "trimmed_mean"

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float) or not 0 <= self.beta < 0.5:
            raise ConfigError(f"trim_beta (the fraction trimmed at each end) must be in [0, 0.5), got {self.beta!r}")
        _check_byzantine(self.byzantine)
        check_threads(self.threads)

    def trimmed(self, num_clients: int) -> int:
        """How many values are dropped at each end of ``num_clients``: ``floor(beta * n)``."""
        return math.floor(self.beta * num_clients + 1e-9)

    def check(self, num_clients: int) -> None:
        """Refuse a round whose trim cannot cover ``byzantine`` clients."""
        if self.trimmed(num_clients) < self.byzantine:
            need = math.ceil(self.byzantine / self.beta - 1e-9) if self.beta > 0 else None
            fix = f"select at least {need} clients per round or raise" if need else "raise"
            raise ConfigError(
                f"the trimmed mean with beta={self.beta} drops {self.trimmed(num_clients)} of {num_clients} values at "
                f"each end, fewer than the {self.byzantine} Byzantine client(s) to tolerate; {fix} strategy.trim_beta"
            )

    def preflight(self, smallest: int, spec: Sequence[TensorSpec] | None) -> None:
        """Refuse before the first round what :meth:`check` refuses of a round of ``smallest`` clients, the fewest
        a round selects (:class:`server.round_loop.Preflighted`); warn when such a round trims nothing, which
        makes it the plain mean (``beta`` 0.1 of 6 clients: floor(0.6) = 0).

        Raises:
            ConfigError: as :meth:`check`, saying that rounds may be that small.
        """
        _refuse_small_rounds(self.check, smallest)
        if self.beta > 0 and self.trimmed(smallest) == 0:
            raise_beta = math.ceil(1000 / smallest) / 1000  # rounded up: floor(beta * n) >= 1 at that beta
            log.warning(
                "the trimmed mean with beta=%g trims floor(%g x %d) = 0 values at each end of a round of %d clients: "
                "such a round is the plain mean, which one Byzantine client moves anywhere; select at least %d "
                "clients a round%s",
                self.beta,
                self.beta,
                smallest,
                smallest,
                math.ceil(1 / self.beta - 1e-9),
                f" or raise trim_beta (--trim-beta) to at least {raise_beta:g}" if raise_beta < 0.5 else "",
            )

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> CoordinateWiseAccumulator:
        """A fresh accumulator for one round (``reference`` is not needed)."""
        updates = SpilledUpdates(spec, threads=self.threads, spill_dir=self.spill_dir)
        return CoordinateWiseAccumulator(
            updates, self.trimmed, byzantine=self.byzantine, minimum=self.smallest_round, rule="the trimmed mean"
        )

    def smallest_round(self, byzantine: int) -> int:
        """The fewest updates (>= 1) whose trim, ``floor(beta * n)``, covers ``byzantine`` clients.

        Raises:
            ConfigError: ``beta`` is 0 and ``byzantine`` > 0 (no round is large enough).
        """
        if byzantine > 0 and self.beta == 0:
            raise ConfigError("the trimmed mean with beta=0 trims nothing, so it tolerates no Byzantine client")
        minimum = 1
        while self.trimmed(minimum) < byzantine:
            minimum += 1
        return minimum


@dataclass(frozen=True, kw_only=True)
class KrumAggregator:
    """Krum and Multi-Krum (Blanchard et al. 2017, "Machine learning with adversaries: Byzantine tolerant gradient
    descent").

    Each kept update ``V_i`` gets the score ``s(i) = sum of ||V_i - V_j||^2 over its n - f - 2 nearest other
    updates``. Krum returns the update of lowest score; Multi-Krum the average of the ``m`` of lowest score
    (weighted by the clients' weights; ties go to the lower client id).

    Tolerates ``f`` Byzantine clients of ``n`` when ``n >= 2f + 3`` (the paper's ``2f + 2 < n``).

    Distances are accumulated block by block as a Gram matrix of the updates centred on their median (float64,
    one single-threaded BLAS product per block, summed in block order so the scores do not depend on the thread
    count): memory O(clients^2 + clients x block) besides the result.

    Attributes:
        byzantine: ``f`` (>= 0).
        select: ``m``, how many updates Multi-Krum averages: 1 is Krum; None takes ``n - f`` (Multi-Krum as the
            paper evaluates it). ``check(n)`` refuses ``m > n - f``.
        threads, spill_dir: as in :class:`MedianAggregator`.
    """

    byzantine: int = 0
    select: int | None = 1
    threads: int | None = None
    spill_dir: str | None = None

    def __post_init__(self) -> None:
        _check_byzantine(self.byzantine)
        if self.select is not None and (
            isinstance(self.select, bool) or not isinstance(self.select, int) or self.select < 1
        ):
            raise ConfigError(f"multi_krum_m (how many updates Multi-Krum averages) must be >= 1, got {self.select!r}")
        check_threads(self.threads)

    @property
    def name(self) -> str:
        """``"krum"`` (select one update) or ``"multi_krum"``."""
        return "krum" if self.select == 1 else "multi_krum"

    def check(self, num_clients: int) -> None:
        """Refuse ``num_clients < 2f + 3``, and Multi-Krum's ``m > n - f``."""
        f = self.byzantine
        if num_clients < 2 * f + 3:
            raise ConfigError(
                f"{self.name} tolerates {f} Byzantine client(s) only with at least {2 * f + 3} clients per round "
                f"(n > 2f + 2), got {num_clients}; select more clients or lower strategy.byzantine"
            )
        if self.select is not None and self.select > num_clients - f:
            raise ConfigError(
                f"multi_krum averages m={self.select} updates, more than the n - f = {num_clients - f} it can trust of "
                f"{num_clients}; lower strategy.multi_krum_m"
            )

    def preflight(self, smallest: int, spec: Sequence[TensorSpec] | None) -> None:
        """Refuse before the first round what :meth:`check` refuses of a round of ``smallest`` clients, the fewest
        a round selects (:class:`server.round_loop.Preflighted`); warn when Multi-Krum averages every update
        (``byzantine`` 0 and ``select`` None: m = n - 0), which is the plain weighted mean.

        Raises:
            ConfigError: as :meth:`check`, saying that rounds may be that small.
        """
        _refuse_small_rounds(self.check, smallest)
        if self.select is None and self.byzantine == 0:
            log.warning(
                "multi_krum with byzantine = 0 averages m = n - f = n updates, all of them: the plain weighted "
                "mean, which one Byzantine client moves anywhere; set byzantine (--byzantine) to the clients to "
                "tolerate, or multi_krum_m (--multi-krum-m) below the clients a round selects"
            )

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> KrumAccumulator:
        """A fresh accumulator for one round (``reference`` is not needed)."""
        return KrumAccumulator(SpilledUpdates(spec, threads=self.threads, spill_dir=self.spill_dir), self)


class KrumAccumulator(_KeepsWholeUpdates):
    """One round of Krum / Multi-Krum (see :class:`KrumAggregator`; updates kept as in :class:`SpilledUpdates`)."""

    def __init__(self, updates: SpilledUpdates, rule: KrumAggregator) -> None:
        self._updates = updates
        self._rule = rule
        self._byzantine = rule.byzantine
        self._refused = set()
        self.selected: tuple[str, ...] = ()
        """The client ids the last result was built from."""

    def scores(self) -> np.ndarray:
        """Krum's score of each kept update, in :meth:`SpilledUpdates.kept` order (float64, shape ``(n,)``).

        Raises:
            AggregationError: fewer than ``2f + 3`` kept updates (``f`` less the clients whose updates were
                refused).
        """
        kept = self._updates.kept()
        n, f = len(kept), self.byzantine_left
        if n < 2 * f + 3:
            refused = f" ({len(self._refused)} of the {self._byzantine} refused)" if self._refused else ""
            raise AggregationError(
                f"{self._rule.name} needs at least {2 * f + 3} updates of positive weight to tolerate {f} Byzantine "
                f"client(s){refused}, got {n}",
                stage="aggregate",
            )
        distances = pairwise_squared_distances(self._updates, kept)
        closest = n - f - 2
        scores = np.empty(n)
        for i in range(n):
            others = np.delete(distances[i], i)
            scores[i] = np.sort(others)[:closest].sum()
        return scores

    def result(self, *, release: bool = False) -> NamedArrays:
        """Krum's chosen update (a copy), or Multi-Krum's weighted average of the ``m`` best, in the spec's dtypes.

        Raises:
            AggregationError: fewer than ``2f + 3`` kept updates, or fewer than ``m + f``.
        """
        updates = self._updates
        updates._check_open()
        scores = self.scores()
        kept = updates.kept()
        n, f = len(kept), self.byzantine_left
        m = self._rule.select if self._rule.select is not None else n - f
        if m > n - f:
            raise AggregationError(
                f"multi_krum averages m={m} updates but only {n} arrived, of which it can trust {n - f}",
                stage="aggregate",
            )
        best = sorted(np.argsort(scores, kind="stable")[:m].tolist())
        self.selected = tuple(kept[i].client for i in best)
        if m == 1:
            out = updates.copy(kept[best[0]])
        else:
            mean = WeightedMean(updates.spec, threads=updates.threads)
            for i in best:
                mean.add(kept[i].arrays, kept[i].weight, client_id=kept[i].client)
            out = mean.result(release=True)
        if release:
            updates.close()
        return out


def pairwise_squared_distances(updates: SpilledUpdates, rows: Sequence[KeptUpdate]) -> np.ndarray:
    """``D[i, j] = ||u_i - u_j||^2`` over every tensor of the spec, for the updates ``rows`` (float64, ``n x n``).

    Block by block: the block of every update is gathered (float64), centred on its coordinate-wise median over the
    updates, and its Gram matrix added to a running one, in block order, on single-threaded BLAS.
    ``D = diag + diag' - 2 G``, clipped at 0 against rounding. Centring does not change the distances; it keeps
    ``diag`` of the size of each update's own distance from the others, so that ``diag_i + diag_j - 2 G_ij`` does
    not cancel away the distances between the honest updates. The mean would not do: one update of 1e10 moves the
    mean (so every row) by 1e10 / n, the honest updates' squared norms then reach 1e20 / n^2, and their distances of
    about 1e-2 are lost in float64's 16 digits, which let a colluding second update be chosen. The median stays
    within the honest values of each coordinate while fewer than half the updates are Byzantine.
    """
    n = len(rows)
    blocks = updates.blocks()
    width = max(j - i for _, i, j in blocks)
    threads = min(updates.threads, len(blocks))
    buffers = [np.empty(n * width) for _ in range(threads)]
    grams = [np.empty((n, n)) for _ in range(threads)]
    total = np.zeros((n, n))
    with threadpool_limits(limits=1, user_api="blas"):
        for first in range(0, len(blocks), threads):
            batch = blocks[first : first + threads]

            def gram(worker: int, k: int, batch: list[Block] = batch) -> None:
                values = updates.gather(rows, batch[k], buffers[k])
                values -= np.median(values, axis=0)
                np.matmul(values, values.T, out=grams[k])

            run_blocks(threads, len(batch), gram)
            for k in range(len(batch)):  # in block order, whichever thread computed it
                total += grams[k]
    diagonal = np.diag(total)
    distances = diagonal[:, None] + diagonal[None, :] - 2.0 * total
    np.maximum(distances, 0.0, out=distances)
    np.fill_diagonal(distances, 0.0)
    return distances


@dataclass(frozen=True, kw_only=True)
class NormBoundAggregator:
    """Norm bounding (Sun et al. 2019, "Can you really backdoor federated learning?"): each update's difference from
    the global model ``g`` is clipped to the L2 norm ``M`` before the weighted mean:
    ``u'_k = g + (u_k - g) * min(1, M / ||u_k - g||)``, ``result = sum w_k u'_k / sum w_k``.

    Streaming: ``sum w_k u'_k = sum (w_k c_k) u_k + (sum w_k (1 - c_k)) g``, so each update is folded into a
    :class:`WeightedMean` with weight ``w_k c_k`` right after a read-only pass computes its norm, and ``g`` once at
    the end: memory O(model) (2x a float32 model), like the mean. The norm is taken over the floating tensors; the
    same factor ``c_k`` applies to every tensor.

    Tolerates no Byzantine majority and gives no per-coordinate guarantee; it bounds each client's influence: an
    arbitrary update moves the result by at most ``w_k M / sum w`` in L2 norm (weights are the clients' own
    claims, so pair it with ``weighting = "uniform"`` when example counts cannot be trusted). ``check(n)`` accepts
    any ``n >= 1``.

    Attributes:
        bound: ``M``, the largest L2 norm of an update's difference from the global model (> 0, finite).
        threads: fold threads (None: as :class:`WeightedMean`).
    """

    bound: float
    threads: int | None = None
    name: str = "norm_bound"

    def __post_init__(self) -> None:
        if isinstance(self.bound, bool) or not isinstance(self.bound, int | float) or not 0 < self.bound < math.inf:
            raise ConfigError(f"norm_bound must be a finite number > 0 (an L2 norm), got {self.bound!r}")
        check_threads(self.threads)

    def check(self, num_clients: int) -> None:
        """Any number of clients >= 1."""

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> NormBoundAccumulator:
        """A fresh accumulator for one round around the global model ``reference``.

        Raises:
            ConfigError: no ``reference``, or one that does not match ``spec`` or holds NaN/Inf.
        """
        if reference is None:
            raise ConfigError("norm bounding clips each update's difference from the global model: pass reference=")
        return NormBoundAccumulator(spec, reference, self.bound, threads=self.threads)


class NormBoundAccumulator:
    """One round of norm bounding (see :class:`NormBoundAggregator`).

    Raises:
        ConfigError: ``reference`` does not match ``spec``, or holds NaN/Inf.
    """

    def __init__(
        self, spec: Sequence[TensorSpec], reference: Mapping[str, np.ndarray], bound: float, *, threads: int | None
    ) -> None:
        self._mean = WeightedMean(spec, threads=threads)
        self._spec = self._mean.spec
        try:
            check_spec(reference, self._spec)
            check_finite(reference)
        except Exception as exc:
            raise ConfigError(f"the reference (global model) cannot be used for norm bounding: {exc}") from exc
        self._reference = {s.name: np.ascontiguousarray(reference[s.name]).reshape(-1) for s in self._spec}
        floating = {s.name for s in self._spec if np.dtype(s.dtype).kind == "f"}
        sizes = {s.name: math.prod(s.shape) for s in self._spec}
        self._float_blocks = [b for b in blocks_of(sizes, _MAX_BLOCK) if b[0] in floating]
        self._bound = float(bound)
        self._reference_weight = 0.0
        self._total_weight = 0.0
        self.clipped = 0
        """How many updates were scaled down so far."""

    @property
    def count(self) -> int:
        """Updates accepted so far."""
        return self._mean.count

    def norm(self, update: Mapping[str, np.ndarray]) -> float:
        """``||update - reference||`` (L2 over the floating tensors, float64; inf when it overflows). Pages of a
        file-mapped update are unmapped as they are read. The update must match the spec."""
        flat = {name: np.ascontiguousarray(update[name]).reshape(-1) for name in self._reference}
        mapped = {name: m for name in flat if (m := file_mapping(update[name], flat[name])) is not None}
        parts = np.zeros(len(self._float_blocks))

        def measure(worker: int, k: int) -> None:
            name, i, j = self._float_blocks[k]
            block, reference = flat[name][i:j], self._reference[name][i:j]
            if block.dtype in FUSED_DTYPES:
                parts[k] = squared_distance(block, reference)
            else:
                difference = block.astype(np.float64) - reference
                parts[k] = float(np.dot(difference, difference))
            if name in mapped:
                drop_read(mapped[name], flat[name], i, j)

        run_blocks(self._mean.threads, len(self._float_blocks), measure)
        return math.sqrt(math.fsum(parts.tolist()))

    def add(
        self, update: Mapping[str, np.ndarray], weight: float, *, client_id: str | None = None, round: int | None = None
    ) -> None:
        """Validate the update, clip its difference from the global model to the bound, fold it in.

        Raises:
            UpdateRejected, PayloadError, NonFiniteError: as :meth:`WeightedMean.add`.
        """
        w = check_weight(weight, self._total_weight, client_id=client_id, round=round)
        check_spec(update, self._spec, round=round, client_id=client_id)
        norm = self.norm(update)
        if math.isnan(norm):
            check_finite(update, round=round, client_id=client_id)  # raises NonFiniteError naming the tensor
        scale = 1.0 if norm <= self._bound else self._bound / norm  # an overflowing norm clips to the reference
        self._mean.add(update, w * scale, client_id=client_id, round=round)  # validates in full before folding
        self._total_weight += w
        self._reference_weight += w * (1.0 - scale)
        self.clipped += scale < 1.0

    def result(self, *, release: bool = False) -> NamedArrays:
        """The weighted mean of the clipped updates (as :meth:`WeightedMean.result`).

        Raises:
            AggregationError: nothing was added, or the weights sum to 0.
        """
        if self._reference_weight > 0.0:
            reference = {s.name: self._reference[s.name].reshape(s.shape) for s in self._spec}
            self._mean.add(reference, self._reference_weight, client_id="global model")
            self._reference_weight = 0.0
        return self._mean.result(release=release)
