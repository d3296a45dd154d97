"""Batched clients' shuffles: every client's permutations drawn in one compiled call equal torch's, drawn client by
client as the one-by-one training loop draws them."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

import simulations.shuffle as shuffle
from fedcore.errors import ConfigError
from fedcore.seeding import derive_seed, derive_seeds


def _torch_draws(cases: list[tuple[int, int, int]]) -> np.ndarray:
    """What :func:`fedcore.training.train_supervised` draws: one generator per client, one randperm per epoch."""
    draws: list[torch.Tensor] = []
    for seed, count, epochs in cases:
        generator = torch.Generator().manual_seed(seed)
        draws.extend(torch.randperm(count, generator=generator) for _ in range(epochs))
    return torch.cat(draws).numpy()


def _columns(cases: list[tuple[int, int, int]]) -> tuple[list[int], list[int], list[int]]:
    return [c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases]


def test_permutations_equal_torch_randperm_client_by_client() -> None:
    rng = random.Random(7)
    # sizes below, at and above the generator's 624-word block, several epochs from one generator, empty clients,
    # seeds of every width up to 63 bits (the seed's low 32 bits seed the generator)
    cases = [
        (rng.getrandbits(rng.choice([1, 31, 32, 33, 63])), rng.choice([0, 1, 2, 60, 623, 624, 625, 1300, 3000]), e)
        for e in [rng.choice([0, 1, 2, 3]) for _ in range(300)]
    ]
    ours = shuffle.epoch_permutations(*_columns(cases))
    assert ours.dtype == np.int64
    np.testing.assert_array_equal(ours, _torch_draws(cases))
    assert shuffle.kernel_matches()


def test_a_round_of_clients_draws_the_one_by_one_loops_shuffles() -> None:
    ids = [f"client-{i:04d}" for i in range(500)]
    seeds = derive_seeds(11, 4, each=ids)
    assert seeds == [derive_seed(11, 4, cid) for cid in ids]
    cases = [(seed, 60 + i % 7, 1 + i % 2) for i, seed in enumerate(seeds)]
    np.testing.assert_array_equal(shuffle.epoch_permutations(*_columns(cases)), _torch_draws(cases))


def test_derive_seeds_without_shared_keys() -> None:
    assert derive_seeds(5, each=["a", 3, ""]) == [derive_seed(5, "a"), derive_seed(5, 3), derive_seed(5, "")]
    assert derive_seeds(5, 1, each=[]) == []


def test_nothing_to_draw() -> None:
    assert shuffle.epoch_permutations([], [], []).shape == (0,)
    assert shuffle.epoch_permutations([3, 4], [0, 5], [2, 0]).shape == (0,)


def test_a_kernel_that_draws_otherwise_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under a torch whose randperm draws another stream, the shuffles come from torch itself, with a warning."""

    def reversed_draws(seeds: np.ndarray, counts: np.ndarray, epochs: np.ndarray, out: np.ndarray) -> None:
        out[:] = np.arange(out.size)[::-1]

    monkeypatch.setattr(shuffle, "torch_randperms", reversed_draws)
    shuffle.kernel_matches.cache_clear()
    try:
        cases = [(3, 10, 2), (2**50 + 1, 61, 1)]
        with caplog.at_level(logging.WARNING, logger="simulations.shuffle"):
            drawn = shuffle.epoch_permutations(*_columns(cases))
        np.testing.assert_array_equal(drawn, _torch_draws(cases))
        assert not shuffle.kernel_matches()
        assert "draw their shuffles through torch one client at a time" in caplog.text
    finally:
        shuffle.kernel_matches.cache_clear()


def test_clients_above_the_32_bit_draws_limit_are_drawn_by_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch shuffles with 64-bit draws from 2**32 / 20 elements on; such a client goes to torch (the limit is
    lowered here to keep the test small)."""
    assert shuffle.kernel_matches()  # checked (and cached) first: the kernel itself is not what differs here
    calls: list[int] = []
    kernel = shuffle.torch_randperms

    def counted(*args: np.ndarray) -> None:
        calls.append(1)
        kernel(*args)

    monkeypatch.setattr(shuffle, "torch_randperms", counted)
    monkeypatch.setattr(shuffle, "RANDPERM_LIMIT", 100)
    cases = [(1, 50, 1), (2, 100, 1)]
    np.testing.assert_array_equal(shuffle.epoch_permutations(*_columns(cases)), _torch_draws(cases))
    assert not calls
    cases = [(1, 50, 1), (2, 99, 2)]
    np.testing.assert_array_equal(shuffle.epoch_permutations(*_columns(cases)), _torch_draws(cases))
    assert calls == [1]


def test_inputs_that_are_not_one_per_client_or_not_counts_are_refused() -> None:
    """The compiled kernel reads the three arrays without bounds checks: lengths that differ, negative or fractional
    counts are refused before it runs (they read past an array's end, or left entries of the output unwritten)."""
    with pytest.raises(ConfigError, match="3 seeds, 1 counts and 1 epoch counts; give one of each per client"):
        shuffle.epoch_permutations([1, 2, 3], [4], [1])
    with pytest.raises(ConfigError, match="one of each per client"):
        shuffle.epoch_permutations([1], [4, 4], [1, 1])
    with pytest.raises(ConfigError, match=r"counts must be integers >= 0, got \[-3\]"):
        shuffle.epoch_permutations([1], [-3], [-2])
    with pytest.raises(ConfigError, match=r"counts must be integers >= 0, got \[2.9\]"):
        shuffle.epoch_permutations([1], [2.9], [1])  # type: ignore[list-item]  # deliberate: a fractional count
    with pytest.raises(ConfigError, match="epochs must be integers >= 0"):
        shuffle.epoch_permutations([1], [3], [-1])


def test_any_integer_seed_draws_torchs_stream_from_its_low_32_bits() -> None:
    cases = [(2**64 - 1, 9, 1), (-1, 9, 2), (2**32 + 5, 9, 1)]
    for seed, count, epochs in cases:
        torch_seed = seed if seed >= 0 else seed & (2**64 - 1)  # torch takes [-2**63, 2**64)
        np.testing.assert_array_equal(
            shuffle.epoch_permutations([seed], [count], [epochs]), _torch_draws([(torch_seed, count, epochs)])
        )


def test_batch_rows_lays_each_clients_permutations_out_step_by_step() -> None:
    """The compiled layout against the one-by-one loop's batches written out in Python: client c's step t takes
    positions (t mod p) * B .. of its epoch-(t div p) permutation, offset by its first row; 0 past its steps or its
    samples. Clients of 0, 1 and 23 samples, several epochs, a step cap, batch sizes 1 to 7."""
    from fedcore.kernels import batch_rows

    rng = random.Random(4)
    for _ in range(40):
        batch = rng.randint(1, 7)
        counts = np.array([rng.choice([0, 1, 5, 23, rng.randint(0, 40)]) for _ in range(rng.randint(1, 6))])
        per_epoch = np.maximum(-(-counts // batch), 1)
        epochs = np.array([rng.randint(1, 3) if n else 0 for n in counts])
        steps = np.array([min(p * e, rng.choice([p * e, 1, 2])) for p, e in zip(per_epoch, epochs, strict=True)])
        epochs = -(-steps // per_epoch)
        firsts = np.cumsum(counts) - counts + 100
        starts = np.cumsum(epochs * counts) - epochs * counts
        drawn = np.concatenate(
            [
                np.concatenate([rng.sample(range(n), n) for _ in range(e)] or [[]])
                for n, e in zip(counts, epochs, strict=True)
            ]
        ).astype(np.int64)
        width = int(steps.max()) + rng.randint(0, 2)
        out = np.full((len(counts), width, batch), -1, dtype=np.int64)
        batch_rows(drawn, starts, counts, per_epoch, steps, firsts, out)
        for c, n in enumerate(counts):
            for t in range(width):
                for j in range(batch):
                    position = (t % per_epoch[c]) * batch + j
                    want = 0
                    if t < steps[c] and position < n:
                        want = firsts[c] + drawn[starts[c] + (t // per_epoch[c]) * n + position]
                    assert out[c, t, j] == want, (c, t, j)


def test_seeds_wider_than_int64_draw_as_their_low_32_bits() -> None:
    wide = [2**64 + 5, 2**70 + 123_456_789, 2**63]
    cases = [(seed, 60, 2) for seed in wide]
    low = [(seed & 0xFFFFFFFF, count, epochs) for seed, count, epochs in cases]
    np.testing.assert_array_equal(shuffle.epoch_permutations(*_columns(cases)), _torch_draws(low))
