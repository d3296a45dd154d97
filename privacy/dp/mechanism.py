"""The pure math of client-level DP-FedAvg: L2 clipping of an update, Gaussian noise, adaptive clipping.

No I/O and no round logic (STYLE.md §1): the aggregators (:mod:`privacy.dp.aggregator`,
:mod:`privacy.dp.secure`) and the client mod of distributed mode (:mod:`privacy.dp.distributed`) call these functions.

Sources:

- McMahan, Ramage, Talwar, Zhang 2018, "Learning Differentially Private Recurrent Language Models" (DP-FedAvg):
  each client's update ``delta_k = w_k - w`` is clipped to L2 norm ``C`` (``pi(delta, C) = delta * min(1, C /
  ||delta||)``, the "flat clipping" over the whole update) and Gaussian noise ``N(0, sigma^2)`` with ``sigma = z C
  / m`` is added to the average over the fixed denominator ``m`` (the expected number of clients per round).
- Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially Private Learning with Adaptive Clipping" (Algorithm 1):
  the clipping norm follows a target quantile ``gamma`` of the update norms by the geometric step ``C <- C *
  exp(-eta_C (b~ - gamma))``, where ``b~ = (sum_k 1[||delta_k|| <= C] + N(0, sigma_b^2)) / m`` is the noisy
  fraction of unclipped updates. The count's noise spends privacy too; with ``sigma_b`` given, the update's noise
  multiplier is raised to ``z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` so both queries together are one Gaussian
  mechanism of noise multiplier ``z`` (their Theorem 1 / section 3.1).

The norm of an update is taken over its floating tensors (parameters and floating buffers such as BatchNorm's
running statistics), in float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedcore.errors import ConfigError
from fedcore.tensors import NamedArrays

__all__ = [
    "AdaptiveClipping",
    "clip_update",
    "clipping_scale",
    "gaussian_noise",
    "l2_norm",
    "minimum_contributors",
    "noise_share_stddev",
    "update_noise_multiplier",
]


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def l2_norm(update: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of ``update`` (``name -> array``) over its floating tensors, computed in float64.

    Returns inf when the squares overflow float64 (such an update is clipped to the zero update's direction-free
    limit by :func:`clipping_scale`, i.e. scaled to 0).
    """
    total = 0.0
    for array in update.values():
        a = np.asarray(array)
        if a.dtype.kind != "f":
            continue
        flat = a.reshape(-1).astype(np.float64, copy=False)
        with np.errstate(over="ignore"):  # an overflow is an infinite norm, handled below
            total += float(np.dot(flat, flat))
    return math.sqrt(total) if math.isfinite(total) else math.inf


def clipping_scale(norm: float, clipping_norm: float) -> float:
    """``min(1, C / norm)``: the factor that brings an update of L2 ``norm`` within ``clipping_norm`` C (1 for the
    zero update, 0 for an infinite norm)."""
    if norm <= clipping_norm:
        return 1.0
    return clipping_norm / norm if math.isfinite(norm) else 0.0


def clip_update(delta: Mapping[str, np.ndarray], clipping_norm: float) -> tuple[NamedArrays, float]:
    """``delta * min(1, C / ||delta||)`` (McMahan et al. 2018, flat clipping) and ``||delta||``.

    Args:
        delta: the update, ``name -> array`` (the floating tensors are clipped, in float64; others are returned
            unchanged).
        clipping_norm: C > 0.

    Returns:
        ``(clipped, norm)``: the clipped update (floating tensors as float64 arrays of the same shapes) and the L2
        norm of ``delta`` before clipping. ``l2_norm(clipped) <= C`` up to float64 rounding (one ulp of C).

    Raises:
        ConfigError: ``clipping_norm`` is not a finite number > 0.
    """
    clipping_norm = _positive("the clipping norm", clipping_norm)
    norm = l2_norm(delta)
    scale = clipping_scale(norm, clipping_norm)
    clipped: NamedArrays = {}
    for name, array in delta.items():
        a = np.asarray(array)
        clipped[name] = a.astype(np.float64) * scale if a.dtype.kind == "f" else a
    return clipped, norm


def gaussian_noise(shapes: Mapping[str, tuple[int, ...]], std: float, rng: np.random.Generator) -> NamedArrays:
    """Independent ``N(0, std^2)`` noise for every tensor of ``shapes`` (``name -> shape``), float64.

    Args:
        std: the standard deviation, >= 0 (0 gives zeros).
        rng: the generator; callers that protect real data pass one seeded from the OS
            (``np.random.default_rng()``), never one derived from the run's seed, which would let whoever knows
            the seed subtract the noise.

    Raises:
        ConfigError: ``std`` is negative or not finite.
    """
    if not (math.isfinite(std) and std >= 0):
        raise ConfigError(f"the noise standard deviation must be a finite number >= 0, got {std!r}")
    return {name: rng.normal(0.0, std, size=shape) for name, shape in shapes.items()}


def update_noise_multiplier(noise_multiplier: float, clipped_count_stddev: float) -> float:
    """The update's noise multiplier ``z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` when the clipped count is released
    with noise ``sigma_b`` (Andrew et al. 2021, section 3.1), so that both together spend what one Gaussian
    mechanism of multiplier ``z`` spends.

    Raises:
        ConfigError: ``2 sigma_b <= z`` (the count alone would spend the whole budget; raise sigma_b) or values
            that are not finite numbers > 0.
    """
    z = _positive("the noise multiplier", noise_multiplier)
    sigma_b = _positive("the clipped count's noise standard deviation", clipped_count_stddev)
    if 2 * sigma_b <= z:
        raise ConfigError(
            f"adaptive clipping with noise multiplier {z} needs the clipped count's noise standard deviation > z / 2 "
            f"= {z / 2}, got {sigma_b}; raise privacy.clipped_count_stddev (--clipped-count-stddev) above {z / 2} "
            "(Andrew et al. suggest about clients per round / 20) or lower the noise multiplier"
        )
    return (z**-2 - (2 * sigma_b) ** -2) ** -0.5


@dataclass(frozen=True, kw_only=True)
class AdaptiveClipping:
    """Adaptive clipping (Andrew et al. 2021, Algorithm 1): the clipping norm tracks the ``target_quantile`` of the
    update norms.

    Attributes:
        target_quantile: gamma in (0, 1), the fraction of updates that should go unclipped (0.5 in the paper).
        learning_rate: eta_C > 0 of the geometric update (0.2 in the paper).
        clipped_count_stddev: sigma_b > 0, the noise on the count of unclipped updates (the paper: m / 20).
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    clipped_count_stddev: float = 1.0

    def __post_init__(self) -> None:
        q = self.target_quantile
        if isinstance(q, bool) or not isinstance(q, int | float) or not 0 < q < 1:
            raise ConfigError(f"the adaptive clipping target_quantile must be in (0, 1), got {q!r}")
        _positive("the adaptive clipping learning_rate", self.learning_rate)
        _positive("the clipped count's noise standard deviation", self.clipped_count_stddev)

    def next_norm(self, clipping_norm: float, unclipped: int, expected_clients: int, noise: float) -> float:
        """``C * exp(-eta_C (b~ - gamma))`` with ``b~ = (unclipped + noise) / expected_clients``.

        Args:
            clipping_norm: this round's C.
            unclipped: how many of this round's updates had norm <= C.
            expected_clients: m, the fixed denominator (clients expected per round).
            noise: a draw of ``N(0, clipped_count_stddev^2)`` (passed in, so the step is checkable by hand).
        """
        return self.step(clipping_norm, unclipped + noise, expected_clients)

    def step(self, clipping_norm: float, noisy_count: float, expected_clients: int) -> float:
        """``C * exp(-eta_C (noisy_count / expected_clients - gamma))``: the geometric update from a count of
        unclipped updates that already carries its noise (distributed mode: the count comes out of the secure sum
        with the clients' noise shares in it, :mod:`privacy.dp.secure`).

        Args:
            clipping_norm: this round's C > 0.
            noisy_count: ``sum_k 1[||delta_k|| <= C] + noise`` (may be negative or above m: it is not clamped, as
                in Andrew et al.'s Algorithm 1).
            expected_clients: m >= 1, the fixed denominator.

        Raises:
            ConfigError: a non-finite count or C, or m < 1.
        """
        c = _positive("the clipping norm", clipping_norm)
        if not math.isfinite(noisy_count):
            raise ConfigError(f"the noisy unclipped count must be finite, got {noisy_count!r}")
        if isinstance(expected_clients, bool) or not isinstance(expected_clients, int) or expected_clients < 1:
            raise ConfigError(f"the expected clients per round must be an integer >= 1, got {expected_clients!r}")
        fraction = noisy_count / expected_clients
        return c * math.exp(-self.learning_rate * (fraction - self.target_quantile))


def minimum_contributors(expected_clients: int, tolerated_dropout: float) -> int:
    """``ceil(m (1 - tolerated_dropout))``: the fewest updates a distributed-mode round may be summed from.

    Raises:
        ConfigError: ``expected_clients`` < 1 or ``tolerated_dropout`` outside [0, 1).
    """
    if isinstance(expected_clients, bool) or not isinstance(expected_clients, int) or expected_clients < 1:
        raise ConfigError(f"the expected clients per round must be an integer >= 1, got {expected_clients!r}")
    if not (isinstance(tolerated_dropout, int | float) and 0 <= tolerated_dropout < 1):
        raise ConfigError(f"tolerated_dropout must be in [0, 1), got {tolerated_dropout!r}")
    return max(1, math.ceil(expected_clients * (1 - tolerated_dropout) - 1e-9))


def noise_share_stddev(
    noise_multiplier: float, clipping_norm: float, expected_clients: int, tolerated_dropout: float = 0.0
) -> float:
    """The standard deviation of one client's noise share in distributed mode: ``z C / sqrt(n_min)``, with
    ``n_min = ceil(m (1 - tolerated_dropout))`` (:func:`minimum_contributors`).

    The sum of ``k`` independent shares has standard deviation ``z C sqrt(k / n_min)``: exactly ``z C`` (the central
    mechanism's noise on the sum) when ``k = n_min`` clients contribute, more when more do. A round with fewer than
    ``n_min`` contributions would carry less noise than accounted, so the server refuses to release it.

    Raises:
        ConfigError: a value out of range.
    """
    z = _positive("the noise multiplier", noise_multiplier)
    c = _positive("the clipping norm", clipping_norm)
    return z * c / math.sqrt(minimum_contributors(expected_clients, tolerated_dropout))
