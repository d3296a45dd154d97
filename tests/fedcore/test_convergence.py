"""Convergence tracking's pure parts: the update norm by hand, and the stop rules over history rows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedcore.convergence import Convergence, Stop, StopRules, row_accuracy, stop_columns, update_norm
from fedcore.errors import ConfigError
from fedcore.tensors import NamedArrays


def test_update_norm_by_hand_over_stepped_tensors_only() -> None:
    old: NamedArrays = {
        "w": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
        "b": np.array([0.5], np.float64),
        "running_mean": np.array([10.0], np.float32),
        "steps": np.array([3], np.int64),
    }
    new: NamedArrays = {
        "w": np.array([[1.0, 2.0], [0.0, 8.0]], np.float32),  # (0, 0, -3, 4): 25
        "b": np.array([-11.5], np.float64),  # -12: 144
        "running_mean": np.array([0.0], np.float32),  # a buffer: left out when trainable is given
        "steps": np.array([9], np.int64),  # an integer tensor: never stepped
    }
    assert update_norm(new, old, frozenset({"w", "b"})) == 13.0
    assert update_norm(new, old, None) == math.sqrt(25 + 144 + 100)  # every floating tensor
    assert update_norm(new, old, frozenset()) == 0.0


def test_update_norm_goes_block_by_block_and_mixes_dtypes() -> None:
    rng = np.random.default_rng(0)
    old: NamedArrays = {"big": rng.standard_normal(3 * (1 << 20) + 5).astype(np.float32), "h": np.ones(4, np.float16)}
    new: NamedArrays = {"big": old["big"] + np.float32(0.5), "h": np.full(4, 2.0, np.float16)}
    diff = new["big"].astype(np.float64) - old["big"].astype(np.float64)
    expected = math.sqrt(float(diff @ diff) + 4.0)
    assert update_norm(new, old) == pytest.approx(expected, rel=1e-12)


def rows(accuracies: list[float | None], seconds: float = 2.0) -> list[dict[str, object]]:
    return [{"round": r, "test_accuracy": a, "seconds": seconds} for r, a in enumerate(accuracies)]


def test_target_accuracy_stops_at_the_first_round_reaching_it_and_reports_rounds_and_seconds() -> None:
    tracker = Convergence(StopRules(target_accuracy=0.8))
    stops = [tracker.observe(row) for row in rows([0.1, 0.5, None, 0.79, 0.8, 0.9])]
    assert [stop is not None for stop in stops] == [False, False, False, False, True, False]  # the first stop only
    assert tracker.reached == (4, 10.0)  # rounds 0..4, 2 s each
    assert tracker.stop == Stop("target_accuracy", 4, "accuracy 0.8000 reached the target 0.8")
    assert "reached at round 4 after 10.0 s" in tracker.summary(5)


def test_plateau_counts_evaluated_rounds_without_a_gain_above_min_delta() -> None:
    rules = StopRules(patience=2, min_delta=0.01)
    # best 0.5 at round 1; 0.505 is no gain (<= 0.01), round 3 not evaluated, 0.49 second stale round: stop at 4
    tracker = Convergence.replay(rules, rows([0.1, 0.5, 0.505, None, 0.49, 0.9]))
    assert tracker.stop is not None and (tracker.stop.rule, tracker.stop.round) == ("plateau", 4)
    assert tracker.best == 0.9  # rows after the stop still update the figures, never the stop
    # a gain resets the count
    assert Convergence.replay(rules, rows([0.1, 0.5, 0.505, 0.6, 0.61, 0.7])).stop is None


def test_the_federated_accuracy_counts_when_the_server_does_not_evaluate() -> None:
    assert row_accuracy({"test_accuracy": None, "federated_accuracy": 0.7}) == 0.7
    assert row_accuracy({"test_accuracy": 0.6, "federated_accuracy": 0.7}) == 0.6
    assert row_accuracy({"test_accuracy": float("nan")}) is None
    assert row_accuracy({"test_accuracy": True}) is None


def test_a_recorded_stop_is_final_whatever_the_rules_are_now() -> None:
    recorded = rows([0.1, 0.5, 0.6])
    recorded[2].update(stop_columns(Stop("plateau", 2)))
    assert recorded[2]["stopped_plateau"] == 1
    tracker = Convergence.replay(StopRules(), recorded)  # no rule set any more: the stop still stands
    assert tracker.stop == Stop("plateau", 2, "recorded in the history")
    # an empty cell read back from a CSV (NaN) is no stop
    assert Convergence.replay(StopRules(), [{"round": 1, "stopped_plateau": float("nan")}]).stop is None


def test_no_target_no_report_and_bad_rules_are_refused() -> None:
    assert Convergence.replay(StopRules(), rows([0.1, 0.99])).summary(1) == ""
    assert "not reached in 1 round(s)" in Convergence.replay(StopRules(target_accuracy=1.0), rows([0.1, 0.9])).summary(
        1
    )
    for bad in ({"target_accuracy": 0.0}, {"target_accuracy": 1.5}, {"patience": 0}, {"min_delta": -0.1}):
        with pytest.raises(ConfigError):
            StopRules(**bad)


def test_rules_that_no_evaluated_round_could_fire_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^target_accuracy reads each evaluated round's accuracy.*; REMEDY, or"):
        StopRules(target_accuracy=0.9).check_measurable(evaluated=False, remedy="REMEDY")
    with pytest.raises(ConfigError, match="target_accuracy and patience read"):
        StopRules(target_accuracy=0.9, patience=3).check_measurable(evaluated=False, remedy="REMEDY")
    StopRules(patience=3).check_measurable(evaluated=True, remedy="REMEDY")
    StopRules(min_delta=0.1).check_measurable(evaluated=False, remedy="REMEDY")  # min_delta alone stops nothing


def test_rules_whose_only_evaluation_reports_no_accuracy_are_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"^patience reads .* the task T declares that its evaluate reports \['mae'\]"
    ):
        StopRules(patience=2).check_accuracy_reported(("mae",), task="T", remedy="REMEDY")
    with pytest.raises(ConfigError, match=r"so they would never stop the run; report 'accuracy' .*REMEDY, or leave"):
        StopRules(target_accuracy=0.9, patience=2).check_accuracy_reported((), task="T", remedy="REMEDY")
    StopRules(patience=2).check_accuracy_reported(("accuracy", "mae"), task="T", remedy="REMEDY")
    StopRules(patience=2).check_accuracy_reported(None, task="T", remedy="REMEDY")  # declares nothing: not checked
    StopRules().check_accuracy_reported(("{they}",), task="{x}", remedy="REMEDY")  # no rule set: nothing to refuse
