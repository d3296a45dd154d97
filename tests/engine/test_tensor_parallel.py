"""Tensor parallelism: plan checks by hand, and gloo runs (tp, dp x tp, FSDP2 x tp, pp x tp) against one device.

The multi-process runs train a two-block GPT (4 heads, tied embeddings) for several SGD steps with momentum,
weight decay and FedProx, an uneven last batch included, and must return the single-device weights in the
global names (the split layers gathered from their shards).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fedcore.engine import ParallelPlan, train_with_plan
from fedcore.engine.tensor_parallel import check_plan, model_plan, resolve_plan
from fedcore.engine.transformer import flops_per_token, gpt, lm_loss
from fedcore.errors import ConfigError
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, TaskContext
from tests.engine import engine_tasks
from tests.engine.engine_tasks import (
    assert_same_state,
    gpt_task,
    initial_parameters,
    reference,
    tiny_gpt,
    tiny_gpt_untied,
)

CONFIG = FitConfig(local_epochs=2, batch_size=6, lr=0.2, momentum=0.9, weight_decay=1e-3, mu=0.1)
CTX = TaskContext(client_id="c1", seed=3, options={"n": "16"})  # 16 = 2 batches of 6 + a last batch of 4
UNTIED = TaskContext(client_id="c1", seed=3, options={"n": "16", "tied": "0"})


# ------------------------------------------------------------------------------------------- plan and checks
def test_plan_degree_counts_in_the_world_size_and_parses_from_cli() -> None:
    plan = ParallelPlan.from_cli(["dp=2", "tp=2", "compile=true"])
    assert plan.tensor_parallel == 2 and plan.compile and plan.tp_enabled and plan.total_ranks == 4
    assert ParallelPlan.from_mapping(plan.to_mapping()) == plan
    table = {"tensor_parallel": 2, "pipeline": 2, "split_points": ["blocks.1"]}
    assert ParallelPlan.from_mapping(table).total_ranks == 4
    with pytest.raises(ConfigError, match=r"x tensor_parallel \(2\) = 4, but the world size is 2"):
        ParallelPlan(tensor_parallel=2, data_parallel=2, world_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel must be an integer >= 1"):
        ParallelPlan(tensor_parallel=0)
    with pytest.raises(ConfigError, match="find_unused_parameters applies to DDP only"):
        ParallelPlan(data_parallel=2, tensor_parallel=2, find_unused_parameters=True)


def test_blocks_declare_megatron_splits() -> None:
    plan = model_plan(tiny_gpt(), 2)
    assert sorted(plan) == sorted(
        f"blocks.{i}.{name}"
        for i in range(2)
        for name in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")
    )
    assert all(isinstance(plan[f"blocks.0.attn.{n}"], ColwiseParallel) for n in "qkv")
    assert isinstance(plan["blocks.0.attn.proj"], RowwiseParallel)
    assert isinstance(plan["blocks.1.mlp.fc"], ColwiseParallel)
    assert isinstance(plan["blocks.1.mlp.proj"], RowwiseParallel)


def test_task_plan_wins_over_the_model_plan() -> None:
    task = engine_tasks.heads_only_task(CTX)
    plan = resolve_plan(task, task.build_model(), 2)
    assert sorted(plan) == sorted(f"blocks.{i}.attn.{n}" for i in range(2) for n in ("q", "k", "v", "proj"))


@pytest.mark.parametrize(
    ("model", "plan", "degree", "message"),
    [
        (tiny_gpt(), None, 8, "does not divide the 4 attention heads"),
        (tiny_gpt(), {"blocks.0.attn.q": ColwiseParallel()}, 3, "does not divide the 16 output features"),
        (tiny_gpt(), {"blocks.0.mlp.proj": RowwiseParallel()}, 3, "does not divide the 64 input features"),
        (tiny_gpt(), {"blocks.0.attn.out": ColwiseParallel()}, 2, "no module of the model"),
        (tiny_gpt(), {"blocks.0.norm1": ColwiseParallel()}, 2, "a LayerNorm; the engine splits nn.Linear"),
        (tiny_gpt(), {"head.out": ColwiseParallel()}, 2, "tied to another module"),
        (nn.Sequential(nn.Linear(4, 4)), None, 2, "declares no tensor-parallel plan"),
    ],
)
def test_bad_plans_are_refused_with_the_numbers(
    model: nn.Module, plan: dict[str, object] | None, degree: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        if plan is None:
            resolve_plan(SupervisedTask(model_fn=lambda: model), model, degree)
        else:
            check_plan(model, plan, degree)  # type: ignore[arg-type]


def test_refused_before_any_worker_starts() -> None:
    spec = f"{engine_tasks.__name__}:mlp_task"
    with pytest.raises(ConfigError, match="declares no tensor-parallel plan"):
        train_with_plan(
            spec, CTX, initial_parameters(engine_tasks.mlp), CONFIG, ParallelPlan(tensor_parallel=2),
            seed=0, round=1, client_id="c1",
        )  # fmt: skip


def test_gpt2_small_size_and_flops_by_hand() -> None:
    with torch.device("meta"):
        model = gpt()
    params = sum(p.numel() for p in model.parameters())
    assert params == 124_475_904  # 50304 x 768 + 1024 x 768 + 12 x 7,087,872 + 2 x 768 (tied head)
    d, t, layers, vocab = 768, 1024, 12, 50304
    expected = 6 * (layers * 7_087_872 + 2 * d + vocab * d) + 12 * layers * d * t
    assert flops_per_token(model, seq_len=t) == expected


def test_lm_loss_is_the_per_sample_mean_of_token_losses() -> None:
    logits = torch.randn(3, 5, 7)
    target = torch.randint(0, 7, (3, 5))
    per_token = nn.functional.cross_entropy(logits.reshape(15, 7), target.reshape(15), reduction="none")
    torch.testing.assert_close(lm_loss(logits, target, reduction="sum"), per_token.reshape(3, 5).mean(1).sum())
    torch.testing.assert_close(lm_loss(logits, target), per_token.mean())


# ------------------------------------------------------------------------------ gloo runs against one device
def _check(plan: ParallelPlan, factory: str = "gpt_task", ctx: TaskContext = CTX) -> None:
    global_parameters = initial_parameters(tiny_gpt_untied if ctx.options.get("tied") == "0" else tiny_gpt)
    expected, expected_result = reference(gpt_task, ctx, global_parameters, CONFIG, seed=1, round=2, client_id="c1")
    spec = f"{engine_tasks.__name__}:{factory}"
    updated, result = train_with_plan(spec, ctx, global_parameters, CONFIG, plan, seed=1, round=2, client_id="c1")
    assert_same_state(updated, expected, atol=1e-5, rtol=1e-4)
    assert result.num_examples == 16
    assert result.metrics["train_loss"] == pytest.approx(expected_result.metrics["train_loss"], rel=1e-5)


@pytest.mark.slow
def test_tensor_parallel_two_ranks_with_the_task_plan(tmp_path: Path) -> None:
    probe = tmp_path / "probe.txt"
    ctx = TaskContext(client_id="c1", seed=3, options={**CTX.options, "probe": str(probe)})
    _check(ParallelPlan(tensor_parallel=2, device="cpu"), factory="heads_only_task", ctx=ctx)  # type: ignore[arg-type]
    # the reference ("-") computed all 16 query features, each rank 8 of them (2 of the 4 heads)
    assert set(probe.read_text().split("\n")[:-1]) == {"- 16", "0 8", "1 8"}


@pytest.mark.slow
def test_data_times_tensor_parallel_four_ranks() -> None:
    _check(ParallelPlan(data_parallel=2, tensor_parallel=2, grad_accum=2, device="cpu"))  # type: ignore[arg-type]


@pytest.mark.slow
def test_sharded_data_times_tensor_parallel_four_ranks() -> None:
    _check(ParallelPlan(data_parallel=2, sharded=True, tensor_parallel=2, device="cpu"), ctx=UNTIED)  # type: ignore[arg-type]


@pytest.mark.slow
def test_pipeline_times_tensor_parallel_four_ranks() -> None:
    plan = ParallelPlan(
        pipeline=2,
        tensor_parallel=2,
        split_points=("blocks.1",),
        microbatches=2,
        schedule="1f1b",  # type: ignore[arg-type]
        device="cpu",  # type: ignore[arg-type]
    )
    _check(plan, ctx=UNTIED)
