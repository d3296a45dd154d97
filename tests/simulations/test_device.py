"""``[simulation] device``: the values a recipe may give, the device each backend resolves them to on this machine
(the process workers' and Ray actors' too), a GPU asked for where torch sees none refused before anything is
written, and what goes to the device (the shared model, each task's tensors once, a test set shared by the clients'
tasks once for all; a process worker's own pool). The CUDA runs themselves are bench/simulation_gpu.py's
(bench/gpu_check.sh), which needs a GPU; here the meta device stands in where only the placement is checked. Also
``[simulation] threads``: the clients train on that many torch threads, and the caller's count comes back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from torch import nn

from client.runner import ModelCache
from fedcore.cli import main
from fedcore.errors import ConfigError
from fedcore.messages import Failure, FitBatchRes
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, TaskContext, TrainContext, TrainResult
from fedcore.tensors import from_state_dict
from simulations.batched import _one_storage
from simulations.config import BackendConfig, load_recipe, training_device, worker_device
from simulations.harness import run_simulation
from simulations.inmemory import MOVED_KEPT, DeviceCopies, InMemoryPool, _views_part, on_device
from tests.simulations.test_harness import tiny_task
from tests.simulations.test_setup_refusals import _simulate

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:-1", "CUDA", "cuda:0 ", "mps", ""])
def test_a_device_that_is_not_auto_cpu_or_cuda_is_refused_with_the_forms_it_takes(value: str) -> None:
    with pytest.raises(ConfigError, match=r"device must be auto, cpu, cuda or cuda:N"):
        BackendConfig(device=value)


def test_the_process_workers_train_on_the_cpu_unless_given_a_gpu() -> None:
    assert training_device(BackendConfig(backend="process", device="cuda")) == torch.device("cpu")  # the driver's
    assert worker_device(BackendConfig(backend="process")) is None
    assert worker_device(BackendConfig(backend="process", device="cpu")) is None
    if CUDA:
        assert worker_device(BackendConfig(backend="process", device="cuda")) == "cuda:0"
    else:
        with pytest.raises(ConfigError, match="device = 'cuda:0' but torch sees no CUDA GPU"):
            worker_device(BackendConfig(backend="process", device="cuda:0"))


def test_ray_actors_train_on_the_gpu_they_hold() -> None:
    pytest.importorskip("ray")
    assert worker_device(BackendConfig(backend="ray")) is None
    assert worker_device(BackendConfig(backend="ray", num_gpus=0.25)) == "cuda"  # auto: the actor's own GPU
    assert worker_device(BackendConfig(backend="ray", num_gpus=0.25, device="cuda")) == "cuda"
    assert worker_device(BackendConfig(backend="ray", num_gpus=0.25, device="cpu")) is None
    with pytest.raises(ConfigError, match="an actor sees a GPU only when it holds one; give num_gpus"):
        BackendConfig(backend="ray", device="cuda")
    with pytest.raises(ConfigError, match="Ray gives each actor its GPU; use device = 'cuda'"):
        BackendConfig(backend="ray", num_gpus=1, device="cuda:1")


def test_a_process_worker_trains_on_the_device_it_is_given() -> None:
    """The worker's own pool gets the device: on the meta device, which holds no numbers, its client's training
    fails, saying so (on the CPU the same worker trains: tests/simulations/test_procpool.py)."""
    from simulations.procpool import ClientTasks, ProcessPool
    from tests.simulations.test_procpool import IDS, TINY, _fit

    tasks = ClientTasks(factory=TINY, num_partitions=len(IDS), seed=0, device="meta")
    with ProcessPool(IDS, tasks, workers=1) as pool:
        (reply,) = list(pool.run(_fit(["client-1"])))
    assert isinstance(reply, Failure) and "cannot be called on meta tensors" in reply.reason, reply


def test_auto_is_the_first_gpu_when_torch_sees_one_and_else_the_cpu() -> None:
    expected = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    assert training_device(BackendConfig()) == expected
    assert training_device(BackendConfig(backend="batched")) == expected
    assert training_device(BackendConfig(device="cpu")) == torch.device("cpu")


@pytest.mark.skipif(CUDA, reason="checks the refusal where torch sees no GPU")
def test_a_gpu_where_torch_sees_none_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=f"device = '{device}' but torch sees no CUDA GPU"):
            training_device(BackendConfig(device=device))
    out = tmp_path / "run"
    assert main(_simulate("--device", "cuda", "--out", str(out))) == 2
    err = capsys.readouterr().err
    assert "device = 'cuda' but torch sees no CUDA GPU" in err and "use device = 'cpu' or 'auto'" in err
    assert not out.exists()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_gpu_past_the_last_one_is_refused() -> None:
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"torch sees {count} GPU"):
        training_device(BackendConfig(device=f"cuda:{count}"))


def test_an_explicit_cpu_run_is_the_default_run_here(tmp_path: Path) -> None:
    """On a machine without a GPU, ``--device cpu`` and the default ``auto`` train the same model bit for bit."""
    if CUDA:
        pytest.skip("auto is the GPU here")
    models = []
    for device in ("cpu", "auto"):
        out = tmp_path / device
        assert main(_simulate("--device", device, "--rounds", "2", "--out", str(out))) == 0
        models.append((out / "model.safetensors").read_bytes())
    assert models[0] == models[1]


def _task(train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor]) -> SupervisedTask:
    return SupervisedTask(model_fn=lambda: nn.Linear(3, 2), train_data=train, test_data=test)


def test_each_tasks_tensors_go_to_the_device_once_and_a_shared_test_set_once_for_all() -> None:
    meta = torch.device("meta")
    test = (torch.randn(50, 3), torch.randint(0, 2, (50,)))
    moved = DeviceCopies(meta)
    shards = [(torch.randn(n, 3), torch.randint(0, 2, (n,))) for n in (4, 7, 0)]
    tasks = [on_device(_task(shard, test), meta, moved) for shard in shards]
    for task, (x, y) in zip(tasks, shards, strict=True):
        assert isinstance(task, SupervisedTask)
        assert task.train_data is not None and task.test_data is not None
        tx, ty = task.train_data
        assert (tx.device, tx.shape, tx.dtype, ty.device, ty.shape, ty.dtype) == (
            meta,
            x.shape,
            x.dtype,
            meta,
            y.shape,
            y.dtype,
        )
        assert task.test_data[0].device == meta and task.test_data[0].shape == (50, 3)
    # one copy of the test set for the three tasks (the same tensors), kept while the shards' copies age out
    assert isinstance(tasks[0], SupervisedTask) and isinstance(tasks[2], SupervisedTask)
    assert tasks[0].test_data is not None and tasks[2].test_data is not None
    assert tasks[0].test_data[0] is tasks[2].test_data[0] and tasks[0].test_data[1] is tasks[2].test_data[1]
    for _ in range(MOVED_KEPT):
        on_device(_task((torch.randn(2, 3), torch.zeros(2, dtype=torch.long)), test), meta, moved)
    assert len(moved.tensors) == MOVED_KEPT and id(test[0]) in moved.tensors and id(shards[0][0]) not in moved.tensors
    assert not moved.storages  # each shard has its own storage
    # the source tensors are not changed, and a task already on the device is left as it is
    assert shards[0][0].device.type == "cpu"
    cpu_task = _task(shards[0], test)
    same = on_device(cpu_task, torch.device("cpu"), DeviceCopies(torch.device("cpu")))
    assert isinstance(same, SupervisedTask)
    assert same.train_data is not None and same.train_data[0] is shards[0][0]


def test_shards_of_one_dataset_go_to_the_device_as_views_of_one_copy_of_it() -> None:
    """The clients' shards view one dataset: the dataset is copied once and each shard's copy views that copy at the
    shard's own rows, so that the batched backend reads them in place (``_one_storage``) as it does on the CPU."""
    x = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    y = torch.arange(40, dtype=torch.int64) % 5
    bounds = [(0, 7), (7, 7), (7, 19), (19, 40)]  # one client without data
    # the CPU stands in for another device: _view makes the copy that ``to`` makes for a GPU
    copies = DeviceCopies(torch.device("cpu"))
    moved = [(copies._view(x[a:b], x.untyped_storage()), copies._view(y[a:b], y.untyped_storage())) for a, b in bounds]
    assert len(copies.storages) == 2  # x's storage and y's, once each
    for (mx, my), (a, b) in zip(moved, bounds, strict=True):
        assert mx is not None and my is not None
        assert torch.equal(mx, x[a:b]) and torch.equal(my, y[a:b]) and mx.dtype == x.dtype and my.dtype == y.dtype
        assert mx.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        assert mx.storage_offset() == 3 * a and mx.stride() == (3, 1)
    found = _one_storage([mx for mx, _ in moved if mx is not None], torch.device("cpu"))
    assert found is not None and found[1] == [a for a, _ in bounds] and torch.equal(found[0], x)
    x[0, 0] = -1.0  # a copy: the source's later changes do not reach it
    assert moved[0][0] is not None and float(moved[0][0][0, 0]) == 0.0
    # a storage reallocated in place (resized) since it was copied is copied again, as it is now: not the old copy,
    # nor another storage that took its old address
    y.resize_(4000).fill_(3)
    again = copies._view(y[10:20], y.untyped_storage())
    assert again is not None and torch.equal(again, torch.full((10,), 3)) and len(copies.storages) == 2
    # what a view of a copied storage cannot carry is copied as it is: a lazy conjugate, a sparse tensor
    z = torch.randn(8, dtype=torch.complex64)
    assert not _views_part(z[2:5].conj()) and not _views_part(z[2:5]._neg_view())
    assert _views_part(z[2:5]) and not _views_part(torch.eye(4).to_sparse()) and not _views_part(z)
    # a shard that is its own storage, or takes part in autograd, is copied as it is
    whole = torch.randn(4, 3)
    assert DeviceCopies(torch.device("meta")).to(whole).shape == (4, 3)
    meta = DeviceCopies(torch.device("meta"))
    meta.to(torch.randn(8, 3, requires_grad=True)[2:4])
    assert not meta.storages and len(meta.tensors) == 1


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (bench/gpu_check.sh runs it)")
def test_a_pools_clients_on_the_gpu_view_one_copy_of_the_dataset() -> None:
    x = torch.randn(60, 3)
    y = torch.randint(0, 2, (60,))
    test = (torch.randn(5, 3), torch.randint(0, 2, (5,)))
    ids = [str(k) for k in range(6)]
    pool = InMemoryPool(
        ids,
        lambda cid: _task((x[10 * int(cid) : 10 * int(cid) + 10], y[10 * int(cid) : 10 * int(cid) + 10]), test),
        device="cuda",
    )
    shards = [cast(SupervisedTask, pool.task(cid)).train_data for cid in ids]
    assert all(s is not None for s in shards)
    found = _one_storage([s[0] for s in shards if s is not None], torch.device("cuda", 0))
    assert found is not None and found[1] == [0, 10, 20, 30, 40, 50]
    assert torch.equal(found[0].cpu(), x)


def test_a_task_that_is_not_supervised_is_left_to_move_its_own_data() -> None:
    class OwnTask:
        def build_model(self) -> nn.Module:
            return nn.Linear(3, 2)

    task = OwnTask()
    assert on_device(task, torch.device("meta")) is task  # type: ignore[arg-type]


def test_the_model_cache_builds_its_model_on_the_device_once() -> None:
    task = _task(
        (torch.randn(4, 3), torch.zeros(4, dtype=torch.long)), (torch.randn(2, 3), torch.zeros(2, dtype=torch.long))
    )
    arrays = from_state_dict(nn.Linear(3, 2).state_dict())
    cache = ModelCache(device="meta")
    with pytest.warns(UserWarning, match="meta parameter"):  # loading into meta tensors copies nothing
        first = cache.load(task, arrays, round=1, client_id="a")
        second = cache.load(task, arrays, round=2, client_id="b")
    assert second is first and {p.device.type for p in first.parameters()} == {"meta"}
    on_cpu = ModelCache().load(task, arrays, round=1, client_id="a")
    assert isinstance(on_cpu, nn.Linear)
    assert {p.device.type for p in on_cpu.parameters()} == {"cpu"}
    np.testing.assert_array_equal(on_cpu.weight.detach().numpy(), arrays["weight"])


def test_the_batched_step_keeps_frozen_parameters_on_the_device_and_the_model_where_it_was_built() -> None:
    """``train_stack`` moves the frozen parameters to the device of the stacked ones (passed beside them to
    ``functional_call``); the model itself, which only lends its structure, stays on the CPU."""
    from simulations.batched import _Batched

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    batched = _Batched(model, nn.functional.cross_entropy)
    batched.to(torch.device("meta"))
    assert {t.device.type for t in batched.frozen.values()} == {"meta"} and list(batched.frozen) == ["0.weight"]
    assert {p.device.type for p in model.parameters()} == {"cpu"}


SEEN_THREADS: list[int] = []


@dataclass(frozen=True, kw_only=True, eq=False)
class _ThreadsTask(SupervisedTask):
    """tiny_task's task, noting the torch threads each client trains on."""

    def train(self, model: nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        SEEN_THREADS.append(torch.get_num_threads())
        return super().train(model, config, context)


def threads_task(ctx: TaskContext) -> SupervisedTask:
    task = tiny_task(ctx)
    return _ThreadsTask(model_fn=task.model_fn, train_data=task.train_data, test_data=task.test_data)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_clients_train_on_the_threads_given_and_the_callers_count_comes_back(tmp_path: Path, threads: int) -> None:
    before = torch.get_num_threads()
    SEEN_THREADS.clear()
    overrides = [f"task.factory='{__name__}:threads_task'", "data.num_clients=4", "sampling.min_fit_clients=4"]
    overrides += ["rounds=2", "output.progress=false", f"output.dir={str(tmp_path)!r}", f"simulation.threads={threads}"]
    run_simulation(load_recipe(None, overrides), echo=lambda _: None)
    assert [threads] * 8 == SEEN_THREADS and torch.get_num_threads() == before
    with pytest.raises(ConfigError, match="backend 'process' trains on one thread a worker"):
        BackendConfig(backend="process", threads=2)
    with pytest.raises(ConfigError, match=r"threads must be in 1\.\.1024"):
        BackendConfig(threads=0)


def test_a_gpu_batch_fits_three_stacked_models_in_half_the_free_memory() -> None:
    from simulations.batched import GPU_STACK_FRACTION, gpu_batch

    two_nn = 199_210 * 4  # bytes of the 2NN's float32 parameters
    assert GPU_STACK_FRACTION == 0.5
    assert gpu_batch(1000, two_nn, 130 << 30) == 1000  # all of a round's 2NNs on an H200
    big = 20_000_000 * 4
    assert gpu_batch(1000, big, 130 << 30) == (65 << 30) // (3 * big) == 290
    assert gpu_batch(1000, big, 100 << 20) == 1  # never fewer than one
    assert gpu_batch(7, 0, 0) == 1 and gpu_batch(7, two_nn, 1 << 40) == 7


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"))]
)
@pytest.mark.parametrize("backend", ["inprocess", "batched"])
def test_a_client_whose_labels_exceed_the_classes_fails_alone_and_the_device_goes_on(backend: str, device: str) -> None:
    """Client b's labels lie beyond the model's 3 classes. On a GPU cross-entropy would index them in a device-side
    assert that ends the process's CUDA context; instead, in both backends and over two rounds, b fails with its
    labels named and a and c train on the device each round (bench/gpu_check.sh runs the CUDA case)."""
    from fedcore.messages import FitIns, FitRes
    from simulations.batched import BatchedPool

    generator = torch.Generator().manual_seed(9)
    data = {
        cid: (torch.randn(6, 4, generator=generator), torch.randint(0, 3, (6,), generator=generator)) for cid in "abc"
    }
    data["b"] = (data["b"][0], torch.tensor([0, 1, 2, 3, 1, 40]))

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def task(cid: str) -> SupervisedTask:
        return SupervisedTask(model_fn=model, train_data=data[cid])

    inmemory = InMemoryPool(list(data), task, device=device)
    pool = BatchedPool(inmemory, device=device) if backend == "batched" else inmemory
    start = from_state_dict(model().state_dict())
    for rnd in (1, 2):
        config = FitConfig(local_epochs=1, batch_size=3, lr=0.1)
        instructions = {cid: FitIns(round=rnd, parameters=start, config=config, seed=rnd) for cid in data}
        replies = {r.client_id: r for r in pool.run(instructions) if not isinstance(r, FitBatchRes)}
        failure = replies["b"]
        assert isinstance(failure, Failure)
        assert failure.reason.startswith("labels 3, 40 lie outside the model's 3 classes; give labels in 0..2"), failure
        for cid in "ac":
            reply = replies[cid]
            assert isinstance(reply, FitRes), reply
            assert all(np.isfinite(value).all() for value in reply.parameters.values())
