"""DP-FedAvg on the server: an :class:`~fedcore.aggregation.Aggregator` that wraps the streaming mean.

Each round the accumulator takes every accepted update ``w_k``, forms ``delta_k = w_k - w`` against the global
model ``w`` the round started from (``reference``), and folds ``delta_k`` with weight 1 into a
:class:`~fedcore.aggregation.WeightedMean` over float64 tensors. The result is McMahan et al. 2018's
*fixed-denominator* estimator with uniform weights (their ``f~_f`` with every ``w_k = 1``, so ``q W = m``)::

    w_next = w + (sum_k clip(delta_k, C) + N(0, (z C)^2 I)) / m

with ``m`` the expected number of clients per round, not the number that replied: the denominator does not depend
on who took part, so the sum's sensitivity ``C`` bounds the average's at ``C / m``. The server optimizer then steps
from this model as from any average (``ServerSGD(lr=1)`` gives ``w_next``).

Two modes (:class:`DPFedAvgAggregator`):

- ``"central"``: the trusted server clips each update (fixed C, or adaptive clipping, :mod:`privacy.dp.mechanism`)
  and adds the noise to the sum.
- ``"distributed"``: the clients clip and add their noise shares (:mod:`privacy.dp.distributed`); the server only
  sums, and refuses to release a sum of fewer than ``n_min = ceil(m (1 - tolerated_dropout))`` updates, whose
  noise would be below ``z C``.

Floating tensors are privatized; integer tensors (e.g. BatchNorm's ``num_batches_tracked``) keep the global
model's value, so nothing of a client's data reaches them. After each released round the accumulator reports the
epsilon spent so far (:mod:`privacy.dp.accounting`), and a round whose release would exceed ``target_epsilon`` is
refused before any client is contacted (:class:`~fedcore.errors.BudgetExhausted`: the run ends with the last round
within budget). The epsilon is a function of the number of rounds released, so a round trained again after a server
restart (resumed from the checkpoint before it) is counted once, unless it had been recorded before (its checkpoint
damaged) or its model had been sent to federated evaluation's clients before the server stopped: then both releases
count (:meth:`DPFedAvgAggregator.superseded_releases`). Adaptive clipping's norm is
kept in each checkpoint (:meth:`DPFedAvgAggregator.state_dict`), so a restarted server clips with the norm the run
had reached.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from fedcore.aggregation import WeightedMean
from fedcore.errors import AggregationError, BudgetExhausted, ConfigError, PayloadError, StateError, UpdateRejected
from fedcore.messages import bound_text
from fedcore.tensors import UPDATE_ADVICE, NamedArrays, TensorSpec, check_finite, check_spec
from privacy.dp.accounting import Accountant, epsilon
from privacy.dp.accounting import check as check_accounting
from privacy.dp.mechanism import (
    AdaptiveClipping,
    clip_update,
    gaussian_noise,
    minimum_contributors,
    noise_share_stddev,
    update_noise_multiplier,
)

log = logging.getLogger("fedcore.privacy")

DPMode = Literal["central", "distributed"]
STATE_NORM = "dp_clipping_norm"
"""The checkpointed state's key: adaptive clipping's norm for the round after the checkpoint."""
STATE_RATE = "dp_sampling_rate"
"""The checkpointed state's key: the sampling rate the accountant composes, when a round sampled from fewer than N
clients raised it above m / N (:meth:`DPFedAvgAggregator.sampled_from`)."""


@dataclass
class _Releases:
    """What the accountant learns as a run goes on (mutable, inside the frozen :class:`DPFedAvgAggregator`).

    Attributes:
        rate: the highest ``m / available`` of a round that sampled from fewer than N clients; 0.0: none did.
        superseded: rounds released and then run again (:meth:`DPFedAvgAggregator.superseded_releases`).
    """

    rate: float = 0.0
    superseded: int = 0


@dataclass(frozen=True, kw_only=True, eq=False)
class DPFedAvgAggregator:
    """Client-level DP-FedAvg's aggregation (see the module docstring).

    Attributes:
        mode: ``"central"`` (the server clips and adds noise) or ``"distributed"`` (the clients do).
        clipping_norm: C > 0 (the initial C with adaptive clipping).
        noise_multiplier: z > 0; with adaptive clipping the total over both queries (Andrew et al. 2021).
        expected_clients: m >= 1, the clients selected per round (the fixed denominator).
        population: N >= m, the clients rounds sample from (sampling rate q = m / N for the accountant).
        delta: the delta epsilon is reported for, in (0, 1).
        target_epsilon: stop before a round whose epsilon would exceed it (None: no budget).
        accountant: ``"rdp"`` or ``"pld"`` (:mod:`privacy.dp.accounting`).
        adaptive: adaptive clipping settings, or None for a fixed C. In distributed mode only under secure
            aggregation (:class:`~privacy.dp.secure.SecureDPAggregator` learns the noisy unclipped count from the
            secure sum); this aggregator's own :meth:`start` refuses it there.
        tolerated_dropout: distributed mode: the fraction of the m clients that may drop out while the sum still
            carries noise ``z C`` (each share is raised to ``z C / sqrt(n_min)``).
        threads: fold threads of the wrapped streaming mean (None: its default).

    Raises:
        ConfigError: a value out of range (``2 sigma_b <= z`` with adaptive clipping).
    """

    mode: DPMode
    clipping_norm: float
    noise_multiplier: float
    expected_clients: int
    population: int
    delta: float = 1e-5
    target_epsilon: float | None = None
    accountant: Accountant = "rdp"
    adaptive: AdaptiveClipping | None = None
    tolerated_dropout: float = 0.0
    threads: int | None = None
    name: str = "dp-fedavg"
    _norms: dict[int, float] = field(default_factory=dict, repr=False)
    _epsilons: dict[tuple[int, float], float] = field(default_factory=dict, repr=False)
    _spent: _Releases = field(default_factory=_Releases, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ("central", "distributed"):
            raise ConfigError(f"dp mode must be 'central' or 'distributed', got {self.mode!r}")
        noise_share_stddev(self.noise_multiplier, self.clipping_norm, self.expected_clients, self.tolerated_dropout)
        if isinstance(self.population, bool) or not isinstance(self.population, int):
            raise ConfigError(f"the client population must be an integer, got {self.population!r}")
        if self.population < self.expected_clients:
            raise ConfigError(
                f"the client population N={self.population} is smaller than the clients per round m="
                f"{self.expected_clients}; give the number of clients rounds sample from"
            )
        if self.mode == "central" and self.tolerated_dropout:
            raise ConfigError("tolerated_dropout applies to distributed mode (central mode adds all the noise itself)")
        if self.adaptive is not None:
            update_noise_multiplier(self.noise_multiplier, self.adaptive.clipped_count_stddev)
        if self.target_epsilon is not None and not (math.isfinite(self.target_epsilon) and self.target_epsilon > 0):
            raise ConfigError(f"target_epsilon must be a finite number > 0, got {self.target_epsilon!r}")
        check_accounting(
            noise_multiplier=self.noise_multiplier,
            sampling_rate=self.sampling_rate,
            delta=self.delta,
            accountant=self.accountant,
        )
        if self.target_epsilon is not None and not self.allows(1):  # known now: no round could ever be released
            raise ConfigError(
                f"target_epsilon {self.target_epsilon:g} cannot pay for one round: a round spends epsilon "
                f"{self.epsilon_after(1):.4g} at noise multiplier {self.noise_multiplier:g}, sampling rate "
                f"{self.expected_clients}/{self.population} and delta {self.delta:g}; raise privacy.target_epsilon "
                "(--target-epsilon) to at least that, raise privacy.noise_multiplier (--noise-multiplier), or select "
                "fewer clients a round (--fraction-fit, --min-fit-clients)"
            )
        self._norms.setdefault(1, float(self.clipping_norm))

    @property
    def sampling_rate(self) -> float:
        """q, the rate the accountant composes for every round: m / N, or the highest rate of a round that sampled
        from fewer than N clients (:meth:`sampled_from`), if higher."""
        return max(self.expected_clients / self.population, self._spent.rate)

    def sampled_from(self, round: int, num_clients: int, available: int) -> None:
        """Account for round ``round`` selecting ``num_clients`` of the ``available`` clients it could select.

        The accountant's rate m / N assumes every round samples from N clients. A round that samples from fewer
        (a deployment where only some of the N are connected) gives each of them a higher chance, ``num_clients /
        available``: from then on every round is composed at that rate, an upper bound on what each round spent
        (epsilon grows with q), and it is logged once per rise. A restarted server continues at the rate kept in
        the checkpoint (:meth:`state_dict`).
        """
        if available >= self.population or available < 1:
            return
        rate = min(1.0, num_clients / available)
        if rate <= self.sampling_rate:
            return
        log.warning(
            "round %d selects %d of the %d clients connected, not of the population N=%d (--population): epsilon "
            "is now composed at sampling rate %d/%d = %.4g for every round (was %.4g), an upper bound; connect "
            "the %d clients for the rate m/N",
            round,
            num_clients,
            available,
            self.population,
            num_clients,
            available,
            rate,
            self.sampling_rate,
            self.population,
        )
        self._spent.rate = rate

    @property
    def minimum_clients(self) -> int:
        """The fewest updates a round may be released from: m in central mode's accounting, ``n_min`` in
        distributed mode (:func:`~privacy.dp.mechanism.minimum_contributors`)."""
        return minimum_contributors(self.expected_clients, self.tolerated_dropout)

    def update_noise_multiplier(self) -> float:
        """The noise multiplier applied to the update sum: z, or ``z_delta`` with adaptive clipping."""
        if self.adaptive is None:
            return float(self.noise_multiplier)
        return update_noise_multiplier(self.noise_multiplier, self.adaptive.clipped_count_stddev)

    def share_stddev(self) -> float:
        """Distributed mode: each client's noise standard deviation ``z C / sqrt(n_min)``."""
        return noise_share_stddev(
            self.noise_multiplier, self.clipping_norm, self.expected_clients, self.tolerated_dropout
        )

    def superseded_releases(self, count: int) -> None:
        """Count ``count`` rounds that were released (recorded, their model evaluated) and then run again, when a
        restarted run fell back past their damaged checkpoints (:meth:`server.state.StateStore.superseded_rounds`):
        each rerun draws fresh noise, so each is a release of its own, and :meth:`epsilon_after` composes them too.
        So are rounds whose model was sent to federated evaluation's clients before the process died unrecorded
        (:meth:`server.state.StateStore.record_release`). A round that was trained but neither recorded nor sent
        out (the process died first) released nothing and counts once."""
        self._spent.superseded = int(count)

    def epsilon_after(self, rounds: int) -> float:
        """The epsilon at :attr:`delta` once rounds 1..``rounds`` have been released, with the superseded
        releases (:meth:`superseded_releases`); computed once per count."""
        releases = rounds + self._spent.superseded if rounds > 0 else 0
        known = self._epsilons.get((releases, self.sampling_rate))
        if known is not None:
            return known
        spent = self._epsilons[releases, self.sampling_rate] = epsilon(
            noise_multiplier=self.noise_multiplier,
            sampling_rate=self.sampling_rate,
            rounds=releases,
            delta=self.delta,
            accountant=self.accountant,
        )
        return spent

    def allows(self, round: int) -> bool:
        """Whether releasing round ``round`` keeps epsilon within :attr:`target_epsilon` (always without one); the
        round loop stops after the last round allowed (:class:`server.round_loop.Budgeted`)."""
        return self.target_epsilon is None or self.epsilon_after(round) <= self.target_epsilon

    def spend(self, round: int) -> float:
        """The epsilon spent once round ``round`` is released.

        Raises:
            BudgetExhausted: it would exceed :attr:`target_epsilon`.
        """
        spent = self.epsilon_after(round)
        if not self.allows(round):
            raise BudgetExhausted(
                f"round {round} would spend epsilon {spent:.4g} > target_epsilon {self.target_epsilon} "
                f"(delta {self.delta}); training stops with the model of round {round - 1}",
                round=round,
            )
        return spent

    def clipping_norm_for(self, round: int) -> float:
        """The clipping norm of ``round``: fixed, or adaptive clipping's from the last round aggregated (by this
        process, or restored from a checkpoint by :meth:`load_state`)."""
        known = [r for r in self._norms if r <= round]
        return self._norms[max(known)] if known else float(self.clipping_norm)

    def adapt(self, round: int, clipping_norm: float, noisy_count: float) -> float:
        """Adaptive clipping's step after round ``round`` (Andrew et al. 2021, Algorithm 1): round ``round + 1``
        clips with ``clipping_norm * exp(-eta_C (noisy_count / m - gamma))``, which is returned and kept for
        :meth:`clipping_norm_for` and :meth:`state_dict`.

        Args:
            round: the round just aggregated.
            clipping_norm: the norm that round clipped with.
            noisy_count: its count of unclipped updates with the count's noise already added.

        Raises:
            ConfigError: no adaptive clipping configured, or values :meth:`AdaptiveClipping.step` refuses.
        """
        if self.adaptive is None:
            raise ConfigError("adapt() needs adaptive clipping (the aggregator has a fixed clipping norm)")
        following = self.adaptive.step(clipping_norm, noisy_count, self.expected_clients)
        self._norms[round + 1] = following
        return following

    def state_dict(self, round: int) -> NamedArrays:
        """What a checkpoint of round ``round`` keeps (:class:`server.round_loop.Stateful`): with adaptive clipping,
        ``dp_clipping_norm``, the norm round ``round + 1`` clips with; ``dp_sampling_rate`` when a round sampled
        from fewer than N clients raised the accountant's rate (:meth:`sampled_from`); float64 scalars. Otherwise
        the epsilon needs no state: it is a function of the number of rounds released."""
        state: NamedArrays = {}
        if self.adaptive is not None:
            state[STATE_NORM] = np.array(self.clipping_norm_for(round + 1), dtype=np.float64)
        if self._spent.rate:
            state[STATE_RATE] = np.array(self.sampling_rate, dtype=np.float64)
        return state

    def load_state(self, round: int, state: NamedArrays) -> None:
        """Continue after round ``round`` with the clipping norm a checkpoint kept (:meth:`state_dict`); a
        checkpoint without one (fixed clipping, or written before the norm was kept) leaves the initial norm.

        A kept sampling rate (:meth:`sampled_from`) is restored: epsilon goes on at the rate the run had reached.

        Raises:
            StateError: the stored norm is not one finite number > 0, or the stored rate not one in (0, 1].
        """
        self._spent.rate = 0.0
        if STATE_RATE in state:
            stored_rate = np.asarray(state[STATE_RATE])
            rate = float(stored_rate) if stored_rate.size == 1 and stored_rate.dtype.kind == "f" else math.nan
            if not 0 < rate <= 1:
                raise StateError(
                    f"the checkpoint of round {round} holds a DP sampling rate that is not one number in (0, 1] "
                    f"({bound_text(repr(stored_rate.tolist()), 60)}); restore an intact checkpoint or start a new run"
                )
            self._spent.rate = rate
        if self.adaptive is None or STATE_NORM not in state:
            if self.adaptive is not None and round > 0:
                log.warning(
                    "the checkpoint of round %d holds no adaptive clipping norm; round %d clips with the initial %g",
                    round,
                    round + 1,
                    self.clipping_norm,
                )
            return
        stored = np.asarray(state[STATE_NORM])
        norm = float(stored) if stored.size == 1 and stored.dtype.kind == "f" else math.nan
        if not (math.isfinite(norm) and norm > 0):
            raise StateError(
                f"the checkpoint of round {round} holds an adaptive clipping norm that is not a finite number > 0 "
                f"({bound_text(repr(stored.tolist()), 60)}); restore an intact checkpoint or start a new run"
            )
        self._norms.clear()
        self._norms[round + 1] = norm

    def check(self, num_clients: int) -> None:
        """Refuse a round that selects more than m clients (a higher sampling rate than the accountant assumes)
        or, in distributed mode, fewer than ``n_min`` (the sum would carry too little noise).

        Raises:
            ConfigError: what does not fit and what to change.
        """
        if num_clients > self.expected_clients:
            raise ConfigError(
                f"the round selects {num_clients} clients but DP-FedAvg accounts for m={self.expected_clients} per "
                f"round (sampling rate {self.expected_clients}/{self.population}); lower the clients per round or "
                "configure the privacy settings for the clients connected"
            )
        if self.mode == "distributed" and num_clients < self.minimum_clients:
            raise ConfigError(
                f"the round selects {num_clients} clients but distributed DP needs at least n_min="
                f"{self.minimum_clients} noise shares (m={self.expected_clients}, tolerated dropout "
                f"{self.tolerated_dropout}); wait for more clients or raise tolerated_dropout"
            )

    def start(
        self, spec: Sequence[TensorSpec], *, round: int, reference: Mapping[str, np.ndarray] | None = None
    ) -> DPFedAvgAccumulator:
        """The round's accumulator around the global model ``reference``.

        Raises:
            BudgetExhausted: releasing round ``round`` would exceed :attr:`target_epsilon`.
            ConfigError: no ``reference``, or one that does not fit ``spec``.
        """
        if self.mode == "distributed" and self.adaptive is not None:
            raise ConfigError(
                "adaptive clipping in distributed mode needs the clients' noisy unclipped count, which only the "
                "secure sum carries: enable secure aggregation (--secure-aggregation) or use a fixed clipping_norm"
            )
        spent = self.spend(round)
        if reference is None:
            raise ConfigError("DP-FedAvg clips each update's difference from the global model: pass reference=")
        return DPFedAvgAccumulator(self, spec, reference, round=round, epsilon=spent)


class DPFedAvgAccumulator:
    """One round of :class:`DPFedAvgAggregator` (implements :class:`~fedcore.aggregation.Accumulator`, plus
    :meth:`report`). Not thread-safe, like the streaming mean it wraps."""

    def __init__(
        self,
        rule: DPFedAvgAggregator,
        spec: Sequence[TensorSpec],
        reference: Mapping[str, np.ndarray],
        *,
        round: int,
        epsilon: float,
    ) -> None:
        self._rule = rule
        self._spec = tuple(spec)
        try:
            check_spec(reference, self._spec)
            check_finite(reference)
        except PayloadError as exc:
            raise ConfigError(f"the global model cannot be the reference of DP-FedAvg: {exc}") from None
        self._reference = reference
        self._floating = tuple(s for s in self._spec if np.dtype(s.dtype).kind == "f")
        if not self._floating:
            raise ConfigError("DP-FedAvg needs a model with floating tensors; this one has none")
        self._sum = WeightedMean([TensorSpec(s.name, s.shape, "float64") for s in self._floating], threads=rule.threads)
        self._round = round
        self._epsilon = epsilon
        self._clipping_norm = rule.clipping_norm_for(round)
        self._unclipped = 0
        self._noise_std = 0.0
        self._nonfinite_advice = _nonfinite_advice(rule, round)

    @property
    def count(self) -> int:
        """Updates accepted so far."""
        return self._sum.count

    def add(
        self, update: Mapping[str, np.ndarray], weight: float, *, client_id: str | None = None, round: int | None = None
    ) -> None:
        """Validate one client's model, form its update against the global model and fold it (clipped first in
        central mode) with weight 1.

        Raises:
            UpdateRejected: ``weight`` is not 1 (DP-FedAvg weights every update alike: weighting "uniform").
            PayloadError, NonFiniteError: the model does not fit the round's spec or holds NaN/Inf.
        """
        if weight != 1.0:
            raise UpdateRejected(f"DP-FedAvg weights every update 1, got weight {weight!r}; use weighting = 'uniform'")
        check_spec(update, self._spec, round=round, client_id=client_id)
        check_finite(update, round=round, client_id=client_id, advice=self._nonfinite_advice)
        delta = {
            s.name: np.asarray(update[s.name], dtype=np.float64) - np.asarray(self._reference[s.name], dtype=np.float64)
            for s in self._floating
        }
        if self._rule.mode == "central":
            delta, norm = clip_update(delta, self._clipping_norm)
            self._unclipped += norm <= self._clipping_norm
        self._sum.add(delta, 1.0, client_id=client_id, round=round)

    def result(self, *, release: bool = False) -> NamedArrays:
        """``w + (sum of the (clipped) updates + noise) / m`` in the spec's dtypes (integer tensors: ``w``'s).

        Raises:
            AggregationError: no update, or (distributed mode) fewer than ``n_min`` updates: the sum would carry
                less noise than accounted, so nothing is released.
        """
        rule, k = self._rule, self._sum.count
        if k == 0:
            raise AggregationError("no update to aggregate")
        if rule.mode == "distributed" and k < rule.minimum_clients:
            raise AggregationError(
                f"only {k} updates arrived but distributed DP needs n_min={rule.minimum_clients} noise shares for "
                f"noise z*C on the sum; the round is not released (raise tolerated_dropout to tolerate more dropouts)"
            )
        mean = self._sum.result(release=release)
        rng = np.random.default_rng()  # OS entropy: the noise must not be derivable from the run's seed
        if rule.mode == "central":
            std = rule.update_noise_multiplier() * self._clipping_norm
            noise = gaussian_noise({s.name: s.shape for s in self._floating}, std, rng)
            self._noise_std = std / rule.expected_clients
        else:
            noise = {}
            self._noise_std = rule.share_stddev() * math.sqrt(k) / rule.expected_clients
        out: NamedArrays = {}
        for s in self._spec:
            ref = np.asarray(self._reference[s.name])
            if s.name not in mean:
                out[s.name] = np.array(ref, copy=True)
                continue
            total = mean[s.name] * k
            if s.name in noise:
                total += noise[s.name]
            out[s.name] = (ref.astype(np.float64) + total / rule.expected_clients).astype(s.dtype)
        if rule.adaptive is not None:
            count_noise = float(rng.normal(0.0, rule.adaptive.clipped_count_stddev))
            rule.adapt(self._round, self._clipping_norm, self._unclipped + count_noise)
        return out

    def report(self) -> Mapping[str, float]:
        """The round's privacy figures for its record (after :meth:`result`): ``epsilon`` spent by the rounds
        released so far (this one included), the clipping norm used, and the standard deviation of the noise on
        the average (``dp_noise_std``)."""
        return {
            "epsilon": self._epsilon,
            "dp_clipping_norm": self._clipping_norm,
            "dp_noise_std": self._noise_std,
        }


def _nonfinite_advice(rule: DPFedAvgAggregator, round: int) -> str:
    """What a non-finite update of round ``round`` means: from round 2 on, the global model the client trained
    from carries the noise of the rounds released before, which can break a model whose weights cannot take it
    (the client's learning rate and data are then not the cause)."""
    if round <= 1:
        return UPDATE_ADVICE
    z, c = rule.update_noise_multiplier(), rule.clipping_norm_for(round - 1)
    return (
        f"the update is rejected. The global model it was trained from carries DP-FedAvg's noise (standard "
        f"deviation {z * c / rule.expected_clients:.3g} per coordinate a round: noise multiplier {z:g} times "
        f"clipping norm {c:g} over {rule.expected_clients} clients a round). If many clients' updates are not "
        "finite, that noise is too large for this model: select more clients a round (--min-fit-clients, "
        "--fraction-fit), or lower --clipping-norm or --noise-multiplier (epsilon rises with a lower noise "
        "multiplier). Otherwise check the client's learning rate and input data."
    )
