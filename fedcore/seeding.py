"""Reproducible randomness keyed by (seed, round, client).

Every random choice in a run (client sampling, data shuffling, dropout, partitioning) draws from a generator
derived here from the run's seed and the keys that identify the draw, never from global RNG state, so a run is
reproducible and a resumed run continues exactly where it stopped. These generators are for experiment
randomness only; secrets come from ``cryptography`` / ``os.urandom``.
"""

from __future__ import annotations

import hashlib

import numpy as np


def derive_seed(seed: int, *keys: int | str) -> int:
    """Return a 63-bit seed derived from ``seed`` and ``keys`` (e.g. round number, client id).

    Stable across processes, platforms and Python versions (SHA-256 of the keys' text), so the same
    (seed, round, client) gives the same stream in simulation and in deployment.
    """
    text = "/".join([str(int(seed)), *(str(k) for k in keys)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def numpy_rng(seed: int, *keys: int | str) -> np.random.Generator:
    """A numpy ``Generator`` (PCG64) keyed by ``seed`` and ``keys``."""
    return np.random.default_rng(derive_seed(seed, *keys))
