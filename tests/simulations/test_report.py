"""Partition report: counts, skew statistics and the heatmap, checked against hand computations."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fedcore.errors import ConfigError
from simulations.partition import dirichlet_class_centric
from simulations.report import class_counts, format_summary, plot_heatmap, skew_summary

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


def test_heatmap_small_table_annotated(tmp_path: Path) -> None:
    out = plot_heatmap(class_counts(LABELS, PARTS, num_classes=3), tmp_path / "small.png", title="two clients")
    assert out.read_bytes()[:4] == b"\x89PNG"
