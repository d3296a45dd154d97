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
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from fedcore.errors import AggregationError, ConfigError
from fedcore.messages import ModSpec
from fedcore.strategy import Strategy
from fedcore.tensors import NamedArrays, TensorSpec
from privacy.dp.aggregator import DPFedAvgAggregator
from privacy.dp.ddgauss import check_field
from privacy.secagg.rounds import MOD, SecAggAccumulator, SecAggAggregator, SecureAggregation


@dataclass(eq=False)
class _Selection:
    """The number of clients the round loop last checked (``check`` comes right before ``start``)."""

    num_clients: int = 0


@dataclass(frozen=True, eq=False)
class SecureDPAggregator:
    """The aggregator of distributed DP-FedAvg under SecAgg+ (made by :func:`secure_distributed_dp`).

    Attributes:
        secagg: the secure sum's aggregator (its protocol's).
        dp: the distributed-mode DP-FedAvg rule: m, N, z, C, delta, budget and accounting.
    """

    secagg: SecAggAggregator
    dp: DPFedAvgAggregator
    selection: _Selection = field(default_factory=_Selection)
    name: str = "dp-secagg"

    def __post_init__(self) -> None:
        if self.dp.mode != "distributed":
            raise ConfigError("under secure aggregation the server cannot clip or noise updates: use dp='distributed'")

    def share_multiplier(self) -> float:
        """Each client's share of the noise multiplier, ``z / sqrt(n_min)``."""
        return self.dp.noise_multiplier / math.sqrt(self.dp.minimum_clients)

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

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> SecureDPAccumulator:
        """The round's accumulator, after the field was checked for the noise (before any client is contacted).

        Raises:
            BudgetExhausted: releasing round ``round`` would exceed the target epsilon.
            ConfigError: a field that cannot carry the noisy sum (:func:`~privacy.dp.ddgauss.check_field`), or
                what the secure sum refuses.
        """
        spent = self.dp.spend(round)
        n = self.selection.num_clients or self.dp.expected_clients
        params = self.secagg.config.resolve(n)
        noise = check_field(
            share_multiplier=self.share_multiplier(),
            clipping_norm=self.dp.clipping_norm,
            clip=params.clip,
            levels=params.levels,
            dimension=sum(int(np.prod(s.shape, dtype=np.int64)) for s in spec),
            minimum_clients=self.dp.minimum_clients,
            num_clients=n,
        )
        inner = self.secagg.start(spec, round=round, reference=reference)
        return SecureDPAccumulator(self, inner, epsilon=spent, noise_stddev=noise)


class SecureDPAccumulator:
    """One round of :class:`SecureDPAggregator` (an :class:`~fedcore.aggregation.Accumulator` with ``report``)."""

    def __init__(self, rule: SecureDPAggregator, inner: SecAggAccumulator, *, epsilon: float, noise_stddev: float):
        self._rule = rule
        self._inner = inner
        self._epsilon = epsilon
        self._noise_stddev = noise_stddev
        self._noise_on_average = 0.0

    @property
    def count(self) -> int:
        """Masked uploads taken so far."""
        return self._inner.count

    def add(
        self, update: Mapping[str, np.ndarray], weight: float, *, client_id: str | None = None, round: int | None = None
    ) -> None:
        """Hand one masked upload to the secure sum (:meth:`SecAggAccumulator.add`)."""
        self._inner.add(update, weight, client_id=client_id, round=round)

    def result(self, *, release: bool = False) -> NamedArrays:
        """``w + T / m`` (T: the unmasked noisy sum of the survivors' clipped updates), in the spec's dtypes.

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
        for s in inner.spec:
            total = outcome.weighted_sum[s.name]
            out[s.name] = (np.asarray(inner.reference[s.name], dtype=np.float64) + total / m).astype(s.dtype)
        return out

    def report(self) -> Mapping[str, float]:
        """``epsilon`` (spent by the rounds released so far, this one included), ``dp_clipping_norm`` and
        ``dp_noise_std`` (the noise's standard deviation on the average, in update units)."""
        return {
            "epsilon": self._epsilon,
            "dp_clipping_norm": float(self._rule.dp.clipping_norm),
            "dp_noise_std": self._noise_on_average,
        }


def secure_distributed_dp(strategy: Strategy, dp: DPFedAvgAggregator) -> Strategy:
    """``strategy`` (securely aggregated, :func:`privacy.secagg.rounds.secure_aggregation`) with distributed
    DP-FedAvg: uniform weights, the ``secagg`` mod clipping and adding the noise shares, the protocol refusing to
    unmask fewer than ``n_min`` inputs, and :class:`SecureDPAggregator`.

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
    mods = tuple(ModSpec(MOD, params) if spec.name == MOD else spec for spec in strategy.mods)
    return replace(
        strategy,
        weighting="uniform",
        aggregator=aggregator,
        protocol=replace(protocol, minimum_inputs=dp.minimum_clients),
        mods=mods,
    )
