"""Distributed DP inside secure aggregation's field: the pure math of fedcore's variant of the distributed discrete
Gaussian mechanism (Kairouz, Liu, Steinke 2021, "The Distributed Discrete Gaussian Mechanism for Federated Learning
with Secure Aggregation", ICML; "DDGauss").

Each of the ``k`` clients whose update reaches the secure sum does, in this order:

1. clip its update ``delta`` to L2 norm ``C`` (:func:`~privacy.dp.mechanism.clip_update`);
2. quantize it as SecAgg+ does (:mod:`privacy.secagg.quantize`, weight 1): ``q_i = SR((delta_i + c) L / (2c))``,
   with ``c`` the field's clipping range and ``L`` its levels. fedcore requires ``c > C``, so the per-coordinate
   clip to ``[-c, c]`` never acts (``|delta_i| <= ||delta|| <= C``) and the only data-dependent step after the L2
   clip is the stochastic rounding, whose error is below one level per coordinate;
3. add integer noise ``g ~ N_Z(0, sigma^2)`` (the discrete Gaussian, :func:`discrete_gaussian`) to every value
   coordinate, in the field's integer units, before masking.

The server unmasks ``T = sum_k (q_k + g_k) mod 2^b`` and nothing else. The noise is added after the only
non-linear step, and the sum modulo ``2^b`` is a function of the integer sum ``sum_k q_k + sum_k g_k``, so whatever
the server computes is post-processing of a sum of discrete Gaussians around ``sum_k q_k`` (DDGauss' structure,
their Algorithm 1, without its random rotation and with a deterministic rounding bound in place of its conditional
rounding). The guarantee fedcore claims, and how each part is bounded:

- **Sensitivity.** Adding or removing one client moves the centred sum ``sum_k (q_k - L/2)`` by a vector of L2 norm
  at most ``Delta = C L / (2c) + sqrt(D)`` integer units (the clipped update, plus rounding error < 1 in each of
  the ``D`` coordinates). The number of contributions travels with the sum (the weight element), as it does in
  plain distributed mode: the count is not protected.
- **Noise.** Each client's ``sigma = z Delta / sqrt(n_min)`` (:func:`integer_noise_stddev`), so ``n_min`` shares
  sum to discrete Gaussians of variance ``z^2 Delta^2`` and the accountant's noise multiplier is ``z``. In update
  units that is ``z (C + sqrt(D) 2c / L)``: the rounding inflates the noise by ``sqrt(D) 2c / (L C)``.
- **Sum of discrete Gaussians.** A sum of ``n`` independent ``N_Z(0, sigma^2)`` is not exactly ``N_Z(0, n
  sigma^2)``; Kairouz et al.'s Theorem 1 bounds the Rényi divergence with an extra ``tau = 10 sum_{j=1}^{n-1}
  exp(-2 pi^2 sigma^2 j / (j + 1))`` per coordinate. fedcore refuses settings where ``D tau`` exceeds
  :data:`MAX_TAU_TOTAL` (:func:`check_field`), and then accounts the continuous Gaussian mechanism of multiplier
  ``z`` with dp-accounting, leaving out that term (below 1e-9 in every Rényi order).
- **Modular wrap-around.** If a coordinate's integer sum leaves ``[0, 2^b)``, the unmasked value wraps: privacy is
  unaffected (post-processing) but the model would be wrong. With ``c > C`` the sum of ``k >= n_min`` quantized
  updates lies at least ``h = k (c - C) L / (2c)`` from either end of the range, and a discrete Gaussian is
  sub-Gaussian with its parameter (Canonne, Kamath, Steinke 2020, Proposition 19: ``P(X >= t) <=
  exp(-t^2 / (2 sigma^2))``), so the chance that any coordinate wraps is at most ``2 D exp(-n_min (c - C)^2 /
  (2 s^2))`` with ``s`` the noise in update units. fedcore refuses a round where that exceeds
  :data:`MAX_WRAP_PROBABILITY` and names the smallest ``c`` (``[strategy.secagg] clip``) that fits.

The sampler is CKS20's Algorithm 3 (rejection from the discrete Laplace), vectorized in floating point as
TensorFlow Federated's implementation of DDGauss does, with numpy's generator seeded from the OS: not the
exact-arithmetic sampler CKS recommend against floating-point timing and rounding attacks (Mironov 2012).
"""

from __future__ import annotations

import math

import numpy as np

from fedcore.errors import ConfigError

MAX_WRAP_PROBABILITY = 1e-9
"""The largest probability, per round, that any coordinate of the secure sum wraps around the field."""
MAX_TAU_TOTAL = 1e-9
"""The largest ``D tau`` (Kairouz et al. 2021, Theorem 1) fedcore leaves out of the accounting."""
_BATCH = 1 << 20


def discrete_gaussian(size: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """``size`` independent draws of the discrete Gaussian ``N_Z(0, sigma^2)`` (``P(x) ∝ exp(-x^2 / (2 sigma^2))``
    on the integers), as int64.

    Canonne, Kamath, Steinke 2020 ("The Discrete Gaussian for Differential Privacy"), Algorithm 3: draw ``Y`` from
    the discrete Laplace of scale ``t = floor(sigma) + 1`` (the difference of two geometric variables) and keep it
    with probability ``exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2))``; in floating point (see the module docstring).

    Args:
        size: number of draws, >= 0.
        sigma: the scale, > 0 (finite, below 2^52 so the draws stay exact in float64).
        rng: the generator (callers protecting real data pass one seeded from the OS).

    Raises:
        ConfigError: ``sigma`` out of range or ``size`` negative.
    """
    if not (math.isfinite(sigma) and 0 < sigma < 2.0**52):
        raise ConfigError(f"the discrete Gaussian's sigma must be a finite number in (0, 2^52), got {sigma!r}")
    if size < 0:
        raise ConfigError(f"the number of draws must be >= 0, got {size}")
    t = math.floor(sigma) + 1
    p = -math.expm1(-1.0 / t)  # P(success) of each geometric: 1 - exp(-1/t)
    shift = sigma * sigma / t
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        n = min(_BATCH, 2 * (size - filled) + 64)  # acceptance is about 0.6 or more (CKS20, Theorem 22)
        y = rng.geometric(p, n) - rng.geometric(p, n)
        distance = np.abs(y) - shift
        keep = y[rng.random(n) < np.exp(-(distance * distance) / (2.0 * sigma * sigma))]
        take = min(keep.size, size - filled)
        out[filled : filled + take] = keep[:take]
        filled += take
    return out


def sensitivity(clipping_norm: float, clip: float, levels: int, dimension: int) -> float:
    """``Delta = C L / (2c) + sqrt(D)``: the L2 bound, in integer units of the field, of one client's centred
    quantized update (the clipped update scaled by ``L / (2c)``, plus rounding error below 1 per coordinate)."""
    return clipping_norm * levels / (2.0 * clip) + math.sqrt(dimension)


def integer_noise_stddev(
    share_multiplier: float, clipping_norm: float, clip: float, levels: int, dimension: int
) -> float:
    """Each client's discrete Gaussian sigma in integer units: ``(z / sqrt(n_min)) * Delta`` with
    ``share_multiplier = z / sqrt(n_min)`` and ``Delta`` from :func:`sensitivity`."""
    return share_multiplier * sensitivity(clipping_norm, clip, levels, dimension)


def tau(sigma: float, num_clients: int) -> float:
    """Kairouz et al. 2021, Theorem 1: ``10 sum_{j=1}^{n-1} exp(-2 pi^2 sigma^2 j / (j + 1))``, the per-coordinate
    excess of a sum of ``n`` discrete Gaussians of parameter ``sigma`` over ``N_Z(0, n sigma^2)``."""
    return 10.0 * sum(math.exp(-2.0 * math.pi**2 * sigma**2 * j / (j + 1)) for j in range(1, num_clients))


def wrap_probability(
    *, clipping_norm: float, clip: float, noise_stddev: float, minimum_clients: int, dimension: int
) -> float:
    """An upper bound on the chance that any of ``dimension`` coordinates of a sum of at least ``minimum_clients``
    updates wraps around the field: ``2 D exp(-n_min (c - C)^2 / (2 s^2))`` (``s``: one client's noise in update
    units; 1 when ``c <= C``)."""
    if clip <= clipping_norm:
        return 1.0
    exponent = minimum_clients * (clip - clipping_norm) ** 2 / (2.0 * noise_stddev**2)
    return min(1.0, 2.0 * dimension * math.exp(-exponent))


def minimum_clip(*, clipping_norm: float, noise_stddev: float, minimum_clients: int, dimension: int) -> float:
    """The smallest clipping range ``c`` for which :func:`wrap_probability` is at most
    :data:`MAX_WRAP_PROBABILITY` (for a given noise ``s`` in update units)."""
    margin = noise_stddev * math.sqrt(2.0 * math.log(2.0 * dimension / MAX_WRAP_PROBABILITY) / minimum_clients)
    return clipping_norm + margin


def check_field(
    *,
    share_multiplier: float,
    clipping_norm: float,
    clip: float,
    levels: int,
    dimension: int,
    minimum_clients: int,
    num_clients: int,
) -> float:
    """Refuse a round whose field cannot carry the noisy sum (see the module docstring); return each client's
    noise standard deviation in update units, ``share_multiplier * Delta * 2c / L``.

    Args:
        share_multiplier: ``z / sqrt(n_min)``.
        clipping_norm: C, the L2 clipping norm of each update.
        clip: c, the field's clipping range (``[strategy.secagg] clip``).
        levels: L, the round's quantization levels.
        dimension: D, the values of an update.
        minimum_clients: n_min, the fewest contributions a released sum has.
        num_clients: n, the clients selected (for ``tau``).

    Raises:
        ConfigError: ``c <= C`` (the field would clip the clipped update), a wrap-around chance above
            :data:`MAX_WRAP_PROBABILITY` (names the ``clip`` that fits), or ``D tau`` above :data:`MAX_TAU_TOTAL`
            (the field is too coarse for the noise; names what to raise).
    """
    sigma = integer_noise_stddev(share_multiplier, clipping_norm, clip, levels, dimension)
    noise = sigma * 2.0 * clip / levels
    needed = minimum_clip(
        clipping_norm=clipping_norm, noise_stddev=noise, minimum_clients=minimum_clients, dimension=dimension
    )
    if clip <= clipping_norm or clip < needed:
        raise ConfigError(
            f"distributed DP under secure aggregation: the field's clipping range clip={clip} cannot hold the noisy "
            f"sum of clipped updates (clipping_norm C={clipping_norm}, noise {noise:.4g} per client, n_min="
            f"{minimum_clients}, {dimension} values): a coordinate could wrap around the field with probability "
            f"above {MAX_WRAP_PROBABILITY}. Set [strategy.secagg] clip (--clip) to at least {needed:.6g}"
        )
    check_coarseness(sigma, levels=levels, dimension=dimension, num_clients=num_clients)
    return noise


def check_coarseness(sigma: float, *, levels: int, dimension: int, num_clients: int) -> None:
    """Refuse a per-client discrete Gaussian of ``sigma`` field units whose sum over ``num_clients`` is too far
    from one discrete Gaussian to be accounted as one: ``D tau > MAX_TAU_TOTAL`` (Kairouz et al. 2021, Theorem 1).

    Raises:
        ConfigError: names what to raise (``field_bits`` or ``quantization_levels``).
    """
    excess = dimension * tau(sigma, num_clients)
    if excess > MAX_TAU_TOTAL:
        raise ConfigError(
            f"distributed DP under secure aggregation: each client's discrete Gaussian noise is only {sigma:.3g} "
            f"field units ({levels} levels), too coarse for the sum of {num_clients} of them to be accounted as one "
            f"Gaussian (D*tau = {excess:.3g} > {MAX_TAU_TOTAL}); raise [strategy.secagg] field_bits or "
            "quantization_levels"
        )


def max_clipping_norm(
    *, share_multiplier: float, clip: float, levels: int, dimension: int, minimum_clients: int
) -> float:
    """The largest clipping norm ``C`` that :func:`check_field` accepts for the field's ``clip`` (adaptive
    clipping's norm is held below it), or 0 when none is.

    :func:`check_field` needs ``c >= C + a (C + r)`` with ``a = (z / sqrt(n_min)) sqrt(2 ln(2 D / p) / n_min)`` and
    ``r = sqrt(D) 2c / L`` (the noise in update units is ``(z / sqrt(n_min)) (C + r)``), so ``C <= (c - a r) /
    (1 + a)``; the value returned is that bound less a relative 1e-9, so that rounding never tips it over.
    """
    a = share_multiplier * math.sqrt(2.0 * math.log(2.0 * dimension / MAX_WRAP_PROBABILITY) / minimum_clients)
    r = math.sqrt(dimension) * 2.0 * clip / levels
    return max(0.0, (clip - a * r) / (1.0 + a) * (1.0 - 1e-9))


def min_clipping_norm(*, share_multiplier: float, clip: float, levels: int, dimension: int, num_clients: int) -> float:
    """The smallest clipping norm ``C`` whose noise :func:`check_coarseness` accepts (adaptive clipping's norm is held
    above it; 0 when every C is fine).

    The per-client sigma ``(z / sqrt(n_min)) (C L / (2c) + sqrt(D))`` grows with C; ``D tau(sigma, n)`` falls with
    sigma, so the smallest sigma that passes is found by bisection (to a relative 1e-12) and turned back into C,
    plus a relative 1e-9 so that rounding never tips it under.
    """
    target = MAX_TAU_TOTAL / dimension
    floor = share_multiplier * math.sqrt(dimension)  # sigma at C = 0
    if tau(floor, num_clients) <= target:
        return 0.0
    low, high = floor, max(2.0 * floor, 1.0)
    while tau(high, num_clients) > target:
        low, high = high, 2.0 * high
    while high - low > 1e-12 * high:
        middle = (low + high) / 2.0
        low, high = (low, middle) if tau(middle, num_clients) <= target else (middle, high)
    return (high / share_multiplier - math.sqrt(dimension)) * 2.0 * clip / levels * (1.0 + 1e-9)


COUNT_TENSOR = "dp.unclipped"
"""Adaptive clipping under secure aggregation: the one-element float64 tensor appended to the securely summed spec
whose field coordinate carries each client's ``S b_i + g_i`` (see :func:`count_scale`)."""
CLIPPING_SETTING = "dp_clipping_norm"
"""The round setting (announced with the keys, :data:`privacy.secagg.codec.SETTING_PREFIX`) that tells the clients
adaptive clipping's norm for the round."""
COUNT_MIN_SIGMA = 64.0
"""The smallest per-client discrete Gaussian (field units) on the count coordinate; ``tau`` is 0 in float64 there."""


def count_scale(count_stddev: float, minimum_clients: int) -> int:
    """``S``, the field units of one unclipped update on the count coordinate: the smallest power of two with
    ``S sigma_b / sqrt(n_min) >= COUNT_MIN_SIGMA``.

    Each client adds ``S b_i + g_i`` (``b_i = 1[||delta_i|| <= C]``, ``g_i ~ N_Z(0, (S sigma_b / sqrt(n_min))^2)``)
    to the coordinate, which quantizes to exactly 0 (the tensor's value is ``-clip``), so the unmasked coordinate is
    ``S sum_i b_i + sum_i g_i``: the count with noise of standard deviation ``sigma_b sqrt(k / n_min)`` in count
    units. With the number of contributions ``k`` public (the weight element), releasing it is releasing
    ``sum_i S (b_i - 1/2)``, of sensitivity ``S / 2``: noise multiplier ``2 sigma_b``, as in Andrew et al. 2021
    (section 3.1), which :func:`~privacy.dp.mechanism.update_noise_multiplier` composes with the update's.

    Raises:
        ConfigError: ``count_stddev`` not a finite number > 0, or ``minimum_clients`` < 1.
    """
    if not (math.isfinite(count_stddev) and count_stddev > 0):
        raise ConfigError(f"the clipped count's noise standard deviation must be finite and > 0, got {count_stddev!r}")
    if minimum_clients < 1:
        raise ConfigError(f"the fewest contributions must be >= 1, got {minimum_clients}")
    needed = COUNT_MIN_SIGMA * math.sqrt(minimum_clients) / count_stddev
    return 1 << max(0, math.ceil(math.log2(needed)))


def check_count_field(*, scale: int, sigma: float, num_clients: int, field_bits: int) -> None:
    """Refuse a field whose count coordinate could wrap: the server reads ``S sum_i b_i + sum_i g_i`` as a signed
    ``b``-bit integer, exact while it lies in ``[-2^(b-1), 2^(b-1))``. ``sum_i b_i <= n`` and the noise of ``n``
    shares is sub-Gaussian with parameter ``sigma sqrt(n)`` (CKS20, Proposition 19), so a margin ``t = sigma sqrt(2 n
    ln(2 / p))`` keeps the chance of a wrap below ``p =`` :data:`MAX_WRAP_PROBABILITY`; ``tau`` of the coordinate
    must also be below :data:`MAX_TAU_TOTAL`.

    Args:
        scale: S (:func:`count_scale`).
        sigma: each client's discrete Gaussian on the coordinate, in field units.
        num_clients: n, the most clients a round sums (the clients per round m).
        field_bits: b.

    Raises:
        ConfigError: the count does not fit (names the ``field_bits`` that would).
    """
    margin = sigma * math.sqrt(2.0 * num_clients * math.log(2.0 / MAX_WRAP_PROBABILITY))
    largest = scale * num_clients + margin
    if largest >= 2.0 ** (field_bits - 1):
        need = math.ceil(math.log2(largest)) + 2
        raise ConfigError(
            f"adaptive clipping under secure aggregation: the noisy unclipped count of {num_clients} clients (scale "
            f"{scale}, noise {sigma:.4g} field units per client) could wrap around a field of {field_bits} bits; "
            f"use [strategy.secagg] field_bits >= {need}"
        )
    check_coarseness(sigma, levels=scale, dimension=1, num_clients=num_clients)


def count_share(unclipped: bool, scale: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """One client's integer on the count coordinate: ``S b + g``, ``b = 1`` for an unclipped update, ``g ~ N_Z(0,
    sigma^2)`` (:func:`discrete_gaussian`); int64 of shape (1,), added after quantization like the update's noise.

    Raises:
        ConfigError: ``sigma`` out of the sampler's range.
    """
    return scale * int(unclipped) + discrete_gaussian(1, sigma, rng)


def read_count(field_sum: np.ndarray, field_bits: int, scale: int) -> float:
    """The noisy count of unclipped updates, ``(S sum_k b_k + sum_k g_k) / S``, from the unmasked sum whose last
    two elements are the count coordinate and the weight element (the count is :data:`COUNT_TENSOR`, last in the
    securely summed spec), read as a signed ``b``-bit integer (:func:`signed`)."""
    return signed(int(field_sum[field_sum.size - 2]), field_bits) / scale


def signed(value: int, field_bits: int) -> int:
    """``value`` (an element of ``Z_{2^b}``, ``0 <= value < 2^b``) read as the signed integer in
    ``[-2^(b-1), 2^(b-1))`` it is congruent to."""
    half = 1 << (field_bits - 1)
    return value - (1 << field_bits) if value >= half else value
