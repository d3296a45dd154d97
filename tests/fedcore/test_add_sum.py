"""WeightedMean.add_sum: a batch's weighted sum folded at once gives the mean of adding each update with its weight;
a bad batch is refused whole and leaves the running sum as it was."""

from __future__ import annotations

import numpy as np
import pytest

from fedcore.aggregation import MeanAggregator, SumAccumulator, WeightedMean
from fedcore.aggregation.robust import MedianAggregator
from fedcore.errors import NonFiniteError, PayloadError, UpdateRejected
from fedcore.tensors import NamedArrays, spec_of

U0: NamedArrays = {"w": np.array([2.0, 0.0, -2.0], np.float32), "n": np.array([4, 8], np.int64)}
U1: NamedArrays = {"w": np.array([1.0, 2.0, 3.0], np.float32), "n": np.array([1, 2], np.int64)}
U2: NamedArrays = {"w": np.array([4.0, 5.0, 6.0], np.float32), "n": np.array([3, 6], np.int64)}
SPEC = spec_of(U0)


def batch_sum(pairs: list[tuple[dict[str, np.ndarray], float]]) -> dict[str, np.ndarray]:
    """``Σ w · u`` per tensor in float64, as a batched pool forms it."""
    return {name: sum(w * u[name].astype(np.float64) for u, w in pairs) for name in U0}  # type: ignore[misc]


def test_a_batch_sum_gives_the_mean_computed_by_hand() -> None:
    acc = WeightedMean(SPEC)
    acc.add(U0, 2.0, client_id="a")
    acc.add_sum(batch_sum([(U1, 1.0), (U2, 3.0)]), [1.0, 3.0], client_ids=["b", "c"], round=1)
    assert acc.count == 3 and acc.total_weight == 6.0
    mean = acc.result()
    # (2*[2, 0, -2] + 1*[1, 2, 3] + 3*[4, 5, 6]) / 6 = [17, 17, 17] / 6; (2*[4, 8] + [1, 2] + 3*[3, 6]) / 6 = [3, 6]
    np.testing.assert_array_equal(mean["w"], np.array([17 / 6, 17 / 6, 17 / 6], np.float32))
    np.testing.assert_array_equal(mean["n"], np.array([3, 6], np.int64))
    assert mean["w"].dtype == np.float32 and mean["n"].dtype == np.int64


@pytest.mark.parametrize("delta", [False, True])
def test_a_batch_sum_equals_adding_each_update(delta: bool) -> None:
    """One batch into an empty sum: the very bits of one-by-one folding in the batch's order; after an update, within
    the float64 rounding of the other order. With ``delta`` (float32 sum of differences from the global model), the
    sum is taken relative to the reference as add() does."""
    rng = np.random.default_rng(0)
    reference: NamedArrays = {"w": rng.standard_normal(1000).astype(np.float32), "n": np.zeros(2, np.int64)}
    updates: list[NamedArrays] = [
        {"w": reference["w"] + rng.standard_normal(1000).astype(np.float32) * 0.01, "n": np.array([k, 2 * k])}
        for k in range(1, 6)
    ]
    weights = [3.0, 1.0, 7.0, 0.0, 2.5]
    spec = spec_of(reference)
    aggregator = MeanAggregator(delta=delta)
    one_by_one = aggregator.start(spec, round=1, reference=reference)
    batched = aggregator.start(spec, round=1, reference=reference)
    assert isinstance(batched, SumAccumulator)
    for u, w in zip(updates, weights, strict=True):
        one_by_one.add(u, w)
    total = {name: np.zeros(u.shape) for name, u in updates[0].items()}
    for u, w in zip(updates, weights, strict=True):
        for name in total:
            total[name] += w * u[name].astype(np.float64)
    batched.add_sum(total, weights)
    want, got = one_by_one.result(), batched.result()
    if delta:  # D + (S - W r) rounds to float32 once, D + w (u - r) once per update: a unit in the last place
        np.testing.assert_allclose(got["w"], want["w"], rtol=0, atol=float(np.spacing(np.float32(4))))
    else:
        np.testing.assert_array_equal(got["w"], want["w"])
    np.testing.assert_array_equal(got["n"], want["n"])


@pytest.mark.parametrize(
    ("weighted_sum", "weights", "ids", "error", "match"),
    [
        (batch_sum([(U1, 1.0)]), [-1.0], ["b"], UpdateRejected, "finite and >= 0"),
        (batch_sum([(U1, 1.0)]), [float("nan")], ["b"], UpdateRejected, "finite and >= 0"),
        (batch_sum([(U1, 1.0), (U2, 1.0)]), [1.0, 1.0], ["b"], UpdateRejected, "one client id per weight"),
        ({"w": np.array([1.0, np.nan, 3.0]), "n": np.zeros(2)}, [1.0], ["b"], NonFiniteError, "NaN"),
        ({"w": np.ones(3, np.float32), "n": np.zeros(2)}, [1.0], ["b"], PayloadError, "dtype float32"),
        ({"w": np.ones(4), "n": np.zeros(2)}, [1.0], ["b"], PayloadError, "shape"),
        ({"w": np.ones(3)}, [1.0], ["b"], PayloadError, "names"),
    ],
)
def test_a_bad_batch_is_refused_whole_and_leaves_the_sum_untouched(
    weighted_sum: dict[str, np.ndarray], weights: list[float], ids: list[str], error: type, match: str
) -> None:
    acc = WeightedMean(SPEC)
    acc.add(U0, 2.0, client_id="a")
    with pytest.raises(error, match=match):
        acc.add_sum(weighted_sum, weights, client_ids=ids, round=4)
    assert acc.count == 1 and acc.total_weight == 2.0
    mean = acc.result()
    np.testing.assert_array_equal(mean["w"], U0["w"])
    np.testing.assert_array_equal(mean["n"], U0["n"])


def test_only_the_weighted_mean_takes_a_sum() -> None:
    assert isinstance(MeanAggregator().start(SPEC, round=1), SumAccumulator)
    assert not isinstance(MedianAggregator().start(SPEC, round=1), SumAccumulator)
