"""World size 1: the engine's in-process path equals single-device train_supervised."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcore.engine import ParallelPlan, train_with_plan
from fedcore.errors import ConfigError
from fedcore.task import FitConfig, TaskContext
from tests.engine import engine_tasks
from tests.engine.engine_tasks import assert_same_state, initial_parameters, mlp, mlp_task, reference

FACTORY = f"{engine_tasks.__name__}:mlp_task"
CTX = TaskContext(client_id="c1", seed=3, options={"n": "50"})
CONFIG = FitConfig(local_epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3, mu=0.1)


def _check(plan: ParallelPlan, config: FitConfig = CONFIG) -> None:
    global_parameters = initial_parameters(mlp)
    expected, expected_result = reference(mlp_task, CTX, global_parameters, config, seed=1, round=2, client_id="c1")
    updated, result = train_with_plan(FACTORY, CTX, global_parameters, config, plan, seed=1, round=2, client_id="c1")
    assert_same_state(updated, expected)
    assert result.num_examples == expected_result.num_examples == 50
    assert result.metrics["train_loss"] == pytest.approx(expected_result.metrics["train_loss"], rel=1e-5)


def test_plan_of_all_ones_equals_train_supervised() -> None:
    _check(ParallelPlan())


def test_max_steps_is_honoured() -> None:
    _check(ParallelPlan(), FitConfig(local_epochs=3, batch_size=8, lr=0.1, max_steps=5))


def test_gradient_accumulation_equals_one_step_on_the_full_batch() -> None:
    # 4 micro-steps of 2 samples per optimizer step, including the uneven last batch of 50 % 8 = 2 samples
    _check(ParallelPlan(grad_accum=4))


def test_activation_checkpointing_changes_nothing_but_memory() -> None:
    _check(ParallelPlan(activation_checkpointing=True, grad_accum=2))


def test_activation_checkpointing_runs_a_layer_the_sequential_repeats() -> None:
    # the chain of layers skipped the second "0" (named_children() lists a module once): the model trained as
    # Sequential(shared, Tanh, Tanh, head), 0.3 away from single-device training, without an error
    global_parameters = initial_parameters(engine_tasks.reused_mlp)
    expected, _ = reference(engine_tasks.reused_task, CTX, global_parameters, CONFIG, seed=1, round=2, client_id="c1")
    plan = ParallelPlan(activation_checkpointing=True)
    spec = f"{engine_tasks.__name__}:reused_task"
    updated, _ = train_with_plan(spec, CTX, global_parameters, CONFIG, plan, seed=1, round=2, client_id="c1")
    assert_same_state(updated, expected)


def test_result_keeps_global_names_order_and_dtypes() -> None:
    global_parameters = initial_parameters(mlp)
    updated, _ = train_with_plan(
        FACTORY, CTX, global_parameters, CONFIG, ParallelPlan(), seed=0, round=1, client_id="c1"
    )
    assert list(updated) == list(global_parameters)
    assert all(updated[n].dtype == np.float32 and updated[n].shape == a.shape for n, a in global_parameters.items())
    assert not np.allclose(updated["0.weight"], global_parameters["0.weight"])
    assert np.array_equal(global_parameters["0.weight"], initial_parameters(mlp)["0.weight"])  # input untouched


def test_mismatched_global_parameters_fail_before_training() -> None:
    wrong = {f"x.{n}": a for n, a in initial_parameters(mlp).items()}
    with pytest.raises(ConfigError, match="do not match"):
        train_with_plan(FACTORY, CTX, wrong, CONFIG, ParallelPlan(), seed=0, round=1, client_id="c1")


def test_bad_split_point_fails_before_any_process_starts() -> None:
    plan = ParallelPlan(pipeline=2, split_points=("encoder",))
    with pytest.raises(ConfigError, match="names no module"):
        train_with_plan(FACTORY, CTX, initial_parameters(mlp), CONFIG, plan, seed=0, round=1, client_id="c1")


def test_reference_is_deterministic() -> None:
    g = initial_parameters(mlp)
    a, _ = reference(mlp_task, CTX, g, CONFIG, seed=1, round=2, client_id="c1")
    b, _ = reference(mlp_task, CTX, g, CONFIG, seed=1, round=2, client_id="c1")
    c, _ = reference(mlp_task, CTX, g, CONFIG, seed=1, round=3, client_id="c1")
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(torch.from_numpy(a[n]), torch.from_numpy(c[n])) for n in a)
