"""Multi-process gloo runs against the single-process reference (torch.testing.assert_close on the weights).

Every plan must give the model that single-device ``train_supervised`` gives with the same generator, after
several optimizer steps with momentum, weight decay and the FedProx term, including uneven last batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcore.aggregation import WeightedMean
from fedcore.engine import ParallelPlan, train_with_plan
from fedcore.errors import EngineError
from fedcore.task import FitConfig, TaskContext
from fedcore.tensors import spec_of
from tests.engine import engine_tasks
from tests.engine.engine_tasks import (
    assert_same_state,
    deep_mlp,
    deep_task,
    initial_parameters,
    mlp,
    mlp_task,
    reference,
    tied_task,
)

pytestmark = pytest.mark.slow

CONFIG = FitConfig(local_epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3, mu=0.1)
CTX = TaskContext(client_id="c1", seed=3, options={"n": "44"})  # 44 = 5 batches of 8 + a last batch of 4


def _check(factory_name: str, plan: ParallelPlan) -> None:
    factory = getattr(engine_tasks, factory_name)
    model_fn = deep_mlp if factory is deep_task else mlp
    global_parameters = initial_parameters(model_fn)
    expected, expected_result = reference(factory, CTX, global_parameters, CONFIG, seed=1, round=2, client_id="c1")
    spec = f"{engine_tasks.__name__}:{factory_name}"
    updated, result = train_with_plan(spec, CTX, global_parameters, CONFIG, plan, seed=1, round=2, client_id="c1")
    assert_same_state(updated, expected)
    assert result.num_examples == 44
    assert result.metrics["train_loss"] == pytest.approx(expected_result.metrics["train_loss"], rel=1e-5)


def test_ddp_two_ranks_with_gradient_accumulation() -> None:
    _check("mlp_task", ParallelPlan(data_parallel=2, grad_accum=2))


def test_fsdp2_two_ranks() -> None:
    _check("mlp_task", ParallelPlan(data_parallel=2, sharded=True))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stage_pipeline_four_microbatches(schedule: str) -> None:
    _check("mlp_task", ParallelPlan(pipeline=2, split_points=("2",), microbatches=4, schedule=schedule))  # type: ignore[arg-type]


def test_interleaved_1f1b_four_stages_on_two_ranks() -> None:
    plan = ParallelPlan(
        pipeline=2,
        stages_per_rank=2,
        split_points=("1", "2", "3"),
        microbatches=4,
        schedule="interleaved-1f1b",  # type: ignore[arg-type]
    )
    _check("deep_task", plan)


def test_data_times_pipeline_four_ranks() -> None:
    _check("mlp_task", ParallelPlan(data_parallel=2, pipeline=2, split_points=("2",), microbatches=2, schedule="1f1b"))  # type: ignore[arg-type]


def test_pipeline_stage_without_parameters() -> None:
    """Split point "3" leaves stage 1 only the final Tanh (no parameters; the tied layers "0" and "2" share stage 0):
    that rank relays activations and gradients and must not fail building an optimizer of no parameters."""
    global_parameters = initial_parameters(engine_tasks.tied_mlp)
    expected, expected_result = reference(tied_task, CTX, global_parameters, CONFIG, seed=1, round=2, client_id="c1")
    plan = ParallelPlan(pipeline=2, split_points=("3",), microbatches=2, schedule="1f1b")  # type: ignore[arg-type]
    spec = f"{engine_tasks.__name__}:tied_task"
    updated, result = train_with_plan(spec, CTX, global_parameters, CONFIG, plan, seed=1, round=2, client_id="c1")
    assert_same_state(updated, expected)
    assert result.metrics["train_loss"] == pytest.approx(expected_result.metrics["train_loss"], rel=1e-5)


def test_pipeline_of_a_layer_the_sequential_repeats() -> None:
    """Layer "2" is layer "0" again (one module); a stage boundary after both: stage 0 must run it twice."""
    global_parameters = initial_parameters(engine_tasks.reused_mlp)
    expected, _ = reference(engine_tasks.reused_task, CTX, global_parameters, CONFIG, seed=1, round=2, client_id="c1")
    plan = ParallelPlan(pipeline=2, split_points=("3",), microbatches=2, schedule="1f1b")  # type: ignore[arg-type]
    spec = f"{engine_tasks.__name__}:reused_task"
    updated, _ = train_with_plan(spec, CTX, global_parameters, CONFIG, plan, seed=1, round=2, client_id="c1")
    assert_same_state(updated, expected)


def _worker_pids() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"fedcore.engine.worker" in (entry / "cmdline").read_bytes():
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def test_worker_crash_names_the_rank_and_leaves_no_processes() -> None:
    before = _worker_pids()
    spec = f"{engine_tasks.__name__}:crashing_task"
    with pytest.raises(EngineError, match="rank 1 failed: RuntimeError: boom on rank 1") as info:
        train_with_plan(
            spec, CTX, initial_parameters(mlp), CONFIG, ParallelPlan(data_parallel=2), seed=1, round=2, client_id="c1"
        )
    assert info.value.rank == 1 and info.value.client_id == "c1" and info.value.round == 2
    assert _worker_pids() - before == set()


@pytest.mark.parametrize(("death", "cause"), [("exit", "exit code 7"), ("kill", "killed by signal SIGKILL")])
def test_a_rank_dying_without_raising_is_named_not_its_peer(
    death: str, cause: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 dies mid-step with no Python exception (``os._exit``, SIGKILL: what the OOM killer or a crash in native
    code does); rank 0 then raises gloo's "Connection reset by peer". The error names rank 1, not the symptom."""
    monkeypatch.setenv("FEDCORE_TEST_DEATH", death)
    spec = f"{engine_tasks.__name__}:dying_task"
    with pytest.raises(EngineError, match=rf"\] worker rank 1 failed: {cause}") as info:
        train_with_plan(
            spec, CTX, initial_parameters(mlp), CONFIG, ParallelPlan(data_parallel=2), seed=1, round=1, client_id="c1"
        )
    assert info.value.rank == 1


def test_federated_round_with_a_pipelined_client_aggregates_to_the_single_device_model() -> None:
    global_parameters = initial_parameters(mlp)
    contexts = {cid: TaskContext(client_id=cid, seed=5, options={"n": n}) for cid, n in (("a", "40"), ("b", "24"))}
    plans = {"a": ParallelPlan(pipeline=2, split_points=("2",), microbatches=4, schedule="1f1b"), "b": ParallelPlan()}  # type: ignore[arg-type]
    spec = f"{engine_tasks.__name__}:mlp_task"

    def aggregate(train: object) -> dict[str, object]:
        mean = WeightedMean(spec_of(global_parameters))
        for cid, ctx in contexts.items():
            update, result = train(cid, ctx)  # type: ignore[operator]
            mean.add(update, float(result.num_examples), client_id=cid)
        return mean.result()  # type: ignore[return-value]

    engine = aggregate(
        lambda cid, ctx: train_with_plan(
            spec, ctx, global_parameters, CONFIG, plans[cid], seed=9, round=1, client_id=cid
        )
    )
    single = aggregate(
        lambda cid, ctx: reference(mlp_task, ctx, global_parameters, CONFIG, seed=9, round=1, client_id=cid)
    )
    assert_same_state(engine, single)  # type: ignore[arg-type]
