"""The engine on CUDA against single-device training on the CPU; skipped (with the reason) without a GPU.

bench/gpu_check.sh runs these on a GPU machine. Tolerances:

- fp32 (eager, fused SGD, SDPA kernels): the weights within ``atol=1e-4, rtol=1e-3`` of the CPU reference after
  16 SGD steps (TF32 is off for float32 matrix products unless a user turns it on, so only the order of
  summation differs);
- bf16 autocast (fp32 master weights): the update ``w - w_global`` within 3 % of the fp32 update in relative L2
  norm, and the training loss within 1 %; on the CPU, bf16 autocast of the same run differs by 0.5 %;
- ``compile=true``: as fp32 eager.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcore.aggregation import WeightedMean
from fedcore.engine import ParallelPlan, train_with_plan
from fedcore.task import FitConfig, TaskContext
from fedcore.tensors import NamedArrays, spec_of
from tests.engine import engine_tasks
from tests.engine.engine_tasks import (
    assert_same_state,
    gpt_task,
    initial_parameters,
    mlp,
    mlp_task,
    reference,
    tiny_gpt,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run bench/gpu_check.sh)")

CONFIG = FitConfig(local_epochs=2, batch_size=6, lr=0.2, momentum=0.9, weight_decay=1e-3, mu=0.1)
CTX = TaskContext(client_id="c1", seed=3, options={"n": "48"})
SPEC = f"{engine_tasks.__name__}:gpt_task"


def _train(plan: ParallelPlan) -> tuple[NamedArrays, NamedArrays, float, float]:
    """``(global, engine result, engine loss, reference loss)``; the reference trains on the CPU in fp32."""
    global_parameters = initial_parameters(tiny_gpt)
    expected, expected_result = reference(gpt_task, CTX, global_parameters, CONFIG, seed=1, round=2, client_id="c1")
    updated, result = train_with_plan(SPEC, CTX, global_parameters, CONFIG, plan, seed=1, round=2, client_id="c1")
    assert result.num_examples == 48
    return expected, updated, result.metrics["train_loss"], expected_result.metrics["train_loss"]


def test_fp32_on_cuda_equals_the_cpu_reference() -> None:
    expected, updated, loss, expected_loss = _train(ParallelPlan(device="cuda"))  # type: ignore[arg-type]
    assert_same_state(updated, expected, atol=1e-4, rtol=1e-3)
    assert loss == pytest.approx(expected_loss, rel=1e-4)


def test_compiled_fp32_on_cuda_equals_the_cpu_reference() -> None:
    expected, updated, loss, expected_loss = _train(ParallelPlan(device="cuda", compile=True))  # type: ignore[arg-type]
    assert_same_state(updated, expected, atol=1e-4, rtol=1e-3)
    assert loss == pytest.approx(expected_loss, rel=1e-4)


def test_bf16_autocast_on_cuda_stays_within_three_percent_of_fp32() -> None:
    global_parameters = initial_parameters(tiny_gpt)
    expected, updated, loss, expected_loss = _train(ParallelPlan(device="cuda", precision="bf16"))  # type: ignore[arg-type]
    assert all(updated[n].dtype == np.float32 for n in updated)  # fp32 master weights and update
    delta = np.concatenate([(updated[n] - global_parameters[n]).ravel() for n in global_parameters])
    reference_delta = np.concatenate([(expected[n] - global_parameters[n]).ravel() for n in global_parameters])
    assert np.linalg.norm(delta - reference_delta) <= 0.03 * np.linalg.norm(reference_delta)
    assert loss == pytest.approx(expected_loss, rel=1e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL, one rank per GPU)")
@pytest.mark.parametrize(
    "plan",
    [
        ParallelPlan(tensor_parallel=2, device="cuda"),  # type: ignore[arg-type]
        ParallelPlan(data_parallel=2, device="cuda"),  # type: ignore[arg-type]
    ],
    ids=["tp2", "ddp2"],
)
def test_two_gpus_equal_the_cpu_reference(plan: ParallelPlan) -> None:
    expected, updated, loss, expected_loss = _train(plan)
    assert_same_state(updated, expected, atol=1e-4, rtol=1e-3)
    assert loss == pytest.approx(expected_loss, rel=1e-4)


def test_federated_round_with_cuda_clients_aggregates_to_the_cpu_model() -> None:
    global_parameters = initial_parameters(mlp)
    contexts = {cid: TaskContext(client_id=cid, seed=5, options={"n": n}) for cid, n in (("a", "40"), ("b", "24"))}
    spec = f"{engine_tasks.__name__}:mlp_task"
    engine = WeightedMean(spec_of(global_parameters))
    single = WeightedMean(spec_of(global_parameters))
    for cid, ctx in contexts.items():
        plan = ParallelPlan(device="cuda")  # type: ignore[arg-type]
        update, result = train_with_plan(spec, ctx, global_parameters, CONFIG, plan, seed=9, round=1, client_id=cid)
        engine.add(update, float(result.num_examples), client_id=cid)
        update, result = reference(mlp_task, ctx, global_parameters, CONFIG, seed=9, round=1, client_id=cid)
        single.add(update, float(result.num_examples), client_id=cid)
    assert_same_state(engine.result(), single.result(), atol=1e-4, rtol=1e-3)
