"""Quality weighting in the round loop: the global model is the mean of the local models weighted by a metric each
client reports (softmax over -loss/T) or by the server's evaluation of each update, computed by hand from each
client's own run; a client without the metric is rejected or takes the fallback."""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import pytest
import torch

from client.runner import ParallelTraining, run_instruction
from fedcore.aggregation.weights import QualityWeights
from fedcore.engine.plan import ParallelPlan
from fedcore.errors import ClientTaskError, ConfigError
from fedcore.messages import FitIns, FitRes
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import (
    EvalResult,
    FitConfig,
    TaskContext,
    TrainContext,
    TrainResult,
    central_evaluation,
    initial_parameters,
)
from fedcore.tensors import NamedArrays
from server.round_loop import RoundConfig, run_rounds
from simulations.datasets import load_digits_dataset
from simulations.inmemory import InMemoryPool
from tests.engine import engine_tasks
from tests.server.test_round_loop import make_pool, model_fn, shards  # noqa: F401 - fixture

Shards = list[tuple[torch.Tensor, torch.Tensor]]
FIT = FitConfig(local_epochs=1, batch_size=16, lr=0.1)
SAMPLING = SamplingConfig(fraction_fit=1.0, min_fit_clients=4)


def local_replies(shards: Shards, initial: NamedArrays) -> list[FitRes]:  # noqa: F811
    """Each client's own run of round 1 from ``initial`` (what the pool would deliver)."""
    replies = []
    for i, shard in enumerate(shards):
        reply = run_instruction(SupervisedTask(model_fn=model_fn, train_data=shard),
                                FitIns(round=1, parameters=initial, config=FIT, seed=3), f"c{i}")  # fmt: skip
        assert isinstance(reply, FitRes)
        replies.append(reply)
    return replies


def weighted_mean(replies: list[FitRes], weights: list[float]) -> dict[str, np.ndarray]:
    total = sum(weights)
    return {
        name: cast(
            np.ndarray,
            sum(w * r.parameters[name].astype(np.float64) for r, w in zip(replies, weights, strict=True)) / total,
        )
        for name in replies[0].parameters
    }


def test_client_metric_weighting_is_the_softmax_weighted_mean(shards: Shards) -> None:  # noqa: F811
    initial = initial_parameters(model_fn, seed=1)
    quality = QualityWeights(metric="train_loss", temperature=0.2)
    strategy = Strategy(fit=FIT, sampling=SAMPLING, weighting="metric", quality=quality)
    state, _ = run_rounds(make_pool(shards), strategy, initial, RoundConfig(num_rounds=1, seed=3))
    replies = local_replies(shards, initial)
    losses = [r.metrics["train_loss"] for r in replies]
    assert len(set(losses)) == 4  # the weights differ: the test can tell them from uniform or examples
    expected = weighted_mean(replies, [math.exp(-loss / 0.2) for loss in losses])
    for name, value in state.parameters.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_server_evaluation_weighting_weighs_each_update_by_its_validation_accuracy(shards: Shards) -> None:  # noqa: F811
    data = load_digits_dataset(seed=0)
    validation = SupervisedTask(model_fn=model_fn, train_data=None,
                                test_data=(torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)))  # fmt: skip
    validate = central_evaluation(validation, 256)
    initial = initial_parameters(model_fn, seed=1)
    quality = QualityWeights(metric="accuracy", transform="proportional")
    strategy = Strategy(fit=FIT, sampling=SAMPLING, weighting="server", quality=quality)
    with pytest.raises(ConfigError, match="no validation data"):
        run_rounds(make_pool(shards), strategy, initial, RoundConfig(num_rounds=1, seed=3))
    state, _ = run_rounds(make_pool(shards), strategy, initial, RoundConfig(num_rounds=1, seed=3), validate_fn=validate)
    replies = local_replies(shards, initial)
    accuracies = [validate(r.parameters, 1).metrics["accuracy"] for r in replies]
    expected = weighted_mean(replies, accuracies)
    for name, value in state.parameters.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


class SilentTask:
    """A client that trains as the others but reports no metric."""

    def __init__(self, shard: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.inner = SupervisedTask(model_fn=model_fn, train_data=shard)

    def build_model(self) -> torch.nn.Module:
        return model_fn()

    def train(self, model: torch.nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        return TrainResult(num_examples=self.inner.train(model, config, context).num_examples, metrics={})

    def evaluate(self, model: torch.nn.Module, batch_size: int) -> EvalResult:
        return self.inner.evaluate(model, batch_size)


def test_a_client_reporting_no_metric_is_rejected_or_takes_the_fallback(shards: Shards) -> None:  # noqa: F811
    initial = initial_parameters(model_fn, seed=1)
    override: dict[int, object] = {2: lambda: SilentTask(shards[2])}
    sampling = SamplingConfig(fraction_fit=1.0, min_fit_clients=4)
    strict = Strategy(fit=FIT, sampling=sampling, weighting="metric", quality=QualityWeights(temperature=0.2))
    _, records = run_rounds(make_pool(shards, override), strict, initial, RoundConfig(num_rounds=1, seed=3))  # type: ignore[arg-type]
    assert records[-1].accepted == ("c0", "c1", "c3")
    assert "no usable 'train_loss'" in records[-1].failures[0].reason and records[-1].failures[0].client_id == "c2"
    lenient = Strategy(fit=FIT, sampling=sampling, weighting="metric",
                       quality=QualityWeights(temperature=0.2, fallback=5.0))  # fmt: skip
    state, records = run_rounds(make_pool(shards, override), lenient, initial, RoundConfig(num_rounds=1, seed=3))  # type: ignore[arg-type]
    assert records[-1].accepted == ("c0", "c1", "c2", "c3")
    replies = local_replies(shards, initial)
    weights = [math.exp(-(5.0 if i == 2 else r.metrics["train_loss"]) / 0.2) for i, r in enumerate(replies)]
    expected = weighted_mean(replies, weights)
    for name, value in state.parameters.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_clients_report_their_validation_loss_and_the_round_weighs_by_it(shards: Shards) -> None:  # noqa: F811
    data = load_digits_dataset(seed=0)
    held_out = (torch.from_numpy(data.x_test), torch.from_numpy(data.y_test))
    ids = [f"c{i}" for i in range(len(shards))]

    def make(cid: str) -> SupervisedTask:
        return SupervisedTask(model_fn=model_fn, train_data=shards[int(cid[1:])], test_data=held_out)

    fit = FitConfig(local_epochs=1, batch_size=16, lr=0.1, report_validation=True)
    initial = initial_parameters(model_fn, seed=1)
    quality = QualityWeights(metric="val_loss", temperature=0.2)
    strategy = Strategy(fit=fit, sampling=SAMPLING, weighting="metric", quality=quality)
    state, records = run_rounds(InMemoryPool(ids, make), strategy, initial, RoundConfig(num_rounds=1, seed=3))
    assert {"train_val_loss", "train_val_accuracy"} <= set(records[-1].as_row())
    replies = []
    for cid in ids:
        reply = run_instruction(make(cid), FitIns(round=1, parameters=initial, config=fit, seed=3), cid)
        assert isinstance(reply, FitRes)
        own = make(cid).evaluate(_loaded(reply.parameters), 16)  # the client's model on its held-out data
        assert reply.metrics["val_loss"] == own.loss and reply.metrics["val_accuracy"] == own.metrics["accuracy"]
        replies.append(reply)
    # training is the same with or without the report: the updates equal those of the plain configuration
    plain = local_replies(shards, initial)
    for a, b in zip(replies, plain, strict=True):
        for name in a.parameters:
            np.testing.assert_array_equal(a.parameters[name], b.parameters[name])
    expected = weighted_mean(replies, [math.exp(-r.metrics["val_loss"] / 0.2) for r in replies])
    for name, value in state.parameters.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


def _loaded(parameters: NamedArrays) -> torch.nn.Module:
    model = model_fn()
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in parameters.items()})
    return model


def test_report_validation_is_refused_under_a_parallel_plan() -> None:
    task = engine_tasks.mlp_task(TaskContext(client_id="a", seed=5, options={"n": "40"}))
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    plan = ParallelTraining(task_factory="x:y", task_context=TaskContext(), plan=ParallelPlan(data_parallel=2))
    ins = FitIns(round=1, parameters=initial, config=FitConfig(report_validation=True), seed=0)
    with pytest.raises(ClientTaskError, match=r"report_validation.*parallel training plan"):
        run_instruction(task, ins, "a", parallel=plan)
