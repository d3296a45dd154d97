"""Weighted averages of the clients' reported metrics (pure functions; a metric value never fails a round)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedcore.errors import AggregationError

MAXIMUM_METRICS = frozenset({"sgd_epsilon"})
"""Metrics a round reports as their largest value over its clients, not their example-weighted mean: a privacy
guarantee is the worst client's (DP-SGD's per-client ``sgd_epsilon``, :mod:`privacy.dp.sgd`). A client's epsilon
only grows, so the running maximum of the column over the rounds is the run's guarantee."""


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
    if type(value) is float:  # the common case, first: every round reads a few metrics of every client
        return value
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


@dataclass(frozen=True)
class MetricColumns:
    """Several clients' reports as columns (a batch of clients trained together,
    :class:`~fedcore.messages.FitBatchRes`), for :func:`weighted_metrics` to read a column at a time.

    Attributes:
        num_examples: int64 ``(clients,)``: each client's example count.
        metrics: ``name -> float64 (clients,)``: each client's value, NaN where the client reports none.
    """

    num_examples: np.ndarray
    metrics: Mapping[str, np.ndarray]


def weighted_metrics(results: Iterable[tuple[int, Mapping[str, object]] | MetricColumns]) -> MetricAverages:
    """Average each metric over the clients that report it, weighted by their example counts; a metric named in
    :data:`MAXIMUM_METRICS` (a privacy guarantee) gets the largest reported value instead.

    A metric value never makes this fail: a value that is not a finite real number (NaN, Inf, a string, None;
    see :func:`metric_value`), or any value of a report whose example count is not a positive integer (0 for
    a client with an empty test split, whose loss is NaN), is left out of that metric's average and counted in
    ``left_out``; so is a value under a name that is not a string. The other reports' average is unaffected.
    Each average is the exactly rounded sum of the products ``value * weight`` (:func:`weighted_average`), so a
    batch's clients given as :class:`MetricColumns` average to the very bits of the same reports one by one.

    Args:
        results: ``(num_examples, {metric: value})`` per client, e.g. ``[(10, {"acc": 0.5}), (30, {"acc": 0.9})]``
            gives ``MetricAverages(values={"acc": 0.8}, left_out=0)``, or several clients' as
            :class:`MetricColumns` (a NaN there is a value not reported, not one left out).

    Returns:
        The averages and the count of left-out values (:class:`MetricAverages`).
    """
    values: dict[str, list[float]] = {}
    weights: dict[str, list[float]] = {}
    left_out = 0
    for report in results:
        if isinstance(report, MetricColumns):
            left_out += _add_columns(report, values, weights)
            continue
        num_examples, metrics = report
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
        if name in MAXIMUM_METRICS:
            averages[name] = max(kept)
            continue
        try:
            averages[name] = weighted_average(kept, weights[name])
        except AggregationError:  # a mean beyond the float range: leave the metric out
            left_out += len(kept)
    return MetricAverages(values=averages, left_out=left_out)


def _add_columns(columns: MetricColumns, values: dict[str, list[float]], weights: dict[str, list[float]]) -> int:
    """Add a batch's reported values (and their example weights) to ``values`` and ``weights`` as
    :func:`weighted_metrics` adds one report's, a column at a time; return how many were left out."""
    counts = np.asarray(columns.num_examples)
    weight = counts.astype(np.float64)  # as float(int) rounds each count (exact below 2**53)
    usable = (counts > 0) & np.isfinite(weight)
    left_out = 0
    for name, column in columns.metrics.items():
        reported = ~np.isnan(column)
        kept = reported & usable & np.isfinite(column) if isinstance(name, str) else np.zeros_like(reported)
        left_out += int(np.count_nonzero(reported & ~kept))
        if kept.any():
            values.setdefault(name, []).extend(column[kept].tolist())
            weights.setdefault(name, []).extend(weight[kept].tolist())
    return left_out
