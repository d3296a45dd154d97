"""The streaming mean that sums the float32 tensors' differences from the global model in float32
(``WeightedMean(reference=...)``, ``MeanAggregator(delta=True)``): its error against an exact float64 reference,
against the float64 sum it replaces and against flwr's ``aggregate`` (which computes in the updates' float32)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.server.strategy.aggregate import aggregate

from fedcore.aggregation import MeanAggregator, WeightedMean
from fedcore.tensors import NamedArrays, spec_of


def round_of(scale: float, clients: int = 50, seed: int = 0) -> tuple[NamedArrays, list[NamedArrays], np.ndarray]:
    """A global model of N(0, 1) parameters, ``clients`` updates that move it by N(0, scale^2), integer weights."""
    rng = np.random.default_rng(seed)
    x = {"w": rng.normal(size=(400, 250)).astype(np.float32), "b": rng.normal(size=250).astype(np.float32)}
    updates = [
        {n: (a + scale * rng.normal(size=a.shape)).astype(np.float32) for n, a in x.items()} for _ in range(clients)
    ]
    return x, updates, rng.integers(10, 600, clients).astype(np.float64)


def exact_mean(updates: list[NamedArrays], weights: np.ndarray) -> dict[str, np.ndarray]:
    """The weighted mean in float64 from float64 products (the float32 inputs are exact in float64)."""
    return {
        n: sum(w * u[n].astype(np.float64) for u, w in zip(updates, weights, strict=True)) / weights.sum()
        for n in updates[0]
    }


def fold(
    updates: list[NamedArrays], weights: np.ndarray, reference: NamedArrays | None, threads: int = 1
) -> NamedArrays:
    acc = WeightedMean(spec_of(updates[0]), threads=threads, reference=reference)
    for k, (u, w) in enumerate(zip(updates, weights, strict=True)):
        acc.add(u, float(w), client_id=f"c{k}")
    return acc.result(release=True)


@pytest.mark.parametrize("scale", [1e-3, 1e-2, 1e-1])
def test_error_is_bounded_by_the_differences_not_the_parameters(scale: float) -> None:
    x, updates, weights = round_of(scale)
    got = fold(updates, weights, x)
    exact = exact_mean(updates, weights)
    float64_sum = fold(updates, weights, None)
    for name in x:
        assert got[name].dtype == np.float32
        error = np.abs(got[name] - exact[name])
        # the result's own rounding (half a unit in its last place) plus one float32 rounding of D per fold, each
        # at most half a unit of |D| / W <= max_k |u_k - x|
        biggest_step = np.max(np.abs(np.stack([u[name] - x[name] for u in updates])), axis=0)
        bound = 0.5 * np.spacing(np.abs(exact[name]).astype(np.float32)) + len(updates) * np.spacing(biggest_step)
        assert np.all(error <= bound), float(np.max(error / bound))
        # never worse than the float64 sum by more than a float32 unit of the steps
        assert np.max(error) <= np.max(np.abs(float64_sum[name] - exact[name])) + np.max(np.spacing(biggest_step)) * 4
    # measured (seed 0, 50 clients): the float64 sum and the delta sum agree on 99.87% (scale 1e-3), 98.97% (1e-2)
    # and 93.2% (1e-1) of the elements
    same = np.mean(got["w"] == float64_sum["w"])
    assert same > {1e-3: 0.995, 1e-2: 0.98, 1e-1: 0.9}[scale], same


def test_more_accurate_than_flwr_aggregate() -> None:
    x, updates, weights = round_of(1e-2, clients=200)
    got = fold(updates, weights, x)
    exact = exact_mean(updates, weights)
    flwr = aggregate([([u["w"], u["b"]], int(w)) for u, w in zip(updates, weights, strict=True)])
    assert flwr[0].dtype == np.float32  # flwr's aggregate computes in the updates' dtype
    ours, theirs = np.max(np.abs(got["w"] - exact["w"])), np.max(np.abs(flwr[0] - exact["w"]))
    # measured: 2.2e-7 (half a float32 unit of the largest parameters, ~4) against flwr's 2.3e-6
    assert ours < 3e-7 < 1e-6 < theirs


def test_same_bits_whatever_the_thread_count_and_with_or_without_release(monkeypatch: pytest.MonkeyPatch) -> None:
    import fedcore.aggregation.streaming as streaming

    monkeypatch.setattr(streaming, "_BLOCK", 1 << 14)  # blocks small enough for 2 threads on this 100k model
    x, updates, weights = round_of(1e-2, clients=8)
    one = fold(updates, weights, x, threads=1)
    two = fold(updates, weights, x, threads=2)
    acc = WeightedMean(spec_of(x), threads=2, reference=x)
    assert acc.threads == 2
    for u, w in zip(updates, weights, strict=True):
        acc.add(u, float(w))
    kept = acc.result()
    for name in x:
        np.testing.assert_array_equal(one[name], two[name])
        np.testing.assert_array_equal(one[name], kept[name])


def test_identical_updates_average_to_within_a_unit_of_themselves_and_the_reference_is_not_written() -> None:
    x, updates, _ = round_of(1e-2, clients=1)
    before = {n: a.copy() for n, a in x.items()}
    got = fold([updates[0]] * 3, np.array([1.0, 2.0, 5.0]), x)
    for name in x:
        np.testing.assert_array_equal(x[name], before[name])
        # D = 1d + 2d + 5d in float32 rounds (3d needs more bits than d), so not always u itself: within one unit of
        # the larger of |u| and |x| (the result is rounded at x's scale)
        unit = np.spacing(np.maximum(np.abs(updates[0][name]), np.abs(x[name])))
        assert np.all(np.abs(got[name] - updates[0][name]) <= unit)


def test_other_dtypes_keep_float64_sums_and_the_aggregator_passes_the_reference() -> None:
    x: NamedArrays = {
        "w": np.array([1.0, 2.0], np.float32),
        "h": np.array([1.0, 3.0], np.float64),
        "n": np.array(3, np.int64),
    }
    ups = [
        {"w": np.array([1.5, 2.5], np.float32), "h": np.array([2.0, 5.0]), "n": np.array(4, np.int64)},
        {"w": np.array([2.0, 3.0], np.float32), "h": np.array([4.0, 6.0]), "n": np.array(7, np.int64)},
    ]
    acc = MeanAggregator(delta=True).start(spec_of(x), round=1, reference=x)
    plain = MeanAggregator().start(spec_of(x), round=1, reference=x)  # the default: float64 sums
    for u, w in zip(ups, (1.0, 3.0), strict=True):
        acc.add(u, w)
        plain.add(u, w)
    got, want = acc.result(), plain.result()
    # hand-computed: (1·1.5 + 3·2.0) / 4 = 1.875, (1·2.5 + 3·3.0) / 4 = 2.875; (2 + 12) / 4 = 3.5, (5 + 18) / 4 = 5.75;
    # (4 + 21) / 4 = 6.25 -> 6
    np.testing.assert_array_equal(got["w"], np.array([1.875, 2.875], np.float32))
    np.testing.assert_array_equal(got["h"], np.array([3.5, 5.75]))
    assert int(got["n"]) == 6 and got["n"].shape == ()
    for name in x:
        np.testing.assert_array_equal(got[name], want[name])


def test_the_delta_sum_depends_on_the_order_of_the_updates_which_is_why_it_is_off_by_default() -> None:
    x, updates, weights = round_of(1e-2, clients=20)
    forward, backward = fold(updates, weights, x), fold(updates[::-1], weights[::-1], x)
    assert np.any(forward["w"] != backward["w"])  # float32 rounding of D at each fold: the order shows
    plain, plain_back = fold(updates, weights, None), fold(updates[::-1], weights[::-1], None)
    np.testing.assert_array_equal(plain["w"], plain_back["w"])  # float64 sums: hidden by the rounding to float32
