"""Partition reports: per-client class counts, skew statistics and a heatmap.

Typical use::

    counts = class_counts(labels, partitions, num_classes=10)
    print(format_summary(skew_summary(counts)))
    plot_heatmap(counts, "runs/partition.png")
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pandas as pd

from fedcore.errors import ConfigError

__all__ = [
    "class_counts",
    "colour_limit",
    "format_size_summary",
    "format_summary",
    "label_counts",
    "plot_heatmap",
    "size_summary",
    "skew_summary",
]

TOTAL = "total"


def class_counts(labels: npt.ArrayLike, partitions: Sequence[npt.ArrayLike], num_classes: int) -> pd.DataFrame:
    """Count each class on each client.

    Args:
        labels: 1-D integer labels in ``0..num_classes-1``, shape ``(N,)``.
        partitions: one index array into ``labels`` per client.
        num_classes: number of classes ``C``.

    Returns:
        int64 DataFrame with one row per client (index ``0..K-1``, named ``"client"``), one column per class
        (``0..C-1``) and a last column ``"total"``.

    Raises:
        ConfigError: ``num_classes < 1``, labels not 1-D, labels or indices not integers, or out of range.
    """
    if num_classes < 1:
        raise ConfigError(f"num_classes must be >= 1, got {num_classes}")
    y = _integers(labels, "labels")
    if y.ndim != 1:
        raise ConfigError(f"labels must be 1-D, got shape {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ConfigError(f"labels must lie in 0..{num_classes - 1}, found {int(y.min())}..{int(y.max())}")
    for client, indices in enumerate(partitions):
        idx = _integers(indices, f"client {client}'s indices")
        if idx.size and (idx.min() < 0 or idx.max() >= y.size):
            raise ConfigError(f"client {client} has indices outside 0..{y.size - 1}")
    return label_counts((y[np.asarray(indices, dtype=np.int64)] for indices in partitions), num_classes)


def _integers(values: npt.ArrayLike, what: str) -> npt.NDArray[np.int64]:
    """``values`` as int64, refusing floats (1.7 would be counted as class 1, index 0.5 as row 0) and bools."""
    array = np.asarray(values)
    if array.size and (array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer)):
        raise ConfigError(f"{what} must be integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def label_counts(client_labels: Iterable[npt.ArrayLike], num_classes: int) -> pd.DataFrame:
    """Count each class on each client from each client's own labels, one client at a time (clients whose data is
    made on demand are never all held at once).

    Args:
        client_labels: per client, its 1-D integer labels in ``0..num_classes-1``.
        num_classes: number of classes ``C``.

    Returns:
        the table of :func:`class_counts`.

    Raises:
        ConfigError: ``num_classes < 1``, or labels that are not integers or out of range.
    """
    if num_classes < 1:
        raise ConfigError(f"num_classes must be >= 1, got {num_classes}")
    rows_list: list[npt.NDArray[np.int64]] = []
    for client, labels in enumerate(client_labels):
        y = _integers(labels, f"client {client}'s labels").reshape(-1)
        if y.size and (y.min() < 0 or y.max() >= num_classes):
            raise ConfigError(f"client {client} has labels outside 0..{num_classes - 1}")
        rows_list.append(np.bincount(y, minlength=num_classes))
    rows = np.stack(rows_list) if rows_list else np.zeros((0, num_classes), dtype=np.int64)
    table = pd.DataFrame(rows, columns=list(range(num_classes)), index=pd.RangeIndex(len(rows), name="client"))
    table[TOTAL] = rows.sum(axis=1)
    return table


def _class_matrix(df: pd.DataFrame) -> npt.NDArray[np.float64]:
    columns = [c for c in df.columns if c != TOTAL]
    return df[columns].to_numpy(dtype=np.float64)


def skew_summary(df: pd.DataFrame) -> dict[str, float]:
    """Summarize how skewed a partition is, from a :func:`class_counts` table.

    Keys (all floats):
        ``num_clients``; ``mean_size``, ``min_size``, ``max_size`` (samples per client);
        ``mean_classes_present`` (classes with at least one sample, averaged over clients);
        ``mean_tv_distance``: mean over non-empty clients of the total-variation distance
        ``0.5 * sum_c |p_k(c) - p(c)|`` between the client's label distribution ``p_k`` and the global one ``p``
        (0 = same mix, 1 = disjoint);
        ``mean_js_divergence``: mean Jensen-Shannon divergence (base 2, in [0, 1]) between ``p_k`` and ``p``.
        Empty clients are left out of the two distance means (NaN if every client is empty).

    Raises:
        ConfigError: the table has no clients.
    """
    if len(df) == 0:
        raise ConfigError("skew_summary needs at least one client")
    counts = _class_matrix(df)
    sizes = counts.sum(axis=1)
    total = counts.sum()
    nonempty = sizes > 0
    if total > 0 and nonempty.any():
        global_dist = counts.sum(axis=0) / total
        local = counts[nonempty] / sizes[nonempty, None]
        tv = 0.5 * np.abs(local - global_dist).sum(axis=1)
        js = np.array([_js_divergence(p, global_dist) for p in local])
        mean_tv, mean_js = float(tv.mean()), float(js.mean())
    else:
        mean_tv = mean_js = float("nan")
    return {
        "num_clients": float(len(df)),
        "mean_size": float(sizes.mean()),
        "min_size": float(sizes.min()),
        "max_size": float(sizes.max()),
        "mean_classes_present": float((counts > 0).sum(axis=1).mean()),
        "mean_tv_distance": mean_tv,
        "mean_js_divergence": mean_js,
    }


def _js_divergence(p: npt.NDArray[np.float64], q: npt.NDArray[np.float64]) -> float:
    """Jensen-Shannon divergence in bits: ``0.5 KL(p||m) + 0.5 KL(q||m)`` with ``m = (p + q) / 2``."""
    m = 0.5 * (p + q)

    def kl(a: npt.NDArray[np.float64]) -> float:
        mask = a > 0
        return float(np.sum(a[mask] * np.log2(a[mask] / m[mask])))

    return 0.5 * kl(p) + 0.5 * kl(q)


_LABELS = {
    "num_clients": "clients",
    "mean_size": "mean client size",
    "min_size": "min client size",
    "max_size": "max client size",
    "mean_classes_present": "mean classes per client",
    "mean_tv_distance": "mean TV distance to global",
    "mean_js_divergence": "mean JS divergence to global",
}


def format_summary(summary: Mapping[str, float]) -> str:
    """Render a :func:`skew_summary` dict as aligned ``label: value`` lines (counts as integers)."""
    width = max(len(_LABELS.get(k, k)) for k in summary) if summary else 0
    lines = []
    for key, value in summary.items():
        label = _LABELS.get(key, key)
        text = f"{value:.0f}" if key in ("num_clients", "min_size", "max_size") else f"{value:.4g}"
        lines.append(f"{label:<{width}} : {text}")
    return "\n".join(lines)


def size_summary(sizes: npt.ArrayLike) -> dict[str, float]:
    """How unequal the clients' sample counts are (quantity skew), e.g. of a natural split.

    Keys (all floats): ``min``, ``p10``, ``median``, ``p90``, ``max`` (samples per client; quantiles by linear
    interpolation), ``mean``, ``cv`` (coefficient of variation: standard deviation / mean), ``gini`` (Gini
    coefficient of the sizes, 0 = equal, towards 1 = a few clients hold almost everything), ``top10_share``
    (the share of all samples held by the largest 10% of clients, at least one client).

    Raises:
        ConfigError: no sizes, a negative size, or sizes that are all zero.
    """
    x = np.sort(np.asarray(sizes, dtype=np.float64).reshape(-1))
    if x.size == 0:
        raise ConfigError("size_summary needs at least one client")
    if x[0] < 0 or not x[-1] > 0:
        raise ConfigError("size_summary needs sizes >= 0, not all zero")
    n, total = x.size, float(x.sum())
    p10, median, p90 = np.percentile(x, [10, 50, 90])
    # Gini of sorted x: sum_i (2i - n - 1) x_i / (n sum x), i = 1..n
    gini = float(np.sum((2 * np.arange(1, n + 1) - n - 1) * x) / (n * total))
    top = max(1, int(np.ceil(0.1 * n)))
    return {
        "min": float(x[0]),
        "p10": float(p10),
        "median": float(median),
        "p90": float(p90),
        "max": float(x[-1]),
        "mean": total / n,
        "cv": float(x.std() / x.mean()),
        "gini": gini,
        "top10_share": float(x[-top:].sum() / total),
    }


def format_size_summary(summary: Mapping[str, float]) -> str:
    """Render a :func:`size_summary` as two lines: the quantiles of samples per client, then the spread."""
    s = summary
    return (
        f"samples per client: min {s['min']:.0f}, p10 {s['p10']:.0f}, median {s['median']:.0f}, p90 {s['p90']:.0f}, "
        f"max {s['max']:.0f} (mean {s['mean']:.1f})\n"
        f"size spread: coefficient of variation {s['cv']:.3g}, Gini {s['gini']:.3f}, the largest 10% of clients "
        f"hold {100 * s['top10_share']:.1f}% of the samples"
    )


CAP_RATIO = 4.0
""":func:`colour_limit` caps the colours when the largest count exceeds this many times the 99th percentile."""


def colour_limit(counts: npt.NDArray[np.float64]) -> float | None:
    """The count at which :func:`plot_heatmap`'s colours stop: the 99th percentile of the non-zero cells of
    ``counts`` (``(clients, classes)``) when the largest cell is over :data:`CAP_RATIO` times it, else None (the
    colours span every count). E.g. 99 cells of 10 and one of 1,000: 19.9 (``numpy.percentile``, linear)."""
    nonzero = counts[counts > 0]
    if nonzero.size == 0:
        return None
    high = float(np.percentile(nonzero, 99))
    return high if float(nonzero.max()) > CAP_RATIO * high else None


def plot_heatmap(df: pd.DataFrame, path: str | os.PathLike[str], title: str | None = None) -> Path:
    """Write a PNG heatmap of a :func:`class_counts` table: clients on y, classes on x, colour = count.

    Uses a standalone Agg figure (no pyplot global state). The figure grows with the number of clients and
    labels at most ~25 client ticks so that 100 or 1000 clients stay readable; counts are written in the cells
    when the table is small (<= 20 clients and <= 20 classes). When a few cells dwarf the rest (lognormal sizes:
    one of 100,000 synthetic devices holds 300,000 examples), the colours stop at :func:`colour_limit` and the
    colour bar says so, instead of one colour for every other cell.

    Returns:
        the path written (parent directories are created).

    Raises:
        ConfigError: the table has no clients or no classes.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts = _class_matrix(df)
    if counts.size == 0:
        raise ConfigError("plot_heatmap needs a table with at least one client and one class")
    num_clients, num_classes = counts.shape
    class_names = [str(c) for c in df.columns if c != TOTAL]

    fig = Figure(figsize=(max(4.0, 0.45 * num_classes + 2.0), min(24.0, max(3.0, 0.12 * num_clients + 1.5))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    top = colour_limit(counts)
    image = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis", vmax=top)
    capped = top is not None
    label = f"samples (colours stop at the 99th percentile, {top:.0f}; max {counts.max():.0f})" if capped else "samples"
    fig.colorbar(image, ax=ax, label=label, extend="max" if capped else "neither")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_xticks(range(num_classes), class_names)
    step = max(1, int(np.ceil(num_clients / 25)))
    ax.set_yticks(range(0, num_clients, step), [str(i) for i in range(0, num_clients, step)])
    if num_clients <= 20 and num_classes <= 20:
        threshold = (top if top is not None else counts.max()) / 2
        for i in range(num_clients):
            for j in range(num_classes):
                colour = "black" if counts[i, j] > threshold else "white"
                ax.text(j, i, f"{counts[i, j]:.0f}", ha="center", va="center", fontsize=7, color=colour)
    ax.set_title(title or f"class counts per client ({num_clients} clients)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
