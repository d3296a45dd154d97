"""Simulated Byzantine clients: who attacks, what they send, and what the aggregators make of it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.errors import ConfigError
from fedcore.messages import Failure, FitBatchRes, FitIns, FitRes, Instruction, Reply, ServerMessage
from fedcore.seeding import numpy_rng
from fedcore.supervised import SupervisedTask
from fedcore.task import FitConfig
from simulations.attacks import AttackConfig, AttackedPool, attacked_tasks, choose_attackers, poison_update
from simulations.config import load_recipe
from simulations.harness import run_simulation


def test_attackers_are_a_fraction_drawn_from_the_seed() -> None:
    ids = [f"client-{i:03d}" for i in range(20)]
    config = AttackConfig(kind="sign_flip", fraction=0.2)
    chosen = choose_attackers(ids, config, seed=7)
    assert len(chosen) == 4 and chosen <= set(ids)
    assert choose_attackers(list(reversed(ids)), config, seed=7) == chosen  # order of the ids does not matter
    assert choose_attackers(ids, AttackConfig(), seed=7) == frozenset()
    assert len({choose_attackers(ids, config, seed=s) for s in range(5)}) > 1  # another seed, other attackers


def test_poisoned_updates_by_hand() -> None:
    g = {"w": np.array([1.0, 1.0], np.float32), "n": np.array([3])}
    u = {"w": np.array([2.0, 3.0], np.float32), "n": np.array([5])}  # delta = (1, 2)
    rng = np.random.default_rng(0)
    flipped = poison_update(u, g, AttackConfig(kind="sign_flip", fraction=0.1, scale=4.0), rng)
    np.testing.assert_array_equal(flipped["w"], [-3.0, -7.0])  # g - 4 * delta
    assert flipped["w"].dtype == np.float32 and flipped["n"] is u["n"]  # integer buffers pass through
    np.testing.assert_array_equal(poison_update(u, g, AttackConfig(kind="sign_flip", fraction=0.1), rng)["w"], [0, -1])
    np.testing.assert_array_equal(poison_update(u, g, AttackConfig(kind="scale", fraction=0.1), rng)["w"], [11, 21])
    noisy = poison_update(u, g, AttackConfig(kind="gaussian", fraction=0.1, noise_std=3.0), np.random.default_rng(5))
    expected = (1.0 + np.random.default_rng(5).normal(0.0, 3.0, size=2)).astype(np.float32)
    np.testing.assert_array_equal(noisy["w"], expected)


@pytest.mark.parametrize(
    "settings",
    [{"kind": "sybil"}, {"kind": "scale", "fraction": 1.0}, {"fraction": 0.2}, {"kind": "scale", "scale": -1.0}],
)
def test_attack_config_refuses_bad_settings(settings: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        AttackConfig(**settings)  # type: ignore[arg-type]


class EchoClients:
    """Every client answers with the global model plus one."""

    def available(self) -> list[str]:
        return ["a", "b", "c"]

    def wait_for(self, num_clients: int, timeout_s: float) -> list[str]:
        return self.available()

    def run(self, instructions: Mapping[str, ServerMessage], *, timeout_s: float | None) -> Iterator[Reply]:
        for cid, ins in instructions.items():
            assert isinstance(ins, FitIns)
            if cid == "c":
                yield Failure(client_id=cid, round=ins.round, stage=ins.stage, reason="gone")
                continue
            yield FitRes(client_id=cid, round=ins.round, parameters={"w": ins.parameters["w"] + 1}, num_examples=1)


def test_attacked_pool_rewrites_only_the_attackers_fit_results() -> None:
    config = AttackConfig(kind="gaussian", fraction=0.5, noise_std=0.5)
    pool = AttackedPool(EchoClients(), frozenset({"b", "c"}), config, seed=3)
    g = np.zeros(4, np.float32)
    ins: dict[str, Instruction] = {
        cid: FitIns(round=2, parameters={"w": g}, config=FitConfig(), seed=3) for cid in ("a", "b", "c")
    }
    replies: dict[str, Reply] = {}
    for r in pool.run(ins, timeout_s=None):
        assert not isinstance(r, FitBatchRes)
        replies[r.client_id] = r
    assert isinstance(replies["a"], FitRes) and isinstance(replies["b"], FitRes)
    np.testing.assert_array_equal(replies["a"].parameters["w"], g + 1)
    noise = numpy_rng(3, "attack", 2, "b").normal(0.0, 0.5, size=4)
    np.testing.assert_array_equal(replies["b"].parameters["w"], noise.astype(np.float32))
    assert isinstance(replies["c"], Failure)  # a failure stays a failure
    assert pool.available() == ["a", "b", "c"]


def test_label_flipping_attackers_train_on_flipped_labels() -> None:
    x, y = torch.zeros(4, 2), torch.tensor([0, 3, 9, 5])

    def make(cid: str) -> SupervisedTask:
        return SupervisedTask(model_fn=lambda: torch.nn.Linear(2, 10), train_data=(x, y))

    make_task = attacked_tasks(make, frozenset({"bad"}), AttackConfig(kind="label_flip", fraction=0.5), 10)
    flipped = make_task("bad")
    honest = make_task("good")
    assert isinstance(flipped, SupervisedTask) and isinstance(honest, SupervisedTask)
    assert flipped.train_data is not None and honest.train_data is not None
    assert flipped.train_data[1].tolist() == [9, 6, 0, 4]
    assert honest.train_data[1].tolist() == [0, 3, 9, 5]


@pytest.mark.slow
def test_fedavg_collapses_under_sign_flipping_and_the_trimmed_mean_holds(tmp_path: Path) -> None:
    # the robust recipe, shrunk to run in seconds: digits, logistic regression, 10 clients, 2 of them attacking
    overrides = [
        'data.dataset="digits"',
        "data.num_clients=10",
        'model.name="logreg"',
        "sampling.min_fit_clients=10",
        "strategy.byzantine=2",
        "rounds=10",
        "output.progress=false",
        "output.plot=false",
    ]
    recipe = Path(__file__).resolve().parents[2] / "simulations/recipes/robust_sign_flip.toml"

    def accuracy(*extra: str) -> float:
        config = load_recipe(recipe, [*overrides, f'output.dir="{tmp_path / str(len(extra))}"', *extra])
        result = run_simulation(config, echo=lambda _: None)
        return float(result.history["test_accuracy"].dropna().iloc[-1])

    clean = accuracy('attack.kind="none"', "attack.fraction=0.0", 'strategy.aggregator="mean"')
    fedavg = accuracy('strategy.aggregator="mean"')
    trimmed = accuracy()
    assert clean > 0.8
    assert fedavg < clean - 0.3
    assert trimmed > clean - 0.05


@pytest.mark.parametrize(
    ("aggregator", "clients", "fraction"),
    [("trimmed_mean", 10, 0.2), ("median", 5, 0.4), ("krum", 7, 0.29)],  # the fewest clients each rule takes for f = 2
)
def test_attackers_that_send_inf_are_refused_and_the_run_goes_on(
    aggregator: str, clients: int, fraction: float, tmp_path: Path
) -> None:
    """f = 2 attackers send updates of infinities (noise of sd 1e39 overflows float32): both are refused, so the
    kept updates hold no Byzantine one. The rules were sized for 2 among the kept (the trimmed mean: floor(0.2 * 8)
    = 1 < 2; the median: 3 < 2f + 1; Krum: 5 < 2f + 3) and failed every round after 3 attempts, so f attackers
    stopped a run the rule claims to survive."""
    recipe = Path(__file__).resolve().parents[2] / "simulations/recipes/robust_sign_flip.toml"
    overrides = [
        'data.dataset="digits"',
        f"data.num_clients={clients}",
        'model.name="logreg"',
        f"sampling.min_fit_clients={clients}",
        "strategy.byzantine=2",
        f'strategy.aggregator="{aggregator}"',
        'attack.kind="gaussian"',
        f"attack.fraction={fraction}",
        "attack.noise_std=1e39",
        "rounds=3",
        "evaluate_every=3",
        "output.progress=false",
        "output.plot=false",
        f'output.dir="{tmp_path}"',
    ]
    history = run_simulation(load_recipe(recipe, overrides), echo=lambda _: None).history
    assert history["round"].tolist()[-1] == 3
    assert history["failures"].iloc[1:].tolist() == [2, 2, 2]
    assert history["clients"].iloc[1:].tolist() == [clients - 2] * 3
    assert history["test_accuracy"].dropna().iloc[-1] > 0.7
