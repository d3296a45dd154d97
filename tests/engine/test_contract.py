"""The engine's contract: a task declares model, data and loss to be trained under a parallel plan; a task with
its own loop runs as-is on one device and is refused under a parallel plan, never silently replaced."""

from __future__ import annotations

import numpy as np
import pytest
from torch import nn

from client.runner import ParallelTraining, run_instruction
from fedcore.engine import ParallelPlan, train_with_plan
from fedcore.errors import ConfigError
from fedcore.messages import FitIns, FitRes
from fedcore.supervised import SupervisedTask
from fedcore.task import EngineTask, FitConfig, TaskContext, check_engine_task, engine_task_problem
from tests.engine import engine_tasks

CTX = TaskContext(client_id="c1", seed=3, options={"n": "40"})
CONFIG = FitConfig(local_epochs=1, batch_size=8, lr=0.1)
DATA_PARALLEL = ParallelPlan(data_parallel=2)


def factory(name: str) -> str:
    return f"{engine_tasks.__name__}:{name}"


def test_a_supervised_task_fits_the_contract() -> None:
    task = engine_tasks.mlp_task(CTX)
    assert isinstance(task, EngineTask)
    assert engine_task_problem(task) is None
    assert check_engine_task(task) is task


def test_a_task_without_data_and_loss_is_told_what_to_add() -> None:
    problem = engine_task_problem(engine_tasks.OwnLoopTask())
    assert problem is not None
    assert "OwnLoopTask has its own training loop" in problem
    assert "training_data() method" in problem and "loss_fn(output, target, reduction=...)" in problem
    assert not isinstance(engine_tasks.OwnLoopTask(), EngineTask)


def test_a_subclass_that_overrides_train_has_its_own_loop() -> None:
    problem = engine_task_problem(engine_tasks.head_only_task(CTX))
    assert problem is not None and "HeadOnlyTask overrides train() of SupervisedTask" in problem


@pytest.mark.parametrize("name", ["own_loop_task", "head_only_task"])
def test_train_with_plan_refuses_a_task_with_its_own_loop_before_any_worker(name: str) -> None:
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    with pytest.raises(ConfigError, match="a parallel plan cannot train this task") as info:
        train_with_plan(factory(name), CTX, initial, CONFIG, DATA_PARALLEL, seed=0, round=2, client_id="c1")
    assert "without a parallel plan" in str(info.value) and "round 2" in str(info.value)


@pytest.mark.parametrize("name", ["own_loop_task", "head_only_task"])
def test_an_instruction_under_a_parallel_plan_refuses_a_task_with_its_own_loop(name: str) -> None:
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    task = getattr(engine_tasks, name)(CTX)
    parallel = ParallelTraining(task_factory=factory(name), task_context=CTX, plan=DATA_PARALLEL)
    with pytest.raises(ConfigError, match="cannot train this task"):
        run_instruction(task, FitIns(round=1, parameters=initial, config=CONFIG, seed=0), "c1", parallel=parallel)


def test_a_task_with_its_own_loop_runs_as_is_on_one_device() -> None:
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    expected = {n: a * np.float32(0.5) + np.float32(0.5) for n, a in initial.items()}
    ins = FitIns(round=1, parameters=initial, config=CONFIG, seed=0)
    reply = run_instruction(engine_tasks.OwnLoopTask(), ins, "c1")
    updated, result = train_with_plan(
        factory("own_loop_task"), CTX, initial, CONFIG, ParallelPlan(), seed=0, round=1, client_id="c1"
    )
    assert isinstance(reply, FitRes) and reply.num_examples == result.num_examples == 7
    assert result.metrics == {"train_loss": 0.25}
    for name in initial:
        assert np.array_equal(reply.parameters[name], expected[name]), name
        assert np.array_equal(updated[name], expected[name]), name


def test_a_subclass_loop_runs_as_written_on_one_device_by_the_runner_and_the_engine() -> None:
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    ins = FitIns(round=2, parameters=initial, config=CONFIG, seed=4)
    reply = run_instruction(engine_tasks.head_only_task(CTX), ins, "c1")
    updated, _ = train_with_plan(
        factory("head_only_task"), CTX, initial, CONFIG, ParallelPlan(), seed=4, round=2, client_id="c1"
    )
    assert isinstance(reply, FitRes)
    for name in initial:
        assert np.array_equal(updated[name], reply.parameters[name]), name
        # only the head ("4.") is trained: the task's own loop ran, not the engine's
        assert np.array_equal(reply.parameters[name], initial[name]) == (not name.startswith("4.")), name


def test_a_loss_without_a_reduction_argument_is_refused_under_a_plan_before_any_worker() -> None:
    # the workers used to start and fail with "TypeError: _mean_loss() got an unexpected keyword argument"
    problem = engine_task_problem(engine_tasks.mean_loss_task(CTX))
    assert problem is not None and "loss_fn _mean_loss takes no reduction argument" in problem
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    with pytest.raises(ConfigError, match=r"a parallel plan cannot train this task: .* reduction='sum'"):
        train_with_plan(factory("mean_loss_task"), CTX, initial, CONFIG, DATA_PARALLEL, seed=0, round=1, client_id="c1")


def test_a_loss_without_a_reduction_argument_trains_as_is_on_one_device() -> None:
    # in process it raised the same TypeError; the task's own train() (train_supervised, batch means) runs instead
    initial = engine_tasks.initial_parameters(engine_tasks.mlp)
    expected, _ = engine_tasks.reference(engine_tasks.mlp_task, CTX, initial, CONFIG, seed=0, round=1, client_id="c1")
    updated, _ = train_with_plan(
        factory("mean_loss_task"), CTX, initial, CONFIG, ParallelPlan(), seed=0, round=1, client_id="c1"
    )
    engine_tasks.assert_same_state(updated, expected)


@pytest.mark.parametrize(
    ("loss_fn", "accepted"),
    [
        (nn.functional.cross_entropy, True),
        (lambda output, target, **kwargs: output.sum(), True),
        (lambda output, target, *, reduction="mean": output.sum(), True),
        (lambda output, target: output.sum(), False),
        (nn.CrossEntropyLoss(), False),  # a loss module: forward(input, target), its reduction fixed at construction
    ],
)
def test_which_losses_take_a_reduction(loss_fn: object, accepted: bool) -> None:
    task = SupervisedTask(model_fn=engine_tasks.mlp, train_data=engine_tasks._data(CTX), loss_fn=loss_fn)  # type: ignore[arg-type]
    assert (engine_task_problem(task) is None) is accepted
