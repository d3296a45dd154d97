"""Fused element-wise kernels for the streaming aggregator, compiled with numba.

Each kernel does in one pass over a block what numpy would do in two or three (cast, scale, add; or an
all-finite test), so the fold moves each byte of the update once. They release the GIL (``nogil=True``) and
are driven by :mod:`fedcore.aggregation`'s own thread pool, one block per call: numba's threading layer is not
used, so results never depend on thread timing and no OpenMP threads spin while another process holds a core.
No fastmath: ``total[i] + w * float64(u[i])`` is rounded exactly as numpy's cast-multiply-add rounds it.

Compiled on first use in each process (about a second for both, numba's import included), not cached on disk: several
processes (a server and its tests, workers) starting at once would otherwise race on the cache files. For
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
def all_finite(block: np.ndarray) -> bool:  # pragma: no cover - compiled
    """True when no element of the float32/float64 ``block`` is NaN or infinite (``v - v`` is 0 only then)."""
    for i in range(block.size):
        v = block[i]
        if v - v != 0:  # NaN - NaN and inf - inf are NaN, which compares unequal to everything
            return False
    return True


def warm_up() -> None:
    """Compile both kernels for float32 and float64 updates now (a server calls this before it listens, so the
    first round's fold does not hold the GIL for a compile while heartbeats wait)."""
    total = np.zeros(1)
    for dtype in FUSED_DTYPES:
        block = np.ones(1, dtype=dtype)
        fold_block(total, block, 1.0)
        all_finite(block)
