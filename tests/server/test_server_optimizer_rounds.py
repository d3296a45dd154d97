"""Rounds of FedAvgM and FedAdam through the in-memory pool against a hand-run chain of the server equations.

The model holds BatchNorm (the issue's Linear(8,16)-BatchNorm1d(16)-ReLU-Linear(16,3), clients of 100 and 300
examples), so the chain also checks that buffers take the example-weighted average while only trainable
parameters are stepped. Every round is compared, so a loop that applied the plain average in some rounds, skipped
the optimizer state, or stepped the running statistics fails by value.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client.runner import run_instruction
from fedcore.messages import FitIns, FitRes
from fedcore.strategy import SamplingConfig, Strategy, StrategyConfig, build_strategy
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, TaskContext, central_evaluation, initial_parameters, trainable_names
from fedcore.tensors import NamedArrays
from server.round_loop import RoundConfig, RoundRecord, ServerState, initial_state, run_rounds
from simulations.config import load_recipe
from simulations.harness import run_simulation
from simulations.inmemory import InMemoryPool

SIZES = {"c0": 100, "c1": 300}
SEED = 4
FIT = FitConfig(local_epochs=1, batch_size=32, lr=0.05)


def bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def client_data(cid: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A 3-class problem; the two clients' inputs have different scales (non-IID statistics), both small enough
    that the clients' running variances fall below the initial 1, as in the issue."""
    n, k = SIZES[cid], int(cid[1:])
    g = torch.Generator().manual_seed(100 + k)
    x = torch.randn(n, 8, generator=g) * (0.5 + 0.5 * k)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x, y


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(client_data(c) for c in SIZES), strict=True)
    return torch.cat(xs)[::3], torch.cat(ys)[::3]


def make_task(cid: str) -> SupervisedTask:
    return SupervisedTask(model_fn=bn_model, train_data=client_data(cid))


def strategy_for(name: str, server_lr: float | None = None) -> Strategy:
    if name == "fedavgm":
        config = StrategyConfig(name="fedavgm", server_momentum=0.9, server_lr=server_lr)
    else:
        config = StrategyConfig(name=name, server_lr=server_lr)
    return build_strategy(config, FIT, SamplingConfig(fraction_fit=1.0, min_fit_clients=2))


def hand_average(parameters: NamedArrays, rnd: int) -> NamedArrays:
    """Each client trained by hand from ``parameters``; their example-weighted mean, as float64 sums."""
    ins = FitIns(round=rnd, parameters=parameters, config=FIT, seed=SEED)
    updates = {cid: run_instruction(make_task(cid), ins, cid) for cid in SIZES}
    total = sum(SIZES.values())
    out: NamedArrays = {}
    for name, x in parameters.items():
        acc = np.zeros(x.shape, np.float64)
        for cid, res in updates.items():
            assert isinstance(res, FitRes)
            acc = acc + SIZES[cid] * res.parameters[name].astype(np.float64)
        mean = acc / total
        out[name] = (np.rint(mean) if x.dtype.kind == "i" else mean).astype(x.dtype)
    return out


def hand_chain(name: str, rounds: int) -> list[NamedArrays]:
    """The global model after each round, from the equations of Hsu et al. 2019 (FedAvgM: v ← βv + Δ, x ← x + ηv)
    and Reddi et al. 2021 (FedAdam: m ← β1 m + (1−β1)Δ, v ← β2 v + (1−β2)Δ², x ← x + η m/(√v + τ), v0 = τ²), with
    Δ = average − x, for the trainable parameters; buffers take the average. State kept in float32 like the
    parameters."""
    trainable = trainable_names(bn_model)
    assert trainable is not None and "1.running_var" not in trainable and "1.weight" in trainable
    x = initial_parameters(bn_model, SEED)
    m = {n: np.zeros_like(a) for n, a in x.items() if n in trainable}
    v = {
        n: (np.full_like(a, 1e-3**2) if name == "fedadam" else np.zeros_like(a)) for n, a in x.items() if n in trainable
    }
    chain = []
    for rnd in range(1, rounds + 1):
        average = hand_average(x, rnd)
        new: NamedArrays = {}
        for n, a in x.items():
            if n not in trainable:
                new[n] = average[n]
                continue
            a64 = a.astype(np.float64)
            delta = average[n].astype(np.float64) - a64
            if name == "fedavgm":
                v64 = 0.9 * v[n].astype(np.float64) + delta
                new[n] = (a64 + 1.0 * v64).astype(a.dtype)
                v[n] = v64.astype(a.dtype)
            else:
                m64 = 0.9 * m[n].astype(np.float64) + 0.1 * delta
                v64 = 0.99 * v[n].astype(np.float64) + 0.01 * delta * delta
                new[n] = (a64 + 0.01 * m64 / (np.sqrt(v64) + 1e-3)).astype(a.dtype)  # FedAdam's default eta
                m[n], v[n] = m64.astype(a.dtype), v64.astype(a.dtype)
        x = new
        chain.append(x)
    return chain


def run_loop(
    name: str, rounds: int, trainable: frozenset[str] | None, server_lr: float | None = None
) -> tuple[list[NamedArrays], list[RoundRecord]]:
    strategy = strategy_for(name, server_lr)
    seen: list[NamedArrays] = []

    def keep(record: RoundRecord, state: ServerState) -> None:
        seen.append({n: a.copy() for n, a in state.parameters.items()})

    start = initial_state(initial_parameters(bn_model, SEED), strategy, trainable=trainable)
    evaluate_fn = central_evaluation(SupervisedTask(model_fn=bn_model, test_data=held_out()), 64)
    _, records = run_rounds(
        InMemoryPool(list(SIZES), make_task),
        strategy,
        start,
        RoundConfig(num_rounds=rounds, seed=SEED),
        evaluate_fn=evaluate_fn,
        on_round_end=keep,
    )
    return seen[1:], records[1:]  # round 0: the initial model's evaluation


@pytest.mark.parametrize("name", ["fedavgm", "fedadam"])
def test_three_rounds_equal_the_hand_run_chain(name: str) -> None:
    got, records = run_loop(name, 3, trainable_names(bn_model))
    want = hand_chain(name, 3)
    for rnd, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        for n in w:
            np.testing.assert_allclose(g[n], w[n], rtol=1e-5, atol=1e-6, err_msg=f"round {rnd} {n}")
        # the clients add ceil(100/32) = 4 and ceil(300/32) = 10 batches: t + (100·4 + 300·10)/400 = t + 8.5, which
        # rounds to even: 8, 16, 24
        assert int(g["1.num_batches_tracked"]) == 8 * rnd
    for record in records:
        assert record.eval_loss is not None and math.isfinite(record.eval_loss)


def test_fedadam_at_server_lr_1_keeps_running_var_positive_and_the_loss_finite() -> None:
    # the case (at 1.0, the default then): every floating tensor was stepped and running_var went negative
    # in round 2
    got, records = run_loop("fedadam", 3, trainable_names(bn_model), server_lr=1.0)
    for rnd, (params, record) in enumerate(zip(got, records, strict=True), start=1):
        assert (params["1.running_var"] > 0).all(), rnd
        assert record.eval_loss is not None and math.isfinite(record.eval_loss), rnd
    # and this is what stepping the buffers did (trainable=None: every floating tensor through Adam)
    stepped, stepped_records = run_loop("fedadam", 2, None, server_lr=1.0)
    assert (stepped[1]["1.running_var"] < 0).any()
    assert stepped_records[1].eval_loss is not None and math.isnan(stepped_records[1].eval_loss)


def bn_task(ctx: TaskContext) -> SupervisedTask:
    """The issue's setup as a user's task factory: two clients of 100 and 300 examples, a server test split."""
    if ctx.role == "server":
        return SupervisedTask(model_fn=bn_model, test_data=held_out())
    return make_task(f"c{ctx.partition_id}")


def test_the_simulation_tells_buffers_from_trainable_parameters(tmp_path: Path) -> None:
    config = load_recipe(
        None,
        [
            f"task.factory='{__name__}:bn_task'",
            "data.num_clients=2",
            "sampling.min_fit_clients=2",
            "sampling.fraction_fit=1.0",
            "strategy.name='fedadam'",
            "train.batch_size=32",
            "train.lr=0.05",
            "rounds=3",
            "evaluate_every=1",
            f"seed={SEED}",
            "output.progress=false",
            "output.plot=false",
            f"output.dir={str(tmp_path)!r}",
        ],
    )
    result = run_simulation(config, echo=lambda _: None)
    assert not result.diverged
    assert (result.final.parameters["1.running_var"] > 0).all()
    assert result.history["test_loss"].notna().all()


def test_resuming_from_mapped_checkpoints_keeps_stepping_trainable_parameters_only(tmp_path: Path) -> None:
    # a deployment continues each round from the checkpoint it wrote, which does not hold the trainable names
    from server.state import StateStore, load_checkpoint

    strategy = strategy_for("fedadam")
    start = initial_state(initial_parameters(bn_model, SEED), strategy, trainable=trainable_names(bn_model))
    config = RoundConfig(num_rounds=3, seed=SEED)
    reference, _ = run_rounds(InMemoryPool(list(SIZES), make_task), strategy, start, config)
    store = StateStore(tmp_path / "state")

    def from_checkpoint(record: RoundRecord, state: ServerState) -> ServerState:
        return load_checkpoint(store.save_checkpoint(state), mapped=True)

    final, _ = run_rounds(InMemoryPool(list(SIZES), make_task), strategy, start, config, on_round_end=from_checkpoint)
    store.close()
    assert final.trainable == start.trainable
    for name, array in reference.parameters.items():
        assert np.array_equal(final.parameters[name], array), name
