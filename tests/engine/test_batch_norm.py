"""BatchNorm under every plan: the same parameters and buffers as single-device training, or a ConfigError.

Each plan is compared with single-device ``train_supervised`` on the same batches (``torch.testing.assert_close``
on every state entry: weights, ``running_mean``, ``running_var`` and ``num_batches_tracked``), after 12 SGD
steps with momentum, weight decay and FedProx. The model has one BatchNorm with momentum 0.1 and one with the
cumulative average (momentum None), whose running statistics depend on ``num_batches_tracked``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from fedcore.engine import ParallelPlan, train_with_plan
from fedcore.engine.batch_stats import BufferWatch, batch_statistics_modules, check_buffers_agree
from fedcore.errors import ConfigError, EngineError
from fedcore.task import FitConfig, TaskContext
from tests.engine import engine_tasks
from tests.engine.engine_tasks import (
    CLASSES,
    FEATURES,
    assert_same_state,
    bn_mlp,
    bn_task,
    initial_parameters,
    reference,
    run_plan,
    running_sum_model,
)

FACTORY = f"{engine_tasks.__name__}:bn_task"
CONFIG = FitConfig(local_epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3, mu=0.1)
CTX = TaskContext(client_id="c1", seed=3, options={"n": "44"})  # 6 batches per epoch, the last of 4 samples
STEPS = 12


def _check(plan: ParallelPlan) -> None:
    global_parameters = initial_parameters(bn_mlp)
    expected, _ = reference(bn_task, CTX, global_parameters, CONFIG, seed=1, round=2, client_id="c1")
    updated, result = train_with_plan(FACTORY, CTX, global_parameters, CONFIG, plan, seed=1, round=2, client_id="c1")
    assert int(expected["1.num_batches_tracked"]) == int(expected["4.num_batches_tracked"]) == STEPS
    assert_same_state(updated, expected)
    assert all(np.isfinite(a).all() for a in updated.values())
    assert result.num_examples == 44


def test_single_device_plan_equals_the_reference() -> None:
    _check(ParallelPlan())


def test_activation_checkpointing_counts_each_batch_once() -> None:
    # the recomputation in the backward pass used to update the running statistics again: 24 instead of 12
    _check(ParallelPlan(activation_checkpointing=True))


@pytest.mark.slow
def test_ddp_normalizes_over_the_global_batch_with_checkpointing() -> None:
    _check(ParallelPlan(data_parallel=2, activation_checkpointing=True))


@pytest.mark.slow
def test_fsdp2_normalizes_over_the_global_batch() -> None:
    _check(ParallelPlan(data_parallel=2, sharded=True))


@pytest.mark.slow
def test_pipeline_shape_inference_leaves_the_running_statistics_alone() -> None:
    # stage 1 starts with BatchNorm "4": its shape inference used to read an uninitialized tensor (NaN
    # running_var), and every new micro-batch shape counted an extra batch
    _check(ParallelPlan(pipeline=2, split_points=("3",), microbatches=1, schedule="gpipe"))  # type: ignore[arg-type]


@pytest.mark.slow
def test_data_times_pipeline_synchronizes_each_stage_over_its_replicas() -> None:
    _check(ParallelPlan(data_parallel=2, pipeline=2, split_points=("3",), microbatches=1, schedule="gpipe"))  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_custom_running_statistic_that_differs_between_ranks_fails_the_round() -> None:
    # each rank sums its own half of every batch: rank 0's sum alone would be returned without this check;
    # the call counter is the same on both ranks and is not named
    with pytest.raises(EngineError, match=r"buffers \['1\.running_sum'\] differ between the data-parallel ranks"):
        run_plan("running_sum_task", running_sum_model, ParallelPlan(data_parallel=2), ctx=CTX, config=CONFIG)


def test_a_custom_running_statistic_under_gradient_accumulation_is_refused() -> None:
    # each micro-step ran the counter: 'calls' came back 12 instead of 6 (and the sum from the same samples), a
    # model unlike single-device training's, returned without an error
    with pytest.raises(
        ConfigError, match=r"buffers \['1\.running_sum', '1\.calls'\] change in training: with grad_accum=2"
    ):
        run_plan("running_sum_task", running_sum_model, ParallelPlan(grad_accum=2), ctx=CTX, config=CONFIG)


@pytest.mark.slow
def test_a_custom_running_statistic_under_pipeline_micro_batches_fails_the_round() -> None:
    plan = ParallelPlan(pipeline=2, split_points=("1",), microbatches=2)  # stage 1: RunningSum alone
    with pytest.raises(EngineError, match=r"rank 1 failed: ConfigError: buffers \['1\.running_sum', '1\.calls'\]"):
        run_plan("running_sum_task", running_sum_model, plan, ctx=CTX, config=CONFIG)


def test_unchanged_and_non_persistent_buffers_keep_gradient_accumulation() -> None:
    """A constant persistent buffer and a cache (non-persistent) the forward rewrites are no running statistic."""
    model = running_sum_model()
    model.register_buffer("scale", torch.ones(CLASSES))
    model.register_buffer("cache", torch.zeros(CLASSES), persistent=False)
    watch = BufferWatch(model)
    model.get_buffer("cache").add_(1.0)
    watch.check(ParallelPlan(grad_accum=2))
    watch = BufferWatch(model)
    model(torch.ones(2, FEATURES))
    with pytest.raises(ConfigError, match=r"buffers \['1\.running_sum', '1\.calls'\] change"):
        watch.check(ParallelPlan(grad_accum=2))


def test_a_constant_buffer_holding_a_nan_keeps_gradient_accumulation() -> None:
    """A persistent buffer the step leaves alone is unchanged even where it holds NaN (a "not set" marker), which
    torch.equal never finds equal to itself; a NaN that appears, or a value that changes beside one, is a change."""
    model = running_sum_model()
    model.register_buffer("marker", torch.tensor([float("nan"), 1.0, -0.0]))
    BufferWatch(model).check(ParallelPlan(grad_accum=2))
    for changed in ([float("nan"), 2.0, 0.0], [float("nan"), float("nan"), 0.0], [1.0, 1.0, 0.0]):
        watch = BufferWatch(model)
        model.get_buffer("marker").copy_(torch.tensor(changed))
        with pytest.raises(ConfigError, match=r"buffers \['marker'\] change in training"):
            watch.check(ParallelPlan(grad_accum=2))
        model.get_buffer("marker").copy_(torch.tensor([float("nan"), 1.0, -0.0]))


def test_data_parallel_ranks_holding_the_same_nan_in_a_buffer_agree(tmp_path: Path) -> None:
    """check_buffers_agree compared the ranks' maximum and minimum with !=, and NaN != NaN: a constant buffer holding
    a NaN (a "not set" marker) failed every data-parallel round as "differ between the data-parallel ranks". One
    rank (a gloo group of one) shows it: its maximum and minimum are its own values."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert group is not None
        check_buffers_agree([("marker", torch.tensor([float("nan"), 1.0])), ("calls", torch.tensor(3))], group)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (ParallelPlan(grad_accum=2), "grad_accum=2 with '1' \\(BatchNorm1d\\), '4' \\(BatchNorm1d\\)"),
        (ParallelPlan(data_parallel=2, grad_accum=4), "set grad_accum=1"),
        (ParallelPlan(pipeline=2, split_points=("3",), microbatches=2), "microbatches=2 .* set microbatches=1"),
    ],
)
def test_plans_that_split_a_batch_statistic_are_refused_before_start(plan: ParallelPlan, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_plan("bn_task", bn_mlp, plan, ctx=CTX, config=CONFIG)


def test_a_batch_smaller_than_the_data_parallel_degree_is_refused_before_start() -> None:
    ctx = TaskContext(client_id="c1", seed=3, options={"n": "41"})  # the last batch holds 1 sample
    with pytest.raises(ConfigError, match=r"a batch of 1 samples .* data_parallel=2"):
        run_plan("bn_task", bn_mlp, ParallelPlan(data_parallel=2), ctx=ctx, config=CONFIG)


def test_instance_norm_with_running_statistics_is_refused_under_data_parallelism() -> None:
    model = nn.Sequential(nn.Conv1d(2, 3, 1), nn.InstanceNorm1d(3, track_running_stats=True))
    ParallelPlan().check_model(model)
    with pytest.raises(ConfigError, match=r"InstanceNorm .* not synchronized"):
        ParallelPlan(data_parallel=2).check_model(model)
    assert [name for name, _ in batch_statistics_modules(nn.Sequential(nn.InstanceNorm1d(3)))] == []


def test_models_without_batch_statistics_keep_every_plan() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.GroupNorm(2, 4))
    assert batch_statistics_modules(model) == []
    ParallelPlan(data_parallel=2, grad_accum=4).check_model(model)
