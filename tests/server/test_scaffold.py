"""SCAFFOLD end to end in process: equal to a hand-written SCAFFOLD in plain torch on the same batches, and its
control variates survive a checkpoint (server) and the client state files (clients)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client.state import ClientStateStore
from fedcore.aggregation import MedianAggregator
from fedcore.algorithms.scaffold import CONTROL, ControlRule, scaffold
from fedcore.errors import ConfigError
from fedcore.messages import FitRes, PoolReply, ServerMessage
from fedcore.strategy import SamplingConfig, StrategyConfig, build_strategy, sample_clients
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig, initial_parameters, trainable_names
from server.pool import ClientPool, PoolWrapper
from server.round_loop import RoundConfig, ServerState, initial_state, run_rounds
from server.state import StateStore, load_checkpoint
from simulations.attacks import AttackConfig, AttackedPool
from simulations.inmemory import InMemoryPool

IDS = ["a", "b", "c"]
SEED = 3
K = 4  # local steps: full-batch epochs, so every step sees the same batch in both implementations
LR = 0.1
ETA_G = 0.7
FIT = FitConfig(local_epochs=K, batch_size=64, lr=LR)
SAMPLING = SamplingConfig(fraction_fit=0.5, min_fit_clients=2)  # 2 of 3 clients a round: |S| / N = 2/3


def model_fn() -> nn.Linear:
    return nn.Linear(4, 3)


def client_data(cid: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(IDS.index(cid) + 10)
    x = torch.randn(12, 4, generator=g) + IDS.index(cid)  # shifted features: the clients disagree
    y = torch.randint(0, 3, (12,), generator=g)
    return x, y


def make_task(cid: str) -> SupervisedTask:
    return SupervisedTask(model_fn=model_fn, train_data=client_data(cid))


def run(tmp: Path, rounds: int, start: ServerState | None = None) -> tuple[ServerState, ClientStateStore]:
    strategy = scaffold(fit=FIT, sampling=SAMPLING, server_lr=ETA_G)
    store = ClientStateStore(tmp / "clients")
    pool = InMemoryPool(IDS, make_task, state=store)
    if start is None:
        params = initial_parameters(model_fn, SEED)
        start = initial_state(params, strategy, trainable=trainable_names(model_fn))
    final, _ = run_rounds(pool, strategy, start, RoundConfig(num_rounds=rounds, seed=SEED))
    return final, store


def reference(
    rounds: int,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Algorithm 1 of Karimireddy et al. 2020 (option II), written out in plain torch."""
    x = {n: torch.from_numpy(a.copy()) for n, a in initial_parameters(model_fn, SEED).items()}
    c = {n: torch.zeros_like(t) for n, t in x.items()}
    c_i = {cid: {n: torch.zeros_like(t) for n, t in x.items()} for cid in IDS}
    model = model_fn()
    for rnd in range(1, rounds + 1):
        chosen = sample_clients(IDS, 2, seed=SEED, round=rnd)
        delta_y, delta_c = [], []
        for cid in chosen:
            inputs, targets = client_data(cid)
            y = {n: t.clone() for n, t in x.items()}
            for _ in range(K):
                with torch.no_grad():
                    model.weight.copy_(y["weight"])
                    model.bias.copy_(y["bias"])
                model.zero_grad()
                nn.functional.cross_entropy(model(inputs), targets).backward()
                assert model.weight.grad is not None and model.bias.grad is not None
                grads = {"weight": model.weight.grad, "bias": model.bias.grad}
                y = {n: y[n] - LR * (grads[n] + c[n] - c_i[cid][n]) for n in y}
            new = {n: c_i[cid][n] - c[n] + (x[n] - y[n]) / (K * LR) for n in x}
            delta_y.append({n: y[n] - x[n] for n in x})
            delta_c.append({n: new[n] - c_i[cid][n] for n in x})
            c_i[cid] = new
        x = {n: x[n] + ETA_G * sum(d[n] for d in delta_y) / len(chosen) for n in x}
        c = {n: c[n] + len(chosen) / len(IDS) * sum(d[n] for d in delta_c) / len(chosen) for n in x}
    return x, c, c_i


def assert_close(got: dict[str, np.ndarray], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(torch.from_numpy(np.array(got[n])), want[n], rtol=1e-5, atol=1e-6)


def test_scaffold_equals_a_hand_written_scaffold_on_the_same_batches(tmp_path: Path) -> None:
    final, store = run(tmp_path, rounds=3)
    x, c, c_i = reference(3)
    assert_close(final.parameters, x)
    assert_close(final.groups[CONTROL], c)
    assert any(float(t.abs().max()) > 1e-3 for t in c.values())  # the control variates did move
    for cid in IDS:
        stored = store.entry(cid).get(CONTROL)
        if stored is None:  # never sampled: c_i is still zero
            assert all(float(t.abs().max()) == 0 for t in c_i[cid].values())
        else:
            assert_close(stored, c_i[cid])
    assert len(list((tmp_path / "clients").iterdir())) == len(
        {cid for r in range(1, 4) for cid in sample_clients(IDS, 2, seed=SEED, round=r)}
    )


def test_control_variates_survive_a_checkpoint_and_resume_gives_the_same_model(tmp_path: Path) -> None:
    straight, _ = run(tmp_path / "straight", rounds=3)
    first, _ = run(tmp_path / "resumed", rounds=2)
    store = StateStore(tmp_path / "state")
    try:
        path = store.save_checkpoint(first)
    finally:
        store.close()
    loaded = load_checkpoint(path)
    assert set(loaded.groups) == {CONTROL}
    for n, a in first.groups[CONTROL].items():
        np.testing.assert_array_equal(loaded.groups[CONTROL][n], a)
    # a restarted server: the checkpoint's state and the same client state directory (the clients kept theirs)
    resumed, _ = run(tmp_path / "resumed", rounds=3, start=ServerState(
        round=loaded.round,
        parameters=loaded.parameters,
        optimizer_state=loaded.optimizer_state,
        trainable=trainable_names(model_fn),
        groups=loaded.groups,
    ))  # fmt: skip
    for n in straight.parameters:
        np.testing.assert_array_equal(resumed.parameters[n], straight.parameters[n])
        np.testing.assert_array_equal(resumed.groups[CONTROL][n], straight.groups[CONTROL][n])


def test_a_round_run_again_counts_once_on_the_client(tmp_path: Path) -> None:
    """A server that restarts from round 2's checkpoint runs round 3 again with clients that already trained it:
    they start from the c_i they had before round 3, so the result equals the uninterrupted run's."""
    straight, _ = run(tmp_path / "straight", rounds=3)
    second, _ = run(tmp_path / "twice", rounds=2)
    run(tmp_path / "twice", rounds=3, start=second)  # round 3, whose replies the server then loses
    again, _ = run(tmp_path / "twice", rounds=3, start=second)
    for n in straight.parameters:
        np.testing.assert_array_equal(again.parameters[n], straight.parameters[n])
        np.testing.assert_array_equal(again.groups[CONTROL][n], straight.groups[CONTROL][n])


def test_a_state_of_another_strategy_is_refused(tmp_path: Path) -> None:
    params = initial_parameters(model_fn, SEED)
    fedavg = build_strategy(StrategyConfig(name="fedavg"), FIT, SAMPLING)
    plain = initial_state(params, fedavg)
    pool = InMemoryPool(IDS, make_task, state=ClientStateStore(tmp_path))
    with pytest.raises(
        ConfigError, match=r"holds the tensor groups \[\] but strategy 'scaffold' declares \['control'\]"
    ):
        run_rounds(pool, scaffold(fit=FIT, sampling=SAMPLING), plain, RoundConfig(num_rounds=1))


def test_control_rule_update_is_c_plus_fraction_of_the_mean() -> None:
    rule = ControlRule()
    c = {"w": np.array([1.0, -2.0], np.float32)}
    got = rule.update(c, {"w": np.array([0.3, 0.6])}, accepted=2, available=8)
    np.testing.assert_allclose(got["w"], [1.075, -1.85], rtol=1e-6)
    assert got["w"].dtype == np.float32 and c["w"][0] == 1.0  # its input untouched
    assert rule.init({"w": np.ones(2, np.float32), "n": np.zeros((), np.int64)}, trainable=None).keys() == {"w"}
    with pytest.raises(ConfigError, match="N must be"):
        rule.update(c, c, accepted=3, available=2)


def test_scaffold_is_selected_by_its_name_and_checks_its_settings() -> None:
    strategy = build_strategy(StrategyConfig(name="scaffold", server_lr=0.5), FIT, SAMPLING)
    assert strategy.name == "scaffold" and set(strategy.groups) == {CONTROL}
    assert [m.name for m in strategy.mods] == ["scaffold"]
    with pytest.raises(ConfigError, match="proximal"):
        scaffold(fit=FitConfig(mu=0.1), sampling=SAMPLING)
    with pytest.raises(ConfigError, match="eta_g"):
        scaffold(fit=FIT, sampling=SAMPLING, server_lr=0.0)


class Recording(PoolWrapper):
    """The honest replies, kept as they pass."""

    def __init__(self, pool: ClientPool) -> None:
        super().__init__(pool)
        self.replies: dict[str, FitRes] = {}

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[PoolReply]:
        for reply in self._pool.run(instructions, timeout_s=timeout_s):
            if isinstance(reply, FitRes):
                self.replies[reply.client_id] = reply
            yield reply


def test_a_robust_rule_also_combines_the_control_variates(tmp_path: Path) -> None:
    """SCAFFOLD over the coordinate-wise median, f = 1 of 3, client c sending its delta c_i flipped and scaled by
    1000: the server's c is the median of the three delta c_i (all 3 of 3 clients took part), so within the honest
    ones in every coordinate. The control group was averaged plainly whatever the model's rule, and an attacker's
    delta c_i reached every client's gradients through c (a median-protected run fell from 0.72 to 0.13)."""
    config = StrategyConfig(name="scaffold", server_lr=ETA_G, aggregator="median", byzantine=1)
    strategy = build_strategy(config, FIT, SamplingConfig(fraction_fit=1.0, min_fit_clients=3))
    assert strategy.groups[CONTROL].aggregator == MedianAggregator(byzantine=1)
    recording = Recording(InMemoryPool(IDS, make_task, state=ClientStateStore(tmp_path)))
    attack = AttackConfig(kind="sign_flip", fraction=0.3, scale=1000.0)
    pool = AttackedPool(recording, frozenset({"c"}), attack, seed=SEED)
    params = initial_parameters(model_fn, SEED)
    start = initial_state(params, strategy, trainable=trainable_names(model_fn))
    final, _ = run_rounds(pool, strategy, start, RoundConfig(num_rounds=1, seed=SEED))
    deltas = {cid: recording.replies[cid].groups[CONTROL] for cid in IDS}
    for name, c in final.groups[CONTROL].items():
        sent = [deltas["a"][name], deltas["b"][name], -1000.0 * deltas["c"][name]]
        np.testing.assert_allclose(c, np.median(np.stack(sent), axis=0), rtol=1e-6, atol=1e-7)
        honest = np.stack([deltas["a"][name], deltas["b"][name]])
        assert np.all(c >= honest.min(axis=0) - 1e-6) and np.all(c <= honest.max(axis=0) + 1e-6)
    with pytest.raises(ConfigError, match="SCAFFOLD with norm bounding"):
        StrategyConfig(name="scaffold", aggregator="norm_bound", norm_bound=1.0)
