"""Partition report: counts, skew statistics and the heatmap, checked against hand computations."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fedcore.errors import ConfigError
from simulations.partition import dirichlet_class_centric
from simulations.report import class_counts, colour_limit, format_summary, plot_heatmap, skew_summary

# 8 samples, 3 classes. Client 0 holds indices 0,1,2,5 -> labels 0,0,1,2; client 1 holds 3,4,6,7 -> 1,1,0,0
LABELS = np.array([0, 0, 1, 1, 1, 2, 0, 0])
PARTS = [np.array([0, 1, 2, 5]), np.array([3, 4, 6, 7])]


def test_class_counts_hand_table() -> None:
    table = class_counts(LABELS, PARTS, num_classes=3)
    assert list(table.columns) == [0, 1, 2, "total"]
    assert table.index.name == "client"
    assert table.to_numpy().tolist() == [[2, 1, 1, 4], [2, 2, 0, 4]]


def test_class_counts_keeps_empty_classes_and_clients() -> None:
    table = class_counts(np.array([0, 0, 1]), [np.array([0, 1]), np.array([], dtype=np.int64)], num_classes=4)
    assert table.to_numpy().tolist() == [[2, 0, 0, 0, 2], [0, 0, 0, 0, 0]]
    with pytest.raises(ConfigError, match=r"0\.\.1"):
        class_counts(np.array([0, 2]), [np.array([0])], num_classes=2)


def test_skew_summary_hand_computed() -> None:
    summary = skew_summary(class_counts(LABELS, PARTS, num_classes=3))
    # global p = (4, 3, 1) / 8; client 0 p0 = (2, 1, 1) / 4; client 1 p1 = (2, 2, 0) / 4
    # TV0 = 0.5 (|.5-.5| + |.25-.375| + |.25-.125|) = 0.125; TV1 = 0.5 (0 + .125 + .125) = 0.125
    assert summary["num_clients"] == 2
    assert summary["mean_size"] == 4 and summary["min_size"] == 4 and summary["max_size"] == 4
    assert summary["mean_classes_present"] == 2.5
    assert summary["mean_tv_distance"] == pytest.approx(0.125)
    # JS(p0, p) in bits, m = (p0 + p) / 2 = (.5, .3125, .1875)
    m0 = np.array([0.5, 0.3125, 0.1875])
    js0 = 0.5 * (0.25 * math.log2(0.25 / 0.3125) + 0.25 * math.log2(0.25 / 0.1875)) + 0.5 * (
        0.375 * math.log2(0.375 / 0.3125) + 0.125 * math.log2(0.125 / 0.1875)
    )
    assert m0.sum() == 1.0
    # m1 = (p1 + p) / 2 = (.5, .4375, .0625)
    js1 = 0.5 * (0.5 * math.log2(0.5 / 0.4375)) + 0.5 * (
        0.375 * math.log2(0.375 / 0.4375) + 0.125 * math.log2(0.125 / 0.0625)
    )
    assert summary["mean_js_divergence"] == pytest.approx((js0 + js1) / 2)


def test_skew_summary_extremes() -> None:
    labels = np.array([0, 0, 1, 1])
    disjoint = skew_summary(class_counts(labels, [np.array([0, 1]), np.array([2, 3])], num_classes=2))
    assert disjoint["mean_tv_distance"] == pytest.approx(0.5)
    assert disjoint["mean_js_divergence"] == pytest.approx(
        1.5 - 0.75 * math.log2(3)
    )  # JS((1,0), (.5,.5)), m = (.75,.25)
    same = skew_summary(class_counts(labels, [np.array([0, 2]), np.array([1, 3])], num_classes=2))
    assert same["mean_tv_distance"] == 0.0 and same["mean_js_divergence"] == 0.0


def test_format_summary_lines() -> None:
    text = format_summary(skew_summary(class_counts(LABELS, PARTS, num_classes=3)))
    lines = text.splitlines()
    assert len(lines) == 7
    assert lines[0].split(":") == ["clients                      ", " 2"]
    assert "mean TV distance to global   : 0.125" in lines


def test_heatmap_png_for_100_clients(tmp_path: Path) -> None:
    labels = np.repeat(np.arange(10), 600)
    parts = dirichlet_class_centric(labels, 100, seed=0, alpha=0.3, min_partition_size=1)
    out = plot_heatmap(class_counts(labels, parts, num_classes=10), tmp_path / "nested" / "heatmap.png")
    assert out == tmp_path / "nested" / "heatmap.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000


def test_the_colours_stop_below_a_few_outlying_counts(tmp_path: Path) -> None:
    """99 cells of 10 and one of 1,000: the 99th percentile of the non-zero cells (linear) is 10 + 0.01 * 990 =
    19.9, and 1,000 is over 4x that, so the colours stop there; a table without such an outlier spans them all."""
    counts = np.full((50, 2), 10.0)
    counts[7, 1] = 1000.0
    assert colour_limit(counts) == pytest.approx(19.9)
    counts[7, 1] = 40.0  # 99th percentile 10.3; 40 is under 4x that
    assert colour_limit(counts) is None
    assert colour_limit(np.zeros((3, 2))) is None
    assert colour_limit(np.array([[0.0, 5.0], [500.0, 0.0]])) is None  # two cells: the percentile is near the max
    labels = np.concatenate([np.tile(np.repeat([0, 1], 10), 50), np.zeros(1000, dtype=np.int64)])
    parts = [np.arange(20 * i, 20 * i + 20) for i in range(50)] + [np.arange(1000, 2000)]
    table = class_counts(labels, parts, num_classes=2)
    assert colour_limit(table.drop(columns="total").to_numpy(dtype=float)) == pytest.approx(10.0)
    assert plot_heatmap(table, tmp_path / "outlier.png").read_bytes()[:4] == b"\x89PNG"


def test_heatmap_small_table_annotated(tmp_path: Path) -> None:
    out = plot_heatmap(class_counts(LABELS, PARTS, num_classes=3), tmp_path / "small.png", title="two clients")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_float_labels_and_indices_are_refused_not_truncated() -> None:
    """Labels 0.5 and 1.7 were counted as classes 0 and 1, and index 0.5 as row 0, without a word."""
    from simulations.report import label_counts

    labels = np.array([0, 1, 1])
    with pytest.raises(ConfigError, match="labels must be integers, got dtype float64"):
        class_counts(np.array([0.5, 1.7]), [np.array([0, 1])], 2)
    with pytest.raises(ConfigError, match="client 1's indices must be integers, got dtype float64"):
        class_counts(labels, [np.array([0]), np.array([0.5, 1.7])], 2)
    with pytest.raises(ConfigError, match="client 0's labels must be integers, got dtype float64"):
        label_counts([[0, 1.9]], 2)
    # integer labels of any width and an empty client still count, by hand: client 0 holds 0 and 1, client 1 none
    table = class_counts(labels.astype(np.uint8), [np.array([0, 2], dtype=np.int32), []], 2)
    assert table.to_numpy().tolist() == [[1, 1, 2], [0, 0, 0]]
