"""Partitioners: coverage, sizes, skew, limits and reproducibility, with numbers checked by hand."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pandas as pd
import pytest

import simulations.partition as partition_mod
from fedcore.errors import ConfigError, PartitionError
from simulations.partition import (
    dirichlet_class_centric,
    dirichlet_client_centric,
    iid,
    natural,
    partition,
    pathological_shards,
    quantity_skew,
)

BALANCED = np.repeat(np.arange(10, dtype=np.int64), 6000)  # label-sorted, 6000 per class


def assert_exact_cover(parts: list[npt.NDArray[np.int64]], n: int) -> None:
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "each client's indices must be sorted and unique"
    everything = np.concatenate(parts)
    assert everything.size == n
    np.testing.assert_array_equal(np.sort(everything), np.arange(n))


def classes_present(labels: npt.NDArray[np.int64], parts: list[npt.NDArray[np.int64]]) -> list[int]:
    return [len(np.unique(labels[p])) for p in parts]


def mean_tv(labels: npt.NDArray[np.int64], parts: list[npt.NDArray[np.int64]], num_classes: int = 10) -> float:
    glob = np.bincount(labels, minlength=num_classes) / labels.size
    tvs = [0.5 * np.abs(np.bincount(labels[p], minlength=num_classes) / p.size - glob).sum() for p in parts]
    return float(np.mean(tvs))


ALL_METHODS = [
    ("iid", {}),
    ("dirichlet", {"alpha": 0.5}),
    ("dirichlet-client", {"alpha": 0.5}),
    ("shards", {"shards_per_client": 2}),
    ("quantity", {"sigma": 1.0}),
]


@pytest.mark.parametrize(("method", "params"), ALL_METHODS)
def test_every_index_exactly_once(method: str, params: dict[str, float]) -> None:
    parts = partition(BALANCED, method, 100, seed=3, **params)
    assert len(parts) == 100
    assert_exact_cover(parts, BALANCED.size)


@pytest.mark.parametrize(("method", "params"), ALL_METHODS)
def test_same_seed_same_partition_other_seed_differs(method: str, params: dict[str, float]) -> None:
    labels = BALANCED[::10]
    a = partition(labels, method, 20, seed=7, **params)
    b = partition(labels, method, 20, seed=7, **params)
    c = partition(labels, method, 20, seed=8, **params)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_iid_sizes_and_mix_on_sorted_labels() -> None:
    parts = iid(BALANCED, 7, seed=0)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == 60000
    assert classes_present(BALANCED, parts) == [10] * 7
    assert mean_tv(BALANCED, parts) < 0.02
    # an int N works as well and gives the same split
    assert all(np.array_equal(x, y) for x, y in zip(parts, iid(60000, 7, seed=0), strict=True))


def test_shards_follow_fedavg_paper() -> None:
    parts = pathological_shards(BALANCED, 100, seed=0, shards_per_client=2)
    assert [p.size for p in parts] == [600] * 100  # two shards of 300 each
    assert max(classes_present(BALANCED, parts)) <= 2
    # classes hold 6000 = 20 shards each, so shards never straddle a class: per-class counts are 300 or 600
    per_class = np.stack([np.bincount(BALANCED[p], minlength=10) for p in parts])
    assert set(np.unique(per_class).tolist()) <= {0, 300, 600}
    # a shard's 300 samples are a seeded random subset of its class, not the first 300 indices
    assert not all(np.array_equal(p[:300] % 6000, np.arange(300)) for p in parts)


def test_shards_uneven_count_still_covers() -> None:
    labels = np.arange(103) % 4
    parts = pathological_shards(labels, 5, seed=1, shards_per_client=2)
    assert_exact_cover(parts, 103)
    assert {p.size for p in parts} <= {20, 21, 22}


def test_quantity_sizes_sum_and_minimum() -> None:
    parts = quantity_skew(1000, 50, seed=2, sigma=2.0, min_partition_size=5)
    sizes = np.array([p.size for p in parts])
    assert sizes.sum() == 1000
    assert sizes.min() >= 5
    assert sizes.max() > 3 * np.median(sizes)  # sigma=2 is strongly skewed
    assert_exact_cover(parts, 1000)
    flat = quantity_skew(1000, 50, seed=2, sigma=0.0)
    assert {p.size for p in flat} == {20}


def test_dirichlet_large_alpha_is_near_iid() -> None:
    parts = dirichlet_class_centric(BALANCED, 100, seed=0, alpha=1000.0)
    assert mean_tv(BALANCED, parts) < 0.1
    assert np.mean(classes_present(BALANCED, parts)) == 10


def test_dirichlet_small_alpha_is_skewed() -> None:
    parts = dirichlet_class_centric(BALANCED, 100, seed=0, alpha=0.05, min_partition_size=1)
    assert min(p.size for p in parts) >= 1
    assert np.mean(classes_present(BALANCED, parts)) <= 3
    assert mean_tv(BALANCED, parts) > 0.6


def test_dirichlet_impossible_minimum_fails_fast() -> None:
    labels = np.arange(50) % 5
    with pytest.raises(PartitionError, match="min_partition_size"):
        dirichlet_class_centric(labels, 10, seed=0, alpha=0.5, min_partition_size=10)


def test_dirichlet_redraw_limit_raises_promptly() -> None:
    labels = np.arange(100) % 10  # a minimum of 10 on 10 clients needs a perfectly even draw
    start = time.perf_counter()
    with pytest.raises(PartitionError, match=r"in 7 draws.*smallest.*larger alpha"):
        dirichlet_class_centric(labels, 10, seed=0, alpha=0.1, min_partition_size=10, max_redraws=7)
    assert time.perf_counter() - start < 2.0


def test_dirichlet_redraw_then_succeeds() -> None:
    parts = dirichlet_class_centric(BALANCED[::10], 20, seed=4, alpha=0.3, min_partition_size=40)
    assert min(p.size for p in parts) >= 40
    assert_exact_cover(parts, 6000)


def test_client_centric_skew_follows_alpha() -> None:
    skewed = dirichlet_client_centric(BALANCED, 100, seed=0, alpha=0.1)
    mixed = dirichlet_client_centric(BALANCED, 100, seed=0, alpha=1000.0)
    assert [p.size for p in skewed] == [600] * 100
    assert np.mean(classes_present(BALANCED, skewed)) < 3
    assert mean_tv(BALANCED, mixed) < 0.1


def test_client_centric_exhausted_classes_never_nan() -> None:
    # two tiny classes and one big one: the tiny ones run out early while clients still want them
    labels = np.array([0] * 3 + [1] * 2 + [2] * 500, dtype=np.int64)
    with np.errstate(all="raise"):  # a 0/0 renormalization would raise here
        parts = dirichlet_client_centric(labels, 50, seed=0, alpha=0.01)
    assert [p.size for p in parts] == [11] * 5 + [10] * 45
    assert_exact_cover(parts, labels.size)


def test_client_centric_fixed_size_leaves_rest_unassigned() -> None:
    parts = dirichlet_client_centric(BALANCED[::100], 10, seed=0, alpha=1.0, samples_per_client=50)
    assert [p.size for p in parts] == [50] * 10
    assert np.unique(np.concatenate(parts)).size == 500
    with pytest.raises(PartitionError, match="exceeds"):
        dirichlet_client_centric(BALANCED[::100], 10, seed=0, alpha=1.0, samples_per_client=61)


def test_natural_split_by_column() -> None:
    table = pd.DataFrame(
        {"hospital": ["va", "cleveland", "va", "hungary", "cleveland", "va"], "age": [50, 60, 40, 55, 65, 70]}
    )
    parts, names = natural(table, "hospital")
    assert names == ["cleveland", "hungary", "va"]
    assert [p.tolist() for p in parts] == [[1, 4], [3], [0, 2, 5]]
    with pytest.raises(ConfigError, match="not in the table"):
        natural(table, "site")
    with pytest.raises(PartitionError, match="missing"):
        natural(pd.DataFrame({"site": ["a", None]}), "site")


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: iid(10, 0, seed=0), ConfigError, "num_clients must be >= 1"),
        (lambda: iid(10, 11, seed=0), PartitionError, "11 clients"),
        (lambda: dirichlet_class_centric(BALANCED, 10, seed=0, alpha=0.0), ConfigError, "alpha"),
        (lambda: dirichlet_client_centric(BALANCED, 10, seed=0, alpha=-1.0), ConfigError, "alpha"),
        (lambda: dirichlet_class_centric(BALANCED, 10, seed=0, alpha=1.0, max_redraws=0), ConfigError, "max_redraws"),
        (lambda: pathological_shards(np.arange(10), 6, seed=0), PartitionError, "12 shards"),
        (lambda: quantity_skew(10, 5, seed=0, sigma=-1.0), ConfigError, "sigma"),
        (lambda: quantity_skew(10, 5, seed=0, min_partition_size=3), PartitionError, "min_partition_size"),
        (lambda: iid(np.zeros((4, 2), dtype=np.int64), 2, seed=0), ConfigError, "1-D"),
        (
            lambda: quantity_skew(1000.0, 2, seed=0),
            ConfigError,
            r"or the number of samples \(an integer\), got 1000\.0",
        ),
        (lambda: iid(True, 1, seed=0), ConfigError, r"or the number of samples \(an integer\), got True"),
        (lambda: pathological_shards(np.linspace(0, 1, 10), 2, seed=0), ConfigError, "integers"),
        (lambda: partition(BALANCED, "label-flip", 10, seed=0), ConfigError, "dirichlet-client"),
        (lambda: partition(BALANCED, "dirichlet", 10, seed=0, alpah=1.0), ConfigError, "bad parameters"),
    ],
)
def test_invalid_inputs_raise_clear_errors(call: Callable[[], object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    ("method", "params", "match"),
    [
        ("dirichlet", {"alpha": "0.5"}, "alpha must be a finite number > 0, got '0.5'"),
        ("dirichlet-client", {"alpha": None}, "alpha must be a finite number > 0, got None"),
        ("dirichlet", {"alpha": True}, "alpha must be a finite number > 0, got True"),
        ("shards", {"shards_per_client": 2.5}, "shards_per_client must be an integer, got 2.5"),
        ("shards", {"shards_per_client": True}, "shards_per_client must be an integer, got True"),
        ("dirichlet", {"alpha": 1.0, "min_partition_size": float("nan")}, "min_partition_size must be an integer"),
        ("dirichlet", {"alpha": 1.0, "max_redraws": 1.5}, "max_redraws must be an integer, got 1.5"),
        ("dirichlet-client", {"alpha": 1.0, "samples_per_client": float("nan")}, "samples_per_client must be an int"),
        ("dirichlet-client", {"alpha": 1.0, "samples_per_client": 2.5}, "samples_per_client must be an integer"),
        ("quantity", {"min_partition_size": 1.5}, "min_partition_size must be an integer, got 1.5"),
        ("quantity", {"sigma": "1"}, "sigma must be a finite number >= 0, got '1'"),
        ("quantity", {"sigma": 1e308}, r"sigma=1e\+308 is too large"),
    ],
)
def test_parameters_of_the_wrong_type_are_refused_by_name(method: str, params: dict[str, object], match: str) -> None:
    """A library caller's NaN or 2.5 shard count was truncated (2.5 samples each gave 2), gave every client 0
    samples (samples_per_client NaN), failed inside numpy (AxisError, TypeError) or ran 100 futile redraws; a sigma
    whose draws overflow failed with an internal "sizes summing to 100 for 1000 samples"."""
    with pytest.raises(ConfigError, match=match):
        partition(BALANCED, method, 10, seed=0, **params)


@pytest.mark.parametrize("seed", [1.5, "7", True, None], ids=["float", "str", "bool", "none"])
def test_a_seed_that_is_not_an_integer_is_refused(seed: object) -> None:
    """1.5 was cut to 1 (the partition of seed 1, without a word) and '7' failed with a bare ValueError."""
    with pytest.raises(ConfigError, match="a seed must be an integer"):
        partition(BALANCED, "iid", 10, seed=seed)  # type: ignore[arg-type]


def test_a_numpy_integer_seed_is_the_same_seed() -> None:
    numpy_seed = partition(BALANCED, "iid", 10, seed=np.int64(3))  # type: ignore[arg-type]
    assert all(np.array_equal(a, b) for a, b in zip(numpy_seed, partition(BALANCED, "iid", 10, seed=3), strict=True))


def test_quantity_skew_with_huge_sigma_still_assigns_every_sample_once() -> None:
    """lognormal(0, 300) overflows float64; the weights must be normalized in log space."""
    parts = partition_mod.quantity_skew(1438, 10, 0, sigma=300.0, min_partition_size=1)
    merged = np.concatenate(parts)
    assert len(merged) == 1438 and len(np.unique(merged)) == 1438
    assert min(len(p) for p in parts) >= 1


def test_client_centric_gets_more_skewed_as_alpha_shrinks() -> None:
    """When a client's dominant class runs out, its fallback mix must stay skewed, not revert to the prior."""
    from simulations.report import class_counts, skew_summary

    labels = np.repeat(np.arange(10), 144)

    def tv_distance(alpha: float) -> float:
        parts = partition_mod.dirichlet_client_centric(labels, 10, 0, alpha=alpha)
        return skew_summary(class_counts(labels, parts, 10))["mean_tv_distance"]

    tv = {alpha: tv_distance(alpha) for alpha in (1e-1, 1e-4, 1e-8)}
    assert tv[1e-4] >= tv[1e-1] - 0.05
    assert tv[1e-8] >= tv[1e-1] - 0.05
    assert tv[1e-8] > 0.7
