"""Distributed DP-FedAvg under SecAgg+: the clients clip and add their discrete Gaussian noise shares inside the
field (:mod:`privacy.dp.ddgauss`), the server unmasks only the noisy sum (:mod:`privacy.secagg.rounds`).

:func:`secure_distributed_dp` composes a securely aggregated strategy with DP-FedAvg's distributed mode
(:class:`~privacy.dp.aggregator.DPFedAvgAggregator`, which keeps the accounting):

- the ``secagg`` client mod clips each update to L2 norm C, quantizes it with weight 1 and adds the noise share
  ``N_Z(0, (z Delta / sqrt(n_min))^2)`` before masking (``Delta``: :func:`~privacy.dp.ddgauss.sensitivity`);
- the protocol refuses to unmask a sum of fewer than ``n_min = ceil(m (1 - tolerated_dropout))`` masked inputs:
  after the fit exchange, with fewer survivors the attempt fails before any share is asked for, so the server
  never learns a sum that carries less noise than accounted (the attempt is retried with a fresh selection);
- the aggregator releases McMahan et al.'s fixed-denominator estimate ``w + T / m`` from the unmasked sum
  ``T = sum_k (clip(delta_k) + noise_k)`` of the ``k >= n_min`` survivors, and reports epsilon (the Gaussian
  mechanism of multiplier z, sampled at ``q = m / N``, composed per round), the clipping norm and the noise on the
  average, ``s sqrt(k) / m`` with ``s`` each client's noise in update units.

Dropouts: ``k`` shares carry noise ``z Delta sqrt(k / n_min)``, so a round with exactly ``n_min`` survivors has the
accounted noise and one with more has more (up to ``1 / sqrt(1 - tolerated_dropout)`` times); fewer are refused as
above. The field is checked before any client is contacted (:func:`~privacy.dp.ddgauss.check_field`: wrap-around
and the sum-of-discrete-Gaussians term).

Adaptive clipping (Andrew et al. 2021, Algorithm 1) in this mode: the round's C is announced with the keys (the
``dp_clipping_norm`` round setting); the securely summed spec gains the one-element tensor
:data:`~privacy.dp.ddgauss.COUNT_TENSOR`, on which each client adds ``S b_i + N_Z(0, (S sigma_b / sqrt(n_min))^2)``
with ``b_i = 1[||delta_i|| <= C]`` (:func:`~privacy.dp.ddgauss.count_share`); the server reads only the noisy count
out of the unmasked sum (:func:`~privacy.dp.ddgauss.read_count`) and steps C for the next round
(:meth:`DPFedAvgAggregator.adapt`). The update's share multiplier is ``z_delta / sqrt(n_min)`` with ``z_delta =
(z^-2 - (2 sigma_b)^-2)^(-1/2)``, so the update (multiplier ``z_delta`` on sensitivity Delta) and the count
(``2 sigma_b`` on sensitivity S / 2, the number of contributions being public) together are the Gaussian mechanism
of multiplier z, which is what is accounted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from fedcore.errors import AggregationError, ConfigError
from fedcore.messages import ModSpec
from fedcore.strategy import Strategy
from fedcore.tensors import NamedArrays, TensorSpec
from privacy.dp.aggregator import DPFedAvgAggregator
from privacy.dp.ddgauss import (
    CLIPPING_SETTING,
    COUNT_TENSOR,
    check_count_field,
    check_field,
    count_scale,
    max_clipping_norm,
    min_clipping_norm,
    read_count,
)
from privacy.secagg.config import weak_points
from privacy.secagg.rounds import MOD, SecAggAccumulator, SecAggAggregator, SecureAggregation

log = logging.getLogger("fedcore.privacy")


@dataclass(eq=False)
class _Selection:
    """The number of clients the round loop last checked (``check`` comes right before ``start``)."""

    num_clients: int = 0


@dataclass(frozen=True, eq=False)
class SecureDPAggregator:
    """The aggregator of distributed DP-FedAvg under SecAgg+ (made by :func:`secure_distributed_dp`).

    Attributes:
        secagg: the secure sum's aggregator (its protocol's).
        dp: the distributed-mode DP-FedAvg rule: m, N, z, C, delta, budget, accounting and adaptive clipping.
    """

    secagg: SecAggAggregator
    dp: DPFedAvgAggregator
    selection: _Selection = field(default_factory=_Selection)
    name: str = "dp-secagg"

    def __post_init__(self) -> None:
        if self.dp.mode != "distributed":
            raise ConfigError("under secure aggregation the server cannot clip or noise updates: use dp='distributed'")

    def share_multiplier(self) -> float:
        """Each client's share of the update's noise multiplier: ``z / sqrt(n_min)``, or ``z_delta / sqrt(n_min)``
        with adaptive clipping (:func:`~privacy.dp.mechanism.update_noise_multiplier`)."""
        return self.dp.update_noise_multiplier() / math.sqrt(self.dp.minimum_clients)

    def count_scale(self) -> int:
        """Adaptive clipping: S, the field units of one unclipped update (:func:`~privacy.dp.ddgauss.count_scale`);
        0 with a fixed clipping norm."""
        if self.dp.adaptive is None:
            return 0
        return count_scale(self.dp.adaptive.clipped_count_stddev, self.dp.minimum_clients)

    def count_noise(self) -> float:
        """Adaptive clipping: each client's discrete Gaussian sigma on the count coordinate, ``S sigma_b /
        sqrt(n_min)`` field units (0 with a fixed clipping norm)."""
        if self.dp.adaptive is None:
            return 0.0
        return self.count_scale() * self.dp.adaptive.clipped_count_stddev / math.sqrt(self.dp.minimum_clients)

    def allows(self, round: int) -> bool:
        """As :meth:`DPFedAvgAggregator.allows` (the target epsilon)."""
        return self.dp.allows(round)

    def check(self, num_clients: int) -> None:
        """Refuse a selection the DP rule (more than m, fewer than ``n_min``) or SecAgg+ refuses.

        Raises:
            ConfigError: what does not fit and what to change.
        """
        self.dp.check(num_clients)
        self.secagg.check(num_clients)
        self.selection.num_clients = num_clients

    def superseded_releases(self, count: int) -> None:
        """As :meth:`DPFedAvgAggregator.superseded_releases` (rounds released, then run again)."""
        self.dp.superseded_releases(count)

    def sampled_from(self, round: int, num_clients: int, available: int) -> None:
        """As :meth:`DPFedAvgAggregator.sampled_from` (a round sampling from fewer than N clients)."""
        self.dp.sampled_from(round, num_clients, available)

    def state_dict(self, round: int) -> NamedArrays:
        """As :meth:`DPFedAvgAggregator.state_dict`: adaptive clipping's norm for round ``round + 1``, the raised
        sampling rate."""
        return self.dp.state_dict(round)

    def load_state(self, round: int, state: NamedArrays) -> None:
        """As :meth:`DPFedAvgAggregator.load_state` (a restarted server continues with the stored norm)."""
        self.dp.load_state(round, state)

    def _held(self, norm: float, round: int, clip: float, levels: int, dimension: int, num_clients: int) -> float:
        """An adapted norm held within what the field carries: at most :func:`~privacy.dp.ddgauss.max_clipping_norm`
        (wrap-around), at least :func:`~privacy.dp.ddgauss.min_clipping_norm` (noise too coarse). The configured
        initial norm is returned as it is (:func:`~privacy.dp.ddgauss.check_field` then refuses it if it does not
        fit)."""
        if norm == self.dp.clipping_norm:
            return norm
        share, n_min = self.share_multiplier(), self.dp.minimum_clients
        high = max_clipping_norm(
            share_multiplier=share, clip=clip, levels=levels, dimension=dimension, minimum_clients=n_min
        )
        low = min_clipping_norm(
            share_multiplier=share, clip=clip, levels=levels, dimension=dimension, num_clients=num_clients
        )
        held = min(max(norm, low), high)
        if held != norm:
            log.warning(
                "round %d: adaptive clipping reached C=%.6g, outside [%.6g, %.6g], what the field (clip=%g, %d levels) "
                "carries; the round clips with C=%.6g (raise [strategy.secagg] clip to let C grow, or field_bits to "
                "let it shrink)",
                round,
                norm,
                low,
                high,
                clip,
                levels,
                held,
            )
        return held

    def preflight(self, smallest: int, spec: Sequence[TensorSpec] | None) -> None:
        """Refuse before the first round what every round would refuse (:class:`server.round_loop.Preflighted`):
        SecAgg+'s graph and threshold for rounds of m and of ``n_min`` clients, and with the model's ``spec`` the
        field for the noisy sum at the initial clipping norm (:func:`~privacy.dp.ddgauss.check_field`).
        ``smallest`` (the strategy's min_fit_clients) is not used: a round selects m clients, and one of fewer than
        ``n_min`` is refused by :meth:`check` whatever the settings.

        Settings that run but protect or survive less are logged (:func:`~privacy.secagg.config.weak_points`: a
        threshold of 1, fewer tolerated neighbour dropouts than ``tolerated_dropout`` promises).

        Raises:
            ConfigError: what to change, as :meth:`start` says it at round 1.
        """
        dp = self.dp
        self.secagg.config.check(dp.minimum_clients)  # the smallest round released (m itself without dropout)
        if spec is not None:
            self._checked(spec, dp.expected_clients, 1)  # resolves SecAgg+ for m too
        params = self.secagg.config.resolve(dp.expected_clients)
        for warning in weak_points(params, dropouts=dp.expected_clients - dp.minimum_clients):
            log.warning("%s", warning)

    def _checked(self, spec: Sequence[TensorSpec], n: int, round: int) -> tuple[float, float, tuple[TensorSpec, ...]]:
        """A round of ``n`` clients: the sum's noise standard deviation, the clipping norm and the secure sum's
        spec (the model's, plus the count with adaptive clipping), once the field was checked for them.

        Raises:
            ConfigError: the field cannot carry the noisy sum or the noisy count, or SecAgg+ refuses ``n``.
        """
        dp = self.dp
        params = self.secagg.config.resolve(n)
        dimension = sum(int(np.prod(s.shape, dtype=np.int64)) for s in spec)
        clipping_norm = dp.clipping_norm_for(round)
        secure_spec = tuple(spec)
        if dp.adaptive is not None:
            check_count_field(
                scale=self.count_scale(),
                sigma=self.count_noise(),
                num_clients=max(n, dp.expected_clients),
                field_bits=params.field_bits,
            )
            clipping_norm = self._held(clipping_norm, round, params.clip, params.levels, dimension, n)
            secure_spec += (TensorSpec(COUNT_TENSOR, (1,), "float64"),)
        noise = check_field(
            share_multiplier=self.share_multiplier(),
            clipping_norm=clipping_norm,
            clip=params.clip,
            levels=params.levels,
            dimension=dimension,
            minimum_clients=dp.minimum_clients,
            num_clients=n,
        )
        return noise, clipping_norm, secure_spec

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> SecureDPAccumulator:
        """The round's accumulator, after the field was checked for the noise (before any client is contacted).

        With adaptive clipping the round's norm (:meth:`DPFedAvgAggregator.clipping_norm_for`) is announced to the
        clients with the keys; an adapted norm outside what the field carries is held at the nearer limit (logged;
        :meth:`_held`), the configured initial norm is refused instead, as a fixed one is.

        Raises:
            BudgetExhausted: releasing round ``round`` would exceed the target epsilon.
            ConfigError: a field that cannot carry the noisy sum (:func:`~privacy.dp.ddgauss.check_field`) or the
                noisy count (:func:`~privacy.dp.ddgauss.check_count_field`), or what the secure sum refuses.
        """
        dp = self.dp
        spent = dp.spend(round)
        n = self.selection.num_clients or dp.expected_clients
        noise, clipping_norm, secure_spec = self._checked(spec, n, round)
        inner = self.secagg.start(secure_spec, round=round, reference=reference)
        if dp.adaptive is not None:
            inner.settings[CLIPPING_SETTING] = clipping_norm
        return SecureDPAccumulator(
            self, inner, tuple(spec), epsilon=spent, noise_stddev=noise, clipping_norm=clipping_norm
        )


class SecureDPAccumulator:
    """One round of :class:`SecureDPAggregator` (an :class:`~fedcore.aggregation.Accumulator` with ``report``)."""

    def __init__(
        self,
        rule: SecureDPAggregator,
        inner: SecAggAccumulator,
        spec: tuple[TensorSpec, ...],
        *,
        epsilon: float,
        noise_stddev: float,
        clipping_norm: float,
    ):
        self._rule = rule
        self._inner = inner
        self._spec = spec
        self._epsilon = epsilon
        self._noise_stddev = noise_stddev
        self._clipping_norm = clipping_norm
        self._noise_on_average = 0.0
        self._unclipped: float | None = None

    @property
    def count(self) -> int:
        """Masked uploads taken so far."""
        return self._inner.count

    @property
    def noisy_unclipped(self) -> float | None:
        """Adaptive clipping, after :meth:`result`: the noisy count of unclipped updates the secure sum revealed
        (``sum_k b_k`` plus noise of standard deviation ``sigma_b sqrt(k / n_min)``); None before or without."""
        return self._unclipped

    def add(
        self, update: Mapping[str, np.ndarray], weight: float, *, client_id: str | None = None, round: int | None = None
    ) -> None:
        """Hand one masked upload to the secure sum (:meth:`SecAggAccumulator.add`)."""
        self._inner.add(update, weight, client_id=client_id, round=round)

    def result(self, *, release: bool = False) -> NamedArrays:
        """``w + T / m`` (T: the unmasked noisy sum of the survivors' clipped updates), in the spec's dtypes; with
        adaptive clipping, also the next round's norm from the noisy count (:meth:`DPFedAvgAggregator.adapt`).

        Raises:
            AggregationError: the round protocol never ran, or fewer than ``n_min`` updates are in the sum.
        """
        dp, inner = self._rule.dp, self._inner
        if inner.server is None:
            raise AggregationError("secure aggregation: the round protocol never started", round=inner.round)
        outcome = inner.server.result
        k = outcome.total_weight
        if k < dp.minimum_clients:
            raise AggregationError(
                f"only {k} updates are in the secure sum but distributed DP needs n_min={dp.minimum_clients} noise "
                "shares; the round is not released",
                round=inner.round,
            )
        self._noise_on_average = self._noise_stddev * math.sqrt(k) / dp.expected_clients
        m = dp.expected_clients
        out: NamedArrays = {}
        for s in self._spec:
            total = outcome.weighted_sum[s.name]
            out[s.name] = (np.asarray(inner.reference[s.name], dtype=np.float64) + total / m).astype(s.dtype)
        if dp.adaptive is not None:
            self._unclipped = read_count(outcome.field_sum, inner.server.params.field_bits, self._rule.count_scale())
            dp.adapt(inner.round, self._clipping_norm, self._unclipped)
        return out

    def report(self) -> Mapping[str, float]:
        """``epsilon`` (spent by the rounds released so far, this one included), ``dp_clipping_norm`` (the norm
        this round clipped with), ``dp_noise_std`` (the noise's standard deviation on the average, in update
        units) and, with adaptive clipping, ``dp_unclipped`` (:attr:`noisy_unclipped`, a DP release itself)."""
        figures = {
            "epsilon": self._epsilon,
            "dp_clipping_norm": float(self._clipping_norm),
            "dp_noise_std": self._noise_on_average,
        }
        if self._unclipped is not None:
            figures["dp_unclipped"] = self._unclipped
        return figures


def secure_distributed_dp(strategy: Strategy, dp: DPFedAvgAggregator) -> Strategy:
    """``strategy`` (securely aggregated, :func:`privacy.secagg.rounds.secure_aggregation`) with distributed
    DP-FedAvg: uniform weights, the ``secagg`` mod clipping and adding the noise shares (and, with adaptive
    clipping, its noisy clipped-count bit), the protocol refusing to unmask fewer than ``n_min`` inputs, and
    :class:`SecureDPAggregator`.

    Raises:
        ConfigError: the strategy is not securely aggregated, or ``dp`` is not in distributed mode.
    """
    protocol = strategy.protocol
    if not isinstance(protocol, SecureAggregation) or not isinstance(strategy.aggregator, SecAggAggregator):
        raise ConfigError("secure_distributed_dp needs a strategy built with secure_aggregation")
    aggregator = SecureDPAggregator(strategy.aggregator, dp)
    params: dict[str, bool | int | float | str] = {
        "weighting": "uniform",
        "clipping_norm": float(dp.clipping_norm),
        "noise_multiplier": aggregator.share_multiplier(),
    }
    if dp.adaptive is not None:
        params |= {"count_scale": aggregator.count_scale(), "count_noise": aggregator.count_noise()}
    mods = tuple(ModSpec(MOD, params) if spec.name == MOD else spec for spec in strategy.mods)
    return replace(
        strategy,
        weighting="uniform",
        aggregator=aggregator,
        protocol=replace(protocol, minimum_inputs=dp.minimum_clients),
        mods=mods,
    )
