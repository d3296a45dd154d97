"""Reproducible randomness keyed by (seed, round, client).

Every random choice in a run (client sampling, data shuffling, dropout, partitioning) draws from a generator
derived here from the run's seed and the keys that identify the draw, never from global RNG state, so a run is
reproducible and a resumed run continues exactly where it stopped. These generators are for experiment
randomness only; secrets come from ``cryptography`` / ``os.urandom``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from fedcore.errors import ConfigError


def derive_seed(seed: int, *keys: int | str) -> int:
    """Return a 63-bit seed derived from ``seed`` and ``keys`` (e.g. round number, client id).

    Stable across processes, platforms and Python versions (SHA-256 of the keys' text), so the same
    (seed, round, client) gives the same stream in simulation and in deployment.

    Raises:
        ConfigError: ``seed`` is not an integer (a float, a string or a bool).
    """
    text = "/".join([_seed_text(seed), *(str(k) for k in keys)])
    return _seed_of(hashlib.sha256(text.encode()).digest())


def derive_seeds(seed: int, *keys: int | str, each: Iterable[int | str]) -> list[int]:
    """``[derive_seed(seed, *keys, last) for last in each]`` (e.g. a round's clients' seeds), with the hash of the
    shared prefix computed once: about 0.8 against 2.2 us a seed."""
    prefix = hashlib.sha256("/".join([_seed_text(seed), *(str(k) for k in keys), ""]).encode())
    seeds = []
    for last in each:
        digest = prefix.copy()
        digest.update(str(last).encode())
        seeds.append(_seed_of(digest.digest()))
    return seeds


def _seed_text(seed: object) -> str:
    """The seed's decimal text. Raises ConfigError for anything but an integer (a Python or numpy int, not a bool):
    ``int()`` cut 1.5 to 1 and failed on '7' with a bare ValueError."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ConfigError(f"a seed must be an integer, got {seed!r} ({type(seed).__name__}); pass e.g. seed=0")
    return str(int(seed))


def _seed_of(digest: bytes) -> int:
    """The 63-bit seed of a SHA-256 digest: its first 8 bytes, little-endian, shifted right by one."""
    return int.from_bytes(digest[:8], "little") >> 1


def numpy_rng(seed: int, *keys: int | str) -> np.random.Generator:
    """A numpy ``Generator`` (PCG64) keyed by ``seed`` and ``keys``."""
    return np.random.default_rng(derive_seed(seed, *keys))
