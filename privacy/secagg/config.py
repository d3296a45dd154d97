"""SecAgg+ parameters and their validation, done when a round is configured, before any client is contacted.

A :class:`SecAggConfig` holds what a user chooses (neighbours k, threshold t, field bits b, clipping range,
maximum example weight, quantization levels), most of it optional; :meth:`SecAggConfig.resolve` turns it into
the :class:`RoundParams` of one round of ``n`` selected clients, or raises :class:`~fedcore.errors.ConfigError`
for a setting the protocol cannot honour:

- **Graph** (Bell et al. 2020, §3): each client shares its secrets with its ``k`` neighbours on a randomly
  permuted k-regular Harary graph. A k-regular graph on ``n`` vertices exists only when ``n·k`` is even, so an
  odd ``k`` needs an even ``n``. Default ``k``: the smallest odd integer ``>= 2·log2(n)`` (15 for 100 clients);
  when ``n`` is odd, that number plus one (an odd degree is impossible there); at most ``n - 1`` (the complete
  graph, which always exists).
- **Threshold**: ``k/2 < t <= k``; default ``floor(k/2) + 1``. Up to ``k - t`` neighbours of each client may
  drop out after key sharing. A threshold at or below ``k/2`` is refused: a server that lies about who dropped
  out could then ask one half of a client's neighbours for self-mask shares and the other half for mask-key
  shares, and unmask that client's update (Bonawitz et al. 2017, §4).
- **Bit budget**: inputs are clipped to ``[-clip, clip]`` and stochastically rounded to integers ``0..L``
  (``L`` = quantization levels), each client uploads ``w·q`` with its integer example weight ``0 <= w <= W``
  (``W = max_weight``) folded in, plus ``w`` itself; the sum of ``n`` uploads is exact in the field ``Z_{2^b}``
  only if ``n·W·L <= 2^b - 1``. Default ``L``: the largest that fits (capped at 2^52, where float64 stops being
  exact). An explicit ``L`` that does not fit is refused, with the largest one that does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedcore.errors import ConfigError

MIN_FIELD_BITS = 8
MAX_FIELD_BITS = 64
MAX_LEVELS = 1 << 52
"""Quantized values are computed in float64, exact for integers up to 2^53."""


def default_neighbours(num_clients: int) -> int:
    """The default number of neighbours ``k`` for ``num_clients`` clients (see the module docstring).

    >>> [default_neighbours(n) for n in (2, 3, 10, 50, 100, 101)]
    [1, 2, 7, 13, 15, 16]
    """
    k = math.ceil(2 * math.log2(num_clients))
    if k % 2 == 0:
        k += 1
    if num_clients % 2 == 1:
        k += 1
    return max(1, min(k, num_clients - 1))


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"secure aggregation: {name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ConfigError(f"secure aggregation: {name} must be {bound}, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class RoundParams:
    """The resolved parameters of one SecAgg+ round (every value concrete and checked).

    Attributes:
        num_clients: ``n``, the clients selected for the round.
        neighbours: ``k``, each client's degree in the sharing graph (shares per secret).
        threshold: ``t``, shares needed to reconstruct a secret; ``k/2 < t <= k``.
        field_bits: ``b``; arithmetic is modulo ``2^b``.
        clip: inputs are clipped to ``[-clip, clip]`` before quantization.
        max_weight: ``W``, the largest integer example weight a client may fold in.
        levels: ``L``; a clipped value ``x`` becomes an integer in ``0..L`` with ``E[q] = (x + clip)·L/(2·clip)``.
    """

    num_clients: int
    neighbours: int
    threshold: int
    field_bits: int
    clip: float
    max_weight: int
    levels: int

    @property
    def dtype(self) -> np.dtype:
        """The unsigned integer dtype of masked uploads: the narrowest one holding ``b`` bits (uint32 for b=32)."""
        for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
            if np.iinfo(dtype).bits >= self.field_bits:
                return np.dtype(dtype).newbyteorder("<")
        raise ConfigError(f"secure aggregation: field_bits {self.field_bits} is above {MAX_FIELD_BITS}")

    @property
    def modulus_mask(self) -> int:
        """``2^b - 1``: the mask that reduces a value of :attr:`dtype` modulo ``2^b``."""
        return (1 << self.field_bits) - 1

    @property
    def step(self) -> float:
        """The quantization step ``2·clip/L`` in the update's units."""
        return 2.0 * self.clip / self.levels

    @property
    def error_bound(self) -> float:
        """Largest absolute error, per coordinate, of the dequantized weighted mean against the float weighted
        mean of the clipped updates: each client's stochastic rounding moves ``q`` by less than 1 (``step`` in
        update units), and a weighted mean of errors each below ``step`` is below ``step``. The error is
        unbiased; its standard deviation is at most ``step/2`` over the square root of the clients' effective
        number."""
        return self.step


@dataclass(frozen=True, kw_only=True, slots=True)
class SecAggConfig:
    """What a user configures for SecAgg+ (Bell et al. 2020); :meth:`resolve` fixes it for a round of n clients.

    Attributes:
        neighbours: ``k``, neighbours per client in the sharing graph; None: :func:`default_neighbours`.
        threshold: ``t``, shares needed to reconstruct a client's secret, ``k/2 < t <= k``; None: ``k//2 + 1``.
        field_bits: ``b``, bits of the field ``Z_{2^b}`` masked uploads live in (8..64, default 32: uint32).
        clip: update coordinates are clipped to ``[-clip, clip]`` (finite, > 0) before quantization.
        max_weight: the largest integer example weight a client may fold into its upload (>= 1); a client with
            more examples is refused when it masks. Part of the bit budget: ``n·max_weight·L < 2^b``.
        quantization_levels: ``L``, integers ``0..L`` a clipped coordinate is rounded to; None: the largest that
            fits the bit budget.
        stage_deadline_s: seconds the server waits for the replies of each of the protocol's four stages
            (advertise keys, share keys, deliver shares, unmask); a client that misses it drops out of the round
            (and is recovered as the protocol allows). None: the round's deadline (``round_timeout_s``). The fit
            exchange keeps the round's deadline. Finite, > 0.

    Raises:
        ConfigError: a value of the wrong type or out of its range (on construction), or a setting that cannot
            be honoured for a given number of clients (:meth:`resolve`).
    """

    neighbours: int | None = None
    threshold: int | None = None
    field_bits: int = 32
    clip: float = 1.0
    max_weight: int = 1024
    quantization_levels: int | None = None
    stage_deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.neighbours is not None:
            _check_int("neighbours", self.neighbours, 1)
        if self.threshold is not None:
            _check_int("threshold", self.threshold, 1)
        _check_int("field_bits", self.field_bits, MIN_FIELD_BITS, MAX_FIELD_BITS)
        if isinstance(self.clip, bool) or not isinstance(self.clip, int | float) or not math.isfinite(self.clip):
            raise ConfigError(f"secure aggregation: clip must be a finite number, got {self.clip!r}")
        if self.clip <= 0:
            raise ConfigError(
                f"secure aggregation: clip must be > 0 (updates are clipped to [-clip, clip]), got {self.clip}"
            )
        _check_int("max_weight", self.max_weight, 1)
        if self.quantization_levels is not None:
            _check_int("quantization_levels", self.quantization_levels, 1, MAX_LEVELS)
        deadline = self.stage_deadline_s
        if deadline is not None and (
            isinstance(deadline, bool)
            or not isinstance(deadline, int | float)
            or not math.isfinite(deadline)
            or deadline <= 0
        ):
            raise ConfigError(
                f"secure aggregation: stage_deadline_s must be a finite number of seconds > 0 (or unset for the "
                f"round's deadline), got {deadline!r}"
            )

    def resolve(self, num_clients: int) -> RoundParams:
        """The parameters of a round of ``num_clients`` clients.

        Raises:
            ConfigError: fewer than 2 clients; ``k`` outside ``1..n-1`` or with ``n·k`` odd; ``t`` outside
                ``(k/2, k]``; a bit budget the field cannot hold (says which value to change, and to what).
        """
        n = _check_int("number of clients", num_clients, 2)
        k = default_neighbours(n) if self.neighbours is None else self.neighbours
        if k > n - 1:
            raise ConfigError(f"secure aggregation: {k} neighbours per client need at least {k + 1} clients, got {n}")
        if (n * k) % 2 == 1:
            raise ConfigError(
                f"secure aggregation: a {k}-regular graph on {n} clients does not exist (n·k must be even); "
                f"choose an even number of neighbours ({k - 1} or {k + 1}) or select an even number of clients"
            )
        t = k // 2 + 1 if self.threshold is None else self.threshold
        if not k / 2 < t <= k:
            raise ConfigError(
                f"secure aggregation: threshold {t} with {k} neighbours must satisfy k/2 < t <= k "
                f"(between {k // 2 + 1} and {k}); a lower one lets a server that lies about dropouts unmask a client"
            )
        budget = (1 << self.field_bits) - 1
        fit = budget // (n * self.max_weight)
        if self.quantization_levels is None:
            if fit < 1:
                need = (n * self.max_weight).bit_length()
                raise ConfigError(
                    f"secure aggregation: {n} clients of weight up to {self.max_weight} overflow a field of "
                    f"{self.field_bits} bits; use field_bits >= {need} or a smaller max_weight"
                )
            levels = min(fit, MAX_LEVELS)
        else:
            levels = self.quantization_levels
            if levels > fit:
                need = (n * self.max_weight * levels).bit_length()
                raise ConfigError(
                    f"secure aggregation: the weighted sum of {n} clients (weight <= {self.max_weight}, "
                    f"{levels} quantization levels) could overflow a field of {self.field_bits} bits; use "
                    f"quantization_levels <= {fit}, field_bits >= {need}, or a smaller max_weight"
                )
        return RoundParams(
            num_clients=n,
            neighbours=k,
            threshold=t,
            field_bits=self.field_bits,
            clip=float(self.clip),
            max_weight=self.max_weight,
            levels=levels,
        )

    def check(self, num_clients: int) -> None:
        """Refuse, with ConfigError, a round of ``num_clients`` clients that :meth:`resolve` refuses."""
        self.resolve(num_clients)


def weak_points(params: RoundParams, dropouts: int = 0) -> list[str]:
    """Warnings for SecAgg+ settings that run but protect or survive less than a user would expect, one text each.

    - Threshold 1 (one neighbour): a single share rebuilds a client's mask seeds, so one neighbour colluding with
      the server unmasks that client's update (Bell et al. 2020 take ``k`` of the order of ``log n`` and ``t``
      above ``k / 2`` against such coalitions).
    - ``dropouts`` (the clients a round's DP noise is set to tolerate losing) above ``k - t``: a client whose
      neighbours drop beyond ``k - t`` leaves fewer than ``t`` shares of a seed, and the round is aborted.

    Args:
        params: a round's resolved parameters (:meth:`SecAggConfig.resolve`).
        dropouts: the dropped clients the rounds should survive.
    """
    k, t = params.neighbours, params.threshold
    found = []
    if t == 1:
        found.append(
            f"secure aggregation with {k} neighbour(s) and threshold 1: one neighbour's share rebuilds a client's "
            "masks, so a single client colluding with the server unmasks that client's update; use neighbours >= 3 "
            "(the threshold is then >= 2)"
        )
    if dropouts > k - t:
        found.append(
            f"the rounds are set to tolerate {dropouts} dropped client(s) (privacy.tolerated_dropout), but SecAgg+ "
            f"with {k} neighbours and threshold {t} cannot unmask a client that loses more than {k - t} of its "
            "neighbours: a round with such dropouts is aborted; raise neighbours (--neighbours) or lower the "
            "threshold (--threshold, down to neighbours / 2 + 1)"
        )
    return found
