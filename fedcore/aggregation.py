"""Pure aggregation math: a streaming weighted mean of client updates and weighted metric averages.

No I/O and no strategy logic here; strategies and the server call these functions (STYLE.md §1).

:class:`WeightedMean` keeps one running sum ``Σ w_k · u_k`` per tensor, so memory stays O(model) however
many clients report (DESIGN.md, "Aggregation is streaming"). The sum is kept in float64 (2x the size of a
float32 model): the error then no longer grows with the number of clients, and 1000 float32 updates average
to within ~1e-7 relative of an exact reference, where a float32 running sum drifts to ~1e-6..1e-5.

Speed: an update is folded in cache-sized blocks (``_BLOCK`` elements), each in one fused pass
(:func:`fedcore.kernels.fold_block`: cast, scale and add into the float64 sum in place; numpy's cast-scale-add
through a scratch block for other dtypes). The blocks are spread over a small persistent pool of Python
threads (the kernels and numpy release the GIL), each pulling
the next block from a shared counter, so a thread that another process slows down just takes fewer blocks.
Every element's result depends only on that element, never on which thread computed its block, so the sum is
bit-for-bit the same whatever the thread count or timing. No torch / OpenMP / BLAS threads: those spin at
barriers and stalled ~100x when another process held a core, which a shared server cannot risk.
Before folding, the update is validated in a separate read-only pass (same pool), so a rejected update never
touches the running sum. ``bench/aggregation.py`` measures it against flwr and the machine's ``a += b``.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import numbers
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from fedcore.errors import AggregationError, ConfigError, PayloadError, UpdateRejected
from fedcore.kernels import FUSED_DTYPES, all_finite, fold_block
from fedcore.tensors import (
    NamedArrays,
    TensorSpec,
    check_finite,
    check_spec,
    parse_header,
    spec_of,
    split_payload,
)

__all__ = [
    "Accumulator",
    "Aggregator",
    "MeanAggregator",
    "MetricAverages",
    "WeightedMean",
    "example_weight",
    "mean",
    "metric_value",
    "weighted_average",
    "weighted_metrics",
]

_BLOCK = 1 << 18
"""Elements per block (one task for a thread): 2 MiB of float64 sum per block. With the fused kernels the block
no longer needs to fit in L2 (one streaming pass); 64K..1M measured within noise on the 2-core dev VM with
bench/aggregation.py --block, and larger blocks mean fewer Python task hand-offs."""

_MAX_THREADS = 8
"""Upper bound on the default thread count: the fold is memory-bound, more threads only add contention."""

_MAPPED_SUM_BYTES = 1 << 20
"""Running sums of at least this many bytes live in their own anonymous mapping, so that
``result(release=True)`` can hand the unused tail of the buffer back to the OS."""

_PAGE = mmap.PAGESIZE

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _reset_pool_after_fork() -> None:
    # a forked child inherits the executor object but not its threads: submitting to it would hang forever
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pool_after_fork)


def _executor() -> ThreadPoolExecutor:
    """The process-wide pool that runs the helper threads (created on first use; threads start lazily)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_MAX_THREADS - 1, thread_name_prefix="fedcore-aggregate")
        return _pool


def _default_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, cpus))


@runtime_checkable
class Accumulator(Protocol):
    """One round's aggregation in progress: updates are added as they arrive, the result is taken once.

    :class:`WeightedMean` is the default one. An implementation validates an update completely before it keeps
    anything of it, so a rejected update (the exceptions below) leaves the round's aggregate untouched.
    """

    @property
    def count(self) -> int:
        """Number of updates accepted so far."""
        ...

    def add(
        self, update: Mapping[str, np.ndarray], weight: float, *, client_id: str | None = None, round: int | None = None
    ) -> None:
        """Validate and take in one client's update (``name -> array`` matching the round's spec) with its
        aggregation weight (finite, >= 0).

        Raises:
            UpdateRejected, PayloadError, NonFiniteError: the update or its weight cannot be used.
        """
        ...

    def result(self, *, release: bool = False) -> NamedArrays:
        """The aggregate, with the spec's names, shapes and dtypes. ``release=True`` may reuse the accumulator's
        memory for the result, after which the accumulator is spent.

        Raises:
            AggregationError: nothing usable was added (no updates, weights summing to 0, too few for the rule).
        """
        ...


@runtime_checkable
class Aggregator(Protocol):
    """How a round's updates become one: the strategy carries it and the round loop folds every update through
    the :class:`Accumulator` it starts for the round (DESIGN.md, "Round protocol seams").

    """

    @property
    def name(self) -> str:
        """A label for reports and configuration (e.g. ``"mean"``)."""
        ...

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> Accumulator:
        """A fresh accumulator for one round over tensors of ``spec`` (``reference``: the global model the round's
        clients started from, for rules that work on the difference from it).

        Raises:
            ConfigError: the spec cannot be aggregated by this rule.
        """
        ...

    def check(self, num_clients: int) -> None:
        """Refuse, before any client is contacted, a round of ``num_clients`` selected clients that this rule
        cannot aggregate (e.g. Krum with too few clients for the Byzantine clients it must tolerate).

        Raises:
            ConfigError: what does not fit and what to change.
        """
        ...


@dataclass(frozen=True)
class MeanAggregator:
    """The streaming weighted mean (FedAvg, McMahan et al. 2017): each round folds through a :class:`WeightedMean`.

    Memory O(model) whatever the number of clients; tolerates no Byzantine client (one arbitrary update moves the
    mean arbitrarily far).

    Attributes:
        threads: fold threads per round (None: see :class:`WeightedMean`).
    """

    threads: int | None = None
    name: str = "mean"

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> WeightedMean:
        """A :class:`WeightedMean` over ``spec`` (raises ConfigError as it does; ``reference`` is not needed)."""
        return WeightedMean(spec, threads=self.threads)

    def check(self, num_clients: int) -> None:
        """Any number of clients >= 1 can be averaged."""


class WeightedMean:
    """Streaming weighted mean of client updates (FedAvg's aggregation, McMahan et al. 2017).

    ``result() = Σ_k w_k · u_k / Σ_k w_k`` per tensor, computed as a float64 running sum.

    Args:
        spec: names, shapes and dtypes of the model's tensors (e.g. ``spec_of(global_params)``). Every update
            must match it exactly. Supported dtypes: floating (float16/32/64), integer and bool.
        threads: how many threads fold an update (the calling thread is one of them); default: the CPUs this
            process may run on; at most 8 and at most one per block. The result does not depend on it, bit for bit.

    Raises:
        ConfigError: the spec is empty, has duplicate names or a complex / non-numeric dtype, or ``threads`` < 1.

    Memory: one float64 array per tensor (2x a float32 model), plus one fixed scratch block per thread; the pages
    of a sum are only allocated when the first update touches them. An update given as read-only file mappings
    (``np.memmap`` with mode ``"r"``, as the server maps spilled updates) has its pages unmapped block by block
    right after they were read, so folding it adds no resident memory however large it is (the file stays the
    source of the data). ``result(release=True)`` turns the sums into the result in place (peak: the sums, 2x;
    after it: the result, 1x).
    Not thread-safe: one caller at a time per instance (the instance runs its own helper threads).
    """

    def __init__(self, spec: Sequence[TensorSpec], *, threads: int | None = None) -> None:
        spec = tuple(spec)
        if not spec:
            raise ConfigError("WeightedMean needs a non-empty spec (the model's tensors)")
        names = [s.name for s in spec]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate tensor names in spec: {sorted({n for n in names if names.count(n) > 1})}")
        for s in spec:
            kind = np.dtype(s.dtype).kind
            if kind not in "fiub":
                raise ConfigError(f"tensor {s.name!r} has dtype {s.dtype}; only real numeric dtypes can be averaged")
        if threads is None:
            threads = _default_threads()
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")
        self._spec = spec
        self._sums: dict[str, np.ndarray] = {s.name: _zeros64(math.prod(s.shape)) for s in spec}
        # work items: (tensor name, start, end), in spec order; a tensor spans ceil(size / _BLOCK) of them
        self._blocks: list[tuple[str, int, int]] = [
            (name, i, min(i + _BLOCK, total.size))
            for name, total in self._sums.items()
            for i in range(0, max(total.size, 1), _BLOCK)
        ]
        floating = {s.name for s in spec if np.dtype(s.dtype).kind == "f"}
        self._float_blocks = [b for b in self._blocks if b[0] in floating]
        self._threads = min(threads, _MAX_THREADS, len(self._blocks))
        self._scratch = [np.empty(min(_BLOCK, max(t.size for t in self._sums.values())), np.float64)]
        self._scratch += [np.empty_like(self._scratch[0]) for _ in range(self._threads - 1)]
        self._total_weight = 0.0
        self._clients: list[str] = []
        self._count = 0
        self._released = False

    @property
    def spec(self) -> tuple[TensorSpec, ...]:
        """The tensor specs every update must match."""
        return self._spec

    @property
    def threads(self) -> int:
        """How many threads fold an update (the caller's included)."""
        return self._threads

    @property
    def count(self) -> int:
        """Number of updates folded in so far (including those with weight 0)."""
        return self._count

    @property
    def total_weight(self) -> float:
        """Sum of the weights of the updates folded in so far."""
        return self._total_weight

    def add(
        self,
        update: Mapping[str, np.ndarray],
        weight: float,
        *,
        client_id: str | None = None,
        round: int | None = None,
    ) -> None:
        """Validate one client's update, then fold ``weight · update`` into the running sum.

        Validation happens completely before any folding, so a rejected update leaves the sum untouched.

        Args:
            update: ``name -> array`` with exactly the names, shapes and dtypes of the spec (any order).
            weight: the client's weight, usually its number of training examples; finite and >= 0.
            client_id, round: context for error messages.

        Raises:
            UpdateRejected: the weight is negative, NaN or infinite (or overflows the total weight).
            PayloadError: names, shapes or dtypes differ from the spec.
            NonFiniteError: a floating tensor holds NaN or Inf.
        """
        self._check_open()
        w = self._check_weight(weight, client_id=client_id, round=round)
        check_spec(update, self._spec, round=round, client_id=client_id)
        flat = {name: np.ascontiguousarray(update[name]).reshape(-1) for name in self._sums}
        mapped = {name: m for name in self._sums if (m := _file_mapping(update[name], flat[name])) is not None}
        self._check_finite(flat, round=round, client_id=client_id, mapped=mapped)
        self._fold(flat, w, client_id, mapped=mapped)

    def add_bytes(
        self,
        payload: bytes,
        weight: float,
        *,
        client_id: str | None = None,
        round: int | None = None,
    ) -> None:
        """Validate a safetensors payload and fold it in without copying its tensors.

        The payload is parsed in place (header checked against the spec, tensors viewed with
        ``np.frombuffer``), unlike flwr's ``aggregate_inplace``, which first deserializes every tensor of
        every client into a new array.

        Args:
            payload: safetensors bytes, e.g. from :func:`fedcore.tensors.encode`.
            weight, client_id, round: as in :meth:`add`.

        Raises:
            UpdateRejected: the weight is invalid.
            PayloadError: truncated or corrupted bytes; names, shapes or dtypes differ from the spec.
            NonFiniteError: a floating tensor holds NaN or Inf.
        """
        self._check_open()
        w = self._check_weight(weight, client_id=client_id, round=round)
        flat = _view_payload(payload, self._spec, round=round, client_id=client_id)
        self._check_finite(flat, round=round, client_id=client_id)
        self._fold(flat, w, client_id)

    def result(self, *, release: bool = False) -> NamedArrays:
        """Return the weighted mean, each tensor cast back to its spec dtype (integers rounded to nearest).

        Args:
            release: build the result inside the running sums' own memory (tensor by tensor, front to back) and
                hand the unused rest of each large sum back to the OS, so the peak stays at the sums' size (2x a
                float32 model) and only the result (1x) remains. The accumulator is spent afterwards: ``add`` and
                ``result`` raise. Same values, bit for bit, as without it.

        Raises:
            AggregationError: nothing was added, or the weights sum to 0 (the message names the clients), or the
                accumulator was already spent by ``result(release=True)``.
        """
        self._check_open()
        if self._count == 0:
            raise AggregationError("no updates were added; nothing to aggregate", stage="aggregate")
        if self._total_weight <= 0.0:
            raise AggregationError(
                f"the weights of the {self._count} update(s) sum to 0 (clients {self._client_names()}); "
                "clients must report a positive number of examples",
                stage="aggregate",
            )
        if release:
            return self._result_in_place()
        flat_out = {s.name: np.empty(math.prod(s.shape), dtype=s.dtype) for s in self._spec}
        total_weight = self._total_weight

        def divide(worker: int, k: int) -> None:
            name, i, j = self._blocks[k]
            blk = self._scratch[worker][: j - i]
            np.divide(self._sums[name][i:j], total_weight, out=blk)
            result = flat_out[name]
            if result.dtype.kind in "iub":
                np.rint(blk, out=blk)
            np.copyto(result[i:j], blk, casting="unsafe")

        self._parallel(len(self._blocks), divide)
        return {s.name: flat_out[s.name].reshape(s.shape) for s in self._spec}

    def _result_in_place(self) -> NamedArrays:
        """``result(release=True)``: the same per-element operations as :meth:`result`, written over the sums.

        Output element ``k`` (itemsize <= 8) occupies bytes that belong to float64 elements ``<= k``, which were
        read before it is written when the blocks run in order on one thread; hence no parallel blocks here.
        """
        self._released = True
        total_weight = self._total_weight
        blk_all = self._scratch[0]
        out: NamedArrays = {}
        sums, self._sums = self._sums, {}
        for s in self._spec:
            total = sums.pop(s.name)
            dtype = np.dtype(s.dtype)
            n = total.size
            target = total if dtype == np.float64 else total.view(np.uint8)[: n * dtype.itemsize].view(dtype)
            for i in range(0, n, _BLOCK):
                j = min(i + _BLOCK, n)
                blk = blk_all[: j - i]
                np.divide(total[i:j], total_weight, out=blk)
                if dtype.kind in "iub":
                    np.rint(blk, out=blk)
                np.copyto(target[i:j], blk, casting="unsafe")
            _release_tail(total, n * dtype.itemsize)
            out[s.name] = target.reshape(s.shape)
            del total, target
        return out

    def _check_open(self) -> None:
        if self._released:
            raise AggregationError(
                "this accumulator was spent by result(release=True); make a new WeightedMean", stage="aggregate"
            )

    def _client_names(self) -> str:
        shown = ", ".join(repr(c) for c in self._clients[:10])
        more = len(self._clients) - 10
        return shown + (f" and {more} more" if more > 0 else "")

    def _check_weight(self, weight: float, *, client_id: str | None, round: int | None) -> float:
        try:
            w = float(weight)
        except (TypeError, ValueError) as exc:
            raise UpdateRejected(f"weight {weight!r} is not a number", round=round, client_id=client_id) from exc
        if not math.isfinite(w) or w < 0.0:
            raise UpdateRejected(
                f"weight {weight!r} must be finite and >= 0 (usually the number of training examples)",
                round=round,
                client_id=client_id,
            )
        if not math.isfinite(self._total_weight + w):
            raise UpdateRejected(f"weight {weight!r} overflows the total weight", round=round, client_id=client_id)
        return w

    def _parallel(self, n_tasks: int, task: Callable[[int, int], None]) -> None:
        """Run ``task(worker, k)`` for every ``k < n_tasks`` on up to ``self._threads`` threads; return when all ran.

        Each thread (the caller is worker 0) pulls the next ``k`` from a shared counter, so a thread that the OS
        descheduled delays the others by at most one block. ``worker`` selects that thread's scratch buffer.
        """
        workers = min(self._threads, n_tasks)
        if workers <= 1:
            for k in range(n_tasks):
                task(0, k)
            return
        lock = threading.Lock()
        next_k = 0
        failed = False

        def run(worker: int) -> None:
            nonlocal next_k, failed
            while True:
                with lock:
                    k = next_k
                    next_k += 1
                    if k >= n_tasks or failed:
                        return
                try:
                    task(worker, k)
                except BaseException:
                    failed = True
                    raise

        pool = _executor()
        helpers: list[Future[None]] = [pool.submit(run, worker) for worker in range(1, workers)]
        try:
            run(0)
        finally:
            for helper in helpers:
                helper.result()  # waits; re-raises a helper's exception

    def _check_finite(
        self,
        flat: Mapping[str, np.ndarray],
        *,
        round: int | None,
        client_id: str | None,
        mapped: Mapping[str, mmap.mmap] | None = None,
    ) -> None:
        """Same verdict as :func:`check_finite`, in one read-only parallel pass without full-size temporaries.

        A block's sum is finite only if every element is; a non-finite block sum (NaN/Inf, or a rare overflow
        of finite values) triggers the exact element-wise check of that tensor, which raises NonFiniteError
        naming it (the first such tensor in spec order, whatever the thread timing).
        """
        blocks = self._float_blocks
        suspect = np.zeros(len(blocks), dtype=bool)

        def check(worker: int, k: int) -> None:
            name, i, j = blocks[k]
            block = flat[name][i:j]
            finite = all_finite(block) if block.dtype in FUSED_DTYPES else np.isfinite(block.sum())
            if not finite:
                suspect[k] = True
            if mapped and name in mapped:
                _drop_mapped(mapped[name], flat[name], i, j)

        self._parallel(len(blocks), check)
        if suspect.any():
            for name in dict.fromkeys(blocks[k][0] for k in np.flatnonzero(suspect)):
                check_finite({name: flat[name]}, round=round, client_id=client_id)

    def _fold(
        self,
        flat: Mapping[str, np.ndarray],
        w: float,
        client_id: str | None,
        *,
        mapped: Mapping[str, mmap.mmap] | None = None,
    ) -> None:
        if w > 0.0:

            def fold(worker: int, k: int) -> None:
                name, i, j = self._blocks[k]
                total = self._sums[name][i:j]
                # the product is formed in float64 too: a float32 product (faster) errs by 6e-8 of |w·u|, which
                # cancellation across clients turned into 1e-3 relative error
                update = flat[name][i:j]
                if update.dtype in FUSED_DTYPES:
                    fold_block(total, update, w)  # one fused pass: cast, scale, add
                else:
                    part = self._scratch[worker][: j - i]
                    np.copyto(part, update)
                    np.multiply(part, w, out=part)
                    np.add(total, part, out=total)
                if mapped and name in mapped:
                    _drop_mapped(mapped[name], flat[name], i, j)

            self._parallel(len(self._blocks), fold)
        self._total_weight += w
        self._count += 1
        self._clients.append(client_id if client_id is not None else f"#{self._count}")


def _zeros64(n: int) -> np.ndarray:
    """A zero float64 vector; a large one in its own private anonymous mapping (pages allocated on first touch).

    Private, not mmap's default MAP_SHARED: ``MADV_DONTNEED`` frees private anonymous pages, while shared ones stay
    allocated in shared memory (they only leave the resident set), so :func:`_release_tail` would free nothing.
    """
    if n * 8 < _MAPPED_SUM_BYTES:
        return np.zeros(n, np.float64)
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buffer = mmap.mmap(-1, n * 8, flags=private) if private else mmap.mmap(-1, n * 8)
    return np.frombuffer(buffer, dtype=np.float64, count=n)


def _release_tail(total: np.ndarray, used: int) -> None:
    """Hand the pages of ``total``'s buffer past its first ``used`` bytes back to the OS (large sums only)."""
    base = total.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = -(-used // _PAGE) * _PAGE
    if start < len(base):
        with contextlib.suppress(OSError, ValueError):  # else the tail simply stays resident
            base.madvise(mmap.MADV_DONTNEED, start, len(base) - start)


def _file_mapping(array: np.ndarray, flat: np.ndarray) -> mmap.mmap | None:
    """The read-only file mapping behind ``array`` (a ``np.memmap`` opened with mode "r") when ``flat`` views it.

    Only such mappings are released after reading: their pages come back from the file if touched again. Private
    (copy-on-write) or anonymous memory is never released.
    """
    if not isinstance(array, np.memmap) or array.mode != "r" or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    handle = getattr(array, "_mmap", None)
    if not isinstance(handle, mmap.mmap) or not np.shares_memory(array, flat):
        return None
    return handle


def _drop_mapped(handle: mmap.mmap, flat: np.ndarray, i: int, j: int) -> None:
    """Unmap the pages of ``flat[i:j]`` (rounded out to whole pages) from the read-only file mapping ``handle``."""
    try:
        base = np.frombuffer(handle, dtype=np.uint8).ctypes.data
        start = flat.ctypes.data - base + i * flat.itemsize
        end = min(len(handle), -(-(start + (j - i) * flat.itemsize) // _PAGE) * _PAGE)
        start -= start % _PAGE
        if end > start:
            handle.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):  # pragma: no cover - a closed mapping: nothing left to release
        pass


def _view_payload(
    payload: bytes, spec: Sequence[TensorSpec], *, round: int | None, client_id: str | None
) -> dict[str, np.ndarray]:
    """Parse a safetensors payload into flat read-only views, checking it against ``spec``.

    Raises PayloadError for truncated/corrupted bytes or any name, shape, dtype or offset mismatch.
    """

    def fail(message: str) -> PayloadError:
        return PayloadError(message, round=round, client_id=client_id, stage="decode")

    header_json, body_len, body = split_payload(payload, round=round, client_id=client_id)
    entries, _ = parse_header(header_json, body_len, round=round, client_id=client_id, require_order=False)
    arrays: dict[str, np.ndarray] = {}
    want = {s.name: s for s in spec}
    if set(entries) != set(want):
        # same message as check_spec (missing / unexpected names); placeholders carry only the names
        check_spec({n: np.empty(0, dtype=e.dtype) for n, e in entries.items()}, spec, round=round, client_id=client_id)
    for name, s in want.items():
        e = entries[name]
        if e.shape != s.shape:
            raise fail(f"tensor {name!r} has shape {e.shape}, expected {s.shape}.")
        if e.dtype.name != s.dtype:
            raise fail(f"tensor {name!r} has dtype {e.dtype.name}, expected {s.dtype}.")
        count = (e.end - e.start) // e.dtype.itemsize
        arrays[name] = np.frombuffer(payload, dtype=e.dtype, count=count, offset=body + e.start)
    return arrays


def mean(updates: Iterable[Mapping[str, np.ndarray]]) -> NamedArrays:
    """Unweighted mean of updates that share one spec (the first update's).

    Raises:
        AggregationError: ``updates`` is empty.
        PayloadError, NonFiniteError: an update differs in spec from the first, or holds NaN/Inf.
    """
    acc: WeightedMean | None = None
    for k, update in enumerate(updates):
        if acc is None:
            acc = WeightedMean(spec_of(update))
        acc.add(update, 1.0, client_id=f"#{k}")
    if acc is None:
        raise AggregationError("mean() of no updates", stage="aggregate")
    return acc.result()


def weighted_average(values: Sequence[float], weights: Sequence[float]) -> float:
    """Return ``Σ w_i · v_i / Σ w_i`` (math.fsum, exact rounding).

    Values near the float range (e.g. 1e308) do not overflow: when ``Σ w_i · v_i`` would, the mean is taken as
    ``Σ (w_i / Σ w) · v_i``, a convex combination that stays within the values' range.

    Raises:
        AggregationError: lengths differ, a value or weight is not finite, a weight is negative, or the
            weights sum to 0.
    """
    if len(values) != len(weights):
        raise AggregationError(f"{len(values)} values but {len(weights)} weights")
    if not all(math.isfinite(v) for v in values) or not all(math.isfinite(w) and w >= 0 for w in weights):
        raise AggregationError("values must be finite and weights finite and >= 0")
    try:
        total = math.fsum(weights)
    except OverflowError:  # weights near the float limit: the scaled path below
        total = math.inf
    if total <= 0.0:
        raise AggregationError(f"the weights of {len(weights)} value(s) sum to 0; nothing to average")
    if math.isfinite(total):
        try:
            result = math.fsum(v * w for v, w in zip(values, weights, strict=True)) / total
        except (OverflowError, ValueError):  # a partial sum, or products of both signs (inf - inf), left the range
            result = math.inf
        if math.isfinite(result):
            return result
    # huge values or weights: scale the weights first; |Σ (w_i / W) · v_i| <= max |v_i|
    top = max(weights)
    scaled = [w / top for w in weights]  # in [0, 1]: their sum is finite
    share = math.fsum(scaled)
    try:
        result = math.fsum(v * (w / share) for v, w in zip(values, scaled, strict=True))
    except OverflowError:
        result = math.inf
    if not math.isfinite(result):  # only when rounding pushes a mean of values at the float limit past it
        raise AggregationError(f"the weighted mean of {len(values)} value(s) is beyond the float range")
    return result


@dataclass(frozen=True)
class MetricAverages:
    """What :func:`weighted_metrics` returns.

    Attributes:
        values: ``{metric: example-weighted average}`` over the reports that count, in order of first appearance.
            A metric none of whose reports count is absent.
        left_out: how many reported values were left out of their metric's average: values that are not real
            numbers or not finite, and every value of a report whose example count is not a positive integer.
    """

    values: dict[str, float]
    left_out: int


def metric_value(value: object) -> float | None:
    """A reported metric value as a float, or None when it is not a number.

    Real numbers (int, float, bool as 0/1, numpy scalars and 0-d arrays, one-element torch tensors: what
    ``float()`` takes through ``__float__``) become floats; an int beyond the float range becomes ``±inf``.
    Strings (even numeric ones), None, containers and arrays of one or more dimensions give None. Never raises.
    """
    if isinstance(value, str | bytes) or not hasattr(type(value), "__float__"):
        return None
    if isinstance(value, np.ndarray) and value.ndim > 0:
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:  # a huge int or fraction
        try:
            return math.inf if value > 0 else -math.inf  # type: ignore[operator]
        except Exception:
            return None
    except Exception:  # multi-element tensors, complex values, a __float__ that raises
        return None


def example_weight(num_examples: object) -> float | None:
    """A report's example count as a positive finite weight, or None when it is not one (0, negative, bool,
    not an integer, beyond the float range). Never raises."""
    if isinstance(num_examples, bool) or not isinstance(num_examples, numbers.Integral) or num_examples <= 0:
        return None
    try:
        weight = float(num_examples)
    except OverflowError:
        return None
    return weight if math.isfinite(weight) else None


def weighted_metrics(results: Iterable[tuple[int, Mapping[str, object]]]) -> MetricAverages:
    """Average each metric over the clients that report it, weighted by their example counts.

    A metric value never makes this fail: a value that is not a finite real number (NaN, Inf, a string, None;
    see :func:`metric_value`), or any value of a report whose example count is not a positive integer (0 for
    a client with an empty test split, whose loss is NaN), is left out of that metric's average and counted in
    ``left_out``; so is a value under a name that is not a string. The other reports' average is unaffected.

    Args:
        results: ``(num_examples, {metric: value})`` per client, e.g. ``[(10, {"acc": 0.5}), (30, {"acc": 0.9})]``
            gives ``MetricAverages(values={"acc": 0.8}, left_out=0)``.

    Returns:
        The averages and the count of left-out values (:class:`MetricAverages`).
    """
    values: dict[str, list[float]] = {}
    weights: dict[str, list[float]] = {}
    left_out = 0
    for num_examples, metrics in results:
        if not isinstance(metrics, Mapping):  # not a metrics dict at all: one report that cannot count
            left_out += 1
            continue
        weight = example_weight(num_examples)
        for name, raw in metrics.items():
            value = metric_value(raw)
            if weight is None or value is None or not math.isfinite(value) or not isinstance(name, str):
                left_out += 1
                continue
            values.setdefault(name, []).append(value)
            weights.setdefault(name, []).append(weight)
    averages: dict[str, float] = {}
    for name, kept in values.items():
        try:
            averages[name] = weighted_average(kept, weights[name])
        except AggregationError:  # a mean beyond the float range: leave the metric out
            left_out += len(kept)
    return MetricAverages(values=averages, left_out=left_out)
