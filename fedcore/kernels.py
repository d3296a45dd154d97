"""Fused element-wise kernels for the aggregators, compiled with numba.

Each kernel does in one pass over a block what numpy would do in two or three (cast, scale, add; or an
all-finite test), so the fold moves each byte of the update once. They release the GIL (``nogil=True``) and
are driven by :mod:`fedcore.aggregation.blocks`' own thread pool, one block per call: numba's threading layer is not
used, so results never depend on thread timing and no OpenMP threads spin while another process holds a core.
No fastmath in the fold: ``total[i] + w * float64(u[i])`` is rounded exactly as numpy's cast-multiply-add rounds
it (only the finite test reassociates, where the order cannot change the verdict).

Compiled on first use in each process (about a second for the fold's two, numba's import included), not cached on
disk: several processes (a server and its tests, workers) starting at once would otherwise race on the cache files. For
dtypes other than float32/float64 the aggregator keeps its numpy path.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: update dtypes the fused kernels are used for.
FUSED_DTYPES: frozenset[np.dtype] = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


@njit(nogil=True)
def fold_block(total: np.ndarray, update: np.ndarray, weight: float) -> None:  # pragma: no cover - compiled
    """``total[i] += weight * float64(update[i])`` for a float64 ``total`` and a float32/float64 ``update``."""
    for i in range(total.size):
        total[i] += weight * np.float64(update[i])


@njit(nogil=True)
def fold_rows(  # pragma: no cover - compiled
    total: np.ndarray, rows: np.ndarray, index: np.ndarray, weights: np.ndarray
) -> None:
    """:func:`fold_block` of ``rows[index[k]]`` with ``weights[k]`` for each ``k`` in turn, in one call: ``total`` a
    float64 vector, ``rows`` a 2-D float32/float64 array of rows of ``total``'s length, ``index`` int64 and
    ``weights`` float64 of one length. Each element is summed in the same order with the same operations as by
    those calls one by one, so the result has the same bits (a batch of 1,000 clients' rows folded without 1,000
    calls from Python)."""
    for k in range(index.size):
        row = index[k]
        weight = weights[k]
        for i in range(total.size):
            total[i] += weight * np.float64(rows[row, i])


@njit(nogil=True, fastmath={"reassoc"})
def all_finite(block: np.ndarray) -> bool:  # pragma: no cover - compiled
    """True when no element of the float32/float64 ``block`` is NaN or infinite.

    ``v - v`` is 0 for a finite ``v`` and NaN for NaN and ±inf, so the sum of ``v - v`` over the block is 0 exactly
    when every element is finite, in whatever order it is summed: the one fast-math flag, ``reassoc``, lets LLVM
    sum it in SIMD lanes (11x faster than an element-by-element test with an early exit: 8 against 88 us for
    157,000 float32 elements). Without ``nnan``/``ninf`` LLVM may not fold ``v - v`` to 0.
    """
    total = block.dtype.type(0)
    for i in range(block.size):
        total += block[i] - block[i]
    return total == 0


@njit(nogil=True)
def squared_distance(update: np.ndarray, reference: np.ndarray) -> float:  # pragma: no cover - compiled
    """``sum((float64(update[i]) - float64(reference[i]))**2)`` over two equal-length float32/float64 blocks."""
    total = 0.0
    for i in range(update.size):
        d = np.float64(update[i]) - np.float64(reference[i])
        total += d * d
    return total


@njit(nogil=True)
def _select(a: np.ndarray, lo: int, hi: int, kth: int) -> None:  # pragma: no cover - compiled
    """Reorder ``a[lo:hi]`` so that ``a[kth]`` holds the value of that rank, no larger value before it and no
    smaller one after it (Hoare's quickselect, median-of-three pivot; no randomness)."""
    hi -= 1
    while hi > lo:
        mid = (lo + hi) // 2
        if a[mid] < a[lo]:
            a[mid], a[lo] = a[lo], a[mid]
        if a[hi] < a[lo]:
            a[hi], a[lo] = a[lo], a[hi]
        if a[hi] < a[mid]:
            a[hi], a[mid] = a[mid], a[hi]
        pivot = a[mid]
        i, j = lo, hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while a[j] > pivot:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if kth <= j:
            hi = j
        elif kth >= i:
            lo = i
        else:
            return


@njit(nogil=True)
def quantize_into(  # pragma: no cover - compiled
    values: np.ndarray,
    dither: np.ndarray,
    clip: float,
    scale: float,
    levels: np.uint64,
    weight: np.uint64,
    out: np.ndarray,
) -> None:
    """SecAgg+'s stochastic quantization of one block in one pass (``privacy.secagg.quantize.quantize_block``'s
    numpy steps, rounded the same way bit for bit): for float32/float64 ``values`` and uint32 ``dither`` words,
    ``out[i] = weight * min(floor(y) + [d_i / 2^32 < y - floor(y)], levels)`` with ``y = (clip(x_i, -c, c) + c)
    * scale``, written to the unsigned ``out`` (``weight * levels`` fits it: the caller's bit budget)."""
    top = np.float64(levels)
    for i in range(values.size):
        y = float(values[i])
        if y < -clip:
            y = -clip
        elif y > clip:
            y = clip
        y = (y + clip) * scale
        whole = np.floor(y)
        up = np.float64(dither[i]) * (1.0 / 4294967296.0) < y - whole
        if whole > top:
            whole = top
        q = np.uint64(whole)
        if up:
            q += np.uint64(1)
        if q > levels:
            q = levels
        out[i] = q * weight


_TILE = 32
"""Columns transposed at a time by :func:`trimmed_mean_columns` (a tile of 32 x clients float64 stays in L1/L2)."""


@njit(nogil=True)
def trimmed_mean_columns(values: np.ndarray, trim: int, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[j]`` = mean of column ``j`` of the float64 ``values`` (clients x elements) without its ``trim``
    smallest and ``trim`` largest entries; ``trim = (n - 1) // 2`` gives the median (the mean of the two middle
    values for an even ``n``). Needs ``n - 2 * trim >= 1``.

    Columns are transposed a tile at a time (rows read contiguously), then each column is reordered by two
    quickselects and its middle summed in float64, in the order the selection leaves it: that order depends on
    the order of the rows, in the last bits of the sum only.
    """
    n, m = values.shape
    tile = np.empty((_TILE, n))
    keep = n - 2 * trim
    for j0 in range(0, m, _TILE):
        width = min(_TILE, m - j0)
        for i in range(n):
            for c in range(width):
                tile[c, i] = values[i, j0 + c]
        for c in range(width):
            column = tile[c]
            if trim > 0:
                _select(column, 0, n, trim)
                if keep == 2:  # an even median: the other middle value is the smallest above it
                    smallest = trim + 1
                    for i in range(trim + 2, n):
                        if column[i] < column[smallest]:
                            smallest = i
                    column[trim + 1], column[smallest] = column[smallest], column[trim + 1]
                elif keep > 2:
                    _select(column, trim, n, n - trim - 1)
            total = 0.0
            for i in range(trim, n - trim):
                total += column[i]
            out[j0 + c] = total / keep


_MT_N = 624
_MT_M = 397


@njit(nogil=True)
def torch_randperms(  # pragma: no cover - compiled
    seeds: np.ndarray, counts: np.ndarray, epochs: np.ndarray, out: np.ndarray
) -> None:
    """Each client's ``epochs[c]`` permutations of ``range(counts[c])``, as ``torch.randperm(counts[c],
    generator=g)`` draws them one after another from ``g = torch.Generator().manual_seed(seeds[c])`` on the CPU,
    written one after another into the int64 ``out`` (client by client, epoch by epoch; ``out`` holds
    ``sum(counts * epochs)`` entries). ``seeds``, ``counts`` and ``epochs`` are int64 arrays of one length, counts
    below ``2**32 / 20``.

    The stream follows ATen's CPU generator and its ``randperm`` for such counts: MT19937 (Matsumoto & Nishimura,
    1998; seeded by ``init_genrand`` with the seed's low 32 bits, 32-bit outputs) and a forward Fisher-Yates
    shuffle of the identity that swaps entry ``i`` with entry ``i + random() % (n - i)``. The generator's state is
    seeded and regenerated word by word as outputs are taken (regenerating word ``k`` in place reads word ``k + 1``
    before its own regeneration and word ``k + 397`` after it exactly when the whole-block step does), so a client
    that takes 59 outputs costs about 520 word updates, not 1,248. :mod:`simulations.shuffle` checks the stream
    against the installed torch before relying on it.
    """
    state = np.empty(_MT_N, dtype=np.uint64)
    mask = np.uint64(0xFFFFFFFF)
    upper, lower, matrix = np.uint64(0x80000000), np.uint64(0x7FFFFFFF), np.uint64(0x9908B0DF)
    position = 0
    for c in range(seeds.size):
        n = counts[c]
        if n <= 0 or epochs[c] <= 0:
            continue
        state[0] = np.uint64(seeds[c]) & mask
        ready = 1  # words seeded so far
        k = 0  # the next word to regenerate and output
        for _ in range(epochs[c]):
            for i in range(n):
                out[position + i] = i
            for i in range(n - 1):
                far = k + _MT_M if k + _MT_M < _MT_N else k + _MT_M - _MT_N
                need = far + 1 if k + _MT_M < _MT_N else _MT_N
                while ready < need:
                    previous = state[ready - 1] ^ (state[ready - 1] >> np.uint64(30))
                    state[ready] = (np.uint64(1812433253) * previous + np.uint64(ready)) & mask
                    ready += 1
                after = k + 1 if k + 1 < _MT_N else 0
                y = (state[k] & upper) | (state[after] & lower)
                word = state[far] ^ (y >> np.uint64(1))
                if y & np.uint64(1):
                    word ^= matrix
                state[k] = word
                k = after
                word ^= word >> np.uint64(11)
                word ^= (word << np.uint64(7)) & np.uint64(0x9D2C5680)
                word ^= (word << np.uint64(15)) & np.uint64(0xEFC60000)
                word ^= word >> np.uint64(18)
                z = i + np.int64(word % np.uint64(n - i))
                out[position + i], out[position + z] = out[position + z], out[position + i]
            position += n


@njit(nogil=True)
def batch_rows(  # pragma: no cover - compiled
    drawn: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    per_epoch: np.ndarray,
    steps: np.ndarray,
    firsts: np.ndarray,
    out: np.ndarray,
) -> None:
    """Lay the clients' shuffles out as the rows each client's mini-batch takes at each step: for client ``c`` with
    ``counts[c]`` samples (its rows ``firsts[c] + i``), ``per_epoch[c] >= 1`` batches an epoch and ``steps[c]``
    steps, whose permutations lie one epoch after another from ``drawn[starts[c]]``, step ``t`` takes positions
    ``(t mod per_epoch[c]) * B + j`` of the permutation of epoch ``t div per_epoch[c]``, ``B = out.shape[2]``:
    ``out[c, t, j] = firsts[c] + drawn[...]`` where that position is below ``counts[c]`` and ``t < steps[c]``, and
    0 elsewhere (a partial batch's padding, never read). ``out`` is int64 ``(clients, width, B)``, every other
    array int64 ``(clients,)`` except ``drawn``."""
    clients, width, batch = out.shape
    for c in range(clients):
        n, per, first = counts[c], per_epoch[c], firsts[c]
        for t in range(width):
            if t >= steps[c]:
                for j in range(batch):
                    out[c, t, j] = 0
                continue
            position = (t % per) * batch
            base = starts[c] + (t // per) * n + position
            for j in range(batch):
                out[c, t, j] = drawn[base + j] + first if position + j < n else 0


def warm_up() -> None:
    """Compile the kernels for float32 and float64 updates now (a server calls this before it listens, so the
    first round's fold does not hold the GIL for a compile while heartbeats wait)."""
    total = np.zeros(1)
    for dtype in FUSED_DTYPES:
        for writeable in (True, False):  # updates mapped from spill files are read-only: their own signature
            block = np.ones(1, dtype=dtype)
            block.flags.writeable = writeable
            fold_block(total, block, 1.0)
            all_finite(block)
            squared_distance(block, block)
    trimmed_mean_columns(np.zeros((3, 2)), 1, np.zeros(2))
