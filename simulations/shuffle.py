"""The one-by-one training loop's data shuffles, drawn for a whole batch of clients in one call.

:func:`fedcore.training.train_supervised` shuffles a client's data with ``torch.randperm(n, generator=g)`` at each
epoch begun, ``g`` a CPU generator seeded with ``derive_seed(seed, round, client_id)``. Batched clients
(:mod:`simulations.batched`) must take the very same batches, so they need the same permutations: drawn client by
client through torch, seeding a generator and calling ``randperm`` costs about 4 us a client, and with the seeds'
hashing about 12 us, a fifth of the host's work per client at 1,000 clients a round. :func:`epoch_permutations`
hashes the seeds with one shared prefix (:func:`fedcore.seeding.derive_seeds`) and draws every client's
permutations in one compiled call (:func:`fedcore.kernels.torch_randperms`: torch's own generator and shuffle,
reproduced), about 1.3 us a client of 60 samples.

That kernel reproduces the stream of the torch it was written against; a torch that draws ``randperm`` otherwise
would make batched clients train on other batches than one-by-one clients. So it is used only once it has drawn
torch's own permutations for a set of seeds and sizes in this process (:func:`kernel_matches`), and torch draws
them otherwise, with a warning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np
import torch

from fedcore.errors import ConfigError
from fedcore.kernels import torch_randperms

log = logging.getLogger(__name__)

RANDPERM_LIMIT = 2**32 // 20
"""torch's CPU ``randperm`` shuffles with 32-bit draws below this many elements (and otherwise with 64-bit ones,
which :func:`fedcore.kernels.torch_randperms` does not reproduce): larger clients are drawn by torch."""

_CHECK_CASES = ((0, 0, 1), (1, 1, 2), (2**62 + 12345, 2, 1), (987654321, 60, 3), (2**40 + 7, 623, 1), (5, 1300, 2))
"""(seed, count, epochs) drawn both ways by :func:`kernel_matches`: the empty and single cases, counts around the
generator's 624-word block, several epochs (one generator across them), seeds wider than 32 bits."""


def epoch_permutations(
    seeds: Sequence[int], counts: Sequence[int] | np.ndarray, epochs: Sequence[int] | np.ndarray
) -> np.ndarray:
    """Each client's permutations, one after another: for client ``c``, the ``epochs[c]`` permutations of
    ``range(counts[c])`` that ``torch.randperm(counts[c], generator=g)`` draws in turn from ``g =
    torch.Generator().manual_seed(seeds[c])``, as :func:`fedcore.training.train_supervised` draws them.

    Args:
        seeds: each client's generator seed, an integer (:func:`fedcore.seeding.derive_seed`: in ``[0, 2**63)``);
            as in torch's CPU generator, only its low 32 bits seed the stream.
        counts: each client's sample count, an integer >= 0.
        epochs: how many permutations each client draws, an integer >= 0.

    Returns:
        int64 ``(sum(counts[c] * epochs[c]),)``, client by client in the order given, epoch by epoch.

    Raises:
        ConfigError: the three are not one entry per client, or a count or epoch count is not an integer >= 0.
    """
    seed_array = _low_words(seeds)
    count_array = _whole_numbers("counts", counts)
    epoch_array = _whole_numbers("epochs", epochs)
    if not seed_array.shape == count_array.shape == epoch_array.shape:
        raise ConfigError(
            f"{seed_array.size} seeds, {count_array.size} counts and {epoch_array.size} epoch counts; give one of each "
            "per client"
        )
    out = np.empty(int((count_array * epoch_array).sum()), dtype=np.int64)
    if not out.size:
        return out
    if int(count_array.max()) < RANDPERM_LIMIT and kernel_matches():
        torch_randperms(seed_array, count_array, epoch_array, out)
        return out
    return _drawn_by_torch(seed_array, count_array, epoch_array)


def _low_words(seeds: Sequence[int]) -> np.ndarray:
    """The low 32 bits of each seed (what torch's CPU generator is seeded with), int64 ``(len(seeds),)``: in one
    NumPy pass for seeds that fit in int64 (all of :func:`fedcore.seeding.derive_seed`'s), else one by one."""
    try:
        return np.asarray(seeds, dtype=np.int64).reshape(-1) & 0xFFFFFFFF
    except (OverflowError, TypeError, ValueError):  # wider integers (or objects int() takes): Python's own ints
        return np.fromiter((int(seed) & 0xFFFFFFFF for seed in seeds), dtype=np.int64)


def _whole_numbers(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    """``values`` as a flat int64 array.

    Raises:
        ConfigError: a value is not an integer >= 0.
    """
    array = np.asarray(values).reshape(-1)
    if array.size and (array.dtype.kind not in "iu" or int(array.min()) < 0):
        raise ConfigError(f"{name} must be integers >= 0, got {array[:5].tolist()}{' ...' if array.size > 5 else ''}")
    return array.astype(np.int64)


def _drawn_by_torch(seeds: np.ndarray, counts: np.ndarray, epochs: np.ndarray) -> np.ndarray:
    """:func:`epoch_permutations` drawn by torch itself, client by client."""
    generator = torch.Generator()
    draws: list[torch.Tensor] = []
    for seed, count, times in zip(seeds.tolist(), counts.tolist(), epochs.tolist(), strict=True):
        if count <= 0 or times <= 0:
            continue
        generator.manual_seed(seed)
        draws.extend(torch.randperm(count, generator=generator) for _ in range(times))
    return torch.cat(draws).numpy() if draws else np.empty(0, dtype=np.int64)


@functools.cache
def kernel_matches() -> bool:
    """Whether :func:`fedcore.kernels.torch_randperms` draws the installed torch's permutations (checked once a
    process on :data:`_CHECK_CASES`, compiling the kernel: about 0.5 s, numba's import excluded); logs a warning
    when it does not."""
    seeds, counts, epochs = (np.asarray(column, dtype=np.int64) for column in zip(*_CHECK_CASES, strict=True))
    ours = np.empty(int((counts * epochs).sum()), dtype=np.int64)
    torch_randperms(seeds, counts, epochs, ours)
    if np.array_equal(ours, _drawn_by_torch(seeds, counts, epochs)):
        return True
    log.warning(
        "torch %s shuffles with randperm otherwise than the batched clients' compiled shuffle expects; batched "
        "clients draw their shuffles through torch one client at a time instead (the same batches, about 10 us a "
        "client slower)",
        torch.__version__,
    )
    return False
