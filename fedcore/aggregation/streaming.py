"""The streaming weighted mean of client updates (FedAvg's aggregation) and its aggregator.

Pure math, no I/O and no strategy logic here; strategies and the server call it (STYLE.md §1).

:class:`WeightedMean` keeps one running sum ``Σ w_k · u_k`` per tensor, so memory stays O(model) however
many clients report (DESIGN.md, "Aggregation is streaming"). The sum is kept in float64 (2x the size of a
float32 model): the error then no longer grows with the number of clients, and 1000 float32 updates average
to within ~1e-7 relative of an exact reference, where a float32 running sum drifts to ~1e-6..1e-5.

Speed: an update is folded in cache-sized blocks (``_BLOCK`` elements), each in one fused pass
(:func:`fedcore.kernels.fold_block`: cast, scale and add into the float64 sum in place; numpy's cast-scale-add
through a scratch block for other dtypes), spread over the shared thread pool of
:func:`fedcore.aggregation.blocks.run_blocks` (bit-for-bit the same sum whatever the thread count or timing).
Before folding, the update is validated in a separate read-only pass (same pool), so a rejected update never
touches the running sum. ``bench/aggregation.py`` measures it against flwr and the machine's ``a += b``.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from fedcore.aggregation.blocks import (
    MAX_THREADS,
    blocks_of,
    check_finite_blocks,
    check_spec_kinds,
    check_threads,
    check_weight,
    drop_read,
    file_mapping,
    populate,
    release_tail,
    run_blocks,
)
from fedcore.aggregation.protocol import BlockArray
from fedcore.errors import AggregationError, PayloadError, UpdateRejected
from fedcore.kernels import FUSED_DTYPES, fold_block
from fedcore.tensors import (
    NamedArrays,
    TensorSpec,
    check_spec,
    parse_header,
    spec_of,
    split_payload,
)

_BLOCK = 1 << 18
"""Elements per block (one task for a thread): 2 MiB of float64 sum per block. With the fused kernels the block
no longer needs to fit in L2 (one streaming pass); 64K..1M measured within noise on the 2-core dev VM with
bench/aggregation.py --block, and larger blocks mean fewer Python task hand-offs."""

_MAPPED_SUM_BYTES = 1 << 20
"""Running sums of at least this many bytes live in their own anonymous mapping, so that
``result(release=True)`` can hand the unused tail of the buffer back to the OS."""


@dataclass(frozen=True)
class MeanAggregator:
    """The streaming weighted mean (FedAvg, McMahan et al. 2017): each round folds through a :class:`WeightedMean`.

    Memory O(model) whatever the number of clients; tolerates no Byzantine client (one arbitrary update moves the
    mean arbitrarily far).

    Attributes:
        threads: fold threads per round (None: see :class:`WeightedMean`).
        delta: sum the float32 tensors' differences from the round's global model in float32 (1x the model; see
            :class:`WeightedMean`'s ``reference``) rather than the updates themselves in float64 (2x). The mean
            then differs from the float64 sum's by at most about one unit in the last place of the result
            (``tests/fedcore/test_delta_mean.py`` measures it). Off by default: a float32 sum depends on the order
            the updates are folded in, and the process and Ray backends fold them as they arrive, so their models
            would no longer equal the in-process backend's bit for bit (the float64 sum of float32 products has
            29 bits to spare, which the rounding to float32 hides).
    """

    threads: int | None = None
    name: str = "mean"
    delta: bool = False

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> WeightedMean:
        """A :class:`WeightedMean` over ``spec`` (raises ConfigError as it does), summing differences from
        ``reference`` (the global model) when :attr:`delta` and a reference is given."""
        return WeightedMean(spec, threads=self.threads, reference=reference if self.delta else None)

    def check(self, num_clients: int) -> None:
        """Any number of clients >= 1 can be averaged."""


class WeightedMean:
    """Streaming weighted mean of client updates (FedAvg's aggregation, McMahan et al. 2017).

    ``result() = Σ_k w_k · u_k / Σ_k w_k`` per tensor, computed as a float64 running sum; or, for the float32
    tensors when a ``reference`` is given, as ``r + (Σ_k w_k · (u_k − r)) / Σ_k w_k`` with the sum of differences
    kept in float32.

    Args:
        spec: names, shapes and dtypes of the model's tensors (e.g. ``spec_of(global_params)``). Every update
            must match it exactly. Supported dtypes: floating (float16/32/64), integer and bool.
        threads: how many threads fold an update (the calling thread is one of them); default: the CPUs this
            process may run on; at most 8, one per block and one per ``_BLOCK`` elements of the model. The result
            does not depend on it, bit for bit.
        reference: the model the updates started from (the round's global model, ``name -> array`` of ``spec``),
            or None. Given, each float32 tensor keeps ``D = Σ_k w_k · (u_k − r)`` in float32 (1x, not 2x, the
            model): each fold computes ``D + w · (u − r)`` in float64 and rounds it once to float32, and the result
            is ``r + D / Σ w`` computed in float64 and rounded once. The differences are a round of local training,
            small beside the parameters, so the float32 rounding of ``D`` is relative to them and not to the
            parameters: the mean is within about one unit in the last place (float32) of the float64 sum's (equal
            to it for most elements), unlike a float32 sum of the updates themselves (flwr's ``aggregate``), whose
            error is relative to the parameters. Deterministic as the float64 sum: the same bits whatever the
            thread count, but not whatever the order of the updates (fold them in a fixed order). Only read, never
            written; it must stay unchanged until the result is taken.

    Raises:
        ConfigError: the spec is empty, has duplicate names or a complex / non-numeric dtype, or ``threads`` < 1.
        PayloadError: ``reference`` does not match the spec.

    Memory: one float64 array per tensor (2x a float32 model; a float32 one per float32 tensor with a ``reference``:
    1x), plus one fixed scratch block per thread; the pages of a sum are only allocated when the first update with a
    weight > 0 is folded into them (by :meth:`add_sum`, all at once first: it writes every one). An update given as
    read-only file mappings (``np.memmap`` with mode ``"r"``, as the server maps spilled updates) has its pages
    unmapped block by block right after they were read, so folding it adds no resident memory however large it is
    (the file stays the source of the data). ``result(release=True)`` turns the sums into the result in place (peak:
    the sums, 2x; after it: the result, 1x).
    Not thread-safe: one caller at a time per instance (the instance runs its own helper threads).
    """

    def __init__(
        self,
        spec: Sequence[TensorSpec],
        *,
        threads: int | None = None,
        reference: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        spec = check_spec_kinds(spec, "WeightedMean")
        threads = check_threads(threads)
        self._spec = spec
        self._reference: dict[str, np.ndarray] = {}  # flat float32 views, for the tensors summed as differences
        if reference is not None:
            check_spec(reference, spec)
            self._reference = {s.name: _flat(reference[s.name]) for s in spec if np.dtype(s.dtype) == np.float32}
        self._sums: dict[str, np.ndarray] = {
            s.name: _zeros(math.prod(s.shape), np.float32 if s.name in self._reference else np.float64) for s in spec
        }
        # work items: (tensor name, start, end), in spec order; a tensor spans ceil(size / _BLOCK) of them
        self._blocks = blocks_of({name: total.size for name, total in self._sums.items()}, _BLOCK)
        floating = {s.name for s in spec if np.dtype(s.dtype).kind == "f"}
        self._float_blocks = [b for b in self._blocks if b[0] in floating]
        # one thread per _BLOCK elements of the whole model at most: a thread hand-off costs about 0.1 ms, more than
        # folding a small model (measured, 2-core VM: 200k elements 0.24 ms on one thread, 0.36 ms on two; 1M: 0.97
        # ms, 0.73 ms); many small tensors are many blocks but little work
        elements = sum(total.size for total in self._sums.values())
        self._threads = min(threads, MAX_THREADS, len(self._blocks), max(1, math.ceil(elements / _BLOCK)))
        self._scratch = [np.empty(min(_BLOCK, max(t.size for t in self._sums.values())), np.float64)]
        self._scratch += [np.empty_like(self._scratch[0]) for _ in range(self._threads - 1)]
        self._total_weight = 0.0
        self._clients: list[str] = []
        self._count = 0
        self._released = False
        self._populated = False  # the sums' pages, allocated in one call before the first fold that writes them

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
        w = check_weight(weight, self._total_weight, client_id=client_id, round=round)
        check_spec(update, self._spec, round=round, client_id=client_id)
        # a BlockArray (a compressed update) is decoded block by block as the passes below read it, never whole
        flat = {name: _flat(update[name]) for name in self._sums}
        mapped = {name: m for name in self._sums if (m := file_mapping(update[name], flat[name])) is not None}
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
        w = check_weight(weight, self._total_weight, client_id=client_id, round=round)
        flat = _view_payload(payload, self._spec, round=round, client_id=client_id)
        self._check_finite(flat, round=round, client_id=client_id)
        self._fold(flat, w, client_id)

    def add_sum(
        self,
        weighted_sum: Mapping[str, np.ndarray],
        weights: Sequence[float],
        *,
        client_ids: Sequence[str] | None = None,
        round: int | None = None,
    ) -> None:
        """Fold the already weighted sum of several clients' updates, ``S = Σ_k w_k · u_k``, in one pass: the same
        mean as :meth:`add` of each update with its weight, up to the order in which the float64 products were
        summed (where ``S`` was formed, e.g. one matrix-vector product over a batch of stacked updates; relative
        differences of about 1e-16, hidden by the rounding of the result to float32 for nearly every element).

        For a tensor summed as differences from a ``reference`` ``r``, ``S − (Σ_k w_k) · r`` is added to the
        float32 sum of differences (formed in float64 and rounded once, as :meth:`add` does per update).

        Args:
            weighted_sum: ``name -> float64 array`` with exactly the spec's names and shapes.
            weights: the clients' weights, each finite and >= 0, in the order they were formed in; the total weight
                grows by each in turn, as it would by :meth:`add`.
            client_ids: the clients, one per weight (for reports and error messages), or None.
            round: context for error messages.

        Raises:
            UpdateRejected: a weight is negative, NaN or infinite, overflows the total weight, or the client ids are
                not one per weight.
            PayloadError: names or shapes differ from the spec, or a tensor is not float64.
            NonFiniteError: the sum holds NaN or Inf.
        """
        self._check_open()
        ids = [f"#{self._count + k + 1}" for k in range(len(weights))] if client_ids is None else list(client_ids)
        if len(ids) != len(weights):
            raise UpdateRejected(
                f"a batch of {len(weights)} weights names {len(ids)} clients; give one client id per weight",
                round=round,
            )
        total = self._total_weight
        for w, cid in zip(weights, ids, strict=True):
            total += check_weight(w, total, client_id=cid, round=round)
        batch_weight = total - self._total_weight
        summed = tuple(TensorSpec(s.name, s.shape, "float64") for s in self._spec)
        check_spec(weighted_sum, summed, round=round)
        flat = {name: _flat(weighted_sum[name]) for name in self._sums}
        check_finite_blocks(flat, self._blocks, self._threads, round=round, client_id=None)

        def fold(worker: int, k: int) -> None:
            name, i, j = self._blocks[k]
            part = flat[name][i:j]
            total_block = self._sums[name][i:j]
            reference = self._reference.get(name)
            if reference is None:
                np.add(total_block, part, out=total_block)
                return
            scratch = self._scratch[worker][: j - i]  # D + (S − W·r) in float64, rounded once to float32
            np.multiply(reference[i:j], batch_weight, out=scratch, dtype=np.float64)
            np.subtract(part, scratch, out=scratch)
            np.add(scratch, total_block, out=scratch)
            np.copyto(total_block, scratch, casting="same_kind")

        self._populate()
        self._parallel(len(self._blocks), fold)
        self._total_weight = total
        self._count += len(ids)
        self._clients.extend(ids)

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
            self._mean_block(name, i, j, total_weight, blk)
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
            target = total if dtype == total.dtype else total.view(np.uint8)[: n * dtype.itemsize].view(dtype)
            for i in range(0, n, _BLOCK):
                j = min(i + _BLOCK, n)
                blk = blk_all[: j - i]
                self._mean_block(s.name, i, j, total_weight, blk, sums=total)
                if dtype.kind in "iub":
                    np.rint(blk, out=blk)
                np.copyto(target[i:j], blk, casting="unsafe")
            release_tail(total, n * dtype.itemsize)
            out[s.name] = target.reshape(s.shape)
            del total, target
        self._reference = {}  # the global model is not kept alive by a spent accumulator
        return out

    def _mean_block(
        self, name: str, i: int, j: int, total_weight: float, out: np.ndarray, *, sums: np.ndarray | None = None
    ) -> None:
        """Elements ``i:j`` of tensor ``name``'s mean, in float64, into ``out``: ``sum / Σ w``, or for a tensor
        summed as differences ``reference + sum / Σ w``."""
        total = (self._sums[name] if sums is None else sums)[i:j]
        np.divide(total, total_weight, out=out)
        reference = self._reference.get(name)
        if reference is not None:
            np.add(out, reference[i:j], out=out)

    def _populate(self) -> None:
        """Before :meth:`add_sum` folds a batch's sum: the sums' pages in one call each
        (:func:`~fedcore.aggregation.blocks.populate`), not one page fault per page as the fold writes them (a
        batched simulation round folds only that one sum, so those faults were most of its fold). Not when the
        accumulator is made: a server makes it before it writes the round's task payload, and sums allocated then
        would add to that write's peak. Not for :meth:`add`'s per-client updates either: on a server the first fold
        overlaps other clients' uploads, so a sum whole from that fold's start could only raise the peak (the quick
        bench/server_memory.py --part a --mib 64 --clients 4 spreads 4.0-4.8x run to run, too much to tell), for a
        few milliseconds a round."""
        if not self._populated:
            self._populated = True
            for total in self._sums.values():
                populate(total)

    def _check_open(self) -> None:
        if self._released:
            raise AggregationError(
                "this accumulator was spent by result(release=True); make a new WeightedMean", stage="aggregate"
            )

    def _client_names(self) -> str:
        shown = ", ".join(repr(c) for c in self._clients[:10])
        more = len(self._clients) - 10
        return shown + (f" and {more} more" if more > 0 else "")

    def _parallel(self, n_tasks: int, task: Callable[[int, int], None]) -> None:
        """:func:`run_blocks` on this instance's threads (``worker`` selects that thread's scratch buffer)."""
        run_blocks(self._threads, n_tasks, task)

    def _check_finite(
        self,
        flat: Mapping[str, np.ndarray],
        *,
        round: int | None,
        client_id: str | None,
        mapped: Mapping[str, mmap.mmap] | None = None,
    ) -> None:
        """Same verdict as :func:`~fedcore.tensors.check_finite`, in one read-only parallel pass
        (:func:`~fedcore.aggregation.blocks.check_finite_blocks`)."""
        check_finite_blocks(flat, self._float_blocks, self._threads, round=round, client_id=client_id, mapped=mapped)

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
                reference = self._reference.get(name)
                if reference is not None:  # D + w·(u − r) in float64, rounded once to float32
                    part = self._scratch[worker][: j - i]
                    np.subtract(update, reference[i:j], out=part, dtype=np.float64)
                    np.multiply(part, w, out=part)
                    np.add(part, total, out=part)
                    np.copyto(total, part, casting="same_kind")
                elif update.dtype in FUSED_DTYPES:
                    fold_block(total, update, w)  # one fused pass: cast, scale, add
                else:
                    part = self._scratch[worker][: j - i]
                    np.copyto(part, update)
                    np.multiply(part, w, out=part)
                    np.add(total, part, out=total)
                if mapped and name in mapped:
                    drop_read(mapped[name], flat[name], i, j)

            self._parallel(len(self._blocks), fold)
        self._total_weight += w
        self._count += 1
        self._clients.append(client_id if client_id is not None else f"#{self._count}")


def _flat(array: np.ndarray) -> np.ndarray:
    """``array`` flattened (a view where it can be), or a :class:`BlockArray` as it is (it reads flat blocks)."""
    if not isinstance(array, np.ndarray) and isinstance(array, BlockArray):  # the Protocol check is slow (~20 us)
        return cast(np.ndarray, array)
    return np.ascontiguousarray(array).reshape(-1)


def _zeros(n: int, dtype: type[np.floating]) -> np.ndarray:
    """A zero vector of ``dtype``; a large one in its own private anonymous mapping (pages allocated on first touch).

    Private, not mmap's default MAP_SHARED: ``MADV_DONTNEED`` frees private anonymous pages, while shared ones stay
    allocated in shared memory (they only leave the resident set), so
    :func:`~fedcore.aggregation.blocks.release_tail` would free nothing.
    """
    size = n * np.dtype(dtype).itemsize
    if size < _MAPPED_SUM_BYTES:
        return np.zeros(n, dtype)
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buffer = mmap.mmap(-1, size, flags=private) if private else mmap.mmap(-1, size)
    return np.frombuffer(buffer, dtype=dtype, count=n)


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
