"""The ``[privacy]`` table of a recipe or server config, and :func:`apply_dp`, which turns a strategy into
client-level DP-FedAvg (McMahan et al. 2018) in central or distributed mode.

``apply_dp`` composes (STYLE.md §2): it keeps the strategy's sampling, local training and server optimizer, and
replaces how updates are combined (:class:`~privacy.dp.aggregator.DPFedAvgAggregator`, uniform weights) and, in
distributed mode, prepends the ``dp-clip`` client mod (:mod:`privacy.dp.distributed`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Literal

from fedcore.aggregation import MeanAggregator
from fedcore.errors import ConfigError
from fedcore.messages import ModSpec
from fedcore.strategy import Strategy
from privacy.dp.accounting import ACCOUNTANTS, MAX_NOISE_MULTIPLIER, Accountant
from privacy.dp.aggregator import DPFedAvgAggregator, DPMode
from privacy.dp.distributed import MOD_NAME
from privacy.dp.mechanism import AdaptiveClipping
from privacy.secagg.codec import PROTOCOL as SECAGG_PROTOCOL


@dataclass(frozen=True, kw_only=True)
class PrivacyConfig:
    """Client-level differential privacy settings (the ``[privacy]`` table).

    Attributes:
        dp: ``"off"``, ``"central"`` (the trusted server clips every update and adds the noise) or
            ``"distributed"`` (each client clips and adds its noise share; with secure aggregation on, the share is
            discrete Gaussian noise added inside the field, :mod:`privacy.dp.secure`).
        clipping_norm: C, the L2 bound of each client's update (the initial C with adaptive clipping), > 0.
        noise_multiplier: z, the noise standard deviation on the sum over C, > 0.
        adaptive_clipping: track a quantile of the update norms (Andrew et al. 2021): central mode, or distributed
            mode under secure aggregation (each client adds its noisy clipped-count bit inside the secure sum).
        target_quantile: gamma, the fraction of updates left unclipped, in (0, 1).
        clipping_lr: eta_C, the geometric step of adaptive clipping, > 0.
        clipped_count_stddev: sigma_b, the noise on the count of unclipped updates, > z / 2; 0: m / 20 as in the
            paper. The update's noise multiplier becomes ``z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` so that both
            releases together are accounted as noise multiplier z.
        delta: the delta epsilon is reported for, in (0, 1) (choose it below 1 / number of clients).
        target_epsilon: stop before a round that would spend more (0: no target).
        accountant: ``"rdp"`` or ``"pld"`` (dp-accounting).
        tolerated_dropout: distributed mode: the fraction of a round's clients that may drop out with the sum's
            noise still >= z C, in [0, 1) (each share is raised to ``z C / sqrt(ceil(m (1 - d)))``).
        population: N, the number of clients rounds sample from (the sampling rate is m / N). A simulation uses
            its number of clients when 0; a server needs it.
        dp_sgd: sample-level DP-SGD on every client through Opacus (the ``dp-sgd`` client mod,
            :mod:`privacy.dp.sgd`), alone or with ``dp``.
        dp_sgd_noise_multiplier: DP-SGD's noise over the per-example clipping norm, > 0.
        dp_sgd_max_grad_norm: DP-SGD's per-example gradient clipping norm, > 0.
    """

    dp: Literal["off", "central", "distributed"] = "off"
    clipping_norm: float = 1.0
    noise_multiplier: float = 1.0
    adaptive_clipping: bool = False
    target_quantile: float = 0.5
    clipping_lr: float = 0.2
    clipped_count_stddev: float = 0.0
    delta: float = 1e-5
    target_epsilon: float = 0.0
    accountant: Accountant = "rdp"
    tolerated_dropout: float = 0.0
    population: int = 0
    dp_sgd: bool = False
    dp_sgd_noise_multiplier: float = 1.0
    dp_sgd_max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.dp not in ("off", "central", "distributed"):
            raise ConfigError(f"privacy.dp must be 'off', 'central' or 'distributed', got {self.dp!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ConfigError(f"privacy.accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}")
        for name in (
            "clipping_norm",
            "noise_multiplier",
            "clipping_lr",
            "dp_sgd_noise_multiplier",
            "dp_sgd_max_grad_norm",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"privacy.{name} must be a finite number > 0, got {value!r}")
            if name.endswith("noise_multiplier") and value > MAX_NOISE_MULTIPLIER:
                raise ConfigError(
                    f"privacy.{name} must be at most {MAX_NOISE_MULTIPLIER:g}, got {value!r}: the noise would be "
                    f"{value:g} times the clipping norm, leaving nothing of the updates (typical values are 0.5 to 5)"
                )
        for name in ("clipped_count_stddev", "target_epsilon"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"privacy.{name} must be a finite number >= 0 (0: default/none), got {value!r}")
        if not 0 < self.target_quantile < 1:
            raise ConfigError(f"privacy.target_quantile must be in (0, 1), got {self.target_quantile!r}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"privacy.delta must be in (0, 1), got {self.delta!r}")
        if not 0 <= self.tolerated_dropout < 1:
            raise ConfigError(f"privacy.tolerated_dropout must be in [0, 1), got {self.tolerated_dropout!r}")
        if self.population < 0:
            raise ConfigError(f"privacy.population must be >= 0, got {self.population!r}")

    @property
    def enabled(self) -> bool:
        """Whether client-level DP is on."""
        return self.dp != "off"


_SGD_KEYS = ("dp_sgd_noise_multiplier", "dp_sgd_max_grad_norm")


def accounting_identity(config: PrivacyConfig, strategy: Strategy) -> dict[str, object]:
    """The settings a run's privacy guarantee rests on, for a restarted server to hold against its first start
    (:meth:`server.state.StateStore.check_privacy`): every ``[privacy]`` key in use except ``target_epsilon`` (the
    budget may be raised; the epsilon reported stays true), and with DP-FedAvg the clients per round m that the
    sampling rate m / N and the fixed denominator use. Epsilon is a function of the number of rounds released at
    these settings, so a run resumed under others would report an epsilon that holds for neither (a noise
    multiplier raised from 0.5 to 10 on restart reported the rounds before as almost free).

    Returns:
        A JSON-ready mapping: ``{"dp": "off", "dp_sgd": False}`` when both are off.
    """
    unused = {"target_epsilon"}
    if not config.dp_sgd:
        unused.update(_SGD_KEYS)
    if not config.enabled:  # DP-FedAvg's settings count only with it; delta only with one of the two
        unused.update(k for k in asdict(config) if k not in ("dp", "dp_sgd", "delta", *_SGD_KEYS))
        if not config.dp_sgd:
            unused.add("delta")
    identity: dict[str, object] = {k: v for k, v in asdict(config).items() if k not in unused}
    if config.enabled:
        identity["clients_per_round"] = strategy.sampling.num_fit(config.population) if config.population else None
    return identity


def weak_delta(config: PrivacyConfig, population: int) -> str | None:
    """The warning for a client-level DP run whose delta is not below 1 / N, or None.

    An (epsilon, delta) guarantee may fail outright with probability delta; at delta of the order of 1 / N it is
    met by a mechanism that publishes a few clients' data whole (Dwork & Roth 2014, "The Algorithmic Foundations of
    Differential Privacy", section 2.3), so such a delta protects little, whatever the epsilon (a delta of 0.5
    reported epsilon 0.0000). The usual choice is well below 1 / N, e.g. 1 / N^1.1.
    """
    if not config.enabled or population < 1 or config.delta < 1 / population:
        return None
    return (
        f"privacy.delta = {config.delta:g} is not below 1 / N = 1/{population} = {1 / population:.3g}: the "
        "guarantee then allows publishing a few clients' data whole, whatever epsilon is reported; choose delta below "
        f"1 / N (--delta), e.g. {population**-1.1:.2g}"
    )


def apply_dp(strategy: Strategy, config: PrivacyConfig, *, population: int | None = None) -> Strategy:
    """``strategy`` with client-level DP-FedAvg and/or sample-level DP-SGD as ``config`` says (unchanged when
    both are off).

    Args:
        strategy: the strategy to privatize: its sampling, fit settings and server optimizer are kept.
        config: the privacy settings.
        population: N when ``config.population`` is 0 (a simulation passes its number of clients; a
            ``config.population`` other than it is refused).

    Returns:
        With ``dp``: the strategy with ``weighting="uniform"``, a :class:`~privacy.dp.aggregator.DPFedAvgAggregator`
        and, in distributed mode, the ``dp-clip`` mod first (outermost, so it sees the final reply). A securely
        aggregated strategy in distributed mode gets :func:`privacy.dp.secure.secure_distributed_dp` instead (the
        noise is added inside the field by the ``secagg`` mod). With ``dp_sgd``: the ``dp-sgd`` mod (inside
        ``dp-clip``).

    Raises:
        ConfigError: no population, adaptive clipping in distributed mode without secure aggregation, a strategy
            with tensor groups (e.g. SCAFFOLD: its control variates would
            leave the clients unprotected), a non-mean aggregator (robust rules and DP noise do not compose
            here), a float32 running sum (``MeanAggregator(delta=True)``, strategy.sum_dtype: DP-FedAvg's mean
            replaces it), a quality weighting (metric, server), central mode under secure aggregation, or settings
            the mechanism refuses.
    """
    if config.dp_sgd:
        if strategy.groups:
            raise ConfigError(
                f"strategy {strategy.name!r} exchanges tensor groups ({', '.join(sorted(strategy.groups))}) and "
                "corrects gradients itself; DP-SGD cannot be combined with it"
            )
        from privacy.dp.sgd import MOD_NAME as SGD_MOD  # imports Opacus: only when DP-SGD is asked for

        sgd = ModSpec(
            SGD_MOD,
            {
                "noise_multiplier": config.dp_sgd_noise_multiplier,
                "max_grad_norm": config.dp_sgd_max_grad_norm,
                "delta": config.delta,
            },
        )
        strategy = replace(strategy, mods=(sgd, *strategy.mods))
    if not config.enabled:
        return strategy
    if config.population and population and config.population != population:
        # the sampling rate m / N must use the N rounds sample from: a larger one under-reports epsilon
        raise ConfigError(
            f"privacy.population = {config.population}, but the rounds sample from {population} clients (the "
            f"accountant's sampling rate would be wrong, and epsilon with it); leave privacy.population unset "
            f"(--population) to use {population}"
        )
    n = config.population or population or 0
    if n < 1:
        raise ConfigError(
            "differential privacy needs the number of clients rounds sample from, for the sampling rate: "
            "set privacy.population (--population N)"
        )
    if strategy.groups:
        raise ConfigError(
            f"strategy {strategy.name!r} exchanges tensor groups ({', '.join(sorted(strategy.groups))}) that DP-FedAvg "
            "does not privatize; use a FedAvg-family strategy with privacy.dp"
        )
    if strategy.weighting not in ("examples", "uniform"):  # a quality weight would bound no client's influence
        raise ConfigError(
            f"privacy.dp weighs every update 1 (DP-FedAvg's sensitivity bound); weighting {strategy.weighting!r} "
            "cannot be combined with it: use weighting = 'uniform'"
        )
    secure = strategy.protocol is not None and strategy.protocol.name == SECAGG_PROTOCOL
    if secure and config.dp != "distributed":
        raise ConfigError(
            "under secure aggregation the server never sees an update, so it cannot clip or add noise (central "
            "mode); use privacy.dp = 'distributed' (--dp distributed): each client clips and adds its noise share"
        )
    compressed = [mod.name for mod in strategy.mods if mod.name == "compress"]
    if compressed:
        raise ConfigError(
            "privacy.dp clips each update whole and adds noise to their sum, and a compressed update is decoded "
            "block by block into the streaming mean: strategy.compression cannot be combined with it; use "
            "--compression none"
        )
    if isinstance(strategy.aggregator, MeanAggregator) and strategy.aggregator.delta:
        raise ConfigError(
            "privacy.dp replaces the streaming mean with DP-FedAvg's clipped mean, which sums in float64: "
            "strategy.sum_dtype = 'float32' cannot apply; use sum_dtype = 'float64' (--sum-dtype float64)"
        )
    if strategy.aggregator.name != "mean" and not secure:
        raise ConfigError(
            f"privacy.dp replaces the aggregator with DP-FedAvg's clipped mean; the strategy's "
            f"{strategy.aggregator.name!r} aggregator cannot be combined with it"
        )
    if config.adaptive_clipping and config.dp == "distributed" and not secure:
        raise ConfigError(
            "adaptive clipping in distributed mode needs the clients' noisy clipped counts summed where the server "
            "cannot see one: enable secure aggregation (--secure-aggregation), or use a fixed clipping_norm"
        )
    mode: DPMode = "central" if config.dp == "central" else "distributed"
    m = strategy.sampling.num_fit(n)
    if m > n:  # the round loop would select m and find the accounting's rate wrong at round 1
        raise ConfigError(
            f"the rounds select {m} clients (min_fit_clients {strategy.sampling.min_fit_clients}, fraction_fit "
            f"{strategy.sampling.fraction_fit:g}) but privacy.population is {n}: DP-FedAvg's sampling rate m / N "
            "cannot exceed 1; give the number of clients rounds sample from (--population) or lower "
            "--min-fit-clients"
        )
    adaptive = None
    if config.adaptive_clipping:
        adaptive = AdaptiveClipping(
            target_quantile=config.target_quantile,
            learning_rate=config.clipping_lr,
            clipped_count_stddev=config.clipped_count_stddev or m / 20,
        )
    aggregator = DPFedAvgAggregator(
        mode=mode,
        clipping_norm=config.clipping_norm,
        noise_multiplier=config.noise_multiplier,
        expected_clients=m,
        population=n,
        delta=config.delta,
        target_epsilon=config.target_epsilon or None,
        accountant=config.accountant,
        adaptive=adaptive,
        tolerated_dropout=config.tolerated_dropout,
    )
    if secure:
        from privacy.dp.secure import secure_distributed_dp  # imports the SecAgg+ machinery: only when it is on

        return secure_distributed_dp(strategy, aggregator)
    mods = strategy.mods
    if config.dp == "distributed":
        share = ModSpec(MOD_NAME, {"clipping_norm": config.clipping_norm, "noise_stddev": aggregator.share_stddev()})
        mods = (share, *mods)
    return replace(strategy, weighting="uniform", aggregator=aggregator, mods=mods)
