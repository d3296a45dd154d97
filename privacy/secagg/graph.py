"""The sharing graph of SecAgg+: a randomly permuted k-regular Harary graph (Bell et al. 2020, §3; Harary 1962).

Clients ``0..n-1`` (positions in the round's participant list) are placed on a ring in a random order drawn
from a public 32-byte seed the server picks; each client's neighbours are the ``k/2`` clients on either side of
it on the ring and, when ``k`` is odd (which needs an even ``n``), the client opposite it. Every client has
exactly ``k`` neighbours and the relation is symmetric. Server and clients compute the same graph from the seed.

The order is a Fisher-Yates shuffle driven by the AES-128-CTR keystream (:func:`~privacy.secagg.crypto.expand`) of a key
derived from the seed (64-bit draws reduced modulo ``i + 1``; the bias is below ``n / 2^64``), so it is reproducible
from the seed and independent of numpy's RNG.
"""

from __future__ import annotations

import numpy as np

from fedcore.errors import ConfigError
from privacy.secagg.crypto import KEY_BYTES, derive, expand

Graph = tuple[tuple[int, ...], ...]
"""``graph[i]``: the sorted neighbours of client ``i``."""


def permutation(n: int, seed: bytes) -> list[int]:
    """A permutation of ``0..n-1`` drawn from ``seed`` (32 bytes)."""
    if len(seed) != KEY_BYTES:
        raise ConfigError(f"secure aggregation: the graph seed has {KEY_BYTES} bytes, got {len(seed)}")
    draws = expand(derive(seed, b"graph-permutation", b""), max(n, 1), np.dtype("<u8")).tolist()
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = draws[i] % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def harary(n: int, k: int, seed: bytes) -> Graph:
    """The neighbours of each of ``n`` clients on the k-regular Harary graph permuted by ``seed``.

    Args:
        n: number of clients (>= 2).
        k: degree, ``1 <= k <= n - 1``, ``n·k`` even.
        seed: 32 public random bytes.

    Returns:
        ``graph[i]``: client ``i``'s ``k`` neighbours, sorted.

    Raises:
        ConfigError: ``k`` outside ``1..n-1``, or ``n·k`` odd (no k-regular graph on n vertices exists).
    """
    if not 1 <= k <= n - 1:
        raise ConfigError(f"secure aggregation: {k} neighbours per client need at least {k + 1} clients, got {n}")
    if (n * k) % 2:
        raise ConfigError(f"secure aggregation: a {k}-regular graph on {n} clients does not exist (n·k must be even)")
    order = permutation(n, seed)
    offsets = [d for j in range(1, k // 2 + 1) for d in (j, -j)]
    if k % 2:
        offsets.append(n // 2)
    graph = []
    position = {client: p for p, client in enumerate(order)}
    for client in range(n):
        p = position[client]
        graph.append(tuple(sorted(order[(p + d) % n] for d in offsets)))
    return tuple(graph)
