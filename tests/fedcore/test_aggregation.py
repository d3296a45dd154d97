"""WeightedMean, mean, weighted_average and weighted_metrics: hand-computed numbers and flwr as a reference."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.server.strategy.aggregate import aggregate, aggregate_inplace

from fedcore.aggregation import MetricAverages, WeightedMean, mean, streaming, weighted_average, weighted_metrics
from fedcore.errors import AggregationError, ConfigError, NonFiniteError, PayloadError, UpdateRejected
from fedcore.tensors import NamedArrays, encode, spec_of
from tests.residency import mapping_rss, needs_smaps


def _snapshot(acc: WeightedMean) -> tuple[dict[str, np.ndarray], float, int]:
    return {n: t.copy() for n, t in acc._sums.items()}, acc.total_weight, acc.count


def _assert_same_snapshot(
    a: tuple[dict[str, np.ndarray], float, int], b: tuple[dict[str, np.ndarray], float, int]
) -> None:
    assert a[1] == b[1] and a[2] == b[2]
    for name in a[0]:
        assert np.array_equal(a[0][name], b[0][name])


def test_two_clients_by_hand() -> None:
    # (1·[1, 2] + 3·[5, 10]) / 4 = [16, 32] / 4 = [4, 8];  (1·7 + 3·(−1)) / 4 = 4 / 4 = 1
    acc = WeightedMean(spec_of({"w": np.zeros(2, np.float32), "b": np.zeros((), np.float32)}))
    acc.add({"w": np.array([1.0, 2.0], np.float32), "b": np.array(7.0, np.float32)}, 1, client_id="a")
    acc.add({"b": np.array(-1.0, np.float32), "w": np.array([5.0, 10.0], np.float32)}, 3, client_id="b")
    assert acc.count == 2
    assert acc.total_weight == 4.0
    out = acc.result()
    assert list(out) == ["w", "b"]
    assert out["w"].dtype == np.float32 and out["b"].shape == ()
    np.testing.assert_array_equal(out["w"], [4.0, 8.0])
    assert out["b"] == 1.0


def test_integer_tensors_rounded_to_nearest() -> None:
    # (1·10 + 1·13) / 2 = 11.5 -> 12 (rint: half to even); (2·3 + 1·4) / 3 = 10/3 = 3.33 -> 3; int64 stays int64
    acc = WeightedMean(spec_of({"n": np.zeros(1, np.int64), "k": np.zeros(1, np.int32)}))
    acc.add({"n": np.array([10]), "k": np.array([3], np.int32)}, 1)
    acc.add({"n": np.array([13]), "k": np.array([3], np.int32)}, 1)
    out = acc.result()
    assert out["n"].dtype == np.int64 and out["n"][0] == 12  # 11.5 rounds to even
    acc2 = WeightedMean(spec_of({"k": np.zeros(1, np.int32)}))
    acc2.add({"k": np.array([3], np.int32)}, 2)
    acc2.add({"k": np.array([4], np.int32)}, 1)
    assert acc2.result()["k"].dtype == np.int32 and acc2.result()["k"][0] == 3
    acc3 = WeightedMean(spec_of({"k": np.zeros(1, np.int32)}))
    acc3.add({"k": np.array([3], np.int32)}, 1)
    acc3.add({"k": np.array([4], np.int32)}, 2)  # 11/3 = 3.67 -> 4
    assert acc3.result()["k"][0] == 4


def _random_clients(rng: np.random.Generator, n: int) -> list[tuple[list[np.ndarray], int]]:
    return [
        (
            [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)],
            int(rng.integers(1, 500)),
        )
        for _ in range(n)
    ]


def test_matches_flwr_aggregate_and_aggregate_inplace() -> None:
    rng = np.random.default_rng(7)
    results = _random_clients(rng, 12)
    expected = aggregate(results)
    fit_results = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, {})) for arrays, n in results]
    expected_inplace = aggregate_inplace(fit_results)  # type: ignore[arg-type]
    names = ["weight", "bias"]
    acc = WeightedMean(spec_of(dict(zip(names, results[0][0], strict=True))))
    acc_bytes = WeightedMean(acc.spec)
    for k, (arrays, n) in enumerate(results):
        update = dict(zip(names, arrays, strict=True))
        acc.add(update, n, client_id=f"c{k}")
        acc_bytes.add_bytes(encode(update), n, client_id=f"c{k}")
    for out in (acc.result(), acc_bytes.result()):
        for name, ref, ref_inplace in zip(names, expected, expected_inplace, strict=True):
            np.testing.assert_allclose(out[name], ref, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(out[name], ref_inplace, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("bad_update", "weight", "error", "words"),
    [
        ({"w": np.array([1.0, np.nan, 0.0], np.float32)}, 1.0, NonFiniteError, "'w'"),
        ({"w": np.array([1.0, np.inf, 0.0], np.float32)}, 1.0, NonFiniteError, "'w'"),
        ({"w": np.zeros(4, np.float32)}, 1.0, PayloadError, "shape"),
        ({"w": np.zeros(3, np.float64)}, 1.0, PayloadError, "dtype"),
        ({"weights": np.zeros(3, np.float32)}, 1.0, PayloadError, "missing ['w']"),
        ({"w": np.zeros(3, np.float32)}, -1.0, UpdateRejected, "weight"),
        ({"w": np.zeros(3, np.float32)}, float("nan"), UpdateRejected, "weight"),
        ({"w": np.zeros(3, np.float32)}, float("inf"), UpdateRejected, "weight"),
    ],
)
def test_rejected_update_leaves_accumulator_unchanged(
    bad_update: NamedArrays, weight: float, error: type[PayloadError | UpdateRejected], words: str
) -> None:
    acc = WeightedMean(spec_of({"w": np.zeros(3, np.float32)}))
    acc.add({"w": np.array([1.0, 2.0, 3.0], np.float32)}, 2.0, client_id="good")
    before = _snapshot(acc)
    with pytest.raises(error) as info:
        acc.add(bad_update, weight, client_id="mallory", round=3)
    assert "mallory" in str(info.value) and info.value.client_id == "mallory" and info.value.round == 3
    assert words in str(info.value)
    _assert_same_snapshot(before, _snapshot(acc))
    np.testing.assert_array_equal(acc.result()["w"], [1.0, 2.0, 3.0])


def test_nan_after_finite_prefix_is_rejected_before_any_fold() -> None:
    # a NaN in the last tensor (and late in a big one) must not leave the earlier tensors folded
    spec = spec_of({"a": np.zeros(600_000, np.float32), "b": np.zeros(10, np.float32)})
    acc = WeightedMean(spec)
    acc.add({"a": np.ones(600_000, np.float32), "b": np.ones(10, np.float32)}, 1.0)
    before = _snapshot(acc)
    a = np.full(600_000, 5.0, np.float32)
    a[-1] = np.nan
    with pytest.raises(NonFiniteError, match="'a'"):
        acc.add({"a": a, "b": np.ones(10, np.float32)}, 1.0, client_id="x")
    b = np.ones(10, np.float32)
    b[3] = -np.inf
    with pytest.raises(NonFiniteError, match="'b'"):
        acc.add_bytes(encode({"a": np.ones(600_000, np.float32), "b": b}), 1.0, client_id="x")
    _assert_same_snapshot(before, _snapshot(acc))


def test_overflowing_sum_of_finite_values_is_accepted() -> None:
    # the fast finiteness check sums the update; a float32 sum can overflow although every value is finite
    big = np.full(8, 3e38, np.float32)
    acc = WeightedMean(spec_of({"w": big}))
    acc.add({"w": big}, 1.0)
    np.testing.assert_array_equal(acc.result()["w"], big)


def test_add_bytes_rejects_bad_payloads_without_folding() -> None:
    spec = spec_of({"w": np.zeros((2, 2), np.float32)})
    acc = WeightedMean(spec)
    good = encode({"w": np.ones((2, 2), np.float32)})
    acc.add_bytes(good, 1.0)
    before = _snapshot(acc)
    bad = [
        good[:-3],
        good[:6],
        b"\x05\x00\x00\x00\x00\x00\x00\x00{abc}",
        encode({"v": np.ones((2, 2), np.float32)}),
        encode({"w": np.ones(4, np.float32)}),
        encode({"w": np.ones((2, 2), np.float64)}),
        encode({"w": np.ones((2, 2), np.float32), "extra": np.ones(1, np.float32)}),
    ]
    for payload in bad:
        with pytest.raises(PayloadError) as info:
            acc.add_bytes(payload, 1.0, client_id="eve")
        assert info.value.client_id == "eve"
    _assert_same_snapshot(before, _snapshot(acc))


def test_zero_total_weight_and_empty_raise_naming_clients() -> None:
    acc = WeightedMean(spec_of({"w": np.zeros(2, np.float32)}))
    with pytest.raises(AggregationError, match="no updates"):
        acc.result()
    acc.add({"w": np.ones(2, np.float32)}, 0, client_id="alice")
    acc.add({"w": np.ones(2, np.float32)}, 0.0, client_id="bob")
    with pytest.raises(AggregationError, match="'alice', 'bob'"):
        acc.result()


def test_thousand_clients_within_1e6_of_float64_reference() -> None:
    rng = np.random.default_rng(1000)
    n_params, n_clients = 100_000, 1000
    base = rng.standard_normal(n_params).astype(np.float32)
    acc = WeightedMean(spec_of({"w": base}))
    ref_sum = np.zeros(n_params, np.float64)
    naive32 = np.zeros(n_params, np.float32)
    weights = rng.uniform(1.0, 1000.0, n_clients)
    for k in range(n_clients):
        update = base + rng.standard_normal(n_params).astype(np.float32)
        acc.add({"w": update}, weights[k])
        ref_sum += weights[k] * update.astype(np.float64)
        naive32 += np.float32(weights[k]) * update
    ref = ref_sum / weights.sum()
    out = acc.result()["w"]
    rel = np.max(np.abs(out - ref) / np.abs(ref))
    assert rel < 1e-6, rel
    # for contrast: a float32 running sum is an order of magnitude off (not asserted tightly; documents why)
    naive_rel = np.max(np.abs(naive32 / np.float32(weights.sum()) - ref) / np.abs(ref))
    assert naive_rel > rel


def test_mean_and_helpers() -> None:
    out = mean([{"w": np.array([1.0, 4.0])}, {"w": np.array([3.0, 8.0])}])
    np.testing.assert_array_equal(out["w"], [2.0, 6.0])
    with pytest.raises(AggregationError):
        mean([])
    # (1·10 + 3·20) / 4 = 70 / 4 = 17.5
    assert weighted_average([10.0, 20.0], [1, 3]) == 17.5
    with pytest.raises(AggregationError):
        weighted_average([1.0], [0])
    with pytest.raises(AggregationError):
        weighted_average([1.0, 2.0], [1])
    # acc: (10·0.5 + 30·0.9) / 40 = 32 / 40 = 0.8; loss only from the second and third: (30·2 + 20·5) / 50 = 3.2
    metrics = weighted_metrics([(10, {"acc": 0.5}), (30, {"acc": 0.9, "loss": 2.0}), (20, {"loss": 5.0})])
    assert metrics.values == pytest.approx({"acc": 0.8, "loss": 3.2}) and metrics.left_out == 0
    # a zero-weight report is left out (counted), never an error
    assert weighted_metrics([(0, {"acc": 0.5})]) == MetricAverages(values={}, left_out=1)


def _multi_block_clients(rng: np.random.Generator, n: int) -> list[tuple[dict[str, np.ndarray], float]]:
    # tensors of several blocks (and an odd tail), a tiny one and an integer one, to cross block boundaries
    size = 3 * streaming._BLOCK + 17
    return [
        (
            {
                "a": (rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3)).astype(np.float32),
                "b": rng.standard_normal(3).astype(np.float32),
                "n": rng.integers(-1000, 1000, 5),
            },
            float(rng.uniform(0.5, 1000.0)),
        )
        for _ in range(n)
    ]


def test_threads_give_bit_identical_results() -> None:
    # every element is computed the same way whichever thread takes its block: the bytes must not depend on
    # the thread count or the timing (repeated runs with several threads), nor on add vs add_bytes
    clients = _multi_block_clients(np.random.default_rng(5), 6)
    spec = spec_of(clients[0][0])
    outs = []
    for threads, rep in [(1, 0), (2, 0), (2, 1), (3, 0), (5, 0)]:
        acc = WeightedMean(spec, threads=threads)
        assert acc.threads == min(threads, 4)  # 4 blocks' worth of elements: at most 4 threads
        for k, (update, w) in enumerate(clients):
            if (k + rep) % 2:
                acc.add_bytes(encode(update), w)
            else:
                acc.add(update, w)
        outs.append((acc.result(), {n: t.copy() for n, t in acc._sums.items()}))
    for result, sums in outs[1:]:
        for s in spec:
            assert result[s.name].tobytes() == outs[0][0][s.name].tobytes()
            assert sums[s.name].tobytes() == outs[0][1][s.name].tobytes()


def test_threaded_rejection_leaves_sum_unchanged() -> None:
    # a NaN in the last block of a multi-block tensor, an Inf in a later tensor: with several threads the check
    # still completes before any block is folded, and the error names the first bad tensor in spec order
    clients = _multi_block_clients(np.random.default_rng(6), 2)
    spec = spec_of(clients[0][0])
    acc = WeightedMean(spec, threads=3)
    acc.add(*clients[0])
    before = _snapshot(acc)
    bad = {name: arr.copy() for name, arr in clients[1][0].items()}
    bad["a"][-1] = np.nan
    bad["b"][0] = np.inf
    for _ in range(3):
        with pytest.raises(NonFiniteError, match="'a'"):
            acc.add(bad, 2.0, client_id="m")
        with pytest.raises(NonFiniteError, match="'a'"):
            acc.add_bytes(encode(bad), 2.0, client_id="m")
        _assert_same_snapshot(before, _snapshot(acc))
    bad["a"][-1] = 1.0
    with pytest.raises(NonFiniteError, match="'b'"):
        acc.add(bad, 2.0, client_id="m")
    _assert_same_snapshot(before, _snapshot(acc))


def test_threads_argument_validated() -> None:
    spec = spec_of({"w": np.zeros(3, np.float32)})
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="threads"):
            WeightedMean(spec, threads=bad)  # type: ignore[arg-type]
    assert WeightedMean(spec, threads=4).threads == 1  # never more threads than blocks
    # many blocks but little work: 6 tensors (6 blocks) of 6,000 elements in all fold on one thread, as a thread
    # hand-off costs more than the fold; 6 tensors of just over one block's worth of elements in all get 2
    small = spec_of({f"t{k}": np.zeros(streaming._BLOCK // 6 + 1, np.float32) for k in range(6)})
    assert WeightedMean(small, threads=4).threads == 2
    assert WeightedMean(spec_of({f"t{k}": np.zeros(1000, np.float32) for k in range(6)}), threads=4).threads == 1
    assert WeightedMean(spec).threads >= 1


def _mixed_updates(n: int = 3) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(7)
    base: NamedArrays = {
        "big": rng.standard_normal(300_001).astype(np.float32),  # > 1 MiB of float64: its own mapping
        "half": rng.standard_normal((5, 7)).astype(np.float16),
        "steps": np.array([3], np.int64),
        "count": np.arange(6, dtype=np.int32),
        "flag": np.array([True, False]),
        "f64": rng.standard_normal(9),
        "empty": np.zeros((0, 3), np.float32),
    }
    updates = [{k: (v + k_i).astype(v.dtype) if v.dtype != bool else v for k, v in base.items()} for k_i in range(n)]
    return base, updates


def test_result_release_is_bit_identical_and_spends_the_accumulator() -> None:
    base, updates = _mixed_updates()
    plain, released = WeightedMean(spec_of(base), threads=2), WeightedMean(spec_of(base), threads=2)
    for k, update in enumerate(updates):
        plain.add(update, 1.5 + k)
        released.add(update, 1.5 + k)
    want = plain.result()
    got = released.result(release=True)
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        assert np.array_equal(got[name], want[name]), name
    with pytest.raises(AggregationError, match="spent"):
        released.result()
    with pytest.raises(AggregationError, match="spent"):
        released.add(updates[0], 1.0)


def test_result_release_frees_the_unused_half_of_a_large_sum() -> None:
    spec = spec_of({"w": np.zeros(1 << 20, np.float32)})  # 8 MiB of float64 sum
    acc = WeightedMean(spec, threads=1)
    acc.add({"w": np.ones(1 << 20, np.float32)}, 2.0)
    out = acc.result(release=True)["w"]
    np.testing.assert_array_equal(out, 1.0)
    # the float64 sum's mapping: past the float32 result its pages were handed back, so they read as zeros now
    # (before, they held the sums 2.0); pages still allocated would keep those bytes
    buffer: object = out
    while not isinstance(buffer, mmap.mmap):
        assert isinstance(buffer, np.ndarray | memoryview)
        buffer = buffer.obj if isinstance(buffer, memoryview) else buffer.base
    tail = np.frombuffer(buffer, np.uint8)[out.nbytes :]
    assert tail.size == out.nbytes and not tail.any()
    out[:] = 5.0  # the result is an ordinary writable array
    assert out.flags.writeable and out.sum() == 5.0 * (1 << 20)


@needs_smaps
def test_a_large_sum_takes_memory_only_once_a_weighted_update_is_folded() -> None:
    """A server makes the round's accumulator before it writes the round's task payload from the global model, so a
    large sum must take no memory until the first update with a weight is folded into it (else it adds to that
    write's peak); then all of it is allocated and holds the sum (for a batch's sum, in one call first where Linux
    has MADV_POPULATE_WRITE). Measured as differences of its mapping's resident bytes, which a neighbouring mapping
    merged with it shares."""
    n = 1 << 20  # 8 MiB of float64 sum: a mapping of its own
    ignored, update = np.ones(n, np.float32), np.full(n, 3.0, np.float32)  # resident before the first measurement
    acc = WeightedMean(spec_of({"w": update}), threads=1)
    total = acc._sums["w"]  # white box: the running sum, whose mapping is measured
    made = mapping_rss(total)
    acc.add({"w": ignored}, 0.0)  # a weight of 0 writes nothing
    assert mapping_rss(total) - made < 1 << 20
    acc.add({"w": update}, 2.0)
    assert mapping_rss(total) - made >= 8 * n - (1 << 20)
    np.testing.assert_array_equal(acc.result()["w"], 3.0)
    # a batch's pre-summed update (add_sum) has the pages allocated in one call first, with the same result
    summed = {"w": update.astype(np.float64) * 2.0}
    batch = WeightedMean(spec_of({"w": update}), threads=1)
    total = batch._sums["w"]
    made = mapping_rss(total)
    batch.add_sum(summed, [2.0])
    assert mapping_rss(total) - made >= 8 * n - (1 << 20)
    np.testing.assert_array_equal(batch.result()["w"], 3.0)


def test_updates_mapped_from_files_fold_like_in_memory_ones(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fedcore.payload import open_safetensors, save_payload

    base, updates = _mixed_updates()
    in_memory, from_files = WeightedMean(spec_of(base), threads=2), WeightedMean(spec_of(base), threads=2)
    for k, update in enumerate(updates):
        in_memory.add(update, 2.0 + k)
        path = save_payload(tmp_path / f"u{k}.safetensors", update).path
        mapped, _ = open_safetensors(path)
        from_files.add(mapped, 2.0 + k)
        # the pages were released after the fold, but the data is still readable from the file
        for name in update:
            assert np.array_equal(mapped[name], update[name])
    _assert_same_snapshot(_snapshot(in_memory), _snapshot(from_files))


def test_a_rejected_mapped_update_leaves_the_sum_untouched(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fedcore.payload import open_safetensors, save_payload

    base, updates = _mixed_updates(1)
    acc = WeightedMean(spec_of(base), threads=2)
    acc.add(updates[0], 1.0)
    before = _snapshot(acc)
    bad = dict(updates[0])
    bad["big"] = bad["big"].copy()
    bad["big"][12345] = np.nan
    mapped, _ = open_safetensors(save_payload(tmp_path / "bad.safetensors", bad).path)
    with pytest.raises(NonFiniteError, match="big"):
        acc.add(mapped, 1.0)
    _assert_same_snapshot(before, _snapshot(acc))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_finite_kernel_finds_every_nan_and_infinity_wherever_it_is(dtype: type[np.floating]) -> None:
    from fedcore.kernels import all_finite

    rng = np.random.default_rng(0)
    finite = rng.standard_normal(1000).astype(dtype)
    largest = np.full(1000, np.finfo(dtype).max, dtype)  # finite values whose plain sum would overflow to inf
    assert all_finite(finite) and all_finite(largest) and all_finite(finite[:0]) and all_finite(-largest)
    for bad in (np.nan, np.inf, -np.inf):
        for position in (0, 1, 7, 8, 9, 500, 998, 999):  # SIMD lanes, the remainder loop, both ends
            block = finite.copy()
            block[position] = bad
            assert not all_finite(block), (bad, position)
            assert not all_finite(block[position:]) and all_finite(block[position + 1 :])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fold_rows_gives_the_bits_of_folding_each_row_in_turn(dtype: type[np.floating]) -> None:
    """The batched backend's one call over a batch's rows against the aggregator's fold of one update at a time,
    rows taken out of order and one twice, weights of very different sizes: the same float64 bits."""
    from fedcore.kernels import fold_block, fold_rows

    rng = np.random.default_rng(9)
    rows = (rng.standard_normal((7, 1000)) * 10.0 ** rng.integers(-6, 6, size=(7, 1))).astype(dtype)
    index = np.array([3, 0, 6, 3, 2], dtype=np.int64)
    weights = np.array([60.0, 1e-3, 7.5, 1e6, 0.1])
    one_by_one = np.zeros(1000)
    for row, weight in zip(index, weights, strict=True):
        fold_block(one_by_one, rows[row], float(weight))
    together = np.zeros(1000)
    fold_rows(together, rows, index, weights)
    assert together.tobytes() == one_by_one.tobytes()
