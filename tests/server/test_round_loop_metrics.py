"""No metric value can end a round or a run, or cost a round its model (issue 8, "Run-killing metric values").

Clients train a real model on small synthetic data through the in-memory pool; their tasks report the bad values.
Non-finite values and zero-weight reports are left out of their metric's average, the count is recorded with the
round (``RoundRecord.metrics_left_out``), and the global model is the same as when the bad values are absent.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator, Mapping
from typing import cast

import numpy as np
import pytest
import torch
from torch import nn

from client.runner import run_instruction
from fedcore.errors import ClientTaskError
from fedcore.messages import EvaluateIns, EvaluateRes, FitIns, FitRes, Reply, ServerMessage
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import EvalResult, FitConfig, TrainContext, TrainResult, initial_parameters
from fedcore.tensors import NamedArrays
from server.round_loop import RoundConfig, RoundRecord, run_rounds
from simulations.inmemory import InMemoryPool

SIZES = {"c0": 60, "c1": 20, "c2": 40}


def model_fn() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def data(cid: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(int(cid[1:]))
    x = torch.randn(SIZES[cid], 4, generator=g)
    return x, (x[:, 0] > 0).long()


class Reporting:
    """A supervised client that adds ``extra`` to its training metrics and may have an empty test split."""

    def __init__(self, cid: str, extra: Mapping[str, object] | None = None, empty_test: bool = False) -> None:
        x, y = data(cid)
        self.inner = SupervisedTask(
            model_fn=model_fn, train_data=(x, y), test_data=(x[:0], y[:0]) if empty_test else (x, y)
        )
        self.extra = dict(extra or {})

    def build_model(self) -> nn.Module:
        return model_fn()

    def train(self, model: nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        result = self.inner.train(model, config, context)
        return TrainResult(
            num_examples=result.num_examples,
            metrics={**result.metrics, **self.extra},  # type: ignore[dict-item]  # deliberate: values of any kind
        )

    def evaluate(self, model: nn.Module, batch_size: int) -> EvalResult:
        return self.inner.evaluate(model, batch_size)


def strategy(fraction_evaluate: float = 0.0) -> Strategy:
    return Strategy(
        fit=FitConfig(batch_size=8, lr=0.1),
        sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=3, fraction_evaluate=fraction_evaluate),
        evaluate_batch_size=16,
    )


def run(tasks: dict[str, Reporting], rounds: int = 2, **kwargs: object) -> tuple[NamedArrays, list[RoundRecord]]:
    state, records = run_rounds(
        InMemoryPool(list(tasks), lambda cid: tasks[cid]),
        kwargs.pop("strategy", strategy()),  # type: ignore[arg-type]
        initial_parameters(model_fn, seed=1),
        RoundConfig(num_rounds=rounds, seed=2),
        **kwargs,  # type: ignore[arg-type]
    )
    return state.parameters, records


def plain() -> dict[str, Reporting]:
    return {cid: Reporting(cid) for cid in SIZES}


@functools.cache
def reference_model(rounds: int) -> NamedArrays:
    """The global model when every client reports only its plain training metrics."""
    return run(plain(), rounds=rounds)[0]


def assert_same_model(a: NamedArrays, b: NamedArrays) -> None:
    assert all(np.array_equal(a[n], b[n]) for n in a)


def test_a_nan_fit_metric_is_left_out_and_the_round_and_its_model_are_kept() -> None:
    # the issue's first case: c1's AUC is NaN (its data hold a single class)
    tasks = {
        "c0": Reporting("c0", {"auc": 0.9}),
        "c1": Reporting("c1", {"auc": math.nan}),
        "c2": Reporting("c2", {"auc": 0.6}),
    }
    params, records = run(tasks)
    reference = reference_model(rounds=2)
    assert_same_model(params, reference)  # the model update is unaffected
    for record in records:
        # auc over c0 and c2: (60·0.9 + 40·0.6) / 100 = 0.78
        assert record.train_metrics["auc"] == pytest.approx(0.78, rel=1e-12)
        assert record.metrics_left_out == 1
        row = record.as_row()
        assert row["metrics_left_out"] == 1 and type(row["metrics_left_out"]) is int


def test_a_client_with_an_empty_test_split_is_left_out_of_federated_evaluation() -> None:
    # the second case: c1 reports loss NaN with 0 examples
    tasks = {cid: Reporting(cid, empty_test=cid == "c1") for cid in SIZES}
    params, records = run(tasks, rounds=1, strategy=strategy(fraction_evaluate=1.0))
    record = records[-1]
    # the reference: the two other clients' evaluations of the final model, weighted 60 : 40
    ins = EvaluateIns(round=1, parameters=params, batch_size=16)
    res = {cid: run_instruction(tasks[cid], ins, cid) for cid in ("c0", "c2")}
    assert isinstance(res["c0"], EvaluateRes) and isinstance(res["c2"], EvaluateRes)
    assert record.federated_eval_loss == pytest.approx((60 * res["c0"].loss + 40 * res["c2"].loss) / 100, rel=1e-12)
    accuracy = (60 * res["c0"].metrics["accuracy"] + 40 * res["c2"].metrics["accuracy"]) / 100
    assert record.federated_eval_metrics["accuracy"] == pytest.approx(accuracy, rel=1e-12)
    assert record.metrics_left_out == 1  # c1's loss (an empty split reports no accuracy)
    assert record.failures == ()
    reference = reference_model(rounds=1)
    assert_same_model(params, reference)


def test_when_every_client_has_an_empty_test_split_the_round_records_no_federated_loss() -> None:
    tasks = {cid: Reporting(cid, empty_test=True) for cid in SIZES}
    _, records = run(tasks, rounds=1, strategy=strategy(fraction_evaluate=1.0))
    assert records[-1].federated_eval_loss is None and records[-1].metrics_left_out == 3


def test_bool_huge_missing_and_non_numeric_fit_metrics_never_fail_a_round(caplog: pytest.LogCaptureFixture) -> None:
    odd: dict[str, object] = {
        "flag": True,
        "huge": 10**400,
        "text": "high",
        "none": None,
        7: 1.0,  # type: ignore[dict-item]  # deliberate: a name that is not a str
        "big": 1e308,
    }
    tasks = {"c0": Reporting("c0", odd), "c1": Reporting("c1", {"flag": False, "big": 1e308}), "c2": Reporting("c2")}
    with caplog.at_level(logging.WARNING):
        params, records = run(tasks)
    reference = reference_model(rounds=2)
    assert_same_model(params, reference)
    metrics = records[-1].train_metrics
    assert metrics["flag"] == pytest.approx(60 / 80)  # c0 True (60 examples), c1 False (20); c2 reports none
    assert metrics["big"] == pytest.approx(1e308)  # 1e308·60 + 1e308·20 overflows; the mean does not
    assert metrics["7"] == 1.0  # a non-str name becomes its text on the client
    assert "huge" not in metrics and "text" not in metrics and "none" not in metrics
    assert records[-1].metrics_left_out == 1  # huge: inf on the client, left out on the server
    assert "dropping 2 metric(s) that are not numbers" in caplog.text


def failing_evaluations() -> list[object]:
    def nan_loss(params: NamedArrays, rnd: int) -> EvalResult:
        return EvalResult(
            loss=math.nan,
            num_examples=5,
            metrics={"accuracy": "n/a", "ok": True, "inf": math.inf},  # type: ignore[dict-item]  # deliberate: "n/a"
        )

    def empty_split(params: NamedArrays, rnd: int) -> EvalResult:
        return EvalResult(loss=math.nan, num_examples=0, metrics={"accuracy": 0.0})

    def raises(params: NamedArrays, rnd: int) -> EvalResult:
        raise RuntimeError("the server's test data are gone")

    def not_a_result(params: NamedArrays, rnd: int) -> object:
        return (0.5, {"accuracy": 0.5})  # flwr's evaluate_fn shape

    def bad_labels(params: NamedArrays, rnd: int) -> EvalResult:  # what evaluate_supervised raises for them
        raise ClientTaskError("labels 12 lie outside the model's 10 classes; give labels in 0..9")

    return [nan_loss, empty_split, raises, not_a_result, bad_labels]


@pytest.mark.parametrize(
    "evaluate_fn", failing_evaluations(), ids=["nan-loss", "empty-split", "raises", "not-a-result", "bad-labels"]
)
def test_the_servers_own_evaluation_never_costs_a_round(evaluate_fn: object, caplog: pytest.LogCaptureFixture) -> None:
    """An evaluation that fails is logged and left out of the round's record; the round and its model are kept. A
    failure that names its cause in the server's data (a ClientTaskError) is one line a round, without traceback;
    another error has its traceback logged the first time, then one line each round it repeats."""
    with caplog.at_level(logging.ERROR, logger="fedcore.server"):
        params, records = run(plain(), evaluate_fn=evaluate_fn)
    if evaluate_fn.__name__ == "raises":  # type: ignore[attr-defined]
        failed = [r for r in caplog.records if "evaluation failed" in r.getMessage()]
        assert [(r.getMessage(), r.exc_info is not None) for r in failed] == [
            ("round 0: the server's evaluation failed; the round is recorded without it", True),
            *(
                (
                    f"round {rnd}: the server's evaluation failed again (RuntimeError: the server's test data are "
                    "gone); the round is recorded without it",
                    False,
                )
                for rnd in (1, 2)
            ),
        ]
    if evaluate_fn.__name__ == "bad_labels":  # type: ignore[attr-defined]
        failed = [r for r in caplog.records if "evaluation failed" in r.getMessage()]
        assert [r.getMessage() for r in failed] == [
            f"round {rnd}: the server's evaluation failed on the server's test data: labels 12 lie outside the "
            "model's 10 classes; give labels in 0..9; the round is recorded without it"
            for rnd in (0, 1, 2)
        ]
        assert all(r.exc_info is None for r in failed)
    reference = reference_model(rounds=2)
    assert_same_model(params, reference)
    assert [r.round for r in records] == [0, 1, 2]
    for record in records:
        if evaluate_fn.__name__ == "nan_loss":  # type: ignore[attr-defined]
            # values that are numbers are kept as they are (a NaN test loss is how divergence shows); "n/a" is not
            assert record.eval_loss is not None and math.isnan(record.eval_loss)
            assert record.eval_metrics == {"ok": 1.0, "inf": math.inf}
            assert record.metrics_left_out == 1
        elif evaluate_fn.__name__ == "empty_split":  # type: ignore[attr-defined]
            # 0 examples: a NaN without meaning (not divergence); left out like a client's empty split
            assert record.eval_loss is None and record.eval_metrics == {} and record.metrics_left_out == 2
        else:
            assert record.eval_loss is None and record.eval_metrics == {}


class DirectPool:
    """A client pool (the :class:`server.pool.ClientPool` protocol) whose clients reply with fixed example counts
    and metrics, as a pool of another transport could deliver them."""

    def __init__(self, counts: dict[str, object], metrics: dict[str, object]) -> None:
        self.counts, self.metrics = counts, metrics

    def available(self) -> list[str]:
        return list(self.counts)

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        return self.available()

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[Reply]:
        for cid, ins in instructions.items():
            assert isinstance(ins, FitIns)
            moved = {n: a + np.asarray(1, a.dtype) for n, a in ins.parameters.items()}
            count, metrics = cast(int, self.counts[cid]), cast(Mapping[str, float], self.metrics[cid])
            yield FitRes(client_id=cid, round=ins.round, parameters=moved, num_examples=count, metrics=metrics)


def test_example_counts_that_are_not_integers_reject_that_update_only() -> None:
    # g: beyond the wire's int64 and the state database's INTEGER, within the float range
    counts: dict[str, object] = {"a": 10, "b": True, "c": 2.5, "d": -3, "e": 10**400, "f": np.int64(30), "g": 10**30}
    metrics: dict[str, object] = {cid: {"loss": 1.0} for cid in counts}
    metrics["a"] = None  # not a dict at all
    start = {"w": np.array([0.0, 1.0], np.float32)}
    sampling = SamplingConfig(fraction_fit=1.0, min_fit_clients=1)
    state, records = run_rounds(
        DirectPool(counts, metrics), Strategy(sampling=sampling), start, RoundConfig(num_rounds=1)
    )
    assert records[-1].accepted == ("a", "f")
    assert {f.client_id for f in records[-1].failures} == {"b", "c", "d", "e", "g"}
    reasons = " ".join(f.reason for f in records[-1].failures)
    assert "is not an integer in 0..2**63-1" in reasons and "the example count 10000" in reasons
    np.testing.assert_array_equal(state.parameters["w"], [1.0, 2.0])
    assert records[-1].train_metrics == {"loss": 1.0} and records[-1].metrics_left_out == 1


def test_metric_values_of_both_signs_beyond_the_float_range_in_sum_never_fail_a_round() -> None:
    # 10·1e308 and 30·(-1e308) are +inf and -inf as products; the mean, -0.5e308, is a float
    counts: dict[str, object] = {"a": 10, "b": 30}
    metrics: dict[str, object] = {"a": {"big": 1e308, "inf": math.inf}, "b": {"big": -1e308, "inf": -math.inf}}
    sampling = SamplingConfig(fraction_fit=1.0, min_fit_clients=1)
    state, records = run_rounds(
        DirectPool(counts, metrics),
        Strategy(sampling=sampling),
        {"w": np.zeros(2, np.float32)},
        RoundConfig(num_rounds=1),
    )
    assert records[-1].accepted == ("a", "b")
    assert records[-1].train_metrics == {"big": pytest.approx(-0.5e308, rel=1e-15)}
    assert records[-1].metrics_left_out == 2  # the two infinities
    np.testing.assert_array_equal(state.parameters["w"], [1.0, 1.0])


class Diverged(Reporting):
    """A client whose evaluation gives an infinite loss on its 20 examples, and accuracy 1.0."""

    def evaluate(self, model: nn.Module, batch_size: int) -> EvalResult:
        return EvalResult(loss=math.inf, num_examples=20, metrics={"accuracy": 1.0})


def test_a_clients_infinite_evaluation_loss_is_left_out_not_a_failure() -> None:
    tasks = {"c0": Reporting("c0"), "c1": Diverged("c1"), "c2": Reporting("c2")}
    params, records = run(tasks, rounds=1, strategy=strategy(fraction_evaluate=1.0))
    record = records[-1]
    ins = EvaluateIns(round=1, parameters=params, batch_size=16)
    res = {cid: run_instruction(tasks[cid], ins, cid) for cid in ("c0", "c2")}
    assert isinstance(res["c0"], EvaluateRes) and isinstance(res["c2"], EvaluateRes)
    assert record.failures == () and record.metrics_left_out == 1  # c1's loss only
    assert record.federated_eval_loss == pytest.approx((60 * res["c0"].loss + 40 * res["c2"].loss) / 100, rel=1e-12)
    accuracy = (60 * res["c0"].metrics["accuracy"] + 20 * 1.0 + 40 * res["c2"].metrics["accuracy"]) / 120
    assert record.federated_eval_metrics["accuracy"] == pytest.approx(accuracy, rel=1e-12)
