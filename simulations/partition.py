"""Partitioners: split a dataset's sample indices over simulated clients, IID or non-IID.

Every partitioner is a pure function of ``(labels, num_clients, seed, **params)`` and returns one sorted
``int64`` index array per client. Randomness comes only from :func:`fedcore.seeding.numpy_rng` keyed by the
seed and the method name, so the same arguments always give the same partition.

Methods:

* :func:`iid` — uniform random split, sizes differ by at most one.
* :func:`dirichlet_class_centric` — label skew, per class proportions over clients ~ Dir(alpha).
* :func:`dirichlet_client_centric` — label skew, per client class mix ~ Dir(alpha * prior) (Hsu et al. 2019).
* :func:`pathological_shards` — label-sorted shards, a few per client (McMahan et al. 2017).
* :func:`quantity_skew` — lognormal client sizes, IID labels.
* :func:`natural` — one client per value of a table column (hospital, speaker, device).

Bad parameter values raise :class:`~fedcore.errors.ConfigError`; data that cannot satisfy the constraints
(more clients than samples, minimum size never reached) raises :class:`~fedcore.errors.PartitionError`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from fedcore.errors import ConfigError, PartitionError
from fedcore.seeding import numpy_rng

__all__ = [
    "METHODS",
    "dirichlet_class_centric",
    "dirichlet_client_centric",
    "iid",
    "natural",
    "partition",
    "pathological_shards",
    "quantity_skew",
]

Partition = list[npt.NDArray[np.int64]]


# --------------------------------------------------------------------------------------------------- checks


def _check_int(name: str, value: int, minimum: int) -> None:
    """Refuse a count that is not an integer (a float such as 2.5 or NaN, a bool, a string) or is below ``minimum``:
    the partitioners would otherwise truncate it, fail inside numpy, or hand out empty clients."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


def _check_num_clients(num_clients: int, num_samples: int) -> None:
    _check_int("num_clients", num_clients, 1)
    if num_clients > num_samples:
        raise PartitionError(
            f"cannot give {num_clients} clients at least one sample each from only {num_samples} samples; "
            "use fewer clients or a larger dataset"
        )


def _as_labels(labels: npt.ArrayLike) -> npt.NDArray[np.int64]:
    array = np.asarray(labels)
    if array.ndim != 1:
        raise ConfigError(f"labels must be a 1-D array, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ConfigError(f"labels must be integers (class ids), got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def _num_samples(labels_or_n: int | npt.ArrayLike) -> int:
    if isinstance(labels_or_n, int | np.integer) and not isinstance(labels_or_n, bool):
        if labels_or_n < 0:
            raise ConfigError(f"number of samples must be >= 0, got {labels_or_n}")
        return int(labels_or_n)
    if np.ndim(labels_or_n) == 0:  # 1000.0, True: not "labels must be a 1-D array, got shape ()"
        raise ConfigError(
            f"expected the labels (a 1-D array) or the number of samples (an integer), got {labels_or_n!r}"
        )
    return int(_as_labels(labels_or_n).shape[0])


def _check_number(name: str, value: float, *, zero_ok: bool = False) -> None:
    """Refuse a parameter that is not a real number (a string, None, a bool), not finite, or below zero (or zero,
    unless ``zero_ok``), with one message whatever the fault."""
    real = not isinstance(value, bool) and isinstance(value, int | float | np.integer | np.floating)
    if not real or not np.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0, got {value!r}")


def _finish(parts: list[npt.NDArray[Any]]) -> Partition:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


# ----------------------------------------------------------------------------------------------- partitioners


def iid(labels_or_n: int | npt.ArrayLike, num_clients: int, seed: int) -> Partition:
    """Split ``N`` samples uniformly at random over ``num_clients`` clients.

    Args:
        labels_or_n: the labels (1-D, any length ``N``; only the length is used) or ``N`` itself.
        num_clients: number of clients ``K`` (1 <= K <= N).
        seed: run seed; the draw is keyed by ``(seed, "iid")``.

    Returns:
        ``K`` sorted int64 index arrays covering ``0..N-1`` exactly once; sizes differ by at most one. The
        indices are shuffled first, so label-sorted input still gives IID clients.

    Raises:
        ConfigError: ``num_clients < 1`` or malformed labels.
        PartitionError: ``num_clients > N``.
    """
    n = _num_samples(labels_or_n)
    _check_num_clients(num_clients, n)
    order = numpy_rng(seed, "iid").permutation(n)
    return _finish(np.array_split(order, num_clients))


def dirichlet_class_centric(
    labels: npt.ArrayLike,
    num_clients: int,
    seed: int,
    *,
    alpha: float,
    min_partition_size: int = 10,
    max_redraws: int = 100,
    self_balancing: bool = True,
) -> Partition:
    """Label-skewed split: for each class, its samples go to clients in proportions ``p ~ Dir(alpha * 1_K)``.

    The common scheme (Yurochkin et al. 2019; as in the NIID-Bench and Flower ``DirichletPartitioner``): for each
    class, shuffle its indices, draw ``p``, optionally zero the share of clients that already hold more than
    ``N / K`` samples (``self_balancing``), renormalize, and cut the class at the cumulative proportions. The
    whole draw is repeated while the smallest client has fewer than ``min_partition_size`` samples, at most
    ``max_redraws`` times in all, so it always terminates.

    Small ``alpha`` (e.g. 0.05) gives clients dominated by one or two classes; large ``alpha`` (e.g. 1000) gives
    near-IID clients.

    Args:
        labels: 1-D integer class labels, shape ``(N,)``.
        num_clients: number of clients ``K``.
        seed: run seed; draws are keyed by ``(seed, "dirichlet")``.
        alpha: Dirichlet concentration (> 0).
        min_partition_size: the smallest client size accepted (>= 0).
        max_redraws: the most draws tried (>= 1) before giving up.
        self_balancing: stop giving new samples to clients already above ``N / K``.

    Returns:
        ``K`` sorted int64 index arrays covering ``0..N-1`` exactly once.

    Raises:
        ConfigError: bad ``alpha``, ``num_clients``, ``min_partition_size`` or ``max_redraws``.
        PartitionError: ``K > N``, ``K * min_partition_size > N``, or no draw within ``max_redraws`` reached
            ``min_partition_size`` (the message gives the smallest size reached).
    """
    y = _as_labels(labels)
    n = y.shape[0]
    _check_num_clients(num_clients, n)
    _check_number("alpha", alpha)
    _check_int("min_partition_size", min_partition_size, 0)
    _check_int("max_redraws", max_redraws, 1)
    if num_clients * min_partition_size > n:
        raise PartitionError(
            f"{num_clients} clients x min_partition_size {min_partition_size} = "
            f"{num_clients * min_partition_size} exceeds the {n} samples; lower min_partition_size or num_clients"
        )

    rng = numpy_rng(seed, "dirichlet")
    class_indices = [np.flatnonzero(y == c) for c in np.unique(y)]
    best_min = -1
    for _ in range(max_redraws):
        parts = _dirichlet_class_draw(class_indices, num_clients, n, alpha, self_balancing, rng)
        smallest = min(len(p) for p in parts)
        if smallest >= min_partition_size:
            return _finish(parts)
        best_min = max(best_min, smallest)
    raise PartitionError(
        f"Dirichlet partition (alpha={alpha}, {num_clients} clients, {n} samples) did not give every client "
        f"at least {min_partition_size} samples in {max_redraws} draws; the largest smallest-client size reached "
        f"was {best_min}. Use a larger alpha, a smaller min_partition_size or fewer clients"
    )


def _dirichlet_class_draw(
    class_indices: list[npt.NDArray[np.intp]],
    num_clients: int,
    num_samples: int,
    alpha: float,
    self_balancing: bool,
    rng: np.random.Generator,
) -> list[npt.NDArray[np.intp]]:
    """One class-centric draw; returns unsorted index arrays, one per client."""
    parts: list[list[npt.NDArray[np.intp]]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    cap = num_samples / num_clients
    for members in class_indices:
        members = rng.permutation(members)
        p = rng.dirichlet(np.full(num_clients, alpha))
        if self_balancing:
            p = np.where(sizes < cap, p, 0.0)
        total = p.sum()
        if not np.isfinite(total) or total <= 0:
            # All of the mass fell on full clients (or underflowed to zero): spread over the open ones.
            p = (sizes < cap).astype(np.float64) if self_balancing else np.ones(num_clients)
            total = p.sum()
        cuts = (np.cumsum(p / total) * len(members)).astype(np.int64)[:-1]
        for client, chunk in enumerate(np.split(members, cuts)):
            parts[client].append(chunk)
            sizes[client] += len(chunk)
    return [np.concatenate(chunks) for chunks in parts]


def dirichlet_client_centric(
    labels: npt.ArrayLike,
    num_clients: int,
    seed: int,
    *,
    alpha: float,
    samples_per_client: int | None = None,
) -> Partition:
    """Label-skewed split after Hsu, Qi & Brown 2019: each client's class mix is ``q ~ Dir(alpha * prior)``.

    ``prior`` is the global class frequency vector. Each client then receives its samples drawn class by class
    from ``q`` without replacement; when a class runs out, ``q`` is renormalized over the classes that still
    have samples, and if all of ``q``'s mass sits on exhausted classes the client draws a fresh mix
    ``Dir(alpha * prior)`` over the classes that remain, so a small alpha stays skewed (never a NaN
    probability). Samples are drawn in multinomial batches with the exhausted draws
    redrawn, which has the same distribution as drawing them one by one.

    Args:
        labels: 1-D integer class labels, shape ``(N,)``.
        num_clients: number of clients ``K``.
        seed: run seed; draws are keyed by ``(seed, "dirichlet-client")``.
        alpha: Dirichlet concentration (> 0); small means skewed.
        samples_per_client: samples per client; default ``N // K`` with the ``N % K`` leftover samples given
            one each to the first clients, so that every sample is assigned.

    Returns:
        ``K`` sorted int64 index arrays, disjoint; with the default size they cover ``0..N-1`` exactly once.

    Raises:
        ConfigError: bad ``alpha``, ``num_clients`` or ``samples_per_client``.
        PartitionError: ``K > N`` or ``K * samples_per_client > N``.
    """
    y = _as_labels(labels)
    n = y.shape[0]
    _check_num_clients(num_clients, n)
    _check_number("alpha", alpha)
    if samples_per_client is None:
        sizes = np.full(num_clients, n // num_clients, dtype=np.int64)
        sizes[: n % num_clients] += 1
    else:
        _check_int("samples_per_client", samples_per_client, 1)
        if samples_per_client * num_clients > n:
            raise PartitionError(
                f"{num_clients} clients x {samples_per_client} samples = {samples_per_client * num_clients} "
                f"exceeds the {n} samples; lower samples_per_client or num_clients"
            )
        sizes = np.full(num_clients, samples_per_client, dtype=np.int64)

    rng = numpy_rng(seed, "dirichlet-client")
    classes, counts = np.unique(y, return_counts=True)
    prior = counts / n
    pools = [rng.permutation(np.flatnonzero(y == c)) for c in classes]
    taken = np.zeros(len(classes), dtype=np.int64)  # how many of each pool are handed out
    parts: list[npt.NDArray[np.intp]] = []
    for size in sizes:
        q = rng.dirichlet(alpha * prior)
        if not np.all(np.isfinite(q)):
            q = prior.copy()
        chosen: list[npt.NDArray[np.intp]] = []
        need = int(size)
        while need > 0:
            left = counts - taken
            weights = np.where(left > 0, q, 0.0)
            if not weights.sum() > 0:
                # q's mass is all on exhausted classes: redraw the mix over the remaining classes, keeping
                # its skew (falling back to the prior here would make tiny alphas nearly IID).
                remaining = left > 0
                redrawn = rng.dirichlet(alpha * prior[remaining])
                if not np.all(np.isfinite(redrawn)) or not redrawn.sum() > 0:
                    redrawn = prior[remaining] / prior[remaining].sum()
                q = np.zeros_like(prior)
                q[remaining] = redrawn
                weights = q
            draws = rng.multinomial(need, weights / weights.sum())
            grant = np.minimum(draws, left)
            for c in np.flatnonzero(grant):
                chosen.append(pools[c][taken[c] : taken[c] + grant[c]])
                taken[c] += grant[c]
            need -= int(grant.sum())
        parts.append(np.concatenate(chosen) if chosen else np.empty(0, dtype=np.intp))
    return _finish(parts)


def pathological_shards(labels: npt.ArrayLike, num_clients: int, seed: int, *, shards_per_client: int = 2) -> Partition:
    """Pathological non-IID split of McMahan et al. 2017 (FedAvg): label-sorted shards, a few per client.

    Indices are sorted by label (stable, ties broken by a seeded shuffle), cut into
    ``num_clients * shards_per_client`` contiguous shards, and each client gets ``shards_per_client`` shards
    chosen at random. With 60000 labels, 100 clients and 2 shards per client every shard holds 300 samples, as
    in the paper. If ``N`` is not a multiple of the shard count, the first ``N % shards`` shards hold one extra
    sample so that every sample is still assigned.

    Args:
        labels: 1-D integer class labels, shape ``(N,)``.
        num_clients: number of clients ``K``.
        seed: run seed; draws are keyed by ``(seed, "shards")``.
        shards_per_client: shards per client (>= 1).

    Returns:
        ``K`` sorted int64 index arrays covering ``0..N-1`` exactly once.

    Raises:
        ConfigError: bad ``num_clients`` or ``shards_per_client``.
        PartitionError: fewer samples than shards.
    """
    y = _as_labels(labels)
    n = y.shape[0]
    _check_num_clients(num_clients, n)
    _check_int("shards_per_client", shards_per_client, 1)
    num_shards = num_clients * shards_per_client
    if num_shards > n:
        raise PartitionError(
            f"{num_clients} clients x {shards_per_client} shards = {num_shards} shards but only {n} samples; "
            "use fewer clients or fewer shards per client"
        )
    rng = numpy_rng(seed, "shards")
    shuffled = rng.permutation(n)
    order = shuffled[np.argsort(y[shuffled], kind="stable")]
    shards = np.array_split(order, num_shards)
    assignment = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return _finish([np.concatenate([shards[s] for s in row]) for row in assignment])


def quantity_skew(
    n_or_labels: int | npt.ArrayLike,
    num_clients: int,
    seed: int,
    *,
    sigma: float = 1.0,
    min_partition_size: int = 1,
) -> Partition:
    """Quantity skew: client sizes proportional to ``lognormal(0, sigma)`` draws, samples assigned IID.

    Each client first gets ``min_partition_size`` samples; the remaining ``N - K * min_partition_size`` are
    shared in proportion to the lognormal weights (largest-remainder rounding), so sizes sum to exactly ``N``.

    Args:
        n_or_labels: ``N`` or the labels (only their length is used).
        num_clients: number of clients ``K``.
        seed: run seed; draws are keyed by ``(seed, "quantity")``.
        sigma: lognormal shape (>= 0; 0 gives equal sizes).
        min_partition_size: the smallest client size (>= 0).

    Returns:
        ``K`` sorted int64 index arrays covering ``0..N-1`` exactly once.

    Raises:
        ConfigError: bad ``sigma``, ``num_clients`` or ``min_partition_size``.
        PartitionError: ``K * min_partition_size > N`` or ``K > N``.
    """
    n = _num_samples(n_or_labels)
    _check_num_clients(num_clients, n)
    _check_number("sigma", sigma, zero_ok=True)
    _check_int("min_partition_size", min_partition_size, 0)
    spare = n - num_clients * min_partition_size
    if spare < 0:
        raise PartitionError(
            f"{num_clients} clients x min_partition_size {min_partition_size} exceeds the {n} samples; "
            "lower min_partition_size or num_clients"
        )
    rng = numpy_rng(seed, "quantity")
    # Normalize lognormal(0, sigma) draws in log space: exp(z - max z) never overflows, however large sigma is.
    log_weights = rng.normal(0.0, sigma, num_clients)
    if not np.all(np.isfinite(log_weights)):  # sigma near float64's largest: a draw overflowed to inf
        raise ConfigError(f"sigma={sigma!r} is too large: its normal draws overflow float64; use sigma <= 1e300")
    weights = np.exp(log_weights - log_weights.max())
    shares = weights / weights.sum() * spare
    extra = np.floor(shares).astype(np.int64)
    leftover = spare - int(extra.sum())
    extra[np.argsort(extra - shares, kind="stable")[:leftover]] += 1  # largest fractional parts first
    sizes = extra + min_partition_size
    if int(sizes.sum()) != n or int(sizes.min()) < min_partition_size:  # guard the invariant, never duplicate
        raise PartitionError(f"quantity skew produced sizes summing to {int(sizes.sum())} for {n} samples")
    order = rng.permutation(n)
    return _finish(np.split(order, np.cumsum(sizes)[:-1]))


def natural(table: pd.DataFrame, column: str) -> tuple[Partition, list[str]]:
    """Natural split: one client per distinct value of ``table[column]`` (hospital, speaker, device ...).

    Args:
        table: the dataset as a DataFrame; indices returned are row positions (0..len-1), not index labels.
        column: the column whose values name the clients.

    Returns:
        ``(partitions, names)``: clients in sorted order of the value; ``partitions[i]`` is the sorted int64
        row positions where ``table[column] == names[i]`` (as a string).

    Raises:
        ConfigError: ``column`` is not in the table.
        PartitionError: the table is empty, or the column has missing or unorderable values.
    """
    if column not in table.columns:
        raise ConfigError(f"column {column!r} is not in the table; columns are {list(table.columns)}")
    values = table[column]
    if len(values) == 0:
        raise PartitionError(f"cannot split an empty table by {column!r}")
    if values.isna().any():
        raise PartitionError(
            f"column {column!r} has {int(values.isna().sum())} missing values; drop or fill them before splitting"
        )
    try:
        groups = sorted(values.unique())
    except TypeError as err:
        raise PartitionError(f"column {column!r} mixes values that cannot be ordered: {err}") from err
    array = values.to_numpy()
    parts = [np.flatnonzero(array == g).astype(np.int64) for g in groups]
    return parts, [str(g) for g in groups]


# ----------------------------------------------------------------------------------------------- dispatcher

METHODS: dict[str, Callable[..., Partition]] = {
    "iid": iid,
    "dirichlet": dirichlet_class_centric,
    "dirichlet-client": dirichlet_client_centric,
    "shards": pathological_shards,
    "quantity": quantity_skew,
}


def partition(labels: npt.ArrayLike, method: str, num_clients: int, seed: int, **params: Any) -> Partition:
    """Partition ``labels`` over ``num_clients`` clients with the partitioner named ``method``.

    Names: ``"iid"``, ``"dirichlet"`` (class-centric, needs ``alpha``), ``"dirichlet-client"`` (Hsu et al.,
    needs ``alpha``), ``"shards"`` (McMahan et al.), ``"quantity"`` (lognormal sizes). ``params`` are passed on
    as keyword arguments.

    Raises:
        ConfigError: unknown method or parameters it does not take; plus whatever the partitioner raises.
    """
    try:
        func = METHODS[method]
    except KeyError:
        raise ConfigError(f"unknown partition method {method!r}; choose one of {sorted(METHODS)}") from None
    try:
        inspect.signature(func).bind(labels, num_clients, seed, **params)
    except TypeError as err:
        raise ConfigError(f"bad parameters {sorted(params)} for partition method {method!r}: {err}") from err
    return func(labels, num_clients, seed, **params)
