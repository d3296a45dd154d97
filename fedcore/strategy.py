"""Strategies, composed from parts: client sampling, update weighting, a server optimizer, local training config.

A :class:`Strategy` is a value, not a class hierarchy. The well-known algorithms are recipes over it:

=============  ==============================================================================================
FedAvg         weighting by examples, ``ServerSGD(lr=1)`` (McMahan et al. 2017)
FedAvgM        ``ServerSGD(lr, momentum)`` (Hsu et al. 2019)
FedProx        FedAvg with ``FitConfig.mu > 0`` (Li et al. 2020)
FedAdagrad     ``ServerAdaptive("adagrad")``  (Reddi et al. 2021)
FedAdam        ``ServerAdaptive("adam")``     (Reddi et al. 2021)
FedYogi        ``ServerAdaptive("yogi")``     (Reddi et al. 2021)
SCAFFOLD       ``ServerSGD(lr=eta_g)``, a ``control`` tensor group and the ``scaffold`` client mod
               (Karimireddy et al. 2020; :mod:`fedcore.algorithms.scaffold`)
=============  ==============================================================================================

The round loop (:mod:`server.round_loop`) owns the control flow; the strategy only answers "whom", "with what
settings", "with what weight" and "how to step the global model".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal, Protocol

from fedcore.aggregation import (
    Aggregator,
    KrumAggregator,
    MeanAggregator,
    MedianAggregator,
    NormBoundAggregator,
    TrimmedMeanAggregator,
)
from fedcore.aggregation.weights import (
    WEIGHT_RULES,
    QualityWeights,
    Transform,
    UpdateEvaluation,
    WeightRule,
    update_weight,
)
from fedcore.errors import ConfigError, PayloadError
from fedcore.messages import FitRes, ModSpec
from fedcore.mods import ServerInverse, check_mods
from fedcore.payload import check_group_name
from fedcore.selection import SELECTION_NAMES, SelectionConfig, Selector
from fedcore.selection import sample_clients as sample_clients  # re-exported: its home before selection policies
from fedcore.server_opt import ServerAdaptive, ServerOptimizer, ServerSGD, check_finite_number
from fedcore.stages import RoundProtocol
from fedcore.task import FitConfig
from fedcore.tensors import NamedArrays
from privacy.secagg.config import SecAggConfig

STRATEGY_NAMES = ("fedavg", "fedavgm", "fedprox", "fedadagrad", "fedadam", "fedyogi", "scaffold")
ADAPTIVE_SERVER_LR = 0.01
"""The server learning rate FedAdam, FedYogi and FedAdagrad start from when none is given (as
:class:`~fedcore.server_opt.ServerAdaptive`): their step is about ``lr`` per weight whatever the update's size, so
1.0, the averaging strategies' default, moves every weight by about 1 a round (mnist-5k, 2NN, 5 rounds: accuracy
0.098 at 1.0, 0.759 at 0.01)."""


def default_server_lr(strategy: str) -> float:
    """The server learning rate a strategy starts from: :data:`ADAPTIVE_SERVER_LR` for the adaptive ones
    (fedadagrad, fedadam, fedyogi), 1.0 (the plain average's step) for the others."""
    return ADAPTIVE_SERVER_LR if strategy in ("fedadagrad", "fedadam", "fedyogi") else 1.0


AGGREGATOR_NAMES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "norm_bound")
_DEFAULT_TRIM_BETA = 0.1


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """Which clients take part in a round.

    Attributes:
        fraction_fit: fraction C of available clients selected for training each round, in (0, 1].
        min_fit_clients: at least this many clients train each round (>= 1).
        fraction_evaluate: fraction of available clients asked to evaluate each round (0 = no federated
            evaluation; the server may still evaluate centrally).
        min_evaluate_clients: at least this many evaluate when ``fraction_evaluate > 0``.
    """

    fraction_fit: float = 0.1
    min_fit_clients: int = 2
    fraction_evaluate: float = 0.0
    min_evaluate_clients: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.fraction_fit <= 1:
            raise ConfigError(f"fraction_fit must be in (0, 1], got {self.fraction_fit}")
        if self.min_fit_clients < 1:
            raise ConfigError(f"min_fit_clients must be >= 1, got {self.min_fit_clients}")
        if not 0 <= self.fraction_evaluate <= 1:
            raise ConfigError(f"fraction_evaluate must be in [0, 1], got {self.fraction_evaluate}")
        if self.min_evaluate_clients < 0:
            raise ConfigError(f"min_evaluate_clients must be >= 0, got {self.min_evaluate_clients}")

    def num_fit(self, num_available: int) -> int:
        """How many clients to select for training out of ``num_available``: ``max(min, floor(C * n))``."""
        return max(self.min_fit_clients, math.floor(self.fraction_fit * num_available + 1e-9))

    def num_evaluate(self, num_available: int) -> int:
        """How many clients to ask for evaluation (0 when federated evaluation is off)."""
        if self.fraction_evaluate == 0:
            return 0
        return max(self.min_evaluate_clients, math.floor(self.fraction_evaluate * num_available + 1e-9))


class GroupRule(Protocol):
    """The rule of one tensor group besides the model (DESIGN.md, "Tensor groups"): its server-side state, how the
    replies' tensors of the group are combined, and how the combination updates the state.

    Each round the server sends the group's state with the fit instruction (``FitIns.groups``); every accepted
    reply must carry the group with the same names, shapes and dtypes (``FitRes.groups``); the replies' tensors
    go through :attr:`aggregator` with :meth:`weight`, and :meth:`update` makes the next state from the result.
    The round loop applies the rules of all groups alike; it knows no algorithm by name.
    """

    @property
    def aggregator(self) -> Aggregator:
        """How the replies' tensors of the group are combined."""
        ...

    def init(self, parameters: NamedArrays, *, trainable: frozenset[str] | None) -> NamedArrays:
        """The group's state at round 0 for the initial model ``parameters`` (``trainable``: see
        :class:`server.round_loop.ServerState`)."""
        ...

    def weight(self, num_examples: int) -> float:
        """The aggregation weight of a reply from a client with ``num_examples`` training examples."""
        ...

    def update(self, state: NamedArrays, combined: NamedArrays, *, accepted: int, available: int) -> NamedArrays:
        """The group's next state from its current ``state`` and the ``combined`` replies of ``accepted`` clients,
        out of ``available`` clients connected when the round started. Must not mutate its inputs."""
        ...


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """A federated algorithm as a composition of parts.

    Attributes:
        name: a label for reports (e.g. ``"fedavgm"``).
        fit: the local training settings sent to clients each round (FedProx: ``fit.mu > 0``).
        sampling: whom to select each round.
        weighting: how much each update counts (:mod:`fedcore.aggregation.weights`): ``"examples"`` by its
            client's example count (FedAvg), ``"uniform"`` 1 each, ``"metric"`` by a metric the client reports,
            ``"server"`` by the server's own evaluation of the update on its validation data (the round loop's
            ``validate_fn``).
        quality: the metric, transform (``exp(-v/T)`` or ``v``), temperature and fallback of the ``metric`` and
            ``server`` rules (:class:`~fedcore.aggregation.weights.QualityWeights`).
        server_optimizer: how the average moves the global model (:class:`ServerSGD`, :class:`ServerAdaptive`).
        aggregator: how the round's updates become one (:class:`~fedcore.aggregation.Aggregator`; default the
            streaming weighted mean, :class:`~fedcore.aggregation.MeanAggregator`).
        evaluate_batch_size: batch size for client-side and server-side evaluation.
        groups: the tensor groups exchanged besides the model, ``name -> rule`` (:class:`GroupRule`); empty for
            FedAvg and its relatives.
        mods: the client mods every fit instruction declares, in order, outermost first (:mod:`fedcore.mods`);
            checked against the registry here, when the strategy is configured.
        protocol: a multi-stage round protocol whose exchanges run around each round's fit exchange
            (:class:`~fedcore.stages.RoundProtocol`, e.g. secure aggregation); None: a round is one fit exchange.
        selection: which of the available clients take part (:class:`~fedcore.selection.Selector`: the policy and
            what it learned from finished rounds); default uniform sampling.

    Raises:
        ConfigError: bad weighting or batch size, a group name that cannot travel, or a mod that cannot run.
    """

    name: str = "fedavg"
    fit: FitConfig = field(default_factory=FitConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    weighting: WeightRule = "examples"
    quality: QualityWeights = field(default_factory=QualityWeights)
    server_optimizer: ServerOptimizer = field(default_factory=ServerSGD)
    aggregator: Aggregator = field(default_factory=MeanAggregator)
    evaluate_batch_size: int = 256
    groups: Mapping[str, GroupRule] = field(default_factory=dict)
    mods: tuple[ModSpec, ...] = ()
    protocol: RoundProtocol | None = None
    selection: Selector = field(default_factory=Selector)

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHT_RULES:
            raise ConfigError(f"weighting must be one of {', '.join(WEIGHT_RULES)}, got {self.weighting!r}")
        if self.evaluate_batch_size < 1:
            raise ConfigError(f"evaluate_batch_size must be >= 1, got {self.evaluate_batch_size}")
        for name in self.groups:
            try:
                check_group_name(name)
            except PayloadError as exc:
                raise ConfigError(exc.message) from None
        mods = check_mods(tuple(self.mods))
        if any(isinstance(mod, ServerInverse) for mod in mods) and not isinstance(self.aggregator, MeanAggregator):
            raise ConfigError(
                f"compressed updates are decoded block by block into the streaming mean; the "
                f"{self.aggregator.name!r} aggregator needs each update whole (robust rules, DP, secure "
                "aggregation). Use aggregator = 'mean' or compression = 'none'"
            )

    def weight(self, reply: FitRes, *, evaluate: UpdateEvaluation | None = None) -> float:
        """The aggregation weight of ``reply``, an update whose example count is already checked (an int >= 0),
        from its example count and the metrics it reports, by the strategy's :attr:`weighting`
        (:func:`fedcore.aggregation.weights.update_weight`; ``evaluate`` runs the server's evaluation of this
        update, for rule ``server``). The weight depends on this reply alone, never on the order of arrival.

        Raises:
            UpdateRejected: the count is beyond the float range, or the quality value is unusable and there is no
                fallback.
            ConfigError: rule ``server`` without ``evaluate``.
        """
        return update_weight(self.weighting, self.quality, reply.num_examples, reply.metrics, evaluate)


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """The ``[strategy]`` table of a recipe: which algorithm, with its server-side hyper-parameters.

    Attributes:
        name: one of fedavg, fedavgm, fedprox, fedadagrad, fedadam, fedyogi, scaffold.
        weighting: ``"examples"`` (FedAvg), ``"uniform"`` (SCAFFOLD's paper averages the models uniformly),
            ``"metric"`` (a metric each client reports, see weight_metric) or ``"server"`` (the server's evaluation
            of each update on its validation data); see :mod:`fedcore.aggregation.weights`.
        weight_metric: the quality value of the metric and server weightings: a metric the clients report
            (``train_loss``) or, for server, ``loss`` or a metric of the server's evaluation (``accuracy``).
        weight_transform: ``softmax`` (weight ``exp(-value / temperature)``, for losses) or ``proportional``
            (weight = value, for accuracies).
        weight_temperature: the softmax temperature, > 0 (small: the best updates dominate).
        weight_fallback: the value assumed for an update whose value is missing or not finite (e.g. a loss of 10);
            unset: such an update is rejected.
        weight_times_examples: multiply the quality weight by the client's example count.
        server_lr: server learning rate (eta; SCAFFOLD's eta_g), > 0. Unset: the strategy's own default, 1.0 for
            FedAvg/FedAvgM/FedProx/SCAFFOLD (the plain average) and 0.01 for FedAdam/FedYogi/FedAdagrad (an Adam step of
            1.0 moves every weight by about 1 each round; Reddi et al. 2021 tune it in [1e-3, 1], and 0.01 is
            :class:`~fedcore.server_opt.ServerAdaptive`'s default). Resolved when the config is made, so
            :attr:`server_lr` is always a number afterwards.
        server_momentum: FedAvgM momentum (beta), in [0, 1).
        beta1, beta2: FedAdam/FedYogi moment decay rates, in [0, 1).
        tau: adaptivity (epsilon) of the adaptive optimizers, > 0.
        aggregator: how each round's updates become one, before the server optimizer steps: ``mean`` (the
            streaming weighted mean, FedAvg), or a robust rule of :mod:`fedcore.aggregation.robust`: ``median``
            and ``trimmed_mean`` (coordinate-wise, Yin et al. 2018), ``krum`` and ``multi_krum`` (Blanchard et
            al. 2017), ``norm_bound`` (Sun et al. 2019).
        byzantine: ``f``, the Byzantine clients per round the robust rule must tolerate (median, trimmed_mean,
            krum, multi_krum); a round with too few clients for it is refused before it starts.
        trim_beta: the fraction trimmed at each end by ``trimmed_mean``, in [0, 0.5).
        multi_krum_m: how many of the best-scored updates ``multi_krum`` averages (unset: n - f).
        norm_bound: the L2 bound on each update's difference from the global model (``norm_bound``; required).
        sum_dtype: the running sum of the ``mean`` aggregator: ``float64`` (the updates summed in float64, 2x the
            model; the default) or ``float32`` (the float32 tensors' differences from the round's global model
            summed in float32, 1x the model: :class:`~fedcore.aggregation.MeanAggregator`'s ``delta``; the mean is
            within about one float32 unit of the float64 one, but depends on the order the updates are folded in,
            so the process and Ray backends, which fold them as they arrive, no longer give the in-process model bit
            for bit). Tensor groups (SCAFFOLD's control variates) keep the float64 sum. The other aggregators, secure
            aggregation and ``privacy.dp`` keep no such sum: they refuse ``float32``.
        secure_aggregation: aggregate the updates with SecAgg+ (Bell et al. 2020): the server learns only the
            weighted sum of the clients' quantized updates (:mod:`privacy.secagg.rounds`). Needs the ``mean``
            aggregator and a strategy without tensor groups (not scaffold).
        secagg: the SecAgg+ parameters (neighbours k, threshold t, field bits, clipping range of each update
            coordinate, maximum example weight, quantization levels); checked against each round's selection
            before any client is contacted.
        compression: how clients compress their update before sending it (:mod:`fedcore.compression`): ``none``,
            ``float16`` or ``bfloat16`` (casts), ``int8`` (QSGD stochastic quantization, Alistarh et al. 2017),
            ``topk`` (top-k sparsification with error feedback, Stich et al. 2018). Needs the ``mean`` aggregator
            and no secure aggregation.
        topk_fraction: the fraction of the update's entries a ``topk`` client sends, in (0, 1].
        topk_scope: where ``topk`` chooses them: ``tensor`` (that fraction of each tensor, layer-wise) or ``model``
            (that fraction of the whole update, by magnitude over all tensors together).
        topk_warmup_rounds: rounds of DGC's exponential sparsity warm-up (Lin et al. 2018) at the start of the run,
            from dense down to ``topk_fraction`` (:func:`fedcore.compression.warmup_fraction`); 0 (none) .. 1000.
        quantization_block: elements per scale of ``int8`` quantization, 16..1048576.
        selection: how the clients of a round are chosen (:mod:`fedcore.selection`): ``uniform`` (FedAvg),
            ``stratified`` (by a client attribute), ``power-of-choice`` (Cho et al. 2020, highest last loss of d
            candidates), ``oort`` (Lai et al. 2021, utility and speed).
        selector: the selection policies' parameters (:class:`~fedcore.selection.SelectionConfig`).

        A rule's parameters are ignored by the other aggregators, so that one recipe can be run with another
        aggregator (``--aggregator mean``) to compare.
    """

    CONFIG_KIND: ClassVar[str] = "name"
    """A table that names another strategy than the default's starts from this class's defaults
    (:func:`fedcore.config.from_mapping`): ``--strategy fedadam`` does not inherit the default FedAvgM's momentum."""

    name: str = "fedavg"
    weighting: WeightRule = "examples"
    weight_metric: str = "train_loss"
    weight_transform: Transform = "softmax"
    weight_temperature: float = 1.0
    weight_fallback: float | None = None
    weight_times_examples: bool = False
    server_lr: float | None = None
    server_momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    aggregator: str = "mean"
    byzantine: int = 0
    trim_beta: float = _DEFAULT_TRIM_BETA
    multi_krum_m: int | None = None
    norm_bound: float | None = None
    sum_dtype: Literal["float64", "float32"] = "float64"
    secure_aggregation: bool = False
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    compression: Literal["none", "float16", "bfloat16", "int8", "topk"] = "none"
    topk_fraction: float = 0.01
    topk_scope: Literal["tensor", "model"] = "tensor"
    topk_warmup_rounds: int = 0
    quantization_block: int = 512
    selection: Literal["uniform", "stratified", "power-of-choice", "oort"] = "uniform"
    selector: SelectionConfig = field(default_factory=SelectionConfig)

    def __post_init__(self) -> None:
        if self.selection not in SELECTION_NAMES:
            raise ConfigError(f"unknown selection {self.selection!r}; choose one of {', '.join(SELECTION_NAMES)}")
        if self.name not in STRATEGY_NAMES:
            raise ConfigError(f"unknown strategy {self.name!r}; choose one of {', '.join(STRATEGY_NAMES)}")
        if self.weighting not in WEIGHT_RULES:
            raise ConfigError(f"weighting must be one of {', '.join(WEIGHT_RULES)}, got {self.weighting!r}")
        self.quality_weights()  # their own checks, now
        if self.server_lr is None:  # the strategy's own default, kept as a number (config.json, restart checks)
            object.__setattr__(self, "server_lr", default_server_lr(self.name))
        # the server optimizer's settings, named as the user sets them (the optimizers check them again, by their
        # own names, for a caller that builds one directly)
        check_finite_number("server_lr (--server-lr)", self.step_size(), low=0.0, low_open=True)
        check_finite_number("server_momentum (--server-momentum)", self.server_momentum, low=0.0, high=1.0)
        check_finite_number("beta1 (--beta1)", self.beta1, low=0.0, high=1.0)
        check_finite_number("beta2 (--beta2)", self.beta2, low=0.0, high=1.0)
        check_finite_number("tau (--tau)", self.tau, low=0.0, low_open=True)
        if self.name == "fedavgm" and self.server_momentum == 0:
            raise ConfigError("fedavgm needs server_momentum > 0 (e.g. 0.9); with 0 it is plain fedavg")
        if self.server_momentum != 0 and self.name != "fedavgm":
            raise ConfigError(f"server_momentum applies to fedavgm only, not {self.name!r}")
        if self.aggregator not in AGGREGATOR_NAMES:
            raise ConfigError(f"unknown aggregator {self.aggregator!r}; choose one of {', '.join(AGGREGATOR_NAMES)}")
        if isinstance(self.byzantine, bool) or not isinstance(self.byzantine, int) or self.byzantine < 0:
            raise ConfigError(
                f"byzantine (the Byzantine clients to tolerate) must be an integer >= 0, got {self.byzantine!r}"
            )
        if self.aggregator == "norm_bound" and self.norm_bound is None:
            raise ConfigError("aggregator norm_bound needs strategy.norm_bound (the L2 bound on each update's change)")
        if self.sum_dtype not in ("float64", "float32"):
            raise ConfigError(f"sum_dtype must be 'float64' or 'float32', got {self.sum_dtype!r}")
        if self.sum_dtype == "float32" and self.aggregator != "mean":
            raise ConfigError(
                f"sum_dtype = 'float32' sets the running sum of aggregator 'mean'; {self.aggregator!r} keeps none: "
                "use sum_dtype = 'float64' (--sum-dtype float64) or aggregator = 'mean'"
            )
        if self.sum_dtype == "float32" and self.secure_aggregation:
            raise ConfigError(
                "sum_dtype = 'float32' sets the streaming mean's running sum; secure_aggregation sums quantized "
                "updates in a finite field instead: use sum_dtype = 'float64' (--sum-dtype float64)"
            )
        aggregator = build_aggregator(self)  # the rule's own checks (ranges), now rather than at the first round
        if self.name == "scaffold":
            from fedcore.algorithms.scaffold import control_aggregator

            control_aggregator(aggregator)  # the control variates can be combined by it
        unweighted = self.aggregator in ("median", "trimmed_mean", "krum") or (
            self.aggregator == "multi_krum" and self.multi_krum_m == 1
        )
        if unweighted and self.weighting in ("metric", "server"):
            raise ConfigError(
                f"aggregator {self.aggregator!r} ignores the clients' weights (a Byzantine client would choose its "
                f"own), so weighting {self.weighting!r} would change nothing"
                + (" and cost a server evaluation of every update" if self.weighting == "server" else "")
                + ": use weighting = 'examples' or 'uniform', or an aggregator that weights the updates (mean, "
                "multi_krum, norm_bound)"
            )
        if not isinstance(self.secagg, SecAggConfig):
            raise ConfigError(f"strategy.secagg must be a SecAggConfig table, got {type(self.secagg).__name__}")
        if self.secure_aggregation and self.weighting not in ("examples", "uniform"):
            raise ConfigError(
                f"secure_aggregation sums the updates without seeing them or their weights' inputs: it needs "
                f"weighting = 'examples' or 'uniform', got {self.weighting!r}"
            )
        if self.secure_aggregation and (self.name == "scaffold" or self.aggregator != "mean"):
            raise ConfigError(
                "secure_aggregation sums the updates without seeing them: it needs aggregator = 'mean' and a "
                f"strategy without extra tensor groups (not scaffold); got {self.name!r} with {self.aggregator!r}"
            )
        compression_mod(self)  # its parameters' ranges
        if self.compression != "none" and (self.secure_aggregation or self.aggregator != "mean"):
            raise ConfigError(
                f"compression {self.compression!r} sends an encoded update that the server decodes block by block "
                "into the streaming mean: it needs aggregator = 'mean' and no secure_aggregation (SecAgg+ masks "
                f"the full update, the other aggregators read each update whole); got aggregator {self.aggregator!r}"
                + (" with secure_aggregation" if self.secure_aggregation else "")
            )

    def step_size(self) -> float:
        """:attr:`server_lr` as a number (it is resolved to the strategy's default when unset)."""
        return default_server_lr(self.name) if self.server_lr is None else self.server_lr

    def quality_weights(self) -> QualityWeights:
        """The transform of the metric and server weightings (:class:`~fedcore.aggregation.weights.QualityWeights`).

        Raises:
            ConfigError: a value out of range.
        """
        return QualityWeights(
            metric=self.weight_metric,
            transform=self.weight_transform,
            temperature=self.weight_temperature,
            fallback=self.weight_fallback,
            times_examples=self.weight_times_examples,
        )


def compression_mod(config: StrategyConfig) -> ModSpec | None:
    """The ``compress`` client mod that ``config.compression`` declares (None for ``"none"``).

    Raises:
        ConfigError: an unknown method, or a fraction or block out of range.
    """
    if config.compression == "none":
        return None
    spec = ModSpec(
        "compress",
        {
            "method": config.compression,
            "fraction": config.topk_fraction,
            "block": config.quantization_block,
            "scope": config.topk_scope,
            "warmup_rounds": config.topk_warmup_rounds,
        },
    )
    check_mods((spec,))
    return spec


def build_aggregator(config: StrategyConfig) -> Aggregator:
    """The :class:`~fedcore.aggregation.Aggregator` that ``config.aggregator`` and its parameters name.

    Raises:
        ConfigError: a parameter out of range (e.g. ``trim_beta >= 0.5``, ``norm_bound <= 0``).
    """
    if config.aggregator == "median":
        return MedianAggregator(byzantine=config.byzantine)
    if config.aggregator == "trimmed_mean":
        return TrimmedMeanAggregator(beta=config.trim_beta, byzantine=config.byzantine)
    if config.aggregator == "krum":
        return KrumAggregator(byzantine=config.byzantine, select=1)
    if config.aggregator == "multi_krum":
        return KrumAggregator(byzantine=config.byzantine, select=config.multi_krum_m)
    if config.aggregator == "norm_bound":
        if config.norm_bound is None:
            raise ConfigError("aggregator norm_bound needs strategy.norm_bound (the L2 bound on each update's change)")
        return NormBoundAggregator(bound=config.norm_bound)
    return MeanAggregator(delta=config.sum_dtype == "float32")


def build_strategy(config: StrategyConfig, fit: FitConfig, sampling: SamplingConfig) -> Strategy:
    """Compose the :class:`Strategy` a recipe describes.

    FedProx is FedAvg's server with the proximal coefficient ``fit.mu`` on the clients; with ``mu = 0`` it is
    exactly FedAvg (Li et al. 2020, section 3), which is taken (an ablation) with a warning on the log.
    ``secure_aggregation`` wraps the result with :func:`privacy.secagg.rounds.secure_aggregation`. SCAFFOLD is
    :func:`fedcore.algorithms.scaffold.scaffold` with ``server_lr`` as its global step size eta_g. The aggregator
    (:func:`build_aggregator`) combines with any of them: e.g. FedAvgM over the coordinate-wise median steps the
    global model by the median update. ``compression`` declares the ``compress`` client mod
    (:func:`compression_mod`) outermost, so that it compresses what every other mod returned (SCAFFOLD's model; its
    ``control`` group travels uncompressed).
    """
    if config.name == "fedprox" and fit.mu == 0:
        logging.getLogger("fedcore.strategy").warning(
            "strategy fedprox with train.mu = 0 trains exactly as fedavg; set the proximal coefficient with "
            "train.mu (--mu), e.g. 0.01 (Li et al. 2020 try 0.001 to 1)"
        )
    strategy = _build_strategy(config, fit, sampling)
    compress = compression_mod(config)
    return strategy if compress is None else replace(strategy, mods=(compress, *strategy.mods))


def _build_strategy(config: StrategyConfig, fit: FitConfig, sampling: SamplingConfig) -> Strategy:
    optimizer: ServerOptimizer
    if config.name == "scaffold":
        from fedcore.algorithms.scaffold import scaffold

        composed = replace(
            scaffold(
                fit=fit,
                sampling=sampling,
                server_lr=config.step_size(),
                weighting=config.weighting,
                aggregator=build_aggregator(config),
            ),
            quality=config.quality_weights(),
        )
        return replace(composed, selection=Selector(config.selection, config.selector))
    if config.name in ("fedavg", "fedprox", "fedavgm"):
        optimizer = ServerSGD(lr=config.step_size(), momentum=config.server_momentum)
    else:
        kind = config.name.removeprefix("fed")
        optimizer = ServerAdaptive(
            kind=kind,  # type: ignore[arg-type]
            lr=config.step_size(),
            beta1=config.beta1,
            beta2=config.beta2,
            tau=config.tau,
        )
    strategy = Strategy(
        name=config.name,
        fit=fit,
        sampling=sampling,
        weighting=config.weighting,
        quality=config.quality_weights(),
        server_optimizer=optimizer,
        aggregator=build_aggregator(config),
        selection=Selector(config.selection, config.selector),
    )
    if config.secure_aggregation:
        from privacy.secagg.rounds import secure_aggregation

        return secure_aggregation(strategy, config.secagg)
    return strategy
