"""The client-side runner: validation of what comes in and goes out, and the parallel-engine path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client.runner import ParallelTraining, run_instruction
from fedcore.engine.plan import ParallelPlan
from fedcore.errors import ClientTaskError, PayloadError
from fedcore.messages import EvaluateIns, FitIns, FitRes
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.task import FitConfig, TaskContext
from server.round_loop import RoundConfig, run_rounds
from simulations.inmemory import InMemoryPool
from tests.engine import engine_tasks

CONFIG = FitConfig(local_epochs=2, batch_size=8, lr=0.05, momentum=0.9, mu=0.1)
SPEC = f"{engine_tasks.__name__}:mlp_task"


def context(cid: str) -> TaskContext:
    return TaskContext(client_id=cid, seed=5, options={"n": {"a": "40", "b": "24"}[cid]})


def test_fit_returns_the_global_names_and_dtypes_and_counts_examples() -> None:
    task = engine_tasks.mlp_task(context("a"))
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    reply = run_instruction(task, FitIns(round=1, parameters=initial, config=CONFIG, seed=1), "a")
    assert isinstance(reply, FitRes)
    assert list(reply.parameters) == list(initial)
    assert all(reply.parameters[n].dtype == initial[n].dtype for n in initial)
    assert reply.num_examples == 40
    assert not all(np.array_equal(reply.parameters[n], initial[n]) for n in initial)


def test_mismatched_global_model_is_refused_before_training() -> None:
    task = engine_tasks.mlp_task(context("a"))
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    wrong = {n: (a[:1] if a.ndim else a) for n, a in initial.items()}
    with pytest.raises(PayloadError, match="shape"):
        run_instruction(task, FitIns(round=2, parameters=wrong, config=CONFIG, seed=1), "a")


def test_a_task_that_raises_becomes_a_client_task_error_with_context() -> None:
    task = engine_tasks.mlp_task(context("a"))
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    broken = type(task)(model_fn=task.model_fn, train_data=(task.train_data[0][:, :3], task.train_data[1]))  # type: ignore[index]
    with pytest.raises(ClientTaskError, match=r"round 4, client 'a', stage fit.*RuntimeError"):
        run_instruction(broken, FitIns(round=4, parameters=initial, config=CONFIG, seed=1), "a")


class _Returns:
    """The MLP task, with train and evaluate returning ``value`` instead of their results."""

    def __init__(self, value: object) -> None:
        self.inner = engine_tasks.mlp_task(context("a"))
        self.value = value

    def build_model(self) -> torch.nn.Module:
        return self.inner.build_model()

    def train(self, model: torch.nn.Module, config: FitConfig, context: object) -> object:
        self.inner.train(model, config, context)  # type: ignore[arg-type]
        return self.value

    def evaluate(self, model: torch.nn.Module, batch_size: int) -> object:
        return self.value


@pytest.mark.parametrize(
    ("value", "shown"), [(None, "None (NoneType)"), ((np.zeros(2), 40, {}), "(array([0., 0.]), 40, {}) (tuple)")]
)
def test_a_train_or_evaluate_that_returns_no_result_says_what_it_must_return(value: object, shown: str) -> None:
    """A forgotten ``return`` (None) or Flower's (parameters, num_examples, metrics) tuple: the round failed with
    "the task raised AttributeError: 'NoneType' object has no attribute 'num_examples'"."""
    task = _Returns(value)
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    with pytest.raises(ClientTaskError) as caught:
        run_instruction(task, FitIns(round=3, parameters=initial, config=CONFIG, seed=1), "a")  # type: ignore[arg-type]
    assert str(caught.value) == (
        f"[round 3, client 'a', stage fit] task.train returned {shown}, not a TrainResult; it must return "
        "TrainResult(num_examples=..., metrics=...) (fedcore.task)"
    )
    with pytest.raises(ClientTaskError) as caught:
        run_instruction(task, EvaluateIns(round=3, parameters=initial), "a")  # type: ignore[arg-type]
    assert str(caught.value) == (
        f"[round 3, client 'a', stage evaluate] task.evaluate returned {shown}, not an EvalResult; it must return "
        "EvalResult(loss=..., num_examples=..., metrics=...) (fedcore.task)"
    )


def test_evaluate_reports_loss_and_accuracy() -> None:
    task = engine_tasks.mlp_task(context("b"))
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    reply = run_instruction(task, EvaluateIns(round=1, parameters=initial), "b")
    assert reply.num_examples == 24
    assert 0.0 <= reply.metrics["accuracy"] <= 1.0


@pytest.mark.slow
def test_round_with_a_pipelined_client_equals_the_round_on_one_device() -> None:
    """One client trains on a 2-stage 1F1B pipeline (2 processes), the other in-process; same global model."""
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    strategy = Strategy(fit=CONFIG, sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=2))
    pipeline = ParallelPlan(pipeline=2, split_points=("2",), microbatches=4, schedule="1f1b")  # type: ignore[arg-type]

    def run(plan_for_a: ParallelPlan | None) -> dict[str, np.ndarray]:
        def parallel(cid: str) -> ParallelTraining | None:
            if cid != "a" or plan_for_a is None:
                return None
            return ParallelTraining(task_factory=SPEC, task_context=context(cid), plan=plan_for_a, timeout_s=120)

        pool = InMemoryPool(["a", "b"], lambda cid: engine_tasks.mlp_task(context(cid)), parallel)
        return run_rounds(pool, strategy, initial, RoundConfig(num_rounds=1, seed=9))[0].parameters

    with_pipeline, on_one_device = run(pipeline), run(None)
    for name in initial:
        torch.testing.assert_close(
            torch.from_numpy(with_pipeline[name]), torch.from_numpy(on_one_device[name]), atol=1e-5, rtol=1e-5
        )


class Reports:
    """A task whose train and evaluate return fixed values, to check what the runner lets through."""

    def __init__(self, num_examples: object, metrics: object, loss: object = 0.5) -> None:
        self.num_examples, self.metrics, self.loss = num_examples, metrics, loss

    def build_model(self) -> torch.nn.Module:
        return engine_tasks.mlp()

    def train(self, model, config, context):  # type: ignore[no-untyped-def]
        from fedcore.task import TrainResult

        return TrainResult(num_examples=self.num_examples, metrics=self.metrics)

    def evaluate(self, model, batch_size):  # type: ignore[no-untyped-def]
        from fedcore.task import EvalResult

        return EvalResult(loss=self.loss, num_examples=self.num_examples, metrics=self.metrics)


@pytest.mark.parametrize("count", [True, 2.5, -1, "3", None, 2**63, 10**30])
def test_an_example_count_that_is_not_an_integer_fails_the_instruction_with_its_value(count: object) -> None:
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    for ins in (FitIns(round=3, parameters=initial, config=CONFIG, seed=1), EvaluateIns(round=3, parameters=initial)):
        with pytest.raises(ClientTaskError, match=rf"round 3, client 'a', stage {ins.stage.value}.*num_examples="):
            run_instruction(Reports(count, {}), ins, "a")


def test_metrics_become_floats_under_str_names_and_what_is_not_a_number_is_dropped() -> None:
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    metrics = {
        "acc": np.float32(0.5),
        "ok": True,
        3: 2,
        "huge": 10**400,
        "nan": float("nan"),
        "s": "x",
        "t": torch.tensor(0.25),
        "x" * 300: 1.0,
    }
    reply = run_instruction(
        Reports(np.int64(7), metrics), FitIns(round=1, parameters=initial, config=CONFIG, seed=1), "a"
    )
    assert isinstance(reply, FitRes) and reply.num_examples == 7 and type(reply.num_examples) is int
    got = dict(reply.metrics)
    assert got.pop("fit_seconds") >= 0.0
    assert got.pop("nan") != got.get("nan", 0.0)  # NaN is passed on: the server leaves it out and counts it
    assert got == {"acc": 0.5, "ok": 1.0, "3": 2.0, "huge": float("inf"), "t": 0.25, "x" * 128: 1.0}
    assert all(type(v) is float for v in reply.metrics.values())
    with pytest.raises(ClientTaskError, match="metrics of type list"):
        run_instruction(Reports(7, [0.5]), FitIns(round=1, parameters=initial, config=CONFIG, seed=1), "a")


def test_an_evaluation_loss_that_is_a_number_is_passed_on_and_one_that_is_not_fails() -> None:
    # NaN/Inf losses (an empty split, a diverged model) are metric values: the server leaves them out and counts
    # them (issue 8: a metric value never fails anything); a loss that is no number is a bug in the task
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    ins = EvaluateIns(round=2, parameters=initial)
    reply = run_instruction(Reports(0, {}, loss=float("nan")), ins, "a")
    assert reply.num_examples == 0 and reply.loss != reply.loss  # type: ignore[union-attr]
    reply = run_instruction(Reports(5, {"accuracy": 0.5}, loss=float("inf")), ins, "a")
    assert (reply.num_examples, reply.loss, reply.metrics) == (5, float("inf"), {"accuracy": 0.5})  # type: ignore[union-attr]
    assert run_instruction(Reports(5, {}, loss=10**400), ins, "a").loss == float("inf")  # type: ignore[union-attr]
    with pytest.raises(ClientTaskError, match=r"loss='low' \(str\); the loss must be a number"):
        run_instruction(Reports(5, {}, loss="low"), ins, "a")


class ReadsGlobalsAfterTraining:
    """Trains (moves every parameter by 1), then reads the round's global parameters and writes into them."""

    def __init__(self) -> None:
        self.seen: dict[str, torch.Tensor] = {}

    def build_model(self) -> torch.nn.Module:
        return engine_tasks.mlp()

    def train(self, model, config, context):  # type: ignore[no-untyped-def]
        from fedcore.task import TrainResult

        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        assert len(context.global_parameters) == len(list(model.parameters()))
        for name, tensor in context.global_parameters.items():
            self.seen[name] = tensor.clone()
            tensor.fill_(7.0)  # must not reach the global model the other clients get
        return TrainResult(num_examples=3)

    def evaluate(self, model, batch_size):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def test_global_parameters_are_the_received_ones_whenever_read_and_writing_them_changes_nothing() -> None:
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    before = {n: a.copy() for n, a in initial.items()}
    task = ReadsGlobalsAfterTraining()
    reply = run_instruction(task, FitIns(round=1, parameters=initial, config=CONFIG, seed=1), "a")
    assert set(task.seen) == {n for n, _ in engine_tasks.mlp().named_parameters()}
    for name, tensor in task.seen.items():
        assert torch.equal(tensor, torch.from_numpy(before[name])), name  # read after training: still the global
        assert np.array_equal(initial[name], before[name]), name
        assert np.array_equal(reply.parameters[name], before[name] + np.float32(1.0)), name  # type: ignore[union-attr]
