"""Meta-device construction: a pipeline rank gives storage only to its own stages, filled from the global model."""

from __future__ import annotations

import numpy as np
import torch
from engine_tasks import initial_parameters, tiny_gpt, tiny_gpt_untied
from torch import nn

from fedcore.engine import ParallelPlan
from fedcore.engine.materialize import build_on_meta, can_build_on_meta, materialize
from fedcore.engine.pipeline import other_ranks_state_names


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
        model.get_submodule("blocks.0.attn.q").weight.add_(1.0)
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
