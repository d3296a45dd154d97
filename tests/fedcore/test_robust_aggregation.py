"""Robust aggregators: hand-computed cases, numpy references on random data, refusals, validation, and memory."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from fedcore.aggregation import (
    Aggregator,
    CountsRejections,
    KrumAggregator,
    MedianAggregator,
    NormBoundAggregator,
    TrimmedMeanAggregator,
    robust,
)
from fedcore.errors import AggregationError, ConfigError, NonFiniteError, PayloadError, UpdateRejected
from fedcore.payload import open_safetensors, save_payload
from fedcore.tensors import NamedArrays, spec_of

ROOT = Path(__file__).resolve().parents[2]


def _vector(values: Sequence[float]) -> dict[str, np.ndarray]:
    return {"w": np.array(values, np.float32)}


def _aggregate(
    aggregator: Aggregator, updates: list[dict[str, np.ndarray]], weights: list[float] | None = None
) -> NamedArrays:
    accumulator = aggregator.start(spec_of(updates[0]), round=1)
    for k, update in enumerate(updates):
        accumulator.add(update, 1.0 if weights is None else weights[k], client_id=f"c{k:02d}", round=1)
    return accumulator.result(release=True)


# ------------------------------------------------------------------------------------------------- by hand


def test_median_by_hand_odd_and_even_counts_and_integers() -> None:
    rows = [[1, 5, 9], [2, 0, 7], [10, 4, 8]]
    # per coordinate: median(1, 2, 10) = 2, median(5, 0, 4) = 4, median(9, 7, 8) = 8
    out = _aggregate(MedianAggregator(), [_vector(r) for r in rows])
    np.testing.assert_array_equal(out["w"], [2, 4, 8])
    assert out["w"].dtype == np.float32
    # a fourth row [0, 0, 0]: sorted (0, 1, 2, 10) -> 1.5; (0, 0, 4, 5) -> 2; (0, 7, 8, 9) -> 7.5
    out = _aggregate(MedianAggregator(), [_vector(r) for r in [*rows, [0, 0, 0]]])
    np.testing.assert_array_equal(out["w"], [1.5, 2.0, 7.5])
    # integers: median(1, 2) = 1.5 rounds to 2 (half to even), median(3, 6) = 4.5 rounds to 4
    ints = [{"n": np.array([1, 3], np.int64)}, {"n": np.array([2, 6], np.int64)}]
    out = _aggregate(MedianAggregator(), ints)
    assert out["n"].dtype == np.int64
    np.testing.assert_array_equal(out["n"], [2, 4])


def test_trimmed_mean_by_hand() -> None:
    # beta 0.2 of 5 clients trims floor(1.0) = 1 at each end: (0, 1, 2, 10, 100) -> (1 + 2 + 10) / 3
    rows = [[1, 0], [2, 0], [10, 3], [0, 3], [100, -50]]
    out = _aggregate(TrimmedMeanAggregator(beta=0.2), [_vector(r) for r in rows])
    # second coordinate: (-50, 0, 0, 3, 3) -> (0 + 0 + 3) / 3 = 1
    np.testing.assert_allclose(out["w"], [13 / 3, 1.0], rtol=1e-7)
    # beta 0 is the plain mean
    out = _aggregate(TrimmedMeanAggregator(beta=0.0), [_vector(r) for r in rows])
    np.testing.assert_allclose(out["w"], [113 / 5, -44 / 5], rtol=1e-7)


def test_krum_and_multi_krum_by_hand() -> None:
    # points 0, 1, 2.5, 3, 100 with f = 1: each is scored on its n - f - 2 = 2 nearest others:
    # 0: 1 + 6.25 = 7.25; 1: 1 + 2.25 = 3.25; 2.5: 0.25 + 2.25 = 2.5; 3: 0.25 + 4 = 4.25; 100: 97^2 + 97.5^2
    points = [_vector([p, -p]) for p in (0.0, 1.0, 2.5, 3.0, 100.0)]
    accumulator = KrumAggregator(byzantine=1).start(spec_of(points[0]), round=1)
    for k, update in enumerate(points):
        accumulator.add(update, 1.0, client_id=f"c{k}")
    np.testing.assert_allclose(accumulator.scores(), [7.25 * 2, 3.25 * 2, 2.5 * 2, 4.25 * 2, (97**2 + 97.5**2) * 2])
    out = accumulator.result()
    np.testing.assert_array_equal(out["w"], [2.5, -2.5])
    assert accumulator.selected == ("c2",)
    # Multi-Krum, m = 3: the three best are 2.5, 1 and 3; weights 1, 2, 1 -> (2 * 1 + 2.5 + 3) / 4 = 1.875
    out = _aggregate(KrumAggregator(byzantine=1, select=3), points, weights=[5.0, 2.0, 1.0, 1.0, 1e6])
    np.testing.assert_allclose(out["w"], [1.875, -1.875])
    # m = None takes n - f = 4: 0, 1, 2.5, 3 with weights 5, 2, 1, 1 -> (0 + 2 + 2.5 + 3) / 9
    out = _aggregate(KrumAggregator(byzantine=1, select=None), points, weights=[5.0, 2.0, 1.0, 1.0, 1e6])
    np.testing.assert_allclose(out["w"], [7.5 / 9, -7.5 / 9], rtol=1e-6)


def test_norm_bound_by_hand() -> None:
    # global model g = (1, 1); u1 - g = (3, 4) has norm 5 > 1: clipped to (0.6, 0.8); u2 - g = (0.3, 0.4) is kept
    g = _vector([1.0, 1.0])
    accumulator = NormBoundAggregator(bound=1.0).start(spec_of(g), round=1, reference=g)
    accumulator.add(_vector([4.0, 5.0]), 1.0, client_id="a")
    accumulator.add(_vector([1.3, 1.4]), 3.0, client_id="b")
    assert accumulator.clipped == 1
    # (1 * (1.6, 1.8) + 3 * (1.3, 1.4)) / 4 = (1.375, 1.5)
    np.testing.assert_allclose(accumulator.result()["w"], [1.375, 1.5], rtol=1e-6)
    with pytest.raises(ConfigError, match="reference"):
        NormBoundAggregator(bound=1.0).start(spec_of(g), round=1)


@pytest.mark.parametrize("swamp", [1e6, 1e10, 1e14])
def test_one_huge_update_does_not_let_krum_choose_a_colluding_one(swamp: float) -> None:
    """Five honest updates near 0 (sd 0.01), one attacker at -5 everywhere, a second one of ``swamp``: f = 2 of
    n = 7 = 2f + 3. Distances from a Gram matrix centred on the mean lost the honest updates' distances in float64
    rounding once one update was huge (its 1e10 / 7 moved every row), and Krum chose the attacker at -5; direct
    differences (flwr's aggregate_krum) choose an honest update. Both attackers stay unchosen, as flwr's."""
    from flwr.server.strategy.aggregate import aggregate_krum

    rng = np.random.default_rng(3)
    honest = [{"w": rng.normal(0.0, 0.01, 1000)} for _ in range(5)]
    updates = [*honest, {"w": np.full(1000, -5.0)}, {"w": honest[0]["w"] + swamp}]
    accumulator = KrumAggregator(byzantine=2).start(spec_of(updates[0]), round=1)
    for k, update in enumerate(updates):
        accumulator.add(update, 1.0, client_id=f"c{k}")
    out = accumulator.result()
    (expected,) = aggregate_krum([([u["w"]], 1) for u in updates], num_malicious=2, to_keep=0)
    assert accumulator.selected[0] in {f"c{k}" for k in range(5)}
    np.testing.assert_array_equal(out["w"], expected)
    multi = _aggregate(KrumAggregator(byzantine=2, select=None), updates)  # n - f = 5: exactly the honest ones
    np.testing.assert_allclose(multi["w"], np.mean([u["w"] for u in honest], axis=0), rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------------------------------------- refusals


def test_check_refuses_rounds_a_rule_cannot_honour() -> None:
    KrumAggregator(byzantine=2).check(7)
    with pytest.raises(ConfigError, match="at least 7 clients"):
        KrumAggregator(byzantine=2).check(6)
    with pytest.raises(ConfigError, match="m=6"):
        KrumAggregator(byzantine=2, select=6).check(7)
    MedianAggregator(byzantine=2).check(5)
    with pytest.raises(ConfigError, match="at least 5 clients"):
        MedianAggregator(byzantine=2).check(4)
    TrimmedMeanAggregator(beta=0.1, byzantine=1).check(10)
    with pytest.raises(ConfigError, match="at least 10 clients"):
        TrimmedMeanAggregator(beta=0.1, byzantine=1).check(9)
    with pytest.raises(ConfigError):
        TrimmedMeanAggregator(beta=0.0, byzantine=1).check(100)
    for bad in (
        lambda: TrimmedMeanAggregator(beta=0.5),
        lambda: TrimmedMeanAggregator(beta=-0.1),
        lambda: MedianAggregator(byzantine=-1),
        lambda: KrumAggregator(select=0),
        lambda: NormBoundAggregator(bound=0.0),
        lambda: NormBoundAggregator(bound=float("inf")),
    ):
        with pytest.raises(ConfigError):
            bad()


def test_preflight_refuses_small_rounds_and_warns_when_a_rule_removes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The trimmed mean's default beta 0.1 of 6 clients trims floor(0.6) = 0 values, and Multi-Krum with f = 0 and
    no m averages all n: both were the plain mean without a word (a scaled attacker took the loss from 2.4 to
    116)."""
    TrimmedMeanAggregator(beta=0.1).preflight(10, None)
    KrumAggregator(byzantine=1, select=None).preflight(5, None)
    MedianAggregator().preflight(2, None)
    assert caplog.records == []
    TrimmedMeanAggregator(beta=0.1).preflight(6, None)
    assert caplog.messages[-1].startswith(
        "the trimmed mean with beta=0.1 trims floor(0.1 x 6) = 0 values at each end of a round of 6 clients: such a "
        "round is the plain mean"
    )
    assert caplog.messages[-1].endswith(
        "select at least 10 clients a round or raise trim_beta (--trim-beta) to at least 0.167"
    )
    assert TrimmedMeanAggregator(beta=0.167).trimmed(6) == 1  # the advice works
    TrimmedMeanAggregator(beta=0.1).preflight(3, None)  # 1/3 rounded up, not to 0.333 (floor(0.333 x 3) = 0)
    assert caplog.messages[-1].endswith("to at least 0.334") and TrimmedMeanAggregator(beta=0.334).trimmed(3) == 1
    TrimmedMeanAggregator(beta=0.1).preflight(2, None)  # 0.5 is out of range: no beta helps, only more clients
    assert caplog.messages[-1].endswith("select at least 10 clients a round")
    KrumAggregator(select=None).preflight(5, None)
    assert caplog.messages[-1].startswith("multi_krum with byzantine = 0 averages m = n - f = n updates, all of them")
    with pytest.raises(
        ConfigError,
        match=r"at least 5 clients per round \(n > 2f \+ 2\), got 4; .* as few as 4 clients: min_fit_clients",
    ):
        KrumAggregator(byzantine=1).preflight(4, None)


def test_result_refuses_too_few_updates_after_dropouts() -> None:
    accumulator = KrumAggregator(byzantine=1).start(spec_of(_vector([0.0])), round=1)
    for k in range(4):
        accumulator.add(_vector([float(k)]), 1.0, client_id=f"c{k}")
    accumulator.add(_vector([9.0]), 0.0, client_id="empty")  # weight 0: accepted, takes no part
    assert accumulator.count == 5
    with pytest.raises(AggregationError, match="at least 5"):
        accumulator.result()


def test_refused_updates_count_against_the_byzantine_budget() -> None:
    """A client whose update is refused (NaN, wrong shape) is one of the f faulty clients: the kept updates hold at
    most f - r Byzantine ones. The rule sized for f failed the round when f clients sent NaN (trimmed mean, beta
    0.25, f = 1 of 4: 3 kept, floor(0.75) = 0 < 1), so f attackers could stop a run the rule claims to survive."""
    rows = [[1.0, 4.0], [2.0, 0.0], [6.0, 2.0]]
    accumulator = TrimmedMeanAggregator(beta=0.25, byzantine=1).start(spec_of(_vector([0, 0])), round=1)
    for k, row in enumerate(rows):
        accumulator.add(_vector(row), 1.0, client_id=f"c{k}")
    with pytest.raises(NonFiniteError):
        accumulator.add(_vector([float("nan"), 0.0]), 1.0, client_id="bad")
    with pytest.raises(AggregationError, match=r"at least 4 updates .* to tolerate 1 Byzantine client"):
        accumulator.result()
    assert isinstance(accumulator, CountsRejections)
    accumulator.rejected("bad")
    accumulator.rejected("bad")  # the same client counts once
    np.testing.assert_allclose(accumulator.result()["w"], [3.0, 2.0], rtol=1e-7)  # trim 0 of 3: the plain mean
    # Krum with f = 2 of 7, two refused: the 5 kept hold no Byzantine update, so each is scored on its n - 0 - 2 = 3
    # nearest others (5 < 2f + 3 before any refusal). Points 0, 1, 2, 4, 8: scores 1+4+16, 1+1+9, 1+4+4, 4+9+16,
    # 16+36+49 -> the point 2 (9)
    krum = KrumAggregator(byzantine=2).start(spec_of(_vector([0.0])), round=1)
    for k, point in enumerate([0.0, 1.0, 2.0, 4.0, 8.0]):
        krum.add(_vector([point]), 1.0, client_id=f"c{k}")
    with pytest.raises(AggregationError, match="at least 7 updates"):
        krum.scores()
    assert isinstance(krum, CountsRejections)
    krum.rejected("x")  # f - r = 1: each scored on its 2 nearest others: 1+4, 1+1, 1+4, 4+9, 16+36
    np.testing.assert_array_equal(krum.scores(), [5.0, 2.0, 5.0, 13.0, 52.0])
    krum.rejected("y")
    np.testing.assert_array_equal(krum.scores(), [21.0, 11.0, 9.0, 29.0, 101.0])
    np.testing.assert_array_equal(krum.result()["w"], [2.0])
    median = MedianAggregator(byzantine=2).start(spec_of(_vector([0.0])), round=1)
    for k, point in enumerate([0.0, 5.0, 1.0]):
        median.add(_vector([point]), 1.0, client_id=f"c{k}")
    assert isinstance(median, CountsRejections)
    median.rejected("x")
    median.rejected("y")
    np.testing.assert_array_equal(median.result()["w"], [1.0])


# ------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "aggregator", [MedianAggregator(), TrimmedMeanAggregator(beta=0.2), KrumAggregator(byzantine=0)]
)
def test_rejected_updates_leave_nothing_behind(aggregator: Aggregator, tmp_path: Path) -> None:
    aggregator = dataclasses.replace(aggregator, spill_dir=str(tmp_path))  # type: ignore[type-var]
    spec = spec_of({"w": np.zeros(3, np.float32), "n": np.zeros(2, np.int64)})
    good = [{"w": np.array([k, 2 * k, 3 * k], np.float32), "n": np.array([k, k])} for k in range(3)]
    accumulator = aggregator.start(spec, round=1)
    accumulator.add(good[0], 1.0, client_id="a")
    with pytest.raises(NonFiniteError):
        accumulator.add({"w": np.array([1, np.nan, 0], np.float32), "n": np.array([1, 1])}, 1.0, client_id="x")
    with pytest.raises(PayloadError):
        accumulator.add({"w": np.zeros(4, np.float32), "n": np.array([1, 1])}, 1.0, client_id="y")
    with pytest.raises(UpdateRejected):
        accumulator.add(good[1], -1.0, client_id="z")
    assert accumulator.count == 1
    accumulator.add(good[1], 1.0, client_id="b")
    accumulator.add(good[2], 1.0, client_id="c")
    (spill,) = tmp_path.iterdir()
    assert sorted(spill.iterdir()) == []  # spilled files are unlinked once mapped
    out = accumulator.result(release=True)
    reference = _aggregate(aggregator, good)
    for name in out:
        np.testing.assert_array_equal(out[name], reference[name])
    assert list(tmp_path.iterdir()) == []  # the temporary directory went with the result
    with pytest.raises(AggregationError):
        accumulator.add(good[0], 1.0)


# ------------------------------------------------------------------------------------------------- references


def _random_updates(rng: np.random.Generator, n: int, size: int) -> list[dict[str, np.ndarray]]:
    return [
        {
            "a": (rng.standard_normal(size) * 3).astype(np.float32).reshape(-1, 1),
            "b": rng.standard_normal((3, 2)).astype(np.float32),
            "c": rng.standard_normal(5),  # float64
        }
        for _ in range(n)
    ]


def _direct_krum(updates: list[dict[str, np.ndarray]], f: int, m: int) -> dict[str, np.ndarray]:
    vectors = [np.concatenate([u[name].astype(np.float64).ravel() for name in u]) for u in updates]
    n = len(vectors)
    scores = []
    for i in range(n):
        distances = sorted(float(np.sum((vectors[i] - vectors[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(distances[: n - f - 2]))
    best = sorted(np.argsort(scores, kind="stable")[:m])
    return {name: np.mean([updates[i][name].astype(np.float64) for i in best], axis=0) for name in updates[0]}


@pytest.mark.parametrize("n", [7, 12])
def test_equal_to_numpy_references_on_random_data_across_blocks(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # small gather buffers: the 3001-element tensor spans several blocks, read by two threads
    monkeypatch.setattr(robust, "_GATHER_BYTES", 8 * n * 1024)
    rng = np.random.default_rng(n)
    updates = _random_updates(rng, n, 3001)
    order = rng.permutation(n)  # arrival order must not matter

    def run(aggregator: Aggregator) -> dict[str, np.ndarray]:
        accumulator = aggregator.start(spec_of(updates[0]), round=1)
        for k in order:
            accumulator.add(updates[k], 1.0, client_id=f"c{k:02d}")
        return accumulator.result(release=True)

    stacked = {name: np.stack([u[name] for u in updates]) for name in updates[0]}
    median = run(MedianAggregator(threads=2))
    for name, values in stacked.items():
        np.testing.assert_array_equal(median[name], np.median(values, axis=0).astype(values.dtype))
    trimmed = run(TrimmedMeanAggregator(beta=0.2, threads=2))
    k = int(0.2 * n)
    for name, values in stacked.items():
        expected = np.sort(values.astype(np.float64), axis=0)[k : n - k].mean(axis=0).astype(values.dtype)
        np.testing.assert_allclose(trimmed[name], expected, rtol=1e-6, atol=1e-12)
    f = (n - 3) // 2
    krum = run(KrumAggregator(byzantine=f, threads=2))
    for name, value in _direct_krum(updates, f, 1).items():
        np.testing.assert_array_equal(krum[name], value.astype(krum[name].dtype))
    multi = run(KrumAggregator(byzantine=f, select=None, threads=2))
    for name, value in _direct_krum(updates, f, n - f).items():
        np.testing.assert_allclose(multi[name], value.astype(multi[name].dtype), rtol=1e-6)
    # the same bytes whatever the arrival order and thread count
    order = np.arange(n)
    again = run(TrimmedMeanAggregator(beta=0.2, threads=1))
    for name in trimmed:
        np.testing.assert_array_equal(trimmed[name], again[name])


def test_file_mapped_updates_are_read_in_place(tmp_path: Path) -> None:
    # updates mapped read-only from files (as the gRPC server hands them over) give the in-memory result
    rng = np.random.default_rng(3)
    updates = _random_updates(rng, 6, 4000)
    accumulator = MedianAggregator(spill_dir=str(tmp_path / "spill")).start(spec_of(updates[0]), round=1)
    for k, update in enumerate(updates):
        save_payload(tmp_path / f"u{k}.safetensors", update, durable=False)
        mapped, _ = open_safetensors(tmp_path / f"u{k}.safetensors")
        accumulator.add(mapped, 1.0, client_id=f"c{k}")
    assert not (tmp_path / "spill").exists()  # nothing was spilled again
    out = accumulator.result(release=True)
    expected = _aggregate(MedianAggregator(), updates)
    for name in out:
        np.testing.assert_array_equal(out[name], expected[name])


def test_norm_bound_equals_clipping_by_hand_on_random_data() -> None:
    rng = np.random.default_rng(4)
    g = {"a": rng.standard_normal(1000).astype(np.float32), "n": np.array([3, 4])}
    updates = [
        {"a": g["a"] + rng.standard_normal(1000).astype(np.float32) * s, "n": np.array([5, 4])} for s in (0.01, 1, 5)
    ]
    weights = [10.0, 20.0, 30.0]
    out = NormBoundAggregator(bound=2.0).start(spec_of(g), round=1, reference=g)
    for k, (u, w) in enumerate(zip(updates, weights, strict=True)):
        out.add(u, w, client_id=str(k))
    result = out.result()
    clipped = []
    for u in updates:
        d = u["a"].astype(np.float64) - g["a"]
        c = min(1.0, 2.0 / np.linalg.norm(d))
        clipped.append((g["a"] + c * d, g["n"] + c * (u["n"] - g["n"])))
    expected_a = sum(w * a for (a, _), w in zip(clipped, weights, strict=True)) / sum(weights)
    expected_n = sum(w * n for (_, n), w in zip(clipped, weights, strict=True)) / sum(weights)
    np.testing.assert_allclose(result["a"], expected_a.astype(np.float32), rtol=1e-5)
    np.testing.assert_array_equal(result["n"], np.rint(expected_n).astype(np.int64))


# ------------------------------------------------------------------------------------------------- memory


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import numpy as np
    from fedcore.aggregation import MedianAggregator
    from fedcore.payload import open_safetensors, save_payload
    from fedcore.tensors import spec_of

    def status(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    directory, clients, params, mode = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rng = np.random.default_rng(0)
    for k in range(clients if mode == "mapped" else 0):  # one update in memory at a time, as a server spills them
        update = {"w": rng.standard_normal(params, dtype=np.float32)}
        save_payload(directory / f"{k}.safetensors", update, durable=False)
    spec = spec_of({"w": np.zeros(params, np.float32)})
    warm = MedianAggregator(threads=2).start(spec_of({"w": np.zeros(8, np.float32)}), round=0)
    for k in range(3):
        warm.add({"w": np.full(8, k, np.float32)}, 1.0)
    warm.result(release=True)  # numba compiled, threads started
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    accumulator = MedianAggregator(threads=2, spill_dir=str(directory)).start(spec, round=1)
    for k in range(clients):
        if mode == "mapped":  # deployment: mapped from the spill file the server received
            update, _ = open_safetensors(directory / f"{k}.safetensors")
        else:  # simulation: in memory, spilled by the aggregator, then dropped
            update = {"w": rng.standard_normal(params, dtype=np.float32)}
        accumulator.add(update, 1.0, client_id=str(k))
        del update
    result = accumulator.result(release=True)
    print(json.dumps({"peak": status("VmHWM") - before, "model": params * 4, "check": float(result["w"][:10].sum())}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to measure peak memory")
@pytest.mark.parametrize("mode", ["mapped", "memory"])
def test_median_memory_stays_bounded_with_many_updates(tmp_path: Path, mode: str) -> None:
    clients, params = 40, 1_000_000  # 160 MB of updates, 4 MB per model
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path), str(clients), str(params), mode],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    model = report["model"]
    buffers = 2 * robust._GATHER_BYTES + 2 * 8 * robust._MAX_BLOCK  # gather buffers + outputs of two threads
    # the update being added (in memory: 1x, and the spill file's pages while written) plus the result, buffers
    assert report["peak"] < 4 * model + buffers, report  # O(model + clients x block) ...
    assert report["peak"] < clients * model / 4, report  # ... never O(clients x model)
