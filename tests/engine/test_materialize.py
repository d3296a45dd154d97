"""Meta-device construction: a rank gives storage only to what it holds, filled from the global model.

Pipeline ranks their own stages (unit tests here; the pipeline equivalence tests train that way), DDP ranks the
whole replica, FSDP2 and tensor-parallel ranks their shards: real gloo runs whose workers record what they
initialized and the local sizes of their parameters, against single-device training and the real build.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from torch import nn

from fedcore.engine import ParallelPlan, train_with_plan
from fedcore.engine.materialize import (
    build_on_meta,
    can_build_on_meta,
    has_meta_tensors,
    materialize,
    materialize_local,
    meta_model,
)
from fedcore.engine.pipeline import other_ranks_state_names
from fedcore.task import FitConfig, TaskContext
from fedcore.tensors import NamedArrays
from tests.engine import engine_tasks
from tests.engine.engine_tasks import (
    assert_same_state,
    initial_parameters,
    probe_mlp,
    probe_task,
    reference,
    tiny_gpt,
    tiny_gpt_untied,
)


def test_only_the_rank_s_stage_gets_storage_holding_the_global_values() -> None:
    arrays = initial_parameters(tiny_gpt)
    model = build_on_meta(tiny_gpt)
    assert all(p.is_meta for p in model.parameters())
    skip = {name for name in arrays if name.startswith("blocks.1.")}
    created = materialize(model, arrays, torch.device("cpu"), skip=skip)
    state = model.state_dict()
    for name, array in arrays.items():
        if name in skip:
            assert state[name].is_meta, name
        else:
            assert np.array_equal(state[name].numpy(), array), name
    # 2 embedding tensors (the head's weight is the token table), 16 in blocks.0 (2 norms, q, k, v, proj, fc,
    # proj: weight and bias each), 2 in the head's norm
    assert created == 2 + 16 + 2
    assert model.get_submodule("head.out").weight is model.get_submodule("embed.token").weight  # still tied
    assert all(p.requires_grad for p in model.get_submodule("blocks.0").parameters())
    with torch.no_grad():
        cast(nn.Linear, model.get_submodule("blocks.0.attn.q")).weight.add_(1.0)
    assert np.array_equal(arrays["blocks.0.attn.q.weight"], initial_parameters(tiny_gpt)["blocks.0.attn.q.weight"])


def test_pipeline_ranks_skip_each_other_s_stages() -> None:
    plan = ParallelPlan(pipeline=2, split_points=("blocks.1",))
    model = build_on_meta(tiny_gpt_untied)
    names = set(model.state_dict())
    first, second = other_ranks_state_names(model, plan, 0), other_ranks_state_names(model, plan, 1)
    assert first == {n for n in names if n.startswith(("blocks.1.", "head."))}
    assert second == names - first


class _WithCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.register_buffer("cache", torch.arange(4.0), persistent=False)


def test_a_non_persistent_buffer_keeps_the_model_off_the_meta_device() -> None:
    assert can_build_on_meta(tiny_gpt())
    assert not can_build_on_meta(_WithCache())
    assert meta_model(_WithCache) is None


def _needs_values() -> nn.Module:
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(float(model.weight.abs().sum().item()) < 0)  # .item() fails on meta tensors
    return model


def test_a_constructor_that_needs_real_values_keeps_the_model_off_the_meta_device() -> None:
    assert meta_model(_needs_values) is None
    model = meta_model(tiny_gpt)
    assert model is not None and all(t.is_meta for t in model.state_dict().values())


def test_materialize_local_fills_every_tensor_and_keeps_ties() -> None:
    # no DTensor here (a replicated model): every tensor gets all of its global value, and the tie survives to_empty
    arrays = initial_parameters(tiny_gpt)
    model = build_on_meta(tiny_gpt)
    assert has_meta_tensors(model)
    filled = materialize_local(model, arrays, torch.device("cpu"))
    assert not has_meta_tensors(model)
    assert filled == len(arrays) - 1  # head.out.weight is embed.token.weight: filled once
    assert model.get_submodule("head.out").weight is model.get_submodule("embed.token").weight
    for name, tensor in model.state_dict().items():
        assert np.array_equal(tensor.numpy(), arrays[name]), name


# ------------------------------------------------------------------------- ranks of data and tensor parallelism
PROBE_CONFIG = FitConfig(local_epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3, mu=0.1)
FULL = {"0.weight": 16 * 6, "0.bias": 16, "2.weight": 16 * 16, "2.bias": 16, "4.weight": 5 * 16, "4.bias": 5}
# FSDP2 shards dim 0 as torch.chunk does: 16 rows -> 8 + 8, the last layer's 5 rows -> 3 + 2
SHARDS = [
    {"0.weight": 8 * 6, "0.bias": 8, "2.weight": 8 * 16, "2.bias": 8, "4.weight": 3 * 16, "4.bias": 3},
    {"0.weight": 8 * 6, "0.bias": 8, "2.weight": 8 * 16, "2.bias": 8, "4.weight": 2 * 16, "4.bias": 2},
]
# layer 0 column-wise (weight rows and bias split), layer 2 row-wise (weight columns split, bias replicated),
# layer 4 replicated
SLICES = {"0.weight": 8 * 6, "0.bias": 8, "2.weight": 16 * 8, "2.bias": 16, "4.weight": 5 * 16, "4.bias": 5}


def _probe_lines(path: Path) -> dict[str, dict[str, object]]:
    """Per worker rank: its weight initializations in order and the local numel of its parameters."""
    ranks: dict[str, dict[str, object]] = {}
    for line in path.read_text().splitlines():
        rank, kind, value = line.split(" ", 2)
        if rank == "-":  # the test process and the caller build the model for real: not a rank
            continue
        entry = ranks.setdefault(rank, {"init": [], "numel": None})
        if kind == "init":
            entry["init"].append(value)  # type: ignore[attr-defined]
        else:
            entry["numel"] = json.loads(value)
    return ranks


def _train_probed(
    tmp_path: Path, plan: ParallelPlan, *, real: bool
) -> tuple[NamedArrays, dict[str, dict[str, object]]]:
    probe = tmp_path / f"probe-{'real' if real else 'meta'}.txt"
    ctx = TaskContext(client_id="c1", seed=3, options={"n": "44", "probe": str(probe), "real": "1" if real else "0"})
    global_parameters = initial_parameters(lambda: probe_mlp(str(tmp_path / "global.txt")))
    spec = f"{engine_tasks.__name__}:probe_task"
    updated, result = train_with_plan(spec, ctx, global_parameters, PROBE_CONFIG, plan, seed=1, round=2, client_id="c1")
    expected, expected_result = reference(
        probe_task, ctx, global_parameters, PROBE_CONFIG, seed=1, round=2, client_id="c1"
    )
    assert_same_state(updated, expected)  # the tolerance of the other equivalence tests (float32 rounding)
    assert result.metrics["train_loss"] == pytest.approx(expected_result.metrics["train_loss"], rel=1e-5)
    return updated, _probe_lines(probe)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plan", "numel"),
    [
        (ParallelPlan(data_parallel=2), [FULL, FULL]),
        (ParallelPlan(data_parallel=2, sharded=True, grad_accum=2), SHARDS),
        (ParallelPlan(tensor_parallel=2), [SLICES, SLICES]),
    ],
    ids=["ddp", "fsdp2", "tp"],
)
def test_ranks_build_on_meta_hold_only_their_part_and_train_as_the_real_build(
    tmp_path: Path, plan: ParallelPlan, numel: list[dict[str, int]]
) -> None:
    updated, ranks = _train_probed(tmp_path, plan, real=False)
    assert sorted(ranks) == ["0", "1"]
    for rank, entry in ranks.items():
        assert entry["init"] == ["meta"] * 3, rank  # the three layers were initialized on meta only: no storage
        assert entry["numel"] == numel[int(rank)], rank  # what the rank holds when its first forward runs
    # a model that cannot be built on meta (a non-persistent buffer) takes the real path: full-size random inits,
    # the same local sizes, and the same update bit for bit (the same values meet the same operations)
    real_updated, real_ranks = _train_probed(tmp_path, plan, real=True)
    for rank, entry in real_ranks.items():
        assert entry["init"] == ["meta"] * 3 + ["real"] * 3, rank  # the meta build finds the buffer; then the real one
        assert entry["numel"] == numel[int(rank)], rank
    assert all(np.array_equal(real_updated[name], updated[name]) for name in updated)


@pytest.mark.slow
def test_fsdp2_with_activation_checkpointing_fills_the_shards_of_a_meta_model(tmp_path: Path) -> None:
    # the FSDP2 root is the checkpointing chain, not the model: its shards are re-padded at the first forward
    _, ranks = _train_probed(
        tmp_path, ParallelPlan(data_parallel=2, sharded=True, activation_checkpointing=True), real=False
    )
    assert {rank: entry["init"] for rank, entry in ranks.items()} == {"0": ["meta"] * 3, "1": ["meta"] * 3}
