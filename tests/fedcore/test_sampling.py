"""Client sampling, ``sample_clients``: its properties for fixed (seed, round, stage), checked by value."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from fedcore.errors import ConfigError
from fedcore.strategy import sample_clients

IDS = [f"client-{i:02d}" for i in range(10)]


def test_same_inputs_give_the_same_selection_of_distinct_available_clients() -> None:
    a = sample_clients(IDS, 4, seed=7, round=3, stage="fit")
    assert a == sample_clients(IDS, 4, seed=7, round=3, stage="fit")
    assert len(set(a)) == 4 and set(a) <= set(IDS) and a == sorted(a)


def test_the_selection_does_not_depend_on_the_order_of_the_ids() -> None:
    shuffled = IDS.copy()
    for k in range(5):
        random.Random(k).shuffle(shuffled)
        for rnd in (1, 2, 9):
            assert sample_clients(shuffled, 3, seed=1, round=rnd) == sample_clients(IDS, 3, seed=1, round=rnd)


def test_rounds_stages_and_seeds_each_change_the_selection() -> None:
    # 10 choose 3 = 120 possible selections: 40 rounds drawing the same one would be a seed that ignores the round
    by_round = {tuple(sample_clients(IDS, 3, seed=5, round=r)) for r in range(1, 41)}
    assert len(by_round) >= 25  # expected ~35 distinct of 40 draws from 120
    by_stage = {tuple(sample_clients(IDS, 3, seed=5, round=r, stage="evaluate")) for r in range(1, 41)}
    assert len(by_stage) >= 25
    differs_by_stage = sum(
        sample_clients(IDS, 3, seed=5, round=r) != sample_clients(IDS, 3, seed=5, round=r, stage="evaluate")
        for r in range(1, 41)
    )
    assert differs_by_stage >= 30  # equal with probability 1/120 per round
    differs_by_seed = sum(
        sample_clients(IDS, 3, seed=5, round=r) != sample_clients(IDS, 3, seed=6, round=r) for r in range(1, 41)
    )
    assert differs_by_seed >= 30


def test_every_client_and_every_pair_is_chosen_about_equally_often() -> None:
    rounds = 3000
    ids = IDS[:6]
    singles: Counter[str] = Counter()
    pairs: Counter[tuple[str, ...]] = Counter()
    for r in range(1, rounds + 1):
        chosen = sample_clients(ids, 2, seed=11, round=r)
        singles.update(chosen)
        pairs[tuple(chosen)] += 1
    # each client: 3000·2/6 = 1000 expected, sd √(3000·(1/3)·(2/3)) ≈ 26: within ±130 (5 sd)
    assert set(singles) == set(ids)
    assert all(abs(n - 1000) < 130 for n in singles.values()), singles
    # each of the 15 pairs: 200 expected, sd ≈ 13.7: within ±70 (a sliding window would give 6 pairs only)
    assert set(pairs) == {tuple(p) for p in itertools.combinations(ids, 2)}
    assert all(abs(n - 200) < 70 for n in pairs.values()), pairs


def test_all_or_none_and_too_many() -> None:
    assert sample_clients(IDS, 10, seed=0, round=1) == IDS
    assert sample_clients(IDS, 0, seed=0, round=1) == []
    with pytest.raises(ConfigError, match="cannot select 11 clients from 10"):
        sample_clients(IDS, 11, seed=0, round=1)
