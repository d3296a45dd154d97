"""The prefetching input pipeline: the same batches in the same order with and without prefetching, so training is
bit for bit the same; on CUDA (skipped without one, run by bench/gpu_check.sh) the side-stream copies too."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from fedcore.engine import ParallelPlan
from fedcore.engine.loader import Batch, BatchLoader, Rows, all_rows, part
from fedcore.engine.runner import RankResult, train_rank
from fedcore.engine.runtime import single_process_env
from fedcore.errors import ConfigError
from fedcore.task import FitConfig, TaskContext
from tests.engine.engine_tasks import initial_parameters, mlp, mlp_task

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run bench/gpu_check.sh)")
CPU = torch.device("cpu")


def _epochs(loader: BatchLoader, epochs: int, batch_size: int, seed: int = 7) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        batch
        for _ in range(epochs)
        for batch in loader.epoch(torch.randperm(len(loader), generator=generator), batch_size)
    ]


def _same(a: list[Batch], b: list[Batch]) -> bool:
    def equal(s: torch.Tensor | None, t: torch.Tensor | None) -> bool:
        return (s is None and t is None) or (s is not None and t is not None and torch.equal(s.cpu(), t.cpu()))

    return len(a) == len(b) and all(
        (p.size, p.start, p.rows) == (q.size, q.start, q.rows) and equal(p.x, q.x) and equal(p.y, q.y)
        for p, q in zip(a, b, strict=True)
    )


def test_batches_by_hand_for_a_shard() -> None:
    x = torch.arange(10.0).reshape(5, 2)  # sample i is [2i, 2i + 1]
    y = torch.tensor([10, 11, 12, 13, 14])
    order = torch.tensor([3, 1, 4, 0, 2])
    # rank 1 of 2 reads rows [1, 2) of a batch of 2 and nothing of the last batch of 1 (tensor_split: 1 + 0)
    loader = BatchLoader(x, y, CPU, rows=lambda size: Rows(*part(size, 2, 1)))
    batches = list(loader.epoch(order, 2))
    assert [(b.size, b.start, b.rows) for b in batches] == [(2, 1, 1), (2, 1, 1), (1, 1, 0)]
    assert [b.x.tolist() for b in batches if b.x is not None] == [[[2.0, 3.0]], [[0.0, 1.0]], []]
    assert [b.y.tolist() for b in batches if b.y is not None] == [[11], [10], []]
    # a pipeline rank without the first stage reads the targets only
    targets_only = BatchLoader(x, y, CPU, rows=lambda size: Rows(0, size, inputs=False))
    first = next(iter(targets_only.epoch(order, 2)))
    assert first.x is None and first.y is not None and first.y.tolist() == [13, 11]


def test_part_cuts_as_tensor_split() -> None:
    for size in range(0, 12):
        for parts in range(1, 5):
            pieces = torch.tensor_split(torch.arange(size), parts)
            for index, piece in enumerate(pieces):
                start, stop = part(size, parts, index)
                assert torch.equal(torch.arange(start, stop), piece)
    with pytest.raises(ConfigError, match="part 2 of 2"):
        part(4, 2, 2)


@pytest.mark.parametrize(
    "rows",
    [all_rows, lambda size: Rows(*part(size, 3, 2)), lambda size: Rows(*part(size, 2, 0), inputs=False)],
    ids=["all", "shard-2-of-3", "targets-of-shard-0"],
)
def test_prefetching_hands_out_the_same_batches_in_the_same_order(rows: object) -> None:
    x, y = torch.randn(23, 3, 2), torch.randint(0, 5, (23,))
    plain = _epochs(BatchLoader(x, y, CPU, rows=rows, prefetch=False), epochs=3, batch_size=5)  # type: ignore[arg-type]
    ahead = _epochs(BatchLoader(x, y, CPU, rows=rows, prefetch=True), epochs=3, batch_size=5)  # type: ignore[arg-type]
    threaded = _epochs(BatchLoader(x, y, CPU, rows=rows, background=True), epochs=3, batch_size=5)  # type: ignore[arg-type]
    assert len(plain) == 3 * 5  # 23 = 4 batches of 5 and one of 3, per epoch
    assert _same(plain, ahead) and _same(plain, threaded)
    # against the definition: rows of x[order[s : s + 5]], each epoch a new permutation
    generator = torch.Generator().manual_seed(7)
    expected = []
    for _ in range(3):
        order = torch.randperm(23, generator=generator)
        for start in range(0, 23, 5):
            idx = order[start : start + 5]
            r = rows(len(idx))  # type: ignore[operator]
            mine = idx[r.start : r.stop]
            expected.append(
                Batch(x[mine] if r.inputs else None, y[mine] if r.targets else None, len(idx), r.start, len(mine))
            )
    assert _same(plain, expected)


def test_prefetching_prepares_the_next_batch_when_one_is_handed_out() -> None:
    asked: list[int] = []

    def rows(size: int) -> Rows:
        asked.append(size)
        return all_rows(size)

    x, y = torch.randn(10, 2), torch.zeros(10)
    for prefetch, staged_at_first in ((True, [4, 4]), (False, [4])):
        asked.clear()
        batches = BatchLoader(x, y, CPU, rows=rows, prefetch=prefetch).epoch(torch.arange(10), 4)
        next(batches)
        assert asked == staged_at_first  # with prefetching, batch 1 was gathered when batch 0 was handed out
        assert [b.size for b in batches] == [4, 2] and asked == [4, 4, 2]


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fedcore-batches")]


def test_a_background_epoch_stopped_early_leaves_no_thread() -> None:
    x, y = torch.randn(40, 2), torch.zeros(40)
    batches = BatchLoader(x, y, CPU, background=True).epoch(torch.arange(40), 4)
    first = next(batches)
    assert first.x is not None and torch.equal(first.x, x[:4])
    assert len(_loader_threads()) == 1  # batch 1 is being gathered there
    batches.close()  # as a loop that stops at max_steps does
    assert _loader_threads() == []


def test_bad_loader_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="3 inputs but 2 targets"):
        BatchLoader(torch.zeros(3), torch.zeros(2), CPU)
    with pytest.raises(ConfigError, match="batch_size must be >= 1"):
        next(BatchLoader(torch.zeros(3), torch.zeros(3), CPU).epoch(torch.arange(3), 0))


CTX = TaskContext(client_id="c1", seed=3, options={"n": "50"})
# 50 = 6 batches of 8 and one of 2; two micro-steps per step (the last batch's are 1 + 1 samples), FedProx on
CONFIG = FitConfig(local_epochs=3, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3, mu=0.1)


def _train(device: torch.device, plan: ParallelPlan, config: FitConfig = CONFIG, **options: object) -> RankResult:
    env = single_process_env("cuda" if device.type == "cuda" else "cpu")  # type: ignore[arg-type]
    task = mlp_task(CTX)
    return train_rank(task, initial_parameters(mlp), config, plan, env, seed=1, round=2, client_id="c1", **options)  # type: ignore[arg-type]


def _bitwise_equal(a: RankResult, b: RankResult) -> bool:
    assert a.state is not None and b.state is not None
    return a.train_loss == b.train_loss and all(torch.equal(a.state[n], b.state[n]) for n in a.state)


def test_training_with_prefetching_is_bit_for_bit_training_without() -> None:
    plan = ParallelPlan(grad_accum=2)
    with_prefetch, without = _train(CPU, plan, prefetch=True), _train(CPU, plan, prefetch=False)
    assert _bitwise_equal(with_prefetch, without)
    max_steps = FitConfig(local_epochs=3, batch_size=8, lr=0.1, momentum=0.9, max_steps=9)  # stops inside epoch 2
    assert _bitwise_equal(_train(CPU, plan, config=max_steps), _train(CPU, plan, config=max_steps, prefetch=False))
    assert with_prefetch.state is not None
    assert not np.allclose(with_prefetch.state["0.weight"].numpy(), initial_parameters(mlp)["0.weight"])  # it trained


# ------------------------------------------------------------------------------------------------------- CUDA
@needs_cuda
@pytest.mark.parametrize("prefetch", [True, False])
def test_side_stream_copies_hand_out_the_cpu_batches(prefetch: bool) -> None:
    cuda = torch.device("cuda", torch.cuda.current_device())
    x, y = torch.randn(301, 64, 64), torch.randint(0, 9, (301,))
    rows = lambda size: Rows(*part(size, 2, 1))  # noqa: E731
    loader = BatchLoader(x, y, cuda, rows=rows, prefetch=prefetch, device_bytes=0)
    assert loader.copies_on_side_stream
    on_gpu = _epochs(loader, epochs=3, batch_size=32)
    assert all(b.x is not None and b.x.is_cuda for b in on_gpu)
    assert _same(on_gpu, _epochs(BatchLoader(x, y, CPU, rows=rows), epochs=3, batch_size=32))


@needs_cuda
def test_a_lagging_compute_stream_reads_every_batch_whole() -> None:
    # every batch is read by a kernel queued behind a 20 ms sleep on the compute stream and then dropped: without
    # the per-batch event the read could overtake the copy, and without record_stream a later copy (on the side
    # stream, which does not wait) could reuse the batch's memory before the read; either gives wrong sums
    cuda = torch.device("cuda", torch.cuda.current_device())
    x, y = torch.randn(64, 256, 1024), torch.zeros(64)  # 1 MiB per sample
    loader = BatchLoader(x, y, cuda, device_bytes=0)
    sums = []
    for batch in loader.epoch(torch.arange(64).flip(0), 8):
        assert batch.x is not None
        torch.cuda._sleep(20_000_000)  # GPU cycles (about 10-20 ms)
        sums.append(batch.x.double().sum())
        del batch
    expected = [x[torch.arange(64).flip(0)[s : s + 8]].double().sum() for s in range(0, 64, 8)]
    torch.testing.assert_close(torch.stack(sums).cpu(), torch.stack(expected), rtol=1e-9, atol=1e-6)


@needs_cuda
def test_training_on_cuda_from_pinned_memory_equals_device_resident_data() -> None:
    cuda = torch.device("cuda", torch.cuda.current_device())
    plan = ParallelPlan(grad_accum=2)
    resident = _train(cuda, plan)
    pinned = _train(cuda, plan, device_data_bytes=0)
    pinned_plain = _train(cuda, plan, device_data_bytes=0, prefetch=False)
    assert _bitwise_equal(pinned, resident) and _bitwise_equal(pinned_plain, resident)
    cpu = _train(CPU, plan)
    assert resident.state is not None and cpu.state is not None
    for name in cpu.state:  # the CUDA tests' fp32 tolerance (tests/engine/test_cuda.py)
        torch.testing.assert_close(resident.state[name], cpu.state[name], atol=1e-4, rtol=1e-3)
