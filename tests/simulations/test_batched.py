"""Batched clients (simulations/batched.py) against one-by-one training: same parameters and losses within 1e-5,
clients of unequal sizes included; what cannot be batched is refused before a round."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
import pytest
import torch
from torch import nn

from fedcore.errors import ClientTaskError, ConfigError
from fedcore.messages import Failure, FitBatchRes, FitIns, FitRes, PoolReply, Reply
from fedcore.seeding import derive_seed
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, TrainResult
from fedcore.tensors import from_state_dict
from fedcore.training import train_supervised
from simulations.batched import (
    BatchedPool,
    ClientShard,
    StackBuffers,
    TrainedClients,
    _step_runs,
    check_batchable,
    check_batchable_clients,
    presum_weight,
    train_stack,
)
from simulations.config import load_recipe
from simulations.harness import run_simulation
from simulations.inmemory import InMemoryPool
from simulations.models import MLP2NN

SEED, ROUND = 7, 3


class SmallCNN(nn.Module):
    """conv3x3(4) - ReLU - maxpool2 - fc: a convolution under vmap on 1x8x8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


class NoisyForward(nn.Module):
    """A linear model whose forward draws random numbers: not batchable (vmap's randomness is refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + torch.randn_like(x))


def own_cross_entropy(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy as a user's own loss: labels beyond the model's classes raise in training (the pool checks
    labels up front for torch's own cross-entropy and NLL only)."""
    return nn.functional.cross_entropy(output, target, reduction=reduction)


def one_per_client(replies: Sequence[PoolReply]) -> TypeGuard[Sequence[Reply]]:
    """No reply is a batch's :class:`FitBatchRes`: what a pool without a pre-sum weight sends, one per client."""
    return not any(isinstance(r, FitBatchRes) for r in replies)


def assert_as_in_process(replies: Iterable[PoolReply], inprocess: Iterable[PoolReply], trained: Iterable[str]) -> None:
    """The clients ``trained``, and no others, reply with a :class:`FitRes` whose parameters are those of their
    in-process replies within 1e-5."""
    got = {r.client_id: r for r in replies if isinstance(r, FitRes)}
    want = {r.client_id: r for r in inprocess if isinstance(r, FitRes)}
    assert sorted(got) == sorted(trained) and set(got) <= set(want)
    for cid, reply in got.items():
        for name, value in want[cid].parameters.items():
            np.testing.assert_allclose(reply.parameters[name], value, rtol=1e-5, atol=1e-6)


def small_mlp() -> MLP2NN:
    return MLP2NN(num_inputs=12, num_classes=3, hidden=8)


def wide_first_layer() -> nn.Module:
    """A perceptron whose first layer (12 -> 64, no bias) is wide enough for the fused path to defer its updates
    over windows of steps (_DeferredFirst); the second has a bias."""
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 64, bias=False), nn.ReLU(), nn.Linear(64, 3))


def wide_first_layer_with_bias() -> nn.Module:
    """As :func:`wide_first_layer`, the first layer with a bias (deferred as well)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 3, bias=False))


def narrow_without_biases() -> nn.Module:
    """A perceptron without biases whose first layer (12 -> 8) is too narrow to defer: the fused path runs every
    layer itself, the round's first step through the global model's unstacked weights."""
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8, bias=False), nn.ReLU(), nn.Linear(8, 3, bias=False))


def shards(sizes: list[int], shape: tuple[int, ...]) -> list[ClientShard]:
    generator = torch.Generator().manual_seed(0)
    return [
        ClientShard(
            f"client-{i:03d}",
            torch.randn(n, *shape, generator=generator),
            torch.randint(0, 3, (n,), generator=generator),
        )
        for i, n in enumerate(sizes)
    ]


def one_by_one(
    model_fn: Callable[[], nn.Module], clients: list[ClientShard], config: FitConfig, start: dict[str, torch.Tensor]
) -> list[tuple[dict[str, torch.Tensor], TrainResult]]:
    """Each client alone with fedcore's own loop, as the in-process backend trains it."""
    results = []
    for shard in clients:
        model = model_fn()
        model.load_state_dict(start)
        generator = torch.Generator().manual_seed(derive_seed(SEED, ROUND, shard.client_id))
        global_parameters = {n: t.clone() for n, t in start.items()}
        result = train_supervised(
            model, shard.x, shard.y, config, generator=generator, global_parameters=global_parameters
        )
        results.append((model.state_dict(), result))
    return results


@pytest.mark.parametrize(
    ("model_fn", "shape", "sizes", "config"),
    [
        # equal sizes, the workload's shape: one vmap call per step
        (small_mlp, (12,), [20, 20, 20], FitConfig(local_epochs=1, batch_size=5, lr=0.1)),
        # unequal sizes: different step counts, partial batches at different steps, an empty client, E=2
        (small_mlp, (12,), [23, 0, 7, 10, 3, 23, 16], FitConfig(local_epochs=2, batch_size=4, lr=0.1)),
        # momentum, weight decay and the FedProx term, capped steps ending mid-epoch
        (
            small_mlp,
            (12,),
            [9, 14, 5, 14],
            FitConfig(local_epochs=3, batch_size=4, lr=0.05, momentum=0.9, weight_decay=0.01, mu=0.5, max_steps=7),
        ),
        # the fused path with the first layer's updates deferred (defer_first_layer) over windows of 2 steps:
        # windows cut through epochs, partial batches, clients that finish mid-window, an empty client
        (wide_first_layer, (12,), [23, 0, 7, 10, 3, 23, 16], FitConfig(local_epochs=2, batch_size=4, lr=0.1)),
        # windows of 8 steps of 1 sample (the most rows deferred at once is 64)
        (wide_first_layer_with_bias, (12,), [9, 12, 4], FitConfig(local_epochs=1, batch_size=1, lr=0.05)),
        # the fused path, no layer deferred and none with a bias; clients with partial batches at the first step
        (narrow_without_biases, (12,), [3, 9, 0, 2, 12], FitConfig(local_epochs=2, batch_size=4, lr=0.1)),
        # a convolutional model
        (SmallCNN, (1, 8, 8), [11, 6, 8], FitConfig(local_epochs=2, batch_size=4, lr=0.05, momentum=0.5)),
    ],
)
def test_batched_clients_equal_one_by_one_training(
    model_fn: Callable[[], nn.Module], shape: tuple[int, ...], sizes: list[int], config: FitConfig
) -> None:
    torch.manual_seed(1)
    start = model_fn().state_dict()
    clients = shards(sizes, shape)
    updates = train_stack(model_fn(), start, clients, config, seed=SEED, round=ROUND, defer_first_layer=True).updates()
    expected = one_by_one(model_fn, clients, config, start)
    assert [u.num_examples for u in updates] == sizes
    for update, (state, result), n in zip(updates, expected, sizes, strict=True):
        assert set(update.parameters) == set(state)
        for name, value in state.items():
            torch.testing.assert_close(update.parameters[name], value, rtol=1e-5, atol=1e-5)
        if n == 0:
            assert update.metrics == {} and result.metrics == {}
            for name in state:
                assert torch.equal(update.parameters[name], start[name])  # untouched
        else:
            assert update.metrics["train_loss"] == pytest.approx(result.metrics["train_loss"], rel=1e-5, abs=1e-6)
            moved = max(float((update.parameters[k] - start[k]).abs().max()) for k in start)
            assert moved > 1e-3  # it trained: equality is not two untouched models


def test_check_batchable_refuses_what_it_cannot_reproduce() -> None:
    data = (torch.randn(4, 12), torch.randint(0, 3, (4,)))
    check_batchable(SupervisedTask(model_fn=small_mlp, train_data=data))
    with pytest.raises(ConfigError, match=r"buffers.*BatchNorm.*inprocess"):
        check_batchable(
            SupervisedTask(model_fn=lambda: nn.Sequential(nn.Linear(12, 3), nn.BatchNorm1d(3)), train_data=data)
        )
    with pytest.raises(ConfigError, match=r"randomness.*Dropout"):
        check_batchable(
            SupervisedTask(model_fn=lambda: nn.Sequential(nn.Dropout(0.5), nn.Linear(12, 3)), train_data=data)
        )

    with pytest.raises(ConfigError, match="random numbers"):
        check_batchable(SupervisedTask(model_fn=NoisyForward, train_data=data))

    class OwnLoop(SupervisedTask):
        def train(self, model, config, context):  # type: ignore[no-untyped-def]
            return super().train(model, config, context)

    with pytest.raises(ConfigError, match=r"overrides SupervisedTask\.train"):
        check_batchable(OwnLoop(model_fn=small_mlp, train_data=data))


def test_the_batched_step_is_tried_on_a_client_whose_data_the_model_accepts() -> None:
    """The first client's labels exceed the model's classes, the second's task raises, the third has 1 label for 4
    inputs and the fourth a 0-dim x: the check passes over them and tries the model's batched step on the fifth, so
    a model that vmap cannot run (its forward draws random numbers) is still refused before a round; a batchable
    model passes, as does a run whose clients all fail. A round whose first clients are those trains the others."""

    generator = torch.Generator().manual_seed(6)
    data = {
        cid: (torch.randn(4, 12, generator=generator), torch.randint(0, 3, (4,), generator=generator)) for cid in "acd"
    }
    data["a"] = (data["a"][0], data["a"][1] + 100)
    data["x"] = (torch.randn(4, 12), torch.zeros(1, dtype=torch.int64))
    data["z"] = (torch.tensor(1.0), torch.zeros(1, dtype=torch.int64))

    def tasks(model_fn: Callable[[], nn.Module]) -> Callable[[str], SupervisedTask]:
        def task(cid: str) -> SupervisedTask:
            if cid == "b":
                raise ValueError("client b's data are unavailable")
            return SupervisedTask(model_fn=model_fn, train_data=data[cid])

        return task

    assert check_batchable(tasks(NoisyForward)("a")) == []  # one client's bad labels hide the model's problem ...
    ids = ["a", "b", "x", "z", "c", "d"]
    with pytest.raises(ConfigError, match="random numbers"):  # ... which the next clients show
        check_batchable_clients(InMemoryPool(ids, tasks(NoisyForward)), ids)
    assert check_batchable_clients(InMemoryPool(ids, tasks(small_mlp)), ids) == []
    assert check_batchable_clients(InMemoryPool(ids[:4], tasks(NoisyForward)), ids[:4]) == []  # all fail alone
    start = from_state_dict(small_mlp().state_dict())
    config = FitConfig(local_epochs=1, batch_size=2, lr=0.1)
    instructions = {cid: FitIns(round=1, parameters=start, config=config, seed=SEED) for cid in ids}
    replies = list(BatchedPool(InMemoryPool(ids, tasks(small_mlp))).run(instructions))
    assert one_per_client(replies)
    assert [r.client_id for r in replies if isinstance(r, FitRes)] == ["c", "d"]
    assert [r.client_id for r in replies if isinstance(r, Failure)] == ["a", "b", "x", "z"]
    # no task of the first clients builds (their data are missing): they fail alone, the later ones train
    late = ["b", "c", "d"]
    assert check_batchable_clients(InMemoryPool(late, tasks(small_mlp)), late[:1]) == []
    replies = list(BatchedPool(InMemoryPool(late, tasks(small_mlp))).run({cid: instructions[cid] for cid in late}))
    assert one_per_client(replies)
    assert [(type(r).__name__, r.client_id) for r in replies] == [("Failure", "b"), ("FitRes", "c"), ("FitRes", "d")]
    assert "client b's data are unavailable" in str(replies[0])


class TinyLSTM(nn.Module):
    """Embedding - LSTM - Linear on the last step: a model with an op vmap has no batching rule for on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.out = nn.Linear(5, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(x))
        return self.out(hidden[:, -1])


def test_ops_without_a_batching_rule_are_named_once_and_not_warned_at_every_step() -> None:
    """check_batchable names the ops vmap runs client by client (the harness says the model may train slower
    batched); the training then trains the LSTM as one-by-one training does without torch's warning at each step."""
    torch.manual_seed(2)
    x, y = torch.randint(0, 6, (12, 7)), torch.randint(0, 6, (12,))
    mlp_data = (torch.randn(4, 12), torch.zeros(4, dtype=torch.int64))
    assert check_batchable(SupervisedTask(model_fn=small_mlp, train_data=mlp_data)) == []
    unbatched = check_batchable(SupervisedTask(model_fn=TinyLSTM, train_data=(x, y)))
    # labels beyond the model's classes fail unbatched too: not refused (the client fails alone in its round)
    assert check_batchable(SupervisedTask(model_fn=small_mlp, train_data=(mlp_data[0], mlp_data[1] + 100))) == []
    assert unbatched and all(op.startswith("aten::") for op in unbatched), unbatched
    clients = [ClientShard("a", x[:7], y[:7]), ClientShard("b", x[7:], y[7:])]
    config = FitConfig(local_epochs=1, batch_size=3, lr=0.1)
    start = TinyLSTM().state_dict()
    with warnings.catch_warnings(record=True) as caught:  # the process's filters, batched.py's among them
        updates = train_stack(TinyLSTM(), start, clients, config, seed=SEED, round=ROUND).updates()
    assert not [w for w in caught if "batching rule" in str(w.message)]
    for update, (state, _) in zip(updates, one_by_one(TinyLSTM, clients, config, start), strict=True):
        for name, value in state.items():
            torch.testing.assert_close(update.parameters[name], value, rtol=1e-5, atol=1e-5)


def test_batched_pool_fails_only_the_client_with_bad_data() -> None:
    generator = torch.Generator().manual_seed(0)
    data = {
        "a": (torch.randn(10, 12, generator=generator), torch.randint(0, 3, (10,), generator=generator)),
        "b": (
            torch.randn(6, 12, generator=generator),
            torch.randint(0, 3, (5,), generator=generator),
        ),  # one label short
        "c": (torch.randn(7, 12, generator=generator), torch.randint(0, 3, (7,), generator=generator)),
        "d": (torch.tensor(1.0), torch.tensor(2)),  # 0-dim: no samples dimension at all
    }
    tasks = {cid: SupervisedTask(model_fn=small_mlp, train_data=d) for cid, d in data.items()}
    torch.manual_seed(2)
    start = from_state_dict(small_mlp().state_dict())
    config = FitConfig(local_epochs=1, batch_size=4, lr=0.1)
    instructions = {cid: FitIns(round=1, parameters=start, config=config, seed=SEED) for cid in data}
    batched = list(BatchedPool(InMemoryPool(list(data), tasks.__getitem__), batch_clients=1).run(instructions))
    inprocess = list(InMemoryPool(list(data), tasks.__getitem__).run(instructions))
    assert one_per_client(batched)
    assert [r.client_id for r in batched] == ["a", "b", "c", "d"]
    assert isinstance(batched[1], Failure) and "6 samples but y has 5" in batched[1].reason
    assert isinstance(batched[3], Failure) and "x is a 0-dim tensor" in batched[3].reason
    assert isinstance(inprocess[1], Failure) and isinstance(inprocess[3], Failure)
    for got, want in ((batched[0], inprocess[0]), (batched[2], inprocess[2])):
        assert isinstance(got, FitRes) and isinstance(want, FitRes)
        assert got.num_examples == want.num_examples
        assert got.payload_bytes == want.payload_bytes  # the bytes_up column counts the same
        for name, value in want.parameters.items():
            np.testing.assert_allclose(got.parameters[name], value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("presum", [False, True])
def test_a_client_whose_labels_or_task_fail_fails_alone_in_its_batch(presum: bool) -> None:
    """One batch of four: b's labels exceed the model's 3 classes (the batch's step raises in the task's own loss),
    e's task factory raises.
    Only b and e fail, each with its own reason; a, c and d give the updates they give in process (the batch trained
    again in halves: a and b alone, c and d together), pre-summed or one reply each."""
    from tests.simulations.test_presum import fedavg, fold

    generator = torch.Generator().manual_seed(0)
    data = {
        cid: (torch.randn(8, 12, generator=generator), torch.randint(0, 3, (8,), generator=generator)) for cid in "abcd"
    }
    data["b"] = (data["b"][0], data["b"][1] + 100)

    def task(cid: str) -> SupervisedTask:
        if cid == "e":
            raise ValueError("client e's data are unavailable")
        return SupervisedTask(model_fn=small_mlp, train_data=data[cid], loss_fn=own_cross_entropy)

    torch.manual_seed(2)
    start = from_state_dict(small_mlp().state_dict())
    config = FitConfig(local_epochs=1, batch_size=4, lr=0.1)
    ids = [*data, "e"]
    instructions = {cid: FitIns(round=1, parameters=start, config=config, seed=SEED) for cid in ids}
    weigh = presum_weight(fedavg()) if presum else None
    replies = list(BatchedPool(InMemoryPool(ids, task), weigh=weigh).run(instructions))
    inprocess = {r.client_id: r for r in InMemoryPool(ids, task).run(instructions)}
    failures = {r.client_id: r.reason for r in replies if isinstance(r, Failure)}
    assert set(failures) == {"b", "e"}
    assert "index 10" in failures["b"] and "out of bounds" in failures["b"], failures["b"]  # a label of 100-102
    assert failures["e"] == "ValueError: client e's data are unavailable"
    assert all(isinstance(inprocess[cid], Failure) for cid in "be")
    # the failing client first: the batch is sized from the first client whose task builds
    first = {cid: instructions[cid] for cid in ["e", *data]}
    replies_first = list(BatchedPool(InMemoryPool(ids, task), weigh=weigh).run(first))
    assert {r.client_id for r in replies_first if isinstance(r, Failure)} == {"b", "e"}
    honest = [inprocess[cid] for cid in "acd"]
    assert all(isinstance(r, FitRes) for r in honest)
    trained: list[PoolReply] = [r for r in replies if not isinstance(r, Failure)]
    if presum:  # the three updates summed where they trained (a alone, c with d), as the in-process mean
        assert all(isinstance(r, FitBatchRes) for r in trained)
        assert sorted(cid for r in trained if isinstance(r, FitBatchRes) for cid in r.client_ids) == ["a", "c", "d"]
    else:
        assert sorted(r.client_id for r in trained if isinstance(r, FitRes)) == ["a", "c", "d"]
    weights = {cid: 8.0 for cid in "acd"}
    want, got = fold(list(honest), weights, start).result(), fold(trained, weights, start).result()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)
        assert np.abs(value - start[name]).max() > 1e-3  # they trained


@pytest.mark.parametrize("bad", [["c05"], [f"c{i:02d}" for i in range(16) if i != 9]], ids=["one bad", "all but one"])
def test_a_batch_whose_training_raises_is_searched_in_parts(bad: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Sixteen clients in one batch; labels beyond the model's classes (raising in the task's own loss) for one of
    them, or for all but one. One bad client: the batch is trained again in halves, 9 batched trainings in all (16;
    8 + 8; 4 + 4 of the failing half; 2 + 2 of its failing half; 1 + 1), not 1 + 16 one client at a time. All but
    one bad: both halves raise, so each client trains alone (1 + 2 + 16, not the 31 of halving down to each). Only
    the bad clients fail; the others give their in-process updates."""
    import simulations.batched as batched_module

    generator = torch.Generator().manual_seed(4)
    ids = [f"c{i:02d}" for i in range(16)]
    data = {
        cid: (torch.randn(8, 12, generator=generator), torch.randint(0, 3, (8,), generator=generator)) for cid in ids
    }
    for cid in bad:
        data[cid] = (data[cid][0], data[cid][1] + 50)
    sizes: list[int] = []
    real_train_stack = batched_module.train_stack

    def counted(*args: Any, **kwargs: Any) -> TrainedClients:  # the real training, its batch sizes noted
        sizes.append(len(args[2]))  # train_stack(model, global_parameters, shards, ...)
        return real_train_stack(*args, **kwargs)

    monkeypatch.setattr(batched_module, "train_stack", counted)

    def task(cid: str) -> SupervisedTask:
        return SupervisedTask(model_fn=small_mlp, train_data=data[cid], loss_fn=own_cross_entropy)

    torch.manual_seed(2)
    start = from_state_dict(small_mlp().state_dict())
    instructions = {
        cid: FitIns(round=1, parameters=start, config=FitConfig(local_epochs=1, batch_size=4, lr=0.1), seed=SEED)
        for cid in ids
    }
    replies = list(BatchedPool(InMemoryPool(ids, task)).run(instructions))
    if len(bad) == 1:  # c00-c07 and c08-c15; c00-c03 and c04-c07; c04-c05 and c06-c07; c04 and c05
        assert sizes == [16, 8, 8, 4, 4, 2, 2, 1, 1]
    else:
        assert sizes == [16, 8, 8] + [1] * 16
    assert one_per_client(replies)
    assert [r.client_id for r in replies if isinstance(r, Failure)] == bad
    assert_as_in_process(replies, InMemoryPool(ids, task).run(instructions), [c for c in ids if c not in bad])


@pytest.mark.parametrize("loss", ["cross_entropy", "nll_loss"])
def test_labels_beyond_the_models_classes_fail_their_client_before_its_batch_trains(
    loss: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With torch's cross-entropy or NLL loss, labels outside 0..classes-1 (other than the ignored -100) fail their
    client when its data are read, named in the reason, before any batch trains (on a GPU, such an index would be a
    device-side assert that ends the CUDA context): the batch of the others trains once, with their in-process
    updates; -100 (ignored by the loss) is accepted."""
    import simulations.batched as batched_module
    from fedcore.training import label_problem

    assert label_problem(torch.tensor([0, 2, -100, 1]), 3) is None
    assert label_problem(torch.tensor([[0, 7], [-1, 3]]), 3) == (
        "labels -1, 3, 7 lie outside the model's 3 classes; give labels in 0..2 (or -100 to skip a sample), or a "
        "model with more outputs"
    )
    loss_fn = getattr(nn.functional, loss)
    generator = torch.Generator().manual_seed(8)
    data = {
        cid: (torch.randn(6, 12, generator=generator), torch.randint(0, 3, (6,), generator=generator)) for cid in "abcd"
    }
    data["b"] = (data["b"][0], torch.tensor([0, 1, 5, 2, -100, 9]))
    data["d"] = (data["d"][0], torch.tensor([0, -100, 2, 1, -100, 0]))

    def log_probabilities() -> nn.Module:
        return nn.Sequential(small_mlp(), nn.LogSoftmax(1))

    model_fn = log_probabilities if loss == "nll_loss" else small_mlp

    def task(cid: str) -> SupervisedTask:
        return SupervisedTask(model_fn=model_fn, train_data=data[cid], loss_fn=loss_fn)

    sizes: list[int] = []
    real_train_stack = batched_module.train_stack

    def counted(*args: Any, **kwargs: Any) -> TrainedClients:  # the real training, its batch sizes noted
        sizes.append(len(args[2]))
        return real_train_stack(*args, **kwargs)

    monkeypatch.setattr(batched_module, "train_stack", counted)
    torch.manual_seed(2)
    start = from_state_dict(task("a").build_model().state_dict())
    config = FitConfig(local_epochs=1, batch_size=3, lr=0.1)
    instructions = {cid: FitIns(round=1, parameters=start, config=config, seed=SEED) for cid in data}
    got = list(BatchedPool(InMemoryPool(list(data), task)).run(instructions))
    assert one_per_client(got)
    replies = {r.client_id: r for r in got}
    assert sizes == [3]  # a, c and d, once
    failure = replies["b"]
    assert isinstance(failure, Failure) and failure.reason == (
        "labels 5, 9 lie outside the model's 3 classes; give labels in 0..2 (or -100 to skip a sample), or a model "
        "with more outputs"
    )
    inprocess = list(InMemoryPool(list(data), task).run(instructions))
    assert [r.client_id for r in inprocess if isinstance(r, Failure)] == ["b"]
    assert_as_in_process(got, inprocess, "acd")


@pytest.mark.parametrize("presum", [False, True], ids=["replies", "presummed"])
def test_labels_changed_in_place_after_a_round_fail_their_client_by_name(presum: bool) -> None:
    """The pool reads a client's labels once, when its data are first read; the same tensors given again with labels
    changed in place since then are checked by train_stack against the model's classes before its first step: the
    client fails with the reason it fails with in process, not an index error (or, on a GPU, a device-side assert),
    and the others train as in process."""
    from tests.simulations.test_presum import fedavg

    generator = torch.Generator().manual_seed(12)
    data = {
        cid: (torch.randn(6, 12, generator=generator), torch.randint(0, 3, (6,), generator=generator)) for cid in "abcd"
    }

    def task(cid: str) -> SupervisedTask:
        return SupervisedTask(model_fn=small_mlp, train_data=data[cid])

    config = FitConfig(local_epochs=1, batch_size=3, lr=0.1)
    pool = BatchedPool(InMemoryPool(list(data), task), weigh=presum_weight(fedavg()) if presum else None)
    torch.manual_seed(2)
    start = from_state_dict(task("a").build_model().state_dict())

    def instructions(rnd: int) -> dict[str, FitIns]:
        return {cid: FitIns(round=rnd, parameters=start, config=config, seed=SEED) for cid in data}

    assert not any(isinstance(r, Failure) for r in pool.run(instructions(1)))
    data["c"][1][4] = 3  # the same tensor, one label now beyond the 3 classes
    data["c"][1][0] = -100  # ignored: not named
    got = list(pool.run(instructions(2)))
    inprocess = {r.client_id: r for r in InMemoryPool(list(data), task).run(instructions(2))}
    want = inprocess["c"]
    assert isinstance(want, Failure) and want.reason == (
        "labels 3 lie outside the model's 3 classes; give labels in 0..2 (or -100 to skip a sample), or a model "
        "with more outputs"
    )
    failures = [r for r in got if isinstance(r, Failure)]
    assert [(f.client_id, f.reason) for f in failures] == [("c", want.reason)]
    if presum:  # searched in halves: a and b, then d
        assert [r.client_ids for r in got if isinstance(r, FitBatchRes)] == [("a", "b"), ("d",)]
    else:
        assert_as_in_process(got, inprocess.values(), "abd")
    # train_stack itself, given the classes: the client named before any step
    shards = [ClientShard(cid, *data[cid]) for cid in "abcd"]
    with pytest.raises(ClientTaskError, match=r"^\[round 2, client 'c'\] labels 3 lie outside the model's 3 classes"):
        train_stack(small_mlp(), _tensors_of(start), shards, config, seed=SEED, round=2, classes=3)
    others = [shard for shard in shards if shard.client_id != "c"]
    trained = train_stack(small_mlp(), _tensors_of(start), others, config, seed=SEED, round=2, classes=3)
    assert trained.num_examples().tolist() == [6, 6, 6]


def test_the_per_round_label_check_reads_the_batchs_labels_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients viewing one storage of labels are read where they lie, rows of other clients between them; a bad
    label among those others (a client failed when its data were read) is not the batch's: one check a batch, not
    one more per client every round, and the batch trains."""
    import simulations.batched as batched_module

    x_store, y_store = torch.randn(24, 12), torch.randint(0, 3, (24,))
    y_store[8] = 7  # another client's, between this batch's
    clients = [ClientShard(cid, x_store[a:b], y_store[a:b]) for cid, a, b in (("a", 0, 6), ("c", 12, 18))]
    calls: list[int] = []
    real = batched_module.label_problem

    def counted(y: torch.Tensor, num_classes: int) -> str | None:
        calls.append(len(y))
        return real(y, num_classes)

    monkeypatch.setattr(batched_module, "label_problem", counted)
    start = {n: t.detach().clone() for n, t in small_mlp().state_dict().items()}
    config = FitConfig(local_epochs=1, batch_size=3, lr=0.1)
    trained = train_stack(small_mlp(), start, clients, config, seed=SEED, round=ROUND, classes=3)
    assert calls == [12] and trained.num_examples().tolist() == [6, 6]


def _tensors_of(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(value) for name, value in arrays.items()}


def random_clients(seed: int, ids: str, size: int = 6) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Clients ``ids`` of ``size`` random inputs (12 features, float32) and labels in 0..2 (int64) each."""
    generator = torch.Generator().manual_seed(seed)
    return {
        cid: (torch.randn(size, 12, generator=generator), torch.randint(0, 3, (size,), generator=generator))
        for cid in ids
    }


def batched_and_in_process(
    data: dict[str, tuple[torch.Tensor, torch.Tensor]], config: FitConfig
) -> tuple[list[PoolReply], list[Reply]]:
    """One round of :func:`small_mlp` clients on ``data`` (one batch), batched and in process: their replies."""

    def task(cid: str) -> SupervisedTask:
        return SupervisedTask(model_fn=small_mlp, train_data=data[cid])

    start = from_state_dict(small_mlp().state_dict())
    instructions = {cid: FitIns(round=1, parameters=start, config=config, seed=SEED) for cid in data}
    batched = list(BatchedPool(InMemoryPool(list(data), task)).run(instructions))
    return batched, list(InMemoryPool(list(data), task).run(instructions))


def test_uint8_labels_train_batched_as_in_process_and_other_integer_labels_fail_in_both() -> None:
    """torch's cross-entropy takes uint8 class indices as int64 ones: batched clients train on them as in process
    (vmap's gather takes int64 only: the batch's labels are widened), also when the uint8 client comes first and
    sizes the batch. int32 and bool labels, which the loss refuses in process, fail their client batched too (the
    batch's concatenation would have promoted them to int64 and trained on them), unless it has no data to train on
    (then the loss never reads them, in process either)."""
    data = random_clients(10, "abcd")
    for cid in "ab":
        data[cid] = (data[cid][0], data[cid][1].to(torch.uint8))
    data["c"] = (data["c"][0], data["c"][1].to(torch.int32))
    data["d"] = (data["d"][0], data["d"][1] > 0)
    data["e"] = (torch.empty(0, 12), torch.empty(0, dtype=torch.int32))  # no data: its labels are never read
    got, local = batched_and_in_process(data, FitConfig(local_epochs=1, batch_size=4, lr=0.1))
    assert one_per_client(got)
    replies = {r.client_id: r for r in got}
    inprocess = {r.client_id: r for r in local}
    assert_as_in_process(got, inprocess.values(), "abe")
    assert [r.num_examples for r in (replies["e"], inprocess["e"]) if isinstance(r, FitRes)] == [0, 0]
    failure, alone = replies["c"], inprocess["c"]
    assert isinstance(failure, Failure) and isinstance(alone, Failure)
    assert "labels of dtype int32: torch's cross_entropy takes class indices as int64" in failure.reason
    assert "Long" in alone.reason, alone.reason  # torch's own words in process
    failure, alone = replies["d"], inprocess["d"]
    assert isinstance(failure, Failure) and isinstance(alone, Failure)
    assert "labels of dtype bool: torch's cross_entropy takes class indices as int64" in failure.reason
    assert "Bool" in alone.reason, alone.reason


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_a_first_client_whose_inputs_the_model_cannot_take_fails_alone(dtype: torch.dtype) -> None:
    """The batch is sized (batch_clients = 0) from the first client's data, by trying the fused path's check on
    them: inputs of another dtype than the model's weights make that check raise, which fails that client alone, as
    in process, rather than the run. Clients of other input dtypes train in batches of their own: int64 inputs are
    not promoted to float32 and trained, as one batch's concatenation would have done."""
    data = random_clients(13, "abc")
    data["a"] = (data["a"][0].to(dtype), data["a"][1])
    got, inprocess = batched_and_in_process(data, FitConfig(local_epochs=1, batch_size=3, lr=0.1))
    assert [r.client_id for r in inprocess if isinstance(r, Failure)] == ["a"]
    assert [r.client_id for r in got if isinstance(r, Failure)] == ["a"]
    assert_as_in_process(got, inprocess, "bc")


def test_a_model_vmap_cannot_run_is_refused_at_the_first_client_with_usable_data() -> None:
    """The pool's own check of a model (for callers without the harness's check before round 1): a first client
    whose labels fail the plain loss too cannot tell; the next client with usable data refuses the model, rather
    than every client failing in every round."""
    generator = torch.Generator().manual_seed(11)
    data = {
        cid: (torch.randn(4, 12, generator=generator), torch.randint(0, 3, (4,), generator=generator)) for cid in "ab"
    }
    data["a"] = (data["a"][0], data["a"][1] + 100)
    pool = BatchedPool(
        InMemoryPool(
            ["a", "b"],
            lambda cid: SupervisedTask(model_fn=NoisyForward, train_data=data[cid], loss_fn=own_cross_entropy),
        )
    )
    start = from_state_dict(NoisyForward().state_dict())
    config = FitConfig(local_epochs=1, batch_size=2, lr=0.1)
    with pytest.raises(ConfigError, match="random numbers"):
        list(pool.run({cid: FitIns(round=1, parameters=start, config=config, seed=SEED) for cid in "ab"}))


def test_batched_pool_reads_a_clients_data_once_while_the_pool_keeps_its_task() -> None:
    """Over three rounds: the same results as in-process each round, a bad client failing each round, each client's
    data read from its task once while the pool keeps the task, and with a pool bounded to 2 tasks (rebuilt as they
    are dropped), no more than 2 clients' data kept and the same results."""
    generator = torch.Generator().manual_seed(1)
    data = {
        cid: (torch.randn(n, 12, generator=generator), torch.randint(0, 3, (n,), generator=generator))
        for cid, n in (("a", 9), ("b", 5), ("c", 7))
    }
    data["bad"] = (torch.randn(4, 12), torch.zeros(3, dtype=torch.long))
    built: list[str] = []

    def make(cid: str) -> SupervisedTask:
        built.append(cid)
        return SupervisedTask(model_fn=small_mlp, train_data=data[cid])

    torch.manual_seed(3)
    start = from_state_dict(small_mlp().state_dict())
    config = FitConfig(local_epochs=1, batch_size=4, lr=0.1)
    for max_tasks in (None, 2):
        built.clear()
        batched = BatchedPool(InMemoryPool(list(data), make, max_tasks=max_tasks))
        inprocess = InMemoryPool(list(data), lambda cid: SupervisedTask(model_fn=small_mlp, train_data=data[cid]))
        for rnd in (1, 2, 3):
            instructions = {cid: FitIns(round=rnd, parameters=start, config=config, seed=SEED) for cid in data}
            got, want = list(batched.run(instructions)), list(inprocess.run(instructions))
            assert one_per_client(got)
            assert [r.client_id for r in got] == ["a", "b", "c", "bad"]
            assert isinstance(got[3], Failure) and "4 samples but y has 3" in got[3].reason
            for one, other in zip(got[:3], want[:3], strict=True):
                assert isinstance(one, FitRes) and isinstance(other, FitRes)
                for name, value in other.parameters.items():
                    np.testing.assert_allclose(one.parameters[name], value, rtol=1e-5, atol=1e-5)
            assert len(batched._shards) == (4 if max_tasks is None else 2)
        assert built == (list(data) if max_tasks is None else list(data) * 3)


def test_batched_pool_reads_data_that_a_task_gives_anew_or_that_change_shape_in_place() -> None:
    """What a round trains on is what the task gives that round, as in-process: a task whose ``training_data``
    gives other tensors each round, and tensors resized in place between rounds (shrunk, grown, x and y then of
    different lengths: that client fails alone). The pool's kept shard must not hide either."""
    generator = torch.Generator().manual_seed(5)
    current: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @dataclass(frozen=True, kw_only=True, eq=False)
    class Fresh(SupervisedTask):  # gives the client's data of the moment
        client: str = ""

        def training_data(self) -> tuple[torch.Tensor, torch.Tensor]:
            return current[self.client]

    placeholder = (torch.zeros(1, 12), torch.zeros(1, dtype=torch.long))
    fresh = {cid: Fresh(model_fn=small_mlp, train_data=placeholder, client=cid) for cid in "ab"}
    resized = {
        cid: (torch.randn(9, 12, generator=generator), torch.randint(0, 3, (9,), generator=generator)) for cid in "cd"
    }
    tasks = {**fresh, **{cid: SupervisedTask(model_fn=small_mlp, train_data=d) for cid, d in resized.items()}}
    batched = BatchedPool(InMemoryPool(list(tasks), tasks.__getitem__))
    inprocess = InMemoryPool(list(tasks), tasks.__getitem__)
    start = from_state_dict(small_mlp().state_dict())
    config = FitConfig(local_epochs=1, batch_size=4, lr=0.1)
    for rnd, (c_rows, d_rows) in enumerate([(9, 9), (4, 20), (6, 6)], start=1):
        for k, cid in enumerate("ab"):
            n = 3 + rnd + k
            current[cid] = (torch.randn(n, 12, generator=generator), torch.randint(0, 3, (n,), generator=generator))
        resized["c"][0].resize_(c_rows, 12).normal_(generator=generator)
        resized["c"][1].resize_(c_rows).random_(0, 3, generator=generator)
        resized["d"][0].resize_(d_rows, 12).normal_(generator=generator)
        resized["d"][1].resize_(d_rows if rnd < 3 else d_rows - 1).random_(0, 3, generator=generator)
        instructions = {cid: FitIns(round=rnd, parameters=start, config=config, seed=SEED) for cid in tasks}
        got, want = list(batched.run(instructions)), list(inprocess.run(instructions))
        assert one_per_client(got)
        assert [r.client_id for r in got] == list(tasks)
        for one, other in zip(got, want, strict=True):
            assert type(one) is type(other), (rnd, one, other)
            if isinstance(other, Failure):
                assert isinstance(one, Failure) and "6 samples but y has 5" in one.reason
                continue
            assert isinstance(one, FitRes) and isinstance(other, FitRes)
            assert one.num_examples == other.num_examples
            for name, value in other.parameters.items():
                np.testing.assert_allclose(one.parameters[name], value, rtol=1e-5, atol=1e-5)
    assert [r.client_id for r in got if isinstance(r, Failure)] == ["d"]


SMALL = [
    "data.dataset=digits",
    "data.num_clients=8",
    "data.partition=quantity",  # lognormal sizes: every client a different size
    "model.name=2nn",
    "sampling.min_fit_clients=4",
    "sampling.fraction_fit=0.5",
    "train.batch_size=32",
    "train.lr=0.05",
    "train.momentum=0.5",
    "rounds=2",
    "evaluate_every=2",
    "strategy.name=fedavg",
    "output.progress=false",
    "output.plot=false",
]


def test_batched_backend_gives_the_in_process_history(tmp_path: Path) -> None:
    runs = {}
    for backend in ("inprocess", "batched"):
        config = load_recipe(None, [*SMALL, f"output.dir={str(tmp_path / backend)!r}", f"simulation.backend={backend}"])
        runs[backend] = run_simulation(config, echo=lambda _: None)
    inprocess, batched = runs["inprocess"], runs["batched"]
    assert list(batched.history["clients"]) == list(inprocess.history["clients"]) == [0, 4, 4]
    for column in ("train_loss", "test_loss", "test_accuracy"):
        np.testing.assert_allclose(batched.history[column], inprocess.history[column], rtol=1e-5, atol=1e-6)
    for name, value in inprocess.final.parameters.items():
        np.testing.assert_allclose(batched.final.parameters[name], value, rtol=1e-5, atol=1e-5)


def test_batched_backend_refuses_a_strategy_with_client_mods(tmp_path: Path) -> None:
    overrides = [*SMALL, f"output.dir={str(tmp_path)!r}", "simulation.backend=batched", "strategy.name=scaffold"]
    with pytest.raises(ConfigError, match="inprocess"):
        run_simulation(load_recipe(None, overrides), echo=lambda _: None)
    assert not (tmp_path / "history.csv").exists()  # refused before the first round
    overrides = [*SMALL, f"output.dir={str(tmp_path)!r}", "simulation.backend=batched", "train.report_validation=true"]
    with pytest.raises(ConfigError, match="report_validation"):
        run_simulation(load_recipe(None, overrides), echo=lambda _: None)
    overrides = [*SMALL, f"output.dir={str(tmp_path)!r}", "simulation.backend=batched", "strategy.compression=int8"]
    with pytest.raises(ConfigError, match=r"compress, from \[strategy\] compression \(--compression\).*'process'"):
        run_simulation(load_recipe(None, overrides), echo=lambda _: None)


def test_the_first_layer_is_deferred_only_when_asked(tmp_path: Path) -> None:
    """``simulation.defer_first_layer`` reaches the batched clients: a round with it differs from one without in
    the last digits (another float order), both within 1e-5 of in-process training; off by default, and refused
    for another backend."""
    dropped = ("train.momentum", "train.batch_size", "rounds", "evaluate_every")
    plain_sgd = [o for o in SMALL if not o.startswith(dropped)] + ["train.batch_size=8", "rounds=1", "evaluate_every=1"]
    assert load_recipe(None, plain_sgd).simulation.defer_first_layer is False
    with pytest.raises(ConfigError, match=r"defer_first_layer .* add backend = 'batched'"):
        load_recipe(None, [*plain_sgd, "simulation.defer_first_layer=true"])
    finals = {}
    for name, extra in (
        ("inprocess", []),
        ("batched", ["simulation.backend=batched"]),
        ("deferred", ["simulation.backend=batched", "simulation.defer_first_layer=true"]),
    ):
        config = load_recipe(None, [*plain_sgd, *extra, f"output.dir={str(tmp_path / name)!r}"])
        finals[name] = run_simulation(config, echo=lambda _: None).final.parameters
    assert any(not np.array_equal(finals["deferred"][n], finals["batched"][n]) for n in finals["batched"])
    for name in ("batched", "deferred"):
        for tensor, value in finals["inprocess"].items():
            np.testing.assert_allclose(finals[name][tensor], value, rtol=1e-5, atol=1e-5)


def test_defer_first_layer_says_once_when_it_defers_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Asked of a model it cannot apply to (logistic regression: a first layer too narrow to gain; momentum: not
    the fused path), defer_first_layer trains as without it and says so once a run, naming the reason; where it
    applies (the 2NN with plain SGD) the training says it deferred and nothing is logged."""
    dropped = ("train.momentum", "train.batch_size", "rounds", "evaluate_every", "model.name")
    plain_sgd = [o for o in SMALL if not o.startswith(dropped)] + ["train.batch_size=8", "rounds=2", "evaluate_every=2"]
    asked = ["simulation.backend=batched", "simulation.defer_first_layer=true"]
    cases = (
        ("logreg", ["model.name=logreg"], "the first Linear maps 64 inputs to 10 outputs, too narrow at batch size 8"),
        ("momentum", ["model.name=2nn", "train.momentum=0.5"], "the clients train with momentum 0.5, and it needs"),
    )
    for name, extra, why in cases:
        caplog.clear()
        config = load_recipe(None, [*plain_sgd, *asked, *extra, f"output.dir={str(tmp_path / name)!r}"])
        with caplog.at_level("WARNING", logger="fedcore.simulation"):
            run_simulation(config, echo=lambda _: None)
        said = [r.getMessage() for r in caplog.records if "deferred nothing" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith(f"round 1: defer_first_layer deferred nothing: {why}"), said
    caplog.clear()
    config = load_recipe(None, [*plain_sgd, *asked, "model.name=2nn", f"output.dir={str(tmp_path / '2nn')!r}"])
    with caplog.at_level("WARNING", logger="fedcore.simulation"):
        run_simulation(config, echo=lambda _: None)
    assert not any("deferred nothing" in r.getMessage() for r in caplog.records)
    torch.manual_seed(0)
    clients = shards([9, 12, 4], (12,))
    fit = FitConfig(local_epochs=1, batch_size=1, lr=0.05)
    start = wide_first_layer().state_dict()
    assert train_stack(wide_first_layer(), start, clients, fit, seed=SEED, round=ROUND, defer_first_layer=True).deferred
    assert not train_stack(wide_first_layer(), start, clients, fit, seed=SEED, round=ROUND).deferred


def test_backend_is_a_recipe_key_and_a_flag() -> None:
    from fedcore.cli import simulate_options

    flags = {o.flag: o for o in simulate_options()}
    assert flags["--backend"].key == "simulation.backend"
    assert set(flags["--backend"].choices or ()) >= {"inprocess", "batched"}
    assert load_recipe(None, ["simulation.backend=batched"]).simulation.backend == "batched"
    with pytest.raises(ConfigError, match="backend"):
        load_recipe(None, ["simulation.backend=ray-of-light"])


def test_the_fused_path_takes_only_a_plain_perceptron() -> None:
    from simulations.batched import _LinearChain

    sample = torch.randn(2, 1, 28, 28)
    assert _LinearChain.detect(MLP2NN(), sample) is not None  # the 2NN: Flatten, Linear, ReLU, ... in order

    class Residual(nn.Module):  # the same kinds of modules, another forward
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.relu = nn.Linear(784, 784), nn.Linear(784, 10), nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.flatten(x, 1)
            return self.b(self.relu(self.a(h)) + h)

    assert _LinearChain.detect(Residual(), sample) is None
    assert _LinearChain.detect(SmallCNN(), torch.randn(2, 1, 8, 8)) is None


class FrozenFirst(nn.Module):
    """A first layer whose weight does not train (random features), then a trained layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 8)
        self.a.weight.requires_grad_(False)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_frozen_parameters_take_the_global_models_values_as_in_process() -> None:
    """A frozen parameter is not trained, but the forward reads it: batched clients read the round's global value,
    as in process, not the value of the pool's own build of the model (a fresh random draw here)."""
    data = random_clients(14, "abc")

    def task(cid: str) -> SupervisedTask:
        return SupervisedTask(model_fn=FrozenFirst, train_data=data[cid])

    torch.manual_seed(21)
    start = from_state_dict(FrozenFirst().state_dict())
    config = FitConfig(local_epochs=2, batch_size=3, lr=0.1)
    instructions = {cid: FitIns(round=1, parameters=start, config=config, seed=SEED) for cid in data}
    got = list(BatchedPool(InMemoryPool(list(data), task)).run(instructions))
    inprocess = list(InMemoryPool(list(data), task).run(instructions))
    assert_as_in_process(got, inprocess, "abc")
    for reply in got:
        assert isinstance(reply, FitRes)
        np.testing.assert_array_equal(reply.parameters["a.weight"], start["a.weight"])  # not trained
        assert np.abs(reply.parameters["b.weight"] - start["b.weight"]).max() > 1e-3  # trained


def test_the_fused_path_is_checked_once_per_model_of_a_pool_and_at_each_call_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether a model is a plain perceptron is asked once per model and input shape when the caller keeps the
    answers (BatchedPool, whose models it builds itself and never changes), and at every call of train_stack
    otherwise: a caller's model may change between calls (a parameter frozen, a layer skipped by an attribute)."""
    import simulations.batched as batched

    checks: list[int] = []
    detect = batched._LinearChain.detect

    def counted(model: nn.Module, sample: torch.Tensor) -> batched._LinearChain | None:
        checks.append(len(sample))
        return detect(model, sample)

    monkeypatch.setattr(batched._LinearChain, "detect", staticmethod(counted))
    model = small_mlp()
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    config = FitConfig(local_epochs=1, batch_size=4, lr=0.1)
    clients = shards([5, 3], (12,))
    kept: dict = {}
    for _ in range(3):
        train_stack(model, start, clients, config, seed=SEED, round=ROUND, fused_checks=kept)
    assert checks == [2]
    for _ in range(2):
        train_stack(model, start, clients, config, seed=SEED, round=ROUND)
    assert checks == [2, 2, 2]
    model.net[1].bias.requires_grad_(False)  # now a frozen parameter: the general path, not a stale fused answer
    frozen = train_stack(model, start, clients, config, seed=SEED, round=ROUND).updates()
    assert all(torch.equal(u.parameters["net.1.bias"], start["net.1.bias"]) for u in frozen)
    checks.clear()
    data = {cid: (torch.randn(6, 12), torch.randint(0, 3, (6,))) for cid in "abc"}
    pool = BatchedPool(InMemoryPool(list(data), lambda cid: SupervisedTask(model_fn=small_mlp, train_data=data[cid])))
    for rnd in (1, 2, 3):
        list(
            pool.run(
                {
                    cid: FitIns(
                        round=rnd, parameters=from_state_dict(small_mlp().state_dict()), config=config, seed=SEED
                    )
                    for cid in data
                }
            )
        )
    assert len(checks) == 1


def test_a_model_that_is_one_linear_layer_trains_on_the_fused_path() -> None:
    """The fused path names a model's Linear weights by their module's name; a model that is itself the Linear has
    them at the top ("weight", "bias"), which once raised KeyError('.weight')."""
    torch.manual_seed(0)
    model = nn.Linear(12, 3)
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    config = FitConfig(local_epochs=1, batch_size=4, lr=0.1)
    clients = shards([5, 3], (12,))
    together = train_stack(model, start, clients, config, seed=SEED, round=ROUND).updates()
    alone = one_by_one(lambda: nn.Linear(12, 3), clients, config, start)
    for got, (want, _) in zip(together, alone, strict=True):
        for name in ("weight", "bias"):
            torch.testing.assert_close(got.parameters[name], want[name], rtol=1e-5, atol=1e-6)


def test_a_module_held_under_two_names_is_refused() -> None:
    """functional_call on a module registered twice (``self.b = self.a``) leaves a batched tensor in it, which broke
    the cached model's next use; tied parameters (``b.weight = a.weight``) are trained."""

    class SharedModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(12, 12)
            self.b = self.a
            self.head = nn.Linear(12, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.b(torch.relu(self.a(x)))))

    class TiedWeight(SharedModule):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Linear(12, 12)
            self.b.weight = self.a.weight

    data = (torch.randn(8, 12), torch.randint(0, 3, (8,)))
    with pytest.raises(ConfigError, match="one module under several names \\('a' and 'b'\\)"):
        check_batchable(SupervisedTask(model_fn=SharedModule, train_data=data))
    check_batchable(SupervisedTask(model_fn=TiedWeight, train_data=data))


@pytest.mark.parametrize(
    "config",
    [
        FitConfig(local_epochs=2, batch_size=4, lr=0.1),  # the fused path (plain SGD on an MLP)
        FitConfig(local_epochs=2, batch_size=4, lr=0.05, momentum=0.9, mu=0.5),  # vmap, momentum buffers
    ],
)
def test_reused_buffers_train_the_same_bits_and_results_outlive_them(config: FitConfig) -> None:
    """Batches trained one after another in one StackBuffers (a larger batch after a smaller one, and a smaller one
    after it) equal batches trained in fresh memory bit for bit, and the updates taken from a batch keep their
    values when the next batch reuses its memory."""
    from simulations.batched import StackBuffers

    torch.manual_seed(2)
    start = small_mlp().state_dict()
    batches = [shards(sizes, (12,)) for sizes in ([5, 9], [23, 0, 7, 10, 3], [4])]
    for batch, offset in zip(batches, (0, 10, 20), strict=True):  # distinct client ids: distinct shuffles
        batch[:] = [ClientShard(f"client-{offset + i}", s.x, s.y) for i, s in enumerate(batch)]
    fresh = [train_stack(small_mlp(), start, batch, config, seed=SEED, round=ROUND).updates() for batch in batches]
    buffers = StackBuffers()
    kept = []
    for batch in batches:
        trained = train_stack(small_mlp(), start, batch, config, seed=SEED, round=ROUND, buffers=buffers)
        assert trained.borrowed
        kept.append(trained.updates())
    held = buffers.nbytes()
    assert held > 0
    for got_batch, want_batch in zip(kept, fresh, strict=True):  # checked after every batch has been trained
        for got, want in zip(got_batch, want_batch, strict=True):
            assert got.metrics == want.metrics
            for name, value in want.parameters.items():
                assert torch.equal(got.parameters[name], value), name
    # the largest batch's memory is kept, not one buffer per batch: training the first batch again adds nothing
    train_stack(small_mlp(), start, batches[0], config, seed=SEED, round=ROUND, buffers=buffers)
    assert buffers.nbytes() == held


@pytest.mark.parametrize(
    "config",
    [
        FitConfig(local_epochs=2, batch_size=4, lr=0.1),  # the fused path
        FitConfig(local_epochs=2, batch_size=4, lr=0.05, momentum=0.9, mu=0.5),  # vmap
    ],
)
def test_clients_viewing_one_storage_train_without_a_copy_and_the_same_bits(config: FitConfig) -> None:
    """Clients whose data are runs of rows of one tensor (PreparedData.shard's views), listed out of storage order,
    one of them empty and a row belonging to no client between two, train to the same bits as copies of their data,
    and the buffers then hold no copy of the data; data that cannot be read in place (x views, y copies; strided
    views) are concatenated, to the same bits."""
    from simulations.batched import StackBuffers

    torch.manual_seed(4)
    start = small_mlp().state_dict()
    x_rows, y_rows = torch.randn(60, 12), torch.randint(0, 3, (60,))
    spans = [(30, 53), (0, 0), (53, 60), (0, 10), (11, 14), (14, 30)]  # row 10 belongs to no client
    views = [ClientShard(f"client-{i}", x_rows[a:b], y_rows[a:b]) for i, (a, b) in enumerate(spans)]
    copies = [ClientShard(s.client_id, s.x.clone(), s.y.clone()) for s in views]
    mixed = [ClientShard(s.client_id, s.x, s.y.clone()) for s in views]
    wide = torch.randn(60, 24)
    strided = [ClientShard(s.client_id, wide[a:b, ::2], s.y) for s, (a, b) in zip(views, spans, strict=True)]
    for s, (a, b) in zip(strided, spans, strict=True):
        s.x.copy_(x_rows[a:b])  # the same values in a layout that is not row-contiguous
    expected = train_stack(small_mlp(), start, copies, config, seed=SEED, round=ROUND).updates()
    copied = StackBuffers()
    train_stack(small_mlp(), start, copies, config, seed=SEED, round=ROUND, buffers=copied)
    for clients in (views, mixed, strided):
        buffers = StackBuffers()
        got = train_stack(small_mlp(), start, clients, config, seed=SEED, round=ROUND, buffers=buffers).updates()
        for update, want in zip(got, expected, strict=True):
            assert update.metrics == want.metrics
            for name, value in want.parameters.items():
                assert torch.equal(update.parameters[name], value), name
        if clients is views:  # the clients' 59 rows were not copied together: 59 x 12 float32s, 59 int64s
            assert copied.nbytes() - buffers.nbytes() == 59 * 12 * 4 + 59 * 8
        else:
            assert buffers.nbytes() == copied.nbytes()


def test_train_loss_sums_the_last_epoch_begun_as_the_loop_does() -> None:
    """``train_loss`` of a batch, by hand: the loss of each step of a client's last epoch begun, times that step's
    batch size, over the samples seen in it; a step outside that epoch (even an infinite loss) does not count."""
    from simulations.batched import TrainedClients, _schedule

    config = FitConfig(local_epochs=2, batch_size=4, lr=0.1, max_steps=5)
    sizes = [10, 6, 0]  # batches an epoch: 3 (4, 4, 2) and 2 (4, 2); 5 steps and 4 steps; none
    plans = [_schedule(n, config) for n in sizes]
    assert plans == [(3, 5), (2, 4), (0, 0)]
    losses = torch.tensor(
        [
            [float("inf"), 9.0, 9.0, 0.5, 0.25],  # last epoch begun: steps 3 and 4 (batches of 4 and 4)
            [9.0, 9.0, 0.75, 1.5, 0.0],  # steps 2 and 3 (batches of 4 and 2); step 4 is past its 4 steps
            [0.0] * 5,
        ],
        dtype=torch.float32,
    )
    trained = TrainedClients(
        clients=[
            ClientShard(f"c{i}", torch.zeros(n, 1), torch.zeros(n, dtype=torch.long)) for i, n in enumerate(sizes)
        ],
        order=[2, 0, 1],  # rows in another order than the clients: row r is client order[r]
        params={},
        global_parameters={},
        canonical={},
        losses=losses[[2, 0, 1]],
        sizes=[sizes[2], sizes[0], sizes[1]],
        plans=[plans[2], plans[0], plans[1]],
        config=config,
    )
    assert trained.metrics() == [
        {"train_loss": (0.5 * 4 + 0.25 * 4) / 8},
        {"train_loss": (0.75 * 4 + 1.5 * 2) / 6},
        {},
    ]


def test_train_stack_refuses_unusable_data_with_the_reason() -> None:
    """What batched clients cannot train raises a ClientTaskError that says what is wrong, with or without reused
    buffers; inputs that require grad (outside what buffers take) still train, to the same bits."""
    from fedcore.errors import ClientTaskError
    from simulations.batched import StackBuffers

    start = small_mlp().state_dict()
    config = FitConfig(local_epochs=1, batch_size=4, lr=0.1, momentum=0.5)
    good = shards([6, 5], (12,))
    cases = {
        "x is a 0-dim tensor": [*good, ClientShard("c", torch.tensor(1.0), torch.tensor(0))],
        "x has 4 samples but y has 3": [*good, ClientShard("c", torch.randn(4, 12), torch.zeros(3, dtype=torch.long))],
        "differ in shape per sample \\(\\(11,\\), \\(12,\\)\\)": [
            *good,
            ClientShard("c", torch.randn(4, 11), torch.zeros(4, dtype=torch.long)),
        ],
    }
    for reason, clients in cases.items():
        for buffers in (None, StackBuffers()):
            with pytest.raises(ClientTaskError, match=reason):
                train_stack(small_mlp(), start, clients, config, seed=SEED, round=ROUND, buffers=buffers)
    tracked = [ClientShard(s.client_id, s.x.clone().requires_grad_(True), s.y) for s in good]
    fused = FitConfig(local_epochs=2, batch_size=2, lr=0.1)  # plain SGD: the fused path, its first layer deferred
    for model_fn, fit in ((small_mlp, config), (wide_first_layer_with_bias, fused)):
        start = model_fn().state_dict()
        plain = train_stack(model_fn(), start, good, fit, seed=SEED, round=ROUND, defer_first_layer=True).updates()
        got = train_stack(
            model_fn(), start, tracked, fit, seed=SEED, round=ROUND, buffers=StackBuffers(), defer_first_layer=True
        ).updates()
        for a, b in zip(got, plain, strict=True):
            for name, value in b.parameters.items():
                assert torch.equal(a.parameters[name].detach(), value), name


def test_a_clients_infinite_sample_stays_in_its_own_model() -> None:
    """The largest client's first sample is the concatenated data's row 0, which the batch index pads partial
    batches with: an infinite value there must not reach the other clients' deferred first layers (0 * inf).
    One wide Linear layer: its outputs on that row are infinite but not NaN, so the fused path still takes it."""

    def wide_linear() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(12, 64))

    sizes = [12, 6, 5]  # batch 4: the 6- and 5-sample clients have partial batches, and finish before the first
    clients = shards(sizes, (12,))
    clients[0].x[0, 3] = float("inf")
    config = FitConfig(local_epochs=1, batch_size=4, lr=0.1)
    torch.manual_seed(4)
    start = wide_linear().state_dict()
    trained = train_stack(wide_linear(), start, clients, config, seed=SEED, round=ROUND, defer_first_layer=True)
    updates = trained.updates()
    expected = one_by_one(wide_linear, clients, config, start)
    assert not all(bool(torch.isfinite(t).all()) for t in expected[0][0].values())  # it diverges alone too
    for update, (state, _) in list(zip(updates, expected, strict=True))[1:]:
        for name, value in state.items():
            assert torch.isfinite(update.parameters[name]).all(), name
            torch.testing.assert_close(update.parameters[name], value, rtol=1e-5, atol=1e-5)


def test_the_first_layer_is_deferred_only_where_it_saves_work() -> None:
    from simulations.batched import _LinearChain

    def window(model: nn.Module, batch_size: int, features: int = 12) -> int:
        chain = _LinearChain.detect(model, torch.randn(2, features))
        assert chain is not None
        stacked = {n: p.detach().unsqueeze(0) for n, p in model.named_parameters()}
        return chain.deferral(stacked, batch_size)

    # 12 x 64 / ((2 x 12 + 64) x 4) = 2.2: windows of 2 steps; of 1 sample, 8 steps (8 x 1 < 64 rows)
    assert window(wide_first_layer(), 4) == 2
    assert window(wide_first_layer_with_bias(), 1) == 8
    assert window(wide_first_layer(), 8) == 0  # one step's worth: nothing to gain
    assert window(small_mlp(), 4) == 0  # 12 -> 8: the Gram matrix would cost more than it saves
    assert window(MLP2NN(), 10, 784) == 6  # the 2NN, B=10: 8.9 steps worth it, 64 rows cap it at 6 (E=1 in one window)
    assert window(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), 10, 784) == 0  # logistic regression


def test_the_cpu_batch_size_follows_what_a_step_allocates() -> None:
    """batch_clients = 0 on the CPU: the fused path (plain SGD on a perceptron, no stacked gradients) trains as many
    2NNs together as fit 128 MiB of stacked models; the vmap path (here with momentum) as many as keep the largest
    stacked parameter, and so its gradient, within 16 MiB."""
    data = (torch.randn(20, 1, 28, 28), torch.randint(0, 10, (20,)))
    ids = [f"c{i}" for i in range(1000)]
    pool = BatchedPool(InMemoryPool(ids, lambda _: SupervisedTask(model_fn=MLP2NN, train_data=data)))
    model_bytes = sum(p.numel() * 4 for p in MLP2NN().parameters())  # 199,210 float32 parameters
    largest = 200 * 784 * 4  # the first layer's weight
    plain = FitConfig(local_epochs=1, batch_size=10, lr=0.05)
    assert pool._auto_batch("c0", 1000, plain) == (128 << 20) // model_bytes == 168
    assert pool._auto_batch("c0", 100, plain) == 100  # a round of issue 12's workload: one batch
    assert pool._auto_batch("c0", 1000, replace(plain, momentum=0.9)) == (16 << 20) // largest == 26


def test_clients_built_on_demand_are_batched_no_more_than_the_pool_keeps_built() -> None:
    """With max_tasks (clients built when sampled, e.g. 100,000 synthetic devices), batch_clients = 0 takes at most
    max_tasks clients a batch, so that a batch's tasks and data stay bounded; an explicit batch_clients is kept."""
    from tests.simulations.test_presum import fedavg

    data = (torch.randn(6, 12), torch.randint(0, 3, (6,)))
    ids = [f"c{i}" for i in range(7)]
    config = FitConfig(local_epochs=1, batch_size=3, lr=0.05)
    start = from_state_dict(small_mlp().state_dict())
    instructions = {cid: FitIns(round=1, parameters=start, config=config, seed=SEED) for cid in ids}
    for batch_clients, sizes in ((0, [3, 3, 1]), (5, [5, 2])):
        inner = InMemoryPool(ids, lambda _: SupervisedTask(model_fn=small_mlp, train_data=data), max_tasks=3)
        pool = BatchedPool(inner, batch_clients=batch_clients, weigh=presum_weight(fedavg()))
        assert pool._auto_batch("c0", 7, config) == 7  # the model alone would take them all
        replies = list(pool.run(instructions))
        assert [len(r.client_ids) for r in replies if isinstance(r, FitBatchRes)] == sizes


def test_views_and_copies_agree_on_odd_storages() -> None:
    """Read in place or copied together, the clients train to the same bits when a NaN sits in a storage row no
    client owns (the fused path is checked on the clients' own first samples, not the storage's) or in the largest
    client's first sample (a NaN output is the model's too), and when two storages begin at one address (numpy views
    of one buffer: read as one only when they are one)."""
    torch.manual_seed(5)
    start = small_mlp().state_dict()
    config = FitConfig(local_epochs=1, batch_size=4, lr=0.1)

    def same(views: list[ClientShard]) -> None:
        copies = [ClientShard(s.client_id, s.x.clone(), s.y.clone()) for s in views]
        got = train_stack(small_mlp(), start, views, config, seed=SEED, round=ROUND).updates()
        want = train_stack(small_mlp(), start, copies, config, seed=SEED, round=ROUND).updates()
        for update, expected in zip(got, want, strict=True):
            assert update.metrics.keys() == expected.metrics.keys()
            for name, value in expected.parameters.items():
                torch.testing.assert_close(update.parameters[name], value, rtol=0, atol=0, equal_nan=True)

    x_rows, y_rows = torch.randn(30, 12), torch.randint(0, 3, (30,))
    x_rows[0] = float("nan")  # owned by no client
    same([ClientShard("a", x_rows[1:16], y_rows[1:16]), ClientShard("b", x_rows[16:30], y_rows[16:30])])
    x_rows[1] = float("nan")  # the largest client's first sample
    same([ClientShard("a", x_rows[1:16], y_rows[1:16]), ClientShard("b", x_rows[16:30], y_rows[16:30])])
    buffer = np.random.default_rng(0).standard_normal((60, 12)).astype(np.float32)
    labels = np.random.default_rng(1).integers(0, 3, 60)
    first = ClientShard("a", torch.from_numpy(buffer[:30]), torch.from_numpy(labels[:30]))  # a 30-row storage
    later = ClientShard("b", torch.from_numpy(buffer)[40:50], torch.from_numpy(labels)[40:50])  # same address, 60
    assert first.x.untyped_storage().data_ptr() == later.x.untyped_storage().data_ptr()
    same([first, later])


def test_a_bfloat16_batch_sums_its_updates() -> None:
    """A stack of a dtype the CPU kernels do not take (bfloat16, which numpy has no dtype for) is summed by the
    matrix-vector path; that once raised TypeError asking numpy for a 'bfloat16' dtype."""
    torch.manual_seed(1)
    model = small_mlp().to(torch.bfloat16)
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    clients = [ClientShard(s.client_id, s.x.to(torch.bfloat16), s.y) for s in shards([6, 4], (12,))]
    trained = train_stack(
        model, start, clients, FitConfig(local_epochs=1, batch_size=4, lr=0.1), seed=SEED, round=ROUND
    )
    total = trained.weighted_sum([1.0, 2.5])
    updates = trained.updates()
    for name, value in total.items():
        want = sum(w * updates[k].parameters[name].double() for k, w in enumerate([1.0, 2.5]))
        assert isinstance(want, torch.Tensor)
        assert value.dtype == np.float64
        np.testing.assert_allclose(value, want.numpy(), rtol=1e-12, atol=0)


def test_what_the_pool_keeps_of_each_clients_data_leaves_the_round_end_collection_alone() -> None:
    """The read of a client's data that BatchedPool keeps between rounds (ClientShard.read, the fingerprint it is
    checked by) is plain tuples of numbers, dtypes and devices, which the garbage collector stops tracking after a
    few of the collections rounds end with: a pool of 1,000 clients does not make each of them walk thousands more
    objects (torch.Size, a tuple subclass, would stay tracked)."""
    import gc

    from simulations.batched import _fingerprint, read_shard

    x, y = torch.randn(40, 3, 2), torch.zeros(40, dtype=torch.long)
    kept = [read_shard(x[a : a + 10], y[a : a + 10]) for a in (0, 10, 20)]
    prints = [_fingerprint(x[a : a + 10], y[a : a + 10]) for a in (0, 10, 20)]
    for _ in range(4):  # a tuple is let go once its elements are: one nesting level a collection (a round's end)
        gc.collect()
    assert not any(gc.is_tracked(read) for read in kept) and not any(gc.is_tracked(p) for p in prints)
    assert kept[1][:3] == (None, 10, (3, 2)) and kept[1][3] is not None and kept[1][3][1] == 10


@pytest.mark.parametrize("chunk_bytes", [1, 2_500, 7_000])
def test_the_fused_path_in_cache_sized_chunks_gives_the_bits_of_one_chunk(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    """On the CPU the fused path takes the clients a chunk at a time through all their steps (FUSED_CHUNK_BYTES):
    clients of unequal sizes (chunks that end after different step counts, an empty client, E=2 and a step cap
    mid-epoch) train to the very bits of one chunk, and their losses too; and within 1e-5 of one by one."""
    import simulations.batched as batched

    config = FitConfig(local_epochs=2, batch_size=4, lr=0.1, max_steps=7)
    clients = shards([23, 0, 7, 10, 3, 23, 16, 1, 9], (12,))
    torch.manual_seed(4)
    start = {n: t.detach().clone() for n, t in small_mlp().state_dict().items()}
    whole = train_stack(small_mlp(), start, clients, config, seed=SEED, round=ROUND, buffers=StackBuffers())
    want = [u.parameters for u in whole.updates()]
    want_loss = whole.train_loss()
    monkeypatch.setattr(batched, "FUSED_CHUNK_BYTES", chunk_bytes)  # 1, 2 and 6 clients a chunk
    chunked = train_stack(small_mlp(), start, clients, config, seed=SEED, round=ROUND, buffers=StackBuffers())
    assert np.array_equal(chunked.train_loss(), want_loss, equal_nan=True)
    for got, expected in zip(chunked.updates(), want, strict=True):
        for name, value in expected.items():
            assert torch.equal(got.parameters[name], value), name
    for got, (alone, _) in zip(chunked.updates(), one_by_one(small_mlp, clients, config, start), strict=True):
        for name, value in alone.items():
            torch.testing.assert_close(got.parameters[name], value, rtol=1e-5, atol=1e-6)


def test_step_runs_are_each_steps_runs_of_one_batch_size_up_to_the_first_idle_step() -> None:
    # four clients sorted largest first (25, 23, 13, 7 samples at B=10, one epoch): their batch size at each step
    table = np.array([[10, 10, 5, 0], [10, 10, 3, 0], [10, 3, 0, 0], [7, 0, 0, 0]], dtype=np.int64)
    assert _step_runs(table) == [
        [(0, 3, 10), (3, 4, 7)],
        [(0, 2, 10), (2, 3, 3)],
        [(0, 1, 5), (1, 2, 3)],
    ]  # step 3 trains no client: the runs end there
    assert _step_runs(table[:1]) == [[(0, 1, 10)], [(0, 1, 10)], [(0, 1, 5)]]
    assert _step_runs(np.zeros((3, 2), dtype=np.int64)) == []
    assert _step_runs(np.zeros((0, 4), dtype=np.int64)) == []
