"""Privacy accounting for client-level DP-FedAvg through Google's dp-accounting library (RDP and PLD).

One round releases the Gaussian mechanism of noise multiplier ``z`` on a sample of the clients; ``r`` rounds are
its ``r``-fold composition. fedcore selects a fixed number ``m`` of the ``N`` clients each round (uniformly,
without replacement); the accounting models it as Poisson sampling with rate ``q = m / N``, as McMahan et al. 2018
(section 3) and Opacus do for fixed-size batches. That is the library's ``PoissonSampledDpEvent(q,
GaussianDpEvent(z))`` composed ``r`` times, for the add-or-remove-one-client relation (client-level DP).

Accountants: ``"rdp"`` (Rényi DP, Mironov 2017; the moments accountant of Abadi et al. 2016, which McMahan et al.
use) and ``"pld"`` (privacy loss distributions, Koskela et al. 2020 / Doroshenko et al. 2022: tighter, slower).
One call costs about 0.5 s (RDP at q ~ 0.2) to 10 s (PLD) on a 2-core machine; the aggregator computes it once
per round.
"""

from __future__ import annotations

import logging
from typing import Literal

import dp_accounting
from dp_accounting import pld, rdp

from fedcore.errors import ConfigError

Accountant = Literal["rdp", "pld"]
MAX_NOISE_MULTIPLIER = 1e6
"""The largest noise multiplier taken: the noise is then a million times the clipping norm, and nothing of the
updates is left to learn from; far above it (z^2 past a float's range, z ~ 1e154) dp-accounting overflows."""
ACCOUNTANTS: tuple[Accountant, ...] = ("rdp", "pld")


def round_event(noise_multiplier: float, sampling_rate: float) -> dp_accounting.DpEvent:
    """One round's DP event: ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` (the sampled Gaussian mechanism).

    Raises:
        ConfigError: ``q`` outside (0, 1] or ``z`` not a finite number > 0.
    """
    if not (isinstance(sampling_rate, int | float) and 0 < sampling_rate <= 1):
        raise ConfigError(f"the sampling rate (clients per round / clients) must be in (0, 1], got {sampling_rate!r}")
    if not (isinstance(noise_multiplier, int | float) and 0 < noise_multiplier <= MAX_NOISE_MULTIPLIER):
        raise ConfigError(
            f"the noise multiplier must be a number in (0, {MAX_NOISE_MULTIPLIER:g}], got {noise_multiplier!r}"
        )
    return dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))


class _DropOrderWarnings(logging.Filter):
    """dp-accounting logs (through absl) every fractional Rényi order whose series does not converge and leaves
    that order out of the minimum; at small orders with q ~ 0.2 that is several lines per call, every round. The
    epsilon is still the library's (the minimum over the orders that converged), so these lines are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_DropOrderWarnings())


def check(*, noise_multiplier: float, sampling_rate: float, delta: float, accountant: str) -> None:
    """Validate accounting settings without computing anything (what :func:`epsilon` would refuse).

    Raises:
        ConfigError: a value out of range or an unknown accountant.
    """
    round_event(noise_multiplier, sampling_rate)
    if not (isinstance(delta, int | float) and 0 < delta < 1):
        raise ConfigError(f"delta must be in (0, 1), got {delta!r}")
    if accountant not in ACCOUNTANTS:
        raise ConfigError(f"unknown accountant {accountant!r}; choose one of {', '.join(ACCOUNTANTS)}")


def epsilon(
    *, noise_multiplier: float, sampling_rate: float, rounds: int, delta: float, accountant: Accountant = "rdp"
) -> float:
    """The epsilon of ``rounds`` rounds of the sampled Gaussian mechanism at ``delta``.

    Args:
        noise_multiplier: z, the noise standard deviation over the sensitivity (the clipping norm).
        sampling_rate: q = clients per round / clients, in (0, 1].
        rounds: rounds released so far, >= 0 (0 gives 0).
        delta: in (0, 1).
        accountant: ``"rdp"`` or ``"pld"``.

    Raises:
        ConfigError: a value out of range or an unknown accountant.
    """
    check(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, delta=delta, accountant=accountant)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ConfigError(f"rounds must be an integer >= 0, got {rounds!r}")
    if rounds == 0:
        return 0.0
    library: dp_accounting.PrivacyAccountant = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    library.compose(round_event(noise_multiplier, sampling_rate), rounds)
    return float(library.get_epsilon(delta))
