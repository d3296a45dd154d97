"""Metric averaging never fails a round: every kind of bad value is left out of its average and counted."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcore.aggregation import (
    MetricAverages,
    MetricColumns,
    example_weight,
    metric_value,
    weighted_average,
    weighted_metrics,
)


def test_non_finite_values_are_left_out_and_the_rest_averaged_by_examples() -> None:
    # the first case: one client's AUC is NaN (its data hold a single class)
    # auc: only c0 and c2 count: (100·0.8 + 300·0.6) / 400 = 260 / 400 = 0.65
    # loss: all three: (100·1 + 50·2 + 300·3) / 450 = 1100 / 450
    got = weighted_metrics(
        [
            (100, {"auc": 0.8, "loss": 1.0}),
            (50, {"auc": math.nan, "loss": 2.0}),
            (300, {"auc": 0.6, "loss": 3.0}),
            (10, {"auc": math.inf, "loss": -math.inf}),
        ]
    )
    assert got.values == {"auc": pytest.approx(0.65, rel=1e-15), "loss": pytest.approx(1100 / 450, rel=1e-15)}
    assert got.left_out == 3


def test_zero_example_reports_are_left_out_whatever_they_hold() -> None:
    # the second case: a client with an empty test split reports loss NaN with 0 examples
    got = weighted_metrics([(0, {"loss": math.nan, "accuracy": 0.0}), (40, {"loss": 0.5, "accuracy": 0.75})])
    assert got == MetricAverages(values={"loss": 0.5, "accuracy": 0.75}, left_out=2)
    # all reports weightless: no average at all, and no error
    assert weighted_metrics([(0, {"loss": math.nan})]) == MetricAverages(values={}, left_out=1)
    assert weighted_metrics([]) == MetricAverages(values={}, left_out=0)


@pytest.mark.parametrize(
    ("count", "counts"),
    [(-5, False), (True, False), (2.5, False), ("7", False), (None, False), (10**400, False), (np.int64(4), True)],
)
def test_report_weights_that_are_not_positive_integers_leave_the_report_out(count: object, counts: bool) -> None:
    # (4·1 + 4·3) / 8 = 2 when the odd report counts with weight 4; else only the first: 1
    got = weighted_metrics([(4, {"m": 1.0}), (count, {"m": 3.0})])  # type: ignore[list-item]
    assert got == (MetricAverages({"m": 2.0}, 0) if counts else MetricAverages({"m": 1.0}, 1))


def test_values_of_every_kind() -> None:
    assert metric_value(True) == 1.0 and metric_value(np.bool_(False)) == 0.0
    assert metric_value(np.float32(0.5)) == 0.5 and metric_value(np.array(2.0)) == 2.0
    assert metric_value(torch.tensor(0.25)) == 0.25
    assert metric_value(10**400) == math.inf and metric_value(-(10**400)) == -math.inf
    for bad in ("0.5", b"1", None, [1.0], {"a": 1}, np.array([1.0]), torch.tensor([1.0, 2.0]), 1 + 2j):
        assert metric_value(bad) is None, bad
    # bools average as 0/1; strings, None and huge values are left out; a non-str name too
    got = weighted_metrics(
        [
            (1, {"ok": True, "s": "high", "n": None, "h": 10**400, 3: 1.0}),  # type: ignore[dict-item]  # non-str name
            (3, {"ok": False, "s": 2.0, "n": 4.0, "h": 1e308}),
        ]
    )
    assert got.values == {"ok": 0.25, "s": 2.0, "n": 4.0, "h": 1e308}
    assert got.left_out == 4
    assert weighted_metrics([(3, None), (1, {"a": 1.0})]) == MetricAverages({"a": 1.0}, 1)  # type: ignore[list-item]


def test_averages_near_the_float_limit_do_not_overflow() -> None:
    # 1e308·100 + 1e308·300 overflows; the mean is 1e308
    assert weighted_average([1e308, 1e308], [100, 300]) == pytest.approx(1e308, rel=1e-15)
    assert weighted_average([1e308, -1e308], [1, 3]) == pytest.approx(-0.5e308, rel=1e-15)
    assert weighted_average([2.0, 4.0], [1e308, 1e308]) == pytest.approx(3.0, rel=1e-15)  # weights sum to inf
    assert weighted_metrics([(1, {"x": 1.7e308}), (1, {"x": 1.7e308})]).values == {"x": pytest.approx(1.7e308)}
    # products of both signs beyond the range (1e309 and -3e309): fsum's inf - inf, not a crash
    assert weighted_average([1e308, -1e308], [10, 30]) == pytest.approx(-0.5e308, rel=1e-15)
    both_signs = weighted_metrics([(10, {"x": 1e308}), (30, {"x": -1e308, "y": 1.0})])
    assert both_signs.values == {"x": pytest.approx(-0.5e308, rel=1e-15), "y": 1.0}
    assert both_signs.left_out == 0


def test_example_weight() -> None:
    assert example_weight(3) == 3.0 and example_weight(np.int32(2)) == 2.0
    for bad in (0, -1, True, 1.0, "3", None, 10**400):
        assert example_weight(bad) is None


def test_a_batch_as_columns_averages_to_the_bits_of_its_reports_one_by_one() -> None:
    """A batch's reports as columns (NaN: not reported) give the very averages and left-out count of the same reports
    one by one, mixed with other clients' in any order: each average is an exactly rounded sum."""
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 50, size=40)
    counts[:3] = 0  # a count of 0: every value of that report is left out
    loss = rng.random(40) * 3
    loss[5], loss[6], loss[7] = np.nan, np.inf, -np.inf  # not reported; two values left out
    seconds = rng.random(40)
    columns = MetricColumns(counts.astype(np.int64), {"train_loss": loss, "fit_seconds": seconds})
    rows = [
        (n, {name: float(column[k]) for name, column in columns.metrics.items() if not np.isnan(column[k])})
        for k, n in enumerate(counts.tolist())
    ]
    others = [(7, {"train_loss": 0.25, "accuracy": 0.5}), (0, {"fit_seconds": 1.0}), (3, {"train_loss": math.nan})]
    want = weighted_metrics([*others, *rows])
    got = weighted_metrics([*others, columns])
    assert got.values == want.values  # exact: every bit
    assert got.left_out == want.left_out == 1 + 1 + 2 + 3 * 2  # others' NaN and count 0; inf, -inf; 3 reports of 0
    assert list(got.values) == ["train_loss", "accuracy", "fit_seconds"]
    assert weighted_metrics([MetricColumns(np.zeros(0, dtype=np.int64), {"x": np.zeros(0)})]) == MetricAverages({}, 0)


def test_a_privacy_guarantee_is_the_largest_reported_not_the_mean() -> None:
    """DP-SGD's per-client epsilon: the round's value was the example-weighted mean (3.41 where a client that had
    trained in every round was at 4.96); the guarantee is the worst client's."""
    reports = [(10, {"sgd_epsilon": 1.5, "acc": 0.5}), (30, {"sgd_epsilon": 4.96, "acc": 0.9}), (60, {"acc": 0.2})]
    merged = weighted_metrics(reports)
    assert merged.values == {"sgd_epsilon": 4.96, "acc": pytest.approx((5 + 27 + 12) / 100)}
    columns = MetricColumns(
        num_examples=np.array([10, 30, 60]),
        metrics={"sgd_epsilon": np.array([1.5, 4.96, np.nan]), "acc": np.array([0.5, 0.9, 0.2])},
    )
    assert weighted_metrics([columns]).values == merged.values
