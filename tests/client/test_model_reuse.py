"""One model object reused across instructions and clients trains exactly as a model built for each instruction."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from torch import nn

from client.runner import ModelCache, load_parameters, run_instruction
from fedcore.errors import ClientTaskError, PayloadError
from fedcore.messages import EvaluateIns, FitIns, FitRes
from fedcore.payload import open_safetensors, save_payload
from fedcore.strategy import SamplingConfig, Strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, TrainContext, TrainResult, initial_parameters
from server.round_loop import RoundConfig, run_rounds
from simulations.inmemory import InMemoryPool
from tests.residency import mapping_rss, needs_smaps

FEATURES, CLASSES = 6, 3
#: momentum (optimizer state), weight decay, FedProx (global parameters), two epochs of uneven batches
CONFIG = FitConfig(local_epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-3, mu=0.1)
BUILDS: list[int] = []


class Net(nn.Module):
    """BatchNorm (running statistics), dropout (global torch RNG) and a buffer left out of the state dict that
    training changes (a fresh model starts it at 0, so a reused one must too)."""

    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, CLASSES)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x))))) * (1 + 0.01 * self.calls)


def build_net() -> nn.Module:
    BUILDS.append(1)
    return Net()


class HeadOnlyForA(SupervisedTask):
    """Client "a" trains only the last layer (and leaves the others frozen); every other client trains all."""

    def train(self, model: nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        if context.client_id == "a":
            for name, param in model.named_parameters():
                param.requires_grad_(name.startswith("fc2."))
        return super().train(model, config, context)


def data(cid: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed({"a": 1, "b": 2, "c": 3}[cid])
    n = {"a": 30, "b": 21, "c": 18}[cid]
    return torch.randn(n, FEATURES, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)


def task(cid: str) -> SupervisedTask:
    return HeadOnlyForA(model_fn=build_net, train_data=data(cid))


INITIAL = initial_parameters(Net, seed=0)


def fit(cid: str, models: ModelCache | None, rnd: int = 1) -> FitRes:
    reply = run_instruction(
        task(cid), FitIns(round=rnd, parameters=INITIAL, config=CONFIG, seed=11), cid, models=models
    )
    assert isinstance(reply, FitRes)
    return reply


def assert_same(a: FitRes, b: FitRes) -> None:
    assert list(a.parameters) == list(b.parameters)
    for name in a.parameters:
        assert np.array_equal(a.parameters[name], b.parameters[name]), name
    assert a.num_examples == b.num_examples and a.metrics["train_loss"] == b.metrics["train_loss"]


@pytest.mark.parametrize("order", [("a", "b", "c"), ("c", "b", "a"), ("b", "a", "c")])
def test_clients_on_one_shared_model_in_any_order_get_the_updates_of_fresh_models(order: tuple[str, ...]) -> None:
    fresh = {cid: fit(cid, None) for cid in "abc"}
    assert not np.array_equal(fresh["a"].parameters["fc1.weight"], fresh["b"].parameters["fc1.weight"])
    assert np.array_equal(fresh["a"].parameters["fc1.weight"], INITIAL["fc1.weight"])  # a froze fc1
    assert not np.array_equal(fresh["a"].parameters["bn.running_mean"], INITIAL["bn.running_mean"])
    models = ModelCache()
    BUILDS.clear()
    shared = {}
    for cid in order:
        shared[cid] = fit(cid, models)
        # an evaluation in between leaves the model in eval mode; the next fit must not inherit it
        run_instruction(task(cid), EvaluateIns(round=1, parameters=shared[cid].parameters), cid, models=models)
    assert len(BUILDS) == 1  # one model for every instruction
    for cid in order:
        assert_same(shared[cid], fresh[cid])


def test_a_reused_model_gives_the_same_rounds_as_fresh_ones() -> None:
    models = ModelCache()
    first = fit("b", models)
    again = fit("b", models)
    later = fit("b", models, rnd=2)
    assert_same(first, again)
    assert_same(later, fit("b", None, rnd=2))
    assert not np.array_equal(first.parameters["fc1.weight"], later.parameters["fc1.weight"])


class Breaks(SupervisedTask):
    """Turns the model to float64 and fails."""

    def train(self, model: nn.Module, config: FitConfig, context: TrainContext) -> TrainResult:
        model.double()
        raise RuntimeError("out of memory")


def test_a_model_left_changed_by_a_failed_instruction_is_not_reused() -> None:
    models = ModelCache()
    BUILDS.clear()
    ins = FitIns(round=1, parameters=INITIAL, config=CONFIG, seed=11)
    with pytest.raises(ClientTaskError, match="out of memory"):
        run_instruction(Breaks(model_fn=build_net, train_data=data("a")), ins, "a", models=models)
    assert_same(fit("a", models), fit("a", None))
    assert len(BUILDS) == 3  # the broken model was dropped; the fresh reference built its own


def test_parameters_that_do_not_fit_the_shared_model_are_refused() -> None:
    models = ModelCache()
    fit("a", models)
    wrong = dict(INITIAL, **{"fc2.bias": np.zeros(CLASSES + 1, np.float32)})
    with pytest.raises(PayloadError, match=r"fc2\.bias"):
        run_instruction(task("a"), FitIns(round=2, parameters=wrong, config=CONFIG, seed=11), "a", models=models)


def test_a_simulation_builds_the_model_once_and_matches_fresh_models() -> None:
    strategy = Strategy(fit=CONFIG, sampling=SamplingConfig(fraction_fit=1.0, min_fit_clients=3))
    BUILDS.clear()
    final, _ = run_rounds(InMemoryPool(["a", "b", "c"], task), strategy, INITIAL, RoundConfig(num_rounds=2, seed=11))
    assert len(BUILDS) == 1
    state = INITIAL  # the same two rounds by hand, each client on a model of its own
    for rnd in (1, 2):
        replies = [
            run_instruction(task(cid), FitIns(round=rnd, parameters=state, config=CONFIG, seed=11), cid)
            for cid in "abc"
        ]
        fits = [r for r in replies if isinstance(r, FitRes)]
        total = sum(r.num_examples for r in fits)
        averages = {
            n: cast(np.ndarray, sum(r.parameters[n].astype(np.float64) * r.num_examples for r in fits) / total)
            for n in INITIAL
        }
        state = {
            n: (np.rint(v) if INITIAL[n].dtype.kind == "i" else v).astype(INITIAL[n].dtype) for n, v in averages.items()
        }
    for name, value in final.parameters.items():
        np.testing.assert_allclose(value, state[name], rtol=1e-6, atol=1e-7)


def test_the_cache_keeps_no_replaced_global_model_alive() -> None:
    """The cache remembers which global model it checked by weak references: once the server replaces the model,
    the old one is freed (a strong reference would keep a model-sized copy beside the next one)."""
    import gc
    import weakref

    one = task("a")
    models = ModelCache()
    first = {name: array.copy() for name, array in INITIAL.items()}
    models.load(one, first, round=1, client_id="a")
    alive = [weakref.ref(a) for a in first.values()]
    del first
    gc.collect()
    assert all(ref() is None for ref in alive)
    second = {name: array.copy() for name, array in INITIAL.items()}
    models.load(one, second, round=2, client_id="a")
    assert models._is_checked(second) and not models._is_checked(dict(second, extra=np.zeros(1)))


def test_an_update_lends_the_models_memory_and_a_held_one_never_changes() -> None:
    """The cache's model gives its memory to the update (no copy); an update still held when the next client
    loads gets to keep it, whether through the FitRes or a view of one of its arrays, and equals a fresh model's."""
    models = ModelCache()
    held = fit("a", models)
    model = models._model
    assert model is not None
    assert isinstance(model, Net)
    assert np.shares_memory(held.parameters["fc2.weight"], model.fc2.weight.detach().numpy())
    before = {name: array.copy() for name, array in held.parameters.items()}
    view = fit("b", models).parameters["fc1.weight"][2:].reshape(-1)  # the FitRes itself is dropped at once
    view_before = view.copy()
    fit("c", models)
    for name, array in held.parameters.items():
        assert np.array_equal(array, before[name]), name
    assert np.array_equal(view, view_before)
    assert_same(held, fit("a", None))


def test_a_dropped_update_gives_its_memory_back_to_the_next_client() -> None:
    """Once the update is dropped (folded, as the round loop does), the next client trains in the same memory:
    no model-sized allocation per client; an update still held makes the next client take new memory."""
    models = ModelCache()
    reply = fit("b", models)
    address = reply.parameters["fc1.weight"].ctypes.data
    del reply
    kept = fit("c", models)
    assert kept.parameters["fc1.weight"].ctypes.data == address
    after = fit("a", models)
    assert after.parameters["fc1.weight"].ctypes.data != address  # "c"'s update was held
    assert_same(kept, fit("c", None))
    assert_same(after, fit("a", None))


def test_a_model_that_is_not_the_caches_own_is_copied() -> None:
    models = ModelCache()
    model = Net()
    state = models.lend(model)
    assert not np.shares_memory(state["fc1.weight"], model.fc1.weight.detach().numpy())
    assert np.array_equal(state["fc1.weight"], model.fc1.weight.detach().numpy())


def test_between_rounds_the_pools_model_holds_no_memory_and_trains_as_before() -> None:
    pool = InMemoryPool(["a", "b", "c"], task)
    instructions = {cid: FitIns(round=1, parameters=INITIAL, config=CONFIG, seed=11) for cid in "abc"}
    first = list(pool.run(instructions))
    model = pool._models._model
    assert model is not None
    assert all(t.numel() == 0 for t in model.state_dict().values())  # released: parameters and buffers
    assert all(t.numel() == 0 for t in model.parameters())
    again = list(pool.run(instructions))  # new memory, the same training; the first round's updates unchanged
    for one, two, cid in zip(first, again, "abc", strict=True):
        assert isinstance(one, FitRes) and isinstance(two, FitRes)
        assert_same(one, fit(cid, None))
        assert_same(two, one)


@needs_smaps
def test_a_global_model_mapped_from_a_file_is_loaded_without_staying_resident(tmp_path: Path) -> None:
    """A global model mapped read-only from a file (a simulation's state between rounds) loads into the cached model
    with the very values of the file, and its pages leave the resident set as they are copied: it is never resident
    whole beside the model it is copied into. A tensor in memory beside it loads as before."""
    model = nn.Sequential(nn.Linear(600, 3000), nn.Linear(3000, 4))  # a 1.8M-element weight: 7 MiB
    generator = torch.Generator().manual_seed(5)
    values = {n: torch.randn(t.shape, generator=generator).numpy() for n, t in model.state_dict().items()}
    save_payload(tmp_path / "global.safetensors", values)
    mapped, _ = open_safetensors(tmp_path / "global.safetensors")
    parameters = {**mapped, "1.bias": values["1.bias"].copy()}  # one tensor in memory
    big = mapped["0.weight"]
    assert isinstance(big, np.memmap) and float(np.sum(big, dtype=np.float64)) != 0.0
    assert mapping_rss(big) >= big.nbytes - 4096  # all of it read in

    cache = ModelCache()
    task = SupervisedTask(model_fn=lambda: nn.Sequential(nn.Linear(600, 3000), nn.Linear(3000, 4)))
    loaded = cache.load(task, parameters, round=1, client_id="c0")
    assert mapping_rss(big) <= 8192  # at most the pages at its two ends
    for name, tensor in loaded.state_dict().items():
        assert np.array_equal(tensor.numpy(), values[name]), name


def test_mapped_tied_weights_load_as_load_state_dict_does(tmp_path: Path) -> None:
    """Tied weights mapped from a file with different values, in the reverse of the model's order: the model keeps
    the value load_state_dict gives it (the later key in the model's order), not the order of the arrays."""

    def build() -> nn.Sequential:
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        model[1].weight = model[0].weight
        return model

    values = {"1.weight": np.full((4, 4), 2.0, np.float32), "0.weight": np.full((4, 4), 1.0, np.float32)}
    save_payload(tmp_path / "tied.safetensors", values)
    mapped, _ = open_safetensors(tmp_path / "tied.safetensors")
    expected = build()
    expected.load_state_dict({n: torch.from_numpy(a.copy()) for n, a in values.items()})
    loaded = build()
    load_parameters(loaded, mapped, round=1, client_id="c0")
    assert isinstance(expected[0], nn.Linear) and isinstance(loaded[0], nn.Linear)
    assert expected[0].weight[0, 0].item() == 2.0
    assert torch.equal(loaded[0].weight, expected[0].weight)
